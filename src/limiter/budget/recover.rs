//! Exactly once for budget ops whose answer was lost: a hold whose request the failure mode did
//! not admit is cancelled, a settlement sent again, both in the background; and a settlement of
//! a hold made at another price version priced again at that version's row.

use super::{BudgetAction, BudgetOp, BudgetOutcome, StoreError};
use crate::budget::cost;
use crate::config::{Domain, FailureMode};
use crate::limiter::repair::{self, Repair};
use crate::limiter::Limiter;
use crate::store::Store;

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
            BudgetAction::Cancel | BudgetAction::Peek | BudgetAction::Lease { .. } => return,
        };
        let store = self.store.clone();
        let repair = Repair {
            metric: "tollgate_budget_recoveries_total",
            domain: domain.name.clone(),
            kind,
            otherwise: "a budget op could not be repaired; the hold expires as on_lost_settle says",
        };
        repair::spawn(repair, move || {
            let (store, op) = (store.clone(), op.clone());
            async move { call(store.as_ref(), &op).await }
        });
    }
}

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
