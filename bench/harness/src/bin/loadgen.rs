//! Load generator for tollgate's benchmarks.
//!
//! It speaks gRPC over raw HTTP/2 (the `h2` crate, as h2load does) rather than through a tonic
//! client, so that the generator takes as little as possible of the CPU it shares with tollgate
//! and Redis on the benchmark machine.
//!
//! `loadgen run`: closed loop (as fast as the server answers) or open loop (`--rate`, a fixed
//! request rate, for latency at a given load), over `--connections` HTTP/2 connections with
//! `--concurrency` requests in flight each, tenants drawn uniformly or Zipf-distributed from
//! `--tenants` ids (or each in turn with `--sequential`). With `--count N` it sends exactly N
//! requests and stops. Prints one line of `key=value` results: `requests` and the rates and
//! latencies count the measured period, `sent` everything including the warm-up.
//!
//! `loadgen body`: writes a gRPC-framed RateLimitRequest, the request body h2load sends.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use hdrhistogram::Histogram;
use prost::Message;
use rand::distr::Distribution;
use rand::SeedableRng;
use tollgate_bench::seconds;

/// What to do: send load (`run`), or write the request body (`body`).
#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Mode {
    Run,
    Body,
}

/// What to do and the load's flags.
#[derive(Parser)]
struct Args {
    #[arg(value_enum)]
    mode: Mode,
    /// tollgate's gRPC address.
    #[arg(long, default_value = "127.0.0.1:8081")]
    addr: String,
    #[arg(long, default_value = "bench")]
    domain: String,
    /// Tenants asked about.
    #[arg(long, default_value_t = 10_000)]
    tenants: u64,
    /// The Zipf exponent of the tenants' popularity (0: uniform).
    #[arg(long, default_value_t = 0.0)]
    zipf: f64,
    /// The tenants' names' prefix.
    #[arg(long, default_value = "t")]
    prefix: String,
    /// A `class` entry after the tenant's, if given.
    #[arg(long)]
    class: Option<String>,
    /// Descriptors per request.
    #[arg(long, default_value_t = 1)]
    per_request: usize,
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Requests in flight (closed loop).
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Seconds measured.
    #[arg(long, default_value = "10", value_parser = seconds)]
    duration: Duration,
    /// Seconds before the measurement.
    #[arg(long, default_value = "2", value_parser = seconds)]
    warmup: Duration,
    /// Open loop at this many requests a second.
    #[arg(long)]
    rate: Option<f64>,
    /// Tenants in order rather than drawn.
    #[arg(long)]
    sequential: bool,
    /// Stop after this many requests.
    #[arg(long)]
    count: Option<u64>,
}

fn request(args: &Args, tenants: impl Iterator<Item = u64>) -> RateLimitRequest {
    RateLimitRequest {
        domain: args.domain.clone(),
        descriptors: tenants
            .map(|t| {
                let mut entries = vec![Entry { key: "tenant".into(), value: format!("{}{t}", args.prefix) }];
                if let Some(class) = &args.class {
                    entries.push(Entry { key: "class".into(), value: class.clone() });
                }
                RateLimitDescriptor { entries, ..Default::default() }
            })
            .collect(),
        hits_addend: 1,
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    match args.mode {
        Mode::Body => {
            use std::io::Write;
            std::io::stdout().write_all(&framed(&request(&args, 0..args.per_request as u64))).unwrap();
        }
        Mode::Run => run(args).await,
    }
}

async fn run(args: Args) {
    let args = Arc::new(args);
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(args.warmup.is_zero()));
    let histogram = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap()));
    let (ok, over, errors) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let sequence = Arc::new(AtomicU64::new(0));
    let issued = Arc::new(AtomicU64::new(0));
    let sent_total = Arc::new(AtomicU64::new(0));
    let workers = args.connections * args.concurrency;
    // Open loop: each worker sends on its own schedule, together `rate` requests per second.
    let interval = args.rate.map(|r| Duration::from_secs_f64(workers as f64 / r));
    let uri: http::Uri =
        format!("http://{}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", args.addr)
            .parse()
            .unwrap();
    let mut tasks = Vec::new();
    for c in 0..args.connections {
        let tcp = tokio::net::TcpStream::connect(&args.addr).await.expect("connect");
        tcp.set_nodelay(true).unwrap();
        let (client, connection) = h2::client::Builder::new()
            .initial_window_size(1 << 20)
            .initial_connection_window_size(1 << 24)
            .handshake::<_, Bytes>(tcp)
            .await
            .expect("HTTP/2 handshake");
        tokio::spawn(connection);
        for w in 0..args.concurrency {
            let (args, stop, measuring, histogram) =
                (args.clone(), stop.clone(), measuring.clone(), histogram.clone());
            let (ok, over, errors, sequence) = (ok.clone(), over.clone(), errors.clone(), sequence.clone());
            let (issued, uri, client) = (issued.clone(), uri.clone(), client.clone());
            let sent_total = sent_total.clone();
            let seed = (c * 10_000 + w) as u64;
            tasks.push(tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let zipf =
                    (args.zipf > 0.0).then(|| rand_distr::Zipf::new(args.tenants as f64, args.zipf).unwrap());
                let mut local = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
                let mut next = Instant::now()
                    + interval.map_or(Duration::ZERO, |i| i.mul_f64(rand::Rng::random::<f64>(&mut rng)));
                while !stop.load(Ordering::Relaxed) {
                    if args.count.is_some_and(|c| issued.fetch_add(1, Ordering::Relaxed) >= c) {
                        break;
                    }
                    if let Some(i) = interval {
                        tokio::time::sleep_until(next.into()).await;
                        next += i;
                    }
                    let tenants: Vec<u64> = (0..args.per_request)
                        .map(|_| {
                            if args.sequential {
                                sequence.fetch_add(1, Ordering::Relaxed) % args.tenants
                            } else if let Some(z) = &zipf {
                                z.sample(&mut rng) as u64 - 1
                            } else {
                                rand::Rng::random_range(&mut rng, 0..args.tenants)
                            }
                        })
                        .collect();
                    let body = framed(&request(&args, tenants.into_iter()));
                    // Latency counts from the actual send: tokio's timer wakes up to a millisecond
                    // late, which is the generator's error, not the server's. Each of the many
                    // workers keeps its own schedule, so a slow answer delays one worker only.
                    let sent = Instant::now();
                    sent_total.fetch_add(1, Ordering::Relaxed);
                    let code = call(client.clone(), uri.clone(), body).await;
                    if !measuring.load(Ordering::Relaxed) {
                        continue;
                    }
                    let _ = local.record(sent.elapsed().as_micros() as u64);
                    match code {
                        Some(1) => ok.fetch_add(1, Ordering::Relaxed),
                        Some(_) => over.fetch_add(1, Ordering::Relaxed),
                        None => errors.fetch_add(1, Ordering::Relaxed),
                    };
                }
                histogram.lock().unwrap().add(&local).unwrap();
            }));
        }
    }
    tokio::time::sleep(args.warmup).await;
    measuring.store(true, Ordering::SeqCst);
    let start = Instant::now();
    if args.count.is_some() {
        for t in tasks.drain(..) {
            let _ = t.await;
        }
    } else {
        tokio::time::sleep(args.duration).await;
    }
    measuring.store(false, Ordering::SeqCst);
    let elapsed = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        let _ = t.await;
    }
    let h = histogram.lock().unwrap();
    let (ok, over, errors) =
        (ok.load(Ordering::SeqCst), over.load(Ordering::SeqCst), errors.load(Ordering::SeqCst));
    let total = ok + over + errors;
    println!(
        "requests={total} sent={} rps={:.0} decisions_per_s={:.0} ok={ok} over_limit={over} errors={errors} p50_us={} p99_us={} p999_us={} max_us={}",
        sent_total.load(Ordering::SeqCst),
        total as f64 / elapsed,
        total as f64 * args.per_request as f64 / elapsed,
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.value_at_quantile(0.999),
        h.max()
    );
}

// The gRPC request body: a 5-byte prefix (uncompressed, length) and the message.
fn framed(request: &RateLimitRequest) -> Bytes {
    let message = request.encode_to_vec();
    let mut body = Vec::with_capacity(5 + message.len());
    body.push(0);
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(&message);
    body.into()
}

// One ShouldRateLimit call over raw HTTP/2; the response's overall_code, or None on any error.
async fn call(client: h2::client::SendRequest<Bytes>, uri: http::Uri, body: Bytes) -> Option<i32> {
    let request = http::Request::post(uri)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let mut client = client.ready().await.ok()?;
    let (response, mut stream) = client.send_request(request, false).ok()?;
    stream.send_data(body, true).ok()?;
    let response = response.await.ok()?;
    if response.headers().get("grpc-status").is_some_and(|s| s != "0") {
        return None;
    }
    let mut body = response.into_body();
    let mut data = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.ok()?;
        let _ = body.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await.ok()?;
    if trailers.as_ref().and_then(|t| t.get("grpc-status")).is_some_and(|s| s != "0") {
        return None;
    }
    // overall_code is field 1, encoded first; absent means 0 (UNKNOWN).
    match data.get(5..7) {
        Some([0x08, code]) => Some(i32::from(*code)),
        _ => Some(0),
    }
}
