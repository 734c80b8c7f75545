//! LLM spend budgets in the decision ([`crate::budget`]): in a priced domain, a descriptor down to
//! a request id asks for a hold, and the descriptors of one request with a `usage` entry last
//! settle it; each request is one budget op, whose answer becomes the verdict of its descriptors.
//!
//! What a descriptor of a priced domain gets:
//! * its path matches no node, or names no request id: no limit (as any unmatched descriptor);
//! * its model is not in the price table: OVER_LIMIT, exhausted level `model`, never priced at
//!   zero;
//! * a usage kind tollgate does not know: no limit, counted (Envoy ignores the answer to a
//!   stream-end call anyway);
//! * otherwise the store's verdict, or the domain's failure mode when the store fails.

use std::sync::Arc;

use super::{
    count_store_error, Code, DecideError, Decision, DescriptorVerdict, Effect, Limiter, Outcome, Query,
};
use crate::budget::{
    cost, BucketLevel, BudgetAction, BudgetOp, BudgetOutcome, HadHold, HoldVerdict, Kind, LevelOp,
    LevelReading, LostSettle, Money, PriceRow, RECORD_GRACE_MS,
};
use crate::config::{Domain, FailureMode, Limit, Priced};
use crate::identity;
use crate::store::{Store, StoreError};
use crate::telemetry::logs::{self, ErrorChain};

/// The entry key that marks a settlement descriptor; its value names the usage kind.
pub const USAGE_KEY: &str = "usage";

/// What a priced request's descriptor found.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetReport {
    /// The descriptor key of the exhausted budget nearest the top (`model` for a model the price
    /// table lacks); `None` when admitted, or when a token bucket denied.
    pub exhausted: Option<String>,
    /// The money left at the level with the least of it, after this call, and the whole
    /// seconds until its period ends.
    pub least: Option<(Money, u64)>,
    /// The price table's currency.
    pub currency: String,
    /// When a denial could end, in whole seconds: the exhausted budget's period end, or the
    /// short bucket's refill.
    pub retry_after_s: Option<u64>,
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
    descriptors: Vec<usize>,
}

// Why a descriptor gets no op.
enum Refusal {
    NotBudgeted,
    UnknownModel,
}

impl Limiter {
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
        let mut requests: Vec<Request> = Vec::new();
        for (i, d) in query.descriptors.iter().enumerate() {
            let (path, usage) = match d.entries.split_last() {
                Some((&(USAGE_KEY, kind), rest)) => (rest, Some(kind)),
                _ => (&d.entries[..], None),
            };
            let kind = match usage.map(Kind::parse) {
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
                    matches!(r.op.action, BudgetAction::Settle { .. })
                        && settles(&query.descriptors[r.descriptors[0]].entries, path)
                }) {
                    if let BudgetAction::Settle { usage } = &mut r.op.action {
                        usage.push(priced_usage(&r.op.row, kind, d.hits));
                    }
                    r.descriptors.push(i);
                    continue;
                }
            }
            match self.request(domain, priced, path, now, d.hits, kind) {
                Err(Refusal::NotBudgeted) => verdicts[i] = Some((Code::Ok, Outcome::NoLimit)),
                Err(Refusal::UnknownModel) => {
                    count_refusal(domain, "unknown_model");
                    let report = BudgetReport {
                        exhausted: Some(priced.model_key.clone()),
                        least: None,
                        currency: currency.clone(),
                        retry_after_s: None,
                    };
                    verdicts[i] = Some((Code::OverLimit, Outcome::Budget(report)));
                }
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
    pub(super) fn explain_priced(
        &self,
        domain: &Domain,
        priced: &Priced,
        entries: &[(&str, &str)],
        hits: u64,
    ) -> Effect {
        let path = match entries.split_last() {
            Some((&(USAGE_KEY, _), rest)) => rest,
            _ => entries,
        };
        match self.request(domain, priced, path, self.clock.now_ms(), hits, None) {
            Err(Refusal::NotBudgeted) => Effect::NoRule,
            Err(Refusal::UnknownModel) => Effect::UnknownModel,
            Ok(request) => {
                let model = path.iter().find(|(k, _)| *k == priced.model_key).map(|(_, v)| (*v).to_owned());
                Effect::Budget(Box::new(BudgetExplained {
                    op: request.op,
                    level_names: request.level_names,
                    model: model.unwrap_or_default(),
                    currency: priced.prices.currency.clone(),
                }))
            }
        }
    }

    // The op for the request whose descriptor walks `path`: a hold of `hits` output tokens, or
    // with a usage `kind`, the settlement of `hits` of them.
    fn request(
        &self,
        domain: &Domain,
        priced: &Priced,
        path: &[(&str, &str)],
        now: u64,
        hits: u64,
        kind: Option<Kind>,
    ) -> Result<Request, Refusal> {
        let value = |key: &str| path.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
        let request_id = value(&priced.request_id_key).ok_or(Refusal::NotBudgeted)?;
        let nodes = domain.root.path(path).ok_or(Refusal::NotBudgeted)?;
        let model = value(&priced.model_key)
            .and_then(|m| priced.prices.models.get(m))
            .ok_or(Refusal::UnknownModel)?;
        let mut levels = Vec::new();
        let mut level_names = Vec::new();
        let mut buckets = Vec::new();
        for (depth, node) in nodes.iter().enumerate() {
            let entries = &path[..=depth];
            if let Some(budget) = &node.budget {
                levels.push(LevelOp {
                    base: identity::budget_level(domain, entries),
                    amount: budget.amount,
                    around: budget.calendar.around(now as i64),
                });
                level_names.push(node.key.clone());
            }
            if let Some(rule) = &node.rule {
                if let Limit::Bucket(spec) = rule.limit {
                    buckets.push(BucketLevel { key: identity::rule_bucket(domain, rule, entries).key, spec });
                }
            }
        }
        let op = BudgetOp {
            record: identity::budget_record(domain, path, request_id),
            levels,
            buckets,
            version: priced.prices.version.clone(),
            row: model.row,
            lost: priced.on_lost_settle,
            life_ms: priced.hold_ttl.as_millis() as u64 + RECORD_GRACE_MS,
            action: match kind {
                None => {
                    let (amount, tokens) = model.hold(hits);
                    BudgetAction::Hold { amount, tokens, ttl_ms: priced.hold_ttl.as_millis() as u64 }
                }
                Some(kind) => BudgetAction::Settle { usage: vec![priced_usage(&model.row, kind, hits)] },
            },
        };
        Ok(Request { op, level_names, descriptors: Vec::new() })
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

    // Spend, holds, settlements, cancels, expiries and denials, in metrics.
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
            BudgetOutcome::Held { verdict, exhausted, short, .. } => {
                let verdict = match verdict {
                    HoldVerdict::Admitted => "admitted",
                    HoldVerdict::Duplicate => "duplicate",
                    HoldVerdict::Denied => "denied",
                };
                metrics::counter!("tollgate_budget_holds_total", "domain" => name.clone(), "verdict" => verdict)
                    .increment(1);
                let level = match (exhausted, short) {
                    (Some(l), _) => request.level_names.get(*l).cloned(),
                    (None, Some(_)) => Some("token_bucket".to_owned()),
                    (None, None) => None,
                };
                if let Some(level) = level {
                    metrics::counter!("tollgate_budget_denials_total", "domain" => name, "level" => level)
                        .increment(1);
                }
            }
            BudgetOutcome::Settled { charged, had, .. } => {
                metrics::counter!("tollgate_budget_settlements_total", "domain" => name.clone(), "hold" => had_label(had))
                    .increment(1);
                metrics::counter!(
                    "tollgate_budget_spend_nanos_total",
                    "domain" => name,
                    "currency" => priced.prices.currency.clone(),
                    "version" => request.op.version.clone()
                )
                .increment(u64::try_from(charged.0).unwrap_or(u64::MAX));
            }
            BudgetOutcome::Cancelled { had, .. } => {
                metrics::counter!("tollgate_budget_cancels_total", "domain" => name, "hold" => had_label(had))
                    .increment(1);
            }
            BudgetOutcome::Reprice { .. } | BudgetOutcome::Peeked { .. } => {}
        }
    }
}

// The verdict and report of a request's answer.
fn report(request: &Request, outcome: &BudgetOutcome, currency: &str) -> (Code, BudgetReport) {
    let (now_ms, levels, code, exhausted, retry) = match outcome {
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
    let report = BudgetReport {
        exhausted: exhausted.and_then(|l| request.level_names.get(l).cloned()),
        least,
        currency: currency.to_owned(),
        retry_after_s: retry,
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
    let usage = usage.iter().map(|&(kind, tokens, _)| priced_usage(&row, kind, tokens)).collect();
    let again = BudgetOp { version, row, action: BudgetAction::Settle { usage }, ..op.clone() };
    match store.budget(&again).await? {
        BudgetOutcome::Reprice { .. } => {
            Err(StoreError::Protocol("a hold changed price version twice".into()))
        }
        outcome => Ok(outcome),
    }
}

// What a settlement or cancel found of its hold, as a metric label.
fn had_label(had: &HadHold) -> &'static str {
    match had {
        HadHold::Open => "open",
        HadHold::Expired => "expired",
        HadHold::Settled => "settled",
        HadHold::None => "none",
    }
}

// `tokens` of `kind` and what they cost at `row`'s prices, as a settlement carries them.
fn priced_usage(row: &PriceRow, kind: Kind, tokens: u64) -> (Kind, u64, Money) {
    (kind, tokens, cost(tokens, row.price(kind)))
}

// Whether `entries` are a settlement of the request `path` names.
fn settles(entries: &[(&str, &str)], path: &[(&str, &str)]) -> bool {
    entries.len() == path.len() + 1 && entries.starts_with(path)
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
