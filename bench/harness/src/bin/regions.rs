//! The multi-region row of tollgate's benchmarks (issue 36), on loopback: a global tier of two
//! replicas on one Redis (`--global-tier`) and three regions (eu, us, ap), each with its own
//! Redis and two replicas (`--global-url` naming both global replicas) that reach the global
//! tier through the fault proxy, every answer held back 80, 120 or 150 ms (this machine's kernel
//! has no `netem`, so the proxy stands in for distance). It measures, in one run:
//!
//! * **latency**: open-loop RLS load on eu's replicas, the same rate over the same tenants, for a
//!   rule marked `global: true` and the same rule without it (decided in eu's Redis), in turn,
//!   twice each; and the same for LLM calls' holds on a budget marked `global: true` (decided on
//!   the replica's money lease, in its own ledger in eu's Redis) and one without it;
//! * **cost**: the global Redis's commands (`INFO commandstats`, the scripts' own included) and
//!   CPU per bucket per region per second while those buckets are asked for, in the 5 s in which
//!   they are parked once the asking stops, and over the next minute, parked;
//! * **the bound**: three times a global bucket's rate asked 80/15/5 by the regions (paced
//!   clients, as `tests/global_world.rs`): admitted against `capacity + rate x T`, over the whole
//!   run and its first 30 s, and the worst window.
//!
//! Prints one line of `key=value` results; every process it starts is stopped when it ends.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use hdrhistogram::Histogram;
use tollgate_bench::paced::{count, excess, paced, Admitted};
use tollgate_bench::proxy::{Fault, FaultProxy};
use tollgate_bench::{free_port, percentile, redis_work, wait_until, Child};
use tonic::transport::Channel;

/// The world's bucket: capacity and rate.
const CAPACITY: f64 = 50.0;
const RATE: f64 = 50.0;

/// The config directory's files: the world's bucket, and a rule with room for every request,
/// global and not, for the latency rows.
const CONFIG: [(&str, &str); 5] = [
    ("budget_global.yaml", "domain: budget_global\ntenant_key: org\nhold_ttl: 60s\nprices: {version: v1, currency: USD, models: {m: {input: 1.00, output: 10.00, reserve_input_tokens: 100}}}\ndescriptors:\n  - key: org\n    budget: {amount: 1000000, per: month}\n    global: true\n    descriptors:\n      - key: model\n        descriptors:\n          - key: request_id\n"),
    ("budget_regional.yaml", "domain: budget_regional\ntenant_key: org\nhold_ttl: 60s\nprices: {version: v1, currency: USD, models: {m: {input: 1.00, output: 10.00, reserve_input_tokens: 100}}}\ndescriptors:\n  - key: org\n    budget: {amount: 1000000, per: month}\n    descriptors:\n      - key: model\n        descriptors:\n          - key: request_id\n"),
    ("world.yaml", "domain: world\ndescriptors:\n  - key: tenant\n    token_bucket: {capacity: 50, refill_per_second: 50}\n    global: true\n"),
    ("global.yaml", "domain: global\ndescriptors:\n  - key: tenant\n    token_bucket: {capacity: 1000000000, refill_per_second: 1000000000}\n    global: true\n"),
    ("regional.yaml", "domain: regional\ndescriptors:\n  - key: tenant\n    token_bucket: {capacity: 1000000000, refill_per_second: 1000000000}\n"),
];

/// The run's flags.
#[derive(Parser)]
struct Args {
    /// The tollgate binary.
    #[arg(long, default_value = "target/release/tollgate")]
    tollgate: PathBuf,
    /// Where configs and logs go.
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Seconds of the 80/15/5 world.
    #[arg(long, default_value_t = 60.0)]
    world_seconds: f64,
    /// Seconds of each latency measurement.
    #[arg(long, default_value_t = 10.0)]
    latency_seconds: f64,
    /// Requests a second of the latency load.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Tenants of the latency load.
    #[arg(long, default_value_t = 1000)]
    buckets: usize,
}

/// A redis-server on a free loopback port: its guard and address.
fn redis(dir: &Path, name: &str) -> (Child, String) {
    let port = free_port();
    let child = Child::spawn(
        Command::new("redis-server").args(["--port", &port.to_string(), "--bind", "127.0.0.1"]).args([
            "--save",
            "",
            "--appendonly",
            "no",
        ]),
        &dir.join(format!("redis-{name}.log")),
    );
    let addr = format!("127.0.0.1:{port}");
    wait_until("redis", || std::net::TcpStream::connect(&addr).is_ok());
    (child, addr)
}

/// A tollgate replica on free loopback ports, ready: its guard and gRPC address.
fn tollgate(a: &Args, config: &Path, name: &str, flags: &[&str]) -> (Child, String) {
    let (grpc, http) = (free_port(), free_port());
    let child = Child::spawn(
        Command::new(&a.tollgate)
            .arg("serve")
            .arg("--config")
            .arg(config)
            .args(["--grpc-addr", &format!("127.0.0.1:{grpc}"), "--http-addr", &format!("127.0.0.1:{http}")])
            .args(["--drain-delay", "0s"])
            .args(flags)
            .env("RUST_LOG", "error"),
        &a.dir.join(format!("tollgate-{name}.log")),
    );
    wait_until("tollgate /readyz", || ready(http));
    (child, format!("127.0.0.1:{grpc}"))
}

fn ready(http: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", http)) else { return false };
    let _ = s.write_all(b"GET /readyz HTTP/1.0\r\n\r\n");
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200")
}

// A request of `domain` for tenant `tenant`: in a budget's domain, an LLM call's hold of 100
// output tokens, its id `id`.
fn request(domain: &str, tenant: &str, id: &str) -> RateLimitRequest {
    let entry = |key: &str, value: &str| Entry { key: key.into(), value: value.to_owned() };
    let (entries, hits_addend) = if domain.starts_with("budget_") {
        (vec![entry("org", tenant), entry("model", "m"), entry("request_id", id)], 100)
    } else {
        (vec![entry("tenant", tenant)], 1)
    };
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: vec![RateLimitDescriptor { entries, ..Default::default() }],
        hits_addend,
    }
}

/// Open-loop load: `rate` requests a second over `buckets` tenants in `domain`, to `addrs` in
/// turn, for `warmup` then `seconds`; the latencies of the measured part (µs), each request timed
/// from when it was due, so a slow answer does not hide the ones queued behind it.
async fn open_loop(addrs: &[String], domain: &str, a: &Args, warmup: Duration) -> Histogram<u64> {
    let mut clients = Vec::new();
    for addr in addrs {
        let channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
        clients.push(RateLimitServiceClient::new(channel));
    }
    let histogram = Arc::new(std::sync::Mutex::new(Histogram::<u64>::new(3).unwrap()));
    let start = Instant::now();
    let measured_from = start + warmup;
    let until = measured_from + Duration::from_secs_f64(a.latency_seconds);
    let every = Duration::from_secs_f64(1.0 / a.rate);
    let mut tasks = Vec::new();
    let mut due = start;
    let mut i = 0usize;
    while due < until {
        tokio::time::sleep_until(due.into()).await;
        let mut client = clients[i % clients.len()].clone();
        let request = request(domain, &format!("t{}", i % a.buckets), &format!("{start:?}-{i}"));
        let histogram = histogram.clone();
        tasks.push(tokio::spawn(async move {
            client.should_rate_limit(request).await.expect("answer");
            if due >= measured_from {
                histogram.lock().unwrap().record(due.elapsed().as_micros() as u64).unwrap();
            }
        }));
        i += 1;
        due += every;
    }
    for t in tasks {
        t.await.unwrap();
    }
    Arc::try_unwrap(histogram).unwrap().into_inner().unwrap()
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
    let config = a.dir.join("regions");
    std::fs::create_dir_all(&config).unwrap();
    for (file, yaml) in CONFIG {
        std::fs::write(config.join(file), yaml).unwrap();
    }

    let (_global_redis, global_redis) = redis(&a.dir, "global");
    let globals: Vec<(Child, String)> = (0..2)
        .map(|i| {
            let flags = [
                "--redis-url",
                &format!("redis://{global_redis}"),
                "--global-tier",
                "--global-tier-insecure",
            ];
            tollgate(&a, &config, &format!("global-{i}"), &flags)
        })
        .collect();
    let (mut keep, mut keep_proxies) = (Vec::new(), Vec::new());
    let mut regions: Vec<Vec<String>> = Vec::new();
    for (name, ms) in [("eu", 80), ("us", 120), ("ap", 150)] {
        let (r, addr) = redis(&a.dir, name);
        let proxies: Vec<FaultProxy> = globals
            .iter()
            .map(|(_, g)| FaultProxy::start(g.rsplit(':').next().unwrap().parse().unwrap()))
            .collect();
        let urls: Vec<String> = proxies
            .iter()
            .map(|p| {
                p.set(Fault::DelayReplies(Duration::from_millis(ms)));
                format!("http://127.0.0.1:{}", p.port)
            })
            .collect();
        let mut replicas = Vec::new();
        for i in 0..2 {
            let urls = urls.join(",");
            let flags = ["--redis-url", &format!("redis://{addr}"), "--global-url", &urls, "--region", name];
            let (child, grpc) = tollgate(&a, &config, &format!("{name}-{i}"), &flags);
            keep.push(child);
            replicas.push(grpc);
        }
        keep.push(r);
        regions.push(replicas);
        keep_proxies.extend(proxies);
    }

    // Latency: the same open-loop load on eu, a regional rule and a global one in turn, twice
    // (so that a slow spell of the shared cores does not land on one side only). The cost of the
    // global one is what the global Redis ran meanwhile, per bucket, per region, per second.
    let warmup = Duration::from_secs(3);
    let mut regional = open_loop(&regions[0], "regional", &a, warmup).await;
    let before = redis_work(&global_redis);
    let mut global = open_loop(&regions[0], "global", &a, warmup).await;
    let after = redis_work(&global_redis);
    regional.add(open_loop(&regions[0], "regional", &a, warmup).await).unwrap();
    global.add(open_loop(&regions[0], "global", &a, warmup).await).unwrap();
    // Per bucket per second of the first global run (its warm-up's first leases included).
    let per = |n: f64, seconds: f64| n / (a.buckets as f64 * seconds);
    let run = a.latency_seconds + warmup.as_secs_f64();
    let hot = per((after.0 - before.0) as f64, run);
    let hot_cpu_us = per((after.1 - before.1) * 1e6, run);
    // Idle: the same buckets asked for nothing: the 5 s in which they are parked, then a minute
    // of parked leases (each renewed once in it).
    let parking = redis_work(&global_redis);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let parked = redis_work(&global_redis);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let idle = redis_work(&global_redis);
    let parking_cmds = per((parked.0 - parking.0) as f64, 5.0);
    let idle_cmds = per((idle.0 - parked.0) as f64, 60.0);
    let idle_cpu_us = per((idle.1 - parked.1) * 1e6, 60.0);

    // The same for LLM calls' holds on a global budget and a regional one (after the idle
    // buckets' minute, which the leases' renewals would otherwise add to); the global Redis's
    // commands per budget (a money lease) per region per second while held from.
    let mut budget_regional = open_loop(&regions[0], "budget_regional", &a, warmup).await;
    let before = redis_work(&global_redis);
    let mut budget_global = open_loop(&regions[0], "budget_global", &a, warmup).await;
    let after = redis_work(&global_redis);
    budget_regional.add(open_loop(&regions[0], "budget_regional", &a, warmup).await).unwrap();
    budget_global.add(open_loop(&regions[0], "budget_global", &a, warmup).await).unwrap();
    let budget_cmds = per((after.0 - before.0) as f64, run);
    let budget_cpu_us = per((after.1 - before.1) * 1e6, run);
    // The world: three times the rate, split 80/15/5.
    let admitted = Admitted::default();
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(a.world_seconds);
    let loads: Vec<_> = regions
        .iter()
        .enumerate()
        .map(|(i, addrs)| {
            let rate = move |_| 3.0 * RATE * [0.80, 0.15, 0.05][i];
            tokio::spawn(paced(i, addrs.clone(), ("world", "acme"), (start, until), rate, admitted.clone()))
        })
        .collect();
    for l in loads {
        l.await.unwrap();
    }
    let all = admitted.lock().unwrap().clone();
    let bound = |seconds: f64| CAPACITY + RATE * seconds;
    let first = a.world_seconds.min(30.0);
    let per_region: Vec<String> =
        (0..3).map(|r| count(&all, start, Some(r), 0.0, a.world_seconds).to_string()).collect();
    println!(
        "regional_p50_us={} regional_p99_us={} global_p50_us={} global_p99_us={} budget_regional_p50_us={} budget_regional_p99_us={} budget_global_p50_us={} budget_global_p99_us={} budget_cmds={budget_cmds:.3} budget_cpu_us={budget_cpu_us:.2} hot_cmds={hot:.3} hot_cpu_us={hot_cpu_us:.2} parking_cmds={parking_cmds:.3} idle_cmds={idle_cmds:.3} idle_cpu_us={idle_cpu_us:.3} admitted={} bound={:.0} ratio={:.3} first_ratio={:.3} worst_over={:.2} per_region={}",
        percentile(&regional, 0.5),
        percentile(&regional, 0.99),
        percentile(&global, 0.5),
        percentile(&global, 0.99),
        percentile(&budget_regional, 0.5),
        percentile(&budget_regional, 0.99),
        percentile(&budget_global, 0.5),
        percentile(&budget_global, 0.99),
        all.len(),
        bound(a.world_seconds),
        all.len() as f64 / bound(a.world_seconds),
        count(&all, start, None, 0.0, first) as f64 / bound(first),
        excess(&all, CAPACITY, RATE),
        per_region.join("/"),
    );
}
