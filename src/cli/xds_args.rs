//! The flags of `serve` that take rules from an xDS server, and those that send
//! envoyproxy/ratelimit's metrics (statsd, or mapped for Prometheus).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use tollgate::app::RatelimitStatsSettings;
use tollgate::edge::client_tls::ClientTlsFiles;
use tollgate::edge::xds::{Backoff, XdsSettings};
use tollgate::reload::PushLimits;
use tollgate::telemetry::ratelimit_stats::StatsSettings;

/// Where pushed rules come from.
#[derive(Args)]
pub(super) struct XdsArgs {
    /// Take the rules from this xDS server (host:port, or http:// / https:// URL): an ADS stream,
    /// state of the world, of envoyproxy/ratelimit's RateLimitConfig resources.
    #[arg(long, env = "TOLLGATE_XDS_SERVER")]
    xds_server: Option<String>,
    /// The node id the xDS server keys this client's resources by.
    #[arg(long, env = "TOLLGATE_XDS_NODE_ID", default_value = "default")]
    xds_node_id: String,
    /// The node's metadata: KEY=VALUE,...
    #[arg(long, env = "TOLLGATE_XDS_NODE_METADATA", value_delimiter = ',', value_parser = pair)]
    xds_node_metadata: Vec<(String, String)>,
    /// Headers on the xDS stream: NAME=VALUE,...
    #[arg(long = "xds-header", env = "TOLLGATE_XDS_HEADERS", value_delimiter = ',', value_parser = pair, hide_env_values = true)]
    xds_headers: Vec<(String, String)>,
    /// TLS to the xDS server.
    #[arg(long, env = "TOLLGATE_XDS_TLS")]
    xds_tls: bool,
    /// CA certificates (PEM) that signed the xDS server's certificate (default: the web's roots).
    #[arg(long, env = "TOLLGATE_XDS_TLS_CA")]
    xds_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for an xDS server that requires mutual TLS.
    #[arg(long, env = "TOLLGATE_XDS_TLS_CERT", requires = "xds_tls_key")]
    xds_tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "TOLLGATE_XDS_TLS_KEY", requires = "xds_tls_cert")]
    xds_tls_key: Option<PathBuf>,
    /// The name the xDS server's certificate must carry, if not its host's.
    #[arg(long, env = "TOLLGATE_XDS_TLS_SERVER_NAME")]
    xds_tls_server_name: Option<String>,
    /// The first delay before opening a broken xDS stream again; it doubles to --xds-backoff-max.
    #[arg(long, env = "TOLLGATE_XDS_BACKOFF_INITIAL", default_value = "10s", value_parser = humantime::parse_duration)]
    xds_backoff_initial: Duration,
    /// The longest delay between attempts.
    #[arg(long, env = "TOLLGATE_XDS_BACKOFF_MAX", default_value = "60s", value_parser = humantime::parse_duration)]
    xds_backoff_max: Duration,
    /// How far each delay is spread, both ways, as a fraction of itself.
    #[arg(long, env = "TOLLGATE_XDS_BACKOFF_RANDOM_FACTOR", default_value_t = 0.5)]
    xds_backoff_random_factor: f64,
    /// Do not spread the delays.
    #[arg(long, env = "TOLLGATE_XDS_BACKOFF_NO_JITTER")]
    xds_backoff_no_jitter: bool,
    /// Largest xDS response accepted, in bytes (default 4 MiB).
    #[arg(long, env = "TOLLGATE_XDS_MAX_MESSAGE_BYTES")]
    xds_max_message_bytes: Option<usize>,
    /// With --xds-server, serve --config's domains beside the pushed ones (without it, giving both
    /// is an error: the pushed set is the whole config, as in envoyproxy/ratelimit).
    #[arg(long, env = "TOLLGATE_XDS_WITH_FILES", requires = "xds_server")]
    pub(super) xds_with_files: bool,
    /// Most domains a pushed config may bring (the files' included); a push with more is
    /// NACKed with the reason.
    #[arg(long, env = "TOLLGATE_MAX_DOMAINS", default_value_t = PushLimits::DEFAULT.max_domains)]
    max_domains: usize,
    /// Most rules, over all domains, a pushed config may bring; a push with more is NACKed.
    #[arg(long, env = "TOLLGATE_MAX_RULES", default_value_t = PushLimits::DEFAULT.max_rules)]
    max_rules: usize,
    /// Take a push with no domain at all while domains are served (it unlimits them all);
    /// without it such a push is NACKed.
    #[arg(long, env = "TOLLGATE_XDS_ALLOW_EMPTY", requires = "xds_server")]
    xds_allow_empty: bool,
    /// Be ready before the first pushed config arrives, limiting nothing until it does.
    #[arg(long, env = "TOLLGATE_START_WITHOUT_CONFIG")]
    pub(super) start_without_config: bool,
}

impl XdsArgs {
    /// The xDS client's settings, if a server is named.
    pub(super) fn settings(&self) -> Option<XdsSettings> {
        let server = self.xds_server.clone()?;
        let tls = (self.xds_tls || server.starts_with("https://")).then(|| ClientTlsFiles {
            ca: self.xds_tls_ca.clone(),
            client: self.xds_tls_cert.clone().zip(self.xds_tls_key.clone()),
            server_name: self.xds_tls_server_name.clone(),
        });
        Some(XdsSettings {
            server,
            node_id: self.xds_node_id.clone(),
            node_metadata: self.xds_node_metadata.clone(),
            headers: self.xds_headers.clone(),
            tls,
            backoff: Backoff {
                initial: self.xds_backoff_initial,
                max: self.xds_backoff_max.max(self.xds_backoff_initial),
                random_factor: self.xds_backoff_random_factor,
                jitter: !self.xds_backoff_no_jitter,
            },
            max_message_bytes: self.xds_max_message_bytes,
            limits: PushLimits {
                max_domains: self.max_domains,
                max_rules: self.max_rules,
                allow_empty: self.xds_allow_empty,
            },
        })
    }
}

/// envoyproxy/ratelimit's metrics.
#[derive(Args)]
pub(super) struct StatsArgs {
    /// Send envoyproxy/ratelimit's metrics, under its names, as statsd to this host:port (UDP).
    #[arg(long, env = "TOLLGATE_STATSD")]
    statsd: Option<String>,
    /// Serve envoyproxy/ratelimit's metrics, mapped for Prometheus, on this address (followed by
    /// tollgate's own series).
    #[arg(long, env = "TOLLGATE_PROMETHEUS_ADDR")]
    prometheus_addr: Option<SocketAddr>,
    /// The path they are served at.
    #[arg(long, env = "TOLLGATE_PROMETHEUS_PATH", default_value = "/metrics")]
    prometheus_path: String,
    /// A statsd_exporter mapping file (default: envoyproxy/ratelimit's own mapping).
    #[arg(long, env = "TOLLGATE_PROMETHEUS_MAPPER", requires = "prometheus_addr")]
    prometheus_mapper: Option<PathBuf>,
    /// How often the counts leave for statsd.
    #[arg(long, env = "TOLLGATE_STATS_FLUSH_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    stats_flush_interval: Duration,
    /// The fraction of a limit past which admitted hits count as near_limit.
    #[arg(long, env = "TOLLGATE_NEAR_LIMIT_RATIO", default_value_t = 0.8)]
    near_limit_ratio: f64,
}

impl StatsArgs {
    /// The settings, if either sink is asked for; `detailed_keys` bounds per-value names.
    pub(super) fn settings(&self, detailed_keys: usize) -> anyhow::Result<Option<RatelimitStatsSettings>> {
        if self.statsd.is_none() && self.prometheus_addr.is_none() {
            return Ok(None);
        }
        let mapping = match &self.prometheus_mapper {
            Some(file) => Some(
                std::fs::read_to_string(file)
                    .with_context(|| format!("reading the mapping file {}", file.display()))?,
            ),
            None => None,
        };
        Ok(Some(RatelimitStatsSettings {
            stats: StatsSettings {
                statsd: self.statsd.clone(),
                prometheus: self.prometheus_addr.map(|_| mapping),
                near_limit_ratio: self.near_limit_ratio,
                detailed_keys,
            },
            flush_interval: self.stats_flush_interval,
            prometheus: self.prometheus_addr.map(|addr| (addr, self.prometheus_path.clone())),
        }))
    }
}

pub(super) fn pair(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .ok_or_else(|| format!("{text:?}: expected KEY=VALUE"))
}
