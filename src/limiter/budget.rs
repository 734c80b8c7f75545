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

use std::sync::Arc;

use futures::future::join_all;

use super::{
    count_store_error, Code, DecideError, Decision, DescriptorVerdict, Effect, Limiter, Outcome, Query,
};
use crate::budget::money::MAX_TOKENS;
use crate::budget::{
    cost, BucketLevel, BudgetAction, BudgetOp, BudgetOutcome, BudgetOverride, HadHold, HoldVerdict, Kind,
    LevelOp, LevelReading, LostSettle, Money, PriceRow, RECORD_GRACE_MS,
};
use crate::config::{Domain, FailureMode, Limit, Priced};
use crate::identity;
use crate::store::{Store, StoreError};
use crate::telemetry::logs::{self, ErrorChain};
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
    // The request's tenant (for logs).
    tenant: Option<String>,
    descriptors: Vec<usize>,
}

// Why a descriptor gets no op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    // Not a path down to a request id, one for one.
    Malformed,
    // An empty request id.
    EmptyId,
    // The model has no price.
    UnknownModel,
    // The hold is larger than a level's whole amount.
    TooLarge,
}

impl Refusal {
    fn exhausted(self, priced: &Priced) -> &str {
        match self {
            Refusal::Malformed | Refusal::TooLarge => REFUSED_REQUEST,
            Refusal::EmptyId => REFUSED_REQUEST_ID,
            Refusal::UnknownModel => &priced.model_key,
        }
    }

    fn reason(self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::EmptyId => "empty_request_id",
            Refusal::UnknownModel => "unknown_model",
            Refusal::TooLarge => "hold_above_amount",
        }
    }
}

/// A priced descriptor's entries, taken apart: the path through the tree (levels, model and
/// request id), the body size, and for a stream-end call the served model and usage kind.
#[derive(Debug, Clone, PartialEq)]
struct Parsed<'q> {
    path: Vec<(&'q str, &'q str)>,
    input_bytes: Option<u64>,
    served: Option<&'q str>,
    usage: Option<&'q str>,
}

fn parse<'q>(priced: &Priced, entries: &[(&'q str, &'q str)]) -> Result<Parsed<'q>, Refusal> {
    let (mut rest, usage) = match entries.split_last() {
        Some((&(USAGE_KEY, kind), rest)) => (rest, Some(kind)),
        _ => (entries, None),
    };
    let mut served = None;
    if usage.is_some() {
        if let Some((&(SERVED_MODEL_KEY, model), before)) = rest.split_last() {
            served = Some(model);
            rest = before;
        }
    }
    let Some((&(id_key, id), before)) = rest.split_last() else { return Err(Refusal::Malformed) };
    if id_key != priced.request_id_key {
        return Err(Refusal::Malformed);
    }
    let mut path = before.to_vec();
    let mut input_bytes = None;
    if let Some(&(key, bytes)) = path.last() {
        if key == priced.input_bytes_key {
            input_bytes = Some(bytes.parse::<u64>().map_err(|_| Refusal::Malformed)?);
            path.pop();
        }
    }
    path.push((id_key, id));
    Ok(Parsed { path, input_bytes, served, usage })
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
            query.descriptors.iter().map(|d| parse(priced, &d.entries)).collect();
        let overrides = self.budget_overrides(domain, parsed.iter().filter_map(|p| p.as_ref().ok())).await;
        let mut requests: Vec<Request> = Vec::new();
        let parsed_all = &parsed;
        for (i, (d, parsed)) in query.descriptors.iter().zip(parsed_all).enumerate() {
            let refused = |refusal: Refusal| {
                count_refusal(domain, refusal.reason());
                let report = BudgetReport::refused(refusal.exhausted(priced), &currency);
                Some((Code::OverLimit, Outcome::Budget(report)))
            };
            let parsed = match parsed {
                Ok(p) => p,
                Err(refusal) => {
                    verdicts[i] = refused(*refusal);
                    continue;
                }
            };
            let kind = match parsed.usage.map(Kind::parse) {
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
                    let first = parsed_all[r.descriptors[0]].as_ref();
                    matches!(r.op.action, BudgetAction::Settle { .. })
                        && first.is_ok_and(|f| (&f.path, f.served) == (&parsed.path, parsed.served))
                }) {
                    let (row, most) = settlement_price(priced, parsed);
                    if let BudgetAction::Settle { usage } = &mut r.op.action {
                        usage.push(capped_usage(domain, &row.unwrap_or(r.op.row), most, kind, d.hits));
                    }
                    r.descriptors.push(i);
                    continue;
                }
            }
            match self.request(domain, priced, parsed, now, d.hits, kind, &overrides) {
                Err(refusal) => verdicts[i] = refused(refusal),
                Ok(mut request) => {
                    request.descriptors.push(i);
                    requests.push(request);
                }
            }
        }
        let mut failure = None;
        for request in &requests {
            let (code, outcome) = match call(self.store.as_ref(), &request.op).await {
                Ok(outcome) => {
                    self.count_budget(domain, priced, request, &outcome);
                    let (code, report) = report(request, &outcome, &currency);
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
        self.telemetry.record(query, &decision);
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
        let parsed = match parse(priced, entries) {
            Ok(p) => Parsed { usage: None, served: None, ..p },
            Err(_) => return Effect::NoRule,
        };
        let overrides = self.budget_overrides(domain, std::iter::once(&parsed)).await;
        match self.request(domain, priced, &parsed, self.clock.now_ms(), hits, None, &overrides) {
            Err(Refusal::UnknownModel) => Effect::UnknownModel,
            Err(_) => Effect::NoRule,
            Ok(request) => {
                let model =
                    parsed.path.iter().find(|(k, _)| *k == priced.model_key).map(|(_, v)| (*v).to_owned());
                Effect::Budget(Box::new(BudgetExplained {
                    op: request.op,
                    level_names: request.level_names,
                    model: model.unwrap_or_default(),
                    currency: priced.prices.currency.clone(),
                }))
            }
        }
    }

    // The overrides of every level on the paths of `parsed`, from the quota source, by the
    // level's path text ([`identity::path_text`]).
    async fn budget_overrides<'p, 'q: 'p>(
        &self,
        domain: &Domain,
        parsed: impl Iterator<Item = &'p Parsed<'q>>,
    ) -> Vec<(String, BudgetOverride)> {
        let mut paths: Vec<String> = Vec::new();
        for p in parsed {
            let Some(nodes) = domain.root.path(&p.path) else { continue };
            for (depth, node) in nodes.iter().enumerate() {
                if node.budget.is_some() {
                    let text = identity::path_text(&p.path[..=depth]);
                    if !paths.contains(&text) {
                        paths.push(text);
                    }
                }
            }
        }
        let found = join_all(paths.iter().map(|p| self.quotas.budget(&domain.name, p))).await;
        paths.into_iter().zip(found).filter_map(|(p, o)| Some((p, o?))).collect()
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
        overrides: &[(String, BudgetOverride)],
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
        let mut buckets = Vec::new();
        for (depth, node) in nodes.iter().enumerate() {
            let entries = &path[..=depth];
            if let Some(budget) = &node.budget {
                let text = identity::path_text(entries);
                let over = overrides.iter().find(|(p, _)| *p == text).map(|(_, o)| o);
                let (amount, calendar) = match over {
                    Some(o) => {
                        (o.amount, o.per.map_or(budget.calendar.clone(), |per| budget.calendar.with_per(per)))
                    }
                    None => (budget.amount, budget.calendar.clone()),
                };
                levels.push(LevelOp {
                    base: identity::budget_level(domain, entries),
                    amount,
                    around: calendar.around(now as i64),
                    alerts: budget.alerts(amount),
                });
                level_names.push(node.key.clone());
                alert_at.push(budget.alert_at.clone());
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
        let op = BudgetOp {
            record: identity::budget_record(domain, path, request_id),
            binding: identity::path_text(levels_path),
            levels,
            buckets,
            version,
            row,
            lost: priced.on_lost_settle,
            life_ms: priced.hold_ttl.as_millis() as u64 + RECORD_GRACE_MS,
            action,
        };
        Ok(Request { op, level_names, alert_at, tenant, descriptors: Vec::new() })
    }

    // After a failed op, in the background and under the background deadline: a hold whose
    // request the failure mode did not admit is cancelled (the script may have run and its reply
    // been lost: the request must take nothing), and a settlement is sent again (it is
    // idempotent per kind, and Envoy never resends it). What still fails is left to the hold's
    // expiry (`on_lost_settle`), logged and counted.
    fn recover(&self, domain: &Domain, op: &BudgetOp) {
        let (kind, op) = match op.action {
            BudgetAction::Hold { .. } if domain.failure_mode == FailureMode::Allow => return,
            BudgetAction::Hold { .. } => ("cancel", BudgetOp { action: BudgetAction::Cancel, ..op.clone() }),
            BudgetAction::Settle { .. } => ("settle", op.clone()),
            BudgetAction::Cancel | BudgetAction::Peek => return,
        };
        let store = self.store.clone();
        let name = domain.name.clone();
        tokio::spawn(async move {
            let mut last = None;
            for attempt in 0..RECOVERY_ATTEMPTS {
                if attempt > 0 {
                    tokio::time::sleep(RECOVERY_PAUSE).await;
                }
                match crate::store::with_deadline(RECOVERY_DEADLINE, call(store.as_ref(), &op)).await {
                    Ok(_) => {
                        last = None;
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            let outcome = if last.is_some() { "failed" } else { "ok" };
            metrics::counter!("tollgate_budget_recoveries_total", "domain" => name.clone(), "kind" => kind, "outcome" => outcome)
                .increment(1);
            if let Some(error) = last {
                tracing::warn!(domain = %name, kind, error = %ErrorChain(&error), "a budget op could not be repaired; the hold expires as on_lost_settle says");
            }
        });
    }

    // Spend, holds, settlements, cancels, expiries, denials, refusals and alerts, in metrics
    // and, for what an operator must hear of, logs.
    fn count_budget(&self, domain: &Domain, priced: &Priced, request: &Request, outcome: &BudgetOutcome) {
        let name = domain.name.clone();
        let (released, expired) = match outcome {
            BudgetOutcome::Held { expired, .. } => (false, *expired),
            BudgetOutcome::Settled { had, expired, .. } | BudgetOutcome::Cancelled { had, expired, .. } => {
                (*had == HadHold::Open, *expired)
            }
            BudgetOutcome::Reprice { .. } | BudgetOutcome::Peeked { .. } => (false, 0),
        };
        let lost = match priced.on_lost_settle {
            LostSettle::Charge => "charged",
            LostSettle::Release => "released",
        };
        metrics::counter!("tollgate_budget_holds_expired_total", "domain" => name.clone(), "outcome" => lost)
            .increment(expired);
        // Holds this replica opened less those it saw closed (settled or cancelled while open,
        // found expired): summed over the replicas, the holds open, since a hold opened on one
        // replica may close on another.
        let opened = matches!(outcome, BudgetOutcome::Held { verdict: HoldVerdict::Admitted, .. });
        let net = f64::from(u8::from(opened)) - f64::from(u8::from(released)) - expired as f64;
        metrics::gauge!("tollgate_budget_holds_open", "domain" => name.clone()).increment(net);
        match outcome {
            BudgetOutcome::Held { verdict, exhausted, short, levels, .. } => {
                metrics::counter!("tollgate_budget_holds_total", "domain" => name.clone(), "verdict" => verdict_label(*verdict))
                    .increment(1);
                if *verdict == HoldVerdict::Reused {
                    self.refused_by_record(domain, request, "request_id_reused");
                }
                let level = match (exhausted, short) {
                    (Some(l), _) => request.level_names.get(*l).cloned(),
                    (None, Some(_)) => Some("token_bucket".to_owned()),
                    (None, None) => None,
                };
                if let Some(level) = level {
                    metrics::counter!("tollgate_budget_denials_total", "domain" => name, "level" => level)
                        .increment(1);
                }
                alerts(domain, request, levels);
            }
            BudgetOutcome::Settled { charged, had, levels, .. } => {
                metrics::counter!("tollgate_budget_settlements_total", "domain" => name.clone(), "hold" => had_label(had))
                    .increment(1);
                if *had == HadHold::Other {
                    self.refused_by_record(domain, request, "path_mismatch");
                }
                count_spend(name, &priced.prices.currency, &request.op.version, *charged);
                alerts(domain, request, levels);
            }
            BudgetOutcome::Cancelled { had, .. } => {
                metrics::counter!("tollgate_budget_cancels_total", "domain" => name, "hold" => had_label(had))
                    .increment(1);
            }
            BudgetOutcome::Reprice { .. } | BudgetOutcome::Peeked { .. } => {}
        }
    }

    // A request the store refused because its id's record is another request's: counted, and
    // logged with the tenant (never the request id, which a client may have chosen).
    fn refused_by_record(&self, domain: &Domain, request: &Request, reason: &'static str) {
        count_refusal(domain, reason);
        if let Some(held_back) = logs::throttled("budget_record_refused") {
            let tenant = request.tenant.as_deref().map(traces::tenant_hash).unwrap_or_default();
            let action =
                if matches!(request.op.action, BudgetAction::Hold { .. }) { "hold" } else { "settlement" };
            tracing::warn!(domain = %domain.name, reason, action, tenant_hash = %tenant, held_back, "a request id's record belongs to another request: nothing held or charged");
        }
    }
}

// Alerts the op crossed, once a period across every replica (the store counts them): logged
// and counted by level and threshold.
fn alerts(domain: &Domain, request: &Request, levels: &[LevelReading]) {
    for (i, reading) in levels.iter().enumerate() {
        let (before, after) = reading.alerted;
        for k in before..after {
            let (Some(level), Some(fraction)) =
                (request.level_names.get(i), request.alert_at.get(i).and_then(|a| a.get(k as usize)))
            else {
                continue;
            };
            let threshold = fraction_text(*fraction);
            metrics::counter!("tollgate_budget_alerts_total", "domain" => domain.name.clone(), "level" => level.clone(), "threshold" => threshold.clone())
                .increment(1);
            let tenant = request.tenant.as_deref().map(traces::tenant_hash).unwrap_or_default();
            tracing::warn!(domain = %domain.name, level = %level, threshold = %threshold, tenant_hash = %tenant, spent = %reading.spent, period_end_ms = reading.end_ms, "budget alert: a level's spend crossed a soft limit");
        }
    }
}

// Money spent, in nano-units: a counter that saturates instead of wrapping, so that no charge,
// however large, makes the total read small.
fn count_spend(domain: String, currency: &str, version: &str, charged: Money) {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    type Totals = Mutex<HashMap<(String, String, String), u64>>;
    static TOTALS: OnceLock<Totals> = OnceLock::new();
    let labels = (domain, currency.to_owned(), version.to_owned());
    let total = {
        let mut totals = TOTALS.get_or_init(Totals::default).lock().unwrap_or_else(|e| e.into_inner());
        let total = totals.entry(labels.clone()).or_default();
        *total = total.saturating_add(u64::try_from(charged.0).unwrap_or(u64::MAX));
        *total
    };
    let (domain, currency, version) = labels;
    metrics::counter!("tollgate_budget_spend_nanos_total", "domain" => domain, "currency" => currency, "version" => version)
        .absolute(total);
}

/// A fraction in nano-units as its shortest decimal (800,000,000: `0.8`).
pub fn fraction_text(fraction: Money) -> String {
    let text = fraction.to_string();
    let text = text.trim_end_matches('0');
    text.strip_suffix('.').unwrap_or(text).to_owned()
}

// The verdict and report of a request's answer.
fn report(request: &Request, outcome: &BudgetOutcome, currency: &str) -> (Code, BudgetReport) {
    let (now_ms, levels, code, exhausted, retry) = match outcome {
        BudgetOutcome::Held { verdict: HoldVerdict::Reused, .. } => {
            return (Code::OverLimit, BudgetReport::refused(REFUSED_REQUEST_ID, currency));
        }
        BudgetOutcome::Held { now_ms, verdict, exhausted, short, levels, buckets, .. } => {
            let code = if *verdict == HoldVerdict::Denied { Code::OverLimit } else { Code::Ok };
            let retry = match (exhausted, short) {
                (Some(l), _) => levels.get(*l).map(|r| seconds_until(r.end_ms, *now_ms)),
                (None, Some(b)) => {
                    buckets.get(*b).and_then(|(_, wait)| wait.map(|ms| ms.div_ceil(1000).max(1)))
                }
                (None, None) => None,
            };
            (*now_ms, levels.as_slice(), code, *exhausted, retry)
        }
        BudgetOutcome::Settled { now_ms, levels, .. } => (*now_ms, levels.as_slice(), Code::Ok, None, None),
        BudgetOutcome::Reprice { .. } | BudgetOutcome::Cancelled { .. } | BudgetOutcome::Peeked { .. } => {
            (0, &[][..], Code::Ok, None, None)
        }
    };
    let amounts = request.op.levels.iter().map(|l| l.amount);
    let least = levels
        .iter()
        .zip(amounts)
        .map(|(r, amount): (&LevelReading, Money)| {
            (amount.saturating_sub(r.used), seconds_until(r.end_ms, now_ms))
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
    };
    (code, report)
}

/// How often a failed hold's cancel or a failed settlement is tried again, how far apart, and how
/// long each try may take (no request waits on them).
const RECOVERY_ATTEMPTS: u32 = 3;
const RECOVERY_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);
const RECOVERY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

// One budget op; a settlement of a hold made at another price version is priced again at that
// version's row, which the store keeps with the hold.
async fn call(store: &dyn Store, op: &BudgetOp) -> Result<BudgetOutcome, StoreError> {
    let outcome = store.budget(op).await?;
    let BudgetOutcome::Reprice { version, row, .. } = outcome else { return Ok(outcome) };
    let BudgetAction::Settle { usage } = &op.action else {
        return Err(StoreError::Protocol("only a settlement is repriced".into()));
    };
    let usage =
        usage.iter().map(|&(kind, tokens, _)| (kind, tokens, cost(tokens, row.price(kind)))).collect();
    let again = BudgetOp { version, row, action: BudgetAction::Settle { usage }, ..op.clone() };
    match store.budget(&again).await? {
        BudgetOutcome::Reprice { .. } => {
            Err(StoreError::Protocol("a hold changed price version twice".into()))
        }
        outcome => Ok(outcome),
    }
}

/// What a settlement or cancel found of its hold, as a metric label.
pub fn had_label(had: &HadHold) -> &'static str {
    match had {
        HadHold::Open => "open",
        HadHold::Expired => "expired",
        HadHold::Settled => "settled",
        HadHold::None => "none",
        HadHold::Other => "other",
    }
}

/// A hold's verdict, as a metric label.
pub fn verdict_label(verdict: HoldVerdict) -> &'static str {
    match verdict {
        HoldVerdict::Admitted => "admitted",
        HoldVerdict::Duplicate => "duplicate",
        HoldVerdict::Reused => "reused",
        HoldVerdict::Denied => "denied",
    }
}

// The row a settlement is priced at, and the most each kind is charged for: the served model's
// when the table has it, else the held model's; no row when neither is in the table (the
// record's row then prices it).
fn settlement_price(priced: &Priced, parsed: &Parsed<'_>) -> (Option<PriceRow>, [u64; 4]) {
    let held = parsed.path.iter().find(|(k, _)| *k == priced.model_key).map(|(_, v)| *v);
    let model = parsed.served.and_then(|m| priced.prices.model(m)).or_else(|| priced.prices.model(held?));
    match model {
        Some((_, row)) => (Some(row.row), Kind::ALL.map(|k| row.most(k))),
        None => (None, [MAX_TOKENS; 4]),
    }
}

// `tokens` of `kind`, at most `most[kind]` (the model's maximum for the kind: more is charged
// at the maximum, logged and counted), and what they cost at `row`'s prices.
fn capped_usage(
    domain: &Domain,
    row: &PriceRow,
    most: [u64; 4],
    kind: Kind,
    tokens: u64,
) -> (Kind, u64, Money) {
    let most = most[kind as usize];
    if tokens > most {
        metrics::counter!("tollgate_budget_usage_capped_total", "domain" => domain.name.clone(), "kind" => kind.name())
            .increment(1);
        if let Some(held_back) = logs::throttled("budget_usage_capped") {
            tracing::warn!(domain = %domain.name, kind = kind.name(), tokens, charged_as = most, held_back, "a usage count above the model's maximum was charged at the maximum");
        }
    }
    let tokens = tokens.min(most);
    (kind, tokens, cost(tokens, row.price(kind)))
}

// Whole seconds from `now_ms` to `end_ms`, rounded up.
fn seconds_until(end_ms: i64, now_ms: u64) -> u64 {
    u64::try_from(end_ms).unwrap_or(0).saturating_sub(now_ms).div_ceil(1000)
}

fn count_refusal(domain: &Domain, reason: &'static str) {
    metrics::counter!("tollgate_budget_refusals_total", "domain" => domain.name.clone(), "reason" => reason)
        .increment(1);
}

// A budget op the store failed: counted and logged as every store failure is.
fn budget_store_failed(domain: &Domain, error: &StoreError) {
    count_store_error(domain, if matches!(error, StoreError::Timeout(_)) { "timeout" } else { "error" });
    if let Some(held_back) = logs::throttled("budget_store_failed") {
        let mode = domain.failure_mode;
        tracing::warn!(domain = %domain.name, error = %ErrorChain(error), failure_mode = %mode, held_back, "store failed on a budget; applying the failure mode");
    }
}
