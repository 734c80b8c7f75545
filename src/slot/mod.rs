//! Concurrency limits: at most `max` requests in flight under a node, each holding a slot from
//! request time until its stream ends.
//!
//! A node with `concurrency: {max, ttl}` owns a **slot set** per value path (one per tenant, key
//! or model, as its place in the tree says): the request ids holding a slot, each with the time
//! its slot expires if it is never given back. A request names its path down to its request id:
//!
//! * **Take** (request time): if the request id has a record, the answer is the recorded one and
//!   nothing more is taken (a retry); a record for another path refuses the request
//!   ([`SlotVerdict::Reused`]). Otherwise every set on the path drops its expired slots, and if
//!   each has one free, the request's token buckets are evaluated with it; only if they admit it
//!   too is a slot added to every set. All or nothing, in one atomic step, and recorded.
//! * **Give back** (stream end): the record's slots are removed from their sets once, however
//!   often it is sent; a slot already expired stays gone; a record for another path changes
//!   nothing.
//!
//! **The bound**: a set admits only while fewer than `max` slots are open, and a slot stays open
//! until given back or expired, so at no moment are more than `max` requests admitted under the
//! node whose slots are open, across every replica (the set lives in the store). A slot lost
//! with its give-back frees itself after `ttl`.
//!
//! The arithmetic is [`Slots`] in Rust (the memory store's) and `store/redis/slot.lua` in Redis,
//! the same step for step, which `tests/equivalence_slot.rs` holds them to.

use std::collections::{BTreeMap, HashMap};

use crate::bucket::{BucketOp, Group, GroupOutcome};
use crate::sweep::sweep_map;

/// A node's concurrency limit (`concurrency: {max, ttl}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ConcurrencySpec {
    /// Most requests in flight under the node (per value path).
    pub max: u64,
    /// How long a slot not given back stays taken, in milliseconds.
    pub ttl_ms: u64,
}

/// The entry key that makes a descriptor a give-back: the take's entries, then this (any value).
pub const RELEASE_KEY: &str = "release";

/// How long a slot not given back stays taken, by default: ten minutes, Envoy's longest usual
/// stream timeout.
pub const DEFAULT_TTL_MS: u64 = 600_000;

/// How long a set is kept after its latest slot expires: only cleaning up (its slots stopped
/// counting at their own expiry), long enough that no op on it can meet the millisecond by which
/// Redis's expiry clock may lag the script's.
const LINGER_MS: u64 = 3_600_000;

/// One slot set a request takes from: a node's set for the request's values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotSet {
    /// The set's storage key ([`crate::identity`]).
    pub key: String,
    /// Most slots open at once.
    pub max: u64,
    /// How long a slot not given back stays open, in milliseconds.
    pub ttl_ms: u64,
}

/// Taking slots or giving them back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotAction {
    /// At request time.
    Take,
    /// At stream end.
    GiveBack,
    /// Giving back a take that the request's other limits refused (or the failure mode did): its
    /// slots freed, and its record answering a retry as refused, as the request was.
    Undo,
}

/// A request's slot operation.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotOp {
    /// The key of the request's record ([`crate::identity`]), in its tenant's slot.
    pub record: String,
    /// The request's path as text ([`crate::identity::path_text`]): a record for another path
    /// is a reused request id.
    pub binding: String,
    /// Every set on the path.
    pub sets: Vec<SlotSet>,
    /// Take or give back.
    pub action: SlotAction,
    /// The request's token-bucket ops, evaluated with a take, all or nothing.
    pub group: Group,
}

/// What became of a take or give-back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotVerdict {
    /// A slot taken in every set.
    Taken,
    /// A set was full (index into the op's sets), or the token buckets denied (no index).
    Refused(Option<usize>),
    /// A retry of a recorded take: its answer (admitted or not), nothing taken.
    Repeated(bool),
    /// The request id's record names another path: refused, nothing changed.
    Reused,
    /// Slots given back: how many were still open.
    GivenBack(u64),
    /// A give-back with nothing to give back (no record, a refused take, already given back).
    Nothing,
}

/// One set after the op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetReading {
    /// Slots open after the op.
    pub open: u64,
    /// Expired slots dropped by the op.
    pub expired: u64,
    /// For a full set, milliseconds until its earliest slot expires.
    pub frees_in_ms: Option<u64>,
    /// Whether the op gave the request's slot back to it.
    pub given_back: bool,
}

/// What an op that takes or gives back slots alongside something else (a budget hold, its
/// settlement or cancel) did to its sets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetsOutcome {
    /// Per set, in the op's order (empty when the op read none).
    pub readings: Vec<SetReading>,
    /// A take refused for this full set (an index into the op's sets).
    pub full: Option<usize>,
}

/// The outcome of a [`SlotOp`].
#[derive(Debug, Clone, PartialEq)]
pub struct SlotOutcome {
    /// What happened.
    pub verdict: SlotVerdict,
    /// Per set of the op, in order (empty for a repeat, a reuse, or a give-back without record).
    pub sets: Vec<SetReading>,
    /// The token buckets' outcome, for a take that evaluated them.
    pub group: Option<GroupOutcome>,
    /// The store's clock, in milliseconds.
    pub now_ms: u64,
}

impl SlotOutcome {
    /// Whether the request is admitted.
    pub fn admitted(&self) -> bool {
        matches!(
            self.verdict,
            SlotVerdict::Taken
                | SlotVerdict::Repeated(true)
                | SlotVerdict::GivenBack(_)
                | SlotVerdict::Nothing
        )
    }
}

// A request's record.
#[derive(Debug, Clone)]
struct Record {
    binding: String,
    admitted: bool,
    given_back: bool,
    expires_at_ms: u64,
}

/// Every set's and record's state (the memory store's).
#[derive(Debug, Default)]
pub struct Slots {
    // Set key -> member (record key) -> expiry ms; with the set's own expiry.
    sets: HashMap<String, (BTreeMap<String, u64>, u64)>,
    records: HashMap<String, Record>,
    // Expired entries are dropped when the maps have doubled since the last time: memory follows
    // the live entries (a client sending a fresh request id per request grows nothing for long).
    sweep_at: usize,
}

impl Slots {
    /// Applies `op` at `now_ms`; `buckets` evaluates its group atomically with it (with needs as
    /// given, or as checks when `check` is true).
    pub fn apply(
        &mut self,
        op: &SlotOp,
        now_ms: u64,
        buckets: &mut dyn FnMut(Group) -> GroupOutcome,
    ) -> SlotOutcome {
        self.sweep_expired(now_ms);
        let outcome = |verdict, sets, group| SlotOutcome { verdict, sets, group, now_ms };
        let record = self.records.get(&op.record).filter(|r| r.expires_at_ms >= now_ms).cloned();
        if let Some(r) = &record {
            if r.binding != op.binding {
                return outcome(SlotVerdict::Reused, Vec::new(), None);
            }
        }
        match op.action {
            SlotAction::Take => {
                if let Some(r) = record {
                    return outcome(SlotVerdict::Repeated(r.admitted), Vec::new(), None);
                }
                let (mut readings, full) = self.read_sets(&op.sets, now_ms);
                let group = if full.is_some() {
                    let checks: Group =
                        op.group.iter().map(|b| BucketOp { need: 0.0, ..b.clone() }).collect();
                    buckets(checks)
                } else {
                    buckets(op.group.clone())
                };
                let admitted = full.is_none() && group.admitted;
                self.close_sets(&op.sets, &op.record, admitted, now_ms, &mut readings);
                let life = op.sets.iter().map(|s| s.ttl_ms).max().unwrap_or(0);
                self.records.insert(
                    op.record.clone(),
                    Record {
                        binding: op.binding.clone(),
                        admitted,
                        given_back: false,
                        expires_at_ms: now_ms + life,
                    },
                );
                let verdict = if admitted { SlotVerdict::Taken } else { SlotVerdict::Refused(full) };
                outcome(verdict, readings, Some(group))
            }
            SlotAction::GiveBack | SlotAction::Undo => {
                if !record.is_some_and(|r| r.admitted && !r.given_back) {
                    return outcome(SlotVerdict::Nothing, Vec::new(), None);
                }
                let (readings, given) = self.give_back(&op.sets, &op.record, now_ms);
                if let Some(stored) = self.records.get_mut(&op.record) {
                    stored.given_back = true;
                    stored.admitted = op.action == SlotAction::GiveBack;
                }
                outcome(SlotVerdict::GivenBack(given), readings, None)
            }
        }
    }

    // Drops expired sets and records, as Redis would have.
    fn sweep_expired(&mut self, now_ms: u64) {
        if self.sets.len() + self.records.len() < self.sweep_at.max(1024) {
            return;
        }
        sweep_map(&mut self.sets, |(_, expiry)| *expiry >= now_ms);
        sweep_map(&mut self.records, |r| r.expires_at_ms >= now_ms);
        self.sweep_at = 2 * (self.sets.len() + self.records.len());
    }

    /// Sets and records held, expired or not (for memory tests).
    pub fn len(&self) -> usize {
        self.sets.len() + self.records.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    // The steps on sets that slot ops and budget holds share (and `store/redis/sets.lua` with
    // them in Redis).

    /// Drops every set's expired slots: what each has open then, and the first set that is full.
    pub(crate) fn read_sets(&mut self, sets: &[SlotSet], now_ms: u64) -> (Vec<SetReading>, Option<usize>) {
        let readings: Vec<SetReading> = sets.iter().map(|s| self.sweep(&s.key, now_ms)).collect();
        let full = sets.iter().zip(&readings).position(|(s, r)| r.open >= s.max);
        (readings, full)
    }

    /// After [`Slots::read_sets`]: an admitted request's slot added to every set (open until its
    /// set's ttl); for a refused one, when each full set's earliest slot frees.
    pub(crate) fn close_sets(
        &mut self,
        sets: &[SlotSet],
        record: &str,
        admitted: bool,
        now_ms: u64,
        readings: &mut [SetReading],
    ) {
        for (set, reading) in sets.iter().zip(readings.iter_mut()) {
            if admitted {
                let expiry = now_ms + set.ttl_ms;
                let (members, set_expiry) = self.sets.entry(set.key.clone()).or_default();
                members.insert(record.to_owned(), expiry);
                *set_expiry = (*set_expiry).max(expiry + LINGER_MS);
                reading.open += 1;
            } else if reading.open >= set.max {
                reading.frees_in_ms = self.earliest(&set.key).map(|at| at.saturating_sub(now_ms));
            }
        }
    }

    /// The slot of `record` given back to every set it is still open in: what each has open
    /// then, and how many were given back. The sets the path has now: a set no longer configured
    /// keeps its slot until it expires.
    pub(crate) fn give_back(
        &mut self,
        sets: &[SlotSet],
        record: &str,
        now_ms: u64,
    ) -> (Vec<SetReading>, u64) {
        let mut given = 0;
        let mut readings = Vec::with_capacity(sets.len());
        for key in sets.iter().map(|s| &s.key) {
            let mut reading = self.sweep(key, now_ms);
            if let Some((members, _)) = self.sets.get_mut(key) {
                if members.remove(record).is_some() {
                    given += 1;
                    reading.open -= 1;
                    reading.given_back = true;
                }
            }
            readings.push(reading);
        }
        (readings, given)
    }

    // Drops the set's expired slots; what is open then.
    fn sweep(&mut self, key: &str, now_ms: u64) -> SetReading {
        let Some((members, set_expiry)) = self.sets.get_mut(key) else {
            return SetReading { open: 0, expired: 0, frees_in_ms: None, given_back: false };
        };
        // A set an hour past its latest slot is gone, as its key is from Redis.
        if *set_expiry < now_ms {
            self.sets.remove(key);
            return SetReading { open: 0, expired: 0, frees_in_ms: None, given_back: false };
        }
        let before = members.len();
        members.retain(|_, at| *at > now_ms);
        SetReading {
            open: members.len() as u64,
            expired: (before - members.len()) as u64,
            frees_in_ms: None,
            given_back: false,
        }
    }

    fn earliest(&self, key: &str) -> Option<u64> {
        self.sets.get(key).and_then(|(members, _)| members.values().min().copied())
    }

    /// The open slots of the set at `key` and their expiries, as stored (for equivalence tests).
    pub fn open(&self, key: &str) -> Vec<(String, u64)> {
        let mut open: Vec<(String, u64)> = self
            .sets
            .get(key)
            .map(|(m, _)| m.iter().map(|(k, v)| (k.clone(), *v)).collect())
            .unwrap_or_default();
        open.sort();
        open
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(id: u32, now_ms: u64, slots: &mut Slots) -> SlotVerdict {
        let op = SlotOp {
            record: format!("r:{id}"),
            binding: "p".into(),
            sets: vec![SlotSet { key: format!("s:{}", id % 7), max: 1, ttl_ms: 1_000 }],
            action: SlotAction::Take,
            group: Vec::new(),
        };
        let mut admit = |_group: Group| GroupOutcome {
            admitted: true,
            now_ms,
            verdicts: Vec::new(),
            refunded: false,
            unanswered: Vec::new(),
        };
        slots.apply(&op, now_ms, &mut admit).verdict
    }

    #[test]
    fn a_flood_of_fresh_request_ids_leaves_only_the_live_ones() {
        let mut slots = Slots::default();
        for id in 0..100_000 {
            // A new id every 0.1 ms: ten thousand records live at once at most.
            take(id, u64::from(id) / 10, &mut slots);
        }
        assert!(slots.len() < 25_000, "{} held", slots.len());
        assert_eq!(take(100_000, 20_000, &mut slots), SlotVerdict::Taken);
    }
}
