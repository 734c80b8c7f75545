use std::collections::BTreeMap;

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
    for env in [[("BACKEND_TYPE", "memcache")], [("GRPC_UDS", "/tmp/s")], [("SHADOW_MODE", "maybe")]] {
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

#[test]
fn service_wide_settings_become_tollgates() {
    let t = run(
        &[
            ("QUOTA_MODE", "true"),
            ("MERGE_DOMAIN_CONFIG", "1"),
            ("CACHE_KEY_PREFIX", "eg_"),
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
            ("LIMIT_RESET_HEADER", "X-Reset"),
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/c"),
            ("GRPC_SERVER_TLS_KEY", "/k"),
            ("GRPC_CLIENT_TLS_CACERT", "/ca"),
            ("GRPC_CLIENT_TLS_SAN", "envoy.internal"),
        ],
        false,
    )
    .unwrap();
    for (name, value) in [
        ("TOLLGATE_QUOTA_MODE", "true"),
        ("TOLLGATE_MERGE_DOMAIN_CONFIG", "true"),
        ("TOLLGATE_REDIS_KEY_PREFIX", "eg_"),
        ("TOLLGATE_LIMIT_HEADERS", "RateLimit-Limit,RateLimit-Remaining,X-Reset"),
        ("TOLLGATE_TLS_CLIENT_SAN", "envoy.internal"),
    ] {
        assert_eq!(t.set.get(name).map(String::as_str), Some(value), "{name}");
    }
    assert!(t.ignored.is_empty(), "{:?}", t.ignored);
}
