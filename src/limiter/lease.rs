//! Leases: what a protocol whose clients enforce limits themselves (Envoy's Rate Limit
//! Quota Service) asks of the decision core, and the policy that sizes them.
//!
//! Such a client names a bucket by an id, which [`Limiter::rlqs_bucket`] maps to a rule exactly
//! as an RLS descriptor is (the tree walk is [`crate::config::Domain::bucket_entries`]), so both
//! protocols reach the same bucket and spend one budget. Each tollgate replica serving such
//! clients leases part of the bucket, a capacity and a rate ([`crate::bucket::lease`]), which
//! its clients enforce between them as refilling local buckets; the rest of the bucket is what
//! RLS requests see. [`LocalLease`] decides when a replica's lease is set again and to what size:
//! in proportion to its clients' demand beside every other replica's (each lease records its
//! demand), with a floor so that an idle client wakes up to a burst. A cold lease costs one
//! renewal a [`RENEW_AFTER`]; a hot one (its clients use much of it) is sized again every
//! [`RESIZE_HOT_AFTER`], and one the store cut short every round, since those are the buckets
//! whose leases move. [`Limiter::lease`] sets leases, many per store call.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::{Limiter, Plan, QueryDescriptor};
use crate::bucket::{BucketSpec, LeaseOp, LeaseOutcome, Others, Role};
use crate::config::Domain;
use crate::store::{self, StoreError};
use crate::telemetry::traces;
use tracing::Instrument as _;

/// What an RLQS bucket id gets.
#[derive(Debug, Clone)]
pub enum RlqsBucket {
    /// A bucket limits it: lease part of it.
    Leased(LeasedBucket),
    /// No limit applies: an `unlimited` rule, or a rule in shadow mode.
    Unlimited(Arc<Domain>),
    /// No rule matches (or entries are left over); `None` for an unknown domain.
    Unknown(Option<Arc<Domain>>),
}

/// A bucket a replica can lease part of.
#[derive(Debug, Clone)]
pub struct LeasedBucket {
    /// Its storage key (the same as for RLS requests with the same entries).
    pub key: String,
    /// Its capacity and rate.
    pub spec: BucketSpec,
    /// Tokens per request.
    pub cost: u64,
    /// Its domain (failure mode, metrics).
    pub domain: Arc<Domain>,
    /// In a region, a rule marked `global: true`: the entries naming the bucket at the global
    /// tier, where leases of it are set (not in this region's store, which does not hold it).
    pub global: Option<Arc<[(String, String)]>>,
}

/// How long a lease lives unless set again.
pub const LEASE_TTL: Duration = Duration::from_secs(60);
/// How old a lease is renewed (set again unchanged) at: half its life, so that one lost renewal
/// leaves the next to land before it expires.
pub const RENEW_AFTER: Duration = Duration::from_secs(30);
/// How long an assignment made from a lease stands at a client: ended well before the lease, so
/// that what a client may still admit is always inside a live lease, however late the assignment
/// reached it.
pub const ASSIGNMENT_TTL: Duration = Duration::from_secs(40);
/// How often a hot lease is sized again: often enough that a leaseholder which starts beside it (and
/// records its demand) gets its share within a few seconds.
pub const RESIZE_HOT_AFTER: Duration = Duration::from_secs(2);
/// How long lease ops may take: no request waits on them (a late one delays an assignment), so
/// not the request deadline, under which a burst of them queued into failure answers. Seconds,
/// not less: three replicas' first reports of 10,000 buckets each on a Cluster are tens of
/// thousands of script calls at once, and at 500 ms some of them timed out into failure-mode
/// answers on this 2-core machine, though Redis answered them all.
pub const BACKGROUND_DEADLINE: Duration = Duration::from_secs(2);
/// The smallest part of a bucket's rate and capacity a replica leases for clients that asked for
/// nothing lately: an idle client wakes up to a request or more at once, and its next report
/// moves the lease.
const FLOOR: f64 = 1.0 / 16.0;
/// The most of the rate the other leases leave that a young lease takes: three quarters, so that
/// replicas starting on a bucket together each get some (3/4, 3/16, 3/64, ...) and together leave
/// little of its refill unleased: the bucket is full then, so what they leave is lost (with half,
/// a hot bucket on 3 replicas lost an eighth of its rate for its first second or two, 2 of the
/// 350 tokens a perfect first 30 s admits).
pub const YOUNG_OF_UNLEASED: f64 = 0.75;
/// How far a wanted size may move before it is set again: less is noise between reports.
const SLACK: f64 = 0.2;
/// A lease is hot when its clients ask for more than this part of its rate.
const HOT: f64 = 0.5;
/// How much earlier than it was set a lease's age counts from (see [`LocalLease::due`]): half of
/// the edge's tick, which looks at a bucket once a second.
const OFF_PHASE_MS: u64 = 500;
/// How long a lease stays at the floor after its first op, and then until an op after that has
/// told it the others: every replica's streams report a new bucket at about the same time, but
/// not at once (a replica resolving a first report of thousands of buckets answers a few hundred
/// milliseconds after another), and a lease that grew to its part among the leaseholders it knew at
/// its next round would leave a late one nothing, so no first assignment, until it learns of it
/// at its next op (measured: 3 % of the first assignments of 1,000 new buckets on 3 replicas came
/// after 2-5 s when leases grew at the next round).
const GROW_AFTER_MS: u64 = 1_000;

/// One replica's lease on one bucket, as this replica last set it.
#[derive(Debug, Clone, Default)]
pub struct LocalLease {
    // What the store gave (capacity, rate per second), and what was asked for.
    leased: Option<(f64, f64)>,
    wanted: (f64, f64),
    // When it was last set, and first set, on the replica's clock.
    at_ms: u64,
    first_ms: Option<u64>,
    // The other leaseholders' leases and demand, as of the last op.
    others: Others,
    // The last op failed: the next round tries again.
    failed: bool,
}

impl LocalLease {
    /// The lease op for `target` due at `now_ms` given `demand` (this replica's clients'
    /// requests per second), if one is (always, when `force`): the first, a size that moved, a
    /// cut one, a hot one, one after a failure, a renewal. It is fresh (the client's local bucket
    /// starts afresh, full: the whole capacity is taken again) when `fresh` says the client's
    /// bucket starts afresh anyway, and when it more than doubles the capacity: Envoy rebuilds a
    /// grown bucket at its old fill ratio, so a busy client, whose bucket is near empty, would
    /// get almost none of what the growth took (the floor a lease starts at, then its part, lost
    /// 40 of 250 requests over 20 s that way).
    pub fn due(
        &self,
        target: &LeasedBucket,
        replica: &str,
        demand: f64,
        now_ms: u64,
        force: bool,
        fresh: bool,
    ) -> Option<LeaseOp> {
        let tokens = demand * target.cost as f64;
        // What the last op told of the others dates from the lease's first second, when they may
        // not all have started: sized by it, the first leases to grow would leave a late one a
        // cut, tiny capacity (one request beside a third of the rate, which a local bucket
        // cannot spend in full); so at the floor, and set once more, unchanged, to learn them.
        let young = self.young();
        let grown = self.first_ms.is_some_and(|first| now_ms.saturating_sub(first) >= GROW_AFTER_MS);
        let want = self.want(&target.spec, tokens, target.cost as f64, young);
        // An op set off the bucket's phase of the tick (at once, after the lease's first second)
        // is looked at next at that phase, up to a tick less than a whole one later: so its ages
        // count from up to half a tick earlier, or a cut lease would wait two seconds to be set
        // again rather than one (measured: the first lease to grow after its first second, cut
        // by the others' young rates, left 0.9 tokens a second unleased for 2 s).
        let age = now_ms.saturating_sub(self.at_ms) + OFF_PHASE_MS;
        let due = match self.leased {
            _ if force || fresh || self.failed => true,
            None => true,
            Some((_, rate)) => {
                let moved = |now: f64, then: f64| (now - then).abs() > SLACK * then.max(f64::MIN_POSITIVE);
                let hot = tokens > HOT * rate;
                moved(want.0, self.wanted.0)
                    || moved(want.1, self.wanted.1)
                    || (young && grown)
                    || (self.cut() && age >= 1_000)
                    || (hot && age >= RESIZE_HOT_AFTER.as_millis() as u64)
                    || age >= RENEW_AFTER.as_millis() as u64
            }
        };
        due.then(|| LeaseOp {
            key: target.key.clone(),
            spec: target.spec,
            replica: replica.to_owned(),
            capacity: want.0,
            unit: target.cost as f64,
            refill_per_second: want.1,
            of_unleased: if young { YOUNG_OF_UNLEASED } else { 1.0 },
            ttl_ms: LEASE_TTL.as_millis() as u64,
            demand: tokens,
            fresh: fresh || self.restarts(want.0),
        })
    }

    // Whether growing to `capacity` should restart the client's bucket: when it more than
    // doubles a lease the store gave in full. A lease the store cut short had no more to give: taken
    // again whole, it would come back as little and destroy what the client had (a hot bucket
    // fell to 0.88 of its bound so).
    fn restarts(&self, capacity: f64) -> bool {
        self.leased.is_some_and(|(leased, _)| leased < capacity / 2.0 && !short(leased, self.wanted.0))
    }

    // Whether the store gave the last op less than it asked, by more than the slack.
    fn cut(&self) -> bool {
        self.leased
            .is_some_and(|(capacity, rate)| short(capacity, self.wanted.0) || short(rate, self.wanted.1))
    }

    /// Records what `op` got at `now_ms` (this replica's clock).
    /// True when it is the first op past the lease's first second: the next may size it by the
    /// others it told, so set it again now rather than a round later (the bucket's unleased
    /// refill is lost meanwhile).
    pub fn set(&mut self, op: &LeaseOp, outcome: &LeaseOutcome, now_ms: u64) -> bool {
        let was_young = self.first_ms.is_some() && self.young();
        self.leased = Some((outcome.capacity, outcome.refill_per_second));
        self.wanted = (op.capacity, op.refill_per_second);
        self.at_ms = now_ms;
        self.first_ms.get_or_insert(now_ms);
        self.others = outcome.others;
        self.failed = false;
        was_young && !self.young()
    }

    // Whether the last op dates from the lease's first second (or there was none).
    fn young(&self) -> bool {
        self.first_ms.is_none_or(|first| self.at_ms.saturating_sub(first) < GROW_AFTER_MS)
    }

    /// Records that an op failed.
    pub fn failed(&mut self) {
        self.failed = true;
    }

    // The size wanted for `tokens` per second of demand: its part of all the demand the other
    // leases record, of the whole bucket (the store cuts it to what the others leave), at least
    // the floor; alone, or all idle, the floor when idle and everything when not. A first lease
    // knows no one else's demand yet: it starts at the floor, which leaves room for the leases
    // starting beside it (every replica's stream reports a new bucket at once), and stays there
    // while `young` ([`GROW_AFTER_MS`]), until its ops have told it theirs; its rate meanwhile
    // is most of what the others leave ([`YOUNG_OF_UNLEASED`]). In whole requests' capacity
    // (`unit`), at least one, which is what a local bucket needs.
    fn want(&self, spec: &BucketSpec, tokens: f64, unit: f64, young: bool) -> (f64, f64) {
        let total = tokens + self.others.demand;
        let part = if young || total <= 0.0 { FLOOR } else { (tokens / total).max(FLOOR) };
        // A young lease's rate is most of what the others leave (the op's `of_unleased`): the
        // bucket's refill beyond its capacity is lost while leases leave it unleased, and the floor
        // left 15 of 16 parts of it unleased for the lease's first second.
        let rate = if young { YOUNG_OF_UNLEASED } else { part };
        // Whole requests: an Envoy's local bucket holds whole requests, so a lease's fraction of
        // one would be tokens taken from the balance that no one spends (a third of 50 leased as
        // 16.7 to three Envoys of 16 left the last one's growth a token short).
        let whole = |tokens: f64| (tokens / unit).floor() * unit;
        (whole(spec.capacity() * part).max(unit).min(spec.capacity()), spec.refill_per_second() * rate)
    }
}

// Whether `got` falls short of `wanted` by more than the slack.
fn short(got: f64, wanted: f64) -> bool {
    got < wanted * (1.0 - SLACK)
}

impl Limiter {
    /// The bucket an RLQS bucket id of `domain` stands for.
    pub async fn rlqs_bucket(&self, domain: &str, bucket: &HashMap<String, String>) -> RlqsBucket {
        let rules = self.rules.load_full();
        let Some(domain) = rules.domain(domain) else { return RlqsBucket::Unknown(None) };
        let Some(entries) = domain.bucket_entries(bucket) else {
            return RlqsBucket::Unknown(Some(domain.clone()));
        };
        let descriptor = QueryDescriptor { entries, hits: 1, credit: false, limit: None };
        let mut plans = vec![self.plan(domain, &descriptor)];
        self.resolve_quotas(domain, &mut plans).await;
        match plans.pop() {
            // In a region a global rule's bucket is the global tier's: its leases are set there
            // (named by the entries), not on the regional store's bucket, which would limit this
            // region alone.
            Some(Plan::Bucket(p)) if p.role != Role::Shadow => {
                let global = self.shares.is_some() && p.rule.is_some_and(|r| r.global);
                let entries = descriptor.entries.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned()));
                RlqsBucket::Leased(LeasedBucket {
                    key: p.bucket.key,
                    spec: p.spec.expect("tenant quotas resolved"),
                    cost: p.rule.map_or(1, |r| r.cost.max(1)),
                    domain: domain.clone(),
                    global: global.then(|| entries.collect()),
                })
            }
            Some(Plan::Bucket(_) | Plan::Unlimited(_)) => RlqsBucket::Unlimited(domain.clone()),
            Some(Plan::Free) | None => RlqsBucket::Unknown(Some(domain.clone())),
        }
    }

    /// The bucket a region leases for `entries` of `domain`: one that a rule marked `global: true`
    /// limits (in force, not in shadow mode), as an RLS descriptor with these entries would reach
    /// it. `None` otherwise.
    pub async fn global_bucket(&self, domain: &str, entries: &[(&str, &str)]) -> Option<LeasedBucket> {
        let rules = self.rules.load_full();
        let domain = rules.domain(domain)?;
        let descriptor = QueryDescriptor { entries: entries.to_vec(), hits: 1, credit: false, limit: None };
        match self.plan(domain, &descriptor) {
            Plan::Bucket(p) if p.role != Role::Shadow && p.rule.is_some_and(|r| r.global) => {
                Some(LeasedBucket {
                    key: p.bucket.key,
                    spec: p.spec?,
                    cost: p.rule.map_or(1, |r| r.cost.max(1)),
                    domain: domain.clone(),
                    global: None,
                })
            }
            _ => None,
        }
    }

    /// Sets the leases `ops`, all at once (one store call per slot), under the background
    /// deadline; one result per op.
    pub async fn lease(&self, ops: &[LeaseOp]) -> Vec<Result<LeaseOutcome, StoreError>> {
        // A trace of its own (no request leads to it), the store call its child.
        let span = tracing::trace_span!(
            target: traces::TARGET,
            "rlqs.lease",
            leases = ops.len(),
            failed = tracing::field::Empty,
        );
        let call = tracing::trace_span!(
            target: traces::TARGET,
            parent: &span,
            "store.lease",
            buckets = ops.len(),
            outcome = tracing::field::Empty,
        );
        let results =
            store::in_background(BACKGROUND_DEADLINE, self.store.lease(ops)).instrument(call.clone()).await;
        let failed = results.iter().filter(|r| r.is_err()).count();
        span.record("failed", failed);
        call.record("outcome", if failed == 0 { "ok" } else { "error" });
        results
    }
}
