//! What a decision is counted as: each descriptor's verdict mapped to its metric labels (the
//! rule's path and the outcome), the subject it counts against (the tenant, or for rules outside
//! a tenant the value that chose the bucket), and whether it joins the top-denied ranking.
//! Telemetry only counts what it is given; the mapping lives here, beside the types it reads.

use super::{Code, Decision, DescriptorVerdict, Limiter, Outcome, Query, QueryDescriptor};
use crate::telemetry::failure_label;
use crate::telemetry::ratelimit_stats::{self, tally, RatelimitStats};

impl Limiter {
    /// Counts `decision` on `query`, per descriptor and in hits.
    pub(super) fn count_decision(&self, query: &Query<'_>, decision: &Decision) {
        let domain = decision.domain.as_ref().map_or(crate::telemetry::UNKNOWN_DOMAIN, |d| d.name.as_str());
        for (descriptor, verdict) in query.descriptors.iter().zip(&decision.descriptors) {
            let (rule, outcome) = match &verdict.outcome {
                Outcome::NoLimit | Outcome::Unlimited => (None, "ok"),
                Outcome::Bucket(b) => {
                    let label = match (b.denied(), b.shadow) {
                        (false, _) => "ok",
                        (true, true) => "shadow_over_limit",
                        (true, false) => "over_limit",
                    };
                    (b.limit.rule.as_ref(), label)
                }
                Outcome::StoreFailed { limit, mode } => (limit.rule.as_ref(), failure_label(*mode)),
                Outcome::Budget(_) if verdict.code == Code::OverLimit => (None, "over_limit"),
                Outcome::Budget(_) => (None, "ok"),
                Outcome::BudgetFailed { mode } | Outcome::SlotFailed { mode } => (None, failure_label(*mode)),
                Outcome::Slot(s) => {
                    let rule = s.bucket.as_ref().and_then(|b| b.limit.rule.as_ref());
                    (rule, if verdict.code == Code::OverLimit { "over_limit" } else { "ok" })
                }
            };
            let rule_path = rule.map_or("", |r| r.path.as_str());
            self.telemetry.count_decision(domain, rule_path, outcome, verdict.hits);
            if let Some(stats) = ratelimit_stats::stats() {
                count_ratelimit_stats(stats, domain, descriptor, verdict, decision.overall);
            }

            let Some(rule) = rule else { continue };
            let subject = match rule.tenant_depth {
                Some(depth) => descriptor.entries.get(depth),
                None => descriptor.entries.last(),
            }
            .map(|(_, value)| *value);
            let Some(subject) = subject else { continue };
            if rule.detailed_metric {
                self.telemetry.count_tenant_decision(domain, rule_path, subject, outcome, verdict.hits);
            }
            if outcome == "over_limit" && rule.tenant_depth.is_some() {
                self.telemetry.count_denied_tenant(subject, verdict.hits.max(1));
            }
        }
    }
}

// envoyproxy/ratelimit's per-rule counters for one descriptor, in its terms: the limit is the
// bucket's capacity in hits, the count is what the bucket lacked of full before this request
// (after it, for the hits it took).
fn count_ratelimit_stats(
    stats: &RatelimitStats,
    domain: &str,
    descriptor: &QueryDescriptor<'_>,
    verdict: &DescriptorVerdict,
    overall: Code,
) {
    match &verdict.outcome {
        Outcome::StoreFailed { .. } | Outcome::BudgetFailed { .. } => {
            stats.count("ratelimit.service.call.should_rate_limit.redis_error");
        }
        Outcome::Bucket(b) => {
            let Some(rule) = &b.limit.rule else { return };
            let cost = rule.cost.max(1) as f64;
            let capacity = b.limit.spec.capacity();
            let taken =
                if b.verdict.allowed && overall == Code::Ok { verdict.hits as f64 * cost } else { 0.0 };
            let lacked = (capacity - b.verdict.tokens - taken).max(0.0);
            let limit = (capacity / cost).floor() as u64;
            let used = (lacked / cost).round() as u64;
            let counts = tally(limit, used, verdict.hits, stats.near_limit_ratio(), b.shadow);
            let detailed = rule.detailed_metric.then(|| {
                descriptor.entries.iter().map(|(k, v)| format!("{k}_{v}")).collect::<Vec<_>>().join(".")
            });
            stats.count_rule(domain, &rule.path, detailed.as_deref(), counts);
        }
        _ => {}
    }
}
