//! Config loading, validation and descriptor matching, without any server.

use std::path::Path;

use tollgate::bucket::BucketSpec;
use tollgate::config::{ConfigError, FailureMode, Limit, RuleSet};

fn load(yaml: &str) -> RuleSet {
    RuleSet::from_yaml(Path::new("test.yaml"), yaml).unwrap_or_else(|e| panic!("{e}"))
}

fn error(yaml: &str) -> String {
    match RuleSet::from_yaml(Path::new("test.yaml"), yaml) {
        Ok(_) => panic!("accepted:\n{yaml}"),
        Err(e) => e.to_string(),
    }
}

/// The path of the rule that `entries` selects in domain `d`, or "-" for none.
fn matched(rules: &RuleSet, d: &str, entries: &[(&str, &str)]) -> String {
    rules.domain(d).unwrap().lookup(entries).map(|r| r.path.clone()).unwrap_or_else(|| "-".into())
}

// The examples of envoyproxy/ratelimit's README, unchanged.
const RATELIMIT_EXAMPLES: &[&str] = &[
    r#"
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500

  - key: database
    value: default
    rate_limit:
      unit: second
      requests_per_unit: 500
"#,
    r#"
domain: messaging
descriptors:
  # Only allow 5 marketing messages a day
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5

  # Only allow 100 messages a day to any unique phone number
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
"#,
    r#"
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10

  # Black list IP
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 0
"#,
    r#"
domain: example4
descriptors:
  - key: key
    value: value
    descriptors:
      - key: subkey
        rate_limit:
          requests_per_unit: 300
          unit: second
"#,
    r#"
domain: internal
descriptors:
  - key: ldap
    rate_limit:
      unlimited: true

  - key: azure
    rate_limit:
      unit: minute
      requests_per_unit: 100
"#,
    r#"
domain: example6
descriptors:
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit:
          requests_per_unit: 10
          unit: second
        shadow_mode: true
      - key: user
        value: user-b
        rate_limit:
          requests_per_unit: 20
          unit: second
"#,
    r#"
domain: example7
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          name: specific_limit
          requests_per_unit: 5
          unit: second
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces:
            - name: specific_limit
          requests_per_unit: 10
          unit: second
"#,
    r#"
domain: example8
descriptors:
  - key: key1
    detailed_metric: true
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: key1
    value: value1
    rate_limit:
      unit: minute
      requests_per_unit: 20
"#,
    r#"
domain: example9
descriptors:
  - key: key1
    value: value*
    rate_limit:
      unit: minute
      requests_per_unit: 20
"#,
];

#[test]
fn envoyproxy_ratelimit_files_load_unchanged_from_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    for (i, yaml) in RATELIMIT_EXAMPLES.iter().enumerate() {
        let ext = if i % 2 == 0 { "yaml" } else { "yml" };
        std::fs::write(dir.path().join(format!("{i}.{ext}")), yaml).unwrap();
    }
    std::fs::write(dir.path().join("README.md"), "not config").unwrap();
    std::fs::write(dir.path().join(".hidden.yaml"), "garbage: [").unwrap();
    let rules = RuleSet::load(dir.path()).unwrap();
    assert_eq!(rules.domains().count(), RATELIMIT_EXAMPLES.len());

    // Example 2: nested and key-only rules.
    assert_eq!(
        matched(&rules, "messaging", &[("message_type", "marketing"), ("to_number", "206")]),
        "message_type_marketing.to_number"
    );
    assert_eq!(matched(&rules, "messaging", &[("to_number", "206")]), "to_number");
    assert_eq!(matched(&rules, "messaging", &[("message_type", "other"), ("to_number", "206")]), "-");
    // Example 3: the most specific match wins.
    assert_eq!(matched(&rules, "edge_proxy_per_ip", &[("remote_address", "50.0.0.1")]), "remote_address");
    assert_eq!(
        matched(&rules, "edge_proxy_per_ip", &[("remote_address", "50.0.0.5")]),
        "remote_address_50.0.0.5"
    );
    let blocked =
        rules.domain("edge_proxy_per_ip").unwrap().lookup(&[("remote_address", "50.0.0.5")]).unwrap();
    assert_eq!(blocked.limit, Limit::Bucket(BucketSpec::new(0.0, 0.0).unwrap()));
    // Example 4: a limit applies only at the depth of the descriptor's last entry.
    assert_eq!(matched(&rules, "example4", &[("key", "value")]), "-");
    assert_eq!(matched(&rules, "example4", &[("key", "value"), ("subkey", "x")]), "key_value.subkey");
    assert_eq!(matched(&rules, "example4", &[("key", "value"), ("subkey", "x"), ("deeper", "y")]), "-");
    // Example 5: unlimited.
    assert_eq!(rules.domain("internal").unwrap().lookup(&[("ldap", "x")]).unwrap().limit, Limit::Unlimited);
    // Example 6: shadow mode.
    let a = rules.domain("example6").unwrap().lookup(&[("service", "s"), ("user", "user-a")]).unwrap();
    assert!(a.shadow_mode);
    // Example 7: names and replaces.
    let r = rules.domain("example7").unwrap().lookup(&[("key_2", "value_2"), ("user", "bkthomps")]).unwrap();
    assert_eq!(r.replaces, vec!["specific_limit".to_string()]);
    // Example 8: detailed metrics.
    assert!(rules.domain("example8").unwrap().lookup(&[("key1", "x")]).unwrap().detailed_metric);
    // Example 9: wildcard values.
    assert_eq!(matched(&rules, "example9", &[("key1", "value_2")]), "key1_value*");
    assert_eq!(matched(&rules, "example9", &[("key1", "other")]), "-");
}

#[test]
fn rate_limit_becomes_a_token_bucket() {
    let rules = load(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: Minute, requests_per_unit: 20}\n  - key: b\n    rate_limit: {unit: DAY, requests_per_unit: 86400}\n",
    );
    let d = rules.domain("d").unwrap();
    assert_eq!(
        d.lookup(&[("a", "x")]).unwrap().limit,
        Limit::Bucket(BucketSpec::new(20.0, 20.0 / 60.0).unwrap())
    );
    assert_eq!(d.lookup(&[("b", "x")]).unwrap().limit, Limit::Bucket(BucketSpec::new(86400.0, 1.0).unwrap()));
}

#[test]
fn wildcard_matching() {
    let rules = load(
        r#"
domain: w
descriptors:
  - key: k
    value: "foo*"
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: k
    value: "bar*b"
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: order
    value: "a*"
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: order
    value: "ab*"
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: order
    value: "abc"
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: order
    rate_limit: {unit: second, requests_per_unit: 6}
"#,
    );
    let m = |k, v| matched(&rules, "w", &[(k, v)]);
    assert_eq!(m("k", "foo"), "k_foo*");
    assert_eq!(m("k", "foobar"), "k_foo*");
    assert_eq!(m("k", "bar"), "-", "foo* shares nothing with bar");
    assert_eq!(m("k", "barb"), "k_bar*b");
    assert_eq!(m("k", "barab"), "k_bar*b");
    assert_eq!(m("k", "bara"), "-");
    assert_eq!(m("k", "xbarb"), "-");
    assert_eq!(m("order", "abx"), "order_a*", "first wildcard in config order");
    assert_eq!(m("order", "abc"), "order_abc", "exact beats wildcard");
    assert_eq!(m("order", "zzz"), "order", "wildcard beats key-only, key-only catches the rest");
}

#[test]
fn whitelisted_nodes_and_intermediate_nodes_have_no_limit() {
    let rules = load(
        "domain: d\ndescriptors:\n  - key: healthcheck\n  - key: parent\n    descriptors:\n      - key: child\n        rate_limit: {unit: second, requests_per_unit: 1}\n",
    );
    assert_eq!(matched(&rules, "d", &[("healthcheck", "x")]), "-");
    assert_eq!(matched(&rules, "d", &[("parent", "x")]), "-");
    assert_eq!(matched(&rules, "d", &[("parent", "x"), ("child", "y")]), "parent.child");
    assert_eq!(rules.domain("d").unwrap().rules.len(), 1);
}

#[test]
fn extensions() {
    let rules = load(
        r#"
domain: ext
tenant_key: org
failure_mode: deny
response_headers: [ietf]
default_tier: free
tiers:
  free:
    default: {capacity: 20, refill_per_second: 2}
    export: {capacity: 100, refill_per_second: 1}
  pro:
    default: {capacity: 200, refill_per_second: 50}
tenants:
  t42: {tier: pro, overrides: {export: {capacity: 1000, refill_per_second: 10}}}
descriptors:
  - key: org
    token_bucket: {capacity: 100, refill_per_second: 50}
    descriptors:
      - key: path
        value: /export
        class: export
        cost: 25
        quota: tenant
      - key: path
        value: "/v*"
        share_threshold: true
        rate_limit: {name: versioned, unit: second, requests_per_unit: 5}
"#,
    );
    let d = rules.domain("ext").unwrap();
    assert_eq!((d.tenant_key.as_str(), d.failure_mode), ("org", FailureMode::Deny));
    assert!(d.headers.ietf && !d.headers.x_ratelimit && !d.headers.retry_after);
    let org = d.lookup(&[("org", "t1")]).unwrap();
    assert_eq!(org.limit, Limit::Bucket(BucketSpec::new(100.0, 50.0).unwrap()));
    assert_eq!((org.tenant_depth, org.cost, org.class.as_deref()), (Some(0), 1, None));
    let export = d.lookup(&[("org", "t1"), ("path", "/export")]).unwrap();
    assert_eq!(
        (export.limit, export.cost, export.class.as_deref()),
        (Limit::TenantQuota, 25, Some("export"))
    );
    let versioned = d.lookup(&[("org", "t1"), ("path", "/v2/items")]).unwrap();
    assert_eq!(versioned.class.as_deref(), None, "a rule's name is not a class");
    assert_eq!(versioned.name.as_deref(), Some("versioned"));
    assert_eq!(versioned.shared_values, vec![None, Some("/v*".to_string())]);

    // Quota resolution through the embedded records.
    let t42 = d.tenants.get("t42").map(|r| r.as_ref());
    let spec = |capacity, refill_per_second| Some(BucketSpec::new(capacity, refill_per_second).unwrap());
    assert_eq!(d.quotas.resolve(t42, "export"), spec(1000.0, 10.0));
    assert_eq!(d.quotas.resolve(t42, "search"), spec(200.0, 50.0));
    assert_eq!(d.quotas.resolve(None, "export"), spec(100.0, 1.0));
    assert_eq!(d.quotas.resolve(None, "search"), spec(20.0, 2.0));
}

#[test]
fn errors_name_file_position_path_and_problem() {
    let cases: &[(&str, &str)] = &[
        ("domain: d\ndescriptors:\n  - key: a\n    rate_limits: {unit: second}\n", "rate_limits"),
        ("descriptors: []\n", "config file cannot have empty domain"),
        ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n", "invalid rate limit unit 'fortnight'"),
        ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {requests_per_unit: 1}\n", "descriptors[0](a): missing unit (second, minute"),
        ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, unit: second}\n", "should not specify rate limit unit when unlimited"),
        ("domain: d\ndescriptors:\n  - key: ''\n", "descriptor has empty key"),
        ("domain: d\ndescriptors:\n  - key: route\n    concurrency: {max: 2}\n", "a concurrency limit sits under the 'tenant' entry"),
        ("domain: d\ndescriptors:\n  - key: tenant\n    concurrency: {max: 0}\n", "concurrency max must be at least 1"),
        ("domain: d\ndescriptors:\n  - key: a\n    global: true\n", "global needs a rate_limit or token_bucket"),
        ("domain: d\ndescriptors:\n  - key: a\n    global: true\n    rate_limit: {unlimited: true}\n", "global needs a rate_limit or token_bucket"),
        ("domain: d\ndescriptors:\n  - key: a\n    global_fallback: {split: 2}\n    token_bucket: {capacity: 1, refill_per_second: 1}\n", "global_fallback needs global: true"),
        ("domain: d\ndescriptors:\n  - key: a\n    global: true\n    global_fallback: {split: 1}\n    token_bucket: {capacity: 1, refill_per_second: 1}\n", "split: the number of regions sharing the bucket, 2 to 1000"),
        ("domain: d\ntenant_key: org\nprices: {version: '1', currency: USD, models: {m: {input: 1, output: 1}}}\ndescriptors:\n  - key: org\n    global: true\n    token_bucket: {capacity: 1, refill_per_second: 1}\n    descriptors:\n      - key: model\n        descriptors:\n          - key: request_id\n", "in a domain with prices, global marks a budget"),
        ("domain: d\ntenant_key: org\nprices: {version: '1', currency: USD, models: {m: {input: 1, output: 1}}}\ndescriptors:\n  - key: org\n    global: true\n    global_fallback: {split: 3}\n    budget: {amount: 1, per: day}\n    descriptors:\n      - key: model\n        descriptors:\n          - key: request_id\n", "a global budget cut off from the global tier denies"),
        ("domain: d\ndescriptors:\n  - key: tenant\n    concurrency: {max: 2, ttl: soon}\n", "concurrency ttl 'soon'"),
        ("domain: d\nrequest_id_key: id\ndescriptors:\n  - key: tenant\n", "this domain has neither"),
        ("domain: d\ndescriptors:\n  - key: a\n    value: x\n  - key: a\n    value: x\n", "duplicate descriptor composite key 'a_x'"),
        ("domain: d\ndescriptors:\n  - key: a\n  - key: a\n", "duplicate descriptor composite key 'a'"),
        ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: ''}]}\n", "should not have an empty replaces entry"),
        ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {name: n, unit: second, requests_per_unit: 1, replaces: [{name: n}]}\n", "replaces should not contain name of same descriptor"),
        ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    token_bucket: {capacity: 1, refill_per_second: 1}\n", "mutually exclusive"),
        ("domain: d\ndefault_tier: f\ntiers: {f: {default: {capacity: 1, refill_per_second: 1}}}\ndescriptors:\n  - key: user\n    quota: tenant\n", "quota: tenant needs a 'tenant' descriptor"),
        ("domain: d\ndescriptors:\n  - key: tenant\n    quota: tenant\n", "needs tiers and a default_tier"),
        ("domain: d\ndescriptors:\n  - key: tenant\n    quota: org\n", "unknown quota source 'org'"),
        ("domain: d\ndescriptors:\n  - key: a\n    class: x\n    rate_limit: {unit: second, requests_per_unit: 1}\n", "class only names tenant buckets"),
        ("domain: d\ndescriptors:\n  - key: tenant\n    class: x\n", "class needs a limit"),
        ("domain: d\ndescriptors:\n  - key: a\n    cost: 0\n    rate_limit: {unit: second, requests_per_unit: 1}\n", "cost must be at least 1"),
        ("domain: d\ndescriptors:\n  - key: a\n    cost: 2\n    rate_limit: {unlimited: true}\n", "cost needs a limit"),
        ("domain: d\ntiers: {f: {default: {capacity: 1, refill_per_second: 1}}}\n", "default_tier: required when tiers are defined"),
        ("domain: d\ndefault_tier: f\ntiers: {f: {export: {capacity: 1, refill_per_second: 1}}}\n", "the default tier needs a 'default' bucket"),
        ("domain: d\ndefault_tier: g\ntiers: {f: {default: {capacity: 1, refill_per_second: 1}}}\n", "unknown tier 'g'"),
        ("domain: d\ndefault_tier: f\ntiers: {f: {default: {capacity: 1, refill_per_second: 1}}}\ntenants: {t: {tier: gold}}\n", "tenants.t.tier: unknown tier 'gold'"),
        ("domain: d\ndescriptors:\n  - key: a\n    token_bucket: {capacity: -1, refill_per_second: 1}\n", "capacity must be between 0"),
        ("domain: d\ndescriptors:\n  - key: a\n    token_bucket: {capacity: 5, refill_per_second: 0}\n", "refill_per_second must be above 0"),
        ("domain: d\nfailure_mode: maybe\n", "unknown failure mode 'maybe'"),
        ("domain: d\nresponse_headers: [x-ratelimit, bogus]\n", "response_headers[1]: unknown header set 'bogus'"),
        ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: -5}\n", "requests_per_unit must be a non-negative integer"),
        ("domain: [\n", "test.yaml"),
    ];
    for (yaml, expected) in cases {
        let message = error(yaml);
        assert!(message.contains(expected), "expected '{expected}' in: {message}");
        assert!(message.starts_with("test.yaml"), "names the file: {message}");
    }
}

#[test]
fn node_errors_carry_line_column_and_tree_path() {
    let message = error(
        "domain: d\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: class\n        value: export\n        cost: 0\n        rate_limit: {unit: second, requests_per_unit: 1}\n",
    );
    assert_eq!(
        message,
        "test.yaml:7:15: descriptors[0](tenant).descriptors[0](class=export): cost must be at least 1"
    );
}

#[test]
fn a_shared_class_must_have_one_limit() {
    // Within a domain: the second rule of class `export` sizes it differently.
    let message = error(
        "domain: d\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: route\n        value: a\n        class: export\n        rate_limit: {unit: minute, requests_per_unit: 2}\n      - key: route\n        value: b\n        class: export\n        rate_limit: {unit: minute, requests_per_unit: 3}\n",
    );
    assert_eq!(
        message,
        "test.yaml:9:14: descriptors[0](tenant).descriptors[1](route=b): class 'export' is already sized differently at line 5:14; rules sharing a class share one bucket and must agree on its limit"
    );
    let message = error(
        "domain: d\ndefault_tier: f\ntiers: {f: {default: {capacity: 1, refill_per_second: 1}}}\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: a\n        class: x\n        quota: tenant\n      - key: b\n        class: x\n        token_bucket: {capacity: 1, refill_per_second: 1}\n",
    );
    assert!(message.contains("class 'x' is already sized differently"), "quota and bucket: {message}");
    // Same limit twice is sharing, not an error.
    load("domain: d\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: a\n        class: x\n        rate_limit: {unit: minute, requests_per_unit: 2}\n      - key: b\n        class: x\n        rate_limit: {unit: minute, requests_per_unit: 2}\n");

    // Across domains that name the same class scope.
    let dir = tempfile::tempdir().unwrap();
    let file = |limit: u32| {
        format!("class_scope: shared\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: k\n        class: x\n        rate_limit: {{unit: minute, requests_per_unit: {limit}}}\n")
    };
    std::fs::write(dir.path().join("a.yaml"), format!("domain: a\n{}", file(2))).unwrap();
    std::fs::write(dir.path().join("b.yaml"), format!("domain: b\n{}", file(2))).unwrap();
    assert_eq!(RuleSet::load(dir.path()).unwrap().domains().count(), 2);
    std::fs::write(dir.path().join("b.yaml"), format!("domain: b\n{}", file(5))).unwrap();
    let message = RuleSet::load(dir.path()).unwrap_err().to_string();
    assert!(
        message.contains("b.yaml:6:14: class x: class 'x' of class scope 'shared' is sized differently at"),
        "{message}"
    );
    assert!(message.contains("a.yaml:6:14"), "{message}");
}

/// A class sized by the tenant's quota in two domains of one class scope must resolve to one
/// bucket for every tier and inline tenant: tiers are per domain, the bucket is not.
#[test]
fn a_shared_class_sized_by_tiers_resolves_alike_in_every_domain() {
    let dir = tempfile::tempdir().unwrap();
    let file = |domain: &str, pro: u32, tenants: &str| {
        format!(
            "domain: {domain}\nclass_scope: shared\ntiers:\n  free: {{default: {{capacity: 10, refill_per_second: 1}}}}\n  pro: {{default: {{capacity: {pro}, refill_per_second: 1}}}}\ndefault_tier: free\n{tenants}descriptors:\n  - key: tenant\n    descriptors:\n      - key: k\n        class: x\n        quota: tenant\n"
        )
    };
    let load = |a: String, b: String| {
        std::fs::write(dir.path().join("a.yaml"), a).unwrap();
        std::fs::write(dir.path().join("b.yaml"), b).unwrap();
        RuleSet::load(dir.path()).map(|_| ()).map_err(|e| e.to_string())
    };
    load(file("a", 100, ""), file("b", 100, "")).expect("the same tiers");
    let message = load(file("a", 100, ""), file("b", 200, "")).unwrap_err();
    println!("{message}");
    assert!(
        message.contains("b.yaml:10:14: class x: class 'x' of class scope 'shared' is sized differently at"),
        "{message}"
    );
    assert!(
        message.contains("a.yaml:10:14 for tier 'pro' (capacity 200, 1/s here, capacity 100, 1/s there)"),
        "{message}"
    );
    // An inline tenant on a tier in one domain only.
    let acme = "tenants:\n  acme: {tier: pro}\n";
    let message = load(file("a", 100, acme), file("b", 100, "")).unwrap_err();
    assert!(
        message.contains("for tenant 'acme' (capacity 10, 1/s here, capacity 100, 1/s there)"),
        "{message}"
    );
    load(file("a", 100, acme), file("b", 100, acme)).expect("the same tenant records");
}

#[test]
fn directory_errors() {
    let dir = tempfile::tempdir().unwrap();
    let err = RuleSet::load(dir.path()).unwrap_err();
    assert!(matches!(err, ConfigError::NoFiles { .. }), "{err}");
    std::fs::write(dir.path().join("a.yaml"), "domain: same\n").unwrap();
    std::fs::write(dir.path().join("b.yaml"), "domain: same\n").unwrap();
    let message = RuleSet::load(dir.path()).unwrap_err().to_string();
    assert!(message.contains("b.yaml: duplicate domain 'same' (already defined in"), "{message}");
    assert!(RuleSet::load(&dir.path().join("missing.yaml")).is_err());
}

#[test]
fn kubernetes_configmap_layout_loads() {
    // A ConfigMap volume: files are symlinks into `..data`, itself a symlink to a timestamped dir.
    let dir = tempfile::tempdir().unwrap();
    let stamp = dir.path().join("..2026_12_02_00_00_00.000000001");
    std::fs::create_dir(&stamp).unwrap();
    std::fs::write(stamp.join("rules.yaml"), "domain: cm\n").unwrap();
    std::os::unix::fs::symlink("..2026_12_02_00_00_00.000000001", dir.path().join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/rules.yaml", dir.path().join("rules.yaml")).unwrap();
    let rules = RuleSet::load(dir.path()).unwrap();
    assert_eq!(rules.domains().map(|d| d.name.as_str()).collect::<Vec<_>>(), vec!["cm"]);
}

/// The size limit of a domain file (the parser's node budget, its guard against YAML bombs) has
/// its own error, in the config's terms; a file within it loads.
#[test]
fn a_file_past_the_node_limit_says_so() {
    let rules = |n: usize| {
        let mut text = String::from("domain: big\ndescriptors:\n");
        for i in 0..n {
            text.push_str(&format!(
                "  - key: k\n    value: v{i}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
            ));
        }
        text
    };
    let error = RuleSet::from_yaml(Path::new("big.yaml"), &rules(30_000)).expect_err("too large").to_string();
    assert!(error.contains("larger than one domain file may be: more than 250000 YAML nodes"), "{error}");
    assert!(RuleSet::from_yaml(Path::new("ok.yaml"), &rules(10_000)).is_ok());
}
