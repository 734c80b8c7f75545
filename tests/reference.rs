//! envoyproxy/ratelimit's own scenarios, answered as that project answers them: `current_limit`
//! echoes the configured limit, a request-level override ignores the rule (no name, never
//! replaced, never shadowed), `quota_mode` descriptors deny only together, `metadata` of the
//! descriptors that passed reaches the response's dynamic metadata, and a denied request charges
//! none of its buckets. Each runs on the embedded store, a standalone Redis and a Redis Cluster,
//! and on Redis the bucket balances are read back.

mod common;

use common::*;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::Struct;

const CONFIG: &str = r#"
domain: ref
descriptors:
  - key: per_minute
    rate_limit: {unit: minute, requests_per_unit: 60}
  - key: per_week
    rate_limit: {unit: week, requests_per_unit: 7}
  - key: blocked
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: named
    rate_limit: {name: named_rule, unit: hour, requests_per_unit: 100}
  - key: replacer
    rate_limit: {replaces: [{name: named_rule}], unit: hour, requests_per_unit: 100}
  - key: shadowed
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: q1
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: q2
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: tagged
    metadata: {team: {name: payments}, tier: gold}
    rate_limit: {unit: hour, requests_per_unit: 1}
"#;

fn current_limit(
    r: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse,
    i: usize,
) -> (u32, i32, String) {
    let l = r.statuses[i].current_limit.as_ref().expect("current_limit");
    (l.requests_per_unit, l.unit, l.name.clone())
}

// Units in the RLS enum: 1 SECOND, 2 MINUTE, 3 HOUR, 4 DAY, 5 MONTH, 6 YEAR, 7 WEEK.
async fn current_limit_is_echoed(addr: &str) {
    let r = ask(addr, req("ref", &["per_minute=echo", "per_week=echo", "blocked=echo"], 1)).await.unwrap();
    assert_eq!(current_limit(&r, 0), (60, 2, String::new()), "60/MINUTE, not 1/SECOND");
    assert_eq!(current_limit(&r, 1), (7, 7, String::new()), "7/WEEK, not 1/DAY");
    assert_eq!(current_limit(&r, 2), (0, 1, String::new()), "0/SECOND, not 0/YEAR");
    assert_eq!(r.overall_code, OVER_LIMIT);
    let r = ask(addr, req("ref", &["named=echo"], 1)).await.unwrap();
    assert_eq!(current_limit(&r, 0), (100, 3, "named_rule".into()));
}

fn with_override(mut request: RateLimitRequest, i: usize, per_minute: u32) -> RateLimitRequest {
    request.descriptors[i].limit = Some(RateLimitOverride { requests_per_unit: per_minute, unit: 2 });
    request
}

async fn override_ignores_replaces_and_shadow(addr: &str) {
    // The override on `named` carries no name, so `replacer` cannot drop it: 1/minute holds.
    let request = with_override(req("ref", &["named=ov", "replacer=ov"], 1), 0, 1);
    let r = ask(addr, request.clone()).await.unwrap();
    assert_eq!(r.overall_code, OK);
    assert_eq!(current_limit(&r, 0), (1, 2, String::new()), "an override has no name");
    let r = ask(addr, request).await.unwrap();
    assert_eq!((r.overall_code, r.statuses[0].code), (OVER_LIMIT, OVER_LIMIT), "the override is enforced");
    // Without the override the named rule is replaced, as before.
    let r = ask(addr, req("ref", &["named=ov2", "replacer=ov2"], 1)).await.unwrap();
    assert!(r.statuses[0].current_limit.is_none());
    // An override on a shadow-mode rule is not shadowed.
    let request = with_override(req("ref", &["shadowed=ov"], 1), 0, 1);
    assert_eq!(ask(addr, request.clone()).await.unwrap().overall_code, OK);
    assert_eq!(ask(addr, request).await.unwrap().overall_code, OVER_LIMIT);
    // And the rule's own bucket was never touched by the override.
    let r = ask(addr, req("ref", &["shadowed=ov"], 1)).await.unwrap();
    assert_eq!(r.statuses[0].limit_remaining, 99);
}

async fn a_denied_request_charges_nothing(addr: &str) {
    let both = req("ref", &["key2=v", "key3=v"], 1);
    let mut codes = Vec::new();
    for _ in 0..15 {
        codes.push(ask(addr, both.clone()).await.unwrap().overall_code);
    }
    assert_eq!(codes.iter().filter(|c| **c == OK).count(), 10);
    assert!(codes[10..].iter().all(|c| *c == OVER_LIMIT));
    // key2 was charged only for the 10 admitted requests.
    let r = ask(addr, req("ref", &["key2=v"], 1)).await.unwrap();
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 9), "20 - 10 - this one");
}

async fn quota_mode_denies_only_together(addr: &str) {
    let both = req("ref", &["q1=a", "q2=a"], 1);
    let r = ask(addr, both.clone()).await.unwrap();
    assert_eq!((r.overall_code, r.statuses[0].code, r.statuses[1].code), (OK, OK, OK));
    // q1 is out; q2 still has 2: the request passes, q1's status says it is over.
    for _ in 0..2 {
        let r = ask(addr, both.clone()).await.unwrap();
        assert_eq!((r.overall_code, r.statuses[0].code, r.statuses[1].code), (OK, OVER_LIMIT, OK));
    }
    // Both out: denied.
    let r = ask(addr, both).await.unwrap();
    assert_eq!(
        (r.overall_code, r.statuses[0].code, r.statuses[1].code),
        (OVER_LIMIT, OVER_LIMIT, OVER_LIMIT)
    );
    // A quota-mode descriptor alone that is over denies.
    assert_eq!(ask(addr, req("ref", &["q1=a"], 1)).await.unwrap().overall_code, OVER_LIMIT);
}

fn string_at<'a>(s: &'a Struct, path: &[&str]) -> Option<&'a str> {
    let (last, init) = path.split_last()?;
    let mut at = s;
    for key in init {
        match &at.fields.get(*key)?.kind {
            Some(Kind::StructValue(inner)) => at = inner,
            _ => return None,
        }
    }
    match &at.fields.get(*last)?.kind {
        Some(Kind::StringValue(v)) => Some(v),
        _ => None,
    }
}

async fn metadata_of_passed_descriptors(addr: &str) {
    let r = ask(addr, req("ref", &["tagged=m", "per_minute=m"], 1)).await.unwrap();
    let m = r.dynamic_metadata.as_ref().expect("dynamic metadata");
    assert_eq!(string_at(m, &["domain"]), Some("ref"));
    assert_eq!(string_at(m, &["metadata", "team", "name"]), Some("payments"));
    assert_eq!(string_at(m, &["metadata", "tier"]), Some("gold"));
    let Some(Kind::ListValue(descriptors)) = &m.fields["descriptors"].kind else { panic!("{m:?}") };
    assert_eq!(descriptors.values.len(), 2);
    // Over the limit: its metadata is left out, and the decision is unchanged by metadata.
    let r = ask(addr, req("ref", &["tagged=m"], 1)).await.unwrap();
    assert_eq!(r.overall_code, OVER_LIMIT);
    assert_eq!(string_at(r.dynamic_metadata.as_ref().unwrap(), &["metadata", "tier"]), None);
}

async fn all_scenarios(addr: &str) {
    current_limit_is_echoed(addr).await;
    override_ignores_replaces_and_shadow(addr).await;
    a_denied_request_charges_nothing(addr).await;
    quota_mode_denies_only_together(addr).await;
    metadata_of_passed_descriptors(addr).await;
}

const FLAGS: &[&str] = &["--response-dynamic-metadata"];

#[tokio::test(flavor = "multi_thread")]
async fn embedded_memory_store() {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, FLAGS);
    all_scenarios(&server.addr()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn standalone_redis() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Redis(redis.url()), FLAGS);
    all_scenarios(&server.addr()).await;
    // The balances behind a_denied_request_charges_nothing, read back from Redis.
    let mut con = redis.connection();
    assert_eq!(stored_tokens(&mut con, "rl:ref:key3=v").round(), 0.0);
    assert_eq!(stored_tokens(&mut con, "rl:ref:key2=v").floor(), 9.0, "20 - 11 admitted, no more");
    // The override's bucket is its own, next to the rule's.
    let keys: Vec<String> = redis::cmd("KEYS").arg("rl:ref:*shadowed=ov").query(&mut con).unwrap();
    let mut keys = keys;
    keys.sort();
    assert_eq!(keys, vec!["rl:ref:=1/minute:shadowed=ov".to_string(), "rl:ref:shadowed=ov".to_string()]);
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_cluster() {
    let cluster = RedisCluster::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Cluster(cluster.seeds()), FLAGS);
    all_scenarios(&server.addr()).await;
}

#[test]
fn an_empty_replaces_entry_gets_the_reference_message() {
    let (_dir, config) = config_file(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{}]}\n",
    );
    let out = std::process::Command::new(tollgate_bin())
        .args(["validate", config.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("should not have an empty replaces entry"), "{err}");
}
