//! LLM spend budgets in the decision ([`crate::budget`]): in a priced domain, a descriptor down to
//! a request id asks for a hold, and the descriptors of one request with a `usage` entry last
//! settle it; each request is one budget op, whose answer becomes the verdict of its descriptors.
//!
//! A priced domain decides on the request, not on what its client says about it. What a
//! descriptor of a priced domain gets:
//! * its entries do not walk the tree down to the request id node, one for one (a level missing,
//!   an entry extra, a body size that is not a number): OVER_LIMIT, exhausted `request`; so does
//!   a malformed call ([`Limiter::refuse_malformed`]);
//! * an empty request id, or one whose record is another request's: OVER_LIMIT, exhausted
//!   `request_id`, nothing held or charged anywhere;
//! * its model is not in the price table: OVER_LIMIT, exhausted `model`, never priced at zero;
//! * a hold above a level's whole amount: OVER_LIMIT, exhausted `request`, no `Retry-After`
//!   (waiting cannot help);
//! * a usage kind tollgate does not know: no limit, counted (Envoy ignores the answer to a
//!   stream-end call anyway); a count above the model's maximum for its kind is charged at that
//!   maximum, logged and counted;
//! * otherwise the store's verdict, or the domain's failure mode (`deny` unless the file says
//!   otherwise) when the store fails.
//!
//! A stream-end descriptor may carry a `served_model` entry before its `usage` entry: the model
//! the response names. It is priced at that model when the table has it (by name or alias),
//! else at the held model; a hold whose model has left the table settles at the row its record
//! keeps.

mod count;
mod global;
mod money_lease;
mod parse;
mod recover;
mod standing;

pub use self::money_lease::{BudgetGrant, BudgetRenewal, GlobalBudgets, BUDGET_LEASE_TTL, MAX_BUDGET_LEASES};
pub use self::standing::{LeaseStanding, LevelStanding, Standing, StandingError};

use std::sync::Arc;

use futures::future::join_all;

use self::count::{budget_store_failed, count_refusal};
use self::money_lease::LeasedLevel;
use self::parse::{capped_usage, parse, settlement_price, Parsed, Refusal};
use self::recover::call;

use super::decision::SlotLimit;
use super::slots::node_path;
use super::{Code, DecideError, Decision, DescriptorVerdict, Effect, Limiter, Outcome, Query};
use crate::budget::{
    BucketLevel, BudgetAction, BudgetOp, BudgetOutcome, BudgetOverride, BudgetSpec, Calendar, HoldVerdict,
    Kind, LevelOp, LevelReading, Money, PriceRow, RECORD_GRACE_MS,
};
use crate::config::{Domain, FailureMode, Limit, Priced};
use crate::identity;
use crate::slot::SlotSet;
use crate::store::StoreError;
use crate::telemetry::logs;
use crate::telemetry::traces;

/// The entry key that marks a settlement descriptor; its value names the usage kind.
pub const USAGE_KEY: &str = "usage";
/// The entry key, right before `usage`, naming the model the response says served it.
pub const SERVED_MODEL_KEY: &str = "served_model";
/// The exhausted "level" of a request tollgate refuses whatever the budgets say.
pub const REFUSED_REQUEST: &str = "request";
/// The exhausted "level" of a request id that is empty or another request's.
pub const REFUSED_REQUEST_ID: &str = "request_id";

/// What a priced request's descriptor found.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetReport {
    /// The descriptor key of the exhausted budget nearest the top (`model` for a model the price
    /// table lacks, `request` or `request_id` for a refused request); `None` when admitted, or
    /// when a token bucket denied.
    pub exhausted: Option<String>,
    /// The money left at the level with the least of it, after this call, and the whole
    /// seconds until its period ends.
    pub least: Option<(Money, u64)>,
    /// The price table's currency.
    pub currency: String,
    /// When a denial could end, in whole seconds: the exhausted budget's period end, or the
    /// short bucket's refill.
    pub retry_after_s: Option<u64>,
    /// Per level whose spend is at or above a soft limit: its descriptor key and the highest
    /// such `alert_at` fraction.
    pub warnings: Vec<(String, Money)>,
    /// The concurrency limits on the request's path, after its hold (a slot taken with it) or
    /// settlement (given back).
    pub slots: Vec<SlotLimit>,
}

impl BudgetReport {
    // A request refused before the store: `exhausted` names why.
    fn refused(exhausted: &str, currency: &str) -> BudgetReport {
        BudgetReport {
            exhausted: Some(exhausted.to_owned()),
            least: None,
            currency: currency.to_owned(),
            retry_after_s: None,
            warnings: Vec::new(),
            slots: Vec::new(),
        }
    }
}

/// What a priced domain's descriptor would send, for `tollgate explain`.
#[derive(Debug, Clone)]
pub struct BudgetExplained {
    /// The op: a hold of the descriptor's hits as output tokens.
    pub op: BudgetOp,
    /// Each budget level's descriptor key, top first (as `op.levels`).
    pub level_names: Vec<String>,
    /// Each concurrency limit's node path, as `op.sets`.
    pub set_nodes: Vec<String>,
    /// Per budget level, whether it is global (`global: true`).
    pub global: Vec<bool>,
    /// The model, and the price table's currency.
    pub model: String,
    /// The currency.
    pub currency: String,
}

// A request's op, before the store: what it is for and which descriptors it answers.
struct Request {
    op: BudgetOp,
    // The descriptor key of each budget level, top first (for `X-Budget-Exhausted`).
    level_names: Vec<String>,
    // Each level's `alert_at` fractions (for `X-Budget-Warning` and the alert log).
    alert_at: Vec<Vec<Money>>,
    // Each level's value, as the top spenders metric shows it: the tenant's own, a hash below it
    // (a level such as an API key may be a credential).
    level_subjects: Vec<String>,
    // Each concurrency limit's node path (the rule label of its metrics), as `op.sets`.
    set_nodes: Vec<String>,
    // The request's tenant (for logs).
    tenant: Option<String>,
    // Per level, whether its budget is global; those decided on this replica's money leases (in
    // a region).
    global: Vec<bool>,
    leased: Vec<LeasedLevel>,
    descriptors: Vec<usize>,
}

impl Limiter {
    /// The answer to a call to priced domain `domain` that could not be read (too many or too
    /// long entries): every descriptor OVER_LIMIT with exhausted `request`, so that nothing a
    /// client sends turns into an admit. `None` when the domain is not priced.
    pub fn refuse_malformed(&self, domain: &str, descriptors: usize, why: &str) -> Option<Decision> {
        let rules = self.rules.load_full();
        let domain = rules.domain(domain)?;
        let priced = domain.priced.as_ref()?;
        count_refusal(domain, Refusal::Malformed.reason());
        if let Some(held_back) = logs::throttled("budget_malformed") {
            tracing::warn!(domain = %domain.name, why, held_back, "refused a malformed call to a priced domain");
        }
        let report = BudgetReport::refused(REFUSED_REQUEST, &priced.prices.currency);
        let verdict = DescriptorVerdict { code: Code::OverLimit, outcome: Outcome::Budget(report), hits: 0 };
        Some(Decision {
            overall: Code::OverLimit,
            descriptors: vec![verdict; descriptors.max(1)],
            domain: Some(domain.clone()),
        })
    }

    /// Decides a query of the priced `domain`.
    pub(super) async fn decide_priced(
        &self,
        domain: &Arc<Domain>,
        priced: &Priced,
        query: &Query<'_>,
    ) -> Result<Decision, DecideError> {
        let now = self.clock.now_ms();
        let currency = priced.prices.currency.clone();
        let mut verdicts: Vec<Option<(Code, Outcome)>> = vec![None; query.descriptors.len()];
        let parsed: Vec<Result<Parsed<'_>, Refusal>> =
            query.descriptors.iter().map(|d| parse(domain, priced, &d.entries)).collect();
        let overrides = self
            .budget_overrides(domain, parsed.iter().filter_map(|p| Some(&p.as_ref().ok()?.path[..])))
            .await;
        let mut requests: Vec<Request> = Vec::new();
        for (i, (d, descriptor)) in query.descriptors.iter().zip(&parsed).enumerate() {
            let refused = |refusal: Refusal| {
                count_refusal(domain, refusal.reason());
                let report = BudgetReport::refused(refusal.exhausted(priced), &currency);
                Some((Code::OverLimit, Outcome::Budget(report)))
            };
            let this = match descriptor {
                Ok(p) => p,
                Err(refusal) => {
                    verdicts[i] = refused(*refusal);
                    continue;
                }
            };
            let kind = match this.usage.map(Kind::parse) {
                Some(None) => {
                    count_refusal(domain, "unknown_usage_kind");
                    verdicts[i] = Some((Code::Ok, Outcome::NoLimit));
                    continue;
                }
                other => other.flatten(),
            };
            if let Some(kind) = kind {
                // The kinds of one request's settlement arrive together: one op.
                if let Some(r) = requests.iter_mut().find(|r| {
                    let first = parsed[r.descriptors[0]].as_ref();
                    matches!(r.op.action, BudgetAction::Settle { .. })
                        && first.is_ok_and(|f| (&f.path, f.served) == (&this.path, this.served))
                }) {
                    let (row, most) = settlement_price(priced, this);
                    if let BudgetAction::Settle { usage } = &mut r.op.action {
                        usage.push(capped_usage(domain, &row.unwrap_or(r.op.row), most, kind, d.hits));
                    }
                    r.descriptors.push(i);
                    continue;
                }
            }
            match self.request(domain, priced, this, now, d.hits, kind, &overrides) {
                Err(refusal) => verdicts[i] = refused(refusal),
                Ok(mut request) => {
                    request.descriptors.push(i);
                    requests.push(request);
                }
            }
        }
        let mut failure = None;
        for request in &mut requests {
            let _flight = match request.op.action {
                BudgetAction::Hold { amount, .. } => {
                    self.lease_amounts(&mut request.op, &request.leased, amount).await
                }
                _ => None,
            };
            let request = &*request;
            let (code, outcome) = match call(self.store.as_ref(), &request.op).await {
                Ok(outcome) => {
                    self.count_budget(domain, priced, request, &outcome);
                    let (code, report) = self.report(request, &outcome, &currency);
                    (code, Outcome::Budget(report))
                }
                Err(error) => {
                    budget_store_failed(domain, &error);
                    self.recover(domain, &request.op);
                    let mode = domain.failure_mode;
                    let code = if mode == FailureMode::Allow { Code::Ok } else { Code::OverLimit };
                    failure.get_or_insert(error);
                    (code, Outcome::BudgetFailed { mode })
                }
            };
            for &i in &request.descriptors {
                verdicts[i] = Some((code, outcome.clone()));
            }
        }
        let descriptors: Vec<DescriptorVerdict> = verdicts
            .into_iter()
            .zip(&query.descriptors)
            .map(|(v, d)| {
                let (code, outcome) = v.expect("every descriptor answered");
                DescriptorVerdict { code, outcome, hits: d.hits }
            })
            .collect();
        let overall =
            if descriptors.iter().any(|d| d.code == Code::OverLimit) { Code::OverLimit } else { Code::Ok };
        let decision = Decision { overall, descriptors, domain: Some(domain.clone()) };
        self.count_decision(query, &decision);
        match failure {
            Some(source) if domain.failure_mode == FailureMode::Error => {
                Err(DecideError::Unavailable { domain: domain.name.clone(), source })
            }
            _ => Ok(decision),
        }
    }

    /// What `entries` (a request-time or stream-end descriptor of priced `domain`) would be held
    /// to, with `hits` output tokens to hold.
    pub(super) async fn explain_priced(
        &self,
        domain: &Domain,
        priced: &Priced,
        entries: &[(&str, &str)],
        hits: u64,
    ) -> Effect {
        let parsed = match parse(domain, priced, entries) {
            Ok(p) => Parsed { usage: None, served: None, ..p },
            Err(_) => return Effect::NoRule,
        };
        let overrides = self.budget_overrides(domain, std::iter::once(&parsed.path[..])).await;
        match self.request(domain, priced, &parsed, self.clock.now_ms(), hits, None, &overrides) {
            Err(Refusal::UnknownModel) => Effect::UnknownModel,
            Err(_) => Effect::NoRule,
            Ok(request) => {
                let model =
                    parsed.path.iter().find(|(k, _)| *k == priced.model_key).map(|(_, v)| (*v).to_owned());
                Effect::Budget(Box::new(BudgetExplained {
                    op: request.op,
                    level_names: request.level_names,
                    set_nodes: request.set_nodes,
                    global: request.global,
                    model: model.unwrap_or_default(),
                    currency: priced.prices.currency.clone(),
                }))
            }
        }
    }

    // The overrides of every budget level on `paths`, from the quota source, by the level's
    // path text ([`identity::path_text`]).
    async fn budget_overrides<'p, 'q: 'p>(
        &self,
        domain: &Domain,
        paths: impl Iterator<Item = &'p [(&'q str, &'q str)]>,
    ) -> Overrides {
        let mut texts: Vec<String> = Vec::new();
        for path in paths {
            let Some(nodes) = domain.root.path(path) else { continue };
            for (depth, node) in nodes.iter().enumerate() {
                if node.budget.is_some() {
                    let text = identity::path_text(&path[..=depth]);
                    if !texts.contains(&text) {
                        texts.push(text);
                    }
                }
            }
        }
        let found = join_all(texts.iter().map(|p| self.quotas.budget(&domain.name, p))).await;
        texts.into_iter().zip(found).filter_map(|(p, o)| Some((p, o?))).collect()
    }

    // The op for the request whose descriptor is `parsed`: a hold of `hits` output tokens, or
    // with a usage `kind`, the settlement of `hits` of them.
    #[allow(clippy::too_many_arguments)]
    fn request(
        &self,
        domain: &Domain,
        priced: &Priced,
        parsed: &Parsed<'_>,
        now: u64,
        hits: u64,
        kind: Option<Kind>,
        overrides: &Overrides,
    ) -> Result<Request, Refusal> {
        let path = &parsed.path[..];
        let nodes = domain.root.path(path).ok_or(Refusal::Malformed)?;
        let (&(_, request_id), levels_path) = path.split_last().expect("a path ends with its request id");
        if request_id.is_empty() {
            return Err(Refusal::EmptyId);
        }
        let held_model = levels_path.iter().find(|(k, _)| *k == priced.model_key).map(|(_, v)| *v);
        let held = held_model.and_then(|m| priced.prices.model(m)).map(|(_, row)| row);
        let mut levels = Vec::new();
        let mut level_names = Vec::new();
        let mut alert_at = Vec::new();
        let mut level_subjects = Vec::new();
        let mut buckets = Vec::new();
        let (mut sets, mut set_nodes) = (Vec::new(), Vec::new());
        let mut level_entries = Vec::new();
        for (depth, node) in nodes.iter().enumerate() {
            let entries = &path[..=depth];
            if let Some(limit) = node.concurrency {
                sets.push(SlotSet {
                    key: identity::slot_set(domain, entries),
                    max: limit.max,
                    ttl_ms: limit.ttl_ms,
                });
                set_nodes.push(node_path(entries));
            }
            if let Some(budget) = &node.budget {
                let owned = entries.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
                level_entries.push((owned, budget.global));
                let (amount, calendar) = amount_and_calendar(budget, overrides, entries);
                levels.push(LevelOp {
                    base: identity::budget_level(domain, entries),
                    amount,
                    around: calendar.around(now as i64),
                    alerts: budget.alerts(amount),
                });
                level_names.push(node.key.clone());
                alert_at.push(budget.alert_at.clone());
                let value = entries[depth].1;
                level_subjects.push(if node.key == domain.tenant_key {
                    value.to_owned()
                } else {
                    traces::tenant_hash(value)
                });
            }
            if let Some(rule) = &node.rule {
                if let Limit::Bucket(spec) = rule.limit {
                    buckets.push(BucketLevel { key: identity::rule_bucket(domain, rule, entries).key, spec });
                }
            }
        }
        let (row, version, action) = match kind {
            None => {
                let model = held.ok_or(Refusal::UnknownModel)?;
                let (amount, tokens) = model.hold(hits, parsed.input_bytes);
                if levels.iter().any(|l| l.amount < amount) {
                    return Err(Refusal::TooLarge);
                }
                let ttl_ms = priced.hold_ttl.as_millis() as u64;
                (model.row, priced.prices.version.clone(), BudgetAction::Hold { amount, tokens, ttl_ms })
            }
            Some(kind) => {
                let (row, most) = settlement_price(priced, parsed);
                // Without a row today, the record's row prices it: an empty version never
                // matches one, so the store answers with the record's row (or, without a
                // record, charges nothing).
                let version = if row.is_some() { priced.prices.version.clone() } else { String::new() };
                let row = row.unwrap_or(PriceRow([Money::ZERO; 4]));
                let usage = vec![capped_usage(domain, &row, most, kind, hits)];
                (row, version, BudgetAction::Settle { usage })
            }
        };
        let tenant = path.iter().find(|(k, _)| *k == domain.tenant_key).map(|(_, v)| (*v).to_owned());
        let global = level_entries.iter().map(|(_, g)| *g).collect();
        let leased = self.leased_levels(&domain.name, &mut levels, &level_entries);
        let op = BudgetOp {
            record: identity::budget_record(domain, path, request_id),
            binding: identity::path_text(levels_path),
            levels,
            buckets,
            sets,
            version,
            row,
            lost: priced.on_lost_settle,
            life_ms: priced.hold_ttl.as_millis() as u64 + RECORD_GRACE_MS,
            action,
        };
        Ok(Request {
            op,
            level_names,
            alert_at,
            level_subjects,
            set_nodes,
            tenant,
            global,
            leased,
            descriptors: Vec::new(),
        })
    }
}

// The overrides found, by level path text.
type Overrides = Vec<(String, BudgetOverride)>;

// The amount and calendar of `budget` at the level `entries` reach: an override's, else the
// file's.
fn amount_and_calendar(
    budget: &BudgetSpec,
    overrides: &Overrides,
    entries: &[(&str, &str)],
) -> (Money, Calendar) {
    let text = identity::path_text(entries);
    match overrides.iter().find(|(p, _)| *p == text).map(|(_, o)| o) {
        Some(o) => {
            (o.amount, o.per.map_or_else(|| budget.calendar.clone(), |per| budget.calendar.with_per(per)))
        }
        None => (budget.amount, budget.calendar.clone()),
    }
}

impl Limiter {
    // The verdict and report of a request's answer, with what the global tier's last answer left
    // unheld at each of its global levels.
    fn report(&self, request: &Request, outcome: &BudgetOutcome, currency: &str) -> (Code, BudgetReport) {
        let mut unleased = vec![Money::ZERO; request.op.levels.len()];
        for level in &request.leased {
            unleased[level.index] = self.unleased(&level.key);
        }
        report(request, outcome, currency, &unleased)
    }
}

// The verdict and report of a request's answer. A global level's money left is its lease's room
// here plus `unleased` (what nobody holds at the global tier); one exhausted here may be granted
// more within a round, so its wait is a second, not its period.
fn report(
    request: &Request,
    outcome: &BudgetOutcome,
    currency: &str,
    unleased: &[Money],
) -> (Code, BudgetReport) {
    let (now_ms, levels, code, exhausted, retry) = match outcome {
        BudgetOutcome::Held { verdict: HoldVerdict::Reused, .. } => {
            return (Code::OverLimit, BudgetReport::refused(REFUSED_REQUEST_ID, currency));
        }
        BudgetOutcome::Held { now_ms, verdict, exhausted, short, levels, buckets, slots, .. } => {
            let code = if *verdict == HoldVerdict::Denied { Code::OverLimit } else { Code::Ok };
            let whole = |ms: u64| ms.div_ceil(1000).max(1);
            let retry = match (exhausted, slots.full, short) {
                (Some(l), _, _) if request.leased.iter().any(|g| g.index == *l) => Some(1),
                (Some(l), _, _) => levels.get(*l).map(|r| seconds_until(r.end_ms, *now_ms)),
                (None, Some(set), _) => slots.readings.get(set).and_then(|r| r.frees_in_ms).map(whole),
                (None, None, Some(b)) => buckets.get(*b).and_then(|(_, wait)| wait.map(whole)),
                (None, None, None) => None,
            };
            (*now_ms, levels.as_slice(), code, *exhausted, retry)
        }
        BudgetOutcome::Settled { now_ms, levels, .. } => (*now_ms, levels.as_slice(), Code::Ok, None, None),
        BudgetOutcome::Reprice { .. }
        | BudgetOutcome::Cancelled { .. }
        | BudgetOutcome::Peeked { .. }
        | BudgetOutcome::Leased { .. } => (0, &[][..], Code::Ok, None, None),
    };
    let least = levels
        .iter()
        .zip(&request.op.levels)
        .zip(unleased)
        .map(|((r, level), unleased): ((&LevelReading, &LevelOp), &Money)| {
            (level.amount.saturating_sub(r.used) + *unleased, seconds_until(r.end_ms, now_ms))
        })
        .min_by_key(|(left, _)| *left);
    // Per level, the highest soft limit its spend is at or above.
    let warnings = levels
        .iter()
        .zip(&request.op.levels)
        .zip(request.level_names.iter().zip(&request.alert_at))
        .filter_map(|((reading, level), (name, fractions))| {
            let crossed = level.alerts.iter().filter(|a| **a <= reading.spent).count();
            Some((name.clone(), *fractions.get(crossed.checked_sub(1)?)?))
        })
        .collect();
    let report = BudgetReport {
        exhausted: exhausted.and_then(|l| request.level_names.get(l).cloned()),
        least,
        currency: currency.to_owned(),
        retry_after_s: retry,
        warnings,
        slots: slot_limits(request, outcome),
    };
    (code, report)
}

// The request's concurrency limits as its op left them.
fn slot_limits(request: &Request, outcome: &BudgetOutcome) -> Vec<SlotLimit> {
    let readings = match outcome {
        BudgetOutcome::Held { slots, .. } | BudgetOutcome::Settled { slots, .. } => &slots.readings,
        _ => return Vec::new(),
    };
    readings
        .iter()
        .zip(&request.op.sets)
        .zip(&request.set_nodes)
        .map(|((r, set), node)| SlotLimit::of(set, node, Some(r)))
        .collect()
}

// Whole seconds from `now_ms` to `end_ms`, rounded up.
fn seconds_until(end_ms: i64, now_ms: u64) -> u64 {
    u64::try_from(end_ms).unwrap_or(0).saturating_sub(now_ms).div_ceil(1000)
}
