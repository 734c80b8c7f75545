//! Charging after the response, through a real Envoy 1.40 with the shipped
//! `envoy/llm-gateway.yaml` and `examples/llm-gateway.yaml`: a check before the request (hits 0),
//! the cost charged from the upstream's `x-tokens-used` when the response is done.
//!
//! * A trial tenant (1,000 tokens refilling 100/s), responses of 600: 200, 200, then 429 with
//!   Retry-After, and 200 again after the refill; the refused request is charged nothing.
//! * A streamed (chunked) response reports its cost in a trailer (which the gateway's Lua filter
//!   copies into dynamic metadata, as Envoy cannot read trailers in hits_addend): charged once,
//!   after it ends.
//! * Two Envoys in front of two tollgate replicas on a Redis Cluster share one budget: the
//!   tokens charged equal those the upstream reported (within 1 %), and the tokens admitted stay
//!   within the budget plus one response in flight per Envoy.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

fn bearer(tenant: &str) -> String {
    let tokens: Value = serde_json::from_str(include_str!("../envoy/demo/tokens.json")).unwrap();
    format!("Bearer {}", tokens[tenant].as_str().expect("a demo token"))
}

fn loopback() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().unwrap()
}

/// A stand-in for an LLM API: `GET /complete?tokens=N` answers with `x-tokens-used: N`;
/// `GET /stream?tokens=N&chunks=K&pause_ms=P` streams K chunks P ms apart, then reports N in a
/// trailer. It counts the tokens it reported.
struct Upstream {
    addr: SocketAddr,
    reported: Arc<AtomicU64>,
}

async fn llm_upstream() -> Upstream {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let reported = Arc::new(AtomicU64::new(0));
    let counter = reported.clone();
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else { return };
            tokio::spawn(serve_connection(socket, counter.clone()));
        }
    });
    Upstream { addr, reported }
}

async fn serve_connection(socket: tokio::net::TcpStream, reported: Arc<AtomicU64>) {
    let (read, mut write) = socket.into_split();
    let mut read = BufReader::new(read);
    loop {
        let mut line = String::new();
        if read.read_line(&mut line).await.unwrap_or(0) == 0 {
            return;
        }
        let target = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
        loop {
            let mut header = String::new();
            if read.read_line(&mut header).await.unwrap_or(0) == 0 {
                return;
            }
            if header == "\r\n" {
                break;
            }
        }
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let param = |name: &str| -> u64 {
            query.split('&').find_map(|kv| kv.strip_prefix(&format!("{name}="))?.parse().ok()).unwrap_or(0)
        };
        let tokens = param("tokens");
        let ok = if path == "/stream" {
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\ntrailer: x-tokens-used\r\n\r\n";
            let mut ok = write.write_all(head.as_bytes()).await.is_ok();
            for _ in 0..param("chunks") {
                tokio::time::sleep(Duration::from_millis(param("pause_ms"))).await;
                ok &= write.write_all(b"6\r\ntoken \r\n").await.is_ok();
            }
            ok && write.write_all(format!("0\r\nx-tokens-used: {tokens}\r\n\r\n").as_bytes()).await.is_ok()
        } else {
            let response =
                format!("HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-tokens-used: {tokens}\r\n\r\nok");
            write.write_all(response.as_bytes()).await.is_ok()
        };
        if !ok {
            return;
        }
        reported.fetch_add(tokens, Ordering::SeqCst);
    }
}

/// The shipped LLM gateway, pointed at `tollgate` and `llm`.
fn gateway(listener: SocketAddr, admin: SocketAddr, tollgate: SocketAddr, llm: SocketAddr) -> Value {
    let mut c = repo_yaml("envoy/llm-gateway.yaml");
    let socket = |a: SocketAddr| json!({"address": a.ip().to_string(), "port_value": a.port()});
    c["admin"]["address"]["socket_address"] = socket(admin);
    c["static_resources"]["listeners"][0]["address"]["socket_address"] = socket(listener);
    for cluster in c["static_resources"]["clusters"].as_array_mut().unwrap() {
        let addr = if cluster["name"] == "tollgate" { tollgate } else { llm };
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"] = socket(addr);
    }
    c
}

fn examples() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/examples"))
}

/// Hits tollgate decided for the token budget (checks count 0, charges their cost).
fn tokens_decided(servers: &[&Tollgate]) -> f64 {
    servers
        .iter()
        .map(|s| {
            sample(
                &s.metrics(),
                "tollgate_decisions_total",
                &[("domain", "llm-gateway"), ("rule", "tenant.meter_tokens")],
            )
        })
        .sum()
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..250 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_token_budget_charged_after_the_response() {
    let redis = Redis::start();
    let tollgate = Tollgate::start(examples(), &Backend::Redis(redis.url()), &[]);
    let llm = llm_upstream().await;
    let (listener, admin) = (loopback(), loopback());
    let _envoy = Envoy::start(&gateway(listener, admin, tollgate.grpc, llm.addr), admin);
    let trial = bearer("initech");
    let get = |path: &str| http_request(listener, path, &[("authorization", &trial)]);

    // 1,000 tokens, responses of 600: 200, 200 (the check passes at 400), then 429.
    let mut statuses = Vec::new();
    for round in 1..=2u64 {
        let r = get("/complete?tokens=600");
        statuses.push(r.status);
        wait_for("the charge after the response", || tokens_decided(&[&tollgate]) >= 600.0 * round as f64)
            .await;
    }
    let refused = get("/complete?tokens=600");
    statuses.push(refused.status);
    let retry: u64 = refused.header("retry-after").expect("Retry-After").parse().unwrap();
    let balance: f64 = redis::cmd("HGET")
        .arg("rl:{initech}:llm-gateway:tokens")
        .arg("t")
        .query(&mut redis.connection())
        .unwrap();
    println!("trial tenant, 1,000 tokens, responses of 600: {statuses:?}, Retry-After {retry} s, balance {balance:.1}");
    assert_eq!(statuses, vec![200, 200, 429]);
    assert!((1..=3).contains(&retry), "200 tokens of debt at 100/s: {retry}");
    assert!((-200.0..0.0).contains(&balance), "in debt by less than one response: {balance}");
    assert_eq!(llm.reported.load(Ordering::SeqCst), 1200, "the refused request never reached the upstream");
    // Nothing charged for the 429: Envoy's own response has no x-tokens-used.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(tokens_decided(&[&tollgate]), 1200.0, "the 429 was charged nothing");
    // After the refill time, 200 again.
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let again = get("/complete?tokens=10");
    assert_eq!(again.status, 200, "{again:?}");
    wait_for("its charge", || tokens_decided(&[&tollgate]) >= 1210.0).await;

    // A streamed response: charged once, after it ends, from its trailer.
    let free = bearer("globex");
    let before = tokens_decided(&[&tollgate]);
    let start = Instant::now();
    let stream = tokio::task::spawn_blocking(move || {
        http_request(listener, "/stream?tokens=700&chunks=5&pause_ms=150", &[("authorization", &free)])
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let during = tokens_decided(&[&tollgate]) - before;
    let streamed = stream.await.unwrap();
    let done = start.elapsed();
    wait_for("the stream's charge", || tokens_decided(&[&tollgate]) - before >= 700.0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = tokens_decided(&[&tollgate]) - before;
    println!(
        "streamed response ({} bytes in {done:?}, cost 700 in a trailer): charged {during} while streaming, {after} after",
        streamed.body.len()
    );
    assert_eq!(streamed.status, 200);
    assert_eq!(streamed.body.matches("token ").count(), 5, "every chunk arrived: {:?}", streamed.body);
    assert_eq!(during, 0.0, "nothing is charged before the response ends");
    assert_eq!(after, 700.0, "charged once");
}

#[tokio::test(flavor = "multi_thread")]
async fn two_envoys_share_one_budget_on_a_cluster() {
    const BUDGET: f64 = 5_000.0;
    const REFILL: f64 = 1.0;
    let cluster = RedisCluster::start();
    let replicas: Vec<Tollgate> =
        (0..2).map(|_| Tollgate::start(examples(), &Backend::Cluster(cluster.seeds()), &[])).collect();
    let llm = llm_upstream().await;
    let mut envoys = Vec::new();
    let mut listeners = Vec::new();
    for replica in &replicas {
        let (listener, admin) = (loopback(), loopback());
        envoys.push(Envoy::start(&gateway(listener, admin, replica.grpc, llm.addr), admin));
        listeners.push(listener);
    }
    // One client per Envoy, each sending one request at a time, costs 50-150 tokens.
    let start = Instant::now();
    let clients: Vec<_> = listeners
        .iter()
        .enumerate()
        .map(|(c, listener)| {
            let (listener, token) = (*listener, bearer("hooli"));
            tokio::task::spawn_blocking(move || {
                let (mut admitted, mut refused, mut admitted_tokens) = (0u64, 0u64, 0u64);
                let mut i = c as u64;
                while start.elapsed() < Duration::from_secs(6) {
                    let cost = 50 + (i * 37) % 101;
                    i += 2;
                    let r = http_request(
                        listener,
                        &format!("/complete?tokens={cost}"),
                        &[("authorization", &token)],
                    );
                    match r.status {
                        200 => {
                            admitted += 1;
                            admitted_tokens += cost;
                        }
                        429 => {
                            refused += 1;
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        other => panic!("unexpected {other}: {r:?}"),
                    }
                }
                (admitted, refused, admitted_tokens)
            })
        })
        .collect();
    let mut totals = (0, 0, 0);
    for client in clients {
        let (a, r, t) = client.await.unwrap();
        totals = (totals.0 + a, totals.1 + r, totals.2 + t);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let reported = llm.reported.load(Ordering::SeqCst) as f64;
    let servers: Vec<&Tollgate> = replicas.iter().collect();
    wait_for("every charge", || tokens_decided(&servers) >= reported).await;
    let balance: f64 = redis::cmd("HGET")
        .arg("rl:{hooli}:llm-gateway:tokens")
        .arg("t")
        .query(&mut cluster.connection())
        .unwrap();
    let refilled = REFILL * start.elapsed().as_secs_f64();
    let charged = BUDGET + refilled - balance;
    println!(
        "2 Envoys, 2 replicas, one budget of {BUDGET}: {} admitted ({} tokens), {} refused in {elapsed:.1} s; upstream reported {reported}, charged {charged:.1} (balance {balance:.1})",
        totals.0, totals.2, totals.1
    );
    assert!(totals.1 > 0, "the budget ran out");
    assert_eq!(totals.2 as f64, reported, "every admitted response was reported");
    assert!((charged - reported).abs() <= reported * 0.01, "charged {charged} vs reported {reported}");
    // Admitted within the budget (and what refilled) plus one response in flight per Envoy.
    assert!(reported <= BUDGET + refilled + 2.0 * 150.0, "admitted {reported} tokens");
}
