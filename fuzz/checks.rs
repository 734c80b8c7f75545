//! What the fuzz targets check, shared with tests/fuzz_regressions.rs so that every input kept
//! in fuzz/regressions/ is re-checked by the normal test suite.
//!
//! Inputs are raw bytes; targets that need several strings split them on 0xFF bytes (which
//! never occur in UTF-8).

#![allow(dead_code)]

use std::path::Path;
use std::sync::OnceLock;

use tollgate::config::RuleSet;
use tollgate::identity::{self, cluster_slot};
use tollgate::matcher::Pattern;
use tollgate::units::{RatePerUnit, Unit};

fn fields(data: &[u8]) -> Vec<String> {
    data.split(|b| *b == 0xFF).map(|f| String::from_utf8_lossy(f).into_owned()).collect()
}

/// Any text: the config loader answers Ok or Err, never panics, and what it accepts it can
/// describe.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(rules) = RuleSet::from_yaml(Path::new("fuzz.yaml"), text) {
        for domain in rules.domains() {
            assert!(!domain.name.is_empty());
            assert!(domain.rules.iter().all(|r| r.cost >= 1));
        }
    }
}

/// Wildcards agree with a plain backtracking reference; lookups on a tree with every kind of
/// node never panic and are deterministic.
pub fn matching(data: &[u8]) {
    let f = fields(data);
    if f.len() >= 2 && f[0].contains('*') {
        assert_eq!(Pattern::new(&f[0]).matches(&f[1]), reference(f[0].as_bytes(), f[1].as_bytes()), "{f:?}");
    }
    static RULES: OnceLock<RuleSet> = OnceLock::new();
    let rules = RULES.get_or_init(|| {
        let yaml = "domain: d\ndescriptors:\n- key: a\n  rate_limit: {unit: second, requests_per_unit: 1}\n  descriptors:\n  - key: b\n    value: \"x*y*z\"\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: b\n    value: xyz\n    rate_limit: {unlimited: true}\n- key: a\n  value: \"*\"\n  descriptors:\n  - key: c\n- key: tenant\n  token_bucket: {capacity: 1, refill_per_second: 1}\n";
        RuleSet::from_yaml(Path::new("fuzz.yaml"), yaml).expect("fixture")
    });
    let domain = rules.domain("d").expect("fixture domain");
    let entries: Vec<(&str, &str)> =
        f.chunks(2).map(|p| (p[0].as_str(), p.get(1).map_or("", String::as_str))).collect();
    let first = domain.lookup(&entries).map(|r| r.path.clone());
    assert_eq!(first, domain.lookup(&entries).map(|r| r.path.clone()));
}

// `*` matches any run of bytes; everything else is literal and anchored. The classic two-pointer
// walk that backs up to the last star (a different algorithm from the matcher's leftmost piece
// search): usually linear, so the reference is not the cost of the target. A dynamic program over
// (pattern, value) prefixes cost O(|pattern| x |value|) per input, instrumented compare by compare:
// 1,500 executions a second.
fn reference(pattern: &[u8], value: &[u8]) -> bool {
    let (mut p, mut v) = (0, 0);
    // The last star seen, and where in the value its run currently ends.
    let mut star: Option<(usize, usize)> = None;
    while v < value.len() {
        if pattern.get(p) == Some(&b'*') {
            star = Some((p, v));
            p += 1;
        } else if pattern.get(p) == Some(&value[v]) {
            p += 1;
            v += 1;
        } else if let Some((at, end)) = star {
            // Let the star take one more byte and retry what follows it.
            star = Some((at, end + 1));
            p = at + 1;
            v = end + 1;
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&b| b == b'*')
}

/// Bucket keys decode back to what identifies them (so distinct descriptors never share a key),
/// a tenant's keys hold exactly one hash tag and take their slot from the tenant alone, and plain
/// descriptor keys hold no brace at all.
pub fn keys(data: &[u8]) {
    let f = fields(data);
    let (tenant, value) = (f[0].as_str(), f.get(1).map_or("v", String::as_str));
    static RULES: OnceLock<RuleSet> = OnceLock::new();
    let rules = RULES.get_or_init(|| {
        let yaml = "domain: d\ndescriptors:\n- key: tenant\n  token_bucket: {capacity: 1, refill_per_second: 1}\n  descriptors:\n  - key: k\n    token_bucket: {capacity: 1, refill_per_second: 1}\n  - key: c\n    class: shared\n    token_bucket: {capacity: 1, refill_per_second: 1}\n- key: k\n  token_bucket: {capacity: 1, refill_per_second: 1}\n";
        RuleSet::from_yaml(Path::new("fuzz.yaml"), yaml).expect("fixture")
    });
    let domain = rules.domain("d").expect("fixture domain");
    let bucket = |entries: &[(&str, &str)]| {
        let rule = domain.lookup(entries).expect("fixture rule");
        identity::rule_bucket(domain, rule, entries).key
    };
    let per_value = bucket(&[("tenant", tenant), ("k", value)]);
    let class = bucket(&[("tenant", tenant), ("c", value)]);
    for key in [&per_value, &class] {
        assert_eq!(key.matches('{').count(), 1, "{key:?}");
        assert_eq!(key.matches('}').count(), 1, "{key:?}");
    }
    let (t, rest) = decode(&per_value);
    assert_eq!(
        (t.as_str(), rest.as_str()),
        (tenant, format!("d:tenant={}:k={}", identity::escape(tenant), identity::escape(value)).as_str())
    );
    assert_eq!(
        unescape_entries(&rest),
        vec![("tenant".to_owned(), tenant.to_owned()), ("k".to_owned(), value.to_owned())]
    );
    assert_eq!(
        decode(&class),
        (tenant.to_owned(), "d:shared".to_owned()),
        "every value shares the class bucket"
    );
    assert_eq!(cluster_slot(&per_value), cluster_slot(&class));
    let plain = bucket(&[("k", value)]);
    assert!(!plain.contains(['{', '}']), "{plain:?}");
    let limit = RatePerUnit { requests_per_unit: 1, unit: Unit::Second };
    let overridden = identity::override_bucket(domain, limit, &[("tenant", tenant), ("k", value)]).key;
    assert_ne!(overridden, per_value, "an override never shares the rule's bucket");
    assert_eq!(cluster_slot(&overridden), cluster_slot(&per_value));
}

// (tenant, the rest after the hash tag), the tenant unescaped.
fn decode(key: &str) -> (String, String) {
    let rest = key.strip_prefix("rl:{").expect("prefix");
    let (tenant, rest) = rest.split_once("}:").expect("tag end");
    let tenant = if tenant == "%" { String::new() } else { unescape(tenant) };
    (tenant, rest.to_owned())
}

// The `k=v` entries after the domain.
fn unescape_entries(rest: &str) -> Vec<(String, String)> {
    let (_, entries) = rest.split_once(':').expect("domain");
    entries
        .split(':')
        .map(|e| {
            let (k, v) = e.split_once('=').expect("k=v");
            (unescape(k), unescape(v))
        })
        .collect()
}

fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).expect("escape");
            out.push(u8::from_str_radix(hex, 16).expect("hex"));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).expect("utf-8")
}

/// RLQS bucket ids (maps of entries) are named injectively: a name decodes back to exactly the
/// id's entries, whatever bytes its keys and values hold, so no two ids share a bucket.
pub fn bucket_ids(data: &[u8]) {
    let f = fields(data);
    let id: std::collections::BTreeMap<&str, &str> =
        f.chunks(2).map(|p| (p[0].as_str(), p.get(1).map_or("", String::as_str))).collect();
    let name = identity::bucket_id_name(id.iter().map(|(k, v)| (*k, *v)));
    // A name is the entries part of a key: decoded as the keys check decodes one.
    let decoded = if name.is_empty() { Vec::new() } else { unescape_entries(&format!("_:{name}")) };
    assert!(
        name.is_empty() || name.split(':').all(|e| e.matches('=').count() == 1),
        "one raw '=' per entry: {name}"
    );
    let expected: Vec<(String, String)> =
        id.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    assert_eq!(decoded, expected, "{name}");
}
