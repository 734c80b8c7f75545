//! `charge: always`: the cost known after the response (LLM tokens) is always charged, even past
//! zero, down to `-max_debt`; a check (hits 0) is denied while the balance is below zero, with a
//! Retry-After that says when it is back to zero. On the embedded store, a standalone Redis and
//! a Redis Cluster, with balances read back from Redis.

mod common;

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;

const CONFIG: &str = r#"
domain: llm
default_tier: free
tiers:
  free:
    default: {capacity: 100, refill_per_second: 0.001}
    tokens: {capacity: 1000, refill_per_second: 10}
descriptors:
  - key: tenant
    quota: tenant
    descriptors:
      - key: meter
        value: tokens
        class: tokens
        quota: tenant
        charge: always
  - key: plain
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: metered
    token_bucket: {capacity: 10, refill_per_second: 0.001}
    charge: always
    max_debt: 5
"#;

fn tokens(tenant: &str, hits: u64) -> RateLimitRequest {
    let mut r = req("llm", &[&format!("tenant={tenant},meter=tokens")], 1);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: hits });
    r
}

fn remaining(r: &RateLimitResponse) -> (i32, u32, Option<&str>, Option<&str>) {
    (
        r.overall_code,
        r.statuses[0].limit_remaining,
        header(r, "X-RateLimit-Remaining"),
        header(r, "Retry-After"),
    )
}

async fn check_then_charge(addr: &str, tenant: &str) {
    // Round 1: the check passes, the response cost 600.
    assert_eq!(remaining(&ask(addr, tokens(tenant, 0)).await.unwrap()).0, OK);
    assert_eq!(ask(addr, tokens(tenant, 600)).await.unwrap().statuses[0].limit_remaining, 400);
    // Round 2: 400 left, the check passes, the response cost 600 again: 200 in debt.
    assert_eq!(remaining(&ask(addr, tokens(tenant, 0)).await.unwrap()).0, OK);
    let charged = ask(addr, tokens(tenant, 600)).await.unwrap();
    assert_eq!(charged.overall_code, OVER_LIMIT, "600 > 400: the charge is denied, yet taken");
    // Round 3: the check is denied while in debt; Retry-After says when the balance is back to
    // zero (200 tokens at 10/s), and the remaining count never goes below zero.
    let r = ask(addr, tokens(tenant, 0)).await.unwrap();
    let (code, left, x_remaining, retry) = remaining(&r);
    assert_eq!((code, left, x_remaining), (OVER_LIMIT, 0, Some("0")));
    let retry: u64 = retry.expect("Retry-After").parse().unwrap();
    assert!((19..=20).contains(&retry), "Retry-After {retry}");
    let reset = r.statuses[0].duration_until_reset.as_ref().unwrap().seconds;
    assert!((119..=120).contains(&reset), "back to full: 1200 tokens at 10/s, got {reset}");
}

async fn debt_has_a_floor(addr: &str) {
    // max_debt 5: a charge of 100 on a 10-token bucket leaves -5; 85 are forgiven.
    let mut r = req("llm", &["metered=a"], 1);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: 100 });
    assert_eq!(ask(addr, r).await.unwrap().overall_code, OVER_LIMIT);
    let mut check = req("llm", &["metered=a"], 1);
    check.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    let r = ask(addr, check).await.unwrap();
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    assert!((4_990..=5_000).contains(&retry), "5 tokens of debt at 0.001/s: {retry}");
}

async fn only_admitted_charges_are_all_or_nothing(addr: &str) {
    // `plain` (1/hour) is spent; a request with it and a charge: the charge is taken, `plain`
    // is not (it had nothing to take), and the request is denied.
    assert_eq!(ask(addr, req("llm", &["plain=x"], 1)).await.unwrap().overall_code, OK);
    let mut both = req("llm", &["plain=x", "tenant=aon,meter=tokens"], 1);
    both.descriptors[1].hits_addend = Some(UInt64Value { value: 300 });
    let r = ask(addr, both).await.unwrap();
    assert_eq!((r.overall_code, r.statuses[1].limit_remaining), (OVER_LIMIT, 700));
}

async fn all_scenarios(addr: &str) {
    check_then_charge(addr, "t1").await;
    debt_has_a_floor(addr).await;
    only_admitted_charges_are_all_or_nothing(addr).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn embedded_memory_store() {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, &[]);
    all_scenarios(&server.addr()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn standalone_redis() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    all_scenarios(&server.addr()).await;
    let mut con = redis.connection();
    let t = stored_tokens(&mut con, "rl:{t1}:llm:tokens");
    assert!((-200.0..=-150.0).contains(&t), "in debt in Redis (refilling at 10/s since): {t}");
    let t = stored_tokens(&mut con, "rl:llm:metered=a");
    assert!((-5.0..=-4.99).contains(&t), "at the floor: {t}");
    let forgiven = sample(&server.metrics(), "tollgate_debt_forgiven_tokens_total", &[("domain", "llm")]);
    assert_eq!(forgiven, 85.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_cluster() {
    let cluster = RedisCluster::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Cluster(cluster.seeds()), &[]);
    all_scenarios(&server.addr()).await;
}
