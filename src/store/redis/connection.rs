//! How tollgate reaches Redis: which deployment (one server, a Cluster, the primary behind
//! Sentinel), with what TLS beyond the public web roots, and one script run on the node that owns
//! a slot. Nothing here knows what the scripts compute; `src/store/redis/mod.rs` does.

use std::path::PathBuf;
use std::time::Duration;

use redis::aio::ConnectionManagerConfig;
use redis::{ClientTlsConfig, IntoConnectionInfo, TlsCertificates, Value};

use super::cluster::{Cluster, ClusterError};
use super::late_window;
use super::node::{self, Node, Script};
use super::sentinel::{Sentinel, SentinelTarget};
use crate::identity::cluster_slot;
use crate::store::StoreError;

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

// A connected deployment.
pub(super) enum Connection {
    Standalone(Box<Node>),
    Cluster(Cluster),
    // Boxed: the Sentinel client's state is ten times the others'.
    Sentinel(Box<Sentinel>),
}

impl Connection {
    // Prepares the connections to `target` without waiting for Redis to be up, with a
    // description for logs (addresses, never credentials).
    pub(super) fn open(
        target: &RedisTarget,
        deadline: Duration,
        tls: &RedisTls,
    ) -> Result<(Connection, String), ConnectError> {
        let certificates = tls.certificates()?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(deadline))
            .set_response_timeout(Some(late_window(deadline)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        Ok(match target {
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
                (Connection::Standalone(Box::new(node)), description)
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
        })
    }

    // The slot a key is evaluated in: its Cluster slot, or 0 where one server holds every key.
    pub(super) fn slot(&self, key: &str) -> u16 {
        match self {
            Connection::Cluster(_) => cluster_slot(key),
            Connection::Standalone(_) | Connection::Sentinel(_) => 0,
        }
    }

    // Runs `script` once on the node of `slot`.
    pub(super) async fn eval(
        &self,
        script: &Script,
        slot: u16,
        call: &node::Call<'_>,
    ) -> Result<Value, StoreError> {
        match self {
            Connection::Standalone(node) => node.eval(script, call, false).await.map_err(StoreError::Redis),
            Connection::Sentinel(sentinel) => sentinel.eval(script, call).await.map_err(StoreError::Redis),
            Connection::Cluster(cluster) => cluster.eval(script, slot, call).await.map_err(from_cluster),
        }
    }

    // PING on the server (every primary of a Cluster).
    pub(super) async fn ping(&self) -> Result<(), StoreError> {
        match self {
            Connection::Standalone(node) => {
                node.query::<String>(&mut redis::cmd("PING")).await.map(drop).map_err(StoreError::Redis)
            }
            Connection::Sentinel(sentinel) => {
                sentinel.query::<String>(&mut redis::cmd("PING")).await.map(drop).map_err(StoreError::Redis)
            }
            Connection::Cluster(cluster) => cluster.ping().await.map_err(from_cluster),
        }
    }

    // A connection of its own for subscribing to channels.
    pub(super) async fn pubsub(&self) -> Result<redis::aio::PubSub, StoreError> {
        match self {
            Connection::Standalone(node) => node.pubsub().await.map_err(StoreError::Redis),
            Connection::Sentinel(sentinel) => sentinel.pubsub().await.map_err(StoreError::Redis),
            Connection::Cluster(cluster) => cluster.pubsub().await.map_err(from_cluster),
        }
    }

    // Changes on every reconnection and failover: the server's state or clock may have jumped.
    pub(super) fn epoch(&self) -> u64 {
        match self {
            Connection::Standalone(node) => node.epoch(),
            Connection::Sentinel(sentinel) => sentinel.epoch(),
            Connection::Cluster(cluster) => cluster.epoch(),
        }
    }
}

fn from_cluster(e: ClusterError) -> StoreError {
    match e {
        ClusterError::NoOwner(slot) => StoreError::NoOwner(slot),
        ClusterError::Redis(e) => StoreError::Redis(e),
    }
}
