//! The `tollgate` command: `serve`, `validate`, `ask`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use arc_swap::ArcSwap;
use clap::{Args, Parser, Subcommand};

use tollgate::client;
use tollgate::config::RuleSet;
use tollgate::limiter::Limiter;
use tollgate::quota::EmbeddedQuotas;
use tollgate::server::{self, Listen, Shutdown};
use tollgate::store::{MemoryStore, RedisStore, RedisTarget, Store};

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
    Serve(ServeArgs),
    /// Load and check a config exactly as `serve` would, and summarise it.
    Validate {
        /// A YAML file, or a directory of *.yaml / *.yml files (one domain per file).
        path: PathBuf,
    },
    /// Ask a running server about descriptors and print its answer.
    Ask(AskArgs),
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
    /// Deadline for each Redis call; past it the domain's failure mode answers.
    #[arg(long, env = "TOLLGATE_REDIS_TIMEOUT", default_value = "50ms", value_parser = humantime::parse_duration)]
    redis_timeout: Duration,
    /// Evaluate and count every limit, but never answer OVER_LIMIT.
    #[arg(long, env = "TOLLGATE_SHADOW_MODE")]
    shadow_mode: bool,
    /// On SIGTERM, how long to stay up unready before draining (lets load balancers notice).
    #[arg(long, env = "TOLLGATE_DRAIN_DELAY", default_value = "5s", value_parser = humantime::parse_duration)]
    drain_delay: Duration,
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tollgate::telemetry::init(cli.log_format == "json");
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Validate { path } => validate(&path),
        Command::Ask(args) => ask(args),
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
        let store: Arc<dyn Store> = match (&args.redis_url, args.redis_cluster.is_empty()) {
            (Some(url), _) => {
                Arc::new(RedisStore::connect(&RedisTarget::Standalone(url.clone()), args.redis_timeout)?)
            }
            (None, false) => Arc::new(RedisStore::connect(
                &RedisTarget::Cluster(args.redis_cluster.clone()),
                args.redis_timeout,
            )?),
            (None, true) => {
                tracing::warn!(
                    "no --redis-url or --redis-cluster: using the embedded memory store. Limits hold \
                     PER PROCESS ONLY; every replica enforces the full limit on its own"
                );
                Arc::new(MemoryStore::new())
            }
        };
        tracing::info!(store = %store.describe(), shadow_mode = args.shadow_mode, "store ready");
        let rules = Arc::new(ArcSwap::from_pointee(rules));
        let limiter =
            Arc::new(Limiter::new(rules.clone(), store, Arc::new(EmbeddedQuotas), args.shadow_mode));
        let listen = Listen { grpc: args.grpc_addr, http: args.http_addr };
        server::run(listen, rules, limiter, shutdown_signal(args.drain_delay)).await?;
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
    let response = runtime()?.block_on(client::ask(&args.addr, request.clone()))?;
    print!("{}", client::render(&request, &response));
    Ok(())
}
