//! Rules pushed over xDS, as Envoy Gateway pushes them to envoyproxy/ratelimit: a neutral ADS
//! server (tests/common/xds.rs) drives a real tollgate started only with envoyproxy/ratelimit's
//! environment. Updates keep balances, a bad resource is NACKed while the last good config
//! serves, a restarted server is found again, TLS and mutual TLS reach it, readiness waits for a
//! first config unless told not to, and two replicas on one Redis Cluster share pushed limits.

mod common;

use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::google::protobuf::Any;

const NODE: &str = "envoy-ratelimit";

fn api(per_minute: u32) -> envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitConfig {
    rate_limit_config(
        "api",
        &format!("domain: api\ndescriptors:\n  - key: path\n    value: /a\n    rate_limit: {{unit: MINUTE, requests_per_unit: {per_minute}}}\n"),
    )
}

fn other() -> envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitConfig {
    rate_limit_config(
        "other",
        "domain: other\ndescriptors:\n  - key: k\n    rate_limit: {unit: HOUR, requests_per_unit: 1}\n",
    )
}

// envoyproxy/ratelimit's environment for an xDS config from `xds`, on standalone Redis at
// `redis` (host:port), with a fast backoff for the tests.
fn env<'a>(xds: &'a str, redis: &'a str, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut env = vec![
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", xds),
        ("CONFIG_GRPC_XDS_NODE_ID", NODE),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", redis),
        ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "100ms"),
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "400ms"),
        ("LOG_LEVEL", "info"),
    ];
    env.extend_from_slice(extra);
    env
}

// Hits of `k=v` on `domain` admitted out of `tries`, one at a time.
async fn admitted(server: &Tollgate, domain: &str, descriptor: &str, tries: u32) -> u32 {
    let mut ok = 0;
    for _ in 0..tries {
        let r = ask(&server.addr(), req(domain, &[descriptor], 1)).await.unwrap();
        if r.overall_code == Code::Ok as i32 {
            ok += 1;
        }
    }
    ok
}

fn health(server: &Tollgate) -> u16 {
    http_get(server.http, "/healthcheck").map_or(0, |(status, _)| status)
}

#[tokio::test(flavor = "multi_thread")]
async fn pushed_limits_apply_and_an_update_keeps_the_balance() {
    let redis = Redis::start();
    let xds = XdsServer::start(None);
    xds.push("v1", &[api(5)]);
    let addr = xds.addr.to_string();
    let redis_at = redis.addr();
    let server = Tollgate::start_as_ratelimit(&env(&addr, &redis_at, &[])).wait_ready();
    xds.wait_for_ack("v1");
    let first = &xds.requests()[0];
    assert_eq!(first.node.as_ref().unwrap().id, NODE);
    assert_eq!(first.type_url, "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig");

    assert_eq!(admitted(&server, "api", "path=/a", 3).await, 3);
    // The limit raised to 6: the bucket keeps its 2 tokens, as across a file reload (a fresh
    // bucket would admit 6).
    xds.push("v2", &[api(6)]);
    xds.wait_for_ack("v2");
    let started = Instant::now();
    let after = admitted(&server, "api", "path=/a", 8).await;
    // 6 a minute refills a token every 10 s: at most one more while this runs.
    let refill = (started.elapsed().as_secs_f64() / 10.0).ceil() as u32;
    assert!((2..=2 + refill).contains(&after), "admitted {after} after the update; the balance was not kept");

    // A domain added, then removed: limited while pushed, unknown (no limit) after.
    xds.push("v3", &[api(6), other()]);
    xds.wait_for_ack("v3");
    assert_eq!(admitted(&server, "other", "k=x", 3).await, 1);
    xds.push("v4", &[api(6)]);
    xds.wait_for_ack("v4");
    assert_eq!(admitted(&server, "other", "k=x", 3).await, 3, "a domain the push leaves out is gone");
    let log = server.log();
    assert!(log.contains("xDS config accepted"), "{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_invalid_push_is_nacked_and_the_last_good_config_serves() {
    let redis = Redis::start();
    let xds = XdsServer::start(None);
    xds.push("v1", &[api(2)]);
    let (addr, redis_at) = (xds.addr.to_string(), redis.addr());
    let server = Tollgate::start_as_ratelimit(&env(&addr, &redis_at, &[])).wait_ready();
    xds.wait_for_ack("v1");

    let mut bad = api(5);
    bad.descriptors[0].rate_limit.as_mut().unwrap().unit = 0; // UNKNOWN
    xds.push("v2", &[bad]);
    let nack = xds.wait_for_nack();
    assert_eq!(nack.version_info, "v1", "a NACK keeps the version in force");
    let detail = nack.error_detail.unwrap();
    assert!(detail.message.contains("xds:api") && detail.message.contains("unit"), "{}", detail.message);
    assert_eq!(admitted(&server, "api", "path=/a", 4).await, 2, "the last good limit (2) serves");

    // Bytes that are not a RateLimitConfig: NACKed too.
    xds.push_any(
        "v3",
        vec![Any {
            type_url: "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig".into(),
            value: vec![0xff, 0xff, 0xff],
        }],
    );
    wait_until("a second NACK", 500, Duration::from_millis(20), || {
        xds.requests().iter().filter(|r| r.error_detail.is_some()).count() == 2
    });
    let scrape = server.metrics();
    assert_eq!(sample(&scrape, "tollgate_xds_updates_total", &[("result", "rejected")]), 2.0);
    assert_eq!(sample(&scrape, "tollgate_xds_updates_total", &[("result", "accepted")]), 1.0);
    let log = server.log();
    assert_eq!(log.matches("xDS config rejected").count(), 2, "one line per rejected push: {log}");
    assert_eq!(health(&server), 200);

    // A good push after the bad ones is taken.
    xds.push("v4", &[api(2), other()]);
    xds.wait_for_ack("v4");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_server_is_found_again_and_the_config_serves_meanwhile() {
    let redis = Redis::start();
    let mut xds = XdsServer::start(None);
    xds.push("v1", &[api(3)]);
    let (addr, redis_at) = (xds.addr.to_string(), redis.addr());
    let server = Tollgate::start_as_ratelimit(&env(&addr, &redis_at, &[])).wait_ready();
    xds.wait_for_ack("v1");

    xds.stop();
    wait_until("the stream loss logged", 500, Duration::from_millis(20), || {
        server.log().contains("xDS stream down")
    });
    assert_eq!(admitted(&server, "api", "path=/a", 5).await, 3, "the config in force keeps serving");
    assert_eq!(health(&server), 200, "still ready: it has a config");

    xds.restart(None);
    xds.push("v2", &[api(3), other()]);
    let back = Instant::now();
    xds.wait_for_ack("v2");
    // Backoff from 100 ms to at most 400 ms (each +-50%): found again well within a second.
    assert!(back.elapsed() < Duration::from_secs(3), "reconnected after {:?}", back.elapsed());
    assert!(xds.streams() >= 2);
    let resubscribed = xds.requests().into_iter().filter(|r| r.response_nonce.is_empty()).collect::<Vec<_>>();
    assert_eq!(resubscribed.last().unwrap().version_info, "v1", "a new stream says what is in force");
    assert_eq!(admitted(&server, "other", "k=x", 2).await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn tls_and_mutual_tls_reach_the_server() {
    let pki = TestPki::new();
    let redis = Redis::start();
    let redis_at = redis.addr();
    let (ca, cert, key) = (pki.path_str("ca.pem"), pki.path_str("client.pem"), pki.path_str("client.key"));

    let xds = XdsServer::start(Some(XdsTls { pki: &pki, mutual: true }));
    xds.push("v1", &[api(3)]);
    let addr = format!("localhost:{}", xds.addr.port());
    let tls = [
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", ca.as_str()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", cert.as_str()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", key.as_str()),
    ];
    let server = Tollgate::start_as_ratelimit(&env(&addr, &redis_at, &tls)).wait_ready();
    xds.wait_for_ack("v1");
    assert_eq!(admitted(&server, "api", "path=/a", 4).await, 3);

    // Without a client certificate the mutual-TLS server refuses: no config, never ready.
    let xds_mutual = XdsServer::start(Some(XdsTls { pki: &pki, mutual: true }));
    xds_mutual.push("v1", &[api(3)]);
    let addr = format!("localhost:{}", xds_mutual.addr.port());
    let half =
        [("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"), ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", ca.as_str())];
    let refused = Tollgate::start_as_ratelimit(&env(&addr, &redis_at, &half));
    wait_until("the refusal logged", 500, Duration::from_millis(20), || {
        refused.log().contains("xDS stream down")
    });
    assert_eq!(health(&refused), 503);
    assert!(xds_mutual.requests().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn readiness_waits_for_a_first_config_unless_forced() {
    let redis = Redis::start();
    let redis_at = redis.addr();
    let xds = XdsServer::start(None);
    let addr = xds.addr.to_string();

    let waiting = Tollgate::start_as_ratelimit(&env(&addr, &redis_at, &[]));
    wait_until("the stream opened", 500, Duration::from_millis(20), || xds.streams() >= 1);
    let (status, body) = http_get(waiting.http, "/healthcheck").unwrap();
    assert_eq!((status, body.as_str()), (503, "no config yet: waiting for the first from the xDS server\n"));
    assert_eq!(http_get(waiting.http, "/readyz").unwrap().0, 503);

    let forced = Tollgate::start_as_ratelimit(&env(
        &addr,
        &redis_at,
        &[("FORCE_START_WITHOUT_INITIAL_CONFIG", "true")],
    ));
    let forced = forced.wait_ready();
    assert_eq!(health(&forced), 200);
    // Forced, but healthy only with a config: waits, as envoyproxy/ratelimit does.
    let strict = Tollgate::start_as_ratelimit(&env(
        &addr,
        &redis_at,
        &[
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
            ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "true"),
        ],
    ));
    wait_until("the strict stream opened", 500, Duration::from_millis(20), || xds.streams() >= 3);
    assert_eq!(health(&strict), 503);

    xds.push("v1", &[api(3)]);
    let waiting = waiting.wait_ready();
    let strict = strict.wait_ready();
    for server in [&waiting, &strict, &forced] {
        assert_eq!(health(server), 200);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_on_a_cluster_share_pushed_limits_exactly() {
    let cluster = RedisCluster::start();
    let xds = XdsServer::start(None);
    xds.push("v1", &[api(20)]);
    let addr = xds.addr.to_string();
    let seeds = cluster.seeds();
    let on_cluster = [("REDIS_TYPE", "CLUSTER")];
    let a = Tollgate::start_as_ratelimit(&env(&addr, &seeds, &on_cluster)).wait_ready();
    let b = Tollgate::start_as_ratelimit(&env(&addr, &seeds, &on_cluster)).wait_ready();
    let started = Instant::now();
    let mut ok = 0;
    for i in 0..40 {
        let server = if i % 2 == 0 { &a } else { &b };
        ok += admitted(server, "api", "path=/a", 1).await;
    }
    // 20 a minute: one token every 3 s may come back while this runs.
    let refill = (started.elapsed().as_secs_f64() / 3.0).ceil() as u32;
    assert!((20..=20 + refill).contains(&ok), "two replicas admitted {ok} of a shared 20");
}

// A one-rule domain named `name`.
fn named(name: &str) -> envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitConfig {
    rate_limit_config(
        name,
        &format!("domain: {name}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: HOUR, requests_per_unit: 1}}\n"),
    )
}

// Whether any series of the scrape is labelled with `domain`.
fn has_domain(scrape: &prometheus_parse::Scrape, domain: &str) -> bool {
    scrape.samples.iter().any(|s| s.labels.get("domain") == Some(domain))
}

// The NACKs the server has had, oldest first; waits for the `n`th.
fn nacks(xds: &XdsServer, n: usize) -> Vec<String> {
    let found = || -> Vec<String> {
        xds.requests().into_iter().filter_map(|r| r.error_detail.map(|d| d.message)).collect()
    };
    wait_until("a NACK", 500, Duration::from_millis(20), || found().len() >= n);
    found()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_control_plane_gets_a_bounded_share_of_the_replica() {
    let redis = Redis::start();
    let xds = XdsServer::start(None);
    xds.push("v1", &[api(5), other()]);
    let (addr, redis_at) = (xds.addr.to_string(), redis.addr());
    let limits =
        [("TOLLGATE_MAX_DOMAINS", "3"), ("TOLLGATE_MAX_RULES", "4"), ("TOLLGATE_METRICS_IDLE", "2s")];
    let server = Tollgate::start_as_ratelimit(&env(&addr, &redis_at, &limits)).wait_ready();
    xds.wait_for_ack("v1");
    let reloaded =
        |server: &Tollgate| sample(&server.metrics(), "tollgate_config_last_reload_successful", &[]);
    assert_eq!(reloaded(&server), 1.0, "an accepted push is a successful reload");

    // Over a cap: NACKed with the reason and the flag, the config in force serving.
    xds.push("v2", &[api(5), other(), named("d3"), named("d4")]);
    let why = nacks(&xds, 1);
    assert!(why[0].contains("4 domains") && why[0].contains("--max-domains"), "{why:?}");
    assert_eq!(reloaded(&server), 0.0);
    // A push with no domain would unlimit both: NACKed, both still limited.
    xds.push("v3", &[]);
    let why = nacks(&xds, 2);
    assert!(why[1].contains("no domain") && why[1].contains("--xds-allow-empty"), "{why:?}");
    assert_eq!(admitted(&server, "other", "k=x", 3).await, 1, "still limited after an empty push");

    // Series follow the config: a domain dropped loses its series within the idle window.
    xds.push("v4", &[api(5)]);
    xds.wait_for_ack("v4");
    assert_eq!(reloaded(&server), 1.0);
    let scrape = server.metrics();
    assert_eq!(sample(&scrape, "tollgate_xds_domains_removed_total", &[]), 1.0, "other was dropped");
    assert!(has_domain(&scrape, "other"), "kept until idle");
    wait_until("the dropped domain's series to go", 100, Duration::from_millis(100), || {
        !has_domain(&server.metrics(), "other")
    });
    assert!(has_domain(&server.metrics(), "api"), "the config in force keeps its series");

    // Churn is paced: three swaps of two new domains each fit the budget (2 x (3 + 4) pairs);
    // the fourth would hold more series than that and waits for the first's to be forgotten.
    for (version, a, b) in [("v5", "x1", "x2"), ("v6", "y1", "y2"), ("v7", "z1", "z2")] {
        xds.push(version, &[api(5), named(a), named(b)]);
        xds.wait_for_ack(version);
    }
    let started = Instant::now();
    xds.push("v8", &[api(5), named("w1"), named("w2")]);
    wait_until("the push to be paced", 100, Duration::from_millis(20), || {
        sample(&server.metrics(), "tollgate_xds_pushes_paced_total", &[]) >= 1.0
    });
    xds.wait_for_ack("v8");
    assert!(started.elapsed() >= Duration::from_millis(500), "taken after {:?}", started.elapsed());
    assert_eq!(admitted(&server, "w1", "k=x", 2).await, 1, "the paced push is in force");
}

/// The walkthrough's server refuses a file whose unit the proto cannot carry, naming it as
/// written (it went out as UNKNOWN, and tollgate's NACK could only say that).
#[test]
fn the_example_server_names_a_unit_it_cannot_push() {
    let file = "domain: f\ndescriptors:\n  - key: k\n    descriptors:\n      - key: j\n        rate_limit: {unit: fortnight, requests_per_unit: 1}\n";
    let said = rate_limit_config_error("f", file);
    assert!(said.contains("\"fortnight\""), "{said}");
}
