//! The two implementations of money budgets, `src/budget/ledger.rs` (memory store) and
//! `src/store/redis/budget.lua` (Redis), replay the same random sequences of holds and
//! settlements and must agree exactly: every answer (verdicts, the exhausted level, money used
//! per level, period ends, what a settlement charged and found, the token buckets' balances) and
//! every level's stored spent and held money.
//!
//! The sequences run in real time against Redis's clock (the memory store's manual clock is set
//! to the time each script reports), with periods of 700 ms and holds of 20-400 ms, so that
//! periods roll over, holds expire unsettled (charged or released), records outlive their holds
//! and expire, settlements come in parts, twice, late and without a hold, and a price version
//! changes while holds are open; cancels and read-only peeks are among the ops.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tollgate::bucket::BucketSpec;
use tollgate::budget::{
    BucketLevel, BudgetAction, BudgetOp, BudgetOutcome, HadHold, HoldVerdict, Kind, LevelOp, LostSettle,
    Money, PriceRow,
};
use tollgate::clock::ManualClock;
use tollgate::store::{MemoryStore, RedisStore, RedisTarget, RedisTls, Store};

const PERIOD_MS: i64 = 700;

fn row(version: &str) -> PriceRow {
    let n = if version == "v1" { 1 } else { 3 };
    PriceRow([Money(2_500 * n), Money(1_250 * n), Money(3_750 * n), Money(10_000 * n)])
}

// The op of `request` (an index into a small pool, so that ids repeat) at Redis time `now`.
fn op(rng: &mut StdRng, now: i64, lost: LostSettle) -> BudgetOp {
    let request = rng.random_range(0..24);
    let start = now.div_euclid(PERIOD_MS) * PERIOD_MS;
    let around = [start - PERIOD_MS, start, start + PERIOD_MS, start + 2 * PERIOD_MS];
    // A request id belongs to one path, as its hold and settlement descriptors share it.
    let team = request % 2;
    let levels = vec![
        LevelOp { base: "rl:{o}:llm:org=o:budget".into(), amount: Money(40_000_000), around },
        LevelOp { base: format!("rl:{{o}}:llm:org=o:team={team}:budget"), amount: Money(15_000_000), around },
        LevelOp {
            base: format!("rl:{{o}}:llm:org=o:team={team}:key=k:budget"),
            amount: Money(6_000_000),
            around,
        },
    ];
    let buckets = vec![BucketLevel {
        key: format!("rl:{{o}}:llm:org=o:team={team}:key=k"),
        spec: BucketSpec::new(6_000.0, 4_000.0).unwrap(),
    }];
    let version = if rng.random_bool(0.9) { "v1" } else { "v2" };
    let action = if rng.random_bool(0.12) {
        BudgetAction::Cancel
    } else if rng.random_bool(0.05) {
        BudgetAction::Peek
    } else if rng.random_bool(0.6) {
        BudgetAction::Hold {
            amount: Money(rng.random_range(0..4_000_000)),
            tokens: rng.random_range(0..3_000),
            ttl_ms: rng.random_range(20..400),
        }
    } else {
        let mut usage = Vec::new();
        for kind in Kind::ALL {
            if rng.random_bool(0.5) {
                let tokens = rng.random_range(0..300u64);
                usage.push((kind, tokens, tollgate::budget::cost(tokens, row(version).price(kind))));
            }
        }
        if rng.random_bool(0.2) && !usage.is_empty() {
            // The same kind twice in one call: charged once.
            usage.push(usage[0]);
        }
        BudgetAction::Settle { usage }
    };
    BudgetOp {
        record: format!("rl:{{o}}:llm:hold:r{request}"),
        levels,
        buckets,
        version: version.into(),
        row: row(version),
        lost,
        life_ms: rng.random_range(300..900),
        action,
    }
}

fn now_of(outcome: &BudgetOutcome) -> u64 {
    match outcome {
        BudgetOutcome::Held { now_ms, .. }
        | BudgetOutcome::Settled { now_ms, .. }
        | BudgetOutcome::Reprice { now_ms, .. }
        | BudgetOutcome::Cancelled { now_ms, .. }
        | BudgetOutcome::Peeked { now_ms, .. } => *now_ms,
    }
}

async fn replay(seed: u64, redis: &common::Redis) -> HashMap<&'static str, usize> {
    let mut rng = StdRng::seed_from_u64(seed);
    let lost = if seed % 2 == 0 { LostSettle::Charge } else { LostSettle::Release };
    let store = RedisStore::connect(
        &RedisTarget::Standalone(redis.url()),
        Duration::from_secs(2),
        Duration::ZERO,
        &RedisTls::default(),
    )
    .unwrap();
    let clock = ManualClock::new(0);
    let memory = MemoryStore::with_clock(Arc::new(clock.clone()));
    let mut con = redis.connection();
    let _: () = redis::cmd("FLUSHALL").query(&mut con).unwrap();
    let mut seen: HashMap<&'static str, usize> = HashMap::new();
    for step in 0..400 {
        if rng.random_bool(0.1) {
            tokio::time::sleep(Duration::from_millis(rng.random_range(10..300))).await;
        }
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query(&mut con).unwrap();
        let op = op(&mut rng, secs * 1000 + micros / 1000, lost);
        let from_redis = store.budget(&op).await.expect("redis answers");
        clock.set(now_of(&from_redis));
        let from_memory = memory.budget(&op).await.unwrap();
        assert_eq!(from_redis, from_memory, "seed {seed} step {step}: {op:?}");
        let what = match &from_redis {
            BudgetOutcome::Held { verdict: HoldVerdict::Admitted, .. } => "held",
            BudgetOutcome::Held { verdict: HoldVerdict::Duplicate, .. } => "duplicate hold",
            BudgetOutcome::Held { exhausted: Some(_), .. } => "budget denied",
            BudgetOutcome::Held { .. } => "bucket denied",
            BudgetOutcome::Settled { had: HadHold::Open, .. } => "settled open",
            BudgetOutcome::Settled { had: HadHold::Expired, .. } => "settled expired",
            BudgetOutcome::Settled { had: HadHold::Settled, .. } => "settled again",
            BudgetOutcome::Settled { had: HadHold::None, .. } => "settled without hold",
            BudgetOutcome::Reprice { .. } => "repriced",
            BudgetOutcome::Cancelled { had: HadHold::Open, .. } => "cancelled open",
            BudgetOutcome::Cancelled { had: HadHold::None, .. } => "cancelled before held",
            BudgetOutcome::Cancelled { .. } => "cancelled nothing",
            BudgetOutcome::Peeked { .. } => "peeked",
        };
        *seen.entry(what).or_default() += 1;
        // Every level the op read that is clearly alive in Redis: the same spent and held money
        // in the memory store.
        if let BudgetOutcome::Held { levels: readings, .. }
        | BudgetOutcome::Settled { levels: readings, .. } = &from_redis
        {
            for (level, reading) in op.levels.iter().zip(readings) {
                let key = format!("{}:{}", level.base, reading.end_ms - PERIOD_MS);
                let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut con).unwrap();
                if ttl < 100 {
                    continue;
                }
                let (spent, held): (Option<String>, Option<String>) =
                    redis::cmd("HMGET").arg(&key).arg("s").arg("h").query(&mut con).unwrap();
                let money = |t: Option<String>| t.and_then(|t| Money::from_nanos(&t)).unwrap_or_default();
                assert_eq!(
                    Some((money(spent), money(held))),
                    memory.budget_level(&key),
                    "seed {seed} step {step}: level {key}"
                );
                *seen.entry("levels compared").or_default() += 1;
            }
        }
    }
    println!("seed {seed} ({lost:?}): {seen:?}");
    seen
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_ledger_and_lua_script_agree() {
    let redis = common::Redis::start();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for seed in [1, 2, 3, 4] {
        for (what, n) in replay(seed, &redis).await {
            *seen.entry(what).or_default() += n;
        }
    }
    for what in [
        "held",
        "duplicate hold",
        "budget denied",
        "bucket denied",
        "settled open",
        "settled expired",
        "settled again",
        "settled without hold",
        "repriced",
        "cancelled open",
        "cancelled before held",
        "peeked",
        "levels compared",
    ] {
        assert!(seen.get(what).copied().unwrap_or(0) > 5, "{what} exercised too rarely: {seen:?}");
    }
}
