//! `POST /json`: the RLS call for clients that do not speak gRPC, as envoyproxy/ratelimit serves
//! it.
//!
//! The body is a `RateLimitRequest` in protobuf's JSON mapping (field names in lowerCamelCase or
//! as in the .proto, enums by name or number, 64-bit numbers as numbers or strings, unknown
//! fields refused); the answer is the `RateLimitResponse` in the same mapping, with fields at
//! their default value left out. The decision is the gRPC edge's own, through
//! [`RateLimitGrpc::answer`]: same validation, limits, in-flight bound and metrics. The HTTP
//! status says the overall code as the reference does (200 OK, 429 OVER_LIMIT), and the
//! response headers tollgate would add through Envoy (`X-RateLimit-*`, `RateLimit`,
//! `Retry-After`) are also set on the HTTP response. Errors: 400 for a body that is not a valid
//! request (the reason in the body), 413 past [`MAX_BODY_BYTES`], 415 without `Content-Type:
//! application/json` (a browser can send a form or text cross-site without asking first, but not
//! JSON: the header makes it ask, and CORS refuses), 503 when the store is unavailable under
//! `failure_mode: error` or too many decisions are in flight.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use envoy_types::pb::envoy::config::core::v3::HeaderValue as ProtoHeader;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as ProtoUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code as ProtoCode;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::{value::Kind, Duration as ProtoDuration, Struct, UInt64Value};
use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use super::RateLimitGrpc;

/// Largest body accepted: the gRPC edge's largest message (tonic's default, 4 MiB).
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// Answers one `POST /json`.
pub async fn handle(State(rls): State<Arc<RateLimitGrpc>>, headers: HeaderMap, body: Bytes) -> Response {
    let json = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, "POST /json needs Content-Type: application/json\n")
            .into_response();
    }
    let request = match parse(&body) {
        Ok(r) => r,
        Err(message) => {
            metrics::counter!("tollgate_invalid_requests_total").increment(1);
            return (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response();
        }
    };
    let response = match rls.answer(&request).await {
        Ok(r) => r,
        Err(status) => {
            let http = match status.code() {
                tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            return (http, format!("{}\n", status.message())).into_response();
        }
    };
    let http = match ProtoCode::try_from(response.overall_code) {
        Ok(ProtoCode::Ok) => StatusCode::OK,
        Ok(ProtoCode::OverLimit) => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let mut answer = (http, axum::Json(to_json(&response))).into_response();
    for h in &response.response_headers_to_add {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(&h.key), HeaderValue::try_from(&h.value)) {
            answer.headers_mut().append(name, value);
        }
    }
    answer
}

/// The request in `body`, or why it is not one.
pub fn parse(body: &[u8]) -> Result<RateLimitRequest, String> {
    let json: JsonRequest =
        serde_json::from_slice(body).map_err(|e| format!("not a RateLimitRequest: {e}"))?;
    let mut descriptors = Vec::with_capacity(json.descriptors.len());
    for (i, d) in json.descriptors.into_iter().enumerate() {
        let limit = match d.limit {
            Some(l) => Some(RateLimitOverride {
                requests_per_unit: l
                    .requests_per_unit
                    .get_u32()
                    .map_err(|e| format!("descriptor {i}: limit: {e}"))?,
                unit: l
                    .unit
                    .map(|u| u.number())
                    .transpose()
                    .map_err(|e| format!("descriptor {i}: limit: {e}"))?
                    .unwrap_or(0),
            }),
            None => None,
        };
        descriptors.push(RateLimitDescriptor {
            entries: d.entries.into_iter().map(|e| Entry { key: e.key, value: e.value }).collect(),
            limit,
            hits_addend: d
                .hits_addend
                .map(|h| h.get_u64().map(|value| UInt64Value { value }))
                .transpose()
                .map_err(|e| format!("descriptor {i}: hitsAddend: {e}"))?,
            is_negative_hits: d.is_negative_hits,
        });
    }
    Ok(RateLimitRequest {
        domain: json.domain,
        descriptors,
        hits_addend: json
            .hits_addend
            .map(|h| h.get_u32())
            .transpose()
            .map_err(|e| format!("hitsAddend: {e}"))?
            .unwrap_or(0),
    })
}

/// `response` in protobuf's JSON mapping, default values left out.
pub fn to_json(response: &RateLimitResponse) -> Json {
    let mut out = Map::new();
    if let Some(code) = code_name(response.overall_code) {
        out.insert("overallCode".into(), json!(code));
    }
    let statuses: Vec<Json> = response
        .statuses
        .iter()
        .map(|s| {
            let mut status = Map::new();
            if let Some(code) = code_name(s.code) {
                status.insert("code".into(), json!(code));
            }
            if let Some(limit) = &s.current_limit {
                let mut l = Map::new();
                if !limit.name.is_empty() {
                    l.insert("name".into(), json!(limit.name));
                }
                if limit.requests_per_unit != 0 {
                    l.insert("requestsPerUnit".into(), json!(limit.requests_per_unit));
                }
                if let Ok(unit) = ProtoUnit::try_from(limit.unit) {
                    if unit != ProtoUnit::Unknown {
                        l.insert("unit".into(), json!(unit.as_str_name()));
                    }
                }
                status.insert("currentLimit".into(), Json::Object(l));
            }
            if s.limit_remaining != 0 {
                status.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(d) = &s.duration_until_reset {
                status.insert("durationUntilReset".into(), json!(duration(d)));
            }
            Json::Object(status)
        })
        .collect();
    if !statuses.is_empty() {
        out.insert("statuses".into(), Json::Array(statuses));
    }
    let headers = |list: &[ProtoHeader]| -> Json {
        list.iter().map(|h| json!({"key": h.key, "value": h.value})).collect()
    };
    if !response.response_headers_to_add.is_empty() {
        out.insert("responseHeadersToAdd".into(), headers(&response.response_headers_to_add));
    }
    if !response.request_headers_to_add.is_empty() {
        out.insert("requestHeadersToAdd".into(), headers(&response.request_headers_to_add));
    }
    if let Some(metadata) = &response.dynamic_metadata {
        out.insert("dynamicMetadata".into(), structure(metadata));
    }
    Json::Object(out)
}

// A code's name, or `None` for UNKNOWN (the default value, left out) and values not in the enum.
fn code_name(code: i32) -> Option<&'static str> {
    ProtoCode::try_from(code).ok().filter(|c| *c != ProtoCode::Unknown).map(|c| c.as_str_name())
}

// A Duration as the JSON mapping writes it: seconds, with 0, 3, 6 or 9 fraction digits.
fn duration(d: &ProtoDuration) -> String {
    match d.nanos {
        0 => format!("{}s", d.seconds),
        n if n % 1_000_000 == 0 => format!("{}.{:03}s", d.seconds, n / 1_000_000),
        n if n % 1_000 == 0 => format!("{}.{:06}s", d.seconds, n / 1_000),
        n => format!("{}.{:09}s", d.seconds, n),
    }
}

fn structure(s: &Struct) -> Json {
    Json::Object(s.fields.iter().map(|(k, v)| (k.clone(), value(v.kind.as_ref()))).collect())
}

fn value(kind: Option<&Kind>) -> Json {
    match kind {
        None | Some(Kind::NullValue(_)) => Json::Null,
        Some(Kind::NumberValue(n)) => json!(n),
        Some(Kind::StringValue(s)) => json!(s),
        Some(Kind::BoolValue(b)) => json!(b),
        Some(Kind::StructValue(s)) => structure(s),
        Some(Kind::ListValue(l)) => l.values.iter().map(|v| value(v.kind.as_ref())).collect(),
    }
}

// The request's JSON form. Each field also answers to its .proto name, as the mapping requires.

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct JsonRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
    #[serde(default, alias = "hits_addend")]
    hits_addend: Option<Number>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct JsonDescriptor {
    #[serde(default)]
    entries: Vec<JsonEntry>,
    #[serde(default)]
    limit: Option<JsonOverride>,
    #[serde(default, alias = "hits_addend")]
    hits_addend: Option<Number>,
    #[serde(default, alias = "is_negative_hits")]
    is_negative_hits: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct JsonOverride {
    #[serde(alias = "requests_per_unit")]
    requests_per_unit: Number,
    #[serde(default)]
    unit: Option<Enum>,
}

// An integer as the mapping allows it: a JSON number or a decimal string.
#[derive(Deserialize)]
#[serde(untagged)]
enum Number {
    Int(u64),
    Text(String),
}

impl Number {
    fn get_u64(&self) -> Result<u64, String> {
        match self {
            Number::Int(n) => Ok(*n),
            Number::Text(s) => s.parse().map_err(|_| format!("'{s}' is not an unsigned integer")),
        }
    }

    fn get_u32(&self) -> Result<u32, String> {
        let n = self.get_u64()?;
        u32::try_from(n).map_err(|_| format!("{n} is larger than a uint32"))
    }
}

// An enum value by name or by number.
#[derive(Deserialize)]
#[serde(untagged)]
enum Enum {
    Number(i32),
    Name(String),
}

impl Enum {
    fn number(&self) -> Result<i32, String> {
        match self {
            Enum::Number(n) => Ok(*n),
            Enum::Name(name) => RateLimitUnit::from_str_name(name)
                .map(|u| u as i32)
                .ok_or_else(|| format!("unknown unit '{name}'")),
        }
    }
}
