//! The decision: from a `RateLimitRequest` to a verdict per descriptor.
//!
//! This is where every request's answer is made, in five steps:
//!
//! 1. [`validate`] rejects malformed requests before anything is looked up.
//! 2. Each descriptor is matched against its domain ([`crate::matcher`]) and becomes a plan: no
//!    limit, unlimited, or a bucket operation with key, capacity, rate and need. A request-level
//!    `limit` override replaces the configured limit; `replaces` drops superseded rules.
//! 3. Tenant quotas are resolved through the [`QuotaSource`].
//! 4. Operations are grouped: all operations on one tenant's buckets form one all-or-nothing group
//!    (one Lua call on one Cluster slot); other buckets are grouped per key. The [`Store`]
//!    evaluates all groups, different slots concurrently.
//! 5. Store failures become the domain's failure mode; shadow rules never deny.
//!
//! The result is a [`Decision`]; turning it into protobuf and headers is the protocol edge's job.

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use futures::future::join_all;

use crate::bucket::{BucketOp, BucketSpec, Group, Verdict};
use crate::config::{Domain, FailureMode, Limit, Rule, RuleSet};
use crate::keys::{self, Class};
use crate::matcher::DescriptorEntry;
use crate::quota::{QuotaSource, DEFAULT_CLASS};
use crate::store::{Store, StoreError};
use crate::units;

/// Most descriptors one request may carry.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 64;
/// Longest descriptor entry key or value, in bytes.
pub const MAX_ENTRY_BYTES: usize = 1024;

/// Makes rate-limit decisions against the current rules and a store.
pub struct Limiter {
    rules: Arc<ArcSwap<RuleSet>>,
    store: Arc<dyn Store>,
    quotas: Arc<dyn QuotaSource>,
    global_shadow: bool,
}

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The request is malformed; the message says how.
    #[error("{0}")]
    InvalidArgument(String),
}

/// The answer to one request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// OVER_LIMIT if any descriptor is, else OK.
    pub overall: Code,
    /// One verdict per request descriptor, in request order.
    pub descriptors: Vec<DescriptorVerdict>,
    /// The domain that decided, if it is configured.
    pub domain: Option<Arc<Domain>>,
    /// Set when the store failed in a domain whose failure mode is `error`: the caller must
    /// answer UNAVAILABLE instead of this decision.
    pub unavailable: Option<StoreError>,
}

/// The answer for one descriptor.
#[derive(Debug, Clone)]
pub struct DescriptorVerdict {
    /// OK or OVER_LIMIT (shadow rules are always OK).
    pub code: Code,
    /// What decided it.
    pub outcome: Outcome,
    /// Hits the descriptor asked for (tokens = hits x the rule's cost).
    pub hits: u64,
}

/// What decided a descriptor's code.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// No limit applies: unknown domain, no matching rule, a whitelisted node, or replaced.
    NoLimit,
    /// An `unlimited` rule.
    Unlimited,
    /// A bucket was evaluated.
    Bucket(BucketReport),
    /// The store failed and the failure mode answered.
    StoreFailed {
        /// The limit that could not be checked.
        limit: LimitInfo,
        /// The mode applied.
        mode: FailureMode,
    },
}

/// The limit a descriptor was held to.
#[derive(Debug, Clone)]
pub struct LimitInfo {
    /// The rule, or `None` for a request-level limit override without a matching rule.
    pub rule: Option<Arc<Rule>>,
    /// A name for the limit in responses: the rule's name, else its class, else empty.
    pub name: String,
    /// The bucket's capacity and rate.
    pub spec: BucketSpec,
}

/// A bucket's state after a decision.
#[derive(Debug, Clone)]
pub struct BucketReport {
    /// The limit applied.
    pub limit: LimitInfo,
    /// The store's verdict for this descriptor's operation.
    pub verdict: Verdict,
    /// The rule is in shadow mode (or the service is): a denial was not enforced.
    pub shadow: bool,
}

impl BucketReport {
    /// Whole tokens left, as reported to clients.
    pub fn remaining(&self) -> u32 {
        self.verdict.tokens.max(0.0).floor().min(f64::from(u32::MAX)) as u32
    }

    /// Whether this bucket denied the request (shadow denials included).
    pub fn denied(&self) -> bool {
        !self.verdict.allowed
    }
}

// A descriptor's plan before the store is asked.
enum Plan<'r> {
    Free,
    Unlimited,
    Bucket(BucketPlan<'r>),
}

struct BucketPlan<'r> {
    rule: Option<&'r Arc<Rule>>,
    key: String,
    group: String,
    spec: Option<BucketSpec>,
    quota: Option<(&'r str, String)>,
    need: f64,
    shadow: bool,
}

impl Limiter {
    /// A limiter reading rules from `rules` (swappable at any time) and state from `store`.
    pub fn new(
        rules: Arc<ArcSwap<RuleSet>>,
        store: Arc<dyn Store>,
        quotas: Arc<dyn QuotaSource>,
        global_shadow: bool,
    ) -> Self {
        Limiter { rules, store, quotas, global_shadow }
    }

    /// The store this limiter uses.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Decides `request`.
    pub async fn decide(&self, request: &RateLimitRequest) -> Result<Decision, DecideError> {
        validate(request)?;
        let rules = self.rules.load_full();
        let Some(domain) = rules.domain(&request.domain) else {
            return Ok(Decision::all_ok(request));
        };

        let mut plans: Vec<Plan<'_>> =
            request.descriptors.iter().map(|d| self.plan(domain, d, request.hits_addend)).collect();
        drop_replaced(&mut plans);
        self.resolve_quotas(domain, &mut plans).await;

        // Group the bucket operations; remember where each descriptor's operation went.
        let mut batch: Vec<Group> = Vec::new();
        let mut group_of: HashMap<&str, usize> = HashMap::new();
        let mut slot: Vec<Option<(usize, usize)>> = Vec::with_capacity(plans.len());
        for plan in &plans {
            let Plan::Bucket(p) = plan else {
                slot.push(None);
                continue;
            };
            let g = *group_of.entry(p.group.as_str()).or_insert_with(|| {
                batch.push(Vec::new());
                batch.len() - 1
            });
            let spec = p.spec.expect("quotas resolved");
            batch[g].push(BucketOp { key: p.key.clone(), spec, need: p.need, shadow: p.shadow });
            slot.push(Some((g, batch[g].len() - 1)));
        }
        let results = if batch.is_empty() { Vec::new() } else { self.store.evaluate(&batch).await };
        let mut unavailable = None;
        for error in results.iter().filter_map(|r| r.as_ref().err()) {
            let kind = if matches!(error, StoreError::Timeout(_)) { "timeout" } else { "error" };
            let mode = domain.failure_mode;
            metrics::counter!("tollgate_store_errors_total", "domain" => domain.name.clone(), "kind" => kind, "failure_mode" => mode.to_string()).increment(1);
            tracing::warn!(domain = %domain.name, %error, failure_mode = %mode, "store failed; applying the failure mode");
            if mode == FailureMode::Error {
                unavailable = Some(error.clone());
            }
        }

        let mut descriptors = Vec::with_capacity(plans.len());
        for ((plan, slot), d) in plans.iter().zip(&slot).zip(&request.descriptors) {
            let hits = hits(d, request.hits_addend);
            let (code, outcome) = match (plan, slot) {
                (Plan::Bucket(p), Some((g, i))) => {
                    let limit = LimitInfo {
                        rule: p.rule.cloned(),
                        name: p.rule.map(|r| limit_name(r)).unwrap_or_default(),
                        spec: batch[*g][*i].spec,
                    };
                    match &results[*g] {
                        Ok(outcome) => {
                            let report =
                                BucketReport { limit, verdict: outcome.verdicts[*i], shadow: p.shadow };
                            let code =
                                if report.denied() && !report.shadow { Code::OverLimit } else { Code::Ok };
                            (code, Outcome::Bucket(report))
                        }
                        Err(_) => {
                            let mode = domain.failure_mode;
                            let code = if mode == FailureMode::Allow { Code::Ok } else { Code::OverLimit };
                            (code, Outcome::StoreFailed { limit, mode })
                        }
                    }
                }
                (Plan::Unlimited, _) => (Code::Ok, Outcome::Unlimited),
                _ => (Code::Ok, Outcome::NoLimit),
            };
            descriptors.push(DescriptorVerdict { code, outcome, hits });
        }
        let overall =
            if descriptors.iter().any(|d| d.code == Code::OverLimit) { Code::OverLimit } else { Code::Ok };
        Ok(Decision { overall, descriptors, domain: Some(domain.clone()), unavailable })
    }

    fn plan<'r>(&self, domain: &'r Domain, d: &'r RateLimitDescriptor, request_hits: u32) -> Plan<'r> {
        let rule = domain.lookup(&d.entries);
        // `validate` has checked the override's unit.
        let override_spec =
            d.limit.and_then(|o| Some(units::bucket(o.requests_per_unit, override_unit(o.unit)?)));
        let spec = match (override_spec, rule.map(|r| r.limit)) {
            (Some(spec), _) | (None, Some(Limit::Bucket(spec))) => Some(spec),
            (None, Some(Limit::TenantQuota)) => None,
            (None, Some(Limit::Unlimited)) => return Plan::Unlimited,
            (None, None) => return Plan::Free,
        };

        // The values that identify the bucket: the request's, or a shared wildcard's pattern.
        let values: Vec<(&str, &str)> = d
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let shared = rule.and_then(|r| r.shared_values.get(i)?.as_deref());
                (e.key(), shared.unwrap_or(e.value()))
            })
            .collect();
        let tenant_depth = match rule {
            Some(r) => r.tenant_depth,
            None => values.iter().position(|(k, _)| *k == domain.tenant_key),
        };
        let (key, group, quota) = match tenant_depth {
            Some(t) => {
                let tenant = values[t].1;
                let others: Vec<(&str, &str)> =
                    values.iter().enumerate().filter(|(i, _)| *i != t).map(|(_, e)| *e).collect();
                let class = match rule.and_then(|r| r.class.as_deref()) {
                    Some(name) => Class::Named(name),
                    None if others.is_empty() => Class::Named(DEFAULT_CLASS),
                    None => Class::Path(&others),
                };
                let quota_class = match class {
                    Class::Named(name) => name.to_owned(),
                    Class::Path(_) => class.render(),
                };
                // Braces keep tenant groups apart from key groups, which never contain one.
                (keys::tenant_key(tenant, &class), format!("{{{tenant}}}"), Some((tenant, quota_class)))
            }
            None => {
                let key = keys::descriptor_key(&domain.name, &values);
                (key.clone(), key, None)
            }
        };

        let need = hits(d, request_hits).saturating_mul(rule.map_or(1, |r| r.cost)) as f64;
        // envoyproxy/ratelimit never applies shadow mode to a request-level override.
        let shadow = self.global_shadow || (override_spec.is_none() && rule.is_some_and(|r| r.shadow_mode));
        Plan::Bucket(BucketPlan {
            rule,
            key,
            group,
            spec,
            quota,
            need: if d.is_negative_hits { -need } else { need },
            shadow,
        })
    }

    // One lookup per distinct tenant, all at once.
    async fn resolve_quotas(&self, domain: &Domain, plans: &mut [Plan<'_>]) {
        let mut tenants: Vec<&str> = Vec::new();
        for plan in plans.iter() {
            if let Plan::Bucket(BucketPlan { spec: None, quota: Some((tenant, _)), .. }) = plan {
                if !tenants.contains(tenant) {
                    tenants.push(tenant);
                }
            }
        }
        if tenants.is_empty() {
            return;
        }
        let records = join_all(tenants.iter().map(|t| self.quotas.tenant(domain, t))).await;
        for plan in plans.iter_mut() {
            if let Plan::Bucket(p @ BucketPlan { spec: None, .. }) = plan {
                // Validation puts every quota rule under a tenant node.
                let (tenant, class) = p.quota.as_ref().expect("a quota rule has a tenant");
                let record = &records[tenants.iter().position(|t| t == tenant).expect("collected above")];
                // Validation guarantees a default tier with a default bucket.
                p.spec = domain.quotas.resolve(record.as_deref(), class);
            }
        }
    }
}

impl Decision {
    fn all_ok(request: &RateLimitRequest) -> Decision {
        let descriptors = request
            .descriptors
            .iter()
            .map(|d| DescriptorVerdict {
                code: Code::Ok,
                outcome: Outcome::NoLimit,
                hits: hits(d, request.hits_addend),
            })
            .collect();
        Decision { overall: Code::Ok, descriptors, domain: None, unavailable: None }
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

/// The name a limit goes by in responses.
fn limit_name(rule: &Rule) -> String {
    rule.name.clone().or_else(|| rule.class.clone()).unwrap_or_default()
}

/// The unit of a request-level limit override; `None` if unknown.
fn override_unit(unit: i32) -> Option<Unit> {
    units::parse(RateLimitUnit::try_from(unit).ok()?.as_str_name())
}

// When a matched rule names others in `replaces`, those others apply no limit to this request.
fn drop_replaced(plans: &mut [Plan<'_>]) {
    let replaced: Vec<&str> = plans
        .iter()
        .filter_map(|p| match p {
            Plan::Bucket(b) => b.rule,
            _ => None,
        })
        .flat_map(|r| r.replaces.iter().map(String::as_str))
        .collect();
    if replaced.is_empty() {
        return;
    }
    let replaced: Vec<String> = replaced.into_iter().map(str::to_owned).collect();
    for plan in plans.iter_mut() {
        if let Plan::Bucket(b) = plan {
            if b.rule.and_then(|r| r.name.as_deref()).is_some_and(|n| replaced.iter().any(|x| x == n)) {
                *plan = Plan::Free;
            }
        }
    }
}

/// Rejects requests tollgate will not evaluate, with a message for the caller.
pub fn validate(request: &RateLimitRequest) -> Result<(), DecideError> {
    let invalid = |m: String| Err(DecideError::InvalidArgument(m));
    if request.domain.is_empty() {
        return invalid("domain must not be empty".into());
    }
    if request.descriptors.is_empty() {
        return invalid("at least one descriptor is required".into());
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return invalid(format!(
            "at most {MAX_DESCRIPTORS} descriptors per request, got {}",
            request.descriptors.len()
        ));
    }
    for (i, d) in request.descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            return invalid(format!("descriptor {i} has no entries"));
        }
        if d.entries.len() > MAX_ENTRIES {
            return invalid(format!(
                "descriptor {i} has {} entries, at most {MAX_ENTRIES} allowed",
                d.entries.len()
            ));
        }
        for (j, e) in d.entries.iter().enumerate() {
            if e.key.is_empty() {
                return invalid(format!("descriptor {i} entry {j} has an empty key"));
            }
            if e.key.len() > MAX_ENTRY_BYTES || e.value.len() > MAX_ENTRY_BYTES {
                return invalid(format!(
                    "descriptor {i} entry {j}: keys and values are limited to {MAX_ENTRY_BYTES} bytes"
                ));
            }
        }
        if let Some(o) = &d.limit {
            if override_unit(o.unit).is_none() {
                return invalid(format!("descriptor {i}: the limit override has no valid unit ({})", o.unit));
            }
        }
    }
    Ok(())
}
