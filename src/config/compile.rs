//! From a parsed file to a [`Domain`]: every semantic check, with the file, line and tree path
//! of what is wrong.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use super::raw;
use super::{Blanket, ChargeRule, ClassDef, ConfigError, Domain, FailureMode, HeaderSets, Limit, Rule};
use crate::bucket::{BucketSpec, MAX_CAPACITY};
use crate::matcher::{Level, Node, ValueMatch};
use crate::quota::{Quotas, TenantRecord, DEFAULT_CLASS};
use crate::units::{RatePerUnit, Unit};

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
    let class_scope = raw.class_scope.unwrap_or_else(|| name.clone());
    if class_scope.is_empty() {
        return Err(invalid("class_scope", "must not be empty".into()));
    }
    let failure_mode = failure_mode(raw.failure_mode.as_deref()).map_err(|m| invalid("failure_mode", m))?;
    let rlqs_unknown = match raw.rlqs_unknown.as_deref() {
        None | Some("allow") => Blanket::AllowAll,
        Some("deny") => Blanket::DenyAll,
        Some(other) => return Err(invalid("rlqs_unknown", format!("unknown answer '{other}' (expected allow or deny)"))),
    };
    let headers = header_sets(raw.response_headers.as_deref()).map_err(|(at, m)| invalid(&at, m))?;
    let quotas = quotas(&raw.tiers, raw.default_tier).map_err(|(at, m)| invalid(&at, m))?;
    let tenants = tenants(raw.tenants, &quotas).map_err(|(at, m)| invalid(&at, m))?;

    let mut tree = Tree { file, tenant_key: &tenant_key, quotas: &quotas, rules: Vec::new(), classes: BTreeMap::new() };
    let root = tree.level(raw.descriptors.as_deref().unwrap_or_default(), &Place::root())?;
    let (rules, classes) = (tree.rules, tree.classes);
    Ok(Domain {
        name,
        file: file.to_owned(),
        tenant_key,
        class_scope,
        classes,
        failure_mode,
        rlqs_unknown,
        headers,
        quotas,
        tenants,
        rules,
        root,
    })
}

fn failure_mode(text: Option<&str>) -> Result<FailureMode, String> {
    match text {
        None | Some("allow") => Ok(FailureMode::Allow),
        Some("deny") => Ok(FailureMode::Deny),
        Some("error") => Ok(FailureMode::Error),
        Some(other) => Err(format!("unknown failure mode '{other}' (expected allow, deny or error)")),
    }
}

fn header_sets(sets: Option<&[String]>) -> Result<HeaderSets, (String, String)> {
    let Some(sets) = sets else { return Ok(HeaderSets::default()) };
    let mut h = HeaderSets { x_ratelimit: false, retry_after: false, ietf: false, grpc_status_details: false };
    for (i, set) in sets.iter().enumerate() {
        match set.as_str() {
            "x-ratelimit" => h.x_ratelimit = true,
            "retry-after" => h.retry_after = true,
            "ietf" => h.ietf = true,
            "grpc-status-details" => h.grpc_status_details = true,
            other => {
                return Err((
                    format!("response_headers[{i}]"),
                    format!(
                        "unknown header set '{other}' (expected x-ratelimit, retry-after, ietf or grpc-status-details)"
                    ),
                ))
            }
        }
    }
    Ok(h)
}

fn quotas(
    raw: &BTreeMap<String, BTreeMap<String, raw::TokenBucket>>,
    default_tier: Option<String>,
) -> Result<Quotas, (String, String)> {
    let mut tiers = HashMap::new();
    for (tier, classes) in raw {
        let mut specs = HashMap::new();
        for (class, bucket) in classes {
            let spec = token_bucket(bucket).map_err(|m| (format!("tiers.{tier}.{class}"), m))?;
            specs.insert(class.clone(), spec);
        }
        tiers.insert(tier.clone(), specs);
    }
    match &default_tier {
        None if !tiers.is_empty() => {
            return Err(("default_tier".into(), "required when tiers are defined".into()))
        }
        Some(t) => match tiers.get(t) {
            None => return Err(("default_tier".into(), format!("unknown tier '{t}'"))),
            Some(classes) if !classes.contains_key(DEFAULT_CLASS) => {
                return Err((format!("tiers.{t}"), format!("the default tier needs a '{DEFAULT_CLASS}' bucket")))
            }
            Some(_) => {}
        },
        None => {}
    }
    Ok(Quotas { tiers, default_tier })
}

fn tenants(
    raw: BTreeMap<String, raw::Tenant>,
    quotas: &Quotas,
) -> Result<HashMap<String, Arc<TenantRecord>>, (String, String)> {
    let mut tenants = HashMap::new();
    for (tenant, record) in raw {
        if let Some(tier) = &record.tier {
            if !quotas.tiers.contains_key(tier) {
                return Err((format!("tenants.{tenant}.tier"), format!("unknown tier '{tier}'")));
            }
        }
        let mut overrides = HashMap::new();
        for (class, bucket) in &record.overrides {
            let spec = token_bucket(bucket).map_err(|m| (format!("tenants.{tenant}.overrides.{class}"), m))?;
            overrides.insert(class.clone(), spec);
        }
        tenants.insert(tenant, Arc::new(TenantRecord { tier: record.tier, overrides }));
    }
    Ok(tenants)
}

/// Where a node sits: what its rule and its errors need to know about its ancestors.
#[derive(Clone)]
struct Place {
    at: String,
    path: String,
    depth: usize,
    position: (usize, usize),
    tenant_depth: Option<usize>,
    shared_values: Vec<Option<String>>,
}

impl Place {
    fn root() -> Place {
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

struct Tree<'a> {
    file: &'a Path,
    tenant_key: &'a str,
    quotas: &'a Quotas,
    rules: Vec<Arc<Rule>>,
    classes: BTreeMap<String, ClassDef>,
}

impl Tree<'_> {
    fn level(&mut self, descriptors: &[raw::Descriptor], parent: &Place) -> Result<Level, ConfigError> {
        let mut level = Level::default();
        for (i, d) in descriptors.iter().enumerate() {
            let place = parent.child(d, i, self.tenant_key);
            let invalid = |message: String| ConfigError::Invalid {
                file: self.file.to_owned(),
                position: Some(place.position),
                at: place.at.clone(),
                message,
            };
            let key = d.key.value.as_str();
            let value = d.value.as_deref().filter(|v| !v.is_empty());
            if key.is_empty() {
                return Err(invalid("descriptor has empty key".into()));
            }
            if d.share_threshold && !value.is_some_and(|v| v.contains('*')) {
                return Err(invalid(format!(
                    "share_threshold can only be used with wildcard values (containing '*'), but found key '{}'",
                    place.path
                )));
            }
            let rule = self.rule(d, &place).map_err(invalid)?.map(Arc::new);
            if let Some(rule) = &rule {
                self.share_class(rule).map_err(invalid)?;
                self.rules.push(rule.clone());
            }
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

    fn rule(&mut self, d: &raw::Descriptor, place: &Place) -> Result<Option<Rule>, String> {
        let exclusive = [d.rate_limit.is_some(), d.token_bucket.is_some(), d.quota.is_some()];
        if exclusive.iter().filter(|x| **x).count() > 1 {
            return Err("rate_limit, token_bucket and quota are mutually exclusive".into());
        }
        let mut name = None;
        let mut replaces = Vec::new();
        let mut rate = None;
        let limit = if let Some(rl) = &d.rate_limit {
            name = rl.name.clone().filter(|n| !n.is_empty());
            replaces = replaces_of(rl, name.as_deref())?;
            let (limit, configured) = rate_limit(rl)?;
            rate = configured;
            Some(limit)
        } else if let Some(tb) = &d.token_bucket {
            Some(Limit::Bucket(token_bucket(tb).map_err(|m| format!("token_bucket: {m}"))?))
        } else if let Some(source) = &d.quota {
            self.tenant_quota(source, place)?;
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
        let charge = charge(d, limited)?;
        let Some(limit) = limit else { return Ok(None) };
        Ok(Some(Rule {
            path: place.path.clone(),
            position: place.position,
            name,
            limit,
            rate,
            cost: d.cost.unwrap_or(1),
            class: d.class.clone(),
            shadow_mode: d.shadow_mode,
            quota_mode: d.quota_mode,
            charge,
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
            return Err(format!("quota: tenant needs a '{}' descriptor at or above this node", self.tenant_key));
        }
        if self.quotas.default_tier.is_none() {
            return Err("quota: tenant needs tiers and a default_tier in this file".into());
        }
        Ok(())
    }
}

// `charge:`, `max_debt:` and `hits_from:` of a node.
fn charge(d: &raw::Descriptor, limited: bool) -> Result<ChargeRule, String> {
    match d.charge.as_deref() {
        None | Some("admitted") => {
            if d.max_debt.is_some() || d.hits_from.is_some() {
                return Err("max_debt and hits_from need charge: always".into());
            }
            Ok(ChargeRule::Admitted)
        }
        Some("always") => {
            if !limited {
                return Err("charge needs a limit on the same node".into());
            }
            if let Some(debt) = d.max_debt {
                if !debt.is_finite() || !(0.0..=MAX_CAPACITY).contains(&debt) {
                    return Err(format!("max_debt must be between 0 and {MAX_CAPACITY:e} tokens, got {debt}"));
                }
            }
            Ok(ChargeRule::Always { max_debt: d.max_debt, hits_from: d.hits_from.clone() })
        }
        Some(other) => Err(format!("unknown charge '{other}' (expected admitted or always)")),
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
fn rate_limit(rl: &raw::RateLimit) -> Result<(Limit, Option<RatePerUnit>), String> {
    let unit = rl.unit.as_deref().and_then(Unit::parse);
    match (rl.unlimited, unit) {
        (true, Some(_)) => Err("should not specify rate limit unit when unlimited".into()),
        (true, None) => Ok((Limit::Unlimited, None)),
        (false, Some(unit)) => {
            let rate = RatePerUnit { requests_per_unit: rl.requests_per_unit, unit };
            Ok((Limit::Bucket(rate.bucket()), Some(rate)))
        }
        (false, None) => Err(format!(
            "invalid rate limit unit '{}' (expected second, minute, hour, day, week, month or year)",
            rl.unit.as_deref().unwrap_or_default()
        )),
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
    BucketSpec::new(b.capacity, b.refill_per_second).map_err(|e| e.to_string())
}
