//! Wiring: from what an operator configures to a running service.
//!
//! [`Settings`] is what `tollgate serve` takes from its flags and environment (the CLI fills it;
//! tests fill it directly). [`App::start`] builds the parts in dependency order: the rules, the
//! metrics, the store (Redis, with coalescing and the pre-check, or the embedded one), the quota
//! source, the limiter, the TLS configuration, and the watchers that keep rules and
//! certificates current. [`App::serve`] runs both protocol edges on listeners the caller bound.
//!
//! An `App` owns every background task it started: dropping it stops them (the store's, the
//! quota cache's and the metrics exporter's go with their owners inside).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::clock::MonotonicClock;
use crate::config::{ConfigError, RuleSet, Sources};
use crate::connections::ConnLimits;
use crate::edge::client_tls::ClientTlsFiles;
use crate::edge::region::client::GlobalLeases;
use crate::edge::region::RegionAuth;
use crate::edge::rlqs::RlqsLimits;
use crate::edge::rls::AnswerExtras;
use crate::edge::xds::{XdsError, XdsSettings};
use crate::limiter::{GlobalBudgets, GlobalShares, Limiter, ServiceModes};
use crate::quota::cache::CachedQuotas;
use crate::quota::postgres::{PostgresQuotas, QuotaError};
use crate::quota::{EmbeddedQuotas, QuotaSource};
use crate::reload::{Reloader, Watch};
use crate::server::{self, Listeners, ServeError, Service, Shutdown};
use crate::store::{health, ConnectError, MemoryStore, Precheck, RedisStore, RedisTarget, RedisTls, Store};
use crate::telemetry::ratelimit_stats::{self, StatsSettings};
use crate::telemetry::{Telemetry, TelemetryConfig};
use crate::tls::{ReloadingTls, TlsError, TlsFiles};
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;

/// Connections to the quota database per process; lookups are rare (one per tenant per TTL).
const QUOTA_DB_CONNECTIONS: usize = 8;

/// Everything `tollgate serve` can be told.
#[derive(Debug, Clone)]
pub struct Settings {
    /// A YAML file, or a directory of them; with `xds` too, their domains are served beside the
    /// pushed ones.
    pub config: Option<PathBuf>,
    /// Rules pushed by an xDS server.
    pub xds: Option<XdsSettings>,
    /// Ready before the first push is accepted, with no rules meanwhile (envoyproxy/ratelimit's
    /// `FORCE_START_WITHOUT_INITIAL_CONFIG`).
    pub ready_without_config: bool,
    /// envoyproxy/ratelimit's metrics under its names.
    pub ratelimit_stats: Option<RatelimitStatsSettings>,
    /// The shared store; `None` for the embedded one (limits per process).
    pub redis: Option<RedisSettings>,
    /// Tenant quotas from PostgreSQL; `None` for the config's inline tenants only.
    pub quotas: Option<QuotaSettings>,
    /// gRPC over TLS.
    pub tls: Option<TlsFiles>,
    /// Service-wide shadow and quota modes.
    pub modes: ServiceModes,
    /// What every RLS answer carries beyond the decision.
    pub answer_extras: AnswerExtras,
    /// Most decisions in flight.
    pub max_inflight: usize,
    /// Answer `ShouldRateLimit` on the fast path (`src/edge/rls/fast.rs`) rather than through
    /// tonic's generic stack.
    pub rls_fast_path: bool,
    /// The RLQS edge's bounds: abandonment, bucket and stream caps.
    pub rlqs: RlqsLimits,
    /// Connection caps and timeouts on both ports.
    pub connections: ConnLimits,
    /// Serve `POST /json` and `GET /config` on the plaintext HTTP port even with mutual TLS on
    /// gRPC.
    pub http_unauthenticated: bool,
    /// Serve `tollgate.region.v1.RegionLeases` on the gRPC port to the regions this allows: this
    /// is the global tier of the limits marked `global: true`.
    pub global_tier: Option<RegionAuth>,
    /// This is a region: decide the limits marked `global: true` on shares leased from the global
    /// tier.
    pub global: Option<GlobalSettings>,
    /// Bounds of the per-tenant metric series.
    pub telemetry: TelemetryConfig,
    /// Install the process-wide Prometheus recorder (once per process; off for a second `App`
    /// in one test process).
    pub exporter: bool,
    /// Watch the config and TLS files, and `SIGHUP`.
    pub watch: bool,
    /// Drop a domain whose file is gone on the reload that finds it gone, rather than keep it
    /// until `SIGHUP` confirms the removal.
    pub allow_domain_removal: bool,
    /// Read files and resources naming one domain as one domain (envoyproxy/ratelimit's
    /// `MERGE_DOMAIN_CONFIG`) instead of refusing the second.
    pub merge_domains: bool,
}

impl Settings {
    /// `serve`'s defaults for the config at `config`: the embedded store, no quota database, no
    /// TLS, no exporter, no watchers.
    pub fn new(config: impl Into<PathBuf>) -> Settings {
        Settings {
            config: Some(config.into()),
            xds: None,
            ready_without_config: false,
            ratelimit_stats: None,
            redis: None,
            quotas: None,
            tls: None,
            modes: ServiceModes::default(),
            answer_extras: AnswerExtras::default(),
            max_inflight: 10_000,
            rls_fast_path: true,
            rlqs: RlqsLimits::default(),
            connections: ConnLimits::default(),
            http_unauthenticated: false,
            global_tier: None,
            global: None,
            telemetry: TelemetryConfig::default(),
            exporter: false,
            watch: false,
            allow_domain_removal: false,
            merge_domains: false,
        }
    }
}

/// envoyproxy/ratelimit's metrics: where they go and how often.
#[derive(Debug, Clone)]
pub struct RatelimitStatsSettings {
    /// Sinks and counting.
    pub stats: StatsSettings,
    /// How often counts leave for statsd.
    pub flush_interval: Duration,
    /// Serve the mapped series (and tollgate's own) here, at this path.
    pub prometheus: Option<(SocketAddr, String)>,
}

/// A region's link to the global tier of global limits.
#[derive(Debug, Clone)]
pub struct GlobalSettings {
    /// The global tier's gRPC addresses (`http://host:port` or `https://`), tried in turn: a
    /// region renews through one until a round fails, then through the next.
    pub urls: Vec<String>,
    /// This region's name (no whitespace); the replica leases as `<region>/<replica>`.
    pub region: String,
    /// How long a request for a global bucket without a share here waits for its first lease
    /// before it is denied.
    pub first_lease_wait: Duration,
    /// TLS to an `https://` global tier.
    pub tls: ClientTlsFiles,
}

/// How to reach Redis.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// Standalone, Cluster or Sentinel.
    pub target: RedisTarget,
    /// Certificates for `rediss://`.
    pub tls: RedisTls,
    /// Deadline per call; past it the domain's failure mode answers.
    pub timeout: Duration,
    /// Hot-tenant coalescing delay (0: off).
    pub coalesce_delay: Duration,
    /// Buckets the exact pre-check remembers; `None` turns it off.
    pub precheck_buckets: Option<usize>,
}

/// The quota database and its cache.
#[derive(Debug, Clone)]
pub struct QuotaSettings {
    /// `postgres://user:password@host:port/db`.
    pub url: String,
    /// Extra CA certificates for its TLS.
    pub ca: Option<PathBuf>,
    /// How long a tenant's quota is served before it is read again.
    pub cache_ttl: Duration,
    /// Most tenants cached.
    pub cache_size: u64,
}

/// Why the service could not start. Each names the setting at fault.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The config does not load.
    #[error("loading the config: {0}")]
    Config(#[source] ConfigError),
    /// The metrics recorder could not be installed.
    #[error("installing the metrics recorder: {0}")]
    Metrics(#[source] metrics_exporter_prometheus::BuildError),
    /// The Redis settings are unusable (TLS files, URLs).
    #[error("Redis: {0}")]
    Redis(#[source] ConnectError),
    /// The quota database settings are unusable.
    #[error("--quota-store: {0}")]
    Quotas(#[source] QuotaError),
    /// The gRPC TLS files do not make a configuration.
    #[error("gRPC TLS: {0}")]
    Tls(#[source] TlsError),
    /// The global tier's address is unusable.
    #[error("{0}")]
    Global(#[source] crate::edge::region::client::BadUrl),
    /// The xDS client's settings are unusable.
    #[error("{0}")]
    Xds(#[source] XdsError),
    /// envoyproxy/ratelimit's metrics could not be set up.
    #[error("{0}")]
    RatelimitStats(String),
    /// Files could not be watched.
    #[error("watching {what}: {source}")]
    Watch {
        /// The config or the TLS files.
        what: &'static str,
        /// Why.
        #[source]
        source: notify::Error,
    },
}

/// The running parts of the service.
pub struct App {
    /// The rules in force, swapped by reloads.
    pub rules: Arc<ArcSwap<RuleSet>>,
    /// The decision core both edges use.
    pub limiter: Arc<Limiter>,
    /// Metrics.
    pub telemetry: Arc<Telemetry>,
    /// The gRPC TLS configuration, reloaded when its files change.
    pub tls: Option<Arc<ReloadingTls>>,
    max_inflight: usize,
    rls_fast_path: bool,
    answer_extras: AnswerExtras,
    rlqs: RlqsLimits,
    connections: ConnLimits,
    http_unauthenticated: bool,
    global_tier: Option<RegionAuth>,
    global_leases: Option<Arc<GlobalLeases>>,
    // A region's money leases and the global tier's endpoints, handed back at drain.
    money_leases: Option<(Arc<GlobalBudgets>, Vec<tonic::transport::Endpoint>)>,
    config_loaded: watch::Receiver<bool>,
    _watches: Vec<Watch>,
    _tasks: Vec<AbortOnDropHandle<()>>,
}

/// The store `redis` describes (the embedded one for `None`), with the pre-check in front of
/// Redis unless it is turned off; the task that tells the pre-check of other replicas' raises
/// goes into `tasks`. Needs a Tokio runtime.
pub fn store(
    redis: Option<&RedisSettings>,
    tasks: &mut Vec<AbortOnDropHandle<()>>,
) -> Result<Arc<dyn Store>, ConnectError> {
    let Some(redis) = redis else {
        tracing::warn!(
            "no Redis configured: using the embedded memory store. Limits hold PER PROCESS ONLY; \
             every replica enforces the full limit on its own"
        );
        return Ok(Arc::new(MemoryStore::new()));
    };
    let store =
        Arc::new(RedisStore::connect(&redis.target, redis.timeout, redis.coalesce_delay, &redis.tls)?);
    Ok(match redis.precheck_buckets {
        Some(buckets) => {
            let precheck = Arc::new(
                Precheck::new(store.clone(), Arc::new(MonotonicClock::new()), buckets).awaiting_raises(),
            );
            tasks.push(store.follow_raises(precheck.clone()));
            precheck
        }
        None => store,
    })
}

impl App {
    /// Builds and starts everything `settings` asks for. Needs a Tokio runtime.
    pub fn start(settings: &Settings) -> Result<App, StartError> {
        let rules = match &settings.config {
            Some(path) => Sources::read(path)
                .and_then(|files| RuleSet::compile(files.merging_domains(settings.merge_domains)))
                .map_err(StartError::Config)?,
            None => RuleSet::default(),
        };
        for domain in rules.domains() {
            tracing::info!(domain = %domain.name, file = %domain.file.display(), rules = domain.rules.len(), "loaded domain");
        }
        let telemetry = Arc::new(if settings.exporter {
            Telemetry::install(settings.telemetry).map_err(StartError::Metrics)?
        } else {
            Telemetry::without_exporter(settings.telemetry)
        });
        let mut tasks = Vec::new();
        if let Some(stats) = &settings.ratelimit_stats {
            tasks.extend(start_ratelimit_stats(stats, telemetry.clone(), settings.connections)?);
        }
        crate::telemetry::register_domains(&rules);
        if settings.config.is_some() {
            // The startup load counts as one, as envoyproxy/ratelimit counts it.
            crate::telemetry::count_config_load(true);
        }
        let store = store(settings.redis.as_ref(), &mut tasks).map_err(StartError::Redis)?;
        tracing::info!(store = %store.describe(), shadow_mode = settings.modes.shadow, quota_mode = settings.modes.quota, "store configured");
        // Says at once, and on every change, whether the store answers and why not.
        tasks.push(health::watch(store.clone()));
        let quotas: Arc<dyn QuotaSource> = match &settings.quotas {
            Some(q) => {
                let db = PostgresQuotas::connect(&q.url, QUOTA_DB_CONNECTIONS, q.ca.as_deref())
                    .map_err(StartError::Quotas)?;
                tracing::info!(quota_store = %db.describe(), ttl = ?q.cache_ttl, size = q.cache_size, "tenant quotas from the database");
                // A decision never waits on the database longer than on Redis.
                let deadline = settings.redis.as_ref().map_or(Duration::from_millis(50), |r| r.timeout);
                Arc::new(CachedQuotas::new(db, q.cache_size, q.cache_ttl, deadline))
            }
            None => Arc::new(EmbeddedQuotas),
        };
        let rules = Arc::new(ArcSwap::from_pointee(rules));
        if settings.exporter {
            // Series of domains and rules a reload or push dropped are forgotten (series.rs).
            tasks.push(telemetry.keep_series(rules.clone()));
        }
        let mut limiter = Limiter::new(rules.clone(), store, quotas, telemetry.clone(), settings.modes);
        let mut money_leases = None;
        let mut global_leases = None;
        if let Some(global) = &settings.global {
            let endpoints = global
                .urls
                .iter()
                .map(|url| crate::edge::region::client::endpoint(url, &global.tls))
                .collect::<Result<Vec<_>, _>>()
                .map_err(StartError::Global)?;
            let leaseholder = format!("{}/{}", global.region, server::replica_name());
            let shares = Arc::new(GlobalShares::new(leaseholder, global.first_lease_wait));
            tracing::info!(global_tier = ?global.urls, leaseholder = %shares.leaseholder(), "deciding global limits on shares of the global tier's buckets");
            let clock: Arc<dyn crate::clock::Clock> = Arc::new(crate::clock::SystemClock);
            tasks.push(AbortOnDropHandle::new(tokio::spawn(crate::edge::region::client::renew_forever(
                shares.clone(),
                endpoints.clone(),
                clock.clone(),
            ))));
            let budgets =
                Arc::new(GlobalBudgets::new(shares.leaseholder().to_owned(), global.first_lease_wait));
            limiter = limiter.with_global_shares(shares).with_global_budgets(budgets.clone());
            // RLQS streams' leases of global buckets, each stream a leaseholder beneath the region.
            global_leases = Some(Arc::new(GlobalLeases::new(global.region.clone(), endpoints.clone())));
            money_leases = Some((budgets, endpoints, clock));
        }
        let limiter = Arc::new(limiter);
        // Global budgets' money leases are read and sized through the limiter.
        if let Some((budgets, endpoints, clock)) = &money_leases {
            tasks.push(AbortOnDropHandle::new(tokio::spawn(
                crate::edge::region::client::renew_budgets_forever(
                    limiter.clone(),
                    budgets.clone(),
                    endpoints.clone(),
                    clock.clone(),
                ),
            )));
        }
        let tls = match &settings.tls {
            Some(files) => {
                let tls = ReloadingTls::load(files.clone()).map_err(StartError::Tls)?;
                tracing::info!(mutual = files.client_ca.is_some(), "gRPC over TLS");
                Some(tls)
            }
            None => None,
        };
        let awaits_push = settings.xds.is_some() && !settings.ready_without_config;
        let reloader = Arc::new(
            Reloader::new(
                settings.config.as_deref(),
                rules.clone(),
                settings.allow_domain_removal,
                awaits_push,
            )
            .merging_domains(settings.merge_domains)
            .forgetting_series_after(settings.telemetry.series_idle),
        );
        let config_loaded = reloader.loaded();
        if let Some(xds) = &settings.xds {
            tracing::info!(server = %xds.server, node = %xds.node_id, ready_without_config = settings.ready_without_config, "rate-limit configs from xDS");
            tasks.push(crate::edge::xds::start(xds.clone(), reloader.clone()).map_err(StartError::Xds)?);
        }
        let mut watches = Vec::new();
        if settings.watch {
            let config = reloader.watch();
            watches.extend(config.map_err(|source| StartError::Watch { what: "the config", source })?);
            if let Some(tls) = &tls {
                watches
                    .push(tls.watch().map_err(|source| StartError::Watch { what: "the TLS files", source })?);
            }
        }
        Ok(App {
            rules,
            limiter,
            telemetry,
            tls,
            max_inflight: settings.max_inflight,
            rls_fast_path: settings.rls_fast_path,
            answer_extras: settings.answer_extras.clone(),
            rlqs: settings.rlqs,
            connections: settings.connections,
            http_unauthenticated: settings.http_unauthenticated,
            global_tier: settings.global_tier.clone(),
            global_leases,
            money_leases: money_leases.map(|(budgets, endpoints, _)| (budgets, endpoints)),
            config_loaded,
            _watches: watches,
            _tasks: tasks,
        })
    }

    /// What the edges serve.
    pub fn service(&self) -> Service {
        Service {
            rules: self.rules.clone(),
            limiter: self.limiter.clone(),
            telemetry: self.telemetry.clone(),
            max_inflight: self.max_inflight,
            rls_fast_path: self.rls_fast_path,
            answer_extras: self.answer_extras.clone(),
            rlqs: self.rlqs,
            connections: self.connections,
            http_unauthenticated: self.http_unauthenticated,
            global_tier: self.global_tier.clone(),
            global_leases: self.global_leases.clone(),
            config_loaded: self.config_loaded.clone(),
        }
    }

    /// Serves on `grpc` and `http` (with the app's TLS on gRPC), and the probes on `probe` if
    /// given, until `shutdown`, then drains. The app, and every task it owns, stops when this
    /// returns.
    pub async fn serve(
        self,
        grpc: tokio::net::TcpListener,
        http: tokio::net::TcpListener,
        probe: Option<tokio::net::TcpListener>,
        shutdown: impl Future<Output = Shutdown>,
    ) -> Result<(), ServeError> {
        let listeners = Listeners { grpc, tls: self.tls.clone(), http, probe };
        let served = server::run(listeners, self.service(), shutdown).await;
        if let Some((budgets, endpoints)) = &self.money_leases {
            let clock = crate::clock::SystemClock;
            crate::edge::region::client::hand_back_budgets(&self.limiter, budgets, endpoints, &clock).await;
        }
        served
    }
}

// Installs envoyproxy/ratelimit's metrics, and starts their flushing and, when asked, the port
// that serves them mapped for Prometheus (with tollgate's own series after them).
// The port has the HTTP port's connection cap and timeouts.
fn start_ratelimit_stats(
    settings: &RatelimitStatsSettings,
    telemetry: Arc<Telemetry>,
    connections: ConnLimits,
) -> Result<Vec<AbortOnDropHandle<()>>, StartError> {
    let stats = ratelimit_stats::install(settings.stats.clone()).map_err(StartError::RatelimitStats)?;
    let mut tasks = Vec::new();
    let every = settings.flush_interval.max(Duration::from_millis(10));
    tasks.push(AbortOnDropHandle::new(tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        loop {
            ticks.tick().await;
            stats.flush();
        }
    })));
    if let Some((addr, path)) = &settings.prometheus {
        let listener = std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(tokio::net::TcpListener::from_std)
            .map_err(|e| StartError::RatelimitStats(format!("PROMETHEUS_ADDR {addr}: {e}")))?;
        tracing::info!(%addr, %path, "envoyproxy/ratelimit's metrics for Prometheus");
        let router = axum::Router::new().route(
            path,
            axum::routing::get(move || {
                let telemetry = telemetry.clone();
                async move { format!("{}{}", stats.render(), telemetry.render()) }
            }),
        );
        let gate = crate::connections::gate("prometheus", &connections);
        // Stops when the app drops the task.
        let serving =
            crate::connections::serve_http(listener, router, gate, connections, std::future::pending());
        tasks.push(AbortOnDropHandle::new(tokio::spawn(serving)));
    }
    Ok(tasks)
}
