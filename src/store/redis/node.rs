//! One Redis server: connections that run each script call at most once.
//!
//! A connection is the `redis` crate's `ConnectionManager`, which reconnects by itself and never
//! resends a command. A node has two: one for the calls a request waits on and one for background
//! work ([`crate::store::in_background`]: RLQS leases, budget recovery). Redis runs one connection's
//! commands in the order they came, so on one connection a request's script queued behind every
//! lease script in flight (measured: 5 RLQS streams of 20,000 buckets put RLS probes at a 51 ms
//! median and answered 40% of them from the failure mode at a 50 ms deadline); across connections
//! the server takes turns, and a request waits for at most the scripts it is read beside.
//!
//! On top of them this module sends the bucket script by its SHA (`EVALSHA`), loads it and sends
//! again on `NOSCRIPT` (the server said it did not run it), and sends it after
//! `ASKING` when a Cluster slot is being migrated. Nothing else is ever sent twice: a reply that
//! is lost after the command went out may hide a script run, and running it again would take the
//! tokens twice.
//!
//! A node also keeps the state operators care about, down or up, and logs only its changes: one
//! line when it stops answering, one when it answers again, with how long it was away.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, RedisError, Value};

use crate::telemetry::logs::ErrorChain;

/// The bucket script, as `EVALSHA` needs it.
pub(crate) struct Script {
    source: &'static str,
    sha: String,
}

impl Script {
    pub(crate) fn new(source: &'static str) -> Script {
        Script { source, sha: redis::Script::new(source).get_hash().to_owned() }
    }
}

/// One script call: its keys and arguments.
pub(crate) struct Call<'a> {
    pub keys: &'a [&'a str],
    pub args: &'a [super::wire::Arg<'a>],
}

/// A connection to one Redis server.
pub(crate) struct Node {
    addr: String,
    client: redis::Client,
    connection: ConnectionManager,
    background: ConnectionManager,
    down_since: Mutex<Option<Instant>>,
    // Moves when the node answers again after trouble: it may have restarted, or be another
    // server now, with other state and another clock.
    epoch: Arc<AtomicU64>,
}

impl Node {
    /// A node for `client`, connected lazily and reconnected in the background; `epoch` is
    /// advanced whenever it answers again after trouble.
    pub(crate) fn new(
        addr: String,
        client: redis::Client,
        config: ConnectionManagerConfig,
        epoch: Arc<AtomicU64>,
    ) -> Result<Node, RedisError> {
        let connection = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())?;
        let background = ConnectionManager::new_lazy_with_config(client.clone(), config)?;
        Ok(Node { addr, client, connection, background, down_since: Mutex::new(None), epoch })
    }

    /// A connection of its own for subscribing to channels.
    pub(crate) async fn pubsub(&self) -> Result<redis::aio::PubSub, RedisError> {
        self.client.get_async_pubsub().await
    }

    /// The server's address.
    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    /// How many times this node (or the nodes sharing its counter) came back.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Runs `call` once; after `asking`, as the target of an `ASK` redirect.
    pub(crate) async fn eval(
        &self,
        script: &Script,
        call: &Call<'_>,
        asking: bool,
    ) -> Result<Value, RedisError> {
        let result = match self.send(script, call, asking).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                // Not run: load the script (after a restart, failover or SCRIPT FLUSH) and send again.
                self.query::<String>(redis::cmd("SCRIPT").arg("LOAD").arg(script.source)).await?;
                self.send(script, call, asking).await
            }
            other => other,
        };
        self.note(&result);
        result
    }

    async fn send(&self, script: &Script, call: &Call<'_>, asking: bool) -> Result<Value, RedisError> {
        let mut eval = redis::cmd("EVALSHA");
        eval.arg(&script.sha).arg(call.keys.len()).arg(call.keys).arg(call.args);
        if !asking {
            return self.query(&mut eval).await;
        }
        // ASKING applies to the next command on the same connection: send both together.
        let mut pipe = redis::pipe();
        pipe.cmd("ASKING").ignore().add_command(eval);
        let (value,): (Value,) = pipe.query_async(&mut self.connection()).await?;
        Ok(value)
    }

    /// Runs any other command (topology reads, PING).
    pub(crate) async fn query<T: redis::FromRedisValue>(&self, cmd: &mut Cmd) -> Result<T, RedisError> {
        let result = cmd.query_async(&mut self.connection()).await;
        if result.is_ok() {
            self.note::<()>(&Ok(()));
        }
        result
    }

    // The connection for a call made now: background work's own, else the requests' one.
    fn connection(&self) -> ConnectionManager {
        if crate::store::is_background() {
            self.background.clone()
        } else {
            self.connection.clone()
        }
    }

    // Logs the changes between answering and not answering.
    fn note<T>(&self, result: &Result<T, RedisError>) {
        let trouble = match result {
            Ok(_) => false,
            Err(e) => {
                e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
            }
        };
        let mut down = self.down_since.lock().unwrap_or_else(|p| p.into_inner());
        match (trouble, *down) {
            (true, None) => {
                *down = Some(Instant::now());
                if let Err(error) = result {
                    tracing::warn!(node = %self.addr, error = %ErrorChain(error), "Redis node stopped answering");
                }
            }
            (false, Some(since)) => {
                *down = None;
                self.epoch.fetch_add(1, Ordering::Relaxed);
                let away: Duration = since.elapsed();
                tracing::info!(node = %self.addr, away = ?away, "Redis node answers again");
            }
            _ => {}
        }
    }
}
