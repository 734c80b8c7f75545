//! Per-tenant quotas: which bucket a tenant gets for a class.
//!
//! A domain defines tiers (`free`, `pro`, ...), each mapping classes to buckets, plus a
//! `default_tier`. A tenant record names the tenant's tier and may override single classes.
//! [`Quotas::resolve`] applies the one resolution order every source shares:
//!
//! 1. the tenant's override for the class,
//! 2. the tenant's tier's bucket for the class,
//! 3. the tenant's tier's `default` bucket,
//! 4. the same two lookups in `default_tier` (also used for unknown tenants and unknown tiers).
//!
//! Where tenant records come from is a [`QuotaSource`]: the domain file's inline `tenants:` map
//! ([`EmbeddedQuotas`]), or PostgreSQL ([`postgres`]) behind a cache ([`cache`]), which falls
//! back to the inline records. Validation guarantees `default_tier` has a `default` bucket, so
//! resolution always ends in a bucket.

pub mod budgets;
pub mod cache;
pub mod postgres;

use indexmap::IndexMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use serde::Serialize;

use crate::bucket::BucketSpec;
use crate::budget::BudgetOverride;

/// The class every tier must be able to fall back to.
pub const DEFAULT_CLASS: &str = "default";

/// What is known about one tenant.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TenantRecord {
    /// The tenant's tier; `None` means the domain's `default_tier`.
    pub tier: Option<String>,
    /// Buckets for single classes that replace the tier's.
    pub overrides: IndexMap<String, BucketSpec>,
}

/// One domain's tiers and the tier of last resort.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Quotas {
    /// Tier name to class name to bucket.
    pub tiers: IndexMap<String, IndexMap<String, BucketSpec>>,
    /// The tier of tenants without a (known) tier.
    pub default_tier: Option<String>,
}

impl Quotas {
    /// The bucket `record`'s tenant gets for `class`; `None` only if the domain has no tiers.
    pub fn resolve(&self, record: Option<&TenantRecord>, class: &str) -> Option<BucketSpec> {
        self.resolve_with_source(record, class).map(|(spec, _)| spec)
    }

    /// [`Quotas::resolve`], and where the bucket came from.
    pub fn resolve_with_source<'a>(
        &'a self,
        record: Option<&'a TenantRecord>,
        class: &'a str,
    ) -> Option<(BucketSpec, QuotaOrigin<'a>)> {
        if let Some(spec) = record.and_then(|r| r.overrides.get(class)) {
            return Some((*spec, QuotaOrigin::Override));
        }
        let in_tier = |tier: &'a str| {
            let classes = self.tiers.get(tier)?;
            match classes.get(class) {
                Some(spec) => Some((*spec, QuotaOrigin::Tier { tier, class })),
                None => classes
                    .get(DEFAULT_CLASS)
                    .map(|spec| (*spec, QuotaOrigin::Tier { tier, class: DEFAULT_CLASS })),
            }
        };
        record
            .and_then(|r| r.tier.as_deref())
            .and_then(in_tier)
            .or_else(|| self.default_tier.as_deref().and_then(in_tier))
    }
}

/// Where a tenant's bucket for a class came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaOrigin<'a> {
    /// The tenant's own override for the class.
    Override,
    /// A tier's bucket: the class's own, or the tier's `default` bucket.
    Tier {
        /// The tier: the tenant's, or the domain's `default_tier`.
        tier: &'a str,
        /// The class whose bucket it is (`default` when the tier has none for the class asked).
        class: &'a str,
    },
}

/// A domain file's inline tenant records (`tenants:`), by tenant id.
pub type InlineTenants = IndexMap<String, Arc<TenantRecord>>;

/// Where tenant records live.
///
/// Lookups are asynchronous so that a database-backed source fits behind the same seam; a
/// source answers `None` for tenants it does not know, which then get `default_tier`.
pub trait QuotaSource: Send + Sync + 'static {
    /// The record of `tenant` in a domain whose file has the records `inline` (`tenants:`).
    fn tenant<'a>(
        &'a self,
        inline: &'a InlineTenants,
        tenant: &'a str,
    ) -> BoxFuture<'a, Option<Arc<TenantRecord>>>;

    /// The override of the budget at the level `path` ([`crate::identity::path_text`]) of
    /// `domain`, if one is set; a source without budget overrides has none.
    fn budget<'a>(&'a self, domain: &'a str, path: &'a str) -> BoxFuture<'a, Option<BudgetOverride>> {
        let _ = (domain, path);
        Box::pin(std::future::ready(None))
    }
}

/// Tenant records written inline in the domain file (`tenants:`).
#[derive(Debug, Default, Clone, Copy)]
pub struct EmbeddedQuotas;

impl QuotaSource for EmbeddedQuotas {
    fn tenant<'a>(
        &'a self,
        inline: &'a InlineTenants,
        tenant: &'a str,
    ) -> BoxFuture<'a, Option<Arc<TenantRecord>>> {
        Box::pin(std::future::ready(inline.get(tenant).cloned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(capacity: f64) -> BucketSpec {
        BucketSpec::new(capacity, 1.0).unwrap()
    }

    fn quotas() -> Quotas {
        let tier = |pairs: &[(&str, f64)]| {
            pairs.iter().map(|(c, cap)| (c.to_string(), b(*cap))).collect::<IndexMap<_, _>>()
        };
        Quotas {
            tiers: IndexMap::from([
                ("free".into(), tier(&[("default", 20.0), ("export", 2.0)])),
                ("pro".into(), tier(&[("default", 200.0)])),
                ("odd".into(), tier(&[("export", 7.0)])),
            ]),
            default_tier: Some("free".into()),
        }
    }

    #[test]
    fn resolution_order() {
        let q = quotas();
        let pro = TenantRecord {
            tier: Some("pro".into()),
            overrides: IndexMap::from([("export".into(), b(1000.0))]),
        };
        assert_eq!(q.resolve(Some(&pro), "export"), Some(b(1000.0)), "override");
        assert_eq!(q.resolve(Some(&pro), "search"), Some(b(200.0)), "tier default");
        let odd = TenantRecord { tier: Some("odd".into()), ..Default::default() };
        assert_eq!(q.resolve(Some(&odd), "export"), Some(b(7.0)), "tier class");
        assert_eq!(q.resolve(Some(&odd), "search"), Some(b(20.0)), "default tier default");
        let lost = TenantRecord { tier: Some("gone".into()), ..Default::default() };
        assert_eq!(q.resolve(Some(&lost), "export"), Some(b(2.0)), "unknown tier");
        assert_eq!(q.resolve(None, "export"), Some(b(2.0)), "unknown tenant");
        assert_eq!(Quotas::default().resolve(None, "x"), None);
    }
}
