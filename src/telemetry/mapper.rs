//! statsd_exporter's mapping file, applied in process: envoyproxy/ratelimit's statsd names become
//! Prometheus series with labels, as Envoy Gateway's dashboards expect (`PROMETHEUS_MAPPER_YAML`).
//!
//! Owned here rather than taken from a library: no Rust crate reads statsd_exporter's mapping
//! format. The subset is what Envoy Gateway's file and envoyproxy/ratelimit's default use, with
//! statsd_exporter's meaning: `match` as a glob (`*` is one dot-free run of characters, the
//! whole name must match) or, with `match_type: regex`, a regular expression found anywhere in
//! the name; `name` and `labels` expanded from the captures (`$1`, `${1}`, `$name`);
//! `match_metric_type` (counter, gauge, observer or its old name timer); `timer_type` /
//! `observer_type` (histogram, else summary); `scale`; `action: drop`. Globs are tried before
//! regular expressions, each kind in file order, as statsd_exporter does; an unmapped name keeps
//! its name with every character outside `[a-zA-Z0-9_]` turned into `_`.

use indexmap::IndexMap;
use regex::Regex;
use serde::Deserialize;

/// What a statsd line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatKind {
    /// `|c`
    Counter,
    /// `|g`
    Gauge,
    /// `|ms` (and `|h`, `|d`): an observation.
    Timer,
}

/// A mapped series: its Prometheus name, labels and how observations are kept.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapped {
    /// The Prometheus name.
    pub name: String,
    /// Labels in file order.
    pub labels: Vec<(String, String)>,
    /// Observations go into a histogram (else a summary).
    pub histogram: bool,
    /// Multiplies every value.
    pub scale: f64,
}

/// A compiled mapping file.
#[derive(Debug)]
pub struct Mapper {
    globs: Vec<Rule>,
    regexes: Vec<Rule>,
}

#[derive(Debug)]
struct Rule {
    pattern: Regex,
    name: String,
    labels: IndexMap<String, String>,
    kind: Option<StatKind>,
    histogram: bool,
    scale: f64,
    drop: bool,
}

#[derive(Deserialize)]
struct File {
    #[serde(default)]
    mappings: Vec<Entry>,
}

#[derive(Deserialize)]
struct Entry {
    #[serde(rename = "match")]
    pattern: String,
    #[serde(default)]
    match_type: Option<String>,
    #[serde(default)]
    name: String,
    #[serde(default)]
    labels: IndexMap<String, String>,
    #[serde(default)]
    match_metric_type: Option<String>,
    #[serde(default)]
    timer_type: Option<String>,
    #[serde(default)]
    observer_type: Option<String>,
    #[serde(default)]
    scale: Option<f64>,
    #[serde(default)]
    action: Option<String>,
    // Read and unused: statsd_exporter's HELP text.
    #[serde(default)]
    #[allow(dead_code)]
    help: Option<String>,
}

/// envoyproxy/ratelimit's own mapping (`envoyproxy/ratelimit/src/stats/prom/default_mapper.yaml`), used when no
/// file is given.
pub const DEFAULT_MAPPING: &str = include_str!("default_mapper.yaml");

impl Mapper {
    /// Compiles a mapping file's text.
    pub fn parse(text: &str) -> Result<Mapper, String> {
        let file: File = serde_saphyr::from_str(text).map_err(|e| e.to_string())?;
        let mut mapper = Mapper { globs: Vec::new(), regexes: Vec::new() };
        for (i, entry) in file.mappings.into_iter().enumerate() {
            let at = |what: String| format!("mappings[{i}] ({}): {what}", entry.pattern);
            let regex = match entry.match_type.as_deref() {
                None | Some("glob" | "") => false,
                Some("regex") => true,
                Some(other) => return Err(at(format!("unknown match_type {other:?}"))),
            };
            let source = if regex { entry.pattern.clone() } else { glob(&entry.pattern) };
            let pattern = Regex::new(&source).map_err(|e| at(e.to_string()))?;
            let kind = match entry.match_metric_type.as_deref() {
                None | Some("") => None,
                Some("counter") => Some(StatKind::Counter),
                Some("gauge") => Some(StatKind::Gauge),
                Some("observer" | "timer") => Some(StatKind::Timer),
                Some(other) => return Err(at(format!("unknown match_metric_type {other:?}"))),
            };
            let observer = entry.observer_type.or(entry.timer_type);
            let drop = match entry.action.as_deref() {
                None | Some("map" | "") => false,
                Some("drop") => true,
                Some(other) => return Err(at(format!("unknown action {other:?}"))),
            };
            if !drop && entry.name.is_empty() {
                return Err(at("a mapping needs a name".into()));
            }
            let rule = Rule {
                pattern,
                name: entry.name,
                labels: entry.labels,
                kind,
                histogram: observer.as_deref() == Some("histogram"),
                scale: entry.scale.unwrap_or(1.0),
                drop,
            };
            if regex { &mut mapper.regexes } else { &mut mapper.globs }.push(rule);
        }
        Ok(mapper)
    }

    /// The series `name` of `kind` maps to; `None` for a dropped name.
    pub fn map(&self, name: &str, kind: StatKind) -> Option<Mapped> {
        for rule in self.globs.iter().chain(&self.regexes) {
            if rule.kind.is_some_and(|k| k != kind) {
                continue;
            }
            let Some(captures) = rule.pattern.captures(name) else { continue };
            if rule.drop {
                return None;
            }
            let expand = |template: &str| {
                let mut out = String::new();
                captures.expand(template, &mut out);
                out
            };
            return Some(Mapped {
                name: expand(&rule.name),
                labels: rule.labels.iter().map(|(k, v)| (k.clone(), expand(v))).collect(),
                histogram: rule.histogram,
                scale: rule.scale,
            });
        }
        let escaped = name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        Some(Mapped { name: escaped, labels: Vec::new(), histogram: false, scale: 1.0 })
    }

    /// The names of the histograms the file can produce, for their buckets.
    pub fn histogram_names(&self) -> impl Iterator<Item = &str> {
        self.globs.iter().chain(&self.regexes).filter(|r| r.histogram).map(|r| r.name.as_str())
    }
}

// A glob as an anchored regular expression: `*` is a run of characters without a dot.
fn glob(pattern: &str) -> String {
    let parts: Vec<String> = pattern.split('*').map(regex::escape).collect();
    format!("^{}$", parts.join("([^.]*)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENVOY_GATEWAY: &str = include_str!("../../tests/data/envoy-gateway/statsd_conf.yaml");

    fn labels(m: &Mapped) -> Vec<(&str, &str)> {
        m.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }

    #[test]
    fn envoy_gateways_file_maps_every_name_ratelimit_sends() {
        let mapper = Mapper::parse(ENVOY_GATEWAY).unwrap();
        let one =
            mapper.map("ratelimit.service.rate_limit.api.path_/a.total_hits", StatKind::Counter).unwrap();
        assert_eq!(one.name, "ratelimit_service_rate_limit_total_hits");
        assert_eq!(labels(&one), [("domain", "api"), ("key1", "path_/a")]);
        assert!(one.histogram, "timer_type histogram is kept, whatever the kind");

        let deep = "ratelimit.service.rate_limit.api.route_r.rule-0-match-0_x.user.over_limit";
        let deep = mapper.map(deep, StatKind::Counter).unwrap();
        assert_eq!(deep.name, "ratelimit_service_rate_limit_over_limit");
        assert_eq!(labels(&deep), [("domain", "api"), ("key1", "route_r"), ("key2", "rule-0-match-0_x")]);

        let err =
            mapper.map("ratelimit.service.call.should_rate_limit.redis_error", StatKind::Counter).unwrap();
        assert_eq!(
            (err.name.as_str(), labels(&err)),
            ("ratelimit_service_should_rate_limit_error", vec![("err_type", "redis_error")])
        );
        assert_eq!(
            mapper.map("ratelimit.service.call.should_rate_limit.redis_error", StatKind::Timer).unwrap().name,
            "ratelimit_service_call_should_rate_limit_redis_error",
            "match_metric_type: counter does not match a timer"
        );
        let time = mapper.map("ratelimit_server.ShouldRateLimit.response_time", StatKind::Timer).unwrap();
        assert_eq!(
            (time.name.as_str(), labels(&time)),
            ("ratelimit_service_response_time_seconds", vec![("grpc_method", "ShouldRateLimit")])
        );
        assert!(time.histogram);
        let loaded = mapper.map("ratelimit.service.config_load_success", StatKind::Counter).unwrap();
        assert_eq!(loaded.name, "ratelimit_service_config_load_success");
    }

    #[test]
    fn globs_match_whole_names_and_regexes_anywhere_drop_drops() {
        let mapper = Mapper::parse(
            "mappings:\n- match: a.*\n  name: glob_$1\n- match: 'b\\.(x+)'\n  match_type: regex\n  name: re_${1}\n- match: '.'\n  match_type: regex\n  action: drop\n  name: dropped\n",
        )
        .unwrap();
        assert_eq!(mapper.map("a.b", StatKind::Counter).unwrap().name, "glob_b");
        assert_eq!(mapper.map("zz.b.xx.y", StatKind::Counter).unwrap().name, "re_xx");
        assert_eq!(
            mapper.map("a.b.c", StatKind::Counter),
            None,
            "the glob's * stops at a dot; the drop catches it"
        );
        assert!(Mapper::parse("mappings:\n- match: x\n  match_type: fuzzy\n  name: y\n").is_err());
    }
}
