//! Requests as groups of bucket operations, the twin of `src/store/redis/group.lua`: a group is
//! admitted or denied as a whole, later operations see earlier debits of the same key, a denied
//! group still takes what is charged always, and a batch's writes never move an expiry earlier.
//! The arithmetic of each operation is in `src/bucket/refill.rs`.

use std::collections::HashMap;

use super::refill::{
    asked, covers, debit, leases_live, life_ms, note_spec, raises_ceiling, refill, unleased,
};
use super::spec::wait_between;
use super::{
    Batch, BucketOp, BucketState, Charge, Evaluation, Group, GroupOutcome, Role, Verdict, Write, MAX_WAIT_MS,
};

/// The operations that give back what `outcome` took for `group`, each with the index of the
/// operation it undoes: every debit charged because the group was admitted comes back as a
/// credit (capped at capacity), every credit is taken back (down to zero at most). What is
/// charged always stays charged.
pub fn refund(group: &Group, outcome: &GroupOutcome) -> Vec<(usize, BucketOp)> {
    if !outcome.admitted {
        return Vec::new();
    }
    group
        .iter()
        .zip(&outcome.verdicts)
        .enumerate()
        .filter(|(_, (op, v))| v.allowed && op.need != 0.0 && op.charge == Charge::Admitted)
        .map(|(i, (op, _))| {
            let charge = if op.need < 0.0 { Charge::Always { max_debt: 0.0 } } else { Charge::Admitted };
            (
                i,
                BucketOp {
                    key: op.key.clone(),
                    spec: op.spec,
                    need: -op.need,
                    unseen: 0.0,
                    role: Role::Shadow,
                    charge,
                },
            )
        })
        .collect()
}

/// Evaluates `batch` at `now_ms` against what `load` returns for a key: the stored state and
/// when the store drops it (ms since the epoch), or `None` when no bucket is stored.
///
/// `load` is called at most once per distinct key.
pub fn evaluate(
    batch: &Batch,
    now_ms: u64,
    mut load: impl FnMut(&str) -> Option<(BucketState, u64)>,
) -> Evaluation {
    // Committed state of every key touched so far in this batch, and the stored expiries.
    let mut running: HashMap<&str, Option<BucketState>> = HashMap::new();
    let mut expiries: HashMap<&str, u64> = HashMap::new();
    let mut load = |key| {
        let stored = load(key);
        if let Some((_, expires_at_ms)) = stored {
            expiries.insert(key, expires_at_ms);
        }
        stored.map(|(state, _)| state)
    };
    let mut dirty: HashMap<&str, u64> = HashMap::new();
    let mut dirty_order: Vec<&str> = Vec::new();
    let mut groups = Vec::with_capacity(batch.len());

    for group in batch {
        // Tentative state: this group's debits, visible to its later operations only.
        let mut tentative: HashMap<&str, BucketState> = HashMap::new();
        let mut verdicts = Vec::with_capacity(group.len());
        // Per operation: it found a stored bucket whose rate ceiling its spec raises.
        let mut raised = Vec::with_capacity(group.len());
        // Per operation: it asked tokens of a bucket with live leases (its demand is recorded).
        let mut asks = Vec::with_capacity(group.len());
        // Per operation: the capacity and rate per ms the leases leave its spec.
        let mut rooms = Vec::with_capacity(group.len());
        let (mut enforced_short, mut quota_ops, mut quota_allowed) = (false, 0, 0);

        for op in group {
            let key = op.key.as_str();
            let before = match tentative.get(key) {
                Some(s) => Some(s),
                None => running.entry(key).or_insert_with(|| load(key)).as_ref(),
            };
            let mut state = refill(before, &op.spec, now_ms);
            let raises = before.is_some() && raises_ceiling(&state, &op.spec);
            let room = unleased(&state, &op.spec, now_ms);
            let allowed = covers(state.tokens, op.need);
            let retry_after_ms =
                if allowed { Some(0) } else { wait_between(room.0, room.1, state.tokens, op.need.max(0.0)) };
            let mut forgiven = 0.0;
            if allowed || matches!(op.charge, Charge::Always { .. }) {
                forgiven = debit(&mut state, op, room.0, now_ms);
            } else if raises {
                note_spec(&mut state, &op.spec, now_ms);
            }
            let asks_now = asked(op) > 0.0 && leases_live(&state.leases, now_ms);
            if asks_now {
                state.asked.record(now_ms, asked(op));
            }
            raised.push(raises);
            asks.push(asks_now);
            rooms.push(room);
            let (tokens, fastest_refill) = (state.tokens, state.rate_ceiling());
            tentative.insert(key, state);
            match op.role {
                Role::Enforced => enforced_short |= !allowed,
                Role::Shadow => {}
                Role::QuotaMode => {
                    quota_ops += 1;
                    quota_allowed += usize::from(allowed);
                }
            }
            verdicts.push(Verdict {
                allowed,
                tokens,
                retry_after_ms,
                reset_ms: 0,
                forgiven,
                fastest_refill,
                kept_ms: 0,
            });
        }
        let admitted = !enforced_short && (quota_ops == 0 || quota_allowed > 0);

        let each = group.iter().zip(verdicts.iter_mut()).zip(raised).zip(rooms).zip(asks);
        for ((((op, verdict), raises), room), asks) in each {
            let key = op.key.as_str();
            let always = matches!(op.charge, Charge::Always { .. });
            let (charged, raises) = if admitted {
                running.insert(key, tentative.get(key).cloned());
                (verdict.allowed || always, raises)
            } else {
                // A denied group takes only what is charged always, replayed on the committed
                // state in the group's order, and records a raised rate ceiling and its demand.
                let committed = running[key].as_ref();
                let mut state = refill(committed, &op.spec, now_ms);
                let raises = committed.is_some() && raises_ceiling(&state, &op.spec);
                verdict.forgiven = 0.0;
                if always {
                    verdict.forgiven = debit(&mut state, op, room.0, now_ms);
                    if asks {
                        state.asked.record(now_ms, asked(op));
                    }
                    verdict.tokens = state.tokens;
                    verdict.fastest_refill = state.rate_ceiling();
                    running.insert(key, Some(state));
                } else {
                    if raises || asks {
                        let mut noted = committed.expect("a raise or an ask needs a stored bucket").clone();
                        if raises {
                            note_spec(&mut noted, &op.spec, now_ms);
                            note_spec(&mut state, &op.spec, now_ms);
                        }
                        if asks {
                            noted.asked.record(now_ms, asked(op));
                        }
                        running.insert(key, Some(noted));
                    }
                    verdict.tokens = state.tokens;
                    verdict.fastest_refill = state.rate_ceiling();
                }
                (always, raises)
            };
            // Written when charged, when its spec raised the rate ceiling (a denied request under a
            // faster rate starts the raise's delay as a charge would), and when it asked of a
            // leased bucket.
            if ((charged && op.need != 0.0) || raises || asks) && op.spec.refill_per_second() > 0.0 {
                let written = running[key].as_ref().expect("a written bucket has state");
                let ttl = life_ms(written, op.charge.floor(), now_ms);
                let slot = dirty.entry(key).or_insert_with(|| {
                    dirty_order.push(key);
                    0
                });
                *slot = (*slot).max(ttl);
            }
            verdict.reset_ms = wait_between(room.0, room.1, verdict.tokens, room.0).unwrap_or(0);
        }
        groups.push(GroupOutcome { admitted, now_ms, verdicts, refunded: false, unanswered: Vec::new() });
    }

    // A write never moves an expiry earlier: the bucket lives as long as the longest of what it
    // had left and what this batch's charges need.
    for (key, ttl) in dirty.iter_mut() {
        if let Some(at) = expiries.get(key) {
            *ttl = (*ttl).max(at.saturating_sub(now_ms).min(MAX_WAIT_MS));
        }
    }
    // Known once every group has run: a later group may write a bucket an earlier one read.
    for (group, outcome) in batch.iter().zip(&mut groups) {
        for (op, verdict) in group.iter().zip(&mut outcome.verdicts) {
            let key = op.key.as_str();
            verdict.kept_ms = match dirty.get(key) {
                Some(ttl) => *ttl,
                None => expiries.get(key).map_or(0, |at| at.saturating_sub(now_ms)),
            };
        }
    }

    let writes = dirty_order
        .into_iter()
        .map(|key| Write {
            key: key.to_owned(),
            state: running[key].clone().expect("a debited bucket has state"),
            ttl_ms: dirty[key],
        })
        .collect();
    Evaluation { groups, writes }
}
