//! A neutral xDS management server for the tests: gRPC ADS, state of the world, serving
//! envoyproxy/ratelimit's `RateLimitConfig` resources, as Envoy Gateway's control plane does.
//!
//! It runs on a runtime of its own (so synchronous tests can drive it), sends the current
//! snapshot on every stream when it changes, logs every request a client sends (to read ACKs
//! and NACKs back), and can be stopped and started again on the same port.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitConfig;
use tokio::sync::{oneshot, watch};
use tokio_stream::wrappers::TcpListenerStream;

use super::*;

// The ADS core the walkthrough's server runs too.
#[path = "../../examples/xds-server/ads.rs"]
mod ads;
use ads::{Ads, Log, Snapshot};

/// TLS for the server: its certificate, and with `mutual`, client certificates from the CA.
pub struct XdsTls<'a> {
    pub pki: &'a TestPki,
    pub mutual: bool,
}

pub struct XdsServer {
    pub addr: SocketAddr,
    snapshot: watch::Sender<Snapshot>,
    log: Arc<Log>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl XdsServer {
    /// A server on a free loopback port.
    pub fn start(tls: Option<XdsTls<'_>>) -> XdsServer {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        Self::start_at(addr, tls, watch::Sender::new(None), Arc::default())
    }

    fn start_at(
        addr: SocketAddr,
        tls: Option<XdsTls<'_>>,
        snapshot: watch::Sender<Snapshot>,
        log: Arc<Log>,
    ) -> XdsServer {
        let tls = tls.map(|t| {
            let identity = tonic::transport::Identity::from_pem(
                std::fs::read(t.pki.path("server.pem")).unwrap(),
                std::fs::read(t.pki.path("server.key")).unwrap(),
            );
            let mut config = tonic::transport::ServerTlsConfig::new().identity(identity);
            if t.mutual {
                config = config.client_ca_root(tonic::transport::Certificate::from_pem(
                    std::fs::read(t.pki.path("ca.pem")).unwrap(),
                ));
            }
            config
        });
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let service = Ads { snapshot: snapshot.subscribe(), log: log.clone() };
        let thread = std::thread::spawn(move || {
            let runtime =
                tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind(addr).await.expect("xDS port free");
                bound_tx.send(()).unwrap();
                let mut builder = tonic::transport::Server::builder();
                if let Some(tls) = tls {
                    builder = builder.tls_config(tls).unwrap();
                }
                let serving = builder
                    .add_service(AggregatedDiscoveryServiceServer::new(service))
                    .serve_with_incoming(TcpListenerStream::new(listener));
                // Not a graceful stop, which would wait for streams that never end: the
                // listener goes now, the open streams with the runtime.
                tokio::select! {
                    _ = serving => {}
                    _ = stop_rx => {}
                }
            });
            runtime.shutdown_background();
        });
        bound_rx.recv().expect("xDS server bound");
        XdsServer { addr, snapshot, log, stop: Some(stop_tx), thread: Some(thread) }
    }

    /// Stops serving (open streams break); the snapshot and the request log stay.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }

    /// Serves again on the same port, with the same snapshot.
    pub fn restart(&mut self, tls: Option<XdsTls<'_>>) {
        self.stop();
        let log = self.log.clone();
        let snapshot = std::mem::replace(&mut self.snapshot, watch::Sender::new(None));
        *self = Self::start_at(self.addr, tls, snapshot, log);
    }

    /// Makes `configs` the whole config, as `version`.
    pub fn push(&self, version: &str, configs: &[RateLimitConfig]) {
        self.push_any(version, ads::resources(configs));
    }

    /// Makes `resources` the whole config, as `version`, whatever they hold.
    pub fn push_any(&self, version: &str, resources: Vec<Any>) {
        self.snapshot.send_replace(Some((version.to_owned(), resources)));
    }

    /// Every request clients sent, in order.
    pub fn requests(&self) -> Vec<DiscoveryRequest> {
        self.log.requests.lock().unwrap().clone()
    }

    /// Streams opened so far.
    pub fn streams(&self) -> u32 {
        self.log.streams.load(Ordering::SeqCst)
    }

    /// Waits until a client has ACKed `version` (a request with it and a nonce, no error).
    pub fn wait_for_ack(&self, version: &str) {
        wait_until(&format!("an ACK of xDS version {version}"), 500, Duration::from_millis(20), || {
            self.requests().iter().any(|r| {
                r.version_info == version && !r.response_nonce.is_empty() && r.error_detail.is_none()
            })
        });
    }

    /// Waits for a NACK and returns it.
    pub fn wait_for_nack(&self) -> DiscoveryRequest {
        let mut nack = None;
        wait_until("an xDS NACK", 500, Duration::from_millis(20), || {
            nack = self.requests().into_iter().find(|r| r.error_detail.is_some());
            nack.is_some()
        });
        nack.unwrap()
    }
}

impl Drop for XdsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A `RateLimitConfig` from the file syntax (or Envoy Gateway's dump of one), named `name`.
pub fn rate_limit_config(name: &str, yaml: &str) -> RateLimitConfig {
    ads::rate_limit_config(name, yaml).expect("YAML")
}

/// What the walkthrough's server says of a file it will not push.
pub fn rate_limit_config_error(name: &str, yaml: &str) -> String {
    ads::rate_limit_config(name, yaml).expect_err("refused")
}
