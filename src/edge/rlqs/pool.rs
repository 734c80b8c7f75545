//! This replica's leases: every bucket some stream of this replica asks for, leased from the
//! shared store once per [`TICK`], at its phase of each wall-clock round, and split among the
//! streams. A bucket's phase is one of [`PHASES`] slices of the tick, from its key's Cluster slot:
//! every replica leases a given bucket at the same moment (they see each other's takes of the
//! round), while different buckets' calls are spread over the tick instead of all queueing at its
//! start, where they missed the store's deadline (1,000 buckets on 3 replicas: 23,659
//! failure-mode answers in 20 s, with Redis at 13 % of a core).
//!
//! Per bucket and tick: the demand of this replica's streams is registered in the store beside
//! other replicas' ([`crate::store::Store::share_demand`]); this replica takes its share of the
//! round, what the bucket holds plus what other replicas took in it ([`Limiter::lease`]); the
//! requests taken are split among its streams in proportion to their demand, each capped at
//! twice its demand ([`assign::split`]), and what no stream can use is given back at once. The
//! buckets a stream joins are leased at once, together, not at the next tick, since its Envoy
//! refuses requests until it has an assignment. When the store fails, the streams are told so
//! and answer with the domain's failure mode.
//!
//! A round's events reach each stream as one batch ([`Events`]), which the stream answers in as
//! few messages as fit. A stream that takes no batch for a whole tick (an Envoy that reads
//! nothing) gets nothing: what the batch granted is given back.
//!
//! The tick task belongs to the pool and stops with it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::join_all;
use futures::StreamExt as _;
use tokio::sync::mpsc;

use super::assign;
use crate::config::FailureMode;
use crate::limiter::{Leasable, Limiter};
use crate::telemetry::logs::{self, ErrorChain};

/// How often buckets are leased (and Envoys get fresh grants).
pub const TICK: Duration = Duration::from_secs(1);
/// Slices of a tick over which buckets are leased, each at the slice its key falls in.
pub const PHASES: u64 = 10;
/// Most buckets one lease task leases at once. A stream's first report may name thousands of
/// buckets; leased all at once, their calls queue past the store's deadline and answer with the
/// failure mode, while a bounded number in flight finish in order within it.
const LEASES_IN_FLIGHT: usize = 64;

/// A stream's bucket: the stream and the bucket id (as its sorted entries) it reported.
pub type MemberId = (u64, String);

/// What the pool sends a stream: the events of one round, for any number of its buckets.
pub type Events = Vec<Event>;

/// What the pool tells a stream about one of its buckets.
#[derive(Debug, Clone)]
pub enum Event {
    /// Admit up to this many requests until the next grant.
    Grant {
        /// The Envoy's bucket id, encoded.
        bucket: String,
        /// Requests it may admit.
        requests: u64,
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
}

struct Bucket {
    target: Leasable,
    // Its phase of the tick ([`phase_of`] its key).
    phase: u64,
    members: HashMap<MemberId, Member>,
    // Fractions of a request owed to each member, and to this replica by the store.
    owed: HashMap<MemberId, f64>,
    owed_replica: f64,
    // When it was last leased: a bucket leased at a join skips its phase's tick if that comes
    // within half a tick, which would replace the join's grant before the Envoy could use it.
    leased_at: Option<std::time::Instant>,
}

/// The leased buckets of this replica.
pub struct Pool {
    inner: Arc<Inner>,
    ticker: tokio::task::JoinHandle<()>,
}

struct Inner {
    limiter: Arc<Limiter>,
    // This replica's name in the store's demand registries.
    replica: String,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.ticker.abort();
    }
}

impl Pool {
    /// A pool leasing through `limiter` as `replica`; starts its tick task.
    pub fn new(limiter: Arc<Limiter>, replica: String) -> Pool {
        let inner = Arc::new(Inner { limiter, replica, buckets: Mutex::default() });
        let ticking = Arc::downgrade(&inner);
        let ticker = tokio::spawn(async move {
            loop {
                let (wait, phase) = until_next_phase();
                tokio::time::sleep(wait).await;
                let Some(inner) = ticking.upgrade() else { return };
                let recent = |b: &Bucket| b.leased_at.is_some_and(|at| at.elapsed() < TICK / 2);
                let keys: Vec<String> = inner
                    .lock()
                    .iter()
                    .filter(|(_, b)| b.phase == phase && !recent(b))
                    .map(|(k, _)| k.clone())
                    .collect();
                // A phase's leases run on their own, so that a slow store holds up no other phase.
                tokio::spawn(async move { inner.lease_rounds(&keys).await });
            }
        });
        Pool { inner, ticker }
    }

    /// Makes `member` a lessee of `target` with `demand` requests per second; true if it is new
    /// (then lease its bucket with [`Pool::lease_now`]).
    pub fn join(
        &self,
        member: MemberId,
        target: Leasable,
        demand: f64,
        events: mpsc::Sender<Events>,
    ) -> bool {
        let mut buckets = self.inner.lock();
        let bucket = buckets.entry(target.key.clone()).or_insert_with(|| Bucket {
            phase: phase_of(&target.key),
            target,
            members: HashMap::new(),
            owed: HashMap::new(),
            owed_replica: 0.0,
            leased_at: None,
        });
        let fresh = bucket.members.insert(member, Member { demand, events }).is_none();
        metrics::gauge!("tollgate_rlqs_buckets").set(buckets.len() as f64);
        fresh
    }

    /// Leases the buckets `keys` now, together, instead of at the next tick.
    pub fn lease_now(&self, keys: Vec<String>) {
        if keys.is_empty() {
            return;
        }
        let inner = self.inner.clone();
        tokio::spawn(async move { inner.lease_rounds(&keys).await });
    }

    /// Updates `member`'s demand for the bucket `key`.
    pub fn set_demand(&self, key: &str, member: &MemberId, demand: f64) {
        if let Some(m) = self.inner.lock().get_mut(key).and_then(|b| b.members.get_mut(member)) {
            m.demand = demand;
        }
    }

    /// Removes `member` from the bucket `key`; a bucket without members is no longer leased.
    pub fn leave(&self, key: &str, member: &MemberId) {
        let mut buckets = self.inner.lock();
        if let Some(bucket) = buckets.get_mut(key) {
            bucket.members.remove(member);
            if bucket.members.is_empty() {
                buckets.remove(key);
            }
        }
        metrics::gauge!("tollgate_rlqs_buckets").set(buckets.len() as f64);
    }

    /// Gives `requests` of a member's grants back to the bucket.
    pub async fn give_back(&self, target: &Leasable, requests: u64) {
        self.inner.give_back(target, requests).await;
    }
}

// Every replica leases a bucket at its phase of each wall-clock round (rounds are multiples of
// TICK since the Unix epoch; replicas' clocks agree to NTP's precision), so that within a round
// all see the same refill, and each sees the others' takes of this round only (they stand for
// half a tick). Returns how long until the next phase starts, and which phase that is.
fn until_next_phase() -> (Duration, u64) {
    let slice = TICK.as_millis() as u64 / PHASES;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let next = now / slice + 1;
    (Duration::from_millis(next * slice - now), next % PHASES)
}

// The phase of the bucket `key`: from its Cluster slot, so that a tenant's buckets (one slot)
// are leased together.
fn phase_of(key: &str) -> u64 {
    u64::from(crate::identity::cluster_slot(key)) % PHASES
}

// An event for a member, the channel it goes by, and the grant to give back if it cannot.
type Delivery = (MemberId, mpsc::Sender<Events>, Event, Option<(Leasable, u64)>);

// One stream's events of a round, and the grants among them to give back if it takes none.
struct Batch {
    sender: mpsc::Sender<Events>,
    events: Events,
    grants: Vec<(Leasable, u64)>,
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Bucket>> {
        self.buckets.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    // One lease of each bucket of `keys` for all its members; each stream gets the round's events
    // as one batch, delivered in a task of its own, so that a stream that reads nothing holds up
    // only its own grants, not the next round.
    async fn lease_rounds(self: &Arc<Self>, keys: &[String]) {
        let rounds: Vec<Vec<Delivery>> = futures::stream::iter(keys.to_vec())
            .map(|key| {
                let inner = self.clone();
                async move { inner.lease_round(&key).await }
            })
            .buffer_unordered(LEASES_IN_FLIGHT)
            .collect()
            .await;
        let mut batches: HashMap<u64, Batch> = HashMap::new();
        for (member, sender, event, grant) in rounds.into_iter().flatten() {
            let batch = batches.entry(member.0).or_insert_with(|| Batch {
                sender,
                events: Vec::new(),
                grants: Vec::new(),
            });
            batch.events.push(event);
            batch.grants.extend(grant);
        }
        for batch in batches.into_values() {
            let inner = self.clone();
            tokio::spawn(async move {
                if batch.sender.send_timeout(batch.events, TICK).await.is_err() {
                    join_all(
                        batch.grants.iter().map(|(target, requests)| inner.give_back(target, *requests)),
                    )
                    .await;
                }
            });
        }
    }

    // One lease of the bucket `key` for all its members: the event for each member, with the
    // grant to give back if it cannot be delivered.
    async fn lease_round(&self, key: &str) -> Vec<Delivery> {
        let (target, members, owed) = {
            let mut buckets = self.lock();
            let Some(bucket) = buckets.get_mut(key) else { return Vec::new() };
            bucket.leased_at = Some(std::time::Instant::now());
            let tick_ms = TICK.as_millis() as u64;
            let members: Vec<(MemberId, f64, u64)> = bucket
                .members
                .iter()
                .map(|(id, m)| (id.clone(), m.demand, assign::cap(m.demand, tick_ms)))
                .collect();
            (bucket.target.clone(), members, bucket.owed_replica)
        };
        let demand: f64 = members.iter().map(|(_, d, _)| d).sum();
        let cap: u64 = members.iter().map(|(_, _, c)| c).sum();
        match self.limiter.lease(&target, &self.replica, demand, cap, owed, TICK.as_millis() as u64 / 2).await
        {
            Ok((requests, owed)) => {
                metrics::counter!("tollgate_rlqs_leased_requests_total").increment(requests);
                let (grants, spare) = {
                    let mut buckets = self.lock();
                    match buckets.get_mut(key) {
                        Some(bucket) => {
                            bucket.owed_replica = owed;
                            assign::split(requests, &members, &mut bucket.owed)
                        }
                        None => (Vec::new(), requests),
                    }
                };
                let mut unsent = spare;
                let mut deliveries = Vec::new();
                for (member, requests) in grants {
                    match self.sender(key, &member) {
                        Some(sender) => {
                            let event = Event::Grant { bucket: member.1.clone(), requests };
                            deliveries.push((member, sender, event, Some((target.clone(), requests))));
                        }
                        None => unsent += requests,
                    }
                }
                self.give_back(&target, unsent).await;
                deliveries
            }
            Err(error) => {
                if let Some(held_back) = logs::throttled("rlqs_lease_failed") {
                    tracing::warn!(domain = %target.domain.name, error = %ErrorChain(&error), held_back, "could not lease from the store; applying the failure mode");
                }
                let mode = target.domain.failure_mode;
                members
                    .into_iter()
                    .filter_map(|(member, _, _)| {
                        let sender = self.sender(key, &member)?;
                        let event = Event::StoreFailed { bucket: member.1.clone(), mode };
                        Some((member, sender, event, None))
                    })
                    .collect()
            }
        }
    }

    // The events channel of a member of `key`, if it is still there.
    fn sender(&self, key: &str, member: &MemberId) -> Option<mpsc::Sender<Events>> {
        self.lock().get(key).and_then(|b| b.members.get(member)).map(|m| m.events.clone())
    }

    async fn give_back(&self, target: &Leasable, requests: u64) {
        if requests == 0 {
            return;
        }
        metrics::counter!("tollgate_rlqs_refunded_requests_total").increment(requests);
        if let Err(error) = self.limiter.give_back(target, requests).await {
            metrics::counter!("tollgate_store_refund_failures_total").increment(1);
            if let Some(held_back) = logs::throttled("rlqs_refund_failed") {
                tracing::warn!(domain = %target.domain.name, error = %ErrorChain(&error), held_back, "could not give unused lease back");
            }
        }
    }
}
