//! `tollgate budget`: budget overrides in the quota database, by priced domain and level. A level
//! is given as its descriptor entries from the top (`--level org=acme,team=search`), the way
//! `ask` takes a descriptor; tollgate stores it as the path text its keys use, so that the row
//! and a request's lookup meet. Serving replicas see a change within the quota cache's TTL, on
//! the next request that reaches the level after it (the query comes with that request).

use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use tollgate::quota::budgets::BudgetRow;
use tollgate::quota::postgres::PostgresQuotas;

use super::quota::{DatabaseArgs, RowCheck};
use super::{runtime, Outcome};

#[derive(Args)]
pub(super) struct BudgetArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(subcommand)]
    action: BudgetAction,
}

#[derive(Subcommand)]
enum BudgetAction {
    /// Set a level's amount (and optionally its period) in place of its domain file's budget.
    Set {
        /// The priced domain.
        #[arg(long)]
        domain: String,
        /// The level, as its entries from the top: org=acme,team=search.
        #[arg(long)]
        level: String,
        /// The amount a period allows, a decimal in the price table's currency (500.00).
        #[arg(long)]
        amount: String,
        /// The period (minute, hour, day, week, month or year); the file's when not given.
        #[arg(long)]
        per: Option<String>,
        #[command(flatten)]
        check: RowCheck,
    },
    /// Show a level's override.
    Get {
        #[arg(long)]
        domain: String,
        #[arg(long)]
        level: String,
    },
    /// Show every override (of --domain, when given).
    List {
        #[arg(long)]
        domain: Option<String>,
    },
    /// Delete a level's override: its domain file's budget applies again.
    Delete {
        #[arg(long)]
        domain: String,
        #[arg(long)]
        level: String,
    },
}

pub(super) fn run(args: BudgetArgs) -> Outcome {
    let db = args.database.connect()?;
    runtime()?.block_on(async move {
        match args.action {
            BudgetAction::Set { domain, level, amount, per, check } => {
                check.check(|rules| no_budget_at(rules, &domain, &level))?;
                let path = path(&level)?;
                db.set_budget(&domain, &path, &amount, per.as_deref()).await?;
                print(&db, Some(&domain), Some(&path)).await?;
            }
            BudgetAction::Get { domain, level } => {
                let path = path(&level)?;
                if !print(&db, Some(&domain), Some(&path)).await? {
                    outln!("{domain} {path}: no override (the domain file's budget applies)");
                }
            }
            BudgetAction::List { domain } => {
                if !print(&db, domain.as_deref(), None).await? {
                    outln!("no budget overrides (every level has its domain file's budget)");
                }
            }
            BudgetAction::Delete { domain, level } => {
                let deleted = db.delete_budget(&domain, &path(&level)?).await?;
                outln!("deleted {deleted} row(s)");
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

// The path text of `level` (`org=acme,team=search`).
fn path(level: &str) -> anyhow::Result<String> {
    let entries = tollgate::client::parse_descriptor(level).map_err(anyhow::Error::msg).context("--level")?;
    let entries: Vec<(&str, &str)> = entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Ok(tollgate::identity::path_text(&entries))
}

// Why `level` of `domain` has no budget in `rules`, if it has none: the domain unknown or not
// priced, or the level's path names no node with `budget:`.
fn no_budget_at(rules: &tollgate::config::RuleSet, domain: &str, level: &str) -> Option<String> {
    let Some(d) = rules.domain(domain) else { return Some(format!("no domain '{domain}'")) };
    if d.priced.is_none() {
        return Some(format!("domain '{domain}' prices nothing (no prices:), so it has no budgets"));
    }
    let entries = tollgate::client::parse_descriptor(level).ok()?;
    let entries: Vec<(&str, &str)> = entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    match d.root.path(&entries) {
        Some(nodes) if nodes.last().is_some_and(|n| n.budget.is_some()) => None,
        Some(_) => {
            Some(format!("the level {level} of domain '{domain}' has no budget: (an override replaces one)"))
        }
        None => {
            Some(format!("no level {level} in domain '{domain}' (its entries name no node, from the top)"))
        }
    }
}

// Prints the rows found; whether there were any.
async fn print(db: &PostgresQuotas, domain: Option<&str>, path: Option<&str>) -> anyhow::Result<bool> {
    let rows = db.list_budgets(domain, path).await?;
    for BudgetRow { domain, path, amount, per } in &rows {
        outln!("{domain} {path}: {amount} a {}", per.as_deref().unwrap_or("period (the file's)"));
    }
    Ok(!rows.is_empty())
}
