//! One bucket's arithmetic, the twin of `src/store/redis/bucket.lua`: the leases a bucket records
//! and what they take of it as time passes (set by [`super::lease()`], the twin of `lease.lua`,
//! which builds on this file as `lease.lua` follows `bucket.lua`), the refill walk between two
//! evaluations (pending rate raises, leases expiring on the way), what the leases leave a spec,
//! the debit with its debt floor, and how long a written bucket must live. [`super::group`]
//! composes these into all-or-nothing groups.

use super::spec::wait;
use super::{BucketOp, BucketSpec, BucketState, MAX_WAIT_MS, RATE_RAISE_DELAY_MS};

/// One replica's lease on a bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    /// The replica that took it (no whitespace: the Redis field separates by it).
    pub replica: String,
    /// Tokens its Envoys' local buckets may take together.
    pub capacity: f64,
    /// Tokens per second those local buckets refill together.
    pub refill_per_second: f64,
    /// When it stops counting, in clock milliseconds (alive while the clock is before it).
    pub expires_at_ms: u64,
    /// What its Envoys asked for, in tokens per second: what other replicas size theirs by.
    pub demand: f64,
    /// Tokens its rate filled while it leased no capacity, toward its capacity.
    pub banked: f64,
    /// When the lease was last set, in clock milliseconds (the bank fills from then).
    pub since_ms: u64,
}

/// The capacity and rate (per second) of the leases in `leases` alive at `at_ms`, summed in order.
pub fn leased_at(leases: &[Lease], at_ms: u64) -> (f64, f64) {
    let mut leased = (0.0, 0.0);
    for h in leases.iter().filter(|h| h.expires_at_ms > at_ms) {
        leased.0 += h.capacity;
        leased.1 += h.refill_per_second;
    }
    leased
}

/// What lease `h` has banked for its leaseholder as of `at_ms`: a lease with no capacity banks its
/// rate (up to `capacity`), so that a leaseholder cut below one request still gets its rate's worth
/// when it next grows; a lease with capacity keeps what its growth left of the bank.
pub fn bank(h: &Lease, at_ms: u64, capacity: f64) -> f64 {
    if h.capacity == 0.0 {
        (h.banked + h.refill_per_second * at_ms.saturating_sub(h.since_ms) as f64 / 1000.0).min(capacity)
    } else {
        h.banked
    }
}

/// What the leases alive at `alive_ms` have banked as of `at_ms`, summed in order: tokens the
/// balance must leave room for, since their leaseholders spend them on top of it.
pub fn banked_at(leases: &[Lease], alive_ms: u64, at_ms: u64, capacity: f64) -> f64 {
    let mut banked = 0.0;
    for h in leases.iter().filter(|h| h.expires_at_ms > alive_ms) {
        banked += bank(h, at_ms, capacity);
    }
    banked
}

/// Whether any of `leases` is alive at `now_ms`.
pub fn leases_live(leases: &[Lease], now_ms: u64) -> bool {
    leases.iter().any(|h| h.expires_at_ms > now_ms)
}

/// The window over which [`Asked`] counts, in milliseconds.
pub const ASKED_WINDOW_MS: u64 = 5_000;

/// Tokens asked of a bucket by requests other than leases (RLS, `POST /json`), counted while it
/// has leases, in two windows of `WINDOW_MS` ([`ASKED_WINDOW_MS`] in the bucket's state): the
/// demand RLQS leases are sized beside, so that when both sides ask more than the bucket gives,
/// each gets its demand's part (an RLS request takes what refilled whenever it comes; a lease
/// only what its size says). A region's share counts its own demand in shorter windows.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Asked<const WINDOW_MS: u64 = ASKED_WINDOW_MS> {
    /// Tokens asked in the window before the current one.
    pub previous: f64,
    /// Tokens asked in the current window.
    pub current: f64,
    /// When the current window started, in clock milliseconds (0: never counted).
    pub since_ms: u64,
}

impl<const WINDOW_MS: u64> Asked<WINDOW_MS> {
    // Moves the windows on to the one `now_ms` falls in.
    fn roll(&mut self, now_ms: u64) {
        if self.since_ms == 0 || now_ms >= self.since_ms.saturating_add(2 * WINDOW_MS) {
            *self = Asked { previous: 0.0, current: 0.0, since_ms: now_ms };
        } else if now_ms >= self.since_ms + WINDOW_MS {
            *self = Asked { previous: self.current, current: 0.0, since_ms: self.since_ms + WINDOW_MS };
        }
    }

    /// Counts `need` tokens asked at `now_ms`.
    pub fn record(&mut self, now_ms: u64, need: f64) {
        self.roll(now_ms);
        self.current += need;
    }

    /// Tokens asked per second over the last window and the current one, as of `now_ms`.
    pub fn per_second(&mut self, now_ms: u64) -> f64 {
        self.roll(now_ms);
        let span = WINDOW_MS + now_ms.saturating_sub(self.since_ms);
        (self.previous + self.current) * 1000.0 / span as f64
    }
}

/// How long after `now_ms` the last lease alive then expires (0 if none): a bucket written now
/// must live that much longer, since the leases may take all of its refill until then.
pub fn leased_for_ms(leases: &[Lease], now_ms: u64) -> u64 {
    leases.iter().map(|h| h.expires_at_ms.saturating_sub(now_ms)).max().unwrap_or(0)
}

/// Brings a bucket's balance up to `now_ms` under `spec`.
///
/// The refill runs at `spec`'s rate, never faster than the rate in force, which a pending raise
/// replaces from the moment it takes effect, less what live leases take; the balance is capped at
/// the capacity less what they lease. The interval is walked in pieces between the moments those
/// change (the raise, each lease's expiry), so a lease counts until the millisecond it expires. A
/// clock step backwards refills nothing and does not move `last_refill_ms` back, so the same
/// interval is never refilled twice.
pub fn refill(state: Option<&BucketState>, spec: &BucketSpec, now_ms: u64) -> BucketState {
    let Some(s) = state else {
        return BucketState { tokens: spec.capacity(), last_refill_ms: now_ms, ..BucketState::default() };
    };
    let rate = spec.rate_per_ms();
    // An unknown rate in force (0) caps nothing.
    let capped = |in_force: f64| if in_force > 0.0 { rate.min(in_force / 1000.0) } else { rate };
    let mut next = s.clone();
    let mut from = s.last_refill_ms;
    let mut tokens = s.tokens;
    loop {
        let mut to = now_ms.max(from);
        if next.pending_refill > 0.0 && next.pending_from_ms > from && next.pending_from_ms < to {
            to = next.pending_from_ms;
        }
        for h in &s.leases {
            if h.expires_at_ms > from && h.expires_at_ms < to {
                to = h.expires_at_ms;
            }
        }
        if next.pending_refill > 0.0 && next.pending_from_ms <= from && from < now_ms {
            take_effect(&mut next);
        }
        let (leased_capacity, leased_rate) = leased_at(&s.leases, from);
        let grow = (capped(next.fastest_refill) - leased_rate / 1000.0).max(0.0);
        // The banks grow while the balance refills: the two together stay within the capacity.
        let room =
            (spec.capacity() - leased_capacity - banked_at(&s.leases, from, to, spec.capacity())).max(0.0);
        tokens = room.min(tokens + (to - from) as f64 * grow);
        from = to;
        if from >= now_ms {
            break;
        }
    }
    if next.pending_refill > 0.0 && next.pending_from_ms <= now_ms {
        take_effect(&mut next);
    }
    next.tokens = tokens;
    next.last_refill_ms = s.last_refill_ms.max(now_ms);
    next
}

// The pending rate becomes the rate in force.
pub(super) fn take_effect(state: &mut BucketState) {
    state.fastest_refill = state.pending_refill;
    state.pending_refill = 0.0;
    state.pending_from_ms = 0;
}

/// What is left of `spec` beside the leases alive at `now_ms`: capacity, and refill per ms.
pub(super) fn unleased(state: &BucketState, spec: &BucketSpec, now_ms: u64) -> (f64, f64) {
    let (leased_capacity, leased_rate) = leased_at(&state.leases, now_ms);
    let banked = banked_at(&state.leases, now_ms, now_ms, spec.capacity());
    (
        (spec.capacity() - leased_capacity - banked).max(0.0),
        (spec.rate_per_ms() - leased_rate / 1000.0).max(0.0),
    )
}

/// Whether a balance of `tokens` covers `need`: credits always do; a check (0) needs a
/// balance that is not in debt.
pub fn covers(tokens: f64, need: f64) -> bool {
    need < 0.0 || tokens >= need
}

// Records that a charge used `spec` at `now_ms`: its capacity and rate count for the bucket's
// life, and a rate faster than the bucket's ceiling becomes pending. A spec that never refills
// (capacity 0) is never stored, so its rate counts for nothing.
pub(super) fn note_spec(state: &mut BucketState, spec: &BucketSpec, now_ms: u64) {
    state.largest_capacity = state.largest_capacity.max(spec.capacity());
    let rate = spec.refill_per_second();
    if rate <= 0.0 {
        return;
    }
    if state.fastest_refill == 0.0 {
        state.fastest_refill = rate;
    } else if raises_ceiling(state, spec) {
        state.pending_refill = rate;
        state.pending_from_ms = now_ms.saturating_add(RATE_RAISE_DELAY_MS);
    }
    state.slowest_refill = if state.slowest_refill == 0.0 { rate } else { state.slowest_refill.min(rate) };
}

// Whether `spec` refills faster than the ceiling of the bucket `state`, whose rate in force is
// known: then its rate becomes pending.
pub(super) fn raises_ceiling(state: &BucketState, spec: &BucketSpec) -> bool {
    state.fastest_refill > 0.0 && spec.refill_per_second() > state.rate_ceiling()
}

// Takes `op.need` from `state` as its charge mode says, capped at `capacity` (what the leases
// leave), and records the op's spec; returns the tokens forgiven below the floor. A balance
// already below this op's floor (left by a deeper one) is not raised to it.
pub(super) fn debit(state: &mut BucketState, op: &BucketOp, capacity: f64, now_ms: u64) -> f64 {
    note_spec(state, &op.spec, now_ms);
    let after = capacity.min(state.tokens - op.need);
    let kept = after.max(state.tokens.min(op.charge.floor()));
    state.tokens = kept;
    kept - after
}

// What a bucket with leases records as asked of it by `op`: its need and the denials it did not
// see.
pub(super) fn asked(op: &BucketOp) -> f64 {
    op.need.max(0.0) + op.unseen
}

// How long a bucket written as `state` at `now_ms` by an operation with debt floor `floor` must
// live: until its balance (or the floor, if lower) has refilled to the largest capacity at the
// slowest rate any charge used, plus a second, counted from when the last live lease expires
// (until then the leases may take all of its refill). Past that it is full under every spec that
// wrote it.
pub(super) fn life_ms(state: &BucketState, floor: f64, now_ms: u64) -> u64 {
    let lowest = state.tokens.min(floor);
    wait(state.largest_capacity - lowest, state.slowest_refill / 1000.0)
        .saturating_add(1000)
        .saturating_add(leased_for_ms(&state.leases, now_ms))
        .min(MAX_WAIT_MS)
}
