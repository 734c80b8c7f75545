//! Concurrency limits on a priced domain: a request's slot is taken with its money hold, all or
//! nothing in one script, and given back by its settlement (or the cancel of a hold whose answer
//! was lost). On the embedded store, Redis, a Redis Cluster and Redis behind Sentinel, with the
//! open slots and the held and spent money read back from Redis.

mod common;

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use tollgate::budget::{Calendar, Money, Per};

// $2 per million output tokens: a hold of 1,000 output tokens is $0.002; the org's $0.007 a
// month covers three holds at once, its concurrency limit two.
const CONFIG: &str = r#"
domain: llm
tenant_key: org
hold_ttl: 60s
prices:
  version: "1"
  currency: USD
  models:
    m: {input: 1.00, output: 2.00, default_output_tokens: 1000}
descriptors:
  - key: org
    budget: {amount: 0.007, per: month}
    concurrency: {max: 2, ttl: 60s}
    descriptors:
      - key: model
        descriptors:
          - key: request_id
"#;

const SET: &str = "rl:{acme}:llm:org=acme:slots";

fn hold(id: &str) -> RateLimitRequest {
    let mut r = req("llm", &[&format!("org=acme,model=m,request_id={id}")], 1);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: 1_000 });
    r
}

fn settle(id: &str, output: u64) -> RateLimitRequest {
    let mut r = req("llm", &[&format!("org=acme,model=m,request_id={id},usage=output")], 1);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: output });
    r
}

fn usd(text: &str) -> Money {
    Money::parse(text).unwrap()
}

/// What Redis holds: the set's open slots and the org's spent and held money this month.
type Read<'a> = &'a dyn Fn() -> Option<(i64, Money, Money)>;

fn remaining(r: &RateLimitResponse) -> Option<&str> {
    header(r, "X-Concurrency-Remaining")
}

async fn slots_with_a_budget(backend: Backend, extra: &[&str], read: Read<'_>) {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &backend, extra);
    let addr = server.addr();
    let expect = |open: i64, spent: &str, held: &str, why: &str| {
        if let Some(state) = read() {
            assert_eq!(state, (open, usd(spent), usd(held)), "{why}: open slots, spent, held");
        }
    };

    let a = ask(&addr, hold("a")).await.unwrap();
    assert_eq!((a.overall_code, remaining(&a)), (OK, Some("1")));
    let b = ask(&addr, hold("b")).await.unwrap();
    assert_eq!((b.overall_code, remaining(&b)), (OK, Some("0")));
    expect(2, "0", "0.004", "two holds, two slots");

    // Full: refused with nothing held, though the budget has room for a third; the answer names
    // no exhausted budget.
    let c = ask(&addr, hold("c")).await.unwrap();
    assert_eq!((c.overall_code, remaining(&c)), (OVER_LIMIT, Some("0")));
    assert_eq!(header(&c, "X-Budget-Exhausted"), None, "refused by the full set, not a budget");
    expect(2, "0", "0.004", "a refused hold holds nothing and takes no slot");

    // a's settlement ($0.001 for 500 output tokens) gives its slot back, once.
    let settled = ask(&addr, settle("a", 500)).await.unwrap();
    assert_eq!((settled.overall_code, remaining(&settled)), (OK, Some("1")));
    ask(&addr, settle("a", 500)).await.unwrap();
    expect(1, "0.001", "0.002", "a settled and its slot given back");

    // c again (its refused hold left no record): a slot and the budget's last $0.002.
    let c = ask(&addr, hold("c")).await.unwrap();
    assert_eq!((c.overall_code, remaining(&c)), (OK, Some("0")));
    expect(2, "0.001", "0.004", "c held with a slot");

    // b settles 1,500 tokens ($0.003); d finds a free slot but not the money ($0.004 spent +
    // $0.002 held + $0.002 > $0.007): refused by the budget, and takes no slot.
    assert_eq!(ask(&addr, settle("b", 1_500)).await.unwrap().overall_code, OK);
    let d = ask(&addr, hold("d")).await.unwrap();
    assert_eq!(d.overall_code, OVER_LIMIT);
    assert_eq!(header(&d, "X-Budget-Exhausted"), Some("org"));
    assert_eq!(remaining(&d), Some("1"), "no slot taken by a hold the budget refused");
    expect(1, "0.004", "0.002", "d refused: nothing held, no slot");

    let m = server.metrics();
    let slots =
        |event: &str| sample(&m, "tollgate_concurrency_slots_total", &[("rule", "org"), ("event", event)]);
    assert_eq!((slots("taken"), slots("refused"), slots("given_back")), (3.0, 1.0, 2.0));
    assert_eq!(sample(&m, "tollgate_concurrency_slots_open", &[("rule", "org")]), 1.0, "c's slot open");
}

fn month_key() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let start = Calendar::new(Per::Month, "UTC").unwrap().window(now).start_ms;
    format!("rl:{{acme}}:llm:org=acme:budget:{start}")
}

fn read_from(con: &mut dyn redis::ConnectionLike) -> (i64, Money, Money) {
    let open: i64 = redis::cmd("ZCARD").arg(SET).query(con).unwrap();
    let (s, h): (Option<String>, Option<String>) =
        redis::cmd("HMGET").arg(month_key()).arg("s").arg("h").query(con).unwrap();
    let money = |t: Option<String>| t.map(|t| Money::from_nanos(&t).unwrap()).unwrap_or_default();
    (open, money(s), money(h))
}

#[tokio::test(flavor = "multi_thread")]
async fn slots_with_a_budget_on_the_embedded_store() {
    slots_with_a_budget(Backend::Memory, &[], &|| None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn slots_with_a_budget_on_redis() {
    let redis = Redis::start();
    slots_with_a_budget(Backend::Redis(redis.url()), &[], &|| Some(read_from(&mut redis.connection()))).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn slots_with_a_budget_on_a_cluster() {
    let cluster = RedisCluster::start();
    let read = || Some(read_from(&mut cluster.connection()));
    slots_with_a_budget(Backend::Cluster(cluster.seeds()), &[], &read).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn slots_with_a_budget_behind_sentinel() {
    let group = SentinelGroup::start();
    let sentinel = ["--redis-sentinel", &group.addrs(), "--redis-sentinel-master", SENTINEL_MASTER];
    let read = || Some(read_from(&mut group.primary.connection()));
    slots_with_a_budget(Backend::Memory, &sentinel, &read).await;
}
