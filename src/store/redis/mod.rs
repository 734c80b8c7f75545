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
mod hold;

pub use self::hold::parse_holds;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{join_all, BoxFuture};
use redis::aio::ConnectionManagerConfig;
use redis::{ClientTlsConfig, IntoConnectionInfo, TlsCertificates, Value};

use super::cluster::{Cluster, ClusterError};
use super::coalesce::{Call, Coalescer, Late};
use super::node::{self, Node, Script};
use super::sentinel::{Sentinel, SentinelTarget};
use super::{LateReply, Store, StoreError};
use crate::bucket::{
    refund, Batch, BucketOp, BucketState, Charge, Group, GroupOutcome, HoldOp, HoldOutcome, Role, Verdict,
};
use crate::budget::{BudgetOp, BudgetOutcome};
use crate::identity::cluster_slot;
use crate::telemetry::logs;

/// The bucket script, loaded once per process.
const SCRIPT: &str =
    concat!(include_str!("bucket.lua"), include_str!("group.lua"), include_str!("token_bucket.lua"));
/// The RLQS held-shares script.
const HOLD_SCRIPT: &str = concat!(include_str!("bucket.lua"), include_str!("hold.lua"));
/// The money budgets script.
const BUDGET_SCRIPT: &str =
    concat!(include_str!("bucket.lua"), include_str!("group.lua"), include_str!("budget.lua"));
/// Reads a bucket without changing it.
const PEEK_SCRIPT: &str = include_str!("peek.lua");

/// How long a call may go on after its caller's deadline, so that a late reply can still be
/// refunded: twice the deadline, and at least a second.
pub fn late_window(deadline: Duration) -> Duration {
    (deadline * 2).max(Duration::from_secs(1))
}

/// Which Redis deployment to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One server: `redis://[user:password@]host:port[/db]` or `rediss://...` for TLS.
    Standalone(String),
    /// A Cluster, found through these seed nodes (`host:port`).
    Cluster(Vec<String>),
    /// The primary a set of sentinels names, followed through failovers.
    Sentinel(SentinelTarget),
}

/// Certificates for TLS to Redis (`rediss://`) beyond the public web roots.
#[derive(Debug, Clone, Default)]
pub struct RedisTls {
    /// CA bundle (PEM) that signed the servers' certificates.
    pub ca: Option<PathBuf>,
    /// Client certificate and key (PEM), when the servers require TLS client authentication.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// Why a store could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// A certificate or key file could not be read.
    #[error("{}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The address or URL is not one the Redis client accepts.
    #[error("{0}")]
    Address(#[source] redis::RedisError),
}

impl RedisTls {
    fn certificates(&self) -> Result<Option<TlsCertificates>, ConnectError> {
        if self.ca.is_none() && self.client.is_none() {
            return Ok(None);
        }
        let read =
            |p: &PathBuf| std::fs::read(p).map_err(|source| ConnectError::File { path: p.clone(), source });
        let root_cert = self.ca.as_ref().map(read).transpose()?;
        let client_tls = match &self.client {
            Some((cert, key)) => Some(ClientTlsConfig { client_cert: read(cert)?, client_key: read(key)? }),
            None => None,
        };
        Ok(Some(TlsCertificates { client_tls, root_cert }))
    }
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
    hold_script: Script,
    budget_script: Script,
    deadline: Duration,
    description: String,
}

enum Connection {
    Standalone(Node),
    Cluster(Cluster),
    // Boxed: the Sentinel client's state is ten times the others'.
    Sentinel(Box<Sentinel>),
}

impl Connection {
    // The slot a key is evaluated in: its Cluster slot, or 0 where one server holds every key.
    fn slot(&self, key: &str) -> u16 {
        match self {
            Connection::Cluster(_) => cluster_slot(key),
            Connection::Standalone(_) | Connection::Sentinel(_) => 0,
        }
    }
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
        let certificates = tls.certificates()?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(deadline))
            .set_response_timeout(Some(late_window(deadline)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let (connection, description) = match target {
            RedisTarget::Standalone(url) => {
                let info = url.as_str().into_connection_info().map_err(ConnectError::Address)?;
                let description = format!("redis at {}", info.addr());
                let addr = info.addr().to_string();
                let client = match certificates {
                    Some(certs) => redis::Client::build_with_tls(info, certs),
                    None => redis::Client::open(info),
                }
                .map_err(ConnectError::Address)?;
                let node =
                    Node::new(addr, client, config, Default::default()).map_err(ConnectError::Address)?;
                (Connection::Standalone(node), description)
            }
            RedisTarget::Cluster(seeds) => {
                let mut infos = Vec::with_capacity(seeds.len());
                for seed in seeds {
                    let url = if seed.contains("://") { seed.clone() } else { format!("redis://{seed}") };
                    infos.push(url.as_str().into_connection_info().map_err(ConnectError::Address)?);
                }
                let addrs: Vec<String> = infos.iter().map(|i| i.addr().to_string()).collect();
                let cluster = Cluster::new(infos, certificates, config);
                (Connection::Cluster(cluster), format!("redis cluster via {}", addrs.join(",")))
            }
            RedisTarget::Sentinel(target) => {
                let sentinel = Sentinel::new(target, certificates, config).map_err(ConnectError::Address)?;
                let description = sentinel.describe();
                (Connection::Sentinel(Box::new(sentinel)), description)
            }
        };
        let shared = Arc::new(Shared {
            connection,
            script: Script::new(SCRIPT),
            peek_script: Script::new(PEEK_SCRIPT),
            hold_script: Script::new(HOLD_SCRIPT),
            budget_script: Script::new(BUDGET_SCRIPT),
            deadline,
            description,
        });
        let call_shared = shared.clone();
        let call: Call = Arc::new(move |slot: u16, groups: Vec<Group>| {
            let shared = call_shared.clone();
            Box::pin(async move { shared.run(slot, &groups.iter().collect::<Vec<_>>()).await })
        });
        let coalescer = Coalescer::new(call, coalesce_delay, deadline);
        Ok(RedisStore { shared, coalescer })
    }

    /// Reads the bucket at `key` without changing it, with Redis's clock (for `tollgate explain`).
    pub async fn peek(&self, key: &str) -> Result<Peek, StoreError> {
        let slot = self.shared.connection.slot(key);
        let reply = self.shared.eval_in_slot(&self.shared.peek_script, slot, &[key], &[]).await?;
        let Value::Array(items) = reply else {
            return Err(StoreError::Protocol(format!("expected an array, got {reply:?}")));
        };
        let number = |i: usize| items.get(i).and_then(reply_number);
        let (Some(seconds), Some(micros)) = (number(7), number(8)) else {
            return Err(StoreError::Protocol(format!("expected TIME in the peek reply, got {items:?}")));
        };
        let state = match (number(0), number(1)) {
            (Some(tokens), Some(last)) => Some(BucketState {
                tokens,
                last_refill_ms: last as u64,
                fastest_refill: number(2).unwrap_or(0.0),
                pending_refill: number(3).unwrap_or(0.0),
                pending_from_ms: number(4).unwrap_or(0.0) as u64,
                largest_capacity: number(5).unwrap_or(0.0),
                slowest_refill: number(6).unwrap_or(0.0),
                holds: match items.get(10) {
                    Some(Value::BulkString(h)) => parse_holds(&String::from_utf8_lossy(h))?,
                    _ => Vec::new(),
                },
                // What other requests asked lately is not shown by `explain`.
                asked: Default::default(),
            }),
            _ => None,
        };
        let ttl_ms = number(9).filter(|t| *t >= 0.0).map(|t| t as u64);
        Ok(Peek { state, now_ms: (seconds * 1000.0 + (micros / 1000.0).floor()) as u64, ttl_ms })
    }

    fn slot_of(&self, op: &BucketOp) -> u16 {
        self.shared.connection.slot(&op.key)
    }

    // Gives back what the admitted parts of a group took, before its caller is answered.
    async fn refund_parts(
        &self,
        group: &Group,
        parts: &[Part],
        answers: &[Result<GroupOutcome, StoreError>],
        combined: &mut GroupOutcome,
    ) {
        let mut calls: Vec<(u16, Group, Vec<usize>)> = Vec::new();
        for (part, answer) in parts.iter().zip(answers) {
            let Ok(outcome) = answer else { continue };
            let sub: Group = part.ops.iter().map(|&i| group[i].clone()).collect();
            let (positions, back): (Vec<usize>, Group) =
                refund(&sub, outcome).into_iter().map(|(i, op)| (part.ops[i], op)).unzip();
            if !back.is_empty() {
                calls.push((part.slot, back, positions));
            }
        }
        if calls.is_empty() {
            return;
        }
        let results = join_all(calls.iter().map(|(slot, back, _)| {
            self.coalescer.submit(*slot, vec![back.clone()], Late::Fixed(LateReply::Keep))
        }))
        .await;
        combined.refunded = true;
        metrics::counter!("tollgate_store_refunds_total", "reason" => "split").increment(1);
        for ((_, _, positions), result) in calls.iter().zip(results) {
            match result.map(|mut o| o.pop()) {
                Ok(Some(outcome)) => {
                    for (&i, v) in positions.iter().zip(outcome.verdicts) {
                        combined.verdicts[i].tokens = v.tokens;
                        combined.verdicts[i].reset_ms = v.reset_ms;
                    }
                }
                Ok(None) | Err(_) => {
                    metrics::counter!("tollgate_store_refund_failures_total").increment(1);
                    if let Some(held_back) = logs::throttled("split_refund_failed") {
                        tracing::error!(
                            keys = ?positions.iter().map(|&i| group[i].key.as_str()).collect::<Vec<_>>(),
                            held_back,
                            "could not refund the debits of a request denied in another Cluster slot"
                        );
                    }
                }
            }
        }
    }

    // One group evaluated slot by slot (it spans several): admitted only if every part is and,
    // with quota-mode operations, one of them had its tokens. Otherwise what the admitted parts
    // took is refunded before the answer, unless a failed part's request is admitted anyway. A
    // denial that is known wins over a failed part: the group is denied, its failed operations
    // listed as unanswered, and `denied` tells their late replies to give their tokens back.
    async fn evaluate_split(
        &self,
        group: &Group,
        parts: Vec<Part>,
        answers: Vec<Result<GroupOutcome, StoreError>>,
        late: LateReply,
        denied: &AtomicBool,
    ) -> Result<GroupOutcome, StoreError> {
        let mut verdicts = vec![None; group.len()];
        let mut now_ms = 0;
        let mut failure = None;
        let mut parts_admitted = true;
        for (part, answer) in parts.iter().zip(&answers) {
            match answer {
                Ok(outcome) => {
                    now_ms = now_ms.max(outcome.now_ms);
                    parts_admitted &= outcome.admitted;
                    for (&i, v) in part.ops.iter().zip(&outcome.verdicts) {
                        verdicts[i] = Some(*v);
                    }
                }
                Err(e) => failure = Some(e.clone()),
            }
        }
        let quota: Vec<bool> = group
            .iter()
            .zip(&verdicts)
            .filter(|(op, _)| op.role == Role::Quota)
            .map(|(_, v)| v.is_some_and(|v| v.allowed))
            .collect();
        let admitted = failure.is_none() && parts_admitted && (quota.is_empty() || quota.contains(&true));
        // An enforced operation that answered short denies the group whatever the rest says.
        let known_denial = group
            .iter()
            .zip(&verdicts)
            .any(|(op, v)| op.role == Role::Enforced && v.is_some_and(|v| !v.allowed));
        let unanswered = (0..group.len()).filter(|&i| verdicts[i].is_none()).collect();
        let mut combined = GroupOutcome {
            admitted,
            now_ms,
            verdicts: verdicts.into_iter().map(|v| v.unwrap_or(FAILED)).collect(),
            refunded: false,
            unanswered,
        };
        if failure.is_some() && known_denial {
            denied.store(true, Ordering::SeqCst);
        }
        if !admitted && (failure.is_none() || known_denial || late == LateReply::GiveBack) {
            self.refund_parts(group, &parts, &answers, &mut combined).await;
        }
        match failure {
            Some(e) if !known_denial => Err(e),
            _ => Ok(combined),
        }
    }
}

// A verdict standing in for an operation whose slot failed; never reported (the group fails).
const FAILED: Verdict = Verdict {
    allowed: false,
    tokens: 0.0,
    retry_after_ms: None,
    reset_ms: 0,
    forgiven: 0.0,
    fastest_refill: 0.0,
    kept_ms: 0,
};

// The operations of one group that live in one slot.
struct Part {
    slot: u16,
    ops: Vec<usize>,
}

// One script call: the groups (whole, or parts of split ones) of one slot, and which (group,
// part) each of them answers.
struct SlotCall {
    slot: u16,
    groups: Vec<Group>,
    parts: Vec<(usize, usize)>,
}

impl Shared {
    // One script run for groups that all live in `slot` (or on one standalone server).
    async fn run(&self, slot: u16, batch: &[&Group]) -> Result<Vec<GroupOutcome>, StoreError> {
        let mut keys: Vec<&str> = Vec::new();
        let mut key_index: HashMap<&str, usize> = HashMap::new();
        let mut args: Vec<String> =
            Vec::with_capacity(1 + batch.iter().map(|g| 1 + 6 * g.len()).sum::<usize>());
        args.push(batch.len().to_string());
        for group in batch {
            args.push(group.len().to_string());
            for op in group.iter() {
                let index = *key_index.entry(op.key.as_str()).or_insert_with(|| {
                    keys.push(op.key.as_str());
                    keys.len()
                });
                args.push(index.to_string());
                // Display of f64 is the shortest text that parses back to the same double.
                args.push(op.spec.capacity().to_string());
                args.push(op.spec.refill_per_second().to_string());
                args.push(op.need.to_string());
                args.push(
                    match op.role {
                        Role::Enforced => "0",
                        Role::Shadow => "1",
                        Role::Quota => "2",
                    }
                    .to_owned(),
                );
                args.push(match op.charge {
                    Charge::Admitted => String::new(),
                    Charge::Always { max_debt } => max_debt.to_string(),
                });
                args.push(op.unseen.to_string());
            }
        }
        let call = node::Call { keys: &keys, args: &args };
        let start = Instant::now();
        let reply = self.eval(&self.script, slot, &call).await;
        metrics::histogram!("tollgate_store_duration_seconds").record(start.elapsed());
        metrics::counter!("tollgate_store_calls_total").increment(1);
        metrics::counter!("tollgate_store_call_groups_total").increment(batch.len() as u64);
        parse_reply(reply?, batch)
    }
}

impl Shared {
    // Runs `script` once on the node of `slot` with `keys` (all in it), within the deadline.
    // (Bucket scripts go through the coalescer, which applies the deadline itself.)
    async fn eval_in_slot(
        &self,
        script: &Script,
        slot: u16,
        keys: &[&str],
        args: &[String],
    ) -> Result<Value, StoreError> {
        let call = node::Call { keys, args };
        let deadline = super::deadline_or(self.deadline);
        tokio::time::timeout(deadline, self.eval(script, slot, &call))
            .await
            .map_err(|_| StoreError::Timeout(deadline))?
    }

    // Runs `script` once on the node of `slot`.
    async fn eval(&self, script: &Script, slot: u16, call: &node::Call<'_>) -> Result<Value, StoreError> {
        match &self.connection {
            Connection::Standalone(node) => node.eval(script, call, false).await.map_err(StoreError::Redis),
            Connection::Sentinel(sentinel) => sentinel.eval(script, call).await.map_err(StoreError::Redis),
            Connection::Cluster(cluster) => cluster.eval(script, slot, call).await.map_err(|e| match e {
                ClusterError::NoOwner(slot) => StoreError::NoOwner(slot),
                ClusterError::Redis(e) => StoreError::Redis(e),
            }),
        }
    }
}

impl Store for RedisStore {
    fn evaluate<'a>(
        &'a self,
        batch: &'a Batch,
        late: LateReply,
    ) -> BoxFuture<'a, Vec<Result<GroupOutcome, StoreError>>> {
        Box::pin(async move {
            // Each group's operations by slot; a standalone server is one slot.
            let split: Vec<Vec<Part>> = batch
                .iter()
                .map(|group| {
                    let mut parts: Vec<Part> = Vec::new();
                    for (i, op) in group.iter().enumerate() {
                        let slot = self.slot_of(op);
                        match parts.iter_mut().find(|p| p.slot == slot) {
                            Some(part) => part.ops.push(i),
                            None => parts.push(Part { slot, ops: vec![i] }),
                        }
                    }
                    parts
                })
                .collect();
            // One call per slot, all groups' parts in it. In a part of a split group, quota-mode
            // operations cannot see each other, so they only report; the split group decides.
            let mut calls: Vec<SlotCall> = Vec::new();
            for (g, parts) in split.iter().enumerate() {
                for (p, part) in parts.iter().enumerate() {
                    let sub: Group = if parts.len() == 1 {
                        batch[g].clone()
                    } else {
                        part.ops
                            .iter()
                            .map(|&i| {
                                let op = &batch[g][i];
                                let role = if op.role == Role::Quota { Role::Shadow } else { op.role };
                                BucketOp { role, ..op.clone() }
                            })
                            .collect()
                    };
                    let at = match calls.iter().position(|c| c.slot == part.slot) {
                        Some(at) => at,
                        None => {
                            calls.push(SlotCall { slot: part.slot, groups: Vec::new(), parts: Vec::new() });
                            calls.len() - 1
                        }
                    };
                    calls[at].groups.push(sub);
                    calls[at].parts.push((g, p));
                }
            }
            let owners: Vec<Vec<(usize, usize)>> = calls.iter().map(|c| c.parts.clone()).collect();
            // Set when a split group is denied by a part that answered while another failed: the
            // failed parts' late replies then give their tokens back, whatever `late` says.
            let denied = Arc::new(AtomicBool::new(false));
            let late_for = |late| match late {
                LateReply::Keep if split.iter().any(|parts| parts.len() > 1) => {
                    Late::KeepUnlessDenied(denied.clone())
                }
                late => Late::Fixed(late),
            };
            // The common case, one slot, needs no join.
            let answers = if calls.len() == 1 {
                let call = calls.pop().expect("one call");
                vec![self.coalescer.submit(call.slot, call.groups, late_for(late)).await]
            } else {
                join_all(calls.into_iter().map(|c| self.coalescer.submit(c.slot, c.groups, late_for(late))))
                    .await
            };
            let mut part_answers: Vec<Vec<Option<Result<GroupOutcome, StoreError>>>> =
                split.iter().map(|parts| parts.iter().map(|_| None).collect()).collect();
            for (owners, answer) in owners.iter().zip(answers) {
                match answer {
                    Ok(outcomes) => {
                        for (&(g, p), outcome) in owners.iter().zip(outcomes) {
                            part_answers[g][p] = Some(Ok(outcome));
                        }
                    }
                    Err(e) => {
                        for &(g, p) in owners {
                            part_answers[g][p] = Some(Err(e.clone()));
                        }
                    }
                }
            }
            let mut results = Vec::with_capacity(batch.len());
            for ((group, parts), answers) in batch.iter().zip(split).zip(part_answers) {
                let mut answers: Vec<Result<GroupOutcome, StoreError>> =
                    answers.into_iter().map(|a| a.expect("every part has an answer")).collect();
                results.push(if parts.len() == 1 {
                    answers.pop().expect("one part")
                } else {
                    self.evaluate_split(group, parts, answers, late, &denied).await
                });
            }
            results
        })
    }

    fn hold<'a>(&'a self, ops: &'a [HoldOp]) -> BoxFuture<'a, Vec<Result<HoldOutcome, StoreError>>> {
        Box::pin(self.hold_all(ops))
    }

    fn budget<'a>(&'a self, op: &'a BudgetOp) -> BoxFuture<'a, Result<BudgetOutcome, StoreError>> {
        Box::pin(self.budget_op(op))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let ping = async {
                match &self.shared.connection {
                    Connection::Standalone(node) => node
                        .query::<String>(&mut redis::cmd("PING"))
                        .await
                        .map(drop)
                        .map_err(StoreError::Redis),
                    Connection::Sentinel(sentinel) => sentinel
                        .query::<String>(&mut redis::cmd("PING"))
                        .await
                        .map(drop)
                        .map_err(StoreError::Redis),
                    Connection::Cluster(cluster) => cluster.ping().await.map_err(|e| match e {
                        ClusterError::NoOwner(slot) => StoreError::NoOwner(slot),
                        ClusterError::Redis(e) => StoreError::Redis(e),
                    }),
                }
            };
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
        let connection = match &self.shared.connection {
            Connection::Standalone(node) => node.epoch(),
            Connection::Sentinel(sentinel) => sentinel.epoch(),
            Connection::Cluster(cluster) => cluster.epoch(),
        };
        connection.wrapping_add(self.coalescer.refunds())
    }
}

// Reads the flat reply described at the top of the script.
fn parse_reply(reply: Value, batch: &[&Group]) -> Result<Vec<GroupOutcome>, StoreError> {
    let Value::Array(items) = reply else {
        return Err(StoreError::Protocol(format!("expected an array, got {reply:?}")));
    };
    let expected = 1 + batch.iter().map(|g| 1 + 7 * g.len()).sum::<usize>();
    if items.len() != expected {
        return Err(StoreError::Protocol(format!("expected {expected} values, got {}", items.len())));
    }
    let mut items = items.into_iter();
    let now_ms = u64::try_from(int(&mut items)?).unwrap_or(0);
    let mut outcomes = Vec::with_capacity(batch.len());
    for group in batch {
        let admitted = int(&mut items)? == 1;
        let mut verdicts = Vec::with_capacity(group.len());
        for _ in 0..group.len() {
            let allowed = int(&mut items)? == 1;
            let tokens = float(&mut items)?;
            let retry = int(&mut items)?;
            let reset = int(&mut items)?;
            let forgiven = float(&mut items)?;
            let fastest_refill = float(&mut items)?;
            let kept = int(&mut items)?;
            verdicts.push(Verdict {
                allowed,
                tokens,
                retry_after_ms: u64::try_from(retry).ok(),
                reset_ms: u64::try_from(reset).unwrap_or(0),
                forgiven,
                fastest_refill,
                kept_ms: u64::try_from(kept).unwrap_or(0),
            });
        }
        outcomes.push(GroupOutcome { admitted, now_ms, verdicts, refunded: false, unanswered: Vec::new() });
    }
    Ok(outcomes)
}

fn int(items: &mut impl Iterator<Item = Value>) -> Result<i64, StoreError> {
    match items.next() {
        Some(Value::Int(i)) => Ok(i),
        other => Err(StoreError::Protocol(format!("expected an integer, got {other:?}"))),
    }
}

fn float(items: &mut impl Iterator<Item = Value>) -> Result<f64, StoreError> {
    match items.next() {
        Some(Value::BulkString(b)) => bulk_number(&b)
            .ok_or_else(|| StoreError::Protocol(format!("not a number: {:?}", String::from_utf8_lossy(&b)))),
        other => Err(StoreError::Protocol(format!("expected a number, got {other:?}"))),
    }
}

// A number the scripts return as a bulk string (Lua numbers are not exact as integer replies).
fn bulk_number(bytes: &[u8]) -> Option<f64> {
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

// A number in a script's reply: a bulk string as above, or an integer.
fn reply_number(value: &Value) -> Option<f64> {
    match value {
        Value::BulkString(b) => bulk_number(b),
        Value::Int(n) => Some(*n as f64),
        _ => None,
    }
}
