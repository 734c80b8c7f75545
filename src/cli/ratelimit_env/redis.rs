//! `REDIS_*`: the socket type, the deployment (single, Cluster, Sentinel), its URL forms,
//! credentials and TLS; the pool and pipeline settings a multiplexed client has no use for.

use super::{Flag, Translation, Var};

pub(super) fn translate(
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
            t.copy(get, &[("REDIS_SENTINEL_AUTH", "TOLLGATE_REDIS_SENTINEL_PASSWORD")]);
        }
        other => return Err(format!("REDIS_TYPE={other}: SINGLE, CLUSTER or SENTINEL")),
    }
    t.copy(
        get,
        &[
            ("REDIS_TLS_CACERT", "TOLLGATE_REDIS_CA"),
            ("REDIS_TLS_CLIENT_CERT", "TOLLGATE_REDIS_CLIENT_CERT"),
            ("REDIS_TLS_CLIENT_KEY", "TOLLGATE_REDIS_CLIENT_KEY"),
            ("REDIS_TIMEOUT", "TOLLGATE_REDIS_TIMEOUT"),
        ],
    );
    if flag("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", false)? == Some(true)
        && get("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION").is_some()
    {
        return Err("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION=true: tollgate always verifies the Redis server's name; give its CA (REDIS_TLS_CACERT) instead".into());
    }
    let pooled =
        "tollgate multiplexes each node's connection and coalesces calls per slot (--coalesce-delay)";
    let pool = [
        "REDIS_POOL_SIZE",
        "REDIS_PIPELINE_WINDOW",
        "REDIS_PIPELINE_LIMIT",
        "REDIS_CLUSTER_PIPELINE_PARALLELISM",
        "REDIS_POOL_ON_EMPTY_BEHAVIOR",
    ];
    t.ignore(get, &pool, pooled);
    for name in ["REDIS_PERSECOND", "REDIS_PERSECOND_URL", "REDIS_PERSECOND_TYPE"] {
        if get(name).is_some_and(|v| !v.is_empty() && v != "false") {
            t.ignored.push(format!("{name}: one Redis holds every bucket, per-second ones too"));
        }
    }
    let startup = [
        "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
        "REDIS_STARTUP_INITIAL_INTERVAL",
        "REDIS_STARTUP_MAX_INTERVAL",
        "REDIS_STARTUP_MAX_ELAPSED_TIME",
    ];
    t.ignore(
        get,
        &startup,
        "readiness follows Redis at every probe, and connections are retried without end",
    );
    Ok(())
}
