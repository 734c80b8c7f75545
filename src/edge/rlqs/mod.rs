//! The RLQS edge: Envoy's `envoy.service.rate_limit_quota.v3.RateLimitQuotaService`, the server
//! side of the `envoy.filters.http.rate_limit_quota` filter.
//!
//! Envoy groups requests into buckets, enforces each bucket's assignment locally at full speed,
//! and streams usage reports; tollgate answers with assignments. The buckets are the RLS path's
//! own (a bucket id maps to a rule as a descriptor does), so a tenant reached through both
//! protocols spends one budget. An assignment is a lease: every request an Envoy may admit was
//! taken from the shared bucket before the assignment was sent ([`pool`]), so across any number
//! of Envoys and replicas the bucket's limit holds. Each stream runs in one task
//! ([`session`]); the arithmetic is in [`assign`].
//!
//! Streams never end by themselves: when the server drains, every stream is closed (Envoy keeps
//! its cached assignments and reconnects, to another replica if this one is gone). What a closed
//! stream's Envoy may still have used of its grants is parked in the store under the Envoy's name
//! ([`ENVOY_NAME_METADATA`], else its address) for its next stream to settle.

pub mod assign;
pub mod pool;
pub mod session;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use self::pool::Pool;
use crate::clock::Clock;
use crate::limiter::Limiter;

/// The gRPC service Envoy's rate_limit_quota filter streams to.
pub struct RateLimitQuotaGrpc {
    limiter: Arc<Limiter>,
    pool: Arc<Pool>,
    clock: Arc<dyn Clock>,
    abandon_after: Duration,
    closing: watch::Receiver<bool>,
    streams: AtomicU64,
    replica: String,
}

impl RateLimitQuotaGrpc {
    /// A service leasing through `limiter` as `replica` (its name in the store's demand
    /// registries); a bucket without usage for `abandon_after` is abandoned; every stream ends
    /// when `closing` turns true.
    pub fn new(
        limiter: Arc<Limiter>,
        replica: String,
        clock: Arc<dyn Clock>,
        abandon_after: Duration,
        closing: watch::Receiver<bool>,
    ) -> Self {
        let pool = Arc::new(Pool::new(limiter.clone(), replica.clone()));
        RateLimitQuotaGrpc {
            limiter,
            pool,
            clock,
            abandon_after,
            closing,
            streams: AtomicU64::new(0),
            replica,
        }
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for RateLimitQuotaGrpc {
    type StreamRateLimitQuotasStream = ReceiverStream<Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let (answers, stream) = mpsc::channel(64);
        let context = session::Context {
            limiter: self.limiter.clone(),
            pool: self.pool.clone(),
            clock: self.clock.clone(),
            abandon_after: self.abandon_after,
            closing: self.closing.clone(),
        };
        let id = self.streams.fetch_add(1, Ordering::Relaxed);
        let peer = session::Peer { name: envoy_name(&request), stream: format!("{}#{id}", self.replica) };
        tokio::spawn(session::run(context, id, peer, request.into_inner(), answers));
        Ok(Response::new(ReceiverStream::new(stream)))
    }
}

/// The stream metadata by which an Envoy names itself (`grpc_service.initial_metadata`); without
/// it, an Envoy is named by its address. Envoys that share an address should each set it.
pub const ENVOY_NAME_METADATA: &str = "x-tollgate-envoy";

// The name the grants of a closed stream are parked under, for the Envoy's next stream to claim:
// the name it gives itself, else its IP address (unique per pod in Kubernetes). A name two live
// streams share (Envoys behind one address) settles nothing: the store notices the two streams.
fn envoy_name<T>(request: &Request<T>) -> String {
    let named = request.metadata().get(ENVOY_NAME_METADATA).and_then(|v| v.to_str().ok());
    match named {
        Some(name) if !name.is_empty() && name.len() <= 256 => format!("name={name}"),
        _ => request.remote_addr().map(|a| format!("ip={}", a.ip())).unwrap_or_default(),
    }
}
