//! An OTLP/gRPC trace receiver on loopback: what Envoy and tollgate export lands here.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;

/// A span as received, with its resource's `service.name`.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service: String,
    pub span: Span,
}

impl ReceivedSpan {
    /// A string attribute of the span.
    pub fn attribute(&self, key: &str) -> Option<String> {
        string_attribute(&self.span.attributes, key)
    }
}

fn string_attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    let value = attributes.iter().find(|kv| kv.key == key)?.value.as_ref()?.value.as_ref()?;
    Some(match value {
        AnyValue::StringValue(s) => s.clone(),
        AnyValue::IntValue(n) => n.to_string(),
        AnyValue::BoolValue(b) => b.to_string(),
        AnyValue::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    })
}

/// The receiver; it stops when dropped.
pub struct OtlpReceiver {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    task: tokio::task::JoinHandle<()>,
}

struct Collect(Arc<Mutex<Vec<ReceivedSpan>>>);

#[tonic::async_trait]
impl TraceService for Collect {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .as_ref()
                .and_then(|r| string_attribute(&r.attributes, "service.name"))
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    spans.push(ReceivedSpan { service: service.clone(), span });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans: Arc<Mutex<Vec<ReceivedSpan>>> = Arc::default();
        let service = TraceServiceServer::new(Collect(spans.clone()));
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await;
        });
        OtlpReceiver { addr, spans, task }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap().clone()
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
