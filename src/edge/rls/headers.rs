//! Response headers that tell clients where they stand.
//!
//! Whatever the domain's sets, an answer the failure mode gave (the store did not answer) carries
//! [`FAILURE_MODE_HEADER`] with the mode (`allow` or `deny`), so that a caller, `tollgate ask`,
//! and Envoy's access logs can tell it from a real decision.
//!
//! Envoy copies these onto the response: the upstream's on OK, the 429 on OVER_LIMIT. Per domain
//! (`response_headers:`) three sets can be chosen:
//!
//! * `x-ratelimit`: `X-RateLimit-Limit` (capacity) and `X-RateLimit-Remaining` (whole tokens
//!   left) of the most constrained bucket: the denying bucket with the fewest tokens when the
//!   request is denied, otherwise the bucket with the fewest tokens.
//! * `retry-after`: on OVER_LIMIT, `Retry-After` in whole seconds (at least 1): the longest wait
//!   among the denying buckets. Omitted when a denying request can never succeed (its cost
//!   exceeds the bucket's capacity), because retrying cannot help.
//! * `ietf`: `RateLimit-Policy` and `RateLimit` structured fields of
//!   draft-ietf-httpapi-ratelimit-headers (-09): one item per bucket, `q` = capacity, `w` =
//!   seconds to refill from empty, `r` = remaining, `t` = seconds until full.
//! * (always, in a domain with prices) `X-Budget-Exhausted` (the exhausted level's descriptor
//!   key, nearest the top; `model` for a model without a price), `X-Budget-Remaining` (the money
//!   left at the level with the least, all nine decimals and the currency) and `X-Budget-Reset`
//!   (whole seconds to that level's period end); with `retry-after`, a budget's denial is retried
//!   at its period end, and a request refused whatever the budgets say (`request`, `request_id`:
//!   retrying cannot help) gets none. `X-Budget-Warning` (`<level>=<threshold>, ...`) names each
//!   level whose spend is at or above one of its `alert_at` soft limits, with the highest.
//! * (service-wide, `--limit-headers`) envoyproxy/ratelimit's `LIMIT_RESPONSE_HEADERS_ENABLED`:
//!   the limit of the most constrained descriptor as "N per unit" (`RateLimit-Limit`), its whole
//!   tokens left (`RateLimit-Remaining`) and whole seconds until its bucket is full again
//!   (`RateLimit-Reset`; upstream's fixed window ends then, a token bucket is full then), under
//!   the names the operator chose. Most constrained is upstream's choice: a denying enforced
//!   limit if any, otherwise the one with the fewest left.
//! * (always, on a path with a concurrency limit) `X-Concurrency-Limit` and
//!   `X-Concurrency-Remaining` of the tightest slot set; on a take refused because a set is full,
//!   `Retry-After` when its earliest open slot expires unreturned (an upper bound of the wait).
//! * `grpc-status-details`: on OVER_LIMIT, `grpc-status-details-bin`, the base64 of a
//!   `google.rpc.Status` (RESOURCE_EXHAUSTED) carrying `google.rpc.RetryInfo` with the same wait
//!   as `Retry-After` (without RetryInfo when retrying cannot help). Envoy's gRPC local reply for
//!   a rate-limited request keeps it, so gRPC clients get a machine-readable retry delay.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD_NO_PAD;
use base64::Engine;
use tonic_types::{ErrorDetails, StatusExt};

use crate::limiter::{BucketReport, BudgetReport, Code, Decision, Outcome};

/// Set on an answer the failure mode gave, with the mode.
pub const FAILURE_MODE_HEADER: &str = "X-Tollgate-Failure-Mode";
/// Set on a region's answer in which a global bucket was decided without a live share here, with
/// how (`deny`, `split`).
pub const GLOBAL_FALLBACK_HEADER: &str = "X-Tollgate-Global-Fallback";
/// Names the exhausted budget level of a priced request's denial.
pub const BUDGET_EXHAUSTED: &str = "X-Budget-Exhausted";
/// Names each budget level whose spend is at or above a soft limit, with that limit.
pub const BUDGET_WARNING: &str = "X-Budget-Warning";
/// The most requests in flight of the tightest concurrency limit on a request's path.
pub const CONCURRENCY_LIMIT: &str = "X-Concurrency-Limit";
/// Slots left under that limit after the request.
pub const CONCURRENCY_REMAINING: &str = "X-Concurrency-Remaining";

/// The headers for `decision`, as (name, value) pairs.
pub fn response_headers(decision: &Decision) -> Vec<(&'static str, String)> {
    let Some(domain) = &decision.domain else { return Vec::new() };
    let sets = domain.headers;
    let failed = decision.descriptors.iter().find_map(|d| match &d.outcome {
        Outcome::StoreFailed { mode, .. } | Outcome::BudgetFailed { mode } => Some(mode.to_string()),
        _ => None,
    });
    let buckets: Vec<&BucketReport> = decision
        .descriptors
        .iter()
        .filter_map(|d| match &d.outcome {
            Outcome::Bucket(b) => Some(b),
            _ => None,
        })
        .collect();
    // The buckets that made the request OVER_LIMIT (none when it is OK).
    let denying: Vec<&BucketReport> = match decision.overall {
        Code::OverLimit => buckets.iter().copied().filter(|b| b.denied() && !b.shadow).collect(),
        Code::Ok => Vec::new(),
    };
    let mut headers = Vec::new();
    if let Some(mode) = failed {
        headers.push((FAILURE_MODE_HEADER, mode));
    }
    if let Some(fallback) = buckets.iter().find_map(|b| b.fallback) {
        headers.push((GLOBAL_FALLBACK_HEADER, fallback.as_str().to_owned()));
    }

    budget_headers(decision, sets.retry_after, &mut headers);
    slot_headers(decision, &mut headers);

    let candidates = if denying.is_empty() { &buckets } else { &denying };
    let most_constrained = candidates.iter().min_by(|a, b| {
        (a.remaining(), a.limit.spec.capacity())
            .partial_cmp(&(b.remaining(), b.limit.spec.capacity()))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    if let (true, Some(b)) = (sets.x_ratelimit, most_constrained) {
        headers.push(("X-RateLimit-Limit", whole(b.limit.spec.capacity()).to_string()));
        headers.push(("X-RateLimit-Remaining", b.remaining().to_string()));
    }

    if !denying.is_empty() {
        // The longest wait in whole seconds, or none if a denying bucket can never admit.
        let waits: Option<Vec<u64>> = denying.iter().map(|b| b.verdict.retry_after_ms).collect();
        let retry_after = waits.and_then(|w| w.into_iter().max()).map(|ms| ms.div_ceil(1000).max(1));
        if let (true, Some(seconds)) = (sets.retry_after, retry_after) {
            headers.push(("Retry-After", seconds.to_string()));
        }
        if sets.grpc_status_details {
            headers.push(("grpc-status-details-bin", grpc_status_details(retry_after)));
        }
    }

    if sets.ietf && !buckets.is_empty() {
        let mut policies = Vec::new();
        let mut states = Vec::new();
        for (i, b) in buckets.iter().enumerate() {
            let id = policy_id(b, i);
            let spec = b.limit.spec;
            let window = spec.reset_ms(0.0).div_ceil(1000).max(1);
            policies.push(format!("{id};q={};w={window}", whole(spec.capacity())));
            states.push(format!("{id};r={};t={}", b.remaining(), b.verdict.reset_ms.div_ceil(1000)));
        }
        headers.push(("RateLimit-Policy", policies.join(", ")));
        headers.push(("RateLimit", states.join(", ")));
    }
    headers
}

/// The names of the three headers of `--limit-headers`: limit, remaining, reset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitHeaderNames {
    /// The limit, as requests per unit.
    pub limit: String,
    /// Whole tokens left.
    pub remaining: String,
    /// Whole seconds until the bucket is full.
    pub reset: String,
}

impl Default for LimitHeaderNames {
    // envoyproxy/ratelimit's defaults.
    fn default() -> Self {
        LimitHeaderNames {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

/// envoyproxy/ratelimit's limit headers for `decision` (none when no descriptor has a limit):
/// the last denying enforced limit, otherwise the first with the fewest whole tokens left.
pub fn limit_headers(names: &LimitHeaderNames, decision: &Decision) -> Vec<(String, String)> {
    let buckets = decision.descriptors.iter().filter_map(|d| match &d.outcome {
        Outcome::Bucket(b) => Some(b),
        _ => None,
    });
    let mut chosen: Option<&BucketReport> = None;
    for b in buckets {
        let enforced_denial = b.denied() && !b.shadow && !b.quota_mode;
        match chosen {
            _ if enforced_denial => chosen = Some(b),
            Some(c) if c.denied() && !c.shadow && !c.quota_mode => {}
            Some(c) if c.remaining() <= b.remaining() => {}
            _ => chosen = Some(b),
        }
    }
    let Some(b) = chosen else { return Vec::new() };
    vec![
        (names.limit.clone(), b.limit.current_limit.requests_per_unit.to_string()),
        (names.remaining.clone(), (if b.denied() { 0 } else { b.remaining() }).to_string()),
        (names.reset.clone(), b.verdict.reset_ms.div_ceil(1000).to_string()),
    ]
}

// Where a priced request's budgets stand, on OK and OVER_LIMIT alike: the exhausted level, the
// money left at the level with the least of it and when its period ends; `Retry-After` when a
// budget (its period end) or a token bucket (its refill) denied.
fn budget_headers(decision: &Decision, retry_after: bool, headers: &mut Vec<(&'static str, String)>) {
    let reports: Vec<&BudgetReport> = decision
        .descriptors
        .iter()
        .filter_map(|d| match &d.outcome {
            Outcome::Budget(r) => Some(r),
            _ => None,
        })
        .collect();
    if let Some(level) = reports.iter().find_map(|r| r.exhausted.as_ref()) {
        headers.push((BUDGET_EXHAUSTED, level.clone()));
    }
    let mut warnings: Vec<String> = Vec::new();
    for (level, fraction) in reports.iter().flat_map(|r| &r.warnings) {
        let text = format!("{level}={}", fraction.fraction_text());
        if !warnings.contains(&text) {
            warnings.push(text);
        }
    }
    if !warnings.is_empty() {
        headers.push((BUDGET_WARNING, warnings.join(", ")));
    }
    if let Some((report, (left, reset))) =
        reports.iter().filter_map(|r| Some((r, r.least?))).min_by_key(|(_, (left, _))| *left)
    {
        headers.push(("X-Budget-Remaining", format!("{left} {}", report.currency)));
        headers.push(("X-Budget-Reset", reset.to_string()));
    }
    if retry_after && decision.overall == Code::OverLimit {
        if let Some(seconds) = reports.iter().filter_map(|r| r.retry_after_s).max() {
            headers.push(("Retry-After", seconds.max(1).to_string()));
        }
    }
}

// Where a request's concurrency slots stand (whatever the domain's sets): the tightest set's
// limit and slots left, and on a take refused because a set is full, `Retry-After` when its
// earliest slot expires (a give-back may free one sooner: a retry then is not wasted, only
// possibly early, which is why it says at most that). A priced request's slots are taken with
// its hold, whose report carries them and its `Retry-After` (budget_headers).
fn slot_headers(decision: &Decision, headers: &mut Vec<(&'static str, String)>) {
    let sets = decision.descriptors.iter().flat_map(|d| match &d.outcome {
        Outcome::Slot(r) => &r.sets[..],
        Outcome::Budget(r) => &r.slots[..],
        _ => &[],
    });
    let Some(tightest) = sets.filter(|s| s.max > 0).min_by_key(|s| s.max.saturating_sub(s.open)) else {
        return;
    };
    headers.push((CONCURRENCY_LIMIT, tightest.max.to_string()));
    headers.push((CONCURRENCY_REMAINING, tightest.max.saturating_sub(tightest.open).to_string()));
    if decision.overall == Code::OverLimit {
        let refused = decision.descriptors.iter().filter_map(|d| match &d.outcome {
            Outcome::Slot(r) if !r.admitted() => Some(r),
            _ => None,
        });
        if let Some(ms) = refused.flat_map(|r| &r.sets).filter_map(|s| s.frees_in_ms).min() {
            headers.push(("Retry-After", ms.div_ceil(1000).max(1).to_string()));
        }
    }
}

// google.rpc.Status { RESOURCE_EXHAUSTED, RetryInfo }, encoded as gRPC binary headers are.
fn grpc_status_details(retry_after_seconds: Option<u64>) -> String {
    let (message, details) = match retry_after_seconds {
        Some(s) => (
            format!("rate limited; retry in {s} s"),
            ErrorDetails::with_retry_info(Some(Duration::from_secs(s))),
        ),
        None => ("rate limited; this request exceeds the limit's capacity".to_owned(), ErrorDetails::new()),
    };
    let status = tonic::Status::with_error_details(tonic::Code::ResourceExhausted, message, details);
    STANDARD_NO_PAD.encode(status.details())
}

fn whole(x: f64) -> u64 {
    x.max(0.0).floor() as u64
}

// A structured-field string naming the bucket's policy: the limit's name, else the rule path,
// else its position. Only printable ASCII is allowed in sf-strings; anything else becomes `?`.
fn policy_id(b: &BucketReport, index: usize) -> String {
    let name = match (&b.limit.name, &b.limit.rule) {
        (n, _) if !n.is_empty() => n.clone(),
        (_, Some(rule)) => rule.path.clone(),
        _ => format!("limit{index}"),
    };
    let mut out = String::with_capacity(name.len() + 2);
    out.push('"');
    for c in name.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out.push('"');
    out
}
