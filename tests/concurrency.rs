//! Concurrency limits over the RLS API, on the embedded store, Redis, a Redis Cluster and Redis
//! behind Sentinel: a take is
//! idempotent per request id, a give-back counts once, a slot not given back expires, a request
//! id reused on another path is refused, and a take is all or nothing with the token bucket on
//! its path. What Redis holds is read back: the open slots are exactly the admitted takes not
//! given back.

mod common;

use std::time::Duration;

use common::proxy::{Fault, FaultProxy};
use common::*;

const CONFIG: &str = r#"
domain: conc
descriptors:
  - key: tenant
    concurrency: {max: 2, ttl: 2s}
    descriptors:
      - key: route
        token_bucket: {capacity: 5, refill_per_second: 0.001}
"#;

const SET: &str = "rl:{acme}:conc:tenant=acme:slots";

async fn take(
    server: &Tollgate,
    route: &str,
    id: &str,
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse {
    let d = format!("tenant=acme,route={route},request_id={id}");
    ask(&server.addr(), req("conc", &[&d], 1)).await.expect("answer")
}

async fn give_back(server: &Tollgate, id: &str) -> i32 {
    let d = format!("tenant=acme,route=/export,request_id={id},release=1");
    ask(&server.addr(), req("conc", &[&d], 1)).await.expect("answer").overall_code
}

fn remaining(r: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse) -> &str {
    header(r, "X-Concurrency-Remaining").expect("X-Concurrency-Remaining")
}

// `zcard` reads the open slots from Redis (none for the embedded store).
async fn slots_as_promised(backend: Backend, extra: &[&str], zcard: &dyn Fn() -> Option<i64>) {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &backend, extra);
    let (_, shown) = http_get(server.http, "/config").unwrap();
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(
        shown["domains"][0]["concurrency"],
        serde_json::json!([{"path": "tenant", "max": 2, "ttl_ms": 2000}]),
        "GET /config shows the limit"
    );
    let (_, scrape) = http_get(server.http, "/metrics").unwrap();
    for event in ["taken", "refused", "given_back", "expired"] {
        let series =
            format!(r#"tollgate_concurrency_slots_total{{domain="conc",rule="tenant",event="{event}"}} 0"#);
        assert!(scrape.lines().any(|l| l == series), "{series} at startup");
    }
    assert!(scrape.contains(r#"tollgate_rule_limit{domain="conc",rule="tenant",kind="concurrency"} 2"#));
    // What Redis holds: exactly the admitted takes not given back.
    let expect_open = |n: i64| {
        if let Some(open) = zcard() {
            assert_eq!(open, n, "open slots in Redis");
        }
    };

    let a = take(&server, "/export", "a").await;
    assert_eq!(a.overall_code, OK);
    assert_eq!((header(&a, "X-Concurrency-Limit"), remaining(&a)), (Some("2"), "1"));
    assert_eq!(take(&server, "/export", "b").await.overall_code, OK);
    let full = take(&server, "/export", "c").await;
    assert_eq!(full.overall_code, OVER_LIMIT, "two in flight");
    assert_eq!(remaining(&full), "0");
    let retry: u64 = header(&full, "Retry-After").expect("Retry-After").parse().unwrap();
    assert!((1..=2).contains(&retry), "the earliest slot expires within its 2 s ttl: {retry}");

    // A retry of a take gets its answer again and takes nothing more.
    assert_eq!(take(&server, "/export", "a").await.overall_code, OK);
    assert_eq!(take(&server, "/export", "c").await.overall_code, OVER_LIMIT, "c was refused: still refused");
    expect_open(2);
    // Reused on another path: refused, nothing changed.
    assert_eq!(take(&server, "/other", "b").await.overall_code, OVER_LIMIT);

    // A give-back frees one slot, once.
    assert_eq!(give_back(&server, "a").await, OK);
    assert_eq!(give_back(&server, "a").await, OK);
    expect_open(1);
    let d = take(&server, "/export", "d").await;
    assert_eq!(d.overall_code, OK);
    assert_eq!(remaining(&d), "0", "b and d in flight");

    // Not given back: b and d expire after their ttl, and their give-back then changes nothing.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let e = take(&server, "/export", "e").await;
    assert_eq!(e.overall_code, OK);
    assert_eq!(remaining(&e), "1");
    assert_eq!(give_back(&server, "b").await, OK);
    expect_open(1);

    // All or nothing with the route's token bucket (5 tokens: a, b, d, e took four): f takes the
    // last token and the second slot; g finds a free slot (f given back) but no token, and takes
    // no slot.
    assert_eq!(take(&server, "/export", "f").await.overall_code, OK);
    assert_eq!(give_back(&server, "f").await, OK);
    let g = take(&server, "/export", "g").await;
    assert_eq!(g.overall_code, OVER_LIMIT, "the token bucket is empty");
    assert_eq!(remaining(&g), "1", "and no slot was taken");
    expect_open(1);
    let m = server.metrics();
    assert!(sample(&m, "tollgate_concurrency_slots_total", &[("event", "taken")]) >= 5.0);
    assert!(sample(&m, "tollgate_concurrency_slots_total", &[("event", "refused")]) >= 1.0);
    assert!(sample(&m, "tollgate_concurrency_slots_total", &[("event", "given_back")]) >= 2.0);
    // Taken less given back and expired: e's slot (one replica, so its own count is the world's).
    assert_eq!(sample(&m, "tollgate_concurrency_slots_open", &[("rule", "tenant")]), 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn slots_on_the_embedded_store() {
    slots_as_promised(Backend::Memory, &[], &|| None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn slots_on_redis() {
    let redis = Redis::start();
    let zcard = || Some(redis::cmd("ZCARD").arg(SET).query(&mut redis.connection()).unwrap());
    slots_as_promised(Backend::Redis(redis.url()), &[], &zcard).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn slots_on_a_cluster() {
    let cluster = RedisCluster::start();
    let zcard = || Some(redis::cmd("ZCARD").arg(SET).query(&mut cluster.connection()).unwrap());
    slots_as_promised(Backend::Cluster(cluster.seeds()), &[], &zcard).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn slots_behind_sentinel() {
    let group = SentinelGroup::start();
    let sentinel = ["--redis-sentinel", &group.addrs(), "--redis-sentinel-master", SENTINEL_MASTER];
    let zcard = || Some(redis::cmd("ZCARD").arg(SET).query(&mut group.primary.connection()).unwrap());
    slots_as_promised(Backend::Memory, &sentinel, &zcard).await;
}

// A take whose reply comes after the deadline, in a `deny` domain: the failure mode refuses the
// request, and the slot its script took is given back in the background long before its ttl.
#[tokio::test(flavor = "multi_thread")]
async fn a_take_the_failure_mode_refused_holds_no_slot() {
    let redis = Redis::start();
    let proxy = FaultProxy::start(redis.port);
    let (_dir, config) =
        config_file(&format!("failure_mode: deny\n{}", CONFIG.replace("ttl: 2s", "ttl: 60s")));
    let server = Tollgate::start(
        &config,
        &Backend::Redis(format!("redis://127.0.0.1:{}", proxy.port)),
        &["--redis-timeout", "100ms"],
    );
    // Warmed up (the script loaded), then one take whose reply is held back.
    assert_eq!(take(&server, "/export", "warm").await.overall_code, OK);
    assert_eq!(give_back(&server, "warm").await, OK);
    proxy.set(Fault::DelayReplies(Duration::from_millis(300)));
    assert_eq!(take(&server, "/export", "late").await.overall_code, OVER_LIMIT, "the failure mode (deny)");
    proxy.set(Fault::Pass);
    let mut con = redis.connection();
    wait_until("the refused take's slot given back", 300, Duration::from_millis(10), || {
        redis::cmd("ZCARD").arg(SET).query::<i64>(&mut con).unwrap() == 0
    });
    wait_until("the repair counted", 300, Duration::from_millis(10), || {
        let labels = [("kind", "give_back_refused_take"), ("outcome", "ok")];
        sample(&server.metrics(), "tollgate_concurrency_repairs_total", &labels) == 1.0
    });
}

// A slot given back through replica X is free for replica Y at once: slots are never answered
// from a replica's pre-check (both run with it), so Y asks the store, which has the slot. On
// standalone Redis and a Cluster.
async fn given_back_on_one_replica_free_on_the_other(backend: Backend) {
    let (_dir, config) = config_file(CONFIG);
    let x = Tollgate::start(&config, &backend, &[]);
    let y = Tollgate::start(&config, &backend, &[]);
    assert_eq!(take(&x, "/export", "a").await.overall_code, OK);
    assert_eq!(take(&x, "/export", "b").await.overall_code, OK);
    for id in ["c", "d", "e"] {
        assert_eq!(take(&y, "/export", id).await.overall_code, OVER_LIMIT, "full, seen by Y");
    }
    assert_eq!(give_back(&x, "a").await, OK);
    assert_eq!(take(&y, "/export", "f").await.overall_code, OK, "the very next take on Y");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slot_given_back_on_one_replica_is_free_on_the_other_at_once() {
    let redis = Redis::start();
    given_back_on_one_replica_free_on_the_other(Backend::Redis(redis.url())).await;
    let cluster = RedisCluster::start();
    given_back_on_one_replica_free_on_the_other(Backend::Cluster(cluster.seeds())).await;
}

// A take whose request also has a limit outside the tenant (another Cluster slot): the take is
// decided first, so a retry gets its recorded answer without the outside bucket charged again; a
// refused take charges nothing outside, and a denial outside undoes the take (its retry refused
// as it was). The route bucket's balance and the open slots are read back from Redis.
async fn a_take_with_a_limit_in_another_slot(backend: Backend, read: &dyn Fn() -> (f64, i64)) {
    const SPLIT: &str = r#"
domain: conc
descriptors:
  - key: tenant
    concurrency: {max: 2, ttl: 10s}
  - key: route
    token_bucket: {capacity: 3, refill_per_second: 0.0001}
"#;
    let (_dir, config) = config_file(SPLIT);
    let server = Tollgate::start(&config, &backend, &[]);
    let take = |id: &'static str| {
        let addr = server.addr();
        async move {
            let d = format!("tenant=acme,request_id={id}");
            ask(&addr, req("conc", &[&d, "route=/export"], 1)).await.unwrap().overall_code
        }
    };
    let route = |r: (f64, i64)| r.0.floor();
    assert_eq!((take("a").await, take("b").await), (OK, OK));
    assert_eq!(route(read()), 1.0);
    assert_eq!(take("c").await, OVER_LIMIT, "two slots open");
    assert_eq!(route(read()), 1.0, "the route only read");
    let d = "tenant=acme,request_id=a,release=1";
    assert_eq!(ask(&server.addr(), req("conc", &[d], 1)).await.unwrap().overall_code, OK);
    assert_eq!(take("d").await, OK);
    assert_eq!(read(), (0.0, 2));
    assert_eq!(take("d").await, OK, "a retry: its recorded answer, though the route is empty");
    assert_eq!(read(), (0.0, 2), "nothing charged or taken again");
    let d = "tenant=acme,request_id=b,release=1";
    assert_eq!(ask(&server.addr(), req("conc", &[d], 1)).await.unwrap().overall_code, OK);
    assert_eq!(take("e").await, OVER_LIMIT, "the route is empty");
    assert_eq!(read(), (0.0, 1), "e's slot given back");
    assert_eq!(take("e").await, OVER_LIMIT, "a retry of e: refused, as recorded");
    assert_eq!(read(), (0.0, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_take_with_a_limit_in_another_slot_on_redis_and_a_cluster() {
    const ROUTE: &str = "rl:conc:route=/export";
    let redis = Redis::start();
    let read = || {
        let mut c = redis.connection();
        let t: Option<f64> = redis::cmd("HGET").arg(ROUTE).arg("t").query(&mut c).unwrap();
        (t.unwrap_or(3.0).floor(), redis::cmd("ZCARD").arg(SET).query(&mut c).unwrap())
    };
    a_take_with_a_limit_in_another_slot(Backend::Redis(redis.url()), &read).await;
    let cluster = RedisCluster::start();
    assert_ne!(
        tollgate::identity::cluster_slot(ROUTE),
        tollgate::identity::cluster_slot(SET),
        "the route's bucket lies in another slot"
    );
    let read = || {
        let mut c = cluster.connection();
        let t: Option<f64> = redis::cmd("HGET").arg(ROUTE).arg("t").query(&mut c).unwrap();
        (t.unwrap_or(3.0).floor(), redis::cmd("ZCARD").arg(SET).query(&mut c).unwrap())
    };
    a_take_with_a_limit_in_another_slot(Backend::Cluster(cluster.seeds()), &read).await;
}

// Two descriptors down to one request id under one tenant (a limit per route and one per user):
// one request, its slots all or nothing in one script. A take the user's full set refuses takes
// no route slot; the stream-end call gives both back, whatever the order of its descriptors.
// Takes at two tenants are undone when one refuses.
#[tokio::test(flavor = "multi_thread")]
async fn two_takes_of_one_request_are_all_or_nothing() {
    const TWO: &str = r#"
domain: conc
descriptors:
  - key: tenant
    descriptors:
      - key: route
        concurrency: {max: 2, ttl: 60s}
      - key: user
        concurrency: {max: 1, ttl: 60s}
"#;
    const ROUTE: &str = "rl:{acme}:conc:tenant=acme:route=/export:slots";
    const USER: &str = "rl:{acme}:conc:tenant=acme:user=u1:slots";
    let redis = Redis::start();
    let (_dir, config) = config_file(TWO);
    let server = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    let call = |descriptors: Vec<String>| {
        let addr = server.addr();
        async move {
            let refs: Vec<&str> = descriptors.iter().map(String::as_str).collect();
            ask(&addr, req("conc", &refs, 1)).await.unwrap()
        }
    };
    let take = |id: &str| {
        vec![
            format!("tenant=acme,route=/export,request_id={id}"),
            format!("tenant=acme,user=u1,request_id={id}"),
        ]
    };
    let open = || {
        let mut c = redis.connection();
        let mut zcard = |key: &str| redis::cmd("ZCARD").arg(key).query::<i64>(&mut c).unwrap();
        (zcard(ROUTE), zcard(USER))
    };
    let a = call(take("a")).await;
    assert_eq!(a.overall_code, OK);
    assert_eq!(header(&a, "X-Concurrency-Remaining"), Some("0"), "the user's set is the tightest");
    assert_eq!(open(), (1, 1));
    // The user's set is full: b takes no route slot either.
    assert_eq!(call(take("b")).await.overall_code, OVER_LIMIT);
    assert_eq!(open(), (1, 1), "nothing taken for b");
    // A retry of a's call: its recorded answer, nothing more taken.
    assert_eq!(call(take("a")).await.overall_code, OK);
    assert_eq!(open(), (1, 1));
    // The give-back, its descriptors in the other order: both slots back.
    let release = vec![
        "tenant=acme,user=u1,request_id=a,release=1".to_owned(),
        "tenant=acme,route=/export,request_id=a,release=1".to_owned(),
    ];
    assert_eq!(call(release).await.overall_code, OK);
    assert_eq!(open(), (0, 0));
    // b's refusal is recorded (its retry is refused again); a new request gets both slots.
    assert_eq!(call(take("b")).await.overall_code, OVER_LIMIT);
    assert_eq!(call(take("c")).await.overall_code, OK);
    assert_eq!(open(), (1, 1));

    // Takes at two tenants (two records, two Cluster slots): zeta's is taken first, acme's user
    // set is full (c), so zeta's slot is given back: the refused request holds nothing.
    const ZETA: &str = "rl:{zeta}:conc:tenant=zeta:route=/export:slots";
    let two_tenants = vec![
        "tenant=zeta,route=/export,request_id=d".to_owned(),
        "tenant=acme,user=u1,request_id=d".to_owned(),
    ];
    assert_eq!(call(two_tenants).await.overall_code, OVER_LIMIT);
    let zeta: i64 = redis::cmd("ZCARD").arg(ZETA).query(&mut redis.connection()).unwrap();
    assert_eq!((zeta, open()), (0, (1, 1)), "zeta's slot given back, acme's sets as they were");
    let m = server.metrics();
    assert_eq!(sample(&m, "tollgate_concurrency_slots_open", &[("rule", "tenant.route")]), 1.0);
}
