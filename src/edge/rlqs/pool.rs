//! This replica's leases: every bucket some stream of this replica reports, and for each
//! stream the lease it keeps on that bucket in the shared store ([`crate::bucket::lease`]), which
//! its Envoy enforces as a refilling local bucket ([`LocalBucket`]). In a region, a global rule's
//! bucket is the global tier's, and its leases are set there ([`GlobalLeases`]) in the same way.
//!
//! A lease belongs to one stream (its leaseholder name is this replica's and a number of the stream's
//! membership), not to the replica: an Envoy spends a local bucket it was given whatever the
//! others do, so each one's capacity must be backed on its own, and moving capacity from one
//! Envoy to another is a shrink and a growth, each through the store.
//!
//! Once a [`TICK`], at its phase of the tick, each member's [`LocalLease`] says whether its lease is
//! due to be set again (new, resized, cut short, hot, after a failure, or up for renewal); the due
//! ones of a phase go to the store together, [`LEASE_OPS_PER_CALL`] to a call, and each outcome goes to
//! its stream as an assignment that lives [`ASSIGNMENT_TTL`], well inside the lease's life. So an
//! idle bucket costs one renewal a [`crate::limiter::RENEW_AFTER`] and nothing else. A bucket's
//! phase is one of [`PHASES`] slices of the tick, from its key's Cluster slot, so that the calls
//! spread over the tick.
//!
//! An Envoy starts a new local bucket full: its first one, and one after a blanket assignment or
//! an expired one. The lease op before such an assignment is *fresh*: the store takes the whole
//! capacity again, not only what it grew by, since the Envoy may have spent what it had. A stream
//! that leaves leaves its lease to expire: its Envoy may use its cached assignment until then.
//! When the store fails, the stream is told so and answers with the domain's failure mode.
//!
//! A round's events reach each stream as one batch ([`Events`]), which the stream answers in as
//! few messages as fit. The tick task belongs to the pool and stops with it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use tokio::sync::mpsc;

use super::assign::LocalBucket;
use crate::bucket::{LeaseOp, LeaseOutcome};
use crate::config::FailureMode;
use crate::edge::region::client::{GlobalLeaseError, GlobalLeases, GlobalName};
use crate::limiter::{LeasedBucket, Limiter, LocalLease, ASSIGNMENT_TTL};
use crate::store::StoreError;
use crate::telemetry;
use crate::telemetry::logs::{self, ErrorChain};

/// How often buckets are looked at (and leases set when due).
pub const TICK: Duration = Duration::from_secs(1);
/// Slices of a tick over which buckets are looked at, each at the slice its key falls in.
pub const PHASES: u64 = 10;
/// Most lease ops in one store call (one script run per slot in it): thousands of new buckets in
/// one script would hold Redis up for everyone else.
const LEASE_OPS_PER_CALL: usize = 256;
/// Most store calls this replica's rounds have in flight together: a first report of thousands
/// of buckets, booked in chunks, starts a round per chunk, and calls queued behind too many
/// others in Redis would outlast the background deadline. Redis runs one script at a time, and
/// every lease script queued there is one a request's script may wait behind: with 8 in flight,
/// RLS requests beside 5 streams of 20,000 new buckets were answered at p99 49-53 ms and 4-40 of
/// 600 from the failure mode at a 50 ms deadline; with 2, p99 13-21 ms and none. First
/// assignments at 10,000 x 3 moved within the noise of one hour's runs (median 0.72-0.85 s with
/// 2, 0.65-0.72 s with 8; `ONLY=hostile` and `ONLY=rlqs bench/run`).
const CALLS_IN_FLIGHT: usize = 2;
/// How long a store call's events wait for room in a stream's queue: a stream resolving a chunk
/// of a first report of thousands of new buckets reads no events meanwhile.
const DELIVERY_WAIT: Duration = Duration::from_secs(5);

/// A stream's bucket: the stream and the bucket id (as its sorted entries) it reported.
pub type MemberId = (u64, String);

/// What the pool sends a stream: the events of one store call, for any number of its buckets,
/// each with its number in the pool's order of outcomes. Batches are delivered by tasks of their
/// own and may arrive out of order, so a stream keeps, per bucket, the latest by number (an older
/// assignment applied after a newer one would shrink an Envoy's bucket to a size its lease no
/// longer has: seen as a first second's floor arriving after the growth that replaced it).
pub type Events = Vec<(u64, Event)>;

/// What the pool tells a stream about one of its buckets.
#[derive(Debug, Clone)]
pub enum Event {
    /// Admit from a local bucket of this size for [`ASSIGNMENT_TTL`]; none: admit nothing, or,
    /// for an Envoy never given one, wait for the next.
    Assign {
        /// The Envoy's bucket id, encoded.
        bucket: String,
        /// Its local bucket.
        assignment: Option<LocalBucket>,
        /// Start it afresh, full: its lease took the whole capacity again.
        fresh: bool,
    },
    /// The store failed; answer as this failure mode says.
    StoreFailed {
        /// The Envoy's bucket id, encoded.
        bucket: String,
        /// The domain's failure mode.
        mode: FailureMode,
    },
}

struct Member {
    demand: f64,
    events: mpsc::Sender<Events>,
    // Its name among the bucket's leaseholders: this replica's and a number unique in it.
    leaseholder: String,
    leasing: LocalLease,
    // When a local bucket was last sent; none when the Envoy has none from us (then the next one
    // starts full).
    sent_at: Option<u64>,
    // A local bucket was ever sent: until then the Envoy has spent nothing of the lease, so an op
    // need not take its whole capacity again (a lease too small for an assignment, a rule
    // refilling under a request an hour, was otherwise taken afresh every round).
    given: bool,
    // A lease op for it is in flight.
    busy: bool,
}

impl Member {
    // Whether an assignment now would start a local bucket its Envoy had from us afresh.
    fn fresh(&self, now_ms: u64) -> bool {
        let lives = ASSIGNMENT_TTL.as_millis() as u64;
        self.given && self.sent_at.is_none_or(|at| now_ms.saturating_sub(at) >= lives)
    }
}

struct Bucket {
    target: LeasedBucket,
    // Its phase of the tick ([`phase_of`] its key).
    phase: u64,
    members: HashMap<MemberId, Member>,
}

/// The leases of this replica.
pub struct Pool {
    inner: Arc<Inner>,
    ticker: tokio::task::JoinHandle<()>,
}

struct Inner {
    limiter: Arc<Limiter>,
    // In a region, where the leases of global rules' buckets are set.
    global: Option<Arc<GlobalLeases>>,
    // This replica's name in the buckets' leases.
    replica: String,
    started: Instant,
    // Memberships so far: numbers each member's leaseholder name.
    joined: std::sync::atomic::AtomicU64,
    buckets: Mutex<HashMap<String, Bucket>>,
    // Permits for store calls in flight ([`CALLS_IN_FLIGHT`]).
    calls: tokio::sync::Semaphore,
    // Numbers outcomes from 1, under the buckets' lock (see [`Events`]).
    outcomes: std::sync::atomic::AtomicU64,
    // Ops of `Round::Now` (first leases, and the growth right after a lease's second look) not
    // answered yet: while there are any, the ticks' rounds wait, so that Envoys waiting for a
    // first assignment come first (renewals have half a lease's life to land).
    first_ops: std::sync::atomic::AtomicUsize,
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.ticker.abort();
    }
}

impl Pool {
    /// A pool leasing through `limiter` as `replica` (and, in a region, global rules' buckets
    /// through `global`); starts its tick task on `runtime`, where its rounds run too.
    pub fn new(
        limiter: Arc<Limiter>,
        global: Option<Arc<GlobalLeases>>,
        replica: String,
        runtime: &tokio::runtime::Handle,
    ) -> Pool {
        let inner = Arc::new(Inner {
            limiter,
            global,
            replica,
            started: Instant::now(),
            joined: Default::default(),
            buckets: Mutex::default(),
            calls: tokio::sync::Semaphore::new(CALLS_IN_FLIGHT),
            outcomes: Default::default(),
            first_ops: Default::default(),
        });
        let ticking = Arc::downgrade(&inner);
        let ticker = runtime.spawn(async move {
            loop {
                let (wait, phase) = until_next_phase();
                tokio::time::sleep(wait).await;
                let Some(inner) = ticking.upgrade() else { return };
                let keys: Vec<String> =
                    inner.lock().iter().filter(|(_, b)| b.phase == phase).map(|(k, _)| k.clone()).collect();
                // A phase's ops run on their own, so that a slow store holds up no other phase.
                tokio::spawn(async move { inner.round(Round::Due(keys)).await });
            }
        });
        Pool { inner, ticker }
    }

    /// Records that `member` wants `demand` requests per second of `target`, making it a leaseholder
    /// if it is not one yet; true if it is new (then set its lease with [`Pool::lease_now`]).
    pub fn report(
        &self,
        member: &MemberId,
        target: &LeasedBucket,
        demand: f64,
        events: &mpsc::Sender<Events>,
    ) -> bool {
        let mut buckets = self.inner.lock();
        // The common case, a member's every report after its first, allocates nothing.
        if let Some(known) = buckets.get_mut(&target.key).and_then(|b| b.members.get_mut(member)) {
            known.demand = demand;
            return false;
        }
        let before = buckets.len();
        let bucket = buckets.entry(target.key.clone()).or_insert_with(|| Bucket {
            phase: phase_of(&target.key),
            target: target.clone(),
            members: HashMap::new(),
        });
        let n = self.inner.joined.fetch_add(1, Ordering::Relaxed);
        let leaseholder = format!("{}#{n}", self.inner.replica);
        let events = events.clone();
        bucket.members.insert(
            member.clone(),
            Member {
                demand,
                events,
                leaseholder,
                leasing: LocalLease::default(),
                sent_at: None,
                given: false,
                busy: false,
            },
        );
        telemetry::add_rlqs_leaseholders(1.0);
        if buckets.len() != before {
            metrics::gauge!("tollgate_rlqs_buckets").set(buckets.len() as f64);
        }
        true
    }

    /// Sets the leases of `members` of the buckets `keys` now, instead of at their next phase:
    /// their Envoys refuse requests until they have an assignment.
    pub fn lease_now(&self, members: Vec<(String, MemberId)>) {
        if members.is_empty() {
            return;
        }
        let inner = self.inner.clone();
        tokio::spawn(async move { inner.round(Round::Now(members)).await });
    }

    /// Removes `member` from the bucket `key`. Its lease stays until it expires: its Envoy may use
    /// its cached assignment until then.
    pub fn leave(&self, key: &str, member: &MemberId) {
        let mut buckets = self.inner.lock();
        if let Some(bucket) = buckets.get_mut(key) {
            if bucket.members.remove(member).is_some() {
                telemetry::add_rlqs_leaseholders(-1.0);
            }
            if bucket.members.is_empty() {
                buckets.remove(key);
                metrics::gauge!("tollgate_rlqs_buckets").set(buckets.len() as f64);
            }
        }
    }
}

// Every replica looks at a bucket at its phase of each wall-clock round (rounds are multiples of
// TICK since the Unix epoch), so that a tenant's buckets (one slot) are set together. Returns how
// long until the next phase starts, and which phase that is.
fn until_next_phase() -> (Duration, u64) {
    let slice = TICK.as_millis() as u64 / PHASES;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let next = now / slice + 1;
    (Duration::from_millis(next * slice - now), next % PHASES)
}

// The phase of the bucket `key`: from its Cluster slot.
fn phase_of(key: &str) -> u64 {
    u64::from(crate::identity::cluster_slot(key)) % PHASES
}

// One stream's events of a round, and whose they are.
struct Batch {
    sender: mpsc::Sender<Events>,
    events: Events,
    members: Vec<(String, MemberId)>,
}

// A call's ops and their outcomes.
type Answered = (Vec<Planned>, Vec<Result<LeaseOutcome, LeaseFailure>>);

// Why an op's lease was not set: the region's store failed (the stream answers with the failure
// mode), or, for a global rule's bucket, the global tier could not be reached or refused (the
// Envoy keeps its assignment, which ends inside the lease it was made from, and the next round
// tries again; cut off past the assignment's end, the Envoy applies its filter's
// expired-assignment behavior).
#[derive(Debug)]
enum LeaseFailure {
    Store(StoreError),
    Global(GlobalLeaseError),
}

// Which members a round looks at.
enum Round {
    // Every member of these buckets, whose ops are due.
    Due(Vec<String>),
    // These members of these buckets, now, before the ticks' rounds (see `first_ops`).
    Now(Vec<(String, MemberId)>),
}

// An op and whose it is; for a global rule's bucket, its domain and entries at the global tier.
struct Planned {
    op: LeaseOp,
    member: MemberId,
    global: Option<GlobalName>,
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Bucket>> {
        self.buckets.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    // One round: the ops it calls for, in calls of [`LEASE_OPS_PER_CALL`]; as each call is answered,
    // each stream's events of it as one batch, delivered in a task of its own, so that a stream
    // that reads nothing holds up no one else, and the first buckets of a round of thousands are
    // assigned without waiting for the last.
    async fn round(self: &Arc<Self>, round: Round) {
        let first = matches!(round, Round::Now(_));
        if !first && self.first_ops.load(Ordering::Relaxed) > 0 {
            return;
        }
        let planned = self.plan(round);
        if planned.is_empty() {
            return;
        }
        if first {
            self.first_ops.fetch_add(planned.len(), Ordering::Relaxed);
        }
        // Calls of the region's store's buckets, then of global rules' buckets (at the global tier).
        let (global, local): (Vec<Planned>, Vec<Planned>) =
            planned.into_iter().partition(|p| p.global.is_some());
        let calls: Vec<Vec<Planned>> = {
            let mut calls = Vec::new();
            for planned in [local, global] {
                let mut planned = planned.into_iter().peekable();
                while planned.peek().is_some() {
                    calls.push(planned.by_ref().take(LEASE_OPS_PER_CALL).collect());
                }
            }
            calls
        };
        let mut answered = futures::stream::iter(calls)
            .map(|call| async move {
                let results = self.lease(&call).await;
                (call, results)
            })
            .buffer_unordered(CALLS_IN_FLIGHT);
        while let Some(answer) = answered.next().await {
            let ops = answer.0.len();
            self.deliver(answer);
            if first {
                self.first_ops.fetch_sub(ops, Ordering::Relaxed);
            }
        }
    }

    // Sets a call's leases, one result per op: in the region's store, or, for a call of global
    // rules' buckets (a call is one or the other), at the global tier.
    async fn lease(&self, call: &[Planned]) -> Vec<Result<LeaseOutcome, LeaseFailure>> {
        if call.first().is_some_and(|p| p.global.is_some()) {
            // A bucket is leased at the global tier only in a region, which has the client.
            let client = self.global.as_ref().expect("global buckets only in a region");
            let ops: Vec<(LeaseOp, &GlobalName)> = call
                .iter()
                .map(|p| (p.op.clone(), p.global.as_ref().expect("a call of global buckets")))
                .collect();
            return client.lease(&ops).await.into_iter().map(|r| r.map_err(LeaseFailure::Global)).collect();
        }
        let ops: Vec<LeaseOp> = call.iter().map(|p| p.op.clone()).collect();
        // Only store calls take a permit: they are what queues in Redis. A global tier that does
        // not answer (each call waits its timeout) holds up no regional lease.
        // The semaphore is never closed.
        let _permit = self.calls.acquire().await;
        self.limiter.lease(&ops).await.into_iter().map(|r| r.map_err(LeaseFailure::Store)).collect()
    }

    // Books a call's outcomes (under one lock and one clock reading) and sends each stream its
    // events of them.
    fn deliver(self: &Arc<Self>, (call, results): Answered) {
        let mut batches: HashMap<u64, Batch> = HashMap::new();
        // Members whose next op may size their lease by what this one told (see `LocalLease::set`).
        let mut grown: Vec<(String, MemberId)> = Vec::new();
        {
            let now_ms = self.now_ms();
            let mut buckets = self.lock();
            for (planned, result) in call.into_iter().zip(results) {
                if let Some((sender, event)) = settle(&mut buckets, &planned, result, now_ms, &mut grown) {
                    let batch = batches.entry(planned.member.0).or_insert_with(|| Batch {
                        sender,
                        events: Vec::new(),
                        members: Vec::new(),
                    });
                    batch.events.push((self.outcomes.fetch_add(1, Ordering::Relaxed) + 1, event));
                    batch.members.push((planned.op.key, planned.member));
                }
            }
        }
        if !grown.is_empty() {
            let inner = self.clone();
            tokio::spawn(async move { inner.round(Round::Now(grown)).await });
        }
        for batch in batches.into_values() {
            let inner = self.clone();
            tokio::spawn(async move {
                // A stream that takes nothing for that long gets nothing: its Envoy has none of
                // these assignments, so the members' next ops are fresh, at their next round.
                if batch.sender.send_timeout(batch.events, DELIVERY_WAIT).await.is_err() {
                    let mut buckets = inner.lock();
                    for (key, id) in batch.members {
                        if let Some(member) = buckets.get_mut(&key).and_then(|b| b.members.get_mut(&id)) {
                            member.sent_at = None;
                        }
                    }
                }
            });
        }
    }

    // The ops a round calls for.
    fn plan(&self, round: Round) -> Vec<Planned> {
        let now_ms = self.now_ms();
        let mut buckets = self.lock();
        let mut planned = Vec::new();
        let mut visit = |bucket: &mut Bucket, id: &MemberId, force: bool| {
            let Some(member) = bucket.members.get_mut(id) else { return };
            if member.busy {
                return;
            }
            let fresh = member.fresh(now_ms);
            let due =
                member.leasing.due(&bucket.target, &member.leaseholder, member.demand, now_ms, force, fresh);
            if let Some(op) = due {
                member.busy = true;
                let global = (bucket.target.global.clone())
                    .map(|entries| GlobalName { domain: bucket.target.domain.name.clone(), entries });
                planned.push(Planned { op, member: id.clone(), global });
            }
        };
        match round {
            Round::Due(keys) => {
                for key in keys {
                    let Some(bucket) = buckets.get_mut(&key) else { continue };
                    let ids: Vec<MemberId> = bucket.members.keys().cloned().collect();
                    for id in &ids {
                        visit(bucket, id, false);
                    }
                }
            }
            Round::Now(members) => {
                for (key, id) in members {
                    if let Some(bucket) = buckets.get_mut(&key) {
                        visit(bucket, &id, true);
                    }
                }
            }
        }
        planned
    }
}

// Books what an op got at `now_ms` in `buckets`: the event for its member's stream. A member
// whose lease may grow now goes on `grown`.
fn settle(
    buckets: &mut HashMap<String, Bucket>,
    planned: &Planned,
    result: Result<LeaseOutcome, LeaseFailure>,
    now_ms: u64,
    grown: &mut Vec<(String, MemberId)>,
) -> Option<(mpsc::Sender<Events>, Event)> {
    let bucket = buckets.get_mut(&planned.op.key)?;
    let cost = bucket.target.cost;
    let mode = bucket.target.domain.failure_mode;
    let member = bucket.members.get_mut(&planned.member)?;
    member.busy = false;
    let name = planned.member.1.clone();
    match result {
        Ok(outcome) => {
            telemetry::count_rlqs_lease("set");
            if outcome.refused {
                // The bucket has its most leaseholders: this stream's Envoys get no assignment
                // (their no_assignment_behavior) until one of those goes.
                metrics::counter!("tollgate_leaseholders_refused_total", "by" => "bucket").increment(1);
            }
            if member.leasing.set(&planned.op, &outcome, now_ms) {
                grown.push((planned.op.key.clone(), planned.member.clone()));
            }
            let assignment = LocalBucket::of(outcome.capacity, outcome.refill_per_second, cost);
            // An Envoy never given a bucket by this stream keeps what it has (its cached
            // assignment, from another replica's stream, stands on that stream's lease).
            if assignment.is_none() && member.sent_at.is_none() {
                return None;
            }
            member.sent_at = assignment.map(|_| now_ms);
            // The first local bucket starts full, as a fresh one does.
            let fresh = planned.op.fresh || !member.given;
            member.given |= assignment.is_some();
            let event = Event::Assign { bucket: name, assignment, fresh };
            Some((member.events.clone(), event))
        }
        Err(LeaseFailure::Store(error)) => {
            telemetry::count_rlqs_lease("failed");
            if let Some(held_back) = logs::throttled("rlqs_lease_failed") {
                tracing::warn!(error = %ErrorChain(&error), held_back, "could not set a lease in the store; applying the failure mode");
            }
            member.leasing.failed();
            member.sent_at = None;
            Some((member.events.clone(), Event::StoreFailed { bucket: name, mode }))
        }
        Err(LeaseFailure::Global(error)) => {
            telemetry::count_rlqs_lease("failed");
            if let Some(held_back) = logs::throttled("rlqs_global_lease_failed") {
                tracing::warn!(error = %ErrorChain(&error), held_back, "could not set a lease of a global bucket at the global tier; its Envoys keep their assignments until they end");
            }
            member.leasing.failed();
            None
        }
    }
}
