//! RLQS leases in Redis: the lease script (`lease.lua` after `bucket.lua`), one call per slot
//! for all of a batch's ops in it, the slots' calls concurrent, so a replica's renewals of
//! thousands of buckets are a few script runs per node rather than one per bucket. The calls run
//! under the caller's deadline ([`crate::store::in_background`]); a lost reply needs no repair,
//! since the same op sent again sets the same lease.

use std::collections::HashMap;

use futures::future::join_all;
use redis::Value;

use super::wire::{int, texts};
use super::RedisStore;
use crate::bucket::{Lease, LeaseOp, LeaseOutcome, Others};
use crate::store::StoreError;

impl RedisStore {
    pub(super) async fn lease_all(&self, ops: &[LeaseOp]) -> Vec<Result<LeaseOutcome, StoreError>> {
        let mut by_slot: HashMap<u16, Vec<usize>> = HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            by_slot.entry(self.shared.connection.slot(&op.key)).or_default().push(i);
        }
        let calls = by_slot.into_iter().map(|(slot, members)| async move {
            let mut keys: Vec<&str> = Vec::new();
            let mut args = vec![members.len().to_string()];
            for &i in &members {
                let op = &ops[i];
                let k = match keys.iter().position(|k| *k == op.key) {
                    Some(k) => k,
                    None => {
                        keys.push(&op.key);
                        keys.len() - 1
                    }
                };
                args.extend([
                    (k + 1).to_string(),
                    op.spec.capacity().to_string(),
                    op.spec.refill_per_second().to_string(),
                    op.replica.clone(),
                    op.capacity.to_string(),
                    op.refill_per_second.to_string(),
                    op.ttl_ms.to_string(),
                    op.demand.to_string(),
                    op.unit.to_string(),
                    if op.fresh { "1" } else { "0" }.to_owned(),
                    op.of_unleased.to_string(),
                ]);
            }
            let reply = self.shared.eval_in_slot(&self.shared.lease_script, slot, &keys, &texts(&args)).await;
            (members, reply.and_then(|r| parse_outcomes(r, ops.len())))
        });
        let mut results: Vec<Option<Result<LeaseOutcome, StoreError>>> = ops.iter().map(|_| None).collect();
        for (members, reply) in join_all(calls).await {
            match reply {
                Ok(outcomes) => {
                    for (i, outcome) in members.into_iter().zip(outcomes) {
                        results[i] = Some(Ok(outcome));
                    }
                }
                Err(e) => {
                    for i in members {
                        results[i] = Some(Err(e.clone()));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(StoreError::Protocol("a lease without a reply".into()))))
            .collect()
    }
}

fn parse_outcomes(reply: Value, most: usize) -> Result<Vec<LeaseOutcome>, StoreError> {
    let Value::Array(items) = reply else {
        return Err(StoreError::Protocol(format!("lease script: expected an array, got {reply:?}")));
    };
    let mut items = items.into_iter();
    let now_ms = u64::try_from(int(&mut items)?).map_err(|e| StoreError::Protocol(e.to_string()))?;
    let mut outcomes = Vec::new();
    for item in items.take(most) {
        let Value::BulkString(bytes) = item else {
            return Err(StoreError::Protocol(format!("lease script: expected six numbers, got {item:?}")));
        };
        let text = String::from_utf8_lossy(&bytes);
        let numbers: Option<Vec<f64>> = text.split(' ').map(|w| w.parse().ok()).collect();
        let Some(&[capacity, refill_per_second, others_capacity, others_rate, demand, refused]) =
            numbers.as_deref()
        else {
            return Err(StoreError::Protocol(format!("lease script: expected six numbers, got {text:?}")));
        };
        outcomes.push(LeaseOutcome {
            now_ms,
            capacity,
            refill_per_second,
            others: Others { capacity: others_capacity, refill_per_second: others_rate, demand },
            refused: refused == 1.0,
        });
    }
    Ok(outcomes)
}

/// The leases in a bucket's `h` field (seven words each, as `bucket.lua` writes them).
pub fn parse_leases(field: &str) -> Result<Vec<Lease>, StoreError> {
    let words: Vec<&str> = field.split_whitespace().collect();
    let bad = || StoreError::Protocol(format!("a bucket's leases: {field:?}"));
    if !words.len().is_multiple_of(7) {
        return Err(bad());
    }
    words
        .chunks(7)
        .map(|w| {
            Ok(Lease {
                replica: w[0].to_owned(),
                capacity: w[1].parse().map_err(|_| bad())?,
                refill_per_second: w[2].parse().map_err(|_| bad())?,
                expires_at_ms: w[3].parse().map_err(|_| bad())?,
                demand: w[4].parse().map_err(|_| bad())?,
                banked: w[5].parse().map_err(|_| bad())?,
                since_ms: w[6].parse().map_err(|_| bad())?,
            })
        })
        .collect()
}
