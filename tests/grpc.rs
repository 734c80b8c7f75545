//! gRPC end to end: the real `tollgate` binary, asked by a tonic client, on each backend
//! (embedded memory, standalone Redis, Redis Cluster). Every scenario uses its own keys, so all
//! of them share one server per backend.

mod common;

use common::*;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::google::protobuf::UInt64Value;
use tonic::Code;

const CONFIG: &str = r#"
domain: test
default_tier: free
tiers:
  free:
    default: {capacity: 5, refill_per_second: 0.001}
    export: {capacity: 50, refill_per_second: 0.001}
descriptors:
  - key: per_minute
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: tenant
    quota: tenant
    descriptors:
      - key: class
        value: export
        class: export
        cost: 25
        quota: tenant
  - key: shadowed
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: free_pass
    rate_limit: {unlimited: true}
  - key: whitelisted
  - key: team
    value: a
    descriptors:
      - key: user
        rate_limit: {name: team_user, unit: hour, requests_per_unit: 1}
  - key: vip
    descriptors:
      - key: user
        rate_limit: {replaces: [{name: team_user}], unit: hour, requests_per_unit: 100}
"#;

async fn twenty_per_minute(addr: &str) {
    for expected_remaining in (0..20).rev() {
        let r = ask(addr, req("test", &["per_minute=a"], 1)).await.unwrap();
        assert_eq!(r.overall_code, OK);
        let s = &r.statuses[0];
        assert_eq!(s.limit_remaining, expected_remaining);
        let limit = s.current_limit.as_ref().expect("current_limit");
        assert_eq!((limit.requests_per_unit, limit.unit), (20, 2), "20 per MINUTE");
        assert_eq!(header(&r, "X-RateLimit-Limit"), Some("20"));
        assert_eq!(header(&r, "X-RateLimit-Remaining"), Some(expected_remaining.to_string().as_str()));
        assert_eq!(header(&r, "Retry-After"), None);
    }
    let r = ask(addr, req("test", &["per_minute=a"], 1)).await.unwrap();
    assert_eq!(r.overall_code, OVER_LIMIT);
    assert_eq!(r.statuses[0].code, OVER_LIMIT);
    // One token every 3 s, and the last refill is at most a few ms old.
    let retry: u64 = header(&r, "Retry-After").expect("Retry-After").parse().unwrap();
    assert!((2..=3).contains(&retry), "Retry-After {retry}");
    // Another value of the key-only rule has its own bucket.
    let r = ask(addr, req("test", &["per_minute=b"], 1)).await.unwrap();
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 19));
}

async fn weighted_cost(addr: &str) {
    let export = "tenant=weighted,class=export";
    for remaining in [25, 0] {
        let r = ask(addr, req("test", &[export], 1)).await.unwrap();
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, remaining));
    }
    let r = ask(addr, req("test", &[export], 1)).await.unwrap();
    assert_eq!(r.overall_code, OVER_LIMIT);
    // 25 tokens at 0.001/s.
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    assert!((24_990..=25_000).contains(&retry), "Retry-After {retry}");
    // hits_addend multiplies the cost: 2 hits x 25 > 0 left.
    let r = ask(addr, req("test", &["tenant=weighted2,class=export"], 2)).await.unwrap();
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 0));
}

async fn hits_addend_zero_only_checks(addr: &str) {
    let mut request = req("test", &["per_minute=check"], 1);
    request.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    for _ in 0..3 {
        let r = ask(addr, request.clone()).await.unwrap();
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 20));
    }
    // A descriptor's own hits_addend beats the request's.
    let mut request = req("test", &["per_minute=check"], 7);
    request.descriptors[0].hits_addend = Some(UInt64Value { value: 3 });
    let r = ask(addr, request).await.unwrap();
    assert_eq!(r.statuses[0].limit_remaining, 17);
}

async fn limit_override(addr: &str) {
    let mut request = req("test", &["per_minute=override"], 1);
    request.descriptors[0].limit = Some(RateLimitOverride { requests_per_unit: 2, unit: 3 }); // per HOUR
    for remaining in [1, 0] {
        let r = ask(addr, request.clone()).await.unwrap();
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, remaining));
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (2, 3));
    }
    assert_eq!(ask(addr, request.clone()).await.unwrap().overall_code, OVER_LIMIT);
    // An override applies even where no rule matches.
    let mut request = req("test", &["nothing_configured=x"], 1);
    request.descriptors[0].limit = Some(RateLimitOverride { requests_per_unit: 1, unit: 1 });
    assert_eq!(ask(addr, request.clone()).await.unwrap().overall_code, OK);
    assert_eq!(ask(addr, request.clone()).await.unwrap().overall_code, OVER_LIMIT);
    // Unit UNKNOWN is refused.
    request.descriptors[0].limit = Some(RateLimitOverride { requests_per_unit: 1, unit: 0 });
    assert_eq!(ask(addr, request).await.unwrap_err().code(), Code::InvalidArgument);
}

async fn shadow_mode_never_denies(addr: &str) {
    for remaining in [0, 0, 0] {
        let r = ask(addr, req("test", &["shadowed=x"], 1)).await.unwrap();
        assert_eq!((r.overall_code, r.statuses[0].code), (OK, OK));
        assert_eq!(r.statuses[0].limit_remaining, remaining, "the bucket is still evaluated");
        assert_eq!(header(&r, "Retry-After"), None);
    }
}

async fn unlimited_and_whitelisted(addr: &str) {
    let r = ask(addr, req("test", &["free_pass=x", "whitelisted=y", "unknown_key=z"], 1)).await.unwrap();
    assert_eq!(r.overall_code, OK);
    assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
    for s in &r.statuses {
        assert_eq!(s.code, OK);
    }
    assert!(r.statuses[1].current_limit.is_none() && r.statuses[2].current_limit.is_none());
    assert!(r.response_headers_to_add.is_empty(), "no bucket, no headers");
}

async fn replaces_drops_the_replaced_rule(addr: &str) {
    let both = req("test", &["team=a,user=rep", "vip=1,user=rep"], 1);
    for _ in 0..3 {
        let r = ask(addr, both.clone()).await.unwrap();
        assert_eq!(r.overall_code, OK);
        assert!(r.statuses[0].current_limit.is_none(), "team_user is replaced");
        assert_eq!(r.statuses[1].current_limit.as_ref().unwrap().requests_per_unit, 100);
    }
    // The replaced bucket was never touched: its one request per hour is still there.
    let alone = req("test", &["team=a,user=rep"], 1);
    assert_eq!(ask(addr, alone.clone()).await.unwrap().overall_code, OK);
    assert_eq!(ask(addr, alone).await.unwrap().overall_code, OVER_LIMIT);
}

async fn unknown_domain_is_ok(addr: &str) {
    let r = ask(addr, req("nope", &["per_minute=a", "tenant=x"], 1)).await.unwrap();
    assert_eq!(r.overall_code, OK);
    assert_eq!(r.statuses.len(), 2);
    assert!(r.statuses.iter().all(|s| s.code == OK && s.current_limit.is_none()));
}

async fn invalid_requests(addr: &str) {
    let mut empty_key = req("test", &["per_minute=a"], 1);
    empty_key.descriptors[0].entries[0].key.clear();
    let mut no_entries = req("test", &["per_minute=a"], 1);
    no_entries.descriptors[0].entries.clear();
    let cases = vec![
        ("empty domain", req("", &["per_minute=a"], 1)),
        ("no descriptors", req("test", &[], 1)),
        ("65 descriptors", req("test", &vec!["per_minute=many"; 65], 1)),
        ("long key", req("test", &[&format!("{}=v", "k".repeat(1025))], 1)),
        ("long value", req("test", &[&format!("per_minute={}", "v".repeat(1025))], 1)),
        ("empty key", empty_key),
        ("no entries", no_entries),
    ];
    for (what, request) in cases {
        let err = ask(addr, request).await.expect_err(what);
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err:?}");
        assert!(!err.message().is_empty());
    }
    // 64 descriptors are fine.
    let r = ask(addr, req("test", &vec!["per_minute=many"; 64], 1)).await.unwrap();
    assert_eq!(r.statuses.len(), 64);
}

async fn all_or_nothing(addr: &str) {
    let tenant = "tenant=aon";
    let export = "tenant=aon,class=export";
    // Drain the export bucket (50 tokens, cost 25).
    for _ in 0..2 {
        assert_eq!(ask(addr, req("test", &[export], 1)).await.unwrap().overall_code, OK);
    }
    let r = ask(addr, req("test", &[tenant, export], 1)).await.unwrap();
    assert_eq!(r.overall_code, OVER_LIMIT);
    assert_eq!((r.statuses[0].code, r.statuses[0].limit_remaining), (OK, 5), "tenant-wide bucket untouched");
    assert_eq!(r.statuses[1].code, OVER_LIMIT);
    assert_eq!(header(&r, "X-RateLimit-Limit"), Some("50"), "headers describe the denying bucket");
    let r = ask(addr, req("test", &[tenant], 1)).await.unwrap();
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 4));
}

async fn all_scenarios(addr: &str) {
    twenty_per_minute(addr).await;
    weighted_cost(addr).await;
    hits_addend_zero_only_checks(addr).await;
    limit_override(addr).await;
    shadow_mode_never_denies(addr).await;
    unlimited_and_whitelisted(addr).await;
    replaces_drops_the_replaced_rule(addr).await;
    unknown_domain_is_ok(addr).await;
    invalid_requests(addr).await;
    all_or_nothing(addr).await;
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
    // State really lives in Redis, under the documented keys.
    let mut con = redis.connection();
    let tokens = stored_tokens(&mut con, "rl:{aon}:test:tenant=aon");
    assert_eq!(tokens.floor(), 4.0);
    let ttl: i64 = redis::cmd("PTTL").arg("rl:{aon}:test:tenant=aon").query(&mut con).unwrap();
    assert!(ttl > 0, "idle buckets expire");
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_cluster() {
    let cluster = RedisCluster::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Cluster(cluster.seeds()), &[]);
    all_scenarios(&server.addr()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn global_shadow_mode() {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, &["--shadow-mode"]);
    for _ in 0..25 {
        let r = ask(&server.addr(), req("test", &["per_minute=g"], 1)).await.unwrap();
        assert_eq!(r.overall_code, OK);
    }
    let r = ask(&server.addr(), req("test", &["per_minute=g"], 1)).await.unwrap();
    assert_eq!(r.statuses[0].limit_remaining, 0, "limits are still evaluated");
}
