//! The RLQS edge: Envoy's `envoy.service.rate_limit_quota.v3.RateLimitQuotaService`, the server
//! side of the `envoy.filters.http.rate_limit_quota` filter.
//!
//! Envoy groups requests into buckets, enforces each bucket's assignment locally at full speed,
//! and streams usage reports; tollgate answers with assignments. The buckets are the RLS path's
//! own (a bucket id maps to a rule as a descriptor does), so a tenant reached through both
//! protocols spends one budget. An assignment is a part of a held share: each replica holds a
//! share of the bucket in the store, which the rest of the bucket no longer holds or refills
//! ([`crate::bucket::hold`]), and splits it among its streams as refilling local buckets
//! ([`pool`]), so across any number of Envoys and replicas the bucket's limit holds. Each stream
//! runs in one task ([`session`]); the arithmetic is in [`assign`], the answers' encoding in
//! [`answer`].
//!
//! Streams never end by themselves: when the server drains, every stream is closed (Envoy keeps
//! its cached assignments and reconnects, to another replica if this one is gone). What a closed
//! stream's Envoy may still admit is inside this replica's hold, which outlives its assignments,
//! so nothing is settled.

pub mod answer;
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
}

impl RateLimitQuotaGrpc {
    /// A service holding shares through `limiter` as `replica` (its name in the buckets' holds,
    /// unique among replicas, without whitespace); a bucket without usage for `abandon_after` is
    /// abandoned; every stream ends when `closing` turns true.
    pub fn new(
        limiter: Arc<Limiter>,
        replica: String,
        clock: Arc<dyn Clock>,
        abandon_after: Duration,
        closing: watch::Receiver<bool>,
    ) -> Self {
        let pool = Arc::new(Pool::new(limiter.clone(), replica));
        RateLimitQuotaGrpc { limiter, pool, clock, abandon_after, closing, streams: AtomicU64::new(0) }
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
        let peer = session::Peer { name: envoy_name(&request) };
        tokio::spawn(session::run(context, id, peer, request.into_inner(), answers));
        Ok(Response::new(ReceiverStream::new(stream)))
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
