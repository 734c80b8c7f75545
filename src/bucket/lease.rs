//! Leases: parts of a bucket a tollgate replica hands to the Envoys it serves over Rate
//! Limit Quota streams, who enforce them on their own.
//!
//! A lease is a capacity and a refill rate, recorded in the bucket's own state with an expiry.
//! While it lives, the rest of the bucket (what RLS requests and the pre-check see) keeps and
//! refills only what is left: at most `capacity - Σ leased capacity` tokens, refilling at
//! `rate - Σ leased rate` ([`super::refill()`] walks the expiries between two evaluations, so a lease
//! counts exactly until the millisecond it expires). An Envoy's new local bucket starts full, so
//! taking or growing a lease's capacity needs the added tokens at once: they come from the lease's
//! bank, else from the balance, and a lease grows no further than those cover (never into debt:
//! an Envoy spends a full bucket whatever the balance). Shrinking one returns capacity and rate,
//! not tokens. So the tokens every Envoy can spend plus the shared balance never exceed the
//! capacity, and together they refill no faster than the rate: the bound of a bucket that no
//! replica leases.
//!
//! **The bank.** A lease smaller than one request (`unit`) is leased at capacity 0: no Envoy can
//! use it, but it keeps its rate, which no one else spends then, so that rate fills the lease's
//! bank, from which the capacity grows later. This is what lets an Envoy's lease start on a
//! bucket whose balance RLS requests keep at zero: without it the lease could never get the first
//! request's tokens.
//!
//! A lease op sets a replica's lease to an absolute size, so running it twice (a retry after a
//! lost reply) takes nothing more: it is exactly-once by construction.
//!
//! This is the Rust twin of `lease` in `src/store/redis/lease.lua`; `tests/equivalence.rs` replays both.

use super::refill::{bank, life_ms, note_spec, refill, Lease};
use super::{BucketSpec, BucketState, Write, MAX_WAIT_MS};

/// Sets `replica`'s lease on a bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseOp {
    /// The bucket's key.
    pub key: String,
    /// The bucket's capacity and rate.
    pub spec: BucketSpec,
    /// Who leases.
    pub replica: String,
    /// The capacity wanted, in tokens (0 with a rate of 0 releases the lease).
    pub capacity: f64,
    /// The smallest capacity worth leasing (one request's tokens): less is leased as 0.
    pub unit: f64,
    /// The rate wanted, in tokens per second.
    pub refill_per_second: f64,
    /// The most of the rate the other leases leave that this op takes (1: all of it). A first
    /// lease, which cannot know how many replicas start beside it, takes part of it
    /// (`crate::limiter::YOUNG_OF_UNLEASED`): any number of them starting at once each get some,
    /// and together they leave little of the rate unleased.
    pub of_unleased: f64,
    /// How long the lease lives from now, in milliseconds.
    pub ttl_ms: u64,
    /// The replica's demand, in tokens per second.
    pub demand: f64,
    /// Some of the replica's clients start their local buckets afresh, full, with the
    /// assignment this op makes: its whole capacity is taken again, not only what it grew by.
    pub fresh: bool,
}

/// Most leaseholders with a live lease on one bucket. Every lease op and every request on the
/// bucket reads all of its leases inside one script, so their number is what a request costs
/// the store: 900 RLQS streams on one bucket took 12.8 s of Redis CPU in 18 s and pushed other
/// tenants into the failure mode (100 did not). A newcomer beyond it gets no lease
/// ([`LeaseOutcome::refused`]); the leaseholders already there keep theirs.
pub const MAX_LEASEHOLDERS: usize = 100;

/// What a lease op got.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseOutcome {
    /// The store's clock, in milliseconds since the epoch.
    pub now_ms: u64,
    /// The capacity leased now: what was wanted, or what the other leases left.
    pub capacity: f64,
    /// The rate leased now.
    pub refill_per_second: f64,
    /// The other leaseholders' live leases: capacity, rate and demand (theirs, and what other
    /// requests asked lately).
    pub others: Others,
    /// The bucket had [`MAX_LEASEHOLDERS`] others and the op's leaseholder was not one of them:
    /// nothing leased, nothing written.
    pub refused: bool,
}

/// The other leaseholders' live leases on a bucket, summed, and the demand beside them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Others {
    /// Their capacity.
    pub capacity: f64,
    /// Their rate per second.
    pub refill_per_second: f64,
    /// Their demand per second, and what requests other than leases asked per second lately
    /// ([`Asked`]).
    pub demand: f64,
}

/// Applies `op` at `now_ms` to the bucket `stored` (its state and expiry, `None` if missing):
/// the outcome, and the write that records it. A bucket that never refills (capacity 0) has
/// nothing to lease: the op leases nothing and writes nothing.
pub fn lease(
    stored: Option<(&BucketState, u64)>,
    op: &LeaseOp,
    now_ms: u64,
) -> (LeaseOutcome, Option<Write>) {
    if op.spec.refill_per_second() <= 0.0 {
        let nothing = LeaseOutcome {
            now_ms,
            capacity: 0.0,
            refill_per_second: 0.0,
            others: Others::default(),
            refused: false,
        };
        return (nothing, None);
    }
    let mut state = refill(stored.map(|(s, _)| s), &op.spec, now_ms);
    let live: Vec<Lease> =
        std::mem::take(&mut state.leases).into_iter().filter(|h| h.expires_at_ms > now_ms).collect();
    // Only a lease asked to be nothing goes: one cut to nothing still records its demand, which the
    // other replicas size theirs by.
    let release = op.capacity <= 0.0 && op.refill_per_second <= 0.0;
    if !release && live.len() >= MAX_LEASEHOLDERS && !live.iter().any(|h| h.replica == op.replica) {
        let refused = LeaseOutcome {
            now_ms,
            capacity: 0.0,
            refill_per_second: 0.0,
            others: Others::default(),
            refused: true,
        };
        return (refused, None);
    }
    let mut others = Others::default();
    let (mut before, mut banked) = (0.0, 0.0);
    for h in &live {
        if h.replica == op.replica {
            before = if op.fresh { 0.0 } else { h.capacity };
            banked = bank(h, now_ms, op.spec.capacity());
        } else {
            others.capacity += h.capacity;
            others.refill_per_second += h.refill_per_second;
            others.demand += h.demand;
        }
    }
    others.demand += state.asked.per_second(now_ms);
    let mut capacity = op.capacity.min((op.spec.capacity() - others.capacity).max(0.0));
    let rate = op
        .refill_per_second
        .min((op.spec.refill_per_second() - others.refill_per_second).max(0.0) * op.of_unleased);
    if capacity > before {
        capacity = capacity.min(before + banked + state.tokens.max(0.0));
    }
    if capacity < op.unit {
        capacity = 0.0;
    }
    if capacity > before {
        let from_bank = banked.min(capacity - before);
        banked -= from_bank;
        state.tokens -= capacity - before - from_bank;
    }
    note_spec(&mut state, &op.spec, now_ms);
    let mine = Lease {
        replica: op.replica.clone(),
        capacity,
        refill_per_second: rate,
        expires_at_ms: now_ms.saturating_add(op.ttl_ms),
        demand: op.demand,
        banked,
        since_ms: now_ms,
    };
    let mut placed = false;
    for h in live {
        if h.replica == op.replica {
            placed = true;
            if !release {
                state.leases.push(mine.clone());
            }
        } else {
            state.leases.push(h);
        }
    }
    if !placed && !release {
        state.leases.push(mine);
    }
    let tokens = state.tokens;
    let mut ttl_ms = life_ms(&state, tokens, now_ms);
    // A write never moves an expiry earlier.
    if let Some((_, expires_at_ms)) = stored {
        ttl_ms = ttl_ms.max(expires_at_ms.saturating_sub(now_ms).min(MAX_WAIT_MS));
    }
    let outcome = LeaseOutcome { now_ms, capacity, refill_per_second: rate, others, refused: false };
    (outcome, Some(Write { key: op.key.clone(), state, ttl_ms }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{evaluate, BucketOp, Charge, Role};

    fn op(capacity: f64, rate: f64) -> LeaseOp {
        LeaseOp {
            key: "k".into(),
            spec: BucketSpec::new(10.0, 1.0).unwrap(),
            replica: "a".into(),
            capacity,
            unit: 1.0,
            refill_per_second: rate,
            of_unleased: 1.0,
            ttl_ms: 60_000,
            demand: 0.5,
            fresh: false,
        }
    }

    fn stored(write: &Option<Write>, now_ms: u64) -> Option<(&BucketState, u64)> {
        write.as_ref().map(|w| (&w.state, now_ms + w.ttl_ms))
    }

    #[test]
    fn a_lease_takes_its_capacity_once_and_leaves_the_rest_to_rls() {
        let (first, w1) = lease(None, &op(4.0, 0.5), 0);
        assert_eq!((first.capacity, first.refill_per_second), (4.0, 0.5));
        assert_eq!(w1.as_ref().unwrap().state.tokens, 6.0);
        // The same op again (a retry after a lost reply) takes nothing more.
        let (again, w2) = lease(stored(&w1, 0), &op(4.0, 0.5), 1_000);
        assert_eq!(again.capacity, 4.0);
        let state = &w2.as_ref().unwrap().state;
        assert_eq!(state.tokens, 6.0, "full at what the lease leaves: 10 - 4");
        // RLS sees 6 tokens refilling at 0.5 a second.
        let rls = BucketOp {
            key: "k".into(),
            spec: op(0.0, 0.0).spec,
            need: 6.0,
            unseen: 0.0,
            role: Role::Enforced,
            charge: Charge::Admitted,
        };
        let e = evaluate(&[vec![rls.clone()]], 1_000, |_| stored(&w2, 1_000).map(|(s, at)| (s.clone(), at)));
        assert!(e.groups[0].admitted);
        let after = e.writes[0].state.clone();
        let e = evaluate(&[vec![BucketOp { need: 1.0, ..rls }]], 2_000, |_| Some((after.clone(), u64::MAX)));
        assert!(!e.groups[0].admitted, "half a token refilled in a second");
        assert_eq!(e.groups[0].verdicts[0].retry_after_ms, Some(1_000));
    }

    #[test]
    fn a_lease_short_of_tokens_banks_its_rate_until_it_covers_a_request() {
        let drained =
            BucketState { tokens: 0.0, last_refill_ms: 0, fastest_refill: 1.0, ..Default::default() };
        let (first, w1) = lease(Some((&drained, u64::MAX)), &op(3.0, 0.5), 0);
        assert_eq!((first.capacity, first.refill_per_second), (0.0, 0.5), "no tokens: the rate alone");
        // Two seconds later the bank has one token, enough for a request.
        let (second, w2) = lease(stored(&w1, 0), &op(3.0, 0.5), 2_000);
        assert_eq!(second.capacity, 1.0 + 1.0, "the bank's token and the balance's 0.5 x 2 s");
        let state = &w2.unwrap().state;
        assert_eq!((state.leases[0].banked, state.tokens), (0.0, 0.0));
    }
}
