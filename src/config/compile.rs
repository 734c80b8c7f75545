//! From a parsed file to a [`Domain`]: the domain's own keys (failure mode, headers, tenant
//! quotas and tenants), the descriptor tree (`src/config/tree.rs`) and the price table
//! (`src/config/priced.rs`), every problem reported with the file, line and tree path of what is
//! wrong (`src/config/problem.rs`).

use std::collections::HashMap;

use indexmap::IndexMap;
use std::path::Path;
use std::sync::Arc;

use serde_saphyr::Spanned;

use super::problem::{position, syntax, text, Problem};
use super::tree::{Place, Tree};
use super::{priced, raw};
use super::{Blanket, ConfigError, Domain, FailureMode, HeaderSets};
use crate::quota::{Quotas, TenantRecord, DEFAULT_CLASS};

/// Compiles the domain file `file` with contents `text`.
pub(super) fn domain(file: &Path, text_: &str) -> Result<Domain, ConfigError> {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_nodes = raw::MAX_NODES;
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
        concurrent: false,
    };
    let root = tree.level(raw.descriptors.as_deref().unwrap_or_default(), &Place::root())?;
    let (rules, classes, concurrent) = (tree.rules, tree.classes, tree.concurrent);
    let (request_id_key, at) = text(raw.request_id_key);
    if request_id_key.is_some() && priced.is_none() && !concurrent {
        return Err(invalid(Problem::new(
            "request_id_key",
            at,
            "names a request for budgets and concurrency limits; this domain has neither",
        )));
    }
    let request_id_key = request_id_key.unwrap_or_else(|| "request_id".into());
    if request_id_key.is_empty() {
        return Err(invalid(Problem::new("request_id_key", at, "must not be empty")));
    }
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
        request_id_key,
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
            let spec = bucket
                .value
                .spec()
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
            let spec = bucket.value.spec().map_err(|m| {
                Problem::new(format!("tenants.{tenant}.overrides.{class}"), position(bucket), m)
            })?;
            overrides.insert(class.clone(), spec);
        }
        tenants.insert(tenant, Arc::new(TenantRecord { tier, overrides }));
    }
    Ok(tenants)
}

// A `token_bucket:` (of a node or a tier).
