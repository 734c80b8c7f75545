//! Distributed traces, exported over OTLP/gRPC when an endpoint is configured (off otherwise).
//!
//! Spans:
//! * `ratelimit` (kind server): one per `ShouldRateLimit` call, with `domain`, `descriptors`,
//!   `outcome` (ok, over_limit, error), `rules` (the config paths of the rules that applied:
//!   bounded by the config) and `tenant` (a short hash, never the id: bounded and not personal,
//!   as the metrics' tenant labels are). Its parent is the caller's span, taken from the W3C
//!   `traceparent` of the gRPC metadata ([`continue_from`]): with Envoy's OpenTelemetry tracer,
//!   Envoy's ratelimit span.
//! * `store.evaluate`: each store call of a decision (`buckets`, `outcome`), a child of the
//!   decision's span;
//! * `rlqs.lease`: each call that sets RLQS streams' leases on buckets (`leases`, `failed`), a
//!   trace of its own (no request leads to it), with its store call as the child `store.lease`
//!   (`buckets`, `outcome`).
//!
//! The spans are declared at level TRACE under the target [`TARGET`], and only the OTLP layer
//! listens to that target: with tracing off (or `RUST_LOG` not asking for it) a span costs one
//! check of a cached interest, and its fields are not even computed.

use std::hash::{Hash, Hasher};
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::{Filtered, Targets};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// The target of tollgate's trace spans.
pub const TARGET: &str = "tollgate::trace";

/// Longest an export may take before it is abandoned.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why traces cannot be exported.
#[derive(Debug, thiserror::Error)]
#[error("OTLP exporter for {endpoint}: {source}")]
pub struct TracesError {
    endpoint: String,
    #[source]
    source: opentelemetry_otlp::ExporterBuildError,
}

/// The OTLP pipeline. Dropping it flushes what is buffered and stops the exporter (call it
/// outside the runtime's tasks, with the runtime still running: the exporter is one of them).
pub struct Traces {
    provider: SdkTracerProvider,
}

impl Traces {
    /// Starts exporting to `endpoint` (OTLP/gRPC, e.g. `http://collector:4317`). The batching
    /// exporter runs as a task of the current Tokio runtime.
    pub fn start(endpoint: &str) -> Result<Traces, TracesError> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|source| TracesError { endpoint: endpoint.to_owned(), source })?;
        let processor = BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
        // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES still apply; the default name is ours.
        let resource = Resource::builder().with_service_name("tollgate").build();
        let provider =
            SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource).build();
        Ok(Traces { provider })
    }

    /// The layer that turns tollgate's spans (and only those) into OTLP spans.
    pub fn layer<S>(
        &self,
    ) -> Filtered<tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>, Targets, S>
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("tollgate"))
            .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE))
    }
}

impl Drop for Traces {
    fn drop(&mut self) {
        if let Err(error) = self.provider.shutdown() {
            eprintln!("tollgate: flushing traces: {error}");
        }
    }
}

/// Makes `span` a child of the caller's span named by W3C trace context (`traceparent`,
/// `tracestate`) in gRPC `metadata`; without one, `span` starts a trace.
pub fn continue_from(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    if span.is_disabled() || metadata.get("traceparent").is_none() {
        return;
    }
    let context = TraceContextPropagator::new().extract(&Metadata(metadata));
    // Only fails for a span the OpenTelemetry layer does not know, i.e. tracing is off.
    let _ = span.set_parent(context);
}

/// A short, stable stand-in for a tenant id in spans.
pub fn tenant_hash(tenant: &str) -> String {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    tenant.hash(&mut hasher);
    format!("{:08x}", hasher.finish() as u32)
}

// gRPC metadata read as a carrier of trace context.
struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}
