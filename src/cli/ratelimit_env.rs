//! envoyproxy/ratelimit's settings, read under their names (its `src/settings/settings.go`), so
//! that a Deployment written for it, Envoy Gateway's among them, runs tollgate unchanged.
//!
//! They are translated, before the command line is parsed, into the `TOLLGATE_*` (and `RUST_LOG`,
//! `OTEL_*`) variables of the same meaning, each only where that variable is not set itself: so
//! tollgate's flags win over both, and its own variables over envoyproxy/ratelimit's. As
//! `tollgate serve` only the variables that are set are read; run as `ratelimit` (the name the
//! image answers to), envoyproxy/ratelimit's defaults apply too where they differ from tollgate's
//! (statsd on, config files under `/srv/runtime_data/current`, Redis on nutcracker's socket).
//! A setting that would change what is enforced and that tollgate cannot honour stops the start
//! with why; one tollgate accepts and ignores is named once at startup with why.

use std::collections::BTreeMap;

/// What the environment says, translated.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Translation {
    /// Variables to set, where not set already.
    pub set: BTreeMap<&'static str, String>,
    /// Settings accepted and ignored, each with why: logged once at startup.
    pub ignored: Vec<String>,
}

/// Translates envoyproxy/ratelimit's settings as `get` reads them; `as_ratelimit` applies its
/// defaults too. An error names the setting and why tollgate cannot run with it.
pub(super) fn translate(
    get: &dyn Fn(&str) -> Option<String>,
    as_ratelimit: bool,
) -> Result<Translation, String> {
    let mut t = Translation::default();
    // envoyproxy/ratelimit's value of a setting: the variable, else (as `ratelimit`) its default.
    let var = |name: &str, default: &str| -> Option<String> {
        get(name)
            .filter(|v| !v.is_empty())
            .or_else(|| as_ratelimit.then(|| default.to_owned()).filter(|d| !d.is_empty()))
    };
    let flag = |name: &str, default: bool| -> Result<Option<bool>, String> {
        match get(name).filter(|v| !v.is_empty()) {
            Some(v) => go_bool(&v).map(Some).ok_or_else(|| format!("{name}={v}: not a boolean")),
            None => Ok(as_ratelimit.then_some(default)),
        }
    };
    let ignore = |t: &mut Translation, name: &str, why: &str| {
        if get(name).is_some_and(|v| !v.is_empty()) {
            t.ignored.push(format!("{name}: {why}"));
        }
    };

    // Listeners.
    if get("HOST").is_some() || get("PORT").is_some() {
        t.set.insert(
            "TOLLGATE_HTTP_ADDR",
            address(
                &var("HOST", "0.0.0.0").unwrap_or("0.0.0.0".into()),
                &var("PORT", "8080").unwrap_or("8080".into()),
            ),
        );
    }
    if get("GRPC_HOST").is_some() || get("GRPC_PORT").is_some() {
        t.set.insert(
            "TOLLGATE_GRPC_ADDR",
            address(
                &var("GRPC_HOST", "0.0.0.0").unwrap_or("0.0.0.0".into()),
                &var("GRPC_PORT", "8081").unwrap_or("8081".into()),
            ),
        );
    }
    if let Some(uds) = get("GRPC_UDS").filter(|v| !v.is_empty()) {
        return Err(format!("GRPC_UDS={uds}: tollgate serves gRPC on TCP only (GRPC_HOST, GRPC_PORT)"));
    }
    for name in ["DEBUG_HOST", "DEBUG_PORT"] {
        ignore(&mut t, name, "no debug port: /config, /metrics and the probes are on PORT");
    }
    for (from, to) in [
        ("GRPC_MAX_CONNECTION_AGE", "TOLLGATE_GRPC_MAX_CONNECTION_AGE"),
        ("GRPC_MAX_CONNECTION_AGE_GRACE", "TOLLGATE_GRPC_MAX_CONNECTION_AGE_GRACE"),
    ] {
        if let Some(v) = get(from).filter(|v| !v.is_empty()) {
            t.set.insert(to, v);
        }
    }
    if flag("GRPC_SERVER_USE_TLS", false)? == Some(true) {
        for (from, to) in
            [("GRPC_SERVER_TLS_CERT", "TOLLGATE_TLS_CERT"), ("GRPC_SERVER_TLS_KEY", "TOLLGATE_TLS_KEY")]
        {
            let v = get(from)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("GRPC_SERVER_USE_TLS=true needs {from}"))?;
            t.set.insert(to, v);
        }
        // settings.go reads GRPC_CLIENT_TLS_CACERT; Envoy Gateway sets GRPC_SERVER_TLS_CA_CERT.
        if let Some(ca) =
            get("GRPC_CLIENT_TLS_CACERT").or_else(|| get("GRPC_SERVER_TLS_CA_CERT")).filter(|v| !v.is_empty())
        {
            t.set.insert("TOLLGATE_TLS_CLIENT_CA", ca);
        }
    }
    if let Some(san) = get("GRPC_CLIENT_TLS_SAN").filter(|v| !v.is_empty()) {
        return Err(format!("GRPC_CLIENT_TLS_SAN={san}: tollgate does not pin client certificates to a name; any certificate the CA signed is accepted, so it will not start with a pin it would not check"));
    }

    // Logs.
    if let Some(level) = var("LOG_LEVEL", "WARN") {
        let filter = match level.to_ascii_lowercase().as_str() {
            "trace" => "trace",
            "debug" => "debug",
            "info" => "info",
            "warn" | "warning" => "warn",
            "error" | "fatal" | "panic" => "error",
            _ => return Err(format!("LOG_LEVEL={level}: not a level (trace, debug, info, warn, error)")),
        };
        t.set.insert("RUST_LOG", filter.to_owned());
    }
    if let Some(format) = get("LOG_FORMAT").filter(|v| !v.is_empty()) {
        if format != "text" && format != "json" {
            return Err(format!("LOG_FORMAT={format}: text or json"));
        }
        t.set.insert("TOLLGATE_LOG_FORMAT", format);
    }

    // Where the rules come from.
    let config_type = var("CONFIG_TYPE", "FILE").map(|c| c.to_ascii_uppercase());
    match config_type.as_deref() {
        Some("GRPC_XDS_SOTW") => xds(get, &var, &flag, &mut t)?,
        Some("FILE") | None => {
            let runtime = ["RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY", "RUNTIME_APPDIRECTORY"];
            if as_ratelimit || runtime.iter().any(|n| get(n).is_some()) {
                let mut path = std::path::PathBuf::from(
                    var("RUNTIME_ROOT", "/srv/runtime_data/current").unwrap_or_default(),
                );
                for part in [
                    var("RUNTIME_SUBDIRECTORY", ""),
                    var("RUNTIME_APPDIRECTORY", "config").or_else(|| Some("config".into())),
                ]
                .into_iter()
                .flatten()
                {
                    path.push(part);
                }
                t.set.insert("TOLLGATE_CONFIG", path.display().to_string());
            }
            if flag("RUNTIME_IGNOREDOTFILES", false)? == Some(false)
                && get("RUNTIME_IGNOREDOTFILES").is_some()
            {
                t.ignored.push("RUNTIME_IGNOREDOTFILES=false: tollgate always skips hidden files (a ConfigMap's ..data is one)".into());
            }
        }
        Some(other) => return Err(format!("CONFIG_TYPE={other}: FILE or GRPC_XDS_SOTW")),
    }
    let force = flag("FORCE_START_WITHOUT_INITIAL_CONFIG", false)?.unwrap_or(false);
    let healthy_needs_one = flag("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", false)?.unwrap_or(false);
    if force && !healthy_needs_one {
        t.set.insert("TOLLGATE_START_WITHOUT_CONFIG", "true".into());
    }

    redis(get, &var, &flag, &mut t)?;

    // What is enforced and answered.
    for (from, to) in [
        ("SHADOW_MODE", "TOLLGATE_SHADOW_MODE"),
        ("RESPONSE_DYNAMIC_METADATA", "TOLLGATE_RESPONSE_DYNAMIC_METADATA"),
    ] {
        if let Some(on) = flag(from, false)?.filter(|_| get(from).is_some()) {
            t.set.insert(to, on.to_string());
        }
    }
    for (name, why) in [
        ("QUOTA_MODE", "a service-wide quota mode is not supported: mark the rules with quota_mode: true"),
        (
            "MERGE_DOMAIN_CONFIG",
            "merging files of one domain is not supported: put each domain in one file or resource",
        ),
    ] {
        if flag(name, false)? == Some(true) && get(name).is_some() {
            return Err(format!("{name}=true: {why}"));
        }
    }
    if let Some(prefix) = get("CACHE_KEY_PREFIX").filter(|v| !v.is_empty()) {
        return Err(format!("CACHE_KEY_PREFIX={prefix}: tollgate's keys have no prefix setting; give each deployment its own Redis database (REDIS_URL=redis://host:port/N)"));
    }
    if flag("LIMIT_RESPONSE_HEADERS_ENABLED", false)? == Some(true)
        && get("LIMIT_RESPONSE_HEADERS_ENABLED").is_some()
    {
        t.ignored.push("LIMIT_RESPONSE_HEADERS_ENABLED: headers are chosen per domain in tollgate (response_headers: [x-ratelimit, retry-after, ietf])".into());
    }
    if let Some(ratio) = get("NEAR_LIMIT_RATIO").filter(|v| !v.is_empty()) {
        t.set.insert("TOLLGATE_NEAR_LIMIT_RATIO", ratio);
    }

    stats(get, &var, &flag, &mut t)?;
    tracing(get, &flag, &mut t)?;

    for (name, why) in [
        (
            "EXPIRATION_JITTER_MAX_SECONDS",
            "token buckets expire when full, not at window ends, so there is no stampede to spread",
        ),
        (
            "LOCAL_CACHE_SIZE_IN_BYTES",
            "tollgate's exact pre-check answers certain denials locally (--precheck-buckets)",
        ),
        ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "tollgate never takes tokens for a denied request"),
        ("USE_DOG_STATSD", "DogStatsD tags are not sent; statsd names are"),
        ("USE_DOG_STATSD_MOGRIFIERS", "DogStatsD tags are not sent; statsd names are"),
        ("EXTRA_TAGS", "statsd tags are not sent"),
        ("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "the mapping file's scale decides the unit"),
    ] {
        ignore(&mut t, name, why);
    }
    for name in ["MEMCACHE_HOST_PORT", "MEMCACHE_SRV"] {
        ignore(&mut t, name, "memcache is not a tollgate store; Redis holds the buckets");
    }
    Ok(t)
}

type Var<'a> = dyn Fn(&str, &str) -> Option<String> + 'a;
type Flag<'a> = dyn Fn(&str, bool) -> Result<Option<bool>, String> + 'a;

fn xds(
    get: &dyn Fn(&str) -> Option<String>,
    var: &Var<'_>,
    flag: &Flag<'_>,
    t: &mut Translation,
) -> Result<(), String> {
    t.set.insert(
        "TOLLGATE_XDS_SERVER",
        var("CONFIG_GRPC_XDS_SERVER_URL", "localhost:18000").unwrap_or_else(|| "localhost:18000".into()),
    );
    t.set.insert(
        "TOLLGATE_XDS_NODE_ID",
        var("CONFIG_GRPC_XDS_NODE_ID", "default").unwrap_or_else(|| "default".into()),
    );
    if let Some(metadata) = get("CONFIG_GRPC_XDS_NODE_METADATA").filter(|v| !v.is_empty()) {
        t.set.insert("TOLLGATE_XDS_NODE_METADATA", metadata);
    }
    if let Some(headers) = get("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS").filter(|v| !v.is_empty()) {
        // envconfig's map form, `key:value,key:value`.
        let pairs: Result<Vec<String>, String> = headers
            .split(',')
            .map(|pair| {
                pair.split_once(':').map(|(k, v)| format!("{}={}", k.trim(), v.trim())).ok_or_else(|| {
                    format!("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS: {pair:?} is not key:value")
                })
            })
            .collect();
        t.set.insert("TOLLGATE_XDS_HEADERS", pairs?.join(","));
    }
    if flag("CONFIG_GRPC_XDS_SERVER_USE_TLS", false)? == Some(true) {
        t.set.insert("TOLLGATE_XDS_TLS", "true".into());
        for (from, to) in [
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "TOLLGATE_XDS_TLS_CERT"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "TOLLGATE_XDS_TLS_KEY"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "TOLLGATE_XDS_TLS_CA"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "TOLLGATE_XDS_TLS_SERVER_NAME"),
        ] {
            if let Some(v) = get(from).filter(|v| !v.is_empty()) {
                t.set.insert(to, v);
            }
        }
    }
    for (from, to) in [
        ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "TOLLGATE_XDS_BACKOFF_INITIAL"),
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "TOLLGATE_XDS_BACKOFF_MAX"),
        ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "TOLLGATE_XDS_BACKOFF_RANDOM_FACTOR"),
        ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "TOLLGATE_XDS_MAX_MESSAGE_BYTES"),
    ] {
        if let Some(v) = get(from).filter(|v| !v.is_empty()) {
            t.set.insert(to, v);
        }
    }
    if flag("XDS_CLIENT_BACKOFF_JITTER", true)? == Some(false) {
        t.set.insert("TOLLGATE_XDS_BACKOFF_NO_JITTER", "true".into());
    }
    if get("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL").is_some() {
        t.ignored.push("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL: one backoff (XDS_CLIENT_BACKOFF_*) paces every reconnection".into());
    }
    Ok(())
}

fn redis(
    get: &dyn Fn(&str) -> Option<String>,
    var: &Var<'_>,
    flag: &Flag<'_>,
    t: &mut Translation,
) -> Result<(), String> {
    match var("BACKEND_TYPE", "redis").map(|b| b.to_ascii_lowercase()).as_deref() {
        None | Some("redis") => {}
        Some(other) => {
            return Err(format!(
                "BACKEND_TYPE={other}: tollgate keeps its buckets in Redis (BACKEND_TYPE=redis)"
            ))
        }
    }
    let Some(url) = var("REDIS_URL", "/var/run/nutcracker/ratelimit.sock") else { return Ok(()) };
    let tls = flag("REDIS_TLS", false)?.unwrap_or(false);
    let unix = var("REDIS_SOCKET_TYPE", "unix").is_some_and(|s| s.eq_ignore_ascii_case("unix"));
    let auth = get("REDIS_AUTH").filter(|v| !v.is_empty());
    // `user:password` or `password`, as a URL's userinfo.
    let userinfo = auth.as_deref().map(|a| match a.split_once(':') {
        Some((user, password)) => format!("{user}:{password}@"),
        None => format!(":{a}@"),
    });
    let scheme = if tls { "rediss" } else { "redis" };
    let with_scheme = |node: &str| {
        if node.contains("://") {
            node.to_owned()
        } else {
            format!("{scheme}://{}{node}", userinfo.as_deref().unwrap_or(""))
        }
    };
    match var("REDIS_TYPE", "SINGLE").unwrap_or_default().to_ascii_uppercase().as_str() {
        "SINGLE" | "" if unix => {
            let password = auth
                .as_deref()
                .map(|a| format!("?pass={}", a.rsplit(':').next().unwrap_or(a)))
                .unwrap_or_default();
            t.set.insert("TOLLGATE_REDIS_URL", format!("redis+unix://{url}{password}"));
        }
        "SINGLE" | "" => {
            t.set.insert("TOLLGATE_REDIS_URL", with_scheme(&url));
        }
        "CLUSTER" => {
            let seeds: Vec<String> = url.split(',').map(|s| with_scheme(s.trim())).collect();
            t.set.insert("TOLLGATE_REDIS_CLUSTER", seeds.join(","));
        }
        "SENTINEL" => {
            let mut parts = url.split(',').map(str::trim);
            let master = parts
                .next()
                .filter(|m| !m.is_empty())
                .ok_or("REDIS_URL: with REDIS_TYPE=SENTINEL, master-name,host:port,...")?;
            let sentinels: Vec<&str> = parts.collect();
            if sentinels.is_empty() {
                return Err(
                    "REDIS_URL: with REDIS_TYPE=SENTINEL, master-name,host:port,... (no sentinel given)"
                        .into(),
                );
            }
            t.set.insert("TOLLGATE_REDIS_SENTINEL_MASTER", master.to_owned());
            t.set.insert("TOLLGATE_REDIS_SENTINEL", sentinels.join(","));
            if let Some(auth) = auth {
                t.set.insert("TOLLGATE_REDIS_SENTINEL_AUTH", auth);
            }
            if let Some(auth) = get("REDIS_SENTINEL_AUTH").filter(|v| !v.is_empty()) {
                t.set.insert("TOLLGATE_REDIS_SENTINEL_PASSWORD", auth);
            }
        }
        other => return Err(format!("REDIS_TYPE={other}: SINGLE, CLUSTER or SENTINEL")),
    }
    for (from, to) in [
        ("REDIS_TLS_CACERT", "TOLLGATE_REDIS_CA"),
        ("REDIS_TLS_CLIENT_CERT", "TOLLGATE_REDIS_CLIENT_CERT"),
        ("REDIS_TLS_CLIENT_KEY", "TOLLGATE_REDIS_CLIENT_KEY"),
        ("REDIS_TIMEOUT", "TOLLGATE_REDIS_TIMEOUT"),
    ] {
        if let Some(v) = get(from).filter(|v| !v.is_empty()) {
            t.set.insert(to, v);
        }
    }
    if flag("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", false)? == Some(true)
        && get("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION").is_some()
    {
        return Err("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION=true: tollgate always verifies the Redis server's name; give its CA (REDIS_TLS_CACERT) instead".into());
    }
    let pooled =
        "tollgate multiplexes each node's connection and coalesces calls per slot (--coalesce-delay)";
    for name in [
        "REDIS_POOL_SIZE",
        "REDIS_PIPELINE_WINDOW",
        "REDIS_PIPELINE_LIMIT",
        "REDIS_CLUSTER_PIPELINE_PARALLELISM",
        "REDIS_POOL_ON_EMPTY_BEHAVIOR",
    ] {
        if get(name).is_some_and(|v| !v.is_empty()) {
            t.ignored.push(format!("{name}: {pooled}"));
        }
    }
    for name in ["REDIS_PERSECOND", "REDIS_PERSECOND_URL", "REDIS_PERSECOND_TYPE"] {
        if get(name).is_some_and(|v| !v.is_empty() && v != "false") {
            t.ignored.push(format!("{name}: one Redis holds every bucket, per-second ones too"));
        }
    }
    for name in [
        "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
        "REDIS_STARTUP_INITIAL_INTERVAL",
        "REDIS_STARTUP_MAX_INTERVAL",
        "REDIS_STARTUP_MAX_ELAPSED_TIME",
    ] {
        if get(name).is_some_and(|v| !v.is_empty()) {
            t.ignored.push(format!(
                "{name}: readiness follows Redis at every probe, and connections are retried without end"
            ));
        }
    }
    Ok(())
}

fn stats(
    get: &dyn Fn(&str) -> Option<String>,
    var: &Var<'_>,
    flag: &Flag<'_>,
    t: &mut Translation,
) -> Result<(), String> {
    if flag("DISABLE_STATS", false)? == Some(true) && get("DISABLE_STATS").is_some() {
        return Ok(());
    }
    if flag("USE_STATSD", true)? == Some(true) {
        let host = var("STATSD_HOST", "localhost").unwrap_or_else(|| "localhost".into());
        let port = var("STATSD_PORT", "8125").unwrap_or_else(|| "8125".into());
        t.set.insert("TOLLGATE_STATSD", format!("{host}:{port}"));
    }
    if flag("USE_PROMETHEUS", false)? == Some(true) {
        let addr = var("PROMETHEUS_ADDR", ":9090").unwrap_or_else(|| ":9090".into());
        let (host, port) =
            addr.rsplit_once(':').ok_or_else(|| format!("PROMETHEUS_ADDR={addr}: host:port"))?;
        t.set.insert("TOLLGATE_PROMETHEUS_ADDR", address(host, port));
        for (from, to) in [
            ("PROMETHEUS_PATH", "TOLLGATE_PROMETHEUS_PATH"),
            ("PROMETHEUS_MAPPER_YAML", "TOLLGATE_PROMETHEUS_MAPPER"),
        ] {
            if let Some(v) = get(from).filter(|v| !v.is_empty()) {
                t.set.insert(to, v);
            }
        }
    }
    if let Some(every) = get("STATS_FLUSH_INTERVAL").filter(|v| !v.is_empty()) {
        t.set.insert("TOLLGATE_STATS_FLUSH_INTERVAL", every);
    }
    Ok(())
}

fn tracing(get: &dyn Fn(&str) -> Option<String>, flag: &Flag<'_>, t: &mut Translation) -> Result<(), String> {
    if flag("TRACING_ENABLED", false)? != Some(true) || get("TRACING_ENABLED").is_none() {
        return Ok(());
    }
    if get("TRACING_EXPORTER_PROTOCOL").is_some_and(|p| !p.eq_ignore_ascii_case("grpc")) {
        t.ignored.push("TRACING_EXPORTER_PROTOCOL: tollgate exports OTLP over gRPC".into());
    }
    if get("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() {
        t.set.insert("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317".into());
    }
    if let Some(name) = get("TRACING_SERVICE_NAME").filter(|v| !v.is_empty()) {
        t.set.insert("OTEL_SERVICE_NAME", name);
    }
    let attributes: Vec<String> = [
        ("TRACING_SERVICE_NAMESPACE", "service.namespace"),
        ("TRACING_SERVICE_INSTANCE_ID", "service.instance.id"),
    ]
    .iter()
    .filter_map(|(from, key)| get(from).filter(|v| !v.is_empty()).map(|v| format!("{key}={v}")))
    .collect();
    if !attributes.is_empty() {
        t.set.insert("OTEL_RESOURCE_ATTRIBUTES", attributes.join(","));
    }
    if let Some(rate) = get("TRACING_SAMPLING_RATE").filter(|v| !v.is_empty()) {
        t.set.insert("OTEL_TRACES_SAMPLER", "parentbased_traceidratio".into());
        t.set.insert("OTEL_TRACES_SAMPLER_ARG", rate);
    }
    Ok(())
}

// Go's `strconv.ParseBool`, which envconfig uses.
fn go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

// `host:port` for a listener: Go's empty host (`:19001`) is every address.
fn address(host: &str, port: &str) -> String {
    let host = if host.is_empty() { "0.0.0.0" } else { host };
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(env: &[(&str, &str)], as_ratelimit: bool) -> Result<Translation, String> {
        let env: BTreeMap<String, String> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        translate(&|name| env.get(name).cloned(), as_ratelimit)
    }

    #[test]
    fn envoy_gateways_deployment_translates_whole() {
        let t = run(
            &[
                ("RUNTIME_ROOT", "/data"),
                ("RUNTIME_SUBDIRECTORY", "ratelimit"),
                ("RUNTIME_IGNOREDOTFILES", "true"),
                ("RUNTIME_WATCH_ROOT", "false"),
                ("LOG_LEVEL", "info"),
                ("USE_STATSD", "false"),
                ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
                ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
                ("GRPC_SERVER_USE_TLS", "true"),
                ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
                ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
                ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
                ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
                ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
                ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
                ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
                ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "redis.redis.svc:6379"),
                ("USE_PROMETHEUS", "true"),
                ("PROMETHEUS_ADDR", ":19001"),
                ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
            ],
            true,
        )
        .unwrap();
        let expect: BTreeMap<&str, String> = [
            ("RUST_LOG", "info"),
            ("TOLLGATE_XDS_SERVER", "envoy-gateway:18001"),
            ("TOLLGATE_XDS_NODE_ID", "envoy-ratelimit"),
            ("TOLLGATE_TLS_CERT", "/certs/tls.crt"),
            ("TOLLGATE_TLS_KEY", "/certs/tls.key"),
            ("TOLLGATE_TLS_CLIENT_CA", "/certs/ca.crt"),
            ("TOLLGATE_XDS_TLS", "true"),
            ("TOLLGATE_XDS_TLS_CERT", "/certs/tls.crt"),
            ("TOLLGATE_XDS_TLS_KEY", "/certs/tls.key"),
            ("TOLLGATE_XDS_TLS_CA", "/certs/ca.crt"),
            ("TOLLGATE_START_WITHOUT_CONFIG", "true"),
            ("TOLLGATE_REDIS_URL", "redis://redis.redis.svc:6379"),
            ("TOLLGATE_PROMETHEUS_ADDR", "0.0.0.0:19001"),
            ("TOLLGATE_PROMETHEUS_MAPPER", "/etc/statsd-exporter/conf.yaml"),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_owned()))
        .collect();
        assert_eq!(t.set, expect, "with xDS the runtime directory is not the config; statsd is off");
        assert!(t.ignored.is_empty(), "{:?}", t.ignored);
    }

    #[test]
    fn files_redis_forms_and_defaults() {
        let t = run(&[("RUNTIME_ROOT", "/data"), ("RUNTIME_SUBDIRECTORY", "ratelimit")], false).unwrap();
        assert_eq!(t.set["TOLLGATE_CONFIG"], "/data/ratelimit/config");
        assert!(!t.set.contains_key("TOLLGATE_STATSD"), "tollgate serve sends no statsd unless asked");
        let t = run(&[], true).unwrap();
        assert_eq!(t.set["TOLLGATE_CONFIG"], "/srv/runtime_data/current/config");
        assert_eq!(t.set["TOLLGATE_STATSD"], "localhost:8125");
        assert_eq!(t.set["TOLLGATE_REDIS_URL"], "redis+unix:///var/run/nutcracker/ratelimit.sock");
        assert_eq!(t.set["RUST_LOG"], "warn");

        let t = run(
            &[
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_TYPE", "cluster"),
                ("REDIS_URL", "a:1, b:2"),
                ("REDIS_AUTH", "u:p"),
                ("REDIS_TLS", "true"),
            ],
            false,
        )
        .unwrap();
        assert_eq!(t.set["TOLLGATE_REDIS_CLUSTER"], "rediss://u:p@a:1,rediss://u:p@b:2");
        let t = run(
            &[
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_TYPE", "SENTINEL"),
                ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
                ("REDIS_AUTH", "pw"),
            ],
            false,
        )
        .unwrap();
        assert_eq!(t.set["TOLLGATE_REDIS_SENTINEL_MASTER"], "mymaster");
        assert_eq!(t.set["TOLLGATE_REDIS_SENTINEL"], "s1:26379,s2:26379");
        assert_eq!(t.set["TOLLGATE_REDIS_SENTINEL_AUTH"], "pw");
        let t = run(
            &[
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "h:6379"),
                ("REDIS_AUTH", "pw"),
                ("REDIS_POOL_SIZE", "20"),
            ],
            false,
        )
        .unwrap();
        assert_eq!(t.set["TOLLGATE_REDIS_URL"], "redis://:pw@h:6379");
        assert_eq!(t.ignored.len(), 1, "{:?}", t.ignored);
    }

    #[test]
    fn what_tollgate_cannot_honour_stops_the_start_with_why() {
        for env in [
            [("BACKEND_TYPE", "memcache")],
            [("GRPC_UDS", "/tmp/s")],
            [("QUOTA_MODE", "true")],
            [("CACHE_KEY_PREFIX", "x_")],
            [("SHADOW_MODE", "maybe")],
        ] {
            let error = run(&env, false).unwrap_err();
            assert!(error.starts_with(env[0].0), "{error}");
        }
    }

    #[test]
    fn xds_headers_metadata_and_backoff() {
        let t = run(
            &[
                ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "authorization:Bearer x,x-team:a"),
                ("CONFIG_GRPC_XDS_NODE_METADATA", "zone=a,rack=b"),
                ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "100ms"),
                ("XDS_CLIENT_BACKOFF_JITTER", "false"),
                ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
                ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "true"),
            ],
            false,
        )
        .unwrap();
        assert_eq!(t.set["TOLLGATE_XDS_SERVER"], "localhost:18000");
        assert_eq!(t.set["TOLLGATE_XDS_HEADERS"], "authorization=Bearer x,x-team=a");
        assert_eq!(t.set["TOLLGATE_XDS_NODE_METADATA"], "zone=a,rack=b");
        assert_eq!(t.set["TOLLGATE_XDS_BACKOFF_INITIAL"], "100ms");
        assert_eq!(t.set["TOLLGATE_XDS_BACKOFF_NO_JITTER"], "true");
        assert!(!t.set.contains_key("TOLLGATE_START_WITHOUT_CONFIG"), "healthy only with a config wins");
    }
}
