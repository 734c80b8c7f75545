//! The xDS config client: rate-limit rules pushed by a control plane, as envoyproxy/ratelimit
//! takes them from Envoy Gateway (`CONFIG_TYPE=GRPC_XDS_SOTW`).
//!
//! One Aggregated Discovery Service stream, state of the world, subscribed to every
//! `ratelimit.config.ratelimit.v3.RateLimitConfig` for this node. Each response is the whole
//! pushed config: its resources are compiled together ([`resource`], then the same compiler as
//! files) and swapped in by the [`Reloader`], then ACKed with the response's version and nonce. A
//! response that does not decode or compile is NACKed, with the error in `error_detail`, logged
//! once and counted; the rules in force stay. A broken stream keeps the rules in force and is
//! opened again after a backoff (exponential from `initial` to `max`, each delay spread by
//! `random_factor` when `jitter` is on); a stream that got a response starts the backoff over.
//! The first request of every stream carries the version in force, so that a server which
//! already sent it may answer with nothing new.
//!
//! Dropping the returned handle stops the client.

pub mod resource;

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use envoy_types::pb::google::rpc::Status;
use envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitConfig;
use prost::{Message as _, Name as _};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::AbortOnDropHandle;
use tonic::metadata::{MetadataKey, MetadataValue};
use tonic::transport::{Channel, Endpoint};

use crate::config::Sources;
use crate::edge::client_tls::ClientTlsFiles;
use crate::reload::{PushError, PushLimits, Reloader};
use crate::telemetry::logs::ErrorChain;

/// Where the control plane is and how to talk to it.
#[derive(Debug, Clone)]
pub struct XdsSettings {
    /// `host:port`, or a URL (`http://`, `https://`).
    pub server: String,
    /// The node id the server keys its snapshots by.
    pub node_id: String,
    /// The node's metadata: string fields.
    pub node_metadata: Vec<(String, String)>,
    /// Headers sent on the stream (e.g. a token).
    pub headers: Vec<(String, String)>,
    /// TLS to the server; `None` for plaintext.
    pub tls: Option<ClientTlsFiles>,
    /// Reconnection pacing.
    pub backoff: Backoff,
    /// Largest response accepted, in bytes (tonic's default, 4 MiB, when `None`); one up to
    /// twice as large is read and NACKed with the reason, a larger one breaks the stream.
    pub max_message_bytes: Option<usize>,
    /// What a push may bring.
    pub limits: PushLimits,
}

/// tonic's own default limit on a message.
const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Delays between attempts to open the stream.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// The first delay.
    pub initial: Duration,
    /// The longest delay.
    pub max: Duration,
    /// How far a delay is spread, both ways, as a fraction of itself.
    pub random_factor: f64,
    /// Spread the delays at all.
    pub jitter: bool,
}

impl Backoff {
    /// envoyproxy/ratelimit's defaults (`XDS_CLIENT_BACKOFF_*`).
    pub const DEFAULT: Backoff = Backoff {
        initial: Duration::from_secs(10),
        max: Duration::from_secs(60),
        random_factor: 0.5,
        jitter: true,
    };

    /// The delay before attempt `attempt` (0 for the first retry).
    pub fn delay(&self, attempt: u32) -> Duration {
        let base = self.initial.saturating_mul(2u32.saturating_pow(attempt.min(31))).min(self.max);
        if !self.jitter || self.random_factor <= 0.0 {
            return base;
        }
        let spread = self.random_factor.min(1.0);
        base.mul_f64(1.0 + spread * (2.0 * rand::random::<f64>() - 1.0))
    }
}

/// The resource type this client subscribes to.
pub fn type_url() -> String {
    RateLimitConfig::type_url()
}

/// Why a stream ended or could not open.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    /// The server's address or TLS settings are unusable.
    #[error("xDS server settings: {0}")]
    Settings(String),
    /// No connection.
    #[error("cannot connect to the xDS server {server}: {source}")]
    Connect {
        /// The server.
        server: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The stream failed or the server refused it.
    #[error("xDS stream: {0}")]
    Stream(#[source] tonic::Status),
    /// The server closed the stream.
    #[error("the xDS server closed the stream")]
    Closed,
}

/// Starts the client: it runs until the handle is dropped. Fails at once only for settings
/// that can never work (TLS files unreadable, a malformed address).
pub fn start(settings: XdsSettings, reloader: Arc<Reloader>) -> Result<AbortOnDropHandle<()>, XdsError> {
    let endpoint = endpoint(&settings)?;
    Ok(AbortOnDropHandle::new(tokio::spawn(run(settings, endpoint, reloader))))
}

async fn run(settings: XdsSettings, endpoint: Endpoint, reloader: Arc<Reloader>) {
    let mut accepted = String::new();
    let mut attempt = 0;
    loop {
        tracing::info!(server = %settings.server, node = %settings.node_id, "opening the xDS stream for rate-limit configs");
        let mut answered = false;
        let ended = stream(&settings, &endpoint, &reloader, &mut accepted, &mut answered).await;
        if answered {
            attempt = 0;
        }
        let delay = settings.backoff.delay(attempt);
        attempt = attempt.saturating_add(1);
        metrics::counter!("tollgate_xds_stream_failures_total").increment(1);
        tracing::warn!(error = %ErrorChain(&ended), retry_in = ?delay, version = %accepted, "xDS stream down; the config in force keeps serving");
        tokio::time::sleep(delay).await;
    }
}

// One stream, until it breaks: the error says how.
async fn stream(
    settings: &XdsSettings,
    endpoint: &Endpoint,
    reloader: &Arc<Reloader>,
    accepted: &mut String,
    answered: &mut bool,
) -> XdsError {
    let channel: Channel = match endpoint.connect().await {
        Ok(channel) => channel,
        Err(source) => return XdsError::Connect { server: settings.server.clone(), source },
    };
    // Read up to twice the limit, so that a response over it is NACKed with the reason rather
    // than breaking the stream where the control plane never learns why.
    let max = settings.max_message_bytes.unwrap_or(DEFAULT_MAX_MESSAGE_BYTES);
    let mut client =
        AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(max.saturating_mul(2));
    let (requests, outgoing) = mpsc::channel(4);
    let node = node(settings);
    let first = DiscoveryRequest {
        version_info: accepted.clone(),
        node: Some(node.clone()),
        type_url: type_url(),
        ..Default::default()
    };
    let _ = requests.try_send(first);
    let mut request = tonic::Request::new(ReceiverStream::new(outgoing));
    for (name, value) in &settings.headers {
        // Checked when the settings were made.
        if let (Ok(name), Ok(value)) =
            (MetadataKey::from_bytes(name.as_bytes()), MetadataValue::try_from(value))
        {
            request.metadata_mut().insert(name, value);
        }
    }
    let mut responses = match client.stream_aggregated_resources(request).await {
        Ok(response) => response.into_inner(),
        Err(status) => return XdsError::Stream(status),
    };
    let mut nacks = NackLog::default();
    loop {
        let response = match responses.message().await {
            Ok(Some(response)) => response,
            Ok(None) => return XdsError::Closed,
            Err(status) => return XdsError::Stream(status),
        };
        *answered = true;
        let reply = answer(settings, reloader, &response, accepted, &mut nacks).await;
        if requests.send(DiscoveryRequest { node: Some(node.clone()), ..reply }).await.is_err() {
            return XdsError::Closed;
        }
    }
}

// Applies one response and says what to answer: an ACK of its version, or a NACK of it that
// keeps the version in force.
async fn answer(
    settings: &XdsSettings,
    reloader: &Arc<Reloader>,
    response: &DiscoveryResponse,
    accepted: &mut String,
    nacks: &mut NackLog,
) -> DiscoveryRequest {
    let ack = |version: &str, error_detail| DiscoveryRequest {
        version_info: version.to_owned(),
        type_url: type_url(),
        response_nonce: response.nonce.clone(),
        error_detail,
        ..Default::default()
    };
    let max = settings.max_message_bytes.unwrap_or(DEFAULT_MAX_MESSAGE_BYTES);
    let size = response.encoded_len();
    let applied = if size > max {
        Err(format!("the response is {size} bytes, over the limit of {max} (--xds-max-message-bytes)"))
    } else {
        match decode(response) {
            Ok(pushed) => apply(reloader, pushed, settings.limits).await,
            Err(problem) => Err(problem),
        }
    };
    crate::telemetry::count_config_load(applied.is_ok());
    metrics::gauge!("tollgate_config_last_reload_successful").set(if applied.is_ok() { 1.0 } else { 0.0 });
    match applied {
        Ok(dropped) => {
            metrics::counter!("tollgate_xds_updates_total", "result" => "accepted").increment(1);
            if !dropped.is_empty() {
                metrics::counter!("tollgate_xds_domains_removed_total").increment(dropped.len() as u64);
                tracing::warn!(version = %response.version_info, domains = ?dropped, "xDS config accepted; it drops these domains, no longer limited");
            }
            tracing::info!(version = %response.version_info, resources = response.resources.len(), "xDS config accepted");
            accepted.clone_from(&response.version_info);
            ack(accepted, None)
        }
        Err(problem) => {
            metrics::counter!("tollgate_xds_updates_total", "result" => "rejected").increment(1);
            // A control plane may push the same bad config in a loop: each version once, its
            // repeats once every NACK_LOG_EVERY with how many went unlogged.
            if let Some(held_back) = nacks.log(&response.version_info, Instant::now()) {
                tracing::error!(version = %response.version_info, error = %problem, in_force = %accepted, nacks_not_logged = held_back, "xDS config rejected (NACK); the config in force keeps serving");
            }
            // INVALID_ARGUMENT, as Envoy NACKs.
            ack(accepted, Some(Status { code: 3, message: problem, details: Vec::new() }))
        }
    }
}

/// Least time between two log lines for NACKs of one version.
const NACK_LOG_EVERY: Duration = Duration::from_secs(10);

// Which NACKs are logged: the first of each version, then one every NACK_LOG_EVERY.
#[derive(Default)]
struct NackLog {
    last: Option<(String, Instant)>,
    held_back: u64,
}

impl NackLog {
    // Whether to log a NACK of `version` now: with how many were not logged since the last line.
    fn log(&mut self, version: &str, now: Instant) -> Option<u64> {
        match &self.last {
            Some((v, at)) if v == version && now.duration_since(*at) < NACK_LOG_EVERY => {
                self.held_back += 1;
                None
            }
            _ => {
                self.last = Some((version.to_owned(), now));
                Some(std::mem::take(&mut self.held_back))
            }
        }
    }
}

// Compiles and swaps in a push, waiting (paced) while the series of earlier pushes fill the
// metrics budget: the control plane sees a late ACK rather than a NACK of a good config. The
// wait ends: the ledger empties within telemetry::series' window and a swap then always fits.
async fn apply(reloader: &Arc<Reloader>, pushed: Sources, limits: PushLimits) -> Result<Vec<String>, String> {
    loop {
        let (reloader, pushed) = (reloader.clone(), pushed.clone());
        match tokio::task::spawn_blocking(move || reloader.push(pushed, &limits)).await {
            Ok(Err(PushError::Churn(wait))) => {
                metrics::counter!("tollgate_xds_pushes_paced_total").increment(1);
                if let Some(held_back) = crate::telemetry::logs::throttled("xds_paced") {
                    tracing::warn!(wait = ?wait, paced_not_logged = held_back, "xDS pushes replace domains and rules faster than their metrics are forgotten: this push waits");
                }
                tokio::time::sleep(wait).await;
            }
            Ok(result) => return result.map_err(|e| ErrorChain(&e).to_string()),
            Err(e) => return Err(format!("compiling the pushed config: {e}")),
        }
    }
}

// The response's resources as config documents, or what is wrong with them.
fn decode(response: &DiscoveryResponse) -> Result<Sources, String> {
    let mut documents = Vec::with_capacity(response.resources.len());
    for any in &response.resources {
        if any.type_url != type_url() {
            return Err(format!("resource of type {} in a response for {}", any.type_url, type_url()));
        }
        let config = RateLimitConfig::decode(any.value.as_slice())
            .map_err(|e| format!("a RateLimitConfig does not decode: {e}"))?;
        documents.push((resource::origin(&config), resource::document(&config)));
    }
    Ok(Sources::pushed(documents))
}

fn node(settings: &XdsSettings) -> Node {
    let fields = settings
        .node_metadata
        .iter()
        .map(|(k, v)| (k.clone(), Value { kind: Some(Kind::StringValue(v.clone())) }))
        .collect();
    #[allow(deprecated)] // build_version: the only field some servers log
    Node {
        id: settings.node_id.clone(),
        metadata: Some(Struct { fields }),
        user_agent_name: "tollgate".into(),
        user_agent_version_type: Some(
            envoy_types::pb::envoy::config::core::v3::node::UserAgentVersionType::UserAgentVersion(
                env!("CARGO_PKG_VERSION").into(),
            ),
        ),
        ..Default::default()
    }
}

// The endpoint of `settings.server`, with its TLS: an unusable setting fails here, at startup.
fn endpoint(settings: &XdsSettings) -> Result<Endpoint, XdsError> {
    let bad = |what: String| XdsError::Settings(what);
    let tls = settings.tls.as_ref();
    let url = if settings.server.contains("://") {
        settings.server.clone()
    } else {
        format!("{}://{}", if tls.is_some() { "https" } else { "http" }, settings.server)
    };
    for (name, value) in &settings.headers {
        MetadataKey::<tonic::metadata::Ascii>::from_bytes(name.as_bytes())
            .map_err(|_| bad(format!("header name {name:?} is not a valid gRPC metadata key")))?;
        MetadataValue::try_from(value.as_str())
            .map_err(|_| bad(format!("header {name}: value is not valid in gRPC metadata")))?;
    }
    let mut endpoint = Endpoint::from_shared(url.clone())
        .map_err(|e| bad(format!("{url}: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        // A server that vanished without closing is noticed, and the stream opened elsewhere.
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true);
    if let Some(tls) = tls {
        let config = tls.config().map_err(bad)?;
        endpoint = endpoint.tls_config(config).map_err(|e| bad(format!("TLS to {url}: {e}")))?;
    }
    Ok(endpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nack_loop_logs_each_version_once_then_rarely() {
        let (mut log, t0) = (NackLog::default(), Instant::now());
        assert_eq!(log.log("v2", t0), Some(0));
        assert_eq!(log.log("v2", t0 + Duration::from_millis(1)), None);
        assert_eq!(log.log("v2", t0 + Duration::from_millis(2)), None);
        assert_eq!(log.log("v3", t0 + Duration::from_millis(3)), Some(2), "a new version is logged");
        assert_eq!(log.log("v3", t0 + Duration::from_millis(4)), None);
        assert_eq!(log.log("v3", t0 + NACK_LOG_EVERY + Duration::from_millis(3)), Some(1));
    }

    #[test]
    fn backoff_grows_to_its_ceiling_and_spreads_within_its_factor() {
        let steady = Backoff { jitter: false, ..Backoff::DEFAULT };
        let secs = |a| steady.delay(a).as_secs();
        assert_eq!([secs(0), secs(1), secs(2), secs(3), secs(40)], [10, 20, 40, 60, 60]);
        for attempt in 0..50 {
            let d = Backoff::DEFAULT.delay(attempt).as_secs_f64();
            let base = steady.delay(attempt).as_secs_f64();
            assert!(d >= base * 0.5 && d <= base * 1.5, "{d} from {base}");
        }
    }
}
