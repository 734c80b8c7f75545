//! The shared store: bucket state in Redis, standalone, Cluster, or behind Sentinel.
//!
//! Every evaluation is one run of `token_bucket.lua` per Cluster slot involved, so the read, the
//! check and the write of a request's buckets in one slot happen as one step on the server: no
//! other replica can spend the same token in between. Capacity and rate travel as ARGV on every
//! call, so a changed quota applies to the next request, and the script's clock is the server's
//! `TIME`.
//!
//! **At most once.** A script call goes out once per attempt: the connections ([`Node`], and
//! [`Cluster`] for a Cluster) resend only what the server said it did not run (redirects,
//! `TRYAGAIN`, `NOSCRIPT`), never after a lost reply.
//!
//! **A failure answer costs nothing.** A caller stops waiting at its deadline and answers with
//! its failure mode, but the call goes on for up to [`late_window`]: if the reply then shows the
//! script ran, the coalescer gives the tokens back ([`LateReply::GiveBack`], for `deny` and
//! `error`) or leaves them ([`LateReply::Keep`], for `allow`, where the request was admitted).
//! A request whose buckets span several slots is evaluated in each concurrently; when one slot
//! denies or fails, what the others took is given back before the answer, unless the request is
//! admitted by `failure_mode: allow`.
//!
//! Calls go through the coalescer (`coalesce.rs`), which also bounds the calls in flight per
//! slot; with coalescing off it never holds a call back to batch it.

mod budget;
mod cluster;
mod coalesce;
mod connection;
mod lease;
mod node;
mod raises;
mod sentinel;
mod slot;
mod split;
mod wire;

pub use self::connection::{ConnectError, RedisTarget, RedisTls};
pub use self::lease::parse_leases;
pub use self::sentinel::SentinelTarget;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use self::coalesce::{Call, Coalescer};
use self::connection::Connection;
use self::node::Script;
use super::{LateReply, Store, StoreError};
use crate::bucket::{Batch, BucketState, Group, GroupOutcome, LeaseOp, LeaseOutcome};
use crate::budget::{BudgetOp, BudgetOutcome};
use crate::slot::{SlotOp, SlotOutcome};

/// The bucket script, loaded once per process.
const SCRIPT: &str =
    concat!(include_str!("bucket.lua"), include_str!("group.lua"), include_str!("token_bucket.lua"));
/// The RLQS leases script.
const LEASE_SCRIPT: &str = concat!(include_str!("bucket.lua"), include_str!("lease.lua"));
/// The money budgets script.
const BUDGET_SCRIPT: &str = concat!(
    include_str!("bucket.lua"),
    include_str!("group.lua"),
    include_str!("sets.lua"),
    include_str!("budget.lua")
);
/// Reads a bucket without changing it.
const PEEK_SCRIPT: &str = include_str!("peek.lua");
/// Counts a slot set's open slots without changing it.
const OPEN_SLOTS_SCRIPT: &str = include_str!("open_slots.lua");
// Concurrency slots, with the request's token buckets all or nothing.
const SLOT_SCRIPT: &str = concat!(
    include_str!("bucket.lua"),
    include_str!("group.lua"),
    include_str!("sets.lua"),
    include_str!("slot.lua")
);

/// How long a call may go on after its caller's deadline, so that a late reply can still be
/// refunded: twice the deadline, and at least a second.
pub fn late_window(deadline: Duration) -> Duration {
    (deadline * 2).max(Duration::from_secs(1))
}

/// A bucket as stored, read without changing it.
#[derive(Debug, Clone, PartialEq)]
pub struct Peek {
    /// The stored state; `None` if no bucket is stored (a missing bucket is full).
    pub state: Option<BucketState>,
    /// Redis's clock, in milliseconds.
    pub now_ms: u64,
    /// The key's time to live, in milliseconds, if it is stored with one.
    pub ttl_ms: Option<u64>,
}

/// Bucket state in Redis.
pub struct RedisStore {
    shared: Arc<Shared>,
    coalescer: Arc<Coalescer>,
}

// What a script call needs, shared with the coalescer's call tasks.
struct Shared {
    connection: Connection,
    script: Script,
    peek_script: Script,
    open_slots_script: Script,
    lease_script: Script,
    budget_script: Script,
    slot_script: Script,
    deadline: Duration,
    description: String,
    // Where a credit's raise is published (`crate::identity::raise_channel`), named once.
    raise_channel: String,
}

impl RedisStore {
    /// Prepares a store for `target` without waiting for Redis to be up. A caller waits at most
    /// `deadline` for an answer; with `coalesce_delay` above zero, concurrent requests for one
    /// slot share script calls, a queued one waiting about that long at most. `tls` adds a CA and
    /// client certificates for `rediss://` targets. Must be called inside a Tokio runtime.
    pub fn connect(
        target: &RedisTarget,
        deadline: Duration,
        coalesce_delay: Duration,
        tls: &RedisTls,
    ) -> Result<RedisStore, ConnectError> {
        let (connection, description) = Connection::open(target, deadline, tls)?;
        let shared = Arc::new(Shared {
            connection,
            script: Script::new(SCRIPT),
            peek_script: Script::new(PEEK_SCRIPT),
            open_slots_script: Script::new(OPEN_SLOTS_SCRIPT),
            lease_script: Script::new(LEASE_SCRIPT),
            budget_script: Script::new(BUDGET_SCRIPT),
            slot_script: Script::new(SLOT_SCRIPT),
            deadline,
            description,
            raise_channel: crate::identity::raise_channel(),
        });
        let call_shared = shared.clone();
        let call: Call = Arc::new(move |slot: u16, groups: &[Group]| {
            let shared = call_shared.clone();
            Box::pin(async move { shared.run(slot, groups).await })
        });
        let coalescer = Coalescer::new(call, coalesce_delay, deadline);
        Ok(RedisStore { shared, coalescer })
    }

    /// Reads the bucket at `key` without changing it, with Redis's clock (for `tollgate explain`).
    pub async fn peek(&self, key: &str) -> Result<Peek, StoreError> {
        let slot = self.shared.connection.slot(key);
        let reply = self.shared.eval_in_slot(&self.shared.peek_script, slot, &[key], &[]).await?;
        wire::peek(reply)
    }

    /// The open slots of the concurrency slot set at `key`, read without changing it.
    pub async fn open_slots(&self, key: &str) -> Result<u64, StoreError> {
        let slot = self.shared.connection.slot(key);
        let reply = self.shared.eval_in_slot(&self.shared.open_slots_script, slot, &[key], &[]).await?;
        let open = wire::int(&mut std::iter::once(reply))?;
        Ok(u64::try_from(open).unwrap_or(0))
    }
}

impl Shared {
    // One script run for groups that all live in `slot` (or on one standalone server).
    async fn run(&self, slot: u16, batch: &[Group]) -> Result<Vec<GroupOutcome>, StoreError> {
        let (keys, args) = wire::encode(batch, &self.raise_channel);
        let call = node::Call { keys: &keys, args: &args };
        let start = Instant::now();
        let reply = self.eval(&self.script, slot, &call).await;
        metrics::histogram!("tollgate_store_duration_seconds").record(start.elapsed());
        metrics::counter!("tollgate_store_calls_total").increment(1);
        metrics::counter!("tollgate_store_call_groups_total").increment(batch.len() as u64);
        wire::groups(reply?, batch)
    }

    // Runs `script` once on the node of `slot` with `keys` (all in it), within the deadline.
    // (Bucket scripts go through the coalescer, which applies the deadline itself.)
    async fn eval_in_slot(
        &self,
        script: &Script,
        slot: u16,
        keys: &[&str],
        args: &[wire::Arg<'_>],
    ) -> Result<redis::Value, StoreError> {
        let call = node::Call { keys, args };
        let deadline = super::deadline_or(self.deadline);
        tokio::time::timeout(deadline, self.eval(script, slot, &call))
            .await
            .map_err(|_| StoreError::Timeout(deadline))?
    }

    // Runs `script` once on the node of `slot`.
    async fn eval(
        &self,
        script: &Script,
        slot: u16,
        call: &node::Call<'_>,
    ) -> Result<redis::Value, StoreError> {
        self.connection.eval(script, slot, call).await
    }
}

impl Store for RedisStore {
    fn evaluate<'a>(
        &'a self,
        batch: &'a Batch,
        late: LateReply,
    ) -> BoxFuture<'a, Vec<Result<GroupOutcome, StoreError>>> {
        Box::pin(self.evaluate_slots(batch, late))
    }

    fn lease<'a>(&'a self, ops: &'a [LeaseOp]) -> BoxFuture<'a, Vec<Result<LeaseOutcome, StoreError>>> {
        Box::pin(self.lease_all(ops))
    }

    fn budget<'a>(&'a self, op: &'a BudgetOp) -> BoxFuture<'a, Result<BudgetOutcome, StoreError>> {
        Box::pin(self.budget_op(op))
    }

    fn slots<'a>(&'a self, op: &'a SlotOp) -> BoxFuture<'a, Result<SlotOutcome, StoreError>> {
        Box::pin(self.slot_op(op))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let ping = self.shared.connection.ping();
            let deadline = self.shared.deadline;
            tokio::time::timeout(deadline, ping).await.map_err(|_| StoreError::Timeout(deadline))?
        })
    }

    fn describe(&self) -> String {
        self.shared.description.clone()
    }

    // Reconnections and failovers (the server's state or clock may have jumped), and late
    // refunds (balances rose after they were reported).
    fn epoch(&self) -> u64 {
        let connection = self.shared.connection.epoch();
        connection.wrapping_add(self.coalescer.refunds())
    }
}
