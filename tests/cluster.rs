//! Redis Cluster behaviour through real tollgate processes: slot placement, spreading, script
//! cache loss, and the seed's concurrency test across three tollgate replicas.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::identity::cluster_slot;

// Fail closed: a store error must never count as an admission in the concurrency test.
const CONFIG: &str = r#"
domain: c
failure_mode: deny
default_tier: free
tiers:
  free:
    default: {capacity: 100, refill_per_second: 0.001}
    export: {capacity: 100, refill_per_second: 0.001}
    search: {capacity: 100, refill_per_second: 0.001}
descriptors:
  - key: tenant
    quota: tenant
    descriptors:
      - key: class
        value: export
        class: export
        quota: tenant
      - key: class
        value: search
        class: search
        quota: tenant
  - key: burst
    token_bucket: {capacity: 10, refill_per_second: 2}
"#;

#[tokio::test(flavor = "multi_thread")]
async fn tenant_keys_share_a_slot_and_tenants_spread_over_all_primaries() {
    let cluster = RedisCluster::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Cluster(cluster.seeds()), &[]);

    // One tenant, three buckets, one request: all keys in one slot, on one primary.
    let r = ask(
        &server.addr(),
        req("c", &["tenant=acme", "tenant=acme,class=export", "tenant=acme,class=search"], 1),
    )
    .await
    .unwrap();
    assert_eq!(r.overall_code, OK);
    let keys = ["rl:{acme}:c:tenant=acme", "rl:{acme}:c:export", "rl:{acme}:c:search"];
    let slots: HashSet<i64> = keys
        .iter()
        .map(|k| node_query::<i64>(cluster.ports[0], &["CLUSTER", "KEYSLOT", k]).unwrap())
        .collect();
    assert_eq!(slots.len(), 1, "one slot for {keys:?}");
    let slot = *slots.iter().next().unwrap() as u16;
    assert_eq!(slot, cluster_slot(keys[0]), "our slot function agrees with Redis");
    let owner = cluster.primary_for_slot(slot);
    for key in &keys {
        let exists: i64 = node_query(owner, &["EXISTS", key]).unwrap();
        assert_eq!(exists, 1, "{key} on the primary of slot {slot}");
    }

    // 1000 tenants land on all three primaries, roughly evenly.
    for i in 0..1000 {
        let r = ask(&server.addr(), req("c", &[&format!("tenant=spread-{i}")], 1)).await.unwrap();
        assert_eq!(r.overall_code, OK);
    }
    let primaries = cluster.primaries();
    assert_eq!(primaries.len(), 3);
    let counts: Vec<i64> = primaries
        .iter()
        .map(|p| node_query::<Vec<String>>(*p, &["KEYS", "rl:{spread-*"]).unwrap().len() as i64)
        .collect();
    println!("tenant buckets per primary: {counts:?}");
    assert_eq!(counts.iter().sum::<i64>(), 1000);
    assert!(counts.iter().all(|c| *c >= 250), "uneven spread {counts:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn script_flush_on_every_node_is_survived() {
    let cluster = RedisCluster::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Cluster(cluster.seeds()), &[]);
    // Tenants on every shard, so every node's script cache is in use.
    let tenants: Vec<String> = (0..30).map(|i| format!("flush-{i}")).collect();
    for round in 1..=3u32 {
        for t in &tenants {
            let r = ask(&server.addr(), req("c", &[&format!("tenant={t}")], 1)).await.unwrap();
            assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 100 - round), "round {round}");
        }
        for port in &cluster.ports {
            let ok: String = node_query(*port, &["SCRIPT", "FLUSH"]).unwrap();
            assert_eq!(ok, "OK");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_through_three_replicas_never_overspend() {
    const CAPACITY: f64 = 10.0;
    const RATE: f64 = 2.0;
    let cluster = RedisCluster::start();
    let (_dir, config) = config_file(CONFIG);
    let servers: Vec<Tollgate> =
        (0..3).map(|_| Tollgate::start(&config, &Backend::Cluster(cluster.seeds()), &[])).collect();

    let admitted = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..50)
        .map(|w| {
            let addr = format!("http://{}", servers[w % 3].addr());
            let (admitted, answered) = (admitted.clone(), answered.clone());
            tokio::spawn(async move {
                let mut client = RateLimitServiceClient::connect(addr).await.expect("connect");
                for _ in 0..10 {
                    let r = client.should_rate_limit(req("c", &["burst=shared"], 1)).await.expect("answer");
                    answered.fetch_add(1, Ordering::SeqCst);
                    if r.into_inner().overall_code == OK {
                        admitted.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    let admitted = admitted.load(Ordering::SeqCst) as f64;
    let bound = CAPACITY + RATE * elapsed;
    println!("admitted {admitted} of 500 in {elapsed:.3}s through 3 replicas; bound {bound:.2}");
    assert_eq!(answered.load(Ordering::SeqCst), 500);
    assert!(admitted <= bound, "admitted {admitted} > capacity + rate x elapsed = {bound}");
    assert!(admitted > 0.0);
}

// Three plain buckets, each in a different slot, asked for together: a request is admitted only
// if all three have a token, and a denied one leaves none of them debited.
const SPLIT: &str = r#"
domain: split
failure_mode: deny
descriptors:
  - key: k1
    rate_limit: {unit: year, requests_per_unit: 100}
  - key: k2
    rate_limit: {unit: year, requests_per_unit: 60}
  - key: k3
    rate_limit: {unit: year, requests_per_unit: 150}
"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_request_across_three_slots_is_all_or_nothing_under_concurrency() {
    let keys = ["rl:split:k1=v", "rl:split:k2=v", "rl:split:k3=v"];
    let slots: HashSet<u16> = keys.iter().map(|k| cluster_slot(k)).collect();
    assert_eq!(slots.len(), 3, "three slots: {slots:?}");
    let cluster = RedisCluster::start();
    let primaries: HashSet<u16> = slots.iter().map(|s| cluster.primary_for_slot(*s)).collect();
    let (_dir, config) = config_file(SPLIT);
    let servers: Vec<Tollgate> =
        (0..2).map(|_| Tollgate::start(&config, &Backend::Cluster(cluster.seeds()), &[])).collect();

    let admitted = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let addr = servers[i % 2].addr();
            let admitted = admitted.clone();
            tokio::spawn(async move {
                let r = ask(&addr, req("split", &["k1=v", "k2=v", "k3=v"], 1)).await.expect("answer");
                if r.overall_code == OK {
                    admitted.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let admitted = admitted.load(Ordering::SeqCst) as f64;
    let mut con = cluster.connection();
    let debits: Vec<f64> = [(keys[0], 100.0), (keys[1], 60.0), (keys[2], 150.0)]
        .iter()
        .map(|(key, capacity)| {
            let tokens = stored_tokens(&mut con, key);
            capacity - tokens
        })
        .collect();
    let scrape = servers
        .iter()
        .map(|s| sample(&s.metrics(), "tollgate_store_refunds_total", &[("reason", "split")]))
        .sum::<f64>();
    println!(
        "3 slots on {} primaries: admitted {admitted} of 200; debits {debits:?}; {scrape} refunds",
        primaries.len()
    );
    // Never beyond the smallest bucket. Fewer is possible: while a denied request's debits are
    // outstanding in one slot, they can deny another request there (conservative, never more).
    assert!((1.0..=60.0).contains(&admitted), "admitted {admitted}; the smallest bucket holds 60");
    for (key, debit) in keys.iter().zip(&debits) {
        // Refill at 100-150 a year adds well under 0.01 tokens during the test.
        assert!((debit - admitted).abs() < 0.01, "{key}: debited {debit}, admitted {admitted}");
    }
    assert!(scrape > 0.0, "denials in one slot were refunded in the others");
}
