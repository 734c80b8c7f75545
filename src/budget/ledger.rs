//! The budget arithmetic in Rust: the memory store's state, step for step the twin of
//! `store/redis/budget.lua` (the same keys, expiries and order of effects), which
//! `tests/equivalence.rs` holds it to.
//!
//! State is what the Lua script keeps in Redis keys: per level and period its spent and held
//! money and its open holds by expiry; per request its record. Entries expire as those keys do,
//! and an expired entry reads as a missing one.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{
    BudgetAction, BudgetOp, BudgetOutcome, HadHold, HoldVerdict, LeaseReading, LevelReading, LostSettle,
    Money, PriceRow,
};
use crate::bucket::{BucketOp, Charge, Group, GroupOutcome, Role};
use crate::slot::{SetsOutcome, Slots};
use crate::sweep::sweep_map;

/// Every level's and request's state.
#[derive(Debug, Default)]
pub struct Ledger {
    levels: HashMap<String, Level>,
    records: HashMap<String, Record>,
    // Expired entries are dropped when the maps have doubled since the last time: memory follows
    // the live entries at O(1) amortised per op.
    sweep_at: usize,
}

// A level in one period: `<base>:<start>` and its `:q` in Redis.
#[derive(Debug, Clone, Default)]
struct Level {
    spent: Money,
    held: Money,
    // (expiry ms, '<amount>|<record>')
    holds: BTreeSet<(u64, String)>,
    // How many of its alerts the spend has crossed, as counted so far.
    alerted: u32,
    // Per leaseholder of a global budget: (granted, reported spent, last round, its member of
    // `holds`, or '' with nothing unspent): `<base>:<start>:L` in Redis.
    leases: BTreeMap<String, (Money, Money, u64, String)>,
    expires_at_ms: u64,
}

// A request's record.
#[derive(Debug, Clone)]
struct Record {
    binding: String,
    version: String,
    row: String,
    amount: Money,
    tokens: u64,
    hold_expires_ms: u64,
    open: bool,
    charged: Money,
    settled: Money,
    // (level key, period end)
    levels: Vec<(String, i64)>,
    kinds: BTreeSet<String>,
    expires_at_ms: u64,
}

impl Record {
    // The record of a settlement that found none: nothing held, the levels it charges.
    fn unheld(op: &BudgetOp, now_ms: u64, levels: &[(String, i64)]) -> Record {
        Record {
            binding: op.binding.clone(),
            version: op.version.clone(),
            row: op.row.text(),
            amount: Money::ZERO,
            tokens: 0,
            hold_expires_ms: now_ms,
            open: false,
            charged: Money::ZERO,
            settled: Money::ZERO,
            levels: levels.to_vec(),
            kinds: BTreeSet::new(),
            expires_at_ms: 0,
        }
    }
}

// A level as an op works on it: its state, period end and whether it was changed.
struct Working {
    key: String,
    state: Level,
    end_ms: i64,
    written: bool,
    // Holds found expired when it was loaded.
    swept: u64,
    // Its alerts (spends, ascending), and how many were crossed when it was loaded.
    alerts: Vec<Money>,
    alerted_before: u32,
}

impl Ledger {
    /// Applies `op` at `now_ms`; `buckets` evaluates one group of token-bucket ops atomically
    /// with it (the memory store's bucket map, under the same lock), and `slots` holds its
    /// concurrency sets.
    pub fn apply(
        &mut self,
        op: &BudgetOp,
        now_ms: u64,
        buckets: &mut dyn FnMut(Group) -> GroupOutcome,
        slots: &mut Slots,
    ) -> BudgetOutcome {
        let now = now_ms as i64;
        let levels: Vec<(String, Money, i64)> = op
            .levels
            .iter()
            .map(|l| {
                let [before, start, end, after] = l.around;
                let (start, end) = if now < start {
                    (before, start)
                } else if now >= end {
                    (end, after)
                } else {
                    (start, end)
                };
                (format!("{}:{start}", l.base), l.amount, end)
            })
            .collect();
        let group = |need: f64| -> Group {
            op.buckets
                .iter()
                .map(|b| BucketOp {
                    key: b.key.clone(),
                    spec: b.spec,
                    need,
                    unseen: 0.0,
                    role: Role::Enforced,
                    charge: match op.action {
                        BudgetAction::Hold { .. }
                        | BudgetAction::Cancel
                        | BudgetAction::Peek
                        | BudgetAction::Lease { .. } => Charge::Admitted,
                        BudgetAction::Settle { .. } => Charge::Always { max_debt: b.spec.capacity() },
                    },
                })
                .collect()
        };
        let record = self.records.get(&op.record).filter(|r| r.expires_at_ms >= now_ms).cloned();
        let mut work: Vec<Working> = Vec::new();
        let outcome = match &op.action {
            BudgetAction::Lease { holder, ttl_ms, reports } => {
                let mut leased = Vec::new();
                for (((key, amount, end), l), report) in levels.iter().zip(&op.levels).zip(reports) {
                    let w = self.load(&mut work, key, *end, now_ms, op.lost, &l.alerts);
                    let level = &mut work[w];
                    let state = &mut level.state;
                    let (mut granted, mut reported, mut round, member) =
                        state.leases.get(holder).cloned().unwrap_or_default();
                    // A stray older than the last renewal applied: its spend counts, the grant
                    // stays.
                    let wanted = if report.round < round { granted } else { report.wanted };
                    round = round.max(report.round);
                    if !member.is_empty() {
                        match state.holds.iter().find(|(_, m)| *m == member).cloned() {
                            Some(live) => {
                                state.holds.remove(&live);
                                state.held = state.held.saturating_sub(granted.saturating_sub(reported));
                            }
                            // It expired unrenewed, and loading the level charged it whole.
                            None => reported = granted,
                        }
                    }
                    if reported < report.spent {
                        state.spent = state.spent + report.spent.saturating_sub(reported);
                        reported = report.spent;
                    }
                    // Never below what it was granted unless it asks for less.
                    let floor = wanted.min(granted).saturating_sub(reported);
                    let room = amount.saturating_sub(state.spent + state.held);
                    let unspent = floor.max(wanted.saturating_sub(reported).min(room));
                    granted = reported + unspent;
                    let mut member = String::new();
                    if unspent > Money::ZERO {
                        member = format!("{}|@{holder}", unspent.nanos());
                        state.holds.insert((now_ms + ttl_ms, member.clone()));
                        state.held = state.held + unspent;
                    }
                    state.leases.insert(holder.clone(), (granted, reported, round, member));
                    level.written = true;
                    leased.push((w, granted));
                }
                alert(&mut work);
                let levels = leased
                    .into_iter()
                    .map(|(w, granted)| LeaseReading {
                        granted,
                        spent: work[w].state.spent,
                        held: work[w].state.held,
                        end_ms: work[w].end_ms,
                    })
                    .collect();
                BudgetOutcome::Leased { now_ms, levels }
            }
            BudgetAction::Hold { amount, tokens, ttl_ms } => {
                let indices: Vec<usize> = levels
                    .iter()
                    .zip(&op.levels)
                    .map(|((key, _, end), l)| self.load(&mut work, key, *end, now_ms, op.lost, &l.alerts))
                    .collect();
                let mut verdict = HoldVerdict::Admitted;
                let mut exhausted = None;
                let mut sets = SetsOutcome::default();
                if let Some(r) = &record {
                    // Only the same request asking again is a retry: open, same path, same hold.
                    let retry = r.open
                        && r.hold_expires_ms > now_ms
                        && r.binding == op.binding
                        && (r.amount, r.tokens) == (*amount, *tokens);
                    verdict = if retry { HoldVerdict::Duplicate } else { HoldVerdict::Reused };
                } else {
                    exhausted = indices.iter().zip(&levels).position(|(&w, (_, cap, _))| {
                        *cap < work[w].state.spent + work[w].state.held + *amount
                    });
                    let (readings, full) = slots.read_sets(&op.sets, now_ms);
                    sets.readings = readings;
                    sets.full = full.filter(|_| exhausted.is_none());
                    if exhausted.is_some() || sets.full.is_some() {
                        verdict = HoldVerdict::Denied;
                    }
                }
                let mut short = None;
                let mut bucket_readings = Vec::new();
                if verdict == HoldVerdict::Admitted && !op.buckets.is_empty() {
                    let outcome = buckets(group(*tokens as f64));
                    bucket_readings = outcome.verdicts.iter().map(|v| (v.tokens, v.retry_after_ms)).collect();
                    if !outcome.admitted {
                        verdict = HoldVerdict::Denied;
                        short = outcome.verdicts.iter().position(|v| !v.allowed);
                    }
                }
                if verdict == HoldVerdict::Admitted {
                    let expires = now_ms + ttl_ms;
                    let member = format!("{}|{}", amount.nanos(), op.record);
                    for &w in &indices {
                        let level = &mut work[w];
                        level.state.held = level.state.held + *amount;
                        level.written = true;
                        level.state.holds.insert((expires, member.clone()));
                    }
                    self.records.insert(
                        op.record.clone(),
                        Record {
                            binding: op.binding.clone(),
                            version: op.version.clone(),
                            row: op.row.text(),
                            amount: *amount,
                            tokens: *tokens,
                            hold_expires_ms: expires,
                            open: true,
                            charged: Money::ZERO,
                            settled: Money::ZERO,
                            levels: indices.iter().map(|&w| (work[w].key.clone(), work[w].end_ms)).collect(),
                            kinds: BTreeSet::new(),
                            expires_at_ms: now_ms + op.life_ms,
                        },
                    );
                }
                if record.is_none() {
                    let admitted = verdict == HoldVerdict::Admitted;
                    slots.close_sets(&op.sets, &op.record, admitted, now_ms, &mut sets.readings);
                }
                alert(&mut work);
                let levels = indices.iter().map(|&w| reading(&work[w])).collect();
                let expired = expired(&work);
                BudgetOutcome::Held {
                    now_ms,
                    verdict,
                    exhausted,
                    short,
                    levels,
                    buckets: bucket_readings,
                    expired,
                    slots: sets,
                }
            }
            BudgetAction::Peek => {
                let alive: Vec<Option<&Level>> = levels
                    .iter()
                    .map(|(key, _, _)| self.levels.get(key).filter(|l| l.expires_at_ms >= now_ms))
                    .collect();
                let leases = alive
                    .iter()
                    .map(|l| {
                        l.map_or_else(Vec::new, |l| {
                            l.leases.iter().map(|(holder, (g, r, _, _))| (holder.clone(), *g, *r)).collect()
                        })
                    })
                    .collect();
                let levels = levels
                    .iter()
                    .zip(&alive)
                    .map(|((_, _, end), l)| {
                        l.map_or((Money::ZERO, Money::ZERO, *end), |l| (l.spent, l.held, *end))
                    })
                    .collect();
                return BudgetOutcome::Peeked { now_ms, levels, leases };
            }
            BudgetAction::Cancel => {
                let had = match &record {
                    None => {
                        let mut closed = Record::unheld(op, now_ms, &[]);
                        closed.expires_at_ms = now_ms + op.life_ms;
                        self.records.insert(op.record.clone(), closed);
                        HadHold::None
                    }
                    Some(r) if r.binding != op.binding => HadHold::Other,
                    Some(r) if !r.open => HadHold::Settled,
                    Some(r) if r.hold_expires_ms <= now_ms => HadHold::Expired,
                    Some(r) => {
                        let member = format!("{}|{}", r.amount.nanos(), op.record);
                        for (key, end) in &r.levels {
                            let w = self.load(&mut work, key, *end, now_ms, op.lost, &[]);
                            let level = &mut work[w];
                            level.state.held = level.state.held.saturating_sub(r.amount);
                            level.written = true;
                            level.state.holds.retain(|(_, m)| *m != member);
                        }
                        if r.tokens > 0 && !op.buckets.is_empty() {
                            buckets(group(-(r.tokens as f64)));
                        }
                        let entry = self.records.get_mut(&op.record).expect("alive");
                        entry.open = false;
                        entry.tokens = 0;
                        HadHold::Open
                    }
                };
                let mut sets = SetsOutcome::default();
                if had != HadHold::Other {
                    sets.readings = slots.give_back(&op.sets, &op.record, now_ms).0;
                }
                BudgetOutcome::Cancelled { now_ms, had, expired: expired(&work), slots: sets }
            }
            BudgetAction::Settle { usage } => {
                let settled = |had, slots| BudgetOutcome::Settled {
                    now_ms,
                    charged: Money::ZERO,
                    had,
                    levels: Vec::new(),
                    expired: 0,
                    slots,
                };
                match &record {
                    // Another request's record: nothing.
                    Some(r) if r.binding != op.binding => {
                        return settled(HadHold::Other, SetsOutcome::default())
                    }
                    Some(r) if r.version != op.version => {
                        return BudgetOutcome::Reprice {
                            now_ms,
                            version: r.version.clone(),
                            row: PriceRow::parse(&r.row).unwrap_or(op.row),
                        };
                    }
                    _ => {}
                }
                let mut sets = SetsOutcome::default();
                sets.readings = slots.give_back(&op.sets, &op.record, now_ms).0;
                let charged_levels: Vec<(String, i64)> = match &record {
                    // No record and no price to charge at: nothing more.
                    None if op.version.is_empty() => return settled(HadHold::None, sets),
                    Some(r) => r.levels.clone(),
                    None => levels.iter().map(|(key, _, end)| (key.clone(), *end)).collect(),
                };
                let no_alerts = Vec::new();
                let indices: Vec<usize> = charged_levels
                    .iter()
                    .enumerate()
                    .map(|(i, (key, end))| {
                        let alerts = op.levels.get(i).map_or(&no_alerts, |l| &l.alerts);
                        self.load(&mut work, key, *end, now_ms, op.lost, alerts)
                    })
                    .collect();
                let (mut cost, mut tokens, mut fresh) = (Money::ZERO, 0u64, Vec::<&str>::new());
                for (kind, count, price) in usage {
                    let name = kind.name();
                    if !fresh.contains(&name) && !record.as_ref().is_some_and(|r| r.kinds.contains(name)) {
                        fresh.push(name);
                        cost = cost + *price;
                        tokens += count;
                    }
                }
                let (mut had, mut held_tokens, mut charged, mut settled) =
                    (HadHold::None, 0, Money::ZERO, Money::ZERO);
                if let Some(r) = &record {
                    (held_tokens, charged, settled) = (r.tokens, r.charged, r.settled);
                    if !r.open {
                        had = HadHold::Settled;
                    } else if r.hold_expires_ms <= now_ms {
                        had = HadHold::Expired;
                        if op.lost == LostSettle::Charge {
                            charged = charged + r.amount;
                        }
                    } else {
                        had = HadHold::Open;
                        let member = format!("{}|{}", r.amount.nanos(), op.record);
                        for &w in &indices {
                            let level = &mut work[w];
                            level.state.held = level.state.held.saturating_sub(r.amount);
                            level.written = true;
                            level.state.holds.retain(|(_, m)| *m != member);
                        }
                    }
                }
                settled = settled + cost;
                let now_charge = settled.saturating_sub(charged);
                charged = charged.max(settled);
                if now_charge > Money::ZERO {
                    for &w in &indices {
                        work[w].state.spent = work[w].state.spent + now_charge;
                        work[w].written = true;
                    }
                }
                let delta = tokens as f64 - held_tokens as f64;
                if !fresh.is_empty() && delta != 0.0 && !op.buckets.is_empty() {
                    buckets(group(delta));
                }
                if !fresh.is_empty() || had != HadHold::Settled {
                    if record.is_none() {
                        // A record that expired in the map is replaced whole, as Redis dropped it.
                        self.records.insert(op.record.clone(), Record::unheld(op, now_ms, &charged_levels));
                    }
                    let entry = self.records.get_mut(&op.record).expect("alive or just written");
                    entry.open = false;
                    entry.charged = charged;
                    entry.settled = settled;
                    if !fresh.is_empty() {
                        entry.tokens = 0;
                    }
                    entry.kinds.extend(fresh.iter().map(|k| (*k).to_owned()));
                    entry.expires_at_ms = entry.expires_at_ms.max(now_ms + op.life_ms);
                }
                alert(&mut work);
                let levels = indices.iter().map(|&w| reading(&work[w])).collect();
                BudgetOutcome::Settled {
                    now_ms,
                    charged: now_charge,
                    had,
                    levels,
                    expired: expired(&work),
                    slots: sets,
                }
            }
        };
        for level in work.into_iter().filter(|l| l.written) {
            let mut state = level.state;
            state.expires_at_ms = (level.end_ms + op.life_ms as i64).max(0) as u64;
            self.levels.insert(level.key, state);
        }
        self.sweep(now_ms);
        outcome
    }

    // The index in `work` of level `key` (period ending `end_ms`), loaded on first use: its
    // holds due by now are no longer held and, under `charge`, are spent.
    fn load(
        &self,
        work: &mut Vec<Working>,
        key: &str,
        end_ms: i64,
        now_ms: u64,
        lost: LostSettle,
        alerts: &[Money],
    ) -> usize {
        if let Some(i) = work.iter().position(|w| w.key == key) {
            return i;
        }
        let mut state =
            self.levels.get(key).filter(|l| l.expires_at_ms >= now_ms).cloned().unwrap_or_default();
        let due: Vec<(u64, String)> =
            state.holds.iter().take_while(|(at, _)| *at <= now_ms).cloned().collect();
        for hold in &due {
            let amount = hold.1.split('|').next().and_then(Money::from_nanos).unwrap_or_default();
            state.held = state.held.saturating_sub(amount);
            // A lease's holder may have spent all of it: charged whatever `lost` says.
            if lost == LostSettle::Charge || hold.1.contains("|@") {
                state.spent = state.spent + amount;
            }
            state.holds.remove(hold);
        }
        let alerted_before = state.alerted;
        work.push(Working {
            key: key.to_owned(),
            state,
            end_ms,
            written: !due.is_empty(),
            swept: due.len() as u64,
            alerts: alerts.to_vec(),
            alerted_before,
        });
        work.len() - 1
    }

    // Drops expired entries, as Redis would have.
    fn sweep(&mut self, now_ms: u64) {
        if self.levels.len() + self.records.len() < self.sweep_at.max(1024) {
            return;
        }
        sweep_map(&mut self.levels, |l| l.expires_at_ms >= now_ms);
        sweep_map(&mut self.records, |r| r.expires_at_ms >= now_ms);
        self.sweep_at = 2 * (self.levels.len() + self.records.len());
    }

    /// A level's spent and held money in the period keyed `key` (`<base>:<start>`), as stored.
    pub fn level(&self, key: &str) -> Option<(Money, Money)> {
        self.levels.get(key).map(|l| (l.spent, l.held))
    }
}

// Holds the op found expired at the first level it loaded (its top one).
fn expired(work: &[Working]) -> u64 {
    work.first().map_or(0, |w| w.swept)
}

// Counts the alerts each level's spend has now crossed; a level whose count grew is written.
fn alert(work: &mut [Working]) {
    for level in work {
        let crossed = level.alerts.iter().filter(|a| **a <= level.state.spent).count() as u32;
        if crossed > level.state.alerted {
            level.state.alerted = crossed;
            level.written = true;
        }
    }
}

fn reading(level: &Working) -> LevelReading {
    LevelReading {
        used: level.state.spent + level.state.held,
        spent: level.state.spent,
        end_ms: level.end_ms,
        alerted: (level.alerted_before, level.state.alerted),
    }
}
