//! The core of a neutral xDS management server for envoyproxy/ratelimit's `RateLimitConfig`, as
//! Envoy Gateway's control plane serves it: gRPC ADS, state of the world.
//!
//! Shared by the walkthrough's server (`main.rs` beside this file) and the tests' harness
//! (`tests/common/xds.rs`), so that what the book shows is what the tests drive. Every stream
//! gets the current snapshot, and every change of it, with a fresh nonce; every request a client
//! sends (its first, its ACKs and NACKs) is kept in the [`Log`].

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryService;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitReplace, RateLimitUnit,
};
use prost::{Message as _, Name as _};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// What the server sends: a version and its resources (none before the first push).
pub type Snapshot = Option<(String, Vec<Any>)>;

/// What clients did: every request, in order, and how many streams they opened.
#[derive(Default)]
pub struct Log {
    pub requests: Mutex<Vec<DiscoveryRequest>>,
    pub streams: AtomicU32,
}

/// The ADS service: sends `snapshot` to every stream, records into `log`.
pub struct Ads {
    pub snapshot: watch::Receiver<Snapshot>,
    pub log: Arc<Log>,
}

/// `configs` as the resources of a response.
pub fn resources(configs: &[RateLimitConfig]) -> Vec<Any> {
    configs.iter().map(|c| Any { type_url: RateLimitConfig::type_url(), value: c.encode_to_vec() }).collect()
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        self.log.streams.fetch_add(1, Ordering::SeqCst);
        let mut incoming = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let (log, mut snapshot) = (self.log.clone(), self.snapshot.clone());
        tokio::spawn(async move {
            // The first request says who asks; then every change of the snapshot is sent.
            let Ok(Some(first)) = incoming.message().await else { return };
            log.requests.lock().unwrap().push(first);
            let requests = log.clone();
            tokio::spawn(async move {
                while let Ok(Some(request)) = incoming.message().await {
                    requests.requests.lock().unwrap().push(request);
                }
            });
            let mut nonce = 0u64;
            snapshot.mark_changed();
            while snapshot.changed().await.is_ok() {
                let Some((version, resources)) = snapshot.borrow_and_update().clone() else { continue };
                nonce += 1;
                let response = DiscoveryResponse {
                    version_info: version,
                    resources,
                    type_url: RateLimitConfig::type_url(),
                    nonce: nonce.to_string(),
                    ..Default::default()
                };
                if tx.send(Ok(response)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        _: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented("state of the world only"))
    }
}

/// A `RateLimitConfig` from the file syntax (or Envoy Gateway's dump of one: `rate_limit: null`,
/// upper-case units, fields the proto lacks are ignored), named `name`.
pub fn rate_limit_config(name: &str, yaml: &str) -> Result<RateLimitConfig, String> {
    let file: serde_json::Value = serde_saphyr::from_str(yaml).map_err(|e| e.to_string())?;
    // The proto has no word for a unit it does not know (it would go out as UNKNOWN, and the
    // NACK could not name what was written): refused here, by the name written.
    if let Some(unit) = unknown_unit(&file["descriptors"]) {
        return Err(format!("unit: {unit:?} is not one of second, minute, hour, day, week, month, year"));
    }
    Ok(RateLimitConfig {
        name: name.to_owned(),
        domain: file["domain"].as_str().unwrap_or_default().to_owned(),
        descriptors: descriptors(&file["descriptors"]),
    })
}

// The first `unit` under `list` that RateLimitUnit does not name.
fn unknown_unit(list: &serde_json::Value) -> Option<String> {
    list.as_array()?.iter().find_map(|d| {
        let unit = d["rate_limit"]["unit"]
            .as_str()
            .filter(|u| RateLimitUnit::from_str_name(&u.to_ascii_uppercase()).is_none());
        unit.map(str::to_owned).or_else(|| unknown_unit(&d["descriptors"]))
    })
}

fn descriptors(list: &serde_json::Value) -> Vec<RateLimitDescriptor> {
    let Some(list) = list.as_array() else { return Vec::new() };
    list.iter()
        .map(|d| RateLimitDescriptor {
            key: d["key"].as_str().unwrap_or_default().to_owned(),
            value: d["value"].as_str().unwrap_or_default().to_owned(),
            rate_limit: d.get("rate_limit").filter(|r| !r.is_null()).map(|r| RateLimitPolicy {
                unit: r["unit"]
                    .as_str()
                    .and_then(|u| RateLimitUnit::from_str_name(&u.to_ascii_uppercase()))
                    .unwrap_or(RateLimitUnit::Unknown) as i32,
                requests_per_unit: r["requests_per_unit"].as_u64().unwrap_or(0) as u32,
                unlimited: r["unlimited"].as_bool().unwrap_or(false),
                name: r["name"].as_str().unwrap_or_default().to_owned(),
                replaces: r["replaces"]
                    .as_array()
                    .map(|l| {
                        l.iter()
                            .map(|x| RateLimitReplace {
                                name: x["name"].as_str().unwrap_or_default().to_owned(),
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            }),
            descriptors: descriptors(&d["descriptors"]),
            shadow_mode: d["shadow_mode"].as_bool().unwrap_or(false),
            detailed_metric: d["detailed_metric"].as_bool().unwrap_or(false),
            quota_mode: d["quota_mode"].as_bool().unwrap_or(false),
            metadata: None,
        })
        .collect()
}
