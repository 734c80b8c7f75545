//! Paced RLS load for the global-limit checks, one stream per region: a neutral client that
//! asks a region's replicas in turn at a demand that may change over time, and records when each
//! request was admitted, so that what the world admitted can be held against
//! `capacity + rate x T` in every window. Shared by `tests/global_world.rs` and the benchmark
//! harness (`bench/harness`, which includes this file), so both measure the same way.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tonic::transport::Channel;

/// The global rule of the two-region tests: one tenant bucket of 20 tokens refilling 10 a second,
/// shared by every region.
pub const GLOBAL_TENANT_RULE: &str = r#"
domain: api
tenant_key: tenant
descriptors:
  - key: tenant
    token_bucket: {capacity: 20, refill_per_second: 10}
    global: true
"#;

/// When the world admitted, and in which region.
pub type Admitted = Arc<Mutex<Vec<(Instant, usize)>>>;

/// Asks `region`'s replicas at `addrs` (host:port) in turn about `tenant=<tenant>` in `domain`,
/// at `rate_at(time since start)` requests a second until `until`, recording each admission.
pub async fn paced(
    region: usize,
    addrs: Vec<String>,
    (domain, tenant): (&str, &str),
    (start, until): (Instant, Instant),
    rate_at: impl Fn(Duration) -> f64,
    admitted: Admitted,
) {
    let mut clients = Vec::new();
    for a in &addrs {
        let channel = Channel::from_shared(format!("http://{a}")).unwrap().connect().await.unwrap();
        clients.push(RateLimitServiceClient::new(channel));
    }
    let request = RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry { key: "tenant".into(), value: tenant.to_owned() }],
            ..Default::default()
        }],
        hits_addend: 1,
    };
    let mut next = Instant::now();
    let mut i = 0;
    while next < until {
        tokio::time::sleep_until(next.into()).await;
        let n = clients.len();
        let answer = clients[i % n].should_rate_limit(request.clone()).await.expect("answer");
        i += 1;
        if answer.into_inner().overall_code == Code::Ok as i32 {
            admitted.lock().unwrap().push((Instant::now(), region));
        }
        next += Duration::from_secs_f64(1.0 / rate_at(next.duration_since(start)));
    }
}

/// The most admitted over `capacity + rate x T` in any window (0: within).
pub fn excess(admitted: &[(Instant, usize)], capacity: f64, rate: f64) -> f64 {
    let mut at: Vec<Instant> = admitted.iter().map(|(t, _)| *t).collect();
    at.sort();
    let mut worst: f64 = 0.0;
    for (i, from) in at.iter().enumerate() {
        for (n, to) in at[i..].iter().enumerate() {
            let bound = capacity + rate * to.duration_since(*from).as_secs_f64();
            worst = worst.max((n + 1) as f64 - bound);
        }
    }
    worst
}

/// Admitted by `region` (any: `None`) between `from` and `to` seconds after `start`.
pub fn count(
    admitted: &[(Instant, usize)],
    start: Instant,
    region: Option<usize>,
    from: f64,
    to: f64,
) -> usize {
    admitted
        .iter()
        .filter(|(t, r)| {
            let s = t.duration_since(start).as_secs_f64();
            region.is_none_or(|want| *r == want) && s >= from && s < to
        })
        .count()
}
