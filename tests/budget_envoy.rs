//! LLM spend budgets through a real Envoy 1.40 (`envoy/llm-budgets.yaml`, the filters `tollgate
//! render` prints for `examples/llm-budgets.yaml`) in front of the stand-in LLM API
//! (`envoy/demo/fake-llm.py`, OpenAI-style `usage`), three tollgate replicas on a Redis Cluster:
//!
//! * 50 concurrent requests on one key with a budget of five cents: the money spent at the org,
//!   team and key levels is exactly the priced usage of the admitted requests, in nano-units; the
//!   usage stays within the holds, so the stated overshoot bound is zero: nothing past the budget;
//!   every hold is released once the stream-end settlements are in;
//! * a streamed answer's usage (its last server-sent event) is settled the same way.

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate::budget::{Calendar, Money, Per};

fn loopback() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().unwrap()
}

fn examples_file() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/examples/llm-budgets.yaml").to_owned()
}

/// The shipped gateway, pointed at the replicas and the stand-in LLM.
fn gateway(listener: SocketAddr, admin: SocketAddr, replicas: &[SocketAddr], llm: SocketAddr) -> Value {
    let mut c = repo_yaml("envoy/llm-budgets.yaml");
    let socket = |a: SocketAddr| json!({"address": a.ip().to_string(), "port_value": a.port()});
    c["admin"]["address"]["socket_address"] = socket(admin);
    c["static_resources"]["listeners"][0]["address"]["socket_address"] = socket(listener);
    for cluster in c["static_resources"]["clusters"].as_array_mut().unwrap() {
        let endpoints: Vec<Value> = if cluster["name"] == "tollgate" {
            replicas
                .iter()
                .map(|r| json!({"endpoint": {"address": {"socket_address": socket(*r)}}}))
                .collect()
        } else {
            vec![json!({"endpoint": {"address": {"socket_address": socket(llm)}}})]
        };
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = json!(endpoints);
    }
    c
}

/// One POST of `body` for API key `key` of org acme, team search; the status and the whole answer.
async fn post(listener: SocketAddr, key: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(listener).await.unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: llm\r\nx-org: acme\r\nx-team: search\r\nx-api-key: {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    (answer.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0), answer)
}

/// One POST for key k1; the status.
async fn complete(listener: SocketAddr, body: &str) -> u16 {
    post(listener, "k1", body).await.0
}

/// What the stand-in charges for `body` at gpt-4o's prices: a quarter of its bytes cached input
/// ($1.25/M), the rest input ($2.50/M), half of max_tokens output ($10/M), each rounded up.
fn priced(body: &str, max_tokens: u64) -> Money {
    let prompt = body.len() as u64;
    let cached = prompt / 4;
    let cost = |tokens: u64, per_million: u128| (u128::from(tokens) * per_million).div_ceil(1_000_000);
    Money(
        cost(prompt - cached, 2_500_000_000)
            + cost(cached, 1_250_000_000)
            + cost(max_tokens / 2, 10_000_000_000),
    )
}

/// Spent and held money at level `path` in the period `calendar` has now.
fn level(con: &mut redis::cluster::ClusterConnection, path: &str, calendar: &Calendar) -> (Money, Money) {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let key = format!("rl:{{acme}}:llm:{path}:budget:{}", calendar.window(now).start_ms);
    let (s, h): (Option<String>, Option<String>) =
        redis::cmd("HMGET").arg(&key).arg("s").arg("h").query(con).unwrap();
    let money = |t: Option<String>| t.map(|t| Money::from_nanos(&t).unwrap()).unwrap_or_default();
    (money(s), money(h))
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_requests_spend_exactly_their_priced_usage() {
    let cluster = RedisCluster::start();
    let replicas: Vec<Tollgate> = (0..3)
        .map(|_| Tollgate::start(examples_file().as_ref(), &Backend::Cluster(cluster.seeds()), &[]))
        .collect();
    let llm_port = free_port();
    let mut llm = Proc::spawn(
        "python3",
        Command::new("python3")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/envoy/demo/fake-llm.py"))
            .arg(llm_port.to_string()),
    );
    let llm_addr: SocketAddr = format!("127.0.0.1:{llm_port}").parse().unwrap();
    wait_until("the stand-in LLM", 100, Duration::from_millis(50), || {
        std::net::TcpStream::connect(llm_addr).is_ok()
    });
    let (listener, admin) = (loopback(), loopback());
    let grpc: Vec<SocketAddr> = replicas.iter().map(|r| r.grpc).collect();
    let _envoy = Envoy::start(&gateway(listener, admin, &grpc, llm_addr), admin);

    // Each holds 2,000 output tokens at $10/M = $0.02 of the key's $0.05 a day, and uses about
    // half of that: 50 at once, then one at a time until the key is spent.
    let body =
        r#"{"model": "gpt-4o", "max_tokens": 2000, "messages": [{"role": "user", "content": "Hello"}]}"#;
    let cost = priced(body, 2_000);
    let burst: Vec<_> = (0..50).map(|_| tokio::spawn(complete(listener, body))).collect();
    let mut codes = Vec::new();
    for task in burst {
        codes.push(task.await.unwrap());
    }
    let admitted_at_once = codes.iter().filter(|c| **c == 200).count();
    assert!(codes.iter().all(|c| *c == 200 || *c == 429), "{codes:?}");
    assert!(
        (1..=4).contains(&admitted_at_once),
        "two holds of $0.02 fit in $0.05 at once (a third or fourth once the first settled): {codes:?}"
    );
    let mut admitted = admitted_at_once as u128;
    for _ in 0..10 {
        // Let the settlements of what was admitted land, then ask again.
        let mut con = cluster.connection();
        wait_until("the settlements", 200, Duration::from_millis(50), || {
            level(&mut con, "org=acme:team=search:api_key=k1", &Calendar::new(Per::Day, "UTC").unwrap()).1
                == Money::ZERO
        });
        match complete(listener, body).await {
            200 => admitted += 1,
            429 => break,
            other => panic!("status {other}"),
        }
    }
    let mut con = cluster.connection();
    wait_until("the last settlement", 200, Duration::from_millis(50), || {
        level(&mut con, "org=acme:team=search:api_key=k1", &Calendar::new(Per::Day, "UTC").unwrap()).1
            == Money::ZERO
    });
    let budget = Money::parse("0.05").unwrap();
    println!(
        "budgets through Envoy: {admitted} admitted ({admitted_at_once} of the burst of 50), each ${cost}"
    );
    let expected = Money(cost.0 * admitted);
    assert!(
        expected <= budget && Money(expected.0 + Money::parse("0.02").unwrap().0) > budget,
        "{expected} spent of {budget}: then a $0.02 hold no longer fits"
    );
    for (path, calendar) in [
        ("org=acme", Calendar::new(Per::Month, "Europe/Berlin").unwrap()),
        ("org=acme:team=search", Calendar::new(Per::Month, "UTC").unwrap()),
        ("org=acme:team=search:api_key=k1", Calendar::new(Per::Day, "UTC").unwrap()),
    ] {
        assert_eq!(
            level(&mut con, path, &calendar),
            (expected, Money::ZERO),
            "{path}: spent is the exact priced usage of the {admitted} admitted requests, every hold released"
        );
    }

    // A streamed answer on another key: its usage, in the last event, is settled the same way.
    let streamed = r#"{"model": "gpt-4o", "max_tokens": 400, "stream": true, "messages": []}"#;
    let (status, answer) = post(listener, "k2", streamed).await;
    assert!(answer.contains("data: [DONE]"), "{answer}");
    assert_eq!(status, 200);
    let day = Calendar::new(Per::Day, "UTC").unwrap();
    wait_until("the streamed settlement", 200, Duration::from_millis(50), || {
        level(&mut con, "org=acme:team=search:api_key=k2", &day).0 > Money::ZERO
    });
    assert_eq!(
        level(&mut con, "org=acme:team=search:api_key=k2", &day),
        (priced(streamed, 400), Money::ZERO)
    );
    llm.kill();
}
