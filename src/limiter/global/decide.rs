//! A decision's global buckets in a region: taken from this replica's shares before the rest of
//! the request goes to the store, and given back when the request is not admitted after all (the
//! store denies, a concurrency limit is full, a take was a retry that takes nothing), so that a
//! share is spent by admitted requests only, as a bucket in the store is.
//!
//! A global op is an enforced debit of a rule marked `global: true`; others stay with the store.
//! A global op with no live share here after the first-lease wait falls back: to its part of the
//! bucket in the store (`global_fallback: {split: N}`), else to a denial.

use super::{GlobalShares, Taken, RENEW_EVERY};
use crate::bucket::{BucketOp, BucketSpec, Group, GroupOutcome, Role, Verdict};
use crate::config::{Domain, FailureMode};
use crate::limiter::{Decision, GlobalFallback, Limiter, Outcome, Plan, Query};
use crate::rule::ChargeRule;
use crate::store::StoreError;

/// What a request's global ops took from the shares, op by op in its group's order: `None` for an
/// op the store decides (not global, or fallen back to its split in the store).
pub(in crate::limiter) struct SharesTaken {
    taken: Vec<Option<Taken>>,
    // Per op, how it was decided without a share (none for an op with one, or not global).
    fallen: Vec<Option<GlobalFallback>>,
}

/// Marks each bucket of `decision` that a fallback decided (`fallbacks` per op of its group,
/// `op_of` per descriptor), for the answer's header.
pub(in crate::limiter) fn mark_fallbacks(
    decision: &mut Decision,
    op_of: &[Option<usize>],
    fallbacks: &[Option<GlobalFallback>],
) {
    for (d, op) in decision.descriptors.iter_mut().zip(op_of) {
        if let (Outcome::Bucket(b), Some(op)) = (&mut d.outcome, op) {
            b.fallback = fallbacks.get(*op).copied().flatten();
        }
    }
}

impl SharesTaken {
    /// Per op of the group, how a fallback decided it, if one did.
    pub(in crate::limiter) fn fallbacks(&self) -> &[Option<GlobalFallback>] {
        &self.fallen
    }

    /// Whether every global op had its tokens: only then may the rest be debited.
    pub(in crate::limiter) fn all(&self) -> bool {
        self.taken.iter().flatten().all(|t| matches!(t, Taken::Yes { .. }))
    }

    /// The ops of `group` the store decides: debits if every share had its tokens, else checks
    /// only (the answer's headers), since the request is denied.
    pub(in crate::limiter) fn rest(&self, group: &Group) -> Group {
        let all = self.all();
        group
            .iter()
            .zip(&self.taken)
            .filter(|(_, t)| t.is_none())
            .map(|(op, _)| BucketOp { need: if all { op.need } else { 0.0 }, ..op.clone() })
            .collect()
    }

    /// The whole group's outcome at `now_ms`: the shares' verdicts beside the store's for the
    /// rest (`stored`, in [`rest`](Self::rest)'s order).
    pub(in crate::limiter) fn merged(
        &self,
        group: &Group,
        stored: Result<Option<GroupOutcome>, StoreError>,
        now_ms: u64,
    ) -> Result<Option<GroupOutcome>, StoreError> {
        let stored = stored?;
        let rest: Vec<usize> = (0..group.len()).filter(|op| self.taken[*op].is_none()).collect();
        let mut verdicts = Vec::with_capacity(group.len());
        let mut next_rest = 0;
        for (op, t) in self.taken.iter().enumerate() {
            match t {
                Some(t) => verdicts.push(share_verdict(*t, group[op].need)),
                None => {
                    let v =
                        stored.as_ref().map(|o| o.verdicts[next_rest]).expect("the store answered the rest");
                    next_rest += 1;
                    verdicts.push(v);
                }
            }
        }
        let unanswered =
            stored.as_ref().map(|o| o.unanswered.iter().map(|&i| rest[i]).collect()).unwrap_or_default();
        Ok(Some(GroupOutcome {
            admitted: self.all() && stored.as_ref().is_none_or(|o| o.admitted),
            now_ms: stored.as_ref().map_or(now_ms, |o| o.now_ms),
            verdicts,
            refunded: false,
            unanswered,
        }))
    }

    /// Gives back to `shares` what they gave a request that was not admitted after all.
    pub(in crate::limiter) fn give_back(&self, shares: &GlobalShares, group: &Group, now_ms: u64) {
        for (op, t) in self.taken.iter().enumerate() {
            if let Some(Taken::Yes { .. }) = t {
                shares.give_back(&group[op].key, group[op].need, now_ms);
            }
        }
    }
}

impl Limiter {
    /// The request's group evaluated with its global buckets taken from this replica's shares,
    /// all or nothing with the rest (taken first; given back if the store then denies).
    pub(in crate::limiter) async fn evaluate_with_shares(
        &self,
        domain: &Domain,
        shares: &GlobalShares,
        query: &Query<'_>,
        plans: &[Plan<'_>],
        mut group: Group,
        op_of: &[Option<usize>],
    ) -> (Result<Option<GroupOutcome>, StoreError>, Vec<Option<GlobalFallback>>) {
        let Some(taken) = self.take_shares(domain, shares, query, plans, &mut group, op_of).await else {
            return (self.evaluate(domain, group).await, Vec::new());
        };
        let rest = taken.rest(&group);
        let stored = if rest.is_empty() { Ok(None) } else { self.evaluate(domain, rest).await };
        let admitted = taken.all()
            && match &stored {
                Ok(Some(o)) => o.admitted,
                Ok(None) => true,
                Err(_) => domain.failure_mode == FailureMode::Allow,
            };
        let now_ms = self.clock.now_ms();
        if !admitted {
            taken.give_back(shares, &group, now_ms);
        }
        (taken.merged(&group, stored, now_ms), taken.fallen)
    }

    /// Takes the global ops of `group` from `shares`, `None` if it has none. An op still without
    /// a share after the first-lease wait is rewritten in `group` to its split's bucket in the
    /// store (left to the store), or denied.
    pub(in crate::limiter) async fn take_shares(
        &self,
        domain: &Domain,
        shares: &GlobalShares,
        query: &Query<'_>,
        plans: &[Plan<'_>],
        group: &mut Group,
        op_of: &[Option<usize>],
    ) -> Option<SharesTaken> {
        // Per op: the descriptor of a global op, and its rule's fallback split.
        let (global, split): (Vec<Option<usize>>, Vec<Option<u32>>) = (0..group.len())
            .map(|op| {
                let Some(d) = op_of.iter().position(|o| *o == Some(op)) else { return (None, None) };
                let Plan::Bucket(p) = &plans[d] else { return (None, None) };
                let rule = p.rule.filter(|r| r.global && matches!(r.charge, ChargeRule::Admitted));
                match rule {
                    Some(r) if p.role == Role::Enforced && group[op].need >= 0.0 => {
                        (Some(d), r.global_fallback)
                    }
                    _ => (None, None),
                }
            })
            .unzip();
        if global.iter().all(Option::is_none) {
            return None;
        }
        let take = |group: &Group, op: usize, d: usize| {
            let entries = &query.descriptors[d].entries;
            let (bucket, now_ms) = (&group[op], self.clock.now_ms());
            shares.take(&bucket.key, (&domain.name, entries), bucket.spec, bucket.need, now_ms)
        };
        let mut taken: Vec<Option<Taken>> =
            global.iter().enumerate().map(|(op, d)| d.map(|d| take(group, op, d))).collect();
        // A bucket without a share here yet: its first lease, briefly awaited, unless the rounds
        // are failing (cut off: no lease is coming, so the fallback answers at once).
        let cut_off = shares.cut_off_for_ms(self.clock.now_ms()).is_some();
        if taken.contains(&Some(Taken::NoShare)) && !cut_off {
            let mut renewed = shares.renewed.subscribe();
            renewed.mark_unchanged();
            shares.wanted.notify_one();
            let _ = tokio::time::timeout(shares.first_lease_wait, renewed.changed()).await;
            for (op, d) in global.iter().enumerate() {
                if let (Some(d), Some(Taken::NoShare)) = (d, taken[op]) {
                    taken[op] = Some(take(group, op, *d));
                }
            }
        }
        // Still without a share: the fallback. A split is decided in the store with the rest.
        let mut fallen = vec![None; group.len()];
        for op in 0..group.len() {
            if taken[op] != Some(Taken::NoShare) {
                continue;
            }
            let spec = group[op].spec;
            let part = split[op].and_then(|n| {
                BucketSpec::new(spec.capacity() / f64::from(n), spec.refill_per_second() / f64::from(n)).ok()
            });
            let fallback = if part.is_some() { GlobalFallback::Split } else { GlobalFallback::Deny };
            metrics::counter!("tollgate_global_fallbacks_total", "fallback" => fallback.as_str())
                .increment(1);
            fallen[op] = Some(fallback);
            let Some(part) = part else { continue };
            group[op].key = crate::identity::fallback_bucket(&group[op].key);
            group[op].spec = part;
            taken[op] = None;
        }
        Some(SharesTaken { taken, fallen })
    }
}

// A share's answer as a bucket verdict (for headers and metrics).
fn share_verdict(taken: Taken, need: f64) -> Verdict {
    let (allowed, tokens, capacity, rate) = match taken {
        Taken::Yes { tokens, capacity, rate } => (true, tokens, capacity, rate),
        Taken::No { tokens, capacity, rate } => (false, tokens, capacity, rate),
        Taken::NoShare => (false, 0.0, 0.0, 0.0),
    };
    let ms = |tokens: f64| if rate > 0.0 { (tokens.max(0.0) / rate * 1000.0).ceil() as u64 } else { 0 };
    let retry_after_ms = match taken {
        Taken::Yes { .. } => Some(0),
        // Waiting helps only if the share can ever hold `need`; without one, at the next round.
        Taken::No { .. } if need <= capacity && rate > 0.0 => Some(ms(need - tokens)),
        Taken::No { .. } => None,
        Taken::NoShare => Some(RENEW_EVERY.as_millis() as u64),
    };
    Verdict {
        allowed,
        tokens,
        retry_after_ms,
        reset_ms: ms(capacity - tokens),
        forgiven: 0.0,
        fastest_refill: rate,
        kept_ms: 0,
    }
}
