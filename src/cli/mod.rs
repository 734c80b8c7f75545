//! The `tollgate` command line: one module per subcommand, each with its arguments and its
//! handler; this one parses, sets up logging, dispatches, and turns the outcome into an exit
//! code. Errors are printed once, each cause once ([`ErrorChain`]).

/// `print!` for a command's output: a reader that went away (`tollgate explain ... | head`) ends
/// the command quietly, as it ends `cat`, where `print!` panics on the broken pipe.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_out(format_args!($($arg)*))
    };
}

/// `println!` for a command's output (see `out!`).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cli::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod ask;
mod budget;
mod explain;
mod quota;
mod ratelimit_env;
mod redis_args;
mod render;
mod serve;
mod validate;
mod xds_args;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tollgate::telemetry::logs::ErrorChain;

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
    /// Serve Envoy's RateLimitService and RateLimitQuotaService (gRPC) and the HTTP endpoints.
    Serve(Box<serve::ServeArgs>),
    /// Load and check a config exactly as `serve` would, and summarise it.
    Validate(validate::ValidateArgs),
    /// Ask a running server about descriptors and print its answer (exit 0 OK, 1 OVER_LIMIT, 2 error).
    Ask(ask::AskArgs),
    /// Explain what a request would be held to: rule, bucket key and slot, limit and its origin,
    /// and (with Redis) the bucket's balance, read without debiting.
    // The usage names --hits: what a request costs is half of what it is held to.
    #[command(
        override_usage = "tollgate explain --config <CONFIG> --domain <DOMAIN> --descriptor <KEY=VALUE,...>... [--hits <HITS>] [OPTIONS]"
    )]
    Explain(Box<explain::ExplainArgs>),
    /// Manage tenant tiers and quota overrides in the quota database.
    Quota(quota::QuotaArgs),
    /// Manage budget overrides (a level's amount and period) in the quota database.
    Budget(budget::BudgetArgs),
    /// Print the Envoy or Istio configuration that sends the descriptors a config expects.
    Render(render::RenderArgs),
}

/// Writes `args` to stdout; exits with success when the reader has gone away.
fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    match std::io::stdout().lock().write_fmt(args) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => panic!("failed printing to stdout: {e}"),
    }
}

/// What a subcommand's handler returns: its exit code, or an error (exit code 1; `ask` uses 2).
type Outcome = anyhow::Result<ExitCode>;

/// Runs the command line of this process. Run as `ratelimit` (the image's `/bin/ratelimit`),
/// it is `tollgate serve` with envoyproxy/ratelimit's defaults.
pub fn main() -> ExitCode {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let as_ratelimit = args
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|name| name == "ratelimit");
    if as_ratelimit {
        args.insert(1, "serve".into());
    }
    // Only the service reads envoyproxy/ratelimit's settings (a global flag may come first).
    let serves = as_ratelimit || args.iter().skip(1).any(|a| a == "serve");
    let ignored = match if serves { from_ratelimit_env(as_ratelimit) } else { Ok(Vec::new()) } {
        Ok(ignored) => ignored,
        Err(error) => {
            eprintln!("tollgate: {error}");
            return ExitCode::FAILURE;
        }
    };
    let cli = Cli::parse_from(args);
    let json = cli.log_format == "json";
    if !matches!(cli.command, Command::Serve(_)) {
        tollgate::telemetry::logs::init(json, None);
    }
    let (result, failure) = match cli.command {
        Command::Serve(args) => (serve::run(*args, json, &ignored), ExitCode::FAILURE),
        Command::Validate(args) => (validate::run(args), ExitCode::FAILURE),
        Command::Ask(args) => (ask::run(args), ExitCode::from(ask::EXIT_ERROR)),
        Command::Explain(args) => (explain::run(*args), ExitCode::FAILURE),
        Command::Quota(args) => (quota::run(args), ExitCode::FAILURE),
        Command::Budget(args) => (budget::run(args), ExitCode::FAILURE),
        Command::Render(args) => (render::run(args), ExitCode::FAILURE),
    };
    result.unwrap_or_else(|error| {
        // One format for every line: several files' problems come one per line.
        for line in ErrorChain(error.as_ref()).to_string().lines() {
            eprintln!("tollgate: {line}");
        }
        failure
    })
}

// Sets the variables envoyproxy/ratelimit's settings stand for, where unset, and says which it
// ignores. Runs first, while this process has one thread.
fn from_ratelimit_env(as_ratelimit: bool) -> Result<Vec<String>, String> {
    let translation = ratelimit_env::translate(&|name| std::env::var(name).ok(), as_ratelimit)?;
    for (name, value) in translation.set {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    Ok(translation.ignored)
}

/// A multi-threaded Tokio runtime for a handler.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    runtime_with(None)
}

/// A multi-threaded Tokio runtime with `workers` threads (`None`: one per core).
fn runtime_with(workers: Option<usize>) -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context as _;
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = workers {
        builder.worker_threads(workers);
    }
    builder.enable_all().build().context("starting the async runtime")
}
