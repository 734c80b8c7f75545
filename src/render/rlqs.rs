//! `tollgate render envoy --protocol rlqs`: the rate_limit_quota filters that put requests into
//! the buckets a domain limits.
//!
//! A bucket id's values must be strings that Envoy's matcher inputs produce. Envoy's input for
//! dynamic metadata yields a protobuf value, not a string: a bucket id built from it fails, and
//! no request is ever matched (seen with Envoy 1.40). So a JWT claim travels through filter
//! state: a `set_filter_state` filter, after jwt_authn, copies each claim the buckets read from
//! the verified payload into a string object (`tollgate.<payload key>.<claim>`), and the bucket
//! matchers read that. A token without the claim gets `-` there (Envoy's formatter for a missing
//! value): those requests share the bucket of tenant `-`. A client cannot set filter state, so
//! the tenant still comes only from a verified token.

use serde_json::{json, Value};

use super::{JwtPayload, RenderError};
use crate::config::{Domain, Limit, Source};
use crate::edge::rlqs::ENVOY_NAME_METADATA;
use crate::matcher::Level;

/// The rate_limit_quota filters for one domain: one per distinct path of entry keys that some
/// rule limits, the most specific first, each with one bucket matcher. Envoy puts a request in
/// one bucket per filter, so a request that several limits apply to (tenant and client address)
/// goes through several filters. A filter applies when every entry its path reads is present;
/// the bucket id holds those entries, and tollgate maps the id to the rule that limits it (values,
/// wildcards and tenant quotas are tollgate's to match). Paths with a `generic_key` mark routes,
/// and the filter has no per-route switch: such domains render for RLS only. A domain whose
/// entries read JWT claims gets the filter that copies them into filter state first.
pub fn quota_filters(
    domain: &Domain,
    jwt: &JwtPayload,
    cluster: &str,
    envoy_name: Option<&str>,
) -> Result<Vec<Value>, RenderError> {
    let mut paths: Vec<Vec<(String, Source)>> = Vec::new();
    collect_paths(domain, &domain.root, &[], &mut paths)?;
    paths.sort_by_key(|entries| std::cmp::Reverse(entries.len()));
    if let Some(marked) = paths.iter().find(|p| p.iter().any(|(_, s)| matches!(s, Source::GenericKey(_)))) {
        let keys: Vec<&str> = marked.iter().map(|(k, _)| k.as_str()).collect();
        return Err(RenderError::RouteMarker { domain: domain.name.clone(), path: keys.join(".") });
    }
    let mut server = json!({ "envoy_grpc": { "cluster_name": cluster } });
    if let Some(name) = envoy_name {
        server["initial_metadata"] = json!([{ "key": ENVOY_NAME_METADATA, "value": name }]);
    }
    let mut claims: Vec<&str> = Vec::new();
    for (_, source) in paths.iter().flatten() {
        if let Source::JwtClaim(claim) = source {
            if !claims.contains(&claim.as_str()) {
                claims.push(claim);
            }
        }
    }
    let mut filters: Vec<Value> = Vec::new();
    if !claims.is_empty() {
        filters.push(claims_to_filter_state(&claims, jwt));
    }
    filters.extend(paths.iter().map(|entries| quota_filter(domain, &server, entries, jwt)));
    Ok(filters)
}

// Where a claim is copied to in filter state, as a string the bucket matchers can read.
fn claim_state_key(jwt: &JwtPayload, claim: &str) -> String {
    format!("tollgate.{}.{claim}", jwt.key())
}

// The filter that copies `claims` from the verified JWT payload into filter state; it must run
// after jwt_authn and before the quota filters.
fn claims_to_filter_state(claims: &[&str], jwt: &JwtPayload) -> Value {
    let values: Vec<Value> = claims
        .iter()
        .map(|claim| {
            let format = format!("%DYNAMIC_METADATA(envoy.filters.http.jwt_authn:{}:{claim})%", jwt.key());
            json!({
                "object_key": claim_state_key(jwt, claim),
                "factory_key": "envoy.string",
                "format_string": { "text_format_source": { "inline_string": format } },
            })
        })
        .collect();
    json!({
        "name": "tollgate.rlqs.jwt_claims",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config",
            "on_request_headers": values,
        },
    })
}

fn collect_paths(
    domain: &Domain,
    level: &Level,
    above: &[(String, Option<Source>)],
    out: &mut Vec<Vec<(String, Source)>>,
) -> Result<(), RenderError> {
    for node in level.nodes() {
        let mut path = above.to_vec();
        path.push((node.key.clone(), node.source.clone()));
        if let Some(rule) = node.rule.as_ref().filter(|r| r.limit != Limit::Unlimited) {
            let entries: Option<Vec<(String, Source)>> =
                path.iter().map(|(k, s)| s.clone().map(|s| (k.clone(), s))).collect();
            let entries = entries.ok_or_else(|| RenderError::NoSource {
                domain: domain.name.clone(),
                path: rule.path.clone(),
            })?;
            if !out.contains(&entries) {
                out.push(entries);
            }
        }
        collect_paths(domain, &node.children, &path, out)?;
    }
    Ok(())
}

// The filter for one path: its matcher applies when every entry is present, and builds the
// bucket id from the entries.
fn quota_filter(domain: &Domain, server: &Value, entries: &[(String, Source)], jwt: &JwtPayload) -> Value {
    let present = |input: Value| json!({ "single_predicate": { "input": input, "value_match": { "safe_regex": { "google_re2": {}, "regex": ".+" } } } });
    let mut predicates = Vec::new();
    let mut builder = serde_json::Map::new();
    for (key, source) in entries {
        let input = quota_input(key, source, jwt);
        predicates.push(present(input.clone()));
        builder.insert(key.clone(), json!({ "custom_value": input }));
    }
    let predicate = match predicates.len() {
        1 => predicates.pop().expect("one"),
        _ => json!({ "and_matcher": { "predicate": predicates } }),
    };
    let name: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
    let name = name.join(".");
    let matcher = json!({
        "predicate": predicate,
        "on_match": { "action": {
            "name": name,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings",
                "bucket_id_builder": { "bucket_id_builder": builder },
                "reporting_interval": "5s",
                // Until tollgate's first assignment, and if assignments stop: refuse, so that
                // nothing is admitted that the shared budget did not cover.
                "no_assignment_behavior": { "fallback_rate_limit": { "blanket_rule": "DENY_ALL" } },
                "expired_assignment_behavior": { "fallback_rate_limit": { "blanket_rule": "DENY_ALL" } },
                "deny_response_settings": { "http_status": { "code": 429 } },
            },
        }},
    });
    json!({
        "name": format!("tollgate.rlqs.{name}"),
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig",
            "rlqs_server": server,
            "domain": domain.name,
            "bucket_matchers": { "matcher_list": { "matchers": [matcher] } },
        },
    })
}

// The matching input that reads entry `key` from `source` (never a constant: those are refused).
fn quota_input(key: &str, source: &Source, jwt: &JwtPayload) -> Value {
    let header = |name: &str| {
        json!({ "name": key, "typed_config": {
            "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
            "header_name": name,
        }})
    };
    match source {
        Source::JwtClaim(claim) => json!({ "name": key, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.FilterStateInput",
            "key": claim_state_key(jwt, claim),
        }}),
        Source::RequestHeader(name) => header(name),
        Source::Path => header(":path"),
        Source::Method => header(":method"),
        Source::RemoteAddress => json!({ "name": key, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.SourceIPInput",
        }}),
        Source::GenericKey(_) => unreachable!("quota_filters refuses route markers"),
    }
}
