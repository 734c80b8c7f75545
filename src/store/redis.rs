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
use crate::bucket::{Batch, Group, GroupOutcome, Verdict};
use crate::keys::cluster_slot;

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
    // The groups `members` of `batch`, all in `slot`: coalesced with other requests', or alone.
    async fn call_slot(
        &self,
        batch: &Batch,
        slot: u16,
        members: &[usize],
    ) -> Result<Vec<GroupOutcome>, StoreError> {
        match &self.coalescer {
            Some(c) => c.submit(slot, members.iter().map(|&i| batch[i].clone()).collect()).await,
            None => self.shared.run(&members.iter().map(|&i| &batch[i]).collect::<Vec<_>>()).await,
        }
    }
}

impl Shared {
    // One script run for groups that all live in one slot (or on one standalone server).
    async fn run(&self, batch: &[&Group]) -> Result<Vec<GroupOutcome>, StoreError> {
        let mut invocation = self.script.prepare_invoke();
        let mut key_index: HashMap<&str, usize> = HashMap::new();
        let mut args: Vec<String> =
            Vec::with_capacity(1 + batch.iter().map(|g| 1 + 5 * g.len()).sum::<usize>());
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
                args.push(op.spec.capacity.to_string());
                args.push(op.spec.refill_per_second.to_string());
                args.push(op.need.to_string());
                args.push(if op.shadow { "1" } else { "0" }.to_owned());
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
            // Partition by slot; a standalone server takes everything in one call.
            let mut partitions: Vec<(u16, Vec<usize>)> = Vec::new();
            for (i, group) in batch.iter().enumerate() {
                let slot = match (&self.shared.connection, group.first()) {
                    (Connection::Cluster(_), Some(op)) => cluster_slot(&op.key),
                    _ => 0,
                };
                match partitions.iter_mut().find(|(s, _)| *s == slot) {
                    Some((_, members)) => members.push(i),
                    None => partitions.push((slot, vec![i])),
                }
            }
            // The common case, one slot, needs no join.
            let answers = if let [(slot, members)] = partitions.as_slice() {
                vec![self.call_slot(batch, *slot, members).await]
            } else {
                join_all(partitions.iter().map(|(slot, members)| self.call_slot(batch, *slot, members))).await
            };
            let mut results: Vec<Option<Result<GroupOutcome, StoreError>>> = vec![None; batch.len()];
            for ((_, members), result) in partitions.iter().zip(answers) {
                match result {
                    Ok(outcomes) => {
                        for (&i, outcome) in members.iter().zip(outcomes) {
                            results[i] = Some(Ok(outcome));
                        }
                    }
                    Err(e) => {
                        for &i in members {
                            results[i] = Some(Err(e.clone()));
                        }
                    }
                }
            }
            results.into_iter().map(|r| r.expect("every group has a result")).collect()
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
    let expected = 1 + batch.iter().map(|g| 1 + 4 * g.len()).sum::<usize>();
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
            verdicts.push(Verdict {
                allowed,
                tokens,
                retry_after_ms: u64::try_from(retry).ok(),
                reset_ms: u64::try_from(reset).unwrap_or(0),
            });
        }
        outcomes.push(GroupOutcome { admitted, now_ms, verdicts });
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
