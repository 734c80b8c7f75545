//! Where bucket state lives.
//!
//! A [`Store`] evaluates a [`Batch`] of groups with the semantics of [`crate::bucket`]: each group
//! all-or-nothing, atomic with respect to every other caller of the same store. Two backends:
//!
//! * [`MemoryStore`]: state in this process; limits hold per process only. For trying tollgate
//!   out and for tests.
//! * [`RedisStore`]: state in Redis (standalone, Cluster, or behind Sentinel), shared by every
//!   replica; each call is one Lua script run, atomic on the server.
//!
//! [`Precheck`] wraps a store and answers denials that are certain without asking it. The Redis
//! backend can coalesce concurrent calls for one Cluster slot into one script run
//! (`redis/coalesce.rs`), which changes round trips, not answers. Everything only Redis needs
//! (its nodes, Cluster, Sentinel, coalescing, the scripts and their wire format) is under `redis/`:
//! a backend in one folder.
//!
//! Results are per group so that a Cluster shard that is down fails only the groups whose keys
//! live on it.
//!
//! A call waits for the store at most the deadline the store was built with (`--redis-timeout`),
//! the one a request answered by the failure mode can afford. Work no request waits on (RLQS
//! leases, budget recovery) runs [`in_background`]: under a longer deadline of its own, and on
//! connections of its own, so that it never queues in front of a request.

pub mod health;
mod memory;
mod precheck;
mod redis;

use std::time::Duration;

use futures::future::BoxFuture;

pub use self::memory::MemoryStore;
pub use self::precheck::{Precheck, MAX_AGE_MS};
pub use self::redis::SentinelTarget;
pub use self::redis::{parse_leases, ConnectError, Peek, RedisStore, RedisTarget, RedisTls};
use crate::bucket::{Batch, GroupOutcome, LeaseOp, LeaseOutcome};
use crate::budget::{BudgetOp, BudgetOutcome};
use crate::slot::{SlotOp, SlotOutcome};

tokio::task_local! {
    static DEADLINE: Duration;
}

/// Runs `calls` as background work: every store call it makes (in this task) waits up to
/// `deadline` instead of the store's own, and goes over the background connections. A late
/// answer there delays an assignment but answers no request, and the request deadline turned
/// queueing under a burst into failure answers. Keep `deadline` within [`redis::late_window`] of
/// the store's deadline, so that a reply past it can still be refunded.
pub async fn in_background<F: std::future::Future>(deadline: Duration, calls: F) -> F::Output {
    DEADLINE.scope(deadline, calls).await
}

/// Whether a call made now is background work ([`in_background`]).
fn is_background() -> bool {
    DEADLINE.try_with(|_| ()).is_ok()
}

/// How long a call made now waits: the task's [`in_background`] deadline, else `default`.
fn deadline_or(default: Duration) -> Duration {
    DEADLINE.try_with(|d| *d).unwrap_or(default)
}

/// A backend holding bucket state.
pub trait Store: Send + Sync + 'static {
    /// Evaluates every group of `batch`, returning one result per group in order. `late` says
    /// what to do with debits whose reply comes after the caller stopped waiting (it answered
    /// with its failure mode instead).
    fn evaluate<'a>(
        &'a self,
        batch: &'a Batch,
        late: LateReply,
    ) -> BoxFuture<'a, Vec<Result<GroupOutcome, StoreError>>>;

    /// Sets replicas' leases on buckets ([`crate::bucket::lease`]), each op on its own, atomic
    /// with every other call on its bucket; one result per op, in order. A lease op sets a lease to
    /// an absolute size, so one whose reply was lost can simply be sent again.
    fn lease<'a>(&'a self, ops: &'a [LeaseOp]) -> BoxFuture<'a, Vec<Result<LeaseOutcome, StoreError>>>;

    /// Applies a budget op ([`crate::budget`]): a request's hold or settlement at every level of
    /// its path and on its token buckets, atomically with every other call on them.
    fn budget<'a>(&'a self, op: &'a BudgetOp) -> BoxFuture<'a, Result<BudgetOutcome, StoreError>>;

    /// Takes or gives back a request's concurrency slots ([`crate::slot`]), a take with the
    /// request's token buckets, all or nothing, atomically with every other call on them.
    fn slots<'a>(&'a self, op: &'a SlotOp) -> BoxFuture<'a, Result<SlotOutcome, StoreError>>;

    /// Checks that the backend answers, for readiness probes.
    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>>;

    /// A short description for logs, without credentials.
    fn describe(&self) -> String;

    /// A counter that moves whenever the backend's state or clock may have jumped (a failover,
    /// a reconnection to a restarted server, a refund the store sent by itself): what was learnt
    /// before is not to be trusted.
    fn epoch(&self) -> u64 {
        0
    }
}

/// Who wants to hear of balances raised by other replicas: a credit or refund on a bucket lifts
/// its balance faster than refill, which a replica that saw the bucket short must not miss.
/// [`RedisStore::follow_raises`] calls it; the pre-check is the listener.
pub trait RaiseListener: Send + Sync + 'static {
    /// The subscription is in place: raises from now on will be heard.
    fn subscribed(&self);
    /// The subscription is gone (connection lost, not yet back): raises may go unheard.
    fn lost(&self);
    /// The balance of the bucket at `key` was raised.
    fn raised(&self, key: &str);
}

/// What becomes of tokens a script took when its reply arrives after the caller gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LateReply {
    /// Keep them: the caller admitted the request anyway (`failure_mode: allow`).
    Keep,
    /// Give them back: the caller answered with a denial or an error, so the request took
    /// nothing (`failure_mode: deny` or `error`).
    GiveBack,
}

/// Why a store could not answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// No answer within the configured deadline.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The Redis client or server reported an error; the script did not run or its reply was
    /// lost (then it may have run, once).
    #[error("redis")]
    Redis(#[source] ::redis::RedisError),
    /// No Redis Cluster node is known to serve the slot.
    #[error("no Redis Cluster node serves slot {0}")]
    NoOwner(u16),
    /// Redis answered something the script never returns.
    #[error("unexpected reply from the bucket script: {0}")]
    Protocol(String),
}
