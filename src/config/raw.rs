//! The YAML schema, exactly as written in files.
//!
//! The envoyproxy/ratelimit keys come first in each struct, tollgate's extensions after. Every
//! struct denies unknown fields, so a typo is an error and not a silently ignored rule. Meaning
//! (units, exclusivity, references between tiers) is checked in [`super::compile`]; the values
//! such a check can reject are `Spanned`, so that its error points at their line and column.
#![allow(missing_docs)] // the fields are the YAML keys, documented in docs/src/configuration.md

use indexmap::IndexMap;

use serde::Deserialize;
use serde_saphyr::Spanned;

use crate::bucket::BucketSpec;
use crate::rule::Source;

/// The most YAML nodes (mappings, sequences and scalars) one domain file may hold: the parser's
/// budget (serde-saphyr's default, set here so that the error can name it), which keeps a
/// crafted file from growing a reload without limit.
pub const MAX_NODES: usize = 250_000;

/// One config file: one domain.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DomainFile {
    pub domain: Option<Spanned<String>>,
    #[serde(default)]
    pub descriptors: Option<Vec<Descriptor>>,

    pub tenant_key: Option<Spanned<String>>,
    pub default_tier: Option<Spanned<String>>,
    #[serde(default)]
    pub tiers: IndexMap<String, IndexMap<String, Spanned<TokenBucket>>>,
    #[serde(default)]
    pub tenants: IndexMap<String, Spanned<Tenant>>,
    pub failure_mode: Option<Spanned<String>>,
    pub response_headers: Option<Vec<Spanned<String>>>,
    pub class_scope: Option<Spanned<String>>,
    pub rlqs_unknown: Option<Spanned<String>>,
    // LLM spend budgets.
    pub prices: Option<Spanned<Prices>>,
    pub model_key: Option<Spanned<String>>,
    pub request_id_key: Option<Spanned<String>>,
    pub input_bytes_key: Option<Spanned<String>>,
    pub hold_ttl: Option<Spanned<String>>,
    pub on_lost_settle: Option<Spanned<String>>,
}

/// A price table, inline or in a file of its own (`file:`, with the other keys).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    pub file: Option<String>,
    pub version: Option<String>,
    pub currency: Option<String>,
    #[serde(default)]
    pub models: IndexMap<String, Spanned<ModelPrices>>,
}

/// A model's prices per million tokens, as decimals read from their text.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPrices {
    pub input: Option<String>,
    pub cached_input: Option<String>,
    pub cache_write: Option<String>,
    pub output: Option<String>,
    pub default_output_tokens: Option<u64>,
    pub reserve_input_tokens: Option<u64>,
    pub max_output_tokens: Option<u64>,
    pub max_input_tokens: Option<u64>,
    pub bytes_per_token: Option<u64>,
    #[serde(default)]
    pub aliases: Vec<String>,
}

/// A money budget on a node.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    pub amount: String,
    pub per: String,
    pub timezone: Option<String>,
    #[serde(default)]
    pub alert_at: Vec<String>,
}

/// A concurrency limit on a node: at most `max` requests in flight, a slot not given back freed
/// after `ttl`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Concurrency {
    pub max: Spanned<u64>,
    pub ttl: Option<Spanned<String>>,
}

/// A node of the descriptor tree.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Descriptor {
    pub key: Spanned<String>,
    pub value: Option<String>,
    pub rate_limit: Option<Spanned<RateLimit>>,
    pub descriptors: Option<Vec<Descriptor>>,
    #[serde(default)]
    pub shadow_mode: bool,
    #[serde(default)]
    pub detailed_metric: bool,
    // Newer envoyproxy/ratelimit keys, accepted so that such files load unchanged.
    #[serde(default)]
    pub value_to_metric: bool,
    #[serde(default)]
    pub share_threshold: bool,
    #[serde(default)]
    pub quota_mode: bool,
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,

    // Spanned, so that a problem with one of them points at it rather than at the node's key.
    pub token_bucket: Option<Spanned<TokenBucket>>,
    pub cost: Option<Spanned<u64>>,
    pub class: Option<Spanned<String>>,
    pub quota: Option<Spanned<String>>,
    pub charge: Option<Spanned<String>>,
    pub max_debt: Option<Spanned<f64>>,
    /// The response header or trailer with a charge's hits, for `tollgate render`.
    pub hits_from: Option<Spanned<String>>,
    pub source: Option<Spanned<Source>>,
    pub budget: Option<Spanned<Budget>>,
    pub concurrency: Option<Spanned<Concurrency>>,
    /// One bucket for every region (the global tier leases it to regions).
    pub global: Option<Spanned<bool>>,
    /// What a region cut off from the global tier past its share decides a global bucket on.
    pub global_fallback: Option<Spanned<GlobalFallback>>,
}

/// `global_fallback: {split: N}`: the bucket split N ways, one part per region, decided in the
/// region's own store (without it, such a region denies).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GlobalFallback {
    pub split: Spanned<u32>,
}

/// envoyproxy/ratelimit's fixed-window limit, which tollgate turns into a token bucket.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    pub unit: Option<Spanned<String>>,
    // Signed, so that a negative count gets a message of ours rather than the parser's.
    pub requests_per_unit: Option<Spanned<i64>>,
    #[serde(default)]
    pub unlimited: bool,
    pub name: Option<String>,
    #[serde(default)]
    pub replaces: Vec<Replaces>,
}

/// An entry of `replaces`; `name` is optional in the schema so that an empty entry gets
/// envoyproxy/ratelimit's own message instead of a schema error.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Replaces {
    pub name: Option<String>,
}

/// An explicit bucket: burst capacity and sustained rate.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBucket {
    pub capacity: f64,
    pub refill_per_second: f64,
}

impl TokenBucket {
    /// The bucket it states, or why it is not one.
    pub fn spec(&self) -> Result<BucketSpec, String> {
        BucketSpec::new(self.capacity, self.refill_per_second).map_err(|e| e.to_string())
    }
}

/// A tenant of the embedded quota source.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    pub tier: Option<Spanned<String>>,
    #[serde(default)]
    pub overrides: IndexMap<String, Spanned<TokenBucket>>,
}
