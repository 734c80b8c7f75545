//! The exact local pre-check: answering OVER_LIMIT without a round trip when the answer is
//! already certain.
//!
//! A bucket's balance only grows by refill. So after a script call reports `tokens` at server time
//! `now`, the balance at any later moment is at most `tokens + elapsed × rate` (capped at the
//! capacity), whatever other replicas spend meanwhile. When that upper bound is below what a
//! request needs, Redis would deny it too, and [`Precheck`] answers locally. An abusive tenant
//! hammering an empty bucket then costs one Redis call per refilled token, not one per request.
//!
//! The bound must never be too low, or the pre-check would deny what Redis admits:
//!
//! * Elapsed time is measured locally from *before* the call that made the observation (the
//!   server read its clock later), stretched by [`DRIFT`] for clock-rate differences, plus
//!   [`SLACK_MS`] for both clocks' millisecond truncation.
//! * An observation is used only for the exact capacity and rate it was made with: a changed
//!   rule or quota makes it useless at once.
//! * Credits (`is_negative_hits`) raise a balance: a credit sent through this replica drops the
//!   observation, and calls that were already running when it completed may not make new ones;
//!   a credit sent by another replica is not seen. Turn the pre-check off where buckets receive
//!   credits through several replicas.
//! * Redis losing state (restart without persistence, failover before replication) refills
//!   buckets. Any store error drops every observation (and voids those of calls running at the
//!   time), and none is used after [`MAX_AGE_MS`].
//!
//! Only buckets that the next equal request would find short are remembered, and each shard of
//! the map has a fixed capacity; when it is full, new observations are skipped (which is always
//! safe: the request goes to Redis).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;

use super::{Store, StoreError};
use crate::bucket::{covers, Batch, BucketOp, BucketSpec, Charge, Group, GroupOutcome, Role, Verdict};
use crate::clock::Clock;

/// Allowed rate difference between the local clock and the Redis server's clock.
pub const DRIFT: f64 = 1e-3;
/// Milliseconds added to every elapsed time for truncation of both clocks to whole milliseconds.
pub const SLACK_MS: u64 = 2;
/// Oldest observation used, in milliseconds.
pub const MAX_AGE_MS: u64 = 1_000;

const SHARDS: usize = 16;

/// A [`Store`] that answers certain denials itself and passes everything else to `inner`.
pub struct Precheck {
    inner: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    shards: Vec<Shard>,
    shard_capacity: usize,
    hasher: RandomState,
    answered: AtomicU64,
}

// One lock's worth of the map. `len` mirrors the map's size so that the common case, a bucket
// with room and nothing remembered, costs no lock. `void_until` is the local time of the last
// credit to one of the shard's buckets or store error: a call that started by then may report a
// balance from before it, so its observations are not taken.
#[derive(Default)]
struct Shard {
    map: Mutex<HashMap<String, Observation>>,
    len: AtomicUsize,
    void_until: AtomicU64,
}

#[derive(Debug, Clone, Copy)]
struct Observation {
    tokens: f64,
    // What the request that left the bucket short needed: the observation is worth keeping while
    // the bucket may still be short of that.
    need: f64,
    server_ms: u64,
    local_ms: u64,
    spec: BucketSpec,
}

impl Observation {
    // Tokens the bucket may hold at local time `now`: an upper bound when `conservative`, the
    // likely balance (for the answer's headers) otherwise.
    fn tokens_at(&self, now: u64, conservative: bool) -> f64 {
        let elapsed = now.saturating_sub(self.local_ms) as f64;
        let elapsed = if conservative { (elapsed + SLACK_MS as f64) * (1.0 + DRIFT) } else { elapsed };
        (self.tokens + elapsed * self.spec.rate_per_ms()).min(self.spec.capacity())
    }
}

impl Precheck {
    /// Wraps `inner`, measuring elapsed time with `clock` (a monotonic one in production),
    /// remembering at most `max_buckets` buckets.
    pub fn new(inner: Arc<dyn Store>, clock: Arc<dyn Clock>, max_buckets: usize) -> Self {
        Precheck {
            inner,
            clock,
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            shard_capacity: max_buckets.div_ceil(SHARDS),
            hasher: RandomState::new(),
            answered: AtomicU64::new(0),
        }
    }

    /// Groups answered without the inner store since start.
    pub fn answered_locally(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    fn shard(&self, key: &str) -> &Shard {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    fn observation(&self, op: &BucketOp, now: u64) -> Option<Observation> {
        let shard = self.shard(&op.key);
        if shard.len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let found = *shard.lock().get(&op.key)?;
        (found.spec == op.spec && now.saturating_sub(found.local_ms) <= MAX_AGE_MS).then_some(found)
    }

    // The group's outcome if every operation is certainly short of tokens, as the store would
    // report it (nothing debited). A group that charges always must reach the store, which
    // takes its tokens even when it denies.
    fn certain_denial(&self, group: &Group, now: u64) -> Option<GroupOutcome> {
        let mut verdicts = Vec::with_capacity(group.len());
        let mut server_ms = 0;
        for op in group {
            // Credits always pass; a charge that goes in whatever the verdict must reach the
            // store. A check (need 0) is short while the bucket is certainly in debt.
            if op.need < 0.0 || (op.need > 0.0 && op.charge != Charge::Admitted) {
                return None;
            }
            let seen = self.observation(op, now)?;
            if covers(seen.tokens_at(now, true), op.need) {
                return None;
            }
            let tokens = seen.tokens_at(now, false);
            verdicts.push(Verdict {
                allowed: false,
                tokens,
                retry_after_ms: op.spec.wait_ms(tokens, op.need),
                reset_ms: op.spec.reset_ms(tokens),
                forgiven: 0.0,
            });
            server_ms = server_ms.max(seen.server_ms + now.saturating_sub(seen.local_ms));
        }
        let admitted = group.iter().all(|op| op.role == Role::Shadow);
        Some(GroupOutcome { admitted, now_ms: server_ms, verdicts, compensated: false })
    }

    // Remembers what the store reported for the buckets the next equal request would find short.
    fn observe(&self, group: &Group, outcome: &GroupOutcome, call_start: u64) {
        for (op, verdict) in group.iter().zip(&outcome.verdicts) {
            // Debits the store gave back raised balances after they were reported: like credits.
            let credit = op.need < 0.0 || outcome.compensated;
            let short = op.need >= 0.0 && !covers(verdict.tokens, op.need);
            let shard = self.shard(&op.key);
            // Skipping the removal of a stale observation is safe (it is still an upper bound);
            // a credit's never is, so credits always take the lock.
            if !short && !credit && shard.len.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut map = shard.lock();
            if credit {
                shard.void_until.store(self.clock.now_ms(), Ordering::Relaxed);
            }
            if !short || call_start <= shard.void_until.load(Ordering::Relaxed) {
                map.remove(&op.key);
                shard.len.store(map.len(), Ordering::Relaxed);
                continue;
            }
            if map.len() >= self.shard_capacity && !map.contains_key(&op.key) {
                let now = self.clock.now_ms();
                map.retain(|_, o| {
                    now.saturating_sub(o.local_ms) <= MAX_AGE_MS && o.tokens_at(now, true) < o.need
                });
                shard.len.store(map.len(), Ordering::Relaxed);
                if map.len() >= self.shard_capacity {
                    continue;
                }
            }
            let seen = Observation {
                tokens: verdict.tokens,
                need: op.need,
                server_ms: outcome.now_ms,
                local_ms: call_start,
                spec: op.spec,
            };
            map.insert(op.key.clone(), seen);
            shard.len.store(map.len(), Ordering::Relaxed);
        }
    }

    fn forget_everything(&self) {
        let now = self.clock.now_ms();
        for shard in &self.shards {
            let mut map = shard.lock();
            shard.void_until.store(now, Ordering::Relaxed);
            map.clear();
            shard.len.store(0, Ordering::Relaxed);
        }
    }
}

impl Shard {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Observation>> {
        self.map.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Store for Precheck {
    fn evaluate<'a>(&'a self, batch: &'a Batch) -> BoxFuture<'a, Vec<Result<GroupOutcome, StoreError>>> {
        Box::pin(async move {
            let call_start = self.clock.now_ms();
            // A credit in one group could lift a later group's bucket: such batches go to the
            // store whole.
            let credits = batch.iter().flatten().any(|op| op.need < 0.0);
            let mut results: Vec<Option<Result<GroupOutcome, StoreError>>> = batch
                .iter()
                .map(|g| if credits { None } else { self.certain_denial(g, call_start).map(Ok) })
                .collect();
            let local = results.iter().filter(|r| r.is_some()).count();
            self.answered.fetch_add(local as u64, Ordering::Relaxed);
            if local > 0 {
                metrics::counter!("tollgate_precheck_answers_total").increment(local as u64);
            }
            if local == batch.len() {
                return results.into_iter().flatten().collect();
            }
            // A denied group debits nothing, so leaving it out does not change the others.
            let remote: Vec<usize> = (0..batch.len()).filter(|&i| results[i].is_none()).collect();
            let answers = if local == 0 {
                self.inner.evaluate(batch).await
            } else {
                let rest: Vec<Group> = remote.iter().map(|&i| batch[i].clone()).collect();
                self.inner.evaluate(&rest).await
            };
            let mut failed = false;
            for (&i, answer) in remote.iter().zip(answers) {
                match &answer {
                    Ok(outcome) => self.observe(&batch[i], outcome, call_start),
                    Err(_) => failed = true,
                }
                results[i] = Some(answer);
            }
            if failed {
                self.forget_everything();
            }
            results.into_iter().map(|r| r.expect("every group has a result")).collect()
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.ping()
    }

    fn describe(&self) -> String {
        format!("{} with the local pre-check", self.inner.describe())
    }
}
