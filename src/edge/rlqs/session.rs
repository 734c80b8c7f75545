//! One Rate Limit Quota stream: one Envoy, in one task.
//!
//! The task owns the stream's state, reads the Envoy's usage reports, receives the pool's grants,
//! and writes every assignment, so nothing about a stream is shared. For each bucket id the Envoy
//! reports, it keeps:
//!
//! * what the id stands for ([`QuotaBucket`]): a leased bucket, a bucket no limit applies to
//!   (ALLOW_ALL), or none (the domain's `rlqs_unknown`);
//! * the Envoy's demand, from the reports ([`Demand`]);
//! * the [`Ledger`] of grants and reported usage, from which proven-unused grants are given back.
//!
//! A grant of `n` requests is sent as DENY_ALL followed by a token bucket of `n` tokens that does
//! not refill, in one response: Envoy then starts a fresh, full bucket, so between two grants it
//! admits at most `n`. A grant of 0 is DENY_ALL alone. Assignments live [`GRANT_TTL`] (several
//! ticks), and static ones (ALLOW_ALL, DENY_ALL) are renewed with every report, since Envoy falls
//! back to its no-assignment behavior when an assignment expires.
//!
//! The pool's events of one round arrive as one batch, and go out in as few responses as fit
//! [`MAX_RESPONSE_BYTES`]. A bucket no report counts a request for during the abandon period gets
//! `abandon_action` and leaves the stream's state. A report the protocol does not allow ends the
//! stream with a status that says why: over the message size limit (RESOURCE_EXHAUSTED), a usage
//! without a bucket id (INVALID_ARGUMENT), no domain in the first report (INVALID_ARGUMENT).
//!
//! The stream ends when the Envoy closes it, its connection drops or the server drains; then its
//! buckets leave the pool, grants the pool sent too late are given back, and what the Envoy may
//! still have used of the others is parked in the store under the Envoy's name. An Envoy that
//! lives on reopens a stream (to any replica) with a report of everything since its last one;
//! that stream takes the parked grants into its own ledger, which settles them like its own.
//! Every report marks the stream alive under the Envoy's name, so that a name two live streams
//! share (Envoys behind one address) settles nothing. Grants of an Envoy that never reports again
//! stay taken: what it used of them is unknown.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt32Value};
use futures::future::join_all;
use futures::{FutureExt as _, StreamExt as _};
use indexmap::IndexMap;
use prost::Message as _;
use tokio::sync::{mpsc, watch};
use tonic::{Status, Streaming};

use super::assign::{Demand, Ledger};
use super::pool::{Event, Events, MemberId, Pool};
use crate::clock::Clock;
use crate::config::{Blanket, FailureMode};
use crate::limiter::{Leasable, Limiter, QuotaBucket};
use crate::store::{LeaseNote, Parked};
use crate::telemetry::logs::{self, ErrorChain};

/// How long a grant stands: a few ticks, so that a late tick does not leave the Envoy without.
pub const GRANT_TTL: Duration = Duration::from_secs(3);
/// How long a static assignment stands: renewed by every report (every 5 s from Envoy 1.40).
pub const STATIC_TTL: Duration = Duration::from_secs(15);
/// A grant replaced this long before a report is taken as known to the Envoy when it counted:
/// longer than a replacement takes to reach the Envoy plus the report's way back. Settling
/// earlier gives back tokens an Envoy still spends (250 ms was seen to under load: 271 and 273
/// admitted against a bound of 261 with a replica killed, 2 of about 12 runs; 0 of 7 at 500 ms);
/// settling later holds unused grants one report longer, which lowers use of the budget (1 s
/// left 221 of 250 once).
pub const SETTLE_MARGIN_MS: u64 = 500;
/// How much later than its `time_elapsed` says a report may arrive and still count everything
/// since a closed stream's last report (`time_elapsed` is in whole seconds: up to 1 s is cut).
pub const CONTINUITY_MARGIN_MS: u64 = 1_500;
/// A grant's token bucket does not refill: one token a day is the slowest Envoy takes.
const NO_REFILL: Duration = Duration::from_secs(86_400);

/// What one stream needs from the server.
pub struct Context {
    /// The decision core.
    pub limiter: Arc<Limiter>,
    /// This replica's leases.
    pub pool: Arc<Pool>,
    /// Time for reports and grants.
    pub clock: Arc<dyn Clock>,
    /// How long a bucket may go without usage before it is abandoned.
    pub abandon_after: Duration,
    /// Set when the server drains.
    pub closing: watch::Receiver<bool>,
}

struct Bucket {
    id: BucketId,
    kind: QuotaBucket,
    demand: Demand,
    ledger: Ledger,
    last_report_ms: u64,
    // When a report last counted a request for it (or it was first reported).
    last_used_ms: u64,
}

/// Who is at the other end of a stream, for the store's parked-lease registries.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The Envoy's name; empty when it has none (then nothing is parked or claimed).
    pub name: String,
    /// This stream, unique across replicas.
    pub stream: String,
}

/// Most bucket actions' encoded bytes in one response: under gRPC's default 4 MiB message limit,
/// with room for the message's own framing.
pub const MAX_RESPONSE_BYTES: usize = 3 << 20;
/// How many buckets a report names for the first time are resolved at once (rule, quota,
/// parked grants): together, not one after another, and without flooding the store.
const FIRST_REPORT_CONCURRENCY: usize = 64;

/// Runs the stream `id` with `peer` until it ends.
pub async fn run(
    context: Context,
    id: u64,
    peer: Peer,
    mut reports: Streaming<RateLimitQuotaUsageReports>,
    answers: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
) {
    let Context { limiter, pool, clock, abandon_after, mut closing } = context;
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
        abandon_after_ms: abandon_after.as_millis().try_into().unwrap_or(u64::MAX),
        domain: None,
        buckets: HashMap::new(),
        recently_abandoned: HashMap::new(),
        unknown_domain_logged: false,
    };
    metrics::gauge!("tollgate_rlqs_streams").increment(1.0);
    // A message read while gathering reports that is not one (the end, an error): next.
    let mut held: Option<Result<Option<RateLimitQuotaUsageReports>, Status>> = None;
    loop {
        let next = async {
            match held.take() {
                Some(message) => message,
                None => reports.message().await,
            }
        };
        let responses = tokio::select! {
            report = next => match report {
                Ok(Some(mut report)) => {
                    held = gather(&mut reports, &mut report);
                    match session.report(report).await {
                        Ok(actions) => bundle(actions),
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
            Some(mut batch) = events.recv() => {
                // Every batch already waiting goes out with this one, in as few messages as fit.
                while let Ok(more) = events.try_recv() {
                    batch.extend(more);
                }
                bundle(session.events(batch))
            }
            () = &mut closed => break,
        };
        if !send_all(&answers, responses).await {
            break;
        }
    }
    let Session { buckets, .. } = session;
    close_out(&limiter, &pool, clock.now_ms(), id, &peer, &buckets, events).await;
    metrics::gauge!("tollgate_rlqs_streams").decrement(1.0);
}

/// How long after an abandon_action a report of the bucket without requests is taken as sent
/// before the Envoy had it: two reporting intervals.
const STALE_REPORT_MS: u64 = 10_000;
/// Most usages gathered into one report (see [`gather`]).
const MAX_GATHERED_USAGES: usize = 4096;

// Appends to `report` the usages of every report already waiting on the stream, up to
// [`MAX_GATHERED_USAGES`], so that they are resolved and leased together: Envoy reports each new
// bucket's first request at once, in a message of its own, and thousands of them one at a time
// would each wait for the ones before. Returns a message read that is not a report (the stream's
// end, an error), to be handled next.
fn gather(
    reports: &mut Streaming<RateLimitQuotaUsageReports>,
    report: &mut RateLimitQuotaUsageReports,
) -> Option<Result<Option<RateLimitQuotaUsageReports>, Status>> {
    while report.bucket_quota_usages.len() < MAX_GATHERED_USAGES {
        match reports.message().now_or_never()? {
            Ok(Some(more)) => {
                if report.domain.is_empty() {
                    report.domain = more.domain;
                }
                report.bucket_quota_usages.extend(more.bucket_quota_usages);
            }
            other => return Some(other),
        }
    }
    None
}

// Sends `responses` in order; false once the Envoy is gone.
async fn send_all(
    answers: &mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    responses: Vec<RateLimitQuotaResponse>,
) -> bool {
    for response in responses {
        if answers.send(Ok(response)).await.is_err() {
            return false;
        }
    }
    true
}

/// Batches waiting for a stream, at most (a round's events are one batch); the pool waits up to
/// a tick for room, then gives the batch's grants back.
const EVENTS_QUEUE: usize = 16;

// One stream's state, owned by its task.
struct Session<'a> {
    limiter: &'a Limiter,
    pool: &'a Arc<Pool>,
    clock: &'a dyn Clock,
    id: u64,
    peer: &'a Peer,
    events: mpsc::Sender<Events>,
    abandon_after_ms: u64,
    domain: Option<String>,
    buckets: HashMap<String, Bucket>,
    // Buckets abandoned within the last STALE_REPORT_MS, and when.
    recently_abandoned: HashMap<String, u64>,
    unknown_domain_logged: bool,
}

impl Session<'_> {
    // A usage report: the buckets it names for the first time are resolved together, then every
    // usage is booked. Answers the static assignments it calls for, or the status that ends the
    // stream.
    async fn report(&mut self, report: RateLimitQuotaUsageReports) -> Result<Vec<BucketAction>, Status> {
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
        let usages: Vec<(String, BucketId, BucketQuotaUsage)> = report
            .bucket_quota_usages
            .into_iter()
            .filter_map(|mut u| {
                let id = u.bucket_id.take()?;
                Some((name(&id), id, u))
            })
            .filter(|(name, _, u)| !self.stale(name, u))
            .collect();
        self.resolve_fresh(&domain, &usages).await;
        let mut actions = Vec::new();
        let mut seen = Vec::new();
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
                QuotaBucket::Lease(target) => {
                    if known {
                        seen.push(target.clone());
                    }
                    bucket.ledger.reported(now, usage.num_requests_allowed, SETTLE_MARGIN_MS);
                    let unused = bucket.ledger.take_refundable();
                    if unused > 0 {
                        let (pool, target) = (self.pool.clone(), target.clone());
                        tokio::spawn(async move { pool.give_back(&target, unused).await });
                    }
                    let member: MemberId = (self.id, name.clone());
                    if self.pool.join(
                        member.clone(),
                        target.clone(),
                        bucket.demand.rate(),
                        self.events.clone(),
                    ) {
                        fresh.push(target.key.clone());
                    }
                    self.pool.set_demand(&target.key, &member, bucket.demand.rate());
                }
                QuotaBucket::Unlimited(_) => actions.push(blanket(&bucket.id, Blanket::AllowAll, STATIC_TTL)),
                QuotaBucket::Unknown(d) => {
                    metrics::counter!("tollgate_rlqs_unknown_buckets_total").increment(1);
                    // As the RLS path answers a domain it does not serve: OK for everything.
                    let answer = d.as_ref().map_or(Blanket::AllowAll, |d| d.rlqs_unknown);
                    actions.push(blanket(&bucket.id, answer, STATIC_TTL));
                }
            }
        }
        // One lookup, not a walk over every bucket the stream holds.
        if self.limiter.rules().domain(&domain).is_none() {
            metrics::counter!("tollgate_rlqs_unknown_domain_reports_total").increment(1);
            if !self.unknown_domain_logged {
                self.unknown_domain_logged = true;
                tracing::warn!(domain = %domain, envoy = %self.peer.name, "an RLQS stream reports for a domain that is not loaded; its buckets are allowed, as RLS allows that domain");
            }
        }
        for name in abandoned {
            self.abandon(&name);
        }
        // The Envoy refuses these buckets' requests until it has an assignment.
        self.pool.lease_now(fresh);
        self.mark_alive(&seen).await;
        Ok(actions)
    }

    // The buckets of `usages` this stream has not seen yet: what each stands for, and for a leased
    // one, the grants a closed stream of the same Envoy parked. Resolved concurrently.
    async fn resolve_fresh(&mut self, domain: &str, usages: &[(String, BucketId, BucketQuotaUsage)]) {
        let mut fresh: Vec<(String, BucketId, u64)> = Vec::new();
        for (name, id, usage) in usages {
            if !self.buckets.contains_key(name) && !fresh.iter().any(|f| &f.0 == name) {
                fresh.push((name.clone(), id.clone(), elapsed_ms(usage)));
            }
        }
        let (limiter, peer, now) = (self.limiter, self.peer, self.clock.now_ms());
        let resolved: Vec<(String, Bucket)> = futures::stream::iter(fresh)
            .map(|(name, id, elapsed)| async move {
                let kind = limiter.quota_bucket(domain, &id.bucket).await;
                // Until a report says otherwise, the Envoy may want all of it: the burst now and
                // the refill after.
                let guess = match &kind {
                    QuotaBucket::Lease(t) => (t.spec.capacity() + t.spec.refill_per_second()) / t.cost as f64,
                    _ => 0.0,
                };
                let mut ledger = Ledger::default();
                if let QuotaBucket::Lease(target) = &kind {
                    adopt_parked(limiter, target, peer, elapsed, now, &mut ledger).await;
                }
                let bucket = Bucket {
                    id,
                    kind,
                    demand: Demand::unknown(guess),
                    ledger,
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

    // The stream is alive: while another stream under the same name is too, the name is shared
    // and nothing parked under it is claimed.
    async fn mark_alive(&self, seen: &[Leasable]) {
        if self.peer.name.is_empty() {
            return;
        }
        let (limiter, peer) = (self.limiter, self.peer);
        let noted = join_all(
            seen.iter().map(|target| limiter.note_lease(target, &peer.name, &peer.stream, LeaseNote::Seen)),
        )
        .await;
        if let Some(Err(error)) = noted.into_iter().find(Result::is_err) {
            if let Some(held_back) = logs::throttled("rlqs_seen_failed") {
                tracing::warn!(error = %ErrorChain(&error), held_back, "could not mark a stream alive in the store");
            }
        }
    }

    // Whether `usage` of the bucket `name` is a report the Envoy sent before it had this stream's
    // abandon_action: no request since (an Envoy that dropped the bucket reports it again only
    // with the request that starts it afresh). Taken for a new bucket, it would be leased every
    // tick for an Envoy that drops every assignment for it, and its grants never settled.
    fn stale(&self, name: &str, usage: &BucketQuotaUsage) -> bool {
        !self.buckets.contains_key(name)
            && self.recently_abandoned.contains_key(name)
            && usage.num_requests_allowed == 0
            && usage.num_requests_denied == 0
    }

    // Drops the bucket `name`, which its Envoy was told to abandon: it leaves the pool, and what
    // its grants may still hold stays taken (the Envoy's last requests under them are never
    // reported). A request for it later starts it afresh.
    fn abandon(&mut self, name: &str) {
        let Some(bucket) = self.buckets.remove(name) else { return };
        self.recently_abandoned.insert(name.to_owned(), self.clock.now_ms());
        metrics::counter!("tollgate_rlqs_abandoned_buckets_total").increment(1);
        if let QuotaBucket::Lease(target) = &bucket.kind {
            self.pool.leave(&target.key, &(self.id, name.to_owned()));
        }
    }

    // What the pool said, as assignments: the latest event per bucket, so that no response
    // carries two assignments for one bucket. A grant superseded before it was sent goes back
    // (the Envoy never had it).
    fn events(&mut self, events: Events) -> Vec<BucketAction> {
        let mut latest: IndexMap<String, Event> = IndexMap::new();
        for event in events {
            let bucket = match &event {
                Event::Grant { bucket, .. } | Event::StoreFailed { bucket, .. } => bucket.clone(),
            };
            if let Some(Event::Grant { requests, .. }) = latest.insert(bucket.clone(), event) {
                if let Some(Bucket { kind: QuotaBucket::Lease(target), .. }) = self.buckets.get(&bucket) {
                    let (pool, target) = (self.pool.clone(), target.clone());
                    tokio::spawn(async move { pool.give_back(&target, requests).await });
                }
            }
        }
        latest.into_values().flat_map(|event| self.event(event)).collect()
    }

    // What the pool said about one bucket, as assignments.
    fn event(&mut self, event: Event) -> Vec<BucketAction> {
        match event {
            Event::Grant { bucket, requests } => match self.buckets.get_mut(&bucket) {
                Some(b) => {
                    b.ledger.granted(self.clock.now_ms(), requests);
                    grant(&b.id, requests)
                }
                None => Vec::new(),
            },
            Event::StoreFailed { bucket, mode } => match (self.buckets.get(&bucket), mode) {
                (Some(b), FailureMode::Allow) => vec![blanket(&b.id, Blanket::AllowAll, GRANT_TTL)],
                (Some(b), FailureMode::Deny) => vec![blanket(&b.id, Blanket::DenyAll, GRANT_TTL)],
                // `error`: no new assignment; Envoy's own expiry behavior applies.
                _ => Vec::new(),
            },
        }
    }
}

// `actions` in as few responses as fit [`MAX_RESPONSE_BYTES`]; a bucket's actions (DENY_ALL and
// its token bucket) stay in one response, as Envoy needs them together.
fn bundle(actions: Vec<BucketAction>) -> Vec<RateLimitQuotaResponse> {
    let mut responses: Vec<RateLimitQuotaResponse> = Vec::new();
    let mut size = 0;
    for action in actions {
        let bytes = action.encoded_len() + 8;
        let same_bucket = responses
            .last()
            .and_then(|r| r.bucket_action.last())
            .is_some_and(|a| a.bucket_id == action.bucket_id);
        if responses.is_empty() || (size + bytes > MAX_RESPONSE_BYTES && !same_bucket) {
            responses.push(RateLimitQuotaResponse::default());
            size = 0;
        }
        size += bytes;
        responses.last_mut().expect("a response").bucket_action.push(action);
    }
    responses
}

// A usage's `time_elapsed` in milliseconds.
fn elapsed_ms(usage: &BucketQuotaUsage) -> u64 {
    usage.time_elapsed.as_ref().map_or(0, |d| {
        (d.seconds.max(0) as u64).saturating_mul(1000).saturating_add((d.nanos.max(0) as u64) / 1_000_000)
    })
}

// The end of the stream `id`: its buckets leave the pool, grants the pool sent that were not
// passed on go back (the Envoy never had them), and what the Envoy may still have used of the
// others is parked for its next stream.
async fn close_out(
    limiter: &Limiter,
    pool: &Pool,
    now: u64,
    id: u64,
    peer: &Peer,
    buckets: &HashMap<String, Bucket>,
    mut events: mpsc::Receiver<Events>,
) {
    for (name, bucket) in buckets {
        if let QuotaBucket::Lease(Leasable { key, .. }) = &bucket.kind {
            pool.leave(key, &(id, name.clone()));
        }
    }
    events.close();
    let mut unsent: Vec<(&Leasable, u64)> = Vec::new();
    while let Ok(batch) = events.try_recv() {
        for event in batch {
            if let Event::Grant { bucket, requests } = event {
                if let Some(Bucket { kind: QuotaBucket::Lease(target), .. }) = buckets.get(&bucket) {
                    unsent.push((target, requests));
                }
            }
        }
    }
    join_all(unsent.into_iter().map(|(target, requests)| pool.give_back(target, requests))).await;
    if peer.name.is_empty() {
        return;
    }
    // All at once: a slow store holds the end of the stream (and a drain) up for one deadline.
    let parks = buckets.values().filter_map(|bucket| {
        let QuotaBucket::Lease(target) = &bucket.kind else { return None };
        let requests = bucket.ledger.unsettled();
        let since_report_ms = now.saturating_sub(bucket.last_report_ms);
        (requests > 0).then(|| park(limiter, target, peer, Parked { requests, since_report_ms }))
    });
    join_all(parks).await;
}

async fn park(limiter: &Limiter, target: &Leasable, peer: &Peer, parked: Parked) {
    match limiter.note_lease(target, &peer.name, &peer.stream, LeaseNote::Park(parked)).await {
        Ok(_) => metrics::counter!("tollgate_rlqs_parked_requests_total", "outcome" => "parked")
            .increment(parked.requests),
        Err(error) => {
            if let Some(held_back) = logs::throttled("rlqs_park_failed") {
                tracing::warn!(domain = %target.domain.name, error = %ErrorChain(&error), held_back, "could not park a closed stream's grants; they stay taken");
            }
        }
    }
}

// A bucket this stream reports for the first time may continue a closed stream of the same
// Envoy. Its parked grants become this stream's first grant if this report counts everything
// since that stream's last report: Envoy counts from its previous report, so the time since the
// parked stream's last report must fit in this report's `time_elapsed`. A report covering under
// a second is not trusted to continue anything: it may be a restarted Envoy's first report of a
// new bucket, which counts from zero. Parked grants that are not adopted stay taken.
async fn adopt_parked(
    limiter: &Limiter,
    target: &Leasable,
    peer: &Peer,
    elapsed_ms: u64,
    now_ms: u64,
    ledger: &mut Ledger,
) {
    if peer.name.is_empty() {
        return;
    }
    match limiter.note_lease(target, &peer.name, &peer.stream, LeaseNote::Claim).await {
        Ok(Some(parked))
            if elapsed_ms >= 1_000 && parked.since_report_ms <= elapsed_ms + CONTINUITY_MARGIN_MS =>
        {
            ledger.granted(now_ms, parked.requests);
            metrics::counter!("tollgate_rlqs_parked_requests_total", "outcome" => "adopted")
                .increment(parked.requests);
        }
        Ok(Some(parked)) => {
            tracing::debug!(envoy = %peer.name, since_report_ms = parked.since_report_ms, elapsed_ms, "a report does not continue the parked stream; its grants stay taken");
        }
        Ok(None) => {}
        Err(error) => {
            if let Some(held_back) = logs::throttled("rlqs_claim_failed") {
                tracing::warn!(domain = %target.domain.name, error = %ErrorChain(&error), held_back, "could not claim a closed stream's grants; they stay taken");
            }
        }
    }
}

// A bucket id as a stable name: its entries, sorted.
fn name(id: &BucketId) -> String {
    let mut entries: Vec<(&String, &String)> = id.bucket.iter().collect();
    entries.sort();
    entries.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

fn ttl(d: Duration) -> Option<ProtoDuration> {
    Some(ProtoDuration { seconds: d.as_secs() as i64, nanos: 0 })
}

fn assignment(id: &BucketId, strategy: Strategy, lives: Duration) -> BucketAction {
    BucketAction {
        bucket_id: Some(id.clone()),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: ttl(lives),
            rate_limit_strategy: Some(RateLimitStrategy { strategy: Some(strategy) }),
        })),
    }
}

// Tells the Envoy to drop the bucket: its cached assignment and usage.
fn abandon(id: &BucketId) -> BucketAction {
    BucketAction { bucket_id: Some(id.clone()), bucket_action: Some(Action::AbandonAction(AbandonAction {})) }
}

fn blanket(id: &BucketId, rule: Blanket, lives: Duration) -> BucketAction {
    let kind = match rule {
        Blanket::AllowAll => "allow_all",
        Blanket::DenyAll => "deny_all",
    };
    metrics::counter!("tollgate_rlqs_assignments_total", "kind" => kind).increment(1);
    let rule = match rule {
        Blanket::AllowAll => BlanketRule::AllowAll,
        Blanket::DenyAll => BlanketRule::DenyAll,
    };
    assignment(id, Strategy::BlanketRule(rule as i32), lives)
}

// DENY_ALL then a full, non-refilling bucket of `requests`: Envoy starts the bucket afresh.
fn grant(id: &BucketId, requests: u64) -> Vec<BucketAction> {
    let mut actions = vec![blanket(id, Blanket::DenyAll, GRANT_TTL)];
    if requests > 0 {
        metrics::counter!("tollgate_rlqs_assignments_total", "kind" => "token_bucket").increment(1);
        let bucket = TokenBucket {
            max_tokens: requests.min(u64::from(u32::MAX)) as u32,
            tokens_per_fill: Some(UInt32Value { value: 1 }),
            fill_interval: ttl(NO_REFILL),
        };
        actions.push(assignment(id, Strategy::TokenBucket(bucket), GRANT_TTL));
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_is_a_fresh_bucket_or_a_denial() {
        let id = BucketId { bucket: HashMap::from([("tenant".to_string(), "t".to_string())]) };
        assert_eq!(grant(&id, 0).len(), 1);
        let both = grant(&id, 7);
        assert_eq!(both.len(), 2);
        let Some(Action::QuotaAssignmentAction(a)) = &both[1].bucket_action else { panic!() };
        let Some(Strategy::TokenBucket(b)) = a.rate_limit_strategy.unwrap().strategy else { panic!() };
        assert_eq!((b.max_tokens, b.fill_interval.unwrap().seconds), (7, 86_400));
        assert_eq!(
            name(&BucketId { bucket: HashMap::from([("b".into(), "2".into()), ("a".into(), "1".into())]) }),
            "a=1,b=2"
        );
    }
}
