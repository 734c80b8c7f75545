//! The two implementations of the bucket algorithm, `src/bucket.rs` (memory store) and
//! `src/store/token_bucket.lua` (Redis), replay the same random operation sequences and must
//! agree exactly: admissions, per-operation verdicts, balances to the last bit, waits.
//!
//! Redis's clock cannot be set, so the memory store follows it: each script run returns the
//! server time it used, and the memory store's manual clock is set to that time. Long idle
//! periods are simulated by moving every stored `last_refill` back in Redis by the same amount
//! the memory clock is moved forward, which gives both stores the same elapsed times.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tollgate::bucket::{BucketOp, BucketSpec, Group};
use tollgate::clock::ManualClock;
use tollgate::keys::{tenant_key, Class};
use tollgate::store::{MemoryStore, RedisStore, RedisTarget, RedisTls, Store};

struct Bucket {
    key: String,
    group: usize,
    spec: BucketSpec,
}

fn buckets(rng: &mut StdRng) -> Vec<Bucket> {
    let capacities = [1.0, 3.0, 10.0, 37.5, 1000.0];
    let rates = [0.001, 0.5, 2.0, 7.3, 1000.0, 1.0 / 3.0];
    let mut all = Vec::new();
    // Three tenants with three classes each (one group per tenant), plus a bucket that is
    // empty for good (capacity 0), alone in its group.
    for tenant in 0..3 {
        for class in ["default", "export", "search"] {
            let spec = BucketSpec {
                capacity: capacities[rng.random_range(0..capacities.len())],
                refill_per_second: rates[rng.random_range(0..rates.len())],
            };
            all.push(Bucket {
                key: tenant_key(&format!("t{tenant}"), &Class::Named(class)),
                group: tenant,
                spec,
            });
        }
    }
    all.push(Bucket {
        key: "rl:d:blocked=1".into(),
        group: 3,
        spec: BucketSpec { capacity: 0.0, refill_per_second: 0.0 },
    });
    all
}

fn random_batch(rng: &mut StdRng, buckets: &[Bucket]) -> Vec<Group> {
    let needs = [0.0, 1.0, 1.0, 1.0, 2.0, 3.0, 7.0, 25.0, -2.0, 1e6];
    (0..rng.random_range(1..=3))
        .map(|_| {
            let group = rng.random_range(0..=3);
            let members: Vec<&Bucket> = buckets.iter().filter(|b| b.group == group).collect();
            (0..rng.random_range(1..=4))
                .map(|_| {
                    let b = members[rng.random_range(0..members.len())];
                    BucketOp {
                        key: b.key.clone(),
                        spec: b.spec,
                        need: needs[rng.random_range(0..needs.len())],
                        shadow: rng.random_bool(0.15),
                    }
                })
                .collect()
        })
        .collect()
}

async fn replay(seed: u64, redis: &common::Redis) {
    let mut rng = StdRng::seed_from_u64(seed);
    let buckets = buckets(&mut rng);
    let store = RedisStore::connect(
        &RedisTarget::Standalone(redis.url()),
        Duration::from_secs(2),
        &RedisTls::default(),
    )
    .unwrap();
    let clock = ManualClock::new(0);
    let memory = MemoryStore::with_clock(Arc::new(clock.clone()));
    let mut con = redis.connection();
    let _: () = redis::cmd("FLUSHALL").query(&mut con).unwrap();
    let mut shift = 0u64;
    let mut compared = 0usize;
    let mut admitted = HashMap::from([(true, 0usize), (false, 0usize)]);

    for step in 0..400 {
        if rng.random_bool(0.1) {
            // Let time pass: up to twice the slowest refill of the small buckets.
            let delta = rng.random_range(1..200_000u64);
            for b in &buckets {
                let last: Option<u64> = redis::cmd("HGET").arg(&b.key).arg("l").query(&mut con).unwrap();
                if let Some(last) = last {
                    let _: () =
                        redis::cmd("HSET").arg(&b.key).arg("l").arg(last - delta).query(&mut con).unwrap();
                }
            }
            shift += delta;
            continue;
        }
        let batch = random_batch(&mut rng, &buckets);
        let from_redis: Vec<_> =
            store.evaluate(&batch).await.into_iter().map(|r| r.expect("redis answers")).collect();
        clock.set(from_redis[0].now_ms + shift);
        let from_memory = memory.evaluate_now(&batch);
        for (g, (r, m)) in from_redis.iter().zip(&from_memory).enumerate() {
            assert_eq!(r.admitted, m.admitted, "seed {seed} step {step} group {g}: {batch:?}");
            assert_eq!(r.verdicts, m.verdicts, "seed {seed} step {step} group {g}: {batch:?}");
            *admitted.get_mut(&r.admitted).unwrap() += 1;
            compared += r.verdicts.len();
        }
    }
    println!("seed {seed}: {compared} operations identical; groups admitted/denied {:?}", admitted);
    assert!(admitted[&true] > 20 && admitted[&false] > 20, "both outcomes exercised: {admitted:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_store_and_lua_script_agree() {
    let redis = common::Redis::start();
    let mut seeds = vec![1, 2, 3, 42];
    match std::env::var("TOLLGATE_EQUIV_SEED") {
        Ok(s) => seeds = vec![s.parse().expect("TOLLGATE_EQUIV_SEED is a number")],
        Err(_) => {
            seeds.push(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs())
        }
    }
    for seed in seeds {
        replay(seed, &redis).await;
    }
}
