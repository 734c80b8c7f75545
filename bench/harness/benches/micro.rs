//! Micro-benchmarks of the request path without the network: descriptor matching, key
//! encoding, and a whole decision on the memory store. Run with `cargo bench` in bench/harness
//! (bench/run does). Figures are per call on this machine, printed by Criterion.

use std::path::Path;
use std::sync::Arc;

use arc_swap::ArcSwap;
use criterion::{criterion_group, criterion_main, Criterion};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use std::hint::black_box;
use tollgate::config::RuleSet;
use tollgate::keys::{cluster_slot, descriptor_key, tenant_key, Class};
use tollgate::limiter::Limiter;
use tollgate::quota::EmbeddedQuotas;
use tollgate::store::MemoryStore;

fn example() -> RuleSet {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tollgate.yaml");
    RuleSet::load(&path).expect("examples/tollgate.yaml loads")
}

// An envoyproxy/ratelimit-style domain with 1,000 exact values and a few wildcards at one level.
fn wide() -> RuleSet {
    let mut yaml = String::from("domain: wide\ndescriptors:\n  - key: path\n    descriptors:\n");
    for i in 0..1000 {
        yaml += &format!(
            "      - {{key: user, value: u{i}, rate_limit: {{unit: second, requests_per_unit: 10}}}}\n"
        );
    }
    yaml += "      - {key: user, value: 'bot-*', rate_limit: {unit: minute, requests_per_unit: 1}}\n";
    yaml += "      - {key: user, rate_limit: {unit: second, requests_per_unit: 100}}\n";
    RuleSet::from_yaml(Path::new("wide.yaml"), &yaml).expect("generated config is valid")
}

fn matching(c: &mut Criterion) {
    let rules = example();
    let domain = rules.domain("api-gateway").unwrap();
    let tenant = [("tenant", "acme")];
    let export = [("tenant", "acme"), ("class", "export")];
    c.bench_function("match/tenant", |b| b.iter(|| domain.lookup(black_box(&tenant[..]))));
    c.bench_function("match/tenant+class", |b| b.iter(|| domain.lookup(black_box(&export[..]))));

    let rules = wide();
    let domain = rules.domain("wide").unwrap();
    let exact = [("path", "/a"), ("user", "u999")];
    let wildcard = [("path", "/a"), ("user", "bot-crawler")];
    let any = [("path", "/a"), ("user", "someone")];
    c.bench_function("match/1000-values/exact", |b| b.iter(|| domain.lookup(black_box(&exact[..]))));
    c.bench_function("match/1000-values/wildcard", |b| b.iter(|| domain.lookup(black_box(&wildcard[..]))));
    c.bench_function("match/1000-values/key-only", |b| b.iter(|| domain.lookup(black_box(&any[..]))));
}

fn keys(c: &mut Criterion) {
    c.bench_function("key/tenant-class", |b| {
        b.iter(|| tenant_key(black_box("tenant-4711"), &Class::Named(black_box("export"))))
    });
    let path = [("path", "/v1/reports"), ("method", "GET")];
    c.bench_function("key/tenant-path", |b| {
        b.iter(|| tenant_key(black_box("tenant-4711"), &Class::Path(&path)))
    });
    let entries = [("remote_address", "203.0.113.7"), ("path", "/login")];
    c.bench_function("key/descriptor", |b| {
        b.iter(|| descriptor_key(black_box("api-gateway"), black_box(&entries)))
    });
    c.bench_function("key/cluster-slot", |b| b.iter(|| cluster_slot(black_box("rl:{tenant-4711}:export"))));
}

fn decide(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let limiter = Limiter::new(
        Arc::new(ArcSwap::from_pointee(example())),
        Arc::new(MemoryStore::new()),
        Arc::new(EmbeddedQuotas),
        false,
    );
    let descriptor = |entries: &[(&str, &str)]| RateLimitDescriptor {
        entries: entries.iter().map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() }).collect(),
        ..Default::default()
    };
    let request = RateLimitRequest {
        domain: "api-gateway".into(),
        descriptors: vec![
            descriptor(&[("tenant", "acme")]),
            descriptor(&[("tenant", "acme"), ("class", "export")]),
        ],
        hits_addend: 0,
    };
    c.bench_function("decide/memory-store/tenant+export", |b| {
        b.iter(|| runtime.block_on(limiter.decide(black_box(&request))).unwrap())
    });
}

criterion_group!(benches, matching, keys, decide);
criterion_main!(benches);
