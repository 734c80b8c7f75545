//! A neutral xDS management server for the tests: gRPC ADS, state of the world, serving
//! envoyproxy/ratelimit's `RateLimitConfig` resources, as Envoy Gateway's control plane does.
//!
//! It runs on a runtime of its own (so synchronous tests can drive it), sends the current
//! snapshot on every stream when it changes, logs every request a client sends (to read ACKs
//! and NACKs back), and can be stopped and started again on the same port.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitReplace, RateLimitUnit,
};
use prost::{Message as _, Name as _};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use super::*;

/// What the server sends: a version and its resources.
type Snapshot = Option<(String, Vec<Any>)>;

#[derive(Default)]
struct Shared {
    requests: Mutex<Vec<DiscoveryRequest>>,
    streams: Mutex<u32>,
}

/// TLS for the server: its certificate, and with `mutual`, client certificates from the CA.
pub struct XdsTls<'a> {
    pub pki: &'a TestPki,
    pub mutual: bool,
}

pub struct XdsServer {
    pub addr: SocketAddr,
    snapshot: watch::Sender<Snapshot>,
    shared: Arc<Shared>,
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
        shared: Arc<Shared>,
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
        let service = Ads { snapshot: snapshot.subscribe(), shared: shared.clone() };
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
        XdsServer { addr, snapshot, shared, stop: Some(stop_tx), thread: Some(thread) }
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
        let shared = self.shared.clone();
        let snapshot = std::mem::replace(&mut self.snapshot, watch::Sender::new(None));
        *self = Self::start_at(self.addr, tls, snapshot, shared);
    }

    /// Makes `configs` the whole config, as `version`.
    pub fn push(&self, version: &str, configs: &[RateLimitConfig]) {
        let resources = configs
            .iter()
            .map(|c| Any { type_url: RateLimitConfig::type_url(), value: c.encode_to_vec() })
            .collect();
        self.push_any(version, resources);
    }

    /// Makes `resources` the whole config, as `version`, whatever they hold.
    pub fn push_any(&self, version: &str, resources: Vec<Any>) {
        self.snapshot.send_replace(Some((version.to_owned(), resources)));
    }

    /// Every request clients sent, in order.
    pub fn requests(&self) -> Vec<DiscoveryRequest> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// Streams opened so far.
    pub fn streams(&self) -> u32 {
        *self.shared.streams.lock().unwrap()
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

struct Ads {
    snapshot: watch::Receiver<Snapshot>,
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        *self.shared.streams.lock().unwrap() += 1;
        let mut incoming = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let (shared, mut snapshot) = (self.shared.clone(), self.snapshot.clone());
        tokio::spawn(async move {
            // The first request says who asks; then every change of the snapshot is sent.
            let Ok(Some(first)) = incoming.message().await else { return };
            shared.requests.lock().unwrap().push(first);
            let log = shared.clone();
            tokio::spawn(async move {
                while let Ok(Some(request)) = incoming.message().await {
                    log.requests.lock().unwrap().push(request);
                }
            });
            let mut nonce = 0u64;
            snapshot.mark_changed();
            while snapshot.changed().await.is_ok() {
                let Some((version, resources)) = snapshot.borrow_and_update().clone() else { continue };
                nonce += 1;
                let response = DiscoveryResponse {
                    version_info: version,
                    resources,
                    type_url: RateLimitConfig::type_url(),
                    nonce: nonce.to_string(),
                    ..Default::default()
                };
                if tx.send(Ok(response)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        _: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented("state of the world only"))
    }
}

/// A `RateLimitConfig` from the file syntax (or Envoy Gateway's dump of one: `rate_limit: null`,
/// upper-case units, fields the proto lacks are ignored), named `name`.
pub fn rate_limit_config(name: &str, yaml: &str) -> RateLimitConfig {
    let file: serde_json::Value = serde_saphyr::from_str(yaml).expect("YAML");
    RateLimitConfig {
        name: name.to_owned(),
        domain: file["domain"].as_str().unwrap_or_default().to_owned(),
        descriptors: descriptors(&file["descriptors"]),
    }
}

fn descriptors(list: &serde_json::Value) -> Vec<RateLimitDescriptor> {
    let Some(list) = list.as_array() else { return Vec::new() };
    list.iter()
        .map(|d| RateLimitDescriptor {
            key: d["key"].as_str().unwrap_or_default().to_owned(),
            value: d["value"].as_str().unwrap_or_default().to_owned(),
            rate_limit: d.get("rate_limit").filter(|r| !r.is_null()).map(|r| RateLimitPolicy {
                unit: r["unit"]
                    .as_str()
                    .and_then(|u| RateLimitUnit::from_str_name(&u.to_ascii_uppercase()))
                    .unwrap_or(RateLimitUnit::Unknown) as i32,
                requests_per_unit: r["requests_per_unit"].as_u64().unwrap_or(0) as u32,
                unlimited: r["unlimited"].as_bool().unwrap_or(false),
                name: r["name"].as_str().unwrap_or_default().to_owned(),
                replaces: r["replaces"]
                    .as_array()
                    .map(|l| {
                        l.iter()
                            .map(|x| RateLimitReplace {
                                name: x["name"].as_str().unwrap_or_default().to_owned(),
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            }),
            descriptors: descriptors(&d["descriptors"]),
            shadow_mode: d["shadow_mode"].as_bool().unwrap_or(false),
            detailed_metric: d["detailed_metric"].as_bool().unwrap_or(false),
            quota_mode: d["quota_mode"].as_bool().unwrap_or(false),
            metadata: None,
        })
        .collect()
}
