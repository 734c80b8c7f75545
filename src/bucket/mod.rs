//! Token-bucket arithmetic: the Rust definition of how a bucket refills, admits and debits.
//!
//! A bucket is a stored balance and the time it was last brought up to date. Nothing refills it
//! in the background: every evaluation first adds `elapsed × rate` tokens, capped at the
//! capacity, then compares the balance with the request's need. Missing state means a full
//! bucket, so idle buckets may expire.
//!
//! Requests arrive as a [`Batch`] of [`Group`]s, one group per request. A group is
//! all-or-nothing: if it is denied, none of its [`Charge::Admitted`] operations is debited. An
//! operation's [`Role`] says how its shortage counts: an enforced operation that is short denies
//! the group, a shadow one never does, and quota-mode operations deny it only when every one of
//! them is short (envoyproxy/ratelimit's `quota_mode`). [`Charge::Always`] operations are debited
//! whatever the verdict, down to a floor of `-max_debt` (a cost known only after the response).
//! Groups are evaluated in order, and an operation sees the debits of earlier operations on the
//! same key, so one request that names the same bucket twice is charged twice.
//!
//! **One bucket, several specs.** Every operation carries its own [`BucketSpec`], and one bucket
//! can be written under several: replicas in the middle of a quota change or a rolling config
//! change, a cache refresh on one replica. The stored state remembers what those specs need, so
//! that none of them can make the bucket forget a debt, and the requests admitted in any window
//! of T seconds stay within `max capacity + max refill × T` over the specs in force:
//!
//! * **Life.** A write never moves a bucket's expiry earlier, and keeps it at least until the
//!   balance, refilled at the slowest rate any charge used, reaches the largest capacity any
//!   charge used ([`BucketState::largest_capacity`], [`BucketState::slowest_refill`]). A bucket
//!   that expires is full under every spec that wrote it, so coming back full changes nothing.
//! * **Capacity.** A balance is capped at the evaluating spec's capacity when it is refilled: a
//!   lowered capacity clamps the balance at the next evaluation; a raised one lets it refill up
//!   to the new capacity at the refill rate, never at once.
//! * **Rate.** A refill never runs faster than the rate the bucket has in force
//!   ([`BucketState::fastest_refill`]). A charge under a faster rate than that is recorded as
//!   pending and takes effect [`RATE_RAISE_DELAY_MS`] later. This is what keeps the local
//!   pre-check exact across replicas: any balance it saw can grow, until its observation is too
//!   old to be used, no faster than the rates recorded when it saw it.
//!
//! Every number that leaves this module is bounded: waits and TTLs are capped at [`MAX_WAIT_MS`],
//! so a bucket with a huge capacity and a tiny rate keeps its state instead of overflowing an
//! expiry time.
//!
//! This module is the memory backend's algorithm, and the one Rust home of the bucket arithmetic:
//! the pre-check and the response headers call it. The Redis backend runs the same algorithm as a
//! Lua script (`src/store/redis/bucket.lua`), operation for operation and in the same floating
//! point order; `tests/equivalence.rs` replays random operation sequences against both and
//! requires identical verdicts, balances, refill times and TTLs. Change one, change the other.

mod hold;
mod spec;

pub use self::hold::{hold, Asked, Hold, HoldOp, HoldOutcome, Others};
pub use self::spec::{BucketSpec, SpecError, MAX_CAPACITY, MAX_WAIT_MS, MIN_REFILL_PER_SECOND};

use std::collections::HashMap;

use serde::Serialize;

use self::hold::{banked_at, held_at, held_for_ms, holds_live};
use self::spec::{wait, wait_between};

/// How long after a charge first uses a refill rate faster than a bucket's rate in force that
/// rate takes effect, in milliseconds. It must exceed the pre-check's longest use of an
/// observation ([`crate::store::MAX_AGE_MS`]) with room for clock-rate differences: a faster rate
/// first used after an observation then never refills the bucket while the observation is used.
pub const RATE_RAISE_DELAY_MS: u64 = 6_000;

/// The stored state of one bucket.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BucketState {
    /// Balance as of `last_refill_ms`; negative only for buckets charged always (debt).
    pub tokens: f64,
    /// When the balance was last brought up to date, in clock milliseconds.
    pub last_refill_ms: u64,
    /// The refill rate (per second) in force: no spec refills the bucket faster. The rate of the
    /// charge that created the bucket, raised when a pending rate takes effect; 0 if unknown
    /// (state written by an older version), when each spec refills at its own rate.
    pub fastest_refill: f64,
    /// A faster rate a charge used, in force from `pending_from_ms` on; 0 if none.
    pub pending_refill: f64,
    /// When `pending_refill` takes effect, in clock milliseconds.
    pub pending_from_ms: u64,
    /// The largest capacity any charge of the bucket used (0 if unknown).
    pub largest_capacity: f64,
    /// The slowest refill rate (per second) any charge of the bucket used (0 if unknown).
    pub slowest_refill: f64,
    /// Replicas' held shares ([`hold`]), in the order first taken; expired ones stay until the
    /// next hold op drops them.
    pub holds: Vec<Hold>,
    /// What requests other than holds asked of the bucket lately, while it had holds: the demand
    /// the holds are sized beside ([`Asked`]).
    pub asked: Asked,
}

impl BucketState {
    /// The fastest rate the bucket may refill at before [`RATE_RAISE_DELAY_MS`] passes: the rate
    /// in force or the pending one. A bound on the balance that other replicas may raise uses it.
    pub fn rate_ceiling(&self) -> f64 {
        self.fastest_refill.max(self.pending_refill)
    }
}

/// How an operation's shortage counts toward its group's admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Short denies the group.
    Enforced,
    /// Evaluated and debited when it has the tokens, but never denies.
    Shadow,
    /// Denies only if every quota-mode operation of the group is short.
    Quota,
}

/// When an operation's tokens are taken.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "charge")]
pub enum Charge {
    /// Only if the operation had its tokens and its group was admitted (the default).
    Admitted,
    /// Always, even past zero, down to `-max_debt`; whatever lies beyond the floor is forgiven.
    Always {
        /// Most debt the bucket may carry, in tokens.
        max_debt: f64,
    },
}

impl Charge {
    /// The lowest balance a bucket charged this way can hold.
    pub fn floor(&self) -> f64 {
        match self {
            Charge::Admitted => 0.0,
            Charge::Always { max_debt } => -max_debt,
        }
    }
}

/// One debit (or credit) against one bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketOp {
    /// The storage key of the bucket (see [`crate::identity`]).
    pub key: String,
    /// Capacity and rate, sent with every operation so a quota change applies at once.
    pub spec: BucketSpec,
    /// Tokens to take. Zero checks without taking; negative gives tokens back (capped).
    pub need: f64,
    /// Tokens asked of the bucket since an op last reached it by requests answered without it
    /// (the pre-check's certain denials): demand that a bucket with holds records beside `need`,
    /// so that holds are sized against what RLS clients ask, not only what reaches the store.
    pub unseen: f64,
    /// How a shortage counts.
    pub role: Role,
    /// When the tokens are taken.
    pub charge: Charge,
}

/// The operations of one request, evaluated all-or-nothing together.
pub type Group = Vec<BucketOp>;

/// Groups evaluated together in one atomic step of a store, each group independently.
pub type Batch = [Group];

/// What one operation found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    /// The bucket covered this operation's need (regardless of the rest of its group).
    pub allowed: bool,
    /// Balance after the group: debited if charged, otherwise only refilled.
    pub tokens: f64,
    /// For a denied operation, how long until the bucket covers `need` (0 for a check); `None`
    /// if it never will (need above capacity). Zero for allowed operations.
    pub retry_after_ms: Option<u64>,
    /// How long until the bucket is full again.
    pub reset_ms: u64,
    /// Tokens of this debit that fell below the debt floor and were forgiven.
    pub forgiven: f64,
    /// The bucket's [`BucketState::fastest_refill`] after this operation.
    pub fastest_refill: f64,
    /// How long after the evaluation the store certainly still holds the bucket's state: the
    /// TTL it was just written with, else what is left of its expiry (0 when it holds none).
    /// Until then, a later evaluation refills the stored state instead of finding the bucket
    /// missing (and so full).
    pub kept_ms: u64,
}

/// What one group found.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupOutcome {
    /// No enforced operation was short and, if there were quota-mode operations, one of them
    /// had its tokens: the group's debits were applied.
    pub admitted: bool,
    /// The store's clock at evaluation, in milliseconds since the epoch.
    pub now_ms: u64,
    /// One verdict per operation, in the group's order.
    pub verdicts: Vec<Verdict>,
    /// Debits were taken and then given back ([`refund`]: a store that evaluates a group in
    /// several steps refunds the steps that succeeded when another one denies): balances rose
    /// after they were reported.
    pub refunded: bool,
    /// Operations the store could not evaluate (a Cluster shard failed) in a group that another
    /// operation's denial decided: their verdicts are placeholders. Empty otherwise.
    pub unanswered: Vec<usize>,
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
    /// Buckets to write back. Untouched, denied and check-only buckets are not written (their
    /// stored state, refilled later, yields the same balance), unless the operation's rate raised
    /// the bucket's rate ceiling.
    pub writes: Vec<Write>,
}

/// Brings a bucket's balance up to `now_ms` under `spec`.
///
/// The refill runs at `spec`'s rate, never faster than the rate in force, which a pending raise
/// replaces from the moment it takes effect, less what live holds take; the balance is capped at
/// the capacity less what they hold. The interval is walked in pieces between the moments those
/// change (the raise, each hold's expiry), so a hold counts until the millisecond it expires. A
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
        for h in &s.holds {
            if h.expires_at_ms > from && h.expires_at_ms < to {
                to = h.expires_at_ms;
            }
        }
        if next.pending_refill > 0.0 && next.pending_from_ms <= from && from < now_ms {
            take_effect(&mut next);
        }
        let (held_capacity, held_rate) = held_at(&s.holds, from);
        let grow = (capped(next.fastest_refill) - held_rate / 1000.0).max(0.0);
        // The banks grow while the balance refills: the two together stay within the capacity.
        let room =
            (spec.capacity() - held_capacity - banked_at(&s.holds, from, to, spec.capacity())).max(0.0);
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
fn take_effect(state: &mut BucketState) {
    state.fastest_refill = state.pending_refill;
    state.pending_refill = 0.0;
    state.pending_from_ms = 0;
}

/// What is left of `spec` beside the holds alive at `now_ms`: capacity, and refill per ms.
fn unheld(state: &BucketState, spec: &BucketSpec, now_ms: u64) -> (f64, f64) {
    let (held_capacity, held_rate) = held_at(&state.holds, now_ms);
    let banked = banked_at(&state.holds, now_ms, now_ms, spec.capacity());
    ((spec.capacity() - held_capacity - banked).max(0.0), (spec.rate_per_ms() - held_rate / 1000.0).max(0.0))
}

/// Whether a balance of `tokens` covers `need`: credits always do; a check (0) needs a
/// balance that is not in debt.
pub fn covers(tokens: f64, need: f64) -> bool {
    need < 0.0 || tokens >= need
}

// Records that a charge used `spec` at `now_ms`: its capacity and rate count for the bucket's
// life, and a rate faster than the bucket's ceiling becomes pending. A spec that never refills
// (capacity 0) is never stored, so its rate counts for nothing.
fn note_spec(state: &mut BucketState, spec: &BucketSpec, now_ms: u64) {
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
fn raises_ceiling(state: &BucketState, spec: &BucketSpec) -> bool {
    state.fastest_refill > 0.0 && spec.refill_per_second() > state.rate_ceiling()
}

// Takes `op.need` from `state` as its charge mode says, capped at `capacity` (what the holds
// leave), and records the op's spec; returns the tokens forgiven below the floor. A balance
// already below this op's floor (left by a deeper one) is not raised to it.
fn debit(state: &mut BucketState, op: &BucketOp, capacity: f64, now_ms: u64) -> f64 {
    note_spec(state, &op.spec, now_ms);
    let after = capacity.min(state.tokens - op.need);
    let kept = after.max(state.tokens.min(op.charge.floor()));
    state.tokens = kept;
    kept - after
}

// What a bucket with holds records as asked of it by `op`: its need and the denials it did not
// see.
fn asked(op: &BucketOp) -> f64 {
    op.need.max(0.0) + op.unseen
}

// How long a bucket written as `state` at `now_ms` by an operation with debt floor `floor` must
// live: until its balance (or the floor, if lower) has refilled to the largest capacity at the
// slowest rate any charge used, plus a second, counted from when the last live hold expires
// (until then the holds may take all of its refill). Past that it is full under every spec that
// wrote it.
fn life_ms(state: &BucketState, floor: f64, now_ms: u64) -> u64 {
    let lowest = state.tokens.min(floor);
    wait(state.largest_capacity - lowest, state.slowest_refill / 1000.0)
        .saturating_add(1000)
        .saturating_add(held_for_ms(&state.holds, now_ms))
        .min(MAX_WAIT_MS)
}

/// The operations that give back what `outcome` took for `group`, each with the index of the
/// operation it undoes: every debit charged because the group was admitted comes back as a
/// credit (capped at capacity), every credit is taken back (down to zero at most). What is
/// charged always stays charged.
pub fn refund(group: &Group, outcome: &GroupOutcome) -> Vec<(usize, BucketOp)> {
    if !outcome.admitted {
        return Vec::new();
    }
    group
        .iter()
        .zip(&outcome.verdicts)
        .enumerate()
        .filter(|(_, (op, v))| v.allowed && op.need != 0.0 && op.charge == Charge::Admitted)
        .map(|(i, (op, _))| {
            let charge = if op.need < 0.0 { Charge::Always { max_debt: 0.0 } } else { Charge::Admitted };
            (
                i,
                BucketOp {
                    key: op.key.clone(),
                    spec: op.spec,
                    need: -op.need,
                    unseen: 0.0,
                    role: Role::Shadow,
                    charge,
                },
            )
        })
        .collect()
}

/// Evaluates `batch` at `now_ms` against what `load` returns for a key: the stored state and
/// when the store drops it (ms since the epoch), or `None` when no bucket is stored.
///
/// `load` is called at most once per distinct key.
pub fn evaluate(
    batch: &Batch,
    now_ms: u64,
    mut load: impl FnMut(&str) -> Option<(BucketState, u64)>,
) -> Evaluation {
    // Committed state of every key touched so far in this batch, and the stored expiries.
    let mut running: HashMap<&str, Option<BucketState>> = HashMap::new();
    let mut expiries: HashMap<&str, u64> = HashMap::new();
    let mut load = |key| {
        let stored = load(key);
        if let Some((_, expires_at_ms)) = stored {
            expiries.insert(key, expires_at_ms);
        }
        stored.map(|(state, _)| state)
    };
    let mut dirty: HashMap<&str, u64> = HashMap::new();
    let mut dirty_order: Vec<&str> = Vec::new();
    let mut groups = Vec::with_capacity(batch.len());

    for group in batch {
        // Tentative state: this group's debits, visible to its later operations only.
        let mut tentative: HashMap<&str, BucketState> = HashMap::new();
        let mut verdicts = Vec::with_capacity(group.len());
        // Per operation: it found a stored bucket whose rate ceiling its spec raises.
        let mut raised = Vec::with_capacity(group.len());
        // Per operation: it asked tokens of a bucket with live holds (its demand is recorded).
        let mut asks = Vec::with_capacity(group.len());
        // Per operation: the capacity and rate per ms the holds leave its spec.
        let mut rooms = Vec::with_capacity(group.len());
        let (mut enforced_short, mut quota_ops, mut quota_allowed) = (false, 0, 0);

        for op in group {
            let key = op.key.as_str();
            let before = match tentative.get(key) {
                Some(s) => Some(s),
                None => running.entry(key).or_insert_with(|| load(key)).as_ref(),
            };
            let mut state = refill(before, &op.spec, now_ms);
            let raises = before.is_some() && raises_ceiling(&state, &op.spec);
            let room = unheld(&state, &op.spec, now_ms);
            let allowed = covers(state.tokens, op.need);
            let retry_after_ms =
                if allowed { Some(0) } else { wait_between(room.0, room.1, state.tokens, op.need.max(0.0)) };
            let mut forgiven = 0.0;
            if allowed || matches!(op.charge, Charge::Always { .. }) {
                forgiven = debit(&mut state, op, room.0, now_ms);
            } else if raises {
                note_spec(&mut state, &op.spec, now_ms);
            }
            let asks_now = asked(op) > 0.0 && holds_live(&state.holds, now_ms);
            if asks_now {
                state.asked.record(now_ms, asked(op));
            }
            raised.push(raises);
            asks.push(asks_now);
            rooms.push(room);
            let (tokens, fastest_refill) = (state.tokens, state.rate_ceiling());
            tentative.insert(key, state);
            match op.role {
                Role::Enforced => enforced_short |= !allowed,
                Role::Shadow => {}
                Role::Quota => {
                    quota_ops += 1;
                    quota_allowed += usize::from(allowed);
                }
            }
            verdicts.push(Verdict {
                allowed,
                tokens,
                retry_after_ms,
                reset_ms: 0,
                forgiven,
                fastest_refill,
                kept_ms: 0,
            });
        }
        let admitted = !enforced_short && (quota_ops == 0 || quota_allowed > 0);

        let each = group.iter().zip(verdicts.iter_mut()).zip(raised).zip(rooms).zip(asks);
        for ((((op, verdict), raises), room), asks) in each {
            let key = op.key.as_str();
            let always = matches!(op.charge, Charge::Always { .. });
            let (charged, raises) = if admitted {
                running.insert(key, tentative.get(key).cloned());
                (verdict.allowed || always, raises)
            } else {
                // A denied group takes only what is charged always, replayed on the committed
                // state in the group's order, and records a raised rate ceiling and its demand.
                let committed = running[key].as_ref();
                let mut state = refill(committed, &op.spec, now_ms);
                let raises = committed.is_some() && raises_ceiling(&state, &op.spec);
                verdict.forgiven = 0.0;
                if always {
                    verdict.forgiven = debit(&mut state, op, room.0, now_ms);
                    if asks {
                        state.asked.record(now_ms, asked(op));
                    }
                    verdict.tokens = state.tokens;
                    verdict.fastest_refill = state.rate_ceiling();
                    running.insert(key, Some(state));
                } else {
                    if raises || asks {
                        let mut noted = committed.expect("a raise or an ask needs a stored bucket").clone();
                        if raises {
                            note_spec(&mut noted, &op.spec, now_ms);
                            note_spec(&mut state, &op.spec, now_ms);
                        }
                        if asks {
                            noted.asked.record(now_ms, asked(op));
                        }
                        running.insert(key, Some(noted));
                    }
                    verdict.tokens = state.tokens;
                    verdict.fastest_refill = state.rate_ceiling();
                }
                (always, raises)
            };
            // Written when charged, when its spec raised the rate ceiling (a denied request under a
            // faster rate starts the raise's delay as a charge would), and when it asked of a
            // held bucket.
            if ((charged && op.need != 0.0) || raises || asks) && op.spec.refill_per_second() > 0.0 {
                let written = running[key].as_ref().expect("a written bucket has state");
                let ttl = life_ms(written, op.charge.floor(), now_ms);
                let slot = dirty.entry(key).or_insert_with(|| {
                    dirty_order.push(key);
                    0
                });
                *slot = (*slot).max(ttl);
            }
            verdict.reset_ms = wait_between(room.0, room.1, verdict.tokens, room.0).unwrap_or(0);
        }
        groups.push(GroupOutcome { admitted, now_ms, verdicts, refunded: false, unanswered: Vec::new() });
    }

    // A write never moves an expiry earlier: the bucket lives as long as the longest of what it
    // had left and what this batch's charges need.
    for (key, ttl) in dirty.iter_mut() {
        if let Some(at) = expiries.get(key) {
            *ttl = (*ttl).max(at.saturating_sub(now_ms).min(MAX_WAIT_MS));
        }
    }
    // Known once every group has run: a later group may write a bucket an earlier one read.
    for (group, outcome) in batch.iter().zip(&mut groups) {
        for (op, verdict) in group.iter().zip(&mut outcome.verdicts) {
            let key = op.key.as_str();
            verdict.kept_ms = match dirty.get(key) {
                Some(ttl) => *ttl,
                None => expiries.get(key).map_or(0, |at| at.saturating_sub(now_ms)),
            };
        }
    }

    let writes = dirty_order
        .into_iter()
        .map(|key| Write {
            key: key.to_owned(),
            state: running[key].clone().expect("a debited bucket has state"),
            ttl_ms: dirty[key],
        })
        .collect();
    Evaluation { groups, writes }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(capacity: f64, refill_per_second: f64) -> BucketSpec {
        BucketSpec::new(capacity, refill_per_second).unwrap()
    }

    // A stored bucket whose expiry has come: whatever a test writes sets the expiry alone.
    fn stored(state: BucketState) -> Option<(BucketState, u64)> {
        Some((state, 0))
    }

    fn op(key: &str, spec: BucketSpec, need: f64) -> BucketOp {
        BucketOp { key: key.into(), spec, need, unseen: 0.0, role: Role::Enforced, charge: Charge::Admitted }
    }

    fn always(key: &str, spec: BucketSpec, need: f64, max_debt: f64) -> BucketOp {
        BucketOp { charge: Charge::Always { max_debt }, ..op(key, spec, need) }
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
                state: BucketState {
                    tokens: 7.0,
                    last_refill_ms: 1_000,
                    fastest_refill: 1.0,
                    largest_capacity: 10.0,
                    slowest_refill: 1.0,
                    ..Default::default()
                },
                ttl_ms: 11_000,
            }]
        );
    }

    #[test]
    fn refill_is_lazy_capped_and_ignores_clock_steps_back() {
        let s = BucketState { tokens: 2.0, last_refill_ms: 10_000, ..Default::default() };
        assert_eq!(refill(Some(&s), &spec(10.0, 2.0), 12_000).tokens, 6.0);
        assert_eq!(refill(Some(&s), &spec(10.0, 2.0), 60_000).tokens, 10.0);
        let back = refill(Some(&s), &spec(10.0, 2.0), 5_000);
        assert_eq!(back, BucketState { tokens: 2.0, last_refill_ms: 10_000, ..Default::default() });
    }

    #[test]
    fn denial_reports_wait_and_writes_nothing() {
        let s = BucketState { tokens: 1.0, last_refill_ms: 0, ..Default::default() };
        let e = evaluate(&[vec![op("a", spec(10.0, 2.0), 4.0)]], 0, |_| stored(s.clone()));
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
        let empty = BucketState { tokens: 0.0, last_refill_ms: 0, ..Default::default() };
        let e = evaluate(
            &[vec![op("tenant", spec(10.0, 1.0), 1.0), op("export", spec(5.0, 1.0), 5.0)]],
            0,
            |k| (k == "export").then_some((empty.clone(), u64::MAX)),
        );
        assert!(!e.groups[0].admitted);
        assert!(e.groups[0].verdicts[0].allowed);
        assert_eq!(e.groups[0].verdicts[0].tokens, 10.0, "tenant bucket not debited");
        assert!(e.writes.is_empty());
    }

    #[test]
    fn shadow_denial_does_not_deny_the_group() {
        let shadow = BucketOp { role: Role::Shadow, ..op("s", spec(1.0, 1.0), 2.0) };
        let e = evaluate(&[vec![op("a", spec(5.0, 1.0), 1.0), shadow]], 0, |_| None);
        assert!(e.groups[0].admitted);
        assert!(!e.groups[0].verdicts[1].allowed);
        assert_eq!(e.writes.len(), 1);
    }

    #[test]
    fn quota_mode_denies_only_when_every_quota_bucket_is_short() {
        let empty = BucketState { tokens: 0.0, last_refill_ms: 0, ..Default::default() };
        let quota = |key: &str| BucketOp { role: Role::Quota, ..op(key, spec(5.0, 1.0), 1.0) };
        let load = |k: &str| (k == "q1").then_some((empty.clone(), u64::MAX));
        let e = evaluate(&[vec![quota("q1"), quota("q2")]], 0, load);
        assert!(e.groups[0].admitted, "q2 has tokens");
        assert_eq!((e.groups[0].verdicts[0].allowed, e.groups[0].verdicts[1].tokens), (false, 4.0));
        let e = evaluate(&[vec![quota("q1")]], 0, load);
        assert!(!e.groups[0].admitted, "the only quota bucket is short");
        let short_enforced = op("q1", spec(5.0, 1.0), 1.0);
        let e = evaluate(&[vec![quota("q2"), short_enforced]], 0, load);
        assert!(!e.groups[0].admitted, "an enforced bucket still denies");
        assert_eq!(e.groups[0].verdicts[0].tokens, 5.0);
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
        let s = BucketState { tokens: 1.0, last_refill_ms: 0, ..Default::default() };
        let e = evaluate(&[vec![op("a", spec(5.0, 1.0), -10.0)]], 0, |_| stored(s.clone()));
        assert_eq!(e.groups[0].verdicts[0].tokens, 5.0, "credit is capped at capacity");
        let e = evaluate(&[vec![op("a", spec(5.0, 1.0), 0.0)]], 0, |_| stored(s.clone()));
        assert!(e.groups[0].verdicts[0].allowed);
        assert!(e.writes.is_empty(), "a check changes nothing");
    }

    #[test]
    fn zero_capacity_denies_forever_without_dividing_by_zero() {
        let e = evaluate(&[vec![op("a", BucketSpec::new(0.0, 0.0).unwrap(), 1.0)]], 0, |_| None);
        let v = e.groups[0].verdicts[0];
        assert_eq!((v.allowed, v.retry_after_ms, v.reset_ms), (false, None, 0));
    }

    #[test]
    fn charge_always_goes_into_debt_down_to_the_floor() {
        let s = spec(1_000.0, 10.0);
        // Check, charge 600, check, charge 600: the second charge goes into debt.
        let start = BucketState { tokens: 1_000.0, last_refill_ms: 0, ..Default::default() };
        let e = evaluate(&[vec![always("a", s, 600.0, 1_000.0)]], 0, |_| stored(start.clone()));
        assert_eq!(e.groups[0].verdicts[0].tokens, 400.0);
        let at = BucketState { tokens: 400.0, last_refill_ms: 0, ..Default::default() };
        let e = evaluate(&[vec![always("a", s, 600.0, 1_000.0)]], 0, |_| stored(at.clone()));
        let v = e.groups[0].verdicts[0];
        assert!(!v.allowed && !e.groups[0].admitted, "600 > 400: denied, yet charged");
        assert_eq!((v.tokens, v.forgiven), (-200.0, 0.0));
        assert_eq!(e.writes[0].state.tokens, -200.0);
        assert_eq!(e.writes[0].ttl_ms, 201_000, "lives until full from the floor");
        // A check while in debt is denied until the balance is back to zero.
        let debt = BucketState { tokens: -200.0, last_refill_ms: 0, ..Default::default() };
        let e = evaluate(&[vec![always("a", s, 0.0, 1_000.0)]], 0, |_| stored(debt.clone()));
        let v = e.groups[0].verdicts[0];
        assert_eq!((v.allowed, v.retry_after_ms), (false, Some(20_000)));
        assert!(e.writes.is_empty());
        // Past the floor the rest is forgiven.
        let e = evaluate(&[vec![always("a", s, 5_000.0, 1_000.0)]], 0, |_| stored(debt.clone()));
        let v = e.groups[0].verdicts[0];
        assert_eq!((v.tokens, v.forgiven, v.retry_after_ms), (-1_000.0, 4_200.0, None));
    }

    #[test]
    fn a_shallow_floor_never_lifts_a_deeper_debt() {
        let debt = BucketState { tokens: -50.0, last_refill_ms: 0, ..Default::default() };
        let e = evaluate(&[vec![always("a", spec(100.0, 1.0), 10.0, 0.0)]], 0, |_| stored(debt.clone()));
        let v = e.groups[0].verdicts[0];
        assert_eq!((v.tokens, v.forgiven), (-50.0, 10.0));
    }

    #[test]
    fn a_denied_group_still_takes_what_is_charged_always() {
        let s = spec(10.0, 1.0);
        let empty = BucketState { tokens: 0.0, last_refill_ms: 0, ..Default::default() };
        let e = evaluate(
            &[vec![op("plain", s, 1.0), always("metered", s, 3.0, 10.0), op("short", s, 1.0)]],
            0,
            |k| (k == "short").then_some((empty.clone(), u64::MAX)),
        );
        let g = &e.groups[0];
        assert!(!g.admitted);
        assert_eq!(g.verdicts[0].tokens, 10.0, "admitted-charge bucket untouched");
        assert_eq!(g.verdicts[1].tokens, 7.0, "always-charge bucket debited");
        assert_eq!(e.writes.len(), 1);
        assert_eq!(e.writes[0].key, "metered");
    }

    #[test]
    fn a_refund_gives_back_what_admission_took() {
        let s = spec(10.0, 1.0);
        let group = vec![op("a", s, 3.0), always("m", s, 2.0, 10.0), op("c", s, -1.0), op("z", s, 0.0)];
        let e = evaluate(std::slice::from_ref(&group), 0, |_| None);
        let back: Group = refund(&group, &e.groups[0]).into_iter().map(|(_, op)| op).collect();
        assert_eq!(
            back.iter().map(|o| (o.key.as_str(), o.need)).collect::<Vec<_>>(),
            vec![("a", -3.0), ("c", 1.0)]
        );
        let after = evaluate(&[back], 0, |k| {
            e.writes.iter().find(|w| w.key == k).map(|w| (w.state.clone(), w.ttl_ms))
        });
        assert_eq!(after.groups[0].verdicts[0].tokens, 10.0);
        let denied = GroupOutcome { admitted: false, ..e.groups[0].clone() };
        assert!(refund(&group, &denied).is_empty(), "a denied group took nothing");
    }

    #[test]
    fn extreme_specs_keep_state_and_bounded_numbers() {
        let s = spec(1e12, 0.0001);
        let e = evaluate(&[vec![op("a", s, 6e11)]], 0, |_| None);
        assert_eq!(e.writes[0].ttl_ms, MAX_WAIT_MS);
        assert_eq!(e.groups[0].verdicts[0].reset_ms, MAX_WAIT_MS);
        let at = e.writes[0].state.clone();
        let e = evaluate(&[vec![op("a", s, 6e11)]], 5, |_| stored(at.clone()));
        assert_eq!(e.groups[0].verdicts[0].retry_after_ms, Some(MAX_WAIT_MS));
    }
    // Stored as `evaluate` wrote it: (state, expiry at).
    fn written(e: &Evaluation, now_ms: u64) -> Option<(BucketState, u64)> {
        e.writes.first().map(|w| (w.state.clone(), now_ms + w.ttl_ms))
    }

    #[test]
    fn a_write_never_moves_the_expiry_earlier() {
        let (slow, fast) = (spec(100.0, 1.0), spec(100.0, 100.0));
        let e = evaluate(&[vec![op("a", slow, 100.0)]], 0, |_| None);
        assert_eq!(e.writes[0].ttl_ms, 101_000);
        // Written before any spec was recorded (an older version's state): the write keeps it.
        let bare = BucketState { tokens: 0.0, last_refill_ms: 0, ..Default::default() };
        let e = evaluate(&[vec![op("a", fast, 1.0)]], 50_000, |_| Some((bare.clone(), 400_000)));
        assert_eq!(e.writes[0].ttl_ms, 350_000, "what was left of its life");
        assert_eq!(e.groups[0].verdicts[0].kept_ms, 350_000);
        let e = evaluate(&[vec![op("a", fast, 1.0)]], 50_000, |_| Some((bare.clone(), 51_000)));
        assert_eq!(e.writes[0].ttl_ms, 2_000, "its own life when longer");
    }

    #[test]
    fn a_bucket_lives_until_full_at_its_largest_capacity_and_slowest_rate() {
        // The small spec alone would keep the bucket 2 s; the large one needs 100 s from empty.
        let (large, small) = (spec(100.0, 1.0), spec(1.0, 1.0));
        let mut at = written(&evaluate(&[vec![op("a", large, 100.0)]], 0, |_| None), 0);
        for t in (1..=100u64).map(|s| s * 1_000) {
            let e = evaluate(&[vec![op("a", small, 1.0)]], t, |_| at.clone());
            assert!(e.groups[0].admitted, "one token a second at {t} ms");
            at = written(&e, t);
        }
        let (state, expires) = at.clone().unwrap();
        assert_eq!((state.largest_capacity, state.slowest_refill), (100.0, 1.0));
        assert_eq!(expires, 100_000 + 101_000, "empty at 100 s: full at the large capacity 100 s later");
        // Just before it expires, the large spec finds 100 tokens refilled, never more.
        let e = evaluate(&[vec![op("a", large, 100.0)]], expires - 1_000, |_| at.clone());
        assert!(e.groups[0].admitted);
        let e = evaluate(&[vec![op("a", large, 1.0)]], expires - 1_000, |_| written(&e, expires - 1_000));
        assert!(!e.groups[0].admitted, "no second burst");
    }

    #[test]
    fn a_faster_rate_takes_effect_after_the_raise_delay() {
        let (slow, fast) = (spec(1_000.0, 1.0), spec(1_000.0, 100.0));
        let at = written(&evaluate(&[vec![op("a", slow, 1_000.0)]], 0, |_| None), 0);
        // The fast spec's first charge is pending: the bucket still refills at 1 per second.
        let e = evaluate(&[vec![op("a", fast, 1.0)]], 1_000, |_| at.clone());
        let state = e.writes[0].state.clone();
        assert_eq!((state.tokens, state.fastest_refill, state.pending_refill), (0.0, 1.0, 100.0));
        assert_eq!(state.pending_from_ms, 1_000 + RATE_RAISE_DELAY_MS);
        assert_eq!(e.groups[0].verdicts[0].fastest_refill, 100.0, "the ceiling a bound must use");
        let at = written(&e, 1_000);
        let before = refill(at.as_ref().map(|(s, _)| s), &fast, 1_000 + RATE_RAISE_DELAY_MS);
        assert_eq!(before.tokens, 6.0, "1 per second until the raise");
        let after = refill(at.as_ref().map(|(s, _)| s), &fast, 2_000 + RATE_RAISE_DELAY_MS);
        assert_eq!((after.tokens, after.fastest_refill, after.pending_refill), (106.0, 100.0, 0.0));
        // The slow spec keeps its own rate, under the raised ceiling too.
        assert_eq!(refill(at.as_ref().map(|(s, _)| s), &slow, 2_000 + RATE_RAISE_DELAY_MS).tokens, 7.0);
    }

    #[test]
    fn a_denied_request_under_a_faster_rate_starts_the_raise() {
        let (slow, fast) = (spec(1.0, 0.001), spec(1.0, 10.0));
        let at = written(&evaluate(&[vec![op("a", slow, 1.0)]], 0, |_| None), 0);
        let e = evaluate(&[vec![op("a", fast, 1.0)]], 500, |_| at.clone());
        assert!(!e.groups[0].admitted, "the old rate is in force");
        let noted = e.writes[0].state.clone();
        assert_eq!((noted.tokens, noted.last_refill_ms), (0.0, 0), "the balance is not rewritten");
        assert_eq!((noted.pending_refill, noted.pending_from_ms), (10.0, 500 + RATE_RAISE_DELAY_MS));
        assert_eq!(e.writes[0].ttl_ms, 1_001_000, "a full life under its recorded specs");
        let later = 600 + RATE_RAISE_DELAY_MS;
        let e = evaluate(&[vec![op("a", fast, 1.0)]], later, |_| Some((noted.clone(), 1_000_500)));
        assert!(e.groups[0].admitted, "a tenth of a second at 10 per second");
    }
}
