//! The slot script's wire format (described at the top of `slot.lua`): a [`SlotOp`] as KEYS and
//! ARGV, the reply read back as a [`SlotOutcome`].

use std::collections::HashMap;

use redis::Value;

use super::wire::{self, Arg};
use super::RedisStore;
use crate::slot::{SlotAction, SlotOp, SlotOutcome, SlotVerdict};
use crate::store::StoreError;

impl RedisStore {
    pub(super) async fn slot_op(&self, op: &SlotOp) -> Result<SlotOutcome, StoreError> {
        let slot = self.shared.connection.slot(&op.record);
        let mut keys: Vec<&str> = vec![&op.record];
        keys.extend(op.sets.iter().map(|s| s.key.as_str()));
        let action = match op.action {
            SlotAction::Take => "take",
            SlotAction::GiveBack => "give",
            SlotAction::Undo => "undo",
        };
        let mut args = vec![Arg::Text(action), Arg::Text(&op.binding), Arg::Int(op.sets.len() as u64)];
        for set in &op.sets {
            args.extend([Arg::Int(set.max), Arg::Int(set.ttl_ms)]);
        }
        let mut index: HashMap<&str, usize> = keys.iter().enumerate().map(|(i, k)| (*k, i + 1)).collect();
        let mut bucket_keys = Vec::new();
        wire::encode_group(
            &op.group,
            &mut |key| {
                let next = index.len() + 1;
                *index.entry(key).or_insert_with(|| {
                    bucket_keys.push(key);
                    next
                })
            },
            &mut args,
        );
        keys.extend(bucket_keys);
        let reply = self.shared.eval_in_slot(&self.shared.slot_script, slot, &keys, &args).await?;
        parse(reply, op)
    }
}

fn parse(reply: Value, op: &SlotOp) -> Result<SlotOutcome, StoreError> {
    let bad = |what: String| StoreError::Protocol(format!("slot script: {what}"));
    let Value::Array(items) = reply else { return Err(bad(format!("expected an array, got {reply:?}"))) };
    let mut items = items.into_iter();
    let verdict = match items.next() {
        Some(Value::BulkString(b)) => String::from_utf8(b).map_err(|_| bad("not UTF-8".into()))?,
        other => return Err(bad(format!("expected a verdict, got {other:?}"))),
    };
    let number = wire::int(&mut items)?;
    let now_ms = u64::try_from(wire::int(&mut items)?).unwrap_or(0);
    let verdict = match verdict.as_str() {
        "taken" => SlotVerdict::Taken,
        "refused" => SlotVerdict::Refused(usize::try_from(number - 1).ok()),
        "repeated" => SlotVerdict::Repeated(number == 1),
        "reused" => SlotVerdict::Reused,
        "given" => SlotVerdict::GivenBack(u64::try_from(number).unwrap_or(0)),
        "nothing" => SlotVerdict::Nothing,
        other => return Err(bad(format!("unknown verdict '{other}'"))),
    };
    let read_sets =
        matches!(verdict, SlotVerdict::Taken | SlotVerdict::Refused(_) | SlotVerdict::GivenBack(_));
    let mut sets = Vec::new();
    if read_sets {
        for _ in &op.sets {
            sets.push(wire::set_reading(&mut items)?);
        }
    }
    let group = match items.next() {
        Some(Value::Int(1)) => Some(wire::read_group(&mut items, op.group.len(), now_ms)?),
        _ => None,
    };
    Ok(SlotOutcome { verdict, sets, group, now_ms })
}
