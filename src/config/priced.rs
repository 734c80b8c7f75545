//! The checks of a priced domain (LLM spend budgets): its price table, the keys that name a
//! request's model and id, its hold settings, and the `budget:` of its nodes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use indexmap::IndexMap;
use serde_saphyr::Spanned;

use super::problem::{position, text, Problem};
use super::{raw, Priced};
use crate::budget::money::MAX_TOKENS;
use crate::budget::{BudgetSpec, Calendar, LostSettle, ModelPrices, Money, Per, PriceRow, PriceTable};

/// How long a hold stands unless settled, by default.
const DEFAULT_HOLD_TTL: Duration = Duration::from_secs(600);

/// The priced settings of a domain file, if it has `prices:`; `file` is the domain file, which a
/// `prices: {file: PATH}` is relative to.
pub(super) fn priced(raw: &mut raw::DomainFile, file: &Path) -> Result<Option<Priced>, Problem> {
    let keys_without_prices = [
        ("model_key", raw.model_key.as_ref().map(position)),
        ("input_bytes_key", raw.input_bytes_key.as_ref().map(position)),
        ("hold_ttl", raw.hold_ttl.as_ref().map(position)),
        ("on_lost_settle", raw.on_lost_settle.as_ref().map(position)),
    ];
    let Some(prices) = raw.prices.take() else {
        if let Some((key, at)) = keys_without_prices.into_iter().find(|(_, at)| at.is_some()) {
            return Err(Problem::new(key, at.flatten(), "only a domain with prices has budgets"));
        }
        return Ok(None);
    };
    let at = position(&prices);
    let (prices, prices_file) = price_table(prices.value, file).map_err(|m| Problem::new("prices", at, m))?;
    let (model_key, _) = text(raw.model_key.take());
    let (input_bytes_key, _) = text(raw.input_bytes_key.take());
    let (hold_ttl, ttl_at) = text(raw.hold_ttl.take());
    let hold_ttl = match hold_ttl {
        None => DEFAULT_HOLD_TTL,
        Some(t) => {
            humantime::parse_duration(&t).ok().filter(|d| *d >= Duration::from_secs(1)).ok_or_else(|| {
                Problem::new(
                    "hold_ttl",
                    ttl_at,
                    format!("'{t}' is not a duration of a second or more (10m, 90s)"),
                )
            })?
        }
    };
    let (lost, lost_at) = text(raw.on_lost_settle.take());
    let on_lost_settle = match lost.as_deref() {
        None | Some("charge") => LostSettle::Charge,
        Some("release") => LostSettle::Release,
        Some(other) => {
            return Err(Problem::new(
                "on_lost_settle",
                lost_at,
                format!("unknown answer '{other}' (expected charge or release)"),
            ))
        }
    };
    Ok(Some(Priced {
        prices: Arc::new(prices),
        prices_file,
        model_key: model_key.unwrap_or_else(|| "model".into()),
        input_bytes_key: input_bytes_key.unwrap_or_else(|| "input_bytes".into()),
        hold_ttl,
        on_lost_settle,
    }))
}

// The table inline, or read from its file.
fn price_table(raw: raw::Prices, file: &Path) -> Result<(PriceTable, Option<(PathBuf, u64)>), String> {
    let Some(path) = raw.file else { return Ok((table(raw)?, None)) };
    if raw.version.is_some() || raw.currency.is_some() || !raw.models.is_empty() {
        return Err("a price table is either inline or in `file:`, not both".into());
    }
    let path = file.parent().unwrap_or(Path::new(".")).join(path);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let raw: raw::Prices = serde_saphyr::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if raw.file.is_some() {
        return Err(format!("{}: a price file cannot name another (`file:`)", path.display()));
    }
    let hash = super::text_hash(&text);
    Ok((table(raw).map_err(|m| format!("{}: {m}", path.display()))?, Some((path, hash))))
}

fn table(raw: raw::Prices) -> Result<PriceTable, String> {
    let version = raw
        .version
        .filter(|v| !v.trim().is_empty())
        .ok_or("a price table needs its `version` (every hold records the version it was priced at)")?;
    if version.contains(char::is_whitespace) {
        return Err(format!("version '{version}' must not contain spaces"));
    }
    let currency = raw.currency.unwrap_or_else(|| "USD".into());
    if raw.models.is_empty() {
        return Err("a price table needs at least one model".into());
    }
    let mut models = IndexMap::new();
    let mut aliases = IndexMap::new();
    for (name, row) in raw.models {
        let row = row.value;
        let price = |kind: &str, text: Option<&String>| -> Result<Option<Money>, String> {
            text.map(|t| Money::parse(t).map_err(|e| format!("models.{name}.{kind}: {e}"))).transpose()
        };
        let (Some(input), Some(output)) =
            (price("input", row.input.as_ref())?, price("output", row.output.as_ref())?)
        else {
            return Err(format!("models.{name}: needs an input and an output price"));
        };
        let cached = price("cached_input", row.cached_input.as_ref())?.unwrap_or(input);
        let write = price("cache_write", row.cache_write.as_ref())?.unwrap_or(input);
        // Counts above MAX_TOKENS are not priced exactly; a maximum past it means none.
        let most = |key: &str, n: Option<u64>| -> Result<u64, String> {
            match n {
                None => Ok(MAX_TOKENS),
                Some(n) if (1..=MAX_TOKENS).contains(&n) => Ok(n),
                Some(n) => Err(format!("models.{name}.{key}: {n} is not between 1 and {MAX_TOKENS}")),
            }
        };
        let max_output_tokens = most("max_output_tokens", row.max_output_tokens)?;
        let max_input_tokens = most("max_input_tokens", row.max_input_tokens)?;
        let bytes_per_token = match row.bytes_per_token {
            None => 1,
            Some(n @ 1..=16) => n,
            Some(n) => return Err(format!("models.{name}.bytes_per_token: {n} is not between 1 and 16")),
        };
        for alias in row.aliases {
            if let Some(earlier) = aliases.insert(alias.clone(), name.clone()) {
                return Err(format!("models.{name}.aliases: '{alias}' is already an alias of {earlier}"));
            }
        }
        models.insert(
            name,
            ModelPrices {
                row: PriceRow([input, cached, write, output]),
                default_output_tokens: row
                    .default_output_tokens
                    .unwrap_or(DEFAULT_OUTPUT_TOKENS)
                    .min(max_output_tokens),
                reserve_input_tokens: row.reserve_input_tokens.unwrap_or(0).min(max_input_tokens),
                max_output_tokens,
                max_input_tokens,
                bytes_per_token,
            },
        );
    }
    if let Some(alias) = aliases.keys().find(|a| models.contains_key(*a)) {
        return Err(format!("'{alias}' is both a model and an alias"));
    }
    Ok(PriceTable { version, currency, models, aliases })
}

/// Output tokens held for a request that names none, where the model's row does not say.
const DEFAULT_OUTPUT_TOKENS: u64 = 1_000;

/// A node's `budget:`.
pub(super) fn budget(raw: &Spanned<raw::Budget>) -> Result<BudgetSpec, String> {
    let b = &raw.value;
    let amount = Money::parse(&b.amount).map_err(|e| format!("budget.amount: {e}"))?;
    let per = Per::parse(&b.per).ok_or_else(|| {
        format!("budget.per: unknown period '{}' (minute, hour, day, week, month or year)", b.per)
    })?;
    let calendar = Calendar::new(per, b.timezone.as_deref().unwrap_or("UTC"))
        .map_err(|e| format!("budget.timezone: {e}"))?;
    let mut alert_at = Vec::new();
    for text in &b.alert_at {
        let fraction = Money::parse(text)
            .ok()
            .filter(|f| f.0 > 0 && f.0 <= crate::budget::money::NANOS)
            .ok_or_else(|| format!("budget.alert_at: '{text}' is not a fraction above 0 and at most 1"))?;
        if alert_at.last().is_some_and(|last| *last >= fraction) {
            return Err(format!(
                "budget.alert_at: '{text}' is not above the one before (list them ascending)"
            ));
        }
        alert_at.push(fraction);
    }
    Ok(BudgetSpec { amount, calendar, alert_at, global: false })
}
