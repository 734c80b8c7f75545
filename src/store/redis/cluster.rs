//! A Redis Cluster client that runs each script call at most once, and never lets one shard's
//! trouble hold another's calls.
//!
//! Why tollgate owns this piece instead of using the `redis` crate's cluster connection: that
//! connection resends a command after a connection error (it cannot know whether the server ran
//! it, and for a script that takes tokens, running twice takes them twice), and while it refreshes
//! its slot map after a node fails it holds every queued request, healthy shards' too. Here:
//!
//! * every node has a connection of its own ([`Node`]); a call waits only on its slot's node;
//! * the slot map (`CLUSTER SLOTS`) is read in the background, after a redirect or any
//!   connection trouble (at most every [`REFRESH_INTERVAL`]) and every [`REFRESH_PERIOD`]
//!   regardless, and swapped in whole; calls never wait for it, except the very first ones;
//! * a call is resent only when the server said it did not run it: `MOVED` (to the node named,
//!   and the map is refreshed), `ASK` (once, after `ASKING`), `TRYAGAIN` (after a pause), and
//!   `NOSCRIPT` (after loading the script, in [`Node::eval`]); at most [`MAX_REDIRECTS`] times.
//!   Any other failure is returned as it is, and the topology is read again.
//!
//! [`Cluster::epoch`] counts topology changes, so that what was learnt from one primary (the
//! pre-check's observations) is not held against its successor, whose clock may differ.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use redis::aio::ConnectionManagerConfig;
use redis::{ConnectionAddr, ConnectionInfo, ErrorKind, RedisError, ServerErrorKind, TlsCertificates, Value};
use tokio::sync::Notify;

use super::node::{Call, Node, Script};

/// Most redirects (MOVED, ASK, TRYAGAIN) followed for one call.
pub const MAX_REDIRECTS: usize = 5;
/// Least time between two reads of the slot map.
pub const REFRESH_INTERVAL: Duration = Duration::from_millis(100);
/// The slot map is read at least this often, even when nothing failed.
pub const REFRESH_PERIOD: Duration = Duration::from_secs(10);
/// Pause before resending after TRYAGAIN (a multi-key call during a slot migration).
const TRYAGAIN_PAUSE: Duration = Duration::from_millis(20);

/// Which node serves each of the 16384 slots.
#[derive(Default)]
struct SlotMap {
    // Index into `owners` per slot, `u16::MAX` for an unserved slot.
    slots: Vec<u16>,
    owners: Vec<Arc<str>>,
}

impl SlotMap {
    fn owner(&self, slot: u16) -> Option<&Arc<str>> {
        let i = *self.slots.get(usize::from(slot))?;
        self.owners.get(usize::from(i))
    }

    fn same_as(&self, other: &SlotMap) -> bool {
        self.slots.len() == other.slots.len()
            && (0..self.slots.len()).all(|s| self.owner(s as u16) == other.owner(s as u16))
    }
}

/// The Cluster client.
pub(crate) struct Cluster {
    inner: Arc<Inner>,
    refresher: tokio::task::JoinHandle<()>,
}

struct Inner {
    seeds: Vec<ConnectionInfo>,
    tls: Option<TlsCertificates>,
    config: ConnectionManagerConfig,
    slots: ArcSwap<SlotMap>,
    nodes: Mutex<HashMap<Arc<str>, Arc<Node>>>,
    wake: Notify,
    first_map: tokio::sync::Mutex<()>,
    epoch: Arc<AtomicU64>,
}

/// Why a call failed.
#[derive(Debug)]
pub(crate) enum ClusterError {
    /// No node is known for the slot (the map is empty or the slot unserved).
    NoOwner(u16),
    /// The node answered with an error or could not be reached.
    Redis(RedisError),
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.refresher.abort();
    }
}

impl Cluster {
    /// A client that finds the cluster through `seeds` (their credentials and TLS settings apply
    /// to every node). Connections are made when first needed, so this does not wait for Redis.
    pub(crate) fn new(
        seeds: Vec<ConnectionInfo>,
        tls: Option<TlsCertificates>,
        config: ConnectionManagerConfig,
    ) -> Cluster {
        let inner = Arc::new(Inner {
            seeds,
            tls,
            config,
            slots: ArcSwap::from_pointee(SlotMap::default()),
            nodes: Mutex::default(),
            wake: Notify::new(),
            first_map: tokio::sync::Mutex::new(()),
            epoch: Arc::default(),
        });
        let refresher = tokio::spawn(refresh_loop(Arc::downgrade(&inner)));
        Cluster { inner, refresher }
    }

    /// Topology changes seen so far.
    pub(crate) fn epoch(&self) -> u64 {
        self.inner.epoch.load(Ordering::Relaxed)
    }

    /// Runs `call` on the primary of `slot`, following redirects that prove it did not run.
    pub(crate) async fn eval(
        &self,
        script: &Script,
        slot: u16,
        call: &Call<'_>,
    ) -> Result<Value, ClusterError> {
        let mut target = self.owner(slot).await?;
        let mut asking = false;
        for _ in 0..MAX_REDIRECTS {
            let node = self.inner.node(&target).map_err(ClusterError::Redis)?;
            match node.eval(script, call, asking).await {
                Ok(value) => return Ok(value),
                Err(e) => match e.kind() {
                    ErrorKind::Server(ServerErrorKind::Moved) => {
                        target = redirect(&e)?;
                        asking = false;
                        self.inner.wake.notify_one();
                    }
                    ErrorKind::Server(ServerErrorKind::Ask) => {
                        target = redirect(&e)?;
                        asking = true;
                    }
                    ErrorKind::Server(ServerErrorKind::TryAgain) => tokio::time::sleep(TRYAGAIN_PAUSE).await,
                    _ => {
                        self.inner.wake.notify_one();
                        return Err(ClusterError::Redis(e));
                    }
                },
            }
        }
        Err(ClusterError::Redis(RedisError::from((ErrorKind::Client, "too many redirects"))))
    }

    /// PINGs the primaries; ready if any answers (shards fail independently).
    pub(crate) async fn ping(&self) -> Result<(), ClusterError> {
        self.owner(0).await?;
        let owners: Vec<Arc<str>> = self.inner.slots.load().owners.clone();
        let mut last = None;
        for owner in owners {
            let node = self.inner.node(&owner).map_err(ClusterError::Redis)?;
            match node.query::<String>(&mut redis::cmd("PING")).await {
                Ok(_) => return Ok(()),
                Err(e) => last = Some(e),
            }
        }
        Err(last.map_or(ClusterError::NoOwner(0), ClusterError::Redis))
    }

    /// A connection for subscribing to channels: classic `PUBLISH` reaches every node of a
    /// Cluster, so any one will do; the primary of slot 0 is one the map always names.
    pub(crate) async fn pubsub(&self) -> Result<redis::aio::PubSub, ClusterError> {
        let owner = self.owner(0).await?;
        let node = self.inner.node(&owner).map_err(ClusterError::Redis)?;
        node.pubsub().await.map_err(ClusterError::Redis)
    }

    // The primary of `slot`; before the first slot map, waits for it.
    async fn owner(&self, slot: u16) -> Result<Arc<str>, ClusterError> {
        if let Some(owner) = self.inner.slots.load().owner(slot) {
            return Ok(owner.clone());
        }
        {
            let _first = self.inner.first_map.lock().await;
            if self.inner.slots.load().slots.is_empty() {
                self.inner.refresh().await;
            }
        }
        self.inner.wake.notify_one();
        self.inner.slots.load().owner(slot).cloned().ok_or(ClusterError::NoOwner(slot))
    }
}

fn redirect(e: &RedisError) -> Result<Arc<str>, ClusterError> {
    match e.redirect_node() {
        Some((addr, _slot)) => Ok(Arc::from(addr)),
        None => Err(ClusterError::Redis(e.clone())),
    }
}

impl Inner {
    // The connection to `addr`, made on first use.
    fn node(&self, addr: &Arc<str>) -> Result<Arc<Node>, RedisError> {
        let mut nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(node) = nodes.get(addr) {
            return Ok(node.clone());
        }
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
            .ok_or_else(|| RedisError::from((ErrorKind::Client, "bad node address", addr.to_string())))?;
        let seed = &self.seeds[0];
        let tcp = match seed.addr() {
            ConnectionAddr::TcpTls { insecure, .. } => {
                ConnectionAddr::TcpTls { host, port, insecure: *insecure, tls_params: None }
            }
            _ => ConnectionAddr::Tcp(host, port),
        };
        let info = seed.clone().set_addr(tcp);
        let client = match &self.tls {
            Some(certs) => redis::Client::build_with_tls(info, certs.clone())?,
            None => redis::Client::open(info)?,
        };
        let node = Arc::new(Node::new(addr.to_string(), client, self.config.clone(), self.epoch.clone())?);
        nodes.insert(addr.clone(), node.clone());
        Ok(node)
    }

    // Reads the slot map from a known primary, else a seed, and swaps it in if it changed.
    async fn refresh(&self) {
        let mut candidates: Vec<Arc<str>> = self.slots.load().owners.clone();
        candidates.extend(self.seeds.iter().filter_map(|s| match s.addr() {
            ConnectionAddr::Tcp(h, p) | ConnectionAddr::TcpTls { host: h, port: p, .. } => {
                Some(Arc::from(format!("{h}:{p}")))
            }
            _ => None,
        }));
        let mut failures = Vec::new();
        for addr in candidates {
            let Ok(node) = self.node(&addr) else { continue };
            match node.query::<Value>(redis::cmd("CLUSTER").arg("SLOTS")).await {
                Ok(reply) => match parse_slots(reply, &addr) {
                    Some(map) => return self.install(map),
                    None => failures.push(format!("{addr}: unexpected CLUSTER SLOTS reply")),
                },
                Err(e) => failures.push(format!("{addr}: {e}")),
            }
        }
        tracing::debug!(?failures, "could not read the Redis Cluster slot map");
    }

    fn install(&self, map: SlotMap) {
        if self.slots.load().same_as(&map) {
            return;
        }
        let first = self.slots.load().slots.is_empty();
        let primaries: Vec<String> = map.owners.iter().map(|o| o.to_string()).collect();
        // Connections to nodes that serve nothing any more are dropped (seeds are made again
        // when a refresh needs them).
        self.nodes.lock().unwrap_or_else(|p| p.into_inner()).retain(|addr, _| map.owners.contains(addr));
        self.slots.store(Arc::new(map));
        self.epoch.fetch_add(1, Ordering::Relaxed);
        if first {
            tracing::info!(?primaries, "Redis Cluster slot map read");
        } else {
            tracing::warn!(?primaries, "Redis Cluster topology changed");
        }
    }
}

async fn refresh_loop(inner: std::sync::Weak<Inner>) {
    let mut last = Instant::now() - REFRESH_INTERVAL;
    loop {
        let Some(me) = inner.upgrade() else { return };
        let woken = tokio::time::timeout(REFRESH_PERIOD, me.wake.notified()).await.is_ok();
        let wait = REFRESH_INTERVAL.saturating_sub(last.elapsed());
        if woken && !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        last = Instant::now();
        me.refresh().await;
    }
}

// CLUSTER SLOTS: [[start, end, [ip, port, id, ...], replicas...], ...]. An empty ip means the
// node that answered.
fn parse_slots(reply: Value, answered_by: &str) -> Option<SlotMap> {
    let Value::Array(ranges) = reply else { return None };
    let mut map = SlotMap { slots: vec![u16::MAX; 16384], owners: Vec::new() };
    let answering_host = answered_by.rsplit_once(':').map_or(answered_by, |(h, _)| h);
    for range in ranges {
        let Value::Array(parts) = range else { return None };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(primary))) =
            (parts.first(), parts.get(1), parts.get(2))
        else {
            return None;
        };
        let host = match primary.first() {
            Some(Value::BulkString(b)) if !b.is_empty() => String::from_utf8_lossy(b).into_owned(),
            _ => answering_host.to_owned(),
        };
        let Some(Value::Int(port)) = primary.get(1) else { return None };
        let owner: Arc<str> = Arc::from(format!("{host}:{port}"));
        let index = match map.owners.iter().position(|o| *o == owner) {
            Some(i) => i,
            None => {
                map.owners.push(owner);
                map.owners.len() - 1
            }
        } as u16;
        for slot in (*start).max(0)..=(*end).min(16383) {
            map.slots[slot as usize] = index;
        }
    }
    Some(map)
}
