//! A region's side of `tollgate.region.v1.RegionLeases` (`--global-url`): every round
//! ([`RENEW_EVERY`], or at once when a bucket wants its first lease) this replica renews its
//! shares of the global buckets its requests asked for ([`GlobalShares::due`]) in one call per
//! [`MAX_BUCKETS_PER_CALL`], and hands the answers back ([`GlobalShares::answered`]). One round
//! runs at a time, so one renewal per bucket is in flight. A round that gets no answer within
//! [`RENEW_TIMEOUT`] is dropped: the shares keep the life they have, and the next round asks
//! again. Money leases of global budgets are renewed the same way on a loop of their own
//! ([`renew_budgets_forever`]).

use std::sync::Arc;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use super::proto::region_leases_client::RegionLeasesClient;
use super::proto::{BucketRenewal, BudgetLevelRenewal, BudgetRenewRequest, Entry, RenewRequest};
use super::MAX_BUCKETS_PER_CALL;
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
            entries: r.entries.iter().map(|(k, v)| Entry { key: k.clone(), value: v.clone() }).collect(),
            capacity: r.ask.capacity,
            refill_per_second: r.ask.refill_per_second,
            demand: r.demand,
            fresh: r.ask.fresh,
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
            entries: r.entries.iter().map(|(k, v)| Entry { key: k.clone(), value: v.clone() }).collect(),
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
