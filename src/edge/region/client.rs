//! A region's side of `tollgate.region.v1.RegionLeases` (`--global-url`): every round
//! ([`RENEW_EVERY`], or at once when a bucket wants its first lease) this replica renews its
//! shares of the global buckets its requests asked for ([`GlobalShares::due`]) in one call per
//! [`MAX_BUCKETS_PER_CALL`], and hands the answers back ([`GlobalShares::answered`]). One round
//! runs at a time, so one renewal per bucket is in flight. A round that gets no answer within
//! [`RENEW_TIMEOUT`] is dropped: the shares keep the life they have, and the next round asks
//! again. Money leases of global budgets are renewed the same way on a loop of their own
//! ([`renew_budgets_forever`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use super::proto::region_leases_client::RegionLeasesClient;
use super::proto::{BucketLease, BucketRenewal, BudgetLevelRenewal, BudgetRenewRequest, Entry, RenewRequest};
use super::MAX_BUCKETS_PER_CALL;
use crate::bucket::{LeaseOp, LeaseOutcome, Others};
use crate::budget::{LeaseReading, Money};
use crate::clock::Clock;
use crate::edge::client_tls::ClientTlsFiles;
use crate::limiter::{
    BudgetGrant, BudgetRenewal, GlobalBudgets, GlobalShares, Granted, Limiter, Renewal, MAX_BUDGET_LEASES,
    RENEW_EVERY,
};
use crate::telemetry::logs;

/// How long a round waits for the global tier's answer.
pub const RENEW_TIMEOUT: Duration = Duration::from_secs(1);
/// How soon a round follows one whose leases came back short: the others' leases shrink at
/// their own rounds, and this one learns of it only by asking again.
const SHORT_AGAIN: Duration = Duration::from_millis(200);

/// The global tier at `url` could not be used.
#[derive(Debug, thiserror::Error)]
#[error("--global-url {url}: {why}")]
pub struct BadUrl {
    url: String,
    why: String,
}

/// The global tier at `url`, over TLS made from `tls` when it is `https://` (the web's roots when
/// no CA is given; a client certificate for a global tier that requires one).
pub fn endpoint(url: &str, tls: &ClientTlsFiles) -> Result<Endpoint, BadUrl> {
    let bad = |why: String| BadUrl { url: url.to_owned(), why };
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .map_err(|e| bad(e.to_string()))?
        .connect_timeout(RENEW_TIMEOUT)
        .tcp_nodelay(true)
        // A connection a partition left dead is found by its pings within two seconds and made
        // again, rather than after the kernel's TCP timeouts.
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(1))
        .keep_alive_while_idle(true);
    if url.starts_with("https://") {
        let config = tls.config().map_err(bad)?;
        endpoint = endpoint.tls_config(config).map_err(|e| bad(format!("TLS: {e}")))?;
    }
    Ok(endpoint)
}

/// Renews `shares` on the global tier at `endpoints` until dropped, on `clock` (the limiter's).
/// A round that fails makes the next on a new connection to the next endpoint: one a partition
/// left half-open (its handshake lost) may otherwise hold every round until its pings give it up,
/// and a global replica that is gone is left for another. Every global replica sets the same
/// lease (this replica's, to an absolute size), so moving between them counts nothing twice.
pub async fn renew_forever(shares: Arc<GlobalShares>, endpoints: Vec<Endpoint>, clock: Arc<dyn Clock>) {
    let mut at = 0;
    let mut client = RegionLeasesClient::new(endpoints[at].connect_lazy());
    let mut next = RENEW_EVERY;
    loop {
        tokio::select! {
            () = tokio::time::sleep(next) => {}
            () = shares.wanted.notified() => {}
        }
        let renewals = shares.due(clock.now_ms());
        let mut short = false;
        for round in renewals.chunks(MAX_BUCKETS_PER_CALL) {
            match renew(&shares, &mut client, round, clock.as_ref()).await {
                Some(cut) => short |= cut,
                None => {
                    at = (at + 1) % endpoints.len();
                    client = RegionLeasesClient::new(endpoints[at].connect_lazy());
                }
            }
        }
        next = if short { SHORT_AGAIN } else { RENEW_EVERY };
        let cut_off = shares.cut_off_for_ms(clock.now_ms()).unwrap_or(0);
        metrics::gauge!("tollgate_global_cut_off_seconds").set(cut_off as f64 / 1000.0);
    }
}

async fn renew(
    shares: &GlobalShares,
    client: &mut RegionLeasesClient<Channel>,
    round: &[Renewal],
    clock: &dyn Clock,
) -> Option<bool> {
    let buckets = round
        .iter()
        .map(|r| BucketRenewal {
            domain: r.domain.clone(),
            entries: entries(&r.entries),
            capacity: r.ask.capacity,
            refill_per_second: r.ask.refill_per_second,
            demand: r.demand,
            fresh: r.ask.fresh,
            ..BucketRenewal::default()
        })
        .collect();
    let request = RenewRequest { region: shares.leaseholder().to_owned(), buckets };
    let answer = tokio::time::timeout(RENEW_TIMEOUT, client.renew(request)).await;
    match answer {
        Ok(Ok(answer)) => {
            let answer = answer.into_inner();
            let granted = round.iter().zip(answer.leases.iter().map(Some).chain(std::iter::repeat(None)));
            let answers = granted
                .map(|(r, lease)| {
                    let g = lease.filter(|l| l.known).map(|l| Granted {
                        bucket: (l.bucket_capacity, l.bucket_refill_per_second, l.cost),
                        capacity: l.capacity,
                        rate: l.refill_per_second,
                        others_demand: l.others_demand,
                        ttl_ms: if l.ttl_ms > 0 { l.ttl_ms } else { answer.ttl_ms },
                    });
                    (r.key.clone(), g)
                })
                .collect();
            metrics::counter!("tollgate_global_rounds_total", "outcome" => "ok").increment(1);
            Some(shares.answered(answers, clock.now_ms()))
        }
        Ok(Err(status)) => {
            shares.failed(round, clock.now_ms());
            round_failed(Some(&status), "shares of global buckets");
            None
        }
        Err(_) => {
            shares.failed(round, clock.now_ms());
            round_failed(None, "shares of global buckets");
            None
        }
    }
}

/// Renews this replica's money leases of global budgets (`budgets`, read and sized through
/// `limiter`) on the global tier at `endpoints` until dropped, every [`RENEW_EVERY`] or at once
/// when a level wants its first lease; a failed round moves to the next endpoint, as
/// [`renew_forever`] does (a renewal reports a total and asks for an absolute grant, so sending
/// it to another global replica counts nothing twice).
pub async fn renew_budgets_forever(
    limiter: Arc<Limiter>,
    budgets: Arc<GlobalBudgets>,
    endpoints: Vec<Endpoint>,
    clock: Arc<dyn Clock>,
) {
    let mut at = 0;
    let mut client = RegionLeasesClient::new(endpoints[at].connect_lazy());
    loop {
        tokio::select! {
            () = tokio::time::sleep(RENEW_EVERY) => {}
            () = budgets.wanted.notified() => {}
        }
        let renewals = limiter.budget_renewals().await;
        for round in renewals.chunks(MAX_BUDGET_LEASES) {
            if !renew_budgets(&budgets, &mut client, round, clock.as_ref()).await {
                at = (at + 1) % endpoints.len();
                client = RegionLeasesClient::new(endpoints[at].connect_lazy());
            }
        }
        if renewals.is_empty() {
            budgets.answered(Vec::new(), clock.now_ms());
        }
    }
}

/// At drain, after the last request: hands this replica's money leases back down to what it has
/// committed (one round, tried at each endpoint in turn within [`RENEW_TIMEOUT`] each), so that
/// a replica stopped in a rolling restart or a scale-down does not leave the unspent part of its
/// grants to lapse and be charged whole. A replica that cannot reach the global tier leaves them
/// to lapse, as a cut-off one does.
pub async fn hand_back_budgets(
    limiter: &Limiter,
    budgets: &GlobalBudgets,
    endpoints: &[Endpoint],
    clock: &dyn Clock,
) {
    budgets.end();
    let renewals = limiter.budget_renewals().await;
    if renewals.is_empty() {
        return;
    }
    for round in renewals.chunks(MAX_BUDGET_LEASES) {
        let mut handed = false;
        for endpoint in endpoints {
            let mut client = RegionLeasesClient::new(endpoint.connect_lazy());
            if renew_budgets(budgets, &mut client, round, clock).await {
                handed = true;
                break;
            }
        }
        if handed {
            tracing::info!(
                leases = round.len(),
                "money leases of global budgets handed back down to what this replica committed"
            );
        } else {
            tracing::warn!(leases = round.len(), "could not hand money leases back at drain; the global tier charges them whole when they lapse");
        }
    }
}

// One call; false when it failed.
async fn renew_budgets(
    budgets: &GlobalBudgets,
    client: &mut RegionLeasesClient<Channel>,
    round: &[BudgetRenewal],
    clock: &dyn Clock,
) -> bool {
    let nanos = |m: Money| u64::try_from(m.0).unwrap_or(u64::MAX);
    let levels = round
        .iter()
        .map(|r| BudgetLevelRenewal {
            domain: r.domain.clone(),
            entries: entries(&r.entries),
            period_end_ms: r.period_end_ms,
            spent_nanos: nanos(r.report.spent),
            wanted_nanos: nanos(r.report.wanted),
            round: r.report.round,
        })
        .collect();
    let sent_ms = clock.now_ms();
    let request = BudgetRenewRequest { region: budgets.leaseholder().to_owned(), levels };
    match tokio::time::timeout(RENEW_TIMEOUT, client.renew_budgets(request)).await {
        Ok(Ok(answer)) => {
            let answer = answer.into_inner();
            let leases = answer.levels.into_iter().map(Some).chain(std::iter::repeat(None));
            let answers = round
                .iter()
                .cloned()
                .zip(leases)
                .map(|(r, lease)| {
                    let grant = lease.filter(|l| l.known).map(|l| BudgetGrant {
                        reading: LeaseReading {
                            granted: Money(l.granted_nanos.into()),
                            spent: Money(l.spent_nanos.into()),
                            held: Money(l.held_nanos.into()),
                            end_ms: l.period_end_ms,
                        },
                        amount: Money(l.amount_nanos.into()),
                        ttl_ms: l.ttl_ms,
                    });
                    (r, grant)
                })
                .collect();
            metrics::counter!("tollgate_global_rounds_total", "outcome" => "ok").increment(1);
            budgets.answered(answers, sent_ms);
            true
        }
        Ok(Err(status)) => {
            round_failed(Some(&status), "money leases of global budgets");
            false
        }
        Err(_) => {
            round_failed(None, "money leases of global budgets");
            false
        }
    }
}

/// RLQS leases of global buckets, in a region: each stream of this replica's RLQS service holds a
/// lease of its own at the global tier (a leaseholder beneath the region, named by the replica and
/// the stream's number), which its
/// Envoy enforces as a local bucket, as a stream's lease of a regional bucket is set in the
/// region's store. Set in calls of their own, beside the shares' rounds; a failed call moves to
/// the next endpoint, as the rounds do.
pub struct GlobalLeases {
    region: String,
    endpoints: Vec<Endpoint>,
    client: Mutex<(usize, RegionLeasesClient<Channel>)>,
}

/// A global bucket as the global tier names it: its domain and descriptor entries.
#[derive(Debug, Clone)]
pub struct GlobalName {
    /// The domain.
    pub domain: String,
    /// The descriptor entries, as an RLS request names the bucket.
    pub entries: Arc<[(String, String)]>,
}

/// Why a stream's lease could not be set at the global tier.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GlobalLeaseError {
    /// No answer in time.
    #[error("no answer from the global tier within {0:?}")]
    Timeout(Duration),
    /// The global tier refused the call, or could not set it.
    #[error("the global tier answered {0}")]
    Refused(String),
    /// No rule marked `global: true` limits the bucket at the global tier.
    #[error("no rule marked global: true limits the bucket at the global tier")]
    Unknown,
    /// The lease lives shorter than asked: a global tier that does not know a renewal's own life
    /// (older than this region). Assignments made from it could outlive it, so none are.
    #[error(
        "the global tier gave the lease {0} ms of life, not the {1} ms asked (is it older than this region?)"
    )]
    ShortLife(u64, u64),
}

impl GlobalLeases {
    /// Leases set beneath `region` on the global tier at `endpoints`.
    pub fn new(region: String, endpoints: Vec<Endpoint>) -> Self {
        let client = RegionLeasesClient::new(endpoints[0].connect_lazy());
        GlobalLeases { region, endpoints, client: Mutex::new((0, client)) }
    }

    /// Sets `ops`, each with the name of its bucket at the global tier, in one call, each op's
    /// leaseholder (a stream's, which names its replica) beneath the region: one result per op.
    pub async fn lease(&self, ops: &[(LeaseOp, &GlobalName)]) -> Vec<Result<LeaseOutcome, GlobalLeaseError>> {
        let buckets = ops
            .iter()
            .map(|(op, name)| BucketRenewal {
                domain: name.domain.clone(),
                entries: entries(&name.entries),
                capacity: op.capacity,
                refill_per_second: op.refill_per_second,
                demand: op.demand,
                fresh: op.fresh,
                holder: op.replica.clone(),
                ttl_ms: op.ttl_ms,
                of_unleased: op.of_unleased,
            })
            .collect();
        let request = RenewRequest { region: self.region.clone(), buckets };
        let mut client = self.client.lock().unwrap_or_else(|e| e.into_inner()).1.clone();
        let failed = |error: GlobalLeaseError| {
            let mut current = self.client.lock().unwrap_or_else(|e| e.into_inner());
            let next = (current.0 + 1) % self.endpoints.len();
            *current = (next, RegionLeasesClient::new(self.endpoints[next].connect_lazy()));
            ops.iter().map(|_| Err(error.clone())).collect()
        };
        let answer = match tokio::time::timeout(RENEW_TIMEOUT, client.renew(request)).await {
            Ok(Ok(answer)) => answer.into_inner(),
            Ok(Err(status)) => {
                return failed(GlobalLeaseError::Refused(format!("{}: {}", status.code(), status.message())))
            }
            Err(_) => return failed(GlobalLeaseError::Timeout(RENEW_TIMEOUT)),
        };
        let leases = answer.leases.iter().map(Some).chain(std::iter::repeat(None));
        let life = |l: &BucketLease| if l.ttl_ms > 0 { l.ttl_ms } else { answer.ttl_ms };
        ops.iter()
            .zip(leases)
            .map(|((op, _), lease)| match lease {
                Some(l) if l.known && life(l) < op.ttl_ms => {
                    Err(GlobalLeaseError::ShortLife(life(l), op.ttl_ms))
                }
                Some(l) if l.known => Ok(LeaseOutcome {
                    // The answer carries no clock: a stream's lease is timed on this replica's.
                    now_ms: 0,
                    capacity: l.capacity,
                    refill_per_second: l.refill_per_second,
                    others: Others {
                        capacity: l.others_capacity,
                        refill_per_second: l.others_refill_per_second,
                        demand: l.others_demand,
                    },
                    // The global tier counts a lease it refused for its leaseholders; the region
                    // sees a lease of nothing.
                    refused: false,
                }),
                _ => Err(GlobalLeaseError::Unknown),
            })
            .collect()
    }
}

// Descriptor entries as the region protocol names a bucket or a budget level.
fn entries(entries: &[(String, String)]) -> Vec<Entry> {
    entries.iter().map(|(k, v)| Entry { key: k.clone(), value: v.clone() }).collect()
}

// A round of `what` that failed (`status`: the global tier's answer; `None`: none in time):
// counted, and logged once in a while.
fn round_failed(status: Option<&tonic::Status>, what: &'static str) {
    metrics::counter!("tollgate_global_rounds_total", "outcome" => "failed").increment(1);
    if let Some(held_back) = logs::throttled(what) {
        let why = match status {
            Some(status) => format!("{}: {}", status.code(), status.message()),
            None => format!("no answer within {RENEW_TIMEOUT:?}"),
        };
        tracing::warn!(
            why,
            held_back,
            "could not renew this region's {what}; they keep their life, then deny"
        );
    }
}
