//! Redis Sentinel: a primary, one replica and three sentinels monitoring them, on loopback.
//! The sentinels are `redis-sentinel` when installed, else `redis-server --sentinel`: the same
//! program (Debian's `redis-sentinel` package links it), without the package's system service
//! that would take port 26379.

use std::process::{Command, Stdio};
use std::time::Duration;

use super::*;

/// The name the sentinels monitor the primary under.
pub const SENTINEL_MASTER: &str = "tollgate";

/// A primary, its replica, and three sentinels with a quorum of two.
pub struct SentinelGroup {
    pub primary: Redis,
    pub replica: Redis,
    pub sentinel_ports: Vec<u16>,
    _sentinels: Vec<Proc>,
    _dir: tempfile::TempDir,
}

impl SentinelGroup {
    /// Starts everything and waits until every sentinel sees the replica and the other two.
    pub fn start() -> SentinelGroup {
        // Redis waits 5 s before a diskless full sync by default, to batch replicas: one here.
        let primary = Redis::start_with(&["--repl-diskless-sync-delay", "0"]);
        let replica = Redis::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
        wait_until("the replica to sync", 500, Duration::from_millis(20), || {
            node_query::<String>(replica.port, &["INFO", "replication"])
                .is_some_and(|info| info.contains("master_link_status:up"))
        });
        let dir = scratch_dir("tollgate-sentinel");
        let mut sentinels = Vec::new();
        let mut sentinel_ports = Vec::new();
        for i in 0..3 {
            let port = free_port();
            let conf = dir.path().join(format!("sentinel-{i}.conf"));
            // A primary is down after 1 s without answers; a failover may take 10 s at most.
            let text = format!(
                "port {port}\nbind 127.0.0.1\nlogfile \"{log}\"\n\
                 sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
                 sentinel failover-timeout {SENTINEL_MASTER} 10000\n",
                log = dir.path().join(format!("sentinel-{i}.log")).display(),
                primary = primary.port,
            );
            std::fs::write(&conf, text).unwrap();
            let program = match std::env::var("TOLLGATE_TEST_SERVER") {
                Ok(server) => server,
                Err(_) if which("redis-sentinel") => "redis-sentinel".to_owned(),
                Err(_) => "redis-server".to_owned(),
            };
            let mut command = Command::new(program);
            command.arg(&conf).arg("--sentinel").stdout(Stdio::null());
            sentinels.push(Proc::spawn("redis-sentinel", &mut command));
            sentinel_ports.push(port);
        }
        for port in &sentinel_ports {
            wait_until(
                "the sentinels to know the replica and each other",
                500,
                Duration::from_millis(20),
                || {
                    let Some(fields) =
                        node_query::<Vec<String>>(*port, &["SENTINEL", "MASTER", SENTINEL_MASTER])
                    else {
                        return false;
                    };
                    let field = |name: &str| {
                        fields.chunks(2).find(|kv| kv[0] == name).map(|kv| kv[1].clone()).unwrap_or_default()
                    };
                    field("num-slaves") == "1" && field("num-other-sentinels") == "2"
                },
            );
        }
        SentinelGroup { primary, replica, sentinel_ports, _sentinels: sentinels, _dir: dir }
    }

    /// `host:port,...` of the sentinels, as `--redis-sentinel` takes them.
    pub fn addrs(&self) -> String {
        self.sentinel_ports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>().join(",")
    }

    /// The port of the primary the first sentinel names now.
    pub fn primary_port(&self) -> Option<u16> {
        let addr: Vec<String> =
            node_query(self.sentinel_ports[0], &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER])?;
        addr.get(1)?.parse().ok()
    }
}

// Whether `program` is on PATH.
fn which(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}
