//! Every balance raise reaches every replica's pre-check: a bucket one replica remembers as
//! empty is lifted by a credit or a late refund through another replica, and the first replica
//! admits as soon as the store would, within the bound the book states (the time a published
//! message takes), not after its observation ages out ([`tollgate::store::MAX_AGE_MS`], 5 s).
//! On standalone Redis, and on a Cluster; a client's credit, and the issue's late refund (a reply
//! held back past the deadline, given back when it comes).

mod common;

use std::time::{Duration, Instant};

use common::proxy::{Fault, FaultProxy};
use common::*;

// `failure_mode: deny`: a request answered without the store's reply took nothing, so a late
// reply's tokens are given back (under `allow` they stay taken).
const CONFIG: &str = r#"
domain: raise
failure_mode: deny
descriptors:
  - key: tenant
    token_bucket: { capacity: 3, refill_per_second: 0.001 }
"#;

async fn hit(server: &Tollgate, hits: u32, credit: bool) -> bool {
    let mut r = req("raise", &["tenant=acme"], hits);
    r.descriptors[0].is_negative_hits = credit;
    ask(&server.addr(), r).await.expect("answer").overall_code == OK
}

// Drains the bucket through `y` until its pre-check answers a denial itself (which it does only
// once it hears the raise channel, subscribed shortly after the replica is ready).
async fn held_empty_by(y: &Tollgate) {
    wait_until("the pre-check to hear raises", 400, Duration::from_millis(10), || {
        sample(&y.metrics(), "tollgate_precheck_hearing_raises", &[]) == 1.0
    });
    while hit(y, 1, false).await {}
    let before = sample(&y.metrics(), "tollgate_precheck_answers_total", &[]);
    assert!(!hit(y, 1, false).await);
    assert_eq!(
        sample(&y.metrics(), "tollgate_precheck_answers_total", &[]),
        before + 1.0,
        "answered locally"
    );
}

// How long after `since` replica `y` first admits (asking every millisecond or so).
async fn admits_after(y: &Tollgate, since: Instant) -> Duration {
    let deadline = since + Duration::from_secs(4);
    while !hit(y, 1, false).await {
        assert!(Instant::now() < deadline, "the other replica still denies what the store holds");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    since.elapsed()
}

async fn a_credit_reaches_the_other_replica(backend: Backend, what: &str) {
    let (_dir, config) = config_file(CONFIG);
    let x = Tollgate::start(&config, &backend, &[]);
    let y = Tollgate::start(&config, &backend, &[]);
    held_empty_by(&y).await;
    assert!(hit(&x, 2, true).await, "a credit is always admitted");
    let credited = Instant::now();
    let took = admits_after(&y, credited).await;
    println!(
        "{what}: a credit through one replica reached the other's pre-check {} ms after its answer",
        took.as_millis()
    );
    assert!(took < Duration::from_millis(500), "{took:?}");
    // The two tokens credited, and no more: the pre-check forgot, the store decides.
    assert!(hit(&y, 1, false).await);
    assert!(!hit(&y, 1, false).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_credit_through_one_replica_reaches_the_others_precheck() {
    let redis = Redis::start();
    a_credit_reaches_the_other_replica(Backend::Redis(redis.url()), "standalone").await;
    let cluster = RedisCluster::start();
    a_credit_reaches_the_other_replica(Backend::Cluster(cluster.seeds()), "cluster").await;
}

// The issue's case: replica X's reply is held back past its 50 ms deadline (X answers with the
// failure mode) and given back when it comes; meanwhile Y emptied the bucket and remembers it.
// `proxy` stands in front of the store's node holding the tenant, for X alone on standalone Redis
// and for both on a Cluster (whose nodes announce their proxies): it holds back only the reply
// read while X waits, so Y's own calls and the published raise pass at once.
async fn a_late_refund_reaches_the_other_replica(x: Backend, y: Backend, proxy: &FaultProxy, what: &str) {
    let (_dir, config) = config_file(CONFIG);
    let x = Tollgate::start(&config, &x, &["--redis-timeout", "50ms"]);
    let y = Tollgate::start(&config, &y, &[]);
    // Warmed up: the script is loaded, so the held-back reply is the script's own.
    assert!(hit(&x, 1, false).await);
    let delay = Duration::from_millis(300);
    proxy.set(Fault::DelayReplies(delay));
    let sent = Instant::now();
    assert!(!hit(&x, 1, false).await, "the failure mode (deny) answers");
    proxy.set(Fault::Pass);
    held_empty_by(&y).await;
    let took = admits_after(&y, sent).await;
    println!(
        "{what}: after a late refund the other replica admitted {} ms after the held-back request (its reply came after {} ms)",
        took.as_millis(),
        delay.as_millis()
    );
    assert!(took >= delay, "not before the refund: {took:?}");
    assert!(took < delay + Duration::from_millis(500), "{took:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_late_refund_through_one_replica_reaches_the_others_precheck() {
    let redis = Redis::start();
    let proxy = FaultProxy::start(redis.port);
    let through = Backend::Redis(format!("redis://127.0.0.1:{}", proxy.port));
    a_late_refund_reaches_the_other_replica(through, Backend::Redis(redis.url()), &proxy, "standalone").await;
    let mut cluster = RedisCluster::start();
    let proxies = cluster.behind_proxies();
    let node = cluster.primary_for_slot(tenant_slot("acme"));
    let proxy = proxies.iter().find(|p| p.port == node).expect("the tenant's node is proxied");
    let seeds = Backend::Cluster(cluster.seeds());
    a_late_refund_reaches_the_other_replica(seeds.clone(), seeds, proxy, "cluster").await;
}

// While the subscription is missing the pre-check answers nothing (every request reaches the
// store), and it answers again once the subscription is back. The channel permission is taken
// from Redis's default user, which drops the subscriber and refuses its new subscriptions
// (the scripts' own publishing fails quietly), then given back.
#[tokio::test(flavor = "multi_thread")]
async fn without_the_subscription_the_precheck_answers_nothing() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let y = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    held_empty_by(&y).await;
    let mut c = redis.connection();
    let acl = |rule: &str, c: &mut redis::Connection| {
        let _: () = redis::cmd("ACL").arg("SETUSER").arg("default").arg(rule).query(c).unwrap();
    };
    acl("resetchannels", &mut c);
    wait_until("the loss is counted", 300, Duration::from_millis(10), || {
        let m = y.metrics();
        sample(&m, "tollgate_precheck_subscription_losses_total", &[]) >= 1.0
            && sample(&m, "tollgate_precheck_hearing_raises", &[]) == 0.0
    });
    let local = |m: &prometheus_parse::Scrape| {
        (sample(m, "tollgate_precheck_answers_total", &[]), sample(m, "tollgate_store_calls_total", &[]))
    };
    let before = local(&y.metrics());
    for _ in 0..5 {
        assert!(!hit(&y, 1, false).await, "the store still denies");
    }
    let during = local(&y.metrics());
    assert_eq!(during.0, before.0, "no local answer while raises go unheard");
    assert_eq!(during.1, before.1 + 5.0, "every request reached the store");

    acl("allchannels", &mut c);
    wait_until("subscribed again", 400, Duration::from_millis(10), || {
        sample(&y.metrics(), "tollgate_precheck_hearing_raises", &[]) == 1.0
    });
    assert!(!hit(&y, 1, false).await);
    assert!(!hit(&y, 1, false).await);
    assert!(local(&y.metrics()).0 >= during.0 + 1.0, "answers locally again once it hears");
}
