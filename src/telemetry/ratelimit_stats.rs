//! envoyproxy/ratelimit's metrics, under its names, for dashboards built on them (Envoy
//! Gateway's among them): sent as statsd over UDP (`USE_STATSD`), or mapped in process through a
//! statsd_exporter mapping file and served for Prometheus (`USE_PROMETHEUS`), or both.
//!
//! The names and types are envoyproxy/ratelimit's (`envoyproxy/ratelimit/src/stats/manager_impl.go`):
//! `ratelimit.service.rate_limit.<domain>.<key>.{total_hits,over_limit,near_limit,within_limit,
//! shadow_mode}` counters per rule (`<key>` is the rule's path, `key_value.key`; with
//! `detailed_metric` the request's own `key_value` entries), `ratelimit.service.call.
//! should_rate_limit.redis_error`, `ratelimit.service.config_load_{success,error}`,
//! `ratelimit_server.ShouldRateLimit.total_requests` and the `response_time` timer in
//! milliseconds. The hits split between within, near and over exactly as there, with the bucket's
//! capacity as the limit and what it lacks of full as the count (see [`tally`]).
//!
//! Counts add up in memory and leave every flush interval, as envoyproxy/ratelimit's stats
//! library does, so a decision costs a map update, not a datagram. The names a client can vary
//! (`detailed_metric` keys) are bounded per interval; `domain_not_found`, whose name would be
//! whatever domain a client sends, is not kept.

use std::collections::HashMap;
use std::net::UdpSocket;
use std::sync::{LazyLock, Mutex, OnceLock};
use std::time::Duration;

use metrics::{Key, Label, Recorder as _};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};
use regex::Regex;

use super::mapper::{Mapper, StatKind};

/// The largest statsd datagram: fits an Ethernet frame's payload after IP and UDP headers.
const DATAGRAM: usize = 1432;
/// Most timer samples kept per interval; beyond it every other one is kept, then every fourth..
const SAMPLES: usize = 10_000;
/// Prometheus's default histogram buckets, which statsd_exporter uses.
const DEFAULT_BUCKETS: [f64; 11] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Where the metrics go and how they are counted.
#[derive(Debug, Clone)]
pub struct StatsSettings {
    /// `host:port` to send statsd to.
    pub statsd: Option<String>,
    /// Map and keep for Prometheus, with this mapping file's text (envoyproxy/ratelimit's own
    /// mapping when `None` inside).
    pub prometheus: Option<Option<String>>,
    /// `NEAR_LIMIT_RATIO`.
    pub near_limit_ratio: f64,
    /// Most distinct `detailed_metric` keys per interval.
    pub detailed_keys: usize,
}

/// The counts since the last flush, and the sinks.
pub struct RatelimitStats {
    pending: Mutex<Pending>,
    near_limit_ratio: f64,
    detailed_keys: usize,
    statsd: Option<UdpSocket>,
    prometheus: Option<(Mapper, PrometheusRecorder)>,
}

#[derive(Default)]
struct Pending {
    // domain -> key -> the rule's five counters.
    rules: HashMap<String, HashMap<String, Tally>>,
    counters: HashMap<&'static str, u64>,
    // name -> samples, and how many samples each stands for.
    timers: HashMap<&'static str, (Vec<f64>, u64, u64)>,
    detailed: usize,
}

/// Hits of one rule by how they stood to its limit.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Every hit.
    pub total_hits: u64,
    /// Hits past the limit.
    pub over_limit: u64,
    /// Hits between the near-limit threshold and the limit.
    pub near_limit: u64,
    /// Hits admitted.
    pub within_limit: u64,
    /// Hits past the limit of a rule in shadow mode.
    pub shadow_mode: u64,
}

static STATS: OnceLock<RatelimitStats> = OnceLock::new();

/// The process's stats, if they were installed.
pub fn stats() -> Option<&'static RatelimitStats> {
    STATS.get()
}

/// Installs the process's stats (once; a second call keeps the first).
pub fn install(settings: StatsSettings) -> Result<&'static RatelimitStats, String> {
    let statsd = match &settings.statsd {
        Some(target) => {
            let socket = UdpSocket::bind("0.0.0.0:0").map_err(|e| format!("statsd socket: {e}"))?;
            socket.connect(target).map_err(|e| format!("statsd {target}: {e}"))?;
            socket.set_nonblocking(true).map_err(|e| format!("statsd socket: {e}"))?;
            Some(socket)
        }
        None => None,
    };
    let prometheus = match &settings.prometheus {
        Some(file) => {
            let mapper = Mapper::parse(file.as_deref().unwrap_or(super::mapper::DEFAULT_MAPPING))
                .map_err(|e| format!("PROMETHEUS_MAPPER_YAML: {e}"))?;
            let mut builder = PrometheusBuilder::new();
            for name in mapper.histogram_names() {
                builder = builder
                    .set_buckets_for_metric(Matcher::Full(name.to_owned()), &DEFAULT_BUCKETS)
                    .map_err(|e| e.to_string())?;
            }
            Some((mapper, builder.build_recorder()))
        }
        None => None,
    };
    Ok(STATS.get_or_init(|| RatelimitStats {
        pending: Mutex::default(),
        near_limit_ratio: settings.near_limit_ratio,
        detailed_keys: settings.detailed_keys,
        statsd,
        prometheus,
    }))
}

/// How `hits` stood to a limit of `limit` that lacked `used` of full before them, as
/// envoyproxy/ratelimit splits them (`GetResponseDescriptorStatus`): within the limit, the
/// part past `near` (the limit times the near-limit ratio) is near; over it, the part past the
/// limit is over and the part before it past `near` is near.
pub fn tally(limit: u64, used: u64, hits: u64, near_limit_ratio: f64, shadow: bool) -> Tally {
    let near = (limit as f64 * near_limit_ratio).floor() as u64;
    let after = used + hits;
    let mut t = Tally { total_hits: hits, ..Tally::default() };
    if after > limit {
        let over = if used >= limit { hits } else { after - limit };
        t.over_limit = over;
        if used < limit {
            t.near_limit = limit - near.max(used);
        }
        if shadow {
            t.shadow_mode = over;
        }
    } else {
        t.within_limit = hits;
        if after > near {
            t.near_limit = if used >= near { hits } else { after - near };
        }
    }
    t
}

impl RatelimitStats {
    /// The near-limit ratio hits are split by.
    pub fn near_limit_ratio(&self) -> f64 {
        self.near_limit_ratio
    }

    /// Adds `tally` to the rule of `domain` whose stat key is `key`, or with `detailed` (a
    /// `detailed_metric` key from the request) to that key while the interval has room for it.
    pub fn count_rule(&self, domain: &str, key: &str, detailed: Option<&str>, tally: Tally) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let pending = &mut *pending;
        let rules = match pending.rules.get_mut(domain) {
            Some(rules) => rules,
            None => pending.rules.entry(domain.to_owned()).or_default(),
        };
        let key = match detailed {
            Some(d) if rules.contains_key(d) => d,
            Some(d) if pending.detailed < self.detailed_keys => {
                pending.detailed += 1;
                d
            }
            _ => key,
        };
        let counts = match rules.get_mut(key) {
            Some(counts) => counts,
            None => rules.entry(key.to_owned()).or_default(),
        };
        counts.total_hits += tally.total_hits;
        counts.over_limit += tally.over_limit;
        counts.near_limit += tally.near_limit;
        counts.within_limit += tally.within_limit;
        counts.shadow_mode += tally.shadow_mode;
    }

    /// Adds one to a counter of fixed name.
    pub fn count(&self, name: &'static str) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        *pending.counters.entry(name).or_default() += 1;
    }

    /// Records `elapsed` on a timer of fixed name, in milliseconds.
    pub fn time(&self, name: &'static str, elapsed: Duration) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let (samples, every, seen) = pending.timers.entry(name).or_insert((Vec::new(), 1, 0));
        *seen += 1;
        if *seen % *every == 0 {
            samples.push(elapsed.as_secs_f64() * 1000.0);
            if samples.len() >= SAMPLES {
                // Keep every other sample; each now stands for twice as many.
                let mut i = 0;
                samples.retain(|_| {
                    i += 1;
                    i % 2 == 0
                });
                *every *= 2;
            }
        }
    }

    /// Sends what was counted since the last flush to the sinks.
    pub fn flush(&self) {
        let stats = self.take();
        if let Some(socket) = &self.statsd {
            send_statsd(socket, &stats);
        }
        if let Some((mapper, recorder)) = &self.prometheus {
            record_mapped(mapper, recorder, &stats);
        }
    }

    /// The mapped series in Prometheus text, after a flush (empty without `USE_PROMETHEUS`).
    pub fn render(&self) -> String {
        self.flush();
        self.prometheus.as_ref().map(|(_, r)| r.handle().render()).unwrap_or_default()
    }

    // Empties the pending counts into statsd lines' parts: name, value, kind, and for timers how
    // many samples each stands for.
    fn take(&self) -> Vec<(String, f64, StatKind, u64)> {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        let mut stats = Vec::new();
        for (domain, rules) in &pending.rules {
            for (key, t) in rules {
                let base = sanitize(&format!("ratelimit.service.rate_limit.{domain}.{key}"));
                for (suffix, n) in [
                    ("total_hits", t.total_hits),
                    ("over_limit", t.over_limit),
                    ("near_limit", t.near_limit),
                    ("within_limit", t.within_limit),
                    ("shadow_mode", t.shadow_mode),
                ] {
                    stats.push((format!("{base}.{suffix}"), n as f64, StatKind::Counter, 1));
                }
            }
        }
        for (name, n) in pending.counters {
            stats.push((name.to_owned(), n as f64, StatKind::Counter, 1));
        }
        for (name, (samples, every, _)) in pending.timers {
            stats.extend(samples.into_iter().map(|ms| (name.to_owned(), ms, StatKind::Timer, every)));
        }
        stats
    }
}

// statsd lines, as many to a datagram as fit. A lost datagram is lost, as with any statsd.
fn send_statsd(socket: &UdpSocket, stats: &[(String, f64, StatKind, u64)]) {
    let mut datagram = String::with_capacity(DATAGRAM);
    for (name, value, kind, every) in stats {
        let line = match (kind, every) {
            (StatKind::Counter, _) => format!("{name}:{value}|c"),
            (StatKind::Gauge, _) => format!("{name}:{value}|g"),
            (StatKind::Timer, 1) => format!("{name}:{value}|ms"),
            (StatKind::Timer, every) => format!("{name}:{value}|ms|@{}", 1.0 / *every as f64),
        };
        if !datagram.is_empty() && datagram.len() + 1 + line.len() > DATAGRAM {
            let _ = socket.send(datagram.as_bytes());
            datagram.clear();
        }
        if !datagram.is_empty() {
            datagram.push('\n');
        }
        datagram.push_str(&line);
    }
    if !datagram.is_empty() {
        let _ = socket.send(datagram.as_bytes());
    }
}

fn record_mapped(mapper: &Mapper, recorder: &PrometheusRecorder, stats: &[(String, f64, StatKind, u64)]) {
    static METADATA: metrics::Metadata<'static> =
        metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));
    for (name, value, kind, every) in stats {
        let Some(mapped) = mapper.map(name, *kind) else { continue };
        let labels: Vec<Label> = mapped.labels.into_iter().map(|(k, v)| Label::new(k, v)).collect();
        let key = Key::from_parts(mapped.name, labels);
        match kind {
            StatKind::Counter => recorder.register_counter(&key, &METADATA).increment(*value as u64),
            StatKind::Gauge => recorder.register_gauge(&key, &METADATA).set(*value),
            StatKind::Timer => {
                let histogram = recorder.register_histogram(&key, &METADATA);
                for _ in 0..*every {
                    histogram.record(value * mapped.scale);
                }
            }
        }
    }
}

// envoyproxy/ratelimit's `SanitizeStatName`: `:` and `|` would end a statsd name early, and the
// dots of an IPv4 address would split it.
fn sanitize(name: &str) -> String {
    static IPV4: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}").expect("a valid pattern"));
    let name = name.replace([':', '|'], "_");
    IPV4.replace_all(&name, |c: &regex::Captures<'_>| c[0].replace('.', "_")).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_split_as_envoyproxy_ratelimit_splits_them() {
        // A limit of 10, near at 8.
        let t = |used, hits| tally(10, used, hits, 0.8, false);
        assert_eq!(t(0, 1), Tally { total_hits: 1, within_limit: 1, ..Tally::default() });
        assert_eq!(t(7, 2), Tally { total_hits: 2, within_limit: 2, near_limit: 1, ..Tally::default() });
        assert_eq!(t(8, 2), Tally { total_hits: 2, within_limit: 2, near_limit: 2, ..Tally::default() });
        // Crossing the limit: 2 over, the 2 between near and the limit near.
        assert_eq!(t(8, 4), Tally { total_hits: 4, over_limit: 2, near_limit: 2, ..Tally::default() });
        assert_eq!(t(10, 3), Tally { total_hits: 3, over_limit: 3, ..Tally::default() });
        assert_eq!(tally(10, 10, 3, 0.8, true).shadow_mode, 3);
    }

    #[test]
    fn names_lose_what_would_break_them() {
        assert_eq!(sanitize("a.remote_address_10.0.0.1.b:c|d"), "a.remote_address_10_0_0_1.b_c_d");
    }

    #[test]
    fn timers_thin_out_past_their_bound_and_say_so() {
        let stats = RatelimitStats {
            pending: Mutex::default(),
            near_limit_ratio: 0.8,
            detailed_keys: 1,
            statsd: None,
            prometheus: None,
        };
        for _ in 0..(SAMPLES * 3) {
            stats.time("t", Duration::from_millis(2));
        }
        let taken = stats.take();
        let stands_for: u64 = taken.iter().map(|s| s.3).sum();
        assert!(taken.len() <= SAMPLES);
        assert!(stands_for.abs_diff((SAMPLES * 3) as u64) <= 4 * SAMPLES as u64 / 1000 + 4, "{stands_for}");

        stats.count_rule("d", "k", Some("k_a"), tally(10, 0, 1, 0.8, false));
        stats.count_rule("d", "k", Some("k_b"), tally(10, 0, 1, 0.8, false));
        let names: Vec<String> =
            stats.take().into_iter().filter(|s| s.0.ends_with("total_hits")).map(|s| s.0).collect();
        assert_eq!(names.len(), 2, "one detailed key, then the rule's own: {names:?}");
    }
}
