//! OpenTelemetry traces through a real Envoy: Envoy's OpenTelemetry tracer and tollgate export
//! to one OTLP receiver, and tollgate's spans join Envoy's trace as children of Envoy's call to
//! the rate-limit service.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const CONFIG: &str =
    "domain: tr\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";

fn loopback() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().unwrap()
}

fn socket(a: SocketAddr) -> Value {
    json!({"socket_address": {"address": a.ip().to_string(), "port_value": a.port()}})
}

fn cluster(name: &str, addr: SocketAddr, http2: bool) -> Value {
    let mut c = json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket(addr)}}]}]},
    });
    if http2 {
        c["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        });
    }
    c
}

/// Envoy tracing every request with its OpenTelemetry tracer, asking tollgate per request.
fn envoy_config(
    listener: SocketAddr,
    admin: SocketAddr,
    tollgate: SocketAddr,
    otlp: SocketAddr,
    upstream: SocketAddr,
) -> Value {
    json!({
        "admin": {"address": socket(admin)},
        "static_resources": {
            "listeners": [{
                "name": "ingress",
                "address": socket(listener),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "ingress",
                        "tracing": {
                            "random_sampling": {"value": 100},
                            "provider": {
                                "name": "envoy.tracers.opentelemetry",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                                    "grpc_service": {"envoy_grpc": {"cluster_name": "otlp"}, "timeout": "1s"},
                                    "service_name": "envoy",
                                },
                            },
                        },
                        "route_config": {"virtual_hosts": [{
                            "name": "all",
                            "domains": ["*"],
                            "routes": [{
                                "match": {"prefix": "/"},
                                "route": {
                                    "cluster": "upstream",
                                    "rate_limits": [{"actions": [{"request_headers": {"header_name": "x-tenant", "descriptor_key": "tenant"}}]}],
                                },
                            }],
                        }]},
                        "http_filters": [
                            {
                                "name": "envoy.filters.http.ratelimit",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                                    "domain": "tr",
                                    "failure_mode_deny": true,
                                    "timeout": "2s",
                                    "rate_limit_service": {
                                        "transport_api_version": "V3",
                                        "grpc_service": {"envoy_grpc": {"cluster_name": "tollgate"}},
                                    },
                                },
                            },
                            {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
                        ],
                    },
                }]}],
            }],
            "clusters": [cluster("tollgate", tollgate, true), cluster("otlp", otlp, true), cluster("upstream", upstream, false)],
        },
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn tollgate_spans_join_envoys_trace() {
    let receiver = OtlpReceiver::start().await;
    let (_dir, config) = config_file(CONFIG);
    let endpoint = format!("http://{}", receiver.addr);
    let tollgate = Tollgate::start(&config, &Backend::Memory, &["--otlp-endpoint", &endpoint]);
    let upstream = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(listener, axum::Router::new().fallback(|| async { "upstream ok" })).await.unwrap()
        });
        addr
    };
    let (listener, admin) = (loopback(), loopback());
    let _envoy = Envoy::start(&envoy_config(listener, admin, tollgate.grpc, receiver.addr, upstream), admin);

    let r = tokio::task::spawn_blocking(move || http_request(listener, "/", &[("x-tenant", "acme-corp")]))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{r:?}");

    // Both export in batches (every 5 s by default): wait, bounded, for the three spans.
    let deadline = Instant::now() + Duration::from_secs(30);
    let (decision, store, parent) = loop {
        let spans = receiver.spans();
        let decision = spans.iter().find(|s| s.service == "tollgate" && s.span.name == "ratelimit").cloned();
        let found = decision.and_then(|d| {
            let store = spans
                .iter()
                .find(|s| s.span.name == "store.evaluate" && s.span.parent_span_id == d.span.span_id)?;
            let parent =
                spans.iter().find(|s| s.service == "envoy" && s.span.span_id == d.span.parent_span_id)?;
            Some((d.clone(), store.clone(), parent.clone()))
        });
        if let Some(found) = found {
            break found;
        }
        assert!(
            Instant::now() < deadline,
            "no joined trace within 30 s; received: {:#?}",
            spans
                .iter()
                .map(|s| (&s.service, &s.span.name, hex(&s.span.span_id), hex(&s.span.parent_span_id)))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!(
        "envoy span {:?} -> tollgate {:?} -> {:?}",
        parent.span.name, decision.span.name, store.span.name
    );
    assert_eq!(decision.span.trace_id, parent.span.trace_id, "one trace");
    assert_eq!(store.span.trace_id, parent.span.trace_id);
    assert_eq!(decision.attribute("domain").as_deref(), Some("tr"));
    assert_eq!(decision.attribute("outcome").as_deref(), Some("ok"));
    assert_eq!(decision.attribute("rules").as_deref(), Some("tenant"));
    let tenant = decision.attribute("tenant").expect("a tenant attribute");
    assert!(tenant.len() == 8 && !tenant.contains("acme"), "hashed, not the id: {tenant}");
    assert_eq!(store.attribute("outcome").as_deref(), Some("ok"));
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Each call setting RLQS leases is a trace of its own, with its store call as a child.
#[tokio::test(flavor = "multi_thread")]
async fn rlqs_leases_are_traced() {
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};

    let receiver = OtlpReceiver::start().await;
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let endpoint = format!("http://{}", receiver.addr);
    let tollgate = Tollgate::start(&config, &Backend::Redis(redis.url()), &["--otlp-endpoint", &endpoint]);
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{}", tollgate.grpc)).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let id = BucketId { bucket: [("tenant".to_string(), "acme".to_string())].into_iter().collect() };
    tx.send(RateLimitQuotaUsageReports {
        domain: "tr".into(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(id),
            time_elapsed: None,
            num_requests_allowed: 0,
            num_requests_denied: 1,
        }],
    })
    .await
    .unwrap();
    let mut answers = client
        .stream_rate_limit_quotas(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), answers.message()).await.unwrap().unwrap();
    assert!(first.is_some(), "an assignment");

    let deadline = Instant::now() + Duration::from_secs(30);
    let (lease, calls) = loop {
        let spans = receiver.spans();
        let lease =
            spans.iter().find(|s| s.span.name == "rlqs.lease" && s.attribute("failed").is_some()).cloned();
        if let Some(lease) = lease {
            let calls: Vec<ReceivedSpan> = spans
                .iter()
                .filter(|s| s.span.name == "store.lease" && s.span.parent_span_id == lease.span.span_id)
                .cloned()
                .collect();
            if !calls.is_empty() {
                break (lease, calls);
            }
        }
        assert!(Instant::now() < deadline, "no traced lease within 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(lease.span.parent_span_id.is_empty(), "a lease call starts its own trace");
    assert_eq!(lease.attribute("leases").as_deref(), Some("1"));
    assert_eq!(lease.attribute("failed").as_deref(), Some("0"));
    assert!(calls.iter().all(|c| c.attribute("outcome").as_deref() == Some("ok")), "{calls:?}");
    drop(tx);
}
