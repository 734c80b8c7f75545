//! What operators see: structured logs ([`logs`]), Prometheus metrics ([`Telemetry`]) and, when
//! configured, OTLP traces ([`traces`]); envoyproxy/ratelimit's metrics under its names, as
//! statsd or mapped for Prometheus ([`ratelimit_stats`], [`mapper`]).

pub mod logs;
pub mod mapper;
mod metrics;
pub mod ratelimit_stats;
mod records;
pub mod series;
pub mod top_denied;
pub mod traces;

pub use self::metrics::{
    add_rlqs_leaseholders, count_rlqs_lease, failure_label, register_domains, Kind, Telemetry,
    TelemetryConfig, LABELLED_BY_TRAFFIC, LATENCY_BUCKETS, METRICS, UNKNOWN_DOMAIN,
};

/// Counts a config load (files or a push) under envoyproxy/ratelimit's names.
pub fn count_config_load(ok: bool) {
    if let Some(stats) = ratelimit_stats::stats() {
        stats.count(if ok {
            "ratelimit.service.config_load_success"
        } else {
            "ratelimit.service.config_load_error"
        });
    }
}
