//! What a descriptor node limits: the compiled rule that matching ([`crate::matcher`]) finds and
//! the decision core applies. Beneath both the matcher and the config that builds it, so that
//! neither needs the other's module to name it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::bucket::{BucketSpec, Charge};
use crate::units::RatePerUnit;

/// When a rule's tokens are taken.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "charge")]
pub enum ChargeRule {
    /// `charge: admitted` (the default): only when the whole request is admitted.
    Admitted,
    /// `charge: always`: every debit, even past zero, down to `-max_debt`.
    Always {
        /// `max_debt`; `None` means the bucket's capacity.
        max_debt: Option<f64>,
        /// The response header or trailer in which the upstream reports the cost
        /// (`hits_from`), for `tollgate render`.
        hits_from: Option<String>,
    },
}

impl ChargeRule {
    /// The bucket arithmetic's charge for a bucket of `spec`.
    pub fn for_bucket(&self, spec: &BucketSpec) -> Charge {
        match self {
            ChargeRule::Admitted => Charge::Admitted,
            ChargeRule::Always { max_debt, .. } => {
                Charge::Always { max_debt: max_debt.unwrap_or(spec.capacity()) }
            }
        }
    }

    /// What two rules sharing a bucket must agree on (where Envoy reads the hits need not).
    pub fn sizing(&self) -> (bool, Option<f64>) {
        match self {
            ChargeRule::Admitted => (false, None),
            ChargeRule::Always { max_debt, .. } => (true, *max_debt),
        }
    }
}

/// A limit attached to a descriptor node.
#[derive(Debug, Clone, Serialize)]
pub struct Rule {
    /// The node's place in the tree, `key_value.key` as envoyproxy/ratelimit prints it.
    pub path: String,
    /// The file it is written in (a domain merged from several files has rules in each).
    #[serde(skip)]
    pub file: PathBuf,
    /// Line and column of the node's `key:` in its file.
    pub position: (usize, usize),
    /// `rate_limit.name`, which `replaces` refers to and responses show; never part of a
    /// bucket's identity.
    pub name: Option<String>,
    /// The bucket, or why there is none.
    pub limit: Limit,
    /// The `rate_limit` as configured, echoed as `current_limit` in responses.
    pub rate: Option<RatePerUnit>,
    /// Tokens per hit.
    pub cost: u64,
    /// The explicit `class`: the tenant bucket this rule shares with every rule of the same
    /// class in its class scope (see [`crate::identity`]).
    pub class: Option<String>,
    /// Evaluated and counted, never denies.
    pub shadow_mode: bool,
    /// envoyproxy/ratelimit's `quota_mode`: over the limit, this descriptor denies the request
    /// only if every quota-mode descriptor of the request is over too.
    pub quota_mode: bool,
    /// When the tokens are taken (`charge:`), and how deep into debt a bucket may go.
    pub charge: ChargeRule,
    /// `global: true`: one bucket for every region. The global tier leases it to regions
    /// (`tollgate.region.v1.RegionLeases`); see `docs/src/design/global-limits.md`.
    pub global: bool,
    /// `global_fallback: {split: N}`: a region cut off from the global tier past its share
    /// decides the bucket in its own store at capacity / N and rate / N (`None`: it denies).
    pub global_fallback: Option<u32>,
    /// Per-value metrics requested.
    pub detailed_metric: bool,
    /// Names of rules this one replaces when both match one request.
    pub replaces: Vec<String>,
    /// `metadata:`, merged into the response's dynamic metadata when this descriptor passes
    /// (with `--response-dynamic-metadata`).
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// Index of the descriptor entry holding the tenant, if the rule is under a tenant node.
    pub tenant_depth: Option<usize>,
    /// For each depth, the pattern that replaces the request's value in the key when the node is
    /// a wildcard with `share_threshold` (all matching values share one bucket).
    #[serde(skip)]
    pub shared_values: Vec<Option<String>>,
}

/// How a rule limits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    /// Never limited, never touches the store.
    Unlimited,
    /// A fixed bucket from `rate_limit` or `token_bucket`.
    Bucket(BucketSpec),
    /// The tenant's resolved quota for the rule's quota class ([`crate::identity::quota_class`]).
    TenantQuota,
}

/// Where Envoy takes an entry's value from; used only by `tollgate render`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Source {
    /// A claim of the verified JWT (jwt_authn payload metadata).
    JwtClaim(String),
    /// A request header.
    RequestHeader(String),
    /// The request path (`:path`).
    Path,
    /// The request method (`:method`).
    Method,
    /// The client address (Envoy's `remote_address` action; the key must be `remote_address`).
    RemoteAddress,
    /// A constant, for routes that should be charged to this node.
    GenericKey(String),
}
