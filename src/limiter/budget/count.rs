//! What budget ops are counted as: metrics for spend, holds, settlements, cancels, expiries,
//! denials, refusals and alerts, and log lines for what an operator must hear of (a refused
//! record, a crossed soft limit, a store failure). Money metrics saturate, never wrap.

use std::time::Duration;

use super::Request;
use crate::budget::{BudgetAction, BudgetOutcome, HadHold, HoldVerdict, LevelReading, LostSettle, Money};
use crate::config::{Domain, Priced};
use crate::limiter::slots::{count_slots, SlotEvent};
use crate::limiter::{count_store_error, Limiter};
use crate::slot::SetsOutcome;
use crate::store::StoreError;
use crate::telemetry::logs::{self, ErrorChain};
use crate::telemetry::traces;

impl Limiter {
    // Spend, holds, settlements, cancels, expiries, denials, refusals and alerts, in metrics
    // and, for what an operator must hear of, logs.
    pub(super) fn count_budget(
        &self,
        domain: &Domain,
        priced: &Priced,
        request: &Request,
        outcome: &BudgetOutcome,
    ) {
        let name = domain.name.clone();
        let (released, expired) = match outcome {
            BudgetOutcome::Held { expired, .. } => (false, *expired),
            BudgetOutcome::Settled { had, expired, .. } | BudgetOutcome::Cancelled { had, expired, .. } => {
                (*had == HadHold::Open, *expired)
            }
            BudgetOutcome::Reprice { .. } | BudgetOutcome::Peeked { .. } | BudgetOutcome::Leased { .. } => {
                (false, 0)
            }
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
        // The ops that write a record: a hold taken (its settlement may extend its life by up
        // to its hold_ttl), and a settlement or cancel that found none.
        let life = Duration::from_millis(request.op.life_ms);
        let written = match outcome {
            BudgetOutcome::Held { verdict: HoldVerdict::Admitted, .. } => Some(life + priced.hold_ttl),
            BudgetOutcome::Settled { had: HadHold::None, .. }
            | BudgetOutcome::Cancelled { had: HadHold::None, .. } => Some(life),
            _ => None,
        };
        if let Some(kept) = written {
            self.telemetry.record_written(&name, kept);
        }
        let (slots, event) = match outcome {
            BudgetOutcome::Held { verdict: HoldVerdict::Admitted, slots, .. } => (slots, SlotEvent::Taken),
            BudgetOutcome::Held { slots, .. } => (slots, SlotEvent::Refused(slots.full)),
            BudgetOutcome::Settled { slots, .. } | BudgetOutcome::Cancelled { slots, .. } => {
                (slots, SlotEvent::Other)
            }
            BudgetOutcome::Reprice { .. } | BudgetOutcome::Peeked { .. } | BudgetOutcome::Leased { .. } => {
                (&SetsOutcome::default(), SlotEvent::Other)
            }
        };
        count_slots(domain, &request.set_nodes, &slots.readings, event);
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
                count_spend(name.clone(), &priced.prices.currency, &request.op.version, *charged);
                if *charged > Money::ZERO {
                    for (level, subject) in request.level_names.iter().zip(&request.level_subjects) {
                        self.telemetry.record_spend(&name, level, subject, charged.0);
                    }
                }
                alerts(domain, request, levels);
            }
            BudgetOutcome::Cancelled { had, .. } => {
                metrics::counter!("tollgate_budget_cancels_total", "domain" => name, "hold" => had_label(had))
                    .increment(1);
            }
            BudgetOutcome::Reprice { .. } | BudgetOutcome::Peeked { .. } | BudgetOutcome::Leased { .. } => {}
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
            let threshold = fraction.fraction_text();
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

// What a settlement or cancel found of its hold, as a metric label.
fn had_label(had: &HadHold) -> &'static str {
    match had {
        HadHold::Open => "open",
        HadHold::Expired => "expired",
        HadHold::Settled => "settled",
        HadHold::None => "none",
        HadHold::Other => "other",
    }
}

// A hold's verdict, as a metric label.
fn verdict_label(verdict: HoldVerdict) -> &'static str {
    match verdict {
        HoldVerdict::Admitted => "admitted",
        HoldVerdict::Duplicate => "duplicate",
        HoldVerdict::Reused => "reused",
        HoldVerdict::Denied => "denied",
    }
}

pub(super) fn count_refusal(domain: &Domain, reason: &'static str) {
    metrics::counter!("tollgate_budget_refusals_total", "domain" => domain.name.clone(), "reason" => reason)
        .increment(1);
}

// A budget op the store failed: counted and logged as every store failure is.
pub(super) fn budget_store_failed(domain: &Domain, error: &StoreError) {
    count_store_error(domain, if matches!(error, StoreError::Timeout(_)) { "timeout" } else { "error" });
    if let Some(held_back) = logs::throttled("budget_store_failed") {
        let mode = domain.failure_mode;
        tracing::warn!(domain = %domain.name, error = %ErrorChain(error), failure_mode = %mode, held_back, "store failed on a budget; applying the failure mode");
    }
}
