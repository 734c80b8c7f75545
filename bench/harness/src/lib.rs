//! What the benchmark binaries share: Redis's own work read by a raw `INFO` call, percentiles,
//! processes owned by guards, and two pieces of the test harness included as they are (the
//! fault-injecting proxy, which holds replies back to stand in for distance between regions, and
//! the paced per-region RLS load of the global-limit checks), so that a figure here is measured as
//! its test checks it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use hdrhistogram::Histogram;

#[allow(dead_code)]
#[path = "../../../tests/common/paced.rs"]
pub mod paced;
#[allow(dead_code)]
#[path = "../../../tests/common/proxy.rs"]
pub mod proxy;

/// A flag's seconds (fractions allowed) as a duration: clap's parser for the binaries' times.
pub fn seconds(s: &str) -> Result<Duration, String> {
    let seconds: f64 = s.parse().map_err(|e| format!("{s}: {e}"))?;
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("{s}: {e}"))
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One INFO section from Redis, by a raw RESP call (the harness takes no Redis client).
pub fn redis_info(addr: &str, section: &str) -> String {
    let mut conn = TcpStream::connect(addr).expect("redis");
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(conn, "INFO {section}\r\n").unwrap();
    let mut reply = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        let n = conn.read(&mut buf).unwrap();
        reply.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&reply);
        if let Some((head, body)) = text.split_once("\r\n") {
            let len: usize = head.trim_start_matches('$').parse().unwrap();
            if body.len() >= len {
                return body[..len].to_owned();
            }
        }
        if n == 0 {
            panic!("redis closed the connection");
        }
    }
}

/// Every command the Redis servers at `addrs` (comma-separated: a Cluster's primaries) ran so far,
/// scripts' commands included, and their CPU seconds, summed.
pub fn redis_work(addrs: &str) -> (u64, f64) {
    let mut total = (0, 0.0);
    for addr in addrs.split(',') {
        total.0 += redis_info(addr, "commandstats")
            .lines()
            .filter_map(|l| l.split_once("calls=")?.1.split(',').next()?.parse::<u64>().ok())
            .sum::<u64>();
        total.1 += redis_info(addr, "cpu")
            .lines()
            .filter(|l| l.starts_with("used_cpu_user:") || l.starts_with("used_cpu_sys:"))
            .filter_map(|l| l.split_once(':')?.1.trim().parse::<f64>().ok())
            .sum::<f64>();
    }
    total
}

/// The value at quantile `q` (0 for an empty histogram).
pub fn percentile(h: &Histogram<u64>, q: f64) -> u64 {
    if h.is_empty() {
        0
    } else {
        h.value_at_quantile(q)
    }
}

/// A process this harness started, killed by its PID when dropped (a panic included).
pub struct Child(std::process::Child);

impl Child {
    /// Starts `command` with its output sent to `log`.
    pub fn spawn(command: &mut Command, log: &std::path::Path) -> Child {
        let log = std::fs::File::create(log).unwrap();
        let child = command.stdout(Stdio::null()).stderr(log).spawn().expect("spawn");
        Child(child)
    }

    /// Kills it now.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `ready` every 50 ms, 10 s at most.
pub fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    for _ in 0..200 {
        if ready() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}
