//! Regions on one machine (loopback): a global tier on Redis (`--global-tier`) and two regions
//! (`--global-url`, embedded stores) reaching it through the fault proxy, each answer held back
//! 100 ms, neutral RLS clients sending each region far more than the whole limit. The tokens the
//! regions admit together stay within `capacity + rate x T` in every window, and most of it is
//! used; a region cut off for 30 s keeps deciding on its share until the share's life ends, then
//! denies, while the other region gets the whole bucket; healed, it is back on a share within
//! seconds. A bucket nothing asks for is parked: renewed seldom, its next request still answered
//! at once.

mod common;

use std::time::{Duration, Instant};

use common::paced::{excess, Admitted, GLOBAL_TENANT_RULE};
use common::proxy::{Fault, FaultProxy};
use common::regions::{eu_and_us, global_tier, region};
use common::*;

const CONFIG: &str = GLOBAL_TENANT_RULE;
const CAPACITY: f64 = 20.0;
const RATE: f64 = 10.0;

// Sends `region` a request every 20 ms until `until`, recording when each was admitted.
async fn load(addr: String, until: Instant, admitted: Admitted) -> (u32, u32) {
    let (mut ok, mut over) = (0, 0);
    while Instant::now() < until {
        let r = ask(&addr, req("api", &["tenant=acme"], 1)).await.expect("answer");
        if r.overall_code == OK {
            ok += 1;
            admitted.lock().unwrap().push((Instant::now(), 0));
        } else {
            over += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (ok, over)
}

#[tokio::test(flavor = "multi_thread")]
async fn two_regions_keep_one_global_limit_and_a_partition_falls_back_to_deny() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let global = global_tier(&config, &Backend::Redis(redis.url()));
    let (regions, proxies) = eu_and_us(&config, &global, Duration::from_millis(100));

    // Six seconds of both regions asking 50 a second each, against 10 a second in all.
    let admitted = Admitted::default();
    let start = Instant::now();
    let until = start + Duration::from_secs(6);
    let loads: Vec<_> =
        regions.iter().map(|r| tokio::spawn(load(r.addr(), until, admitted.clone()))).collect();
    let mut counts = Vec::new();
    for l in loads {
        counts.push(l.await.unwrap());
    }
    let all = admitted.lock().unwrap().clone();
    let bound = CAPACITY + RATE * start.elapsed().as_secs_f64();
    let over = excess(&all, CAPACITY, RATE);
    println!(
        "admitted {} of a bound of {bound:.0} (eu, us: {counts:?}); worst window {over:.2} over",
        all.len()
    );
    assert!(over <= 1e-9, "{over} admitted over capacity + rate x T in some window");
    assert!(all.len() as f64 >= 0.5 * bound, "{} admitted, bound {bound:.0}: the shares are used", all.len());
    assert!(counts.iter().all(|(ok, _)| *ok > 0), "both regions admit: {counts:?}");

    // eu cut off for 30 s: it decides on its share until the share's life ends (10 s after its
    // last renewal was sent, at most a round before the cut), then denies.
    proxies[0].set(Fault::Blackhole);
    let cut = Instant::now();
    let during = load(regions[0].addr(), cut + Duration::from_secs(8), Admitted::default()).await;
    assert!(during.0 > 0, "eu still admits on its share while cut off: {during:?}");
    tokio::time::sleep_until((cut + Duration::from_millis(10_500)).into()).await;
    for _ in 0..3 {
        let r = ask(&regions[0].addr(), req("api", &["tenant=acme"], 1)).await.unwrap();
        assert_eq!(
            r.overall_code,
            OVER_LIMIT,
            "eu's share lapsed: denied ({:?} after the cut)",
            cut.elapsed()
        );
        assert_eq!(header(&r, "X-Tollgate-Global-Fallback"), Some("deny"), "and says the fallback denied");
    }
    let scrape = regions[0].metrics();
    let failed = sample(&scrape, "tollgate_global_rounds_total", &[("outcome", "failed")]);
    // A failed round waits out its 1 s timeout and the next starts a second later: 5 in the
    // 10.5 s on an idle machine, 3 seen in CI with the other tests of this file beside it.
    assert!(failed >= 3.0, "{failed} failed rounds counted");
    let fallback = sample(&scrape, "tollgate_global_fallbacks_total", &[("fallback", "deny")]);
    assert!(fallback >= 3.0, "{fallback} fallback denials counted");
    let cut_off = sample(&scrape, "tollgate_global_cut_off_seconds", &[]);
    // Counted from the last round answered, at most a share's renewal interval (under 6 s) before
    // the cut; set after each round, at least every 2 s (counted from the first failed round it
    // read 4 s here once, with the rounds sparse before the cut).
    assert!((8.0..=17.0).contains(&cut_off), "cut off for {cut_off} s by the gauge, 10.5 s after the cut");
    // Still ready (it serves), and saying why its global limits deny.
    let (status, body) = http_get(regions[0].http, "/readyz").expect("/readyz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("cut off from the global tier for"), "{body}");
    // us gets the whole rate once eu's lease has expired at the global tier.
    let before = Instant::now();
    let us = load(regions[1].addr(), before + Duration::from_secs(3), Admitted::default()).await;
    assert!(us.0 >= 20, "us admitted {us:?} in 3 s with the whole bucket to itself");

    // Cut off for 30 s in all: eu denies throughout, from its share's end on.
    while cut.elapsed() < Duration::from_secs(30) {
        let r = ask(&regions[0].addr(), req("api", &["tenant=acme"], 1)).await.unwrap();
        assert_eq!(r.overall_code, OVER_LIMIT, "eu still cut off, {:?} after the cut", cut.elapsed());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Healed: eu is back on a share within 5 s.
    proxies[0].set(Fault::DelayReplies(Duration::from_millis(100)));
    let healed = Instant::now();
    loop {
        let r = ask(&regions[0].addr(), req("api", &["tenant=acme"], 1)).await.unwrap();
        if r.overall_code == OK {
            break;
        }
        assert!(
            healed.elapsed() < Duration::from_secs(5),
            "eu not back on a share 5 s after the partition healed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("eu back on a share {:?} after the partition healed", healed.elapsed());
    let (_, body) = http_get(regions[0].http, "/readyz").expect("/readyz");
    assert_eq!(body, "ready\n", "healed: no longer cut off");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_quiet_bucket_is_parked_renewed_seldom_and_still_answers_at_once() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let global = global_tier(&config, &Backend::Redis(redis.url()));
    // Each first request waits for its first lease (100 ms away), rather than being denied.
    let wait = ["--global-first-lease-wait", "1s"];
    let (region, _proxy) =
        region(&config, &Backend::Memory, &global, ("eu", Duration::from_millis(100)), &wait);

    // Twenty tenants asked for, then quiet.
    let tenants: Vec<String> = (0..20).map(|i| format!("tenant=t{i}")).collect();
    for t in &tenants {
        assert_eq!(ask(&region.addr(), req("api", &[t], 1)).await.unwrap().overall_code, OK);
    }
    let renewals = || sample(&global.metrics(), "tollgate_global_renewals_total", &[("outcome", "ok")]);
    // Two rounds to notice the quiet (demand counts over 1-2 s), one to park.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let before = renewals();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let quiet = renewals() - before;
    println!("{quiet} renewals of 20 parked buckets in 8 s");
    assert!(quiet <= 20.0, "{quiet} renewals in 8 s: parked buckets are renewed seldom (160 unparked)");

    // A parked bucket answers its next request from the region, without the 100 ms round trip.
    let asked = Instant::now();
    assert_eq!(ask(&region.addr(), req("api", &[&tenants[0]], 1)).await.unwrap().overall_code, OK);
    assert!(
        asked.elapsed() < Duration::from_millis(90),
        "{:?}: answered from the parked share",
        asked.elapsed()
    );
    // Its lease at the global tier is one request's tokens with no rate, living a minute.
    let mut con = redis.connection();
    let field: String = redis::cmd("HGET").arg("rl:{t1}:api:tenant=t1").arg("h").query(&mut con).unwrap();
    let leases = tollgate::store::parse_leases(&field).unwrap();
    let now_ms = redis_ms(&mut con);
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!((leases[0].capacity, leases[0].refill_per_second), (1.0, 0.0), "{leases:?}");
    assert!(leases[0].expires_at_ms > now_ms + 40_000, "a parked lease lives a minute: {leases:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_region_cut_off_decides_on_its_split_of_the_bucket_in_its_own_store() {
    let (global_redis, regional) = (Redis::start(), Redis::start());
    let split = CONFIG.replace("global: true", "global: true\n    global_fallback: {split: 2}");
    let (_dir, config) = config_file(&split);
    let global = Tollgate::start(
        &config,
        &Backend::Redis(global_redis.url()),
        &["--global-tier", "--global-tier-insecure"],
    );
    let proxy = FaultProxy::start(global.grpc.port());
    proxy.set(Fault::Blackhole);
    let url = format!("http://127.0.0.1:{}", proxy.port);
    let region =
        Tollgate::start(&config, &Backend::Redis(regional.url()), &["--global-url", &url, "--region", "eu"]);

    // Never reaching the global tier, eu decides on half the bucket (10 tokens, 5 a second).
    let admitted = Admitted::default();
    let start = Instant::now();
    let (ok, _) = load(region.addr(), start + Duration::from_secs(3), admitted.clone()).await;
    let all = admitted.lock().unwrap().clone();
    let bound = CAPACITY / 2.0 + RATE / 2.0 * start.elapsed().as_secs_f64();
    let over = excess(&all, CAPACITY / 2.0, RATE / 2.0);
    println!(
        "cut off from the start: {ok} admitted of its split's bound {bound:.1}; worst window {over:.2} over"
    );
    // Admissions are stamped when the answer arrives, a few ms after Redis decided: a window
    // between two stamps can look up to rate x that jitter shorter (5/s x 10 ms = 0.05 tokens).
    assert!(over <= 0.05, "{over} over the split's capacity + rate x T");
    assert!(f64::from(ok) >= 0.8 * bound, "{ok} admitted of {bound:.1}: the split is used");
    // Its part lives in the region's own Redis, beside the tenant's other buckets.
    let mut con = regional.connection();
    let tokens: Option<f64> =
        redis::cmd("HGET").arg("rl:{acme}:api:tenant=acme:fallback").arg("t").query(&mut con).unwrap();
    assert!(tokens.is_some(), "the fallback bucket is in the regional store");
    let split = sample(&region.metrics(), "tollgate_global_fallbacks_total", &[("fallback", "split")]);
    assert!(split >= 60.0, "{split} decisions by the split");
    // Known to be cut off (its rounds fail), it no longer waits for a first lease.
    let asked = Instant::now();
    let answer = ask(&region.addr(), req("api", &["tenant=acme"], 1)).await.unwrap();
    assert_eq!(
        header(&answer, "X-Tollgate-Global-Fallback"),
        Some("split"),
        "the answer says the split decided"
    );
    assert!(
        asked.elapsed() < Duration::from_millis(60),
        "{:?}: no first-lease wait once cut off",
        asked.elapsed()
    );
}
