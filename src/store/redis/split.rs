//! Requests whose buckets live in several Cluster slots. Each slot gets one script call with
//! every group's part in it; a split group is admitted only if every part is, and what the
//! admitted parts took is given back before the answer when another part denies (or fails,
//! unless the failure mode admits the request). A denial that is known wins over a failed part.
//! One slot (and a standalone server, or Sentinel's primary, is one slot) needs none of this.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures::future::join_all;

use super::coalesce::Late;
use super::RedisStore;
use crate::bucket::{refund, Batch, BucketOp, Group, GroupOutcome, Role, Verdict};
use crate::store::{LateReply, StoreError};
use crate::telemetry::logs;

// A verdict standing in for an operation whose slot failed; never reported (the group fails).
const FAILED: Verdict = Verdict {
    allowed: false,
    tokens: 0.0,
    retry_after_ms: None,
    reset_ms: 0,
    forgiven: 0.0,
    fastest_refill: 0.0,
    kept_ms: 0,
};

// The operations of one group that live in one slot.
struct Part {
    slot: u16,
    ops: Vec<usize>,
}

// One script call: the groups (whole, or parts of split ones) of one slot, and which (group,
// part) each of them answers.
struct SlotCall {
    slot: u16,
    groups: Vec<Group>,
    parts: Vec<(usize, usize)>,
}

impl RedisStore {
    // Evaluates `batch`, each group in the slots its operations live in.
    pub(super) async fn evaluate_slots(
        &self,
        batch: &Batch,
        late: LateReply,
    ) -> Vec<Result<GroupOutcome, StoreError>> {
        // The common case, every operation in one slot (a standalone server is one slot), needs
        // no parts, no join and no copies of them.
        if let Some(slot) = self.one_slot(batch) {
            return match self.coalescer.submit(slot, batch.to_vec(), Late::Fixed(late)).await {
                Ok(outcomes) => outcomes.into_iter().map(Ok).collect(),
                Err(e) => batch.iter().map(|_| Err(e.clone())).collect(),
            };
        }
        // Each group's operations by slot.
        let split: Vec<Vec<Part>> = batch
            .iter()
            .map(|group| {
                let mut parts: Vec<Part> = Vec::new();
                for (i, op) in group.iter().enumerate() {
                    let slot = self.slot_of(op);
                    match parts.iter_mut().find(|p| p.slot == slot) {
                        Some(part) => part.ops.push(i),
                        None => parts.push(Part { slot, ops: vec![i] }),
                    }
                }
                parts
            })
            .collect();
        // One call per slot, all groups' parts in it. In a part of a split group, quota-mode
        // operations cannot see each other, so they only report; the split group decides.
        let mut calls: Vec<SlotCall> = Vec::new();
        for (g, parts) in split.iter().enumerate() {
            for (p, part) in parts.iter().enumerate() {
                let sub: Group = if parts.len() == 1 {
                    batch[g].clone()
                } else {
                    part.ops
                        .iter()
                        .map(|&i| {
                            let op = &batch[g][i];
                            let role = if op.role == Role::QuotaMode { Role::Shadow } else { op.role };
                            BucketOp { role, ..op.clone() }
                        })
                        .collect()
                };
                let at = match calls.iter().position(|c| c.slot == part.slot) {
                    Some(at) => at,
                    None => {
                        calls.push(SlotCall { slot: part.slot, groups: Vec::new(), parts: Vec::new() });
                        calls.len() - 1
                    }
                };
                calls[at].groups.push(sub);
                calls[at].parts.push((g, p));
            }
        }
        let owners: Vec<Vec<(usize, usize)>> = calls.iter().map(|c| c.parts.clone()).collect();
        // Set when a split group is denied by a part that answered while another failed: the
        // failed parts' late replies then give their tokens back, whatever `late` says.
        let denied = Arc::new(AtomicBool::new(false));
        let late_for = |late| match late {
            LateReply::Keep if split.iter().any(|parts| parts.len() > 1) => {
                Late::KeepUnlessDenied(denied.clone())
            }
            late => Late::Fixed(late),
        };
        let answers =
            join_all(calls.into_iter().map(|c| self.coalescer.submit(c.slot, c.groups, late_for(late))))
                .await;
        let mut part_answers: Vec<Vec<Option<Result<GroupOutcome, StoreError>>>> =
            split.iter().map(|parts| parts.iter().map(|_| None).collect()).collect();
        for (owners, answer) in owners.iter().zip(answers) {
            match answer {
                Ok(outcomes) => {
                    for (&(g, p), outcome) in owners.iter().zip(outcomes) {
                        part_answers[g][p] = Some(Ok(outcome));
                    }
                }
                Err(e) => {
                    for &(g, p) in owners {
                        part_answers[g][p] = Some(Err(e.clone()));
                    }
                }
            }
        }
        let mut results = Vec::with_capacity(batch.len());
        for ((group, parts), answers) in batch.iter().zip(split).zip(part_answers) {
            let mut answers: Vec<Result<GroupOutcome, StoreError>> =
                answers.into_iter().map(|a| a.expect("every part has an answer")).collect();
            results.push(if parts.len() == 1 {
                answers.pop().expect("one part")
            } else {
                self.evaluate_split(group, parts, answers, late, &denied).await
            });
        }
        results
    }

    fn slot_of(&self, op: &BucketOp) -> u16 {
        self.shared.connection.slot(&op.key)
    }

    // The one slot of every operation of `batch`, if they share one and there is one.
    fn one_slot(&self, batch: &Batch) -> Option<u16> {
        let mut ops = batch.iter().flatten();
        let slot = self.slot_of(ops.next()?);
        (batch.iter().all(|g| !g.is_empty()) && ops.all(|op| self.slot_of(op) == slot)).then_some(slot)
    }

    // Gives back what the admitted parts of a group took, before its caller is answered.
    async fn refund_parts(
        &self,
        group: &Group,
        parts: &[Part],
        answers: &[Result<GroupOutcome, StoreError>],
        combined: &mut GroupOutcome,
    ) {
        let mut calls: Vec<(u16, Group, Vec<usize>)> = Vec::new();
        for (part, answer) in parts.iter().zip(answers) {
            let Ok(outcome) = answer else { continue };
            let sub: Group = part.ops.iter().map(|&i| group[i].clone()).collect();
            let (positions, back): (Vec<usize>, Group) =
                refund(&sub, outcome).into_iter().map(|(i, op)| (part.ops[i], op)).unzip();
            if !back.is_empty() {
                calls.push((part.slot, back, positions));
            }
        }
        if calls.is_empty() {
            return;
        }
        let results = join_all(calls.iter().map(|(slot, back, _)| {
            self.coalescer.submit(*slot, vec![back.clone()], Late::Fixed(LateReply::Keep))
        }))
        .await;
        combined.refunded = true;
        metrics::counter!("tollgate_store_refunds_total", "reason" => "split").increment(1);
        for ((_, _, positions), result) in calls.iter().zip(results) {
            match result.map(|mut o| o.pop()) {
                Ok(Some(outcome)) => {
                    for (&i, v) in positions.iter().zip(outcome.verdicts) {
                        combined.verdicts[i].tokens = v.tokens;
                        combined.verdicts[i].reset_ms = v.reset_ms;
                    }
                }
                Ok(None) | Err(_) => {
                    metrics::counter!("tollgate_store_refund_failures_total").increment(1);
                    if let Some(held_back) = logs::throttled("split_refund_failed") {
                        tracing::error!(
                            keys = ?positions.iter().map(|&i| group[i].key.as_str()).collect::<Vec<_>>(),
                            held_back,
                            "could not refund the debits of a request denied in another Cluster slot"
                        );
                    }
                }
            }
        }
    }

    // One group evaluated slot by slot (it spans several): admitted only if every part is and,
    // with quota-mode operations, one of them had its tokens. Otherwise what the admitted parts
    // took is refunded before the answer, unless a failed part's request is admitted anyway. A
    // denial that is known wins over a failed part: the group is denied, its failed operations
    // listed as unanswered, and `denied` tells their late replies to give their tokens back.
    async fn evaluate_split(
        &self,
        group: &Group,
        parts: Vec<Part>,
        answers: Vec<Result<GroupOutcome, StoreError>>,
        late: LateReply,
        denied: &AtomicBool,
    ) -> Result<GroupOutcome, StoreError> {
        let mut verdicts = vec![None; group.len()];
        let mut now_ms = 0;
        let mut failure = None;
        let mut parts_admitted = true;
        for (part, answer) in parts.iter().zip(&answers) {
            match answer {
                Ok(outcome) => {
                    now_ms = now_ms.max(outcome.now_ms);
                    parts_admitted &= outcome.admitted;
                    for (&i, v) in part.ops.iter().zip(&outcome.verdicts) {
                        verdicts[i] = Some(*v);
                    }
                }
                Err(e) => failure = Some(e.clone()),
            }
        }
        let quota_mode: Vec<bool> = group
            .iter()
            .zip(&verdicts)
            .filter(|(op, _)| op.role == Role::QuotaMode)
            .map(|(_, v)| v.is_some_and(|v| v.allowed))
            .collect();
        let admitted =
            failure.is_none() && parts_admitted && (quota_mode.is_empty() || quota_mode.contains(&true));
        // An enforced operation that answered short denies the group whatever the rest says.
        let known_denial = group
            .iter()
            .zip(&verdicts)
            .any(|(op, v)| op.role == Role::Enforced && v.is_some_and(|v| !v.allowed));
        let unanswered = (0..group.len()).filter(|&i| verdicts[i].is_none()).collect();
        let mut combined = GroupOutcome {
            admitted,
            now_ms,
            verdicts: verdicts.into_iter().map(|v| v.unwrap_or(FAILED)).collect(),
            refunded: false,
            unanswered,
        };
        if failure.is_some() && known_denial {
            denied.store(true, Ordering::SeqCst);
        }
        if !admitted && (failure.is_none() || known_denial || late == LateReply::GiveBack) {
            self.refund_parts(group, &parts, &answers, &mut combined).await;
        }
        match failure {
            Some(e) if !known_denial => Err(e),
            _ => Ok(combined),
        }
    }
}
