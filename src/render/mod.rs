//! `tollgate render`: the Envoy and Istio side of a config, generated from the config.
//!
//! The descriptor tree already says which entries tollgate expects; with a `source:` on each
//! node it also says where Envoy gets them, so one file drives both sides and they cannot drift
//! apart. Every rule (except `unlimited` ones, which need no call) becomes one Envoy
//! `rate_limits` entry with one action per node on its path.
//!
//! Placement: an entry whose actions are all request-derived (JWT claim, header, path, method,
//! address) belongs to the virtual host, because it describes every request and the rules pick
//! out the ones they limit. An entry with a `generic_key` marks a route, so it goes to the routes
//! that should be charged to it, grouped by its constant values; a route with its own
//! `rate_limits` replaces the virtual host's, so each route group repeats them.
//!
//! A domain with `charge: always` rules is rendered at the filter level instead: Envoy sends
//! per-descriptor hits, and charges after the response (`apply_on_stream_done`), only for the
//! ratelimit filter's own `rate_limits`, which replace every route's. Such a rule becomes a check
//! before the request (hits 0) and a charge when the response is done, with the hits read from
//! its `hits_from` response header, or from that trailer, which a small Lua filter copies into
//! dynamic metadata (Envoy 1.40 cannot read trailers there).
//!
//! A domain with concurrency limits is rendered at the filter level too: each limit becomes a take
//! (its path and the request id) and a give-back when the response is done (`release`), sent only
//! if the response began (a Lua filter marks it), so that a client's reset does not free a slot
//! while the upstream may still work; the connection manager's `request_timeout` and the route's
//! `timeout` keep what Envoy lets the upstream do within the slot's ttl ([`slot_timeouts`]). A
//! rule at the limit's node is charged by the take.
//!
//! A domain with prices (LLM spend budgets) is rendered by `budget.rs`: a Lua filter that reads
//! the model, the tokens to hold and the usage out of the bodies, and filter-level entries that
//! hold at request time and settle at stream end.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

mod budget;
mod rlqs;

use crate::config::{ChargeRule, Domain, FailureMode, Limit, Rule, RuleSet, Source};
use crate::matcher::Level;

pub use self::rlqs::quota_filters;

/// Where the verified JWT payload sits in Envoy's dynamic metadata.
#[derive(Debug, Clone)]
pub enum JwtPayload {
    /// Envoy's jwt_authn with `payload_in_metadata: <key>`.
    MetadataKey(String),
    /// Istio's RequestAuthentication: the payload is stored under the issuer.
    Issuer(String),
}

impl JwtPayload {
    /// The key the payload is stored under in jwt_authn's dynamic metadata.
    fn key(&self) -> &str {
        match self {
            JwtPayload::MetadataKey(k) | JwtPayload::Issuer(k) => k,
        }
    }
}

/// Which Envoy filter a render configures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `envoy.filters.http.ratelimit`: every request asks tollgate (RLS).
    Rls,
    /// `envoy.filters.http.rate_limit_quota`: Envoy enforces leases tollgate takes for it (RLQS).
    Rlqs,
}

/// What a render needs besides the config.
#[derive(Debug, Clone)]
pub struct RenderOptions {
    /// The domain to render; required when the config has several.
    pub domain: Option<String>,
    /// Where the JWT payload is.
    pub jwt: JwtPayload,
    /// Envoy's deadline for tollgate.
    pub timeout: Duration,
    /// `failure_mode_deny` of the filter for domains whose `failure_mode` is `allow` (a domain
    /// that fails closed, `deny` or `error`, is always rendered with it).
    pub failure_mode_deny: bool,
    /// The filter to configure.
    pub protocol: Protocol,
    /// With [`Protocol::Rlqs`]: the name this Envoy gives itself in its stream metadata
    /// (`x-tollgate-envoy`), for Envoys that share an address; unique per Envoy.
    pub envoy_name: Option<String>,
}

/// Why a config cannot be rendered.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// `--domain` names no configured domain, or is missing with several domains.
    #[error("{0}")]
    Domain(String),
    /// A node on the path of a rule has no `source`.
    #[error("domain '{domain}': descriptor '{path}' has no source: add `source:` (jwt_claim, request_header, path, method, remote_address or generic_key)")]
    NoSource {
        /// The domain rendered.
        domain: String,
        /// The descriptor's place in the tree.
        path: String,
    },
    /// A priced domain needs Envoy's ratelimit filter with its body-reading Lua filter, which
    /// only `render envoy` prints.
    #[error("domain '{domain}' has prices: render it with `tollgate render envoy` (RLS, with the Lua filter that reads the bodies)")]
    Priced {
        /// The domain rendered.
        domain: String,
    },
    /// A route marker has no rendering for the rate_limit_quota filter.
    #[error("domain '{domain}': descriptor '{path}' marks routes with a generic_key, which the rate_limit_quota filter cannot (it has no per-route switch): render this domain with --protocol rls")]
    RouteMarker {
        /// The domain rendered.
        domain: String,
        /// The descriptor's place in the tree.
        path: String,
    },
    /// A `charge: always` rule does not say where Envoy reads the charge.
    #[error("domain '{domain}': descriptor '{path}' charges always but has no hits_from: name the response header (or trailer) that carries the cost")]
    NoHitsFrom {
        /// The domain rendered.
        domain: String,
        /// The descriptor's place in the tree.
        path: String,
    },
}

/// The `rate_limits` entries for one domain.
#[derive(Debug, Clone, PartialEq)]
pub struct RateLimits {
    /// For the virtual host.
    pub virtual_host: Vec<Value>,
    /// For routes, by group (`key=value` of their generic keys); each repeats the virtual
    /// host's entries.
    pub routes: BTreeMap<String, Vec<Value>>,
    /// For the ratelimit filter itself (domains with `charge: always` rules; then the two above
    /// are empty).
    pub filter: Vec<Value>,
    /// The response trailers whose value a charge reads (through the Lua filter).
    pub trailers: Vec<String>,
}

/// The domain `options` selects.
pub fn select<'a>(rules: &'a RuleSet, options: &RenderOptions) -> Result<&'a Domain, RenderError> {
    let names: Vec<&str> = rules.domains().map(|d| d.name.as_str()).collect();
    match &options.domain {
        Some(name) => rules.domain(name).map(|d| d.as_ref()).ok_or_else(|| {
            RenderError::Domain(format!("no domain '{name}' (the config has {})", names.join(", ")))
        }),
        None if names.len() == 1 => Ok(rules.domains().next().expect("one domain")),
        None => Err(RenderError::Domain(format!(
            "the config has several domains ({}): choose one with --domain",
            names.join(", ")
        ))),
    }
}

/// The `rate_limits` entries that produce the descriptors `domain`'s rules expect.
pub fn rate_limits(domain: &Domain, jwt: &JwtPayload) -> Result<RateLimits, RenderError> {
    let mut out = RateLimits {
        virtual_host: Vec::new(),
        routes: BTreeMap::new(),
        filter: Vec::new(),
        trailers: Vec::new(),
    };
    let filter_level = domain.rules.iter().any(|r| matches!(r.charge, ChargeRule::Always { .. }))
        || !domain.concurrency_limits().is_empty();
    walk(domain, &domain.root, jwt, &[], &[], filter_level, &mut out)?;
    for entries in out.routes.values_mut() {
        let mut all = out.virtual_host.clone();
        all.append(entries);
        *entries = all;
    }
    Ok(out)
}

fn walk(
    domain: &Domain,
    level: &Level,
    jwt: &JwtPayload,
    actions: &[Option<Value>],
    groups: &[String],
    filter_level: bool,
    out: &mut RateLimits,
) -> Result<(), RenderError> {
    for node in level.nodes() {
        let mut path = actions.to_vec();
        path.push(node.source.as_ref().map(|s| action(&node.key, s, jwt)));
        let mut groups = groups.to_vec();
        if let Some(Source::GenericKey(value)) = &node.source {
            groups.push(format!("{}={value}", node.key));
        }
        if node.concurrency.is_some() {
            let actions: Option<Vec<Value>> = path.iter().cloned().collect();
            let actions = actions.ok_or_else(|| RenderError::NoSource {
                domain: domain.name.clone(),
                path: node.key.clone(),
            })?;
            for entry in slot_entries(domain, actions, jwt) {
                if !out.filter.contains(&entry) {
                    out.filter.push(entry);
                }
            }
        }
        // A rule at a node with a concurrency limit is charged by the take, whose path is its.
        let covered = node.concurrency.is_some();
        if let Some(rule) = node
            .rule
            .as_ref()
            .filter(|r| r.limit != Limit::Unlimited && !(covered && r.charge == ChargeRule::Admitted))
        {
            let actions: Option<Vec<Value>> = path.iter().cloned().collect();
            let actions = actions.ok_or_else(|| RenderError::NoSource {
                domain: domain.name.clone(),
                path: rule.path.clone(),
            })?;
            let entries = entries(domain, rule, actions, out)?;
            let list = if filter_level {
                &mut out.filter
            } else if groups.is_empty() {
                &mut out.virtual_host
            } else {
                out.routes.entry(groups.join(",")).or_default()
            };
            // Rules for different values of one key (e.g. every remote_address rule) share one
            // entry; a second one would make Envoy send the descriptor, and charge it, twice.
            for entry in entries {
                if !list.contains(&entry) {
                    list.push(entry);
                }
            }
        }
        walk(domain, &node.children, jwt, &path, &groups, filter_level, out)?;
    }
    Ok(())
}

// A concurrency limit's two entries: the take at request time (the path, then the request id
// from `x-request-id`) and the give-back when the response is done (the same, then `release`).
fn slot_entries(domain: &Domain, mut actions: Vec<Value>, jwt: &JwtPayload) -> [Value; 2] {
    actions.push(action(&domain.request_id_key, &Source::RequestHeader("x-request-id".into()), jwt));
    let take = json!({ "actions": actions });
    actions.push(
        json!({ "generic_key": { "descriptor_key": crate::slot::RELEASE_KEY, "descriptor_value": "1" } }),
    );
    // The give-back's hits come from `tollgate:responded`, which the Lua filter sets when the
    // response begins: a request reset before that (the client gone, the upstream perhaps still
    // working) sends no give-back (Envoy drops an entry whose hits_addend is not a number) and
    // keeps its slot until the ttl.
    let give_back = json!({
        "actions": actions,
        "apply_on_stream_done": true,
        "hits_addend": { "format": "%DYNAMIC_METADATA(tollgate:responded)%" },
    });
    [take, give_back]
}

/// How long Envoy may take over a request under a concurrency limit of `ttl`, so that the
/// upstream is done with it before its slot expires: the whole request (head and body) within a
/// sixth of the ttl (the HCM's `request_timeout`), the upstream's answer within two thirds (the
/// route's `timeout`, which starts once the body is in). `None` for no limit.
pub fn slot_timeouts(domain: &Domain) -> Option<(Duration, Duration)> {
    let ttl_ms = domain.concurrency_limits().iter().map(|(_, l)| l.ttl_ms).min()?;
    Some((Duration::from_millis(ttl_ms / 6), Duration::from_millis(ttl_ms * 2 / 3)))
}

// The entries of one rule: one per request; for `charge: always`, a check before the request and
// the charges after it (from the header, or from the trailer the Lua filter copied).
fn entries(
    domain: &Domain,
    rule: &Rule,
    actions: Vec<Value>,
    out: &mut RateLimits,
) -> Result<Vec<Value>, RenderError> {
    let ChargeRule::Always { hits_from, .. } = &rule.charge else {
        return Ok(vec![json!({ "actions": actions })]);
    };
    let name = hits_from
        .as_ref()
        .ok_or_else(|| RenderError::NoHitsFrom { domain: domain.name.clone(), path: rule.path.clone() })?;
    if !out.trailers.contains(name) {
        out.trailers.push(name.clone());
    }
    Ok(vec![
        json!({ "actions": actions, "hits_addend": { "number": 0 } }),
        json!({ "actions": actions, "apply_on_stream_done": true, "hits_addend": { "format": format!("%RESP({name})%") } }),
        json!({ "actions": actions, "apply_on_stream_done": true, "hits_addend": { "format": format!("%DYNAMIC_METADATA(tollgate:{name})%") } }),
    ])
}

/// The Lua filter that copies response trailers `names` into dynamic metadata (`tollgate:<name>`)
/// as a response ends, for charges after the response; it passes the body through chunk by
/// chunk, never buffering it.
pub fn trailer_filter(names: &[String], mark_responded: bool) -> Value {
    let mut script = String::from("function envoy_on_response(handle)\n");
    if mark_responded {
        // What a concurrency limit's give-back reads: the response has begun.
        script.push_str("  handle:streamInfo():dynamicMetadata():set(\"tollgate\", \"responded\", \"1\")\n");
    }
    if !names.is_empty() {
        script.push_str("  for _ in handle:bodyChunks() do end\n  local trailers = handle:trailers()\n");
    }
    for name in names {
        script.push_str(&format!(
            "  local used = trailers and trailers:get(\"{name}\")\n  if used then\n    handle:streamInfo():dynamicMetadata():set(\"tollgate\", \"{name}\", used)\n  end\n"
        ));
    }
    script.push_str("end\n");
    json!({
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": { "inline_string": script },
        },
    })
}

/// The Envoy action that produces entry `key` from `source`.
fn action(key: &str, source: &Source, jwt: &JwtPayload) -> Value {
    match source {
        Source::JwtClaim(claim) => {
            // Without a value Envoy builds no descriptor and skips the call: a token without the
            // claim would go unlimited. The default sends such tokens to one shared bucket.
            json!({ "metadata": {
                "descriptor_key": key,
                "source": "DYNAMIC",
                "metadata_key": {
                    "key": "envoy.filters.http.jwt_authn",
                    "path": [{ "key": jwt.key() }, { "key": claim }],
                },
                "default_value": format!("_no_{claim}_claim"),
            }})
        }
        Source::RequestHeader(header) => header_action(key, header),
        Source::Path => header_action(key, ":path"),
        Source::Method => header_action(key, ":method"),
        Source::RemoteAddress => json!({ "remote_address": {} }),
        Source::GenericKey(value) => {
            json!({ "generic_key": { "descriptor_key": key, "descriptor_value": value } })
        }
    }
}

fn header_action(key: &str, header: &str) -> Value {
    json!({ "request_headers": { "header_name": header, "descriptor_key": key } })
}

/// The ratelimit HTTP filter for `domain`, calling tollgate through `cluster`, with the
/// filter-level `rate_limits` if there are any.
pub fn http_filter(domain: &Domain, cluster: &str, options: &RenderOptions, rate_limits: &[Value]) -> Value {
    let mut filter = json!({
        "name": "envoy.filters.http.ratelimit",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": domain.name,
            "timeout": format!("{}s", options.timeout.as_secs_f64()),
            // Envoy's own answer when tollgate cannot be asked matches the domain's answer when
            // Redis cannot: only `allow` lets the request through uncharged.
            "failure_mode_deny": options.failure_mode_deny || domain.failure_mode != FailureMode::Allow,
            "rate_limited_as_resource_exhausted": true,
            "rate_limit_service": {
                "transport_api_version": "V3",
                "grpc_service": { "envoy_grpc": { "cluster_name": cluster } },
            },
        },
    });
    if !rate_limits.is_empty() {
        filter["typed_config"]["rate_limits"] = json!(rate_limits);
    }
    filter
}

/// `tollgate render envoy`: the filter, the tollgate cluster (at `address`, `host:port`) and
/// the `rate_limits` for the virtual host and for each route group.
pub fn envoy(rules: &RuleSet, options: &RenderOptions, address: &str) -> Result<Value, RenderError> {
    let domain = select(rules, options)?;
    let (host, port) = address.rsplit_once(':').unwrap_or((address, "8081"));
    let port: u16 = port.parse().unwrap_or(8081);
    if let Some(priced) = &domain.priced {
        if options.protocol == Protocol::Rlqs {
            return Err(RenderError::Priced { domain: domain.name.clone() });
        }
        let limits = budget::rate_limits(domain, priced, &options.jwt)?;
        return Ok(json!({
            "domain": domain.name,
            "http_connection_manager": budget::connection_manager(),
            "http_filters": [budget::lua_filter(), http_filter(domain, "tollgate", options, &limits)],
            "cluster": tollgate_cluster(host, port),
        }));
    }
    if options.protocol == Protocol::Rlqs {
        return Ok(json!({
            "domain": domain.name,
            "http_filters": quota_filters(domain, &options.jwt, "tollgate", options.envoy_name.as_deref())?,
            "cluster": tollgate_cluster(host, port),
        }));
    }
    let limits = rate_limits(domain, &options.jwt)?;
    let routes: serde_json::Map<String, Value> = limits
        .routes
        .into_iter()
        .map(|(group, entries)| (group, json!({ "rate_limits": entries })))
        .collect();
    let mut out = json!({
        "domain": domain.name,
        "http_filter": http_filter(domain, "tollgate", options, &limits.filter),
        "cluster": tollgate_cluster(host, port),
    });
    if limits.filter.is_empty() {
        out["virtual_host"] = json!({ "rate_limits": limits.virtual_host });
        out["routes"] = Value::Object(routes);
    }
    let slots = slot_timeouts(domain);
    if !limits.trailers.is_empty() || slots.is_some() {
        out["lua_filter"] = trailer_filter(&limits.trailers, slots.is_some());
    }
    // A slot is named by its request id: Envoy must make every id itself, or a client could
    // resend an admitted request's id and be admitted as its retry, taking no slot. A slot
    // bounds what the upstream does only if Envoy gives up on a request before its ttl.
    if let Some((request, route)) = slots {
        let mut hcm = budget::connection_manager();
        hcm["request_timeout"] = json!(duration(request));
        out["http_connection_manager"] = hcm;
        out["route"] = json!({ "timeout": duration(route) });
    }
    Ok(out)
}

// A protobuf Duration in JSON: seconds with a fraction.
fn duration(d: Duration) -> String {
    format!("{}s", d.as_secs_f64())
}

// tollgate's cluster: HTTP/2, as gRPC needs.
fn tollgate_cluster(host: &str, port: u16) -> Value {
    json!({
        "name": "tollgate",
        "type": "STRICT_DNS",
        "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": { "http2_protocol_options": {} },
            },
        },
        "load_assignment": {
            "cluster_name": "tollgate",
            "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": {
                "socket_address": { "address": host, "port_value": port },
            }}}]}],
        },
    })
}

/// Which Istio proxies to configure.
#[derive(Debug, Clone)]
pub enum IstioTarget {
    /// The ingress gateway (`istio: ingressgateway` in `istio-system`).
    Gateway,
    /// The sidecars of pods labelled `app: <app>` in `namespace`.
    Sidecar {
        /// The pods' `app` label.
        app: String,
        /// Their namespace.
        namespace: String,
    },
}

/// `tollgate render istio`: one EnvoyFilter that inserts the ratelimit filter before the router
/// and merges the `rate_limits` into the virtual hosts and into the routes named after each
/// route group's constant. `service` is tollgate's Kubernetes service host
/// (`tollgate.<namespace>.svc.cluster.local`); its gRPC port must be named `grpc` or have
/// `appProtocol: grpc`, so Istio's outbound cluster speaks HTTP/2 and needs no CLUSTER patch.
pub fn istio(
    rules: &RuleSet,
    options: &RenderOptions,
    target: &IstioTarget,
    service: &str,
    port: u16,
) -> Result<Value, RenderError> {
    let domain = select(rules, options)?;
    if domain.priced.is_some() {
        return Err(RenderError::Priced { domain: domain.name.clone() });
    }
    let limits = rate_limits(domain, &options.jwt)?;
    let (context, namespace, selector, name) = match target {
        IstioTarget::Gateway => (
            "GATEWAY",
            "istio-system",
            json!({ "istio": "ingressgateway" }),
            format!("tollgate-{}-gateway", domain.name),
        ),
        IstioTarget::Sidecar { app, namespace } => (
            "SIDECAR_INBOUND",
            namespace.as_str(),
            json!({ "app": app }),
            format!("tollgate-{}-{app}", domain.name),
        ),
    };
    let cluster = format!("outbound|{port}||{service}");
    let mut patches = vec![json!({
        "applyTo": "HTTP_FILTER",
        "match": { "context": context, "listener": { "filterChain": { "filter": {
            "name": "envoy.filters.network.http_connection_manager",
            "subFilter": { "name": "envoy.filters.http.router" },
        }}}},
        "patch": { "operation": "INSERT_BEFORE", "value": http_filter(domain, &cluster, options, &limits.filter) },
    })];
    let slots = slot_timeouts(domain).is_some();
    if !limits.trailers.is_empty() || slots {
        patches.push(json!({
            "applyTo": "HTTP_FILTER",
            "match": { "context": context, "listener": { "filterChain": { "filter": {
                "name": "envoy.filters.network.http_connection_manager",
                "subFilter": { "name": "envoy.filters.http.router" },
            }}}},
            "patch": { "operation": "INSERT_BEFORE", "value": trailer_filter(&limits.trailers, slots) },
        }));
    }
    if limits.filter.is_empty() {
        patches.push(json!({
            "applyTo": "VIRTUAL_HOST",
            "match": { "context": context },
            "patch": { "operation": "MERGE", "value": { "rate_limits": limits.virtual_host } },
        }));
    }
    for (group, entries) in limits.routes {
        patches.push(json!({
            "applyTo": "HTTP_ROUTE",
            "match": { "context": context, "routeConfiguration": { "vhost": { "route": { "name": route_name(&group) } } } },
            "patch": { "operation": "MERGE", "value": { "route": { "rate_limits": entries } } },
        }));
    }
    Ok(json!({
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": { "name": name, "namespace": namespace },
        "spec": { "workloadSelector": { "labels": selector }, "configPatches": patches },
    }))
}

/// The VirtualService route name a route group's patch matches: its constants' values joined
/// by `-` (`class=export` → `export`).
pub fn route_name(group: &str) -> String {
    group.split(',').map(|kv| kv.split_once('=').map_or(kv, |(_, v)| v)).collect::<Vec<_>>().join("-")
}
