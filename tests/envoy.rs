//! Through a real Envoy with the shipped `envoy/front-proxy.yaml`: JWT-derived tenants, quota
//! headers, 429s, weighted routes, gRPC RESOURCE_EXHAUSTED with RetryInfo, and Envoy's failure
//! mode when tollgate is gone. The stack (Redis Cluster, tollgate on `examples/`, an HTTP and a
//! gRPC upstream, Envoy) runs on loopback ports.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_types::StatusExt;

fn token(tenant: &str) -> String {
    let tokens: Value = serde_json::from_str(include_str!("../envoy/demo/tokens.json")).unwrap();
    tokens[tenant].as_str().unwrap_or_else(|| panic!("no demo token for {tenant}")).to_owned()
}

fn bearer(tenant: &str) -> String {
    format!("Bearer {}", token(tenant))
}

/// Addresses the front proxy is pointed at.
struct Wiring {
    listener: SocketAddr,
    admin: SocketAddr,
    tollgate: SocketAddr,
    upstream: SocketAddr,
    grpc_upstream: SocketAddr,
}

impl Wiring {
    // Fresh listener and admin ports and fresh upstreams, in front of `tollgate`.
    async fn new(tollgate: SocketAddr) -> Wiring {
        Wiring {
            listener: loopback(),
            admin: loopback(),
            tollgate,
            upstream: http_upstream().await,
            grpc_upstream: grpc_upstream().await,
        }
    }
}

fn loopback() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().unwrap()
}

/// The shipped front proxy, with its addresses replaced by the test's.
fn front_proxy(w: &Wiring) -> Value {
    let mut c = repo_yaml("envoy/front-proxy.yaml");
    let socket = |a: SocketAddr| json!({"address": a.ip().to_string(), "port_value": a.port()});
    c["admin"]["address"]["socket_address"] = socket(w.admin);
    c["static_resources"]["listeners"][0]["address"]["socket_address"] = socket(w.listener);
    for cluster in c["static_resources"]["clusters"].as_array_mut().unwrap() {
        let addr = match cluster["name"].as_str().unwrap() {
            "tollgate" => w.tollgate,
            "upstream" => w.upstream,
            "grpc_upstream" => w.grpc_upstream,
            other => panic!("unexpected cluster {other}"),
        };
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"] = socket(addr);
    }
    c
}

/// The ratelimit filter's config inside a front-proxy config.
fn ratelimit_filter(c: &mut Value) -> &mut Value {
    let filters = c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["http_filters"]
        .as_array_mut()
        .unwrap();
    let filter = filters.iter_mut().find(|f| f["name"] == "envoy.filters.http.ratelimit").unwrap();
    &mut filter["typed_config"]
}

async fn http_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(|| async { "upstream ok" });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn grpc_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter.set_service_status("", tonic_health::ServingStatus::Serving).await;
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
            .unwrap()
    });
    addr
}

fn examples() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/examples"))
}

fn decisions(server: &Tollgate) -> f64 {
    sample(&server.metrics(), "tollgate_decisions_total", &[])
}

// Remaining tokens of the policy `name` in an IETF `RateLimit` header.
fn ietf_remaining(header: &str, name: &str) -> u64 {
    let item = header.split(", ").find(|i| i.starts_with(&format!("\"{name}\""))).expect(name);
    item.split(';').find_map(|p| p.strip_prefix("r=")).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn front_proxy_end_to_end() {
    let cluster = RedisCluster::start();
    let tollgate = Tollgate::start(examples(), &Backend::Cluster(cluster.seeds()), &[]);
    let w = Wiring::new(tollgate.grpc).await;
    let envoy = Envoy::start(&front_proxy(&w), w.admin);
    let get = |path: &str, headers: &[(&str, &str)]| http_request(w.listener, path, headers);

    // 200 from the upstream, with the quota headers tollgate asked Envoy to add.
    let globex = bearer("globex");
    let r = get("/", &[("authorization", &globex)]);
    assert_eq!((r.status, r.body.as_str()), (200, "upstream ok"), "{r:?}");
    assert_eq!(r.header("x-ratelimit-limit"), Some("20"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("19"));

    // Drain the free tier's 20-token bucket (refilling 2/s): then 429 with Retry-After.
    let mut admitted = 1;
    let denied = loop {
        let r = get("/", &[("authorization", &globex)]);
        if r.status == 429 {
            break r;
        }
        assert_eq!(r.status, 200);
        admitted += 1;
        assert!(admitted < 100, "never limited");
    };
    assert!(admitted >= 20, "{admitted}");
    assert_eq!(denied.header("retry-after"), Some("1"), "{denied:?}");
    assert_eq!(denied.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(denied.header("x-ratelimit-remaining"), Some("0"));

    // Tenants are independent.
    let r = get("/", &[("authorization", &bearer("initech"))]);
    assert_eq!((r.status, r.header("x-ratelimit-remaining")), (200, Some("19")));

    // /export costs 25 of the 100-token export bucket: four pass, the fifth is refused, and the
    // tenant's other routes are unaffected.
    let hooli = bearer("hooli");
    for expected in [75, 50, 25, 0] {
        let r = get("/export", &[("authorization", &hooli)]);
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(ietf_remaining(r.header("ratelimit").unwrap(), "export"), expected);
    }
    let r = get("/export", &[("authorization", &hooli)]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("25"), "25 tokens at 1/s");
    assert_eq!(get("/", &[("authorization", &hooli)]).status, 200);

    // A header naming another tenant changes nothing: the verified token decides.
    let r = get("/", &[("authorization", &bearer("wayne")), ("x-tenant-id", "stark"), ("tenant", "stark")]);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("19"));
    let r = get("/", &[("authorization", &bearer("stark"))]);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("19"), "stark's bucket was not touched");
    let r = get("/", &[("authorization", &bearer("wayne"))]);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("18"));

    // No token, or a forged one: 401, and tollgate is never asked.
    let before = decisions(&tollgate);
    let forged = format!("{}x", bearer("acme"));
    for headers in [vec![], vec![("authorization", forged.as_str())], vec![("x-tenant-id", "acme")]] {
        assert_eq!(get("/", &headers).status, 401);
    }
    assert_eq!(decisions(&tollgate), before, "rejected requests never reach the limiter");

    // A valid token without the tenant claim is still limited, in one shared bucket.
    let r = get("/", &[("authorization", &bearer("(no tenant claim)"))]);
    assert_eq!((r.status, r.header("x-ratelimit-limit")), (200, Some("20")));

    // gRPC over the limit: RESOURCE_EXHAUSTED, with google.rpc.RetryInfo from tollgate.
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", w.listener))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let tyrell = bearer("tyrell");
    let mut ok = 0;
    let status = loop {
        let mut request = tonic::Request::new(HealthCheckRequest { service: String::new() });
        request.metadata_mut().insert("authorization", tyrell.parse().unwrap());
        match health.check(request).await {
            Ok(_) => ok += 1,
            Err(status) => break status,
        }
        assert!(ok < 100, "gRPC never limited");
    };
    assert!(ok >= 10, "the grpc-api free tier holds 10: {ok}");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let retry = status.get_details_retry_info().expect("RetryInfo in grpc-status-details-bin");
    assert_eq!(retry.retry_delay, Some(Duration::from_secs(1)));
    drop(envoy);
}

#[tokio::test(flavor = "multi_thread")]
async fn tollgate_down_follows_failure_mode_deny() {
    let redis = Redis::start();
    let mut tollgate = Tollgate::start(examples(), &Backend::Redis(redis.url()), &[]);
    let (upstream, grpc) = (http_upstream().await, grpc_upstream().await);
    let mut envoys = Vec::new();
    for deny in [false, true] {
        let w = Wiring {
            listener: loopback(),
            admin: loopback(),
            tollgate: tollgate.grpc,
            upstream,
            grpc_upstream: grpc,
        };
        let mut config = front_proxy(&w);
        ratelimit_filter(&mut config)["failure_mode_deny"] = json!(deny);
        envoys.push((deny, w.listener, Envoy::start(&config, w.admin)));
    }
    let acme = bearer("acme");
    for (_, listener, _) in &envoys {
        assert_eq!(http_request(*listener, "/", &[("authorization", &acme)]).status, 200);
    }
    tollgate.proc.kill();
    for (deny, listener, _) in &envoys {
        let r = http_request(*listener, "/", &[("authorization", &acme)]);
        let expected = if *deny { 500 } else { 200 };
        assert_eq!(r.status, expected, "failure_mode_deny: {deny}: {r:?}");
        assert_eq!(r.header("x-ratelimit-limit"), None);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn what_enable_x_ratelimit_headers_adds() {
    let tollgate = Tollgate::start(examples(), &Backend::Memory, &[]);
    let w = Wiring::new(tollgate.grpc).await;
    let mut config = front_proxy(&w);
    ratelimit_filter(&mut config)["enable_x_ratelimit_headers"] = json!("DRAFT_VERSION_03");
    let _envoy = Envoy::start(&config, w.admin);
    let umbrella = bearer("umbrella");
    let r = http_request(w.listener, "/", &[("authorization", &umbrella)]);
    println!("200 with enable_x_ratelimit_headers: {:#?}", r.headers);
    // Envoy's draft-03 headers describe current_limit (tollgate's refill rate, 2/s) and
    // limit_remaining; tollgate's own header, with the same name, carries the capacity. Envoy
    // does not merge them: both values arrive.
    let limits: Vec<&str> = r
        .headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case("x-ratelimit-limit"))
        .map(|(_, v)| v.as_str())
        .collect();
    assert!(limits.contains(&"20"), "{limits:?}");
    assert!(limits.iter().any(|v| v.starts_with("2, 2;w=1")), "{limits:?}");
    assert!(r.header("x-ratelimit-reset").is_some());
    let denied = (0..100)
        .map(|_| http_request(w.listener, "/", &[("authorization", &umbrella)]))
        .find(|r| r.status == 429)
        .expect("limited within 100 requests");
    println!("429 with enable_x_ratelimit_headers: {:#?}", denied.headers);
    assert!(denied.header("x-ratelimit-reset").is_some());
    assert_eq!(denied.headers.iter().filter(|(k, _)| k.eq_ignore_ascii_case("retry-after")).count(), 1);
}
