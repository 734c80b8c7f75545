//! `tollgate explain`: what a request would be held to, for on-call. For each descriptor: the
//! rule it matches (file:line), its bucket's key and Cluster slot, the capacity and rate and
//! where they come from (rule, tier, tenant override, request override), what changes the
//! outcome (shadow, quota mode, replaces, unlimited, charge: always), and, given a Redis, the
//! bucket's balance and time to full, read without debiting anything. In a priced domain: the
//! model's prices and price version, what the request would hold, and each budget on its path
//! with its period and, given a Redis, what the period has spent and holds.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use clap::Args;
use tollgate::bucket::{refill, Role};
use tollgate::budget::{BudgetAction, BudgetOp, BudgetOutcome, Kind};
use tollgate::client;
use tollgate::config::{ChargeRule, RuleSet};
use tollgate::identity::cluster_slot;
use tollgate::limiter::{
    BudgetExplained, Effect, Explained, Limiter, Query, QueryDescriptor, ServiceModes, SpecOrigin,
};
use tollgate::quota::cache::CachedQuotas;
use tollgate::quota::postgres::PostgresQuotas;
use tollgate::quota::{EmbeddedQuotas, QuotaSource};
use tollgate::slot::SlotAction;
use tollgate::store::{MemoryStore, RedisStore, Store};
use tollgate::telemetry::{Telemetry, TelemetryConfig};

use super::redis_args::RedisArgs;
use super::{runtime, Outcome};

#[derive(Args)]
pub(super) struct ExplainArgs {
    /// A YAML file, or a directory of them, as `serve` takes it.
    #[arg(long, env = "TOLLGATE_CONFIG")]
    config: PathBuf,
    /// The rate-limit domain.
    #[arg(long)]
    domain: String,
    /// One descriptor as key=value,key=value; repeat for several.
    #[arg(long = "descriptor", required = true, value_parser = client::parse_descriptor)]
    descriptors: Vec<Vec<(String, String)>>,
    /// Hits per descriptor (tokens = hits x the rule's cost).
    #[arg(long, default_value_t = 1)]
    hits: u64,
    #[command(flatten)]
    redis: RedisArgs,
    /// Tenant quotas from PostgreSQL, as `serve` reads them.
    #[arg(long, env = "TOLLGATE_QUOTA_STORE", hide_env_values = true)]
    quota_store: Option<String>,
    /// How long to wait for Redis and the quota database.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

pub(super) fn run(args: ExplainArgs) -> Outcome {
    let rules = RuleSet::load(&args.config)?;
    let target = args.redis.target()?;
    runtime()?.block_on(async move {
        let quotas: Arc<dyn QuotaSource> = match &args.quota_store {
            Some(url) => {
                let db = PostgresQuotas::connect(url, 1, None).context("--quota-store")?;
                Arc::new(CachedQuotas::new(db, 1_000, Duration::from_secs(60), args.timeout))
            }
            None => Arc::new(EmbeddedQuotas),
        };
        let store = match &target {
            Some(target) => Some(
                RedisStore::connect(target, args.timeout, Duration::ZERO, &args.redis.tls())
                    .context("connecting to Redis")?,
            ),
            None => None,
        };
        let limiter = Limiter::new(
            Arc::new(ArcSwap::from_pointee(rules)),
            Arc::new(MemoryStore::new()),
            quotas,
            Arc::new(Telemetry::without_exporter(TelemetryConfig::default())),
            ServiceModes::default(),
        );
        let query = Query {
            domain: &args.domain,
            descriptors: args
                .descriptors
                .iter()
                .map(|d| QueryDescriptor {
                    entries: d.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
                    hits: args.hits,
                    credit: false,
                    limit: None,
                })
                .collect(),
        };
        let explanation = limiter.explain(&query).await;
        match &explanation.domain {
            Some(domain) => outln!(
                "domain {} ({}), failure_mode {}",
                domain.name,
                domain.file.display(),
                domain.failure_mode
            ),
            None => {
                outln!("domain {}: not configured, every descriptor is OK and nothing is stored", args.domain)
            }
        }
        for ((i, explained), entries) in explanation.descriptors.iter().enumerate().zip(&args.descriptors) {
            let entries: Vec<String> = entries.iter().map(|(k, v)| format!("{k}={v}")).collect();
            outln!("\ndescriptor {i} [{}]", entries.join(","));
            print_descriptor(explained, args.hits, store.as_ref()).await?;
        }
        if explanation.domain.is_none() {
            // Most likely a typo: say so in the exit code too, for scripts.
            eprintln!("domain {} is not in {}", args.domain, args.config.display());
            return anyhow::Ok(ExitCode::from(1));
        }
        anyhow::Ok(ExitCode::SUCCESS)
    })
}

async fn print_descriptor(
    explained: &Explained,
    hits: u64,
    store: Option<&RedisStore>,
) -> anyhow::Result<()> {
    if let Some(rule) = &explained.rule {
        let mut also = Vec::new();
        if let Some(name) = &rule.name {
            also.push(format!("name {name}"));
        }
        if let Some(class) = &rule.class {
            also.push(format!("class {class}"));
        }
        if rule.global {
            also.push(format!("global: one bucket for every region; {}", fallback(rule.global_fallback)));
        }
        let also = if also.is_empty() { String::new() } else { format!(" ({})", also.join(", ")) };
        let (line, column) = rule.position;
        outln!("  rule:     {} at {}:{line}:{column}{also}", rule.path, rule.file.display());
    }
    for s in &explained.slots {
        let what = match s.action {
            SlotAction::Take => "takes a slot",
            SlotAction::GiveBack | SlotAction::Undo => "gives back its slot",
        };
        outln!(
            "  slots:    {what} of {} (at most {} in flight, a slot not given back freed after {:?})",
            s.node,
            s.max,
            Duration::from_millis(s.ttl_ms)
        );
        outln!("            set {} in Cluster slot {}", s.key, s.slot);
        if let Some(store) = store {
            let open = store.open_slots(&s.key).await.with_context(|| format!("reading {}", s.key))?;
            outln!("            {open} of {} slots open now", s.max);
        }
    }
    let (limit, origin, role, need, tenant, slot) = match &explained.effect {
        Effect::UnknownDomain => return Ok(()),
        Effect::NoRule if !explained.slots.is_empty() => return Ok(()),
        Effect::NoRule => {
            outln!("  no rule with a limit matches: OK, nothing is stored");
            return Ok(());
        }
        Effect::Unlimited => {
            outln!("  unlimited: always OK, the store is never asked");
            return Ok(());
        }
        Effect::Replaced { by } => {
            outln!(
                "  replaced by {} (name {}): no limit for this request",
                by.path,
                by.name.as_deref().unwrap_or("")
            );
            return Ok(());
        }
        Effect::UnknownModel => {
            outln!("  the model has no price in the table: OVER_LIMIT (X-Budget-Exhausted: model)");
            return Ok(());
        }
        Effect::Budget(budget) => return print_budget(budget, hits, store).await,
        Effect::Bucket { limit, origin, role, need, tenant, slot } => {
            (limit, origin, role, need, tenant, slot)
        }
    };
    let tenant = tenant.as_ref().map(|t| format!("   tenant {t}")).unwrap_or_default();
    outln!("  bucket:   {}   slot {slot}{tenant}", limit.key);
    let origin = match origin {
        SpecOrigin::Rule => "the rule".to_owned(),
        SpecOrigin::RequestOverride => "the request's limit override (the rule is ignored)".to_owned(),
        SpecOrigin::TenantOverride { class } => format!("the tenant's override for class '{class}'"),
        SpecOrigin::Tier { tier, class } => format!("tier '{tier}', class '{class}'"),
    };
    outln!(
        "  limit:    capacity {}, refill {}/s ({}/{})   from {origin}",
        limit.spec.capacity(),
        limit.spec.refill_per_second(),
        limit.current_limit.requests_per_unit,
        limit.current_limit.unit.name()
    );
    let cost = explained.rule.as_ref().map_or(1, |r| r.cost);
    outln!("  takes:    {need} tokens ({hits} hits x cost {cost})");
    let mut effects = vec![match role {
        Role::Enforced => "enforced: a shortage denies the request".to_owned(),
        Role::Shadow => "shadow mode: counted, never denies".to_owned(),
        Role::QuotaMode => "quota mode: denies only if every quota-mode descriptor is short".to_owned(),
    }];
    if let Some(rule) = explained.rule.as_ref().filter(|r| matches!(r.charge, ChargeRule::Always { .. })) {
        let floor = rule.charge.for_bucket(&limit.spec).floor();
        effects.push(format!("charge: always (debited even when denied, down to {floor})"));
    }
    outln!("  effects:  {}", effects.join("; "));
    let Some(store) = store else {
        outln!("  balance:  not read (give --redis-url, --redis-cluster or --redis-sentinel)");
        return Ok(());
    };
    let peek = store.peek(&limit.key).await.with_context(|| format!("reading {}", limit.key))?;
    match peek.state {
        None => outln!(
            "  balance:  {} of {} (no bucket stored: full)",
            limit.spec.capacity(),
            limit.spec.capacity()
        ),
        Some(state) => {
            let now = refill(Some(&state), &limit.spec, peek.now_ms);
            let full_in = limit.spec.reset_ms(now.tokens) as f64 / 1000.0;
            let expires = peek
                .ttl_ms
                .map(|t| format!("; key expires in {:.1} s", t as f64 / 1000.0))
                .unwrap_or_default();
            outln!(
                "  balance:  {:.3} of {} now (Redis clock), full in {full_in:.1} s{expires}",
                now.tokens,
                limit.spec.capacity()
            );
            // Leases: an RLQS replica's for its Envoys, or at the global tier a region
            // replica's share (`region:<region>/<replica>`).
            for lease in state.leases.iter().filter(|l| l.expires_at_ms > peek.now_ms) {
                outln!(
                    "  leased:   {:.3} tokens, {:.3}/s to {} (its demand {:.3}/s), for {:.1} s more",
                    lease.capacity,
                    lease.refill_per_second,
                    lease.replica,
                    lease.demand,
                    (lease.expires_at_ms - peek.now_ms) as f64 / 1000.0
                );
            }
        }
    }
    Ok(())
}

// A priced request: the prices it is held at, what it would hold, and each budget on its path
// with, given a Redis, what the period has spent and holds.
async fn print_budget(budget: &BudgetExplained, hits: u64, store: Option<&RedisStore>) -> anyhow::Result<()> {
    let op = &budget.op;
    let prices: Vec<String> =
        Kind::ALL.iter().map(|k| format!("{} {}", k.name(), op.row.price(*k))).collect();
    outln!(
        "  prices:   {} at version {} ({} per 1,000,000 tokens: {})",
        budget.model,
        op.version,
        budget.currency,
        prices.join(", ")
    );
    if let BudgetAction::Hold { amount, tokens, .. } = op.action {
        outln!(
            "  holds:    {amount} {} and {tokens} tokens for {hits} output tokens (0: the model's default)",
            budget.currency
        );
    }
    outln!("  record:   {}   slot {}", op.record, cluster_slot(&op.record));
    let read = match store {
        Some(store) => {
            let peek = BudgetOp { action: BudgetAction::Peek, ..op.clone() };
            match store
                .budget(&peek)
                .await
                .with_context(|| format!("reading the budgets of {}", op.record))?
            {
                BudgetOutcome::Peeked { levels, leases, .. } => Some((levels, leases)),
                other => anyhow::bail!("the store answered a peek with {other:?}"),
            }
        }
        None => None,
    };
    for (i, (level, name)) in op.levels.iter().zip(&budget.level_names).enumerate() {
        let [_, start, end, _] = level.around;
        outln!(
            "  budget:   {name}: {} {} a period, {} .. {}   key {}:{start}",
            level.amount,
            budget.currency,
            instant(start),
            instant(end),
            level.base
        );
        if budget.global[i] {
            outln!("            global: one budget for every region (regions spend from money leases of it)");
        }
        let leases = read.as_ref().and_then(|(_, leases)| leases.get(i)).filter(|l| !l.is_empty());
        match read.as_ref().and_then(|(levels, _)| levels.get(i)) {
            // A global level with no region's lease in this store: a region's store (which keeps
            // only its replicas' own ledgers), or a global tier no region has leased from yet.
            Some((spent, held, _)) if budget.global[i] && leases.is_none() => outln!(
                "            spent {spent}, held {held} in this store, which holds no region's lease: if it is a region's, each replica's spend is in {}:lease:<region>/<replica>; the budget's standing is at the global tier (give its Redis, or GET /budgets on a region replica)",
                level.base
            ),
            Some((spent, held, end)) => outln!(
                "            spent {spent}, held {held}, left {} (period ends {})",
                level.amount.saturating_sub(*spent + *held),
                instant(*end)
            ),
            None => {
                outln!("            spent: not read (give --redis-url, --redis-cluster or --redis-sentinel)")
            }
        }
        // At the global tier, each region replica's money lease: its share of the budget.
        for (holder, granted, reported) in leases.into_iter().flatten() {
            outln!(
                "            leased: {} {} granted to {holder}, {reported} of it reported spent",
                granted,
                budget.currency
            );
        }
    }
    for bucket in &op.buckets {
        outln!(
            "  bucket:   {}   capacity {}, refill {}/s (tokens)",
            bucket.key,
            bucket.spec.capacity(),
            bucket.spec.refill_per_second()
        );
    }
    Ok(())
}

// Milliseconds since the epoch as an RFC 3339 instant.
fn instant(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms).map_or_else(|_| ms.to_string(), |t| t.to_string())
}

// What a region cut off from the global tier past its share does with a global rule's bucket.
pub(super) fn fallback(split: Option<u32>) -> String {
    match split {
        Some(n) => format!("cut off, a region decides on 1/{n} of it in its own store"),
        None => "cut off, a region denies it".to_owned(),
    }
}
