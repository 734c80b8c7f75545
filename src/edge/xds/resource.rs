//! From envoyproxy/ratelimit's `RateLimitConfig` resource to the YAML the config compiler reads.
//!
//! The resource is the file schema in protobuf (`ratelimit.config.ratelimit.v3`, in
//! envoyproxy/ratelimit's `api/ratelimit/config/ratelimit/v3/rls_conf.proto`), so a pushed
//! domain is written out as the file that says the same and compiled by the same code as files:
//! the same checks, the same bucket identity, the same exactness. envoyproxy/ratelimit does the
//! same (`ConfigXdsProtoToYaml`). The text is JSON, which is YAML, one key per line, so that an
//! error's line and column point into what [`document`] made.

use std::path::PathBuf;

use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use serde_json::{json, Map};

/// The name a resource's errors are reported under: `xds:<resource name>`.
pub fn origin(config: &RateLimitConfig) -> PathBuf {
    let name = if config.name.is_empty() { &config.domain } else { &config.name };
    PathBuf::from(format!("xds:{name}"))
}

/// The config file that says what `config` says.
pub fn document(config: &RateLimitConfig) -> String {
    let file = json!({
        "domain": config.domain,
        "descriptors": config.descriptors.iter().map(descriptor).collect::<Vec<_>>(),
    });
    serde_json::to_string_pretty(&file).expect("a JSON value always serializes")
}

fn descriptor(d: &RateLimitDescriptor) -> serde_json::Value {
    let mut node = Map::new();
    node.insert("key".into(), d.key.clone().into());
    // The proto cannot tell an absent value from an empty one; the file schema can, and an
    // empty value is no value there too.
    if !d.value.is_empty() {
        node.insert("value".into(), d.value.clone().into());
    }
    if let Some(policy) = &d.rate_limit {
        node.insert("rate_limit".into(), rate_limit(policy));
    }
    if !d.descriptors.is_empty() {
        node.insert("descriptors".into(), d.descriptors.iter().map(descriptor).collect());
    }
    for (key, set) in
        [("shadow_mode", d.shadow_mode), ("detailed_metric", d.detailed_metric), ("quota_mode", d.quota_mode)]
    {
        if set {
            node.insert(key.into(), true.into());
        }
    }
    if let Some(metadata) = &d.metadata {
        node.insert("metadata".into(), structure(metadata));
    }
    node.into()
}

fn rate_limit(policy: &RateLimitPolicy) -> serde_json::Value {
    let mut limit = Map::new();
    // An unknown enum number keeps its number, so that the compiler's message names it.
    let unit = RateLimitUnit::try_from(policy.unit)
        .map_or_else(|_| policy.unit.to_string(), |u| u.as_str_name().to_owned());
    if policy.unlimited {
        limit.insert("unlimited".into(), true.into());
    } else {
        limit.insert("unit".into(), unit.into());
        limit.insert("requests_per_unit".into(), policy.requests_per_unit.into());
    }
    if !policy.name.is_empty() {
        limit.insert("name".into(), policy.name.clone().into());
    }
    if !policy.replaces.is_empty() {
        let replaces = policy.replaces.iter().map(|r| json!({ "name": r.name })).collect();
        limit.insert("replaces".into(), replaces);
    }
    limit.into()
}

fn structure(s: &Struct) -> serde_json::Value {
    s.fields.iter().map(|(k, v)| (k.clone(), value(v))).collect::<Map<_, _>>().into()
}

fn value(v: &Value) -> serde_json::Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::NumberValue(n)) => json!(n),
        Some(Kind::StringValue(s)) => s.clone().into(),
        Some(Kind::BoolValue(b)) => (*b).into(),
        Some(Kind::StructValue(s)) => structure(s),
        Some(Kind::ListValue(l)) => l.values.iter().map(value).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{RuleSet, Sources};
    use envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitReplace;

    fn node(
        key: &str,
        value: &str,
        limit: Option<RateLimitPolicy>,
        children: Vec<RateLimitDescriptor>,
    ) -> RateLimitDescriptor {
        RateLimitDescriptor {
            key: key.into(),
            value: value.into(),
            rate_limit: limit,
            descriptors: children,
            ..Default::default()
        }
    }

    fn per(unit: RateLimitUnit, n: u32) -> Option<RateLimitPolicy> {
        Some(RateLimitPolicy { unit: unit as i32, requests_per_unit: n, ..Default::default() })
    }

    fn compile(config: &RateLimitConfig) -> Result<RuleSet, crate::config::ConfigError> {
        RuleSet::compile(Sources::pushed(vec![(origin(config), document(config))]))
    }

    #[test]
    fn a_pushed_domain_compiles_as_the_file_that_says_the_same() {
        let config = RateLimitConfig {
            name: "first-listener".into(),
            domain: "first-listener".into(),
            descriptors: vec![node(
                "first-route",
                "first-route",
                None,
                vec![
                    node("rule-0-match-0", "rule-0-match-0", per(RateLimitUnit::Month, 5), vec![]),
                    node("remote_address", "", per(RateLimitUnit::Second, 3), vec![]),
                ],
            )],
        };
        let pushed = compile(&config).expect("compiles");
        let file = RuleSet::from_yaml(
            std::path::Path::new("f.yaml"),
            "domain: first-listener\ndescriptors:\n  - key: first-route\n    value: first-route\n    descriptors:\n      - key: rule-0-match-0\n        value: rule-0-match-0\n        rate_limit: {unit: month, requests_per_unit: 5}\n      - key: remote_address\n        rate_limit: {unit: second, requests_per_unit: 3}\n",
        )
        .expect("compiles");
        let (pushed, file) =
            (pushed.domain("first-listener").unwrap(), file.domain("first-listener").unwrap());
        assert_eq!(pushed.rules.len(), 2);
        for (a, b) in pushed.rules.iter().zip(&file.rules) {
            assert_eq!(a.path, b.path);
            assert_eq!(format!("{:?}", a.limit), format!("{:?}", b.limit));
        }
    }

    #[test]
    fn names_replaces_unlimited_and_metadata_carry_over() {
        let mut metadata = Struct::default();
        metadata.fields.insert("team".into(), Value { kind: Some(Kind::StringValue("a".into())) });
        let config = RateLimitConfig {
            name: "r".into(),
            domain: "d".into(),
            descriptors: vec![
                RateLimitDescriptor {
                    metadata: Some(metadata),
                    shadow_mode: true,
                    ..node(
                        "k",
                        "",
                        Some(RateLimitPolicy {
                            unit: RateLimitUnit::Minute as i32,
                            requests_per_unit: 10,
                            name: "wide".into(),
                            replaces: vec![RateLimitReplace { name: "narrow".into() }],
                            ..Default::default()
                        }),
                        vec![],
                    )
                },
                node("free", "", Some(RateLimitPolicy { unlimited: true, ..Default::default() }), vec![]),
            ],
        };
        let rules = compile(&config).expect("compiles");
        let domain = rules.domain("d").unwrap();
        let wide = &domain.rules[0];
        assert_eq!(wide.name.as_deref(), Some("wide"));
        assert_eq!(wide.replaces, ["narrow"]);
        assert!(wide.shadow_mode);
        assert_eq!(wide.metadata.as_ref().unwrap()["team"], "a");
        assert_eq!(domain.rules[1].limit, crate::config::Limit::Unlimited);
    }

    #[test]
    fn an_invalid_resource_is_named_with_its_place() {
        let config = RateLimitConfig {
            name: "bad".into(),
            domain: "d".into(),
            descriptors: vec![node("k", "", per(RateLimitUnit::Unknown, 5), vec![])],
        };
        let error = compile(&config).unwrap_err().to_string();
        assert!(error.starts_with("xds:bad:"), "{error}");
        assert!(error.contains("unit"), "{error}");
        let empty = RateLimitConfig { name: "e".into(), domain: String::new(), descriptors: vec![] };
        let error = compile(&empty).unwrap_err().to_string();
        assert!(error.contains("empty domain"), "{error}");
    }
}
