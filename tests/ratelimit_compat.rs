//! tollgate in envoyproxy/ratelimit's place, started only with its environment: file configs
//! from `RUNTIME_*` on a ConfigMap mount (`..data` swaps reload, a bad file keeps the last good),
//! and its metrics under its names, as statsd (read by a UDP listener here and mapped with Envoy
//! Gateway's statsd_exporter rules) and mapped in process for Prometheus with that same file.

mod common;

use std::collections::BTreeMap;
use std::net::UdpSocket;
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tollgate::telemetry::mapper::{Mapper, StatKind};

const ENVOY_GATEWAY_MAPPING: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/envoy-gateway/statsd_conf.yaml");

fn rules(per_hour: u32) -> String {
    format!(
        "domain: api\ndescriptors:\n  - key: route\n    value: r\n    descriptors:\n      - key: user\n        rate_limit: {{unit: HOUR, requests_per_unit: {per_hour}}}\n  - key: path\n    rate_limit: {{unit: HOUR, requests_per_unit: {per_hour}}}\n"
    )
}

// Sends `n` single hits and returns how many were admitted.
async fn hits(server: &Tollgate, descriptor: &str, n: u32) -> u32 {
    let mut ok = 0;
    for _ in 0..n {
        let r = ask(&server.addr(), req("api", &[descriptor], 1)).await.unwrap();
        ok += u32::from(r.overall_code == Code::Ok as i32);
    }
    ok
}

async fn limit(server: &Tollgate) -> String {
    let r = ask(&server.addr(), req("api", &["path=/x"], 0)).await.unwrap();
    r.statuses[0].current_limit.as_ref().map_or("-".into(), |l| l.requests_per_unit.to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn runtime_settings_and_configmap_swaps_reload() {
    let mut cm = ConfigMap::nested("ratelimit/config", &rules(3));
    let root = cm.top().to_str().unwrap().to_owned();
    let redis = Redis::start();
    let redis_at = redis.addr();
    let server = Tollgate::start_as_ratelimit(&[
        ("RUNTIME_ROOT", root.as_str()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", redis_at.as_str()),
    ])
    .wait_ready();
    assert_eq!(hits(&server, "path=/x", 5).await, 3);

    cm.publish(&rules(7));
    let deadline = Instant::now() + Duration::from_secs(10);
    while limit(&server).await != "7" {
        assert!(Instant::now() < deadline, "the swapped-in limit never served");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cm.publish(
        "domain: api\ndescriptors:\n  - key: path\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
    );
    wait_until("the bad file rejected", 500, Duration::from_millis(20), || {
        server.log().contains("config rejected; the previous config keeps serving")
    });
    assert_eq!(limit(&server).await, "7", "a bad file keeps the last good config");
}

// The statsd lines in `datagrams`, mapped: (name, labels) -> summed counter.
fn mapped_counters(mapper: &Mapper, datagrams: &[String]) -> BTreeMap<(String, String), f64> {
    let mut sums = BTreeMap::new();
    for line in datagrams.iter().flat_map(|d| d.lines()) {
        let (name, rest) = line.split_once(':').expect("name:value|type");
        let mut parts = rest.split('|');
        let value: f64 = parts.next().unwrap().parse().unwrap();
        let kind = match parts.next().unwrap() {
            "c" => StatKind::Counter,
            "g" => StatKind::Gauge,
            "ms" => StatKind::Timer,
            other => panic!("statsd type {other} in {line}"),
        };
        let Some(mapped) = mapper.map(name, kind) else { continue };
        let labels = mapped.labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
        *sums.entry((mapped.name, labels)).or_default() += if kind == StatKind::Timer { 1.0 } else { value };
    }
    sums
}

#[tokio::test(flavor = "multi_thread")]
async fn statsd_carries_envoyproxy_ratelimits_names_and_counts() {
    let (_dir, config) = config_file(&rules(5));
    let redis = Redis::start();
    let redis_at = redis.addr();
    let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
    listener.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let dir = config.parent().unwrap().to_str().unwrap().to_owned();
    let server = Tollgate::start_as_ratelimit(&[
        ("RUNTIME_ROOT", dir.as_str()),
        ("RUNTIME_APPDIRECTORY", "."),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", redis_at.as_str()),
        ("USE_STATSD", "true"),
        ("STATSD_HOST", "127.0.0.1"),
        ("STATSD_PORT", port.as_str()),
        ("STATS_FLUSH_INTERVAL", "100ms"),
    ])
    .wait_ready();
    assert_eq!(hits(&server, "path=/x", 7).await, 5);
    assert_eq!(hits(&server, "route=r,user=alice", 2).await, 2);

    let mapper = Mapper::parse(&std::fs::read_to_string(ENVOY_GATEWAY_MAPPING).unwrap()).unwrap();
    let mut datagrams = Vec::new();
    let mut counters = BTreeMap::new();
    let want = |c: &BTreeMap<(String, String), f64>, name: &str, labels: &str| {
        c.get(&(name.to_owned(), labels.to_owned())).copied().unwrap_or(0.0)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while want(&counters, "ratelimit_service_total_requests", "grpc_method=ShouldRateLimit") < 9.0 {
        assert!(Instant::now() < deadline, "statsd never carried 9 requests: {counters:?}");
        let mut buf = [0u8; 2048];
        if let Ok(n) = listener.recv(&mut buf) {
            datagrams.push(String::from_utf8(buf[..n].to_vec()).unwrap());
            counters = mapped_counters(&mapper, &datagrams);
        }
    }
    let one = "domain=api,key1=path";
    assert_eq!(want(&counters, "ratelimit_service_rate_limit_total_hits", one), 7.0);
    assert_eq!(want(&counters, "ratelimit_service_rate_limit_within_limit", one), 5.0);
    assert_eq!(want(&counters, "ratelimit_service_rate_limit_over_limit", one), 2.0);
    // Near from 4 (0.8 x 5): the fifth admitted hit, and none of the two over.
    assert_eq!(want(&counters, "ratelimit_service_rate_limit_near_limit", one), 1.0);
    let two = "domain=api,key1=route_r,key2=user";
    assert_eq!(want(&counters, "ratelimit_service_rate_limit_total_hits", two), 2.0);
    assert_eq!(want(&counters, "ratelimit_service_rate_limit_within_limit", two), 2.0);
    // The startup load counts, as envoyproxy/ratelimit counts it (it was never counted before).
    assert_eq!(want(&counters, "ratelimit_service_config_load_success", ""), 1.0, "the startup load");
    assert!(want(&counters, "ratelimit_service_response_time_seconds", "grpc_method=ShouldRateLimit") >= 9.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn prometheus_serves_the_mapped_names_on_its_own_port() {
    let (_dir, config) = config_file(&rules(5));
    let redis = Redis::start();
    let redis_at = redis.addr();
    let dir = config.parent().unwrap().to_str().unwrap().to_owned();
    let metrics_port = free_port();
    let addr = format!("127.0.0.1:{metrics_port}");
    let server = Tollgate::start_as_ratelimit(&[
        ("RUNTIME_ROOT", dir.as_str()),
        ("RUNTIME_APPDIRECTORY", "."),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", redis_at.as_str()),
        ("USE_STATSD", "false"),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", addr.as_str()),
        ("PROMETHEUS_MAPPER_YAML", ENVOY_GATEWAY_MAPPING),
    ])
    .wait_ready();
    assert_eq!(hits(&server, "path=/x", 7).await, 5);
    let (status, body) = http_get(addr.parse().unwrap(), "/metrics").expect("the Prometheus port answers");
    assert_eq!(status, 200);
    let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).unwrap();
    let labels = [("domain", "api"), ("key1", "path")];
    // timer_type applies to observations only: the counters stay counters.
    assert_eq!(sample(&scrape, "ratelimit_service_rate_limit_total_hits", &labels), 7.0);
    assert_eq!(sample(&scrape, "ratelimit_service_rate_limit_over_limit", &labels), 2.0);
    assert_eq!(sample(&scrape, "ratelimit_service_rate_limit_within_limit", &labels), 5.0);
    assert_eq!(
        sample(&scrape, "ratelimit_service_total_requests", &[("grpc_method", "ShouldRateLimit")]),
        7.0
    );
    assert_eq!(
        sample(
            &scrape,
            "ratelimit_service_response_time_seconds_count",
            &[("grpc_method", "ShouldRateLimit")]
        ),
        7.0
    );
    assert!(body.contains("tollgate_decisions_total"), "tollgate's own series follow");
    let limit = [("domain", "api"), ("rule", "path"), ("kind", "requests_per_unit"), ("unit", "hour")];
    assert_eq!(
        sample(&scrape, "tollgate_rule_limit", &limit),
        5.0,
        "the configured limit, for utilisation alerts"
    );
    assert_eq!(
        sample(&scrape, "tollgate_rule_limit", &[("domain", "api"), ("rule", "path"), ("kind", "capacity")]),
        5.0
    );
}

// envoyproxy/ratelimit's service-wide settings, as it reads them: two files of one domain merged
// (MERGE_DOMAIN_CONFIG), every limit in quota mode (QUOTA_MODE: denied only when all are short),
// the limit headers under the names given (LIMIT_RESPONSE_HEADERS_ENABLED, LIMIT_*_HEADER), and
// every key under the deployment's prefix (CACHE_KEY_PREFIX), read back from Redis.
#[tokio::test(flavor = "multi_thread")]
async fn service_wide_settings_as_envoyproxy_ratelimit_reads_them() {
    let (dir, _) = config_file(
        "domain: api\ndescriptors:\n  - key: path\n    rate_limit: {unit: HOUR, requests_per_unit: 2}\n",
    );
    std::fs::write(
        dir.path().join("b.yaml"),
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: HOUR, requests_per_unit: 3}\n",
    )
    .unwrap();
    let root = dir.path().to_str().unwrap().to_owned();
    let redis = Redis::start();
    let redis_at = redis.addr();
    let server = Tollgate::start_as_ratelimit(&[
        ("RUNTIME_ROOT", root.as_str()),
        ("RUNTIME_APPDIRECTORY", "."),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", redis_at.as_str()),
        ("MERGE_DOMAIN_CONFIG", "true"),
        ("QUOTA_MODE", "true"),
        ("CACHE_KEY_PREFIX", "eg_"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
        ("LIMIT_REMAINING_HEADER", "X-Left"),
    ])
    .wait_ready();
    let mut codes = Vec::new();
    let mut answers = Vec::new();
    for _ in 0..4 {
        let r = ask(&server.addr(), req("api", &["path=/x", "user=u"], 1)).await.unwrap();
        codes.push(r.overall_code == Code::Ok as i32);
        answers.push(r);
    }
    assert_eq!(codes, [true, true, true, false], "the third is short on `path` only: quota mode admits it");
    assert!(answers[0].statuses.iter().all(|s| s.current_limit.is_some()), "both files' limits serve");
    // The most constrained limit: `path` (2 per hour) with 1 left after the first request.
    assert_eq!(header(&answers[0], "RateLimit-Limit"), Some("2"));
    assert_eq!(header(&answers[0], "X-Left"), Some("1"));
    let reset: u64 = header(&answers[0], "RateLimit-Reset").unwrap().parse().unwrap();
    assert!((1..=3600).contains(&reset), "seconds until the bucket is full: {reset}");
    assert_eq!(header(&answers[3], "X-Left"), Some("0"));

    let mut redis_conn = redis.connection();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut redis_conn).unwrap();
    assert!(!keys.is_empty());
    assert!(keys.iter().all(|k| k.starts_with("eg_rl:")), "every key under the prefix: {keys:?}");
}

// envoyproxy/ratelimit's default runtime layout (RUNTIME_WATCH_ROOT=true): the root is a
// symlink `current -> v1`, swapped to `v2` by renaming a new link over it. The swap reloads, and
// so does a later edit inside `v2` (the watch follows the link to its new target).
#[tokio::test(flavor = "multi_thread")]
async fn a_swapped_runtime_root_reloads() {
    let (top, _) = config_file("");
    let version = |name: &str, per_hour: u32| {
        let dir = top.path().join(name).join("ratelimit/config");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.yaml"), rules(per_hour)).unwrap();
        dir.join("config.yaml")
    };
    version("v1", 3);
    let current = top.path().join("current");
    std::os::unix::fs::symlink(top.path().join("v1"), &current).unwrap();
    let root = current.to_str().unwrap().to_owned();
    let redis = Redis::start();
    let redis_at = redis.addr();
    let server = Tollgate::start_as_ratelimit(&[
        ("RUNTIME_ROOT", root.as_str()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_WATCH_ROOT", "true"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", redis_at.as_str()),
    ])
    .wait_ready();
    assert_eq!(limit(&server).await, "3");

    let in_v2 = version("v2", 7);
    let link = top.path().join("current.new");
    std::os::unix::fs::symlink(top.path().join("v2"), &link).unwrap();
    std::fs::rename(&link, &current).unwrap();
    let serves = |want: &'static str| {
        let server = &server;
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while limit(server).await != want {
                assert!(Instant::now() < deadline, "limit {want} never served");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    serves("7").await;
    std::fs::write(&in_v2, rules(9)).unwrap();
    serves("9").await;
}
