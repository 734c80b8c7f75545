//! A global money budget across regions on one machine (loopback): a global tier on its Redis
//! (`--global-tier`), region `eu` with two replicas on its own Redis and region `us` with one on
//! another, each reaching the global tier through the fault proxy with every answer held back
//! 80 ms. Neutral RLS clients hold and settle LLM calls in both regions until the budget is gone,
//! each `eu` call held on one replica and settled on the other. Read back from the global tier's
//! Redis: the spend is exactly what the admitted calls cost, and within the amount; every
//! region's ledger is reported in full. The regions then deny, with a wait of a second (a lease
//! may grow), not the period's end.

mod common;

use std::time::{Duration, Instant};

use common::proxy::{Fault, FaultProxy};
use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use tollgate::budget::{Calendar, Money, Per};

const CONFIG: &str = r#"
domain: llm
tenant_key: org
hold_ttl: 60s
on_lost_settle: charge
prices:
  version: "v1"
  currency: USD
  models:
    m: {input: 1.00, output: 10.00, reserve_input_tokens: 100}
descriptors:
  - key: org
    budget: {amount: 0.20, per: month}
    global: true
    descriptors:
      - key: model
        descriptors:
          - key: request_id
"#;
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
    let (_dir, config) = config_file(CONFIG);
    let validate = std::process::Command::new(tollgate_bin()).arg("validate").arg(&config).output().unwrap();
    let said = String::from_utf8_lossy(&validate.stdout);
    assert!(
        said.contains("global: org budget (one budget for every region"),
        "validate says which budget is global: {said}"
    );
    let global_redis = Redis::start();
    let global = Tollgate::start(&config, &Backend::Redis(global_redis.url()), &["--global-tier"]);
    let global_port: u16 = global.addr().rsplit(':').next().unwrap().parse().unwrap();
    let (eu_redis, us_redis) = (Redis::start(), Redis::start());
    let proxies: Vec<FaultProxy> = (0..3).map(|_| FaultProxy::start(global_port)).collect();
    let region = |name: &str, redis: &Redis, proxy: &FaultProxy| {
        proxy.set(Fault::DelayReplies(Duration::from_millis(80)));
        let url = format!("http://127.0.0.1:{}", proxy.port);
        Tollgate::start(&config, &Backend::Redis(redis.url()), &["--global-url", &url, "--region", name])
    };
    let eu = [region("eu", &eu_redis, &proxies[0]), region("eu", &eu_redis, &proxies[1])];
    let us = region("us", &us_redis, &proxies[2]);

    let until = Instant::now() + Duration::from_secs(40);
    let loads = [
        tokio::spawn(spend("eu", eu[0].addr(), eu[1].addr(), until)),
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

    // Every replica reports its ledger within a round or two: the spend read back exactly.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut ledger = global_ledger(&global_redis);
    while ledger.0 != cost && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        ledger = global_ledger(&global_redis);
    }
    println!("global ledger: spent {}, held {}", ledger.0, ledger.1);
    assert_eq!(ledger.0, cost, "the global tier's spend is what the admitted calls cost");
    assert!(ledger.0 + ledger.1 <= AMOUNT, "spent and held within the amount: {ledger:?}");

    // Spent out: a region denies, and says to come back in a second.
    let r = ask(&us.addr(), hold("us-after")).await.unwrap();
    assert_eq!(r.overall_code, OVER_LIMIT);
    assert_eq!(header(&r, "X-Budget-Exhausted"), Some("org"));
    assert_eq!(header(&r, "Retry-After"), Some("1"));
}
