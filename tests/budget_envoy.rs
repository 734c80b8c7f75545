//! LLM spend budgets through a real Envoy 1.40 (`envoy/llm-budgets.yaml`, the filters `tollgate
//! render` prints for `examples/llm-budgets.yaml`) in front of the stand-in LLM API
//! (`envoy/demo/fake-llm.py`, OpenAI-style `usage`), three tollgate replicas on a Redis Cluster:
//!
//! * 50 concurrent requests on one key with a budget of five cents: the money spent at the org,
//!   team and key levels is exactly the priced usage of the admitted requests, in nano-units; the
//!   usage stays within the holds, so the stated overshoot bound is zero: nothing past the budget;
//!   every hold is released once the stream-end settlements are in;
//! * a streamed answer's usage (its last server-sent event) is settled the same way;
//! * a hostile client (one replica on a standalone Redis behind the fault proxy): its own
//!   `x-request-id` never names the hold's record; a decoy `model`/`max_tokens` inside a nested
//!   object is not what is held; a top-level key given twice is refused with 400; an oversized
//!   header, an absent level's header and a failed store are answered 429, nothing charged.

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use common::proxy::{Fault, FaultProxy};
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

/// The stand-in LLM API (`envoy/demo/fake-llm.py`), answering; its process and address.
fn fake_llm() -> (Proc, SocketAddr) {
    let port = free_port();
    let llm = Proc::spawn(
        "python3",
        Command::new("python3")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/envoy/demo/fake-llm.py"))
            .arg(port.to_string()),
    );
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_until("the stand-in LLM", 100, Duration::from_millis(50), || {
        std::net::TcpStream::connect(addr).is_ok()
    });
    (llm, addr)
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
    // The shipped 0.1 s RLS timeout is for release builds; three debug replicas on two shared
    // cores, cold, can take longer for the first holds of a burst, and Envoy's answer to its own
    // timeout (500) says nothing about money. A store failure still reaches tollgate's failure
    // mode well inside a second.
    let hcm = &mut c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filters = hcm["http_filters"].as_array_mut().unwrap();
    let ratelimit = filters.iter_mut().find(|f| f["name"] == "envoy.filters.http.ratelimit").unwrap();
    ratelimit["typed_config"]["timeout"] = json!("1s");
    c
}

/// One POST of `body` for API key `key` of org acme, team search; the status and the whole answer.
async fn post(listener: SocketAddr, key: &str, body: &str) -> (u16, String) {
    post_with(listener, &[("x-org", "acme"), ("x-team", "search"), ("x-api-key", key)], body).await
}

/// One POST of `body` with `headers`; the status and the whole answer.
async fn post_with(listener: SocketAddr, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(listener).await.unwrap();
    let headers: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: llm\r\n{headers}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
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

/// What a request with `body` holds at gpt-4o's prices: max_tokens output ($10/M) and the body's
/// bytes as input tokens at the dearest input price ($2.50/M), rounded up once.
fn held(body: &str, max_tokens: u64) -> Money {
    Money((u128::from(max_tokens) * 10_000_000_000 + body.len() as u128 * 2_500_000_000).div_ceil(1_000_000))
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
fn level(con: &mut impl redis::ConnectionLike, path: &str, calendar: &Calendar) -> (Money, Money) {
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
    let (mut llm, llm_addr) = fake_llm();
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
    let hold = held(body, 2_000);
    assert!(
        expected <= budget && Money(expected.0 + hold.0) > budget,
        "{expected} spent of {budget}: then a ${hold} hold no longer fits"
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

    // The provider fails a call (503, an error and no usage): it bills nothing, and the hold
    // settles at zero at stream end rather than expiring into a charge of all of it.
    let org_month = Calendar::new(Per::Month, "Europe/Berlin").unwrap();
    let (k3, before) = ("org=acme:team=search:api_key=k3", level(&mut con, "org=acme", &org_month));
    let settled_open = || -> f64 {
        let hold = [("hold", "open")];
        replicas.iter().map(|r| sample(&r.metrics(), "tollgate_budget_settlements_total", &hold)).sum()
    };
    let settled_before = settled_open();
    let failed = r#"{"model": "gpt-4o", "max_tokens": 400, "fail": 503, "messages": []}"#;
    let (status, answer) = post(listener, "k3", failed).await;
    assert_eq!(status, 503, "{answer}");
    wait_until("the failed call's settlement of its open hold", 200, Duration::from_millis(50), || {
        settled_open() > settled_before
    });
    assert_eq!(level(&mut con, k3, &day), (Money::ZERO, Money::ZERO), "nothing spent, nothing held");
    assert_eq!(level(&mut con, "org=acme", &org_month), before, "the org's spend is unchanged");
    llm.kill();
}

/// Every record key of org acme's holds in a standalone Redis.
fn records(con: &mut redis::Connection) -> Vec<String> {
    redis::cmd("KEYS").arg("rl:{acme}:llm:hold:*").query(con).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_client_cannot_bend_the_budget_through_envoy() {
    let redis = Redis::start();
    let proxy = FaultProxy::start(redis.port);
    let backend = Backend::Redis(format!("redis://127.0.0.1:{}", proxy.port));
    let replica = Tollgate::start(examples_file().as_ref(), &backend, &["--redis-timeout", "100ms"]);
    let (mut llm, llm_addr) = fake_llm();
    let (listener, admin) = (loopback(), loopback());
    let _envoy = Envoy::start(&gateway(listener, admin, &[replica.grpc], llm_addr), admin);
    let mut con = redis.connection();
    let day = Calendar::new(Per::Day, "UTC").unwrap();
    let key_level = |con: &mut redis::Connection, key: &str| {
        level(con, &format!("org=acme:team=search:api_key={key}"), &day)
    };
    fn org(key: &str) -> Vec<(&str, &str)> {
        vec![("x-org", "acme"), ("x-team", "search"), ("x-api-key", key)]
    }

    // The client's own x-request-id is replaced by Envoy's: the record is not under its value.
    let body = r#"{"model": "gpt-4o", "max_tokens": 100, "messages": []}"#;
    for _ in 0..3 {
        let mut headers = org("k1");
        headers.push(("x-request-id", "chosen-by-client"));
        let (status, _) = post_with(listener, &headers, body).await;
        assert_eq!(status, 200);
    }
    let keys = records(&mut con);
    assert_eq!(keys.len(), 3, "one record per request, not one shared by the client's id: {keys:?}");
    assert!(keys.iter().all(|k| !k.contains("chosen-by-client")), "{keys:?}");
    wait_until("the settlements", 200, Duration::from_millis(50), || {
        key_level(&mut con, "k1").1 == Money::ZERO
    });
    assert_eq!(key_level(&mut con, "k1").0, Money(priced(body, 100).0 * 3), "each charged its own usage");

    // A decoy inside `metadata` is not what is held: the top-level 40,000 tokens ($0.40) are
    // above the key's $0.05 a day, refused outright.
    let decoy = r#"{"metadata": {"max_tokens": 1, "model": "gpt-4o-mini"}, "model": "gpt-4o", "max_tokens": 40000, "messages": []}"#;
    let (status, answer) = post_with(listener, &org("k2"), decoy).await;
    assert_eq!(status, 429, "{answer}");
    assert!(answer.to_lowercase().contains("x-budget-exhausted: request\r\n"), "{answer}");
    // Token maxima Envoy would drop as a hits_addend (above 10^9, or too long for a number) are
    // clamped and held at the model's most: still above k2's $0.05, so refused, never skipped.
    for max in ["1000000001", "4294967296", "99999999999999999999999999"] {
        let huge = format!(r#"{{"model": "gpt-4o", "max_tokens": {max}, "messages": []}}"#);
        let (status, answer) = post_with(listener, &org("k2"), &huge).await;
        assert_eq!(status, 429, "max_tokens {max}: {answer}");
        assert!(answer.to_lowercase().contains("x-budget-exhausted: request\r\n"), "{answer}");
    }
    // A top-level key given twice (the upstream's parser would take the last): 400, no hold.
    let twice = r#"{"model": "gpt-4o-mini", "model": "gpt-4o", "max_tokens": 10, "messages": []}"#;
    let (status, answer) = post_with(listener, &org("k2"), twice).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("more than once"), "{answer}");
    let escaped = r#"{"model": "gpt-4o", "mod\u0065l": "gpt-4o-mini", "max_tokens": 10, "messages": []}"#;
    assert_eq!(post_with(listener, &org("k2"), escaped).await.0, 400, "an escaped duplicate is a duplicate");
    // An API key header over 1,024 bytes, and a request without its team header: 429.
    let long = "k".repeat(2_000);
    let (status, answer) = post_with(listener, &org(&long), body).await;
    assert_eq!(status, 429, "{answer}");
    let (status, answer) = post_with(listener, &[("x-org", "acme"), ("x-api-key", "k2")], body).await;
    assert_eq!(status, 429, "{answer}");
    assert!(answer.to_lowercase().contains("x-budget-exhausted: request\r\n"), "{answer}");
    // A failed store: 429 (the domain and the filter fail closed), nothing held once cancelled.
    proxy.set(Fault::DropReplies);
    let (status, _) = post_with(listener, &org("k2"), body).await;
    assert_eq!(status, 429);
    proxy.set(Fault::Pass);
    wait_until("the cancel", 100, Duration::from_millis(50), || {
        sample(&replica.metrics(), "tollgate_budget_recoveries_total", &[("outcome", "ok")]) >= 1.0
    });
    assert_eq!(key_level(&mut con, "k2"), (Money::ZERO, Money::ZERO), "nothing charged to k2");
    llm.kill();
}
