//! Micro-benchmarks of the request path without the network: descriptor matching, bucket
//! identity (rule and entries to key), and a whole decision on the memory store. Run with `cargo bench` in bench/harness
//! (bench/run does). Figures are per call on this machine, printed by Criterion.

use std::path::Path;
use std::sync::Arc;

use arc_swap::ArcSwap;
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use tollgate::config::RuleSet;
use tollgate::identity::{cluster_slot, rule_bucket};
use tollgate::limiter::{Limiter, Query, QueryDescriptor, ServiceModes};
use tollgate::quota::EmbeddedQuotas;
use tollgate::store::MemoryStore;
use tollgate::telemetry::{Telemetry, TelemetryConfig};

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
    let rules = example();
    let domain = rules.domain("api-gateway").unwrap();
    let export = [("tenant", "tenant-4711"), ("class", "export")];
    let class_rule = domain.lookup(&export[..]).unwrap();
    c.bench_function("key/tenant-class", |b| {
        b.iter(|| rule_bucket(domain, class_rule, black_box(&export[..])))
    });
    let tenant = [("tenant", "tenant-4711")];
    let tenant_rule = domain.lookup(&tenant[..]).unwrap();
    c.bench_function("key/tenant", |b| b.iter(|| rule_bucket(domain, tenant_rule, black_box(&tenant[..]))));
    let rules = wide();
    let domain = rules.domain("wide").unwrap();
    let entries = [("path", "/login"), ("user", "u42")];
    let rule = domain.lookup(&entries[..]).unwrap();
    c.bench_function("key/descriptor", |b| b.iter(|| rule_bucket(domain, rule, black_box(&entries[..]))));
    c.bench_function("key/cluster-slot", |b| {
        b.iter(|| cluster_slot(black_box("rl:{tenant-4711}:api-gateway:export")))
    });
}

fn decide(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let limiter = Limiter::new(
        Arc::new(ArcSwap::from_pointee(example())),
        Arc::new(MemoryStore::new()),
        Arc::new(EmbeddedQuotas),
        Arc::new(Telemetry::without_exporter(TelemetryConfig::default())),
        ServiceModes::default(),
    );
    let descriptor = |entries: Vec<(&'static str, &'static str)>| QueryDescriptor {
        entries,
        hits: 1,
        credit: false,
        limit: None,
    };
    let query = Query {
        domain: "api-gateway",
        descriptors: vec![
            descriptor(vec![("tenant", "acme")]),
            descriptor(vec![("tenant", "acme"), ("class", "export")]),
        ],
    };
    c.bench_function("decide/memory-store/tenant+export", |b| {
        b.iter(|| runtime.block_on(limiter.decide(black_box(&query))).unwrap())
    });
}

criterion_group!(benches, matching, keys, decide);
criterion_main!(benches);
