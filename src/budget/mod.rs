//! Money budgets for LLM spend: what a request may cost, decided at every level of its path at
//! once, held while it runs and settled when its usage is known.
//!
//! A domain with a price table (`prices:`) prices tokens per model and kind ([`PriceTable`]);
//! nodes of its tree with `budget:` cap the money spent under them in each calendar period
//! ([`BudgetSpec`], [`period`]). A request names its path down to a request id:
//!
//! * **At request time** it asks for a hold of the most it may cost ([`ModelPrices::hold`]): its
//!   output tokens (`max_tokens`, at most the model's `max_output_tokens`) at the output price
//!   plus its input tokens (from the body's size, at most `max_input_tokens`) at the dearest
//!   input-kind price, rounded up once. It is admitted only if every budget on its path has that
//!   much left (amount - spent - held) and every token bucket on its path has the tokens; then the
//!   hold is taken at every level, and the tokens from every bucket, in one atomic step
//!   ([`BudgetAction::Hold`]). The request's record binds its id to its path and hold: the id
//!   reused by any other request is refused ([`HoldVerdict::Reused`]).
//! * **At stream end** it reports its usage per token kind. Each kind is priced at the price
//!   version of the hold (rounded up once per kind) and charged at every level the hold was taken
//!   from, the hold released, the token buckets trued up from the tokens held to the tokens used
//!   ([`BudgetAction::Settle`]). A kind is settled once per request, however often it is sent.
//! * A hold not settled within its TTL is charged in full or released ([`LostSettle`]); a
//!   settlement that comes later is charged only what exceeds what the expiry charged.
//!
//! **The bound.** A level admits a request only while its spend and holds leave room for the
//! hold, so its spend in a period exceeds its amount by at most the sum, over requests in flight
//! when it was reached, of (settled cost - hold). The hold is an upper bound of what the upstream
//! can bill (`max_output_tokens`, and input bytes over a `bytes_per_token` no tokenizer of the
//! model goes below), and a settlement never charges more than those maxima: the term is zero
//! for every request that gives its body's size. Without the size it holds
//! `reserve_input_tokens`, and the term is at most (input used - reserve) x the input price.
//!
//! Money is integers of nano-units ([`money`]); nothing here is a float. The arithmetic is
//! [`ledger`] in Rust (the memory store's) and `store/redis/budget.lua` in Redis, kept equal by
//! `tests/equivalence.rs`.

pub mod ledger;
pub mod money;
pub mod period;

use indexmap::IndexMap;
use serde::Serialize;

pub use self::money::{cost, Money, MoneyError};
pub use self::period::{Calendar, Per, UnknownZone, Window};
use crate::bucket::BucketSpec;
use crate::slot::{SetsOutcome, SlotSet};

/// Every reason a priced request is refused for, as `tollgate_budget_refusals_total` counts it
/// (the limiter refuses; telemetry registers the series).
pub const REFUSALS: &[&str] = &[
    "malformed",
    "empty_request_id",
    "unknown_model",
    "hold_above_amount",
    "request_id_reused",
    "path_mismatch",
    "unknown_usage_kind",
];

/// A kind of token a model prices on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Prompt tokens read fresh (without cached and cache-write tokens).
    Input,
    /// Prompt tokens read from the provider's cache.
    CachedInput,
    /// Prompt tokens written to the provider's cache.
    CacheWrite,
    /// Generated tokens.
    Output,
}

impl Kind {
    /// Every kind, in price-row order.
    pub const ALL: [Kind; 4] = [Kind::Input, Kind::CachedInput, Kind::CacheWrite, Kind::Output];

    /// Reads the `usage` entry's value.
    pub fn parse(text: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == text)
    }

    /// The name a `usage` entry gives it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Input => "input",
            Kind::CachedInput => "cached_input",
            Kind::CacheWrite => "cache_write",
            Kind::Output => "output",
        }
    }
}

/// A model's price per million tokens of each kind, fallbacks applied (a cached or cache-write
/// price the table leaves out is the input price).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PriceRow(pub [Money; 4]);

impl PriceRow {
    /// The price of `kind`.
    pub fn price(&self, kind: Kind) -> Money {
        self.0[kind as usize]
    }

    /// The row as the stores keep it: four nano-unit integers.
    pub fn text(&self) -> String {
        self.0.map(Money::nanos).join(" ")
    }

    /// Reads [`PriceRow::text`].
    pub fn parse(text: &str) -> Option<PriceRow> {
        let prices: Option<Vec<Money>> = text.split(' ').map(Money::from_nanos).collect();
        Some(PriceRow(prices?.try_into().ok()?))
    }
}

/// One model's row of the price table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelPrices {
    /// Its prices.
    pub row: PriceRow,
    /// Output tokens held for a request that names none (`max_tokens` absent or 0).
    pub default_output_tokens: u64,
    /// Input tokens held for a request whose body size is not known.
    pub reserve_input_tokens: u64,
    /// The most output tokens a request can be billed (`max_output_tokens`): the most ever held,
    /// and the most an output count is charged for. [`money::MAX_TOKENS`] when not given.
    pub max_output_tokens: u64,
    /// The model's context window (`max_input_tokens`): the most input tokens held, and the most
    /// an input-kind count is charged for. [`money::MAX_TOKENS`] when not given.
    pub max_input_tokens: u64,
    /// Fewest bytes of request body a token of this model's tokenizer spans (`bytes_per_token`):
    /// a body of N bytes is at most N / this many input tokens. 1 (the default) holds for every
    /// byte-level tokenizer, since no token spans less than a byte.
    pub bytes_per_token: u64,
}

impl ModelPrices {
    /// What a request asking for `output_tokens` holds, its body `input_bytes` long if known:
    /// its money (rounded up once) and tokens. Output is `max_tokens` (the model's default if 0)
    /// and input the body's size in tokens (`reserve_input_tokens` without it), each at most the
    /// model's maximum; input is priced at the dearest of the input kinds, since the usage may
    /// come back as any of them.
    pub fn hold(&self, output_tokens: u64, input_bytes: Option<u64>) -> (Money, u64) {
        let output = if output_tokens == 0 { self.default_output_tokens } else { output_tokens };
        let output = output.min(self.max_output_tokens);
        let input =
            input_bytes.map_or(self.reserve_input_tokens, |b| b.div_ceil(self.bytes_per_token.max(1)));
        let input = input.min(self.max_input_tokens);
        let input_price = [Kind::Input, Kind::CachedInput, Kind::CacheWrite]
            .map(|k| self.row.price(k))
            .into_iter()
            .max()
            .unwrap_or_default();
        let scaled = u128::from(output) * self.row.price(Kind::Output).0 + u128::from(input) * input_price.0;
        (Money(scaled.div_ceil(money::PRICE_PER_TOKENS)), output.saturating_add(input))
    }

    /// The most `kind` can be charged for: the context window for input kinds,
    /// `max_output_tokens` for output.
    pub fn most(&self, kind: Kind) -> u64 {
        match kind {
            Kind::Output => self.max_output_tokens,
            Kind::Input | Kind::CachedInput | Kind::CacheWrite => self.max_input_tokens,
        }
    }
}

/// A pinned price table: its version, currency and a row per model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriceTable {
    /// The version every hold records and settles under.
    pub version: String,
    /// The currency of every amount and price (`USD`).
    pub currency: String,
    /// The rows, by model name.
    pub models: IndexMap<String, ModelPrices>,
    /// Other names of a model (`aliases:`, e.g. dated snapshots), to the model's name.
    pub aliases: IndexMap<String, String>,
}

impl PriceTable {
    /// The row of `name`, a model or one of its aliases, and the model's own name.
    pub fn model(&self, name: &str) -> Option<(&str, &ModelPrices)> {
        let name = self.aliases.get(name).map_or(name, String::as_str);
        self.models.get_key_value(name).map(|(k, v)| (k.as_str(), v))
    }
}

/// A money budget on a node: an amount per calendar period.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetSpec {
    /// The money a period allows.
    pub amount: Money,
    /// Its periods.
    pub calendar: Calendar,
    /// Soft limits (`alert_at:`): fractions of the amount, ascending, in nano-units of one
    /// (0.8 is 800,000,000), whose crossing by the spend is logged and counted once a period.
    pub alert_at: Vec<Money>,
    /// `global: true`: one budget for every region, spent by each region from a money lease of
    /// it (`docs/src/design/global-limits.md`).
    pub global: bool,
}

impl BudgetSpec {
    /// The spend at which each of `alert_at` is crossed, for an amount of `amount`.
    pub fn alerts(&self, amount: Money) -> Vec<Money> {
        self.alert_at.iter().map(|f| Money((amount.0 * f.0).div_ceil(money::NANOS))).collect()
    }
}

/// A budget's amount, and optionally its period, set for one level of one domain without a file
/// edit (`tollgate budget set`, read from PostgreSQL beside tenant quotas).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetOverride {
    /// The money a period allows.
    pub amount: Money,
    /// The period, when it differs from the file's.
    pub per: Option<Per>,
}

/// What an expired hold becomes (`on_lost_settle:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LostSettle {
    /// Charged in full (a lost settlement must not make a request free).
    #[default]
    Charge,
    /// Released.
    Release,
}

impl LostSettle {
    /// The word the stores use.
    pub fn name(self) -> &'static str {
        match self {
            LostSettle::Charge => "charge",
            LostSettle::Release => "release",
        }
    }
}

/// A budget on a request's path, as an op names it.
#[derive(Debug, Clone, PartialEq)]
pub struct LevelOp {
    /// Its key without the period ([`crate::identity::budget_level`]).
    pub base: String,
    /// Its amount per period.
    pub amount: Money,
    /// The periods around the caller's clock ([`Calendar::around`]); the store picks by its own.
    pub around: [i64; 4],
    /// The spends at which its soft limits are crossed, ascending ([`BudgetSpec::alerts`]).
    pub alerts: Vec<Money>,
}

/// A token bucket on a request's path.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketLevel {
    /// Its key.
    pub key: String,
    /// Its capacity and rate.
    pub spec: BucketSpec,
}

/// One request's budget op.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetOp {
    /// The key of the request's record ([`crate::identity::budget_record`]).
    pub record: String,
    /// What the record binds the request id to: the request's path, model included
    /// ([`crate::identity::budget_binding`]). An op whose binding differs from the record's
    /// belongs to another request: its hold is refused, its settlement charges nothing.
    pub binding: String,
    /// The budgets on its path, top first.
    pub levels: Vec<LevelOp>,
    /// The token buckets on its path, top first.
    pub buckets: Vec<BucketLevel>,
    /// The concurrency limits on its path, top first: a hold takes a slot of each, all or
    /// nothing with its budgets and buckets; a settlement or a cancel gives it back.
    pub sets: Vec<SlotSet>,
    /// The price version in force, and the model's row in it.
    pub version: String,
    /// The model's prices at that version.
    pub row: PriceRow,
    /// What an expired hold becomes.
    pub lost: LostSettle,
    /// How long a record, and a period's state past its end, are kept: the hold TTL plus
    /// [`RECORD_GRACE_MS`].
    pub life_ms: u64,
    /// Hold or settle.
    pub action: BudgetAction,
}

/// How long a request's record outlives its hold: a settlement later than that is charged as
/// one that never had a hold.
pub const RECORD_GRACE_MS: u64 = 3_600_000;

impl BudgetOp {
    /// An op on `levels` alone, for no request (a peek of standing money, or a lease), in the
    /// slot of `slot_key`.
    pub fn on_levels(
        slot_key: String,
        levels: Vec<LevelOp>,
        lost: LostSettle,
        life_ms: u64,
        action: BudgetAction,
    ) -> BudgetOp {
        BudgetOp {
            record: slot_key,
            binding: String::new(),
            levels,
            buckets: Vec::new(),
            sets: Vec::new(),
            version: String::new(),
            row: PriceRow([Money::ZERO; 4]),
            lost,
            life_ms,
            action,
        }
    }
}

/// What a budget op does.
#[derive(Debug, Clone, PartialEq)]
pub enum BudgetAction {
    /// Take a hold of `amount` and `tokens` for `ttl_ms`, or nothing.
    Hold {
        /// The money held at every level.
        amount: Money,
        /// The tokens taken from every bucket.
        tokens: u64,
        /// How long the hold stands unless settled.
        ttl_ms: u64,
    },
    /// Charge the usage: per kind its tokens and their cost at the op's version.
    Settle {
        /// `(kind, tokens, cost)`.
        usage: Vec<(Kind, u64, Money)>,
    },
    /// Read every level's spent and held money in the period the store's clock is in, changing
    /// nothing (`tollgate explain`).
    Peek,
    /// Undo a hold whose answer never reached the caller, which then denied the request: an
    /// open hold is released and its tokens given back; with no record yet, one is left closed,
    /// so that the hold, should it still arrive, takes nothing.
    Cancel,
    /// Set `holder`'s money lease of every level (a global budget's, at the global tier): its
    /// spend so far is charged, and what it may still spend is held for it until `ttl_ms`
    /// from now, as much as it wants and the level has room for, never less than it had unless
    /// it asks for less ([`LeaseReport`]). A lease not renewed in time is charged whole: the
    /// holder may have spent it all.
    Lease {
        /// The leaseholder (`<region>/<replica>`, no whitespace).
        holder: String,
        /// How long the lease stands unless renewed.
        ttl_ms: u64,
        /// Per level, what the holder reports and wants.
        reports: Vec<LeaseReport>,
    },
}

/// A leaseholder's report of one level, in its period: both amounts since the period began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseReport {
    /// What it has spent (charged on its side): the level is charged what exceeds what was
    /// reported before, so a report sent twice charges once.
    pub spent: Money,
    /// What it wants granted in all, spent included: below what it was granted, a shrink (the
    /// holder has committed no more than this); above, a growth, as far as the level's room goes.
    pub wanted: Money,
    /// The holder's count of its renewals: one older than the last applied (a stray that
    /// arrives late, by another global replica) has its spend charged but leaves the grant as
    /// it is, so that a stale shrink cannot undo a newer grant the holder already spends from.
    pub round: u64,
}

/// A level after a lease op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseReading {
    /// What the holder is granted in all in the period, its reported spend included.
    pub granted: Money,
    /// The level's spent and held money (every lease's unspent part held).
    pub spent: Money,
    /// Held.
    pub held: Money,
    /// When its period ends (ms since the epoch, the store's clock).
    pub end_ms: i64,
}

/// A level after an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LevelReading {
    /// Spent and held in its period.
    pub used: Money,
    /// Spent in its period.
    pub spent: Money,
    /// When its period ends (ms since the epoch, the store's clock).
    pub end_ms: i64,
    /// How many of the level's alerts the spend had crossed before the op and has after it
    /// (as the store counts them, once a period across every replica): `(2, 3)` means the op
    /// crossed the third.
    pub alerted: (u32, u32),
}

/// What a hold op decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldVerdict {
    /// Held at every level.
    Admitted,
    /// The request already has an open record with the same path and hold (a retried call):
    /// admitted, nothing taken again.
    Duplicate,
    /// The request id has a record of another request (another path or hold, or one that is
    /// closed): refused, nothing taken.
    Reused,
    /// A budget or a bucket is short; nothing taken.
    Denied,
}

/// What a settlement found of its hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HadHold {
    /// Open: released now.
    Open,
    /// Expired unsettled (charged or released as `on_lost_settle` says).
    Expired,
    /// Settled before (another kind, or a retry).
    Settled,
    /// None: never held, or its record is gone.
    None,
    /// The record is another request's (another path): nothing charged or released.
    Other,
}

/// The store's answer to a [`BudgetOp`].
#[derive(Debug, Clone, PartialEq)]
pub enum BudgetOutcome {
    /// A hold op's answer.
    Held {
        /// The store's clock.
        now_ms: u64,
        /// The verdict.
        verdict: HoldVerdict,
        /// The first budget, from the top, that could not cover the hold.
        exhausted: Option<usize>,
        /// The first token bucket that lacked the tokens.
        short: Option<usize>,
        /// Every level, after the op.
        levels: Vec<LevelReading>,
        /// Every bucket's tokens and wait until it covers the hold (ms; `None`: never), when
        /// the buckets were asked.
        buckets: Vec<(f64, Option<u64>)>,
        /// Other requests' holds this op found expired (counted at its top level).
        expired: u64,
        /// Its concurrency sets (none read for a retry or a reused id).
        slots: SetsOutcome,
    },
    /// A settlement's answer.
    Settled {
        /// The store's clock.
        now_ms: u64,
        /// Money charged at every level by this op.
        charged: Money,
        /// What it found of its hold.
        had: HadHold,
        /// Every level charged, after the op.
        levels: Vec<LevelReading>,
        /// Holds this op found expired (counted at its top level).
        expired: u64,
        /// Its concurrency sets, the request's slot given back.
        slots: SetsOutcome,
    },
    /// A peek's answer: per level, spent and held money (holds past their expiry included until
    /// an op finds them) and the period's end.
    Peeked {
        /// The store's clock.
        now_ms: u64,
        /// `(spent, held, period end ms)` per level, top first.
        levels: Vec<(Money, Money, i64)>,
        /// Per level, its money leases (a global budget's, at the global tier): each
        /// leaseholder's grant and reported spend, by leaseholder.
        leases: Vec<Vec<(String, Money, Money)>>,
    },
    /// A cancel's answer: what it found of the hold (`Open`: released; `None`: closed before it
    /// could be taken).
    Cancelled {
        /// The store's clock.
        now_ms: u64,
        /// What it found.
        had: HadHold,
        /// Holds this op found expired (counted at its top level).
        expired: u64,
        /// Its concurrency sets, the request's slot given back.
        slots: SetsOutcome,
    },
    /// A lease op's answer, per level.
    Leased {
        /// The store's clock.
        now_ms: u64,
        /// Per level, top first.
        levels: Vec<LeaseReading>,
    },
    /// The hold was made at another price version: price the usage at this row and send again.
    Reprice {
        /// The store's clock.
        now_ms: u64,
        /// The hold's version.
        version: String,
        /// The model's row at that version.
        row: PriceRow,
    },
}
