//! RLQS answers as Envoy reads them: the bucket actions tollgate sends (a refilling local token
//! bucket, a blanket rule, an abandon action), each counted in `tollgate_rlqs_assignments_total`
//! by kind, and their bundling into as few responses as fit gRPC's message size.

use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaResponse};
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt32Value};
use prost::Message as _;

use super::assign::{LocalBucket, FILL_INTERVAL};
use crate::config::Blanket;
use crate::limiter::ASSIGNMENT_TTL;

/// Most bucket actions' encoded bytes in one response: under gRPC's default 4 MiB message limit,
/// with room for the message's own framing.
pub const MAX_RESPONSE_BYTES: usize = 3 << 20;
/// `actions` in as few responses as fit [`MAX_RESPONSE_BYTES`]; a bucket's actions (DENY_ALL and
/// its token bucket) stay in one response, as Envoy needs them together.
pub fn bundle(actions: Vec<BucketAction>) -> Vec<RateLimitQuotaResponse> {
    let mut responses: Vec<RateLimitQuotaResponse> = Vec::new();
    let mut size = 0;
    for action in actions {
        let bytes = action.encoded_len() + 8;
        let same_bucket = responses
            .last()
            .and_then(|r| r.bucket_action.last())
            .is_some_and(|a| a.bucket_id == action.bucket_id);
        if responses.is_empty() || (size + bytes > MAX_RESPONSE_BYTES && !same_bucket) {
            responses.push(RateLimitQuotaResponse::default());
            size = 0;
        }
        size += bytes;
        responses.last_mut().expect("a response").bucket_action.push(action);
    }
    responses
}

fn ttl(d: Duration) -> Option<ProtoDuration> {
    Some(ProtoDuration { seconds: d.as_secs() as i64, nanos: 0 })
}

fn assignment(id: &BucketId, strategy: Strategy, lives: Duration) -> BucketAction {
    BucketAction {
        bucket_id: Some(id.clone()),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: ttl(lives),
            rate_limit_strategy: Some(RateLimitStrategy { strategy: Some(strategy) }),
        })),
    }
}

/// Tells the Envoy to drop the bucket: its cached assignment and usage.
pub fn abandon(id: &BucketId) -> BucketAction {
    BucketAction { bucket_id: Some(id.clone()), bucket_action: Some(Action::AbandonAction(AbandonAction {})) }
}

/// A blanket rule for the bucket, standing `lives`.
pub fn blanket(id: &BucketId, rule: Blanket, lives: Duration) -> BucketAction {
    let kind = match rule {
        Blanket::AllowAll => "allow_all",
        Blanket::DenyAll => "deny_all",
    };
    metrics::counter!("tollgate_rlqs_assignments_total", "kind" => kind).increment(1);
    let rule = match rule {
        Blanket::AllowAll => BlanketRule::AllowAll,
        Blanket::DenyAll => BlanketRule::DenyAll,
    };
    assignment(id, Strategy::BlanketRule(rule as i32), lives)
}

/// A refilling local bucket of `size`, standing [`ASSIGNMENT_TTL`].
pub fn local_bucket(id: &BucketId, size: LocalBucket) -> BucketAction {
    metrics::counter!("tollgate_rlqs_assignments_total", "kind" => "token_bucket").increment(1);
    let bucket = TokenBucket {
        max_tokens: size.requests,
        tokens_per_fill: Some(UInt32Value { value: size.per_fill }),
        fill_interval: ttl(FILL_INTERVAL),
    };
    assignment(id, Strategy::TokenBucket(bucket), ASSIGNMENT_TTL)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_local_bucket_refills() {
        let id = BucketId { bucket: HashMap::from([("tenant".to_string(), "t".to_string())]) };
        let action = local_bucket(&id, LocalBucket { requests: 7, per_fill: 3600 });
        let Some(Action::QuotaAssignmentAction(a)) = &action.bucket_action else { panic!() };
        assert_eq!(a.assignment_time_to_live.unwrap().seconds, ASSIGNMENT_TTL.as_secs() as i64);
        let Some(Strategy::TokenBucket(b)) = a.rate_limit_strategy.unwrap().strategy else { panic!() };
        assert_eq!(
            (b.max_tokens, b.tokens_per_fill.unwrap().value, b.fill_interval.unwrap().seconds),
            (7, 3600, 3600)
        );
    }
}
