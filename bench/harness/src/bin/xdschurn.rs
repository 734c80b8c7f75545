//! `xdschurn --listen ADDR --pushes P --domains D --every MS`: a control plane churning domains.
//! An ADS server (the walkthrough's, `examples/xds-server/ads.rs`) pushes P versions, each of D
//! domains never seen before (one rule each), one every MS milliseconds once the previous is
//! answered, then a last version of one domain; it prints how many pushes were ACKed and NACKed
//! and how long the last took to be ACKed (`ONLY=hostile bench/run` measures tollgate's memory
//! and /metrics beside it). Envoy Gateway names descriptor keys after routes, so ordinary route
//! churn does this slowly.

#[allow(dead_code)] // the walkthrough's server uses parts this one does not
#[path = "../../../../examples/xds-server/ads.rs"]
mod ads;

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use tokio::sync::watch;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    listen: std::net::SocketAddr,
    #[arg(long, default_value_t = 92)]
    pushes: usize,
    #[arg(long, default_value_t = 2_000)]
    domains: usize,
    #[arg(long, default_value_t = 300)]
    every: u64,
}

// How the client answered `version`, among the requests it sent from index `from` on: an ACK
// of it (true), a NACK (false), or nothing yet.
fn answered(log: &ads::Log, version: &str, from: usize) -> Option<bool> {
    let requests = log.requests.lock().unwrap();
    requests.get(from..)?.iter().find_map(|r| match (&r.error_detail, r.response_nonce.is_empty()) {
        (Some(_), _) => Some(false),
        (None, false) if r.version_info == version => Some(true),
        _ => None,
    })
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
    let snapshot = watch::Sender::new(ads::Snapshot::None);
    let log = Arc::new(ads::Log::default());
    let service = ads::Ads { snapshot: snapshot.subscribe(), log: log.clone() };
    let listener = tokio::net::TcpListener::bind(a.listen).await.unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AggregatedDiscoveryServiceServer::new(service))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let config = |name: String| {
        let yaml = format!("domain: {name}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: 10}}\n");
        ads::rate_limit_config(&name, &yaml).unwrap()
    };
    let (mut acked, mut nacked) = (0, 0);
    let started = Instant::now();
    for p in 0..=a.pushes {
        let configs: Vec<_> = if p == a.pushes {
            vec![config("last".into())]
        } else {
            (0..a.domains).map(|d| config(format!("churn-{p}-{d}"))).collect()
        };
        let name = format!("v{p}");
        let sent = Instant::now();
        let from = log.requests.lock().unwrap().len();
        snapshot.send_replace(Some((name.clone(), ads::resources(&configs))));
        // The answer (a paced push is ACKed late): 5 minutes at most.
        let mut answer = None;
        while answer.is_none() && sent.elapsed() < Duration::from_secs(300) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            answer = answered(&log, &name, from);
        }
        match answer {
            Some(true) => acked += 1,
            _ => nacked += 1,
        }
        if p == a.pushes {
            println!(
                "pushes={} domains={} acked={acked} nacked={nacked} last_acked_in_ms={} took_s={:.0}",
                a.pushes + 1,
                a.domains,
                sent.elapsed().as_millis(),
                started.elapsed().as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(a.every)).await;
    }
}
