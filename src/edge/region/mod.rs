//! The global tier's side of limits that hold across regions: `tollgate.region.v1.RegionLeases`
//! (`proto/tollgate/region/v1/region.proto`), served with `--global-tier`.
//!
//! A region renews its leases of the buckets of rules marked `global: true`, many per call. Each
//! renewal is a lease op ([`crate::bucket::lease`]) whose leaseholder is the region (or one
//! beneath it: an RLQS stream of one of its replicas, asking its own life and part of the
//! unleased rate), setting its lease to an absolute size, so a renewal sent twice (a retry after a lost answer, or to another
//! global replica) takes nothing more; the global tier's own RLS requests spend what the leases
//! leave. The region keeps its spending inside its lease by the discipline of
//! [`crate::bucket::Share`]; `tests/global_props.rs` checks the bound of both together.
//!
//! Nothing a caller sends is trusted beyond its own leases: a region name is bounded and free of
//! whitespace (the store's lease field separates by it), sizes are finite and cut to the bucket,
//! a call carries a bounded number of buckets, and entries resolve to a bucket only through a
//! rule marked `global: true`; a money report above the budget's amount is cut to it. The
//! service sets leases that take capacity from every other client of a bucket: it serves only
//! the regions, each by its certificate ([`RegionAuth`], in `auth.rs`).

use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use crate::bucket::{is_parked, LeaseOp, LeaseOutcome, MAX_LEASEHOLDERS};
use crate::budget::{LeaseReport, Money};
use crate::limiter::{LeasedBucket, Limiter, MAX_BUDGET_LEASES, YOUNG_OF_UNLEASED};

mod auth;
pub mod client;

pub use self::auth::RegionAuth;

/// The generated types and service of `tollgate.region.v1`.
pub mod proto {
    #![allow(missing_docs, unused_qualifications, clippy::all, clippy::pedantic)]
    tonic::include_proto!("tollgate.region.v1");
}

use self::proto::region_leases_server::RegionLeases;
use self::proto::{
    BucketLease, BudgetLevelLease, BudgetRenewRequest, BudgetRenewResponse, RenewRequest, RenewResponse,
};

/// How long a region's lease lives at the global tier after the renewal that set it arrived; the
/// region's share lives as long after the renewal was sent, so it ends first.
pub const GLOBAL_LEASE_TTL: Duration = Duration::from_secs(10);
/// How long a parked lease lives (no rate, at most one request's tokens): a region renews it
/// seldom, and one that is gone keeps no more than a request's tokens from the others this long.
pub const PARKED_LEASE_TTL: Duration = Duration::from_secs(60);
/// The shortest life a renewal may ask for its lease: a lease that ends before its answer could
/// come back serves nothing.
const MIN_ASKED_TTL: Duration = Duration::from_secs(1);
/// Most buckets one renewal call may carry.
pub const MAX_BUCKETS_PER_CALL: usize = 10_000;
/// Most entries a bucket may be named by, and the longest key or value.
const MAX_ENTRIES: usize = 64;
const MAX_ENTRY_LEN: usize = 1_024;
/// The longest leaseholder name (`<region>/<replica>`, the replica a host name and more).
const MAX_REGION_LEN: usize = 256;

/// The service.
pub struct RegionLeasesGrpc {
    limiter: Arc<Limiter>,
    auth: RegionAuth,
}

impl RegionLeasesGrpc {
    /// The service, setting leases through `limiter` for the callers `auth` allows.
    pub fn new(limiter: Arc<Limiter>, auth: RegionAuth) -> Self {
        RegionLeasesGrpc { limiter, auth }
    }
}

#[tonic::async_trait]
impl RegionLeases for RegionLeasesGrpc {
    async fn renew(&self, request: Request<RenewRequest>) -> Result<Response<RenewResponse>, Status> {
        self.auth.check(&request, &request.get_ref().region)?;
        let renew = request.into_inner();
        let region = &renew.region;
        check_region(region)?;
        if renew.buckets.len() > MAX_BUCKETS_PER_CALL {
            return Err(Status::invalid_argument(format!(
                "{} buckets in one call; at most {MAX_BUCKETS_PER_CALL}",
                renew.buckets.len()
            )));
        }
        // A region's replicas and their RLQS streams are its leaseholders: one call naming more
        // than a bucket may have is refused whole, rather than walking them inside one script
        // (one renewal naming 3,000 ran 11.8 s and starved every other region).
        let holders: std::collections::HashSet<&str> =
            renew.buckets.iter().map(|b| b.holder.as_str()).collect();
        if holders.len() > MAX_LEASEHOLDERS {
            metrics::counter!("tollgate_leaseholders_refused_total", "by" => "region").increment(1);
            return Err(Status::invalid_argument(format!(
                "{} leaseholders in one call; at most {MAX_LEASEHOLDERS} a region",
                holders.len()
            )));
        }
        let mut found: Vec<Option<(LeasedBucket, LeaseOp)>> = Vec::with_capacity(renew.buckets.len());
        for b in &renew.buckets {
            let sizes = [b.capacity, b.refill_per_second, b.demand];
            if sizes.iter().any(|x| !x.is_finite() || *x < 0.0) {
                return Err(Status::invalid_argument("capacity, rate and demand: finite, not negative"));
            }
            if b.ttl_ms != 0 && !(MIN_ASKED_TTL..=PARKED_LEASE_TTL).contains(&Duration::from_millis(b.ttl_ms))
            {
                return Err(Status::invalid_argument("ttl_ms: 0, or 1,000 to 60,000"));
            }
            if !(b.of_unleased.is_finite() && (0.0..=1.0).contains(&b.of_unleased)) {
                return Err(Status::invalid_argument("of_unleased: 0, or above 0 and at most 1"));
            }
            let holder = if b.holder.is_empty() {
                format!("region:{region}")
            } else {
                check_region(&b.holder)?;
                format!("region:{region}/{}", b.holder)
            };
            let entries = entries(&b.entries)?;
            found.push(self.limiter.global_bucket(&b.domain, &entries).await.map(|bucket| {
                // Capacity 0 with no rate is a release, not a parking.
                let parked = b.capacity > 0.0 && is_parked(b.capacity, b.refill_per_second, bucket.cost);
                let ttl = match b.ttl_ms {
                    0 if parked => PARKED_LEASE_TTL,
                    0 => GLOBAL_LEASE_TTL,
                    asked => Duration::from_millis(asked),
                };
                let op = LeaseOp {
                    key: bucket.key.clone(),
                    spec: bucket.spec,
                    replica: holder,
                    capacity: b.capacity.min(bucket.spec.capacity()),
                    unit: bucket.cost as f64,
                    refill_per_second: b.refill_per_second.min(bucket.spec.refill_per_second()),
                    // A first lease cannot know how many regions start beside it: most of what
                    // the others leave (as an RLQS replica's first lease).
                    of_unleased: match b.of_unleased {
                        0.0 if b.fresh => YOUNG_OF_UNLEASED,
                        0.0 => 1.0,
                        asked => asked,
                    },
                    ttl_ms: ttl.as_millis() as u64,
                    demand: b.demand,
                    fresh: b.fresh,
                };
                (bucket, op)
            }));
        }
        let ops: Vec<LeaseOp> = found.iter().flatten().map(|(_, op)| op.clone()).collect();
        let mut results = self.limiter.lease(&ops).await.into_iter();
        let mut leases = Vec::with_capacity(found.len());
        for f in &found {
            let Some((bucket, op)) = f else {
                metrics::counter!("tollgate_global_renewals_total", "outcome" => "unknown").increment(1);
                leases.push(BucketLease::default());
                continue;
            };
            match results.next().expect("one result per op") {
                Ok(outcome) => {
                    metrics::counter!("tollgate_global_renewals_total", "outcome" => "ok").increment(1);
                    if outcome.refused {
                        metrics::counter!("tollgate_leaseholders_refused_total", "by" => "bucket")
                            .increment(1);
                    }
                    leases.push(lease(bucket, op, &outcome));
                }
                Err(error) => {
                    metrics::counter!("tollgate_global_renewals_total", "outcome" => "store_failed")
                        .increment(1);
                    tracing::warn!(error = %crate::telemetry::logs::ErrorChain(&error), region = %region, "could not set a region's lease in the store");
                    // The region keeps its shares until they expire and renews at its next round.
                    return Err(Status::unavailable("the store did not answer"));
                }
            }
        }
        Ok(Response::new(RenewResponse { leases, ttl_ms: GLOBAL_LEASE_TTL.as_millis() as u64 }))
    }

    async fn renew_budgets(
        &self,
        request: Request<BudgetRenewRequest>,
    ) -> Result<Response<BudgetRenewResponse>, Status> {
        self.auth.check(&request, &request.get_ref().region)?;
        let renew = request.into_inner();
        let region = &renew.region;
        check_region(region)?;
        if renew.levels.len() > MAX_BUDGET_LEASES {
            return Err(Status::invalid_argument(format!(
                "{} levels in one call; at most {MAX_BUDGET_LEASES}",
                renew.levels.len()
            )));
        }
        let mut levels = Vec::with_capacity(renew.levels.len());
        for level in &renew.levels {
            let entries = entries(&level.entries)?;
            let report = LeaseReport {
                spent: Money(level.spent_nanos.into()),
                wanted: Money(level.wanted_nanos.into()),
                round: level.round,
            };
            let holder = format!("region:{region}");
            let leased = self
                .limiter
                .lease_budget(&level.domain, &entries, &holder, level.period_end_ms, report)
                .await;
            levels.push(match leased {
                None => {
                    metrics::counter!("tollgate_global_renewals_total", "outcome" => "unknown").increment(1);
                    BudgetLevelLease::default()
                }
                Some(Ok(grant)) => {
                    metrics::counter!("tollgate_global_renewals_total", "outcome" => "ok").increment(1);
                    let nanos = |m: Money| u64::try_from(m.0).unwrap_or(u64::MAX);
                    BudgetLevelLease {
                        known: true,
                        period_end_ms: grant.reading.end_ms,
                        granted_nanos: nanos(grant.reading.granted),
                        amount_nanos: nanos(grant.amount),
                        spent_nanos: nanos(grant.reading.spent),
                        held_nanos: nanos(grant.reading.held),
                        ttl_ms: grant.ttl_ms,
                    }
                }
                Some(Err(error)) => {
                    metrics::counter!("tollgate_global_renewals_total", "outcome" => "store_failed")
                        .increment(1);
                    tracing::warn!(error = %crate::telemetry::logs::ErrorChain(&error), region = %region, "could not set a region's money lease in the store");
                    return Err(Status::unavailable("the store did not answer"));
                }
            });
        }
        Ok(Response::new(BudgetRenewResponse { levels }))
    }
}

// A leaseholder's name: the store's lease fields separate by whitespace.
fn check_region(region: &str) -> Result<(), Status> {
    if region.is_empty() || region.len() > MAX_REGION_LEN || region.chars().any(char::is_whitespace) {
        return Err(Status::invalid_argument("region: 1-256 characters, no whitespace"));
    }
    Ok(())
}

// Descriptor entries naming a bucket or a budget level, bounded.
fn entries(entries: &[proto::Entry]) -> Result<Vec<(&str, &str)>, Status> {
    if entries.len() > MAX_ENTRIES
        || entries.iter().any(|e| e.key.len() > MAX_ENTRY_LEN || e.value.len() > MAX_ENTRY_LEN)
    {
        return Err(Status::invalid_argument(format!(
            "a bucket or budget is named by at most {MAX_ENTRIES} entries of at most {MAX_ENTRY_LEN} bytes"
        )));
    }
    Ok(entries.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect())
}

fn lease(bucket: &LeasedBucket, op: &LeaseOp, outcome: &LeaseOutcome) -> BucketLease {
    BucketLease {
        ttl_ms: op.ttl_ms,
        known: true,
        bucket_capacity: bucket.spec.capacity(),
        bucket_refill_per_second: bucket.spec.refill_per_second(),
        cost: bucket.cost,
        capacity: outcome.capacity,
        refill_per_second: outcome.refill_per_second,
        others_capacity: outcome.others.capacity,
        others_refill_per_second: outcome.others.refill_per_second,
        others_demand: outcome.others.demand,
    }
}
