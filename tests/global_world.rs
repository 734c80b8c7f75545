//! Three regions and a global tier on one machine (loopback): the global tier is two replicas on
//! one Redis (`--global-tier`); each region has its own Redis and two replicas (`--global-url`
//! naming both global replicas), reaching the global tier through the fault proxy with every
//! answer held back 80, 120 or 150 ms. Paced neutral RLS clients, one per region, ask three
//! times the global rate in all, split 80/15/5:
//!
//! * the regions admit together no more than `capacity + rate x T` in any window, and at least
//!   0.9 of it over the split's 24 s;
//! * when the demand moves (the 5% region becomes the 80% one) that region has its share within
//!   3 s;
//! * with one global replica killed, every region renews through the other and the world keeps
//!   admitting, within the bound (no lease counted twice).

mod common;

use std::time::{Duration, Instant};

use common::paced::{count, excess, paced, Admitted};
use common::proxy::{Fault, FaultProxy};
use common::*;

const CONFIG: &str = r#"
domain: api
tenant_key: tenant
descriptors:
  - key: tenant
    token_bucket: {capacity: 50, refill_per_second: 50}
    global: true
"#;
const CAPACITY: f64 = 50.0;
const RATE: f64 = 50.0;

/// A region: its store, its two proxies to the two global replicas, its replicas.
struct Region {
    _redis: Redis,
    _proxies: Vec<FaultProxy>,
    replicas: Vec<Tollgate>,
}

impl Region {
    fn start(name: &str, delay: Duration, config: &std::path::Path, global_ports: &[u16]) -> Region {
        let redis = Redis::start();
        let proxies: Vec<FaultProxy> = global_ports.iter().map(|p| FaultProxy::start(*p)).collect();
        let urls: Vec<String> = proxies
            .iter()
            .map(|p| {
                p.set(Fault::DelayReplies(delay));
                format!("http://127.0.0.1:{}", p.port)
            })
            .collect();
        let urls = urls.join(",");
        let replicas = (0..2)
            .map(|_| {
                Tollgate::start(
                    config,
                    &Backend::Redis(redis.url()),
                    &["--global-url", &urls, "--region", name],
                )
            })
            .collect();
        Region { _redis: redis, _proxies: proxies, replicas }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn three_regions_share_by_demand_follow_its_shift_and_outlive_a_global_replica() {
    let global_redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let mut globals: Vec<Tollgate> = (0..2)
        .map(|_| {
            Tollgate::start(
                &config,
                &Backend::Redis(global_redis.url()),
                &["--global-tier", "--global-tier-insecure"],
            )
        })
        .collect();
    let global_ports: Vec<u16> = globals.iter().map(|g| g.grpc.port()).collect();
    let regions: Vec<Region> = [("eu", 80), ("us", 120), ("ap", 150)]
        .iter()
        .map(|(name, ms)| Region::start(name, Duration::from_millis(*ms), &config, &global_ports))
        .collect();

    // Three times the rate, split 80/15/5 for 24 s; then eu and ap trade places for 12 s; then
    // one global replica is killed and the same demand runs 10 s more.
    const SPLIT: f64 = 24.0;
    const SHIFTED: f64 = 36.0;
    const END: f64 = 46.0;
    let demand = |region: usize, at: Duration| {
        let parts = if at.as_secs_f64() < SPLIT { [0.80, 0.15, 0.05] } else { [0.05, 0.15, 0.80] };
        3.0 * RATE * parts[region]
    };
    let admitted = Admitted::default();
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(END);
    let loads: Vec<_> = regions
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let addrs = r.replicas.iter().map(Tollgate::addr).collect();
            let rate = move |at| demand(i, at);
            tokio::spawn(paced(i, addrs, ("api", "acme"), (start, until), rate, admitted.clone()))
        })
        .collect();
    tokio::time::sleep_until((start + Duration::from_secs_f64(SHIFTED)).into()).await;
    globals[0].proc.kill();
    for l in loads {
        l.await.unwrap();
    }
    let all = admitted.lock().unwrap().clone();

    let bound = |seconds: f64| CAPACITY + RATE * seconds;
    let per_region = |from: f64, to: f64| -> Vec<usize> {
        (0..3).map(|r| count(&all, start, Some(r), from, to)).collect()
    };
    let split = count(&all, start, None, 0.0, SPLIT);
    let over = excess(&all, CAPACITY, RATE);
    println!(
        "80/15/5 over {SPLIT} s: admitted {split} of a bound of {:.0} ({:.3}; eu, us, ap: {:?}); worst window {over:.2} over",
        bound(SPLIT),
        split as f64 / bound(SPLIT),
        per_region(0.0, SPLIT)
    );
    let first: Vec<usize> = (0..6).map(|s| count(&all, start, None, s as f64, s as f64 + 1.0)).collect();
    let steady = count(&all, start, None, 10.0, SPLIT) as f64 / ((SPLIT - 10.0) * RATE);
    println!("the world's first seconds: {first:?}; from 10 s on {steady:.3} of the rate");
    assert!(over <= 1e-9, "{over} admitted over capacity + rate x T in some window");
    assert!(split as f64 >= 0.9 * bound(SPLIT), "{split} admitted of a bound of {:.0}", bound(SPLIT));

    // The shift: ap's share, second by second after it.
    let ap: Vec<usize> =
        (0..8).map(|s| count(&all, start, Some(2), SPLIT + s as f64, SPLIT + s as f64 + 1.0)).collect();
    println!("ap admitted per second after the shift: {ap:?} (its part of the rate: {:.0})", 0.8 * RATE);
    assert!(
        ap[3..].iter().all(|n| *n as f64 >= 0.75 * 0.8 * RATE),
        "ap has its share in every second from 3 s after the shift: {ap:?}"
    );

    // A global replica killed: the regions renew through the other.
    let after = per_region(SHIFTED + 3.0, END);
    let world = after.iter().sum::<usize>() as f64 / (END - SHIFTED - 3.0);
    println!("with one global replica killed, from 3 s after: {world:.1} a second (eu, us, ap: {after:?})");
    assert!(world >= 0.8 * RATE, "{world:.1} a second admitted with one global replica left");
    assert!(after.iter().all(|n| *n > 0), "every region still admits: {after:?}");
}
