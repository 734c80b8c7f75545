//! The decision: from a [`Query`] to a verdict per descriptor.
//!
//! This is where every request's answer is made, whatever protocol it came in by, in five steps
//! ([`Limiter::decide`]):
//!
//! 1. `Limiter::plan`: each descriptor is matched against its domain ([`crate::matcher`]) and
//!    becomes a plan: no limit, unlimited, or a bucket operation whose key comes from
//!    [`crate::identity`]. A request-level override replaces the matched rule entirely.
//! 2. `drop_replaced`: rules named in another matched rule's `replaces` apply no limit.
//! 3. `Limiter::resolve_quotas`: tenant quotas are resolved through the [`QuotaSource`].
//! 4. `Limiter::evaluate`: every bucket operation of the request forms one all-or-nothing group,
//!    which the [`Store`] evaluates (one script call per Cluster slot involved).
//! 5. `Limiter::verdicts`: store failures become the domain's failure mode, except that a denial
//!    the store did answer wins over the parts it could not; shadow rules never deny; quota-mode
//!    descriptors deny only together; the decision is counted.
//!
//! Protocol edges (the RLS gRPC service, `POST /json`) translate their requests into a [`Query`]
//! and the [`Decision`] back; nothing here knows a wire format. Clients that enforce limits
//! themselves (Envoy's Rate Limit Quota Service) lease parts of the same buckets
//! (`src/limiter/lease.rs`: [`Limiter::lease`], [`LocalLease`]).

mod budget;
mod decision;
mod explain;
mod global;
mod labels;
mod lease;
mod repair;
mod slots;

pub use self::budget::{
    BudgetExplained, BudgetGrant, BudgetRenewal, BudgetReport, GlobalBudgets, LeaseStanding, LevelStanding,
    Standing, StandingError, BUDGET_LEASE_TTL, MAX_BUDGET_LEASES, REFUSED_REQUEST, REFUSED_REQUEST_ID,
    SERVED_MODEL_KEY, USAGE_KEY,
};
pub use self::decision::{
    BucketReport, Code, DecideError, Decision, DescriptorVerdict, GlobalFallback, LimitInfo, Outcome, Query,
    QueryDescriptor, SlotLimit, SlotReport,
};
pub use self::explain::{Effect, Explained, Explanation, SpecOrigin};
pub use self::global::{GlobalShares, Granted, Renewal, RENEW_EVERY};
pub use self::lease::{
    LeasedBucket, LocalLease, RlqsBucket, ASSIGNMENT_TTL, LEASE_TTL, RENEW_AFTER, YOUNG_OF_UNLEASED,
};

use std::sync::Arc;

use arc_swap::ArcSwap;
use futures::future::join_all;

use crate::bucket::{BucketOp, BucketSpec, Charge, Group, GroupOutcome, Role};
use crate::clock::{Clock, SystemClock};
use crate::config::{Domain, FailureMode, Limit, Rule, RuleSet};
use crate::identity::{self, BucketKey};
use crate::quota::QuotaSource;
use crate::store::{LateReply, Store, StoreError};
use crate::telemetry::logs::{self, ErrorChain};
use crate::telemetry::{traces, Telemetry};
use crate::units::RatePerUnit;
use tracing::Instrument as _;

/// Modes that apply to every rule of every domain, as envoyproxy/ratelimit's `SHADOW_MODE` and
/// `QUOTA_MODE` do (overrides included); a rule's own `shadow_mode`/`quota_mode` adds to them.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServiceModes {
    /// Every limit is evaluated and counted but never denies.
    pub shadow: bool,
    /// Every limit is a quota-mode limit: the request is denied only when all of them are short.
    pub quota: bool,
}

impl ServiceModes {
    // Shadow wins over quota mode: a shadow limit never denies, whatever else it is.
    fn role(&self, rule_shadow: bool, rule_quota: bool) -> Role {
        if self.shadow || rule_shadow {
            Role::Shadow
        } else if self.quota || rule_quota {
            Role::QuotaMode
        } else {
            Role::Enforced
        }
    }
}

/// Makes rate-limit decisions against the current rules and a store.
pub struct Limiter {
    rules: Arc<ArcSwap<RuleSet>>,
    store: Arc<dyn Store>,
    quotas: Arc<dyn QuotaSource>,
    telemetry: Arc<Telemetry>,
    modes: ServiceModes,
    // Where budgets' calendar periods are computed from (the store picks by its own clock), and
    // global shares' times.
    clock: Arc<dyn Clock>,
    // This replica's shares of global buckets, in a region (`--global-url`).
    shares: Option<Arc<GlobalShares>>,
    // This replica's money leases of global budgets, in a region.
    budgets: Option<Arc<GlobalBudgets>>,
}

// A descriptor's plan before the store is asked.
enum Plan<'a> {
    Free,
    Unlimited(&'a Arc<Rule>),
    Bucket(BucketPlan<'a>),
}

struct BucketPlan<'a> {
    rule: Option<&'a Arc<Rule>>,
    bucket: BucketKey<'a>,
    // `None` until the tenant's quota is resolved.
    spec: Option<BucketSpec>,
    current_limit: Option<RatePerUnit>,
    need: f64,
    role: Role,
}

impl Limiter {
    /// A limiter reading rules from `rules` (swappable at any time) and state from `store`,
    /// counting its decisions into `telemetry`.
    pub fn new(
        rules: Arc<ArcSwap<RuleSet>>,
        store: Arc<dyn Store>,
        quotas: Arc<dyn QuotaSource>,
        telemetry: Arc<Telemetry>,
        modes: ServiceModes,
    ) -> Self {
        Limiter {
            rules,
            store,
            quotas,
            telemetry,
            modes,
            clock: Arc::new(SystemClock),
            shares: None,
            budgets: None,
        }
    }

    /// The same limiter on `clock` (the system's by default), for deterministic tests.
    pub fn with_clock(self, clock: Arc<dyn Clock>) -> Self {
        Limiter { clock, ..self }
    }

    /// The same limiter deciding the rules marked `global: true` on `shares` (a region's).
    pub fn with_global_shares(self, shares: Arc<GlobalShares>) -> Self {
        Limiter { shares: Some(shares), ..self }
    }

    /// In a region, this replica's cut-off from the global tier: how long its rounds have failed
    /// (`None`: not a region, or its last round reached the global tier).
    pub fn global_cut_off(&self) -> Option<std::time::Duration> {
        let shares = self.shares.as_ref()?;
        shares.cut_off_for_ms(self.clock.now_ms()).map(std::time::Duration::from_millis)
    }

    /// The store this limiter uses.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The rules in force.
    pub fn rules(&self) -> Arc<RuleSet> {
        self.rules.load_full()
    }

    /// Decides `query`, debiting the buckets of an admitted request.
    pub async fn decide(&self, query: &Query<'_>) -> Result<Decision, DecideError> {
        let rules = self.rules.load_full();
        let Some(domain) = rules.domain(query.domain) else {
            let decision = Decision::all_ok(query);
            self.count_decision(query, &decision);
            trace_decision("(unknown)", &[], &decision);
            return Ok(decision);
        };
        if let Some(priced) = &domain.priced {
            return self.decide_priced(domain, priced, query).await;
        }
        // Most requests name no request id: they pay for no slot plans.
        if query.descriptors.iter().any(|d| slots::may_name_slots(domain, &d.entries)) {
            let slot_plans: Vec<Option<slots::SlotPlan<'_>>> =
                query.descriptors.iter().map(|d| slots::plan(domain, &d.entries)).collect();
            if slot_plans.iter().any(Option::is_some) {
                return self.decide_with_slots(domain, query, slot_plans).await;
            }
        }
        let mut plans: Vec<Plan<'_>> = query.descriptors.iter().map(|d| self.plan(domain, d)).collect();
        drop_replaced(&mut plans);
        self.resolve_quotas(domain, &mut plans).await;
        let (group, op_of) = group(&plans);
        let (outcome, fallbacks) = match &self.shares {
            Some(shares) => self.evaluate_with_shares(domain, shares, query, &plans, group, &op_of).await,
            None => (self.evaluate(domain, group).await, Vec::new()),
        };
        let mut decision = self.verdicts(domain, query, &plans, &op_of, &outcome);
        global::mark_fallbacks(&mut decision, &op_of, &fallbacks);
        self.count_decision(query, &decision);
        trace_decision(&domain.name, &plans, &decision);
        match outcome {
            Err(source) if domain.failure_mode == FailureMode::Error => {
                Err(DecideError::Unavailable { domain: domain.name.clone(), source })
            }
            _ => Ok(decision),
        }
    }

    fn plan<'a>(&self, domain: &'a Domain, d: &'a QueryDescriptor<'a>) -> Plan<'a> {
        // envoyproxy/ratelimit: an override ignores the rule entirely (no name, no replaces, no
        // shadow, no cost, no quota), and applies even where no rule matches.
        if let Some(limit) = d.limit {
            return Plan::Bucket(BucketPlan {
                rule: None,
                bucket: identity::override_bucket(domain, limit, &d.entries),
                spec: Some(limit.bucket()),
                current_limit: Some(limit),
                need: signed(d, d.hits),
                role: self.modes.role(false, false),
            });
        }
        let Some(rule) = domain.lookup(&d.entries) else { return Plan::Free };
        let spec = match rule.limit {
            Limit::Bucket(spec) => Some(spec),
            Limit::TenantQuota => None,
            Limit::Unlimited => return Plan::Unlimited(rule),
        };
        let role = self.modes.role(rule.shadow_mode, rule.quota_mode);
        Plan::Bucket(BucketPlan {
            rule: Some(rule),
            bucket: identity::rule_bucket(domain, rule, &d.entries),
            spec,
            current_limit: rule.rate,
            need: signed(d, d.hits.saturating_mul(rule.cost)),
            role,
        })
    }

    // One lookup per distinct tenant, all at once.
    async fn resolve_quotas(&self, domain: &Domain, plans: &mut [Plan<'_>]) {
        let mut tenants: Vec<&str> = Vec::new();
        for plan in plans.iter() {
            if let Plan::Bucket(BucketPlan {
                spec: None, bucket: BucketKey { tenant: Some(t), .. }, ..
            }) = plan
            {
                if !tenants.contains(t) {
                    tenants.push(t);
                }
            }
        }
        if tenants.is_empty() {
            return;
        }
        let records = join_all(tenants.iter().map(|t| self.quotas.tenant(&domain.tenants, t))).await;
        for plan in plans.iter_mut() {
            if let Plan::Bucket(p @ BucketPlan { spec: None, .. }) = plan {
                // Validation puts every quota rule under a tenant node.
                let tenant = p.bucket.tenant.expect("a quota rule has a tenant");
                let rule = p.rule.expect("only rules have quotas");
                let record = &records[tenants.iter().position(|t| *t == tenant).expect("collected above")];
                // Validation guarantees a default tier with a default bucket.
                p.spec = domain.quotas.resolve(record.as_deref(), identity::quota_class(rule));
            }
        }
    }

    // The request's one group, evaluated by the store; a failure is counted and logged here.
    async fn evaluate(&self, domain: &Domain, group: Group) -> Result<Option<GroupOutcome>, StoreError> {
        if group.is_empty() {
            return Ok(None);
        }
        // A request answered by a denial or an error must take nothing, even if the store's reply
        // comes after the deadline; one admitted by `allow` keeps what it took.
        let late =
            if domain.failure_mode == FailureMode::Allow { LateReply::Keep } else { LateReply::GiveBack };
        let result =
            self.store_call(std::slice::from_ref(&group), late).await.pop().expect("one result per group");
        match result {
            Ok(outcome) => {
                if !outcome.unanswered.is_empty() {
                    count_store_error(domain, "error");
                    if let Some(held_back) = logs::throttled("store_part_failed") {
                        tracing::warn!(domain = %domain.name, held_back, "a Redis Cluster shard failed for part of a request that another part denied; answering the denial");
                    }
                }
                let forgiven: f64 = outcome.verdicts.iter().map(|v| v.forgiven).sum();
                if forgiven > 0.0 {
                    metrics::counter!("tollgate_debt_forgiven_tokens_total", "domain" => domain.name.clone())
                        .increment(forgiven.ceil() as u64);
                }
                Ok(Some(outcome))
            }
            Err(error) => {
                count_store_error(
                    domain,
                    if matches!(error, StoreError::Timeout(_)) { "timeout" } else { "error" },
                );
                if let Some(held_back) = logs::throttled("store_failed") {
                    let mode = domain.failure_mode;
                    tracing::warn!(domain = %domain.name, error = %ErrorChain(&error), failure_mode = %mode, held_back, "store failed; applying the failure mode");
                }
                Err(error)
            }
        }
    }

    // One store call, traced as a `store.evaluate` span (see `telemetry::traces`).
    async fn store_call(&self, batch: &[Group], late: LateReply) -> Vec<Result<GroupOutcome, StoreError>> {
        let span = tracing::trace_span!(
            target: traces::TARGET,
            "store.evaluate",
            buckets = batch.iter().map(Vec::len).sum::<usize>(),
            outcome = tracing::field::Empty,
        );
        let results = self.store.evaluate(batch, late).instrument(span.clone()).await;
        let outcome = match results.iter().find(|r| r.is_err()) {
            None => "ok",
            Some(Err(StoreError::Timeout(_))) => "timeout",
            Some(_) => "error",
        };
        span.record("outcome", outcome);
        results
    }

    fn verdicts(
        &self,
        domain: &Arc<Domain>,
        query: &Query<'_>,
        plans: &[Plan<'_>],
        op_of: &[Option<usize>],
        outcome: &Result<Option<GroupOutcome>, StoreError>,
    ) -> Decision {
        let mut descriptors = Vec::with_capacity(plans.len());
        for ((plan, op), d) in plans.iter().zip(op_of).zip(&query.descriptors) {
            let (code, outcome) = match (plan, op, outcome) {
                (Plan::Bucket(p), Some(i), Ok(Some(group))) if !group.unanswered.contains(i) => {
                    let report = BucketReport {
                        limit: limit_info(p),
                        verdict: group.verdicts[*i],
                        shadow: p.role == Role::Shadow,
                        quota_mode: p.role == Role::QuotaMode,
                        fallback: None,
                    };
                    let code = if report.denied() && !report.shadow { Code::OverLimit } else { Code::Ok };
                    (code, Outcome::Bucket(report))
                }
                (Plan::Bucket(p), _, _) => {
                    let mode = domain.failure_mode;
                    let code = if mode == FailureMode::Allow { Code::Ok } else { Code::OverLimit };
                    (code, Outcome::StoreFailed { limit: limit_info(p), mode })
                }
                (Plan::Unlimited(_), _, _) => (Code::Ok, Outcome::Unlimited),
                (Plan::Free, _, _) => (Code::Ok, Outcome::NoLimit),
            };
            descriptors.push(DescriptorVerdict { code, outcome, hits: d.hits });
        }
        Decision { overall: overall(&descriptors), descriptors, domain: Some(domain.clone()) }
    }
}

// Counts a store failure (`kind`: error or timeout) in `domain`, by the failure mode it applies.
fn count_store_error(domain: &Domain, kind: &'static str) {
    metrics::counter!("tollgate_store_errors_total", "domain" => domain.name.clone(), "kind" => kind, "failure_mode" => domain.failure_mode.to_string())
        .increment(1);
}

// Records the decision on the current trace span (the edge's), if one is being traced: the
// domain, the rules that applied (config paths: bounded), the tenant (hashed) and the outcome.
fn trace_decision(domain: &str, plans: &[Plan<'_>], decision: &Decision) {
    // With traces off this is the cached interest of one callsite, not a look at the span stack.
    if !tracing::enabled!(target: traces::TARGET, tracing::Level::TRACE) {
        return;
    }
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    let rules: Vec<&str> = plans.iter().filter_map(Plan::rule).map(|r| r.path.as_str()).collect();
    let tenant = plans.iter().find_map(|p| match p {
        Plan::Bucket(BucketPlan { bucket: BucketKey { tenant: Some(t), .. }, .. }) => Some(*t),
        _ => None,
    });
    span.record("domain", domain);
    span.record("rules", rules.join(",").as_str());
    if let Some(tenant) = tenant {
        span.record("tenant", traces::tenant_hash(tenant).as_str());
    }
    span.record(
        "outcome",
        match decision.overall {
            Code::Ok => "ok",
            Code::OverLimit => "over_limit",
        },
    );
}

// envoyproxy/ratelimit's rule: OVER_LIMIT iff a descriptor not in quota mode is over the limit,
// or every quota-mode descriptor is.
fn overall(descriptors: &[DescriptorVerdict]) -> Code {
    let in_quota_mode = |d: &DescriptorVerdict| matches!(&d.outcome, Outcome::Bucket(b) if b.quota_mode);
    let over = |d: &DescriptorVerdict| d.code == Code::OverLimit;
    let quota_mode: Vec<&DescriptorVerdict> = descriptors.iter().filter(|d| in_quota_mode(d)).collect();
    let enforced_over = descriptors.iter().any(|d| over(d) && !in_quota_mode(d));
    if enforced_over || (!quota_mode.is_empty() && quota_mode.iter().all(|d| over(d))) {
        Code::OverLimit
    } else {
        Code::Ok
    }
}

// Every bucket operation of the request in one group, and where each descriptor's went.
fn group(plans: &[Plan<'_>]) -> (Group, Vec<Option<usize>>) {
    let mut group = Group::new();
    let op_of = plans
        .iter()
        .map(|plan| {
            let Plan::Bucket(p) = plan else { return None };
            let spec = p.spec.expect("tenant quotas resolved");
            // The debt floor of `charge: always` follows the bucket's (resolved) capacity.
            let charge = p.rule.map_or(Charge::Admitted, |r| r.charge.for_bucket(&spec));
            group.push(BucketOp {
                key: p.bucket.key.clone(),
                spec,
                need: p.need,
                unseen: 0.0,
                role: p.role,
                charge,
            });
            Some(group.len() - 1)
        })
        .collect();
    (group, op_of)
}

fn limit_info(p: &BucketPlan<'_>) -> LimitInfo {
    let spec = p.spec.expect("tenant quotas resolved");
    LimitInfo {
        rule: p.rule.cloned(),
        name: p
            .rule
            .map(|r| r.name.clone().or_else(|| r.class.clone()).unwrap_or_default())
            .unwrap_or_default(),
        spec,
        current_limit: p.current_limit.unwrap_or_else(|| RatePerUnit::of_rate(spec.refill_per_second())),
        key: p.bucket.key.clone(),
    }
}

// Tokens to take, negative for a credit.
fn signed(d: &QueryDescriptor<'_>, tokens: u64) -> f64 {
    if d.credit {
        -(tokens as f64)
    } else {
        tokens as f64
    }
}

impl Decision {
    fn all_ok(query: &Query<'_>) -> Decision {
        let descriptors = query
            .descriptors
            .iter()
            .map(|d| DescriptorVerdict { code: Code::Ok, outcome: Outcome::NoLimit, hits: d.hits })
            .collect();
        Decision { overall: Code::Ok, descriptors, domain: None }
    }
}

/// When a matched rule names others in `replaces`, those others apply no limit to this request.
/// As in envoyproxy/ratelimit, an unlimited rule replaces too but is never replaced, and
/// overrides have no rule: they neither replace nor are replaced. Returns each replaced plan's
/// index and the rule that replaced it.
fn drop_replaced<'a>(plans: &mut [Plan<'a>]) -> Vec<(usize, &'a Arc<Rule>)> {
    let replacers: Vec<&'a Arc<Rule>> =
        plans.iter().filter_map(Plan::rule).filter(|r| !r.replaces.is_empty()).collect();
    let mut replaced = Vec::new();
    if replacers.is_empty() {
        return replaced;
    }
    for (i, plan) in plans.iter_mut().enumerate() {
        if let Plan::Bucket(BucketPlan { rule: Some(rule), .. }) = plan {
            let by = rule
                .name
                .as_deref()
                .and_then(|n| replacers.iter().find(|r| r.replaces.iter().any(|x| x == n)));
            if let Some(by) = by {
                replaced.push((i, *by));
                *plan = Plan::Free;
            }
        }
    }
    replaced
}

impl<'a> Plan<'a> {
    fn rule(&self) -> Option<&'a Arc<Rule>> {
        match self {
            Plan::Bucket(b) => b.rule,
            Plan::Unlimited(rule) => Some(rule),
            Plan::Free => None,
        }
    }
}
