//! The attacks of tollgate's hostile-load rows (`ONLY=hostile bench/run`), each a client that
//! takes what it can and prints one line of `key=value` results; bench/run measures tollgate
//! (RSS, fds, RLS probes answered beside the attack) while it runs.
//!
//! - `hostile ids --addr A --streams S --ids N`: S RLQS streams name the same N distinct bucket
//!   ids, in reports of 60,000, and read their answers for `--hold` seconds: `assigned` is how
//!   many got an assignment on each stream (a replica's caps bound it).
//! - `hostile mute --addr A --streams S --ids N`: S RLQS streams name N ids each and never read;
//!   after `--hold` seconds each reads what it is told: `ended` is how many tollgate had ended
//!   with RESOURCE_EXHAUSTED.
//! - `hostile slow-http --addr H --conns N`: N HTTP connections, half sending a partial request
//!   head and stopping, half one byte a second; after `--hold` seconds, `closed` is how many
//!   tollgate had closed.
//! - `hostile idle-h2 --addr G --conns N`: N HTTP/2 connections to the gRPC port that complete
//!   the handshake and send nothing; `closed` as above.
//! - `hostile half-open --addr G --conns N`: from 127.0.0.2, N bare TCP connections that send
//!   nothing, each reopened as soon as tollgate closes it, for `--hold` seconds; meanwhile, five
//!   times a second, a new client from 127.0.0.1 opens a connection and asks one decision:
//!   `fresh` is how many of them were answered within 2 s.
//! - `hostile holders --addr G --holders N [--per-call K]`: a region's renewals at the global
//!   tier naming N leaseholders of one global bucket (`--domain`, `tenant=hot`), K a call, one
//!   call after another for `--hold` seconds: `calls` answered, `ok` of them set, `refused` (a
//!   renewal naming more holders than a bucket may have is refused whole), `leased` (holders
//!   with a lease after the last round: the bucket's cap), and the mean and largest call time.
//!
//! `ids` with `--ids 1` is many streams on one bucket; a stream tollgate refuses is counted
//! (`refused`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use clap::Parser;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tollgate_bench::seconds;

/// The attacks.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Attack {
    Ids,
    Mute,
    SlowHttp,
    IdleH2,
    HalfOpen,
    Holders,
}

/// The attack and its flags.
#[derive(Parser)]
struct Args {
    #[arg(value_enum)]
    attack: Attack,
    /// tollgate's gRPC address.
    #[arg(long, default_value = "127.0.0.1:8081")]
    addr: String,
    #[arg(long, default_value = "rlqs")]
    domain: String,
    /// `ids`: bucket ids reported.
    #[arg(long, default_value_t = 1_000_000)]
    ids: usize,
    /// `ids`, `mute`: streams opened.
    #[arg(long, default_value_t = 20)]
    streams: usize,
    /// `slow-http`, `idle-h2`: connections opened.
    #[arg(long, default_value_t = 1_000)]
    conns: usize,
    /// `holders`: leaseholders named in each renewal.
    #[arg(long, default_value_t = 3_000)]
    holders: usize,
    /// `holders`: leaseholders named in one renewal (all of them if not given).
    #[arg(long)]
    per_call: Option<usize>,
    /// How long the connections are held, in seconds.
    #[arg(long, default_value = "30", value_parser = seconds)]
    hold: Duration,
}

fn usage(prefix: &str, i: usize) -> BucketQuotaUsage {
    let id = BucketId { bucket: HashMap::from([("tenant".to_owned(), format!("{prefix}-{i}"))]) };
    BucketQuotaUsage {
        bucket_id: Some(id),
        time_elapsed: None,
        num_requests_allowed: 0,
        num_requests_denied: 1,
    }
}

type Answers =
    tonic::Streaming<envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse>;

// A stream whose reports are sent through the returned sender; `None` if tollgate refused it.
async fn open(addr: &str) -> Option<(mpsc::Sender<RateLimitQuotaUsageReports>, Answers)> {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(64 << 20);
    let (tx, rx) = mpsc::channel(4);
    let answers = client.stream_rate_limit_quotas(ReceiverStream::new(rx)).await.ok()?.into_inner();
    Some((tx, answers))
}

async fn send_ids(tx: &mpsc::Sender<RateLimitQuotaUsageReports>, domain: &str, prefix: &str, ids: usize) {
    for start in (0..ids).step_by(60_000) {
        let usages = (start..(start + 60_000).min(ids)).map(|i| usage(prefix, i)).collect();
        let report = RateLimitQuotaUsageReports { domain: domain.to_owned(), bucket_quota_usages: usages };
        if tx.send(report).await.is_err() {
            return;
        }
    }
}

async fn ids(a: &Args) {
    // Every stream names the same ids: on one replica, a hold per stream on each bucket.
    let (mut readers, mut refused) = (Vec::new(), 0);
    for _ in 0..a.streams {
        let Some((tx, mut answers)) = open(&a.addr).await else {
            refused += 1;
            continue;
        };
        let (domain, ids, hold) = (a.domain.clone(), a.ids, a.hold);
        readers.push(tokio::spawn(async move {
            let sender = tokio::spawn(async move {
                send_ids(&tx, &domain, "flood", ids).await;
                tx
            });
            let mut assigned = std::collections::HashSet::new();
            let end = Instant::now() + hold;
            while let Ok(Ok(Some(answer))) = tokio::time::timeout_at(end.into(), answers.message()).await {
                for action in answer.bucket_action {
                    if let (Some(id), Some(Action::QuotaAssignmentAction(_))) =
                        (action.bucket_id, action.bucket_action)
                    {
                        assigned.insert(id.bucket.get("tenant").cloned().unwrap_or_default());
                    }
                }
            }
            let _tx = sender.await.unwrap();
            assigned.len()
        }));
    }
    let mut assigned = Vec::new();
    for reader in readers {
        assigned.push(reader.await.unwrap().to_string());
    }
    // Many streams: how many streams got how many assignments, not one figure each.
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for n in &assigned {
        *counts.entry(n.clone()).or_default() += 1;
    }
    let assigned: Vec<String> =
        if a.streams > 20 { counts.iter().map(|(n, k)| format!("{k}x{n}")).collect() } else { assigned };
    println!("streams={} ids={} refused={refused} assigned={}", a.streams, a.ids, assigned.join("+"));
}

async fn mute(a: &Args) {
    let mut streams = Vec::new();
    for s in 0..a.streams {
        let Some((tx, answers)) = open(&a.addr).await else { continue };
        send_ids(&tx, &a.domain, &format!("mute{s}"), a.ids).await;
        streams.push((tx, answers));
    }
    tokio::time::sleep(a.hold).await;
    let mut ended = 0;
    for (_tx, mut answers) in streams {
        // Read what was queued, for 3 s at most: an ended stream's status comes after it; a stream
        // still served is told something every round and never goes quiet.
        let until = tokio::time::Instant::now() + Duration::from_secs(3);
        while let Ok(read) = tokio::time::timeout_at(until, answers.message()).await {
            match read {
                Ok(Some(_)) => continue,
                Err(status) if status.code() == tonic::Code::ResourceExhausted => ended += 1,
                _ => {}
            }
            break;
        }
    }
    println!("streams={} ids={} ended={ended}", a.streams, a.ids);
}

// Whether tollgate closed `stream`: a read that returns 0 bytes or an error, within 10 ms.
async fn closed(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(Duration::from_millis(10), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

async fn slow_http(a: &Args) {
    let mut conns = Vec::new();
    for i in 0..a.conns {
        let Ok(mut stream) = TcpStream::connect(&a.addr).await else { break };
        let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await;
        conns.push((i % 2 == 1, stream));
    }
    let opened = conns.len();
    let end = Instant::now() + a.hold;
    while Instant::now() < end {
        for (_, stream) in conns.iter_mut().filter(|(trickle, _)| *trickle) {
            let _ = stream.write_all(b"x").await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let mut closed_count = 0;
    for (_, stream) in conns.iter_mut() {
        closed_count += usize::from(closed(stream).await);
    }
    println!("conns={} opened={opened} closed={closed_count}", a.conns);
}

async fn idle_h2(a: &Args) {
    let mut conns = Vec::new();
    for _ in 0..a.conns {
        let Ok(stream) = TcpStream::connect(&a.addr).await else { break };
        match h2::client::handshake(stream).await {
            Ok((send, connection)) => {
                let driver = tokio::spawn(connection);
                conns.push((send, driver));
            }
            Err(_) => break,
        }
    }
    let opened = conns.len();
    tokio::time::sleep(a.hold).await;
    let closed_count = conns.iter().filter(|(_, driver)| driver.is_finished()).count();
    println!("conns={} opened={opened} closed={closed_count}", a.conns);
}

// A TCP connection to `to` from the loopback address `from`.
async fn connect_from(from: &str, to: &str) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(format!("{from}:0").parse().unwrap())?;
    socket.connect(to.parse().unwrap()).await
}

// One decision asked on a new connection from 127.0.0.1: answered within 2 s?
async fn fresh_client(addr: &str, domain: &str) -> bool {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor::Entry, RateLimitDescriptor,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let ask = async {
        let mut client = RateLimitServiceClient::connect(format!("http://{addr}")).await.ok()?;
        let entry = Entry { key: "tenant".into(), value: "fresh".into() };
        let request = RateLimitRequest {
            domain: domain.to_owned(),
            descriptors: vec![RateLimitDescriptor { entries: vec![entry], ..Default::default() }],
            hits_addend: 1,
        };
        client.should_rate_limit(request).await.ok()
    };
    matches!(tokio::time::timeout(Duration::from_secs(2), ask).await, Ok(Some(_)))
}

async fn half_open(a: &Args) {
    let (addr, conns, hold) = (a.addr.clone(), a.conns, a.hold);
    let flood = tokio::spawn(async move {
        let (mut held, mut opened) = (Vec::<TcpStream>::new(), 0u64);
        let end = Instant::now() + hold;
        while Instant::now() < end {
            let mut buf = [0u8; 64];
            held.retain(
                |s| matches!(s.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            );
            while held.len() < conns {
                let Ok(Ok(s)) =
                    tokio::time::timeout(Duration::from_millis(200), connect_from("127.0.0.2", &addr)).await
                else {
                    break;
                };
                held.push(s);
                opened += 1;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        opened
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (mut asked, mut answered) = (0, 0);
    let end = Instant::now() + a.hold.saturating_sub(Duration::from_secs(2));
    while Instant::now() < end {
        asked += 1;
        answered += usize::from(fresh_client(&a.addr, "bench").await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let opened = flood.await.unwrap();
    println!("conns={} opened={opened} fresh={answered}/{asked}", a.conns);
}

async fn holders(a: &Args) {
    use tollgate::edge::region::proto::region_leases_client::RegionLeasesClient;
    use tollgate::edge::region::proto::{BucketRenewal, Entry, RenewRequest};
    let mut client = RegionLeasesClient::connect(format!("http://{}", a.addr)).await.unwrap();
    let renewal = |n: usize| BucketRenewal {
        domain: a.domain.clone(),
        entries: vec![Entry { key: "tenant".into(), value: "hot".into() }],
        capacity: 1.0,
        refill_per_second: 1.0,
        demand: 1.0,
        holder: format!("h{n}"),
        ..Default::default()
    };
    let per_call = a.per_call.unwrap_or(a.holders).max(1);
    let calls_of: Vec<RenewRequest> = (0..a.holders)
        .step_by(per_call)
        .map(|from| RenewRequest {
            region: "eu".into(),
            buckets: (from..(from + per_call).min(a.holders)).map(renewal).collect(),
        })
        .collect();
    let (mut calls, mut ok, mut refused, mut leased) = (0u64, 0u64, 0u64, 0usize);
    let (mut total, mut most) = (Duration::ZERO, Duration::ZERO);
    let end = Instant::now() + a.hold;
    'rounds: while Instant::now() < end {
        // One round: every holder named once; `leased` is how many held a lease in the last.
        let mut this_round = 0;
        for request in &calls_of {
            if Instant::now() >= end {
                break 'rounds;
            }
            let start = Instant::now();
            match client.renew(request.clone()).await {
                Ok(answer) => {
                    ok += 1;
                    this_round += answer.get_ref().leases.iter().filter(|l| l.capacity > 0.0).count();
                }
                Err(status) if status.code() == tonic::Code::InvalidArgument => refused += 1,
                Err(status) => panic!("renewal failed: {status}"),
            }
            let took = start.elapsed();
            (calls, total, most) = (calls + 1, total + took, most.max(took));
        }
        leased = this_round;
    }
    let mean_ms = total.as_secs_f64() * 1000.0 / calls.max(1) as f64;
    println!(
        "holders={} per_call={per_call} calls={calls} ok={ok} refused={refused} leased={leased} mean_ms={mean_ms:.2} max_ms={:.1}",
        a.holders,
        most.as_secs_f64() * 1000.0
    );
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
    match a.attack {
        Attack::Ids => ids(&a).await,
        Attack::Mute => mute(&a).await,
        Attack::SlowHttp => slow_http(&a).await,
        Attack::IdleH2 => idle_h2(&a).await,
        Attack::HalfOpen => half_open(&a).await,
        Attack::Holders => holders(&a).await,
    }
}
