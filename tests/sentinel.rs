//! Redis behind Sentinel: tollgate finds the primary through three real sentinels, follows a
//! failover under load (the primary killed by its PID), and counts nothing twice.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

const CAPACITY: f64 = 1_000_000.0;

/// Requests in flight at any time.
const CLIENTS: usize = 4;

#[tokio::test(flavor = "multi_thread")]
async fn decisions_follow_a_sentinel_failover_and_count_nothing_twice() {
    let mut group = SentinelGroup::start();
    let (_dir, config) = config_file(
        "domain: s\nfailure_mode: deny\ndescriptors:\n  - key: k\n    token_bucket: {capacity: 1000000, refill_per_second: 0.001}\n",
    );
    let server = Tollgate::start(
        &config,
        &Backend::Memory,
        &[
            "--redis-sentinel",
            &group.addrs(),
            "--redis-sentinel-master",
            SENTINEL_MASTER,
            "--redis-timeout",
            "500ms",
        ],
    );

    // Clients ask without pause; every answer is recorded with its time.
    let answers: Arc<Mutex<Vec<(Instant, i32)>>> = Arc::default();
    let stop_at = Arc::new(Mutex::new(Instant::now() + Duration::from_secs(60)));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (answers, stop_at, addr) = (answers.clone(), stop_at.clone(), server.addr());
            tokio::spawn(async move {
                while Instant::now() < *stop_at.lock().unwrap() {
                    let code = ask(&addr, req("s", &["k=v"], 1)).await.unwrap().overall_code;
                    answers.lock().unwrap().push((Instant::now(), code));
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;

    let killed = Instant::now();
    group.primary.kill();
    // Wait (bounded) until the sentinels name the replica and an admission follows the last
    // failure-mode answer.
    let deadline = killed + Duration::from_secs(30);
    let resumed = loop {
        assert!(Instant::now() < deadline, "no decision after the failover within 30 s");
        if group.primary_port() == Some(group.replica.port) {
            let answers = answers.lock().unwrap();
            let last_failure = answers.iter().filter(|(_, code)| *code != OK).map(|a| a.0).max();
            let after = last_failure.and_then(|f| answers.iter().find(|(at, code)| *at > f && *code == OK));
            if let Some((at, _)) = after {
                break *at;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    *stop_at.lock().unwrap() = Instant::now();
    for client in clients {
        client.await.unwrap();
    }

    let answers = answers.lock().unwrap();
    let admitted = answers.iter().filter(|(_, code)| *code == OK).count() as f64;
    let denied_by_failure = answers.iter().filter(|(_, code)| *code != OK).count();
    assert!(denied_by_failure > 0, "the kill was noticed");
    let promoted = group.primary_port().expect("a primary after the failover");
    assert_eq!(promoted, group.replica.port, "the replica was promoted");
    let admitted_after = answers.iter().filter(|(at, code)| *code == OK && *at >= resumed).count() as f64;

    // The balance on the new primary.
    let mut con = group.replica.connection();
    let keys: Vec<String> = redis::cmd("KEYS").arg("rl:*").query(&mut con).unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let tokens = stored_tokens(&mut con, &keys[0]);
    let debited = CAPACITY - tokens;
    println!(
        "sentinel failover: {} answers, {admitted} admitted, {denied_by_failure} failure-mode denials; \
         decisions resumed {:.2} s after the kill; debited on the new primary {debited:.1} \
         (lost with the old primary's unreplicated writes: {:.1})",
        answers.len(),
        resumed.duration_since(killed).as_secs_f64(),
        admitted - debited,
    );
    // Nothing counted twice: at most what was admitted (plus the 0.001/s refill's rounding),
    // and the requests in flight when the primary died. A script that ran and reached the
    // replica, but whose reply the kill lost (a killed server resets connections with unread
    // requests), is answered with the failure mode and its tokens stay taken once (the book,
    // "Exactly once": "the script ran, its reply is lost"). Four clients: at most four.
    let in_flight = CLIENTS as f64;
    assert!(
        debited <= admitted + in_flight + 0.5,
        "debited {debited} > admitted {admitted} + {in_flight} in flight"
    );
    // Everything admitted through the new primary is on it.
    assert!(debited >= admitted_after, "debited {debited} < admitted after the failover {admitted_after}");
    assert!(admitted_after > 0.0);
    let metrics = server.metrics();
    let errors = sample(&metrics, "tollgate_store_errors_total", &[]);
    assert_eq!(errors as usize, denied_by_failure, "every failure-mode answer counted");
    // The failover is told, not shouted: a few lines, not one per failed request.
    let log = server.log();
    assert!(log.lines().count() < 30, "{} log lines:\n{log}", log.lines().count());
}
