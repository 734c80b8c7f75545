//! A global money budget across regions on one machine (loopback): a global tier on its Redis
//! (`--global-tier`), region `eu` with two replicas on its own Redis and region `us` with one on
//! another, each reaching the global tier through the fault proxy with every answer held back
//! 80 ms. Neutral RLS clients hold and settle LLM calls in both regions until the budget is gone,
//! each `eu` call held on one replica and settled on the other. Read back from the global tier's
//! Redis: the spend is exactly what the admitted calls cost, and within the amount; every
//! region's ledger is reported in full. The regions then deny, with a wait of a second (a lease
//! may grow), not the period's end.
//!
//! A region cut off from the global tier for 20 s spends its lease until the lease's life ends,
//! then denies the budget's calls while the other region spends on; healed, it is granted again
//! within seconds. The global tier charged the lapsed lease whole: its spend is at least what the
//! calls cost, and within the amount.

mod common;

use std::time::{Duration, Instant};

use common::proxy::Fault;
use common::regions::{eu_and_us, explain, global_budget_config, global_tier, region};
use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use tollgate::budget::{Calendar, Money, Per};

// What a call costs: 20 input tokens at 1.00 and 50 output tokens at 10.00 per million, in
// nano-units.
const COST: u128 = 20 * 1_000 + 50 * 10_000;
const AMOUNT: u128 = 200_000_000;

fn hold(id: &str) -> RateLimitRequest {
    let mut r = req("llm", &[&format!("org=acme,model=m,request_id={id}")], 1);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: 100 });
    r
}

fn settle(id: &str) -> RateLimitRequest {
    let path = format!("org=acme,model=m,request_id={id}");
    let mut r = req("llm", &[&format!("{path},usage=input"), &format!("{path},usage=output")], 1);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: 20 });
    r.descriptors[1].hits_addend = Some(UInt64Value { value: 50 });
    r
}

// Holds calls on `holds` and settles them on `settles` until `until` or 3 s of denials (a lease
// spent grows at the next round, a second away); the calls admitted.
async fn spend(region: &str, holds: String, settles: String, until: Instant) -> u64 {
    let (mut admitted, mut n) = (0, 0);
    let mut last_admitted = Instant::now();
    while Instant::now() < until && last_admitted.elapsed() < Duration::from_secs(3) {
        n += 1;
        let id = format!("{region}-{n}");
        let r = ask(&holds, hold(&id)).await.expect("answer");
        if r.overall_code == OK {
            let s = ask(&settles, settle(&id)).await.expect("answer");
            assert_eq!(s.overall_code, OK, "a settlement is answered OK");
            admitted += 1;
            last_admitted = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    admitted
}

// Sends `addr` a call every 50 ms (held, then settled) until `until`; when each was admitted.
async fn paced(region: &str, addr: String, until: Instant) -> Vec<Instant> {
    let mut admitted = Vec::new();
    let mut n = 0;
    while Instant::now() < until {
        n += 1;
        let id = format!("{region}-p{n}");
        if ask(&addr, hold(&id)).await.expect("answer").overall_code == OK {
            assert_eq!(ask(&addr, settle(&id)).await.expect("answer").overall_code, OK);
            admitted.push(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    admitted
}

// The global budget's spent and held money at the global tier's Redis.
fn global_ledger(redis: &Redis) -> (u128, u128) {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let start = Calendar::new(Per::Month, "UTC").unwrap().window(now).start_ms;
    let key = format!("rl:{{acme}}:llm:org=acme:budget:{start}");
    let (s, h): (Option<String>, Option<String>) =
        redis::cmd("HMGET").arg(&key).arg("s").arg("h").query(&mut redis.connection()).unwrap();
    let money = |t: Option<String>| t.and_then(|t| Money::from_nanos(&t)).map_or(0, |m| m.0);
    (money(s), money(h))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_global_budget_is_spent_across_regions_and_read_back_exactly() {
    let (_dir, config) = config_file(&global_budget_config("0.20", "60s"));
    let validate = std::process::Command::new(tollgate_bin()).arg("validate").arg(&config).output().unwrap();
    let said = String::from_utf8_lossy(&validate.stdout);
    assert!(
        said.contains("global: org budget (one budget for every region"),
        "validate says which budget is global: {said}"
    );
    let global_redis = Redis::start();
    let global = global_tier(&config, &Backend::Redis(global_redis.url()));
    let (eu_redis, us_redis) = (Redis::start(), Redis::start());
    let at = |name: &str, redis: &Redis| {
        region(&config, &Backend::Redis(redis.url()), &global, (name, Duration::from_millis(80)), &[])
    };
    let eu = [at("eu", &eu_redis), at("eu", &eu_redis)];
    let (us, _us_proxy) = at("us", &us_redis);

    let until = Instant::now() + Duration::from_secs(40);
    let loads = [
        tokio::spawn(spend("eu", eu[0].0.addr(), eu[1].0.addr(), until)),
        tokio::spawn(spend("us", us.addr(), us.addr(), until)),
    ];
    let mut admitted = Vec::new();
    for l in loads {
        admitted.push(l.await.unwrap());
    }
    let calls: u64 = admitted.iter().sum();
    let cost = u128::from(calls) * COST;
    println!("admitted (eu, us): {admitted:?}; {cost} of {AMOUNT} nano-units");
    assert!(admitted.iter().all(|n| *n > 0), "both regions spend: {admitted:?}");
    assert!(cost <= AMOUNT, "the world spent {cost}, above the budget of {AMOUNT}");
    // The regions' leases end near the amount: what is left is less than a few calls' holds.
    assert!(cost >= AMOUNT * 9 / 10, "the world spent {cost} of {AMOUNT}: the leases are used");

    // Every replica reports its ledger with its next renewal, at most a lease's life less 6 s
    // away: the spend read back exactly.
    let deadline = Instant::now() + Duration::from_secs(8);
    let mut ledger = global_ledger(&global_redis);
    while ledger.0 != cost && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        ledger = global_ledger(&global_redis);
    }
    println!("global ledger: spent {}, held {}", ledger.0, ledger.1);
    assert_eq!(ledger.0, cost, "the global tier's spend is what the admitted calls cost");
    assert!(ledger.0 + ledger.1 <= AMOUNT, "spent and held within the amount: {ledger:?}");

    // `tollgate explain` on the global tier's Redis shows each region replica's money lease.
    let explained = explain(&config, "llm", "org=acme,model=m,request_id=x", &global_redis.url());
    println!("{explained}");
    assert!(explained.contains("global: one budget for every region"), "{explained}");
    for region in ["eu", "us"] {
        assert!(explained.contains(&format!("USD granted to region:{region}/")), "{explained}");
    }
    // On a region's Redis it says where that store keeps the region's spend, not a full budget.
    let explained = explain(&config, "llm", "org=acme,model=m,request_id=x", &us_redis.url());
    assert!(
        explained.contains("holds no region's lease") && explained.contains(":lease:<region>/<replica>"),
        "{explained}"
    );
    // A region replica's /budgets: the budget worldwide as the global tier last answered it, and
    // its own money lease and ledger.
    let (status, body) = http_get(us.http, "/budgets?domain=llm&org=acme").expect("/budgets");
    assert_eq!(status, 200, "{body}");
    let standing: serde_json::Value = serde_json::from_str(&body).unwrap();
    let org = &standing["levels"][0];
    let nanos = |v: &serde_json::Value| Money::parse(v.as_str().unwrap()).ok().map(|m| m.0);
    let (spent, left) = (nanos(&org["spent"]), nanos(&org["left"]));
    assert!(
        spent.is_some_and(|s| s >= cost * 9 / 10),
        "the world's spend, not this region's store's: {body}"
    );
    assert!(left.is_some_and(|l| l < AMOUNT / 10), "{body}");
    let lease = &org["lease"];
    assert!(lease["holder"].as_str().unwrap().starts_with("us/"), "{body}");
    let here = nanos(&lease["spent"]).unwrap();
    assert!(here > 0 && here < cost, "us's own ledger: part of the world's spend: {body}");

    // Spent out: a region denies, and says to come back in a second.
    let r = ask(&us.addr(), hold("us-after")).await.unwrap();
    assert_eq!(r.overall_code, OVER_LIMIT);
    assert_eq!(header(&r, "X-Budget-Exhausted"), Some("org"));
    assert_eq!(header(&r, "Retry-After"), Some("1"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_region_cut_off_spends_its_lease_then_denies_and_comes_back() {
    let (_dir, config) = config_file(&global_budget_config("5.00", "60s"));
    let global_redis = Redis::start();
    let global = global_tier(&config, &Backend::Redis(global_redis.url()));
    let (regions, proxies) = eu_and_us(&config, &global, Duration::from_millis(80));

    // Both spend for 3 s; then us is cut off for 20 s, and healed.
    let start = Instant::now();
    let cut_at = start + Duration::from_secs(3);
    let heal_at = cut_at + Duration::from_secs(20);
    let end = heal_at + Duration::from_secs(6);
    let eu = tokio::spawn(paced("eu", regions[0].addr(), end));
    let us = tokio::spawn(paced("us", regions[1].addr(), end));
    tokio::time::sleep_until(cut_at.into()).await;
    proxies[1].set(Fault::Blackhole);
    tokio::time::sleep_until(heal_at.into()).await;
    proxies[1].set(Fault::DelayReplies(Duration::from_millis(80)));
    let (eu, us) = (eu.await.unwrap(), us.await.unwrap());

    let secs = |t: &Instant| t.duration_since(cut_at).as_secs_f64();
    let us_cut: Vec<f64> = us.iter().map(secs).filter(|s| (0.0..20.0).contains(s)).collect();
    let last_on_lease = us_cut.iter().copied().fold(0.0, f64::max);
    let back = us.iter().map(secs).find(|s| *s >= 20.0);
    let eu_cut = eu.iter().map(secs).filter(|s| (0.0..20.0).contains(s)).count();
    println!(
        "us, cut off: {} admitted, the last {last_on_lease:.1} s after the cut; back {back:?} s after it; eu admitted {eu_cut} meanwhile",
        us_cut.len()
    );
    assert!(!us_cut.is_empty() && us_cut[0] < 1.0, "cut off, us spends its lease at first: {us_cut:?}");
    assert!(
        last_on_lease <= 11.0,
        "us denies once its lease's life (10 s) is over: the last at {last_on_lease:.1} s"
    );
    assert!(eu_cut >= 300, "eu spends on through the cut: {eu_cut} calls in 20 s");
    let back = back.expect("us is granted again after the heal");
    assert!(back <= 25.0, "us is back within 5 s of the heal: {back:.1} s after the cut");
    let scrape = regions[1].metrics();
    let denied = sample(&scrape, "tollgate_global_fallbacks_total", &[("fallback", "deny")]);
    assert!(denied > 0.0, "us counts the calls its lapsed lease denied");
    assert_eq!(sample(&scrape, "tollgate_global_budget_leases", &[]), 1.0, "us holds one money lease");

    // The lapsed lease was charged whole: the global tier's spend is at least what the calls
    // cost (exactly that plus us's lease's unspent part) and within the amount.
    // A replica reports with its next renewal, at most a lease's life less 6 s away.
    let cost = (eu.len() + us.len()) as u128 * COST;
    let deadline = Instant::now() + Duration::from_secs(8);
    let (mut spent, mut held) = global_ledger(&global_redis);
    while spent < cost && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        (spent, held) = global_ledger(&global_redis);
    }
    println!("calls cost {cost}; the global tier: spent {spent}, held {held}");
    assert!(spent >= cost, "the world's calls cost {cost}, the global tier counts {spent}");
    assert!(spent + held <= 5 * 1_000_000_000, "spent and held within the amount");
}

// A region replica stopped in order (SIGTERM: a rolling restart, a scale-down) hands its money
// lease back down to what it committed before it exits: the global tier then holds none of the
// lease's unspent part (which would lapse 10 s later and be charged whole) and counts exactly
// what the calls cost.
#[tokio::test(flavor = "multi_thread")]
async fn a_region_replica_stopped_in_order_hands_its_lease_back() {
    let (_dir, config) = config_file(&global_budget_config("5.00", "60s"));
    let global_redis = Redis::start();
    let global = global_tier(&config, &Backend::Redis(global_redis.url()));
    let (mut eu, _proxy) = region(
        &config,
        &Backend::Memory,
        &global,
        ("eu", Duration::from_millis(5)),
        &["--drain-delay", "0s"],
    );
    let admitted = paced("eu", eu.addr(), Instant::now() + Duration::from_secs(2)).await.len() as u128;
    assert!(admitted >= 20, "eu spends: {admitted} calls");
    let (_, held) = global_ledger(&global_redis);
    assert!(held > 0, "while eu runs, its lease's unspent part is held at the global tier");
    eu.proc.signal("TERM");
    assert!(eu.proc.wait_exit(Duration::from_secs(10)).is_some_and(|s| s.success()), "eu drains and exits");
    let (spent, held) = global_ledger(&global_redis);
    assert_eq!(
        (spent, held),
        (admitted * COST, 0),
        "the global tier: spent what the calls cost, nothing held"
    );
}
