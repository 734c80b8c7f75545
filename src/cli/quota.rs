//! `tollgate quota`: tenant tiers and quota overrides in the quota database.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context as _};
use clap::{Args, Subcommand};
use tollgate::bucket::BucketSpec;
use tollgate::config::{RuleSet, Sources};
use tollgate::quota::postgres::{Listing, PostgresQuotas};

use super::{runtime, Outcome};

/// The quota database an operator command works on (`tollgate quota`, `tollgate budget`).
#[derive(Args)]
pub(super) struct DatabaseArgs {
    /// The quota database: postgres://user:password@host:port/db.
    #[arg(long, env = "TOLLGATE_QUOTA_STORE", hide_env_values = true, global = true)]
    quota_store: Option<String>,
    /// Extra CA certificates (PEM) to verify the quota database's TLS certificate.
    #[arg(long, env = "TOLLGATE_QUOTA_STORE_CA", global = true)]
    quota_store_ca: Option<PathBuf>,
}

impl DatabaseArgs {
    /// A pool of one connection to the database.
    pub(super) fn connect(&self) -> anyhow::Result<PostgresQuotas> {
        let url =
            self.quota_store.as_deref().context("--quota-store (or TOLLGATE_QUOTA_STORE) is required")?;
        Ok(PostgresQuotas::connect(url, 1, self.quota_store_ca.as_deref())?)
    }
}

/// What a row that `quota set` or `budget set` stores is checked against: a row the servers'
/// rules can never apply (a typo in a domain, a level, a tier) would succeed and never be in force.
#[derive(Args)]
pub(super) struct RowCheck {
    /// The rules the servers load (a file or a directory, as `serve --config`): a row they can
    /// never apply is refused. Without it the row is stored unchecked, which is said.
    #[arg(long, env = "TOLLGATE_CONFIG", value_name = "PATH")]
    config: Option<PathBuf>,
    /// Store the row even where the rules have nowhere it applies (rules to come).
    #[arg(long)]
    force: bool,
}

impl RowCheck {
    /// Checks a row with `problem` (what is wrong with it under the rules, if anything).
    pub(super) fn check(&self, problem: impl FnOnce(&RuleSet) -> Option<String>) -> anyhow::Result<()> {
        let Some(path) = &self.config else {
            eprintln!("note: not checked against any rules (give --config, or TOLLGATE_CONFIG, to check)");
            return Ok(());
        };
        let rules =
            RuleSet::compile(Sources::read(path)?).with_context(|| format!("--config {}", path.display()))?;
        match problem(&rules) {
            Some(problem) if self.force => {
                eprintln!("warning: {problem}; stored anyway (--force)");
                Ok(())
            }
            Some(problem) => bail!("{problem} in {}: refused (--force stores it anyway)", path.display()),
            None => Ok(()),
        }
    }
}

#[derive(Args)]
pub(super) struct QuotaArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(subcommand)]
    action: QuotaAction,
}

#[derive(Subcommand)]
enum QuotaAction {
    /// Create the quota tables (tenant quotas and budget overrides) if they do not exist.
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
        #[command(flatten)]
        check: RowCheck,
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

pub(super) fn run(args: QuotaArgs) -> Outcome {
    let db = args.database.connect()?;
    runtime()?.block_on(async move {
        match args.action {
            QuotaAction::Migrate => {
                // Silent when there was nothing to do, so that it can run on every deploy.
                let created = db.migrate().await?;
                if created > 0 {
                    outln!("created {created} tollgate table(s) in {}", db.describe());
                }
            }
            QuotaAction::Set { tenant, tier, class, capacity, refill_per_second, expires_in, check } => {
                if tier.is_none() && class.is_none() {
                    bail!("nothing to set: give --tier, or --class with --capacity and --refill-per-second");
                }
                check.check(|rules| unknown_tier_or_class(rules, tier.as_deref(), class.as_deref()))?;
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
                    outln!(
                        "tenant {tenant}: no rows in the quota database (it gets its inline record in a domain file, if it has one, else each domain's default tier)"
                    );
                }
                print_listings(&listings);
            }
            QuotaAction::List => {
                let listings = db.list(None).await?;
                if listings.is_empty() {
                    outln!("no tenants in the quota database (every tenant gets its inline record or its domain's default tier)");
                }
                print_listings(&listings);
            }
            QuotaAction::Delete { tenant, class } => {
                let deleted = db.delete(&tenant, class.as_deref()).await?;
                outln!("deleted {deleted} row(s)");
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

// What no domain of `rules` knows of `tier` and `class`: a tier is a domain's (`tiers:`), a class
// a domain's rules' (`class:`) or a tier's.
fn unknown_tier_or_class(rules: &RuleSet, tier: Option<&str>, class: Option<&str>) -> Option<String> {
    let domains = || rules.domains();
    if let Some(tier) = tier.filter(|t| !domains().any(|d| d.quotas.tiers.contains_key(*t))) {
        let mut known: Vec<&str> = Vec::new();
        for name in domains().flat_map(|d| d.quotas.tiers.keys().map(String::as_str)) {
            if !known.contains(&name) {
                known.push(name);
            }
        }
        return Some(format!("no domain has tier '{tier}' (tiers: {})", known.join(", ")));
    }
    let known_class = |c: &str| {
        domains().any(|d| d.classes.contains_key(c) || d.quotas.tiers.values().any(|t| t.contains_key(c)))
    };
    class.filter(|c| !known_class(c)).map(|c| format!("no rule or tier has class '{c}'"))
}

fn print_listings(listings: &[Listing]) {
    for l in listings {
        outln!("tenant {}: tier {}", l.tenant, l.tier.as_deref().unwrap_or("(default tier)"));
        for o in &l.overrides {
            let expiry = o
                .expires_at
                .map(|at| format!(" until {}", humantime::format_rfc3339_seconds(at)))
                .unwrap_or_default();
            outln!("  {}: capacity {}, refill {}/s{expiry}", o.class, o.capacity, o.refill_per_second);
        }
    }
}
