//! The rule configuration: loading, validation, and the compiled form the hot path reads.
//!
//! A config path is one YAML file or a directory of `*.yaml`/`*.yml` files, one domain per file
//! (hidden entries such as a Kubernetes ConfigMap's `..data` are skipped). Files are parsed
//! (`raw.rs`), checked and compiled (`compile.rs`) into a [`RuleSet`]: an immutable tree per domain
//! that descriptor matching ([`crate::matcher`]) walks without allocating. A [`RuleSet`] is
//! either wholly valid or not built at all, so a bad edit can never half-apply.

mod compile;
mod locate;
mod merge;
mod priced;
mod problem;
mod raw;
mod tree;

pub use crate::rule::{ChargeRule, Limit, Rule, Source};

use std::collections::HashMap;

use indexmap::IndexMap;
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use crate::bucket::BucketSpec;
use crate::budget::{LostSettle, PriceTable};
use crate::matcher::{DescriptorEntry, Level};
use crate::quota::{InlineTenants, Quotas, TenantRecord};

/// What sizes a shared class bucket; every rule of a class must agree on it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassDef {
    /// The limit every rule of the class has (a bucket or the tenant's quota).
    pub limit: Limit,
    /// Their charge mode.
    pub charge: ChargeRule,
    /// Where the class was first defined: file, line, column.
    #[serde(skip)]
    pub defined_at: (PathBuf, usize, usize),
}

/// Every domain tollgate serves, as loaded from one config path.
#[derive(Debug, Default)]
pub struct RuleSet {
    domains: IndexMap<String, Arc<Domain>>,
    fingerprint: u64,
}

/// The files of a config path and their text, read but not compiled: reading is cheap, so a
/// reload compares fingerprints before compiling anything.
#[derive(Debug, Clone)]
pub struct Sources {
    files: Vec<(PathBuf, String)>,
    merge_domains: bool,
}

impl Sources {
    /// Reads the file, or every `*.yaml` / `*.yml` file of the directory, at `path`.
    pub fn read(path: &Path) -> Result<Sources, ConfigError> {
        let mut files = Vec::new();
        for file in config_files(path)? {
            let text = std::fs::read_to_string(&file)
                .map_err(|source| ConfigError::Io { path: file.clone(), source })?;
            files.push((file, text));
        }
        Ok(Sources { files, merge_domains: false })
    }

    /// Documents that did not come from files (resources pushed over xDS), each under the name
    /// its errors are reported with.
    pub fn pushed(documents: Vec<(PathBuf, String)>) -> Sources {
        Sources { files: documents, merge_domains: false }
    }

    /// The same sources, read with envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG` when `merge`:
    /// documents naming one domain are one domain ([`merge`]), instead of an error.
    pub fn merging_domains(self, merge: bool) -> Sources {
        Sources { merge_domains: merge, ..self }
    }

    /// These sources followed by `other`'s: one config of both.
    pub fn and(mut self, other: &Sources) -> Sources {
        self.files.extend(other.files.iter().cloned());
        self
    }

    /// A hash of the file names and contents: equal fingerprints, equal configs.
    pub fn fingerprint(&self) -> u64 {
        let mut hasher = DefaultHasher::new();
        self.files.hash(&mut hasher);
        hasher.finish()
    }
}

impl RuleSet {
    /// Loads and validates the file or directory at `path`.
    pub fn load(path: &Path) -> Result<RuleSet, ConfigError> {
        Self::compile(Sources::read(path)?)
    }

    /// Compiles one domain from YAML text; `file` is only used in error messages.
    pub fn from_yaml(file: &Path, text: &str) -> Result<RuleSet, ConfigError> {
        Self::compile(Sources::pushed(vec![(file.to_owned(), text.to_owned())]))
    }

    /// Compiles every file, then checks what spans files: domain names and shared class
    /// scopes. Every bad file is reported, not only the first.
    pub fn compile(sources: Sources) -> Result<RuleSet, ConfigError> {
        let mut domains: IndexMap<String, Domain> = IndexMap::new();
        let mut errors = Vec::new();
        let fingerprint = sources.fingerprint();
        for (file, text) in &sources.files {
            let domain = match compile::domain(file, text) {
                Ok(domain) => domain,
                Err(error) => {
                    errors.push(error);
                    continue;
                }
            };
            match domains.get_mut(&domain.name) {
                Some(first) if sources.merge_domains => {
                    if let Err(error) = merge::merge(first, domain, file) {
                        errors.push(error);
                    }
                }
                Some(first) => errors.push(ConfigError::DuplicateDomain {
                    file: file.clone(),
                    domain: domain.name,
                    first: first.file.clone(),
                }),
                None => {
                    domains.insert(domain.name.clone(), domain);
                }
            }
        }
        let domains: IndexMap<String, Arc<Domain>> =
            domains.into_iter().map(|(name, domain)| (name, Arc::new(domain))).collect();
        if let Err(error) = check_shared_classes(domains.values()) {
            errors.push(error);
        }
        match errors.len() {
            0 => Ok(RuleSet { domains, fingerprint }),
            1 => Err(errors.remove(0)),
            _ => Err(ConfigError::Files(errors)),
        }
    }

    /// The same set with `domain` added, if no domain of the set has its name: a domain whose
    /// file is gone, kept from the config before until the operator confirms its removal.
    pub fn keep(&mut self, domain: Arc<Domain>) {
        self.domains.entry(domain.name.clone()).or_insert(domain);
    }

    /// A hash of the files this set was loaded from: equal fingerprints, equal configs.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The price files the domains read (`prices: {file: PATH}`).
    pub fn price_files(&self) -> impl Iterator<Item = &Path> {
        self.domains
            .values()
            .filter_map(|d| d.priced.as_ref()?.prices_file.as_ref())
            .map(|(p, _)| p.as_path())
    }

    /// Whether every price file still holds what it held when this set was loaded (a file that
    /// cannot be read counts as changed: the reload will say why).
    pub fn price_files_unchanged(&self) -> bool {
        self.domains
            .values()
            .filter_map(|d| d.priced.as_ref()?.prices_file.as_ref())
            .all(|(path, hash)| std::fs::read_to_string(path).is_ok_and(|text| text_hash(&text) == *hash))
    }

    /// The domain named `name`.
    pub fn domain(&self, name: &str) -> Option<&Arc<Domain>> {
        self.domains.get(name)
    }

    /// All domains, in file order (files sorted by name).
    pub fn domains(&self) -> impl Iterator<Item = &Arc<Domain>> {
        self.domains.values()
    }
}

impl ClassDef {
    /// Whether `other` sizes the class's bucket the same way.
    pub fn same_bucket(&self, other: &ClassDef) -> bool {
        self.limit == other.limit && self.charge.sizing() == other.charge.sizing()
    }
}

// Domains that name the same class scope share its class buckets: each class must be sized the
// same way wherever it is used, and a class sized by the tenant's quota must resolve to the same
// bucket in every such domain for every tier and inline tenant (tiers are per domain).
fn check_shared_classes<'a>(domains: impl Iterator<Item = &'a Arc<Domain>>) -> Result<(), ConfigError> {
    let mut seen: HashMap<(&str, &str), (&Domain, &ClassDef)> = HashMap::new();
    for domain in domains {
        for (class, def) in &domain.classes {
            let Some((first_domain, first)) = seen.get(&(domain.class_scope.as_str(), class.as_str())) else {
                seen.insert((domain.class_scope.as_str(), class.as_str()), (domain, def));
                continue;
            };
            let differs = if !first.same_bucket(def) {
                Some(String::new())
            } else if def.limit == Limit::TenantQuota {
                quota_difference(first_domain, domain, class)
            } else {
                None
            };
            if let Some(differs) = differs {
                let (file, line, column) = &def.defined_at;
                return Err(ConfigError::Invalid {
                    file: file.clone(),
                    position: Some((*line, *column)),
                    at: format!("class {class}"),
                    message: format!(
                        "class '{class}' of class scope '{}' is sized differently at {}:{}:{}{differs}; rules sharing a class must agree on its limit",
                        domain.class_scope,
                        first.defined_at.0.display(),
                        first.defined_at.1,
                        first.defined_at.2
                    ),
                });
            }
        }
    }
    Ok(())
}

// Where two domains resolve a tenant's quota for `class` differently, as " for <whom> (<here> here,
// <there> there)": every tier either defines, a tier neither knows (the default tier), and every
// inline tenant either lists. Quota records from PostgreSQL are per tenant, the same in both.
fn quota_difference(there: &Domain, here: &Domain, class: &str) -> Option<String> {
    let differs = |whom: String, pick: &dyn Fn(&Domain) -> Option<BucketSpec>| {
        let (a, b) = (pick(here), pick(there));
        (a != b).then(|| format!(" for {whom} ({} here, {} there)", describe(a), describe(b)))
    };
    let unknown = || differs("tenants of no known tier".to_owned(), &|d| d.quotas.resolve(None, class));
    let tier = |tier: &String| {
        let record = TenantRecord { tier: Some(tier.clone()), ..TenantRecord::default() };
        differs(format!("tier '{tier}'"), &|d| d.quotas.resolve(Some(&record), class))
    };
    let tenant = |tenant: &String| {
        differs(format!("tenant '{tenant}'"), &|d| {
            d.quotas.resolve(d.tenants.get(tenant).map(Arc::as_ref), class)
        })
    };
    unknown()
        .or_else(|| there.quotas.tiers.keys().chain(here.quotas.tiers.keys()).find_map(tier))
        .or_else(|| there.tenants.keys().chain(here.tenants.keys()).find_map(tenant))
}

fn describe(spec: Option<BucketSpec>) -> String {
    match spec {
        Some(s) => format!("capacity {}, {}/s", s.capacity(), s.refill_per_second()),
        None => "no tier".to_owned(),
    }
}

// The files a config path stands for, in a stable order.
fn config_files(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let io = |source| ConfigError::Io { path: path.to_owned(), source };
    if !path.is_dir() {
        std::fs::metadata(path).map_err(io)?;
        return Ok(vec![path.to_owned()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        if !yaml || name.starts_with('.') {
            continue;
        }
        // `metadata` follows symlinks, which is how ConfigMap volumes present their files: a
        // link whose target is gone (a `..data` swap caught half way, a broken deploy) is an
        // error, not a file that was never there.
        let file = entry.path();
        let metadata =
            std::fs::metadata(&file).map_err(|source| ConfigError::Io { path: file.clone(), source })?;
        if metadata.is_file() {
            files.push(file);
        }
    }
    if files.is_empty() {
        return Err(ConfigError::NoFiles { dir: path.to_owned() });
    }
    files.sort();
    Ok(files)
}

/// The hash a price file's text is compared by.
pub(crate) fn text_hash(text: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    text.hash(&mut hasher);
    hasher.finish()
}

/// Why a config could not be loaded. Every variant names the file, in the form
/// `file:line:column: path: problem` where the position and path are known.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The path or a file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path or file.
        path: PathBuf,
        /// Why it could not be read.
        #[source]
        source: std::io::Error,
    },
    /// A directory holds no config file.
    #[error("{}: no *.yaml or *.yml files in this directory", dir.display())]
    NoFiles {
        /// The directory.
        dir: PathBuf,
    },
    /// Not YAML, not of the schema (unknown key, wrong type), or valid YAML whose meaning is
    /// wrong.
    #[error("{}{}: {}{message}", file.display(), position.map(|(l, c)| format!(":{l}:{c}")).unwrap_or_default(), if at.is_empty() { String::new() } else { format!("{at}: ") })]
    Invalid {
        /// The file.
        file: PathBuf,
        /// Line and column of what is wrong, where known.
        position: Option<(usize, usize)>,
        /// Where in the file's tree, e.g. `descriptors[0](tenant).descriptors[1](class=export)`
        /// or `default_tier`; empty where the parser does not say.
        at: String,
        /// What is wrong.
        message: String,
    },
    /// Two files define the same domain.
    #[error("{}: duplicate domain '{domain}' (already defined in {})", file.display(), first.display())]
    DuplicateDomain {
        /// The second file.
        file: PathBuf,
        /// The domain.
        domain: String,
        /// The file that defined it first.
        first: PathBuf,
    },
    /// Several files are wrong: each error, one per line.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Files(Vec<ConfigError>),
}

/// One domain, compiled.
#[derive(Debug)]
pub struct Domain {
    /// The domain name Envoy sends.
    pub name: String,
    /// The file it came from.
    pub file: PathBuf,
    /// The descriptor entry key that carries the tenant id.
    pub tenant_key: String,
    /// Where this domain's class buckets live: its own name unless `class_scope:` says
    /// otherwise; domains with the same scope share class buckets.
    pub class_scope: String,
    /// Every explicit class of the domain's rules, with what sizes it.
    pub classes: IndexMap<String, ClassDef>,
    /// What to answer when the store fails.
    pub failure_mode: FailureMode,
    /// What a Rate Limit Quota bucket that no rule limits gets (`rlqs_unknown:`).
    pub rlqs_unknown: Blanket,
    /// Which response headers to send.
    pub headers: HeaderSets,
    /// Tiers for `quota: tenant` rules.
    pub quotas: Quotas,
    /// The inline tenant records (`tenants:`), the embedded quota source.
    pub tenants: InlineTenants,
    /// Every rule (node with a limit, `unlimited` included), in file order.
    pub rules: Vec<Arc<Rule>>,
    /// Its prices and budget settings, if it prices LLM tokens ([`crate::budget`]).
    pub priced: Option<Priced>,
    /// The descriptor key whose value names a request: it pairs a budget's hold with its
    /// settlement, and a concurrency slot's take with its give-back (`request_id_key:`).
    pub request_id_key: String,
    /// The descriptor tree.
    pub root: Level,
}

/// A priced domain's settings: what tokens cost and how holds behave.
#[derive(Debug)]
pub struct Priced {
    /// The price table in force.
    pub prices: Arc<PriceTable>,
    /// The file the table was read from (`prices: {file: PATH}`), watched like the config, and
    /// a hash of what it held.
    pub prices_file: Option<(PathBuf, u64)>,
    /// The descriptor key whose value names the model (`model_key:`).
    pub model_key: String,
    /// The descriptor key of the optional entry, right before the request id, whose value is the
    /// request body's size in bytes (`input_bytes_key:`): the input tokens held are sized by it.
    pub input_bytes_key: String,
    /// How long a hold stands unless settled.
    pub hold_ttl: std::time::Duration,
    /// What an expired hold becomes.
    pub on_lost_settle: LostSettle,
}

impl Domain {
    /// Every node with a `budget:`, as its descriptor key and its soft limits, in tree order.
    pub fn budget_levels(&self) -> Vec<(&str, &[crate::budget::Money])> {
        fn walk<'a>(level: &'a Level, out: &mut Vec<(&'a str, &'a [crate::budget::Money])>) {
            for node in level.nodes() {
                if let Some(budget) = &node.budget {
                    out.push((node.key.as_str(), budget.alert_at.as_slice()));
                }
                walk(&node.children, out);
            }
        }
        let mut out = Vec::new();
        walk(&self.root, &mut out);
        out
    }

    /// Every node with a concurrency limit, as its path of keys (`tenant.route`) and its limit,
    /// in tree order.
    pub fn concurrency_limits(&self) -> Vec<(String, crate::slot::ConcurrencySpec)> {
        fn walk(level: &Level, above: &str, out: &mut Vec<(String, crate::slot::ConcurrencySpec)>) {
            for node in level.nodes() {
                let path = if above.is_empty() { node.key.clone() } else { format!("{above}.{}", node.key) };
                if let Some(limit) = node.concurrency {
                    out.push((path.clone(), limit));
                }
                walk(&node.children, &path, out);
            }
        }
        let mut out = Vec::new();
        walk(&self.root, "", &mut out);
        out
    }

    /// The rule `entries` selects, if any ([`crate::matcher`]).
    pub fn lookup<E: DescriptorEntry>(&self, entries: &[E]) -> Option<&Arc<Rule>> {
        self.root.lookup(entries)
    }

    /// The descriptor entries a Rate Limit Quota bucket id stands for ([`Level::bucket_entries`]).
    pub fn bucket_entries<'b>(&self, bucket: &'b HashMap<String, String>) -> Option<Vec<(&'b str, &'b str)>> {
        self.root.bucket_entries(bucket)
    }
}

/// The answer when the store cannot be asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Answer OK (fail open).
    #[default]
    Allow,
    /// Answer OVER_LIMIT (fail closed).
    Deny,
    /// Return gRPC UNAVAILABLE and let Envoy's `failure_mode_deny` decide.
    Error,
}

impl fmt::Display for FailureMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FailureMode::Allow => "allow",
            FailureMode::Deny => "deny",
            FailureMode::Error => "error",
        })
    }
}

/// A Rate Limit Quota answer for every request of a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Blanket {
    /// Every request is admitted.
    #[default]
    AllowAll,
    /// Every request is refused.
    DenyAll,
}

/// Which groups of response headers a domain sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HeaderSets {
    /// `X-RateLimit-Limit` and `X-RateLimit-Remaining`.
    pub x_ratelimit: bool,
    /// `Retry-After` on OVER_LIMIT.
    pub retry_after: bool,
    /// IETF `RateLimit-Policy` and `RateLimit`.
    pub ietf: bool,
    /// `grpc-status-details-bin` (google.rpc.Status with RetryInfo) on OVER_LIMIT, for domains
    /// that serve gRPC.
    pub grpc_status_details: bool,
}

impl Default for HeaderSets {
    fn default() -> Self {
        HeaderSets { x_ratelimit: true, retry_after: true, ietf: false, grpc_status_details: false }
    }
}
