//! `tollgate serve`: the service. Flags (each with a `TOLLGATE_*` environment variable) become
//! [`Settings`]; the listeners are bound before anything starts serving; SIGTERM and Ctrl-C
//! drain after `--drain-delay`, a second Ctrl-C exits at once.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use tollgate::app::{App, GlobalSettings, QuotaSettings, RedisSettings, Settings};
use tollgate::connections::ConnLimits;
use tollgate::edge::client_tls::ClientTlsFiles;
use tollgate::edge::region::RegionAuth;
use tollgate::edge::rlqs::RlqsLimits;
use tollgate::edge::rls::headers::LimitHeaderNames;
use tollgate::edge::rls::AnswerExtras;
use tollgate::limiter::ServiceModes;
use tollgate::server::{self, Shutdown};
use tollgate::telemetry::traces::Traces;
use tollgate::telemetry::TelemetryConfig;
use tollgate::tls::TlsFiles;

use super::redis_args::RedisArgs;
use super::xds_args::{pair, StatsArgs, XdsArgs};
use super::{runtime_with, Outcome};

#[derive(Args)]
pub(super) struct ServeArgs {
    /// A YAML file, or a directory of *.yaml / *.yml files (one domain per file). Not needed with
    /// --xds-server.
    #[arg(long, env = "TOLLGATE_CONFIG", required_unless_present = "xds_server")]
    config: Option<PathBuf>,
    #[command(flatten)]
    xds: XdsArgs,
    #[command(flatten)]
    stats: StatsArgs,
    /// Address for gRPC (RateLimitService, RateLimitQuotaService and grpc.health.v1).
    #[arg(long, env = "TOLLGATE_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    grpc_addr: SocketAddr,
    /// Address for HTTP (/healthz, /readyz, /config, /metrics, POST /json).
    #[arg(long, env = "TOLLGATE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Also serve /healthz and /readyz alone on this address, for kubelet's probes: a port that
    /// no flood of the HTTP port's clients reaches (the shipped manifests probe it).
    #[arg(long, env = "TOLLGATE_PROBE_ADDR")]
    probe_addr: Option<SocketAddr>,
    #[command(flatten)]
    redis: RedisArgs,
    /// Export traces over OTLP/gRPC to this collector (e.g. http://127.0.0.1:4317). Off if unset.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// Deadline for each Redis call; past it the domain's failure mode answers.
    #[arg(long, env = "TOLLGATE_REDIS_TIMEOUT", default_value = "50ms", value_parser = humantime::parse_duration)]
    redis_timeout: Duration,
    /// Hot-tenant coalescing: concurrent Redis calls for one slot become one script call, a queued
    /// request waiting about this long at most for the call before it. 0 turns it off.
    #[arg(long, env = "TOLLGATE_COALESCE_DELAY", default_value = "500us", value_parser = humantime::parse_duration)]
    coalesce_delay: Duration,
    /// Turn off the exact local pre-check (answering certain denials without Redis; it hears
    /// raises made through other replicas on the channel `tollgate:raised`).
    #[arg(long, env = "TOLLGATE_NO_PRECHECK")]
    no_precheck: bool,
    /// Most buckets the pre-check remembers.
    #[arg(long, env = "TOLLGATE_PRECHECK_BUCKETS", default_value_t = 100_000)]
    precheck_buckets: usize,
    /// An RLQS bucket with no usage in any report for this long is abandoned: its Envoys are told
    /// to drop it, and tollgate drops its state (a request for it later starts it afresh).
    #[arg(long, env = "TOLLGATE_RLQS_ABANDON_AFTER", default_value = "5m", value_parser = humantime::parse_duration)]
    rlqs_abandon_after: Duration,
    /// Most distinct bucket ids one RLQS stream may have tracked; ids beyond it get no
    /// assignment (Envoy applies its no_assignment_behavior) and are counted.
    #[arg(long, env = "TOLLGATE_RLQS_MAX_BUCKETS_PER_STREAM", default_value_t = RlqsLimits::default().max_buckets_per_stream)]
    rlqs_max_buckets_per_stream: usize,
    /// Most bucket ids this replica tracks over all its RLQS streams (about 3 KB each).
    #[arg(long, env = "TOLLGATE_RLQS_MAX_BUCKETS", default_value_t = RlqsLimits::default().max_buckets)]
    rlqs_max_buckets: usize,
    /// Most RLQS streams open on this replica; new ones beyond it are refused with
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "TOLLGATE_RLQS_MAX_STREAMS", default_value_t = RlqsLimits::default().max_streams)]
    rlqs_max_streams: usize,
    /// Most connections open on each port (gRPC and HTTP, each its own); one more is closed at
    /// once. Default: half of what the open-files limit leaves after 128 for Redis, PostgreSQL
    /// and files, at most 10,000 (tollgate raises its soft limit to the hard one at start).
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Most connections one source address may have open on each port (default: a quarter of
    /// --max-connections), so that no one peer takes a port. Behind a NAT or an L4 load balancer
    /// that hides the peers' addresses, raise it.
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS_PER_SOURCE")]
    max_connections_per_source: Option<usize>,
    /// How long an HTTP client has to send a request's head, however slowly.
    #[arg(long, env = "TOLLGATE_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    http_header_timeout: Duration,
    /// An HTTP connection that moves no byte for this long is closed.
    #[arg(long, env = "TOLLGATE_HTTP_IDLE_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    http_idle_timeout: Duration,
    /// A gRPC connection that moves no byte for this long is closed.
    #[arg(long, env = "TOLLGATE_GRPC_IDLE_TIMEOUT", default_value = "10m", value_parser = humantime::parse_duration)]
    grpc_idle_timeout: Duration,
    /// How long a gRPC connection lives before the server asks it to go away (GOAWAY).
    #[arg(long, env = "TOLLGATE_GRPC_MAX_CONNECTION_AGE", default_value = "24h", value_parser = humantime::parse_duration)]
    grpc_max_connection_age: Duration,
    /// How long a gRPC connection asked to go away has to finish its requests.
    #[arg(long, env = "TOLLGATE_GRPC_MAX_CONNECTION_AGE_GRACE", default_value = "1h", value_parser = humantime::parse_duration)]
    grpc_max_connection_age_grace: Duration,
    /// Most decisions in progress at once; beyond it requests are refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "TOLLGATE_MAX_INFLIGHT", default_value_t = 10_000)]
    max_inflight: usize,
    /// Answer ShouldRateLimit on the fast path (false: through tonic's generic gRPC stack, the
    /// same answers at a higher CPU cost; for comparison).
    #[arg(long, env = "TOLLGATE_RLS_FAST_PATH", default_value_t = true, action = clap::ArgAction::Set)]
    rls_fast_path: bool,
    /// Threads deciding requests (the async runtime's workers); default: half the cores the
    /// process may use, rounded up.
    #[arg(long, env = "TOLLGATE_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    worker_threads: Option<u16>,
    /// Serve gRPC over TLS with this certificate chain (PEM); reloaded when the file changes.
    #[arg(long, env = "TOLLGATE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "TOLLGATE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM): mutual TLS. Then `POST /json` and
    /// `GET /config` are served on the gRPC port (over the same mutual TLS), and refused (403) on
    /// the plaintext HTTP port.
    #[arg(long, env = "TOLLGATE_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// With --tls-client-ca: the name (DNS or IP) every client certificate must be valid for.
    #[arg(long, env = "TOLLGATE_TLS_CLIENT_SAN", requires = "tls_client_ca")]
    tls_client_san: Option<String>,
    /// With --tls-client-ca, still serve `POST /json` and `GET /config` on the plaintext HTTP
    /// port, to anyone who reaches it.
    #[arg(long, env = "TOLLGATE_HTTP_UNAUTHENTICATED")]
    http_unauthenticated: bool,
    /// Be the global tier of the limits marked `global: true`: serve
    /// `tollgate.region.v1.RegionLeases` on the gRPC port, where regions lease their buckets.
    /// Serve it to the regional tiers only (mutual TLS).
    #[arg(long, env = "TOLLGATE_GLOBAL_TIER")]
    global_tier: bool,
    /// With --global-tier: the regions allowed, each bound to the name (a DNS or IP subject
    /// alternative name) its client certificate must be valid for: REGION=NAME,... A caller
    /// renews only as the region its certificate names. Needs mutual TLS (--tls-client-ca).
    #[arg(long, env = "TOLLGATE_GLOBAL_REGION_SAN", value_delimiter = ',', value_parser = pair, requires = "global_tier")]
    global_region_san: Vec<(String, String)>,
    /// With --global-tier: serve RegionLeases to any caller, without mutual TLS or region names
    /// (a trial on one machine; anyone who reaches the port can take every global bucket).
    #[arg(long, env = "TOLLGATE_GLOBAL_TIER_INSECURE", requires = "global_tier")]
    global_tier_insecure: bool,
    /// Be a region of the limits marked `global: true`: decide them on shares leased from the
    /// global tier at these gRPC addresses (http://host:port, or https://; comma-separated: the
    /// next after a failed round). Needs --region.
    #[arg(long, env = "TOLLGATE_GLOBAL_URL", requires = "region", value_delimiter = ',')]
    global_url: Vec<String>,
    /// This region's name (no whitespace), with --global-url.
    #[arg(long, env = "TOLLGATE_REGION", requires = "global_url")]
    region: Option<String>,
    /// With --global-url: how long a request for a global bucket without a share here waits for
    /// its first lease before it is denied. Keep it under Envoy's RLS timeout (0.1 s in the
    /// configs tollgate ships and renders): a request Envoy gives up on passes uncounted when the
    /// filter fails open. A longer wait, under a longer Envoy timeout, answers a new bucket's
    /// first requests rather than denying them.
    #[arg(long, env = "TOLLGATE_GLOBAL_FIRST_LEASE_WAIT", default_value = "80ms", value_parser = humantime::parse_duration, requires = "global_url")]
    global_first_lease_wait: Duration,
    /// CA certificates (PEM) that signed an https:// global tier's certificate (default: the
    /// web's roots).
    #[arg(long, env = "TOLLGATE_GLOBAL_TLS_CA", requires = "global_url")]
    global_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for a global tier that requires mutual TLS (--tls-client-ca).
    #[arg(long, env = "TOLLGATE_GLOBAL_TLS_CERT", requires_all = ["global_url", "global_tls_key"])]
    global_tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "TOLLGATE_GLOBAL_TLS_KEY", requires = "global_tls_cert")]
    global_tls_key: Option<PathBuf>,
    /// The name the global tier's certificate must carry, if not its host's.
    #[arg(long, env = "TOLLGATE_GLOBAL_TLS_SERVER_NAME", requires = "global_url")]
    global_tls_server_name: Option<String>,
    /// Evaluate and count every limit, but never answer OVER_LIMIT.
    #[arg(long, env = "TOLLGATE_SHADOW_MODE")]
    shadow_mode: bool,
    /// Treat every limit as `quota_mode: true`: a request is denied only when all its limits
    /// are short (envoyproxy/ratelimit's `QUOTA_MODE`).
    #[arg(long, env = "TOLLGATE_QUOTA_MODE")]
    quota_mode: bool,
    /// Add envoyproxy/ratelimit's dynamic metadata to every answer: domain, descriptors and the
    /// `metadata:` of the rules that passed.
    #[arg(long, env = "TOLLGATE_RESPONSE_DYNAMIC_METADATA")]
    response_dynamic_metadata: bool,
    /// Add the limit, remaining and reset of the most constrained limit to every answer under
    /// these three header names, as envoyproxy/ratelimit's `LIMIT_RESPONSE_HEADERS_ENABLED` does
    /// (e.g. RateLimit-Limit,RateLimit-Remaining,RateLimit-Reset).
    #[arg(long, env = "TOLLGATE_LIMIT_HEADERS", value_delimiter = ',', num_args = 3)]
    limit_headers: Vec<String>,
    /// On SIGTERM or Ctrl-C, how long to stay up unready before draining (lets load balancers
    /// notice); a second Ctrl-C exits at once.
    #[arg(long, env = "TOLLGATE_DRAIN_DELAY", default_value = "5s", value_parser = humantime::parse_duration)]
    drain_delay: Duration,
    /// Drop a domain whose config file is gone on the reload that finds it gone. Without it the
    /// domain stays served from the last good config, named in a warning at each reload, until
    /// SIGHUP confirms the removal: a ConfigMap target briefly missing never means no limit.
    #[arg(long, env = "TOLLGATE_ALLOW_DOMAIN_REMOVAL")]
    allow_domain_removal: bool,
    /// Read config files (and pushed resources) naming one domain as one domain, their
    /// descriptors together, instead of refusing the second (envoyproxy/ratelimit's
    /// MERGE_DOMAIN_CONFIG). The domain's other settings are said in its first file only.
    #[arg(long, env = "TOLLGATE_MERGE_DOMAIN_CONFIG")]
    merge_domain_config: bool,
    /// Tenant quotas from PostgreSQL: postgres://user:password@host:port/db (see `tollgate quota`).
    #[arg(long, env = "TOLLGATE_QUOTA_STORE", hide_env_values = true)]
    quota_store: Option<String>,
    /// Extra CA certificates (PEM) to verify the quota database's TLS certificate.
    #[arg(long, env = "TOLLGATE_QUOTA_STORE_CA")]
    quota_store_ca: Option<PathBuf>,
    /// How long a tenant's quota is served from the cache before it is read again.
    #[arg(long, env = "TOLLGATE_QUOTA_CACHE_TTL", default_value = "45s", value_parser = humantime::parse_duration)]
    quota_cache_ttl: Duration,
    /// Most tenants held in the quota cache.
    #[arg(long, env = "TOLLGATE_QUOTA_CACHE_SIZE", default_value_t = 100_000)]
    quota_cache_size: u64,
    /// How many of the most-denied tenants /metrics lists.
    #[arg(long, env = "TOLLGATE_TOP_DENIED_TENANTS", default_value_t = 10)]
    top_denied_tenants: usize,
    /// The window over which denied tenants are ranked.
    #[arg(long, env = "TOLLGATE_TOP_DENIED_WINDOW", default_value = "60s", value_parser = humantime::parse_duration)]
    top_denied_window: Duration,
    /// Most per-tenant series for rules with detailed_metric: true; later tenants count as (other).
    #[arg(long, env = "TOLLGATE_DETAILED_METRIC_SERIES", default_value_t = 10_000)]
    detailed_metric_series: usize,
    /// How long a counter or gauge of /metrics may stay untouched before it is forgotten: the
    /// series of domains and rules a reload or push dropped go after about this long (those of
    /// the config in force never do).
    #[arg(long, env = "TOLLGATE_METRICS_IDLE", default_value = "120s", value_parser = humantime::parse_duration)]
    metrics_idle: Duration,
}

impl ServeArgs {
    fn settings(&self) -> anyhow::Result<Settings> {
        let redis = self.redis.target()?.map(|target| RedisSettings {
            target,
            tls: self.redis.tls(),
            timeout: self.redis_timeout,
            coalesce_delay: self.coalesce_delay,
            precheck_buckets: (!self.no_precheck).then_some(self.precheck_buckets),
        });
        if self.global_tier && !self.global_tier_insecure {
            // A renewal takes capacity and money from every other client of a global bucket:
            // served to the regions, each by its certificate, or to anyone only when asked.
            if self.tls_client_ca.is_none() {
                anyhow::bail!("--global-tier serves RegionLeases over mutual TLS only: give --tls-cert, --tls-key and --tls-client-ca (and --global-region-san), or --global-tier-insecure for a trial");
            }
            if self.global_region_san.is_empty() {
                anyhow::bail!("--global-tier: name the regions allowed and their certificates' names with --global-region-san REGION=NAME,... (or --global-tier-insecure for a trial)");
            }
        }
        let xds = self.xds.settings();
        if xds.is_some() && self.config.is_some() && !self.xds.xds_with_files {
            anyhow::bail!("--config and --xds-server: the pushed config is the whole config; add --xds-with-files to serve the files' domains beside it");
        }
        Ok(Settings {
            config: self.config.clone(),
            xds,
            ready_without_config: self.xds.start_without_config,
            ratelimit_stats: self.stats.settings(self.detailed_metric_series)?,
            redis,
            quotas: self.quota_store.as_ref().map(|url| QuotaSettings {
                url: url.clone(),
                ca: self.quota_store_ca.clone(),
                cache_ttl: self.quota_cache_ttl,
                cache_size: self.quota_cache_size,
            }),
            tls: match (&self.tls_cert, &self.tls_key) {
                (Some(cert), Some(key)) => Some(TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: self.tls_client_ca.clone(),
                    client_san: self.tls_client_san.clone(),
                }),
                _ => None,
            },
            modes: ServiceModes { shadow: self.shadow_mode, quota: self.quota_mode },
            answer_extras: AnswerExtras {
                dynamic_metadata: self.response_dynamic_metadata,
                limit_headers: match self.limit_headers.as_slice() {
                    [] => None,
                    [limit, remaining, reset] => Some(LimitHeaderNames {
                        limit: limit.clone(),
                        remaining: remaining.clone(),
                        reset: reset.clone(),
                    }),
                    _ => anyhow::bail!("--limit-headers: three names, for the limit, remaining and reset"),
                },
            },
            max_inflight: self.max_inflight,
            rls_fast_path: self.rls_fast_path,
            connections: ConnLimits {
                max_connections: self.max_connections,
                max_per_source: self.max_connections_per_source,
                header_read_timeout: self.http_header_timeout,
                http_idle_timeout: self.http_idle_timeout,
                grpc_idle_timeout: self.grpc_idle_timeout,
                max_age: self.grpc_max_connection_age,
                max_age_grace: self.grpc_max_connection_age_grace,
            },
            rlqs: RlqsLimits {
                abandon_after: self.rlqs_abandon_after,
                max_buckets_per_stream: self.rlqs_max_buckets_per_stream,
                max_buckets: self.rlqs_max_buckets,
                max_streams: self.rlqs_max_streams,
            },
            http_unauthenticated: self.http_unauthenticated,
            global_tier: self.global_tier.then(|| RegionAuth {
                insecure: self.global_tier_insecure,
                regions: self.global_region_san.clone(),
            }),
            global: match &self.region {
                Some(region) => {
                    if region.is_empty() || region.chars().any(char::is_whitespace) || region.contains('/') {
                        anyhow::bail!("--region {region:?}: a name without whitespace or '/'");
                    }
                    Some(GlobalSettings {
                        urls: self.global_url.clone(),
                        region: region.clone(),
                        first_lease_wait: self.global_first_lease_wait,
                        tls: ClientTlsFiles {
                            ca: self.global_tls_ca.clone(),
                            client: self.global_tls_cert.clone().zip(self.global_tls_key.clone()),
                            server_name: self.global_tls_server_name.clone(),
                        },
                    })
                }
                None => None,
            },
            telemetry: TelemetryConfig {
                top_denied: self.top_denied_tenants,
                top_denied_window: self.top_denied_window,
                detailed_series: self.detailed_metric_series,
                series_idle: self.metrics_idle.max(Duration::from_secs(1)),
            },
            exporter: true,
            watch: true,
            allow_domain_removal: self.allow_domain_removal,
            merge_domains: self.merge_domain_config,
        })
    }
}

/// Serves until a signal; `json` selects JSON log lines; `ignored` names the envoyproxy/ratelimit
/// settings accepted and ignored. Logging starts here rather than in
/// `main` because the trace exporter, when configured, runs on this command's runtime.
pub(super) fn run(args: ServeArgs, json: bool, ignored: &[String]) -> Outcome {
    let settings = args.settings()?;
    let runtime = runtime_with(Some(args.worker_threads.map_or_else(default_workers, usize::from)))?;
    let traces = {
        let _inside = runtime.enter();
        args.otlp_endpoint.as_deref().map(Traces::start).transpose()?
    };
    tollgate::telemetry::logs::init(json, traces.as_ref());
    for setting in ignored {
        tracing::warn!("envoyproxy/ratelimit setting accepted and ignored: {setting}");
    }
    if let Some(endpoint) = &args.otlp_endpoint {
        tracing::info!(%endpoint, "exporting traces over OTLP/gRPC");
    }
    // Every connection is a descriptor: take what the system allows before any is made.
    let open_files = tollgate::connections::raise_fd_limit();
    tracing::debug!(open_files, "open-files limit");
    let served = runtime.block_on(async move {
        // Bound first: a port in use fails before anything connects anywhere.
        let grpc = server::bind(args.grpc_addr).await?;
        let http = server::bind(args.http_addr).await?;
        let probe = match args.probe_addr {
            Some(addr) => Some(server::bind(addr).await?),
            None => None,
        };
        let app = App::start(&settings)?;
        app.serve(grpc, http, probe, shutdown_signal(args.drain_delay)).await?;
        Ok(ExitCode::SUCCESS)
    });
    // Flushes the last spans while the runtime, which runs the exporter, is still up.
    drop(traces);
    served
}

// SIGTERM (an orchestrator) and SIGINT (Ctrl-C at a terminal) both drain after the delay, so
// that no request in flight is dropped; a second SIGINT exits at once, for a person who will not
// wait.
async fn shutdown_signal(drain_delay: Duration) -> Shutdown {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops the server");
            let _ = tokio::signal::ctrl_c().await;
            return Shutdown::Immediate;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {
            tracing::info!("Ctrl-C: draining (press Ctrl-C again to exit at once)");
            tokio::spawn(async {
                if tokio::signal::ctrl_c().await.is_ok() {
                    tracing::warn!("second Ctrl-C: exiting without draining");
                    std::process::exit(130);
                }
            });
        }
    }
    Shutdown::Drain(drain_delay)
}

// Half the cores this process may use (its cgroup's quota included), at least one. Measured on
// two cores (bench/RESULTS.md, the RLS decision path): one worker spent up to a quarter less CPU
// per decision than two (none less on a hot tenant with Redis), which hand requests, wake-ups
// and memory to each other; a fleet pays for
// CPU per decision, and a replica short of cores is scaled out. The kernel's network work
// (loopback delivery, softirq) and the runtimes of RLQS and background work use the other half.
fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().div_ceil(2))
}
