//! The protocol edge: Envoy's `envoy.service.ratelimit.v3.RateLimitService` over gRPC.
//!
//! Every request enters here ([`RateLimitGrpc::should_rate_limit`]), is decided by the
//! [`Limiter`], and leaves as a `RateLimitResponse` built by [`encode`]. Malformed requests get
//! `INVALID_ARGUMENT`; a store failure in a domain whose failure mode is `error` gets
//! `UNAVAILABLE`, so that Envoy's own `failure_mode_deny` decides. Beyond `max_inflight`
//! concurrent decisions, requests are refused at once with `RESOURCE_EXHAUSTED`. Every answer is
//! counted and timed here.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Semaphore;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{DescriptorStatus, RateLimit};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tonic::{Request, Response, Status};

use crate::headers::response_headers;
use crate::limiter::{DecideError, Decision, LimitInfo, Limiter, Outcome};
use crate::telemetry::Telemetry;
use crate::units;

/// The gRPC service Envoy's ratelimit filter calls.
pub struct RateLimitGrpc {
    limiter: Arc<Limiter>,
    telemetry: Arc<Telemetry>,
    inflight: Arc<Semaphore>,
    max_inflight: usize,
}

impl RateLimitGrpc {
    /// A service answering with `limiter`, counting into `telemetry`, with at most
    /// `max_inflight` decisions in progress.
    pub fn new(limiter: Arc<Limiter>, telemetry: Arc<Telemetry>, max_inflight: usize) -> Self {
        RateLimitGrpc { limiter, telemetry, inflight: Arc::new(Semaphore::new(max_inflight)), max_inflight }
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimitGrpc {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let start = Instant::now();
        // Past the bound, refuse at once instead of queueing: a backlog would only answer late,
        // after Envoy has given up, and grow memory. Envoy's failure_mode_deny then decides.
        let Ok(_permit) = self.inflight.clone().try_acquire_owned() else {
            metrics::counter!("tollgate_overload_rejections_total").increment(1);
            return Err(Status::resource_exhausted(format!(
                "tollgate is overloaded: {} decisions in flight",
                self.max_inflight
            )));
        };
        let request = request.into_inner();
        let answer = match self.limiter.decide(&request).await {
            Ok(decision) => {
                self.telemetry.record(&request, &decision);
                match &decision.unavailable {
                    None => Ok(Response::new(encode(&decision))),
                    Some(error) => Err(Status::unavailable(format!(
                        "rate limit store unavailable for domain '{}': {error}",
                        request.domain
                    ))),
                }
            }
            Err(e @ DecideError::InvalidArgument(_)) => {
                metrics::counter!("tollgate_invalid_requests_total").increment(1);
                tracing::debug!(error = %e, "rejected malformed request");
                Err(Status::invalid_argument(e.to_string()))
            }
        };
        metrics::histogram!("tollgate_request_duration_seconds").record(start.elapsed());
        answer
    }
}

/// The protobuf response for `decision`.
pub fn encode(decision: &Decision) -> RateLimitResponse {
    let statuses = decision
        .descriptors
        .iter()
        .map(|d| {
            let mut status = DescriptorStatus { code: d.code as i32, ..Default::default() };
            match &d.outcome {
                Outcome::NoLimit => {}
                Outcome::Unlimited => status.limit_remaining = u32::MAX,
                Outcome::Bucket(b) => {
                    status.current_limit = Some(current_limit(&b.limit));
                    status.limit_remaining = b.remaining();
                    status.duration_until_reset = Some(duration(b.verdict.reset_ms));
                }
                Outcome::StoreFailed { limit, .. } => status.current_limit = Some(current_limit(limit)),
            }
            status
        })
        .collect();
    let response_headers_to_add = response_headers(decision)
        .into_iter()
        .map(|(key, value)| HeaderValue { key: key.to_owned(), value, raw_value: Vec::new() })
        .collect();
    RateLimitResponse {
        overall_code: decision.overall as i32,
        statuses,
        response_headers_to_add,
        ..Default::default()
    }
}

fn current_limit(limit: &LimitInfo) -> RateLimit {
    let (requests_per_unit, unit) = units::requests_per_unit(limit.spec.refill_per_second);
    RateLimit { name: limit.name.clone(), requests_per_unit, unit: unit as i32 }
}

fn duration(ms: u64) -> ProtoDuration {
    ProtoDuration { seconds: (ms / 1000) as i64, nanos: ((ms % 1000) * 1_000_000) as i32 }
}
