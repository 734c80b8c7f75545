//! `tollgate ask`: one `ShouldRateLimit` call to a running server, printed for people, with an
//! exit code for scripts: 0 OK, 1 OVER_LIMIT, 2 the call failed.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use tollgate::client;

use super::{runtime, Outcome};

/// The exit code of an OVER_LIMIT answer.
const EXIT_OVER_LIMIT: u8 = 1;
/// The exit code when there is no answer (connection, TLS, gRPC error, bad arguments).
pub(super) const EXIT_ERROR: u8 = 2;

#[derive(Args)]
pub(super) struct AskArgs {
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

pub(super) fn run(args: AskArgs) -> Outcome {
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
    out!("{}", client::render(&request, &response));
    Ok(if client::over_limit(&response) { ExitCode::from(EXIT_OVER_LIMIT) } else { ExitCode::SUCCESS })
}
