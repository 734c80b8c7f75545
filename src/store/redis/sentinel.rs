//! Redis behind Sentinel: the primary the sentinels name, followed through failovers.
//!
//! The connection to the primary is an ordinary [`Node`] (at most once per call). The `redis`
//! crate's Sentinel client finds the primary: it asks the sentinels for the address of the
//! monitored master and confirms with `ROLE` that the server there is a primary. When a call
//! fails in a way that says the primary may have moved (no connection, a dropped connection, a
//! timeout, or `READONLY` from a primary demoted to a replica), the sentinels are asked again,
//! one lookup at a time and at most every [`LOOKUP_INTERVAL`]; a new address gets a new node and
//! a new store epoch, so that the pre-check forgets what it learnt from the old primary. The
//! failed call itself is not sent again: its caller got the failure mode, and the next calls go
//! to the new primary.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use redis::aio::ConnectionManagerConfig;
use redis::sentinel::{Sentinel as Sentinels, SentinelNodeConnectionInfo};
use redis::{Cmd, IntoConnectionInfo, RedisConnectionInfo, RedisError, TlsCertificates, Value};

use super::node::{Call, Node, Script};
use crate::telemetry::logs::ErrorChain;

/// Least time between two lookups of the primary while calls keep failing.
pub(crate) const LOOKUP_INTERVAL: Duration = Duration::from_millis(250);

/// Where the sentinels are and what they monitor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelTarget {
    /// The sentinels, `host:port` each.
    pub sentinels: Vec<String>,
    /// The master name they monitor.
    pub master: String,
    /// The sentinels' own password, if they require one.
    pub sentinel_password: Option<String>,
    /// The data nodes' credentials: `password` or `user:password`.
    pub auth: Option<String>,
}

/// The primary of a Sentinel-monitored deployment.
pub(crate) struct Sentinel {
    sentinels: tokio::sync::Mutex<Lookup>,
    master: String,
    node_info: SentinelNodeConnectionInfo,
    certificates: Option<TlsCertificates>,
    config: ConnectionManagerConfig,
    current: ArcSwapOption<Node>,
    epoch: Arc<AtomicU64>,
}

// The sentinel client and when it was last asked.
struct Lookup {
    client: Sentinels,
    last: Option<Instant>,
}

impl Sentinel {
    /// A deployment found through `target`, connected when first needed.
    pub(crate) fn new(
        target: &SentinelTarget,
        certificates: Option<TlsCertificates>,
        config: ConnectionManagerConfig,
    ) -> Result<Sentinel, RedisError> {
        let mut infos = Vec::with_capacity(target.sentinels.len());
        for addr in &target.sentinels {
            let url = if addr.contains("://") { addr.clone() } else { format!("redis://{addr}") };
            let mut info = url.as_str().into_connection_info()?;
            if let Some(password) = &target.sentinel_password {
                let settings = info.redis_settings().clone().set_password(password);
                info = info.set_redis_settings(settings);
            }
            infos.push(info);
        }
        let mut settings = RedisConnectionInfo::default();
        if let Some(auth) = &target.auth {
            settings = match auth.split_once(':') {
                Some((user, password)) => settings.set_username(user).set_password(password),
                None => settings.set_password(auth),
            };
        }
        Ok(Sentinel {
            sentinels: tokio::sync::Mutex::new(Lookup { client: Sentinels::build(infos)?, last: None }),
            master: target.master.clone(),
            node_info: SentinelNodeConnectionInfo::default().set_redis_connection_info(settings),
            certificates,
            config,
            current: ArcSwapOption::empty(),
            epoch: Arc::default(),
        })
    }

    /// Changes of primary (and returns of the primary after trouble) so far.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Runs `call` once on the primary.
    pub(crate) async fn eval(&self, script: &Script, call: &Call<'_>) -> Result<Value, RedisError> {
        let node = self.primary().await?;
        let result = node.eval(script, call, false).await;
        self.after(&node, &result).await;
        result
    }

    /// Runs another command (PING) on the primary.
    pub(crate) async fn query<T: redis::FromRedisValue>(&self, cmd: &mut Cmd) -> Result<T, RedisError> {
        let node = self.primary().await?;
        let result = node.query(cmd).await;
        self.after(&node, &result).await;
        result
    }

    /// A connection to the primary for subscribing to channels (replicas relay what is published
    /// too, so a failover does not lose the subscription until the old primary goes away).
    pub(crate) async fn pubsub(&self) -> Result<redis::aio::PubSub, RedisError> {
        self.primary().await?.pubsub().await
    }

    // The current primary, looked up if there is none yet.
    async fn primary(&self) -> Result<Arc<Node>, RedisError> {
        if let Some(node) = self.current.load_full() {
            return Ok(node);
        }
        self.look_up(None).await?;
        self.current.load_full().ok_or_else(|| RedisError::from((redis::ErrorKind::Io, "no primary known")))
    }

    // After a call to `node`: trouble that may mean a failover sends us to the sentinels.
    async fn after<T>(&self, node: &Arc<Node>, result: &Result<T, RedisError>) {
        let Err(e) = result else { return };
        let moved = e.is_io_error()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly);
        if moved {
            if let Err(error) = self.look_up(Some(node)).await {
                tracing::debug!(master = %self.master, error = %ErrorChain(&error), "sentinels could not name a primary yet");
            }
        }
    }

    // Asks the sentinels for the primary, unless another call just did or has already replaced
    // `failed`; installs a node for a new address.
    async fn look_up(&self, failed: Option<&Arc<Node>>) -> Result<(), RedisError> {
        let mut lookup = self.sentinels.lock().await;
        let current = self.current.load_full();
        if let (Some(failed), Some(current)) = (failed, &current) {
            if !Arc::ptr_eq(failed, current) {
                return Ok(());
            }
        }
        if current.is_some() && lookup.last.is_some_and(|at| at.elapsed() < LOOKUP_INTERVAL) {
            return Ok(());
        }
        lookup.last = Some(Instant::now());
        let client = lookup.client.async_master_for(&self.master, Some(&self.node_info)).await?;
        let info = client.get_connection_info().clone();
        let addr = info.addr().to_string();
        if current.as_ref().is_some_and(|n| n.addr() == addr) {
            return Ok(());
        }
        let client = match &self.certificates {
            Some(certs) => redis::Client::build_with_tls(info, certs.clone())?,
            None => client,
        };
        let node = Node::new(addr.clone(), client, self.config.clone(), self.epoch.clone())?;
        match &current {
            Some(old) => {
                tracing::warn!(master = %self.master, from = %old.addr(), to = %addr, "Redis primary moved")
            }
            None => {
                tracing::info!(master = %self.master, primary = %addr, "Redis primary found through Sentinel")
            }
        }
        self.current.store(Some(Arc::new(node)));
        self.epoch.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Where the sentinels are, for logs.
    pub(crate) fn describe(&self) -> String {
        format!("redis primary '{}' via Sentinel", self.master)
    }
}
