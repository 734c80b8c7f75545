//! Metrics (`USE_STATSD`, `USE_PROMETHEUS`, ...) and traces (`TRACING_*`).

use super::{address, Flag, Translation, Var};

pub(super) fn stats(
    get: &dyn Fn(&str) -> Option<String>,
    var: &Var<'_>,
    flag: &Flag<'_>,
    t: &mut Translation,
) -> Result<(), String> {
    if flag("DISABLE_STATS", false)? == Some(true) && get("DISABLE_STATS").is_some() {
        return Ok(());
    }
    if flag("USE_STATSD", true)? == Some(true) {
        let host = var("STATSD_HOST", "localhost").unwrap_or_else(|| "localhost".into());
        let port = var("STATSD_PORT", "8125").unwrap_or_else(|| "8125".into());
        t.set.insert("TOLLGATE_STATSD", format!("{host}:{port}"));
    }
    if flag("USE_PROMETHEUS", false)? == Some(true) {
        let addr = var("PROMETHEUS_ADDR", ":9090").unwrap_or_else(|| ":9090".into());
        let (host, port) =
            addr.rsplit_once(':').ok_or_else(|| format!("PROMETHEUS_ADDR={addr}: host:port"))?;
        t.set.insert("TOLLGATE_PROMETHEUS_ADDR", address(host, port));
        t.copy(
            get,
            &[
                ("PROMETHEUS_PATH", "TOLLGATE_PROMETHEUS_PATH"),
                ("PROMETHEUS_MAPPER_YAML", "TOLLGATE_PROMETHEUS_MAPPER"),
            ],
        );
    }
    t.copy(get, &[("STATS_FLUSH_INTERVAL", "TOLLGATE_STATS_FLUSH_INTERVAL")]);
    Ok(())
}

pub(super) fn tracing(
    get: &dyn Fn(&str) -> Option<String>,
    flag: &Flag<'_>,
    t: &mut Translation,
) -> Result<(), String> {
    if flag("TRACING_ENABLED", false)? != Some(true) || get("TRACING_ENABLED").is_none() {
        return Ok(());
    }
    if get("TRACING_EXPORTER_PROTOCOL").is_some_and(|p| !p.eq_ignore_ascii_case("grpc")) {
        t.ignored.push("TRACING_EXPORTER_PROTOCOL: tollgate exports OTLP over gRPC".into());
    }
    if get("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() {
        t.set.insert("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317".into());
    }
    t.copy(get, &[("TRACING_SERVICE_NAME", "OTEL_SERVICE_NAME")]);
    let attributes: Vec<String> = [
        ("TRACING_SERVICE_NAMESPACE", "service.namespace"),
        ("TRACING_SERVICE_INSTANCE_ID", "service.instance.id"),
    ]
    .iter()
    .filter_map(|(from, key)| get(from).filter(|v| !v.is_empty()).map(|v| format!("{key}={v}")))
    .collect();
    if !attributes.is_empty() {
        t.set.insert("OTEL_RESOURCE_ATTRIBUTES", attributes.join(","));
    }
    if let Some(rate) = get("TRACING_SAMPLING_RATE").filter(|v| !v.is_empty()) {
        t.set.insert("OTEL_TRACES_SAMPLER", "parentbased_traceidratio".into());
        t.set.insert("OTEL_TRACES_SAMPLER_ARG", rate);
    }
    Ok(())
}
