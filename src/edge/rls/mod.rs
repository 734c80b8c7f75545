//! The RLS edge: Envoy's `envoy.service.ratelimit.v3.RateLimitService` over gRPC.
//!
//! Every request of Envoy's ratelimit filter enters here ([`RateLimitGrpc::should_rate_limit`]):
//! it is checked ([`validate`]), translated into a neutral [`Query`] ([`query`]), decided by the
//! [`Limiter`], and leaves as a `RateLimitResponse` built by [`encode`] with the headers of
//! [`headers`]. Malformed requests get `INVALID_ARGUMENT`; a store failure in a domain whose
//! failure mode is `error` gets `UNAVAILABLE`, so that Envoy's own `failure_mode_deny` decides.
//! Beyond `max_inflight` concurrent decisions, requests are refused at once with
//! `RESOURCE_EXHAUSTED`.

pub mod fast;
pub mod headers;
pub mod json;
pub mod metadata;

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Semaphore;
use tracing::Instrument as _;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as ProtoUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as ProtoCode, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tonic::{Request, Response, Status};

use crate::limiter::{Code, Decision, Limiter, Outcome, Query, QueryDescriptor, SlotReport};
use crate::telemetry::traces;
use crate::units::{RatePerUnit, Unit};

/// Most descriptors one request may carry.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 64;
/// Longest descriptor entry key or value, in bytes.
pub const MAX_ENTRY_BYTES: usize = 1024;

/// The gRPC service Envoy's ratelimit filter calls.
pub struct RateLimitGrpc {
    limiter: Arc<Limiter>,
    inflight: Arc<Semaphore>,
    max_inflight: usize,
    extras: AnswerExtras,
}

/// What every answer carries beyond the decision, service-wide (envoyproxy/ratelimit's
/// `RESPONSE_DYNAMIC_METADATA` and `LIMIT_RESPONSE_HEADERS_ENABLED`).
#[derive(Debug, Clone, Default)]
pub struct AnswerExtras {
    /// envoyproxy/ratelimit's response dynamic metadata: domain, descriptors and the `metadata:`
    /// of the rules that passed.
    pub dynamic_metadata: bool,
    /// The limit, remaining and reset headers of the most constrained limit, under these names.
    pub limit_headers: Option<headers::LimitHeaderNames>,
}

impl RateLimitGrpc {
    /// A service answering with `limiter`, with at most `max_inflight` decisions in progress,
    /// adding `extras` to every answer.
    pub fn new(limiter: Arc<Limiter>, max_inflight: usize, extras: AnswerExtras) -> Self {
        RateLimitGrpc { limiter, inflight: Arc::new(Semaphore::new(max_inflight)), max_inflight, extras }
    }
}

impl RateLimitGrpc {
    /// The limiter it answers with.
    pub fn limiter(&self) -> &Arc<Limiter> {
        &self.limiter
    }

    /// The answer to `request`, whichever edge it came through (gRPC or `POST /json`): bounded
    /// in flight, validated, decided, encoded, timed.
    pub async fn answer(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
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
        let answer = decide(&self.limiter, request).await.map(|decision| {
            let mut response = encode(&decision);
            if self.extras.dynamic_metadata {
                response.dynamic_metadata =
                    Some(metadata::to_struct(metadata::dynamic_metadata(request, &decision)));
            }
            if let Some(names) = &self.extras.limit_headers {
                let limit_headers = headers::limit_headers(names, &decision);
                response.response_headers_to_add.extend(
                    limit_headers.into_iter().map(|(key, value)| HeaderValue {
                        key,
                        value,
                        raw_value: Vec::new(),
                    }),
                );
            }
            response
        });
        metrics::histogram!("tollgate_request_duration_seconds").record(start.elapsed());
        if let Some(stats) = crate::telemetry::ratelimit_stats::stats() {
            stats.count("ratelimit_server.ShouldRateLimit.total_requests");
            stats.time("ratelimit_server.ShouldRateLimit.response_time", start.elapsed());
            if answer.is_err() {
                stats.count("ratelimit.service.call.should_rate_limit.service_error");
            }
        }
        answer
    }
}

impl RateLimitGrpc {
    /// [`RateLimitGrpc::answer`] inside the request's `ratelimit` span, continuing the trace the
    /// caller's `metadata` names: what a gRPC call gets, by the fast path or tonic's.
    pub async fn answer_traced(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        request: &RateLimitRequest,
    ) -> Result<RateLimitResponse, Status> {
        let span = tracing::trace_span!(
            target: traces::TARGET,
            "ratelimit",
            otel.kind = "server",
            descriptors = request.descriptors.len(),
            domain = tracing::field::Empty,
            rules = tracing::field::Empty,
            tenant = tracing::field::Empty,
            outcome = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        traces::continue_from(&span, metadata);
        let answer = self.answer(request).instrument(span.clone()).await;
        if let Err(status) = &answer {
            span.record("outcome", "error");
            span.record("otel.status_code", "ERROR");
            tracing::trace!(target: traces::TARGET, parent: &span, code = ?status.code(), "no decision");
        }
        answer
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimitGrpc {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.answer_traced(request.metadata(), request.get_ref()).await.map(Response::new)
    }
}

/// Validates, translates and decides `request`: the gRPC status is the RLS answer to an invalid
/// request or an unavailable store.
pub async fn decide(limiter: &Limiter, request: &RateLimitRequest) -> Result<Decision, Status> {
    if let Err(message) = validate(request) {
        metrics::counter!("tollgate_invalid_requests_total").increment(1);
        // A priced domain answers OVER_LIMIT: a call error would let Envoy admit the request
        // uncharged under `failure_mode_deny: false`.
        if let Some(decision) = limiter.refuse_malformed(&request.domain, request.descriptors.len(), &message)
        {
            return Ok(decision);
        }
        tracing::debug!(error = %message, "rejected malformed request");
        return Err(Status::invalid_argument(message));
    }
    limiter.decide(&query(request)).await.map_err(|e| Status::unavailable(e.to_string()))
}

/// Checks what tollgate will not evaluate; the message says why, for the caller.
pub fn validate(request: &RateLimitRequest) -> Result<(), String> {
    if request.domain.is_empty() {
        return Err("domain must not be empty".into());
    }
    if request.descriptors.is_empty() {
        return Err("at least one descriptor is required".into());
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return Err(format!(
            "at most {MAX_DESCRIPTORS} descriptors per request, got {}",
            request.descriptors.len()
        ));
    }
    for (i, d) in request.descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            return Err(format!("descriptor {i} has no entries"));
        }
        if d.entries.len() > MAX_ENTRIES {
            return Err(format!(
                "descriptor {i} has {} entries, at most {MAX_ENTRIES} allowed",
                d.entries.len()
            ));
        }
        for (j, e) in d.entries.iter().enumerate() {
            if e.key.is_empty() {
                return Err(format!("descriptor {i} entry {j} has an empty key"));
            }
            if e.key.len() > MAX_ENTRY_BYTES || e.value.len() > MAX_ENTRY_BYTES {
                return Err(format!(
                    "descriptor {i} entry {j}: keys and values are limited to {MAX_ENTRY_BYTES} bytes"
                ));
            }
        }
        if let Some(o) = &d.limit {
            if unit(o.unit).is_none() {
                return Err(format!("descriptor {i}: the limit override has no valid unit ({})", o.unit));
            }
        }
    }
    Ok(())
}

/// The neutral query of a validated `request`.
pub fn query(request: &RateLimitRequest) -> Query<'_> {
    Query {
        domain: &request.domain,
        descriptors: request
            .descriptors
            .iter()
            .map(|d| QueryDescriptor {
                entries: d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect(),
                hits: hits(d, request.hits_addend),
                credit: d.is_negative_hits,
                limit: d.limit.and_then(|o| {
                    Some(RatePerUnit { requests_per_unit: o.requests_per_unit, unit: unit(o.unit)? })
                }),
            })
            .collect(),
    }
}

/// Hits a descriptor asks for: its own `hits_addend` if set (0 = only check), else the
/// request's, at least 1.
fn hits(d: &RateLimitDescriptor, request_hits: u32) -> u64 {
    match &d.hits_addend {
        Some(h) => h.value,
        None => u64::from(request_hits.max(1)),
    }
}

/// The unit of a request-level limit override; `None` if unknown.
fn unit(unit: i32) -> Option<Unit> {
    Unit::parse(RateLimitUnit::try_from(unit).ok()?.as_str_name())
}

/// The protobuf response for `decision`.
pub fn encode(decision: &Decision) -> RateLimitResponse {
    let statuses = decision
        .descriptors
        .iter()
        .map(|d| {
            let mut status = DescriptorStatus { code: code(d.code) as i32, ..Default::default() };
            if let Some(limit) = d.limit() {
                status.current_limit = Some(RateLimit {
                    name: limit.name.clone(),
                    requests_per_unit: limit.current_limit.requests_per_unit,
                    unit: proto_unit(limit.current_limit.unit) as i32,
                });
            }
            match &d.outcome {
                Outcome::Unlimited => status.limit_remaining = u32::MAX,
                Outcome::Bucket(b) | Outcome::Slot(SlotReport { bucket: Some(b), .. }) => {
                    status.limit_remaining = b.remaining();
                    status.duration_until_reset = Some(duration(b.verdict.reset_ms));
                }
                // Slots left of the tightest set: what a slot-only descriptor has remaining.
                Outcome::Slot(s) => {
                    let left = s.tightest().map_or(0, |t| t.max.saturating_sub(t.open));
                    status.limit_remaining = u32::try_from(left).unwrap_or(u32::MAX);
                }
                Outcome::NoLimit
                | Outcome::StoreFailed { .. }
                | Outcome::Budget(_)
                | Outcome::BudgetFailed { .. }
                | Outcome::SlotFailed { .. } => {}
            }
            status
        })
        .collect();
    let response_headers_to_add = headers::response_headers(decision)
        .into_iter()
        .map(|(key, value)| HeaderValue { key: key.to_owned(), value, raw_value: Vec::new() })
        .collect();
    RateLimitResponse {
        overall_code: code(decision.overall) as i32,
        statuses,
        response_headers_to_add,
        ..Default::default()
    }
}

fn code(code: Code) -> ProtoCode {
    match code {
        Code::Ok => ProtoCode::Ok,
        Code::OverLimit => ProtoCode::OverLimit,
    }
}

fn proto_unit(unit: Unit) -> ProtoUnit {
    match unit {
        Unit::Second => ProtoUnit::Second,
        Unit::Minute => ProtoUnit::Minute,
        Unit::Hour => ProtoUnit::Hour,
        Unit::Day => ProtoUnit::Day,
        Unit::Week => ProtoUnit::Week,
        Unit::Month => ProtoUnit::Month,
        Unit::Year => ProtoUnit::Year,
    }
}

fn duration(ms: u64) -> ProtoDuration {
    ProtoDuration { seconds: (ms / 1000) as i64, nanos: ((ms % 1000) * 1_000_000) as i32 }
}
