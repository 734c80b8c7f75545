//! Envoy Gateway's own translator outputs, enforced through a real Envoy 1.40: every
//! `RateLimitConfig` of its test data (`tests/data/envoy-gateway/translator/*.yaml`) is pushed
//! over xDS to tollgate started with envoyproxy/ratelimit's environment, and every route of the
//! matching `.routes.yaml` becomes an Envoy listener configured as Envoy Gateway configures it:
//! one ratelimit filter per domain, the route's actions in a `RateLimitPerRoute` for that
//! filter. Requests built to satisfy each route's actions are sent in bursts, and the number
//! admitted is held to what the config states, bucket by bucket, as this file models it.
//!
//! The model: a descriptor's limit is that of the config node its entries reach (exact value,
//! else the node without a value), none if `shadow_mode` or `unlimited`; a bucket is the domain
//! and the entries; a request is admitted when every domain's call (in Envoy Gateway's filter
//! order) finds a token in each of its buckets, and a call that is admitted takes one from each.
//! Every case's domains are renamed `<case>/<domain>`, so the cases share one tollgate and one
//! Envoy without sharing buckets; within a case, bursts are a little over a second apart, so that
//! a per-second bucket starts each burst full, and per-second refills within a burst are allowed
//! for (the upper bound).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/envoy-gateway/translator");

/// One translator test case: its configs (domains renamed) and its routes.
struct Case {
    name: String,
    configs: BTreeMap<String, Value>,
    routes: Vec<Route>,
}

/// One route document: its rate limits per domain (renamed), in Envoy Gateway's filter order.
struct Route {
    by_domain: Vec<(String, Vec<Value>)>,
    listener: SocketAddr,
}

fn cases() -> Vec<Case> {
    let mut names: Vec<String> = std::fs::read_dir(DATA)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|f| f.strip_suffix(".routes.yaml").map(str::to_owned))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let read = |file: String| std::fs::read_to_string(Path::new(DATA).join(file)).unwrap();
            let renamed = |domain: &str| format!("{name}/{domain}");
            let mut configs = BTreeMap::new();
            for doc in serde_saphyr::from_multiple::<Value>(&read(format!("{name}.yaml"))).unwrap() {
                let domain = renamed(doc["domain"].as_str().unwrap());
                configs.insert(domain, doc);
            }
            let routes = serde_saphyr::from_multiple::<Value>(&read(format!("{name}.routes.yaml")))
                .unwrap()
                .into_iter()
                .map(|doc| {
                    let mut by_domain: Vec<(String, Vec<Value>)> = doc["rateLimitsByDomain"]
                        .as_object()
                        .unwrap()
                        .iter()
                        .map(|(d, limits)| (d.clone(), limits.as_array().unwrap().clone()))
                        .collect();
                    // Envoy Gateway orders a listener's filters by domain name.
                    by_domain.sort_by(|a, b| a.0.cmp(&b.0));
                    let by_domain = by_domain.into_iter().map(|(d, l)| (renamed(&d), l)).collect();
                    Route { by_domain, listener: loopback() }
                })
                .collect();
            Case { name, configs, routes }
        })
        .collect()
}

fn loopback() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().unwrap()
}

// Envoy Gateway's test data prints Go structs: one-of wrappers (`ActionSpecifier`,
// `MatchPattern`...) around a PascalCase variant, and wrapper messages as `{value: x}`. This is
// the same in Envoy's JSON: the variant in snake case in place of the wrapper, plain values.
fn envoy_json(v: &Value) -> Value {
    const WRAPPERS: [&str; 4] =
        ["ActionSpecifier", "HeaderMatchSpecifier", "MatchPattern", "QueryParameterMatchSpecifier"];
    match v {
        Value::Object(map) if map.len() == 1 && map.get("value").is_some_and(|x| !x.is_object()) => {
            map["value"].clone()
        }
        Value::Object(map) => {
            let mut out = serde_json::Map::new();
            for (k, x) in map {
                if WRAPPERS.contains(&k.as_str()) {
                    for (variant, inner) in x.as_object().unwrap() {
                        out.insert(snake(variant), envoy_json(inner));
                    }
                } else if k == "EngineType" {
                    // Go's nil one-of: Envoy's default engine.
                } else {
                    out.insert(snake(k), envoy_json(x));
                }
            }
            Value::Object(out)
        }
        Value::Array(list) => Value::Array(list.iter().map(envoy_json).collect()),
        other => other.clone(),
    }
}

fn snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

// One listener per route document, as Envoy Gateway builds it: a ratelimit filter per domain
// (the first is `envoy.filters.http.ratelimit`, the others are named after their domain), the
// route's rate limits in a `RateLimitPerRoute` for each.
fn envoy_config(cases: &[Case], admin: SocketAddr, tollgate: SocketAddr, upstream: SocketAddr) -> Value {
    let socket = |a: SocketAddr| json!({"address": a.ip().to_string(), "port_value": a.port()});
    let cluster = |name: &str, at: SocketAddr, h2: bool| {
        let mut c = json!({
            "name": name,
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": socket(at)}}}]}]}
        });
        if h2 {
            c["typed_extension_protocol_options"] = json!({
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}
                }
            });
        }
        c
    };
    let mut listeners = Vec::new();
    for case in cases {
        for (i, route) in case.routes.iter().enumerate() {
            let filter_name = |n: usize, domain: &str| {
                if n == 0 {
                    "envoy.filters.http.ratelimit".to_owned()
                } else {
                    format!("envoy.filters.http.ratelimit/{domain}")
                }
            };
            let mut filters = Vec::new();
            let mut per_route = serde_json::Map::new();
            for (n, (domain, limits)) in route.by_domain.iter().enumerate() {
                filters.push(json!({
                    "name": filter_name(n, domain),
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                        "domain": domain,
                        "failure_mode_deny": true,
                        "timeout": "2s",
                        "rate_limit_service": {
                            "grpc_service": {"envoy_grpc": {"cluster_name": "tollgate"}},
                            "transport_api_version": "V3"
                        }
                    }
                }));
                per_route.insert(
                    filter_name(n, domain),
                    json!({
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
                        "domain": domain,
                        "rate_limits": envoy_json(&Value::Array(limits.clone())),
                    }),
                );
            }
            filters.push(json!({
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
            }));
            listeners.push(json!({
                "name": format!("{}-{i}", case.name),
                "address": {"socket_address": socket(route.listener)},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "ingress",
                        "route_config": {"virtual_hosts": [{
                            "name": "all",
                            "domains": ["*"],
                            "routes": [{
                                "name": format!("route-{i}"),
                                "match": {"prefix": "/"},
                                "route": {"cluster": "upstream"},
                                "typed_per_filter_config": per_route
                            }]
                        }]},
                        "http_filters": filters
                    }
                }]}]
            }));
        }
    }
    json!({
        "admin": {"address": {"socket_address": socket(admin)}},
        "static_resources": {
            "listeners": listeners,
            "clusters": [cluster("tollgate", tollgate, true), cluster("upstream", upstream, false)]
        }
    })
}

/// A request: method and path (GET / unless chosen), headers, query parameters, and the client
/// address Envoy sees (127.0.0.1 unless chosen, then sent as `x-forwarded-for`, which Envoy
/// takes for the client with `use_remote_address` off, as behind a load balancer).
#[derive(Clone, Debug, Default)]
struct Request {
    method: Option<String>,
    path: Option<String>,
    headers: BTreeMap<String, String>,
    query: BTreeMap<String, String>,
    client: Option<Ipv4Addr>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        match name {
            ":method" => Some(self.method.as_deref().unwrap_or("GET")),
            ":path" => Some(self.path.as_deref().unwrap_or("/")),
            _ => self.headers.get(name).map(String::as_str),
        }
    }

    fn client(&self) -> Ipv4Addr {
        self.client.unwrap_or(Ipv4Addr::LOCALHOST)
    }

    // Makes `matcher` (a header or query matcher of the Go dump) true where it can be, unless
    // something earlier already chose that name's value.
    fn satisfy(&mut self, name: &str, matcher: &Value, query: bool) {
        let pattern = &matcher["StringMatch"]["MatchPattern"];
        let value = match (pattern["Exact"].as_str(), pattern["SafeRegex"]["regex"].as_str()) {
            (Some(exact), _) => exact.to_owned(),
            // A regex without metacharacters matches itself.
            (None, Some(re)) if !re.contains(|c: char| "\\^$.|?*+()[]{}".contains(c)) => re.to_owned(),
            _ => return,
        };
        match (query, name) {
            (true, _) => {
                self.query.entry(name.to_owned()).or_insert(value);
            }
            // Only an origin-form path can be sent.
            (false, ":path") if value.starts_with('/') && self.path.is_none() => self.path = Some(value),
            (false, ":path") => {}
            (false, ":method") if self.method.is_none() => self.method = Some(value),
            (false, ":method") => {}
            (false, _) => {
                self.headers.entry(name.to_owned()).or_insert(value);
            }
        }
    }

    fn target(&self) -> String {
        let path = self.path.as_deref().unwrap_or("/");
        let query: Vec<String> = self.query.iter().map(|(k, v)| format!("{k}={v}")).collect();
        if query.is_empty() {
            path.to_owned()
        } else {
            format!("{path}?{}", query.join("&"))
        }
    }
}

// An address range of a `RemoteAddressMatch`: (prefix, mask).
fn range(r: &Value) -> (u32, u32) {
    let prefix: Ipv4Addr = r["address_prefix"].as_str().unwrap().parse().unwrap();
    let len = r["prefix_len"]["value"].as_u64().unwrap_or(0) as u32;
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    (u32::from(prefix) & mask, mask)
}

fn inside(client: Ipv4Addr, matcher: &Value) -> bool {
    matcher["ranges"].as_array().unwrap().iter().map(range).any(|(p, m)| u32::from(client) & m == p)
}

fn string_matches(matcher: &Value, value: Option<&str>) -> bool {
    let Some(value) = value else { return false };
    let pattern = &matcher["StringMatch"]["MatchPattern"];
    match (pattern["Exact"].as_str(), pattern["SafeRegex"]["regex"].as_str()) {
        (Some(exact), _) => exact == value,
        (None, Some(re)) => regex::Regex::new(&format!("^(?:{re})$")).unwrap().is_match(value),
        _ => panic!("a matcher this model does not know: {matcher}"),
    }
}

// Makes the request satisfy the actions of one rate limit where it can.
fn satisfy(request: &mut Request, limit: &Value) {
    for action in limit["actions"].as_array().unwrap() {
        let (kind, a) = action["ActionSpecifier"].as_object().unwrap().iter().next().unwrap();
        match kind.as_str() {
            "HeaderValueMatch" if a["expect_match"]["value"].as_bool() != Some(false) => {
                for h in a["headers"].as_array().unwrap() {
                    request.satisfy(h["name"].as_str().unwrap(), &h["HeaderMatchSpecifier"], false);
                }
            }
            "QueryParameterValueMatch" if a["expect_match"]["value"].as_bool() != Some(false) => {
                for q in a["query_parameters"].as_array().unwrap() {
                    request.satisfy(q["name"].as_str().unwrap(), &q["QueryParameterMatchSpecifier"], true);
                }
            }
            "RequestHeaders" => {
                request.headers.entry(a["header_name"].as_str().unwrap().to_owned()).or_insert("u1".into());
            }
            "RemoteAddressMatch" => {
                let m = &a["address_matcher"];
                let invert = m["invert_match"].as_bool().unwrap_or(false);
                if request.client.is_none() && !invert && !inside(Ipv4Addr::LOCALHOST, m) {
                    // The first address of the first range (the range itself for a /32).
                    let (prefix, mask) = range(&m["ranges"][0]);
                    request.client = Some(Ipv4Addr::from(if mask == u32::MAX { prefix } else { prefix + 1 }));
                }
            }
            _ => {}
        }
    }
}

// The descriptor Envoy builds from one rate limit's actions for `request` from 127.0.0.1, or
// none when an action produces no entry.
fn descriptor(request: &Request, limit: &Value) -> Option<Vec<(String, String)>> {
    let mut entries = Vec::new();
    for action in limit["actions"].as_array().unwrap() {
        let (kind, a) = action["ActionSpecifier"].as_object().unwrap().iter().next().unwrap();
        let key = |default: &str| a["descriptor_key"].as_str().unwrap_or(default).to_owned();
        let value = || a["descriptor_value"].as_str().unwrap().to_owned();
        let expect = a["expect_match"]["value"].as_bool().unwrap_or(true);
        let entry = match kind.as_str() {
            "GenericKey" => (key("generic_key"), value()),
            "HeaderValueMatch" => {
                let all = a["headers"].as_array().unwrap().iter().all(|h| {
                    string_matches(&h["HeaderMatchSpecifier"], request.header(h["name"].as_str().unwrap()))
                });
                if all != expect {
                    return None;
                }
                (key("header_match"), value())
            }
            "QueryParameterValueMatch" => {
                let all = a["query_parameters"].as_array().unwrap().iter().all(|q| {
                    let v = request.query.get(q["name"].as_str().unwrap()).map(String::as_str);
                    string_matches(&q["QueryParameterMatchSpecifier"], v)
                });
                if all != expect {
                    return None;
                }
                (key("query_match"), value())
            }
            "RequestHeaders" => (key(""), request.headers.get(a["header_name"].as_str().unwrap())?.clone()),
            "RemoteAddressMatch" => {
                let m = &a["address_matcher"];
                if inside(request.client(), m) == m["invert_match"].as_bool().unwrap_or(false) {
                    return None;
                }
                // The value is a format string; the data uses one command.
                let client = request.client().to_string();
                (key(""), value().replace("%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%", &client))
            }
            other => panic!("an action this model does not know: {other}"),
        };
        entries.push(entry);
    }
    Some(entries)
}

/// A bucket's limit as the config states it: tokens and seconds per unit.
#[derive(Clone, Copy, Debug)]
struct Limit {
    requests: f64,
    unit_seconds: f64,
}

// The limit at the node `entries` reach in `config`, as envoyproxy/ratelimit looks it up.
fn limit(config: &Value, entries: &[(String, String)]) -> Option<Limit> {
    let mut level = &config["descriptors"];
    let mut node = None;
    for (k, v) in entries {
        let children = level.as_array()?;
        let exact = children.iter().find(|d| d["key"] == k.as_str() && d["value"] == v.as_str());
        let any = || {
            children.iter().find(|d| d["key"] == k.as_str() && d["value"].as_str().is_none_or(str::is_empty))
        };
        let found = exact.or_else(any)?;
        level = &found["descriptors"];
        node = Some(found);
    }
    let node = node?;
    let rate = node.get("rate_limit").filter(|r| !r.is_null())?;
    if node["shadow_mode"].as_bool() == Some(true) || rate["unlimited"].as_bool() == Some(true) {
        return None;
    }
    let unit_seconds = match rate["unit"].as_str().unwrap().to_ascii_uppercase().as_str() {
        "SECOND" => 1.0,
        "MINUTE" => 60.0,
        "HOUR" => 3600.0,
        "DAY" => 86_400.0,
        "WEEK" => 604_800.0,
        "MONTH" => 2_592_000.0,
        "YEAR" => 31_536_000.0,
        other => panic!("unit {other}"),
    };
    Some(Limit { requests: rate["requests_per_unit"].as_f64().unwrap(), unit_seconds })
}

type BucketId = (String, Vec<(String, String)>);

/// What the model knows of one burst: per domain in filter order, its limited buckets.
struct Burst {
    request: Request,
    domains: Vec<Vec<(BucketId, Limit)>>,
}

fn burst(case: &Case, route: &Route, first: usize) -> Burst {
    let all: Vec<&Value> = route.by_domain.iter().flat_map(|(_, l)| l).collect();
    let mut request = Request::default();
    satisfy(&mut request, all[first]);
    for limit in &all {
        satisfy(&mut request, limit);
    }
    let domains = route
        .by_domain
        .iter()
        .map(|(domain, limits)| {
            limits
                .iter()
                .filter_map(|l| descriptor(&request, l))
                .filter_map(|entries| {
                    let found = limit(&case.configs[domain], &entries)?;
                    Some(((domain.clone(), entries), found))
                })
                .collect()
        })
        .collect();
    Burst { request, domains }
}

// Sends `burst` `n` times through `listener`; the number of 200s and the time it took.
fn send(listener: SocketAddr, burst: &Burst, n: u32) -> Result<(u32, Duration), String> {
    let start = Instant::now();
    let mut admitted = 0;
    let client = burst.request.client.map(|c| c.to_string());
    let mut headers: Vec<(&str, &str)> =
        burst.request.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    headers.extend(client.as_deref().map(|c| ("x-forwarded-for", c)));
    let method = burst.request.method.as_deref().unwrap_or("GET");
    for _ in 0..n {
        let r = http_method(listener, method, &burst.request.target(), &headers);
        match r.status {
            200 => admitted += 1,
            429 => {}
            other => return Err(format!("status {other}: {}", r.body)),
        }
    }
    Ok((admitted, start.elapsed()))
}

/// What one case's bursts found: (limited bursts, bursts with a 429, problems).
fn run_case(case: &Case) -> (u32, u32, Vec<String>) {
    // Tokens left in each bucket whose unit is longer than a second (per-second buckets are full
    // at each burst, which starts more than a second after the case's previous one).
    let mut left: HashMap<BucketId, f64> = HashMap::new();
    let (mut limited, mut denied, mut problems) = (0, 0, Vec::new());
    let mut first_burst = true;
    for (r, route) in case.routes.iter().enumerate() {
        let count = route.by_domain.iter().map(|(_, l)| l.len()).sum::<usize>();
        for first in 0..count {
            let burst = burst(case, route, first);
            if !first_burst {
                std::thread::sleep(Duration::from_millis(1100));
            }
            first_burst = false;
            let tokens = |(id, l): &(BucketId, Limit)| {
                if l.unit_seconds <= 1.0 {
                    l.requests
                } else {
                    left.get(id).copied().unwrap_or(l.requests)
                }
            };
            let floor: Option<f64> = burst.domains.iter().flatten().map(&tokens).reduce(f64::min);
            let n = floor.map_or(5.0, |f| f.min(400.0) + 3.0) as u32;
            let (admitted, took) = match send(route.listener, &burst, n) {
                Ok(x) => x,
                Err(e) => {
                    problems.push(format!("{} route {r} burst {first}: {e}", case.name));
                    continue;
                }
            };
            // Per-second buckets may refill during the burst; longer ones gain nothing here.
            let refill = |l: &Limit| {
                if l.unit_seconds <= 1.0 {
                    (l.requests / l.unit_seconds * (took.as_secs_f64() + 0.05)).ceil()
                } else {
                    0.0
                }
            };
            let low = floor.map_or(n, |f| (f.floor() as u32).min(n));
            let high = burst
                .domains
                .iter()
                .flatten()
                .map(|b| tokens(b) + refill(&b.1))
                .reduce(f64::min)
                .map_or(n, |h| (h.floor() as u32).min(n));
            if floor.is_some() {
                limited += 1;
            }
            if admitted < n {
                denied += 1;
            }
            if !(low..=high).contains(&admitted) {
                problems.push(format!(
                    "{} route {r} burst {first} ({:?}): {admitted} of {n} admitted, the config allows {low}..={high}",
                    case.name, burst.request
                ));
            }
            // Every domain's call debits its buckets for each request that reached it; only
            // the last domain's calls are all the admitted ones, so a longer-than-a-second
            // bucket outside it is not tracked (none is, in this data).
            for (d, buckets) in burst.domains.iter().enumerate() {
                for (id, l) in buckets {
                    if l.unit_seconds > 1.0 {
                        assert_eq!(d + 1, burst.domains.len(), "{}: the model tracks this bucket", case.name);
                        *left.entry(id.clone()).or_insert(l.requests) -= f64::from(admitted);
                    }
                }
            }
        }
    }
    (limited, denied, problems)
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_gateways_translator_outputs_are_the_limits_enforced() {
    let cases = cases();
    assert!(cases.len() >= 25, "Envoy Gateway's test data is all here");
    let configs: Vec<_> = cases
        .iter()
        .flat_map(|c| c.configs.iter())
        .map(|(domain, doc)| {
            let mut config = rate_limit_config(domain, &serde_json::to_string(doc).unwrap());
            config.domain = domain.clone();
            config
        })
        .collect();
    let redis = Redis::start();
    let redis_at = redis.addr();
    let server = XdsServer::start(None);
    let xds_at = server.addr.to_string();
    server.push("eg-1", &configs);
    let tollgate = Tollgate::start_as_ratelimit(&[
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", xds_at.as_str()),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", redis_at.as_str()),
    ])
    .wait_ready();
    server.wait_for_ack("eg-1");

    let upstream = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().fallback(|| async { "upstream ok" });
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    };
    let admin = loopback();
    let config = envoy_config(&cases, admin, tollgate.grpc, upstream);
    let (valid, why) = envoy_validate(&config);
    assert!(valid, "Envoy takes the routes as Envoy Gateway writes them: {why}");
    let _envoy = Envoy::start(&config, admin);

    // Cases run side by side (their buckets are apart); each case's bursts one after another.
    let cases = std::sync::Arc::new(cases);
    let tasks: Vec<_> = (0..cases.len())
        .map(|i| {
            let cases = cases.clone();
            tokio::task::spawn_blocking(move || run_case(&cases[i]))
        })
        .collect();
    let (mut limited, mut denied, mut problems) = (0, 0, Vec::new());
    for task in tasks {
        let (l, d, p) = task.await.unwrap();
        limited += l;
        denied += d;
        problems.extend(p);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // 41 of the 48 bursts meet a limit; the others ask for what no request can be (a header
    // with two values at once, a `:path` without its leading slash) or are shadow mode.
    assert!(limited >= 41, "every limit a request can reach is reached: {limited}");
    assert!(denied >= limited * 9 / 10, "a burst past a limit meets a 429: {denied} of {limited}");
}
