//! The Rate Limit Quota Service edge, spoken to by a gRPC client as Envoy would: bucket ids map
//! to rules as descriptors do, grants are taken from the same Redis buckets the RLS path uses
//! (one budget whatever the protocol), unknown buckets get the domain's `rlqs_unknown`, and a
//! draining server closes its streams, whose grants the Envoy's next stream settles (on another
//! replica) when its first report provably continues them. Through real Envoys in
//! `tests/rlqs_envoy.rs`.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const CONFIG: &str = r#"
domain: quota
rlqs_unknown: deny
descriptors:
  - key: tenant
    token_bucket: {capacity: 50, refill_per_second: 10}
    descriptors:
      - key: route
        value: search
        token_bucket: {capacity: 20, refill_per_second: 0.001}
  - key: free
    rate_limit: {unlimited: true}
  - key: slow
    token_bucket: {capacity: 1, refill_per_second: 0.5}
  - key: round
    token_bucket: {capacity: 100, refill_per_second: 100}
"#;

fn bucket(entries: &[(&str, &str)]) -> BucketId {
    BucketId { bucket: entries.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect() }
}

fn key(id: &BucketId) -> BTreeMap<String, String> {
    id.bucket.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn report(id: &BucketId, allowed: u64, denied: u64, elapsed_ms: u64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(id.clone()),
        time_elapsed: Some(ProtoDuration {
            seconds: (elapsed_ms / 1000) as i64,
            nanos: ((elapsed_ms % 1000) * 1_000_000) as i32,
        }),
        num_requests_allowed: allowed,
        num_requests_denied: denied,
    }
}

/// What an assignment says, in short.
#[derive(Debug, Clone, PartialEq)]
enum Said {
    AllowAll,
    DenyAll,
    Tokens(u32),
}

fn said(response: &RateLimitQuotaResponse) -> Vec<(BTreeMap<String, String>, Said)> {
    response
        .bucket_action
        .iter()
        .filter_map(|a| {
            let Some(Action::QuotaAssignmentAction(q)) = &a.bucket_action else { return None };
            let said = match q.rate_limit_strategy.as_ref()?.strategy.as_ref()? {
                Strategy::BlanketRule(r) if *r == BlanketRule::AllowAll as i32 => Said::AllowAll,
                Strategy::BlanketRule(_) => Said::DenyAll,
                Strategy::TokenBucket(b) => Said::Tokens(b.max_tokens),
                Strategy::RequestsPerTimeUnit(_) => return None,
            };
            Some((key(a.bucket_id.as_ref()?), said))
        })
        .collect()
}

/// A stream to a tollgate, as one Envoy.
struct Stream {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: tonic::Streaming<RateLimitQuotaResponse>,
}

impl Stream {
    async fn open(addr: &str) -> Stream {
        Self::open_as(addr, None).await
    }

    /// A stream whose Envoy names itself `name` in the stream's metadata.
    async fn open_as(addr: &str, name: Option<&str>) -> Stream {
        let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}")).await.unwrap();
        let (reports, rx) = mpsc::channel(16);
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        if let Some(name) = name {
            request.metadata_mut().insert("x-tollgate-envoy", name.parse().unwrap());
        }
        let answers = client.stream_rate_limit_quotas(request).await.unwrap().into_inner();
        Stream { reports, answers }
    }

    /// Closes the Envoy's side and reads every answer the server still sends until it ends the
    /// stream: the requests of every token bucket among them.
    async fn close(self) -> u64 {
        let Stream { reports, mut answers } = self;
        drop(reports);
        let mut granted = 0;
        loop {
            match tokio::time::timeout(Duration::from_secs(5), answers.message()).await {
                Ok(Ok(Some(answer))) => granted += tokens(&said(&answer)),
                Ok(_) => return granted,
                Err(_) => panic!("the stream stayed open 5 s after the Envoy closed its side"),
            }
        }
    }

    async fn send(&self, domain: &str, usages: Vec<BucketQuotaUsage>) {
        self.reports
            .send(RateLimitQuotaUsageReports { domain: domain.into(), bucket_quota_usages: usages })
            .await
            .unwrap();
    }

    async fn next(&mut self) -> Vec<(BTreeMap<String, String>, Said)> {
        let answer = tokio::time::timeout(Duration::from_secs(5), self.answers.message()).await;
        said(&answer.expect("an answer within 5 s").expect("the stream stands").expect("a message"))
    }
}

/// Requests in the token buckets of `said`.
fn tokens(said: &[(BTreeMap<String, String>, Said)]) -> u64 {
    said.iter().map(|(_, s)| if let Said::Tokens(n) = s { u64::from(*n) } else { 0 }).sum()
}

/// The grant (or denial) for `id`, skipping other buckets' messages.
async fn grant_for(stream: &mut Stream, id: &BucketId) -> Said {
    loop {
        for (bucket, said) in stream.next().await.into_iter().rev() {
            if bucket == key(id) {
                return said;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bucket_ids_map_to_rules_and_spend_the_rls_budget() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    let mut stream = Stream::open(&server.addr()).await;

    // A new bucket, reported at once (Envoy denied its first request): a grant at once, taken
    // from the bucket the RLS descriptor tenant=t1 uses.
    let t1 = bucket(&[("tenant", "t1")]);
    let start = Instant::now();
    stream.send("quota", vec![report(&t1, 0, 1, 0)]).await;
    let first = grant_for(&mut stream, &t1).await;
    let waited = start.elapsed();
    let Said::Tokens(granted) = first else { panic!("a token bucket, got {first:?}") };
    println!("first grant: {granted} requests after {waited:?}");
    assert!(granted > 0 && granted <= 50);
    let r = ask(&server.addr(), req("quota", &["tenant=t1"], 1)).await.unwrap();
    assert!(r.statuses[0].limit_remaining <= 50 - granted, "RLS sees what RLQS took: {:?}", r.statuses[0]);

    // Entries in tree order whatever the map's order; a deeper rule; no rule; left-over entries.
    let search = bucket(&[("route", "search"), ("tenant", "t1")]);
    let free = bucket(&[("free", "x")]);
    let nowhere = bucket(&[("tenant", "t1"), ("route", "other")]);
    let extra = bucket(&[("tenant", "t1"), ("colour", "red")]);
    stream
        .send(
            "",
            vec![
                report(&search, 0, 1, 0),
                report(&free, 0, 1, 0),
                report(&nowhere, 0, 1, 0),
                report(&extra, 0, 1, 0),
            ],
        )
        .await;
    let mut seen: HashMap<BTreeMap<String, String>, Said> = HashMap::new();
    while seen.len() < 4 {
        for (b, s) in stream.next().await {
            seen.insert(b, s);
        }
    }
    println!("answers: {seen:?}");
    assert!(matches!(seen[&key(&search)], Said::Tokens(n) if n <= 20), "the deeper rule's bucket: {seen:?}");
    assert_eq!(seen[&key(&free)], Said::AllowAll, "unlimited");
    assert_eq!(seen[&key(&nowhere)], Said::DenyAll, "no rule: rlqs_unknown deny");
    assert_eq!(seen[&key(&extra)], Said::DenyAll, "left-over entries: rlqs_unknown deny");

    // Grants keep coming every second, pushed without a report.
    let again = grant_for(&mut stream, &t1).await;
    assert!(matches!(again, Said::Tokens(_) | Said::DenyAll), "{again:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn draining_closes_open_streams() {
    let (_dir, config) = config_file(CONFIG);
    let mut server = Tollgate::start(&config, &Backend::Memory, &["--drain-delay", "1s"]);
    let mut stream = Stream::open(&server.addr()).await;
    let t = bucket(&[("tenant", "drain")]);
    stream.send("quota", vec![report(&t, 0, 1, 0)]).await;
    assert!(matches!(grant_for(&mut stream, &t).await, Said::Tokens(_)));
    let signalled = Instant::now();
    server.proc.signal("TERM");
    // Grants go on through the drain delay; then the stream is closed by the server.
    let closed = loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.answers.message()).await {
            Ok(Ok(Some(_))) => continue,
            Ok(_) => break signalled.elapsed(),
            Err(_) => panic!("the stream stayed open 5 s past a message"),
        }
    };
    let status = server.proc.wait_exit(Duration::from_secs(5)).expect("tollgate exits");
    let exited = signalled.elapsed();
    println!("SIGTERM with an RLQS stream open (drain delay 1 s): stream closed after {closed:?}, exit {status} after {exited:?}");
    assert!(status.success());
    assert!(closed >= Duration::from_secs(1) && closed < Duration::from_secs(2), "closed after {closed:?}");
    assert!(exited < Duration::from_secs(3), "the drain finished {exited:?} after the signal");
}

/// One Envoy's stream to replica A closes after it used 5 of a 20-request grant (the whole
/// bucket); the Envoy reopens to replica B. Returns B's token grants and the bucket's balance
/// after B's stream closed too.
async fn reopen(second_name: &str, first_elapsed_ms: u64) -> (u64, f64) {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let a = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    let b = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    let search = bucket(&[("tenant", "parked"), ("route", "search")]);

    let mut first = Stream::open_as(&a.addr(), Some("envoy-1")).await;
    first.send("quota", vec![report(&search, 0, 1, 0)]).await;
    assert_eq!(grant_for(&mut first, &search).await, Said::Tokens(20), "the whole bucket (capacity 20)");
    // A's next grants find the bucket empty: DENY_ALL. The Envoy used 5 before that, unreported.
    assert_eq!(grant_for(&mut first, &search).await, Said::DenyAll);
    let from_a = first.close().await;
    assert_eq!(from_a, 0);

    let mut second = Stream::open_as(&b.addr(), Some(second_name)).await;
    second.send("quota", vec![report(&search, 5, 0, first_elapsed_ms)]).await;
    let mut from_b = tokens(&second.next().await);
    // A report once the Envoy has B's first grant settles what A granted.
    tokio::time::sleep(Duration::from_millis(2 * tollgate::edge::rlqs::session::SETTLE_MARGIN_MS)).await;
    second.send("quota", vec![report(&search, 0, 0, 1_000)]).await;
    // B's grants from then on come out of what was given back, if anything was.
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(2) {
        from_b += tokens(&second.next().await);
    }
    from_b += second.close().await;
    let mut con = redis.connection();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*parked*route=search").query(&mut con).unwrap();
    let key = keys.iter().find(|k| !k.contains(":=rlqs")).expect("the bucket's key").clone();
    // A grant in flight when B's stream closed is given back by the pool a moment later.
    let mut balance = stored_tokens(&mut con, &key);
    let settled = Instant::now();
    while settled.elapsed() < Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        balance = stored_tokens(&mut con, &key);
    }
    println!("reopened as {second_name} with time_elapsed {first_elapsed_ms} ms: B granted {from_b}, balance {balance:.3}");
    (from_b, balance)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_closed_streams_grants_settle_on_the_envoys_next_stream() {
    // The Envoy's first report on B counts the 5 it used since its last report to A: the 15 left
    // of A's grant go back to the bucket (refill 0.001/s adds < 0.02 during the test).
    let (from_b, balance) = reopen("envoy-1", 3_000).await;
    assert!(
        (balance + from_b as f64 - 15.0).abs() < 0.05,
        "20 - 5 used = balance {balance} + B's grants {from_b}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn parked_grants_stay_taken_unless_the_next_stream_provably_continues() {
    // Another Envoy's stream, and the first report of a restarted Envoy (a new bucket, counted
    // from zero: under a second), settle nothing: A's 20 stay taken.
    for (name, elapsed) in [("envoy-2", 3_000), ("envoy-1", 0)] {
        let (from_b, balance) = reopen(name, elapsed).await;
        assert_eq!(from_b, 0, "nothing to grant from");
        assert!(balance < 0.05, "A's grant stays taken: balance {balance}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn parked_leases_are_claimed_once_and_never_when_shared_in_every_store() {
    use tollgate::store::{LeaseNote, Parked, RedisStore, RedisTarget, RedisTls};
    let redis = Redis::start();
    let cluster = RedisCluster::start();
    let connect =
        |target| RedisStore::connect(&target, Duration::from_secs(2), Duration::ZERO, &RedisTls::default());
    let memory = tollgate::store::MemoryStore::new();
    let standalone = connect(RedisTarget::Standalone(redis.url())).unwrap();
    let seeds = cluster.seeds().split(',').map(String::from).collect();
    let clustered = connect(RedisTarget::Cluster(seeds)).unwrap();
    let stores: [&dyn tollgate::store::Store; 3] = [&memory, &standalone, &clustered];
    let key = "rl:{t}:d:k=v";
    let lease = Parked { requests: 7, since_report_ms: 1_000 };
    for store in stores {
        let note = |envoy: &'static str, stream: &'static str, note: LeaseNote, ttl_ms: u64| {
            store.note_lease(key, envoy, stream, note, ttl_ms)
        };
        let which = store.describe();
        // One Envoy: its stream closes, its next stream claims what it parked, once.
        note("name=a", "r1#1", LeaseNote::Seen, 10_000).await.unwrap();
        note("name=a", "r1#1", LeaseNote::Park(lease), 10_000).await.unwrap();
        let claimed = note("name=a", "r2#1", LeaseNote::Claim, 10_000).await.unwrap().expect("parked");
        assert_eq!(claimed.requests, 7, "{which}");
        assert!((1_000..1_500).contains(&claimed.since_report_ms), "{which}: {claimed:?}");
        assert_eq!(note("name=a", "r2#2", LeaseNote::Claim, 10_000).await.unwrap(), None, "{which}: once");
        // Two Envoys behind one address, both alive: one's parked grants are nobody's to claim.
        note("ip=10.0.0.1", "r1#2", LeaseNote::Seen, 10_000).await.unwrap();
        note("ip=10.0.0.1", "r2#3", LeaseNote::Seen, 10_000).await.unwrap();
        note("ip=10.0.0.1", "r1#2", LeaseNote::Park(lease), 10_000).await.unwrap();
        assert_eq!(
            note("ip=10.0.0.1", "r2#4", LeaseNote::Claim, 10_000).await.unwrap(),
            None,
            "{which}: shared"
        );
        // Two streams parked under one name.
        note("name=b", "r1#3", LeaseNote::Park(lease), 10_000).await.unwrap();
        note("name=b", "r2#5", LeaseNote::Park(lease), 10_000).await.unwrap();
        assert_eq!(note("name=b", "r1#4", LeaseNote::Claim, 10_000).await.unwrap(), None, "{which}: twice");
        // Expired.
        note("name=c", "r1#5", LeaseNote::Park(lease), 1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(note("name=c", "r1#6", LeaseNote::Claim, 1).await.unwrap(), None, "{which}: expired");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_empty_budget_denies_until_the_refill_is_pushed() {
    // One request's capacity, refilled every 2 s: the first grant empties the bucket, the next
    // ticks find it empty (DENY_ALL), and the tick after the refill grants again, pushed by the
    // server with no report in between.
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, &[]);
    let mut stream = Stream::open(&server.addr()).await;
    let slow = bucket(&[("slow", "s")]);
    stream.send("quota", vec![report(&slow, 0, 1, 0)]).await;
    assert_eq!(grant_for(&mut stream, &slow).await, Said::Tokens(1));
    let emptied = Instant::now();
    assert_eq!(grant_for(&mut stream, &slow).await, Said::DenyAll, "the next tick finds it empty");
    let lifted = loop {
        if grant_for(&mut stream, &slow).await == Said::Tokens(1) {
            break emptied.elapsed();
        }
        assert!(emptied.elapsed() < Duration::from_secs(5), "no grant 5 s after emptying");
    };
    println!("emptied, then granted again {lifted:?} later (refill after 2 s, a tick every 1 s)");
    assert!(lifted >= Duration::from_millis(1_900), "not before the refill: {lifted:?}");
    assert!(lifted <= Duration::from_millis(3_300), "within about a tick of the refill: {lifted:?}");
}

#[tokio::test]
async fn replicas_share_each_round_in_proportion_to_demand_whoever_leases_first() {
    use std::sync::Arc;
    use tollgate::clock::ManualClock;
    use tollgate::limiter::{Limiter, QuotaBucket};
    use tollgate::store::{MemoryStore, RedisStore, RedisTarget, RedisTls, Store};
    use tollgate::telemetry::{Telemetry, TelemetryConfig};

    let (_dir, config) = config_file(CONFIG);
    let redis = Redis::start();
    let clock = ManualClock::new(1_000_000);
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let target = RedisTarget::Standalone(redis.url());
    let remote: Arc<dyn Store> = Arc::new(
        RedisStore::connect(&target, Duration::from_secs(2), Duration::ZERO, &RedisTls::default()).unwrap(),
    );
    for (store, manual) in [(memory, true), (remote, false)] {
        let which = store.describe();
        let limiter = Limiter::new(
            Arc::new(arc_swap::ArcSwap::from_pointee(tollgate::config::RuleSet::load(&config).unwrap())),
            store,
            Arc::new(tollgate::quota::EmbeddedQuotas),
            Arc::new(Telemetry::without_exporter(TelemetryConfig::default())),
            false,
        );
        let id = HashMap::from([("round".to_string(), "r".to_string())]);
        let QuotaBucket::Lease(target) = limiter.quota_bucket("quota", &id).await else { panic!("leasable") };
        // Replica a's Envoys ask 95 requests a second, replica b's 5; a round (500 ms) later the
        // bucket is full again (100 tokens, refilling 100/s).
        let lease = |member: &'static str, demand: f64| {
            let (limiter, target) = (&limiter, &target);
            async move { limiter.lease(target, member, demand, 1_000, 0.0, 500).await.unwrap().0 }
        };
        let next_round = || async {
            match manual {
                true => clock.advance(1_000),
                false => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        };
        // The first round registers both demands.
        lease("a", 95.0).await;
        lease("b", 5.0).await;
        for first in ["a", "b"] {
            next_round().await;
            let (a, b) = if first == "a" {
                let a = lease("a", 95.0).await;
                (a, lease("b", 5.0).await)
            } else {
                let b = lease("b", 5.0).await;
                (lease("a", 95.0).await, b)
            };
            println!("{which}, {first} first: a took {a}, b took {b}");
            assert_eq!((a, b), (95, 5), "{which}, {first} first: shares of the round, not of the remainder");
        }
    }
}

/// A stream's answers: the next message, or the status that ended the stream.
async fn next_or_status(stream: &mut Stream) -> Result<RateLimitQuotaResponse, tonic::Status> {
    match tokio::time::timeout(Duration::from_secs(10), stream.answers.message()).await {
        Ok(Ok(Some(message))) => Ok(message),
        Ok(Ok(None)) => Err(tonic::Status::ok("the stream ended with OK")),
        Ok(Err(status)) => Err(status),
        Err(_) => panic!("no answer within 10 s"),
    }
}

/// One report naming 10,000 buckets: all resolved together, and every bucket's first
/// assignment arrives bundled in a handful of messages, not one message per bucket.
#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_buckets_are_answered_in_bundles() {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, &[]);
    let mut stream = Stream::open(&server.addr()).await;
    let ids: Vec<BucketId> = (0..10_000).map(|i| bucket(&[("tenant", &format!("fleet-{i}"))])).collect();
    let start = Instant::now();
    stream.send("quota", ids.iter().map(|id| report(id, 0, 1, 0)).collect()).await;
    let mut assigned: HashMap<BTreeMap<String, String>, Duration> = HashMap::new();
    let mut messages = 0;
    while assigned.len() < ids.len() {
        if start.elapsed() > Duration::from_secs(30) {
            let missing: Vec<_> = ids.iter().filter(|id| !assigned.contains_key(&key(id))).take(5).collect();
            panic!("{} of 10,000 assigned after 30 s; missing {missing:?}\n{}", assigned.len(), server.log());
        }
        let said = stream.next().await;
        messages += 1;
        for (bucket, _) in said {
            assigned.entry(bucket).or_insert_with(|| start.elapsed());
        }
    }
    let mut times: Vec<Duration> = assigned.values().copied().collect();
    times.sort();
    println!(
        "10,000 buckets in one report (embedded store): every first assignment after {:?} (p50 {:?}) in {messages} messages",
        times[times.len() - 1],
        times[times.len() / 2]
    );
    assert!(messages < 10, "bundled: {messages} messages for 10,000 buckets");
    assert!(times[times.len() - 1] < Duration::from_secs(10), "{:?}", times[times.len() - 1]);
}

/// Reports the protocol does not allow end the stream with a status that says why; counters at
/// the edge of u64 do not.
#[tokio::test(flavor = "multi_thread")]
async fn bad_reports_end_the_stream_with_a_reason() {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, &[]);

    // Counters that would overflow when added: the stream stands and still answers.
    let mut stream = Stream::open(&server.addr()).await;
    let t = bucket(&[("tenant", "huge-counts")]);
    let huge = BucketQuotaUsage {
        num_requests_allowed: u64::MAX,
        num_requests_denied: u64::MAX,
        ..report(&t, 0, 0, 5_000)
    };
    stream.send("quota", vec![huge.clone()]).await;
    stream.send("quota", vec![huge]).await;
    assert!(matches!(grant_for(&mut stream, &t).await, Said::Tokens(_) | Said::DenyAll));

    // A usage without a bucket id.
    let mut stream = Stream::open(&server.addr()).await;
    let mut orphan = report(&t, 1, 0, 1_000);
    orphan.bucket_id = None;
    stream.send("quota", vec![orphan]).await;
    let status = loop {
        if let Err(status) = next_or_status(&mut stream).await {
            break status;
        }
    };
    println!("a usage without a bucket id: {:?} {}", status.code(), status.message());
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");

    // A report over gRPC's 4 MiB limit.
    let mut stream = Stream::open(&server.addr()).await;
    let long = "x".repeat(5 << 20);
    stream.send("quota", vec![report(&bucket(&[("tenant", &long)]), 1, 0, 1_000)]).await;
    let status = loop {
        if let Err(status) = next_or_status(&mut stream).await {
            break status;
        }
    };
    println!("a 5 MiB report: {:?} {}", status.code(), status.message());
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(server.log().contains("over the size limit"), "logged:\n{}", server.log());

    // A domain that is not loaded: allowed, as RLS allows it, counted.
    let mut stream = Stream::open(&server.addr()).await;
    let elsewhere = bucket(&[("tenant", "t")]);
    stream.send("not-loaded", vec![report(&elsewhere, 1, 0, 1_000)]).await;
    assert_eq!(grant_for(&mut stream, &elsewhere).await, Said::AllowAll);
    let counted = sample(&server.metrics(), "tollgate_rlqs_unknown_domain_reports_total", &[]);
    assert!(counted >= 1.0, "counted: {counted}");
    assert_eq!(
        server.log().matches("a domain that is not loaded").count(),
        1,
        "logged once:\n{}",
        server.log()
    );
}

/// A bucket no report counts a request for during `--rlqs-abandon-after` is abandoned on the
/// stream that reports it, its state dropped (the live-bucket gauge falls); a report without
/// requests sent before the Envoy had the abandon_action does not revive it; a request for it
/// later starts it afresh.
#[tokio::test(flavor = "multi_thread")]
async fn idle_buckets_are_abandoned_and_come_back_fresh() {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, &["--rlqs-abandon-after", "2s"]);
    let mut stream = Stream::open(&server.addr()).await;
    let (idle, busy) = (bucket(&[("tenant", "idle")]), bucket(&[("tenant", "busy")]));
    stream.send("quota", vec![report(&idle, 1, 0, 0), report(&busy, 1, 0, 0)]).await;
    assert!(matches!(grant_for(&mut stream, &idle).await, Said::Tokens(_)));
    assert_eq!(sample(&server.metrics(), "tollgate_rlqs_buckets", &[]), 2.0);
    // Reports every half second: the busy bucket counts requests, the idle one none.
    let start = Instant::now();
    let abandoned = loop {
        assert!(start.elapsed() < Duration::from_secs(6), "never abandoned");
        stream.send("quota", vec![report(&idle, 0, 0, 500), report(&busy, 1, 0, 500)]).await;
        let message = next_or_status(&mut stream).await.expect("the stream stands");
        let gone = message.bucket_action.iter().find(|a| {
            matches!(a.bucket_action, Some(Action::AbandonAction(_)))
                && a.bucket_id.as_ref().map(key) == Some(key(&idle))
        });
        if gone.is_some() {
            break start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let metrics = server.metrics();
    println!("abandon after 2 s: the idle bucket abandoned {abandoned:?} after its last request");
    assert!(abandoned >= Duration::from_millis(1_500), "{abandoned:?}");
    assert_eq!(sample(&metrics, "tollgate_rlqs_abandoned_buckets_total", &[]), 1.0);
    assert_eq!(sample(&metrics, "tollgate_rlqs_buckets", &[]), 1.0, "only the busy bucket is live");
    // A report sent before the Envoy had the abandon_action (no request since) does not bring it
    // back: the Envoy would drop every assignment for it.
    // (An unlimited bucket in the same report: its ALLOW_ALL says the report was processed.)
    let marker = bucket(&[("free", "x")]);
    stream
        .send("quota", vec![report(&idle, 0, 0, 500), report(&busy, 1, 0, 500), report(&marker, 1, 0, 0)])
        .await;
    assert_eq!(grant_for(&mut stream, &marker).await, Said::AllowAll);
    assert_eq!(
        sample(&server.metrics(), "tollgate_rlqs_buckets", &[]),
        1.0,
        "a stale report revives nothing"
    );
    // A request for it again: a new bucket, a fresh grant.
    stream.send("quota", vec![report(&idle, 0, 1, 0)]).await;
    assert!(matches!(grant_for(&mut stream, &idle).await, Said::Tokens(_)));
    assert_eq!(sample(&server.metrics(), "tollgate_rlqs_buckets", &[]), 2.0);
}

/// Leases wait for the store longer than requests do: with every Redis reply 150 ms late, past the
/// 50 ms request deadline, an RLS request gets the failure mode, while a lease, which no request
/// waits on, still answers with a grant taken from the bucket (before, a burst of leases queued
/// past the request deadline into failure answers).
#[tokio::test(flavor = "multi_thread")]
async fn leases_wait_longer_than_requests_for_a_slow_store() {
    let redis = Redis::start();
    let proxy = proxy::FaultProxy::start(redis.port);
    let (_dir, config) = config_file(CONFIG);
    let backend = Backend::Redis(format!("redis://127.0.0.1:{}", proxy.port));
    let server = Tollgate::start(&config, &backend, &["--redis-timeout", "50ms"]);
    // One lease first, so that every script is loaded (a NOSCRIPT costs two more round trips).
    let mut stream = Stream::open(&server.addr()).await;
    let warm = bucket(&[("tenant", "t7")]);
    stream.send("quota", vec![report(&warm, 0, 1, 0)]).await;
    assert!(matches!(grant_for(&mut stream, &warm).await, Said::Tokens(_)));
    proxy.set(proxy::Fault::DelayReplies(Duration::from_millis(150)));
    let r = ask(&server.addr(), req("quota", &["tenant=t9"], 1)).await.unwrap();
    let failure_mode = r.response_headers_to_add.iter().any(|h| h.key == "X-Tollgate-Failure-Mode");
    assert!(failure_mode, "the request's deadline passed: {r:?}");
    let t = bucket(&[("tenant", "t8")]);
    let start = Instant::now();
    stream.send("quota", vec![report(&t, 0, 1, 0)]).await;
    // Every assignment for it until a grant: never the failure mode's ALLOW_ALL. (A grant of 0,
    // DENY_ALL, may come first when the next second's lease of the bucket overlaps the first.)
    let mut said = Vec::new();
    while !matches!(said.last(), Some(Said::Tokens(n)) if *n > 0) {
        assert!(start.elapsed() < Duration::from_secs(5), "no grant: {said:?}");
        said.push(grant_for(&mut stream, &t).await);
    }
    println!("a lease through replies 150 ms late: {said:?} after {:?}", start.elapsed());
    assert!(!said.contains(&Said::AllowAll), "never the failure mode: {said:?}\n{}", server.log());
    let tokens = stored_tokens(&mut redis.connection(), "rl:{t8}:quota:tenant=t8");
    assert!(tokens < 50.0, "the grant was taken from the bucket: {tokens}");
}
