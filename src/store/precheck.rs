//! The exact local pre-check: answering OVER_LIMIT without a round trip when the answer is
//! already certain.
//!
//! A bucket's balance only grows by refill. So after a script call reports `tokens` at server time
//! `now`, the balance at any later moment is at most `tokens + elapsed × rate`, whatever other
//! replicas spend meanwhile, where `rate` is the fastest refill anyone applies to the bucket, and
//! the script evaluating this request caps it at this request's capacity. When that upper bound is
//! below what a request needs, Redis would deny it too, and [`Precheck`] answers locally. An
//! abusive tenant hammering an empty bucket then costs one Redis call per refilled token, not one
//! per request.
//!
//! The bound must never be too low, or the pre-check would deny what Redis admits:
//!
//! * Rate: replicas can evaluate one bucket under different specs (a quota change still cached
//!   elsewhere, a rolling config change), and a faster refill through another replica raises the
//!   balance this one sees. The store never refills a bucket faster than its rate ceiling (the
//!   rate in force or a pending one, [`crate::bucket::BucketState::rate_ceiling`]), which the
//!   script returns with every verdict, and a faster rate first asked for takes effect only
//!   [`RATE_RAISE_DELAY_MS`] later, longer than any observation is used. The bound uses the
//!   larger of that ceiling and this request's own rate, so it holds whatever other replicas ask.
//! * Time: elapsed time is measured locally from *before* the call that made the observation
//!   (the server read its clock later), stretched by [`DRIFT`] for clock-rate differences, plus
//!   [`SLACK_MS`] for both clocks' millisecond truncation. A clock that steps (a failover to a
//!   primary whose clock is ahead, a restarted server) comes with a new store epoch
//!   ([`Store::epoch`]): observations from an older epoch are not used.
//! * Credits (`is_negative_hits`, and refunds) raise a balance: one sent through this replica
//!   drops the observation, and calls that were already running when it completed may not make
//!   new ones. A refund the store sends itself (the late reply of a call its caller gave up on)
//!   moves the store's epoch, before it is sent and when it is answered. A credit through any
//!   other replica is published by the script that applies it, and heard here
//!   ([`RaiseListener::raised`], `src/store/redis/raises.rs`) with the same effect, as soon as
//!   the message arrives. While that subscription is missing ([`Precheck::awaiting_raises`]: at
//!   start, and whenever it is lost until it is back) nothing is answered locally or
//!   remembered, and its return forgets everything remembered before.
//! * Expiry: a missing bucket is full at the asker's capacity, which may be larger than the one
//!   the bucket was last written with. The store reports how long it certainly keeps each bucket
//!   ([`Verdict::kept_ms`]: the TTL just written, or what is left of the stored one), and an
//!   observation is used only within that time, measured like elapsed time above.
//! * Redis losing state (restart without persistence, failover before replication, eviction)
//!   refills buckets. Any store error drops every observation (and voids those of calls running
//!   at the time), and none is used after [`MAX_AGE_MS`], which bounds how long a loss nobody
//!   reported can mislead.
//!
//! A bucket whose leases (RLQS) are sized beside what RLS clients ask of it must learn what the
//! pre-check denies too, or a starved RLS client would look as if it asked for one request per
//! refilled token: each observation counts the tokens its denials asked for, and the next
//! operation on the bucket that reaches the store carries them ([`BucketOp::unseen`]).
//!
//! Only buckets that the next equal request would find short are remembered, and each shard of
//! the map has a fixed capacity; when it is full, new observations are skipped (which is always
//! safe: the request goes to Redis). A denial that reached Redis refreshes its observation, so
//! an abusive tenant costs about one script call per [`MAX_AGE_MS`] per bucket.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;

use super::{LateReply, RaiseListener, Store, StoreError};
use crate::bucket::{
    covers, Batch, BucketOp, BucketSpec, Charge, Group, GroupOutcome, LeaseOp, LeaseOutcome, Role, Verdict,
    RATE_RAISE_DELAY_MS,
};
use crate::budget::{BudgetOp, BudgetOutcome};
use crate::clock::Clock;
use crate::slot::{SlotOp, SlotOutcome};

/// Allowed rate difference between the local clock and the Redis server's clock.
pub const DRIFT: f64 = 1e-3;
/// Milliseconds added to every elapsed time for truncation of both clocks to whole milliseconds.
pub const SLACK_MS: u64 = 2;
/// Oldest observation used, in milliseconds, whatever the store says it keeps.
pub const MAX_AGE_MS: u64 = 5_000;

// An observation is used for at most MAX_AGE_MS of local time, which the store's clock may stretch
// by DRIFT plus SLACK_MS; a raised rate must not take effect within that.
const _: () = assert!(MAX_AGE_MS + MAX_AGE_MS / 100 + 100 < RATE_RAISE_DELAY_MS);

const SHARDS: usize = 16;

/// A [`Store`] that answers certain denials itself and passes everything else to `inner`.
pub struct Precheck {
    inner: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    shards: Vec<Shard>,
    shard_capacity: usize,
    hasher: RandomState,
    answered: AtomicU64,
    // Whether raises made through other replicas are heard (always, unless the pre-check relies
    // on a subscription that is not in place).
    hearing: AtomicBool,
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
    // The fastest refill per second the bucket is known to get.
    fastest_refill: f64,
    // How long after the observation the store keeps the bucket.
    kept_ms: u64,
    // The fastest refill of a request this observation bounds (see `observe`).
    rate_limit: f64,
    epoch: u64,
    // Tokens asked by the requests answered from this observation, not yet sent to the store.
    unseen: f64,
}

impl Observation {
    // Elapsed time since the observation at local time `now`, as long as it may have been on
    // the store's clock.
    fn elapsed_at_most(&self, now: u64) -> f64 {
        (now.saturating_sub(self.local_ms) + SLACK_MS) as f64 * (1.0 + DRIFT)
    }

    // Whether the observation may be used at local time `now`: the bucket is certainly still
    // stored, and the observation is young enough.
    fn usable(&self, now: u64) -> bool {
        now.saturating_sub(self.local_ms) <= MAX_AGE_MS && self.elapsed_at_most(now) < self.kept_ms as f64
    }

    // Tokens the bucket may hold at local time `now` for a request of `spec`: an upper bound, if
    // the observation gives one for that spec.
    fn bound(&self, now: u64, spec: &BucketSpec) -> Option<f64> {
        if spec.refill_per_second() > self.rate_limit {
            return None;
        }
        let rate = self.fastest_refill.max(spec.refill_per_second()) / 1000.0;
        Some((self.tokens + self.elapsed_at_most(now) * rate).min(spec.capacity()))
    }

    // The likely balance at `now` if only `spec` refills it (for the answer's headers).
    fn likely(&self, now: u64, spec: &BucketSpec) -> f64 {
        let elapsed = now.saturating_sub(self.local_ms) as f64;
        (self.tokens + elapsed * spec.rate_per_ms()).min(spec.capacity())
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
            hearing: AtomicBool::new(true),
        }
    }

    /// The same pre-check, answering nothing until told that raises made through other replicas
    /// are heard ([`RaiseListener::subscribed`]), and again from when they are not
    /// ([`RaiseListener::lost`]) until they are again.
    pub fn awaiting_raises(self) -> Self {
        Precheck { hearing: AtomicBool::new(false), ..self }
    }

    /// Groups answered without the inner store since start.
    pub fn answered_locally(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    fn shard(&self, key: &str) -> &Shard {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    fn observation(&self, op: &BucketOp, now: u64, epoch: u64) -> Option<Observation> {
        let shard = self.shard(&op.key);
        if shard.len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let found = *shard.lock().get(&op.key)?;
        (found.epoch == epoch && found.usable(now)).then_some(found)
    }

    // The group's outcome if every operation is certainly short of tokens, as the store would
    // report it (nothing debited). A group that charges always must reach the store, which
    // takes its tokens even when it denies.
    fn certain_denial(&self, group: &Group, now: u64, epoch: u64) -> Option<GroupOutcome> {
        let mut verdicts = Vec::with_capacity(group.len());
        let mut server_ms = 0;
        for op in group {
            // Credits always pass; a charge that goes in whatever the verdict must reach the
            // store. A check (need 0) is short while the bucket is certainly in debt.
            if op.need < 0.0 || (op.need > 0.0 && op.charge != Charge::Admitted) {
                return None;
            }
            let seen = self.observation(op, now, epoch)?;
            if covers(seen.bound(now, &op.spec)?, op.need) {
                return None;
            }
            let tokens = seen.likely(now, &op.spec);
            verdicts.push(Verdict {
                allowed: false,
                tokens,
                retry_after_ms: op.spec.wait_ms(tokens, op.need),
                reset_ms: op.spec.reset_ms(tokens),
                forgiven: 0.0,
                fastest_refill: seen.fastest_refill,
                kept_ms: seen.kept_ms.saturating_sub(now.saturating_sub(seen.local_ms)),
            });
            server_ms = server_ms.max(seen.server_ms + now.saturating_sub(seen.local_ms));
        }
        let admitted = group.iter().all(|op| op.role == Role::Shadow);
        Some(GroupOutcome { admitted, now_ms: server_ms, verdicts, refunded: false, unanswered: Vec::new() })
    }

    // Remembers what the store reported for the buckets the next equal request would find short.
    fn observe(&self, group: &Group, outcome: &GroupOutcome, call_start: u64, epoch: u64) {
        for (op, verdict) in group.iter().zip(&outcome.verdicts) {
            // Debits the store gave back raised balances after they were reported: like credits.
            let credit = op.need < 0.0 || outcome.refunded;
            // Nothing is remembered while raises elsewhere go unheard.
            let short =
                op.need >= 0.0 && !covers(verdict.tokens, op.need) && self.hearing.load(Ordering::Acquire);
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
                    let bound = o.tokens + o.elapsed_at_most(now) * o.fastest_refill / 1000.0;
                    o.usable(now) && bound < o.need
                });
                shard.len.store(map.len(), Ordering::Relaxed);
                if map.len() >= self.shard_capacity {
                    continue;
                }
            }
            // A bucket this call wrote holds exactly the balance reported (or less, if a later
            // operation of the batch took more), so the bound holds at any refill rate. A bucket
            // it only read reports its stored balance refilled at this operation's rate and
            // capped at its capacity: an upper bound only if that rate was the fastest the bucket
            // knows and the cap did not cut, and then only for requests refilling no faster.
            // A bucket of capacity 0 (refill 0) is never stored: it bounds only its like.
            let always = matches!(op.charge, Charge::Always { .. });
            let wrote = op.need != 0.0 && (always || (outcome.admitted && verdict.allowed));
            let rate_limit = if wrote {
                f64::INFINITY
            } else if op.spec.capacity() == 0.0 {
                0.0
            } else if op.spec.refill_per_second() >= verdict.fastest_refill
                && verdict.tokens < op.spec.capacity()
            {
                op.spec.refill_per_second()
            } else {
                continue;
            };
            // Finding a bucket of capacity 0 missing is exact.
            let kept_ms = if op.spec.capacity() > 0.0 { verdict.kept_ms } else { MAX_AGE_MS + 1 };
            // Denials counted since this call took the count stay counted.
            let unseen = map.get(&op.key).map_or(0.0, |o| o.unseen);
            let seen = Observation {
                unseen,
                tokens: verdict.tokens,
                need: op.need,
                server_ms: outcome.now_ms,
                local_ms: call_start,
                fastest_refill: verdict.fastest_refill.max(op.spec.refill_per_second()),
                kept_ms,
                rate_limit,
                epoch,
            };
            map.insert(op.key.clone(), seen);
            shard.len.store(map.len(), Ordering::Relaxed);
        }
    }

    // Counts what the denied `group` asked of its buckets, for the next operations that reach
    // the store.
    fn count_unseen(&self, group: &Group) {
        for op in group.iter().filter(|op| op.need > 0.0) {
            if let Some(seen) = self.shard(&op.key).lock().get_mut(&op.key) {
                seen.unseen += op.need;
            }
        }
    }

    // `group` carrying the denials counted for its buckets, if any were (the counts are taken).
    fn take_unseen(&self, group: &Group) -> Option<Group> {
        let mut carried: Option<Group> = None;
        for (i, op) in group.iter().enumerate() {
            let shard = self.shard(&op.key);
            if shard.len.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let unseen = match shard.lock().get_mut(&op.key) {
                Some(seen) if seen.unseen > 0.0 => std::mem::take(&mut seen.unseen),
                _ => continue,
            };
            carried.get_or_insert_with(|| group.clone())[i].unseen += unseen;
        }
        carried
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

impl RaiseListener for Precheck {
    fn subscribed(&self) {
        // Raises made while nobody listened are unknown: start from nothing.
        self.forget_everything();
        self.hearing.store(true, Ordering::Release);
    }

    fn lost(&self) {
        self.hearing.store(false, Ordering::Release);
        self.forget_everything();
    }

    fn raised(&self, key: &str) {
        let shard = self.shard(key);
        let mut map = shard.lock();
        // Calls running now may report a balance from before the raise.
        shard.void_until.store(self.clock.now_ms(), Ordering::Relaxed);
        if map.remove(key).is_some() {
            shard.len.store(map.len(), Ordering::Relaxed);
        }
    }
}

impl Shard {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Observation>> {
        self.map.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Store for Precheck {
    fn evaluate<'a>(
        &'a self,
        batch: &'a Batch,
        late: LateReply,
    ) -> BoxFuture<'a, Vec<Result<GroupOutcome, StoreError>>> {
        Box::pin(async move {
            let call_start = self.clock.now_ms();
            // Read before the call: an epoch that moves during it voids what it reports.
            let epoch = self.inner.epoch();
            // A credit in one group could lift a later group's bucket: such batches go to the
            // store whole.
            // Without hearing other replicas' raises, what was seen is no bound.
            let credits =
                batch.iter().flatten().any(|op| op.need < 0.0) || !self.hearing.load(Ordering::Acquire);
            let mut results: Vec<Option<Result<GroupOutcome, StoreError>>> = batch
                .iter()
                .map(|g| if credits { None } else { self.certain_denial(g, call_start, epoch).map(Ok) })
                .collect();
            let local = results.iter().filter(|r| r.is_some()).count();
            self.answered.fetch_add(local as u64, Ordering::Relaxed);
            if local > 0 {
                metrics::counter!("tollgate_precheck_answers_total").increment(local as u64);
                for (group, _) in batch.iter().zip(&results).filter(|(_, r)| r.is_some()) {
                    self.count_unseen(group);
                }
            }
            if local == batch.len() {
                return results.into_iter().flatten().collect();
            }
            // A denied group debits nothing, so leaving it out does not change the others.
            let remote: Vec<usize> = (0..batch.len()).filter(|&i| results[i].is_none()).collect();
            let carried: Vec<Option<Group>> = remote.iter().map(|&i| self.take_unseen(&batch[i])).collect();
            let answers = if local == 0 && carried.iter().all(Option::is_none) {
                self.inner.evaluate(batch, late).await
            } else {
                let rest: Vec<Group> =
                    remote.iter().zip(carried).map(|(&i, c)| c.unwrap_or_else(|| batch[i].clone())).collect();
                self.inner.evaluate(&rest, late).await
            };
            let mut failed = false;
            for (&i, answer) in remote.iter().zip(answers) {
                match &answer {
                    Ok(outcome) => self.observe(&batch[i], outcome, call_start, epoch),
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

    // Leases only ever lower what the shared part of a bucket holds and refills (a shrink returns
    // capacity and rate, never tokens), so what the pre-check learnt stays a sound bound.
    fn lease<'a>(&'a self, ops: &'a [LeaseOp]) -> BoxFuture<'a, Vec<Result<LeaseOutcome, StoreError>>> {
        self.inner.lease(ops)
    }

    // Budget ops reach only a priced domain's buckets, which RLS requests (the only ones the
    // pre-check answers) never name.
    fn budget<'a>(&'a self, op: &'a BudgetOp) -> BoxFuture<'a, Result<BudgetOutcome, StoreError>> {
        self.inner.budget(op)
    }

    // Slot sets are never answered from what was seen: a give-back on any replica frees a slot
    // at once, which no refill bound describes.
    fn slots<'a>(&'a self, op: &'a SlotOp) -> BoxFuture<'a, Result<SlotOutcome, StoreError>> {
        self.inner.slots(op)
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.ping()
    }

    fn describe(&self) -> String {
        format!("{} with the local pre-check", self.inner.describe())
    }

    fn epoch(&self) -> u64 {
        self.inner.epoch()
    }
}
