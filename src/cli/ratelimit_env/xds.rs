//! `CONFIG_TYPE=GRPC_XDS_SOTW`: the xDS server, node, headers, TLS and backoff.

use super::{Flag, Translation, Var};

pub(super) fn translate(
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
    t.copy(get, &[("CONFIG_GRPC_XDS_NODE_METADATA", "TOLLGATE_XDS_NODE_METADATA")]);
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
        t.copy(
            get,
            &[
                ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "TOLLGATE_XDS_TLS_CERT"),
                ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "TOLLGATE_XDS_TLS_KEY"),
                ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "TOLLGATE_XDS_TLS_CA"),
                ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "TOLLGATE_XDS_TLS_SERVER_NAME"),
            ],
        );
    }
    t.copy(
        get,
        &[
            ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "TOLLGATE_XDS_BACKOFF_INITIAL"),
            ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "TOLLGATE_XDS_BACKOFF_MAX"),
            ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "TOLLGATE_XDS_BACKOFF_RANDOM_FACTOR"),
            ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "TOLLGATE_XDS_MAX_MESSAGE_BYTES"),
        ],
    );
    if flag("XDS_CLIENT_BACKOFF_JITTER", true)? == Some(false) {
        t.set.insert("TOLLGATE_XDS_BACKOFF_NO_JITTER", "true".into());
    }
    if get("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL").is_some() {
        t.ignored.push("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL: one backoff (XDS_CLIENT_BACKOFF_*) paces every reconnection".into());
    }
    Ok(())
}
