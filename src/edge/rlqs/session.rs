//! One Rate Limit Quota stream: one Envoy, in one task.
//!
//! The task owns the stream's state, reads the Envoy's usage reports, receives the pool's
//! events, and writes every assignment, so nothing about a stream is shared. For each bucket id
//! the Envoy reports, it keeps what the id stands for ([`RlqsBucket`]: a leased bucket, a bucket no
//! limit applies to (ALLOW_ALL), or none (the domain's `rlqs_unknown`)) and the Envoy's demand,
//! from the reports ([`Demand`]), which sizes its part of this replica's lease.
//!
//! A leased bucket's assignment is a refilling token bucket (the pool's
//! [`LocalBucket`](super::assign::LocalBucket)), living
//! [`ASSIGNMENT_TTL`] and sent again whenever the lease is set (renewed or resized): an identical
//! one is carried over by Envoy, a changed one rebuilt at its fill ratio, so an assignment never
//! hands the Envoy tokens the lease did not take. Static assignments (ALLOW_ALL, DENY_ALL) are
//! renewed with every report, since Envoy falls back to its no-assignment behavior when an
//! assignment expires.
//!
//! The pool's events of one store call arrive as one batch; the batches waiting go out together,
//! in as few responses as fit (see [`super::answer`]). A report naming thousands of new buckets
//! is booked in chunks, the pool's events answered between them. A bucket no report counts a
//! request for during the abandon period gets `abandon_action` and leaves the stream's state. A
//! report the protocol does not allow ends the stream with a status that says why: over the
//! message size limit (RESOURCE_EXHAUSTED), a usage without a bucket id (INVALID_ARGUMENT), no
//! domain in the first report (INVALID_ARGUMENT).
//!
//! A bucket id beyond the stream's or the replica's cap ([`RlqsLimits`]) is not tracked: it gets
//! no assignment, so Envoy applies its `no_assignment_behavior`; each is counted
//! (`tollgate_rlqs_buckets_refused_total{reason}`) and the stream logs the first.
//!
//! The stream ends when the Envoy closes it, its connection drops, it leaves its answers unread
//! past the deadline ([`super::unread`]) or the server drains; then its buckets leave the pool. Nothing needs settling: what the Envoy may still admit under its
//! cached assignments is inside this replica's lease, which outlives them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use futures::StreamExt as _;
use indexmap::IndexMap;
use tokio::sync::{mpsc, watch};
use tonic::{Status, Streaming};

use super::answer::{abandon, blanket, bundle, local_bucket};
use super::assign::Demand;
use super::gather::gather;
use super::pool::{Event, Events, MemberId, Pool};
use super::unread::{send_all, Answers};
use super::RlqsLimits;
use crate::clock::Clock;
use crate::config::{Blanket, FailureMode};
use crate::limiter::{LeasedBucket, Limiter, RlqsBucket, ASSIGNMENT_TTL};

/// How long a failure-mode assignment stands: a few ticks, so that the next lease replaces it.
pub const FAILURE_TTL: Duration = Duration::from_secs(3);
/// How long a static assignment stands: renewed by every report (every 5 s from Envoy 1.40).
pub const STATIC_TTL: Duration = Duration::from_secs(15);

/// What one stream needs from the server.
pub struct Context {
    /// The decision core.
    pub limiter: Arc<Limiter>,
    /// This replica's leases.
    pub pool: Arc<Pool>,
    /// Time for reports and abandonment.
    pub clock: Arc<dyn Clock>,
    /// Abandonment and the bucket caps.
    pub limits: RlqsLimits,
    /// Set when the server drains.
    pub closing: watch::Receiver<bool>,
}

struct Bucket {
    id: BucketId,
    // The number of the last pool event applied (see `Events`).
    seq: u64,
    kind: RlqsBucket,
    demand: Demand,
    last_report_ms: u64,
    // When a report last counted a request for it (or it was first reported).
    last_used_ms: u64,
}

/// Who is at the other end of a stream, for logs.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The Envoy's name; empty when it has none.
    pub name: String,
}

/// How many buckets a report names for the first time are resolved at once (rule, tenant quota):
/// together, not one after another, and without flooding the store.
const FIRST_REPORT_CONCURRENCY: usize = 64;
/// Most usages booked at once (see `run`): the first of 10,000 new buckets are leased while the
/// rest are still being resolved.
const BOOK_CHUNK: usize = 1024;

// A usage of a report: its bucket's name, its id, and what it says.
type Usage = (String, BucketId, BucketQuotaUsage);

/// Runs the stream `id` with `peer` until it ends.
pub async fn run(
    context: Context,
    id: u64,
    peer: Peer,
    mut reports: Streaming<RateLimitQuotaUsageReports>,
    answers: Answers,
    open: super::peers::Open,
) {
    let Context { limiter, pool, clock, limits, mut closing } = context;
    let closed = async move {
        let _ = closing.wait_for(|c| *c).await;
    };
    tokio::pin!(closed);
    let (events_tx, mut events) = mpsc::channel::<Events>(EVENTS_QUEUE);
    let mut session = Session {
        limiter: &limiter,
        pool: &pool,
        clock: clock.as_ref(),
        id,
        peer: &peer,
        events: events_tx,
        abandon_after_ms: limits.abandon_after.as_millis().try_into().unwrap_or(u64::MAX),
        limits,
        tracked: &open,
        domain: None,
        buckets: HashMap::new(),
        recently_abandoned: HashMap::new(),
        unknown_domain_logged: false,
        refusal_logged: false,
    };
    metrics::gauge!("tollgate_rlqs_streams").increment(1.0);
    // A message read while gathering reports that is not one (the end, an error): next.
    let mut pending: Option<Result<Option<RateLimitQuotaUsageReports>, Status>> = None;
    // Usages accepted and not booked yet, in chunks of BOOK_CHUNK: a first report of thousands of
    // new buckets is booked a chunk at a time, so that a chunk's leases are set while the next is
    // resolved, and the pool's events are answered between chunks. No report is read meanwhile.
    let mut backlog: VecDeque<Vec<Usage>> = VecDeque::new();
    loop {
        if !backlog.is_empty() {
            let responses = match events.try_recv() {
                Ok(batch) => answer(&mut session, batch, &mut events),
                Err(_) => bundle(session.book(backlog.pop_front().unwrap_or_default()).await),
            };
            if !send_all(&answers, responses).await {
                break;
            }
            continue;
        }
        let next = async {
            match pending.take() {
                Some(message) => message,
                None => reports.message().await,
            }
        };
        let responses = tokio::select! {
            report = next => match report {
                Ok(Some(mut report)) => {
                    pending = gather(&mut reports, &mut report);
                    match session.accept(report) {
                        Ok(usages) => {
                            let mut usages = usages.into_iter().peekable();
                            while usages.peek().is_some() {
                                backlog.push_back(usages.by_ref().take(BOOK_CHUNK).collect());
                            }
                            Vec::new()
                        }
                        Err(status) => {
                            let _ = answers.send(Err(status)).await;
                            break;
                        }
                    }
                }
                Ok(None) => break,
                Err(status) => {
                    // tonic refuses a message over its decoding limit with OUT_OF_RANGE.
                    if status.code() == tonic::Code::OutOfRange {
                        metrics::counter!("tollgate_rlqs_stream_errors_total", "reason" => "too_large").increment(1);
                        tracing::warn!(envoy = %peer.name, error = %status.message(), "an RLQS usage report over the size limit; ending its stream");
                        let message = format!("usage report too large: {}", status.message());
                        let _ = answers.send(Err(Status::resource_exhausted(message))).await;
                    }
                    break;
                }
            },
            Some(batch) = events.recv() => answer(&mut session, batch, &mut events),
            () = &mut closed => break,
        };
        if !send_all(&answers, responses).await {
            break;
        }
    }
    for (name, bucket) in &session.buckets {
        if let RlqsBucket::Leased(LeasedBucket { key, .. }) = &bucket.kind {
            pool.leave(key, &(id, name.clone()));
        }
    }
    open.untrack(session.buckets.len());
    drop(events);
    metrics::gauge!("tollgate_rlqs_streams").decrement(1.0);
}

// The pool's `batch` of events, and every batch already waiting with it, as responses: in as few
// messages as fit.
fn answer(
    session: &mut Session<'_>,
    mut batch: Events,
    events: &mut mpsc::Receiver<Events>,
) -> Vec<RateLimitQuotaResponse> {
    while let Ok(more) = events.try_recv() {
        batch.extend(more);
    }
    bundle(session.events(batch))
}

/// How long after an abandon_action a report of the bucket without requests is taken as sent
/// before the Envoy had it: two reporting intervals.
const STALE_REPORT_MS: u64 = 10_000;
/// Batches waiting for a stream, at most (each store call's events are one, and a round of
/// 10,000 first leases is 40 calls); the pool waits a while for room, then drops the batch.
const EVENTS_QUEUE: usize = 64;

// One stream's state, owned by its task.
struct Session<'a> {
    limiter: &'a Limiter,
    pool: &'a Arc<Pool>,
    clock: &'a dyn Clock,
    id: u64,
    peer: &'a Peer,
    events: mpsc::Sender<Events>,
    abandon_after_ms: u64,
    limits: RlqsLimits,
    // This stream's place among the peer's and the replica's, and its bucket ids there.
    tracked: &'a super::peers::Open,
    domain: Option<String>,
    buckets: HashMap<String, Bucket>,
    // Buckets abandoned within the last STALE_REPORT_MS, and when.
    recently_abandoned: HashMap<String, u64>,
    unknown_domain_logged: bool,
    refusal_logged: bool,
}

impl Session<'_> {
    // A usage report: its usages to book, or the status that ends the stream.
    fn accept(&mut self, report: RateLimitQuotaUsageReports) -> Result<Vec<Usage>, Status> {
        metrics::counter!("tollgate_rlqs_reports_total").increment(1);
        if self.domain.is_none() && !report.domain.is_empty() {
            self.domain = Some(report.domain.clone());
        }
        let Some(domain) = self.domain.clone() else {
            return Err(Status::invalid_argument("the first report must name the domain"));
        };
        if report.bucket_quota_usages.iter().any(|u| u.bucket_id.is_none()) {
            metrics::counter!("tollgate_rlqs_stream_errors_total", "reason" => "no_bucket_id").increment(1);
            return Err(Status::invalid_argument("a bucket_quota_usage without a bucket_id"));
        }
        let now = self.clock.now_ms();
        self.recently_abandoned.retain(|_, at| now.saturating_sub(*at) < STALE_REPORT_MS);
        // One lookup, not a walk over every bucket the stream leases.
        if self.limiter.rules().domain(&domain).is_none() {
            metrics::counter!("tollgate_rlqs_unknown_domain_reports_total").increment(1);
            if !self.unknown_domain_logged {
                self.unknown_domain_logged = true;
                tracing::warn!(domain = %domain, envoy = %self.peer.name, "an RLQS stream reports for a domain that is not loaded; its buckets are allowed, as RLS allows that domain");
            }
        }
        Ok(report
            .bucket_quota_usages
            .into_iter()
            .filter_map(|mut u| {
                let id = u.bucket_id.take()?;
                Some((name(&id), id, u))
            })
            .filter(|(name, _, u)| !self.stale(name, u))
            .collect())
    }

    // Books `usages` of the last report: the buckets they name for the first time are resolved
    // together, then every usage is booked. Answers the static assignments they call for.
    async fn book(&mut self, usages: Vec<Usage>) -> Vec<BucketAction> {
        let Some(domain) = self.domain.clone() else { return Vec::new() };
        self.resolve_fresh(&domain, &usages).await;
        let now = self.clock.now_ms();
        let mut actions = Vec::new();
        let mut fresh = Vec::new();
        let mut abandoned = Vec::new();
        for (name, _, usage) in usages {
            let Some(bucket) = self.buckets.get_mut(&name) else { continue };
            let known = bucket.last_report_ms > 0;
            bucket.last_report_ms = now;
            let elapsed = elapsed_ms(&usage);
            let requests = usage.num_requests_allowed.saturating_add(usage.num_requests_denied);
            if requests > 0 || !known {
                bucket.last_used_ms = now;
            }
            if now.saturating_sub(bucket.last_used_ms) >= self.abandon_after_ms {
                actions.push(abandon(&bucket.id));
                abandoned.push(name);
                continue;
            }
            bucket.demand.report(requests, elapsed);
            metrics::counter!("tollgate_rlqs_allowed_requests_total").increment(usage.num_requests_allowed);
            match &bucket.kind {
                RlqsBucket::Leased(target) => {
                    let member: MemberId = (self.id, name.clone());
                    if self.pool.report(&member, target, bucket.demand.rate(), &self.events) {
                        fresh.push((target.key.clone(), member));
                    }
                }
                RlqsBucket::Unlimited(_) => actions.push(blanket(&bucket.id, Blanket::AllowAll, STATIC_TTL)),
                RlqsBucket::Unknown(d) => {
                    metrics::counter!("tollgate_rlqs_unknown_buckets_total").increment(1);
                    // As the RLS path answers a domain it does not serve: OK for everything.
                    let answer = d.as_ref().map_or(Blanket::AllowAll, |d| d.rlqs_unknown);
                    actions.push(blanket(&bucket.id, answer, STATIC_TTL));
                }
            }
        }
        for name in abandoned {
            self.abandon(&name);
        }
        // The Envoy refuses these buckets' requests until it has an assignment.
        self.pool.lease_now(fresh);
        actions
    }

    // The buckets of `usages` this stream has not seen yet: what each stands for. Resolved
    // concurrently.
    async fn resolve_fresh(&mut self, domain: &str, usages: &[Usage]) {
        // A set, not a scan of the list so far: a first report names thousands of buckets.
        let mut seen: HashSet<&str> = HashSet::new();
        let mut fresh: Vec<(String, BucketId)> = Vec::new();
        for (name, id, _) in usages {
            if !self.buckets.contains_key(name) && seen.insert(name) {
                if self.buckets.len() + fresh.len() >= self.limits.max_buckets_per_stream {
                    self.refuse("stream_limit");
                } else if let Err(reason) = self.tracked.track(&self.limits) {
                    self.refuse(reason);
                } else {
                    fresh.push((name.clone(), id.clone()));
                }
            }
        }
        let limiter = self.limiter;
        let resolved: Vec<(String, Bucket)> = futures::stream::iter(fresh)
            .map(|(name, id)| async move {
                let kind = limiter.rlqs_bucket(domain, &id.bucket).await;
                // Until a report says otherwise, the Envoy may want all of it.
                let guess = match &kind {
                    RlqsBucket::Leased(t) => t.spec.refill_per_second() / t.cost as f64,
                    _ => 0.0,
                };
                let bucket = Bucket {
                    id,
                    kind,
                    seq: 0,
                    demand: Demand::unknown(guess),
                    last_report_ms: 0,
                    last_used_ms: 0,
                };
                (name, bucket)
            })
            .buffer_unordered(FIRST_REPORT_CONCURRENCY)
            .collect()
            .await;
        self.buckets.extend(resolved);
    }

    // Whether `usage` of the bucket `name` is a report the Envoy sent before it had this stream's
    // abandon_action: no request since (an Envoy that dropped the bucket reports it again only
    // with the request that starts it afresh). Taken for a new bucket, it would be leased for an
    // Envoy that drops every assignment for it.
    fn stale(&self, name: &str, usage: &BucketQuotaUsage) -> bool {
        !self.buckets.contains_key(name)
            && self.recently_abandoned.contains_key(name)
            && usage.num_requests_allowed == 0
            && usage.num_requests_denied == 0
    }

    // A bucket id beyond a cap (`stream_limit`, `peer_limit`, `replica_limit`): not tracked, no
    // assignment;
    // counted, and the stream's first logged.
    fn refuse(&mut self, reason: &'static str) {
        metrics::counter!("tollgate_rlqs_buckets_refused_total", "reason" => reason).increment(1);
        if !self.refusal_logged {
            self.refusal_logged = true;
            tracing::warn!(envoy = %self.peer.name, reason, max_buckets_per_stream = self.limits.max_buckets_per_stream, max_buckets = self.limits.max_buckets, "an RLQS stream names more bucket ids than tollgate tracks: those beyond get no assignment (Envoy applies its no_assignment_behavior)");
        }
    }

    // Drops the bucket `name`, which its Envoy was told to abandon: it leaves the pool. A request
    // for it later starts it afresh.
    fn abandon(&mut self, name: &str) {
        let Some(bucket) = self.buckets.remove(name) else { return };
        self.tracked.untrack(1);
        self.recently_abandoned.insert(name.to_owned(), self.clock.now_ms());
        metrics::counter!("tollgate_rlqs_abandoned_buckets_total").increment(1);
        if let RlqsBucket::Leased(target) = &bucket.kind {
            self.pool.leave(&target.key, &(self.id, name.to_owned()));
        }
    }

    // What the pool said, as assignments: the latest event per bucket, so that no response
    // carries two assignments for one bucket.
    fn events(&mut self, events: Events) -> Vec<BucketAction> {
        let mut latest: IndexMap<String, (u64, Event)> = IndexMap::new();
        for (seq, event) in events {
            let bucket = match &event {
                Event::Assign { bucket, .. } | Event::StoreFailed { bucket, .. } => bucket.clone(),
            };
            let applied = self.buckets.get(&bucket).map(|b| b.seq);
            let newer = latest.get(&bucket).is_none_or(|(s, _)| seq > *s);
            if applied.is_some_and(|applied| seq > applied) && newer {
                latest.insert(bucket, (seq, event));
            }
        }
        for (bucket, (seq, _)) in &latest {
            if let Some(b) = self.buckets.get_mut(bucket) {
                b.seq = *seq;
            }
        }
        latest.into_values().filter_map(|(_, event)| self.event(event)).flatten().collect()
    }

    // What the pool said about one bucket, as assignments: a fresh local bucket is DENY_ALL and
    // the token bucket in one response, which Envoy starts full.
    fn event(&self, event: Event) -> Option<Vec<BucketAction>> {
        match event {
            Event::Assign { bucket, assignment, fresh } => {
                let b = self.buckets.get(&bucket)?;
                Some(match assignment {
                    Some(assignment) if fresh => {
                        vec![
                            blanket(&b.id, Blanket::DenyAll, ASSIGNMENT_TTL),
                            local_bucket(&b.id, assignment),
                        ]
                    }
                    Some(assignment) => vec![local_bucket(&b.id, assignment)],
                    None => vec![blanket(&b.id, Blanket::DenyAll, ASSIGNMENT_TTL)],
                })
            }
            Event::StoreFailed { bucket, mode } => match (self.buckets.get(&bucket), mode) {
                (Some(b), FailureMode::Allow) => Some(vec![blanket(&b.id, Blanket::AllowAll, FAILURE_TTL)]),
                (Some(b), FailureMode::Deny) => Some(vec![blanket(&b.id, Blanket::DenyAll, FAILURE_TTL)]),
                // `error`: no new assignment; Envoy's own expiry behavior applies.
                _ => None,
            },
        }
    }
}

// A usage's `time_elapsed` in milliseconds.
fn elapsed_ms(usage: &BucketQuotaUsage) -> u64 {
    usage.time_elapsed.as_ref().map_or(0, |d| {
        (d.seconds.max(0) as u64).saturating_mul(1000).saturating_add((d.nanos.max(0) as u64) / 1_000_000)
    })
}

// A bucket id as a stable name that no other id shares ([`identity::bucket_id_name`]).
fn name(id: &BucketId) -> String {
    crate::identity::bucket_id_name(id.bucket.iter().map(|(k, v)| (k.as_str(), v.as_str())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_id_is_named_by_its_sorted_entries() {
        assert_eq!(
            name(&BucketId { bucket: HashMap::from([("b".into(), "2".into()), ("a".into(), "1".into())]) }),
            "a=1:b=2"
        );
        let crafted = BucketId { bucket: HashMap::from([("route".into(), "search,tenant=X".into())]) };
        let real = BucketId {
            bucket: HashMap::from([("route".into(), "search".into()), ("tenant".into(), "X".into())]),
        };
        assert_ne!(name(&crafted), name(&real));
    }
}
