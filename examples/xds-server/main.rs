//! A small xDS management server for trying tollgate's xDS config client on one machine, the
//! way Envoy Gateway drives envoyproxy/ratelimit: every `*.yaml` file of a directory is a
//! `RateLimitConfig` (the file syntax: `domain:` and `descriptors:`, named after the file), and
//! every change to the directory is pushed to every connected client as a new version.
//! Clients' ACKs and NACKs are printed as they come.
//!
//! ```text
//! cargo run --example xds-server -- examples/xds-server/configs
//! ```
//!
//! The walkthrough is in the book: "Replace envoyproxy/ratelimit in Envoy Gateway".

mod ads;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ads::{Ads, Log, Snapshot};
use clap::Parser;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use tokio::sync::watch;

#[derive(Parser)]
struct Args {
    /// Where to serve ADS.
    #[arg(long, default_value = "127.0.0.1:18001")]
    listen: SocketAddr,
    /// The directory of RateLimitConfig files.
    dir: PathBuf,
}

// The directory's YAML files, by name.
fn read(dir: &PathBuf) -> std::io::Result<BTreeMap<String, String>> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            let name = path.file_stem().unwrap_or_default().to_string_lossy().into_owned();
            files.insert(name, std::fs::read_to_string(&path)?);
        }
    }
    Ok(files)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let snapshot = watch::Sender::new(Snapshot::None);
    let log = Arc::new(Log::default());
    let service = Ads { snapshot: snapshot.subscribe(), log: log.clone() };
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("xDS (ADS, state of the world) on {}, serving {}", args.listen, args.dir.display());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AggregatedDiscoveryServiceServer::new(service))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    // Print what clients said since the last look, then poll the directory: a push per change.
    let (mut version, mut last, mut seen) = (0u64, None, 0usize);
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
        let requests = log.requests.lock().unwrap().clone();
        for r in &requests[seen..] {
            let node = r.node.as_ref().map_or("?", |n| n.id.as_str());
            match (&r.error_detail, r.response_nonce.is_empty()) {
                (Some(error), _) => println!("{node}: NACK, keeps {:?}: {}", r.version_info, error.message),
                (None, true) => println!("{node}: subscribed (has {:?})", r.version_info),
                (None, false) => println!("{node}: ACK {}", r.version_info),
            }
        }
        seen = requests.len();
        match read(&args.dir) {
            Ok(files) if Some(&files) != last.as_ref() => {
                let configs: Result<Vec<_>, String> = files
                    .iter()
                    .map(|(name, text)| {
                        ads::rate_limit_config(name, text).map_err(|e| format!("{name}: {e}"))
                    })
                    .collect();
                match configs {
                    Ok(configs) => {
                        version += 1;
                        let domains: Vec<&str> = configs.iter().map(|c| c.domain.as_str()).collect();
                        snapshot.send_replace(Some((format!("v{version}"), ads::resources(&configs))));
                        println!("pushed v{version}: {}", domains.join(", "));
                    }
                    Err(e) => println!("not pushed: {e}"),
                }
                last = Some(files);
            }
            Ok(_) => {}
            Err(e) => println!("cannot read {}: {e}", args.dir.display()),
        }
    }
}
