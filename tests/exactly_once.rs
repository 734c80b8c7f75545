//! Exactly-once accounting at the edges, through a fault-injecting proxy in front of real Redis
//! (standalone, and every node of a real Cluster). After each fault clears, the buckets are read
//! back from Redis and must hold exactly what the admitted requests took:
//!
//! * a reply lost after the script ran is never resent: the tokens are taken once, not twice;
//! * a reply that comes after the deadline is refunded when the request was answered by
//!   `failure_mode: deny`, and kept when `allow` admitted it; a reply that never comes leaves
//!   what the script took (the documented limit);
//! * a known denial wins: a request over two Cluster slots, one over its limit and the other
//!   failing, is denied under `failure_mode: allow`, and the failed part's late tokens come back;
//! * a late reply's refund reaches the pre-check: a denial observed before the refund landed is
//!   not used to deny what Redis admits after it;
//! * two replicas with different specs for one bucket: the faster one's refills never make the
//!   slower one's pre-check deny what Redis admits; driven together for 10 s (standalone and
//!   Cluster), every window of admitted requests stays within the larger spec's bound;
//! * a capacity of 1e12 refilling 0.0001/s keeps its state in Redis.
//!
//! Every test prints what it measured; the book's "Failure behaviour" table quotes them.

mod common;

use std::time::{Duration, Instant};

use common::load::{Kind, Load};
use common::proxy::{Fault, FaultProxy};
use common::*;
use envoy_types::pb::google::protobuf::UInt64Value;

/// 1000 tokens that practically never refill, so every debit is countable; one domain per
/// failure mode.
const CONFIG: &str = r#"
domain: deny
failure_mode: deny
descriptors:
  - key: tenant
    token_bucket: {capacity: 1000, refill_per_second: 0.00001}
"#;
const ALLOW: &str = r#"
domain: allow
failure_mode: allow
descriptors:
  - key: tenant
    token_bucket: {capacity: 1000, refill_per_second: 0.00001}
"#;

fn configs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("deny.yaml"), CONFIG).unwrap();
    std::fs::write(dir.path().join("allow.yaml"), ALLOW).unwrap();
    dir
}

fn hits(
    domain: &str,
    tenant: &str,
    n: u64,
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
    let mut r = req(domain, &[&format!("tenant={tenant}")], 1);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: n });
    r
}

/// The balance of `tenant` in `domain`, read on `port` (a direct connection, never the proxy).
fn tokens(port: u16, domain: &str, tenant: &str) -> f64 {
    let key = format!("rl:{{{tenant}}}:{domain}:tenant={tenant}");
    let t: Option<String> = node_query(port, &["HGET", &key, "t"]);
    t.expect("the bucket exists").parse().unwrap()
}

/// A backend behind proxies: where tollgate connects, and how to read a tenant's bucket directly.
struct Setup {
    backend: Backend,
    proxies: Vec<FaultProxy>,
    // (proxy port, direct port) per node; standalone has one.
    nodes: Vec<(u16, u16)>,
    _redis: Option<Redis>,
    _cluster: Option<RedisCluster>,
    cluster: bool,
}

impl Setup {
    fn standalone() -> Setup {
        let redis = Redis::start();
        let proxy = FaultProxy::start(redis.port);
        Setup {
            backend: Backend::Redis(format!("redis://127.0.0.1:{}", proxy.port)),
            nodes: vec![(proxy.port, redis.port)],
            proxies: vec![proxy],
            _redis: Some(redis),
            _cluster: None,
            cluster: false,
        }
    }

    fn cluster() -> Setup {
        let mut cluster = RedisCluster::start();
        let proxies = cluster.behind_proxies();
        let nodes = cluster.ports.iter().copied().zip(cluster.direct.iter().copied()).collect();
        Setup {
            backend: Backend::Cluster(cluster.seeds()),
            proxies,
            nodes,
            _redis: None,
            _cluster: Some(cluster),
            cluster: true,
        }
    }

    // The proxy and the direct port of the primary holding `tenant`'s buckets.
    fn node_of(&self, tenant: &str) -> (&FaultProxy, u16) {
        let proxy_port = match &self._cluster {
            Some(c) => c.primary_for_slot(tenant_slot(tenant)),
            None => self.nodes[0].0,
        };
        let i = self.nodes.iter().position(|(p, _)| *p == proxy_port).expect("a proxied node");
        (&self.proxies[i], self.nodes[i].1)
    }

    fn name(&self) -> &'static str {
        if self.cluster {
            "cluster"
        } else {
            "standalone"
        }
    }
}

async fn a_lost_reply_is_never_resent(setup: &Setup) {
    let dir = configs();
    let server = Tollgate::start(dir.path(), &setup.backend, &["--redis-timeout", "200ms"]);
    let tenant = "lost";
    let (proxy, direct) = setup.node_of(tenant);
    assert_eq!(ask(&server.addr(), hits("deny", tenant, 1)).await.unwrap().overall_code, OK);
    proxy.set(Fault::DropReplies);
    let r = ask(&server.addr(), hits("deny", tenant, 100)).await.unwrap();
    proxy.set(Fault::Pass);
    let after = tokens(direct, "deny", tenant);
    println!(
        "{}: reply lost after the script ran: answered {} (failure mode), bucket 1000 -> {after:.3}",
        setup.name(),
        r.overall_code
    );
    assert_eq!(r.overall_code, OVER_LIMIT, "failure_mode deny answered");
    assert!((after - 899.0).abs() < 0.01, "taken once (899 left), not twice: {after}");
    // And the connection comes back for the next request.
    let mut answers = Vec::new();
    for _ in 0..100 {
        answers.push(ask(&server.addr(), hits("deny", "other", 1)).await.unwrap().overall_code);
        if answers.last() == Some(&OK) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(answers.last(), Some(&OK), "real answers again: {answers:?}");
}

// Waits until requests get real answers again (nothing still queued behind delayed replies).
async fn settle(server: &Tollgate) {
    for _ in 0..100 {
        let r = ask(&server.addr(), hits("deny", "probe", 1)).await.unwrap();
        if r.overall_code == OK {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no real answers");
}

async fn late_replies(setup: &Setup) {
    let dir = configs();
    let server = Tollgate::start(dir.path(), &setup.backend, &["--redis-timeout", "100ms"]);
    let mut figures = Vec::new();
    for (domain, code, left) in [("deny", OVER_LIMIT, 999.0), ("allow", OK, 969.0)] {
        let tenant = format!("late-{domain}");
        let action = if domain == "deny" { "refunded" } else { "kept" };
        settle(&server).await;
        let (proxy, direct) = setup.node_of(&tenant);
        assert_eq!(ask(&server.addr(), hits(domain, &tenant, 1)).await.unwrap().overall_code, OK);
        assert!((tokens(direct, domain, &tenant) - 999.0).abs() < 0.01, "warmed up");
        let before = sample(&server.metrics(), "tollgate_store_late_replies_total", &[("action", action)]);
        proxy.set(Fault::DelayReplies(Duration::from_millis(300)));
        for _ in 0..3 {
            let r = ask(&server.addr(), hits(domain, &tenant, 10)).await.unwrap();
            assert_eq!(r.overall_code, code, "{domain}: the failure mode answered");
        }
        // The script ran three times; its replies come 300 ms late.
        let start = Instant::now();
        for _ in 0..200 {
            let late = sample(&server.metrics(), "tollgate_store_late_replies_total", &[("action", action)]);
            if late - before >= 3.0 && (tokens(direct, domain, &tenant) - left).abs() < 0.01 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let late = sample(&server.metrics(), "tollgate_store_late_replies_total", &[("action", action)]);
        assert_eq!(
            late - before,
            3.0,
            "{domain}: three late replies {action}; bucket {}\n{}",
            tokens(direct, domain, &tenant),
            server.log()
        );
        proxy.set(Fault::Pass);
        let after = tokens(direct, domain, &tenant);
        figures.push(format!("{domain}: 3 x 10 tokens answered by the failure mode, bucket 999 -> {after:.3} ({action}, settled {:?} after the last answer)", start.elapsed()));
        assert!((after - left).abs() < 0.01, "{domain}: {after}, expected {left}");
    }
    println!("{}: replies 300 ms late, deadline 100 ms: {}", setup.name(), figures.join("; "));
}

async fn replies_that_never_come(setup: &Setup) {
    let dir = configs();
    let server = Tollgate::start(dir.path(), &setup.backend, &["--redis-timeout", "100ms"]);
    settle(&server).await;
    let tenant = "silent";
    let (proxy, direct) = setup.node_of(tenant);
    assert_eq!(ask(&server.addr(), hits("deny", tenant, 1)).await.unwrap().overall_code, OK);
    proxy.set(Fault::SwallowReplies);
    let r = ask(&server.addr(), hits("deny", tenant, 50)).await.unwrap();
    // The call waits for a refundable reply for twice the deadline, at least 1 s.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    proxy.set(Fault::Pass);
    let after = tokens(direct, "deny", tenant);
    let late = sample(&server.metrics(), "tollgate_store_late_replies_total", &[]);
    println!("{}: the script ran, its reply never came: answered {} (failure mode deny), bucket 999 -> {after:.3}, {late} late replies", setup.name(), r.overall_code);
    assert_eq!(r.overall_code, OVER_LIMIT);
    assert!((after - 949.0).abs() < 0.01, "no reply, nothing to refund: the 50 tokens stay taken ({after})");
    assert_eq!(late, 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn standalone_at_most_once_and_late_refunds() {
    let setup = Setup::standalone();
    a_lost_reply_is_never_resent(&setup).await;
    late_replies(&setup).await;
    replies_that_never_come(&setup).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cluster_at_most_once_and_late_refunds() {
    let setup = Setup::cluster();
    a_lost_reply_is_never_resent(&setup).await;
    late_replies(&setup).await;
    replies_that_never_come(&setup).await;
}

/// A reply that comes after the deadline is refunded; a denial another request observed before
/// the refund landed must not make the pre-check deny what Redis then holds.
async fn a_late_refund_reaches_the_precheck(setup: &Setup) {
    let dir = configs();
    let server = Tollgate::start(dir.path(), &setup.backend, &["--redis-timeout", "200ms"]);
    settle(&server).await;
    let tenant = "late-refund-precheck";
    let (proxy, direct) = setup.node_of(tenant);
    assert_eq!(ask(&server.addr(), hits("deny", tenant, 500)).await.unwrap().overall_code, OK);
    // A: its script takes the last 500, its reply comes 300 ms late; `deny` answers and refunds.
    proxy.set(Fault::DelayReplies(Duration::from_millis(300)));
    assert_eq!(ask(&server.addr(), hits("deny", tenant, 500)).await.unwrap().overall_code, OVER_LIMIT);
    proxy.set(Fault::Pass);
    // B: runs while the bucket is empty, its reply queued behind A's: a real denial, observed.
    let b = ask(&server.addr(), hits("deny", tenant, 500)).await.unwrap().overall_code;
    for _ in 0..200 {
        if (tokens(direct, "deny", tenant) - 500.0).abs() < 0.01 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let held = tokens(direct, "deny", tenant);
    assert!((held - 500.0).abs() < 0.01, "the late reply was refunded: {held}");
    // C: Redis holds 500; the pre-check must pass the request on.
    let c = ask(&server.addr(), hits("deny", tenant, 500)).await.unwrap().overall_code;
    let local = sample(&server.metrics(), "tollgate_precheck_answers_total", &[]);
    println!(
        "{}: late refund then a request for the refunded tokens: B {b}, C {c} ({local} local answers)",
        setup.name()
    );
    assert_eq!(c, OK, "Redis held {held} after the refund\n{}", server.log());
    assert!(tokens(direct, "deny", tenant).abs() < 0.01, "C took the refunded tokens");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_known_denial_wins_over_a_failed_cluster_slot() {
    let setup = Setup::cluster();
    let dir = configs();
    let server = Tollgate::start(dir.path(), &setup.backend, &["--redis-timeout", "100ms"]);
    settle(&server).await;
    let empty = "split-empty";
    let (empty_node, empty_direct) = setup.node_of(empty);
    let failing = (0..100)
        .map(|i| format!("split-failing-{i}"))
        .find(|t| setup.node_of(t).0.port != empty_node.port)
        .expect("a tenant on another primary");
    let (failing_node, failing_direct) = setup.node_of(&failing);
    assert_eq!(ask(&server.addr(), hits("allow", empty, 1000)).await.unwrap().overall_code, OK);
    assert_eq!(ask(&server.addr(), hits("allow", &failing, 1)).await.unwrap().overall_code, OK);
    // The failing tenant's shard answers 300 ms late: its script runs, its reply misses the
    // deadline; the empty tenant's shard answers OVER_LIMIT at once.
    failing_node.set(Fault::DelayReplies(Duration::from_millis(300)));
    let mut both = req("allow", &[&format!("tenant={empty}"), &format!("tenant={failing}")], 1);
    both.descriptors[1].hits_addend = Some(UInt64Value { value: 10 });
    let r = ask(&server.addr(), both).await.unwrap();
    failing_node.set(Fault::Pass);
    let mut left = tokens(failing_direct, "allow", &failing);
    for _ in 0..100 {
        if (left - 999.0).abs() < 0.01 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        left = tokens(failing_direct, "allow", &failing);
    }
    let errors = sample(&server.metrics(), "tollgate_store_errors_total", &[("domain", "allow")]);
    println!(
        "cluster, failure_mode allow: a request over an empty slot and a failing one: {} (statuses {:?}); the failing slot's bucket {left} after its late reply; store errors counted {errors}",
        r.overall_code,
        r.statuses.iter().map(|s| s.code).collect::<Vec<_>>()
    );
    assert_eq!(r.overall_code, OVER_LIMIT, "the known denial wins");
    assert!((left - 999.0).abs() < 0.01, "the failed part's late tokens were given back: {left}");
    assert!(tokens(empty_direct, "allow", empty).abs() < 0.01);
    assert!(errors >= 1.0, "the failed part is counted");
    let refunded = sample(&server.metrics(), "tollgate_store_late_replies_total", &[("action", "refunded")]);
    assert_eq!(refunded, 1.0, "the failed part's script ran; its late reply was refunded");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_late_refund_reaches_the_precheck_on_standalone_redis() {
    a_late_refund_reaches_the_precheck(&Setup::standalone()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_faster_spec_on_another_replica_never_makes_the_precheck_deny() {
    let redis = Redis::start();
    let spec = |rate: &str| {
        format!("domain: spec\ndescriptors:\n  - key: tenant\n    token_bucket: {{capacity: 5, refill_per_second: {rate}}}\n")
    };
    let (_slow_dir, slow_config) = config_file(&spec("0.01"));
    let (_fast_dir, fast_config) = config_file(&spec("100"));
    let slow = Tollgate::start(&slow_config, &Backend::Redis(redis.url()), &[]);
    let fast = Tollgate::start(&fast_config, &Backend::Redis(redis.url()), &[]);
    let one = || req("spec", &["tenant=shared"], 1);
    // Both replicas serve the bucket; the slow one empties it and remembers it empty.
    assert_eq!(ask(&fast.addr(), one()).await.unwrap().overall_code, OK);
    let mut admitted = 0;
    while ask(&slow.addr(), one()).await.unwrap().overall_code == OK {
        admitted += 1;
        assert!(admitted <= 10, "the bucket empties");
    }
    // The fast replica's refill puts tokens back...
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(ask(&fast.addr(), one()).await.unwrap().overall_code, OK);
    // ...so Redis admits the slow replica's next request, and its pre-check must not deny it.
    let r = ask(&slow.addr(), one()).await.unwrap();
    let local = sample(&slow.metrics(), "tollgate_precheck_answers_total", &[]);
    println!("two replicas, 0.01/s and 100/s on one bucket: the slow one's request after the fast one's refill: {} ({local} local answers so far)", r.overall_code);
    assert_eq!(r.overall_code, OK, "Redis holds tokens; the pre-check must pass the request on");
}

/// Two replicas started with different rule files for one bucket (a rolling deploy of a changed
/// limit), driven together for 10 s: in every window of T seconds the admitted requests stay
/// within `max capacity + max refill × T`, and the bucket read back from Redis holds what the
/// specs allow.
async fn replicas_that_disagree(setup: &Setup) {
    let spec = |capacity: u32, rate: u32| {
        format!("domain: spec\ndescriptors:\n  - key: tenant\n    token_bucket: {{capacity: {capacity}, refill_per_second: {rate}}}\n")
    };
    let (_a_dir, a_config) = config_file(&spec(20, 5));
    let (_b_dir, b_config) = config_file(&spec(50, 2));
    let (largest, fastest) = (50.0, 5.0);
    let a = Tollgate::start(&a_config, &setup.backend, &[]);
    let b = Tollgate::start(&b_config, &setup.backend, &[]);
    settle(&a).await;
    settle(&b).await;
    let tenant = "disagree";
    let (_, direct) = setup.node_of(tenant);
    let load = Load::start(&[a.addr(), b.addr()], "spec", &[tenant.to_owned()], 8).await;
    // Meanwhile, what the bucket holds, refilled to now at its rate in force: under this load
    // every token is spent as it comes, unless a pre-check denies what Redis would admit, which
    // lets tokens pile up for as long as its observation stands.
    let sampler = tokio::task::spawn_blocking(move || {
        let key = format!("rl:{{{tenant}}}:spec:tenant={tenant}");
        // Sampled once the first burst is spent (the balance first under one token).
        let mut most: Option<f64> = None;
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            let fields: Option<(Option<f64>, Option<u64>, Option<f64>)> =
                node_query(direct, &["HMGET", &key, "t", "l", "r"]);
            let time: Option<(u64, u64)> = node_query(direct, &["TIME"]);
            if let (Some((Some(t), Some(l), Some(r))), Some((s, us))) = (fields, time) {
                let now = s * 1000 + us / 1000;
                let held = t + now.saturating_sub(l) as f64 * r / 1000.0;
                most = match most {
                    Some(m) => Some(m.max(held)),
                    None => (held < 1.0).then_some(held),
                };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        most.expect("the first burst was spent")
    });
    let most_held = sampler.await.unwrap();
    let answers = load.stop().await;
    let admitted: Vec<_> = answers.iter().filter(|a| a.kind == Kind::Admitted).collect();
    let failed = answers.iter().filter(|a| !matches!(a.kind, Kind::Admitted | Kind::Denied)).count();
    assert_eq!(failed, 0, "every answer a real one");
    // The admitted requests of a window were decided between the first one's sending and the
    // last one's answer.
    let mut worst: f64 = 0.0;
    for (i, first) in admitted.iter().enumerate() {
        let from = first.at.saturating_sub(first.latency).as_secs_f64();
        for (n, last) in admitted[i..].iter().enumerate() {
            let bound = largest + fastest * (last.at.as_secs_f64() - from);
            worst = worst.max((n + 1) as f64 / bound);
        }
    }
    let held = tokens(direct, "spec", tenant);
    let local = sample(&a.metrics(), "tollgate_precheck_answers_total", &[])
        + sample(&b.metrics(), "tollgate_precheck_answers_total", &[]);
    println!(
        "{}: two replicas (20 at 5/s, 50 at 2/s) on one bucket for 10 s: {} of {} requests admitted, worst window at {:.2} of the larger spec's bound, {local} answered by the pre-checks, at most {most_held:.2} tokens unspent at any sample, bucket holds {held:.3}",
        setup.name(),
        admitted.len(),
        answers.len(),
        worst
    );
    assert!(worst <= 1.0, "a window admitted more than max capacity + max rate x T: {worst:.3}");
    assert!(admitted.len() as f64 >= 20.0 + 2.0 * 10.0 * 0.8, "the bucket is served: {}", admitted.len());
    assert!((-0.001..=largest).contains(&held), "the balance stays within the specs: {held}");
    // A token refilled while every request was denied locally would wait up to 5 s (the
    // pre-check's longest use of an observation): at 5 per second, 25 tokens.
    assert!(most_held < 5.0, "tokens piled up unspent ({most_held:.2}): a pre-check denied what Redis held");
}

#[tokio::test(flavor = "multi_thread")]
async fn replicas_with_different_rule_files_stay_within_the_larger_spec() {
    replicas_that_disagree(&Setup::standalone()).await;
    replicas_that_disagree(&Setup::cluster()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn extreme_specs_keep_their_state_in_redis() {
    let redis = Redis::start();
    let (_dir, config) = config_file("domain: x\ndescriptors:\n  - key: tenant\n    token_bucket: {capacity: 1e12, refill_per_second: 0.0001}\n");
    let server = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(ask(&server.addr(), hits("x", "huge", 600_000_000_000)).await.unwrap().overall_code);
    }
    let ttl: i64 = redis::cmd("PTTL").arg("rl:{huge}:x:tenant=huge").query(&mut redis.connection()).unwrap();
    println!("capacity 1e12 at 0.0001/s, three requests of 6e11: {codes:?}; TTL {ttl} ms");
    assert_eq!(codes, vec![OK, OVER_LIMIT, OVER_LIMIT], "only one fits");
    assert!(ttl > 1_000_000_000_000, "the state is kept (TTL capped, not overflowed): {ttl}");
}
