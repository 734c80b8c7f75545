//! What goes into a decision and what comes out, in no protocol's terms: the [`Query`] a
//! protocol edge builds from its request, and the [`Decision`] it turns back into its answer,
//! descriptor by descriptor, with what decided each one.

use std::sync::Arc;

use serde::Serialize;

use crate::bucket::{BucketSpec, Verdict};
use crate::config::{Domain, FailureMode, Rule};
use crate::slot::SlotVerdict;
use crate::store::StoreError;
use crate::units::RatePerUnit;

use super::BudgetReport;

/// A rate-limit question, in no protocol's terms.
#[derive(Debug, Clone)]
pub struct Query<'q> {
    /// The domain whose rules apply.
    pub domain: &'q str,
    /// The descriptors, each decided and answered in order.
    pub descriptors: Vec<QueryDescriptor<'q>>,
}

/// One descriptor of a [`Query`].
#[derive(Debug, Clone)]
pub struct QueryDescriptor<'q> {
    /// `(key, value)` entries, matched level by level against the domain's tree.
    pub entries: Vec<(&'q str, &'q str)>,
    /// Hits to take (each costs the rule's `cost` in tokens); 0 only checks.
    pub hits: u64,
    /// Give the hits back instead of taking them.
    pub credit: bool,
    /// A request-level limit that replaces whatever rule matches.
    pub limit: Option<RatePerUnit>,
}

/// The verdict on a whole request or one descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Code {
    /// Within the limit.
    Ok,
    /// Over the limit.
    OverLimit,
}

/// Why a query got no decision.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DecideError {
    /// The store failed in a domain whose failure mode is `error`: the caller answers that it
    /// is unavailable and lets its client's own failure policy decide.
    #[error("rate limit store unavailable for domain '{domain}': {source}")]
    Unavailable {
        /// The domain asked.
        domain: String,
        /// What failed.
        #[source]
        source: StoreError,
    },
}

/// The answer to one query.
#[derive(Debug, Clone)]
pub struct Decision {
    /// OVER_LIMIT if any enforced descriptor is, or every quota-mode descriptor is; else OK.
    pub overall: Code,
    /// One verdict per query descriptor, in query order.
    pub descriptors: Vec<DescriptorVerdict>,
    /// The domain that decided, if it is configured.
    pub domain: Option<Arc<Domain>>,
}

/// The answer for one descriptor.
#[derive(Debug, Clone)]
pub struct DescriptorVerdict {
    /// OK or OVER_LIMIT (shadow rules are always OK).
    pub code: Code,
    /// What decided it.
    pub outcome: Outcome,
    /// Hits the descriptor asked for (tokens = hits x the rule's cost).
    pub hits: u64,
}

/// What decided a descriptor's code.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// No limit applies: unknown domain, no matching rule, a whitelisted node, or replaced.
    NoLimit,
    /// An `unlimited` rule.
    Unlimited,
    /// A bucket was evaluated.
    Bucket(BucketReport),
    /// A priced request's budgets decided ([`crate::budget`]).
    Budget(BudgetReport),
    /// The store failed on a priced request's budgets and the failure mode answered.
    BudgetFailed {
        /// The mode applied.
        mode: FailureMode,
    },
    /// Concurrency slots taken or given back ([`crate::slot`]).
    Slot(SlotReport),
    /// The store failed on a take of concurrency slots and the failure mode answered.
    SlotFailed {
        /// The mode applied.
        mode: FailureMode,
    },
    /// The store failed and the failure mode answered.
    StoreFailed {
        /// The limit that could not be checked.
        limit: LimitInfo,
        /// The mode applied.
        mode: FailureMode,
    },
}

/// A descriptor's concurrency slots: taken (or refused) at request time, given back at stream end.
#[derive(Debug, Clone)]
pub struct SlotReport {
    /// Each slot set on the path, top first.
    pub sets: Vec<SlotLimit>,
    /// What became of the take or give-back.
    pub verdict: SlotVerdict,
    /// The descriptor's own bucket (a take on a path with a rule).
    pub bucket: Option<BucketReport>,
}

impl SlotReport {
    /// Whether the take admitted the request (a give-back always does).
    pub fn admitted(&self) -> bool {
        !matches!(self.verdict, SlotVerdict::Refused(_) | SlotVerdict::Repeated(false) | SlotVerdict::Reused)
    }

    /// The set with the fewest slots left, if any.
    pub fn tightest(&self) -> Option<&SlotLimit> {
        self.sets.iter().min_by_key(|s| s.max.saturating_sub(s.open))
    }
}

/// One slot set after an op.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotLimit {
    /// The node's path (its keys), the rule label of its metrics.
    pub node: String,
    /// Most slots open at once.
    pub max: u64,
    /// Slots open after the op.
    pub open: u64,
    /// Slots the op found expired and dropped.
    pub expired: u64,
    /// For a full set on a refused take, how long until its earliest slot expires.
    pub frees_in_ms: Option<u64>,
}

impl SlotLimit {
    /// `set` (the node `node`'s) as an op left it: its reading, or nothing read.
    pub(super) fn of(
        set: &crate::slot::SlotSet,
        node: &str,
        reading: Option<&crate::slot::SetReading>,
    ) -> SlotLimit {
        SlotLimit {
            node: node.to_owned(),
            max: set.max,
            open: reading.map_or(0, |r| r.open),
            expired: reading.map_or(0, |r| r.expired),
            frees_in_ms: reading.and_then(|r| r.frees_in_ms),
        }
    }
}

/// The limit a descriptor was held to.
#[derive(Debug, Clone)]
pub struct LimitInfo {
    /// The rule, or `None` for a request-level limit override (which ignores the rule).
    pub rule: Option<Arc<Rule>>,
    /// A name for the limit in responses: the rule's name, else its class, else empty.
    pub name: String,
    /// The bucket's capacity and rate.
    pub spec: BucketSpec,
    /// The limit as "N per unit": as configured for `rate_limit` rules and overrides, the
    /// sustained rate otherwise (see [`RatePerUnit::of_rate`]).
    pub current_limit: RatePerUnit,
    /// The bucket's storage key.
    pub key: String,
}

/// A bucket's state after a decision.
#[derive(Debug, Clone)]
pub struct BucketReport {
    /// The limit applied.
    pub limit: LimitInfo,
    /// The store's verdict for this descriptor's operation.
    pub verdict: Verdict,
    /// The rule is in shadow mode (or the service is): a denial was not enforced.
    pub shadow: bool,
    /// The rule is in quota mode: a denial counts only if every quota-mode descriptor is denied.
    pub quota_mode: bool,
    /// In a region, a global bucket decided without a live share here (`global_fallback`).
    pub fallback: Option<GlobalFallback>,
}

/// How a region decided a global bucket it holds no live share of (none leased within the
/// first-lease wait, or it lapsed): denied, or on its split of the bucket in its own store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobalFallback {
    /// Denied (no `global_fallback`).
    Deny,
    /// Decided on the region's part of the bucket (`global_fallback: {split: N}`).
    Split,
}

impl GlobalFallback {
    /// As the `fallback` label of `tollgate_global_fallbacks_total` and the answer's header name it.
    pub fn as_str(self) -> &'static str {
        match self {
            GlobalFallback::Deny => "deny",
            GlobalFallback::Split => "split",
        }
    }
}

impl BucketReport {
    /// Whole tokens left, as reported to clients: never negative (0 while in debt).
    pub fn remaining(&self) -> u32 {
        self.verdict.tokens.max(0.0).floor().min(f64::from(u32::MAX)) as u32
    }

    /// Whether this bucket lacked the tokens (shadow denials included).
    pub fn denied(&self) -> bool {
        !self.verdict.allowed
    }
}

impl DescriptorVerdict {
    /// The limit this descriptor was held to, if any.
    pub fn limit(&self) -> Option<&LimitInfo> {
        match &self.outcome {
            Outcome::Bucket(b) => Some(&b.limit),
            Outcome::Slot(SlotReport { bucket: Some(b), .. }) => Some(&b.limit),
            Outcome::StoreFailed { limit, .. } => Some(limit),
            Outcome::NoLimit
            | Outcome::Unlimited
            | Outcome::Budget(_)
            | Outcome::BudgetFailed { .. }
            | Outcome::Slot(_)
            | Outcome::SlotFailed { .. } => None,
        }
    }
}
