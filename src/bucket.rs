//! Token-bucket arithmetic: the Rust definition of how a bucket refills, admits and debits.
//!
//! A bucket is a stored pair (tokens, last_refill_ms). Nothing refills it in the background: every
//! evaluation first adds `elapsed × rate` tokens, capped at the capacity, then compares the
//! balance with the request's need. Missing state means a full bucket, so idle buckets may expire.
//!
//! Requests arrive as a [`Batch`] of [`Group`]s. A group is all-or-nothing: if any non-shadow
//! operation in it lacks tokens, none of the group's operations is debited. Groups are evaluated
//! in order, and an operation sees the debits of earlier operations on the same key, so one
//! request that names the same bucket twice is charged twice.
//!
//! This module is the memory backend's algorithm. The Redis backend runs the same algorithm as a
//! Lua script (`src/store/token_bucket.lua`), operation for operation and in the same floating
//! point order; `tests/equivalence.rs` replays random operation sequences against both and
//! requires identical decisions and balances. Change one, change the other.

use std::collections::HashMap;

use serde::Serialize;

/// Capacity (largest burst) and sustained refill rate of one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BucketSpec {
    /// Most tokens the bucket can hold; a new bucket starts full.
    pub capacity: f64,
    /// Tokens added per second while the bucket is below capacity.
    pub refill_per_second: f64,
}

/// Largest accepted capacity: beyond 2^53 a balance is no longer exact in an f64.
pub const MAX_CAPACITY: f64 = 1e15;

impl BucketSpec {
    /// A checked bucket: finite, non-negative, and refilling unless it is empty for good.
    /// Every bucket from outside (config, database, command line) comes through here.
    pub fn new(capacity: f64, refill_per_second: f64) -> Result<BucketSpec, String> {
        if !capacity.is_finite() || !(0.0..=MAX_CAPACITY).contains(&capacity) {
            return Err(format!("capacity must be between 0 and {MAX_CAPACITY:e}, got {capacity}"));
        }
        if !refill_per_second.is_finite() || refill_per_second < 0.0 {
            return Err(format!("refill_per_second must be a non-negative number, got {refill_per_second}"));
        }
        if refill_per_second == 0.0 && capacity > 0.0 {
            return Err("refill_per_second must be above 0 (a bucket that never refills is a quota, not a rate limit)".into());
        }
        Ok(BucketSpec { capacity, refill_per_second })
    }

    /// Tokens per millisecond, the unit the algorithm works in.
    fn rate_per_ms(&self) -> f64 {
        self.refill_per_second / 1000.0
    }

    /// How long an untouched bucket must live: past this it is full, and a missing bucket is
    /// treated as full, so expiring it changes nothing.
    pub fn idle_ttl_ms(&self) -> u64 {
        ((self.capacity / self.rate_per_ms()).ceil() + 1000.0) as u64
    }
}

/// The stored state of one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketState {
    /// Balance as of `last_refill_ms`; never negative.
    pub tokens: f64,
    /// When the balance was last brought up to date, in clock milliseconds.
    pub last_refill_ms: u64,
}

/// One debit (or credit) against one bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketOp {
    /// The storage key of the bucket (see [`crate::keys`]).
    pub key: String,
    /// Capacity and rate, sent with every operation so a quota change applies at once.
    pub spec: BucketSpec,
    /// Tokens to take. Zero checks without taking; negative gives tokens back (capped).
    pub need: f64,
    /// A shadow operation is evaluated and debited like any other, but its lack of tokens never
    /// denies its group.
    pub shadow: bool,
}

/// The operations evaluated all-or-nothing together.
pub type Group = Vec<BucketOp>;

/// Groups evaluated together in one atomic step of a store, each group independently.
pub type Batch = [Group];

/// What one operation found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    /// The bucket had the tokens this operation needed (regardless of the rest of its group).
    pub allowed: bool,
    /// Balance after the group: debited if the group was admitted, otherwise only refilled.
    pub tokens: f64,
    /// For a denied operation, how long until the bucket holds `need` tokens; `None` if it
    /// never will (need above capacity). Zero for allowed operations.
    pub retry_after_ms: Option<u64>,
    /// How long until the bucket is full again.
    pub reset_ms: u64,
}

/// What one group found.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupOutcome {
    /// Every non-shadow operation had its tokens, so the group's debits were applied.
    pub admitted: bool,
    /// The store's clock at evaluation, in milliseconds since the epoch.
    pub now_ms: u64,
    /// One verdict per operation, in the group's order.
    pub verdicts: Vec<Verdict>,
}

/// A bucket whose state a batch changed and that must be written back.
#[derive(Debug, Clone, PartialEq)]
pub struct Write {
    /// The bucket's key.
    pub key: String,
    /// The state to store.
    pub state: BucketState,
    /// How long the stored state is worth keeping.
    pub ttl_ms: u64,
}

/// The result of [`evaluate`]: outcomes for the caller, writes for the store.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// One outcome per group, in order.
    pub groups: Vec<GroupOutcome>,
    /// Buckets to write back. Untouched, denied and check-only buckets are not written: their
    /// stored state, refilled later, yields the same balance.
    pub writes: Vec<Write>,
}

/// Brings a bucket's balance up to `now_ms`.
///
/// A clock step backwards refills nothing and does not move `last_refill_ms` back, so the same
/// interval is never refilled twice.
pub fn refill(state: Option<BucketState>, spec: &BucketSpec, now_ms: u64) -> BucketState {
    match state {
        None => BucketState { tokens: spec.capacity, last_refill_ms: now_ms },
        Some(s) => {
            let elapsed = now_ms.saturating_sub(s.last_refill_ms) as f64;
            BucketState {
                tokens: spec.capacity.min(s.tokens + elapsed * spec.rate_per_ms()),
                last_refill_ms: s.last_refill_ms.max(now_ms),
            }
        }
    }
}

/// Evaluates `batch` at `now_ms` against the states `load` returns (`None` = no stored bucket).
///
/// `load` is called at most once per distinct key.
pub fn evaluate(batch: &Batch, now_ms: u64, mut load: impl FnMut(&str) -> Option<BucketState>) -> Evaluation {
    // Committed state of every key touched so far in this batch.
    let mut running: HashMap<&str, Option<BucketState>> = HashMap::new();
    let mut dirty: HashMap<&str, u64> = HashMap::new();
    let mut dirty_order: Vec<&str> = Vec::new();
    let mut groups = Vec::with_capacity(batch.len());

    for group in batch {
        // Tentative state: this group's debits, visible to its later operations only.
        let mut tentative: HashMap<&str, BucketState> = HashMap::new();
        let mut verdicts = Vec::with_capacity(group.len());
        let mut admitted = true;

        for op in group {
            let key = op.key.as_str();
            let before = match tentative.get(key) {
                Some(s) => Some(*s),
                None => *running.entry(key).or_insert_with(|| load(key)),
            };
            let mut state = refill(before, &op.spec, now_ms);
            let allowed = state.tokens >= op.need;
            let retry_after_ms = if allowed {
                state.tokens = op.spec.capacity.min(state.tokens - op.need);
                Some(0)
            } else if op.need > op.spec.capacity {
                None
            } else {
                Some(((op.need - state.tokens) / op.spec.rate_per_ms()).ceil() as u64)
            };
            tentative.insert(key, state);
            admitted &= allowed || op.shadow;
            verdicts.push(Verdict { allowed, tokens: state.tokens, retry_after_ms, reset_ms: 0 });
        }

        for (op, verdict) in group.iter().zip(verdicts.iter_mut()) {
            let key = op.key.as_str();
            if admitted {
                running.insert(key, tentative.get(key).copied());
                let debited = verdict.allowed && op.need != 0.0 && op.spec.refill_per_second > 0.0;
                if debited && dirty.insert(key, op.spec.idle_ttl_ms()).is_none() {
                    dirty_order.push(key);
                }
            } else {
                verdict.tokens = refill(running[key], &op.spec, now_ms).tokens;
            }
            if verdict.tokens < op.spec.capacity {
                verdict.reset_ms =
                    ((op.spec.capacity - verdict.tokens) / op.spec.rate_per_ms()).ceil() as u64;
            }
        }
        groups.push(GroupOutcome { admitted, now_ms, verdicts });
    }

    let writes = dirty_order
        .into_iter()
        .map(|key| Write {
            key: key.to_owned(),
            state: running[key].expect("a debited bucket has state"),
            ttl_ms: dirty[key],
        })
        .collect();
    Evaluation { groups, writes }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(capacity: f64, refill_per_second: f64) -> BucketSpec {
        BucketSpec { capacity, refill_per_second }
    }

    fn op(key: &str, spec: BucketSpec, need: f64) -> BucketOp {
        BucketOp { key: key.into(), spec, need, shadow: false }
    }

    #[test]
    fn new_bucket_starts_full_and_debits() {
        let e = evaluate(&[vec![op("a", spec(10.0, 1.0), 3.0)]], 1_000, |_| None);
        let v = e.groups[0].verdicts[0];
        assert!(e.groups[0].admitted && v.allowed);
        assert_eq!(v.tokens, 7.0);
        assert_eq!(v.reset_ms, 3_000);
        assert_eq!(
            e.writes,
            vec![Write {
                key: "a".into(),
                state: BucketState { tokens: 7.0, last_refill_ms: 1_000 },
                ttl_ms: 11_000,
            }]
        );
    }

    #[test]
    fn refill_is_lazy_capped_and_ignores_clock_steps_back() {
        let s = BucketState { tokens: 2.0, last_refill_ms: 10_000 };
        assert_eq!(refill(Some(s), &spec(10.0, 2.0), 12_000).tokens, 6.0);
        assert_eq!(refill(Some(s), &spec(10.0, 2.0), 60_000).tokens, 10.0);
        let back = refill(Some(s), &spec(10.0, 2.0), 5_000);
        assert_eq!(back, BucketState { tokens: 2.0, last_refill_ms: 10_000 });
    }

    #[test]
    fn denial_reports_wait_and_writes_nothing() {
        let s = BucketState { tokens: 1.0, last_refill_ms: 0 };
        let e = evaluate(&[vec![op("a", spec(10.0, 2.0), 4.0)]], 0, |_| Some(s));
        let v = e.groups[0].verdicts[0];
        assert!(!e.groups[0].admitted && !v.allowed);
        assert_eq!(v.retry_after_ms, Some(1_500));
        assert_eq!(v.tokens, 1.0);
        assert!(e.writes.is_empty());
    }

    #[test]
    fn need_above_capacity_never_succeeds() {
        let e = evaluate(&[vec![op("a", spec(10.0, 2.0), 11.0)]], 0, |_| None);
        assert_eq!(e.groups[0].verdicts[0].retry_after_ms, None);
    }

    #[test]
    fn group_is_all_or_nothing() {
        let empty = BucketState { tokens: 0.0, last_refill_ms: 0 };
        let e = evaluate(
            &[vec![op("tenant", spec(10.0, 1.0), 1.0), op("export", spec(5.0, 1.0), 5.0)]],
            0,
            |k| (k == "export").then_some(empty),
        );
        assert!(!e.groups[0].admitted);
        assert!(e.groups[0].verdicts[0].allowed);
        assert_eq!(e.groups[0].verdicts[0].tokens, 10.0, "tenant bucket not debited");
        assert!(e.writes.is_empty());
    }

    #[test]
    fn shadow_denial_does_not_deny_the_group() {
        let mut shadow = op("s", spec(1.0, 1.0), 2.0);
        shadow.shadow = true;
        let e = evaluate(&[vec![op("a", spec(5.0, 1.0), 1.0), shadow]], 0, |_| None);
        assert!(e.groups[0].admitted);
        assert!(!e.groups[0].verdicts[1].allowed);
        assert_eq!(e.writes.len(), 1);
    }

    #[test]
    fn same_key_twice_in_one_group_is_charged_twice() {
        let s = spec(10.0, 1.0);
        let e = evaluate(&[vec![op("a", s, 6.0), op("a", s, 6.0)]], 0, |_| None);
        assert!(!e.groups[0].admitted, "12 tokens from a 10-token bucket");
        let e = evaluate(&[vec![op("a", s, 4.0), op("a", s, 4.0)]], 0, |_| None);
        assert_eq!(e.groups[0].verdicts[1].tokens, 2.0);
        assert_eq!(e.writes[0].state.tokens, 2.0);
    }

    #[test]
    fn later_groups_see_earlier_debits() {
        let s = spec(3.0, 1.0);
        let batch = [vec![op("a", s, 2.0)], vec![op("a", s, 2.0)]];
        let e = evaluate(&batch, 0, |_| None);
        assert!(e.groups[0].admitted);
        assert!(!e.groups[1].admitted);
        assert_eq!(e.groups[1].verdicts[0].tokens, 1.0);
    }

    #[test]
    fn credit_and_check_only() {
        let s = BucketState { tokens: 1.0, last_refill_ms: 0 };
        let e = evaluate(&[vec![op("a", spec(5.0, 1.0), -10.0)]], 0, |_| Some(s));
        assert_eq!(e.groups[0].verdicts[0].tokens, 5.0, "credit is capped at capacity");
        let e = evaluate(&[vec![op("a", spec(5.0, 1.0), 0.0)]], 0, |_| Some(s));
        assert!(e.groups[0].verdicts[0].allowed);
        assert!(e.writes.is_empty(), "a check changes nothing");
    }

    #[test]
    fn zero_capacity_denies_forever_without_dividing_by_zero() {
        let e = evaluate(&[vec![op("a", spec(0.0, 0.0), 1.0)]], 0, |_| None);
        let v = e.groups[0].verdicts[0];
        assert_eq!((v.allowed, v.retry_after_ms, v.reset_ms), (false, None, 0));
    }
}
