//! A global limit through real Envoys 1.40, one per region: regions eu and us, each a replica
//! behind an Envoy whose ratelimit filter is configured as tollgate ships it (a 0.1 s timeout,
//! failing open), both 150 ms from the global tier. A new bucket's first requests, while each
//! region's first lease is on its way, are denied by tollgate within Envoy's timeout (the default
//! `--global-first-lease-wait`), not let through uncounted by Envoy's failure mode: what both
//! regions admit stays within `capacity + rate x T`, and no answer is an Envoy error.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::paced::{excess, Admitted, GLOBAL_TENANT_RULE};
use common::regions::{eu_and_us, global_tier};
use common::*;
use serde_json::json;

const CONFIG: &str = GLOBAL_TENANT_RULE;
const CAPACITY: f64 = 20.0;
const RATE: f64 = 10.0;

#[tokio::test(flavor = "multi_thread")]
async fn through_envoy_a_new_global_bucket_is_denied_not_let_through_while_its_lease_comes() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let global = global_tier(&config, &Backend::Redis(redis.url()));
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
    let upstream = upstream().await;
    // Each region's Envoy: its listener (the guard keeps it running).
    let envoys: Vec<(SocketAddr, Envoy)> = regions
        .iter()
        .map(|region| {
            let (listener, admin) = (loopback(), loopback());
            let config = tenant_envoy(listener, admin, filter.clone(), &[region.grpc], upstream);
            (listener, Envoy::start(&config, admin))
        })
        .collect();

    // 5 s: eu's Envoy asked 40 a second, us's 20 a second, of a bucket refilling 10 a second.
    let admitted = Admitted::default();
    let start = Instant::now();
    let until = start + Duration::from_secs(5);
    let through = |region: usize, every: Duration| {
        let (admitted, listener) = (admitted.clone(), envoys[region].0);
        std::thread::spawn(move || {
            let mut statuses = Vec::new();
            let mut next = Instant::now();
            while next < until {
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                let status = http_request(listener, "/", &[("x-tenant", "acme")]).status;
                if status == 200 {
                    admitted.lock().unwrap().push((Instant::now(), region));
                }
                statuses.push((next.duration_since(start), status));
                next += every;
            }
            statuses
        })
    };
    let (eu, us) = (through(0, Duration::from_millis(25)), through(1, Duration::from_millis(50)));
    let statuses = [eu.join().unwrap(), us.join().unwrap()];
    let all = admitted.lock().unwrap().clone();

    let early = |region: usize| -> Vec<u16> {
        statuses[region].iter().filter(|(at, _)| *at < Duration::from_millis(150)).map(|(_, s)| *s).collect()
    };
    let passed: Vec<usize> = statuses.iter().map(|s| s.iter().filter(|(_, s)| *s == 200).count()).collect();
    let over = excess(&all, CAPACITY, RATE);
    let bound = CAPACITY + RATE * 5.0;
    println!(
        "admitted {} of a bound of {bound:.0} (through eu's Envoy {}, us's {}); the first 150 ms through eu's Envoy: {:?}, us's: {:?}; worst window {over:.2} over",
        all.len(),
        passed[0],
        passed[1],
        early(0),
        early(1)
    );
    for (region, name) in ["eu", "us"].iter().enumerate() {
        assert!(
            statuses[region].iter().all(|(_, s)| *s == 200 || *s == 429),
            "only 200 and 429 through {name}'s Envoy: {:?}",
            statuses[region]
        );
        assert!(
            early(region).contains(&429),
            "the first requests, before {name}'s first lease, denied by tollgate: {:?}",
            early(region)
        );
    }
    // Client-side times: a request's answer is stamped a moment after its decision, so one token
    // of slack for the order of stamps (the decisions themselves have none: tests/global_world.rs).
    assert!(over <= 1.0, "{over} admitted over capacity + rate x T in some window");
    assert!(
        passed.iter().all(|n| *n > 0) && all.len() as f64 >= 0.6 * bound,
        "{} admitted ({passed:?} by region) of a bound of {bound:.0}",
        all.len()
    );
}
