//! The embedded store: bucket state in a map inside this process.
//!
//! Budgets ([`crate::budget`]) live beside the buckets, in [`Ledger`].
//!
//! Evaluation holds one lock for the whole batch, which gives each batch the same atomicity a Lua
//! script has in Redis. Buckets expire like Redis keys: a bucket idle long enough to be full is
//! dropped, since a missing bucket reads as full. Expired entries are swept whenever the map has
//! doubled since the last sweep, and at least every [`SWEEP_EVERY_MS`] of activity, and the map
//! gives back the room a burst left behind, so memory follows the number of recently active
//! buckets, not the largest number there ever were.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;

use super::{LateReply, Store, StoreError};
use crate::bucket::{self, Batch, BucketState, GroupOutcome, LeaseOp, LeaseOutcome};
use crate::budget::ledger::Ledger;
use crate::budget::{BudgetOp, BudgetOutcome};
use crate::clock::{Clock, SystemClock};
use crate::slot::{SlotOp, SlotOutcome, Slots};
use crate::sweep::sweep_map;

/// Bucket state in process memory.
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
    buckets: Mutex<Swept<String, Entry>>,
    // Budgets; locked after `buckets` when both are (a budget op evaluates its token buckets).
    ledger: Mutex<Ledger>,
    // Concurrency slots; locked after `buckets`, and after `ledger` (a budget op takes and gives
    // back slots).
    slots: Mutex<Slots>,
}

/// The longest a map goes without a sweep while it is used (ms): after a burst, the entries it
/// left expire and their room is given back even if the map never doubles again.
pub const SWEEP_EVERY_MS: u64 = 10_000;

// A map whose expired entries are dropped whenever it has doubled since the last sweep, or
// SWEEP_EVERY_MS has passed: memory follows the live entries, and a call costs O(1) amortised
// however many there are. An expired entry reads as a missing one, so sweeping late changes no
// answer.
struct Swept<K, V> {
    map: HashMap<K, V>,
    sweep_at: usize,
    swept_ms: u64,
}

impl<K: std::hash::Hash + Eq, V> Default for Swept<K, V> {
    fn default() -> Self {
        Swept { map: HashMap::new(), sweep_at: 1024, swept_ms: 0 }
    }
}

impl<K: std::hash::Hash + Eq, V> Swept<K, V> {
    fn sweep(&mut self, now: u64, alive: impl FnMut(&V) -> bool) {
        if self.map.len() >= self.sweep_at || now >= self.swept_ms.saturating_add(SWEEP_EVERY_MS) {
            sweep_map(&mut self.map, alive);
            self.sweep_at = (self.map.len() * 2).max(1024);
            self.swept_ms = now;
        }
    }
}

impl Swept<String, Entry> {
    // Evaluates `batch` at `now` and keeps what it writes.
    fn evaluate(&mut self, batch: &Batch, now: u64) -> Vec<GroupOutcome> {
        let map = &self.map;
        let evaluation = bucket::evaluate(batch, now, |key| {
            // Alive through its expiry millisecond, as Redis keeps a key until its clock passes it.
            map.get(key).filter(|e| e.expires_at_ms >= now).map(|e| (e.state.clone(), e.expires_at_ms))
        });
        for write in evaluation.writes {
            self.put(write, now);
        }
        self.sweep(now, |e| e.expires_at_ms >= now);
        evaluation.groups
    }

    // Stores what `write` says, written at `now`.
    fn put(&mut self, write: bucket::Write, now: u64) {
        let entry = Entry { state: write.state, expires_at_ms: now.saturating_add(write.ttl_ms) };
        self.map.insert(write.key, entry);
    }
}

struct Entry {
    state: BucketState,
    expires_at_ms: u64,
}

impl MemoryStore {
    /// A store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    /// A store on `clock`, for deterministic tests.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        MemoryStore { clock, buckets: Mutex::default(), ledger: Mutex::default(), slots: Mutex::default() }
    }

    /// Evaluates `batch` now; the synchronous core of [`Store::evaluate`].
    pub fn evaluate_now(&self, batch: &Batch) -> Vec<GroupOutcome> {
        let now = self.clock.now_ms();
        let mut buckets = self.buckets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        buckets.evaluate(batch, now)
    }

    /// Applies `op` now; the synchronous core of [`Store::budget`].
    pub fn budget_now(&self, op: &BudgetOp) -> BudgetOutcome {
        let now = self.clock.now_ms();
        let mut buckets = self.buckets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut ledger = self.ledger.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut slots = self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        ledger.apply(op, now, &mut |group| buckets.evaluate(&[group], now).remove(0), &mut slots)
    }

    /// Applies a slot op now, its token buckets under the same lock.
    pub fn slots_now(&self, op: &SlotOp) -> SlotOutcome {
        let now = self.clock.now_ms();
        let mut buckets = self.buckets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut slots = self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        slots.apply(op, now, &mut |group| buckets.evaluate(&[group], now).remove(0))
    }

    /// The open slots of the set at `key` and when each expires (for equivalence tests).
    pub fn open_slots(&self, key: &str) -> Vec<(String, u64)> {
        self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).open(key)
    }

    /// A budget level's spent and held money in the period keyed `key`, as stored (for
    /// equivalence tests).
    pub fn budget_level(&self, key: &str) -> Option<(crate::budget::Money, crate::budget::Money)> {
        self.ledger.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).level(key)
    }

    /// The stored state of `key` and when it expires (clock milliseconds), expired or not: what
    /// Redis's `HMGET` and `PEXPIRETIME` show for the same bucket (for equivalence tests).
    pub fn stored(&self, key: &str) -> Option<(BucketState, u64)> {
        let buckets = self.buckets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        buckets.map.get(key).map(|e| (e.state.clone(), e.expires_at_ms))
    }

    /// Number of buckets held, expired or not (for memory tests).
    pub fn len(&self) -> usize {
        self.buckets.lock().map(|b| b.map.len()).unwrap_or(0)
    }

    /// How many buckets the map has room for without growing (memory it holds).
    pub fn capacity(&self) -> usize {
        self.buckets.lock().map(|b| b.map.capacity()).unwrap_or(0)
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl Store for MemoryStore {
    // In process, a reply is never late.
    fn evaluate<'a>(
        &'a self,
        batch: &'a Batch,
        _late: LateReply,
    ) -> BoxFuture<'a, Vec<Result<GroupOutcome, StoreError>>> {
        let outcomes = self.evaluate_now(batch).into_iter().map(Ok).collect();
        Box::pin(std::future::ready(outcomes))
    }

    fn lease<'a>(&'a self, ops: &'a [LeaseOp]) -> BoxFuture<'a, Vec<Result<LeaseOutcome, StoreError>>> {
        let now = self.clock.now_ms();
        let mut buckets = self.buckets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let outcomes = ops
            .iter()
            .map(|op| {
                let stored = buckets.map.get(&op.key).filter(|e| e.expires_at_ms >= now);
                let (outcome, write) = bucket::lease(stored.map(|e| (&e.state, e.expires_at_ms)), op, now);
                if let Some(write) = write {
                    buckets.put(write, now);
                }
                Ok(outcome)
            })
            .collect();
        // Leases write buckets too: an RLQS-only store must sweep as well.
        buckets.sweep(now, |e| e.expires_at_ms >= now);
        Box::pin(std::future::ready(outcomes))
    }

    fn budget<'a>(&'a self, op: &'a BudgetOp) -> BoxFuture<'a, Result<BudgetOutcome, StoreError>> {
        Box::pin(std::future::ready(Ok(self.budget_now(op))))
    }

    fn slots<'a>(&'a self, op: &'a SlotOp) -> BoxFuture<'a, Result<SlotOutcome, StoreError>> {
        Box::pin(std::future::ready(Ok(self.slots_now(op))))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn describe(&self) -> String {
        "embedded memory store (limits hold per process only)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{BucketOp, BucketSpec, Charge, Role};
    use crate::clock::ManualClock;

    fn take(store: &MemoryStore, key: &str, need: f64) -> (bool, f64) {
        let op = BucketOp {
            key: key.into(),
            spec: BucketSpec::new(10.0, 1.0).unwrap(),
            need,
            unseen: 0.0,
            role: Role::Enforced,
            charge: Charge::Admitted,
        };
        let outcome = &store.evaluate_now(&[vec![op]])[0];
        (outcome.admitted, outcome.verdicts[0].tokens)
    }

    #[test]
    fn state_persists_refills_and_expires() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        assert_eq!(take(&store, "a", 10.0), (true, 0.0));
        assert_eq!(take(&store, "a", 1.0), (false, 0.0));
        clock.advance(2_500);
        assert_eq!(take(&store, "a", 1.0), (true, 1.5));
        clock.advance(11_000);
        assert_eq!(take(&store, "a", 0.0), (true, 10.0), "idle bucket is full");
    }

    #[test]
    fn sweeping_bounds_the_map() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        for round in 0..10 {
            for i in 0..1_000 {
                take(&store, &format!("{round}-{i}"), 1.0);
            }
            clock.advance(60_000);
        }
        assert!(store.len() <= 2_048, "held {} buckets", store.len());
    }

    #[test]
    fn a_burst_gives_its_memory_back() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        for i in 0..50_000 {
            take(&store, &format!("burst-{i}"), 1.0);
        }
        let at_peak = store.capacity();
        // The burst's buckets refill and expire; a trickle of traffic sweeps them and shrinks.
        clock.advance(60_000);
        for i in 0..10 {
            take(&store, &format!("after-{i}"), 1.0);
            clock.advance(SWEEP_EVERY_MS);
        }
        assert!(store.len() <= 10, "held {} buckets", store.len());
        assert!(store.capacity() * 16 < at_peak, "room {} of {at_peak} at the peak", store.capacity());
    }
}
