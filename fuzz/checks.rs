//! What the fuzz targets check, shared with tests/fuzz_regressions.rs so that every input kept
//! in fuzz/regressions/ is re-checked by the normal test suite.
//!
//! Inputs are raw bytes; targets that need several strings split them on 0xFF bytes (which
//! never occur in UTF-8).

#![allow(dead_code)]

use std::path::Path;
use std::sync::OnceLock;

use tollgate::config::RuleSet;
use tollgate::keys::{cluster_slot, descriptor_key, tenant_key, Class};
use tollgate::matcher::Pattern;

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

// `*` matches any run of bytes; everything else is literal and anchored. Dynamic programming
// over (pattern prefix, value prefix), so many stars stay polynomial.
fn reference(pattern: &[u8], value: &[u8]) -> bool {
    // matched[j]: the pattern prefix so far matches value[..j].
    let mut matched = vec![false; value.len() + 1];
    matched[0] = true;
    for &p in pattern {
        let mut next = vec![false; value.len() + 1];
        if p == b'*' {
            let mut any = false;
            for j in 0..=value.len() {
                any |= matched[j];
                next[j] = any;
            }
        } else {
            for j in 1..=value.len() {
                next[j] = matched[j - 1] && value[j - 1] == p;
            }
        }
        matched = next;
    }
    matched[value.len()]
}

/// Tenant keys decode back to their tenant and class (so distinct pairs never share a key),
/// hold exactly one hash tag, and take their slot from the tenant alone; descriptor keys hold
/// no brace at all.
pub fn keys(data: &[u8]) {
    let f = fields(data);
    let (tenant, class, other) =
        (f[0].as_str(), f.get(1).map_or("c", String::as_str), f.get(2).map_or("d", String::as_str));
    let key = tenant_key(tenant, &Class::Named(class));
    assert_eq!(key.matches('{').count(), 1, "{key:?}");
    assert_eq!(key.matches('}').count(), 1, "{key:?}");
    let (t, c) = decode(&key);
    assert_eq!((t.as_str(), c.as_str()), (tenant, class), "{key:?}");
    assert_eq!(cluster_slot(&key), cluster_slot(&tenant_key(tenant, &Class::Named(other))));
    let d = descriptor_key(tenant, &[(class, other)]);
    assert!(!d.contains(['{', '}']), "{d:?}");
}

fn decode(key: &str) -> (String, String) {
    let rest = key.strip_prefix("rl:{").expect("prefix");
    let (tenant, class) = rest.split_once("}:").expect("tag end");
    let tenant = if tenant == "%" { String::new() } else { unescape(tenant) };
    (tenant, unescape(class))
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
