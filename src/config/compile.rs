//! From a parsed file to a [`Domain`]: every semantic check, with the file, line and tree path
//! of what is wrong.

use std::collections::HashMap;

use indexmap::IndexMap;
use std::path::Path;
use std::sync::Arc;

use serde_saphyr::Spanned;

use super::problem::{position, text, Located, Problem};
use super::{locate, priced, raw};
use super::{
    Blanket, ChargeRule, ClassDef, ConfigError, Domain, FailureMode, HeaderSets, Limit, Rule, Source,
};
use crate::bucket::{BucketSpec, MAX_CAPACITY};
use crate::matcher::{Level, Node, ValueMatch};
use crate::quota::{Quotas, TenantRecord, DEFAULT_CLASS};
use crate::units::{RatePerUnit, Unit};

/// The most YAML nodes (mappings, sequences and scalars) one domain file may hold: the parser's
/// budget (serde-saphyr's default, set here so that the error can name it), which keeps a
/// crafted file from growing a reload without limit.
pub const MAX_NODES: usize = 250_000;

/// A parser error as a [`ConfigError`]: its position, the tree path of the descriptor at that
/// line (found from `text`, see [`locate`]) and its message alone, on one line (the parser's own
/// rendering repeats the position and quotes a snippet of `<input>`).
fn syntax(file: &Path, text: &str, error: &serde_saphyr::Error) -> ConfigError {
    use serde_saphyr::budget::BudgetBreach;
    use serde_saphyr::MessageFormatter as _;
    // The parser's node budget (its guard against YAML bombs) is the one limit on a file's size:
    // say so in the config's own terms.
    if let serde_saphyr::Error::Budget { breach: BudgetBreach::Nodes { .. }, .. } = error.without_snippet() {
        return ConfigError::Invalid {
            file: file.to_owned(),
            position: None,
            at: String::new(),
            message: format!(
                "the file is larger than one domain file may be: more than {} YAML nodes (about {} rules of a few lines each)",
                MAX_NODES, MAX_NODES / 11
            ),
        };
    }
    let message = serde_saphyr::DefaultMessageFormatter.format_message(error.without_snippet());
    let message: String = message.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let position =
        error.location().filter(|at| at.line() > 0).map(|at| (at.line() as usize, at.column() as usize));
    let at = position.map(|(line, _)| locate::tree_path(text, line)).unwrap_or_default();
    ConfigError::Invalid { file: file.to_owned(), position, at, message }
}

/// Compiles the domain file `file` with contents `text`.
pub(super) fn domain(file: &Path, text_: &str) -> Result<Domain, ConfigError> {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_nodes = MAX_NODES;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    let mut raw: raw::DomainFile =
        serde_saphyr::from_str_with_options(text_, options).map_err(|e| syntax(file, text_, &e))?;
    let invalid = |p: Problem| p.in_file(file);

    let priced = priced::priced(&mut raw, file).map_err(invalid)?;
    let (name, at) = text(raw.domain);
    let name = name
        .filter(|d| !d.is_empty())
        .ok_or_else(|| invalid(Problem::new("domain", at, "config file cannot have empty domain")))?;
    let (tenant_key, at) = text(raw.tenant_key);
    let tenant_key = tenant_key.unwrap_or_else(|| "tenant".into());
    if tenant_key.is_empty() {
        return Err(invalid(Problem::new("tenant_key", at, "must not be empty")));
    }
    let (class_scope, at) = text(raw.class_scope);
    let class_scope = class_scope.unwrap_or_else(|| name.clone());
    if class_scope.is_empty() {
        return Err(invalid(Problem::new("class_scope", at, "must not be empty")));
    }
    let (mode, at) = text(raw.failure_mode);
    // A priced domain fails closed unless it says otherwise: a store outage must not be
    // unlimited spend.
    let failure_mode = match mode.as_deref() {
        None if priced.is_some() => FailureMode::Deny,
        mode => failure_mode(mode).map_err(|m| invalid(Problem::new("failure_mode", at, m)))?,
    };
    let (answer, at) = text(raw.rlqs_unknown);
    let rlqs_unknown = match answer.as_deref() {
        None | Some("allow") => Blanket::AllowAll,
        Some("deny") => Blanket::DenyAll,
        Some(other) => {
            return Err(invalid(Problem::new(
                "rlqs_unknown",
                at,
                format!("unknown answer '{other}' (expected allow or deny)"),
            )))
        }
    };
    let headers = header_sets(raw.response_headers.as_deref()).map_err(invalid)?;
    let quotas = quotas(&raw.tiers, raw.default_tier).map_err(invalid)?;
    let tenants = tenants(raw.tenants, &quotas).map_err(invalid)?;

    let mut tree = Tree {
        file,
        tenant_key: &tenant_key,
        quotas: &quotas,
        priced: priced.is_some(),
        rules: Vec::new(),
        classes: IndexMap::new(),
    };
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
        priced,
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

fn header_sets(sets: Option<&[Spanned<String>]>) -> Result<HeaderSets, Problem> {
    let Some(sets) = sets else { return Ok(HeaderSets::default()) };
    let mut h =
        HeaderSets { x_ratelimit: false, retry_after: false, ietf: false, grpc_status_details: false };
    for (i, set) in sets.iter().enumerate() {
        match set.value.as_str() {
            "x-ratelimit" => h.x_ratelimit = true,
            "retry-after" => h.retry_after = true,
            "ietf" => h.ietf = true,
            "grpc-status-details" => h.grpc_status_details = true,
            other => {
                return Err(Problem::new(
                    format!("response_headers[{i}]"),
                    position(set),
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
    raw: &IndexMap<String, IndexMap<String, Spanned<raw::TokenBucket>>>,
    default_tier: Option<Spanned<String>>,
) -> Result<Quotas, Problem> {
    let mut tiers = IndexMap::new();
    // Where each tier starts, for errors about the tier as a whole.
    let mut tier_at = HashMap::new();
    for (tier, classes) in raw {
        let mut specs = IndexMap::new();
        for (class, bucket) in classes {
            tier_at.entry(tier.clone()).or_insert_with(|| position(bucket));
            let spec = token_bucket(&bucket.value)
                .map_err(|m| Problem::new(format!("tiers.{tier}.{class}"), position(bucket), m))?;
            specs.insert(class.clone(), spec);
        }
        tiers.insert(tier.clone(), specs);
    }
    let (default_tier, at) = text(default_tier);
    match &default_tier {
        None if !tiers.is_empty() => {
            let first = tier_at.values().flatten().min().copied();
            return Err(Problem::new("default_tier", first, "required when tiers are defined"));
        }
        Some(t) => match tiers.get(t) {
            None => return Err(Problem::new("default_tier", at, format!("unknown tier '{t}'"))),
            Some(classes) if !classes.contains_key(DEFAULT_CLASS) => {
                return Err(Problem::new(
                    format!("tiers.{t}"),
                    tier_at.get(t).copied().flatten(),
                    format!("the default tier needs a '{DEFAULT_CLASS}' bucket"),
                ))
            }
            Some(_) => {}
        },
        None => {}
    }
    Ok(Quotas { tiers, default_tier })
}

fn tenants(
    raw: IndexMap<String, Spanned<raw::Tenant>>,
    quotas: &Quotas,
) -> Result<IndexMap<String, Arc<TenantRecord>>, Problem> {
    let mut tenants = IndexMap::new();
    for (tenant, record) in raw {
        let at = position(&record);
        let record = record.value;
        let (tier, tier_at) = text(record.tier);
        if let Some(tier) = &tier {
            if !quotas.tiers.contains_key(tier) {
                return Err(Problem::new(
                    format!("tenants.{tenant}.tier"),
                    tier_at.or(at),
                    format!("unknown tier '{tier}'"),
                ));
            }
        }
        let mut overrides = IndexMap::new();
        for (class, bucket) in &record.overrides {
            let spec = token_bucket(&bucket.value).map_err(|m| {
                Problem::new(format!("tenants.{tenant}.overrides.{class}"), position(bucket), m)
            })?;
            overrides.insert(class.clone(), spec);
        }
        tenants.insert(tenant, Arc::new(TenantRecord { tier, overrides }));
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
    // The domain has prices: nodes may have budgets, and every limit sits under the tenant (all
    // of a request's levels in one Cluster slot, decided in one script).
    priced: bool,
    rules: Vec<Arc<Rule>>,
    classes: IndexMap<String, ClassDef>,
}

impl Tree<'_> {
    fn level(&mut self, descriptors: &[raw::Descriptor], parent: &Place) -> Result<Level, ConfigError> {
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
                Some(b) => Some(
                    priced::budget(b).map_err(|m| invalid(Located { message: m, position: position(b) }))?,
                ),
            };
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
            let source = d.source.clone();
            check_source(key, value, source.as_ref()).map_err(|m| invalid(m.into()))?;
            let node =
                Node { key: key.to_owned(), value: ValueMatch::parse(value), rule, budget, source, children };
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
        let exclusive = [d.rate_limit.is_some(), d.token_bucket.is_some(), d.quota.is_some()];
        if exclusive.iter().filter(|x| **x).count() > 1 {
            return Err("rate_limit, token_bucket and quota are mutually exclusive".into());
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
                )
                .into());
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
                    return Err(format!(
                        "max_debt must be between 0 and {MAX_CAPACITY:e} tokens, got {debt}"
                    ));
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

fn token_bucket(b: &raw::TokenBucket) -> Result<BucketSpec, String> {
    BucketSpec::new(b.capacity, b.refill_per_second).map_err(|e| e.to_string())
}
