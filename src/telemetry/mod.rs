//! What operators see: structured logs ([`logs`]), Prometheus metrics ([`Telemetry`]) and, when
//! configured, OTLP traces ([`traces`]).

pub mod logs;
mod metrics;
mod records;
pub mod top_denied;
pub mod traces;

pub use self::metrics::{
    add_rlqs_leaseholders, count_rlqs_lease, failure_label, register_domains, Kind, Telemetry,
    TelemetryConfig, LABELLED_BY_TRAFFIC, LATENCY_BUCKETS, METRICS, UNKNOWN_DOMAIN,
};
