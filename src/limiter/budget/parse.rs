//! A priced descriptor taken apart: what it asks for (a hold or a settlement, on which path) and
//! why it may be refused before the store is asked; and what a settlement's counts cost, capped
//! at the model's maxima.

use super::{REFUSED_REQUEST, REFUSED_REQUEST_ID, SERVED_MODEL_KEY, USAGE_KEY};
use crate::budget::money::MAX_TOKENS;
use crate::budget::{cost, Kind, Money, PriceRow};
use crate::config::{Domain, Priced};
use crate::telemetry::logs;

// Why a descriptor gets no op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    // Not a path down to a request id, one for one.
    Malformed,
    // An empty request id.
    EmptyId,
    // The model has no price.
    UnknownModel,
    // The hold is larger than a level's whole amount.
    TooLarge,
}

impl Refusal {
    pub(super) fn exhausted(self, priced: &Priced) -> &str {
        match self {
            Refusal::Malformed | Refusal::TooLarge => REFUSED_REQUEST,
            Refusal::EmptyId => REFUSED_REQUEST_ID,
            Refusal::UnknownModel => &priced.model_key,
        }
    }

    pub(super) fn reason(self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::EmptyId => "empty_request_id",
            Refusal::UnknownModel => "unknown_model",
            Refusal::TooLarge => "hold_above_amount",
        }
    }
}

/// A priced descriptor's entries, taken apart: the path through the tree (levels, model and
/// request id), the body size, and for a stream-end call the served model and usage kind.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Parsed<'q> {
    pub(super) path: Vec<(&'q str, &'q str)>,
    pub(super) input_bytes: Option<u64>,
    pub(super) served: Option<&'q str>,
    pub(super) usage: Option<&'q str>,
}

pub(super) fn parse<'q>(
    domain: &Domain,
    priced: &Priced,
    entries: &[(&'q str, &'q str)],
) -> Result<Parsed<'q>, Refusal> {
    let (mut rest, usage) = match entries.split_last() {
        Some((&(USAGE_KEY, kind), rest)) => (rest, Some(kind)),
        _ => (entries, None),
    };
    let mut served = None;
    if usage.is_some() {
        if let Some((&(SERVED_MODEL_KEY, model), before)) = rest.split_last() {
            served = Some(model);
            rest = before;
        }
    }
    let Some((&(id_key, id), before)) = rest.split_last() else { return Err(Refusal::Malformed) };
    if id_key != domain.request_id_key {
        return Err(Refusal::Malformed);
    }
    let mut path = before.to_vec();
    let mut input_bytes = None;
    if let Some(&(key, bytes)) = path.last() {
        if key == priced.input_bytes_key {
            input_bytes = Some(bytes.parse::<u64>().map_err(|_| Refusal::Malformed)?);
            path.pop();
        }
    }
    path.push((id_key, id));
    Ok(Parsed { path, input_bytes, served, usage })
}

// The row a settlement is priced at, and the most each kind is charged for: the served model's
// when the table has it, else the held model's; no row when neither is in the table (the
// record's row then prices it).
pub(super) fn settlement_price(priced: &Priced, parsed: &Parsed<'_>) -> (Option<PriceRow>, [u64; 4]) {
    let held = parsed.path.iter().find(|(k, _)| *k == priced.model_key).map(|(_, v)| *v);
    let model = parsed.served.and_then(|m| priced.prices.model(m)).or_else(|| priced.prices.model(held?));
    match model {
        Some((_, row)) => (Some(row.row), Kind::ALL.map(|k| row.most(k))),
        None => (None, [MAX_TOKENS; 4]),
    }
}

// `tokens` of `kind`, at most `most[kind]` (the model's maximum for the kind: more is charged
// at the maximum, logged and counted), and what they cost at `row`'s prices.
pub(super) fn capped_usage(
    domain: &Domain,
    row: &PriceRow,
    most: [u64; 4],
    kind: Kind,
    tokens: u64,
) -> (Kind, u64, Money) {
    let most = most[kind as usize];
    if tokens > most {
        metrics::counter!("tollgate_budget_usage_capped_total", "domain" => domain.name.clone(), "kind" => kind.name())
            .increment(1);
        if let Some(held_back) = logs::throttled("budget_usage_capped") {
            tracing::warn!(domain = %domain.name, kind = kind.name(), tokens, charged_as = most, held_back, "a usage count above the model's maximum was charged at the maximum");
        }
    }
    let tokens = tokens.min(most);
    (kind, tokens, cost(tokens, row.price(kind)))
}
