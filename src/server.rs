//! Server lifecycle: serve gRPC and HTTP, drain, stop.
//!
//! Both listeners are bound ([`bind`]) before anything is served, so a port conflict
//! fails start-up instead of leaving a half-running process; tests bind port 0 and serve in
//! process. Shutdown follows the order load balancers need:
//!
//! 1. the shutdown signal arrives;
//! 2. `/readyz` answers 503 and gRPC health reports NOT_SERVING, so Envoy and Kubernetes stop
//!    sending new work;
//! 3. after the drain delay, both servers stop accepting and finish every in-flight request;
//! 4. [`run`] returns.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::edge::region::proto::region_leases_server::RegionLeasesServer;
use crate::edge::region::{RegionAuth, RegionLeasesGrpc};
use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::service::Routes;

use crate::clock::MonotonicClock;
use crate::config::RuleSet;
use crate::connections::{Admitted, ConnLimits};
use crate::edge::region::client::GlobalLeases;
use crate::edge::rlqs::{RateLimitQuotaGrpc, RlqsLimits};
use crate::edge::rls::fast::FastLayer;
use crate::edge::rls::{AnswerExtras, RateLimitGrpc};
use crate::http::{self, Access, HttpState};
use crate::limiter::Limiter;
use crate::telemetry::Telemetry;
use crate::tls::ReloadingTls;

/// The gRPC connections' HTTP/2 receive window. Envoy reports a new RLQS bucket's first request
/// at once, in a message of its own: a burst of new buckets is thousands of small DATA frames on
/// one stream. The HTTP/2 library closes a connection (GOAWAY ENHANCE_YOUR_CALM,
/// `too_many_data_frames`) once the framing overhead of unread small frames passes half the
/// connection window; with hyper's 1 MiB that was about 2,500 reports, which a real Envoy with
/// 10,000 new buckets passed in a second. At 16 MiB the 1 MiB stream window stops the Envoy first
/// (flow control), so one stream cannot trip it; the cost is that a connection may buffer up to
/// 16 MiB of unread requests.
const GRPC_CONNECTION_WINDOW: u32 = 16 << 20;

/// The sockets to serve on.
pub struct Listeners {
    /// gRPC: RateLimitService, RateLimitQuotaService, grpc.health.v1.
    pub grpc: TcpListener,
    /// TLS (or mTLS) for the gRPC port; plaintext when `None`.
    pub tls: Option<Arc<ReloadingTls>>,
    /// The HTTP side endpoints.
    pub http: TcpListener,
    /// `/healthz` and `/readyz` alone, for kubelet: a port no client flood of the HTTP port
    /// reaches (`--probe-addr`).
    pub probe: Option<TcpListener>,
}

impl Listeners {
    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> std::io::Result<SocketAddr> {
        self.grpc.local_addr()
    }

    /// The bound HTTP address.
    pub fn http_addr(&self) -> std::io::Result<SocketAddr> {
        self.http.local_addr()
    }
}

/// Binds `addr` (port 0 picks a free port), saying which address failed.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why (in use, not permitted).
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The HTTP server failed.
    #[error("HTTP server: {0}")]
    Http(#[source] std::io::Error),
    /// The RLQS runtime's thread could not be started.
    #[error("starting the RLQS runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

/// How shutdown should proceed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// Go unready, wait this long for load balancers to notice, then drain.
    Drain(Duration),
    /// Drain in-flight requests without waiting first (Ctrl-C where SIGTERM cannot be watched).
    Immediate,
}

/// What the servers serve.
pub struct Service {
    /// Most decisions in flight at once; more are refused at once with RESOURCE_EXHAUSTED.
    pub max_inflight: usize,
    /// Answer `ShouldRateLimit` on the fast path rather than through tonic's generic stack.
    pub rls_fast_path: bool,
    /// The rules in force, swapped by reloads.
    pub rules: Arc<ArcSwap<RuleSet>>,
    /// The decision maker.
    pub limiter: Arc<Limiter>,
    /// Metrics.
    pub telemetry: Arc<Telemetry>,
    /// What every RLS answer carries beyond the decision.
    pub answer_extras: AnswerExtras,
    /// The RLQS edge's bounds.
    pub rlqs: RlqsLimits,
    /// Connection caps and timeouts on both ports.
    pub connections: ConnLimits,
    /// Serve `POST /json` and `GET /config` on the plaintext HTTP port even when gRPC requires
    /// client certificates.
    pub http_unauthenticated: bool,
    /// Serve `tollgate.region.v1.RegionLeases` (the global tier of global limits) to the
    /// callers this allows.
    pub global_tier: Option<RegionAuth>,
    /// In a region, where RLQS leases of global rules' buckets are set.
    pub global_leases: Option<Arc<GlobalLeases>>,
    /// Whether a config is in force yet: until then, unready (pushed configs only).
    pub config_loaded: watch::Receiver<bool>,
}

// A request that does not decode (a string field that is not UTF-8, bytes that are not the
// message) is answered INTERNAL by tonic, as its own faults are; the fault is the client's:
// INVALID_ARGUMENT, as for every other request tollgate will not evaluate.
// The status is in the trailers (or, for an answer with no body, in the headers).
fn client_decode_errors(
    response: axum::http::Response<tonic::body::Body>,
) -> axum::http::Response<tonic::body::Body> {
    use http_body_util::BodyExt as _;
    let (mut parts, body) = response.into_parts();
    invalid_argument(&mut parts.headers);
    let body = body.map_frame(|mut frame| {
        if let Some(trailers) = frame.trailers_mut() {
            invalid_argument(trailers);
        }
        frame
    });
    axum::http::Response::from_parts(parts, tonic::body::Body::new(body))
}

// INTERNAL for a message that did not decode becomes INVALID_ARGUMENT.
fn invalid_argument(fields: &mut axum::http::HeaderMap) {
    let internal = fields.get("grpc-status").is_some_and(|s| s == "13");
    let undecodable = fields
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        // Percent-encoded on the wire, spaces included.
        .is_some_and(|m| m.replace("%20", " ").starts_with("failed to decode Protobuf message"));
    if internal && undecodable {
        fields.insert("grpc-status", axum::http::HeaderValue::from_static("3"));
    }
}

/// This process's name as a leaseholder (the store's RLQS demand registries, a region's leases
/// at the global tier): unique among replicas.
pub fn replica_name() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    let started =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{host}/{}/{started:x}", std::process::id())
}

/// Serves on `listeners` until `shutdown` resolves, then drains and returns.
pub async fn run(
    listeners: Listeners,
    service: Service,
    shutdown: impl Future<Output = Shutdown>,
) -> Result<(), ServeError> {
    let grpc_addr = listeners.grpc_addr().map_err(ServeError::Http)?;
    let http_addr = listeners.http_addr().map_err(ServeError::Http)?;
    let Listeners { grpc: grpc_listener, tls, http: http_listener, probe: probe_listener } = listeners;

    let (health, health_service) = tonic_health::server::health_reporter();
    let draining = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };

    let Service {
        rules,
        limiter,
        telemetry,
        max_inflight,
        rls_fast_path,
        answer_extras,
        rlqs: rlqs_limits,
        connections,
        http_unauthenticated,
        global_tier,
        global_leases,
        config_loaded,
    } = service;
    // gRPC health says SERVING once a config is in force (at once for files), and not after
    // draining has begun.
    let services = served_services(global_tier.is_some());
    let serving = {
        let (health, draining, mut loaded) = (health.clone(), draining.clone(), config_loaded.clone());
        tokio::spawn(async move {
            set_health(&health, services, false).await;
            if loaded.wait_for(|loaded| *loaded).await.is_ok() && !draining.load(Ordering::SeqCst) {
                set_health(&health, services, true).await;
            }
        })
    };
    let grpc_gate = crate::connections::gate("grpc", &connections);
    let rls = Arc::new(RateLimitGrpc::new(limiter.clone(), max_inflight, answer_extras));
    // With mutual TLS on gRPC, what spends or reveals tenants' budgets is served there, and the
    // plaintext HTTP port refuses it unless the operator opted in.
    let mutual = tls.as_ref().is_some_and(|t| t.mutual());
    let state = HttpState {
        rules,
        store: limiter.store().clone(),
        draining: draining.clone(),
        telemetry: telemetry.clone(),
        rls: rls.clone(),
        access: if mutual && !http_unauthenticated { Access::MutualTlsOnly } else { Access::Open },
        config_loaded,
    };
    let budget = mutual.then(|| http::budget_router(HttpState { access: Access::Open, ..state.clone() }));
    let probe_server = probe_listener.map(|listener| {
        crate::connections::serve_http(
            listener,
            http::probe_router(state.clone()),
            crate::connections::gate("probe", &connections),
            connections,
            stopped(stop_rx.clone()),
        )
    });
    let http_server = crate::connections::serve_http(
        http_listener,
        http::router(state),
        crate::connections::gate("http", &connections),
        connections,
        stopped(stop_rx.clone()),
    );
    // RLQS work runs on a runtime of its own: a first report of 20,000 buckets is seconds of
    // bursts of CPU, and on the decisions' runtime it held RLS requests up past their deadline
    // (measured: 5 such streams, a 50 ms Redis deadline, p99 157 ms and 162 of 400 RLS answers
    // from the failure mode; on its own thread, which the OS time-slices, and with connections of
    // its own, p99 26-40 ms and none). Its
    // streams' bytes still move on this runtime's connections. RLQS streams never end by
    // themselves: they close when the servers stop.
    let rlqs_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("tollgate-rlqs")
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    let rlqs = RateLimitQuotaGrpc::new(
        limiter.clone(),
        global_leases,
        replica_name(),
        Arc::new(MonotonicClock::new()),
        rlqs_limits,
        stop_rx.clone(),
        rlqs_runtime.handle().clone(),
    );
    let rls_fast = rls.clone();
    let grpc_routes = Routes::new(health_service)
        .add_service(RateLimitServiceServer::from_arc(rls))
        .add_service(RateLimitQuotaServiceServer::new(rlqs));
    let grpc_routes = match global_tier {
        Some(auth) => {
            if auth.insecure {
                tracing::warn!("--global-tier-insecure: RegionLeases is served to ANY caller that reaches the gRPC port, without a certificate; anyone there can take every global bucket and budget. For a trial only");
            }
            grpc_routes.add_service(RegionLeasesServer::new(RegionLeasesGrpc::new(limiter.clone(), auth)))
        }
        None => grpc_routes,
    };
    let grpc_routes = match budget {
        Some(budget) => Routes::from(grpc_routes.into_axum_router().merge(budget)),
        None => grpc_routes,
    };
    let routes = tonic::transport::Server::builder()
        .initial_connection_window_size(GRPC_CONNECTION_WINDOW)
        .max_connection_age(connections.max_age)
        .max_connection_age_grace(connections.max_age_grace)
        .layer(tower::util::MapResponseLayer::new(client_decode_errors))
        .layer(tower::util::option_layer(rls_fast_path.then(|| FastLayer::new(rls_fast))))
        .add_routes(grpc_routes);
    let admitted = Admitted { gate: grpc_gate, idle: connections.grpc_idle_timeout };
    let grpc_server: Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> = match &tls {
        Some(tls) => Box::pin(
            routes.serve_with_incoming_shutdown(tls.incoming(grpc_listener, admitted), stopped(stop_rx)),
        ),
        None => Box::pin(routes.serve_with_incoming_shutdown(
            crate::tls::plaintext_incoming(grpc_listener, admitted),
            stopped(stop_rx),
        )),
    };

    let lifecycle = async move {
        let how = shutdown.await;
        draining.store(true, Ordering::SeqCst);
        serving.abort();
        set_health(&health, services, false).await;
        if let Shutdown::Drain(delay) = how {
            tracing::info!(?delay, "shutting down: unready now, draining after the delay");
            tokio::time::sleep(delay).await;
        }
        tracing::info!("draining in-flight requests");
        let _ = stop_tx.send(true);
    };

    tracing::info!(grpc = %grpc_addr, http = %http_addr, "listening");
    let servers = async {
        tokio::try_join!(async { grpc_server.await.map_err(ServeError::Grpc) }, async {
            match probe_server {
                Some(probe) => drop(tokio::join!(http_server, probe)),
                None => http_server.await,
            }
            Ok(())
        })
    };
    tokio::pin!(servers, lifecycle);
    // A server that fails ends everything; otherwise the lifecycle decides when to stop.
    let result = tokio::select! {
        result = &mut servers => result,
        () = &mut lifecycle => servers.await,
    };
    // Every stream has ended with the servers; a tick or lease call still running is dropped (the
    // leases expire by themselves). Blocking here, inside the decisions' runtime, is not allowed.
    rlqs_runtime.shutdown_background();
    result?;
    tracing::info!("stopped");
    Ok(())
}

// The gRPC services this server answers, by their health names: the whole server (""), RLS,
// RLQS and, at the global tier, RegionLeases.
fn served_services(global_tier: bool) -> &'static [&'static str] {
    const ALL: [&str; 4] = [
        "",
        <RateLimitServiceServer<RateLimitGrpc> as tonic::server::NamedService>::NAME,
        <RateLimitQuotaServiceServer<RateLimitQuotaGrpc> as tonic::server::NamedService>::NAME,
        <RegionLeasesServer<RegionLeasesGrpc> as tonic::server::NamedService>::NAME,
    ];
    if global_tier {
        &ALL
    } else {
        &ALL[..3]
    }
}

// Sets every one of `services` serving or not, together.
async fn set_health(health: &tonic_health::server::HealthReporter, services: &[&str], serving: bool) {
    let status =
        if serving { tonic_health::ServingStatus::Serving } else { tonic_health::ServingStatus::NotServing };
    for service in services {
        health.set_service_status(*service, status).await;
    }
}
