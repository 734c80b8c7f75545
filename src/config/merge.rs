//! envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG`: several files (or pushed resources) of one
//! domain read as one.
//!
//! Upstream adds each later file's descriptors to the domain and refuses a descriptor that is
//! already there. tollgate does the same with compiled domains, so that every file is checked on
//! its own first and every error names the file it is in; what a domain says beyond its
//! descriptors (tenant key, class scope, failure mode, headers, tiers, tenants, prices) must be
//! said once: a later file may repeat it identically, but not change it, which would make the
//! domain's behaviour depend on the order files are read in.

use std::path::Path;

use super::{ConfigError, Domain};
use crate::matcher::ValueMatch;

/// Adds `other`'s descriptors, rules and classes (from `file`) to `into`, a domain of the same
/// name read earlier.
pub(super) fn merge(into: &mut Domain, other: Domain, file: &Path) -> Result<(), ConfigError> {
    let refuse = |message: String| ConfigError::Invalid {
        file: file.to_owned(),
        position: None,
        at: String::new(),
        message: format!("merging into domain '{}' of {}: {message}", into.name, into.file.display()),
    };
    if into.priced.is_some() || other.priced.is_some() {
        return Err(refuse("a priced domain is written in one file".into()));
    }
    let settings = [
        ("tenant_key", into.tenant_key == other.tenant_key),
        ("class_scope", into.class_scope == other.class_scope),
        ("failure_mode", into.failure_mode == other.failure_mode),
        ("rlqs_unknown", into.rlqs_unknown == other.rlqs_unknown),
        ("response_headers", into.headers == other.headers),
        ("tiers", other.quotas.tiers.is_empty() && other.quotas.default_tier.is_none()),
        ("tenants", other.tenants.is_empty()),
    ];
    if let Some((setting, _)) = settings.iter().find(|(_, same)| !same) {
        return Err(refuse(format!(
            "{setting} differs; a domain's settings are said in its first file only"
        )));
    }
    for (class, def) in other.classes {
        match into.classes.get(&class) {
            Some(first) if !first.same_bucket(&def) => {
                return Err(refuse(format!("class '{class}' is sized differently in the two files")))
            }
            Some(_) => {}
            None => {
                into.classes.insert(class, def);
            }
        }
    }
    for node in other.root.into_nodes() {
        let name = match &node.value {
            ValueMatch::Any => node.key.clone(),
            ValueMatch::Exact(v) => format!("{}_{v}", node.key),
            ValueMatch::Wildcard(p) => format!("{}_{}", node.key, p.as_str()),
        };
        into.root.insert(node).map_err(|_| refuse(format!("duplicate descriptor composite key '{name}'")))?;
    }
    into.rules.extend(other.rules);
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::{RuleSet, Sources};

    fn compile(files: &[(&str, &str)], merge: bool) -> Result<RuleSet, String> {
        let docs = files.iter().map(|(f, t)| ((*f).into(), (*t).to_owned())).collect();
        RuleSet::compile(Sources::pushed(docs).merging_domains(merge)).map_err(|e| e.to_string())
    }

    const A: &str =
        "domain: api\ndescriptors:\n  - key: path\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
    const B: &str =
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 3}\n";

    #[test]
    fn one_domain_from_two_files_only_when_asked() {
        let error = compile(&[("a.yaml", A), ("b.yaml", B)], false).unwrap_err();
        assert!(error.contains("duplicate domain 'api'"), "{error}");
        let rules = compile(&[("a.yaml", A), ("b.yaml", B)], true).unwrap();
        let api = rules.domain("api").unwrap();
        assert_eq!(api.rules.len(), 2);
        assert!(api.lookup(&[("user", "u")]).is_some_and(|r| r.file.ends_with("b.yaml")));
        assert!(api.lookup(&[("path", "/")]).is_some_and(|r| r.file.ends_with("a.yaml")));
    }

    #[test]
    fn a_descriptor_twice_or_a_setting_changed_is_refused_with_the_file() {
        let error = compile(&[("a.yaml", A), ("c.yaml", A)], true).unwrap_err();
        assert!(error.starts_with("c.yaml: merging into domain 'api' of a.yaml"), "{error}");
        assert!(error.contains("duplicate descriptor composite key 'path'"), "{error}");
        let deny = format!("failure_mode: deny\n{B}");
        let error = compile(&[("a.yaml", A), ("d.yaml", &deny)], true).unwrap_err();
        assert!(error.contains("failure_mode differs"), "{error}");
    }
}
