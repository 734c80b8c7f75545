//! Concurrency limits through a real Envoy 1.40 configured as `envoy/concurrency.yaml` ships it:
//! 100 clients of one tenant against a slow upstream (each request holds its connection 200 ms)
//! behind three tollgate replicas on a Redis Cluster, `max: 5`. The upstream itself counts what
//! it serves at once and never sees more than 5; the throughput is close to 5 / 0.2 s; every slot
//! is free at the end (read back from Redis). Then Envoy is killed with 5 requests in flight: the
//! slots stay taken until their ttl, then come back.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const CONFIG: &str = r#"
domain: exports
descriptors:
  - key: tenant
    concurrency: {max: 5, ttl: 3s}
"#;

const SERVICE_TIME: Duration = Duration::from_millis(200);
const SET: &str = "rl:{acme}:exports:tenant=acme:slots";

fn token(tenant: &str) -> String {
    let tokens: Value = serde_json::from_str(include_str!("../envoy/demo/tokens.json")).unwrap();
    tokens[tenant].as_str().unwrap().to_owned()
}

fn loopback() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().unwrap()
}

/// An upstream that holds each request for `SERVICE_TIME` and counts how many it holds at once.
#[derive(Default)]
struct Upstream {
    now: AtomicU64,
    most: AtomicU64,
    served: AtomicU64,
}

async fn slow_upstream(counts: Arc<Upstream>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(move || {
        let counts = counts.clone();
        async move {
            let now = counts.now.fetch_add(1, Ordering::SeqCst) + 1;
            counts.most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(SERVICE_TIME).await;
            counts.now.fetch_sub(1, Ordering::SeqCst);
            counts.served.fetch_add(1, Ordering::SeqCst);
            "exported"
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn front(listener: SocketAddr, admin: SocketAddr, replicas: &[SocketAddr], upstream: SocketAddr) -> Value {
    let mut c = repo_yaml("envoy/concurrency.yaml");
    let socket = |a: SocketAddr| json!({"address": a.ip().to_string(), "port_value": a.port()});
    c["admin"]["address"]["socket_address"] = socket(admin);
    c["static_resources"]["listeners"][0]["address"]["socket_address"] = socket(listener);
    for cluster in c["static_resources"]["clusters"].as_array_mut().unwrap() {
        let at: Vec<SocketAddr> =
            if cluster["name"] == "tollgate" { replicas.to_vec() } else { vec![upstream] };
        cluster["type"] = json!("STATIC");
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = json!(at
            .iter()
            .map(|a| json!({"endpoint": {"address": {"socket_address": socket(*a)}}}))
            .collect::<Vec<_>>());
    }
    c
}

async fn get(client: &reqwest_like::Client, listener: SocketAddr, bearer: &str) -> u16 {
    client.get(listener, "/report", bearer).await
}

// A tiny HTTP/1.1 client over tokio (one connection per request, as browsers' exports would).
mod reqwest_like {
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    pub struct Client;

    impl Client {
        pub async fn get(&self, addr: SocketAddr, path: &str, bearer: &str) -> u16 {
            let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else { return 0 };
            let request = format!(
                "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {bearer}\r\nConnection: close\r\n\r\n"
            );
            if stream.write_all(request.as_bytes()).await.is_err() {
                return 0;
            }
            let mut response = Vec::new();
            let _ = stream.read_to_end(&mut response).await;
            let text = String::from_utf8_lossy(&response);
            text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_upstream_never_sees_more_than_the_limit_in_flight() {
    let cluster = RedisCluster::start();
    let (_dir, config) = config_file(CONFIG);
    let replicas: Vec<Tollgate> =
        (0..3).map(|_| Tollgate::start(&config, &Backend::Cluster(cluster.seeds()), &[])).collect();
    let counts = Arc::new(Upstream::default());
    let upstream = slow_upstream(counts.clone()).await;
    let (listener, admin) = (loopback(), loopback());
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.grpc).collect();
    let config = front(listener, admin, &addrs, upstream);
    let (valid, why) = envoy_validate(&config);
    assert!(valid, "{why}");
    let mut envoy = Envoy::start(&config, admin);
    let bearer = Arc::new(token("acme"));

    // 100 clients for 3 s; a refused client waits 20 ms before asking again.
    let run = Duration::from_secs(3);
    let start = Instant::now();
    let clients: Vec<_> = (0..100)
        .map(|_| {
            let bearer = bearer.clone();
            tokio::spawn(async move {
                let (mut ok, mut refused, mut other) = (0u64, 0u64, 0u64);
                while start.elapsed() < run {
                    match get(&reqwest_like::Client, listener, &bearer).await {
                        200 => ok += 1,
                        429 => {
                            refused += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        _ => other += 1,
                    }
                }
                (ok, refused, other)
            })
        })
        .collect();
    let (mut ok, mut refused, mut other) = (0, 0, 0);
    for c in clients {
        let (o, r, x) = c.await.unwrap();
        (ok, refused, other) = (ok + o, refused + r, other + x);
    }
    let took = start.elapsed();
    let most = counts.most.load(Ordering::SeqCst);
    let ideal = 5.0 * took.as_secs_f64() / SERVICE_TIME.as_secs_f64();
    println!(
        "100 clients, max 5, 200 ms upstream, 3 replicas on a Cluster: {ok} served in {took:?} ({:.0}% of 5 / service time), {refused} refused, {other} other; the upstream held at most {most} at once",
        100.0 * ok as f64 / ideal
    );
    assert_eq!(other, 0, "every answer a 200 or a 429");
    assert!(most <= 5, "the upstream saw {most} in flight");
    assert_eq!(most, 5, "the limit is used");
    // 75-87% measured (the lower under a full CI run on two cores); well under it means slots
    // linger after their responses.
    assert!(ok as f64 >= 0.6 * ideal, "{ok} served, {ideal:.0} possible");
    assert_eq!(counts.served.load(Ordering::SeqCst), ok);

    // Every slot given back once the responses are done.
    let mut con = cluster.connection();
    wait_until("every slot given back", 200, Duration::from_millis(10), || {
        redis::cmd("ZCARD").arg(SET).query::<i64>(&mut con).unwrap() == 0
    });

    // Envoy killed with five requests in flight: no give-back comes, the slots expire.
    let held: Vec<_> = (0..5)
        .map(|_| {
            let bearer = bearer.clone();
            tokio::spawn(async move { get(&reqwest_like::Client, listener, &bearer).await })
        })
        .collect();
    wait_until("five in flight", 200, Duration::from_millis(10), || counts.now.load(Ordering::SeqCst) == 5);
    envoy.proc.kill();
    for h in held {
        let _ = h.await;
    }
    let killed = Instant::now();
    assert_eq!(redis::cmd("ZCARD").arg(SET).query::<i64>(&mut con).unwrap(), 5, "held by the lost requests");
    let addr = replicas[0].addr();
    let take = |id: String| {
        let d = format!("tenant=acme,request_id={id}");
        let addr = addr.clone();
        async move { ask(&addr, req("exports", &[&d], 1)).await.unwrap().overall_code }
    };
    assert_eq!(take("after-kill".into()).await, OVER_LIMIT, "still full before the ttl");
    let mut retries = 0;
    while take(format!("probe-{retries}")).await != OK {
        retries += 1;
        assert!(killed.elapsed() < Duration::from_secs(5), "the slots never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let back = killed.elapsed();
    println!("Envoy killed with 5 in flight: the slots came back {back:?} later (ttl 3 s from each take)");
    assert!(back >= Duration::from_millis(2500), "not before the ttl: {back:?}");
}

/// A client that resets its request before the response began gives no slot back: the upstream
/// may still be working on it (one that does not abort on a disconnect), so the slot stays taken
/// until the upstream answered or the ttl passed. A request answered gives its slot back at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_reset_before_the_response_keeps_its_slot() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let replica = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    let counts = Arc::new(Upstream::default());
    let upstream = slow_upstream(counts.clone()).await;
    let (listener, admin) = (loopback(), loopback());
    let mut envoy = Envoy::start(&front(listener, admin, &[replica.grpc], upstream), admin);
    let bearer = token("acme");
    let mut con = redis.connection();
    let slots = |con: &mut redis::Connection| redis::cmd("ZCARD").arg(SET).query::<i64>(con).unwrap();

    // Answered: given back.
    assert_eq!(get(&reqwest_like::Client, listener, &bearer).await, 200);
    wait_until("the answered request's slot", 200, Duration::from_millis(10), || slots(&mut con) == 0);

    // Reset while the upstream works: the slot stays, though Envoy saw the stream end.
    let mut stream = tokio::net::TcpStream::connect(listener).await.unwrap();
    let request = format!("GET /report HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {bearer}\r\n\r\n");
    tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes()).await.unwrap();
    wait_until("the upstream at work", 200, Duration::from_millis(5), || {
        counts.now.load(Ordering::SeqCst) == 1
    });
    drop(stream);
    // Envoy counts the stream it lost.
    let stat = |name: &str| -> u64 {
        let (_, body) = http_get(admin, "/stats").unwrap_or_default();
        body.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(": ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    wait_until("Envoy to see the reset", 200, Duration::from_millis(10), || {
        stat("http.ingress.downstream_cx_destroy_remote_active_rq") >= 1
    });
    // A give-back is sent as Envoy ends the stream: one would be in well within 300 ms (this
    // waits for something that must not come, so it can only wait a while).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let given_back =
        sample(&replica.metrics(), "tollgate_concurrency_slots_total", &[("event", "given_back")]);
    assert_eq!(given_back, 1.0, "only the answered request's");
    assert_eq!(slots(&mut con), 1, "the reset request keeps its slot until its ttl");
    envoy.proc.kill();
}
