//! What a peer's connections can take from tollgate is bounded (loopback only, each test within
//! seconds):
//!
//! * 600 slow HTTP clients (a request head never finished) against a replica with 512 file
//!   descriptors: the HTTP port holds its cap, the rest are closed at once and counted, the held
//!   ones are closed when the header timeout passes, and meanwhile gRPC decisions are answered
//!   and Redis reconnects after its connection is killed, and kubelet's probes on their own port
//!   (`--probe-addr`) answer; tollgate raised its soft open-files limit to the hard one;
//! * connections that move no byte are closed after the idle timeout, on both ports;
//! * one peer holding bare TCP connections open on an mTLS port (reopening each one closed)
//!   takes only its share of the budget for connections still opening: clients with valid
//!   certificates from another address are answered meanwhile.

mod common;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use tollgate::client::ask_with;

const CONFIG: &str =
    "domain: c\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";

// Whether the server closed `stream` within `within` (a read ends with EOF or an error).
fn closed_within(mut stream: &TcpStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

// Whether the server has closed `stream` already (a read that would wait says it is open).
fn closed_now(mut stream: &TcpStream) -> bool {
    stream.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 256];
    let closed = match stream.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    stream.set_nonblocking(false).unwrap();
    closed
}

// The soft and hard open-files limits of `pid`.
fn open_files(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    (words[3].to_owned(), words[4].to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_slow_http_clients_leaves_grpc_and_redis_working() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    // The replica starts with a soft limit of 256 open files under a hard one of 512.
    let probe: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let probe_flag = probe.to_string();
    let args = ["--http-header-timeout", "3s", "--probe-addr", &probe_flag];
    let server = Tollgate::start_with_open_files(&config, &Backend::Redis(redis.url()), &args, 256, 512);
    assert_eq!(open_files(server.proc.pid()), ("512".into(), "512".into()), "raised to the hard limit");

    // 600 clients that never finish their request head.
    let start = Instant::now();
    let slow: Vec<TcpStream> = (0..600)
        .filter_map(|_| {
            let mut s = TcpStream::connect(server.http).ok()?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").ok()?;
            Some(s)
        })
        .collect();
    // Each port's cap: (512 - 128) / 2 = 192, one source at most a quarter of it (48), and at
    // most 6 of the 24 places for connections still opening. The others are closed at once.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let closed: Vec<bool> = slow.iter().map(closed_now).collect();
    let refused = closed.iter().filter(|c| **c).count();
    assert!((600 - 48..600).contains(&refused), "one source holds at most 48: {refused} refused");
    println!(
        "600 slow HTTP clients from one address at 512 descriptors: {refused} refused at once, {} held",
        600 - refused
    );

    // kubelet's probes, on a port of their own, are answered meanwhile (29 of 30 failed on the
    // HTTP port before they had one).
    for path in ["/readyz", "/healthz"] {
        assert_eq!(http_get(probe, path).map(|(status, _)| status), Some(200), "{path} on the probe port");
    }
    // gRPC decisions are answered meanwhile, and Redis reconnects after its connection is killed.
    for i in 0..3 {
        let r = tokio::time::timeout(Duration::from_secs(2), ask(&server.addr(), req("c", &["k=v"], 1)))
            .await
            .unwrap_or_else(|_| panic!("ask {i} timed out"))
            .unwrap();
        assert_eq!(r.overall_code, OK);
        assert_eq!(header(&r, "X-Tollgate-Failure-Mode"), None, "a real decision");
    }
    let _: () = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query(&mut redis.connection())
        .unwrap_or(());
    let mut decided = false;
    for _ in 0..50 {
        let r = ask(&server.addr(), req("c", &["k=v"], 1)).await.unwrap();
        if header(&r, "X-Tollgate-Failure-Mode").is_none() {
            decided = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(decided, "Redis reconnected under the flood");

    // The held ones are closed once the header timeout has passed.
    let mut open = 0;
    for s in slow.iter().zip(&closed).filter(|(_, c)| !**c).map(|(s, _)| s) {
        let left = Duration::from_secs(8).saturating_sub(start.elapsed()).max(Duration::from_millis(100));
        if !closed_within(s, left) {
            open += 1;
        }
    }
    assert_eq!(open, 0, "every slow client closed within the header timeout");
    let refused = sample(&server.metrics(), "tollgate_connections_refused_total", &[("port", "http")]);
    assert!(refused >= 552.0, "{refused}");
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_are_closed() {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(
        &config,
        &Backend::Memory,
        &["--http-idle-timeout", "1s", "--grpc-idle-timeout", "1s", "--http-header-timeout", "30s"],
    );
    // HTTP: a keep-alive connection after its answer.
    let mut http = TcpStream::connect(server.http).unwrap();
    http.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut answer = [0u8; 512];
    let n = http.read(&mut answer).unwrap();
    assert!(String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 200"));
    // A gRPC client that sends the HTTP/2 preface and nothing after it.
    let mut grpc = TcpStream::connect(server.grpc).unwrap();
    grpc.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    let start = Instant::now();
    assert!(closed_within(&http, Duration::from_secs(5)), "an idle HTTP connection is closed");
    assert!(closed_within(&grpc, Duration::from_secs(5)), "an idle gRPC connection is closed");
    assert!(start.elapsed() < Duration::from_secs(4), "{:?}", start.elapsed());
    // A connection that works is not idle: decisions go on.
    let r = ask(&server.addr(), req("c", &["k=v"], 1)).await.unwrap();
    assert_eq!(r.overall_code, OK);
}

// A TCP connection to `to` from the loopback address `from` (127.0.0.0/8 is all this host's).
async fn connect_from(from: &str, to: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(format!("{from}:0").parse().unwrap())?;
    socket.connect(to).await
}

#[tokio::test(flavor = "multi_thread")]
async fn one_peer_holding_half_open_connections_leaves_the_port_to_others() {
    let pki = TestPki::new();
    let (_dir, config) = config_file(CONFIG);
    let args = pki.mtls_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // 512 descriptors: 192 a port, 24 of them for connections still opening.
    let server = Tollgate::start_with_open_files(&config, &Backend::Memory, &args, 512, 512);
    let grpc = server.grpc;
    // 127.0.0.2 keeps up to 300 bare connections open, reopening each one the server closes.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooding = stop.clone();
    let flood = tokio::spawn(async move {
        let mut held: Vec<tokio::net::TcpStream> = Vec::new();
        let mut opened = 0u32;
        while !flooding.load(std::sync::atomic::Ordering::Relaxed) {
            let mut buf = [0u8; 64];
            held.retain(
                |s| matches!(s.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            );
            while held.len() < 300 {
                match connect_from("127.0.0.2", grpc).await {
                    Ok(s) => {
                        held.push(s);
                        opened += 1;
                    }
                    Err(_) => break,
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        opened
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (addr, client) = (server.addr(), pki.client_tls(true));
    let started = Instant::now();
    for i in 0..10 {
        let asked = ask_with(&addr, req("c", &["k=v"], 1), Some(&client));
        let r = tokio::time::timeout(Duration::from_secs(3), asked)
            .await
            .unwrap_or_else(|_| panic!("client {i} not answered within 3 s under the flood"))
            .unwrap_or_else(|e| panic!("client {i}: {e}"));
        assert_eq!(r.overall_code, OK);
    }
    let answered_in = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let opened = flood.await.unwrap();
    let scrape = server.metrics();
    let refused = |reason| {
        sample(&scrape, "tollgate_connections_refused_total", &[("port", "grpc"), ("reason", reason)])
    };
    assert!(refused("opening") > 0.0, "the flood met its share of the opening budget");
    println!(
        "one peer flooding the mTLS port ({opened} bare connections opened): 10 of 10 clients with certificates answered in {answered_in:?}; refused: {} opening, {} slow_opening",
        refused("opening"),
        refused("slow_opening")
    );
}
