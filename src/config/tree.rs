//! The descriptor tree of a domain file, node by node: each node's checks (its limit, charge,
//! `replaces`, source), its place among its ancestors for error messages, and the matcher's
//! [`Level`]s and the domain's rules and classes built from it.

use std::path::Path;
use std::sync::Arc;

use indexmap::IndexMap;
use serde_saphyr::Spanned;

use super::problem::{position, Located};
use super::{priced, raw};
use super::{ChargeRule, ClassDef, ConfigError, Limit, Rule, Source};
use crate::bucket::MAX_CAPACITY;
use crate::budget::BudgetSpec;
use crate::matcher::{Level, Node, ValueMatch};
use crate::quota::Quotas;
use crate::slot::{ConcurrencySpec, DEFAULT_TTL_MS};
use crate::units::{RatePerUnit, Unit};

/// Where a node sits: what its rule and its errors need to know about its ancestors.
#[derive(Clone)]
pub(super) struct Place {
    at: String,
    path: String,
    depth: usize,
    position: (usize, usize),
    tenant_depth: Option<usize>,
    shared_values: Vec<Option<String>>,
}

impl Place {
    pub(super) fn root() -> Place {
        Place {
            at: String::new(),
            path: String::new(),
            depth: 0,
            position: (0, 0),
            tenant_depth: None,
            shared_values: vec![],
        }
    }

    // The place of `d`, the `index`th node under `self`.
    fn child(&self, d: &raw::Descriptor, index: usize, tenant_key: &str) -> Place {
        let key = d.key.value.as_str();
        let value = d.value.as_deref().filter(|v| !v.is_empty());
        let label = match value {
            Some(v) => format!("{key}={v}"),
            None => key.to_owned(),
        };
        let sep = if self.at.is_empty() { "" } else { "." };
        let mut shared_values = self.shared_values.clone();
        shared_values.push(value.filter(|v| d.share_threshold && v.contains('*')).map(str::to_owned));
        Place {
            at: format!("{}{sep}descriptors[{index}]({label})", self.at),
            path: match (self.path.is_empty(), value) {
                (true, None) => key.to_owned(),
                (true, Some(v)) => format!("{key}_{v}"),
                (false, None) => format!("{}.{key}", self.path),
                (false, Some(v)) => format!("{}.{key}_{v}", self.path),
            },
            depth: self.depth + 1,
            position: (d.key.referenced.line() as usize, d.key.referenced.column() as usize),
            tenant_depth: self.tenant_depth.or((key == tenant_key).then_some(self.depth)),
            shared_values,
        }
    }
}

pub(super) struct Tree<'a> {
    pub(super) file: &'a Path,
    pub(super) tenant_key: &'a str,
    pub(super) quotas: &'a Quotas,
    // The domain has prices: nodes may have budgets, and every limit sits under the tenant (all
    // of a request's levels in one Cluster slot, decided in one script).
    pub(super) priced: bool,
    pub(super) rules: Vec<Arc<Rule>>,
    pub(super) classes: IndexMap<String, ClassDef>,
    // Some node has a concurrency limit.
    pub(super) concurrent: bool,
}

impl Tree<'_> {
    pub(super) fn level(
        &mut self,
        descriptors: &[raw::Descriptor],
        parent: &Place,
    ) -> Result<Level, ConfigError> {
        let mut level = Level::default();
        for (i, d) in descriptors.iter().enumerate() {
            let place = parent.child(d, i, self.tenant_key);
            let invalid = |problem: Located| ConfigError::Invalid {
                file: self.file.to_owned(),
                position: Some(problem.position.unwrap_or(place.position)),
                at: place.at.clone(),
                message: problem.message,
            };
            let key = d.key.value.as_str();
            let value = d.value.as_deref().filter(|v| !v.is_empty());
            if key.is_empty() {
                return Err(invalid("descriptor has empty key".into()));
            }
            if d.share_threshold && !value.is_some_and(|v| v.contains('*')) {
                return Err(invalid(
                    format!(
                        "share_threshold can only be used with wildcard values (containing '*'), but found key '{}'",
                        place.path
                    )
                    .into(),
                ));
            }
            let rule = self.rule(d, &place).map_err(invalid)?.map(Arc::new);
            if let Some(rule) = &rule {
                self.share_class(rule).map_err(|m| invalid(m.into()))?;
                self.rules.push(rule.clone());
            }
            let budget = match &d.budget {
                None => None,
                Some(_) if !self.priced => {
                    return Err(invalid("a budget needs the domain's `prices:` (what tokens cost)".into()))
                }
                Some(b) => Some(BudgetSpec {
                    global: d.global.as_ref().is_some_and(|g| g.value),
                    ..priced::budget(b).map_err(|m| invalid(Located { message: m, position: position(b) }))?
                }),
            };
            let concurrency = match &d.concurrency {
                None => None,
                Some(c) => Some(concurrency(c).map_err(invalid)?),
            };
            if concurrency.is_some() && place.tenant_depth.is_none() {
                return Err(invalid(
                    format!(
                        "a concurrency limit sits under the '{}' entry (its hash tag keeps a request's slots and buckets in one step)",
                        self.tenant_key
                    )
                    .into(),
                ));
            }
            self.concurrent |= concurrency.is_some();
            if self.priced && (rule.is_some() || budget.is_some()) && place.tenant_depth.is_none() {
                return Err(invalid(
                    format!(
                        "in a domain with prices, every limit sits under the '{}' entry (its hash tag keeps a request's levels together)",
                        self.tenant_key
                    )
                    .into(),
                ));
            }
            let children = self.level(d.descriptors.as_deref().unwrap_or_default(), &place)?;
            let source = d.source.as_ref().map(|s| s.value.clone());
            check_source(key, value, source.as_ref()).map_err(|m| {
                invalid(Located { message: m, position: d.source.as_ref().and_then(position) })
            })?;
            let node = Node {
                key: key.to_owned(),
                value: ValueMatch::parse(value),
                rule,
                budget,
                concurrency,
                source,
                children,
            };
            level.insert(node).map_err(|_| {
                invalid(format!("duplicate descriptor composite key '{}'", place.path).into())
            })?;
        }
        Ok(level)
    }

    // Rules that share a class share its bucket: they must size it the same way.
    fn share_class(&mut self, rule: &Rule) -> Result<(), String> {
        let Some(class) = &rule.class else { return Ok(()) };
        let def = ClassDef {
            limit: rule.limit,
            charge: rule.charge.clone(),
            defined_at: (self.file.to_owned(), rule.position.0, rule.position.1),
        };
        match self.classes.get(class) {
            None => {
                self.classes.insert(class.clone(), def);
                Ok(())
            }
            Some(first) if first.same_bucket(&def) => Ok(()),
            Some(first) => Err(format!(
                "class '{class}' is already sized differently at line {}:{}; rules sharing a class share one bucket and must agree on its limit",
                first.defined_at.1, first.defined_at.2
            )),
        }
    }

    fn rule(&mut self, d: &raw::Descriptor, place: &Place) -> Result<Option<Rule>, Located> {
        // At the second of them, in the file's order.
        let mut limits: Vec<(usize, usize)> = [
            d.rate_limit.as_ref().and_then(position),
            d.token_bucket.as_ref().and_then(position),
            d.quota.as_ref().and_then(position),
        ]
        .into_iter()
        .flatten()
        .collect();
        limits.sort_unstable();
        if limits.len() > 1 {
            return Err(Located {
                message: "rate_limit, token_bucket and quota are mutually exclusive".into(),
                position: Some(limits[1]),
            });
        }
        let mut name = None;
        let mut replaces = Vec::new();
        let mut rate = None;
        let limit = if let Some(rl) = &d.rate_limit {
            name = rl.value.name.clone().filter(|n| !n.is_empty());
            replaces = replaces_of(&rl.value, name.as_deref())?;
            let (limit, configured) = rate_limit(rl)?;
            rate = configured;
            Some(limit)
        } else if let Some(tb) = &d.token_bucket {
            Some(Limit::Bucket(tb.value.spec().map_err(|m| at(tb, format!("token_bucket: {m}")))?))
        } else if let Some(source) = &d.quota {
            self.tenant_quota(&source.value, place).map_err(|m| at(source, m))?;
            Some(Limit::TenantQuota)
        } else {
            None
        };

        let limited = matches!(limit, Some(Limit::Bucket(_) | Limit::TenantQuota));
        if let Some(cost) = &d.cost {
            if cost.value == 0 {
                return Err(at(cost, "cost must be at least 1".into()));
            }
            if !limited {
                return Err(at(cost, "cost needs a limit on the same node".into()));
            }
        }
        if let Some(class) = &d.class {
            if class.value.is_empty() {
                return Err(at(class, "class must not be empty".into()));
            }
            if !limited {
                return Err(at(class, "class needs a limit on the same node".into()));
            }
            if place.tenant_depth.is_none() {
                return Err(at(
                    class,
                    format!(
                        "class only names tenant buckets: it needs a '{}' descriptor at or above this node",
                        self.tenant_key
                    ),
                ));
            }
        }
        let charge = charge(d, limited)?;
        let global = d.global.as_ref().is_some_and(|g| g.value);
        let global_fallback = match &d.global_fallback {
            None => None,
            Some(f) if !global => {
                return Err(at(f, "global_fallback needs global: true on the same node".into()))
            }
            Some(f) if !(2..=1000).contains(&f.value.split.value) => {
                return Err(at(
                    &f.value.split,
                    "split: the number of regions sharing the bucket, 2 to 1000".into(),
                ))
            }
            Some(f) => Some(f.value.split.value),
        };
        if let Some(g) = d.global.as_ref().filter(|g| g.value) {
            if self.priced {
                // In a priced domain the budgets are what is global; its token buckets are
                // taken in the same step as the hold, in the region's store.
                if d.budget.is_none() || limit.is_some() {
                    return Err(at(
                        g,
                        "in a domain with prices, global marks a budget (a node with budget: and no rate_limit or token_bucket)".into(),
                    ));
                }
                if let Some(f) = &d.global_fallback {
                    return Err(at(f, "a global budget cut off from the global tier denies: global_fallback is for token buckets".into()));
                }
            } else if !matches!(limit, Some(Limit::Bucket(_))) {
                return Err(at(g, "global needs a rate_limit or token_bucket on the same node".into()));
            }
        }
        let Some(limit) = limit else { return Ok(None) };
        Ok(Some(Rule {
            path: place.path.clone(),
            file: self.file.to_owned(),
            position: place.position,
            name,
            limit,
            rate,
            cost: d.cost.as_ref().map_or(1, |c| c.value),
            class: d.class.as_ref().map(|c| c.value.clone()),
            shadow_mode: d.shadow_mode,
            quota_mode: d.quota_mode,
            charge,
            global,
            global_fallback,
            detailed_metric: d.detailed_metric || d.value_to_metric,
            replaces,
            metadata: d.metadata.clone(),
            tenant_depth: place.tenant_depth,
            shared_values: place.shared_values.clone(),
        }))
    }

    fn tenant_quota(&self, source: &str, place: &Place) -> Result<(), String> {
        if source != "tenant" {
            return Err(format!("unknown quota source '{source}' (expected 'tenant')"));
        }
        if place.tenant_depth.is_none() {
            return Err(format!(
                "quota: tenant needs a '{}' descriptor at or above this node",
                self.tenant_key
            ));
        }
        if self.quotas.default_tier.is_none() {
            return Err("quota: tenant needs tiers and a default_tier in this file".into());
        }
        Ok(())
    }
}

// A problem with the field `value`, at its position.
fn at<T>(value: &Spanned<T>, message: String) -> Located {
    Located { message, position: position(value) }
}

// `charge:`, `max_debt:` and `hits_from:` of a node.
fn charge(d: &raw::Descriptor, limited: bool) -> Result<ChargeRule, Located> {
    let max_debt = d.max_debt.as_ref().map(|m| m.value);
    let hits_from = d.hits_from.as_ref().map(|h| h.value.clone());
    let Some(charge) = &d.charge else {
        return match (&d.max_debt, &d.hits_from) {
            (Some(m), _) => Err(at(m, "max_debt and hits_from need charge: always".into())),
            (None, Some(h)) => Err(at(h, "max_debt and hits_from need charge: always".into())),
            (None, None) => Ok(ChargeRule::Admitted),
        };
    };
    match charge.value.as_str() {
        "admitted" => match (&d.max_debt, &d.hits_from) {
            (None, None) => Ok(ChargeRule::Admitted),
            _ => Err(at(charge, "max_debt and hits_from need charge: always".into())),
        },
        "always" => {
            if !limited {
                return Err(at(charge, "charge needs a limit on the same node".into()));
            }
            if let Some(debt) = &d.max_debt {
                if !debt.value.is_finite() || !(0.0..=MAX_CAPACITY).contains(&debt.value) {
                    return Err(at(
                        debt,
                        format!("max_debt must be between 0 and {MAX_CAPACITY:e} tokens, got {}", debt.value),
                    ));
                }
            }
            Ok(ChargeRule::Always { max_debt, hits_from })
        }
        other => Err(at(charge, format!("unknown charge '{other}' (expected admitted or always)"))),
    }
}

// envoyproxy/ratelimit's `replaces` checks, with its messages.
fn replaces_of(rl: &raw::RateLimit, name: Option<&str>) -> Result<Vec<String>, String> {
    let mut replaces = Vec::new();
    for r in &rl.replaces {
        let replaced = r.name.as_deref().unwrap_or_default();
        if replaced.is_empty() {
            return Err("should not have an empty replaces entry".into());
        }
        if Some(replaced) == name {
            return Err("replaces should not contain name of same descriptor".into());
        }
        replaces.push(replaced.to_owned());
    }
    Ok(replaces)
}

// A `rate_limit`: unlimited, or N per unit (a bucket, and the rate to echo in responses).
fn rate_limit(spanned: &Spanned<raw::RateLimit>) -> Result<(Limit, Option<RatePerUnit>), Located> {
    let rl = &spanned.value;
    let located =
        |message: String, at: Option<(usize, usize)>| Located { message, position: at.or(position(spanned)) };
    let unit_at = rl.unit.as_ref().and_then(position);
    let unit = match &rl.unit {
        None => None,
        Some(u) => Some(Unit::parse(&u.value).ok_or_else(|| {
            located(
                format!(
                    "invalid rate limit unit '{}' (expected second, minute, hour, day, week, month or year)",
                    u.value
                ),
                unit_at,
            )
        })?),
    };
    let count_at = rl.requests_per_unit.as_ref().and_then(position);
    let count = rl.requests_per_unit.as_ref().map_or(0, |n| n.value);
    let requests_per_unit = u32::try_from(count).map_err(|_| {
        located(
            format!("requests_per_unit must be a non-negative integer up to {}, got {count}", u32::MAX),
            count_at,
        )
    })?;
    match (rl.unlimited, unit) {
        (true, Some(_)) => Err(located("should not specify rate limit unit when unlimited".into(), unit_at)),
        (true, None) => Ok((Limit::Unlimited, None)),
        (false, Some(unit)) => {
            let rate = RatePerUnit { requests_per_unit, unit };
            Ok((Limit::Bucket(rate.bucket()), Some(rate)))
        }
        (false, None) => Err(located(
            "missing unit (second, minute, hour, day, week, month or year), or unlimited: true".into(),
            None,
        )),
    }
}

// A source must be able to produce the node's key and value.
fn check_source(key: &str, value: Option<&str>, source: Option<&Source>) -> Result<(), String> {
    match source {
        Some(Source::RemoteAddress) if key != "remote_address" => {
            Err("source: remote_address needs key: remote_address (Envoy's action always uses that key)"
                .into())
        }
        Some(Source::GenericKey(constant)) if value.is_some_and(|v| v != constant) => Err(format!(
            "source: generic_key '{constant}' always sends that value, but the node matches '{}'",
            value.unwrap_or_default()
        )),
        Some(Source::JwtClaim(s) | Source::RequestHeader(s) | Source::GenericKey(s)) if s.is_empty() => {
            Err("source: the claim, header or value must not be empty".into())
        }
        _ => Ok(()),
    }
}

// A node's `concurrency:`: at least one slot, a ttl of a second or more.
fn concurrency(c: &Spanned<raw::Concurrency>) -> Result<ConcurrencySpec, Located> {
    let max = c.value.max.value;
    if max == 0 {
        return Err(Located {
            message: "concurrency max must be at least 1".into(),
            position: position(&c.value.max),
        });
    }
    let ttl_ms = match &c.value.ttl {
        None => DEFAULT_TTL_MS,
        Some(t) => humantime::parse_duration(&t.value)
            .ok()
            .filter(|d| *d >= std::time::Duration::from_secs(1))
            .map(|d| d.as_millis().min(u128::from(crate::bucket::MAX_WAIT_MS)) as u64)
            .ok_or_else(|| Located {
                message: format!("concurrency ttl '{}': a duration of a second or more, e.g. 10m", t.value),
                position: position(t),
            })?,
    };
    Ok(ConcurrencySpec { max, ttl_ms })
}
