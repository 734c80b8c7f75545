//! The `tollgate` command: `serve`, `validate`, `ask`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};
use arc_swap::ArcSwap;
use clap::{Args, Parser, Subcommand};

use tollgate::bucket::BucketSpec;
use tollgate::client;
use tollgate::clock::MonotonicClock;
use tollgate::config::RuleSet;
use tollgate::limiter::Limiter;
use tollgate::quota::cache::CachedQuotas;
use tollgate::quota::postgres::{Listing, PostgresQuotas};
use tollgate::quota::{EmbeddedQuotas, QuotaSource};
use tollgate::reload::Reloader;
use tollgate::render::{IstioTarget, JwtPayload, Protocol, RenderOptions};
use tollgate::server::{self, Listen, Service, Shutdown};
use tollgate::store::{MemoryStore, Precheck, RedisStore, RedisTarget, RedisTls, Store};
use tollgate::telemetry::{Telemetry, TelemetryConfig};
use tollgate::tls::{ReloadingTls, TlsFiles};

// glibc malloc took about a fifth of the CPU of a decision under load (arena locks, consolidation
// of the many short-lived buffers of HTTP/2 and the Redis client); mimalloc's per-thread free
// lists remove most of it. See bench/RESULTS.md.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Connections to the quota database per process; lookups are rare (one per tenant per TTL).
const QUOTA_DB_CONNECTIONS: usize = 8;

#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "Rate-limit service for Envoy and Istio: per-tenant token buckets in Redis Cluster"
)]
struct Cli {
    /// Log format: text or json.
    #[arg(long, global = true, env = "TOLLGATE_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve Envoy's RateLimitService (gRPC) and the HTTP side endpoints.
    Serve(Box<ServeArgs>),
    /// Load and check a config exactly as `serve` would, and summarise it.
    Validate {
        /// A YAML file, or a directory of *.yaml / *.yml files (one domain per file).
        path: PathBuf,
    },
    /// Ask a running server about descriptors and print its answer.
    Ask(AskArgs),
    /// Manage tenant tiers and quota overrides in the quota database.
    Quota(QuotaArgs),
    /// Print the Envoy or Istio configuration that sends the descriptors a config expects.
    Render(RenderArgs),
}

#[derive(Args)]
struct RenderArgs {
    #[command(subcommand)]
    target: RenderTarget,
}

#[derive(Args)]
struct RenderCommon {
    /// A YAML file, or a directory of *.yaml / *.yml files, with `source:` on its descriptors.
    #[arg(long)]
    config: PathBuf,
    /// The domain to render (required when the config has several).
    #[arg(long)]
    domain: Option<String>,
    /// Envoy's deadline for tollgate; keep it above tollgate's --redis-timeout.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Answer 500 instead of letting requests through when tollgate cannot be reached.
    #[arg(long)]
    failure_mode_deny: bool,
}

/// The Envoy filter `render envoy` configures.
#[derive(Clone, Copy, clap::ValueEnum)]
enum ProtocolArg {
    /// envoy.filters.http.ratelimit: every request asks tollgate.
    Rls,
    /// envoy.filters.http.rate_limit_quota: Envoy enforces what tollgate leases.
    Rlqs,
}

#[derive(Subcommand)]
enum RenderTarget {
    /// The ratelimit filter, the tollgate cluster, and the rate_limits for the virtual host and routes.
    Envoy {
        #[command(flatten)]
        common: RenderCommon,
        /// tollgate's gRPC address as Envoy reaches it.
        #[arg(long, default_value = "tollgate:8081")]
        tollgate_address: String,
        /// jwt_authn's payload_in_metadata key.
        #[arg(long, default_value = "jwt_payload")]
        jwt_payload_key: String,
        /// The filter to configure.
        #[arg(long, value_enum, default_value = "rls")]
        protocol: ProtocolArg,
    },
    /// An EnvoyFilter for the ingress gateway (--gateway) or the sidecars of one app (--sidecar).
    Istio {
        #[command(flatten)]
        common: RenderCommon,
        /// Configure the ingress gateway (istio: ingressgateway in istio-system).
        #[arg(long, conflicts_with = "sidecar", required_unless_present = "sidecar")]
        gateway: bool,
        /// Configure the sidecars of pods labelled app=APP.
        #[arg(long, value_name = "APP")]
        sidecar: Option<String>,
        /// The namespace of those pods.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// The issuer of the RequestAuthentication that verifies the JWT (the metadata key of its payload).
        #[arg(long)]
        jwt_issuer: String,
        /// tollgate's Service host.
        #[arg(long, default_value = "tollgate.tollgate.svc.cluster.local")]
        tollgate_service: String,
        /// tollgate's gRPC Service port.
        #[arg(long, default_value_t = 8081)]
        tollgate_port: u16,
    },
}

#[derive(Args)]
struct ServeArgs {
    /// A YAML file, or a directory of *.yaml / *.yml files (one domain per file).
    #[arg(long, env = "TOLLGATE_CONFIG")]
    config: PathBuf,
    /// Address for gRPC (RateLimitService and grpc.health.v1).
    #[arg(long, env = "TOLLGATE_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    grpc_addr: SocketAddr,
    /// Address for HTTP (/healthz, /readyz, /config).
    #[arg(long, env = "TOLLGATE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Standalone Redis: redis://[user:password@]host:port[/db], or rediss:// for TLS.
    #[arg(long, env = "TOLLGATE_REDIS_URL", hide_env_values = true, conflicts_with = "redis_cluster")]
    redis_url: Option<String>,
    /// Redis Cluster seed nodes: HOST:PORT,HOST:PORT,...
    #[arg(long, env = "TOLLGATE_REDIS_CLUSTER", value_delimiter = ',', hide_env_values = true)]
    redis_cluster: Vec<String>,
    /// CA certificates (PEM) that signed the Redis servers' TLS certificates (rediss://).
    #[arg(long, env = "TOLLGATE_REDIS_CA")]
    redis_ca: Option<PathBuf>,
    /// Client certificate (PEM) for Redis servers that require TLS client authentication.
    #[arg(long, env = "TOLLGATE_REDIS_CLIENT_CERT", requires = "redis_client_key")]
    redis_client_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "TOLLGATE_REDIS_CLIENT_KEY", requires = "redis_client_cert")]
    redis_client_key: Option<PathBuf>,
    /// Deadline for each Redis call; past it the domain's failure mode answers.
    #[arg(long, env = "TOLLGATE_REDIS_TIMEOUT", default_value = "50ms", value_parser = humantime::parse_duration)]
    redis_timeout: Duration,
    /// Hot-tenant coalescing: concurrent Redis calls for one slot become one script call, a queued
    /// request waiting about this long at most for the call before it. 0 turns it off.
    #[arg(long, env = "TOLLGATE_COALESCE_DELAY", default_value = "500us", value_parser = humantime::parse_duration)]
    coalesce_delay: Duration,
    /// Turn off the exact local pre-check (answering certain denials without Redis). Needed when
    /// clients send credits (is_negative_hits) through several replicas.
    #[arg(long, env = "TOLLGATE_NO_PRECHECK")]
    no_precheck: bool,
    /// Most buckets the pre-check remembers.
    #[arg(long, env = "TOLLGATE_PRECHECK_BUCKETS", default_value_t = 100_000)]
    precheck_buckets: usize,
    /// Most decisions in progress at once; beyond it requests are refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "TOLLGATE_MAX_INFLIGHT", default_value_t = 10_000)]
    max_inflight: usize,
    /// Serve gRPC over TLS with this certificate chain (PEM); reloaded when the file changes.
    #[arg(long, env = "TOLLGATE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "TOLLGATE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM): mutual TLS.
    #[arg(long, env = "TOLLGATE_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Evaluate and count every limit, but never answer OVER_LIMIT.
    #[arg(long, env = "TOLLGATE_SHADOW_MODE")]
    shadow_mode: bool,
    /// Add envoyproxy/ratelimit's dynamic metadata to every answer: domain, descriptors and the
    /// `metadata:` of the rules that passed.
    #[arg(long, env = "TOLLGATE_RESPONSE_DYNAMIC_METADATA")]
    response_dynamic_metadata: bool,
    /// On SIGTERM, how long to stay up unready before draining (lets load balancers notice).
    #[arg(long, env = "TOLLGATE_DRAIN_DELAY", default_value = "5s", value_parser = humantime::parse_duration)]
    drain_delay: Duration,
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
}

#[derive(Args)]
struct QuotaArgs {
    /// The quota database: postgres://user:password@host:port/db.
    #[arg(long, env = "TOLLGATE_QUOTA_STORE", hide_env_values = true, global = true)]
    quota_store: Option<String>,
    /// Extra CA certificates (PEM) to verify the quota database's TLS certificate.
    #[arg(long, env = "TOLLGATE_QUOTA_STORE_CA", global = true)]
    quota_store_ca: Option<PathBuf>,
    #[command(subcommand)]
    action: QuotaAction,
}

#[derive(Subcommand)]
enum QuotaAction {
    /// Create the quota tables if they do not exist.
    Migrate,
    /// Set a tenant's tier (--tier) and/or its bucket for one class (--class, --capacity, --refill-per-second).
    Set {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        tier: Option<String>,
        #[arg(long, requires_all = ["capacity", "refill_per_second"])]
        class: Option<String>,
        #[arg(long, requires = "class", allow_negative_numbers = true)]
        capacity: Option<f64>,
        #[arg(long, requires = "class", allow_negative_numbers = true)]
        refill_per_second: Option<f64>,
        /// The override lapses after this long (e.g. 30d).
        #[arg(long, requires = "class", value_parser = humantime::parse_duration)]
        expires_in: Option<Duration>,
    },
    /// Show a tenant's tier and overrides.
    Get {
        #[arg(long)]
        tenant: String,
    },
    /// Show every tenant with a tier or an override.
    List,
    /// Delete a tenant's override for --class, or without --class the tenant and all its overrides.
    Delete {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        class: Option<String>,
    },
}

#[derive(Args)]
struct AskArgs {
    /// The server's gRPC address.
    #[arg(long, default_value = "127.0.0.1:8081")]
    addr: String,
    /// The rate-limit domain.
    #[arg(long)]
    domain: String,
    /// One descriptor as key=value,key=value; repeat for several.
    #[arg(long = "descriptor", required = true, value_parser = client::parse_descriptor)]
    descriptors: Vec<Vec<(String, String)>>,
    /// hits_addend of the request (tokens per descriptor, times the rule's cost).
    #[arg(long, default_value_t = 1)]
    hits: u32,
    /// Use TLS, trusting this CA (PEM).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), for servers that require mTLS.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// Client key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tollgate::telemetry::logs::init(cli.log_format == "json");
    let result = match cli.command {
        Command::Serve(args) => serve(*args),
        Command::Validate { path } => validate(&path),
        Command::Ask(args) => ask(args),
        Command::Quota(args) => quota(args),
        Command::Render(args) => render(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

fn serve(args: ServeArgs) -> Result<()> {
    let rules = RuleSet::load(&args.config).context("loading the config")?;
    for domain in rules.domains() {
        tracing::info!(domain = %domain.name, file = %domain.file.display(), rules = domain.rules.len(), "loaded domain");
    }
    runtime()?.block_on(async move {
        let telemetry = Telemetry::install(TelemetryConfig {
            top_denied: args.top_denied_tenants,
            top_denied_window: args.top_denied_window,
            detailed_series: args.detailed_metric_series,
        })
        .context("installing the metrics recorder")?;
        let redis_tls = RedisTls {
            ca: args.redis_ca.clone(),
            client: args.redis_client_cert.clone().zip(args.redis_client_key.clone()),
        };
        let redis_target = match (&args.redis_url, args.redis_cluster.is_empty()) {
            (Some(url), _) => Some(RedisTarget::Standalone(url.clone())),
            (None, false) => Some(RedisTarget::Cluster(args.redis_cluster.clone())),
            (None, true) => None,
        };
        let store: Arc<dyn Store> = match redis_target {
            Some(target) => {
                let redis = RedisStore::connect(&target, args.redis_timeout, args.coalesce_delay, &redis_tls)?;
                if args.no_precheck {
                    Arc::new(redis)
                } else {
                    Arc::new(Precheck::new(Arc::new(redis), Arc::new(MonotonicClock::new()), args.precheck_buckets))
                }
            }
            None => {
                tracing::warn!(
                    "no --redis-url or --redis-cluster: using the embedded memory store. Limits hold \
                     PER PROCESS ONLY; every replica enforces the full limit on its own"
                );
                Arc::new(MemoryStore::new())
            }
        };
        tracing::info!(store = %store.describe(), shadow_mode = args.shadow_mode, "store configured");
        let quotas: Arc<dyn QuotaSource> = match &args.quota_store {
            Some(url) => {
                let db = PostgresQuotas::connect(url, QUOTA_DB_CONNECTIONS, args.quota_store_ca.as_deref())
                    .context("--quota-store")?;
                tracing::info!(quota_store = %db.describe(), ttl = ?args.quota_cache_ttl, size = args.quota_cache_size, "tenant quotas from the database");
                // A decision never waits on the database longer than on Redis.
                Arc::new(CachedQuotas::new(db, args.quota_cache_size, args.quota_cache_ttl, args.redis_timeout))
            }
            None => Arc::new(EmbeddedQuotas),
        };
        let rules = Arc::new(ArcSwap::from_pointee(rules));
        let _reloader = Reloader::new(&args.config, rules.clone()).spawn().context("watching the config")?;
        let telemetry = Arc::new(telemetry);
        let limiter = Arc::new(Limiter::new(rules.clone(), store, quotas, telemetry.clone(), args.shadow_mode));
        let tls = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => {
                let files = TlsFiles { cert: cert.clone(), key: key.clone(), client_ca: args.tls_client_ca.clone() };
                let tls = ReloadingTls::load(files).context("loading the gRPC TLS files")?;
                tracing::info!(mutual = args.tls_client_ca.is_some(), "gRPC over TLS");
                Some(tls)
            }
            _ => None,
        };
        let _tls_watch = tls.as_ref().map(|t| t.watch()).transpose().context("watching the TLS files")?;
        let service = Service {
            rules,
            limiter,
            telemetry,
            max_inflight: args.max_inflight,
            dynamic_metadata: args.response_dynamic_metadata,
        };
        let listen = Listen { grpc: args.grpc_addr, tls, http: args.http_addr };
        server::run(listen, service, shutdown_signal(args.drain_delay)).await?;
        Ok(())
    })
}

// SIGTERM (an orchestrator) drains after the delay; SIGINT (a person at a terminal) at once.
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
        _ = term.recv() => Shutdown::Drain(drain_delay),
        _ = tokio::signal::ctrl_c() => Shutdown::Immediate,
    }
}

fn validate(path: &Path) -> Result<()> {
    let rules = RuleSet::load(path)?;
    let mut any = false;
    for domain in rules.domains() {
        any = true;
        println!("domain {}: {} rules ({})", domain.name, domain.rules.len(), domain.file.display());
    }
    if !any {
        bail!("{}: no domains", path.display());
    }
    println!("ok");
    Ok(())
}

fn ask(args: AskArgs) -> Result<()> {
    let request = client::request(&args.domain, &args.descriptors, args.hits);
    let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let tls = match &args.tls_ca {
        Some(ca) => Some(client::ClientTls {
            ca_pem: read(ca)?,
            identity_pem: match (&args.tls_cert, &args.tls_key) {
                (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
                _ => None,
            },
            domain: None,
        }),
        None => None,
    };
    let response = runtime()?.block_on(client::ask_with(&args.addr, request.clone(), tls.as_ref()))?;
    print!("{}", client::render(&request, &response));
    Ok(())
}

fn quota(args: QuotaArgs) -> Result<()> {
    let url = args.quota_store.context("--quota-store (or TOLLGATE_QUOTA_STORE) is required")?;
    runtime()?.block_on(async move {
        let db = PostgresQuotas::connect(&url, 1, args.quota_store_ca.as_deref())?;
        match args.action {
            QuotaAction::Migrate => {
                db.migrate().await?;
                println!("quota tables ready in {}", db.describe());
            }
            QuotaAction::Set { tenant, tier, class, capacity, refill_per_second, expires_in } => {
                if tier.is_none() && class.is_none() {
                    bail!("nothing to set: give --tier, or --class with --capacity and --refill-per-second");
                }
                if let Some(tier) = &tier {
                    db.set_tier(&tenant, tier).await?;
                }
                if let (Some(class), Some(capacity), Some(refill)) = (&class, capacity, refill_per_second) {
                    let spec = BucketSpec::new(capacity, refill)?;
                    let expires_at = expires_in.map(|d| SystemTime::now() + d);
                    db.set_override(&tenant, class, spec, expires_at).await?;
                }
                print_listings(&db.list(Some(&tenant)).await?);
            }
            QuotaAction::Get { tenant } => {
                let listings = db.list(Some(&tenant)).await?;
                if listings.is_empty() {
                    println!("tenant {tenant}: no rows (it gets its domain's default tier)");
                }
                print_listings(&listings);
            }
            QuotaAction::List => print_listings(&db.list(None).await?),
            QuotaAction::Delete { tenant, class } => {
                let deleted = db.delete(&tenant, class.as_deref()).await?;
                println!("deleted {deleted} row(s)");
            }
        }
        Ok(())
    })
}

fn print_listings(listings: &[Listing]) {
    for l in listings {
        println!("tenant {}: tier {}", l.tenant, l.tier.as_deref().unwrap_or("(default tier)"));
        for o in &l.overrides {
            let expiry = o
                .expires_at
                .map(|at| format!(" until {}", humantime::format_rfc3339_seconds(at)))
                .unwrap_or_default();
            println!("  {}: capacity {}, refill {}/s{expiry}", o.class, o.capacity, o.refill_per_second);
        }
    }
}

fn render(args: RenderArgs) -> Result<()> {
    let (common, rendered) = match &args.target {
        RenderTarget::Envoy { common, tollgate_address, jwt_payload_key, protocol } => {
            let rules = RuleSet::load(&common.config)?;
            let mut options = render_options(common, JwtPayload::MetadataKey(jwt_payload_key.clone()));
            options.protocol = match protocol {
                ProtocolArg::Rls => Protocol::Rls,
                ProtocolArg::Rlqs => Protocol::Rlqs,
            };
            (common, tollgate::render::envoy(&rules, &options, tollgate_address)?)
        }
        RenderTarget::Istio {
            common,
            gateway: _,
            sidecar,
            namespace,
            jwt_issuer,
            tollgate_service,
            tollgate_port,
        } => {
            let rules = RuleSet::load(&common.config)?;
            let options = render_options(common, JwtPayload::Issuer(jwt_issuer.clone()));
            let target = match sidecar {
                Some(app) => IstioTarget::Sidecar { app: app.clone(), namespace: namespace.clone() },
                None => IstioTarget::Gateway,
            };
            (common, tollgate::render::istio(&rules, &options, &target, tollgate_service, *tollgate_port)?)
        }
    };
    println!(
        "# Generated by `tollgate render` from {}; regenerate it when the config changes.",
        common.config.display()
    );
    print!("{}", serde_saphyr::to_string(&rendered).context("writing YAML")?);
    Ok(())
}

fn render_options(common: &RenderCommon, jwt: JwtPayload) -> RenderOptions {
    RenderOptions {
        domain: common.domain.clone(),
        jwt,
        timeout: common.timeout,
        failure_mode_deny: common.failure_mode_deny,
        protocol: Protocol::Rls,
    }
}
