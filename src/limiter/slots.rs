//! Concurrency limits in a request ([`crate::slot`]): which descriptors take or give back slots,
//! and the store op for them.
//!
//! A descriptor whose last entry is the domain's request id entry, on a path through nodes with
//! `concurrency:`, takes a slot at each of them; the same entries followed by one entry with key
//! [`RELEASE_KEY`] give them back. The path itself (without the id) is what the descriptor's own
//! rule, if any, limits, as for any descriptor; a give-back charges nothing.

use std::sync::Arc;

use super::decision::{SlotLimit, SlotReport};
use super::repair::{self, Repair};
use super::{count_store_error, drop_replaced, group, overall, trace_decision, Limiter, Plan};
use super::{Code, DecideError, Decision, Outcome, Query, QueryDescriptor};
use crate::bucket::{refund, BucketOp, Group, GroupOutcome};
use crate::config::{Domain, FailureMode};
use crate::identity;
use crate::slot::{SetReading, SlotAction, SlotOp, SlotOutcome, SlotSet, SlotVerdict, RELEASE_KEY};
use crate::store::LateReply;
use crate::store::StoreError;
use crate::telemetry::logs::{self, ErrorChain};

/// A descriptor that takes or gives back slots.
#[derive(Debug, Clone)]
pub(super) struct SlotPlan<'q> {
    /// The path, without the request id (and `release`).
    pub(super) path: Vec<(&'q str, &'q str)>,
    /// The op, without the request's token buckets.
    pub(super) op: SlotOp,
    /// Each set's node path (the rule name in metrics), in the op's order.
    pub(super) nodes: Vec<String>,
}

impl SlotPlan<'_> {
    pub(super) fn take(&self) -> bool {
        self.op.action == SlotAction::Take
    }
}

/// Whether a descriptor with `entries` ends as a take or a give-back does (a request id, then
/// perhaps `release`): a test without allocation, before [`plan`] walks the tree.
pub(super) fn may_name_slots(domain: &Domain, entries: &[(&str, &str)]) -> bool {
    match entries {
        [.., (id_key, _), (RELEASE_KEY, _)] | [.., (id_key, _)] => *id_key == domain.request_id_key,
        [] => false,
    }
}

/// The slot plan of a descriptor with `entries` in `domain`, if it takes or gives back slots.
pub(super) fn plan<'q>(domain: &Domain, entries: &[(&'q str, &'q str)]) -> Option<SlotPlan<'q>> {
    let (action, path, id) = match entries {
        [path @ .., (id_key, id), (RELEASE_KEY, _)] if *id_key == domain.request_id_key => {
            (SlotAction::GiveBack, path, *id)
        }
        [path @ .., (id_key, id)] if *id_key == domain.request_id_key => (SlotAction::Take, path, *id),
        _ => return None,
    };
    let nodes = domain.root.path(path)?;
    let mut sets = Vec::new();
    let mut names = Vec::new();
    for (depth, node) in nodes.iter().enumerate() {
        if let Some(limit) = node.concurrency {
            sets.push(SlotSet {
                key: identity::slot_set(domain, &path[..=depth]),
                max: limit.max,
                ttl_ms: limit.ttl_ms,
            });
            names.push(node_path(&path[..=depth]));
        }
    }
    if sets.is_empty() {
        return None;
    }
    let op = SlotOp {
        record: identity::slot_record(domain, path, id),
        binding: identity::path_text(path),
        sets,
        action,
        group: Vec::new(),
    };
    Some(SlotPlan { path: path.to_vec(), op, nodes: names })
}

/// A request's takes at one record as one op, and its give-backs likewise: several descriptors
/// down to the same request id under one tenant are one request, whose slots are all or nothing
/// in one script. Its binding is their paths, sorted (the stream-end call names the same paths,
/// whatever their order). The first such descriptor carries the op; the others carry none.
pub(super) fn merge(mut plans: Vec<Option<SlotPlan<'_>>>) -> Vec<Option<SlotPlan<'_>>> {
    for i in 0..plans.len() {
        let Some(mut merged) = plans[i].take() else { continue };
        let mut bindings = vec![merged.op.binding.clone()];
        for later in plans.iter_mut().skip(i + 1) {
            if !later
                .as_ref()
                .is_some_and(|p| (&p.op.record, p.op.action) == (&merged.op.record, merged.op.action))
            {
                continue;
            }
            let other = later.take().expect("checked");
            for (set, node) in other.op.sets.into_iter().zip(other.nodes) {
                if !merged.op.sets.iter().any(|s| s.key == set.key) {
                    merged.op.sets.push(set);
                    merged.nodes.push(node);
                }
            }
            bindings.push(other.op.binding);
        }
        if bindings.len() > 1 {
            bindings.sort();
            bindings.dedup();
            // A path's text escapes control characters: a newline cannot occur inside one.
            merged.op.binding = bindings.join("\n");
        }
        plans[i] = Some(merged);
    }
    plans
}

/// Each descriptor as what it limits: a slot descriptor its path (without the request id).
pub(super) fn effective<'q>(
    query: &Query<'q>,
    slot_plans: &[Option<SlotPlan<'q>>],
) -> Vec<QueryDescriptor<'q>> {
    query
        .descriptors
        .iter()
        .zip(slot_plans)
        .map(|(d, s)| match s {
            Some(s) => QueryDescriptor { entries: s.path.clone(), ..d.clone() },
            None => d.clone(),
        })
        .collect()
}

/// The descriptors' plans: a take's path is limited by its rule as any descriptor; a give-back
/// charges nothing.
pub(super) fn plans<'a>(
    limiter: &Limiter,
    domain: &'a Domain,
    effective: &'a [QueryDescriptor<'a>],
    slot_plans: &[Option<SlotPlan<'_>>],
) -> Vec<Plan<'a>> {
    effective
        .iter()
        .zip(slot_plans)
        .map(
            |(d, s)| if s.as_ref().is_some_and(|s| !s.take()) { Plan::Free } else { limiter.plan(domain, d) },
        )
        .collect()
}

// A node's place as envoyproxy/ratelimit prints rule paths: `key_value.key`, values of the
// config node only. Slot nodes are named by the request's own values here, which a wildcard or
// any-value node would make unbounded: those are printed by key alone.
pub(super) fn node_path(path: &[(&str, &str)]) -> String {
    path.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(".")
}

impl Limiter {
    /// Decides a request some of whose descriptors take or give back slots: its first take with
    /// every token bucket of the request, all or nothing in one store op (the takes of one
    /// tenant merged into it); a take at another tenant on its own, a refused take undoing the
    /// others. In a region, global buckets are taken from this replica's shares first and given
    /// back unless the request is admitted with its slots.
    pub(super) async fn decide_with_slots(
        &self,
        domain: &Arc<Domain>,
        query: &Query<'_>,
        slot_plans: Vec<Option<SlotPlan<'_>>>,
    ) -> Result<Decision, DecideError> {
        let effective = effective(query, &slot_plans);
        let mut plans = plans(self, domain, &effective, &slot_plans);
        let slot_plans = merge(slot_plans);
        drop_replaced(&mut plans);
        self.resolve_quotas(domain, &mut plans).await;
        let (mut group, op_of) = group(&plans);
        // In a region the request's global buckets are taken from this replica's shares first, as
        // limits outside the take's Cluster slot are: the take decides with the rest, and asks for
        // no slot if a share refused.
        let shared = match &self.shares {
            Some(shares) => self.take_shares(domain, shares, query, &plans, &mut group, &op_of).await,
            None => None,
        };
        let rest = shared.as_ref().map_or_else(|| group.clone(), |taken| taken.rest(&group));
        let shares_refused = shared.as_ref().is_some_and(|taken| !taken.all());
        let takes = |i: usize| slot_plans[i].as_ref().is_some_and(SlotPlan::take) && !shares_refused;
        let first_take = (0..slot_plans.len()).find(|&i| takes(i));
        let mut answers: Vec<Option<Result<SlotOutcome, StoreError>>> = vec![None; slot_plans.len()];
        let outcome = match first_take {
            Some(i) => {
                let plan = slot_plans[i].as_ref().expect("a take");
                let (outcome, answer) = self.take_with(domain, plan, rest.clone()).await;
                answers[i] = answer;
                outcome
            }
            None => self.evaluate(domain, rest.clone()).await,
        };
        for (i, plan) in slot_plans.iter().enumerate() {
            // The first take was decided with the buckets (and not asked at all if they denied).
            let asked = plan.as_ref().is_some_and(|p| !p.take()) || takes(i);
            if let (Some(plan), None, false, true) = (plan, &answers[i], Some(i) == first_take, asked) {
                answers[i] = Some(self.slot_call(domain, &plan.op).await);
            }
        }
        self.undo_if_refused(domain, &slot_plans, &answers, &rest, &outcome).await;
        for (plan, answer) in slot_plans.iter().zip(&answers) {
            if let (Some(plan), Some(Err(_))) = (plan, answer) {
                self.repair_slots(domain, plan);
            }
        }
        // A take answered without taking (a retry's recorded answer, a reused id, a full set) took
        // nothing, so neither do the request's shares.
        let took_nothing = first_take
            .and_then(|i| answers[i].as_ref())
            .is_some_and(|a| a.as_ref().is_ok_and(|a| a.verdict != SlotVerdict::Taken));
        let outcome = match &shared {
            Some(taken) => taken.merged(&group, outcome, self.clock.now_ms()),
            None => outcome,
        };
        let mut decision = self.verdicts(domain, query, &plans, &op_of, &outcome);
        if let Some(taken) = &shared {
            super::global::mark_fallbacks(&mut decision, &op_of, taken.fallbacks());
        }
        // A retried or refused take whose buckets were not evaluated gets its recorded answer.
        let recorded = answers.iter().flatten().find_map(|a| match a {
            Ok(SlotOutcome { verdict: SlotVerdict::Repeated(admitted), .. }) => Some(*admitted),
            Ok(SlotOutcome { verdict: SlotVerdict::Reused, .. }) => Some(false),
            _ => None,
        });
        for ((verdict, plan), answer) in decision.descriptors.iter_mut().zip(&slot_plans).zip(&answers) {
            match (plan, answer) {
                (Some(plan), Some(Ok(answer))) => {
                    count_slots(domain, &plan.nodes, &answer.sets, SlotEvent::of(answer.verdict));
                    let bucket = match &verdict.outcome {
                        Outcome::Bucket(b) => Some(b.clone()),
                        _ => None,
                    };
                    let report = SlotReport {
                        sets: plan
                            .op
                            .sets
                            .iter()
                            .zip(&plan.nodes)
                            .enumerate()
                            .map(|(n, (set, node))| SlotLimit::of(set, node, answer.sets.get(n)))
                            .collect(),
                        verdict: answer.verdict,
                        bucket,
                    };
                    verdict.code = if report.admitted() { verdict.code } else { Code::OverLimit };
                    verdict.outcome = Outcome::Slot(report);
                }
                (Some(plan), Some(Err(_))) if plan.take() => {
                    let mode = domain.failure_mode;
                    verdict.code = if mode == FailureMode::Allow { Code::Ok } else { Code::OverLimit };
                    verdict.outcome = Outcome::SlotFailed { mode };
                }
                (None, _) if recorded.is_some() && matches!(verdict.outcome, Outcome::StoreFailed { .. }) => {
                    verdict.code = if recorded == Some(true) { Code::Ok } else { Code::OverLimit };
                    verdict.outcome = Outcome::NoLimit;
                }
                _ => {}
            }
        }
        decision.overall = overall(&decision.descriptors);
        if let (Some(shares), Some(taken)) = (&self.shares, &shared) {
            if decision.overall != Code::Ok || took_nothing {
                taken.give_back(shares, &group, self.clock.now_ms());
            }
        }
        self.count_decision(query, &decision);
        trace_decision(&domain.name, &plans, &decision);
        let failed = answers.iter().flatten().find_map(|a| a.as_ref().err().cloned()).or(outcome.err());
        match failed {
            Some(source) if domain.failure_mode == FailureMode::Error => {
                Err(DecideError::Unavailable { domain: domain.name.clone(), source })
            }
            _ => Ok(decision),
        }
    }

    // Several takes in one request, all or nothing by undoing: when one refused (or failed
    // under a failure mode that refuses), the others' slots are given back and the buckets the
    // first took refunded. The request is refused, and Envoy sends no give-back for a request
    // it refused: without this, its slots would stay taken until their ttl.
    async fn undo_if_refused(
        &self,
        domain: &Domain,
        slot_plans: &[Option<SlotPlan<'_>>],
        answers: &[Option<Result<SlotOutcome, StoreError>>],
        group: &Group,
        outcome: &Result<Option<GroupOutcome>, StoreError>,
    ) {
        let takes = || slot_plans.iter().zip(answers).filter(|(p, _)| p.as_ref().is_some_and(SlotPlan::take));
        let refused = takes().any(|(_, a)| match a {
            Some(Ok(answer)) => !answer.admitted(),
            Some(Err(_)) => domain.failure_mode != FailureMode::Allow,
            None => false,
        });
        let taken: Vec<&SlotPlan<'_>> = takes()
            .filter(|(_, a)| matches!(a, Some(Ok(SlotOutcome { verdict: SlotVerdict::Taken, .. }))))
            .filter_map(|(p, _)| p.as_ref())
            .collect();
        if !refused || taken.is_empty() {
            return;
        }
        for plan in taken {
            if let Some(answer) = self.undo(domain, plan).await {
                count_slots(domain, &plan.nodes, &answer.sets, SlotEvent::Other);
            }
        }
        if let Ok(Some(admitted)) = outcome {
            self.refund_split(group, admitted).await;
        }
    }

    // Gives back a take the request's other limits refused, its record then answering a retry
    // as refused, as the request was; a failed undo is repaired in the background.
    async fn undo(&self, domain: &Domain, plan: &SlotPlan<'_>) -> Option<SlotOutcome> {
        let op = SlotOp { action: SlotAction::Undo, group: Vec::new(), ..plan.op.clone() };
        match self.slot_call(domain, &op).await {
            Ok(answer) => Some(answer),
            Err(_) => {
                self.repair_slots(domain, &SlotPlan { op, ..plan.clone() });
                None
            }
        }
    }

    // Gives back what an admitted part of a request split across Cluster slots took; whether
    // anything was.
    async fn refund_split(&self, group: &Group, admitted: &GroupOutcome) -> bool {
        let back: Group = refund(group, admitted).into_iter().map(|(_, op)| op).collect();
        if back.is_empty() {
            return false;
        }
        metrics::counter!("tollgate_store_refunds_total", "reason" => "split").increment(1);
        let _ = self.store_call(&[back], LateReply::Keep).await;
        true
    }

    // The take of `plan` with the request's token buckets, all or nothing: those in the take's
    // Cluster slot in its one script; the others (limits outside the tenant, in other slots)
    // after it, and the take undone if they deny (or fail under a failure mode that refuses).
    // The take goes first so that a retry is answered from its record before anything is
    // charged again. The buckets' outcome in the group's order (none for an answer from the
    // record), and the take's answer.
    async fn take_with(
        &self,
        domain: &Domain,
        plan: &SlotPlan<'_>,
        group: Group,
    ) -> (Result<Option<GroupOutcome>, StoreError>, Option<Result<SlotOutcome, StoreError>>) {
        let slot = identity::cluster_slot(&plan.op.record);
        let (inside, outside): (Vec<usize>, Vec<usize>) =
            (0..group.len()).partition(|&n| identity::cluster_slot(&group[n].key) == slot);
        let pick = |which: &[usize]| -> Group { which.iter().map(|&n| group[n].clone()).collect() };
        let op = SlotOp { group: pick(&inside), ..plan.op.clone() };
        let mut answer = self.slot_call(domain, &op).await;
        let (taken, inner) = match &answer {
            _ if outside.is_empty() => {
                let outcome = answer.as_ref().map(|o| o.group.clone()).map_err(Clone::clone);
                return (outcome, Some(answer));
            }
            Ok(SlotOutcome { verdict, group: Some(g), .. }) => (*verdict == SlotVerdict::Taken, g.clone()),
            // A retry or a reused id, answered from the record: nothing else is asked.
            Ok(_) => return (Ok(None), Some(answer)),
            Err(e) => return (Err(e.clone()), Some(answer)),
        };
        // After a refused take the limits outside are only read, for the answer's headers.
        let outer_group: Group = if taken {
            pick(&outside)
        } else {
            pick(&outside).into_iter().map(|b| BucketOp { need: 0.0, ..b }).collect()
        };
        let outer = self.evaluate(domain, outer_group).await;
        let outer_admits = matches!(&outer, Ok(Some(o)) if o.admitted);
        let mut refunded = false;
        if taken && !outer_admits && (outer.is_ok() || domain.failure_mode != FailureMode::Allow) {
            // Reported as refused by the buckets: the slot was never the request's.
            self.undo(domain, plan).await;
            refunded = self.refund_split(&pick(&inside), &inner).await;
            if let Ok(a) = &mut answer {
                a.verdict = SlotVerdict::Refused(None);
            }
        }
        let outer = match outer {
            Ok(Some(o)) => o,
            other => return (other, Some(answer)),
        };
        // Both parts' verdicts back in the group's order.
        let mut verdicts = vec![outer.verdicts[0]; group.len()];
        for (n, v) in outside.iter().zip(&outer.verdicts).chain(inside.iter().zip(&inner.verdicts)) {
            verdicts[*n] = *v;
        }
        let merged = GroupOutcome {
            admitted: taken && outer_admits,
            now_ms: inner.now_ms,
            verdicts,
            refunded,
            unanswered: Vec::new(),
        };
        (Ok(Some(merged)), Some(answer))
    }

    // After a failed op, in the background: a give-back is sent again (it counts once however
    // often it comes); a take the failure mode refused is given back (its script may have run
    // and its reply been lost: the request must hold no slot). A take `allow` admitted keeps
    // whatever it took, which its own give-back frees. What still fails is left to the ttl.
    fn repair_slots(&self, domain: &Domain, plan: &SlotPlan<'_>) {
        let (kind, action) = match plan.op.action {
            SlotAction::Take if domain.failure_mode == FailureMode::Allow => return,
            SlotAction::Take | SlotAction::Undo => ("give_back_refused_take", SlotAction::Undo),
            SlotAction::GiveBack => ("give_back", SlotAction::GiveBack),
        };
        let op = SlotOp { action, group: Vec::new(), ..plan.op.clone() };
        let store = self.store.clone();
        let repair = Repair {
            metric: "tollgate_concurrency_repairs_total",
            domain: domain.name.clone(),
            kind,
            otherwise: "a slot could not be given back; it frees itself after the limit's ttl",
        };
        repair::spawn(repair, move || {
            let (store, op) = (store.clone(), op.clone());
            async move { store.slots(&op).await }
        });
    }

    // One slot op, a failure counted and logged as a bucket call's is.
    async fn slot_call(&self, domain: &Domain, op: &SlotOp) -> Result<SlotOutcome, StoreError> {
        let result = self.store.slots(op).await;
        if let Err(error) = &result {
            count_store_error(
                domain,
                if matches!(error, StoreError::Timeout(_)) { "timeout" } else { "error" },
            );
            if let Some(held_back) = logs::throttled("slots_failed") {
                let mode = domain.failure_mode;
                tracing::warn!(domain = %domain.name, error = %ErrorChain(error), failure_mode = %mode, held_back, "store failed on concurrency slots; applying the failure mode");
            }
        }
        result
    }
}

/// What an op did to a request's slots, beside what its readings say (expired, given back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotEvent {
    /// A slot taken in every set.
    Taken,
    /// Refused because this set was full (none: something else refused it).
    Refused(Option<usize>),
    /// Nothing taken or refused.
    Other,
}

impl SlotEvent {
    fn of(verdict: SlotVerdict) -> SlotEvent {
        match verdict {
            SlotVerdict::Taken => SlotEvent::Taken,
            SlotVerdict::Refused(full) => SlotEvent::Refused(full),
            _ => SlotEvent::Other,
        }
    }
}

/// Slots taken, refused, given back and expired per node (config paths: bounded), and the slots
/// open: taken less given back and expired, per replica; summed over the replicas, the slots
/// open, since a slot taken on one replica may be given back or found expired on another (as
/// `tollgate_budget_holds_open` counts holds).
pub(super) fn count_slots(domain: &Domain, nodes: &[String], readings: &[SetReading], event: SlotEvent) {
    for (n, node) in nodes.iter().enumerate() {
        let reading = readings.get(n);
        let expired = reading.map_or(0, |r| r.expired);
        let given_back = u64::from(reading.is_some_and(|r| r.given_back));
        let taken = u64::from(event == SlotEvent::Taken);
        let refused = u64::from(event == SlotEvent::Refused(Some(n)));
        for (event, by) in
            [("taken", taken), ("refused", refused), ("given_back", given_back), ("expired", expired)]
        {
            if by > 0 {
                metrics::counter!("tollgate_concurrency_slots_total", "domain" => domain.name.clone(), "rule" => node.clone(), "event" => event)
                    .increment(by);
            }
        }
        let net = taken as f64 - given_back as f64 - expired as f64;
        if net != 0.0 {
            metrics::gauge!("tollgate_concurrency_slots_open", "domain" => domain.name.clone(), "rule" => node.clone())
                .increment(net);
        }
    }
}
