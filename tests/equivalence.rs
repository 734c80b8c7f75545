//! The two implementations of the bucket algorithm, `src/bucket/` (memory store) and
//! `src/store/redis/bucket.lua` with `group.lua` (Redis), replay the same random operation sequences and must
//! agree exactly: admissions, per-operation verdicts (forgiven debt included), and for every
//! bucket a step wrote, every stored field to the last bit (balance, refill time, rate in force,
//! pending rate and when it takes effect, largest capacity, slowest rate) and the expiry.
//! The sequences cover every role (enforced, shadow, quota mode), both charge modes with debt and
//! its floor, credits, checks, zero-capacity buckets and extreme specs (a capacity of 1e12
//! refilling 0.0001 per second, whose TTL would overflow without the cap, and the slowest rate
//! accepted). Most keys are written under two or three specs (capacity, rate, charge mode), as
//! replicas in the middle of a quota change write them: pending rate raises, expiries that a
//! write must not move earlier and lives set by another spec's capacity are all exercised.
//!
//! Redis's clock cannot be set, so the memory store follows it: each script run returns the
//! server time it used, and the memory store's manual clock is set to that time. Long idle
//! periods are simulated by moving every stored `last_refill` and expiry back in Redis by the
//! same amount the memory clock is moved forward, which gives both stores the same elapsed times
//! and the same expired buckets.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tollgate::bucket::{
    Asked, BucketOp, BucketSpec, BucketState, Charge, Group, Lease, LeaseOp, Role, MAX_WAIT_MS,
    MIN_REFILL_PER_SECOND,
};
use tollgate::clock::ManualClock;
use tollgate::store::{parse_leases, LateReply, MemoryStore, RedisStore, RedisTarget, RedisTls, Store};

struct Bucket {
    key: String,
    spec: BucketSpec,
    charge: Charge,
}

fn buckets(rng: &mut StdRng) -> Vec<Bucket> {
    let capacities = [1.0, 3.0, 10.0, 37.5, 1000.0];
    let rates = [0.001, 0.5, 2.0, 7.3, 1000.0, 1.0 / 3.0];
    let mut all = Vec::new();
    // Nine specs on five keys: keys 0 to 3 are each written under two specs.
    for i in 0..9 {
        let k = i % 5;
        let capacity = capacities[rng.random_range(0..capacities.len())];
        let charge = match i % 3 {
            0 => Charge::Always { max_debt: capacity },
            1 if rng.random_bool(0.5) => Charge::Always { max_debt: [0.0, 5.0][rng.random_range(0..2)] },
            _ => Charge::Admitted,
        };
        all.push(Bucket {
            key: format!("rl:{{t{}}}:d:k={k}", k % 3),
            spec: BucketSpec::new(capacity, rates[rng.random_range(0..rates.len())]).unwrap(),
            charge,
        });
    }
    // Empty for good, and huge and slow.
    all.push(Bucket {
        key: "rl:d:blocked=1".into(),
        spec: BucketSpec::new(0.0, 0.0).unwrap(),
        charge: Charge::Admitted,
    });
    all.push(Bucket {
        key: "rl:d:huge=1".into(),
        spec: BucketSpec::new(1e12, 0.0001).unwrap(),
        charge: Charge::Admitted,
    });
    all.push(Bucket {
        key: "rl:d:huge=2".into(),
        spec: BucketSpec::new(1e12, 0.0001).unwrap(),
        charge: Charge::Always { max_debt: 1e12 },
    });
    // Three specs on one key, the slowest rate accepted among them.
    for (capacity, rate) in [(10.0, 1000.0), (1000.0, 0.5), (3.0, MIN_REFILL_PER_SECOND)] {
        all.push(Bucket {
            key: "rl:{t0}:d:shared".into(),
            spec: BucketSpec::new(capacity, rate).unwrap(),
            charge: Charge::Admitted,
        });
    }
    all
}

fn random_batch(rng: &mut StdRng, buckets: &[Bucket]) -> Vec<Group> {
    let needs = [0.0, 1.0, 1.0, 1.0, 2.0, 3.0, 7.0, 25.0, 600.0, -2.0, 1e6, 6e11];
    let roles = [Role::Enforced, Role::Enforced, Role::Enforced, Role::Shadow, Role::QuotaMode];
    (0..rng.random_range(1..=3))
        .map(|_| {
            (0..rng.random_range(1..=4))
                .map(|_| {
                    // The key of three specs gets a third of the operations, its fastest spec one
                    // in seven of them, so that faster rates often arrive after slower ones.
                    let b = if rng.random_bool(0.3) {
                        &buckets[buckets.len() - 3 + [0, 1, 1, 1, 2, 2, 2][rng.random_range(0..7)]]
                    } else {
                        &buckets[rng.random_range(0..buckets.len())]
                    };
                    BucketOp {
                        key: b.key.clone(),
                        spec: b.spec,
                        need: needs[rng.random_range(0..needs.len())],
                        unseen: if rng.random_bool(0.2) { 3.0 } else { 0.0 },
                        role: roles[rng.random_range(0..roles.len())],
                        charge: b.charge,
                    }
                })
                .collect()
        })
        .collect()
}

// Up to three replicas' random leases on random buckets: taken, grown, shrunk, renewed, released,
// some short enough to expire between steps.
fn random_leases(rng: &mut StdRng, buckets: &[Bucket]) -> Vec<LeaseOp> {
    let parts = [0.0, 0.1, 0.3, 0.5, 1.0, 2.0];
    (0..rng.random_range(1..=3))
        .map(|_| {
            let b = &buckets[rng.random_range(0..buckets.len())];
            LeaseOp {
                key: b.key.clone(),
                spec: b.spec,
                replica: ["a", "b", "c"][rng.random_range(0..3)].into(),
                capacity: b.spec.capacity() * parts[rng.random_range(0..parts.len())],
                unit: [0.0, 1.0, 3.0][rng.random_range(0..3)],
                refill_per_second: b.spec.refill_per_second() * parts[rng.random_range(0..parts.len())],
                of_unleased: [1.0, 0.5, 1.0 / 3.0][rng.random_range(0..3)],
                ttl_ms: [300, 5_000, 60_000, 900_000][rng.random_range(0..4)],
                demand: [0.0, 0.5, 3.0][rng.random_range(0..3)],
                fresh: rng.random_bool(0.2),
            }
        })
        .collect()
}

// The leases of a bucket's `h` field.
fn leases_in(field: Option<&str>) -> Vec<Lease> {
    parse_leases(field.unwrap_or("")).unwrap()
}

// What the `u` field says was asked of a leased bucket.
fn asked_in(field: Option<&str>) -> Asked {
    let Some(field) = field else { return Asked::default() };
    let words: Vec<&str> = field.split_whitespace().collect();
    Asked {
        previous: words[0].parse().unwrap(),
        current: words[1].parse().unwrap(),
        since_ms: words[2].parse().unwrap(),
    }
}

// The Redis store on `redis`, without coalescing, so that each call is one script run.
fn store_on(redis: &common::Redis) -> RedisStore {
    RedisStore::connect(
        &RedisTarget::Standalone(redis.url()),
        Duration::from_secs(2),
        Duration::ZERO,
        &RedisTls::default(),
    )
    .unwrap()
}

/// Requires every bucket either store wrote at `redis_now` to be the same in both: every field,
/// the leases and the expiry. Returns how many there were.
fn compare_stored(
    keys: &[&str],
    con: &mut redis::Connection,
    memory: &MemoryStore,
    redis_now: u64,
    shift: u64,
    step: &str,
    seen: &mut HashMap<&'static str, usize>,
) -> usize {
    let mut writes = 0;
    for key in keys {
        let fields: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(key)
            .arg(&["t", "l", "r", "p", "q", "c", "s", "h", "u"])
            .query(con)
            .unwrap();
        let expires: i64 = redis::cmd("PEXPIRETIME").arg(key).query(con).unwrap();
        let number = |i: usize| fields[i].as_deref().unwrap().parse::<f64>().unwrap();
        let in_redis = (fields[1].as_deref() == Some(&redis_now.to_string())).then(|| {
            let state = BucketState {
                tokens: number(0),
                last_refill_ms: redis_now,
                fastest_refill: number(2),
                pending_refill: number(3),
                pending_from_ms: number(4) as u64,
                largest_capacity: number(5),
                slowest_refill: number(6),
                leases: leases_in(fields[7].as_deref()),
                asked: asked_in(fields[8].as_deref()),
            };
            (state, expires)
        });
        let in_memory = memory.stored(key).filter(|(s, _)| s.last_refill_ms == redis_now + shift).map(
            |(s, expires_at)| {
                let pending_from_ms = if s.pending_from_ms > 0 { s.pending_from_ms - shift } else { 0 };
                let leases = s
                    .leases
                    .iter()
                    .map(|h| Lease {
                        expires_at_ms: h.expires_at_ms - shift,
                        since_ms: h.since_ms - shift,
                        ..h.clone()
                    })
                    .collect();
                let since_ms = if s.asked.since_ms > 0 { s.asked.since_ms - shift } else { 0 };
                let asked = Asked { since_ms, ..s.asked };
                let state = BucketState { last_refill_ms: redis_now, pending_from_ms, leases, asked, ..s };
                (state, (expires_at - shift) as i64)
            },
        );
        assert_eq!(in_redis, in_memory, "{step} key {key}");
        if let Some((state, _)) = in_redis {
            writes += 1;
            *seen.get_mut("pending").unwrap() += usize::from(state.pending_refill > 0.0);
            *seen.get_mut("mixed").unwrap() += usize::from(state.slowest_refill < state.fastest_refill);
            *seen.get_mut("leased verdict").unwrap() +=
                usize::from(state.leases.iter().any(|h| h.expires_at_ms > redis_now));
            *seen.get_mut("lease expired").unwrap() +=
                usize::from(state.leases.iter().any(|h| h.expires_at_ms <= redis_now));
            *seen.get_mut("banked").unwrap() += usize::from(state.leases.iter().any(|h| h.banked > 0.0));
            *seen.get_mut("asked").unwrap() += usize::from(state.asked.current > 0.0);
        }
    }
    writes
}

/// Replays seed `seed`'s random batches on both stores, requiring identical results; returns how
/// often each case of interest came up (the caller requires each, over all seeds).
async fn replay(seed: u64, redis: &common::Redis) -> HashMap<&'static str, usize> {
    let mut rng = StdRng::seed_from_u64(seed);
    let buckets = buckets(&mut rng);
    let mut keys: Vec<&str> = buckets.iter().map(|b| b.key.as_str()).collect();
    keys.sort();
    keys.dedup();
    let store = store_on(redis);
    let clock = ManualClock::new(0);
    let memory = MemoryStore::with_clock(Arc::new(clock.clone()));
    let mut con = redis.connection();
    let _: () = redis::cmd("FLUSHALL").query(&mut con).unwrap();
    let mut shift = 0u64;
    let mut compared = 0usize;
    let mut writes = 0usize;
    let mut seen =
        HashMap::from([("admitted", 0usize), ("denied", 0), ("debt", 0), ("forgiven", 0), ("capped", 0)]);
    seen.extend([("pending", 0), ("mixed", 0), ("kept longer", 0)]);
    seen.extend([
        ("leased", 0),
        ("lease cut", 0),
        ("leased verdict", 0),
        ("lease expired", 0),
        ("banked", 0),
    ]);
    seen.insert("asked", 0);

    for step in 0..600 {
        if rng.random_bool(0.1) {
            // Let time pass: up to twice the slowest refill of the small buckets.
            let delta = rng.random_range(1..200_000u64);
            // Expiry moves back too, so a bucket expires in Redis exactly when the memory store
            // (whose clock jumps) drops it.
            for key in &keys {
                type Moved = (Option<u64>, Option<u64>, Option<String>, Option<String>);
                let (last, pending_from, leased, asked): Moved =
                    redis::cmd("HMGET").arg(key).arg("l").arg("q").arg("h").arg("u").query(&mut con).unwrap();
                if let (Some(last), Some(pending_from)) = (last, pending_from) {
                    let pending_from = if pending_from > 0 { pending_from - delta } else { 0 };
                    let _: () = redis::cmd("HSET")
                        .arg(key)
                        .arg("l")
                        .arg(last - delta)
                        .arg("q")
                        .arg(pending_from)
                        .query(&mut con)
                        .unwrap();
                    if leased.is_some() {
                        let moved: Vec<String> = leases_in(leased.as_deref())
                            .into_iter()
                            .map(|h| {
                                let (at, since) = (h.expires_at_ms - delta, h.since_ms - delta);
                                let (c, r, d, b) = (h.capacity, h.refill_per_second, h.demand, h.banked);
                                format!("{} {c:.17e} {r:.17e} {at} {d:.17e} {b:.17e} {since}", h.replica)
                            })
                            .collect();
                        let _: () = redis::cmd("HSET")
                            .arg(key)
                            .arg("h")
                            .arg(moved.join(" "))
                            .query(&mut con)
                            .unwrap();
                    }
                    if asked.is_some() {
                        let a = asked_in(asked.as_deref());
                        let moved = format!("{:.17e} {:.17e} {}", a.previous, a.current, a.since_ms - delta);
                        let _: () = redis::cmd("HSET").arg(key).arg("u").arg(moved).query(&mut con).unwrap();
                    }
                    let expires: i64 = redis::cmd("PEXPIRETIME").arg(key).query(&mut con).unwrap();
                    let _: () =
                        redis::cmd("PEXPIREAT").arg(key).arg(expires - delta as i64).query(&mut con).unwrap();
                }
            }
            shift += delta;
            continue;
        }
        if rng.random_bool(0.15) {
            let leases = random_leases(&mut rng, &buckets);
            let from_redis: Vec<_> =
                store.lease(&leases).await.into_iter().map(|r| r.expect("redis answers")).collect();
            let redis_now = from_redis[0].now_ms;
            clock.set(redis_now + shift);
            let from_memory = memory.lease(&leases).await;
            for ((op, r), m) in leases.iter().zip(&from_redis).zip(from_memory) {
                let m = m.unwrap();
                assert_eq!(
                    (r.capacity, r.refill_per_second, r.others),
                    (m.capacity, m.refill_per_second, m.others),
                    "seed {seed} step {step}: {leases:?}"
                );
                *seen.get_mut("leased").unwrap() += usize::from(r.capacity > 0.0);
                *seen.get_mut("lease cut").unwrap() += usize::from(r.capacity < op.capacity);
            }
            compare_stored(
                &keys,
                &mut con,
                &memory,
                redis_now,
                shift,
                &format!("seed {seed} step {step}: {leases:?}"),
                &mut seen,
            );
            continue;
        }
        let batch = random_batch(&mut rng, &buckets);
        let from_redis: Vec<_> = store
            .evaluate(&batch, LateReply::Keep)
            .await
            .into_iter()
            .map(|r| r.expect("redis answers"))
            .collect();
        let redis_now = from_redis[0].now_ms;
        clock.set(redis_now + shift);
        let from_memory = memory.evaluate_now(&batch);
        for (g, (r, m)) in from_redis.iter().zip(&from_memory).enumerate() {
            assert_eq!(r.admitted, m.admitted, "seed {seed} step {step} group {g}: {batch:?}");
            assert_eq!(r.verdicts, m.verdicts, "seed {seed} step {step} group {g}: {batch:?}");
            *seen.get_mut(if r.admitted { "admitted" } else { "denied" }).unwrap() += 1;
            for v in &r.verdicts {
                *seen.get_mut("debt").unwrap() += usize::from(v.tokens < 0.0);
                *seen.get_mut("forgiven").unwrap() += usize::from(v.forgiven > 0.0);
                *seen.get_mut("capped").unwrap() += usize::from(v.reset_ms == MAX_WAIT_MS);
            }
            compared += r.verdicts.len();
        }
        writes += compare_stored(
            &keys,
            &mut con,
            &memory,
            redis_now,
            shift,
            &format!("seed {seed} step {step}: {batch:?}"),
            &mut seen,
        );
        for (g, group) in batch.iter().enumerate() {
            for (op, v) in group.iter().zip(&from_redis[g].verdicts) {
                // Kept longer than the operation's own spec needs: another spec's life or expiry.
                let own = ((op.spec.capacity() + op.charge.floor().abs()) / op.spec.refill_per_second()
                    * 1000.0)
                    .ceil()
                    + 1000.0;
                *seen.get_mut("kept longer").unwrap() += usize::from(v.kept_ms as f64 > own && own < 1e15);
            }
        }
    }
    println!("seed {seed}: {compared} operations and {writes} writes identical; {seen:?}");
    seen
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
    // Each case must come up, over all seeds: one random seed alone may draw few of a rare one.
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for seed in seeds {
        for (what, n) in replay(seed, &redis).await {
            *seen.entry(what).or_default() += n;
        }
    }
    for (what, n) in &seen {
        assert!(*n > 5, "{what} exercised only {n} times: {seen:?}");
    }
}

/// On servers without `PEXPIRETIME` (Redis < 7) the script reports how long a bucket is kept
/// from `PTTL` instead: the same figure, to within the clock reading the two commands take apart.
/// Simulated on Redis 7 by disabling the command (`rename-command PEXPIRETIME ""`).
#[tokio::test(flavor = "multi_thread")]
async fn kept_ms_falls_back_to_pttl_without_pexpiretime() {
    let modern = common::Redis::start();
    let older = common::Redis::start_with(&["--rename-command", "PEXPIRETIME", ""]);
    let absent: redis::RedisResult<i64> = redis::cmd("PEXPIRETIME").arg("x").query(&mut older.connection());
    assert!(absent.is_err(), "the command is gone on the 'older' server");
    let spec = BucketSpec::new(10.0, 0.001).unwrap();
    let op = |need: f64| BucketOp {
        key: "rl:kept:k=v".into(),
        spec,
        need,
        unseen: 0.0,
        role: Role::Enforced,
        charge: Charge::Admitted,
    };
    let mut kept = Vec::new();
    for redis in [&modern, &older] {
        let store = store_on(redis);
        // Written once; then a denial, which writes nothing, reads how long the key is kept.
        let written = store.evaluate(&[vec![op(5.0)]], LateReply::Keep).await.pop().unwrap().unwrap();
        assert!(written.admitted);
        let denied = store.evaluate(&[vec![op(100.0)]], LateReply::Keep).await.pop().unwrap().unwrap();
        assert!(!denied.admitted);
        kept.push((written.verdicts[0].kept_ms, denied.verdicts[0].kept_ms));
    }
    println!("kept_ms (written, read back): with PEXPIRETIME {:?}, with PTTL {:?}", kept[0], kept[1]);
    for (written, read) in &kept {
        assert!(*read <= *written && written - read < 1_000, "{kept:?}");
    }
    // A write never moves an expiry earlier, on either server: a key kept far longer than its
    // spec needs (as an earlier, slower spec may have left it) keeps that expiry.
    for redis in [&modern, &older] {
        let store = store_on(redis);
        let mut con = redis.connection();
        let far: i64 = 900_000_000;
        let _: () = redis::cmd("PEXPIRE").arg("rl:kept:k=v").arg(far).query(&mut con).unwrap();
        let again = store.evaluate(&[vec![op(1.0)]], LateReply::Keep).await.pop().unwrap().unwrap();
        assert!(again.admitted);
        let ttl: i64 = redis::cmd("PTTL").arg("rl:kept:k=v").query(&mut con).unwrap();
        assert!(ttl > far - 1_000 && ttl <= far + 2, "the expiry stands: {ttl} of {far}");
        assert!(again.verdicts[0].kept_ms as i64 >= far - 1_000, "{again:?}");
    }
    // The two servers' buckets were written a few milliseconds apart; their read-backs agree to
    // within the time between the calls and the millisecond PTTL gives away.
    let (a, b) = (kept[0].1 as i64, kept[1].1 as i64);
    assert!((a - b).abs() < 1_000, "{kept:?}");
    assert!(b > 0 && (b as u64) < MAX_WAIT_MS, "a real figure from PTTL: {kept:?}");
}

/// A bucket has at most `MAX_LEASEHOLDERS` leaseholders with live leases, on both twins: the
/// next newcomer is refused and nothing is written for it, a leaseholder already there still
/// renews, and once one releases its lease a newcomer gets one.
#[tokio::test(flavor = "multi_thread")]
async fn both_twins_refuse_a_leaseholder_past_the_most() {
    let redis = common::Redis::start();
    let store = store_on(&redis);
    let clock = ManualClock::new(0);
    let memory = MemoryStore::with_clock(Arc::new(clock.clone()));
    let spec = BucketSpec::new(1_000.0, 1_000.0).unwrap();
    let op = |holder: usize, capacity: f64| LeaseOp {
        key: "rl:{t}:many".into(),
        spec,
        replica: format!("r#{holder}"),
        capacity,
        unit: 1.0,
        refill_per_second: capacity,
        of_unleased: 1.0,
        ttl_ms: 60_000,
        demand: 1.0,
        fresh: false,
    };
    let most = tollgate::bucket::MAX_LEASEHOLDERS;
    // Every leaseholder there, a newcomer, a renewal by the first, a release, the newcomer again.
    let mut steps: Vec<LeaseOp> = (0..most).map(|h| op(h, 5.0)).collect();
    steps.extend([op(most, 5.0), op(0, 6.0), op(1, 0.0), op(most, 5.0)]);
    let mut refused = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let r = store.lease(std::slice::from_ref(step)).await.remove(0).expect("redis answers");
        clock.set(r.now_ms);
        let m = memory.lease(std::slice::from_ref(step)).await.remove(0).unwrap();
        assert_eq!(
            (r.capacity, r.refill_per_second, r.others, r.refused),
            (m.capacity, m.refill_per_second, m.others, m.refused),
            "step {i}"
        );
        refused.push(r.refused);
    }
    let tail: Vec<bool> = refused[most..].to_vec();
    assert_eq!(tail, [true, false, false, false], "newcomer refused; renewal, release, newcomer taken");
    assert!(!refused[..most].contains(&true));
    let field: Option<String> =
        redis::cmd("HGET").arg("rl:{t}:many").arg("h").query(&mut redis.connection()).unwrap();
    assert_eq!(leases_in(field.as_deref()).len(), most, "one released, one taken");
}
