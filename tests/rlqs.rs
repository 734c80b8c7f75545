//! The Rate Limit Quota Service edge, spoken to by a gRPC client as Envoy would: bucket ids map
//! to rules as descriptors do, grants are taken from the same Redis buckets the RLS path uses
//! (one budget whatever the protocol), unknown buckets get the domain's `rlqs_unknown`, and a
//! draining server closes its streams. Through real Envoys in `tests/rlqs_envoy.rs`.

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
        let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}")).await.unwrap();
        let (reports, rx) = mpsc::channel(16);
        let answers = client.stream_rate_limit_quotas(ReceiverStream::new(rx)).await.unwrap().into_inner();
        Stream { reports, answers }
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
