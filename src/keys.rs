//! Storage keys for buckets.
//!
//! Two shapes, chosen so that they can never collide and so that Redis Cluster places them well:
//!
//! * tenant buckets: `rl:{<tenant>}:<class>`. The braces are a Cluster hash tag: only the tenant
//!   is hashed, so all buckets of one tenant share a slot and one Lua call can check and debit
//!   them atomically.
//! * other buckets: `rl:<domain>:<k>=<v>:<k>=<v>...`, one key per distinct descriptor. They
//!   contain no brace, so the whole key is hashed and they spread over all slots.
//!
//! Every user-supplied part is percent-encoded ([`escape`]): `%`, `{`, `}`, `:`, `=` and control
//! characters become `%XX`. So a tenant id cannot open or close the hash tag, no part can forge a
//! separator, and the encoding is injective. An empty tenant id, which Redis would not treat as a
//! hash tag, is written as a lone `%` (never the output of escaping anything).

use std::fmt::Write as _;

/// How a tenant bucket is told apart from the tenant's other buckets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Class<'a> {
    /// A name: the rule's `class`, else its `name`, else `default`.
    Named(&'a str),
    /// The descriptor entries that select the bucket (all but the tenant entry), for rules
    /// without a name: one bucket per distinct combination of values.
    Path(&'a [(&'a str, &'a str)]),
}

impl Class<'_> {
    /// The class as it appears in keys and quota lookups.
    pub fn render(&self) -> String {
        let mut out = String::new();
        match self {
            Class::Named(name) => escape_into(&mut out, name),
            Class::Path(entries) => write_entries(&mut out, entries),
        }
        out
    }
}

/// The key of a tenant's bucket: `rl:{<tenant>}:<class>`.
pub fn tenant_key(tenant: &str, class: &Class<'_>) -> String {
    let mut key = String::with_capacity(8 + tenant.len() + 16);
    key.push_str("rl:{");
    if tenant.is_empty() {
        key.push('%');
    } else {
        escape_into(&mut key, tenant);
    }
    key.push_str("}:");
    match class {
        Class::Named(name) => escape_into(&mut key, name),
        Class::Path(entries) => write_entries(&mut key, entries),
    }
    key
}

/// The key of a bucket that belongs to no tenant: `rl:<domain>:<k>=<v>:...`.
pub fn descriptor_key(domain: &str, entries: &[(&str, &str)]) -> String {
    let mut key = String::with_capacity(4 + domain.len() + entries.len() * 16);
    key.push_str("rl:");
    escape_into(&mut key, domain);
    key.push(':');
    write_entries(&mut key, entries);
    key
}

/// The Redis Cluster slot of `key`, honouring hash tags exactly as Redis does.
pub fn cluster_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let close = bytes[open + 1..].iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &bytes[open + 1..open + 1 + close])
        })
        .unwrap_or(bytes);
    crc16::State::<crc16::XMODEM>::calculate(hashed) % 16384
}

/// Percent-encodes `%`, `{`, `}`, `:`, `=` and control characters of `s`.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    escape_into(&mut out, s);
    out
}

fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '%' | '{' | '}' | ':' | '=' | '\u{0}'..='\u{1f}' | '\u{7f}' => {
                let _ = write!(out, "%{:02X}", c as u32);
            }
            _ => out.push(c),
        }
    }
}

// `k=v` pairs joined by `:`. Escaped parts never contain a raw `=` or `:`, so this parses back
// unambiguously, and it always contains a raw `=`, so it never equals an escaped name.
fn write_entries(out: &mut String, entries: &[(&str, &str)]) {
    for (i, (k, v)) in entries.iter().enumerate() {
        if i > 0 {
            out.push(':');
        }
        escape_into(out, k);
        out.push('=');
        escape_into(out, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        assert_eq!(tenant_key("t42", &Class::Named("export")), "rl:{t42}:export");
        assert_eq!(tenant_key("a}b{", &Class::Named("x:y")), "rl:{a%7Db%7B}:x%3Ay");
        assert_eq!(tenant_key("", &Class::Named("default")), "rl:{%}:default");
        assert_eq!(tenant_key("t", &Class::Path(&[("path", "/export")])), "rl:{t}:path=/export");
        assert_eq!(
            descriptor_key("edge", &[("remote_address", "10.0.0.1"), ("k", "a=b")]),
            "rl:edge:remote_address=10.0.0.1:k=a%3Db"
        );
        assert_eq!(escape("a\nb%"), "a%0Ab%25");
    }

    #[test]
    fn slots_follow_redis_hash_tag_rules() {
        // Reference values from `CLUSTER KEYSLOT`.
        assert_eq!(cluster_slot("foo"), 12182);
        assert_eq!(cluster_slot("{foo}bar"), 12182);
        assert_eq!(cluster_slot("{}foo"), cluster_slot("{}foo"));
        assert_ne!(cluster_slot("{}foo"), cluster_slot("foo"));
        assert_eq!(cluster_slot("rl:{t42}:a"), cluster_slot("rl:{t42}:b"));
    }
}
