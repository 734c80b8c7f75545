//! tollgate itself: the `serve` process under test, and gRPC requests to it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tollgate::client;

use super::*;

/// Path of the tollgate binary Cargo built for these tests.
pub fn tollgate_bin() -> &'static str {
    env!("CARGO_BIN_EXE_tollgate")
}

/// A `tollgate serve` process; its log (stderr) goes to a file, shown if the test fails.
pub struct Tollgate {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub proc: Proc,
    log_dir: tempfile::TempDir,
}

impl Drop for Tollgate {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- tollgate log ({}) ---\n{}", self.grpc, self.log());
        }
    }
}

/// Where a tollgate under test keeps its state.
#[derive(Clone, Debug)]
pub enum Backend {
    Memory,
    Redis(String),
    Cluster(String),
}

impl Tollgate {
    /// Starts `tollgate serve --config config` on `backend` and waits for `/readyz`.
    pub fn start(config: &Path, backend: &Backend, extra: &[&str]) -> Tollgate {
        Self::spawn(config, backend, extra).wait_for("/readyz")
    }

    /// Starts it with extra environment variables (e.g. `RUST_LOG`) and waits for `/readyz`.
    pub fn start_with_env(
        config: &Path,
        backend: &Backend,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Tollgate {
        Self::spawn_with_env(config, backend, extra, env).wait_for("/readyz")
    }

    /// Starts it and waits only for `/healthz` (for tests whose store is meant to be down).
    pub fn start_unready(config: &Path, backend: &Backend, extra: &[&str]) -> Tollgate {
        Self::spawn(config, backend, extra).wait_for("/healthz")
    }

    fn wait_for(mut self, path: &str) -> Tollgate {
        wait_until(&format!("tollgate {path}"), 500, Duration::from_millis(20), || {
            if let Some(status) = self.proc.child.try_wait().expect("try_wait") {
                panic!("tollgate exited ({status}) before answering {path}:\n{}", self.log());
            }
            http_get(self.http, path).is_some_and(|(status, _)| status == 200)
        });
        self
    }

    /// Starts it with extra environment variables (e.g. `RUST_LOG`) and waits for `/healthz`.
    pub fn start_unready_with_env(
        config: &Path,
        backend: &Backend,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Tollgate {
        Self::spawn_with_env(config, backend, extra, env).wait_for("/healthz")
    }

    fn spawn(config: &Path, backend: &Backend, extra: &[&str]) -> Tollgate {
        Self::spawn_with_env(config, backend, extra, &[])
    }

    /// [`Tollgate::start`] with the open-files limit of the process set to `soft` and `hard`.
    pub fn start_with_open_files(
        config: &Path,
        backend: &Backend,
        extra: &[&str],
        soft: u64,
        hard: u64,
    ) -> Tollgate {
        Self::spawn_limited(config, backend, extra, &[], Some((soft, hard))).wait_for("/readyz")
    }

    fn spawn_with_env(config: &Path, backend: &Backend, extra: &[&str], env: &[(&str, &str)]) -> Tollgate {
        Self::spawn_limited(config, backend, extra, env, None)
    }

    fn spawn_limited(
        config: &Path,
        backend: &Backend,
        extra: &[&str],
        env: &[(&str, &str)],
        open_files: Option<(u64, u64)>,
    ) -> Tollgate {
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        // util-linux's prlimit sets the limit and execs tollgate in its place (same PID).
        let mut cmd = match open_files {
            Some((soft, hard)) => {
                let mut prlimit = Command::new("prlimit");
                prlimit.args([format!("--nofile={soft}:{hard}").as_str(), "--", tollgate_bin()]);
                prlimit
            }
            None => Command::new(tollgate_bin()),
        };
        cmd.args(["serve", "--config", config.to_str().unwrap()])
            .args(["--grpc-addr", &grpc.to_string(), "--http-addr", &http.to_string()])
            .env("RUST_LOG", "warn")
            .env_remove("TOLLGATE_REDIS_URL")
            .env_remove("TOLLGATE_REDIS_CLUSTER");
        match backend {
            Backend::Memory => {}
            Backend::Redis(url) => {
                cmd.args(["--redis-url", url]);
            }
            Backend::Cluster(seeds) => {
                cmd.args(["--redis-cluster", seeds]);
            }
        }
        // Defaults for tests, unless the test sets its own: no drain delay, and a Redis deadline
        // generous enough that a loaded CI machine never turns answers into failure modes.
        for (flag, value) in [("--drain-delay", "0s"), ("--redis-timeout", "2s")] {
            if !extra.contains(&flag) {
                cmd.args([flag, value]);
            }
        }
        cmd.args(extra);
        cmd.envs(env.iter().copied());

        let log_dir = scratch_dir("tollgate-log");
        cmd.stderr(std::fs::File::create(log_dir.path().join("stderr.log")).unwrap());
        let proc = Proc::spawn("tollgate", &mut cmd);
        Tollgate { grpc, http, proc, log_dir }
    }

    /// Starts tollgate as envoyproxy/ratelimit's image runs it: the binary under the name
    /// `ratelimit`, no arguments, configured only by `env` (envoyproxy/ratelimit's variables; the
    /// listeners are put on free loopback ports here). Waits for `/healthz` only.
    pub fn start_as_ratelimit(env: &[(&str, &str)]) -> Tollgate {
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log_dir = scratch_dir("tollgate-log");
        let bin = log_dir.path().join("ratelimit");
        std::os::unix::fs::symlink(tollgate_bin(), &bin).unwrap();
        let mut cmd = Command::new(&bin);
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs([
                ("HOST", "127.0.0.1".to_owned()),
                ("PORT", http.port().to_string()),
                ("GRPC_HOST", "127.0.0.1".to_owned()),
                ("GRPC_PORT", grpc.port().to_string()),
                ("USE_STATSD", "false".to_owned()),
                ("TOLLGATE_DRAIN_DELAY", "0s".to_owned()),
            ])
            .envs(env.iter().map(|(k, v)| (*k, v.to_string())));
        cmd.stderr(std::fs::File::create(log_dir.path().join("stderr.log")).unwrap());
        let proc = Proc::spawn("tollgate", &mut cmd);
        Tollgate { grpc, http, proc, log_dir }.wait_for("/healthz")
    }

    /// Waits until `/readyz` answers 200.
    pub fn wait_ready(self) -> Tollgate {
        self.wait_for("/readyz")
    }

    pub fn addr(&self) -> String {
        self.grpc.to_string()
    }

    /// Everything the process has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_dir.path().join("stderr.log")).unwrap_or_default()
    }

    /// The `/metrics` scrape, parsed.
    pub fn metrics(&self) -> prometheus_parse::Scrape {
        let (status, body) = http_get(self.http, "/metrics").expect("/metrics answers");
        assert_eq!(status, 200);
        prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).expect("valid exposition")
    }
}

/// Writes `yaml` to a fresh directory and returns (dir guard, file path).
pub fn config_file(yaml: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = scratch_dir("tollgate-config");
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, yaml).unwrap();
    (dir, path)
}

/// One gRPC round trip.
pub async fn ask(addr: &str, request: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
    match client::ask(addr, request).await {
        Ok(r) => Ok(r),
        Err(client::AskError::Status(s)) => Err(s),
        Err(e) => panic!("{e}"),
    }
}

/// A request with one descriptor per `k=v,k=v` string.
pub fn req(domain: &str, descriptors: &[&str], hits: u32) -> RateLimitRequest {
    let parsed: Vec<Vec<(String, String)>> =
        descriptors.iter().map(|d| client::parse_descriptor(d).expect("descriptor syntax")).collect();
    client::request(domain, &parsed, hits)
}

/// The value of response header `name`.
pub fn header<'a>(response: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    response
        .response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}

/// The value of the sample `name` whose labels include all of `labels` (0 if absent).
pub fn sample(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            prometheus_parse::Value::Histogram(buckets) => buckets.last().map_or(0.0, |b| b.count),
            prometheus_parse::Value::Summary(_) => 0.0,
        })
        .sum()
}

/// Overall code of a response: 1 = OK, 2 = OVER_LIMIT.
pub const OK: i32 = 1;
pub const OVER_LIMIT: i32 = 2;
