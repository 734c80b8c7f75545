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
//! can be written under several: replicas in the middle of a tenant quota change or a rolling config
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
//! the pre-check and the response headers call it. The Redis backend runs the same algorithm as
//! Lua scripts, file for file, operation for operation and in the same floating point order:
//! `src/bucket/refill.rs` (one bucket: refill, debit, life) is `src/store/redis/bucket.lua`,
//! `src/bucket/group.rs` (groups and batches, all or nothing) is `src/store/redis/group.lua`,
//! `src/bucket/lease.rs` is `src/store/redis/lease.lua`. `tests/equivalence.rs` replays random
//! operation sequences against both and requires identical verdicts, balances, refill times and
//! TTLs. Change one, change the other.

mod group;
mod lease;
mod refill;
mod share;
mod spec;
#[cfg(test)]
mod tests;

pub use self::group::{evaluate, refund};
pub use self::lease::{lease, LeaseOp, LeaseOutcome, Others, MAX_LEASEHOLDERS};
pub use self::refill::{covers, refill};
pub use self::refill::{Asked, Lease};
pub use self::share::{is_parked, Ask, Share};
pub use self::spec::{BucketSpec, SpecError, MAX_CAPACITY, MAX_WAIT_MS, MIN_REFILL_PER_SECOND};

use serde::Serialize;

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
    /// Replicas' leases ([`lease`]), in the order first taken; expired ones stay until the
    /// next lease op drops them.
    pub leases: Vec<Lease>,
    /// What requests other than leases asked of the bucket lately, while it had leases: the demand
    /// the leases are sized beside ([`Asked`]).
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
    QuotaMode,
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
    /// (the pre-check's certain denials): demand that a bucket with leases records beside `need`,
    /// so that leases are sized against what RLS clients ask, not only what reaches the store.
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
