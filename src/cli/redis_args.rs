//! The Redis connection flags `serve` and `explain` share.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use tollgate::identity;
use tollgate::store::{RedisTarget, RedisTls, SentinelTarget};

/// Where Redis is: one of --redis-url, --redis-cluster or --redis-sentinel (none: no Redis).
#[derive(Args)]
pub(super) struct RedisArgs {
    /// Standalone Redis: redis://[user:password@]host:port[/db], or rediss:// for TLS.
    #[arg(long, env = "TOLLGATE_REDIS_URL", hide_env_values = true, conflicts_with_all = ["redis_cluster", "redis_sentinel"])]
    redis_url: Option<String>,
    /// Redis Cluster seed nodes: HOST:PORT,HOST:PORT,...
    #[arg(
        long,
        env = "TOLLGATE_REDIS_CLUSTER",
        value_delimiter = ',',
        hide_env_values = true,
        conflicts_with = "redis_sentinel"
    )]
    redis_cluster: Vec<String>,
    /// Redis Sentinel: the sentinels as HOST:PORT,HOST:PORT,... (with --redis-sentinel-master).
    #[arg(long, env = "TOLLGATE_REDIS_SENTINEL", value_delimiter = ',', requires = "redis_sentinel_master")]
    redis_sentinel: Vec<String>,
    /// The master name the sentinels monitor.
    #[arg(long, env = "TOLLGATE_REDIS_SENTINEL_MASTER", requires = "redis_sentinel")]
    redis_sentinel_master: Option<String>,
    /// Password of the sentinels themselves (the data nodes' credentials go in --redis-sentinel-auth).
    #[arg(long, env = "TOLLGATE_REDIS_SENTINEL_PASSWORD", hide_env_values = true)]
    redis_sentinel_password: Option<String>,
    /// Credentials of the data nodes behind Sentinel: [user:]password.
    #[arg(long, env = "TOLLGATE_REDIS_SENTINEL_AUTH", hide_env_values = true)]
    redis_sentinel_auth: Option<String>,
    /// CA certificates (PEM) that signed the Redis servers' TLS certificates (rediss://).
    #[arg(long, env = "TOLLGATE_REDIS_CA")]
    redis_ca: Option<PathBuf>,
    /// Client certificate (PEM) for Redis servers that require TLS client authentication.
    #[arg(long, env = "TOLLGATE_REDIS_CLIENT_CERT", requires = "redis_client_key")]
    redis_client_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "TOLLGATE_REDIS_CLIENT_KEY", requires = "redis_client_cert")]
    redis_client_key: Option<PathBuf>,
    /// Text every key starts with, so that deployments sharing one Redis keep apart (no braces).
    #[arg(long, env = "TOLLGATE_REDIS_KEY_PREFIX", default_value = "")]
    redis_key_prefix: String,
}

impl RedisArgs {
    /// The Redis the flags name, if any. Every command that reaches Redis comes through here, so
    /// this is also where the process's key prefix is set, before any key is made.
    pub(super) fn target(&self) -> anyhow::Result<Option<RedisTarget>> {
        identity::set_key_prefix(&self.redis_key_prefix)?;
        Ok(match (&self.redis_url, self.redis_cluster.is_empty(), self.redis_sentinel.is_empty()) {
            (Some(url), _, _) => Some(RedisTarget::Standalone(url.clone())),
            (None, false, _) => Some(RedisTarget::Cluster(self.redis_cluster.clone())),
            (None, true, false) => Some(RedisTarget::Sentinel(SentinelTarget {
                sentinels: self.redis_sentinel.clone(),
                master: self
                    .redis_sentinel_master
                    .clone()
                    .context("--redis-sentinel-master is required with --redis-sentinel")?,
                sentinel_password: self.redis_sentinel_password.clone(),
                auth: self.redis_sentinel_auth.clone(),
            })),
            (None, true, true) => None,
        })
    }

    /// The TLS certificates for `rediss://`.
    pub(super) fn tls(&self) -> RedisTls {
        RedisTls {
            ca: self.redis_ca.clone(),
            client: self.redis_client_cert.clone().zip(self.redis_client_key.clone()),
        }
    }
}
