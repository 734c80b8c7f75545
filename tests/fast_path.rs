//! The RLS fast path (`src/edge/rls/fast.rs`) answers as tonic's path does: the same requests,
//! raw bytes included, sent to a server with it and to one without (`--rls-fast-path false`), get
//! the same HTTP status, headers, message and trailers, and move the same metrics. Covered: OK and
//! OVER_LIMIT answers with their headers, requests tollgate will not evaluate, bytes that are not
//! a request (which the fast path hands to tonic), compression it does not serve, a store that
//! never answers (each failure mode, and a deadline the caller set with `grpc-timeout`), and TLS.

mod common;

use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use prost::Message as _;
use tonic::codegen::{http, Bytes};

const CONFIG: &str = r#"
domain: test
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 2}
"#;
// A domain per failure mode that answers without the store.
const DOWN: [(&str, &str); 2] = [
    ("deny.yaml", "domain: deny\nfailure_mode: deny\ndescriptors: [{key: tenant, rate_limit: {unit: hour, requests_per_unit: 2}}]\n"),
    ("error.yaml", "domain: error\nfailure_mode: error\ndescriptors: [{key: tenant, rate_limit: {unit: hour, requests_per_unit: 2}}]\n"),
];
const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// A response as the wire had it: status, headers and trailers (without `date`), and the body.
#[derive(Debug, PartialEq)]
struct Raw {
    status: u16,
    headers: Vec<(String, String)>,
    message: Option<RateLimitResponse>,
    trailers: Vec<(String, String)>,
}

fn fields(map: &http::HeaderMap) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = map
        .iter()
        .filter(|(name, _)| *name != "date")
        .map(|(name, value)| (name.to_string(), value.to_str().unwrap_or("?").to_owned()))
        .collect();
    out.sort();
    out
}

// Sends `body` with `headers` to `addr` over plaintext HTTP/2 and reads the whole answer; with
// `end` false the request stays open after the body, as a client that keeps sending would.
async fn send(addr: &str, headers: &[(&str, &str)], body: Vec<u8>, end: bool) -> Raw {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut request = http::Request::post(format!("http://{addr}{PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let (answer, mut send) = client.send_request(request.body(()).unwrap(), false).unwrap();
    send.send_data(Bytes::from(body), end).unwrap();
    let response = answer.await.unwrap();
    let (parts, mut body) = response.into_parts();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await.unwrap().map(|t| fields(&t)).unwrap_or_default();
    let message =
        (bytes.len() > 5).then(|| timeless(RateLimitResponse::decode(&bytes[5..]).expect("a message")));
    Raw { status: parts.status.as_u16(), headers: fields(&parts.headers), message, trailers }
}

// `response` without the times it reports (until a bucket is full, when to retry): two servers
// asked a moment apart may differ in them by a second.
fn timeless(mut response: RateLimitResponse) -> RateLimitResponse {
    for status in &mut response.statuses {
        status.duration_until_reset = status.duration_until_reset.map(|_| Default::default());
    }
    for header in &mut response.response_headers_to_add {
        if ["retry-after", "x-ratelimit-reset"].contains(&header.key.to_ascii_lowercase().as_str()) {
            header.value.clear();
        }
    }
    response
}

// A gRPC message frame around `message`, with `flag` as its compression flag.
fn frame(flag: u8, message: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

fn request(domain: &str, descriptor: &str) -> Vec<u8> {
    frame(0, &req(domain, &[descriptor], 1).encode_to_vec())
}

// The same exchange with both servers; returns the fast path's answer.
async fn same(fast: &Tollgate, tonic: &Tollgate, headers: &[(&str, &str)], body: Vec<u8>) -> Raw {
    same_sent(fast, tonic, headers, body, true).await
}

async fn same_sent(
    fast: &Tollgate,
    tonic: &Tollgate,
    headers: &[(&str, &str)],
    body: Vec<u8>,
    end: bool,
) -> Raw {
    let within = |addr: String, body: Vec<u8>| async move {
        tokio::time::timeout(Duration::from_secs(20), send(&addr, headers, body, end))
            .await
            .unwrap_or_else(|_| panic!("{addr} did not answer within 20 s"))
    };
    let a = within(fast.addr(), body.clone()).await;
    let b = within(tonic.addr(), body).await;
    assert_eq!(a, b, "the fast path answered otherwise than tonic's");
    a
}

fn grpc_status(raw: &Raw) -> Option<&str> {
    raw.trailers.iter().chain(&raw.headers).find(|(k, _)| k == "grpc-status").map(|(_, v)| v.as_str())
}

// What the decisions moved, as both servers count them.
fn counted(server: &Tollgate) -> Vec<(String, f64)> {
    let scrape = server.metrics();
    let mut out: Vec<(String, f64)> = scrape
        .samples
        .iter()
        .filter(|s| {
            ["tollgate_decisions_total", "tollgate_invalid_requests_total", "tollgate_store_errors_total"]
                .contains(&s.metric.as_str())
        })
        .map(|s| {
            let value = match &s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => *v,
                other => panic!("{other:?}"),
            };
            let mut labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            labels.sort();
            (format!("{}{{{}}}", s.metric, labels.join(",")), value)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fast_path_answers_as_tonic_does() {
    let (_dir, config) = config_file(CONFIG);
    let fast = Tollgate::start(&config, &Backend::Memory, &[]);
    let tonic = Tollgate::start(&config, &Backend::Memory, &["--rls-fast-path", "false"]);

    // OK twice, then OVER_LIMIT, with the limit headers.
    for expected in ["0", "0", "0"] {
        let raw = same(&fast, &tonic, &[], request("test", "tenant=a")).await;
        assert_eq!(grpc_status(&raw), Some(expected));
        assert!(raw.message.is_some());
    }
    let over = same(&fast, &tonic, &[], request("test", "tenant=a")).await;
    assert_eq!(over.message.as_ref().map(|m| m.overall_code), Some(2), "OVER_LIMIT: {over:?}");
    // Not evaluated: INVALID_ARGUMENT with tollgate's reason.
    let invalid = same(&fast, &tonic, &[], request("", "tenant=a")).await;
    assert_eq!(grpc_status(&invalid), Some("3"));
    // Bytes that are not a request, a compressed message without an encoding, an encoding tonic
    // does not take, a frame longer than its body, no message at all: tonic's answers.
    for (headers, body, code) in [
        (vec![], frame(0, b"\xff\xff\xff"), "3"),
        (vec![], frame(1, &req("test", &["tenant=b"], 1).encode_to_vec()), "13"),
        (vec![("grpc-encoding", "gzip")], request("test", "tenant=b"), "12"),
        (vec![], request("test", "tenant=b")[..8].to_vec(), "13"),
        (vec![], Vec::new(), "13"),
    ] {
        let raw = same(&fast, &tonic, &headers, body).await;
        assert_eq!(grpc_status(&raw), Some(code), "{raw:?}");
    }
    // A message longer than tonic takes, sent on and on: the fast path holds no more than one
    // message's worth and hands it to tonic, which refuses it by its length prefix.
    let mut endless = frame(0, &[]);
    endless[1..5].copy_from_slice(&(8u32 << 20).to_be_bytes());
    endless.resize(6 << 20, 0);
    let refused = same_sent(&fast, &tonic, &[], endless, false).await;
    assert_eq!(grpc_status(&refused), Some("11"), "OUT_OF_RANGE: {refused:?}");
    assert_eq!(counted(&fast), counted(&tonic), "the same metrics");
    // The fast path served the rest itself.
    let fallbacks =
        |server: &Tollgate| sample(&server.metrics(), "tollgate_rls_fast_path_fallbacks_total", &[]);
    assert_eq!((fallbacks(&fast), fallbacks(&tonic)), (6.0, 0.0), "only the six odd requests reach tonic");
}

// A store that takes connections and never answers: every call waits for its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_store_hung_both_paths_keep_deadlines_and_failure_modes() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (file, yaml) in DOWN {
        std::fs::write(dir.path().join(file), yaml).unwrap();
    }
    let config = dir.path();
    let url = format!("redis://{}", silent.local_addr().unwrap());
    let args = ["--redis-url", url.as_str(), "--redis-timeout", "300ms"];
    let fast = Tollgate::start_unready(config, &Backend::Memory, &args);
    let tonic_args = [&args[..], &["--rls-fast-path", "false"]].concat();
    let tonic = Tollgate::start_unready(config, &Backend::Memory, &tonic_args);
    let denied = same(&fast, &tonic, &[], request("deny", "tenant=a")).await;
    assert_eq!(denied.message.as_ref().map(|m| m.overall_code), Some(2), "{denied:?}");
    let unavailable = same(&fast, &tonic, &[], request("error", "tenant=a")).await;
    assert_eq!(grpc_status(&unavailable), Some("14"), "{unavailable:?}");
    // The caller's deadline (100 ms) comes before the store's (300 ms): tonic's answer to it.
    let late = same(&fast, &tonic, &[("grpc-timeout", "100m")], request("deny", "tenant=b")).await;
    assert_eq!(grpc_status(&late), Some("1"), "CANCELLED: {late:?}");
    assert_eq!(counted(&fast), counted(&tonic), "the same metrics");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_both_paths_answer_alike() {
    let pki = TestPki::new();
    let (_dir, config) = config_file(CONFIG);
    let tls = ["--tls-cert", &pki.path_str("server.pem"), "--tls-key", &pki.path_str("server.key")]
        .map(String::from);
    let tls: Vec<&str> = tls.iter().map(String::as_str).collect();
    let fast = Tollgate::start(&config, &Backend::Memory, &tls);
    let tonic =
        Tollgate::start(&config, &Backend::Memory, &[&tls[..], &["--rls-fast-path", "false"]].concat());
    let client = pki.client_tls(false);
    for _ in 0..3 {
        let ask = |addr: String| {
            let client = client.clone();
            async move {
                let answer = tokio::time::timeout(
                    Duration::from_secs(10),
                    tollgate::client::ask_with(&addr, req("test", &["tenant=t"], 1), Some(&client)),
                )
                .await
                .expect("answered");
                timeless(answer.expect("an answer over TLS"))
            }
        };
        assert_eq!(ask(fast.addr()).await, ask(tonic.addr()).await);
    }
    assert_eq!(counted(&fast), counted(&tonic), "the same metrics");
}
