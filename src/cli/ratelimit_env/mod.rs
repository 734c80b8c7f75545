//! envoyproxy/ratelimit's settings, read under their names
//! (`envoyproxy/ratelimit/src/settings/settings.go`), so that a Deployment written for it, Envoy
//! Gateway's among them, runs tollgate unchanged.
//!
//! They are translated, before the command line is parsed, into the `TOLLGATE_*` (and `RUST_LOG`,
//! `OTEL_*`) variables of the same meaning, each only where that variable is not set itself: so
//! tollgate's flags win over both, and its own variables over envoyproxy/ratelimit's. As
//! `tollgate serve` only the variables that are set are read; run as `ratelimit` (the name the
//! image answers to), envoyproxy/ratelimit's defaults apply too where they differ from tollgate's
//! (statsd on, config files under `/srv/runtime_data/current`, Redis on nutcracker's socket).
//! A setting that would change what is enforced and that tollgate cannot honour stops the start
//! with why; one tollgate accepts and ignores is named once at startup with why.

mod redis;
mod telemetry;
#[cfg(test)]
mod tests;
mod xds;

use std::collections::BTreeMap;

/// What the environment says, translated.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Translation {
    /// Variables to set, where not set already.
    pub set: BTreeMap<&'static str, String>,
    /// Settings accepted and ignored, each with why: logged once at startup.
    pub ignored: Vec<String>,
}

impl Translation {
    /// Each `(from, to)`: `to` takes `from`'s value where `from` is set and not empty.
    fn copy(&mut self, get: &dyn Fn(&str) -> Option<String>, pairs: &[(&str, &'static str)]) {
        for (from, to) in pairs {
            if let Some(v) = get(from).filter(|v| !v.is_empty()) {
                self.set.insert(to, v);
            }
        }
    }

    /// Each of `names` that is set and not empty is ignored, for `why`.
    fn ignore(&mut self, get: &dyn Fn(&str) -> Option<String>, names: &[&str], why: &str) {
        for name in names {
            if get(name).is_some_and(|v| !v.is_empty()) {
                self.ignored.push(format!("{name}: {why}"));
            }
        }
    }
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
    t.ignore(
        get,
        &["DEBUG_HOST", "DEBUG_PORT"],
        "no debug port: /config, /metrics and the probes are on PORT",
    );
    t.copy(
        get,
        &[
            ("GRPC_MAX_CONNECTION_AGE", "TOLLGATE_GRPC_MAX_CONNECTION_AGE"),
            ("GRPC_MAX_CONNECTION_AGE_GRACE", "TOLLGATE_GRPC_MAX_CONNECTION_AGE_GRACE"),
        ],
    );
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
        t.copy(get, &[("GRPC_CLIENT_TLS_SAN", "TOLLGATE_TLS_CLIENT_SAN")]);
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
        Some("GRPC_XDS_SOTW") => xds::translate(get, &var, &flag, &mut t)?,
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

    redis::translate(get, &var, &flag, &mut t)?;

    // What is enforced and answered.
    for (from, to) in [
        ("SHADOW_MODE", "TOLLGATE_SHADOW_MODE"),
        ("RESPONSE_DYNAMIC_METADATA", "TOLLGATE_RESPONSE_DYNAMIC_METADATA"),
        ("QUOTA_MODE", "TOLLGATE_QUOTA_MODE"),
        ("MERGE_DOMAIN_CONFIG", "TOLLGATE_MERGE_DOMAIN_CONFIG"),
    ] {
        if let Some(on) = flag(from, false)?.filter(|_| get(from).is_some()) {
            t.set.insert(to, on.to_string());
        }
    }
    if flag("LIMIT_RESPONSE_HEADERS_ENABLED", false)? == Some(true) {
        let names = [
            ("LIMIT_LIMIT_HEADER", "RateLimit-Limit"),
            ("LIMIT_REMAINING_HEADER", "RateLimit-Remaining"),
            ("LIMIT_RESET_HEADER", "RateLimit-Reset"),
        ]
        .map(|(name, default)| get(name).unwrap_or_else(|| default.to_owned()));
        t.set.insert("TOLLGATE_LIMIT_HEADERS", names.join(","));
    }
    t.copy(
        get,
        &[
            ("NEAR_LIMIT_RATIO", "TOLLGATE_NEAR_LIMIT_RATIO"),
            ("CACHE_KEY_PREFIX", "TOLLGATE_REDIS_KEY_PREFIX"),
        ],
    );

    telemetry::stats(get, &var, &flag, &mut t)?;
    telemetry::tracing(get, &flag, &mut t)?;

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
        t.ignore(get, &[name], why);
    }
    t.ignore(
        get,
        &["MEMCACHE_HOST_PORT", "MEMCACHE_SRV"],
        "memcache is not a tollgate store; Redis holds the buckets",
    );
    Ok(t)
}

/// envoyproxy/ratelimit's value of a setting, with its default as `ratelimit`.
pub(super) type Var<'a> = dyn Fn(&str, &str) -> Option<String> + 'a;
/// A boolean setting, in Go's syntax.
pub(super) type Flag<'a> = dyn Fn(&str, bool) -> Result<Option<bool>, String> + 'a;

// Go's `strconv.ParseBool`, which envconfig uses.
pub(super) fn go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

// `host:port` for a listener: Go's empty host (`:19001`) is every address.
pub(super) fn address(host: &str, port: &str) -> String {
    let host = if host.is_empty() { "0.0.0.0" } else { host };
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}
