//! Descriptor matching: which rule, if any, a request descriptor selects.
//!
//! The semantics are envoyproxy/ratelimit's. A descriptor's entries are matched level by level
//! against the domain's tree. At each level an entry `(k, v)` selects, in this order:
//!
//! 1. the node with key `k` and exactly value `v`,
//! 2. the first node, in config order, with key `k` and a wildcard value matching `v`
//!    (`*` matches any run of characters, anywhere in the pattern),
//! 3. the node with key `k` and no value (any value; one bucket per actual value).
//!
//! A rule applies only if it sits on the node of the descriptor's last entry. A descriptor that
//! is longer than the tree, or that stops at a node without a limit (whitelisted), gets no rule.
//! Lookups allocate nothing: levels index their nodes by key, then by value.
//!
//! Envoy's Rate Limit Quota filter names a bucket by an unordered map instead of a descriptor.
//! [`Level::bucket_entries`] turns it into one by walking the same tree: at each level, the
//! map entry whose key names a node there (the first such node in config order) is consumed, and
//! the walk goes on below the node that entry's value selects. The consumed entries, in order, are
//! the descriptor, matched as any RLS descriptor is; entries left over mean no rule applies.

use std::collections::HashMap;
use std::sync::Arc;

use crate::budget::BudgetSpec;
use crate::rule::{Rule, Source};
use crate::slot::ConcurrencySpec;

/// One `(key, value)` entry of a request descriptor.
pub trait DescriptorEntry {
    /// The entry's key.
    fn key(&self) -> &str;
    /// The entry's value.
    fn value(&self) -> &str;
}

impl DescriptorEntry for (&str, &str) {
    fn key(&self) -> &str {
        self.0
    }
    fn value(&self) -> &str {
        self.1
    }
}

impl DescriptorEntry
    for envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry
{
    fn key(&self) -> &str {
        &self.key
    }
    fn value(&self) -> &str {
        &self.value
    }
}

impl Level {
    /// The rule `entries` selects, if any, with this level as the root.
    pub fn lookup<E: DescriptorEntry>(&self, entries: &[E]) -> Option<&Arc<Rule>> {
        let (last, init) = entries.split_last()?;
        let mut level = self;
        for entry in init {
            level = &level.find(entry.key(), entry.value())?.children;
        }
        level.find(last.key(), last.value())?.rule.as_ref()
    }

    /// The nodes `entries` walk through, top first, with this level as the root; `None` unless
    /// every entry matches one.
    pub fn path<E: DescriptorEntry>(&self, entries: &[E]) -> Option<Vec<&Node>> {
        let mut level = self;
        let mut nodes = Vec::with_capacity(entries.len());
        for entry in entries {
            let node = level.find(entry.key(), entry.value())?;
            nodes.push(node);
            level = &node.children;
        }
        Some(nodes)
    }

    /// The descriptor entries the bucket id `bucket` stands for, in tree order, with this level
    /// as the root; `None` if some of its entries name no node on the walk.
    pub fn bucket_entries<'b>(&self, bucket: &'b HashMap<String, String>) -> Option<Vec<(&'b str, &'b str)>> {
        let mut entries: Vec<(&'b str, &'b str)> = Vec::with_capacity(bucket.len());
        let mut level = self;
        while entries.len() < bucket.len() {
            let Some((key, value)) = level.nodes.iter().find_map(|n| {
                let (k, v) = bucket.get_key_value(&n.key)?;
                (!entries.iter().any(|(done, _)| *done == k)).then_some((k.as_str(), v.as_str()))
            }) else {
                break;
            };
            entries.push((key, value));
            match level.find(key, value) {
                Some(node) => level = &node.children,
                None => break,
            }
        }
        (entries.len() == bucket.len()).then_some(entries)
    }
}

/// How a node's value matches request values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueMatch {
    /// No `value` in config: any value.
    Any,
    /// A literal value.
    Exact(String),
    /// A value containing `*`.
    Wildcard(Pattern),
}

impl ValueMatch {
    /// Classifies a config value; an empty value means any, as in envoyproxy/ratelimit.
    pub fn parse(value: Option<&str>) -> ValueMatch {
        match value {
            None | Some("") => ValueMatch::Any,
            Some(v) if v.contains('*') => ValueMatch::Wildcard(Pattern::new(v)),
            Some(v) => ValueMatch::Exact(v.to_owned()),
        }
    }
}

/// A wildcard value: `*` matches any (possibly empty) run of characters; the rest is literal and
/// anchored at both ends, so `bar*b` matches `barb` and `barab` but not `bara` or `xbarb`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    text: String,
    // The literal pieces between the stars; at least two, as the text contains a star.
    pieces: Vec<String>,
}

impl Pattern {
    /// A pattern from its config text.
    pub fn new(text: &str) -> Pattern {
        Pattern { text: text.to_owned(), pieces: text.split('*').map(str::to_owned).collect() }
    }

    /// The config text.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether `value` matches.
    pub fn matches(&self, value: &str) -> bool {
        let (first, rest) = self.pieces.split_first().expect("split yields a piece");
        let (last, middle) = rest.split_last().expect("a pattern has a star");
        if value.len() < first.len() + last.len()
            || !value.starts_with(first.as_str())
            || !value.ends_with(last.as_str())
        {
            return false;
        }
        // Leftmost placement of each middle piece leaves the most room for the next ones.
        let mut rest = &value[first.len()..value.len() - last.len()];
        for piece in middle {
            match rest.find(piece.as_str()) {
                Some(at) => rest = &rest[at + piece.len()..],
                None => return false,
            }
        }
        true
    }
}

/// A node of the descriptor tree.
#[derive(Debug)]
pub struct Node {
    /// The entry key it matches.
    pub key: String,
    /// How it matches the entry's value.
    pub value: ValueMatch,
    /// The limit at this node, if any.
    pub rule: Option<Arc<Rule>>,
    /// The money budget at this node, if any (priced domains).
    pub budget: Option<BudgetSpec>,
    /// The concurrency limit at this node, if any.
    pub concurrency: Option<ConcurrencySpec>,
    /// Where Envoy takes this entry from (for `tollgate render`).
    pub source: Option<Source>,
    /// The next level.
    pub children: Level,
}

/// The nodes at one depth of the tree, indexed for lookup.
#[derive(Debug, Default)]
pub struct Level {
    nodes: Vec<Node>,
    by_key: HashMap<String, KeyIndex>,
}

#[derive(Debug, Default)]
struct KeyIndex {
    exact: HashMap<String, usize>,
    wildcards: Vec<(Pattern, usize)>,
    any: Option<usize>,
}

/// A second node with the same key and value at one level.
#[derive(Debug)]
pub(crate) struct DuplicateNode;

impl Level {
    /// The nodes in config order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The nodes in config order, taken out of the level.
    pub(crate) fn into_nodes(self) -> Vec<Node> {
        self.nodes
    }

    /// Adds `node`, refusing a second node with the same key and value.
    pub(crate) fn insert(&mut self, node: Node) -> Result<(), DuplicateNode> {
        let index = self.by_key.entry(node.key.clone()).or_default();
        let id = self.nodes.len();
        match &node.value {
            ValueMatch::Any if index.any.is_some() => return Err(DuplicateNode),
            ValueMatch::Any => index.any = Some(id),
            ValueMatch::Exact(v) if index.exact.contains_key(v) => return Err(DuplicateNode),
            ValueMatch::Exact(v) => {
                index.exact.insert(v.clone(), id);
            }
            ValueMatch::Wildcard(p) if index.wildcards.iter().any(|(q, _)| q == p) => {
                return Err(DuplicateNode)
            }
            ValueMatch::Wildcard(p) => index.wildcards.push((p.clone(), id)),
        }
        self.nodes.push(node);
        Ok(())
    }

    fn find(&self, key: &str, value: &str) -> Option<&Node> {
        let index = self.by_key.get(key)?;
        let id = index
            .exact
            .get(value)
            .copied()
            .or_else(|| index.wildcards.iter().find(|(p, _)| p.matches(value)).map(|(_, id)| *id))
            .or(index.any)?;
        Some(&self.nodes[id])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_are_anchored_globs() {
        let p = Pattern::new("bar*b");
        assert!(p.matches("barb") && p.matches("barab"));
        assert!(!p.matches("bara") && !p.matches("xbarb") && !p.matches("bar"));
        let foo = Pattern::new("foo*");
        assert!(foo.matches("foo") && foo.matches("foobar"));
        assert!(!foo.matches("bar") && !foo.matches("xfoo"));
        let mid = Pattern::new("a*b*c");
        assert!(mid.matches("abc") && mid.matches("aXbYbZc"));
        assert!(!mid.matches("acb") && !mid.matches("ab"));
        assert!(Pattern::new("*").matches(""));
    }
}
