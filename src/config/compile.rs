//! From a parsed file to a [`Domain`]: every semantic check, with the file, line and tree path
//! of what is wrong.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use super::raw;
use super::{ConfigError, Domain, FailureMode, HeaderSets, Limit, Rule};
use crate::bucket::BucketSpec;
use crate::matcher::{Level, Node, ValueMatch};
use crate::quota::{Quotas, TenantRecord, DEFAULT_CLASS};
use crate::units;

/// Compiles the domain file `file` with contents `text`.
pub(super) fn domain(file: &Path, text: &str) -> Result<Domain, ConfigError> {
    let raw: raw::DomainFile = serde_saphyr::from_str(text)
        .map_err(|e| ConfigError::Syntax { file: file.to_owned(), message: e.to_string() })?;
    let invalid = |at: &str, message: String| ConfigError::Invalid {
        file: file.to_owned(),
        position: None,
        at: at.to_owned(),
        message,
    };

    let name = raw
        .domain
        .filter(|d| !d.is_empty())
        .ok_or_else(|| invalid("domain", "config file cannot have empty domain".into()))?;
    let tenant_key = raw.tenant_key.unwrap_or_else(|| "tenant".into());
    if tenant_key.is_empty() {
        return Err(invalid("tenant_key", "must not be empty".into()));
    }
    let failure_mode = match raw.failure_mode.as_deref() {
        None | Some("allow") => FailureMode::Allow,
        Some("deny") => FailureMode::Deny,
        Some("error") => FailureMode::Error,
        Some(other) => {
            return Err(invalid(
                "failure_mode",
                format!("unknown failure mode '{other}' (expected allow, deny or error)"),
            ))
        }
    };
    let headers = match raw.response_headers {
        None => HeaderSets::default(),
        Some(sets) => {
            let mut h = HeaderSets {
                x_ratelimit: false,
                retry_after: false,
                ietf: false,
                grpc_status_details: false,
            };
            for (i, set) in sets.iter().enumerate() {
                match set.as_str() {
                    "x-ratelimit" => h.x_ratelimit = true,
                    "retry-after" => h.retry_after = true,
                    "ietf" => h.ietf = true,
                    "grpc-status-details" => h.grpc_status_details = true,
                    other => {
                        return Err(invalid(
                            &format!("response_headers[{i}]"),
                            format!(
                                "unknown header set '{other}' (expected x-ratelimit, retry-after, ietf or grpc-status-details)"
                            ),
                        ))
                    }
                }
            }
            h
        }
    };

    let mut tiers = HashMap::new();
    for (tier, classes) in &raw.tiers {
        let mut specs = HashMap::new();
        for (class, bucket) in classes {
            let spec = token_bucket(bucket).map_err(|m| invalid(&format!("tiers.{tier}.{class}"), m))?;
            specs.insert(class.clone(), spec);
        }
        tiers.insert(tier.clone(), specs);
    }
    let default_tier = raw.default_tier;
    match &default_tier {
        None if !tiers.is_empty() => {
            return Err(invalid("default_tier", "required when tiers are defined".into()))
        }
        Some(t) => match tiers.get(t) {
            None => return Err(invalid("default_tier", format!("unknown tier '{t}'"))),
            Some(classes) if !classes.contains_key(DEFAULT_CLASS) => {
                return Err(invalid(
                    &format!("tiers.{t}"),
                    format!("the default tier needs a '{DEFAULT_CLASS}' bucket"),
                ))
            }
            Some(_) => {}
        },
        None => {}
    }
    let mut tenants = HashMap::new();
    for (tenant, record) in raw.tenants {
        if let Some(tier) = &record.tier {
            if !tiers.contains_key(tier) {
                return Err(invalid(&format!("tenants.{tenant}.tier"), format!("unknown tier '{tier}'")));
            }
        }
        let mut overrides = HashMap::new();
        for (class, bucket) in &record.overrides {
            let spec = token_bucket(bucket)
                .map_err(|m| invalid(&format!("tenants.{tenant}.overrides.{class}"), m))?;
            overrides.insert(class.clone(), spec);
        }
        tenants.insert(tenant, Arc::new(TenantRecord { tier: record.tier, overrides }));
    }
    let quotas = Quotas { tiers, default_tier };

    let mut tree = Tree { file, tenant_key: &tenant_key, quotas: &quotas, rules: Vec::new() };
    let root = tree.level(raw.descriptors.as_deref().unwrap_or_default(), &Place::root())?;
    let rules = tree.rules;
    Ok(Domain {
        name,
        file: file.to_owned(),
        tenant_key,
        failure_mode,
        headers,
        quotas,
        tenants,
        rules,
        root,
    })
}

/// Where a node sits: what its rule and its errors need to know about its ancestors.
#[derive(Clone)]
struct Place {
    at: String,
    path: String,
    depth: usize,
    tenant_depth: Option<usize>,
    shared_values: Vec<Option<String>>,
}

impl Place {
    fn root() -> Place {
        Place { at: String::new(), path: String::new(), depth: 0, tenant_depth: None, shared_values: vec![] }
    }
}

struct Tree<'a> {
    file: &'a Path,
    tenant_key: &'a str,
    quotas: &'a Quotas,
    rules: Vec<Arc<Rule>>,
}

impl Tree<'_> {
    fn level(&mut self, descriptors: &[raw::Descriptor], parent: &Place) -> Result<Level, ConfigError> {
        let mut level = Level::default();
        for (i, d) in descriptors.iter().enumerate() {
            let key = d.key.value.as_str();
            let value = d.value.as_deref().filter(|v| !v.is_empty());
            let label = match value {
                Some(v) => format!("{key}={v}"),
                None => key.to_owned(),
            };
            let sep = if parent.at.is_empty() { "" } else { "." };
            let place = Place {
                at: format!("{}{sep}descriptors[{i}]({label})", parent.at),
                path: match (parent.path.is_empty(), value) {
                    (true, None) => key.to_owned(),
                    (true, Some(v)) => format!("{key}_{v}"),
                    (false, None) => format!("{}.{key}", parent.path),
                    (false, Some(v)) => format!("{}.{key}_{v}", parent.path),
                },
                depth: parent.depth + 1,
                tenant_depth: parent.tenant_depth.or((key == self.tenant_key).then_some(parent.depth)),
                shared_values: {
                    let mut s = parent.shared_values.clone();
                    s.push(value.filter(|v| d.share_threshold && v.contains('*')).map(str::to_owned));
                    s
                },
            };
            let invalid = |message: String| ConfigError::Invalid {
                file: self.file.to_owned(),
                position: Some((d.key.referenced.line() as usize, d.key.referenced.column() as usize)),
                at: place.at.clone(),
                message,
            };
            if key.is_empty() {
                return Err(invalid("descriptor has empty key".into()));
            }
            let rule = self.rule(d, &place).map_err(invalid)?.map(Arc::new);
            self.rules.extend(rule.clone());
            let children = self.level(d.descriptors.as_deref().unwrap_or_default(), &place)?;
            let source = d.source.clone();
            check_source(key, value, source.as_ref()).map_err(invalid)?;
            let node = Node { key: key.to_owned(), value: ValueMatch::parse(value), rule, source, children };
            level
                .insert(node)
                .map_err(|_| invalid(format!("duplicate descriptor composite key '{}'", place.path)))?;
        }
        Ok(level)
    }

    fn rule(&mut self, d: &raw::Descriptor, place: &Place) -> Result<Option<Rule>, String> {
        let exclusive = [d.rate_limit.is_some(), d.token_bucket.is_some(), d.quota.is_some()];
        if exclusive.iter().filter(|x| **x).count() > 1 {
            return Err("rate_limit, token_bucket and quota are mutually exclusive".into());
        }
        let mut name = None;
        let mut replaces = Vec::new();
        let limit = if let Some(rl) = &d.rate_limit {
            let unit = rl.unit.as_deref().and_then(units::parse);
            name = rl.name.clone().filter(|n| !n.is_empty());
            for r in &rl.replaces {
                if r.name.is_empty() {
                    return Err("should not have an empty replaces entry".into());
                }
                if Some(&r.name) == name.as_ref() {
                    return Err("replaces should not contain name of same descriptor".into());
                }
                replaces.push(r.name.clone());
            }
            match (rl.unlimited, unit) {
                (true, Some(_)) => return Err("should not specify rate limit unit when unlimited".into()),
                (true, None) => Some(Limit::Unlimited),
                (false, Some(unit)) => Some(Limit::Bucket(units::bucket(rl.requests_per_unit, unit))),
                (false, None) => {
                    return Err(format!(
                    "invalid rate limit unit '{}' (expected second, minute, hour, day, week, month or year)",
                    rl.unit.as_deref().unwrap_or_default()
                ))
                }
            }
        } else if let Some(tb) = &d.token_bucket {
            Some(Limit::Bucket(token_bucket(tb).map_err(|m| format!("token_bucket: {m}"))?))
        } else if let Some(source) = &d.quota {
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
            Some(Limit::TenantQuota)
        } else {
            None
        };

        let limited = matches!(limit, Some(Limit::Bucket(_) | Limit::TenantQuota));
        if let Some(cost) = d.cost {
            if cost == 0 {
                return Err("cost must be at least 1".into());
            }
            if !limited {
                return Err("cost needs a limit on the same node".into());
            }
        }
        if let Some(class) = &d.class {
            if class.is_empty() {
                return Err("class must not be empty".into());
            }
            if !limited {
                return Err("class needs a limit on the same node".into());
            }
            if place.tenant_depth.is_none() {
                return Err(format!(
                    "class only names tenant buckets: it needs a '{}' descriptor at or above this node",
                    self.tenant_key
                ));
            }
        }
        let Some(limit) = limit else { return Ok(None) };
        Ok(Some(Rule {
            path: place.path.clone(),
            class: d.class.clone().or_else(|| name.clone()),
            name,
            limit,
            cost: d.cost.unwrap_or(1),
            shadow_mode: d.shadow_mode,
            detailed_metric: d.detailed_metric || d.value_to_metric,
            replaces,
            tenant_depth: place.tenant_depth,
            shared_values: place.shared_values.clone(),
        }))
    }
}

// A source must be able to produce the node's key and value.
fn check_source(key: &str, value: Option<&str>, source: Option<&raw::Source>) -> Result<(), String> {
    match source {
        Some(raw::Source::RemoteAddress) if key != "remote_address" => {
            Err("source: remote_address needs key: remote_address (Envoy's action always uses that key)"
                .into())
        }
        Some(raw::Source::GenericKey(constant)) if value.is_some_and(|v| v != constant) => Err(format!(
            "source: generic_key '{constant}' always sends that value, but the node matches '{}'",
            value.unwrap_or_default()
        )),
        Some(raw::Source::JwtClaim(s) | raw::Source::RequestHeader(s) | raw::Source::GenericKey(s))
            if s.is_empty() =>
        {
            Err("source: the claim, header or value must not be empty".into())
        }
        _ => Ok(()),
    }
}

fn token_bucket(b: &raw::TokenBucket) -> Result<BucketSpec, String> {
    BucketSpec::new(b.capacity, b.refill_per_second)
}
