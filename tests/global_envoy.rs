//! A global limit through a real Envoy 1.40: region eu's replica behind an Envoy whose ratelimit
//! filter is configured as tollgate ships it (a 0.1 s timeout, failing open), region us asked by
//! a neutral client, both 150 ms from the global tier. A new bucket's first requests, while eu's
//! first lease is on its way, are denied by tollgate within Envoy's timeout (the default
//! `--global-first-lease-wait`), not let through uncounted by Envoy's failure mode: what both
//! regions admit stays within `capacity + rate x T`, and no answer is an Envoy error.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::paced::{excess, paced, Admitted, GLOBAL_TENANT_RULE};
use common::regions::eu_and_us;
use common::*;
use serde_json::json;

const CONFIG: &str = GLOBAL_TENANT_RULE;
const CAPACITY: f64 = 20.0;
const RATE: f64 = 10.0;

#[tokio::test(flavor = "multi_thread")]
async fn through_envoy_a_new_global_bucket_is_denied_not_let_through_while_its_lease_comes() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let global = Tollgate::start(&config, &Backend::Redis(redis.url()), &["--global-tier"]);
    let (regions, _proxies) = eu_and_us(&config, &global, Duration::from_millis(150));
    let filter = json!({
        "name": "envoy.filters.http.ratelimit",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": "api", "timeout": "0.1s", "failure_mode_deny": false,
            "rate_limit_service": {"transport_api_version": "V3", "grpc_service": {"envoy_grpc": {"cluster_name": "tollgate"}}},
        },
    });
    let loopback = || -> SocketAddr { format!("127.0.0.1:{}", free_port()).parse().unwrap() };
    let (listener, admin) = (loopback(), loopback());
    let _envoy =
        Envoy::start(&tenant_envoy(listener, admin, filter, &[regions[0].grpc], upstream().await), admin);

    // 5 s: eu's Envoy asked 40 a second, us 20 a second, of a bucket refilling 10 a second.
    let admitted = Admitted::default();
    let start = Instant::now();
    let until = start + Duration::from_secs(5);
    let us = tokio::spawn(paced(
        1,
        vec![regions[1].addr()],
        ("api", "acme"),
        (start, until),
        |_| 20.0,
        admitted.clone(),
    ));
    let through_envoy = {
        let admitted = admitted.clone();
        std::thread::spawn(move || {
            let mut statuses = Vec::new();
            let mut next = Instant::now();
            while next < until {
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                let status = http_request(listener, "/", &[("x-tenant", "acme")]).status;
                if status == 200 {
                    admitted.lock().unwrap().push((Instant::now(), 0));
                }
                statuses.push((next.duration_since(start), status));
                next += Duration::from_millis(25);
            }
            statuses
        })
    };
    us.await.unwrap();
    let statuses = through_envoy.join().unwrap();
    let all = admitted.lock().unwrap().clone();

    let early: Vec<u16> =
        statuses.iter().filter(|(at, _)| *at < Duration::from_millis(150)).map(|(_, s)| *s).collect();
    let eu = statuses.iter().filter(|(_, s)| *s == 200).count();
    let over = excess(&all, CAPACITY, RATE);
    let bound = CAPACITY + RATE * 5.0;
    println!(
        "admitted {} of a bound of {bound:.0} (through eu's Envoy {eu}); the first 150 ms through Envoy: {early:?}; worst window {over:.2} over",
        all.len()
    );
    assert!(
        statuses.iter().all(|(_, s)| *s == 200 || *s == 429),
        "only 200 and 429 through Envoy: {statuses:?}"
    );
    assert!(
        early.contains(&429),
        "the first requests, before eu's first lease, denied by tollgate: {early:?}"
    );
    // Client-side times: a request's answer is stamped a moment after its decision, so one token
    // of slack for the order of stamps (the decisions themselves have none: tests/global_world.rs).
    assert!(over <= 1.0, "{over} admitted over capacity + rate x T in some window");
    assert!(
        eu > 0 && all.len() as f64 >= 0.6 * bound,
        "{} admitted (eu {eu}) of a bound of {bound:.0}",
        all.len()
    );
}
