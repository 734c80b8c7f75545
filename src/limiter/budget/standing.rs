//! Where a priced domain's budgets stand (`GET /budgets`): for the levels a caller names, each
//! budget's period, amount (an override applied), and the money spent, held and left, read from
//! the store by a read-only budget op ([`BudgetAction::Peek`]) that changes nothing. In a region,
//! a global budget's money is not in the region's store but at the global tier: its level shows
//! the budget worldwide as the global tier last answered this replica, beside this replica's
//! money lease and its own ledger of it.

use serde::Serialize;

use super::Limiter;
use crate::budget::{BudgetAction, BudgetOp, BudgetOutcome, LevelOp, LostSettle};
use crate::identity;
use crate::store::StoreError;

/// One budget level's standing in its current period.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LevelStanding {
    /// The level's descriptor key (`org`, `team`, ...).
    pub level: String,
    /// Its value on the path asked.
    pub value: String,
    /// When the period began and ends (RFC 3339).
    pub period_start: String,
    /// When the period ends (RFC 3339).
    pub period_end: String,
    /// The amount a period allows, as decimal text.
    pub amount: String,
    /// Spent in the period.
    pub spent: String,
    /// Held by requests in flight.
    pub held: String,
    /// Left: amount - spent - held, never negative.
    pub left: String,
    /// In a region, for a global budget: this replica's money lease. `spent`, `held` and `left`
    /// are then the budget's worldwide, as the global tier last answered ("unknown" before).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseStanding>,
}

/// A region replica's money lease of a global budget, as `/budgets` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeaseStanding {
    /// The leaseholder (`<region>/<replica>`).
    pub holder: String,
    /// What the global tier granted it for the period ("none" while it holds no live lease).
    pub granted: String,
    /// What it spent of it (its own ledger in the region's store).
    pub spent: String,
    /// What it holds of it for requests in flight (the same ledger).
    pub held: String,
    /// When the round that brought the worldwide figures was sent (RFC 3339), if one did.
    pub as_of: Option<String>,
}

/// The standing of every budget on a path.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Standing {
    /// The domain.
    pub domain: String,
    /// The price table's currency.
    pub currency: String,
    /// One per budget on the path, top first.
    pub levels: Vec<LevelStanding>,
}

/// Why a standing could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StandingError {
    /// The domain is not configured, or has no prices.
    #[error("'{0}' is not a priced domain")]
    NotPriced(String),
    /// The levels named do not form a path from the top of the domain's tree.
    #[error("{0}")]
    Path(String),
    /// The store failed.
    #[error("reading the budgets: {0}")]
    Store(#[from] StoreError),
}

impl Limiter {
    /// The standing of the budgets on the path that `levels` (descriptor key, value) name in
    /// priced `domain`, in any order: each is placed at its level of the tree, from the top.
    pub async fn standing(&self, domain: &str, levels: &[(&str, &str)]) -> Result<Standing, StandingError> {
        let rules = self.rules.load_full();
        let (Some(domain), true) =
            (rules.domain(domain), rules.domain(domain).is_some_and(|d| d.priced.is_some()))
        else {
            return Err(StandingError::NotPriced(domain.to_owned()));
        };
        let priced = domain.priced.as_ref().expect("checked above");
        // The path: at each level of the tree, the entry whose key names a node there.
        let mut path: Vec<(&str, &str)> = Vec::new();
        let mut level = &domain.root;
        while let Some(&entry) = levels
            .iter()
            .find(|(k, _)| !path.iter().any(|(p, _)| p == k) && level.nodes().iter().any(|n| n.key == *k))
        {
            path.push(entry);
            let Some(nodes) = domain.root.path(&path) else { break };
            level = &nodes.last().expect("one per entry").children;
        }
        if path.len() != levels.len() || path.is_empty() || domain.root.path(&path).is_none() {
            // Say what to give: the keys of the level where the path stopped.
            let next: Vec<&str> = level.nodes().iter().map(|n| n.key.as_str()).collect();
            let placed: Vec<&str> = path.iter().map(|(k, _)| *k).collect();
            let so_far =
                if placed.is_empty() { String::new() } else { format!(" after {}", placed.join(", ")) };
            return Err(StandingError::Path(format!(
                "name the budget's levels of domain '{}' from the top, as KEY=VALUE: next{so_far}, one of {}",
                domain.name,
                next.join(", ")
            )));
        }
        let nodes = domain.root.path(&path).expect("walked above");
        let overrides = self.budget_overrides(domain, std::iter::once(&path[..])).await;
        let now = self.clock.now_ms() as i64;
        let mut ops = Vec::new();
        let mut names = Vec::new();
        // Per level, the global level's key whose lease this replica's ledger is, in a region.
        let mut leased: Vec<Option<String>> = Vec::new();
        for (depth, node) in nodes.iter().enumerate() {
            let Some(budget) = &node.budget else { continue };
            let entries = &path[..=depth];
            let (amount, calendar) = super::amount_and_calendar(budget, &overrides, entries);
            let base = identity::budget_level(domain, entries);
            let (base, lease_of) = match (&self.budgets, budget.global) {
                (Some(budgets), true) => (identity::budget_lease(&base, budgets.leaseholder()), Some(base)),
                _ => (base, None),
            };
            leased.push(lease_of);
            ops.push((LevelOp { base, amount, around: calendar.around(now), alerts: Vec::new() }, calendar));
            names.push(entries[depth]);
        }
        let levels = ops.iter().map(|(l, _)| l.clone()).collect();
        let record = identity::budget_record(domain, &path, "");
        let op = BudgetOp::on_levels(record, levels, LostSettle::Charge, 0, BudgetAction::Peek);
        let BudgetOutcome::Peeked { levels: read, .. } = self.store.budget(&op).await? else {
            return Err(StandingError::Store(StoreError::Protocol(
                "a peek answered with another outcome".into(),
            )));
        };
        let levels = read
            .iter()
            .zip(&ops)
            .zip(names)
            .zip(&leased)
            .map(|((((spent, held, end), (level, calendar)), (key, value)), lease_of)| {
                let window = calendar.window(end - 1);
                let mut standing = LevelStanding {
                    level: key.to_owned(),
                    value: value.to_owned(),
                    period_start: rfc3339(window.start_ms),
                    period_end: rfc3339(*end),
                    amount: level.amount.to_string(),
                    spent: spent.to_string(),
                    held: held.to_string(),
                    left: level.amount.saturating_sub(*spent + *held).to_string(),
                    lease: None,
                };
                if let (Some(key), Some(budgets)) = (lease_of, &self.budgets) {
                    let (granted, world) = budgets.view(key, self.clock.now_ms());
                    standing.lease = Some(LeaseStanding {
                        holder: budgets.leaseholder().to_owned(),
                        granted: granted.map_or_else(|| "none".to_owned(), |g| g.to_string()),
                        spent: spent.to_string(),
                        held: held.to_string(),
                        as_of: world.map(|(_, _, at)| rfc3339(at as i64)),
                    });
                    let unknown = || "unknown".to_owned();
                    standing.spent = world.map_or_else(unknown, |(s, _, _)| s.to_string());
                    standing.held = world.map_or_else(unknown, |(_, h, _)| h.to_string());
                    standing.left = world
                        .map_or_else(unknown, |(s, h, _)| level.amount.saturating_sub(s + h).to_string());
                }
                standing
            })
            .collect();
        Ok(Standing { domain: domain.name.clone(), currency: priced.prices.currency.clone(), levels })
    }
}

// Milliseconds since the epoch as an RFC 3339 instant.
fn rfc3339(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms).map_or_else(|_| ms.to_string(), |t| t.to_string())
}
