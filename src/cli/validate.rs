//! `tollgate validate`: load a config exactly as `serve` would, and summarise it. Every bad file
//! of a directory is reported, one `file:line:column: path: problem` per line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use clap::Args;
use tollgate::config::{RuleSet, Sources};

use super::Outcome;

#[derive(Args)]
pub(super) struct ValidateArgs {
    /// A YAML file, or a directory of *.yaml / *.yml files (one domain per file).
    #[arg(required_unless_present = "config", conflicts_with = "config", value_name = "PATH")]
    path: Option<PathBuf>,
    /// The same, as `serve` and `render` take it.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Files naming one domain are one domain, as `serve --merge-domain-config` reads them.
    #[arg(long, env = "TOLLGATE_MERGE_DOMAIN_CONFIG")]
    merge_domain_config: bool,
}

pub(super) fn run(args: ValidateArgs) -> Outcome {
    let path = args.path.or(args.config).expect("clap requires one");
    let rules = RuleSet::compile(Sources::read(&path)?.merging_domains(args.merge_domain_config))?;
    let mut any = false;
    for domain in rules.domains() {
        any = true;
        let n = domain.rules.len();
        outln!(
            "domain {}: {n} rule{} ({})",
            domain.name,
            if n == 1 { "" } else { "s" },
            domain.file.display()
        );
        // Global rules are decided elsewhere than the others: said, so that a rule marked by
        // mistake (or not marked) shows.
        for rule in domain.rules.iter().filter(|r| r.global) {
            let fallback = super::explain::fallback(rule.global_fallback);
            outln!("  global: {} (one bucket for every region; {fallback})", rule.path);
        }
        global_budgets(domain.root.nodes(), "");
        slot_timeouts(domain);
    }
    if !any {
        bail!("{}: no domains", path.display());
    }
    outln!("ok");
    Ok(ExitCode::SUCCESS)
}

// What Envoy must do for a concurrency limit to bound the upstream: give up on a request (its
// body included) before the slot's ttl. Envoy's defaults do not (no request timeout, a 15 s
// route timeout that starts after the body), so this is said, and warned of when the ttl is under
// the route timeout's default.
fn slot_timeouts(domain: &tollgate::config::Domain) {
    let Some((request, route)) = tollgate::render::slot_timeouts(domain) else { return };
    let ttl = request * 6;
    outln!(
        "  concurrency: a slot bounds the upstream only while Envoy gives up within its ttl ({ttl:?}): the connection manager's request_timeout at most {request:?}, each route's timeout at most {route:?} (`tollgate render envoy` prints both)"
    );
    if ttl < std::time::Duration::from_secs(16) {
        outln!(
            "  warning: a ttl of {ttl:?} is under Envoy's default route timeout (15 s) plus the time to receive a body: set the route timeouts, or a slot may expire while its upstream still works"
        );
    }
}

// The budgets marked `global: true` under `nodes` (their path so far `above`).
fn global_budgets(nodes: &[tollgate::matcher::Node], above: &str) {
    for node in nodes {
        let path = format!("{above}{}{}", if above.is_empty() { "" } else { "." }, node.key);
        if node.budget.as_ref().is_some_and(|b| b.global) {
            outln!(
                "  global: {path} budget (one budget for every region, spent from money leases; cut off past a lease's life, a region denies)"
            );
        }
        global_budgets(node.children.nodes(), &path);
    }
}
