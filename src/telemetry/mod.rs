//! What operators see: structured logs ([`logs`]) and Prometheus metrics ([`Telemetry`]).

pub mod logs;
mod metrics;
pub mod top_denied;

pub use self::metrics::{Kind, Telemetry, TelemetryConfig, LABELLED_BY_TRAFFIC, LATENCY_BUCKETS, METRICS};
