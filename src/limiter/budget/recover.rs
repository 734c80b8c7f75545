//! Exactly once for budget ops whose answer was lost: a hold whose request the failure mode did
//! not admit is cancelled, a settlement sent again, both in the background; and a settlement of
//! a hold made at another price version priced again at that version's row.

use super::{BudgetAction, BudgetOp, BudgetOutcome, StoreError};
use crate::budget::cost;
use crate::config::{Domain, FailureMode};
use crate::limiter::Limiter;
use crate::store::Store;
use crate::telemetry::logs::ErrorChain;

impl Limiter {
    // After a failed op, in the background and under the background deadline: a hold whose
    // request the failure mode did not admit is cancelled (the script may have run and its reply
    // been lost: the request must take nothing), and a settlement is sent again (it is
    // idempotent per kind, and Envoy never resends it). What still fails is left to the hold's
    // expiry (`on_lost_settle`), logged and counted.
    pub(super) fn recover(&self, domain: &Domain, op: &BudgetOp) {
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
                match crate::store::in_background(RECOVERY_DEADLINE, call(store.as_ref(), &op)).await {
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
}

/// How often a failed hold's cancel or a failed settlement is tried again, how far apart, and how
/// long each try may take (no request waits on them).
const RECOVERY_ATTEMPTS: u32 = 3;
const RECOVERY_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);
const RECOVERY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

// One budget op; a settlement of a hold made at another price version is priced again at that
// version's row, which the store keeps with the hold.
pub(super) async fn call(store: &dyn Store, op: &BudgetOp) -> Result<BudgetOutcome, StoreError> {
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
