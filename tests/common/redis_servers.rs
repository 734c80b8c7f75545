//! Redis: a standalone server and a 6-node Cluster, on loopback ports, with helpers to read
//! keys back and find which node serves a slot.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::*;

/// The server program the store tests start: `redis-server`, or what `TOLLGATE_TEST_SERVER`
/// names (scripts/test runs the store tests again on Valkey 8's `valkey-server`).
pub fn server_program() -> String {
    std::env::var("TOLLGATE_TEST_SERVER").unwrap_or_else(|_| "redis-server".to_owned())
}

/// A `redis-server` command for loopback `port`, without persistence, logging into `dir`.
fn redis_server(port: u16, dir: &Path) -> Command {
    let mut cmd = Command::new(server_program());
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

    /// `host:port`, as envoyproxy/ratelimit's `REDIS_URL` takes it.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
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
        let proxies: Vec<proxy::FaultProxy> =
            self.ports.iter().map(|p| proxy::FaultProxy::start(*p)).collect();
        for (port, proxy) in self.ports.iter().zip(&proxies) {
            let bus = (port + 10_000).to_string();
            let announce = proxy.port.to_string();
            node_query::<String>(*port, &["CONFIG", "SET", "cluster-announce-bus-port", &bus])
                .expect("bus port");
            node_query::<String>(*port, &["CONFIG", "SET", "cluster-announce-port", &announce])
                .expect("announce");
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

/// The balance the bucket at `key` holds in Redis (its `t` field), as last written.
pub fn stored_tokens(con: &mut impl redis::ConnectionLike, key: &str) -> f64 {
    redis::cmd("HGET").arg(key).arg("t").query(con).unwrap_or_else(|e| panic!("bucket {key}: {e}"))
}

/// Redis's clock, in milliseconds since the epoch (what leases and slots expire by).
pub fn redis_ms(con: &mut redis::Connection) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query(con).unwrap();
    s * 1000 + us / 1000
}
