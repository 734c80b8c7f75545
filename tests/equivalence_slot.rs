//! The two implementations of concurrency slots, `src/slot/mod.rs` (memory store) and
//! `src/store/redis/slot.lua` (Redis), replay the same random sequences of takes and give-backs
//! and must agree exactly: every answer (verdict, each set's open and expired slots and when a
//! full one frees, the token buckets' verdicts and balances) and every set's stored slots.
//!
//! The sequences run in real time against Redis's clock (the memory store's manual clock is set
//! to the time each script reports), with slot ttls of 30-300 ms, so that slots expire unreturned
//! and records outlive or precede them; request ids repeat (retries of a take, give-backs sent
//! twice, ids reused on another path); sets are shared between paths; takes carry token buckets
//! that sometimes deny.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tollgate::bucket::{BucketOp, BucketSpec, Charge, Role};
use tollgate::clock::ManualClock;
use tollgate::slot::{SlotAction, SlotOp, SlotSet, SlotVerdict};
use tollgate::store::{MemoryStore, RedisStore, RedisTarget, RedisTls, Store};

const SETS: [(&str, u64, u64); 3] = [
    ("rl:{t}:d:tenant=t:slots", 3, 300),
    ("rl:{t}:d:tenant=t:key=a:slots", 2, 120),
    ("rl:{t}:d:tenant=t:key=b:slots", 1, 30),
];

fn op(rng: &mut StdRng) -> SlotOp {
    // Paths: the tenant's set alone, or with one key's set under it.
    let path = rng.random_range(0..3usize);
    let sets: Vec<SlotSet> = match path {
        0 => vec![0],
        1 => vec![0, 1],
        _ => vec![0, 2],
    }
    .into_iter()
    .map(|i| SlotSet { key: SETS[i].0.to_owned(), max: SETS[i].1, ttl_ms: SETS[i].2 })
    .collect();
    let id = rng.random_range(0..12u32);
    let bucket = BucketOp {
        key: "rl:{t}:d:tenant=t".into(),
        spec: BucketSpec::new(4.0, 8.0).unwrap(),
        need: 1.0,
        unseen: 0.0,
        role: Role::Enforced,
        charge: Charge::Admitted,
    };
    SlotOp {
        record: format!("rl:{{t}}:d:slot:{id}"),
        // Ids mostly keep their path; now and then one is sent on another (reused).
        binding: if rng.random_bool(0.9) {
            format!("tenant=t:path={}", id % 3)
        } else {
            format!("tenant=t:path={path}")
        },
        sets,
        action: match rng.random_range(0..20u32) {
            0..11 => SlotAction::Take,
            11..18 => SlotAction::GiveBack,
            _ => SlotAction::Undo,
        },
        group: if rng.random_bool(0.7) { vec![bucket] } else { Vec::new() },
    }
}

async fn replay(seed: u64, redis: &common::Redis) -> HashMap<&'static str, usize> {
    let mut rng = StdRng::seed_from_u64(seed);
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
        if rng.random_bool(0.15) {
            tokio::time::sleep(Duration::from_millis(rng.random_range(5..120))).await;
        }
        let op = op(&mut rng);
        let from_redis = store.slots(&op).await.expect("redis answers");
        clock.set(from_redis.now_ms);
        let from_memory = memory.slots(&op).await.unwrap();
        assert_eq!(from_redis, from_memory, "seed {seed} step {step}: {op:?}");
        for (key, _, _) in SETS {
            let stored: Vec<(String, f64)> =
                redis::cmd("ZRANGE").arg(key).arg(0).arg(-1).arg("WITHSCORES").query(&mut con).unwrap();
            let mut stored: Vec<(String, u64)> = stored.into_iter().map(|(m, s)| (m, s as u64)).collect();
            stored.sort();
            // Slots Redis has not yet dropped because no op swept the set since they expired are
            // gone from neither; compare the ones still open.
            let now = from_redis.now_ms;
            let open = |v: Vec<(String, u64)>| v.into_iter().filter(|(_, at)| *at > now).collect::<Vec<_>>();
            assert_eq!(open(stored), open(memory.open_slots(key)), "seed {seed} step {step}: set {key}");
        }
        let what = match from_redis.verdict {
            SlotVerdict::GivenBack(n) if n > 0 && op.action == SlotAction::Undo => "undone",
            SlotVerdict::Taken => "taken",
            SlotVerdict::Refused(Some(_)) => "refused: full",
            SlotVerdict::Refused(None) => "refused: buckets",
            SlotVerdict::Repeated(true) => "repeated admitted",
            SlotVerdict::Repeated(false) => "repeated refused",
            SlotVerdict::Reused => "reused id",
            SlotVerdict::GivenBack(0) => "given back, already expired",
            SlotVerdict::GivenBack(_) => "given back",
            SlotVerdict::Nothing => "nothing to give back",
        };
        *seen.entry(what).or_default() += 1;
        if from_redis.sets.iter().any(|s| s.expired > 0) {
            *seen.entry("expired swept").or_default() += 1;
        }
    }
    println!("seed {seed}: {seen:?}");
    seen
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_slots_and_lua_script_agree() {
    let redis = common::Redis::start();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for seed in 0..4 {
        for (k, v) in replay(seed, &redis).await {
            *seen.entry(k).or_default() += v;
        }
    }
    for what in [
        "taken",
        "refused: full",
        "refused: buckets",
        "repeated admitted",
        "repeated refused",
        "reused id",
        "given back",
        "undone",
        "nothing to give back",
        "expired swept",
    ] {
        assert!(seen.get(what).copied().unwrap_or(0) > 0, "the sequences never reached '{what}': {seen:?}");
    }
}
