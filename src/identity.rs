//! Bucket identity: which requests share a bucket, and the storage key that says so.
//!
//! This is the one place where a matched rule and a request's descriptor entries become a
//! bucket. The rules are envoyproxy/ratelimit's, where a counter is identified by the domain
//! and the descriptor's entries, and tollgate adds one explicit way to share:
//!
//! * **Per rule and values.** Two descriptors share a bucket only if they are in the same domain,
//!   select the same rule (the same config node) and carry the same values. Because matching is
//!   deterministic, the domain and the entries (keys and values, in order) identify both the rule
//!   and the values. A rule's `name` plays no part: it is for `replaces` and responses.
//! * **`share_threshold`.** Under a wildcard node with `share_threshold: true`, every value the
//!   wildcard matches counts as the pattern itself, so they share one bucket.
//! * **Explicit classes.** Rules under a tenant entry that set the same `class:` share that
//!   tenant's class bucket, within the domain's class scope: the domain itself, unless its file
//!   says `class_scope: NAME`, which lets domains naming the same scope share their class buckets.
//!   Load-time checks (in [`crate::config`]) refuse a class whose rules disagree on its size.
//! * **Request-level overrides** (`limit` in the descriptor) ignore the matched rule, as in
//!   envoyproxy/ratelimit, and get a bucket per domain, entries and overriding limit.
//!
//! Keys (every user-supplied part percent-encoded by [`escape`]):
//!
//! | bucket | key |
//! |---|---|
//! | rule, no tenant entry | `rl:<domain>:<k>=<v>:<k>=<v>...` |
//! | rule under a tenant entry | `rl:{<tenant>}:<domain>:<k>=<v>:...` (the tenant's entry included) |
//! | explicit class | `rl:{<tenant>}:<scope>:<class>` |
//! | override | as the rule keys, with `=<n>/<unit>` as the first segment after the domain |
//! | money budget (a period of it) | as the rule keys, then `:budget:<period start>` |
//! | a request's budget record | `rl:{<tenant>}:<domain>:hold:<request id>` |
//! | a node's concurrency slots | as the rule keys, then `:slots` |
//! | a request's slot record | `rl:{<tenant>}:<domain>:slot:<request id>` |
//! | a global bucket's fallback in a region cut off | its key, then `:fallback` |
//!
//! The braces are a Redis Cluster hash tag: only the tenant is hashed, so all buckets of one
//! tenant share a slot and one Lua call checks and debits them atomically. Other keys contain no
//! brace and spread over all slots. The shapes cannot collide: escaping leaves no raw `{`, `}`,
//! `:` or `=` in any part, every entry segment holds exactly one raw `=` and never starts with
//! one, a class segment holds none, and an override segment starts with one; a budget's
//! `budget`, period and `q` segments and a record's `hold` follow the domain or entries where
//! those shapes have entry segments or end; a fallback's `fallback` follows a whole rule or class
//! key, where an entry segment would hold a `=` and a class key ends. An empty tenant
//! id, which Redis would not treat as a hash tag, is written as a lone `%` (never the output of
//! escaping anything).
//!
//! Every key may start with a deployment's key prefix ([`set_key_prefix`], envoyproxy/ratelimit's
//! `CACHE_KEY_PREFIX`), so that deployments sharing one Redis keep apart. It is one value per
//! process, set before the first key is made and never changed: a key made without it, or with
//! another, would address another deployment's buckets. A prefix holds no brace, which would
//! move the hash tag and split a tenant's buckets over slots.

use std::fmt::Write as _;
use std::sync::OnceLock;

use crate::config::{Domain, Rule};
use crate::quota::DEFAULT_CLASS;
use crate::units::RatePerUnit;

/// A bucket's storage key and what placed it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketKey<'a> {
    /// The Redis key.
    pub key: String,
    /// The tenant whose hash slot holds it, if any.
    pub tenant: Option<&'a str>,
}

/// What a bucket is, in the words of the identity rules above (for `explain` and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// One bucket per rule and descriptor values.
    PerValues,
    /// All descriptors reaching the rule with values matched by its `share_threshold`
    /// wildcards share the bucket.
    SharedWildcard,
    /// The tenant's class bucket, shared by every rule with this class in the scope.
    Class,
    /// A request-level override's bucket.
    Override,
}

/// The bucket `rule` selects for `entries` (the descriptor that matched it) in `domain`.
pub fn rule_bucket<'a>(domain: &Domain, rule: &'a Rule, entries: &[(&'a str, &'a str)]) -> BucketKey<'a> {
    // A tenant entry under a `share_threshold` wildcard is the pattern, like any shared value.
    let tenant = rule.tenant_depth.and_then(|t| {
        let shared = rule.shared_values.get(t).and_then(Option::as_deref);
        Some(shared.unwrap_or(entries.get(t)?.1))
    });
    let mut key = prefix(tenant);
    match (&rule.class, tenant) {
        (Some(class), Some(_)) => {
            escape_into(&mut key, &domain.class_scope);
            key.push(':');
            escape_into(&mut key, class);
        }
        _ => {
            escape_into(&mut key, &domain.name);
            key.push(':');
            write_entries(&mut key, entries, &rule.shared_values);
        }
    }
    BucketKey { key, tenant }
}

/// How `rule`'s buckets are shared.
pub fn sharing(rule: &Rule) -> Sharing {
    match (&rule.class, rule.tenant_depth) {
        (Some(_), Some(_)) => Sharing::Class,
        _ if rule.shared_values.iter().any(Option::is_some) => Sharing::SharedWildcard,
        _ => Sharing::PerValues,
    }
}

/// The quota class a `quota: tenant` rule is sized by: its `class`, else `default`.
pub fn quota_class(rule: &Rule) -> &str {
    rule.class.as_deref().unwrap_or(DEFAULT_CLASS)
}

/// The bucket of a request-level override `limit` on `entries` in `domain`: the rule, if any,
/// plays no part; a tenant entry only places the bucket in the tenant's slot.
pub fn override_bucket<'a>(
    domain: &Domain,
    limit: RatePerUnit,
    entries: &[(&'a str, &'a str)],
) -> BucketKey<'a> {
    let tenant = tenant_of(domain, entries);
    let mut key = prefix(tenant);
    escape_into(&mut key, &domain.name);
    let _ = write!(key, ":={}/{}:", limit.requests_per_unit, limit.unit.name());
    write_entries(&mut key, entries, &[]);
    BucketKey { key, tenant }
}

static KEY_PREFIX: OnceLock<String> = OnceLock::new();

/// Why a key prefix was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyPrefixError {
    /// A brace would be taken for a Redis Cluster hash tag.
    #[error("key prefix '{0}' holds a brace, which Redis Cluster would take for a hash tag")]
    Brace(String),
    /// The process already makes keys with another prefix.
    #[error("key prefix already set to '{0}'")]
    AlreadySet(String),
}

/// Makes every key of this process start with `prefix`. Call once, before the first key is made;
/// setting the same prefix again is harmless.
pub fn set_key_prefix(prefix: &str) -> Result<(), KeyPrefixError> {
    if prefix.contains(['{', '}']) {
        return Err(KeyPrefixError::Brace(prefix.to_owned()));
    }
    match KEY_PREFIX.get_or_init(|| prefix.to_owned()) {
        set if set == prefix => Ok(()),
        set => Err(KeyPrefixError::AlreadySet(set.clone())),
    }
}

/// The channel every script that raises a bucket's balance publishes the bucket's key on (under
/// the deployment's prefix, like the keys).
pub fn raise_channel() -> String {
    format!("{}tollgate:raised", KEY_PREFIX.get().map_or("", String::as_str))
}

// The deployment's prefix, `rl:` and, for a tenant's bucket, its hash tag.
fn prefix(tenant: Option<&str>) -> String {
    let mut key = String::with_capacity(64);
    key.push_str(KEY_PREFIX.get().map_or("", String::as_str));
    key.push_str("rl:");
    if let Some(tenant) = tenant {
        key.push('{');
        if tenant.is_empty() {
            key.push('%');
        } else {
            escape_into(&mut key, tenant);
        }
        key.push_str("}:");
    }
    key
}

/// The key, without its period, of the money budget at the node that `entries` (a path from the
/// root, with the domain's tenant entry on it) reach in `domain`: the node's key as a rule's
/// bucket's, then `:budget`. A period's state is `<base>:<period start ms>`, its open holds
/// `<base>:<period start ms>:q` ([`crate::budget`]).
pub fn budget_level(domain: &Domain, entries: &[(&str, &str)]) -> String {
    node_key(domain, entries, ":budget")
}

/// The key of leaseholder `holder`'s own ledger of the global budget level keyed `level`
/// ([`budget_level`]) in a region's store, in the level's slot: `<level>:lease:<holder>`.
pub fn budget_lease(level: &str, holder: &str) -> String {
    format!("{level}:lease:{holder}")
}

/// The key of the record pairing request `request_id`'s hold with its settlement, in the slot
/// of the tenant on `entries`: `rl:{<tenant>}:<domain>:hold:<request id>`.
pub fn budget_record(domain: &Domain, entries: &[(&str, &str)], request_id: &str) -> String {
    request_key(domain, entries, ":hold:", request_id)
}

/// The key of the concurrency slot set of the node that `entries` (a path from the root, with
/// the domain's tenant entry on it) reach in `domain`: the node's key as a rule's bucket's, then
/// `:slots`.
pub fn slot_set(domain: &Domain, entries: &[(&str, &str)]) -> String {
    node_key(domain, entries, ":slots")
}

/// The key of the record pairing request `request_id`'s slots with their give-back, in the slot
/// of the tenant on `entries`: `rl:{<tenant>}:<domain>:slot:<request id>`.
pub fn slot_record(domain: &Domain, entries: &[(&str, &str)], request_id: &str) -> String {
    request_key(domain, entries, ":slot:", request_id)
}

// The key of the node `entries` reach, as a rule's bucket's, then `suffix`.
fn node_key(domain: &Domain, entries: &[(&str, &str)], suffix: &str) -> String {
    let mut key = prefix(tenant_of(domain, entries));
    escape_into(&mut key, &domain.name);
    key.push(':');
    write_entries(&mut key, entries, &[]);
    key.push_str(suffix);
    key
}

// `<prefix>{<tenant>}:<domain><kind><request id>`: a request's record of one kind.
fn request_key(domain: &Domain, entries: &[(&str, &str)], kind: &str, request_id: &str) -> String {
    let mut key = prefix(tenant_of(domain, entries));
    escape_into(&mut key, &domain.name);
    key.push_str(kind);
    escape_into(&mut key, request_id);
    key
}

/// `entries` as a key writes them (`k=v:k=v`, every part escaped): one text per path, no two
/// paths alike. A budget record binds its request id to it (the request's path, model included),
/// and a budget override names the level it sets by it.
pub fn path_text(entries: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(64);
    write_entries(&mut out, entries, &[]);
    out
}

/// The name an RLQS bucket id (a map of entries, in no order) is known by: its entries sorted by
/// key, written as [`path_text`] writes a path. Every key and value is escaped, so that no raw
/// `=` or `:` is inside one: two ids share a name only if they have the same entries, whatever
/// their keys and values hold (`{route: "search:tenant=X"}` is not `{route: search, tenant: X}`).
pub fn bucket_id_name<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut entries: Vec<(&str, &str)> = entries.into_iter().collect();
    entries.sort_unstable();
    path_text(&entries)
}

// The value of the domain's tenant entry on `entries`.
fn tenant_of<'a>(domain: &Domain, entries: &[(&'a str, &'a str)]) -> Option<&'a str> {
    entries.iter().find(|(k, _)| *k == domain.tenant_key).map(|(_, v)| *v)
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

/// The bucket a region decides global bucket `key` on while it is cut off from the global tier
/// past its share (`global_fallback: {split: N}`), in the region's own store: in the tenant's slot,
/// beside the region's other buckets of the tenant.
pub fn fallback_bucket(key: &str) -> String {
    format!("{key}:fallback")
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

// `k=v` pairs joined by `:`; a value under a `share_threshold` wildcard is written as the pattern.
// Escaped parts never contain a raw `=` or `:`, so this parses back unambiguously. A literal value
// equal to a pattern's text can only reach that pattern's node: a wildcard earlier in config order
// that matched the text would match every value the pattern does, leaving the pattern unreachable.
fn write_entries(out: &mut String, entries: &[(&str, &str)], shared: &[Option<String>]) {
    for (i, (k, v)) in entries.iter().enumerate() {
        if i > 0 {
            out.push(':');
        }
        escape_into(out, k);
        out.push('=');
        escape_into(out, shared.get(i).and_then(Option::as_deref).unwrap_or(v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping() {
        assert_eq!(escape("a\nb%"), "a%0Ab%25");
        assert_eq!(escape("a}b{:="), "a%7Db%7B%3A%3D");
        assert_eq!(prefix(Some("")), "rl:{%}:");
        assert!(matches!(set_key_prefix("a{b"), Err(KeyPrefixError::Brace(_))));
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
