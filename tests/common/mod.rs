//! The test harness: real servers on loopback, started and stopped by the tests.
//!
//! Every process a test starts is owned by a guard that kills it by PID when dropped, so a
//! failing test leaves nothing behind. Ports come from a range below Linux's ephemeral range
//! (32768+), so they do not collide with the client side of connections; a Cluster node's bus
//! port (port + 10000) stays below it too. Readiness is always polled (PING, CLUSTER INFO,
//! /readyz) with a bounded number of tries, never slept for.

// Each test binary uses a different part of the harness.
#![allow(dead_code, unused_imports)]

pub mod load;
pub mod paced;
pub mod proxy;
pub mod regions;
pub mod rlqs;

mod configmap;
mod envoy;
mod http;
mod otlp;
mod pki;
mod postgres;
mod redis_servers;
mod sentinel;
mod service;
mod xds;

pub use self::configmap::*;
pub use self::envoy::*;
pub use self::http::*;
pub use self::otlp::*;
pub use self::pki::*;
pub use self::postgres::*;
pub use self::redis_servers::*;
pub use self::sentinel::*;
pub use self::service::*;
pub use self::xds::*;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

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

    /// Its resident memory (VmRSS), in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
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
