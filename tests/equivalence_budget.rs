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
//! changes while holds are open; cancels, read-only peeks and regions' money leases (reported
//! spend charged, leases grown, shrunk and left to expire, charged whole) are among the ops. Request ids are
//! reused by other paths and other holds (refused, nothing charged), counts come far above any
//! hold, settlements come whose model left the price table (priced at the record's row), and
//! soft limits are crossed (counted once a period, in both). Every op also carries two
//! concurrency limits (the org's and the team's, on half the paths): holds take a slot of each, all or nothing,
//! and are refused by a full set, settlements and cancels give them back, slots expire; every
//! set's open slots compared after each op.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tollgate::bucket::BucketSpec;
use tollgate::budget::{
    BucketLevel, BudgetAction, BudgetOp, BudgetOutcome, HadHold, HoldVerdict, Kind, LeaseReport, LevelOp,
    LostSettle, Money, PriceRow,
};
use tollgate::clock::ManualClock;
use tollgate::slot::SlotSet;
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
    // A request id belongs to one path, as its hold and settlement descriptors share it; now and
    // then another request (another team's) reuses it.
    let team = if rng.random_bool(0.1) { 1 - request % 2 } else { request % 2 };
    // Soft limits at half and four fifths of each amount.
    let level = |base: String, amount: u128| LevelOp {
        base,
        amount: Money(amount),
        around,
        alerts: vec![Money(amount / 2), Money(amount * 4 / 5)],
    };
    let levels = vec![
        level("rl:{o}:llm:org=o:budget".into(), 40_000_000),
        level(format!("rl:{{o}}:llm:org=o:team={team}:budget"), 15_000_000),
        level(format!("rl:{{o}}:llm:org=o:team={team}:key=k:budget"), 6_000_000),
    ];
    // Slot ttls differ per op as they may after a reload, and span hold ttls.
    let mut set = |key: String, max: u64| SlotSet { key, max, ttl_ms: rng.random_range(200..1_200) };
    let mut sets = vec![
        set("rl:{o}:llm:org=o:slots".into(), 2),
        set(format!("rl:{{o}}:llm:org=o:team={team}:slots"), 1),
    ];
    // Half the requests are on paths without them (so that holds are not all held back).
    if request >= 12 {
        sets.clear();
    }
    let buckets = vec![BucketLevel {
        key: format!("rl:{{o}}:llm:org=o:team={team}:key=k"),
        spec: BucketSpec::new(6_000.0, 4_000.0).unwrap(),
    }];
    // v3: a settlement whose model left the price table, priced at its record's row.
    let version = match rng.random_range(0..20) {
        0 => "v2",
        1 => "",
        _ => "v1",
    };
    let action = if rng.random_bool(0.12) {
        BudgetAction::Cancel
    } else if rng.random_bool(0.05) {
        BudgetAction::Peek
    } else if rng.random_bool(0.06) {
        // A region's money lease of the levels (as at the global tier): spend reported, more or
        // less wanted, beside the holds of the global tier's own requests.
        let holder = if rng.random_bool(0.5) { "eu/a" } else { "us/b" };
        let reports = (0..3)
            .map(|_| {
                let spent = Money(rng.random_range(0..2_000_000));
                // Rounds out of order now and then: a stray's spend counts, its grant does not.
                LeaseReport {
                    spent,
                    wanted: spent + Money(rng.random_range(0..4_000_000)),
                    round: rng.random_range(0..4),
                }
            })
            .collect();
        BudgetAction::Lease { holder: holder.into(), ttl_ms: rng.random_range(20..400), reports }
    } else if rng.random_bool(0.6) {
        // Mostly the request's own hold, so that retries are genuine; sometimes another.
        let (amount, tokens) = if rng.random_bool(0.8) {
            (Money(u128::from(request as u32 + 1) * 150_000), (request + 1) * 100)
        } else {
            (Money(rng.random_range(0..4_000_000)), rng.random_range(0..3_000))
        };
        BudgetAction::Hold { amount, tokens, ttl_ms: rng.random_range(20..400) }
    } else {
        let mut usage = Vec::new();
        for kind in Kind::ALL {
            if rng.random_bool(0.5) {
                // Now and then a count far past any hold (the limiter caps counts at 10^12).
                let tokens =
                    if rng.random_bool(0.03) { 1_000_000_000_000 } else { rng.random_range(0..300u64) };
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
        binding: format!("org=o:team={team}:key=k:model=m"),
        levels,
        buckets,
        sets,
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
        | BudgetOutcome::Peeked { now_ms, .. }
        | BudgetOutcome::Leased { now_ms, .. } => *now_ms,
    }
}

async fn replay(seed: u64, redis: &common::Redis) -> HashMap<&'static str, usize> {
    let mut rng = StdRng::seed_from_u64(seed);
    let lost = if seed.is_multiple_of(2) { LostSettle::Charge } else { LostSettle::Release };
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
    let mut last_held: Option<BudgetOp> = None;
    for step in 0..500 {
        if rng.random_bool(0.1) {
            tokio::time::sleep(Duration::from_millis(rng.random_range(10..300))).await;
        }
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query(&mut con).unwrap();
        // Now and then the cancel the limiter sends after a hold whose answer it lost: of the
        // hold just admitted, so that cancels of open holds are common; or that hold again, as
        // a retry; or its settlement, so that settlements of open holds (and the give-back of
        // their slots) are common too.
        let op = match last_held.take() {
            Some(held) if rng.random_bool(0.3) => BudgetOp { action: BudgetAction::Cancel, ..held },
            Some(held) if rng.random_bool(0.15) => held,
            Some(held) if rng.random_bool(0.3) => {
                let price = row(&held.version).price(Kind::Output);
                let usage = vec![(Kind::Output, 50, tollgate::budget::cost(50, price))];
                BudgetOp { action: BudgetAction::Settle { usage }, ..held }
            }
            _ => op(&mut rng, secs * 1000 + micros / 1000, lost),
        };
        let from_redis = store.budget(&op).await.expect("redis answers");
        clock.set(now_of(&from_redis));
        let from_memory = memory.budget(&op).await.unwrap();
        assert_eq!(from_redis, from_memory, "seed {seed} step {step}: {op:?}");
        if matches!(from_redis, BudgetOutcome::Held { verdict: HoldVerdict::Admitted, .. }) {
            last_held = Some(op.clone());
        }
        let what = match &from_redis {
            BudgetOutcome::Held { verdict: HoldVerdict::Admitted, .. } => "held",
            BudgetOutcome::Held { verdict: HoldVerdict::Duplicate, .. } => "duplicate hold",
            BudgetOutcome::Held { verdict: HoldVerdict::Reused, .. } => "reused id refused",
            BudgetOutcome::Held { exhausted: Some(_), .. } => "budget denied",
            BudgetOutcome::Held { slots, .. } if slots.full.is_some() => "set full",
            BudgetOutcome::Held { .. } => "bucket denied",
            BudgetOutcome::Settled { had: HadHold::Open, .. } => "settled open",
            BudgetOutcome::Settled { had: HadHold::Expired, .. } => "settled expired",
            BudgetOutcome::Settled { had: HadHold::Settled, .. } => "settled again",
            BudgetOutcome::Settled { had: HadHold::None, levels, .. } if levels.is_empty() => {
                "unpriced, no record"
            }
            BudgetOutcome::Settled { had: HadHold::None, .. } => "settled without hold",
            BudgetOutcome::Settled { had: HadHold::Other, .. } => "settled another's record",
            BudgetOutcome::Reprice { .. } => "repriced",
            BudgetOutcome::Cancelled { had: HadHold::Open, .. } => "cancelled open",
            BudgetOutcome::Cancelled { had: HadHold::None, .. } => "cancelled before held",
            BudgetOutcome::Cancelled { .. } => "cancelled nothing",
            BudgetOutcome::Peeked { .. } => "peeked",
            BudgetOutcome::Leased { levels, .. }
                if matches!(&op.action, BudgetAction::Lease { reports, .. }
                    if levels.iter().zip(reports).any(|(l, r)| l.granted < r.wanted)) =>
            {
                "lease cut to the room"
            }
            BudgetOutcome::Leased { .. } => "leased",
        };
        *seen.entry(what).or_default() += 1;
        if let BudgetOutcome::Settled { slots, .. } | BudgetOutcome::Cancelled { slots, .. } = &from_redis {
            if slots.readings.iter().any(|r| r.given_back) {
                *seen.entry("slot given back").or_default() += 1;
            }
        }
        // Every set: the same open slots, expiring at the same times.
        for set in &op.sets {
            let stored: Vec<(String, u64)> =
                redis::cmd("ZRANGE").arg(&set.key).arg(0).arg(-1).arg("WITHSCORES").query(&mut con).unwrap();
            let now = now_of(&from_redis);
            let mut open: Vec<(String, u64)> = stored.into_iter().filter(|(_, at)| *at > now).collect();
            open.sort();
            let memory_open: Vec<(String, u64)> =
                memory.open_slots(&set.key).into_iter().filter(|(_, at)| *at > now).collect();
            assert_eq!(open, memory_open, "seed {seed} step {step}: set {}", set.key);
        }
        if let BudgetOutcome::Held { levels, .. } | BudgetOutcome::Settled { levels, .. } = &from_redis {
            if levels.iter().any(|l| l.alerted.1 > l.alerted.0) {
                *seen.entry("alert crossed").or_default() += 1;
            }
        }
        // Every level the op read that is clearly alive in Redis: the same spent and held money
        // in the memory store.
        let ends: Vec<i64> = match &from_redis {
            BudgetOutcome::Held { levels, .. } | BudgetOutcome::Settled { levels, .. } => {
                levels.iter().map(|l| l.end_ms).collect()
            }
            BudgetOutcome::Leased { levels, .. } => levels.iter().map(|l| l.end_ms).collect(),
            _ => Vec::new(),
        };
        {
            for (level, end_ms) in op.levels.iter().zip(ends) {
                let key = format!("{}:{}", level.base, end_ms - PERIOD_MS);
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
    for seed in [1, 2, 3, 4, 5] {
        for (what, n) in replay(seed, &redis).await {
            *seen.entry(what).or_default() += n;
        }
    }
    for what in [
        "held",
        "duplicate hold",
        "reused id refused",
        "settled another's record",
        "alert crossed",
        "budget denied",
        "set full",
        "slot given back",
        "bucket denied",
        "settled open",
        "settled expired",
        "settled again",
        "settled without hold",
        "repriced",
        "cancelled open",
        "cancelled before held",
        "peeked",
        "leased",
        "lease cut to the room",
        "levels compared",
    ] {
        assert!(seen.get(what).copied().unwrap_or(0) > 5, "{what} exercised too rarely: {seen:?}");
    }
}
