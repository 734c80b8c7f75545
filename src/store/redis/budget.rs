//! Money budgets in Redis: one `budget.lua` run (after `bucket.lua` and `group.lua`) per op, in
//! the slot of the request's org, which every key of the op shares.

use redis::Value;

use super::wire;
use super::RedisStore;
use crate::budget::{
    BudgetAction, BudgetOp, BudgetOutcome, HadHold, HoldVerdict, LeaseReading, LevelReading, Money, PriceRow,
};
use crate::slot::SetsOutcome;
use crate::store::StoreError;

impl RedisStore {
    pub(super) async fn budget_op(&self, op: &BudgetOp) -> Result<BudgetOutcome, StoreError> {
        let slot = self.shared.connection.slot(&op.record);
        let mut keys: Vec<&str> = vec![&op.record];
        keys.extend(op.buckets.iter().map(|b| b.key.as_str()));
        keys.extend(op.sets.iter().map(|s| s.key.as_str()));
        let (name, debt) = match op.action {
            BudgetAction::Hold { .. } => ("hold", false),
            BudgetAction::Settle { .. } => ("settle", true),
            BudgetAction::Cancel => ("cancel", false),
            BudgetAction::Peek => ("peek", false),
            BudgetAction::Lease { .. } => ("lease", false),
        };
        let mut args = vec![
            name.to_owned(),
            op.lost.name().to_owned(),
            op.life_ms.to_string(),
            op.version.clone(),
            op.row.text(),
            op.binding.clone(),
            op.levels.len().to_string(),
        ];
        for level in &op.levels {
            args.extend([level.base.clone(), level.amount.nanos()]);
            args.extend(level.around.iter().map(i64::to_string));
            args.push(level.alerts.len().to_string());
            args.extend(level.alerts.iter().map(|a| a.nanos()));
        }
        args.push(op.buckets.len().to_string());
        for (i, b) in op.buckets.iter().enumerate() {
            // A settlement trues a bucket up whatever it has, down to a capacity's debt.
            let debt = if debt { b.spec.capacity().to_string() } else { String::new() };
            args.extend([
                (i + 2).to_string(),
                b.spec.capacity().to_string(),
                b.spec.refill_per_second().to_string(),
                debt,
            ]);
        }
        args.push(op.sets.len().to_string());
        for (i, set) in op.sets.iter().enumerate() {
            args.extend([
                (i + 2 + op.buckets.len()).to_string(),
                set.max.to_string(),
                set.ttl_ms.to_string(),
            ]);
        }
        match &op.action {
            BudgetAction::Hold { amount, tokens, ttl_ms } => {
                args.extend([amount.nanos(), tokens.to_string(), ttl_ms.to_string()]);
            }
            BudgetAction::Cancel | BudgetAction::Peek => {}
            BudgetAction::Lease { holder, ttl_ms, reports } => {
                args.extend([holder.clone(), ttl_ms.to_string()]);
                for report in reports {
                    args.extend([report.spent.nanos(), report.wanted.nanos(), report.round.to_string()]);
                }
            }
            BudgetAction::Settle { usage } => {
                args.push(usage.len().to_string());
                for (kind, tokens, cost) in usage {
                    args.extend([kind.name().to_owned(), tokens.to_string(), cost.nanos()]);
                }
            }
        }
        let reply =
            self.shared.eval_in_slot(&self.shared.budget_script, slot, &keys, &wire::texts(&args)).await?;
        parse(reply)
    }
}

// The script's reply (see budget.lua).
fn parse(reply: Value) -> Result<BudgetOutcome, StoreError> {
    let Value::Array(items) = reply else { return Err(bad("expected an array")) };
    let mut r = Reply(items.into_iter());
    let now_ms = u64::try_from(r.int()?).map_err(|_| bad("a negative clock"))?;
    let outcome = r.text()?;
    let verdict = match outcome.as_str() {
        "admitted" => HoldVerdict::Admitted,
        "duplicate" => HoldVerdict::Duplicate,
        "reused" => HoldVerdict::Reused,
        "denied" => HoldVerdict::Denied,
        "settled" => {
            let charged = r.money()?;
            let had = r.had()?;
            let levels = r.readings()?;
            let expired = r.count()?;
            let slots = r.sets(false)?;
            return Ok(BudgetOutcome::Settled { now_ms, charged, had, levels, expired, slots });
        }
        "peeked" => {
            let (mut levels, mut leases) = (Vec::new(), Vec::new());
            while r.0.len() > 0 {
                levels.push((r.money()?, r.money()?, r.int()?));
                let mut of_level = (0..r.count()?)
                    .map(|_| Ok((r.text()?, r.money()?, r.money()?)))
                    .collect::<Result<Vec<_>, StoreError>>()?;
                // Redis keeps a hash in no order; the memory store's is by leaseholder.
                of_level.sort_by(|a, b| a.0.cmp(&b.0));
                leases.push(of_level);
            }
            return Ok(BudgetOutcome::Peeked { now_ms, levels, leases });
        }
        "leased" => {
            let mut levels = Vec::new();
            while r.0.len() > 0 {
                levels.push(LeaseReading {
                    granted: r.money()?,
                    spent: r.money()?,
                    held: r.money()?,
                    end_ms: r.int()?,
                });
            }
            return Ok(BudgetOutcome::Leased { now_ms, levels });
        }
        "cancelled" => {
            let had = r.had()?;
            let expired = r.count()?;
            return Ok(BudgetOutcome::Cancelled { now_ms, had, expired, slots: r.sets(false)? });
        }
        "reprice" => {
            let version = r.text()?;
            let row = PriceRow::parse(&r.text()?).ok_or_else(|| bad("not a price row"))?;
            return Ok(BudgetOutcome::Reprice { now_ms, version, row });
        }
        other => return Err(bad(&format!("unknown outcome '{other}'"))),
    };
    let exhausted = usize::try_from(r.int()? - 1).ok();
    let short = usize::try_from(r.int()? - 1).ok();
    let levels = r.readings()?;
    let buckets = (0..r.int()?)
        .map(|_| Ok((r.float()?, u64::try_from(r.int()?).ok())))
        .collect::<Result<Vec<_>, StoreError>>()?;
    let expired = r.count()?;
    let slots = r.sets(true)?;
    Ok(BudgetOutcome::Held { now_ms, verdict, exhausted, short, levels, buckets, expired, slots })
}

fn bad(what: &str) -> StoreError {
    StoreError::Protocol(format!("budget script: {what}"))
}

// The reply's items, read in order.
struct Reply(std::vec::IntoIter<Value>);

impl Reply {
    fn next(&mut self) -> Result<Value, StoreError> {
        self.0.next().ok_or_else(|| bad("reply too short"))
    }

    fn int(&mut self) -> Result<i64, StoreError> {
        match self.next()? {
            Value::Int(i) => Ok(i),
            other => Err(bad(&format!("expected an integer, got {other:?}"))),
        }
    }

    fn text(&mut self) -> Result<String, StoreError> {
        match self.next()? {
            Value::BulkString(b) => String::from_utf8(b).map_err(|_| bad("not UTF-8")),
            Value::SimpleString(s) => Ok(s),
            other => Err(bad(&format!("expected a string, got {other:?}"))),
        }
    }

    fn count(&mut self) -> Result<u64, StoreError> {
        u64::try_from(self.int()?).map_err(|_| bad("a negative count"))
    }

    // The sets' readings, then for a hold the full set that refused it.
    fn sets(&mut self, hold: bool) -> Result<SetsOutcome, StoreError> {
        let mut readings = Vec::new();
        for _ in 0..self.count()? {
            readings.push(wire::set_reading(&mut self.0)?);
        }
        let full = if hold { (self.count()? as usize).checked_sub(1) } else { None };
        Ok(SetsOutcome { readings, full })
    }

    fn had(&mut self) -> Result<HadHold, StoreError> {
        match self.text()?.as_str() {
            "open" => Ok(HadHold::Open),
            "expired" => Ok(HadHold::Expired),
            "settled" => Ok(HadHold::Settled),
            "none" => Ok(HadHold::None),
            "other" => Ok(HadHold::Other),
            other => Err(bad(&format!("unknown hold state '{other}'"))),
        }
    }

    fn money(&mut self) -> Result<Money, StoreError> {
        Money::from_nanos(&self.text()?).ok_or_else(|| bad("not an amount"))
    }

    fn float(&mut self) -> Result<f64, StoreError> {
        self.text()?.parse().map_err(|_| bad("not a number"))
    }

    // A count, then per level: used and spent money, period end, alerts crossed before and after.
    fn readings(&mut self) -> Result<Vec<LevelReading>, StoreError> {
        (0..self.int()?)
            .map(|_| {
                Ok(LevelReading {
                    used: self.money()?,
                    spent: self.money()?,
                    end_ms: self.int()?,
                    alerted: (self.alerts()?, self.alerts()?),
                })
            })
            .collect()
    }

    fn alerts(&mut self) -> Result<u32, StoreError> {
        u32::try_from(self.int()?).map_err(|_| bad("not an alert count"))
    }
}
