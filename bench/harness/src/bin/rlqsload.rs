//! A neutral Rate Limit Quota client for tollgate's RLQS scale benchmark: it stands in for a fleet
//! of Envoys, one stream per tollgate replica, each reporting the same `--buckets` bucket ids
//! (`{tenant: q<i>}`), and enforces what it is assigned as Envoy 1.40 does.
//!
//! Per stream: a first report naming every bucket (one denied request each, as Envoy reports a
//! new bucket's first request), then a report every 5 s. `--hot` of the buckets want `--demand`
//! requests per second each (per stream) and admit what their assignment allows, in 100 ms steps;
//! the others stay idle (usage 0). An assignment is applied as Envoy applies it: DENY_ALL then a
//! token bucket in one response starts a fresh, full bucket; an identical token bucket is carried
//! over; a changed one is rebuilt at the old fill ratio; an assignment expires after its TTL.
//!
//! It measures what the targets are stated in: the time from the first report to each
//! bucket's first assignment, failure-mode assignments (ALLOW_ALL: the bench domain fails open
//! and has no unlimited rule), buckets that were ever left without a live assignment, each hot
//! bucket's admitted requests (over all streams, for the whole run of T s) against its bound
//! `capacity + rate × (T + 1)`, and Redis's own work over the measured window after the warm-up
//! (`INFO commandstats`, so the commands a script runs count too, and `INFO cpu`). Prints one
//! line of `key=value` results.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use hdrhistogram::Histogram;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tollgate_bench::{percentile, redis_work, seconds};

/// The run's flags.
#[derive(Parser)]
struct Args {
    /// The tollgate replicas' gRPC addresses, one stream each.
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1:8081")]
    addrs: Vec<String>,
    /// One address, or a Cluster's primaries comma-separated: their work is summed.
    #[arg(long, default_value = "127.0.0.1:6379")]
    redis: String,
    #[arg(long, default_value = "rlqs")]
    domain: String,
    #[arg(long, default_value_t = 1000)]
    buckets: usize,
    /// Buckets asked for (the first ones); the rest are idle.
    #[arg(long, default_value_t = 0)]
    hot: usize,
    /// Requests a second each hot bucket wants, per stream.
    #[arg(long, default_value_t = 30.0)]
    demand: f64,
    /// The bucket's capacity and rate, as the config states them (for the bound).
    #[arg(long, default_value_t = 50.0)]
    capacity: f64,
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Seconds measured.
    #[arg(long, default_value = "30", value_parser = seconds)]
    duration: Duration,
    /// Seconds before the measurement.
    #[arg(long, default_value = "10", value_parser = seconds)]
    warmup: Duration,
}

/// What one Envoy holds for one bucket.
#[derive(Debug, Clone, Default)]
struct Local {
    /// When the first assignment arrived, in ms since the start.
    first_ms: Option<u64>,
    /// When the live assignment expires; 0: none yet.
    expires_ms: u64,
    /// Whether the live assignment is ALLOW_ALL.
    allow_all: bool,
    /// The token bucket: max tokens, tokens per ms, tokens now, when last refilled.
    max: f64,
    per_ms: f64,
    tokens: f64,
    last_ms: u64,
    /// Since the last report.
    allowed: u64,
    denied: u64,
    /// Since the start.
    admitted: u64,
    /// Whether a live assignment was ever missing after the first one.
    lapsed: bool,
}

impl Local {
    fn refill(&mut self, now: u64) {
        self.tokens = (self.tokens + (now.saturating_sub(self.last_ms)) as f64 * self.per_ms).min(self.max);
        self.last_ms = now;
    }

    fn live(&self, now: u64) -> bool {
        now < self.expires_ms
    }

    /// Admits up to `want` requests now; returns how many.
    fn admit(&mut self, now: u64, want: u64) -> u64 {
        if !self.live(now) {
            return 0;
        }
        if self.allow_all {
            return want;
        }
        self.refill(now);
        let n = (self.tokens.floor() as u64).min(want);
        self.tokens -= n as f64;
        n
    }
}

#[derive(Default)]
struct Totals {
    failure_assignments: u64,
    messages: u64,
}

fn ms_of(d: &Option<ProtoDuration>) -> u64 {
    d.as_ref().map_or(0, |d| d.seconds.max(0) as u64 * 1000 + d.nanos.max(0) as u64 / 1_000_000)
}

/// Applies one response to the stream's buckets, as Envoy 1.40 does.
fn apply(response: &RateLimitQuotaResponse, now: u64, locals: &mut [Local], totals: &mut Totals) {
    totals.messages += 1;
    let mut denied_first: Vec<usize> = Vec::new();
    for action in &response.bucket_action {
        let Some(index) = action
            .bucket_id
            .as_ref()
            .and_then(|id| id.bucket.get("tenant"))
            .and_then(|t| t.strip_prefix('q'))
            .and_then(|i| i.parse::<usize>().ok())
            .filter(|i| *i < locals.len())
        else {
            continue;
        };
        let local = &mut locals[index];
        let Some(Action::QuotaAssignmentAction(q)) = &action.bucket_action else {
            // abandon_action: Envoy drops the bucket.
            *local = Local { first_ms: local.first_ms, admitted: local.admitted, ..Local::default() };
            continue;
        };
        local.first_ms.get_or_insert(now);
        local.expires_ms = now + ms_of(&q.assignment_time_to_live);
        match q.rate_limit_strategy.as_ref().and_then(|s| s.strategy.as_ref()) {
            Some(Strategy::BlanketRule(r)) if *r == BlanketRule::AllowAll as i32 => {
                totals.failure_assignments += 1;
                local.allow_all = true;
            }
            Some(Strategy::BlanketRule(_)) => {
                local.allow_all = false;
                local.max = 0.0;
                local.tokens = 0.0;
                local.per_ms = 0.0;
                denied_first.push(index);
            }
            Some(Strategy::TokenBucket(b)) => {
                let max = b.max_tokens as f64;
                let fill_s = b.fill_interval.as_ref().map_or(1, |d| d.seconds.max(1)) as f64;
                let per_ms = b.tokens_per_fill.as_ref().map_or(1, |v| v.value) as f64 / fill_s / 1000.0;
                local.refill(now);
                if denied_first.contains(&index) {
                    local.tokens = max;
                } else if local.max != max || local.per_ms != per_ms {
                    local.tokens = if local.max > 0.0 { local.tokens / local.max * max } else { max };
                }
                local.allow_all = false;
                local.max = max;
                local.per_ms = per_ms;
                local.last_ms = now;
            }
            _ => {}
        }
    }
}

fn usages(locals: &mut [Local], elapsed_ms: u64) -> Vec<BucketQuotaUsage> {
    locals
        .iter_mut()
        .enumerate()
        .map(|(i, l)| {
            let usage = BucketQuotaUsage {
                bucket_id: Some(BucketId { bucket: HashMap::from([("tenant".to_owned(), format!("q{i}"))]) }),
                time_elapsed: Some(ProtoDuration {
                    seconds: (elapsed_ms / 1000) as i64,
                    nanos: ((elapsed_ms % 1000) * 1_000_000) as i32,
                }),
                num_requests_allowed: l.allowed,
                num_requests_denied: l.denied,
            };
            l.allowed = 0;
            l.denied = 0;
            usage
        })
        .collect()
}

/// One stream: returns when its first report was sent (ms since the start) and its buckets' state
/// at the end.
async fn stream(
    args: Arc<Args>,
    addr: String,
    start: Instant,
    totals: Arc<Mutex<Totals>>,
) -> (u64, Vec<Local>) {
    let now_ms = || start.elapsed().as_millis() as u64;
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(64 << 20);
    let (reports, rx) = mpsc::channel(4);
    let mut answers = client
        .stream_rate_limit_quotas(tonic::Request::new(ReceiverStream::new(rx)))
        .await
        .unwrap()
        .into_inner();
    let mut locals = vec![Local::default(); args.buckets];
    for l in &mut locals {
        l.denied = 1;
    }
    let first = usages(&mut locals, 0);
    let sent_ms = now_ms();
    reports
        .send(RateLimitQuotaUsageReports { domain: args.domain.clone(), bucket_quota_usages: first })
        .await
        .unwrap();
    let step = Duration::from_millis(100);
    let mut ticker = tokio::time::interval(step);
    let mut last_report = now_ms();
    let per_step = args.demand * step.as_secs_f64();
    let mut owed = vec![0.0f64; args.hot];
    let end = args.warmup + args.duration;
    loop {
        tokio::select! {
            answer = answers.message() => match answer {
                Ok(Some(response)) => {
                    let mut t = totals.lock().unwrap();
                    apply(&response, now_ms(), &mut locals, &mut t);
                }
                other => panic!("the stream to {addr} ended: {other:?}"),
            },
            _ = ticker.tick() => {
                let now = now_ms();
                if start.elapsed() >= end {
                    return (sent_ms, locals);
                }
                for (i, local) in locals.iter_mut().enumerate() {
                    if local.first_ms.is_some() && !local.live(now) {
                        local.lapsed = true;
                    }
                    if i < args.hot {
                        owed[i] += per_step;
                        let want = owed[i].floor() as u64;
                        owed[i] -= want as f64;
                        let got = local.admit(now, want);
                        local.allowed += got;
                        local.denied += want - got;
                        local.admitted += got;
                    }
                }
                if now - last_report >= 5_000 {
                    let elapsed = now - last_report;
                    last_report = now;
                    let usages = usages(&mut locals, elapsed);
                    let report = RateLimitQuotaUsageReports { domain: args.domain.clone(), bucket_quota_usages: usages };
                    if reports.send(report).await.is_err() {
                        panic!("the stream to {addr} closed");
                    }
                }
            }
        }
    }
}

#[tokio::main]
async fn main() {
    let args = Arc::new(Args::parse());
    let start = Instant::now();
    let totals = Arc::new(Mutex::new(Totals::default()));
    let streams: Vec<_> = args
        .addrs
        .iter()
        .map(|addr| tokio::spawn(stream(args.clone(), addr.clone(), start, totals.clone())))
        .collect();
    tokio::time::sleep(args.warmup).await;
    let (calls0, cpu0) = redis_work(&args.redis);
    let measured = Instant::now();
    let mut ends = Vec::new();
    for s in streams {
        ends.push(s.await.unwrap());
    }
    let window = measured.elapsed().as_secs_f64();
    let (calls1, cpu1) = redis_work(&args.redis);
    let mut first = Histogram::<u64>::new(3).unwrap();
    let (mut unassigned, mut lapsed, mut late, mut late_hot) = (0, 0, 0, 0);
    for (sent_ms, locals) in &ends {
        for (i, l) in locals.iter().enumerate() {
            // From the moment the stream's first report was sent.
            let waited = l.first_ms.map(|ms| ms.saturating_sub(*sent_ms));
            match waited {
                Some(ms) => first.record(ms).unwrap(),
                None => unassigned += 1,
            }
            // Past the 2 s to a first assignment, and whether those are hot buckets.
            if waited.is_none_or(|ms| ms > 2_000) {
                late += 1;
                late_hot += usize::from(i < args.hot);
            }
            lapsed += usize::from(l.lapsed);
        }
    }
    // Over the whole run, from the first report: the bucket starts full, as the bound allows.
    let bound = args.capacity + args.rate * (start.elapsed().as_secs_f64() + 1.0);
    let ratios: Vec<f64> = (0..args.hot)
        .map(|i| ends.iter().map(|(_, locals)| locals[i].admitted).sum::<u64>() as f64 / bound)
        .collect();
    let pairs = (args.buckets * args.addrs.len()) as f64;
    let t = totals.lock().unwrap();
    println!(
        "buckets={} streams={} first_p50_ms={} first_p99_ms={} first_max_ms={} first_over_2s={late} of_them_hot={late_hot} unassigned={} failure_assignments={} lapsed={} messages={} redis_commands_per_s={:.0} redis_commands_per_pair_per_s={:.3} redis_cpu_percent={:.1} hot={} hot_ratio_min={:.3} hot_ratio_max={:.3}",
        args.buckets,
        args.addrs.len(),
        percentile(&first, 0.5),
        percentile(&first, 0.99),
        first.max(),
        unassigned,
        t.failure_assignments,
        lapsed,
        t.messages,
        (calls1 - calls0) as f64 / window,
        (calls1 - calls0) as f64 / window / pairs,
        (cpu1 - cpu0) / window * 100.0,
        args.hot,
        if ratios.is_empty() { 0.0 } else { ratios.iter().copied().fold(f64::INFINITY, f64::min) },
        ratios.iter().copied().fold(0.0, f64::max),
    );
}
