//! Response dynamic metadata, as envoyproxy/ratelimit's `RESPONSE_DYNAMIC_METADATA` builds it.
//!
//! With `--response-dynamic-metadata`, every answer carries a struct that Envoy's ratelimit
//! filter puts into the request's dynamic metadata (namespace `envoy.filters.http.ratelimit`),
//! where access logs and later filters can read it:
//!
//! ```text
//! domain: <domain>
//! descriptors: [{entries: ["k=v", ...], limit: "...", hitsAddend: N}, ...]
//! hitsAddend: N                # the request's, when not 0
//! metadata: {...}              # the rules' `metadata:` of the descriptors that passed, merged
//! ```
//!
//! Merging is the reference's: nested objects merge key by key, and for any other value the
//! first descriptor to set a key wins. Metadata never changes a decision.

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, NullValue, Struct, Value};
use serde_json::{json, Map, Value as Json};

use crate::limiter::{Code, Decision, Outcome};

/// The dynamic metadata for `decision` on `request`, as JSON.
pub fn dynamic_metadata(request: &RateLimitRequest, decision: &Decision) -> Map<String, Json> {
    let mut fields = Map::new();
    fields.insert("domain".into(), json!(request.domain));
    let descriptors: Vec<Json> = request
        .descriptors
        .iter()
        .map(|d| {
            let mut out = Map::new();
            let entries: Vec<String> = d.entries.iter().map(|e| format!("{}={}", e.key, e.value)).collect();
            out.insert("entries".into(), json!(entries));
            if let Some(limit) = &d.limit {
                out.insert(
                    "limit".into(),
                    json!(format!("requests_per_unit:{} unit:{}", limit.requests_per_unit, limit.unit)),
                );
            }
            if let Some(hits) = &d.hits_addend {
                out.insert("hitsAddend".into(), json!(hits.value));
            }
            Json::Object(out)
        })
        .collect();
    fields.insert("descriptors".into(), Json::Array(descriptors));
    if request.hits_addend != 0 {
        fields.insert("hitsAddend".into(), json!(request.hits_addend));
    }
    let mut passed = Map::new();
    for verdict in decision.descriptors.iter().filter(|d| d.code == Code::Ok) {
        let rule = match &verdict.outcome {
            Outcome::Bucket(b) => b.limit.rule.as_ref(),
            _ => None,
        };
        if let Some(metadata) = rule.and_then(|r| r.metadata.as_ref()) {
            merge(&mut passed, metadata);
        }
    }
    if !passed.is_empty() {
        fields.insert("metadata".into(), Json::Object(passed));
    }
    fields
}

// Objects merge recursively; an existing non-object value is kept.
fn merge(into: &mut Map<String, Json>, from: &Map<String, Json>) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(Json::Object(a)), Json::Object(b)) => merge(a, b),
            (Some(_), _) => {}
            (None, _) => {
                into.insert(k.clone(), v.clone());
            }
        }
    }
}

/// JSON as a `google.protobuf.Struct`.
pub fn to_struct(map: Map<String, Json>) -> Struct {
    Struct { fields: map.into_iter().map(|(k, v)| (k, to_value(v))).collect() }
}

fn to_value(v: Json) -> Value {
    let kind = match v {
        Json::Null => Kind::NullValue(NullValue::NullValue as i32),
        Json::Bool(b) => Kind::BoolValue(b),
        Json::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        Json::String(s) => Kind::StringValue(s),
        Json::Array(items) => {
            Kind::ListValue(ListValue { values: items.into_iter().map(to_value).collect() })
        }
        Json::Object(map) => Kind::StructValue(to_struct(map)),
    };
    Value { kind: Some(kind) }
}
