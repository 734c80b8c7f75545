//! The bucket scripts' wire format, the one place that knows it on the Rust side: a batch of
//! groups as KEYS and ARGV (described at the top of `src/store/redis/token_bucket.lua`), the flat
//! reply read back, and the peek reply. Numbers travel as text that parses back to the same double.

use std::collections::HashMap;

use redis::Value;

use super::{parse_leases, Peek};
use crate::bucket::{BucketState, Charge, Group, GroupOutcome, Role, Verdict};
use crate::slot::SetReading;
use crate::store::StoreError;

/// One script argument, written straight into the command: numbers are formatted there (the
/// shortest text that parses back to the same double, as `ryu` writes it), with no `String` of
/// their own. A call carries seven per bucket operation.
pub(crate) enum Arg<'a> {
    Int(u64),
    Number(f64),
    Text(&'a str),
}

impl redis::ToRedisArgs for Arg<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        match self {
            Arg::Int(n) => n.write_redis_args(out),
            Arg::Number(x) => x.write_redis_args(out),
            Arg::Text(text) => out.write_arg(text.as_bytes()),
        }
    }
}

/// `texts` as arguments, for the scripts whose arguments are built as text.
pub(super) fn texts(texts: &[String]) -> Vec<Arg<'_>> {
    texts.iter().map(|t| Arg::Text(t)).collect()
}

// The distinct keys of `batch` and the ARGV that names them by index.
pub(super) fn encode<'a>(batch: &'a [Group], channel: &'a str) -> (Vec<&'a str>, Vec<Arg<'a>>) {
    let mut keys: Vec<&str> = Vec::new();
    let mut key_index: HashMap<&str, usize> = HashMap::new();
    let mut args: Vec<Arg<'_>> = Vec::with_capacity(2 + batch.iter().map(|g| 1 + 7 * g.len()).sum::<usize>());
    args.push(Arg::Int(batch.len() as u64));
    for group in batch {
        encode_group(
            group,
            &mut |key| {
                *key_index.entry(key).or_insert_with(|| {
                    keys.push(key);
                    keys.len()
                })
            },
            &mut args,
        );
    }
    args.push(Arg::Text(channel));
    (keys, args)
}

// One group as the scripts read it: its op count, then seven values per op, each key named by
// `index` (its place in KEYS, from 1).
pub(super) fn encode_group<'a>(
    group: &'a Group,
    index: &mut dyn FnMut(&'a str) -> usize,
    args: &mut Vec<Arg<'a>>,
) {
    args.push(Arg::Int(group.len() as u64));
    for op in group.iter() {
        args.push(Arg::Int(index(op.key.as_str()) as u64));
        args.push(Arg::Number(op.spec.capacity()));
        args.push(Arg::Number(op.spec.refill_per_second()));
        args.push(Arg::Number(op.need));
        args.push(Arg::Text(match op.role {
            Role::Enforced => "0",
            Role::Shadow => "1",
            Role::QuotaMode => "2",
        }));
        args.push(match op.charge {
            Charge::Admitted => Arg::Text(""),
            Charge::Always { max_debt } => Arg::Number(max_debt),
        });
        args.push(Arg::Number(op.unseen));
    }
}

// Reads the reply of `peek.lua`.
pub(super) fn peek(reply: Value) -> Result<Peek, StoreError> {
    let Value::Array(items) = reply else {
        return Err(StoreError::Protocol(format!("expected an array, got {reply:?}")));
    };
    let number = |i: usize| items.get(i).and_then(reply_number);
    let (Some(seconds), Some(micros)) = (number(7), number(8)) else {
        return Err(StoreError::Protocol(format!("expected TIME in the peek reply, got {items:?}")));
    };
    let state = match (number(0), number(1)) {
        (Some(tokens), Some(last)) => Some(BucketState {
            tokens,
            last_refill_ms: last as u64,
            fastest_refill: number(2).unwrap_or(0.0),
            pending_refill: number(3).unwrap_or(0.0),
            pending_from_ms: number(4).unwrap_or(0.0) as u64,
            largest_capacity: number(5).unwrap_or(0.0),
            slowest_refill: number(6).unwrap_or(0.0),
            leases: match items.get(10) {
                Some(Value::BulkString(h)) => parse_leases(&String::from_utf8_lossy(h))?,
                _ => Vec::new(),
            },
            // What other requests asked lately is not shown by `explain`.
            asked: Default::default(),
        }),
        _ => None,
    };
    let ttl_ms = number(9).filter(|t| *t >= 0.0).map(|t| t as u64);
    Ok(Peek { state, now_ms: (seconds * 1000.0 + (micros / 1000.0).floor()) as u64, ttl_ms })
}

// Reads the flat reply described at the top of `token_bucket.lua`: one outcome per group.
pub(super) fn groups(reply: Value, batch: &[Group]) -> Result<Vec<GroupOutcome>, StoreError> {
    let Value::Array(items) = reply else {
        return Err(StoreError::Protocol(format!("expected an array, got {reply:?}")));
    };
    let expected = 1 + batch.iter().map(|g| 1 + 7 * g.len()).sum::<usize>();
    if items.len() != expected {
        return Err(StoreError::Protocol(format!("expected {expected} values, got {}", items.len())));
    }
    let mut items = items.into_iter();
    let now_ms = u64::try_from(int(&mut items)?).unwrap_or(0);
    let mut outcomes = Vec::with_capacity(batch.len());
    for group in batch {
        outcomes.push(read_group(&mut items, group.len(), now_ms)?);
    }
    Ok(outcomes)
}

// One group's admission and `ops` verdicts, as the scripts reply them.
pub(super) fn read_group(
    items: &mut impl Iterator<Item = Value>,
    ops: usize,
    now_ms: u64,
) -> Result<GroupOutcome, StoreError> {
    let admitted = int(items)? == 1;
    let mut verdicts = Vec::with_capacity(ops);
    for _ in 0..ops {
        let allowed = int(items)? == 1;
        let tokens = float(items)?;
        let retry = int(items)?;
        let reset = int(items)?;
        let forgiven = float(items)?;
        let fastest_refill = float(items)?;
        let kept = int(items)?;
        verdicts.push(Verdict {
            allowed,
            tokens,
            retry_after_ms: u64::try_from(retry).ok(),
            reset_ms: u64::try_from(reset).unwrap_or(0),
            forgiven,
            fastest_refill,
            kept_ms: u64::try_from(kept).unwrap_or(0),
        });
    }
    Ok(GroupOutcome { admitted, now_ms, verdicts, refunded: false, unanswered: Vec::new() })
}

pub(super) fn int(items: &mut impl Iterator<Item = Value>) -> Result<i64, StoreError> {
    match items.next() {
        Some(Value::Int(i)) => Ok(i),
        other => Err(StoreError::Protocol(format!("expected an integer, got {other:?}"))),
    }
}

/// A slot set's reading as sets.lua appends one: open, expired, ms until it frees (-1: not
/// asked), given back (1/0).
pub(super) fn set_reading(items: &mut impl Iterator<Item = Value>) -> Result<SetReading, StoreError> {
    let open = u64::try_from(int(items)?).unwrap_or(0);
    let expired = u64::try_from(int(items)?).unwrap_or(0);
    let frees_in_ms = u64::try_from(int(items)?).ok();
    let given_back = int(items)? == 1;
    Ok(SetReading { open, expired, frees_in_ms, given_back })
}

// An exact number of the reply: an integer, or %.17g text where it is not integral.
fn float(items: &mut impl Iterator<Item = Value>) -> Result<f64, StoreError> {
    let item = items.next();
    item.as_ref()
        .and_then(reply_number)
        .ok_or_else(|| StoreError::Protocol(format!("expected a number, got {item:?}")))
}

// A number the scripts return as a bulk string (Lua numbers are not exact as integer replies).
fn bulk_number(bytes: &[u8]) -> Option<f64> {
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

// A number in a script's reply: a bulk string as above, or an integer.
fn reply_number(value: &Value) -> Option<f64> {
    match value {
        Value::BulkString(b) => bulk_number(b),
        Value::Int(n) => Some(*n as f64),
        _ => None,
    }
}
