//! Global money budgets (`global: true` on a node with `budget:` in a priced domain): one budget
//! for every region, which each region spends from money leases of it, deciding its requests
//! with no cross-region round trip (`docs/src/design/global-limits.md`).
//!
//! **In a region** (`--global-url`) each replica leases, as `<region>/<replica>`, every global
//! budget level its requests reach. A priced request is held and settled as anywhere, every
//! level in one store step, but a global level's ledger is this replica's own in the region's
//! store (`<level>:lease:<holder>`, [`identity::budget_lease`]), with the amount the global tier
//! granted it: a hold is admitted only while this replica's spent and held money leave it room
//! under its grant. A settlement that reaches another replica of the region charges the ledger
//! the hold was taken from (the request's record names it). Every round the replica reads its
//! ledgers and renews: it reports each one's spend (a total, so a renewal sent twice charges
//! once) and asks for what it has committed plus a few seconds of its demand.
//!
//! **At the global tier** a renewal is a lease op on the budget's own ledger
//! ([`BudgetAction::Lease`]): the unspent part of every lease is held there beside the global
//! tier's own requests' holds, so that grants and spend together stay within the amount; a lease
//! not renewed within its life is charged whole (its holder may have spent it all).
//!
//! **The bound**: a replica never commits (spends or holds) more than it is granted, and the
//! global tier never grants more than the amount leaves, so the world's spend in a period exceeds
//! the amount by no more than the per-request overshoot a budget has anyway. What keeps it:
//! * one renewal per ledger in flight (one round at a time per replica);
//! * a growth is used only once granted, and never lowered by the global tier;
//! * a shrink is applied here first: the lower cap is set while no hold of this replica is on
//!   its way to the store, the committed money read after that, and only then the smaller grant
//!   asked for, never below what is committed;
//! * a lease lives here its life from the renewal's sending, at the global tier from its
//!   arrival, so it ends here first; cut off past it, a global level denies.

use std::sync::Arc;

use super::money_lease::{
    BudgetGrant, BudgetRenewal, GlobalBudgets, InFlight, LeasedLevel, BUDGET_LEASE_TTL,
};
use super::{amount_and_calendar, Limiter};
use crate::budget::{
    BudgetAction, BudgetOp, BudgetOutcome, LeaseReading, LeaseReport, LevelOp, LostSettle, Money,
    RECORD_GRACE_MS,
};
use crate::identity;
use crate::store::StoreError;

impl Limiter {
    /// The same limiter deciding global budgets on `budgets` (a region's money leases).
    pub fn with_global_budgets(self, budgets: Arc<GlobalBudgets>) -> Self {
        Limiter { budgets: Some(budgets), ..self }
    }

    // The amounts a hold's global levels may be admitted under, set in `op`: this replica's
    // grants, waiting briefly for a first lease; a level without one gets nothing (the store
    // denies there). The flight ends when the returned guard drops, after the store answered.
    pub(super) async fn lease_amounts(
        &self,
        op: &mut BudgetOp,
        leased: &[LeasedLevel],
        amount: Money,
    ) -> Option<InFlight> {
        let budgets = self.budgets.as_ref()?;
        if leased.is_empty() {
            return None;
        }
        let levels: Vec<(LeasedLevel, LevelOp)> =
            leased.iter().map(|l| (l.clone(), op.levels[l.index].clone())).collect();
        let (mut amounts, mut flight) = budgets.take(&levels, amount, self.clock.now_ms());
        if flight.is_none() {
            let mut renewed = budgets.renewed.subscribe();
            renewed.mark_unchanged();
            budgets.wanted.notify_one();
            let _ = tokio::time::timeout(budgets.first_lease_wait, renewed.changed()).await;
            (amounts, flight) = budgets.take(&levels, Money::ZERO, self.clock.now_ms());
        }
        for (level, amount) in leased.iter().zip(amounts) {
            if amount.is_none() {
                // No lease: the level denies (a budget's only fallback).
                metrics::counter!("tollgate_global_fallbacks_total", "fallback" => "deny").increment(1);
            }
            op.levels[level.index].amount = amount.unwrap_or(Money::ZERO);
        }
        flight
    }

    // The global levels of a request whose levels are `levels` (its level paths `entries`,
    // flags `global`): their ledgers here replace the global ones in the op.
    pub(super) fn leased_levels(
        &self,
        domain: &str,
        levels: &mut [LevelOp],
        level_entries: &[(Vec<(String, String)>, bool)],
    ) -> Vec<LeasedLevel> {
        let Some(budgets) = &self.budgets else { return Vec::new() };
        let mut leased = Vec::new();
        for (index, (level, (entries, global))) in levels.iter_mut().zip(level_entries).enumerate() {
            if !global {
                continue;
            }
            let key = std::mem::take(&mut level.base);
            level.base = identity::budget_lease(&key, budgets.leaseholder());
            leased.push(LeasedLevel { index, key, domain: domain.to_owned(), entries: entries.clone() });
        }
        leased
    }

    /// The money the global tier's last answer left unheld and unspent at the level `key`.
    pub(super) fn unleased(&self, key: &str) -> Money {
        self.budgets.as_ref().map_or(Money::ZERO, |b| b.unleased(key))
    }

    /// This round's renewals of the replica's money leases: each due ledger read here, its
    /// renewal sized by what it committed and its demand.
    pub async fn budget_renewals(&self) -> Vec<BudgetRenewal> {
        let Some(budgets) = &self.budgets else { return Vec::new() };
        let mut renewals = Vec::new();
        let round = budgets.next_round();
        for (key, local) in budgets.due(round, self.clock.now_ms()) {
            let op = BudgetOp::on_levels(
                local.base.clone(),
                vec![local],
                LostSettle::Charge,
                0,
                BudgetAction::Peek,
            );
            match self.store.budget(&op).await {
                Ok(BudgetOutcome::Peeked { now_ms, levels, .. }) => {
                    let Some(&(spent, held, _)) = levels.first() else { continue };
                    renewals.extend(budgets.plan(&key, spent, held, round, now_ms));
                }
                Ok(_) => {}
                Err(error) => {
                    // Not renewed this round: the lease keeps the life it has.
                    tracing::warn!(error = %crate::telemetry::logs::ErrorChain(&error), "could not read this replica's ledger of a global budget");
                }
            }
        }
        renewals
    }

    /// At the global tier: sets `holder`'s money lease of the global budget that `entries` of
    /// `domain` reach, in the period ending at `period_end_ms` (the region's clock), to
    /// `report`. `None` when no global budget is there; a grant of nothing, in the global tier's
    /// period, when the periods differ (clocks apart at the period's turn).
    pub async fn lease_budget(
        &self,
        domain: &str,
        entries: &[(&str, &str)],
        holder: &str,
        period_end_ms: i64,
        report: LeaseReport,
    ) -> Option<Result<BudgetGrant, StoreError>> {
        let rules = self.rules.load_full();
        let domain = rules.domain(domain)?;
        let priced = domain.priced.as_ref()?;
        let budget = domain.root.path(entries)?.last()?.budget.as_ref().filter(|b| b.global)?;
        let overrides = self.budget_overrides(domain, std::iter::once(entries)).await;
        let (amount, calendar) = amount_and_calendar(budget, &overrides, entries);
        // No region spends or asks more than the whole budget: a report above it (2^64-1 nanos
        // was accepted) is cut to it, and counted.
        if report.spent > amount || report.wanted > amount {
            metrics::counter!("tollgate_global_reports_cut_total").increment(1);
        }
        let report =
            LeaseReport { spent: report.spent.min(amount), wanted: report.wanted.min(amount), ..report };
        let around = calendar.around(self.clock.now_ms() as i64);
        let ttl_ms = BUDGET_LEASE_TTL.as_millis() as u64;
        if around[2] != period_end_ms {
            let reading = LeaseReading {
                granted: Money::ZERO,
                spent: Money::ZERO,
                held: Money::ZERO,
                end_ms: around[2],
            };
            return Some(Ok(BudgetGrant { reading, amount, ttl_ms }));
        }
        let level = LevelOp {
            base: identity::budget_level(domain, entries),
            amount,
            around,
            alerts: budget.alerts(amount),
        };
        let life_ms = priced.hold_ttl.as_millis() as u64 + RECORD_GRACE_MS;
        let lease = BudgetAction::Lease { holder: holder.to_owned(), ttl_ms, reports: vec![report] };
        let op = BudgetOp::on_levels(level.base.clone(), vec![level], priced.on_lost_settle, life_ms, lease);
        Some(match self.store.budget(&op).await {
            Ok(BudgetOutcome::Leased { levels, .. }) => match levels.first() {
                Some(reading) => Ok(BudgetGrant { reading: *reading, amount, ttl_ms }),
                None => Err(StoreError::Protocol("a lease op answered no level".into())),
            },
            Ok(_) => Err(StoreError::Protocol("a lease op answered something else".into())),
            Err(error) => Err(error),
        })
    }
}
