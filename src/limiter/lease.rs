//! Leases: what a protocol whose clients enforce limits themselves (Envoy's Rate Limit Quota
//! Service) asks of the decision core.
//!
//! Such a client names a bucket by an id, which [`Limiter::quota_bucket`] maps to a rule exactly
//! as an RLS descriptor is (the tree walk is [`crate::config::Domain::bucket_entries`]), so both
//! protocols reach the same bucket and spend one budget. The client then admits requests on its
//! own, from tokens it was leased: [`Limiter::lease`] takes a member's share of the bucket up
//! front, in proportion to the demand every tollgate replica registers for it in the store, and
//! [`Limiter::give_back`] returns tokens a client can provably no longer use. When a client's
//! stream closes, what it may still have used is parked in the store for its next stream, on any
//! replica, to settle ([`Limiter::note_lease`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::{Limiter, Plan, QueryDescriptor};
use crate::bucket::{BucketOp, BucketSpec, Charge, Role};
use crate::config::Domain;
use crate::store::{self, DemandNote, LateReply, LeaseNote, Parked, StoreError};
use crate::telemetry::traces;
use tracing::Instrument as _;

/// What a quota bucket id gets.
#[derive(Debug, Clone)]
pub enum QuotaBucket {
    /// A bucket limits it: lease from it.
    Lease(Leasable),
    /// No limit applies: an `unlimited` rule, or a rule in shadow mode.
    Unlimited(Arc<Domain>),
    /// No rule matches (or entries are left over); `None` for an unknown domain.
    Unknown(Option<Arc<Domain>>),
}

/// A bucket that can be leased from.
#[derive(Debug, Clone)]
pub struct Leasable {
    /// Its storage key (the same as for RLS requests with the same entries).
    pub key: String,
    /// Its capacity and rate.
    pub spec: BucketSpec,
    /// Tokens per request.
    pub cost: u64,
    /// Its domain (failure mode, metrics).
    pub domain: Arc<Domain>,
}

/// How long a registered demand stands without being renewed, in milliseconds.
pub const DEMAND_TTL_MS: u64 = 3_000;
/// How long a lease's store calls may take: no request waits on them (a late one delays a grant),
/// so not the request deadline, under which a burst of leases queued into failure answers; within
/// the second that a reply past its caller's deadline can still be refunded in.
pub const BACKGROUND_DEADLINE: Duration = Duration::from_millis(500);
/// How long a closed stream's grants stay parked for the Envoy's next stream, and a stream counts
/// as alive after its last report, in milliseconds: Envoy reports every 5 s, and reopens a
/// stream at its next report.
pub const PARKED_TTL_MS: u64 = 10_000;

impl Limiter {
    /// The bucket a quota bucket id of `domain` stands for.
    pub async fn quota_bucket(&self, domain: &str, bucket: &HashMap<String, String>) -> QuotaBucket {
        let rules = self.rules.load_full();
        let Some(domain) = rules.domain(domain) else { return QuotaBucket::Unknown(None) };
        let Some(entries) = domain.bucket_entries(bucket) else {
            return QuotaBucket::Unknown(Some(domain.clone()));
        };
        let descriptor = QueryDescriptor { entries, hits: 1, credit: false, limit: None };
        let mut plans = vec![self.plan(domain, &descriptor)];
        self.resolve_quotas(domain, &mut plans).await;
        match plans.pop() {
            Some(Plan::Bucket(p)) if p.role != Role::Shadow => QuotaBucket::Lease(Leasable {
                key: p.bucket.key,
                spec: p.spec.expect("quotas resolved"),
                cost: p.rule.map_or(1, |r| r.cost.max(1)),
                domain: domain.clone(),
            }),
            Some(Plan::Bucket(_) | Plan::Unlimited(_)) => QuotaBucket::Unlimited(domain.clone()),
            Some(Plan::Free) | None => QuotaBucket::Unknown(Some(domain.clone())),
        }
    }

    /// Takes `member`'s share of what `target` holds this round, in whole requests, at most
    /// `cap`; members lease once a round, at about the same time, and a take counts for the
    /// others for `round_ms` (less than a round). `demand` (requests per second) is
    /// registered for `member` first; the share is its part of every member's standing demand,
    /// of the bucket's balance plus what the other members took this round, so that whoever
    /// leases later in a round is not left a share of the remainder. `owed` is the fraction of a
    /// request the member was entitled to but not given last time (small shares add up over
    /// leases instead of rounding to nothing); returns the requests taken and what is owed now.
    pub async fn lease(
        &self,
        target: &Leasable,
        member: &str,
        demand: f64,
        cap: u64,
        owed: f64,
        round_ms: u64,
    ) -> Result<(u64, f64), StoreError> {
        // A trace of its own per lease (no request leads to it): the store calls are its children.
        let span = tracing::trace_span!(
            target: traces::TARGET,
            "rlqs.lease",
            domain = %target.domain.name,
            demand,
            requests = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let calls = self.lease_untraced(target, member, demand, cap, owed, round_ms).instrument(span.clone());
        let result = store::with_deadline(BACKGROUND_DEADLINE, calls).await;
        match &result {
            Ok((requests, _)) => {
                span.record("requests", requests);
                span.record("outcome", "ok");
            }
            Err(_) => {
                span.record("outcome", "error");
            }
        }
        result
    }

    async fn lease_untraced(
        &self,
        target: &Leasable,
        member: &str,
        demand: f64,
        cap: u64,
        owed: f64,
        round_ms: u64,
    ) -> Result<(u64, f64), StoreError> {
        let shared =
            self.store.share_demand(&target.key, member, DemandNote::Ask(demand), DEMAND_TTL_MS).await?;
        let share = if shared.total > 0.0 { (demand / shared.total).clamp(0.0, 1.0) } else { 1.0 };
        // What the bucket holds now: a check takes nothing.
        let check = self.op(target, 0.0, Charge::Admitted);
        let balance = match self.store_call(&[vec![check]], LateReply::Keep).await.pop() {
            Some(Ok(outcome)) => outcome.verdicts[0].tokens,
            Some(Err(e)) => return Err(e),
            None => return Ok((0, owed)),
        };
        let cost = target.cost as f64;
        let balance = balance.max(0.0);
        let round = (balance + shared.taken_by_others) * share;
        let entitled = round.min(balance) / cost + owed;
        let want = (entitled.floor() as u64).min(cap);
        let owed = (entitled - want as f64).clamp(0.0, 1.0);
        if want == 0 {
            return Ok((0, owed));
        }
        // Take up to `want` requests' tokens: charged always down to zero, so another replica's
        // take in between leaves this one with what is there, never below zero.
        let need = want as f64 * cost;
        let take = self.op(target, need, Charge::Always { max_debt: 0.0 });
        let taken = match self.store_call(&[vec![take]], LateReply::GiveBack).await.pop() {
            Some(Ok(outcome)) => need - outcome.verdicts[0].forgiven,
            Some(Err(e)) => return Err(e),
            None => return Ok((0, owed)),
        };
        let requests = (taken / cost).floor().max(0.0) as u64;
        let spare = taken - requests as f64 * cost;
        if spare > 0.0 {
            self.credit(target, spare).await?;
        }
        // Seen by the members that lease after this one in the round. Failing to record it only
        // makes their next share a little smaller: what was taken stands.
        let took = DemandNote::Took(requests as f64 * cost);
        let _ = self.store.share_demand(&target.key, member, took, round_ms).await;
        Ok((requests, owed))
    }

    /// Tells `target`'s parked-lease registry what `stream` of the Envoy named `envoy` did
    /// ([`LeaseNote`]); a claim returns what a closed stream of that Envoy parked.
    pub async fn note_lease(
        &self,
        target: &Leasable,
        envoy: &str,
        stream: &str,
        note: LeaseNote,
    ) -> Result<Option<Parked>, StoreError> {
        let call = self.store.note_lease(&target.key, envoy, stream, note, PARKED_TTL_MS);
        store::with_deadline(BACKGROUND_DEADLINE, call).await
    }

    /// Gives `requests` requests' tokens back to `target`.
    pub async fn give_back(&self, target: &Leasable, requests: u64) -> Result<(), StoreError> {
        store::with_deadline(BACKGROUND_DEADLINE, self.credit(target, requests as f64 * target.cost as f64))
            .await
    }

    async fn credit(&self, target: &Leasable, tokens: f64) -> Result<(), StoreError> {
        let credit = self.op(target, -tokens, Charge::Admitted);
        match self.store_call(&[vec![credit]], LateReply::Keep).await.pop() {
            Some(Err(e)) => Err(e),
            _ => Ok(()),
        }
    }

    fn op(&self, target: &Leasable, need: f64, charge: Charge) -> BucketOp {
        BucketOp { key: target.key.clone(), spec: target.spec, need, role: Role::Shadow, charge }
    }
}
