//! The store is down or silent: each domain's failure mode answers, within the Redis deadline,
//! and tollgate recovers by itself when Redis comes back.

mod common;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::*;
use tonic::Code;

const CONFIG: &str = r#"
domain: open
failure_mode: allow
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

fn configs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, mode) in [("open", "allow"), ("closed", "deny"), ("loud", "error")] {
        let yaml = CONFIG.replace("domain: open", &format!("domain: {name}")).replace("allow", mode);
        std::fs::write(dir.path().join(format!("{name}.yaml")), yaml).unwrap();
    }
    dir
}

// Asks each domain once, bounding the wait on the client side: a hang fails the test.
async fn failure_modes_answer(addr: &str) {
    for (domain, expected) in [("open", Ok(OK)), ("closed", Ok(OVER_LIMIT)), ("loud", Err(Code::Unavailable))]
    {
        let start = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(2), ask(addr, req(domain, &["k=v"], 1)))
            .await
            .unwrap_or_else(|_| panic!("{domain}: no answer within 2 s"));
        let took = start.elapsed();
        match (answer, expected) {
            (Ok(r), Ok(code)) => {
                assert_eq!(r.overall_code, code, "{domain}");
                assert!(r.statuses[0].current_limit.is_some(), "{domain}: the limit is still reported");
            }
            (Err(status), Err(code)) => assert_eq!(status.code(), code, "{domain}: {status:?}"),
            (other, expected) => panic!("{domain}: got {other:?}, expected {expected:?}"),
        }
        println!("{domain}: answered in {took:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_refusing_connections_then_coming_back() {
    let dir = configs();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let server = Tollgate::start_unready(dir.path(), &Backend::Redis(url), &["--redis-timeout", "50ms"]);
    let (status, body) = http_get(server.http, "/readyz").unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("store unreachable"), "{body}");
    failure_modes_answer(&server.addr()).await;

    // Redis appears on that port: answers become real, with no restart.
    let redis = Redis::start_with(&["--port", &port.to_string()]);
    assert_eq!(redis.port, port);
    let addr = server.addr();
    let mut real = false;
    for _ in 0..100 {
        let r = ask(&addr, req("closed", &["k=recovered"], 1)).await.unwrap();
        if r.overall_code == OK {
            real = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(real, "tollgate reconnected to Redis");
    assert_eq!(ask(&addr, req("closed", &["k=recovered"], 1)).await.unwrap().overall_code, OVER_LIMIT);
    wait_until("/readyz to turn 200", 100, Duration::from_millis(50), || {
        http_get(server.http, "/readyz").is_some_and(|(s, _)| s == 200)
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_that_accepts_but_never_answers() {
    // A listener that completes TCP handshakes (the kernel does) and never reads or writes.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", silent.local_addr().unwrap());
    let dir = configs();
    let server = Tollgate::start_unready(dir.path(), &Backend::Redis(url), &["--redis-timeout", "50ms"]);
    failure_modes_answer(&server.addr()).await;
    assert_eq!(http_get(server.http, "/readyz").unwrap().0, 503);
}

#[tokio::test(flavor = "multi_thread")]
async fn cluster_seeds_unreachable() {
    let dir = configs();
    let seeds = format!("127.0.0.1:{},127.0.0.1:{}", free_port(), free_port());
    let server = Tollgate::start_unready(dir.path(), &Backend::Cluster(seeds), &["--redis-timeout", "50ms"]);
    failure_modes_answer(&server.addr()).await;
}
