//! A region replica's money leases of global budgets, and the discipline that keeps its spending
//! within them (see [`super::global`] for the design and the bound): what each lease was
//! granted, what demand asks of it, and when it is renewed, grown or shrunk.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::budget::{LeaseReading, LeaseReport, LevelOp, Money};

/// How long a money lease lives at the global tier after its renewal arrived (here, after it was
/// sent); not renewed by then, the global tier charges its unspent part whole.
pub const BUDGET_LEASE_TTL: Duration = Duration::from_secs(10);
/// Most levels one renewal call may carry, and most leases a replica holds.
pub const MAX_BUDGET_LEASES: usize = 10_000;
/// A lease is renewed, when nothing else calls for it, once it has this little left to live.
const RENEW_BEFORE_MS: u64 = 6_000;
/// The window demand is counted in (over the last one and the current one).
const DEMAND_WINDOW_MS: u64 = 2_000;
/// How many seconds of demand a lease is granted beyond what is committed.
const AHEAD_S: u128 = 5;
/// A lease not asked for this long is given back (its unspent part released at the global
/// tier), and forgotten after [`FORGET_MS`].
const IDLE_MS: u64 = 60_000;
const FORGET_MS: u64 = 300_000;

/// One level's renewal of a round.
#[derive(Debug, Clone)]
pub struct BudgetRenewal {
    /// The budget level's key at the global tier (the table's key here).
    pub key: String,
    /// The priced domain.
    pub domain: String,
    /// The descriptor entries down to the level.
    pub entries: Vec<(String, String)>,
    /// The period's end (ms), this replica's clock.
    pub period_end_ms: i64,
    /// What this replica spent in the period, and wants granted in all.
    pub report: LeaseReport,
    /// A shrink: the cap set before it is lifted once it is answered.
    pub shrink: bool,
}

/// The global tier's answer for one level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetGrant {
    /// The lease and the level after it.
    pub reading: LeaseReading,
    /// The budget's amount.
    pub amount: Money,
    /// How long the lease lives after the renewal, in milliseconds.
    pub ttl_ms: u64,
}

/// This replica's money leases of global budgets.
pub struct GlobalBudgets {
    leaseholder: String,
    pub(super) first_lease_wait: Duration,
    table: Mutex<HashMap<String, MoneyLease>>,
    /// Woken when a level wants its first lease now.
    pub wanted: tokio::sync::Notify,
    /// Sent after every round (its time, ms).
    pub renewed: tokio::sync::watch::Sender<u64>,
    // Rounds made so far.
    rounds: AtomicU64,
    // Set at drain: every lease is handed back down to what is committed.
    ending: AtomicBool,
}

#[derive(Debug)]
struct MoneyLease {
    domain: String,
    entries: Vec<(String, String)>,
    // This replica's ledger of the level (its amount unused: a peek reads it).
    local: LevelOp,
    end_ms: i64,
    // From the last answer: the grant, and the budget's money nobody holds or spent.
    granted: Option<Money>,
    unleased: Money,
    expires_ms: u64,
    // The budget worldwide as the last answer gave it: spent, held (every lease's unspent part
    // included), and when that answer's round was sent.
    world: Option<(Money, Money, u64)>,
    // A shrink under way: holds are admitted under it until the smaller grant is answered.
    cap: Option<Money>,
    // Holds of this replica on their way to the store under the current amount.
    in_flight: u32,
    // Money asked for (holds tried) in the current and the last window, and the largest hold.
    asked: [Money; 2],
    window_ms: u64,
    largest: Money,
    used_ms: u64,
    // Money held here at the last look: holds still open, which the lease must outlive.
    held: Money,
}

impl MoneyLease {
    // What a hold may be admitted under now: the grant (or the cap below it), while it lives.
    fn amount(&self, now_ms: u64) -> Option<Money> {
        let granted = self.granted.filter(|_| now_ms < self.expires_ms)?;
        Some(self.cap.map_or(granted, |cap| cap.min(granted)))
    }

    fn ask(&mut self, amount: Money, now_ms: u64) {
        let window = now_ms / DEMAND_WINDOW_MS;
        if window != self.window_ms {
            let last = if window == self.window_ms + 1 { self.asked[0] } else { Money::ZERO };
            self.asked = [Money::ZERO, last];
            self.window_ms = window;
        }
        self.asked[0] = self.asked[0] + amount;
        self.largest = self.largest.max(amount);
        self.used_ms = now_ms;
    }

    // What to grant beyond the committed money: a few seconds of demand, at least two of the
    // largest hold; nothing once idle. Once the budget is scarce, no more than half of what
    // nobody holds (as the last answer said), so that the last of a budget is split between
    // the regions that want it rather than taken whole by the first to ask (a lease above what
    // it may ask is shrunk to it).
    fn ahead(&self, now_ms: u64) -> Money {
        if now_ms.saturating_sub(self.used_ms) > IDLE_MS {
            return Money::ZERO;
        }
        let per_window = self.asked[0] + self.asked[1];
        let demand = Money(per_window.0 * AHEAD_S * 1000 / (2 * u128::from(DEMAND_WINDOW_MS)));
        let least = self.largest + self.largest;
        let wanted = demand.max(least);
        match self.granted {
            Some(_) => wanted.min(Money(self.unleased.0 / 2).max(least)),
            None => wanted,
        }
    }
}

/// A global level of a request: its index in the op's levels, and its lease's key.
#[derive(Debug, Clone)]
pub(super) struct LeasedLevel {
    pub index: usize,
    pub key: String,
    pub domain: String,
    pub entries: Vec<(String, String)>,
}

/// Holds of this replica on their way to the store, counted down when dropped.
pub(super) struct InFlight {
    budgets: Arc<GlobalBudgets>,
    keys: Vec<String>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut table = self.budgets.table();
        for key in &self.keys {
            if let Some(lease) = table.get_mut(key) {
                lease.in_flight = lease.in_flight.saturating_sub(1);
            }
        }
    }
}

impl GlobalBudgets {
    /// Money leases held as `leaseholder` (`<region>/<replica>`), a hold on a level without a
    /// live lease waiting up to `first_lease_wait` for its first.
    pub fn new(leaseholder: String, first_lease_wait: Duration) -> Self {
        GlobalBudgets {
            leaseholder,
            first_lease_wait,
            table: Mutex::default(),
            wanted: tokio::sync::Notify::new(),
            renewed: tokio::sync::watch::Sender::new(0),
            rounds: AtomicU64::new(0),
            ending: AtomicBool::new(false),
        }
    }

    /// At drain, once no request is decided here any more: the next round hands every lease
    /// back down to the money committed (spent, and held for requests this replica answered),
    /// so that the global tier, when the lease lapses, charges that and not the whole grant.
    pub fn end(&self) {
        self.ending.store(true, Ordering::Relaxed);
    }

    /// The name this replica leases under.
    pub fn leaseholder(&self) -> &str {
        &self.leaseholder
    }

    // The next round's number (rising: the global tier keeps the last it applied).
    pub(super) fn next_round(&self) -> u64 {
        self.rounds.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, MoneyLease>> {
        // A panic elsewhere while holding the lock leaves the table as it was.
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    // The amounts a hold of `amount` may be admitted under at `levels` (`None`: no live lease),
    // its demand counted and, when every level has one, its flight begun.
    pub(super) fn take(
        self: &Arc<Self>,
        levels: &[(LeasedLevel, LevelOp)],
        amount: Money,
        now_ms: u64,
    ) -> (Vec<Option<Money>>, Option<InFlight>) {
        let mut table = self.table();
        let mut amounts = Vec::with_capacity(levels.len());
        for (level, local) in levels {
            let end_ms = local.around[2];
            let fresh = |local: &LevelOp| MoneyLease {
                domain: level.domain.clone(),
                entries: level.entries.clone(),
                local: local.clone(),
                end_ms,
                granted: None,
                unleased: Money::ZERO,
                expires_ms: 0,
                world: None,
                cap: None,
                in_flight: 0,
                asked: [Money::ZERO; 2],
                window_ms: 0,
                largest: Money::ZERO,
                used_ms: now_ms,
                held: Money::ZERO,
            };
            if table.len() >= MAX_BUDGET_LEASES && !table.contains_key(&level.key) {
                metrics::counter!("tollgate_global_shares_refused_total").increment(1);
                amounts.push(None);
                continue;
            }
            let lease = table.entry(level.key.clone()).or_insert_with(|| fresh(local));
            // A new period is a new ledger here and at the global tier.
            if lease.end_ms != end_ms {
                *lease = fresh(local);
            }
            lease.ask(amount, now_ms);
            amounts.push(lease.amount(now_ms));
        }
        if amounts.iter().any(Option::is_none) {
            return (amounts, None);
        }
        let keys: Vec<String> = levels.iter().map(|(l, _)| l.key.clone()).collect();
        for key in &keys {
            table.get_mut(key).expect("just taken").in_flight += 1;
        }
        (amounts, Some(InFlight { budgets: self.clone(), keys }))
    }

    // The money nobody holds or spent at the global tier, as the last answer for `key` said.
    /// This replica's money lease of the global level `key` as `/budgets` shows it: its grant
    /// (none while it has no live one), and the budget's spent and held money worldwide with
    /// when the global tier said so (none before its first answer).
    pub(super) fn view(&self, key: &str, now_ms: u64) -> (Option<Money>, Option<(Money, Money, u64)>) {
        self.table().get(key).map_or((None, None), |l| (l.amount(now_ms), l.world))
    }

    pub(super) fn unleased(&self, key: &str) -> Money {
        self.table().get(key).map_or(Money::ZERO, |l| l.unleased)
    }

    // The leases due a look this round: their keys and ledgers here. Leases of a period that
    // ended, or long idle, are forgotten (at the global tier, what they left unspent is charged
    // when they lapse).
    // An idle lease is looked at every fifth round only: it has been given back or soon will
    // be, and what is left to report is settlements of its last holds.
    pub(super) fn due(&self, round: u64, now_ms: u64) -> Vec<(String, LevelOp)> {
        let mut table = self.table();
        table.retain(|_, l| {
            let busy = l.in_flight > 0 || l.held > Money::ZERO;
            l.end_ms > now_ms as i64 && (now_ms.saturating_sub(l.used_ms) < FORGET_MS || busy)
        });
        table
            .iter()
            .filter(|(_, l)| {
                round.is_multiple_of(5)
                    || now_ms.saturating_sub(l.used_ms) <= IDLE_MS
                    || self.ending.load(Ordering::Relaxed)
            })
            .map(|(k, l)| (k.clone(), l.local.clone()))
            .collect()
    }

    // The renewal of `key` given its ledger's `spent` and `held` money here, read after the
    // last change of its cap; `None` when it needs none this round.
    pub(super) fn plan(
        &self,
        key: &str,
        spent: Money,
        held: Money,
        round: u64,
        now_ms: u64,
    ) -> Option<BudgetRenewal> {
        let mut table = self.table();
        let lease = table.get_mut(key)?;
        lease.held = held;
        let committed = spent + held;
        let ahead = lease.ahead(now_ms);
        let target = committed + ahead;
        let (wanted, shrink) = match (lease.granted, lease.cap) {
            (None, _) if self.ending.load(Ordering::Relaxed) => return None,
            (Some(_), _) if self.ending.load(Ordering::Relaxed) => {
                // Handed back: nothing is admitted here any more, so nothing beyond it.
                lease.cap = Some(committed);
                (committed, true)
            }
            (None, _) => (target, false),
            // Everything committed since the cap was set was admitted under it.
            (Some(_), Some(cap)) => (cap.max(committed), true),
            // Grown once less than half of what demand wants ahead is left, so that a lease
            // spent from steadily is renewed every few seconds, not every round.
            (Some(granted), None) if committed + Money(ahead.0 / 2) > granted => (target, false),
            (Some(granted), None) if granted.saturating_sub(target) > ahead && lease.in_flight == 0 => {
                // More than twice what demand wants: shrink, the cap first. With nothing in
                // flight, every hold admitted before it is in the next round's reading.
                lease.cap = Some(target);
                return None;
            }
            (Some(granted), None) => {
                // Kept alive while the global tier holds any of it unspent (open holds here
                // included: it would lapse and be charged whole before they settle).
                let nothing_held_there = granted <= spent && ahead == Money::ZERO;
                let ending = lease.expires_ms.saturating_sub(now_ms) < RENEW_BEFORE_MS;
                if !ending || nothing_held_there {
                    return None;
                }
                (granted, false)
            }
        };
        Some(BudgetRenewal {
            key: key.to_owned(),
            domain: lease.domain.clone(),
            entries: lease.entries.clone(),
            period_end_ms: lease.end_ms,
            report: LeaseReport { spent, wanted, round },
            shrink,
        })
    }

    /// Takes the global tier's answers to a round sent at `sent_ms` (`None`: no global budget
    /// there, or the call failed, in which case the leases keep the life they have).
    pub fn answered(&self, answers: Vec<(BudgetRenewal, Option<BudgetGrant>)>, sent_ms: u64) {
        let mut table = self.table();
        for (renewal, grant) in answers {
            let Some(lease) = table.get_mut(&renewal.key) else { continue };
            let Some(grant) = grant else {
                lease.granted = None;
                continue;
            };
            if renewal.shrink {
                lease.cap = None;
            }
            if grant.reading.end_ms == lease.end_ms {
                lease.granted = Some(grant.reading.granted);
                lease.expires_ms = sent_ms + grant.ttl_ms;
                lease.unleased = grant.amount.saturating_sub(grant.reading.spent + grant.reading.held);
                lease.world = Some((grant.reading.spent, grant.reading.held, sent_ms));
            } else {
                // The global tier is in another period (clocks apart at its turn): no lease.
                lease.granted = None;
            }
        }
        metrics::gauge!("tollgate_global_budget_leases").set(table.len() as f64);
        drop(table);
        self.renewed.send_replace(sent_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(granted: Option<Money>) -> MoneyLease {
        MoneyLease {
            domain: "llm".into(),
            entries: vec![("org".into(), "acme".into())],
            local: LevelOp {
                base: "b".into(),
                amount: Money::ZERO,
                around: [0, 0, i64::MAX, i64::MAX],
                alerts: vec![],
            },
            end_ms: i64::MAX,
            granted,
            unleased: Money(100_000),
            expires_ms: 10_000,
            world: None,
            cap: None,
            in_flight: 0,
            asked: [Money(1_000), Money::ZERO],
            window_ms: 0,
            largest: Money(100),
            used_ms: 0,
            held: Money::ZERO,
        }
    }

    fn budgets_with(lease: MoneyLease) -> GlobalBudgets {
        let budgets = GlobalBudgets::new("eu/a".into(), Duration::ZERO);
        budgets.table().insert("k".into(), lease);
        budgets
    }

    #[test]
    fn a_lease_grows_by_demand_and_shrinks_only_through_a_cap_set_with_nothing_in_flight() {
        // 1,000 asked over two 2 s windows: 1,250 over 5 s ahead of what is committed.
        let budgets = budgets_with(lease(Some(Money(1_000))));
        let r = budgets.plan("k", Money(400), Money(100), 1, 0).expect("a growth");
        assert_eq!((r.report.spent, r.report.wanted, r.shrink), (Money(400), Money(1_750), false));

        // Granted far more than wanted, a hold in flight: no shrink yet, and not due.
        let mut big = lease(Some(Money(100_000)));
        big.in_flight = 1;
        let budgets = budgets_with(big);
        assert!(budgets.plan("k", Money(400), Money(100), 1, 0).is_none());
        assert_eq!(budgets.table()["k"].cap, None);
        // Nothing in flight: the cap first (holds admitted under it), the renewal the next round,
        // never below what is committed then.
        budgets.table().get_mut("k").unwrap().in_flight = 0;
        assert!(budgets.plan("k", Money(400), Money(100), 1, 0).is_none());
        assert_eq!(budgets.table()["k"].cap, Some(Money(1_750)));
        assert_eq!(budgets.table()["k"].amount(0), Some(Money(1_750)));
        let r = budgets.plan("k", Money(900), Money(1_000), 2, 1_000).expect("the shrink");
        assert_eq!((r.report.wanted, r.shrink), (Money(1_900), true));
        let grant = BudgetGrant {
            reading: LeaseReading {
                granted: Money(1_900),
                spent: Money(5_000),
                held: Money(2_000),
                end_ms: i64::MAX,
            },
            amount: Money(10_000),
            ttl_ms: 10_000,
        };
        budgets.answered(vec![(r, Some(grant))], 1_000);
        let after = &budgets.table()["k"];
        assert_eq!((after.cap, after.granted, after.unleased), (None, Some(Money(1_900)), Money(3_000)));
    }

    #[test]
    fn an_idle_lease_is_given_back_and_then_left_alone() {
        let mut idle = lease(Some(Money(5_000)));
        idle.expires_ms = 0;
        let budgets = budgets_with(idle);
        let now = IDLE_MS + 1;
        assert!(budgets.plan("k", Money(300), Money(0), 1, now).is_none(), "the cap first");
        let r = budgets.plan("k", Money(300), Money(0), 1, now).expect("given back");
        assert_eq!((r.report.wanted, r.shrink), (Money(300), true));
        let grant = BudgetGrant {
            reading: LeaseReading {
                granted: Money(300),
                spent: Money(300),
                held: Money(0),
                end_ms: i64::MAX,
            },
            amount: Money(10_000),
            ttl_ms: 10_000,
        };
        budgets.answered(vec![(r, Some(grant))], now);
        budgets.table().get_mut("k").unwrap().expires_ms = 0;
        assert!(budgets.plan("k", Money(300), Money(0), 1, now + 1).is_none(), "nothing held there to renew");
        // A hold still open when it was given back: renewed as it ends, and not forgotten, so
        // that the global tier does not charge it whole before it settles.
        let r = budgets.plan("k", Money(200), Money(100), 2, now + 2).expect("kept alive");
        assert_eq!((r.report.spent, r.report.wanted), (Money(200), Money(300)));
        assert_eq!(budgets.due(5, now + FORGET_MS + 1).len(), 1, "not forgotten while a hold is open");
    }
}
