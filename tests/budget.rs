//! LLM spend budgets through the RLS API (a neutral gRPC client, as Envoy's ratelimit filter
//! calls it): a request-time descriptor down to the request id holds what the request may cost
//! at every level, stream-end descriptors with a `usage` entry settle it. On the embedded store,
//! a standalone Redis, a Redis Cluster and Redis behind Sentinel, with every level's spent and
//! held money read back from Redis in nano-units.
//!
//! * a hold and its settlement: exact spend at org, team and key; headers on OK;
//! * a settlement sent twice, or a kind sent twice, is charged once;
//! * a model without a price is denied (`X-Budget-Exhausted: model`), never priced at zero;
//! * all or nothing: a team budget exhausted denies without touching org, key or bucket;
//! * a hold never settled: charged in full (`on_lost_settle: charge`) or released, and a late
//!   settlement charges only what exceeds what the expiry charged;
//! * a price reload while a hold is open: it settles at the version it was held at;
//! * calendar rollover with `per: minute` in a non-UTC zone (standalone Redis);
//! * `tollgate explain` shows the prices, the hold and every budget's spent and held money;
//! * the overshoot bound, met with equality; a reload of an amount keeps what was spent;
//! * exactly once through the fault proxy: a hold whose reply is lost or late (the request
//!   denied by `failure_mode: deny`) is cancelled, a settlement whose reply is lost is sent
//!   again and charged once.

mod common;

use std::path::Path;
use std::time::Duration;

use common::proxy::{Fault, FaultProxy};
use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use tollgate::budget::{Calendar, Money, Per};

fn config(version: &str, output_price: &str, hold_ttl: &str, lost: &str) -> String {
    format!(
        r#"
domain: llm
tenant_key: org
hold_ttl: {hold_ttl}
on_lost_settle: {lost}
prices:
  version: "{version}"
  currency: USD
  models:
    gpt-4o:        {{input: 2.50, cached_input: 1.25, output: {output_price}, default_output_tokens: 1000,
                    aliases: [gpt-4o-2024-08-06]}}
    gpt-4o-mini:   {{input: 0.15, output: 0.60, max_output_tokens: 16384, max_input_tokens: 128000}}
    claude-sonnet: {{input: 3.00, cached_input: 0.30, cache_write: 3.75, output: 15.00, reserve_input_tokens: 4000}}
descriptors:
  - key: org
    budget: {{amount: 1000.00, per: month, timezone: Europe/Berlin}}
    descriptors:
      - key: team
        budget: {{amount: 2.00, per: month}}
        descriptors:
          - key: api_key
            budget: {{amount: 1.00, per: day, alert_at: [0.5, 0.9]}}
            token_bucket: {{capacity: 200000, refill_per_second: 2000}}
            descriptors:
              - key: model
                descriptors:
                  - key: request_id
"#
    )
}

/// Where a test reads levels back: the backend's connection, or nothing for the memory store.
enum Levels {
    Memory,
    Redis(redis::Connection),
    Cluster(Box<redis::cluster::ClusterConnection>),
}

impl Levels {
    /// Spent and held money of the level `path` (`org=o:team=t`) in the period `calendar` has now.
    fn read(&mut self, path: &str, calendar: &Calendar) -> Option<(Money, Money)> {
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
        let org = path.split(':').next().unwrap().trim_start_matches("org=");
        let key = format!("rl:{{{org}}}:llm:{path}:budget:{}", calendar.window(now).start_ms);
        let cmd = redis::cmd("HMGET").arg(&key).arg("s").arg("h").clone();
        let (s, h): (Option<String>, Option<String>) = match self {
            Levels::Memory => return None,
            Levels::Redis(con) => cmd.query(con).unwrap(),
            Levels::Cluster(con) => cmd.query(con).unwrap(),
        };
        let money = |t: Option<String>| t.map(|t| Money::from_nanos(&t).expect("nano-units"));
        Some((money(s).unwrap_or_default(), money(h).unwrap_or_default()))
    }

    fn exists(&mut self, key: &str) -> Option<bool> {
        let cmd = redis::cmd("EXISTS").arg(key).clone();
        match self {
            Levels::Memory => None,
            Levels::Redis(con) => Some(cmd.query(con).unwrap()),
            Levels::Cluster(con) => Some(cmd.query(con).unwrap()),
        }
    }
}

fn month() -> Calendar {
    Calendar::new(Per::Month, "Europe/Berlin").unwrap()
}
fn team_month() -> Calendar {
    Calendar::new(Per::Month, "UTC").unwrap()
}
fn day() -> Calendar {
    Calendar::new(Per::Day, "UTC").unwrap()
}

fn usd(text: &str) -> Money {
    Money::parse(text).unwrap()
}

/// The request-time descriptor: `max_tokens` as hits.
fn hold(org: &str, team: &str, key: &str, model: &str, id: &str, max_tokens: u64) -> RateLimitRequest {
    let mut r =
        req("llm", &[&format!("org={org},team={team},api_key={key},model={model},request_id={id}")], 1);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: max_tokens });
    r
}

/// The stream-end descriptors: one per usage kind.
fn settle(
    org: &str,
    team: &str,
    key: &str,
    model: &str,
    id: &str,
    usage: &[(&str, u64)],
) -> RateLimitRequest {
    let path = format!("org={org},team={team},api_key={key},model={model},request_id={id}");
    let descriptors: Vec<String> = usage.iter().map(|(kind, _)| format!("{path},usage={kind}")).collect();
    let refs: Vec<&str> = descriptors.iter().map(String::as_str).collect();
    let mut r = req("llm", &refs, 1);
    for (d, (_, n)) in r.descriptors.iter_mut().zip(usage) {
        d.hits_addend = Some(UInt64Value { value: *n });
    }
    r
}

fn code_and(r: &RateLimitResponse, name: &str) -> (i32, Option<String>) {
    (r.overall_code, header(r, name).map(str::to_owned))
}

async fn hold_and_settle(addr: &str, levels: &mut Levels) {
    // 1,000 output tokens at $10/M: a hold of $0.01 at every level.
    let r = ask(addr, hold("o1", "t", "k", "gpt-4o", "r1", 1_000)).await.unwrap();
    assert_eq!(r.overall_code, OK);
    // The key's daily $1.00 has least left.
    assert_eq!(header(&r, "X-Budget-Remaining"), Some("0.990000000 USD"));
    let reset: u64 = header(&r, "X-Budget-Reset").unwrap().parse().unwrap();
    assert!((1..=86_400).contains(&reset), "{reset}");
    assert_eq!(header(&r, "X-Budget-Exhausted"), None);
    if let Some(key) = levels.read("org=o1:team=t:api_key=k", &day()) {
        assert_eq!(key, (Money::ZERO, usd("0.01")), "held, not spent");
    }
    // Usage: 1,200 input at $2.50/M ($0.003), 300 cached at $1.25/M ($0.000375), 800 output at
    // $10/M ($0.008): $0.011375, the hold released.
    let usage = [("input", 1_200), ("cached_input", 300), ("output", 800)];
    let r = ask(addr, settle("o1", "t", "k", "gpt-4o", "r1", &usage)).await.unwrap();
    assert_eq!(r.overall_code, OK);
    assert_eq!(header(&r, "X-Budget-Remaining"), Some("0.988625000 USD"));
    let spent = usd("0.011375");
    for (path, calendar) in
        [("org=o1", month()), ("org=o1:team=t", team_month()), ("org=o1:team=t:api_key=k", day())]
    {
        if let Some(level) = levels.read(path, &calendar) {
            assert_eq!(level, (spent, Money::ZERO), "{path}: spent exactly the priced usage, nothing held");
        }
    }
    // The same settlement again, and a kind sent twice in one call: charged once.
    ask(addr, settle("o1", "t", "k", "gpt-4o", "r1", &usage)).await.unwrap();
    let r =
        ask(addr, settle("o1", "t", "k", "gpt-4o", "r1", &[("output", 800), ("output", 800)])).await.unwrap();
    assert_eq!(header(&r, "X-Budget-Remaining"), Some("0.988625000 USD"));
    if let Some(level) = levels.read("org=o1", &month()) {
        assert_eq!(level, (spent, Money::ZERO), "a settlement is idempotent per (request, kind)");
    }
    // A request id whose hold exists: admitted again, nothing held twice.
    let r = ask(addr, hold("o1", "t", "k", "gpt-4o", "r2", 1_000)).await.unwrap();
    let again = ask(addr, hold("o1", "t", "k", "gpt-4o", "r2", 1_000)).await.unwrap();
    assert_eq!((r.overall_code, again.overall_code), (OK, OK));
    if let Some(key) = levels.read("org=o1:team=t:api_key=k", &day()) {
        assert_eq!(key, (spent, usd("0.01")), "one hold for r2, however often it is asked");
    }
}

async fn unknown_model(addr: &str) {
    let r = ask(addr, hold("o2", "t", "k", "gpt-9", "r1", 10)).await.unwrap();
    assert_eq!(code_and(&r, "X-Budget-Exhausted"), (OVER_LIMIT, Some("model".into())));
}

async fn all_or_nothing(addr: &str, levels: &mut Levels) {
    // Keys a and b each spend $0.90 of team t's $2.00 a month.
    for (key, id) in [("a", "r1"), ("b", "r2")] {
        assert_eq!(ask(addr, hold("o3", "t", key, "gpt-4o", id, 90_000)).await.unwrap().overall_code, OK);
        ask(addr, settle("o3", "t", key, "gpt-4o", id, &[("output", 90_000)])).await.unwrap();
    }
    // Key c has its whole $1.00 for the day, but a $0.30 hold would take the team past $2.00.
    let r = ask(addr, hold("o3", "t", "c", "gpt-4o", "r3", 30_000)).await.unwrap();
    assert_eq!(code_and(&r, "X-Budget-Exhausted"), (OVER_LIMIT, Some("team".into())));
    assert_eq!(
        header(&r, "X-Budget-Remaining"),
        Some("0.200000000 USD"),
        "the team's $0.20 left is the least"
    );
    let retry: u64 =
        header(&r, "Retry-After").expect("Retry-After at the team's period end").parse().unwrap();
    assert!(retry >= 1, "{retry}");
    if let Some(org) = levels.read("org=o3", &month()) {
        assert_eq!(org, (usd("1.80"), Money::ZERO), "the org is untouched by the denial");
        assert_eq!(levels.read("org=o3:team=t:api_key=c", &day()), Some((Money::ZERO, Money::ZERO)));
        assert_eq!(
            levels.exists("rl:{o3}:llm:org=o3:team=t:api_key=c"),
            Some(false),
            "the key's bucket untouched"
        );
        assert_eq!(levels.exists("rl:{o3}:llm:hold:r3"), Some(false), "no record for a denied request");
    }
    // What fits is still admitted.
    assert_eq!(ask(addr, hold("o3", "t", "c", "gpt-4o", "r4", 20_000)).await.unwrap().overall_code, OK);
}

/// A request id used again: after its settlement, or by another key while its hold is open. The
/// second asker is refused (`X-Budget-Exhausted: request_id`), nothing held or charged anywhere,
/// and the settlement of the other path charges nothing; the real settlement still lands.
async fn reused_request_ids(addr: &str, levels: &mut Levels) {
    let refused =
        |r: &RateLimitResponse| code_and(r, "X-Budget-Exhausted") == (OVER_LIMIT, Some("request_id".into()));
    assert_eq!(ask(addr, hold("ru", "t", "k", "gpt-4o", "r1", 1_000)).await.unwrap().overall_code, OK);
    ask(addr, settle("ru", "t", "k", "gpt-4o", "r1", &[("output", 1_000)])).await.unwrap();
    // Replayed after its settlement, on the same path: refused, not a free retry.
    for _ in 0..3 {
        let r = ask(addr, hold("ru", "t", "k", "gpt-4o", "r1", 1_000)).await.unwrap();
        assert!(refused(&r), "a settled id is never admitted again: {r:?}");
        assert_eq!(header(&r, "Retry-After"), None, "retrying cannot help");
    }
    // An open id taken by another team's key, and by the same key asking another hold.
    assert_eq!(ask(addr, hold("ru", "t", "k", "gpt-4o", "open", 1_000)).await.unwrap().overall_code, OK);
    assert!(refused(&ask(addr, hold("ru", "t2", "k2", "gpt-4o", "open", 1_000)).await.unwrap()));
    assert!(refused(&ask(addr, hold("ru", "t", "k", "gpt-4o", "open", 9_000)).await.unwrap()));
    // The other key's usage for that id is not charged to the first key's path, nor its own.
    ask(addr, settle("ru", "t2", "k2", "gpt-4o", "open", &[("output", 75_900)])).await.unwrap();
    if let Some(key) = levels.read("org=ru:team=t:api_key=k", &day()) {
        assert_eq!(key, (usd("0.01"), usd("0.01")), "r1 spent, 'open' still held: nothing of k2's");
        assert_eq!(levels.read("org=ru:team=t2:api_key=k2", &day()), Some((Money::ZERO, Money::ZERO)));
        assert_eq!(levels.read("org=ru", &month()), Some((usd("0.01"), usd("0.01"))));
    }
    // The first key's own settlement is still taken.
    ask(addr, settle("ru", "t", "k", "gpt-4o", "open", &[("output", 500)])).await.unwrap();
    if let Some(key) = levels.read("org=ru:team=t:api_key=k", &day()) {
        assert_eq!(key, (usd("0.015"), Money::ZERO), "k's real settlement charged, its hold released");
    }
    // An empty request id is nobody's.
    assert!(refused(&ask(addr, hold("ru", "t", "k", "gpt-4o", "", 1_000)).await.unwrap()));
}

/// What a client sends never turns into an admit: a descriptor with a level missing or an entry
/// extra, a value over the size limit, or a hold larger than a level's whole amount gets
/// OVER_LIMIT with `X-Budget-Exhausted: request` and no Retry-After, and nothing is held.
async fn malformed_requests(addr: &str, levels: &mut Levels) {
    let request_refused = |r: &RateLimitResponse| {
        code_and(r, "X-Budget-Exhausted") == (OVER_LIMIT, Some("request".into()))
            && header(r, "Retry-After").is_none()
    };
    let path = |entries: &str, hits: u64| {
        let mut r = req("llm", &[entries], 1);
        r.descriptors[0].hits_addend = Some(UInt64Value { value: hits });
        r
    };
    for entries in [
        "org=mf,team=t,api_key=k,request_id=r1",
        "org=mf,team=t,model=gpt-4o,request_id=r1",
        "org=mf,team=t,api_key=k,model=gpt-4o,request_id=r1,extra=x",
        "org=mf,team=t,api_key=k,model=gpt-4o",
        "org=mf,team=t,api_key=k,model=gpt-4o,input_bytes=lots,request_id=r1",
    ] {
        let r = ask(addr, path(entries, 10)).await.unwrap();
        assert!(request_refused(&r), "{entries}: {r:?}");
    }
    // A value over 1,024 bytes: not a call error, which Envoy would let through uncharged.
    let r = ask(addr, hold("mf", "t", &"k".repeat(2_000), "gpt-4o", "r2", 10)).await.unwrap();
    assert!(request_refused(&r), "{r:?}");
    // 200,000 output tokens at $15/M is $3.00, above the key's whole $1.00 a day.
    let r = ask(addr, hold("mf", "t", "k", "claude-sonnet", "r3", 200_000)).await.unwrap();
    assert!(request_refused(&r), "{r:?}");
    if let Some(key) = levels.read("org=mf:team=t:api_key=k", &day()) {
        assert_eq!(key, (Money::ZERO, Money::ZERO), "nothing held for any of them");
    }
}

/// The hold is an upper bound: `max_tokens` is held up to the model's `max_output_tokens`, the
/// body's size (`input_bytes`) is held as input tokens at the dearest input price, up to the
/// context window; a settled count above the model's maximum is charged at the maximum; a
/// response naming another model in the table (or an alias) is priced at it.
async fn holds_and_counts_are_bounded(addr: &str, levels: &mut Levels) {
    let mini = "gpt-4o-mini";
    let sized = |id: &str, bytes: u64, max_tokens: u64| {
        let entries = format!("org=hb,team=t,api_key=k,model={mini},input_bytes={bytes},request_id={id}");
        let mut r = req("llm", &[&entries], 1);
        r.descriptors[0].hits_addend = Some(UInt64Value { value: max_tokens });
        r
    };
    // 8,000 bytes: at most 8,000 input tokens at $0.15/M ($0.0012), and 1,000 output at $0.60/M.
    let r = ask(addr, sized("r1", 8_000, 1_000)).await.unwrap();
    assert_eq!((r.overall_code, header(&r, "X-Budget-Remaining")), (OK, Some("0.998200000 USD")));
    // A body past the context window holds 128,000 input tokens ($0.0192); max_tokens past the
    // model's 16,384 holds 16,384 ($0.0098304).
    let r = ask(addr, sized("r2", 10_000_000, 1_000_000)).await.unwrap();
    assert_eq!((r.overall_code, header(&r, "X-Budget-Remaining")), (OK, Some("0.969169600 USD")));
    // A count of 2^64-1 output tokens is charged as 16,384, logged and counted.
    let entries =
        format!("org=hb,team=t,api_key=k,model={mini},input_bytes=10000000,request_id=r2,usage=output");
    let mut r = req("llm", &[&entries], 1);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: u64::MAX });
    ask(addr, r).await.unwrap();
    if let Some(key) = levels.read("org=hb:team=t:api_key=k", &day()) {
        assert_eq!(key, (usd("0.0098304"), usd("0.0018")), "capped at max_output_tokens; r1 still held");
    }
    // A hold on gpt-4o served by gpt-4o-mini is priced at gpt-4o-mini ($0.0006); one on
    // gpt-4o-mini served by a dated alias of gpt-4o at gpt-4o ($0.01).
    let served = |model: &str, id: &str, served: &str| {
        let entries = format!(
            "org=hb,team=t,api_key=k,model={model},request_id={id},served_model={served},usage=output"
        );
        let mut r = req("llm", &[&entries], 1);
        r.descriptors[0].hits_addend = Some(UInt64Value { value: 1_000 });
        r
    };
    assert_eq!(ask(addr, hold("hb", "t", "k", "gpt-4o", "r3", 1_000)).await.unwrap().overall_code, OK);
    ask(addr, served("gpt-4o", "r3", mini)).await.unwrap();
    assert_eq!(ask(addr, hold("hb", "t", "k", mini, "r4", 1_000)).await.unwrap().overall_code, OK);
    ask(addr, served(mini, "r4", "gpt-4o-2024-08-06")).await.unwrap();
    if let Some(key) = levels.read("org=hb:team=t:api_key=k", &day()) {
        assert_eq!(key, (usd("0.0204304"), usd("0.0018")), "+$0.0006 at gpt-4o-mini, +$0.01 at gpt-4o");
    }
}

/// Soft limits: the key's `alert_at: [0.5, 0.9]`. Past half of its $1.00, answers carry
/// `X-Budget-Warning: api_key=0.5`, and the crossing is counted once.
async fn soft_limits_warn(addr: &str) {
    assert_eq!(ask(addr, hold("sl", "t", "k", "gpt-4o", "r1", 10_000)).await.unwrap().overall_code, OK);
    let r = ask(addr, settle("sl", "t", "k", "gpt-4o", "r1", &[("output", 60_000)])).await.unwrap();
    assert_eq!(header(&r, "X-Budget-Warning"), Some("api_key=0.5"), "$0.60 of $1.00 spent");
    let r = ask(addr, hold("sl", "t", "k", "gpt-4o", "r2", 1_000)).await.unwrap();
    assert_eq!((r.overall_code, header(&r, "X-Budget-Warning")), (OK, Some("api_key=0.5")), "while above it");
    let r = ask(addr, hold("sl", "t2", "k", "gpt-4o", "r3", 1_000)).await.unwrap();
    assert_eq!(header(&r, "X-Budget-Warning"), None, "another key is below its limits");
}

async fn scenarios(addr: &str, levels: &mut Levels) {
    hold_and_settle(addr, levels).await;
    unknown_model(addr).await;
    all_or_nothing(addr, levels).await;
    reused_request_ids(addr, levels).await;
    malformed_requests(addr, levels).await;
    holds_and_counts_are_bounded(addr, levels).await;
    soft_limits_warn(addr).await;
}

/// A replica on a standalone Redis, its config in a directory a test rewrites to reload it.
struct Reloadable {
    redis: Redis,
    dir: tempfile::TempDir,
    server: Tollgate,
    levels: Levels,
}

impl Reloadable {
    fn start(text: &str) -> Reloadable {
        let redis = Redis::start();
        let dir = tempfile::tempdir().unwrap();
        let path = write_config(dir.path(), text);
        let server = Tollgate::start(&path, &Backend::Redis(redis.url()), &[]);
        let levels = Levels::Redis(redis.connection());
        Reloadable { redis, dir, server, levels }
    }
}

fn write_config(dir: &Path, text: &str) -> std::path::PathBuf {
    let path = dir.join("llm.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread")]
async fn embedded_memory_store() {
    let (_dir, path) = config_file(&config("2026-12-01", "10.00", "10m", "charge"));
    let server = Tollgate::start(&path, &Backend::Memory, &[]);
    scenarios(&server.addr(), &mut Levels::Memory).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn standalone_redis() {
    let redis = Redis::start();
    let (_dir, path) = config_file(&config("2026-12-01", "10.00", "10m", "charge"));
    let server = Tollgate::start(&path, &Backend::Redis(redis.url()), &[]);
    scenarios(&server.addr(), &mut Levels::Redis(redis.connection())).await;
    // What a request's record costs Redis (it lives hold_ttl + 1 h after its last op), open and
    // settled: the sizing figure of the book.
    let mut con = redis.connection();
    assert_eq!(
        ask(&server.addr(), hold("sz", "t", "k", "gpt-4o", "0123456789abcdef0123456789abcdef", 1_000))
            .await
            .unwrap()
            .overall_code,
        OK
    );
    let record = "rl:{sz}:llm:hold:0123456789abcdef0123456789abcdef";
    let open: u64 =
        redis::cmd("MEMORY").arg("USAGE").arg(record).arg("SAMPLES").arg(0).query(&mut con).unwrap();
    ask(
        &server.addr(),
        settle(
            "sz",
            "t",
            "k",
            "gpt-4o",
            "0123456789abcdef0123456789abcdef",
            &[("input", 900), ("output", 800)],
        ),
    )
    .await
    .unwrap();
    let settled: u64 =
        redis::cmd("MEMORY").arg("USAGE").arg(record).arg("SAMPLES").arg(0).query(&mut con).unwrap();
    println!(
        "a budget record with a 32-character request id: {open} bytes open, {settled} settled (MEMORY USAGE)"
    );
    assert!(open < 1_500 && settled < 1_500, "{open} {settled}");
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_cluster() {
    let cluster = RedisCluster::start();
    let (_dir, path) = config_file(&config("2026-12-01", "10.00", "10m", "charge"));
    let server = Tollgate::start(&path, &Backend::Cluster(cluster.seeds()), &[]);
    scenarios(&server.addr(), &mut Levels::Cluster(Box::new(cluster.connection()))).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_behind_sentinel() {
    let group = SentinelGroup::start();
    let (_dir, path) = config_file(&config("2026-12-01", "10.00", "10m", "charge"));
    let sentinel = ["--redis-sentinel", &group.addrs(), "--redis-sentinel-master", SENTINEL_MASTER];
    let server = Tollgate::start(&path, &Backend::Memory, &sentinel);
    scenarios(&server.addr(), &mut Levels::Redis(group.primary.connection())).await;
}

/// A hold nobody settles: after `hold_ttl` it is charged in full (or released), and a settlement
/// that comes later is charged only what exceeds what the expiry charged.
#[tokio::test(flavor = "multi_thread")]
async fn lost_settlements_are_charged_or_released() {
    let redis = Redis::start();
    for (lost, org) in [("charge", "lc"), ("release", "lr")] {
        let (_dir, path) = config_file(&config("2026-12-01", "10.00", "1s", lost));
        let server = Tollgate::start(&path, &Backend::Redis(redis.url()), &[]);
        let mut levels = Levels::Redis(redis.connection());
        let addr = server.addr();
        // $0.01 held, never settled in time.
        assert_eq!(ask(&addr, hold(org, "t", "k", "gpt-4o", "r1", 1_000)).await.unwrap().overall_code, OK);
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        // Another request's hold sweeps the expired one out of the key's level.
        assert_eq!(ask(&addr, hold(org, "t", "k", "gpt-4o", "r2", 0)).await.unwrap().overall_code, OK);
        let expired = if lost == "charge" { usd("0.01") } else { Money::ZERO };
        let key = levels.read(&format!("org={org}:team=t:api_key=k"), &day()).unwrap();
        assert_eq!(key, (expired, usd("0.01")), "{lost}: the expired hold; r2's is still held");
        let outcome = if lost == "charge" { "charged" } else { "released" };
        let counted =
            sample(&server.metrics(), "tollgate_budget_holds_expired_total", &[("outcome", outcome)]);
        assert_eq!(counted, 1.0, "{lost}: one expired hold counted, once for its three levels");
        let open = sample(&server.metrics(), "tollgate_budget_holds_open", &[("domain", "llm")]);
        assert_eq!(open, 1.0, "{lost}: r1 opened and found expired, r2 open");
        let records = sample(&server.metrics(), "tollgate_budget_records", &[("domain", "llm")]);
        assert_eq!(records, 2.0, "{lost}: r1's and r2's records are kept for their life");
        // r1's usage comes late: $0.012. Charged in full after a release, only $0.002 more after
        // the expiry charged $0.01.
        ask(&addr, settle(org, "t", "k", "gpt-4o", "r1", &[("output", 1_200)])).await.unwrap();
        let key = levels.read(&format!("org={org}:team=t:api_key=k"), &day()).unwrap();
        assert_eq!(key, (usd("0.012"), usd("0.01")), "{lost}: the late settlement makes the spend exact");
        let org_level = levels.read(&format!("org={org}"), &month()).unwrap();
        assert_eq!(org_level, (usd("0.012"), usd("0.01")), "{lost}: every level alike");
    }
}

/// A reload to a new price version while a hold is open: the hold settles at its own version's
/// prices, a hold made after the reload at the new ones.
#[tokio::test(flavor = "multi_thread")]
async fn holds_settle_at_the_price_version_they_were_held_at() {
    let Reloadable { redis: _redis, dir, server, mut levels } =
        Reloadable::start(&config("v1", "10.00", "10m", "charge"));
    let addr = server.addr();
    assert_eq!(ask(&addr, hold("pv", "t", "k", "gpt-4o", "old", 1_000)).await.unwrap().overall_code, OK);
    // v2 doubles the output price.
    write_config(dir.path(), &config("v2", "20.00", "10m", "charge"));
    let reloaded = || sample(&server.metrics(), "tollgate_config_reloads_total", &[("result", "success")]);
    wait_until("the price reload", 200, Duration::from_millis(50), || reloaded() >= 1.0);
    assert_eq!(ask(&addr, hold("pv", "t", "k", "gpt-4o", "new", 1_000)).await.unwrap().overall_code, OK);
    let key = levels.read("org=pv:team=t:api_key=k", &day()).unwrap();
    assert_eq!(key, (Money::ZERO, usd("0.03")), "$0.01 held at v1, $0.02 at v2");
    ask(&addr, settle("pv", "t", "k", "gpt-4o", "old", &[("output", 1_000)])).await.unwrap();
    ask(&addr, settle("pv", "t", "k", "gpt-4o", "new", &[("output", 1_000)])).await.unwrap();
    let key = levels.read("org=pv:team=t:api_key=k", &day()).unwrap();
    assert_eq!(key, (usd("0.03"), Money::ZERO), "1,000 output tokens at $10/M (v1) and at $20/M (v2)");
}

/// `per: minute` in Asia/Kolkata (UTC+5:30): the spend of one minute is gone in the next.
#[tokio::test(flavor = "multi_thread")]
async fn a_minute_budget_resets_at_the_boundary() {
    let redis = Redis::start();
    let text = config("2026-12-01", "10.00", "10m", "charge").replace(
        "budget: {amount: 1.00, per: day, alert_at: [0.5, 0.9]}",
        "budget: {amount: 0.015, per: minute, timezone: Asia/Kolkata}",
    );
    let (_dir, path) = config_file(&text);
    let server = Tollgate::start(&path, &Backend::Redis(redis.url()), &[]);
    let addr = server.addr();
    let minute = Calendar::new(Per::Minute, "Asia/Kolkata").unwrap();
    // Not at the very end of a minute, so that the two requests share it.
    let now_ms =
        || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let end = minute.window(now_ms()).end_ms;
    if end - now_ms() < 3_000 {
        tokio::time::sleep(Duration::from_millis((end - now_ms()) as u64 + 50)).await;
    }
    assert_eq!(ask(&addr, hold("mn", "t", "k", "gpt-4o", "r1", 1_000)).await.unwrap().overall_code, OK);
    let r = ask(&addr, hold("mn", "t", "k", "gpt-4o", "r2", 1_000)).await.unwrap();
    assert_eq!(code_and(&r, "X-Budget-Exhausted"), (OVER_LIMIT, Some("api_key".into())), "$0.02 > $0.015");
    let retry: i64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    let left = (minute.window(now_ms()).end_ms - now_ms()).div_euclid(1000);
    assert!((left..=left + 1).contains(&retry), "Retry-After {retry} s, the minute ends in {left} s");
    tokio::time::sleep(Duration::from_millis((minute.window(now_ms()).end_ms - now_ms()) as u64 + 50)).await;
    assert_eq!(ask(&addr, hold("mn", "t", "k", "gpt-4o", "r3", 1_000)).await.unwrap().overall_code, OK);
}

/// Replies lost or late between tollgate and Redis: nothing held or charged twice, nothing left
/// held for a request that was denied.
#[tokio::test(flavor = "multi_thread")]
async fn lost_replies_are_repaired_exactly_once() {
    let redis = Redis::start();
    let proxy = FaultProxy::start(redis.port);
    let text = config("2026-12-01", "10.00", "10m", "charge")
        .replace("domain: llm\n", "domain: llm\nfailure_mode: deny\n");
    let (_dir, path) = config_file(&text);
    let backend = Backend::Redis(format!("redis://127.0.0.1:{}", proxy.port));
    let server = Tollgate::start(&path, &backend, &["--redis-timeout", "100ms"]);
    let addr = server.addr();
    let mut levels = Levels::Redis(redis.connection());
    let mut direct = redis.connection();
    let key = "org=fx:team=t:api_key=k";
    let open = |con: &mut redis::Connection, id: &str| -> Option<String> {
        redis::cmd("HGET").arg(format!("rl:{{fx}}:llm:hold:{id}")).arg("o").query(con).unwrap()
    };

    for (fault, id) in
        [(Fault::DropReplies, "lost"), (Fault::DelayReplies(Duration::from_millis(300)), "late")]
    {
        proxy.set(fault);
        let r = ask(&addr, hold("fx", "t", "k", "gpt-4o", id, 1_000)).await.unwrap();
        assert_eq!(r.overall_code, OVER_LIMIT, "{fault:?}: failure_mode deny");
        assert_eq!(header(&r, "X-Tollgate-Failure-Mode"), Some("deny"));
        proxy.set(Fault::Pass);
        wait_until("the cancel", 100, Duration::from_millis(50), || {
            open(&mut direct, id).as_deref() == Some("0")
        });
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(
            levels.read(key, &day()),
            Some((Money::ZERO, Money::ZERO)),
            "{fault:?}: the denied request holds nothing"
        );
    }

    // A settlement whose reply is lost: sent again, charged once.
    assert_eq!(ask(&addr, hold("fx", "t", "k", "gpt-4o", "settled", 1_000)).await.unwrap().overall_code, OK);
    proxy.set(Fault::DropReplies);
    let _ = ask(&addr, settle("fx", "t", "k", "gpt-4o", "settled", &[("output", 1_200)])).await.unwrap();
    proxy.set(Fault::Pass);
    wait_until("the settlement", 100, Duration::from_millis(50), || {
        levels.read(key, &day()) == Some((usd("0.012"), Money::ZERO))
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(levels.read(key, &day()), Some((usd("0.012"), Money::ZERO)), "charged once");
    let recoveries = sample(&server.metrics(), "tollgate_budget_recoveries_total", &[("outcome", "ok")]);
    assert!(recoveries >= 3.0, "two cancels and a settlement repaired: {recoveries}");
}

/// `prices: {file: PATH}`: the file is watched like the config; a new version prices the holds made
/// after it, and a table without a version is refused while the last good one keeps serving.
#[tokio::test(flavor = "multi_thread")]
async fn a_price_file_is_watched_and_checked() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("prices")).unwrap();
    let table = |version: &str, output: &str| {
        format!(
            "version: \"{version}\"\ncurrency: USD\nmodels:\n  gpt-4o: {{input: 2.50, output: {output}}}\n"
        )
    };
    let prices_at = dir.path().join("prices/table.yaml");
    std::fs::write(&prices_at, table("f1", "10.00")).unwrap();
    let text = config("unused", "10.00", "10m", "charge");
    let start = text.find("prices:").unwrap();
    let end = text.find("descriptors:").unwrap();
    let text = format!("{}prices: {{file: prices/table.yaml}}\n{}", &text[..start], &text[end..]);
    let path = write_config(dir.path(), &text);
    let server = Tollgate::start(&path, &Backend::Redis(redis.url()), &[]);
    let mut levels = Levels::Redis(redis.connection());
    let addr = server.addr();
    let reloads =
        |result: &str| sample(&server.metrics(), "tollgate_config_reloads_total", &[("result", result)]);

    assert_eq!(ask(&addr, hold("pf", "t", "k", "gpt-4o", "a", 1_000)).await.unwrap().overall_code, OK);
    std::fs::write(&prices_at, table("f2", "20.00")).unwrap();
    wait_until("the price file's reload", 200, Duration::from_millis(50), || reloads("success") >= 1.0);
    assert_eq!(ask(&addr, hold("pf", "t", "k", "gpt-4o", "b", 1_000)).await.unwrap().overall_code, OK);
    let key = levels.read("org=pf:team=t:api_key=k", &day()).unwrap();
    assert_eq!(key, (Money::ZERO, usd("0.03")), "$0.01 held at f1, $0.02 at f2");

    std::fs::write(&prices_at, "currency: USD\nmodels:\n  gpt-4o: {input: 1, output: 1}\n").unwrap();
    wait_until("the refusal", 200, Duration::from_millis(50), || reloads("failure") >= 1.0);
    assert!(server.log().contains("needs its `version`"), "the log says why");
    assert_eq!(ask(&addr, hold("pf", "t", "k", "gpt-4o", "c", 1_000)).await.unwrap().overall_code, OK);
    let key = levels.read("org=pf:team=t:api_key=k", &day()).unwrap();
    assert_eq!(key, (Money::ZERO, usd("0.05")), "f2 still prices: $0.02 more");
}

/// `tollgate explain` on a priced domain: the model's prices and version, what the request would
/// hold, and each budget on its path with what its period spent and holds, read from Redis
/// without changing anything.
#[tokio::test(flavor = "multi_thread")]
async fn explain_shows_prices_the_hold_and_every_budget() {
    let redis = Redis::start();
    let (_dir, path) = config_file(&config("2026-12-01", "10.00", "10m", "charge"));
    let server = Tollgate::start(&path, &Backend::Redis(redis.url()), &[]);
    assert_eq!(
        ask(&server.addr(), hold("ex", "t", "k", "gpt-4o", "r1", 1_000)).await.unwrap().overall_code,
        OK
    );
    let explain = |model: &str| {
        let out = std::process::Command::new(tollgate_bin())
            .args(["explain", "--config", path.to_str().unwrap(), "--domain", "llm", "--hits", "2000"])
            .args(["--descriptor", &format!("org=ex,team=t,api_key=k,model={model},request_id=r2")])
            .args(["--redis-url", &redis.url()])
            .env("RUST_LOG", "off")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let text = explain("gpt-4o");
    for expected in [
        "gpt-4o at version 2026-12-01 (USD per 1,000,000 tokens: input 2.500000000, cached_input 1.250000000, cache_write 2.500000000, output 10.000000000)",
        "holds:    0.020000000 USD and 2000 tokens for 2000 output tokens",
        "record:   rl:{ex}:llm:hold:r2",
        "org: 1000.000000000 USD a period",
        "api_key: 1.000000000 USD a period",
        "spent 0.000000000, held 0.010000000, left 0.990000000",
        "bucket:   rl:{ex}:llm:org=ex:team=t:api_key=k   capacity 200000, refill 2000/s",
    ] {
        assert!(text.contains(expected), "{expected}: {text}");
    }
    assert!(explain("gpt-9").contains("has no price"));
    let mut levels = Levels::Redis(redis.connection());
    assert_eq!(
        levels.read("org=ex:team=t:api_key=k", &day()),
        Some((Money::ZERO, usd("0.01"))),
        "explain takes nothing"
    );
}

/// The stated overshoot bound, met with equality: 50 requests in flight at once, each holding
/// $0.02 of the key's $1.00 and then using $0.05, overspend by exactly the sum of (settled cost -
/// hold) over them; the next request is denied. A reload that lowers the key's amount keeps what
/// was spent.
#[tokio::test(flavor = "multi_thread")]
async fn the_overshoot_is_bounded_by_what_in_flight_requests_exceed_their_holds() {
    // A bucket large enough for the 250,000 tokens used: only money limits here.
    let roomy = |text: String| text.replace("capacity: 200000", "capacity: 2000000");
    let Reloadable { redis: _redis, dir, server, mut levels } =
        Reloadable::start(&roomy(config("2026-12-01", "10.00", "10m", "charge")));
    let addr = server.addr();
    let holds: Vec<_> = (0..50)
        .map(|i| {
            let addr = addr.clone();
            tokio::spawn(async move {
                ask(&addr, hold("ov", "t", "k", "gpt-4o", &format!("r{i}"), 2_000)).await.unwrap()
            })
        })
        .collect();
    for h in holds {
        assert_eq!(h.await.unwrap().overall_code, OK, "50 holds of $0.02 fit in $1.00");
    }
    assert_eq!(ask(&addr, hold("ov", "t", "k", "gpt-4o", "late", 1)).await.unwrap().overall_code, OVER_LIMIT);
    for i in 0..50 {
        ask(&addr, settle("ov", "t", "k", "gpt-4o", &format!("r{i}"), &[("output", 5_000)])).await.unwrap();
    }
    let key = levels.read("org=ov:team=t:api_key=k", &day()).unwrap();
    assert_eq!(key, (usd("2.50"), Money::ZERO), "$1.00 + 50 x ($0.05 - $0.02): the bound, exactly");
    let r = ask(&addr, hold("ov", "t", "k", "gpt-4o", "after", 1)).await.unwrap();
    // The team ($2.00 a month) was overspent with the key: the topmost exhausted level is named.
    assert_eq!(code_and(&r, "X-Budget-Exhausted"), (OVER_LIMIT, Some("team".into())));
    assert_eq!(header(&r, "X-Budget-Remaining"), Some("0.000000000 USD"), "never negative");

    // The key's amount raised to $3.00 and the team's to $10.00: the $2.50 spent stays.
    let raised = roomy(config("2026-12-01", "10.00", "10m", "charge"))
        .replace("amount: 1.00, per: day", "amount: 3.00, per: day")
        .replace("amount: 2.00, per: month", "amount: 10.00, per: month");
    write_config(dir.path(), &raised);
    let reloaded = || sample(&server.metrics(), "tollgate_config_reloads_total", &[("result", "success")]);
    wait_until("the reload", 200, Duration::from_millis(50), || reloaded() >= 1.0);
    let r = ask(&addr, hold("ov", "t", "k", "gpt-4o", "raised", 1)).await.unwrap();
    assert_eq!(r.overall_code, OK);
    assert_eq!(
        header(&r, "X-Budget-Remaining"),
        Some("0.499990000 USD"),
        "$3.00 - $2.50 spent - the new $0.00001 hold"
    );
}

/// A reload that drops a model while one of its holds is open: the settlement is priced at the
/// row the hold's record keeps, not refused; a settlement for the dropped model without a hold
/// charges nothing. A count above the model's maximum is counted and the money metric does not
/// wrap.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_model_settles_at_its_records_row() {
    let Reloadable { redis: _redis, dir, server, mut levels } =
        Reloadable::start(&config("v1", "10.00", "10m", "charge"));
    let addr = server.addr();
    // 1,000 output tokens of claude-sonnet at $15/M, and 4,000 reserved input tokens at the
    // dearest input price (cache writes, $3.75/M): $0.03 held.
    let r = ask(&addr, hold("dm", "t", "k", "claude-sonnet", "open", 1_000)).await.unwrap();
    assert_eq!((r.overall_code, header(&r, "X-Budget-Remaining")), (OK, Some("0.970000000 USD")));
    let dropped = config("v2", "10.00", "10m", "charge").replace(
        "    claude-sonnet: {input: 3.00, cached_input: 0.30, cache_write: 3.75, output: 15.00, reserve_input_tokens: 4000}\n",
        "",
    );
    assert!(!dropped.contains("claude-sonnet"));
    write_config(dir.path(), &dropped);
    let reloaded = || sample(&server.metrics(), "tollgate_config_reloads_total", &[("result", "success")]);
    wait_until("the reload", 200, Duration::from_millis(50), || reloaded() >= 1.0);
    let r = ask(&addr, hold("dm", "t", "k", "claude-sonnet", "late", 1_000)).await.unwrap();
    assert_eq!(code_and(&r, "X-Budget-Exhausted"), (OVER_LIMIT, Some("model".into())), "no new holds");
    // 2,000 output tokens at the record's $15/M: $0.03.
    ask(&addr, settle("dm", "t", "k", "claude-sonnet", "open", &[("output", 2_000)])).await.unwrap();
    ask(&addr, settle("dm", "t", "k", "claude-sonnet", "never-held", &[("output", 2_000)])).await.unwrap();
    let key = levels.read("org=dm:team=t:api_key=k", &day()).unwrap();
    assert_eq!(key, (usd("0.03"), Money::ZERO), "settled at v1's row, the unheld one charged nothing");

    // 2^64-1 tokens of gpt-4o without a table maximum: charged as 10^12 tokens ($10,000,000).
    assert_eq!(ask(&addr, hold("dm", "t", "k", "gpt-4o", "big", 1)).await.unwrap().overall_code, OK);
    ask(&addr, settle("dm", "t", "k", "gpt-4o", "big", &[("output", u64::MAX)])).await.unwrap();
    let org = levels.read("org=dm", &month()).unwrap();
    assert_eq!(org, (usd("10000000.03"), Money::ZERO));
    let metrics = server.metrics();
    assert_eq!(sample(&metrics, "tollgate_budget_usage_capped_total", &[("kind", "output")]), 1.0);
    let spent = sample(&metrics, "tollgate_budget_spend_nanos_total", &[("version", "v2")]);
    assert!(spent >= 1e16, "the spend metric reads what was charged, never wrapped: {spent}");
}

/// A priced domain's failure mode is `deny` unless its file says otherwise: with Redis's replies
/// lost, a hold is answered OVER_LIMIT and nothing is held once the cancel lands.
#[tokio::test(flavor = "multi_thread")]
async fn priced_domains_fail_closed_by_default() {
    let redis = Redis::start();
    let proxy = FaultProxy::start(redis.port);
    let (_dir, path) = config_file(&config("2026-12-01", "10.00", "10m", "charge"));
    let backend = Backend::Redis(format!("redis://127.0.0.1:{}", proxy.port));
    let server = Tollgate::start(&path, &backend, &["--redis-timeout", "100ms"]);
    let mut levels = Levels::Redis(redis.connection());
    proxy.set(Fault::DropReplies);
    let r = ask(&server.addr(), hold("fc", "t", "k", "gpt-4o", "r1", 1_000)).await.unwrap();
    assert_eq!(r.overall_code, OVER_LIMIT);
    assert_eq!(header(&r, "X-Tollgate-Failure-Mode"), Some("deny"));
    proxy.set(Fault::Pass);
    wait_until("the cancel", 100, Duration::from_millis(50), || {
        sample(&server.metrics(), "tollgate_budget_recoveries_total", &[("outcome", "ok")]) >= 1.0
    });
    assert_eq!(levels.read("org=fc:team=t:api_key=k", &day()), Some((Money::ZERO, Money::ZERO)));
}

fn tollgate_cli(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(tollgate_bin()).args(args).env("RUST_LOG", "off").output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Budget overrides from a real PostgreSQL, beside tenant quotas: `tollgate budget set` gives
/// one key $0.015 a day instead of the file's $1.00, in force within the cache TTL; `get` and
/// `list` show it; `delete` gives the file's budget back.
#[tokio::test(flavor = "multi_thread")]
async fn budget_overrides_from_postgres() {
    let pg = Postgres::start();
    let url = pg.url();
    let (ok, out) = tollgate_cli(&["quota", "migrate", "--quota-store", &url]);
    assert!(ok, "{out}");
    let budget = |args: &[&str]| {
        let mut all = vec!["budget"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--quota-store", &url]);
        tollgate_cli(&all)
    };
    let level = "org=po,team=t,api_key=k";
    let (ok, out) = budget(&["set", "--domain", "llm", "--level", level, "--amount", "0.015"]);
    assert!(ok && out.contains("llm org=po:team=t:api_key=k: 0.015 a period (the file's)"), "{out}");
    let (ok, out) = budget(&["set", "--domain", "llm", "--level", "org=po", "--amount", "lots"]);
    assert!(!ok && out.contains("not a decimal amount"), "{out}");
    let (_, out) = budget(&["get", "--domain", "llm", "--level", level]);
    assert!(out.contains("0.015"), "{out}");
    let (_, out) = budget(&["list"]);
    assert!(out.lines().count() == 1 && out.contains("org=po:team=t:api_key=k"), "{out}");

    let redis = Redis::start();
    let (_dir, path) = config_file(&config("2026-12-01", "10.00", "10m", "charge"));
    // Checked against the servers' rules: a domain or level with no budget is refused, unless
    // forced.
    let rules = path.to_str().unwrap();
    let (ok, out) = budget(&["set", "--domain", "lm", "--level", level, "--amount", "1", "--config", rules]);
    assert!(!ok && out.contains("no domain 'lm'") && out.contains("--force"), "{out}");
    let typo = "org=po,taem=t";
    let (ok, out) = budget(&["set", "--domain", "llm", "--level", typo, "--amount", "1", "--config", rules]);
    assert!(!ok && out.contains("no level org=po,taem=t in domain 'llm'"), "{out}");
    let (ok, out) =
        budget(&["set", "--domain", "llm", "--level", level, "--amount", "0.015", "--config", rules]);
    assert!(ok && !out.contains("note:"), "{out}");
    let forced = ["set", "--domain", "llm", "--level", typo, "--amount", "1", "--config", rules, "--force"];
    let (ok, out) = budget(&forced);
    assert!(ok && out.contains("stored anyway (--force)"), "{out}");
    let (ok, _) = budget(&["delete", "--domain", "llm", "--level", typo]);
    assert!(ok);
    let server = Tollgate::start(
        &path,
        &Backend::Redis(redis.url()),
        &["--quota-store", &url, "--quota-cache-ttl", "1s"],
    );
    let addr = server.addr();
    // $0.01 of the overridden $0.015: the next $0.01 hold does not fit.
    let r = ask(&addr, hold("po", "t", "k", "gpt-4o", "r1", 1_000)).await.unwrap();
    assert_eq!((r.overall_code, header(&r, "X-Budget-Remaining")), (OK, Some("0.005000000 USD")));
    let r = ask(&addr, hold("po", "t", "k", "gpt-4o", "r2", 1_000)).await.unwrap();
    assert_eq!(code_and(&r, "X-Budget-Exhausted"), (OVER_LIMIT, Some("api_key".into())));
    // Another key keeps the file's $1.00.
    let r = ask(&addr, hold("po", "t", "k2", "gpt-4o", "r3", 1_000)).await.unwrap();
    assert_eq!(header(&r, "X-Budget-Remaining"), Some("0.990000000 USD"));
    // Deleted: the file's $1.00 again once the cached row is stale (TTL plus one query).
    let (ok, out) = budget(&["delete", "--domain", "llm", "--level", level]);
    assert!(ok && out.contains("deleted 1 row(s)"), "{out}");
    let mut id = 0;
    wait_until("the file's budget back", 100, Duration::from_millis(100), || {
        id += 1;
        let r = futures::executor::block_on(ask(&addr, hold("po", "t", "k", "gpt-4o", &format!("w{id}"), 1)));
        r.is_ok_and(|r| {
            r.overall_code == OK && header(&r, "X-Budget-Remaining").is_some_and(|h| h.starts_with("0.98"))
        })
    });
}

/// Three replicas on one Redis: a soft limit crossed by settlements sent to different replicas
/// is counted once across them, `GET /budgets` on any replica reads the same standing, and every
/// budget series exists at 0 from startup.
#[tokio::test(flavor = "multi_thread")]
async fn budgets_standing_and_alerts_across_three_replicas() {
    let redis = Redis::start();
    let (_dir, path) = config_file(&config("2026-12-01", "10.00", "10m", "charge"));
    let replicas: Vec<Tollgate> =
        (0..3).map(|_| Tollgate::start(&path, &Backend::Redis(redis.url()), &[])).collect();
    let at_zero = replicas[0].metrics();
    for (name, _, _) in
        tollgate::telemetry::METRICS.iter().filter(|(n, _, _)| n.starts_with("tollgate_budget_"))
    {
        if !tollgate::telemetry::LABELLED_BY_TRAFFIC.contains(name) {
            assert!(
                at_zero.samples.iter().any(|s| s.metric == *name && s.labels.get("domain") == Some("llm")),
                "{name} is exported from startup for the priced domain"
            );
        }
    }
    for (name, labels) in [
        ("tollgate_budget_refusals_total", vec![("reason", "path_mismatch")]),
        ("tollgate_budget_holds_total", vec![("verdict", "reused")]),
        ("tollgate_budget_alerts_total", vec![("level", "api_key"), ("threshold", "0.5")]),
        ("tollgate_budget_denials_total", vec![("level", "team")]),
        ("tollgate_budget_spend_nanos_total", vec![("version", "2026-12-01")]),
        ("tollgate_budget_holds_open", vec![("domain", "llm")]),
    ] {
        assert!(
            at_zero
                .samples
                .iter()
                .any(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v))),
            "{name} {labels:?} exported at 0 from startup"
        );
    }
    // Ten requests of $0.10 each on key k, held and settled on replicas in turn: the key crosses
    // 0.5 at the fifth and 0.9 at the ninth.
    for i in 0..10 {
        let replica = &replicas[i % 3];
        let id = format!("r{i}");
        assert_eq!(
            ask(&replica.addr(), hold("al", "t", "k", "gpt-4o", &id, 10_000)).await.unwrap().overall_code,
            OK
        );
        let settle_on = &replicas[(i + 1) % 3];
        ask(&settle_on.addr(), settle("al", "t", "k", "gpt-4o", &id, &[("output", 10_000)])).await.unwrap();
    }
    let crossed = |threshold: &str| -> f64 {
        replicas
            .iter()
            .map(|r| {
                sample(
                    &r.metrics(),
                    "tollgate_budget_alerts_total",
                    &[("level", "api_key"), ("threshold", threshold)],
                )
            })
            .sum()
    };
    assert_eq!(
        (crossed("0.5"), crossed("0.9")),
        (1.0, 1.0),
        "each crossing counted once across the replicas"
    );
    let logged: usize = replicas.iter().map(|r| r.log().matches("budget alert").count()).sum();
    assert_eq!(logged, 2, "and logged once");
    let r = ask(&replicas[2].addr(), hold("al", "t", "k", "gpt-4o", "last", 1)).await.unwrap();
    assert_eq!(
        code_and(&r, "X-Budget-Warning"),
        (OVER_LIMIT, Some("api_key=0.9".into())),
        "spent: nothing fits"
    );

    // The standing, read on each replica, in any order of the levels.
    let mut standings = Vec::new();
    for replica in &replicas {
        let (status, body) =
            http_get(replica.http, "/budgets?domain=llm&team=t&org=al&api_key=k").expect("/budgets answers");
        assert_eq!(status, 200, "{body}");
        standings.push(serde_json::from_str::<serde_json::Value>(&body).unwrap());
    }
    assert!(standings.iter().all(|s| *s == standings[0]), "{standings:?}");
    let key = &standings[0]["levels"][2];
    assert_eq!(standings[0]["currency"], "USD");
    assert_eq!(
        (
            key["level"].as_str(),
            key["amount"].as_str(),
            key["spent"].as_str(),
            key["held"].as_str(),
            key["left"].as_str()
        ),
        (Some("api_key"), Some("1.000000000"), Some("1.000000000"), Some("0.000000000"), Some("0.000000000"))
    );
    let start = key["period_start"].as_str().unwrap();
    assert!(start.ends_with("T00:00:00Z"), "a UTC day begins at midnight: {start}");
    assert_eq!(standings[0]["levels"][0]["spent"], "1.000000000", "the org spent the same");
    let (status, body) = http_get(replicas[0].http, "/budgets?domain=llm&api_key=k").unwrap();
    assert_eq!(status, 400, "not a path from the top: {body}");
    assert!(body.contains("next, one of org"), "says what to give: {body}");
    let (status, body) = http_get(replicas[0].http, "/budgets?domain=llm").unwrap();
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("as KEY=VALUE: next, one of org"), "says what to give, not \"placed: []\": {body}");
    let (status, _) = http_get(replicas[0].http, "/budgets?domain=nope&org=al").unwrap();
    assert_eq!(status, 400);
}
