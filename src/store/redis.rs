//! The shared store: bucket state in Redis, standalone or Cluster.
//!
//! Every evaluation is one run of `token_bucket.lua` per Cluster slot involved, so the read, the
//! check and the write of a group happen as one step on the server: no other replica can spend
//! the same token in between. Groups of different slots go out concurrently; against a
//! standalone server the whole batch is one call. Capacity and rate travel as ARGV on every call,
//! so a changed quota applies to the next request, and the script's clock is the server's `TIME`.
//!
//! The script is sent with EVALSHA and loaded on NOSCRIPT (after a restart or `SCRIPT FLUSH`).
//! Connections are established lazily and re-established by the client, so tollgate starts and
//! keeps answering (with its failure mode) while Redis is away.
//!
//! A Cluster client follows MOVED and ASK by itself, but when a primary dies it keeps dialling
//! the dead address: the slot map it holds is only refreshed by redirections, and the dead node
//! sends none. So after connection errors or timeouts a new Cluster connection is built from the
//! seed nodes in the background, at most every [`REBUILD_INTERVAL`]; it reads the topology again
//! (finding the promoted replica) and replaces the old one once it is ready. Calls to healthy
//! shards keep using the old connection meanwhile, and calls already running finish on it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures::future::{join_all, BoxFuture};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{ClientTlsConfig, IntoConnectionInfo, Script, TlsCertificates, Value};

use super::coalesce::{Call, Coalescer};
use super::{Store, StoreError};
use crate::bucket::{Batch, BucketOp, Charge, Group, GroupOutcome, Role, Verdict};
use crate::identity::cluster_slot;

/// The script, loaded once per process.
const SCRIPT: &str = include_str!("token_bucket.lua");

/// Least time between two rebuilds of a failing Cluster connection.
pub const REBUILD_INTERVAL: Duration = Duration::from_millis(500);

/// Which Redis deployment to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One server: `redis://[user:password@]host:port[/db]` or `rediss://...` for TLS.
    Standalone(String),
    /// A Cluster, found through these seed nodes (`host:port`).
    Cluster(Vec<String>),
}

/// Certificates for TLS to Redis (`rediss://`) beyond the public web roots.
#[derive(Debug, Clone, Default)]
pub struct RedisTls {
    /// CA bundle (PEM) that signed the servers' certificates.
    pub ca: Option<PathBuf>,
    /// Client certificate and key (PEM), when the servers require TLS client authentication.
    pub client: Option<(PathBuf, PathBuf)>,
}

impl RedisTls {
    fn certificates(&self) -> Result<Option<TlsCertificates>, StoreError> {
        if self.ca.is_none() && self.client.is_none() {
            return Ok(None);
        }
        let read =
            |p: &PathBuf| std::fs::read(p).map_err(|e| StoreError::Redis(format!("{}: {e}", p.display())));
        let root_cert = self.ca.as_ref().map(read).transpose()?;
        let client_tls = match &self.client {
            Some((cert, key)) => Some(ClientTlsConfig { client_cert: read(cert)?, client_key: read(key)? }),
            None => None,
        };
        Ok(Some(TlsCertificates { client_tls, root_cert }))
    }
}

/// Bucket state in Redis.
pub struct RedisStore {
    shared: Arc<Shared>,
    coalescer: Option<Arc<Coalescer>>,
}

// What a script call needs, shared with the coalescer's call tasks.
struct Shared {
    connection: Connection,
    script: Script,
    timeout: Duration,
    description: String,
}

enum Connection {
    Standalone(ConnectionManager),
    Cluster(Box<ClusterHandle>),
}

// A Cluster connection that can be replaced by a fresh one.
struct ClusterHandle {
    client: ClusterClient,
    current: Arc<ArcSwap<ClusterConnection>>,
    last_rebuild: Arc<Mutex<Instant>>,
    rebuilding: Arc<AtomicBool>,
}

impl ClusterHandle {
    fn connection(&self) -> ClusterConnection {
        (**self.current.load()).clone()
    }

    // After a connection-level failure: a new connection re-reads the topology from the seeds.
    fn rebuild_after(&self, error: &redis::RedisError) {
        let connection_trouble = error.is_io_error()
            || error.is_timeout()
            || error.is_connection_refusal()
            || error.is_connection_dropped()
            || error.is_cluster_error()
            || matches!(error.kind(), redis::ErrorKind::ClusterConnectionNotFound);
        if connection_trouble {
            self.rebuild();
        }
    }

    // Builds the new connection in the background and swaps it in only once it has connected
    // and read the slot map, so calls to healthy shards never wait for it.
    fn rebuild(&self) {
        {
            let mut last = self.last_rebuild.lock().unwrap_or_else(|p| p.into_inner());
            if last.elapsed() < REBUILD_INTERVAL || self.rebuilding.swap(true, Ordering::SeqCst) {
                return;
            }
            *last = Instant::now();
        }
        let (client, current, rebuilding) =
            (self.client.clone(), self.current.clone(), self.rebuilding.clone());
        tokio::spawn(async move {
            let built = tokio::time::timeout(
                Duration::from_secs(5),
                client.get_async_connection_with_config(Default::default()),
            )
            .await;
            match built {
                Ok(Ok(connection)) => {
                    current.store(Arc::new(connection));
                    metrics::counter!("tollgate_store_reconnects_total").increment(1);
                    tracing::info!("rebuilt the Redis Cluster connection to re-read the topology");
                }
                Ok(Err(error)) => tracing::warn!(%error, "could not rebuild the Redis Cluster connection"),
                Err(_) => tracing::warn!("rebuilding the Redis Cluster connection timed out"),
            }
            rebuilding.store(false, Ordering::SeqCst);
        });
    }
}

impl RedisStore {
    /// Prepares a store for `target` without waiting for Redis to be up; every call is bounded
    /// by `timeout`. `tls` adds a CA and client certificates for `rediss://` targets.
    pub fn connect(
        target: &RedisTarget,
        timeout: Duration,
        tls: &RedisTls,
    ) -> Result<RedisStore, StoreError> {
        let redis_err = |e: redis::RedisError| StoreError::Redis(e.to_string());
        let certificates = tls.certificates()?;
        let (connection, description) = match target {
            RedisTarget::Standalone(url) => {
                let info = url.as_str().into_connection_info().map_err(redis_err)?;
                let description = format!("redis at {}", info.addr());
                let client = match certificates {
                    Some(certs) => redis::Client::build_with_tls(info, certs),
                    None => redis::Client::open(info),
                }
                .map_err(redis_err)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                let manager = ConnectionManager::new_lazy_with_config(client, config).map_err(redis_err)?;
                (Connection::Standalone(manager), description)
            }
            RedisTarget::Cluster(seeds) => {
                let urls: Vec<String> = seeds
                    .iter()
                    .map(|s| if s.contains("://") { s.clone() } else { format!("redis://{s}") })
                    .collect();
                let mut addrs = Vec::with_capacity(urls.len());
                for url in &urls {
                    addrs.push(url.as_str().into_connection_info().map_err(redis_err)?.addr().to_string());
                }
                let mut builder =
                    ClusterClientBuilder::new(urls).connection_timeout(timeout).response_timeout(timeout);
                if let Some(certs) = certificates {
                    builder = builder.certs(certs);
                }
                let client = builder.build().map_err(redis_err)?;
                let connection = client.get_pending_async_connection_with_config(Default::default());
                let handle = ClusterHandle {
                    client,
                    current: Arc::new(ArcSwap::from_pointee(connection)),
                    last_rebuild: Arc::new(Mutex::new(Instant::now())),
                    rebuilding: Arc::default(),
                };
                (Connection::Cluster(Box::new(handle)), format!("redis cluster via {}", addrs.join(",")))
            }
        };
        let shared = Shared { connection, script: Script::new(SCRIPT), timeout, description };
        Ok(RedisStore { shared: Arc::new(shared), coalescer: None })
    }

    /// Turns on hot-tenant coalescing (`store/coalesce.rs`): concurrent requests for one slot
    /// share a script call, a queued request waiting about `delay` at most.
    pub fn coalescing(mut self, delay: Duration) -> Self {
        let shared = self.shared.clone();
        let call: Call = Arc::new(move |groups: Vec<Group>| {
            let shared = shared.clone();
            Box::pin(async move { shared.run(&groups.iter().collect::<Vec<_>>()).await })
        });
        self.coalescer = Some(Coalescer::new(call, delay, self.shared.timeout));
        self
    }
}

impl RedisStore {
    // Groups that all live in `slot`: coalesced with other requests', or sent alone.
    async fn call_slot(&self, slot: u16, groups: Vec<Group>) -> Result<Vec<GroupOutcome>, StoreError> {
        match &self.coalescer {
            Some(c) => c.submit(slot, groups).await,
            None => self.shared.run(&groups.iter().collect::<Vec<_>>()).await,
        }
    }

    fn slot_of(&self, op: &BucketOp) -> u16 {
        match &self.shared.connection {
            Connection::Cluster(_) => cluster_slot(&op.key),
            Connection::Standalone(_) => 0,
        }
    }

    // Gives back what the admitted parts of a group that was denied as a whole took.
    async fn compensate(&self, group: &Group, parts: &[Part], answers: &[Result<GroupOutcome, StoreError>], combined: &mut GroupOutcome) {
        let mut calls: Vec<(u16, Group, Vec<usize>)> = Vec::new();
        for (part, answer) in parts.iter().zip(answers) {
            let Ok(outcome) = answer else { continue };
            if !outcome.admitted {
                continue;
            }
            let mut undo = Group::new();
            let mut positions = Vec::new();
            for (&i, verdict) in part.ops.iter().zip(&outcome.verdicts) {
                let op = &group[i];
                if !verdict.allowed || op.need == 0.0 || op.charge != Charge::Admitted {
                    continue;
                }
                // A debit comes back as a credit (capped at capacity); a credit is taken back
                // down to zero at most.
                let charge = if op.need < 0.0 { Charge::Always { max_debt: 0.0 } } else { Charge::Admitted };
                undo.push(BucketOp { key: op.key.clone(), spec: op.spec, need: -op.need, role: Role::Shadow, charge });
                positions.push(i);
            }
            if !undo.is_empty() {
                calls.push((part.slot, undo, positions));
            }
        }
        if calls.is_empty() {
            return;
        }
        let results = join_all(calls.iter().map(|(slot, undo, _)| self.call_slot(*slot, vec![undo.clone()]))).await;
        combined.compensated = true;
        metrics::counter!("tollgate_store_compensations_total").increment(1);
        for ((_, _, positions), result) in calls.iter().zip(results) {
            match result.map(|mut o| o.pop()) {
                Ok(Some(outcome)) => {
                    for (&i, v) in positions.iter().zip(outcome.verdicts) {
                        combined.verdicts[i].tokens = v.tokens;
                        combined.verdicts[i].reset_ms = v.reset_ms;
                    }
                }
                Ok(None) | Err(_) => {
                    metrics::counter!("tollgate_store_compensation_failures_total").increment(1);
                    tracing::error!(
                        keys = ?positions.iter().map(|&i| group[i].key.as_str()).collect::<Vec<_>>(),
                        "could not give back the debits of a request denied in another Cluster slot"
                    );
                }
            }
        }
    }

    // One group evaluated slot by slot (it spans several): admitted only if every part is and,
    // with quota-mode operations, one of them had its tokens; otherwise the admitted parts are
    // credited back before the answer.
    async fn evaluate_split(&self, group: &Group, parts: Vec<Part>, answers: Vec<Result<GroupOutcome, StoreError>>) -> Result<GroupOutcome, StoreError> {
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
        let mut combined = GroupOutcome {
            admitted,
            now_ms,
            verdicts: verdicts.into_iter().map(|v| v.unwrap_or(FAILED)).collect(),
            compensated: false,
        };
        if !admitted {
            self.compensate(group, &parts, &answers, &mut combined).await;
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(combined),
        }
    }
}

// A verdict standing in for an operation whose slot failed; never reported (the group fails).
const FAILED: Verdict = Verdict { allowed: false, tokens: 0.0, retry_after_ms: None, reset_ms: 0, forgiven: 0.0 };

// One script call: the groups (whole, or parts of split ones) of one slot, and which (group,
// part) each of them answers.
struct SlotCall {
    slot: u16,
    groups: Vec<Group>,
    parts: Vec<(usize, usize)>,
}

// The operations of one group that live in one slot.
struct Part {
    slot: u16,
    ops: Vec<usize>,
}

impl Shared {
    // One script run for groups that all live in one slot (or on one standalone server).
    async fn run(&self, batch: &[&Group]) -> Result<Vec<GroupOutcome>, StoreError> {
        let mut invocation = self.script.prepare_invoke();
        let mut key_index: HashMap<&str, usize> = HashMap::new();
        let mut args: Vec<String> =
            Vec::with_capacity(1 + batch.iter().map(|g| 1 + 6 * g.len()).sum::<usize>());
        args.push(batch.len().to_string());
        for group in batch {
            args.push(group.len().to_string());
            for op in group.iter() {
                let next = key_index.len() + 1;
                let index = *key_index.entry(op.key.as_str()).or_insert_with(|| {
                    invocation.key(op.key.as_str());
                    next
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
            }
        }
        invocation.arg(args);

        let start = Instant::now();
        let reply = match &self.connection {
            Connection::Standalone(c) => {
                tokio::time::timeout(self.timeout, invocation.invoke_async::<Value>(&mut c.clone())).await
            }
            Connection::Cluster(handle) => {
                let reply = tokio::time::timeout(
                    self.timeout,
                    invocation.invoke_async::<Value>(&mut handle.connection()),
                )
                .await;
                match &reply {
                    Err(_) => handle.rebuild(),
                    Ok(Err(e)) => handle.rebuild_after(e),
                    Ok(Ok(_)) => {}
                }
                reply
            }
        };
        metrics::histogram!("tollgate_store_duration_seconds").record(start.elapsed());
        metrics::counter!("tollgate_store_calls_total").increment(1);
        metrics::counter!("tollgate_store_call_groups_total").increment(batch.len() as u64);
        let reply = reply
            .map_err(|_| StoreError::Timeout(self.timeout))?
            .map_err(|e| StoreError::Redis(e.to_string()))?;
        parse_reply(reply, batch)
    }
}

impl Store for RedisStore {
    fn evaluate<'a>(&'a self, batch: &'a Batch) -> BoxFuture<'a, Vec<Result<GroupOutcome, StoreError>>> {
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
            // The common case, one slot, needs no join.
            let answers = if calls.len() == 1 {
                let call = calls.pop().expect("one call");
                vec![self.call_slot(call.slot, call.groups).await]
            } else {
                join_all(calls.into_iter().map(|c| self.call_slot(c.slot, c.groups))).await
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
                    self.evaluate_split(group, parts, answers).await
                });
            }
            results
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let ping = redis::cmd("PING");
            let call = async {
                match &self.shared.connection {
                    Connection::Standalone(c) => ping.query_async::<()>(&mut c.clone()).await,
                    Connection::Cluster(handle) => ping.query_async::<()>(&mut handle.connection()).await,
                }
            };
            let timeout = self.shared.timeout;
            tokio::time::timeout(timeout, call)
                .await
                .map_err(|_| StoreError::Timeout(timeout))?
                .map_err(|e| StoreError::Redis(e.to_string()))
        })
    }

    fn describe(&self) -> String {
        self.shared.description.clone()
    }
}

// Reads the flat reply described at the top of the script.
fn parse_reply(reply: Value, batch: &[&Group]) -> Result<Vec<GroupOutcome>, StoreError> {
    let Value::Array(items) = reply else {
        return Err(StoreError::Protocol(format!("expected an array, got {reply:?}")));
    };
    let expected = 1 + batch.iter().map(|g| 1 + 5 * g.len()).sum::<usize>();
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
            verdicts.push(Verdict {
                allowed,
                tokens,
                retry_after_ms: u64::try_from(retry).ok(),
                reset_ms: u64::try_from(reset).unwrap_or(0),
                forgiven,
            });
        }
        outcomes.push(GroupOutcome { admitted, now_ms, verdicts, compensated: false });
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
        Some(Value::BulkString(b)) => std::str::from_utf8(&b)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .ok_or_else(|| StoreError::Protocol(format!("not a number: {:?}", String::from_utf8_lossy(&b)))),
        other => Err(StoreError::Protocol(format!("expected a number, got {other:?}"))),
    }
}
