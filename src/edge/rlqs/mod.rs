//! The RLQS edge: Envoy's `envoy.service.rate_limit_quota.v3.RateLimitQuotaService`, the server
//! side of the `envoy.filters.http.rate_limit_quota` filter.
//!
//! Envoy groups requests into buckets, enforces each bucket's assignment locally at full speed,
//! and streams usage reports; tollgate answers with assignments. The buckets are the RLS path's
//! own (a bucket id maps to a rule as a descriptor does), so a tenant reached through both
//! protocols spends one budget. An assignment is a part of a lease: each replica leases a
//! part of the bucket in the store, which the rest of the bucket no longer keeps or refills
//! ([`crate::bucket::lease`]), and splits it among its streams as refilling local buckets
//! ([`pool`]), so across any number of Envoys and replicas the bucket's limit holds. Each stream
//! runs in one task ([`session`]); the arithmetic is in [`assign`], the answers' encoding in
//! [`answer`]. Sessions and the pool run on a runtime of their own, which the server hands in:
//! their bursts of CPU (a first report of thousands of buckets) never hold up an RLS decision.
//!
//! Streams never end by themselves: when the server drains, every stream is closed (Envoy keeps
//! its cached assignments and reconnects, to another replica if this one is gone). What a closed
//! stream's Envoy may still admit is inside this replica's lease, which outlives its assignments,
//! so nothing is settled.
//!
//! No peer can make a replica keep state without bound ([`RlqsLimits`]): the bucket ids a stream, and
//! all streams together, have tracked are capped (an id beyond a cap gets no assignment, so
//! Envoy applies its `no_assignment_behavior`); the answers a stream has not read are bounded in
//! bytes, and a stream that stays full past [`UNREAD_DEADLINE`] is ended with
//! RESOURCE_EXHAUSTED and its leases given back (as is one whose oldest answer waits that long);
//! streams past `max_streams` are refused. One source address holds at most a quarter of the
//! streams and of the tracked ids ([`peers`]), so no one client takes the replica's.

pub mod answer;
pub mod assign;
pub mod gather;
pub mod peers;
pub mod pool;
pub mod session;
pub mod unread;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
use tokio::runtime::Handle;
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};

use self::peers::Peers;
use self::pool::Pool;
use crate::clock::Clock;
use crate::edge::region::client::GlobalLeases;
use crate::limiter::Limiter;

/// The RLQS edge's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RlqsLimits {
    /// How long a bucket may go without usage before its Envoys are told to abandon it.
    pub abandon_after: Duration,
    /// Most bucket ids one stream has tracked.
    pub max_buckets_per_stream: usize,
    /// Most bucket ids all streams of this replica have tracked.
    pub max_buckets: usize,
    /// Most streams open at once.
    pub max_streams: usize,
}

impl Default for RlqsLimits {
    /// `serve`'s defaults. A tracked id costs about 3 KB with its share of the store (measured:
    /// 1M ids took the embedded store's RSS up by 2.7 GB), so 100,000 ids are about 300 MB; one
    /// Envoy seldom has more than a few thousand buckets.
    fn default() -> Self {
        RlqsLimits {
            abandon_after: Duration::from_secs(300),
            max_buckets_per_stream: 20_000,
            max_buckets: 100_000,
            max_streams: 1_000,
        }
    }
}

/// Most bytes of answers a stream may have unread: one largest response and some.
pub const MAX_UNREAD_BYTES: usize = answer::MAX_RESPONSE_BYTES + (1 << 20);
/// How long a stream's unread answers may stay at [`MAX_UNREAD_BYTES`] before the stream is ended.
pub const UNREAD_DEADLINE: Duration = Duration::from_secs(10);

/// The gRPC service Envoy's rate_limit_quota filter streams to.
pub struct RateLimitQuotaGrpc {
    limiter: Arc<Limiter>,
    pool: Arc<Pool>,
    clock: Arc<dyn Clock>,
    limits: RlqsLimits,
    closing: watch::Receiver<bool>,
    runtime: Handle,
    streams: AtomicU64,
    // Streams open and bucket ids tracked, by peer and in all.
    peers: Arc<Peers>,
}

impl RateLimitQuotaGrpc {
    /// A service leasing parts of buckets through `limiter` as `replica` (its name in the buckets' leases,
    /// unique among replicas, without whitespace), within `limits`; every stream ends when
    /// `closing` turns true. Its streams and their leases are worked on `runtime`. In a region,
    /// the leases of global rules' buckets are set at the global tier through `global`.
    pub fn new(
        limiter: Arc<Limiter>,
        global: Option<Arc<GlobalLeases>>,
        replica: String,
        clock: Arc<dyn Clock>,
        limits: RlqsLimits,
        closing: watch::Receiver<bool>,
        runtime: Handle,
    ) -> Self {
        let pool = Arc::new(Pool::new(limiter.clone(), global, replica, &runtime));
        RateLimitQuotaGrpc {
            limiter,
            pool,
            clock,
            limits,
            closing,
            runtime,
            streams: AtomicU64::new(0),
            peers: Arc::default(),
        }
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for RateLimitQuotaGrpc {
    type StreamRateLimitQuotasStream = unread::Unread;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let open = match self.peers.open(request.remote_addr().map(|a| a.ip()), &self.limits) {
            Ok(open) => open,
            Err(reason) => {
                metrics::counter!("tollgate_rlqs_streams_refused_total").increment(1);
                let most = if reason == "peer_limit" {
                    self.limits.max_streams / 4
                } else {
                    self.limits.max_streams
                };
                if let Some(held_back) = crate::telemetry::logs::throttled("rlqs_max_streams") {
                    tracing::warn!(max_streams = self.limits.max_streams, reason, held_back, "an RLQS stream refused: the replica has --rlqs-max-streams open, or its address a quarter of them");
                }
                return Err(Status::resource_exhausted(format!(
                    "{} {most} Rate Limit Quota streams open, its most (--rlqs-max-streams; one address holds a quarter)",
                    if reason == "peer_limit" { "this address has" } else { "this replica has" }
                )));
            }
        };
        let (answers, stream) = unread::unread(MAX_UNREAD_BYTES, UNREAD_DEADLINE);
        let context = session::Context {
            limiter: self.limiter.clone(),
            pool: self.pool.clone(),
            clock: self.clock.clone(),
            limits: self.limits,
            closing: self.closing.clone(),
        };
        let id = self.streams.fetch_add(1, Ordering::Relaxed);
        let peer = session::Peer { name: envoy_name(&request) };
        self.runtime.spawn(session::run(context, id, peer, request.into_inner(), answers, open));
        Ok(Response::new(stream))
    }
}

/// The stream metadata by which an Envoy names itself in tollgate's logs
/// (`grpc_service.initial_metadata`); without it, an Envoy is named by its address.
pub const ENVOY_NAME_METADATA: &str = "x-tollgate-envoy";

// The name an Envoy goes by in logs: the name it gives itself, else its IP address.
fn envoy_name<T>(request: &Request<T>) -> String {
    let named = request.metadata().get(ENVOY_NAME_METADATA).and_then(|v| v.to_str().ok());
    match named {
        Some(name) if !name.is_empty() && name.len() <= 256 => format!("name={name}"),
        _ => request.remote_addr().map(|a| format!("ip={}", a.ip())).unwrap_or_default(),
    }
}
