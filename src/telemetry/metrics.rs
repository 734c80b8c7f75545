//! Prometheus metrics, served at `/metrics` on the HTTP port.
//!
//! Counters and histograms go through the `metrics` facade from wherever the event happens
//! (limiter, stores, quota cache, reloader); this module installs the exporter, describes every
//! metric, records decisions, and renders the scrape, including the top denied tenants that the
//! facade cannot express (a set of series that changes every window).
//!
//! Every label set is bounded whatever clients send: domains are configured names (unknown ones
//! are counted as `(unknown)`), rules are config paths, per-tenant series exist only for rules
//! with `detailed_metric: true` and are capped, and the top denied tenants are k series.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, Unit};
use metrics_exporter_prometheus::{BuildError, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;
use tokio_util::task::AbortOnDropHandle;

use super::records::RecordsKept;
use super::top_denied::TopDenied;
use crate::config::{FailureMode, RuleSet};

/// Histogram buckets in seconds: fine enough for p50/p99 from 50 µs to 100 ms, then coarse.
pub const LATENCY_BUCKETS: [f64; 24] = [
    0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0004, 0.0005, 0.0007, 0.001, 0.0015, 0.002, 0.003, 0.004,
    0.005, 0.007, 0.01, 0.015, 0.02, 0.03, 0.05, 0.07, 0.1, 0.25, 1.0,
];

/// The `domain` label of requests for domains not in the config.
pub const UNKNOWN_DOMAIN: &str = "(unknown)";
/// The `tenant` label once the per-tenant series budget is spent.
pub const OTHER_TENANTS: &str = "(other)";

/// Bounds of the per-tenant series.
#[derive(Debug, Clone, Copy)]
pub struct TelemetryConfig {
    /// How many of the most-denied tenants to export.
    pub top_denied: usize,
    /// The window over which denials are ranked.
    pub top_denied_window: Duration,
    /// Most distinct (domain, rule, tenant) series for `detailed_metric` rules.
    pub detailed_series: usize,
    /// How long a counter or gauge may go untouched before the recorder forgets it
    /// ([`super::series`]).
    pub series_idle: Duration,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            top_denied: 10,
            top_denied_window: Duration::from_secs(60),
            detailed_series: 10_000,
            series_idle: super::series::DEFAULT_IDLE,
        }
    }
}

/// The metrics side of the service.
pub struct Telemetry {
    prometheus: Option<PrometheusHandle>,
    // Keeps the exporter's histograms bounded; stops with the telemetry.
    _upkeep: Option<AbortOnDropHandle<()>>,
    top_denied: TopDenied,
    // Per (domain, budget level), the top spenders of the window, in nano-units.
    top_spenders: Mutex<HashMap<(String, String), TopDenied>>,
    top_config: (usize, Duration),
    records: RecordsKept,
    detailed_series: usize,
    detailed_seen: Mutex<HashSet<String>>,
    series_idle: Duration,
}

impl Telemetry {
    /// Installs the process-wide Prometheus recorder and describes every metric. Call once, from
    /// inside the Tokio runtime (it starts the exporter's upkeep task).
    pub fn install(config: TelemetryConfig) -> Result<Telemetry, BuildError> {
        // Counters and gauges untouched for `--metrics-idle` are forgotten; those of the config in
        // force are touched by keep_series (see series.rs). Histograms have no domain label.
        let handle = PrometheusBuilder::new()
            .set_buckets(&LATENCY_BUCKETS)?
            .idle_timeout(MetricKindMask::COUNTER | MetricKindMask::GAUGE, Some(config.series_idle))
            .install_recorder()?;
        let upkeep = handle.clone();
        let upkeep = AbortOnDropHandle::new(tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(5));
            loop {
                every.tick().await;
                upkeep.run_upkeep();
            }
        }));
        describe();
        register_at_zero();
        Ok(Telemetry {
            prometheus: Some(handle),
            _upkeep: Some(upkeep),
            ..Telemetry::without_exporter(config)
        })
    }

    /// Telemetry that keeps the top-denied ranking but exports nothing (for embedding the
    /// limiter where another recorder, or none, is installed).
    pub fn without_exporter(config: TelemetryConfig) -> Telemetry {
        Telemetry {
            prometheus: None,
            _upkeep: None,
            top_denied: TopDenied::new(config.top_denied, config.top_denied_window),
            top_spenders: Mutex::default(),
            top_config: (config.top_denied, config.top_denied_window),
            records: RecordsKept::new(),
            detailed_series: config.detailed_series,
            detailed_seen: Mutex::new(HashSet::new()),
            series_idle: config.series_idle,
        }
    }

    /// Touches every series that exists from startup and those of `rules`' domains and rules,
    /// so that the recorder keeps them however long they stay at their value.
    pub fn touch_series(&self, rules: &RuleSet) {
        register_at_zero();
        register_domains(rules);
    }

    /// How long an untouched counter or gauge is kept.
    pub fn series_idle(&self) -> Duration {
        self.series_idle
    }

    /// Lets the recorder forget what has been idle (it does so only as it renders).
    pub fn prune_series(&self) {
        if let Some(handle) = &self.prometheus {
            drop(handle.render());
        }
    }

    /// Counts `hits` of `domain`'s `rule` (its path, empty for none) decided as `decision`.
    pub fn count_decision(&self, domain: &str, rule: &str, decision: &'static str, hits: u64) {
        counter!("tollgate_decisions_total", "domain" => domain.to_owned(), "rule" => rule.to_owned(), "decision" => decision)
            .increment(hits);
    }

    /// Counts `hits` of `tenant` under a `detailed_metric` rule; tenants beyond the series
    /// budget are counted as `(other)`.
    pub fn count_tenant_decision(
        &self,
        domain: &str,
        rule: &str,
        tenant: &str,
        decision: &'static str,
        hits: u64,
    ) {
        let tenant = self.detailed_label(domain, rule, tenant);
        counter!("tollgate_tenant_decisions_total", "domain" => domain.to_owned(), "rule" => rule.to_owned(), "tenant" => tenant, "decision" => decision)
            .increment(hits);
    }

    /// Counts `hits` denied to `tenant`, for the top denied tenants.
    pub fn count_denied_tenant(&self, tenant: &str, hits: u64) {
        self.top_denied.record(tenant, hits);
    }

    /// Counts `nanos` spent by `subject` (a level's value, or its hash) at budget `level` of
    /// `domain`, for the top spenders per level; bounded like the top denied tenants, and by
    /// the levels of the loaded priced domains.
    pub fn record_spend(&self, domain: &str, level: &str, subject: &str, nanos: u128) {
        let (k, window) = self.top_config;
        let mut tops = self.top_spenders.lock().unwrap_or_else(|p| p.into_inner());
        tops.entry((domain.to_owned(), level.to_owned()))
            .or_insert_with(|| TopDenied::new(k, window))
            .record(subject, u64::try_from(nanos).unwrap_or(u64::MAX));
    }

    /// Counts a budget request record of `domain` written now, which the store may keep for
    /// `kept` ([`RecordsKept`]).
    pub fn record_written(&self, domain: &str, kept: Duration) {
        self.records.written(domain, kept);
    }

    // The tenant label, or `(other)` once the series budget is spent on other tenants.
    fn detailed_label(&self, domain: &str, rule: &str, tenant: &str) -> String {
        let series = format!("{domain}\0{rule}\0{tenant}");
        let mut seen = self.detailed_seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.contains(&series) || seen.len() < self.detailed_series {
            seen.insert(series);
            tenant.to_owned()
        } else {
            OTHER_TENANTS.to_owned()
        }
    }

    /// The Prometheus text exposition for `/metrics`.
    pub fn render(&self) -> String {
        self.records.refresh();
        let mut out = self.prometheus.as_ref().map(PrometheusHandle::render).unwrap_or_default();
        let help = METRICS.iter().find(|m| m.0 == "tollgate_top_denied_tenant_hits").map_or("", |m| m.2);
        let _ = writeln!(out, "# HELP tollgate_top_denied_tenant_hits {help}");
        out.push_str("# TYPE tollgate_top_denied_tenant_hits gauge\n");
        for (rank, (tenant, hits)) in self.top_denied.last_window().iter().enumerate() {
            let _ = writeln!(
                out,
                "tollgate_top_denied_tenant_hits{{rank=\"{}\",tenant=\"{}\"}} {hits}",
                rank + 1,
                escape_label(tenant)
            );
        }
        let help = METRICS.iter().find(|m| m.0 == "tollgate_budget_top_spenders_nanos").map_or("", |m| m.2);
        let _ = writeln!(out, "# HELP tollgate_budget_top_spenders_nanos {help}");
        out.push_str("# TYPE tollgate_budget_top_spenders_nanos gauge\n");
        let tops = self.top_spenders.lock().unwrap_or_else(|p| p.into_inner());
        for ((domain, level), top) in tops.iter() {
            for (rank, (subject, nanos)) in top.last_window().iter().enumerate() {
                let _ = writeln!(
                    out,
                    "tollgate_budget_top_spenders_nanos{{domain=\"{}\",level=\"{}\",rank=\"{}\",value=\"{}\"}} {nanos}",
                    escape_label(domain),
                    escape_label(level),
                    rank + 1,
                    escape_label(subject)
                );
            }
        }
        out
    }
}

// Label values in the text format escape backslash, double quote and newline.
fn escape_label(value: &str) -> String {
    value.replace('\\', r"\\").replace('"', "\\\"").replace('\n', r"\n")
}

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution in buckets.
    Histogram,
}

/// Every metric tollgate exports: name, kind, help. The book's metric table and the Grafana
/// dashboard are checked against this list.
pub const METRICS: &[(&str, Kind, &str)] = &[
    ("tollgate_decisions_total", Kind::Counter, "Decisions per domain, rule and outcome (ok, over_limit, shadow_over_limit, failed_open, failed_closed, error), counted in hits."),
    ("tollgate_tenant_decisions_total", Kind::Counter, "Decisions per tenant for rules with detailed_metric: true, counted in hits; tenants beyond the series budget are counted as (other)."),
    ("tollgate_top_denied_tenant_hits", Kind::Gauge, "Denied hits of the most-denied tenants in the last complete window."),
    ("tollgate_invalid_requests_total", Kind::Counter, "Requests rejected with INVALID_ARGUMENT."),
    ("tollgate_overload_rejections_total", Kind::Counter, "Requests refused with RESOURCE_EXHAUSTED because --max-inflight decisions were in progress."),
    ("tollgate_rls_fast_path_fallbacks_total", Kind::Counter, "ShouldRateLimit requests the fast path handed to tonic's generic stack (compressed, malformed or undecodable)."),
    ("tollgate_connections_refused_total", Kind::Counter, "Connections closed at once, by port (grpc, http) and reason: cap (--max-connections established), per_source (--max-connections-per-source), opening (the budget for connections still opening, or the source's part of it), slow_opening (no TLS handshake or first bytes within 5 s)."),
    ("tollgate_request_duration_seconds", Kind::Histogram, "Time to answer one ShouldRateLimit call, from receipt to response."),
    ("tollgate_store_duration_seconds", Kind::Histogram, "Time of one bucket script call, measured at the Redis client, failures included."),
    ("tollgate_store_calls_total", Kind::Counter, "Bucket script calls sent to Redis."),
    ("tollgate_store_up", Kind::Gauge, "1 while the store answers its once-a-second ping, else 0."),
    ("tollgate_store_down_total", Kind::Counter, "Times the store stopped answering (or changed why), by cause: authentication, permission, tls, connection_refused, connection_lost, dns, timeout, cluster_coverage, other."),
    ("tollgate_store_call_groups_total", Kind::Counter, "Groups (one per tenant or key of a request) evaluated by those calls; divided by the calls, the average coalescing batch."),
    ("tollgate_precheck_answers_total", Kind::Counter, "Groups denied by the exact local pre-check without a Redis call."),
    ("tollgate_concurrency_repairs_total", Kind::Counter, "Slot give-backs sent again in the background after a failed call, by domain, kind (give_back, give_back_refused_take) and outcome (ok, failed: left to the ttl)."),
    ("tollgate_concurrency_slots_total", Kind::Counter, "Concurrency slots by domain, node and event: taken, refused (a full set), given_back, expired (ended without a give-back)."),
    ("tollgate_global_shares", Kind::Gauge, "In a region (--global-url): global buckets this replica holds a share of."),
    ("tollgate_global_budget_leases", Kind::Gauge, "In a region (--global-url): global budget levels this replica holds a money lease of."),
    ("tollgate_global_shares_refused_total", Kind::Counter, "In a region: requests for a global bucket or budget beyond the most shares or money leases a replica holds (denied)."),
    ("tollgate_global_rounds_total", Kind::Counter, "In a region: renewal calls to the global tier, by outcome: ok, failed (no answer in time, or an error; the shares keep their life)."),
    ("tollgate_global_cut_off_seconds", Kind::Gauge, "In a region: seconds since this replica's renewal rounds stopped reaching the global tier (0 while they reach it)."),
    ("tollgate_global_fallbacks_total", Kind::Counter, "In a region: global buckets (and global budget levels) of requests decided by the fallback for want of a live share or money lease (none leased within the first-lease wait, or it lapsed): denied, or split (a bucket decided on its part in this region's store)."),
    ("tollgate_global_renewals_total", Kind::Counter, "Buckets in regions' lease renewals at the global tier, by outcome: ok, unknown (no rule marked global limits it), store_failed."),
    ("tollgate_concurrency_slots_open", Kind::Gauge, "Slots this replica took less those it saw given back or expired, by domain and node; summed over the replicas, the slots open."),
    ("tollgate_precheck_hearing_raises", Kind::Gauge, "1 while the pre-check hears other replicas' balance raises (it answers denials itself only then), else 0."),
    ("tollgate_precheck_subscription_losses_total", Kind::Counter, "Times the subscription to other replicas' balance raises was lost (the pre-check answers nothing until it is back)."),
    ("tollgate_store_reconnects_total", Kind::Counter, "Rebuilds of the Redis Cluster connection after connection errors (to re-read the topology, e.g. after a failover)."),
    ("tollgate_store_refunds_total", Kind::Counter, "Tokens given back by reason: split (a request spanning Cluster slots was denied or failed in one and had taken tokens in another) or late (a script reply came after its caller answered with a denial or an error)."),
    ("tollgate_store_refund_failures_total", Kind::Counter, "Refunds that failed (Redis error): those tokens stay taken."),
    ("tollgate_store_late_replies_total", Kind::Counter, "Script replies that came after their caller's deadline and had taken tokens, by action: refunded (failure_mode deny or error) or kept (allow)."),
    ("tollgate_debt_forgiven_tokens_total", Kind::Counter, "Tokens of charges below a bucket's debt floor (-max_debt) that were forgiven, by domain."),
    ("tollgate_store_errors_total", Kind::Counter, "Failed or timed-out store calls, by domain, kind (error, timeout) and the failure mode that answered."),
    ("tollgate_rlqs_streams", Kind::Gauge, "Open Rate Limit Quota streams (one per Envoy)."),
    ("tollgate_rlqs_buckets", Kind::Gauge, "Buckets this replica's Rate Limit Quota streams report."),
    ("tollgate_rlqs_leaseholders", Kind::Gauge, "(bucket, stream) pairs of this replica: each leases part of its bucket for its Envoy."),
    ("tollgate_rlqs_reports_total", Kind::Counter, "Usage reports received on Rate Limit Quota streams."),
    ("tollgate_rlqs_leases_total", Kind::Counter, "Lease ops on shared buckets, by outcome: set (taken, resized or renewed), failed (the stream gets the failure mode)."),
    ("tollgate_rlqs_holds_total", Kind::Counter, "Deprecated: tollgate_rlqs_leases_total under its old name, exported until 0.3.0."),
    ("tollgate_rlqs_holders", Kind::Gauge, "Deprecated: tollgate_rlqs_leaseholders under its old name, exported until 0.3.0."),
    ("tollgate_rlqs_allowed_requests_total", Kind::Counter, "Requests Envoys reported they allowed under their assignments."),
    ("tollgate_rlqs_assignments_total", Kind::Counter, "Assignments sent to Envoys, by kind (token_bucket, deny_all, allow_all)."),
    ("tollgate_rlqs_unknown_buckets_total", Kind::Counter, "Reports of bucket ids no rule limits (answered with the domain's rlqs_unknown)."),
    ("tollgate_rlqs_unknown_domain_reports_total", Kind::Counter, "RLQS usage reports for a domain that is not loaded (its buckets are allowed, as RLS allows that domain)."),
    ("tollgate_rlqs_abandoned_buckets_total", Kind::Counter, "RLQS buckets abandoned after --rlqs-abandon-after without usage (the Envoy drops them; so does tollgate)."),
    ("tollgate_rlqs_stream_errors_total", Kind::Counter, "RLQS streams ended by tollgate: too_large (a report over the message size limit), no_bucket_id, or unread (answers left unread past the deadline)."),
    ("tollgate_rlqs_buckets_refused_total", Kind::Counter, "RLQS bucket ids not tracked (no assignment: Envoy applies its no_assignment_behavior), by reason: stream_limit (--rlqs-max-buckets-per-stream), peer_limit (a quarter of --rlqs-max-buckets, per source address) or replica_limit (--rlqs-max-buckets)."),
    ("tollgate_rlqs_streams_refused_total", Kind::Counter, "RLQS streams refused with RESOURCE_EXHAUSTED because --rlqs-max-streams were open, or a quarter of them from the stream's source address."),
    ("tollgate_quota_cache_lookups_total", Kind::Counter, "Quota cache lookups: hit (fresh), stale (served while refreshing), miss (queried)."),
    ("tollgate_quota_db_queries_total", Kind::Counter, "Tenant lookups sent to the quota database."),
    ("tollgate_quota_db_errors_total", Kind::Counter, "Quota database queries that failed (error) or took too long (timeout)."),
    ("tollgate_quota_deadline_exceeded_total", Kind::Counter, "Decisions that went on without waiting for a quota query (past the Redis deadline)."),
    ("tollgate_quota_bad_rows_total", Kind::Counter, "Invalid rows in tollgate_overrides that were skipped."),
    ("tollgate_quota_cache_entries", Kind::Gauge, "Tenants held in the quota cache."),
    ("tollgate_config_reloads_total", Kind::Counter, "Config reloads by result: success, failure (the last good config keeps serving), warning (loaded, but domains whose files are gone are kept until SIGHUP confirms)."),
    ("tollgate_rule_limit", Kind::Gauge, "Each rule's configured limit, for utilisation alerts: kind=capacity and kind=refill_per_second (tokens), and for rate_limit rules kind=requests_per_unit with its unit."),
    ("tollgate_xds_updates_total", Kind::Counter, "Configs pushed over xDS, by result: accepted (ACKed) or rejected (NACKed; the config in force stays)."),
    ("tollgate_global_renewals_refused_total", Kind::Counter, "At the global tier: RegionLeases calls refused because the caller's certificate is missing or not valid for its region's name (--global-region-san)."),
    ("tollgate_global_reports_cut_total", Kind::Counter, "At the global tier: money lease reports whose spend or ask was above the budget's amount, cut to it."),
    ("tollgate_leaseholders_refused_total", Kind::Counter, "Lease ops refused because the bucket has its most leaseholders (100) with live leases (by=bucket: an RLQS stream's, or a region's at the global tier), or a region's renewal naming more than that (by=region)."),
    ("tollgate_xds_domains_removed_total", Kind::Counter, "Domains an accepted xDS push dropped (no longer limited; each logged at WARN)."),
    ("tollgate_xds_pushes_paced_total", Kind::Counter, "xDS pushes held back because pushes replace domains and rules faster than their series are forgotten (--max-domains, --max-rules set the budget)."),
    ("tollgate_xds_stream_failures_total", Kind::Counter, "xDS streams that broke or could not open; each is opened again after the backoff."),
    ("tollgate_config_last_reload_successful", Kind::Gauge, "1 if the last config reload succeeded (or none was needed), 0 if it was rejected."),
    ("tollgate_tls_reloads_total", Kind::Counter, "Reloads of the gRPC TLS certificates by result (success, failure)."),
    ("tollgate_tls_handshake_failures_total", Kind::Counter, "gRPC TLS handshakes that failed (e.g. a client without an accepted certificate); one that does not finish in time is a slow_opening refusal."),
    ("tollgate_build_info", Kind::Gauge, "Always 1; the version label says which tollgate runs."),
    ("tollgate_budget_holds_total", Kind::Counter, "Budget holds by verdict: admitted, duplicate (a retry, nothing taken again), reused (the request id is another request's: refused) or denied."),
    ("tollgate_budget_holds_open", Kind::Gauge, "Holds this replica opened less those it saw closed (settled, cancelled or expired); summed over the replicas, the holds open."),
    ("tollgate_budget_holds_expired_total", Kind::Counter, "Holds found expired unsettled, by what on_lost_settle made of them (charged or released)."),
    ("tollgate_budget_denials_total", Kind::Counter, "Holds denied, by the level that had too little left (its descriptor key, or token_bucket)."),
    ("tollgate_budget_settlements_total", Kind::Counter, "Settlements by what they found of their hold: open, expired, settled (a repeat), none (no hold) or other (another request's: nothing charged)."),
    ("tollgate_budget_spend_nanos_total", Kind::Counter, "Money charged, in nano-units of the currency, by price version (saturates, never wraps)."),
    ("tollgate_budget_cancels_total", Kind::Counter, "Holds cancelled after their answer was lost and the request denied, by what the cancel found."),
    ("tollgate_budget_recoveries_total", Kind::Counter, "Background repairs of failed budget ops (a cancel or a settlement sent again), by outcome."),
    ("tollgate_budget_refusals_total", Kind::Counter, "Priced requests refused before or by the store, by reason: malformed, empty_request_id, unknown_model, hold_above_amount, request_id_reused, path_mismatch, unknown_usage_kind."),
    ("tollgate_budget_usage_capped_total", Kind::Counter, "Usage counts above the model's maximum for their kind, charged at that maximum."),
    ("tollgate_budget_alerts_total", Kind::Counter, "Soft limits (alert_at) crossed by a level's spend, once per level, period and threshold across the replicas."),
    ("tollgate_budget_records", Kind::Gauge, "Budget request records this replica wrote that the store may still keep (each for its hold_ttl plus an hour, and its hold_ttl again for a settlement to extend it); summed over the replicas, an upper bound of the records kept."),
    ("tollgate_budget_top_spenders_nanos", Kind::Gauge, "Money spent by the top spenders of each budget level in the last complete window (the tenant level's value, a hash below it)."),
];

/// Series that exist from startup at 0, so that dashboards and alerts see 0 rather than no
/// data. Those labelled by domain and rule are registered per loaded domain
/// ([`register_domains`]); those labelled by tenant get their series with their first event.
const AT_ZERO: &[(&str, &[(&str, &str)])] = &[
    ("tollgate_invalid_requests_total", &[]),
    ("tollgate_overload_rejections_total", &[]),
    ("tollgate_rls_fast_path_fallbacks_total", &[]),
    ("tollgate_connections_refused_total", &[("port", "grpc"), ("reason", "cap")]),
    ("tollgate_connections_refused_total", &[("port", "grpc"), ("reason", "per_source")]),
    ("tollgate_connections_refused_total", &[("port", "grpc"), ("reason", "opening")]),
    ("tollgate_connections_refused_total", &[("port", "grpc"), ("reason", "slow_opening")]),
    ("tollgate_connections_refused_total", &[("port", "http"), ("reason", "cap")]),
    ("tollgate_connections_refused_total", &[("port", "http"), ("reason", "per_source")]),
    ("tollgate_connections_refused_total", &[("port", "http"), ("reason", "opening")]),
    ("tollgate_connections_refused_total", &[("port", "http"), ("reason", "slow_opening")]),
    ("tollgate_store_calls_total", &[]),
    ("tollgate_store_up", &[]),
    ("tollgate_store_down_total", &[("cause", "authentication")]),
    ("tollgate_store_down_total", &[("cause", "permission")]),
    ("tollgate_store_down_total", &[("cause", "tls")]),
    ("tollgate_store_down_total", &[("cause", "connection_refused")]),
    ("tollgate_store_down_total", &[("cause", "connection_lost")]),
    ("tollgate_store_down_total", &[("cause", "dns")]),
    ("tollgate_store_down_total", &[("cause", "timeout")]),
    ("tollgate_store_down_total", &[("cause", "cluster_coverage")]),
    ("tollgate_store_down_total", &[("cause", "other")]),
    ("tollgate_store_call_groups_total", &[]),
    ("tollgate_precheck_answers_total", &[]),
    ("tollgate_precheck_hearing_raises", &[]),
    ("tollgate_precheck_subscription_losses_total", &[]),
    ("tollgate_store_reconnects_total", &[]),
    ("tollgate_store_refunds_total", &[("reason", "split")]),
    ("tollgate_store_refunds_total", &[("reason", "late")]),
    ("tollgate_store_refund_failures_total", &[]),
    ("tollgate_store_late_replies_total", &[("action", "refunded")]),
    ("tollgate_store_late_replies_total", &[("action", "kept")]),
    ("tollgate_global_shares", &[]),
    ("tollgate_global_budget_leases", &[]),
    ("tollgate_global_shares_refused_total", &[]),
    ("tollgate_global_rounds_total", &[("outcome", "ok")]),
    ("tollgate_global_rounds_total", &[("outcome", "failed")]),
    ("tollgate_global_cut_off_seconds", &[]),
    ("tollgate_global_fallbacks_total", &[("fallback", "deny")]),
    ("tollgate_global_fallbacks_total", &[("fallback", "split")]),
    ("tollgate_global_renewals_total", &[("outcome", "ok")]),
    ("tollgate_global_renewals_total", &[("outcome", "unknown")]),
    ("tollgate_global_renewals_total", &[("outcome", "store_failed")]),
    ("tollgate_rlqs_reports_total", &[]),
    ("tollgate_rlqs_leases_total", &[("outcome", "set")]),
    ("tollgate_rlqs_leases_total", &[("outcome", "failed")]),
    ("tollgate_rlqs_holds_total", &[("outcome", "set")]),
    ("tollgate_rlqs_holds_total", &[("outcome", "failed")]),
    ("tollgate_rlqs_allowed_requests_total", &[]),
    ("tollgate_rlqs_assignments_total", &[("kind", "token_bucket")]),
    ("tollgate_rlqs_assignments_total", &[("kind", "deny_all")]),
    ("tollgate_rlqs_assignments_total", &[("kind", "allow_all")]),
    ("tollgate_rlqs_unknown_buckets_total", &[]),
    ("tollgate_rlqs_unknown_domain_reports_total", &[]),
    ("tollgate_rlqs_abandoned_buckets_total", &[]),
    ("tollgate_rlqs_stream_errors_total", &[("reason", "too_large")]),
    ("tollgate_rlqs_stream_errors_total", &[("reason", "no_bucket_id")]),
    ("tollgate_rlqs_stream_errors_total", &[("reason", "unread")]),
    ("tollgate_rlqs_buckets_refused_total", &[("reason", "stream_limit")]),
    ("tollgate_rlqs_buckets_refused_total", &[("reason", "replica_limit")]),
    ("tollgate_rlqs_buckets_refused_total", &[("reason", "peer_limit")]),
    ("tollgate_rlqs_streams_refused_total", &[]),
    ("tollgate_quota_cache_lookups_total", &[("result", "hit")]),
    ("tollgate_quota_cache_lookups_total", &[("result", "stale")]),
    ("tollgate_quota_cache_lookups_total", &[("result", "miss")]),
    ("tollgate_quota_db_queries_total", &[]),
    ("tollgate_quota_db_errors_total", &[("kind", "error")]),
    ("tollgate_quota_db_errors_total", &[("kind", "timeout")]),
    ("tollgate_quota_deadline_exceeded_total", &[]),
    ("tollgate_quota_bad_rows_total", &[]),
    ("tollgate_config_reloads_total", &[("result", "success")]),
    ("tollgate_config_reloads_total", &[("result", "failure")]),
    ("tollgate_config_reloads_total", &[("result", "warning")]),
    ("tollgate_tls_reloads_total", &[("result", "success")]),
    ("tollgate_tls_reloads_total", &[("result", "failure")]),
    ("tollgate_tls_handshake_failures_total", &[]),
    ("tollgate_rlqs_streams", &[]),
    ("tollgate_rlqs_buckets", &[]),
    ("tollgate_rlqs_leaseholders", &[]),
    ("tollgate_rlqs_holders", &[]),
    ("tollgate_quota_cache_entries", &[]),
    ("tollgate_config_last_reload_successful", &[]),
    ("tollgate_xds_updates_total", &[("result", "accepted")]),
    ("tollgate_xds_updates_total", &[("result", "rejected")]),
    ("tollgate_xds_stream_failures_total", &[]),
    ("tollgate_xds_domains_removed_total", &[]),
    ("tollgate_leaseholders_refused_total", &[("by", "bucket")]),
    ("tollgate_global_renewals_refused_total", &[]),
    ("tollgate_global_reports_cut_total", &[]),
    ("tollgate_leaseholders_refused_total", &[("by", "region")]),
    ("tollgate_xds_pushes_paced_total", &[]),
    ("tollgate_request_duration_seconds", &[]),
    ("tollgate_store_duration_seconds", &[]),
];

/// The metrics whose series only traffic creates (their labels name tenants); every other metric
/// is registered at 0 at startup, those labelled by domain and rule for every loaded one, and the
/// budget metrics (`tollgate_budget_*`) for every loaded priced domain ([`register_domains`]).
pub const LABELLED_BY_TRAFFIC: &[&str] = &[
    "tollgate_tenant_decisions_total",
    "tollgate_top_denied_tenant_hits",
    "tollgate_budget_top_spenders_nanos",
];

/// Registers at 0 the series of every domain and rule of `rules` (at startup and after each
/// reload), so that dashboards and alerts see 0 rather than no data: the decisions each rule can
/// make, the store errors by the domain's failure mode, forgiven debt.
pub fn register_domains(rules: &RuleSet) {
    for domain in rules.domains() {
        let failed = failure_label(domain.failure_mode);
        let paths =
            std::iter::once(("", false)).chain(domain.rules.iter().map(|r| (r.path.as_str(), r.shadow_mode)));
        for (rule, shadow) in paths {
            let denied = if shadow { "shadow_over_limit" } else { "over_limit" };
            for decision in ["ok", denied, failed] {
                counter!("tollgate_decisions_total", "domain" => domain.name.clone(), "rule" => rule.to_owned(), "decision" => decision)
                    .increment(0);
            }
        }
        for kind in ["error", "timeout"] {
            counter!("tollgate_store_errors_total", "domain" => domain.name.clone(), "kind" => kind, "failure_mode" => domain.failure_mode.to_string())
                .increment(0);
        }
        counter!("tollgate_debt_forgiven_tokens_total", "domain" => domain.name.clone()).increment(0);
        register_limits(domain);
        register_slots(domain);
        if let Some(priced) = &domain.priced {
            register_budgets(domain, priced);
        }
    }
}

// Each bucket rule's limit as gauges. A rule a reload removes keeps its last value until the
// exporter forgets idle series; a changed limit is set anew.
fn register_limits(domain: &crate::config::Domain) {
    for rule in &domain.rules {
        let crate::config::Limit::Bucket(spec) = rule.limit else { continue };
        let labels = |kind: &'static str| {
            [("domain", domain.name.clone()), ("rule", rule.path.clone()), ("kind", kind.to_owned())]
        };
        gauge!("tollgate_rule_limit", &labels("capacity")).set(spec.capacity());
        gauge!("tollgate_rule_limit", &labels("refill_per_second")).set(spec.refill_per_second());
        if let Some(rate) = &rule.rate {
            let mut labels = labels("requests_per_unit").to_vec();
            labels.push(("unit", rate.unit.name().to_owned()));
            gauge!("tollgate_rule_limit", &labels).set(f64::from(rate.requests_per_unit));
        }
    }
}

// Each concurrency limit's series: its `max` as a limit gauge, its slot events at 0.
fn register_slots(domain: &crate::config::Domain) {
    for (path, limit) in domain.concurrency_limits() {
        gauge!("tollgate_rule_limit", "domain" => domain.name.clone(), "rule" => path.clone(), "kind" => "concurrency")
            .set(limit.max as f64);
        for event in ["taken", "refused", "given_back", "expired"] {
            counter!("tollgate_concurrency_slots_total", "domain" => domain.name.clone(), "rule" => path.clone(), "event" => event)
                .increment(0);
        }
        gauge!("tollgate_concurrency_slots_open", "domain" => domain.name.clone(), "rule" => path.clone())
            .increment(0.0);
    }
    if !domain.concurrency_limits().is_empty() {
        for kind in ["give_back", "give_back_refused_take"] {
            for outcome in ["ok", "failed"] {
                counter!("tollgate_concurrency_repairs_total", "domain" => domain.name.clone(), "kind" => kind, "outcome" => outcome)
                    .increment(0);
            }
        }
    }
}

// The budget series of priced `domain`, at 0.
fn register_budgets(domain: &crate::config::Domain, priced: &crate::config::Priced) {
    let name = || domain.name.clone();
    for verdict in ["admitted", "duplicate", "reused", "denied"] {
        counter!("tollgate_budget_holds_total", "domain" => name(), "verdict" => verdict).increment(0);
    }
    gauge!("tollgate_budget_holds_open", "domain" => name()).increment(0.0);
    gauge!("tollgate_budget_records", "domain" => name()).increment(0.0);
    for outcome in ["charged", "released"] {
        counter!("tollgate_budget_holds_expired_total", "domain" => name(), "outcome" => outcome)
            .increment(0);
    }
    for hold in ["open", "expired", "settled", "none", "other"] {
        counter!("tollgate_budget_settlements_total", "domain" => name(), "hold" => hold).increment(0);
        counter!("tollgate_budget_cancels_total", "domain" => name(), "hold" => hold).increment(0);
    }
    counter!("tollgate_budget_spend_nanos_total", "domain" => name(), "currency" => priced.prices.currency.clone(), "version" => priced.prices.version.clone())
        .increment(0);
    for kind in ["cancel", "settle"] {
        for outcome in ["ok", "failed"] {
            counter!("tollgate_budget_recoveries_total", "domain" => name(), "kind" => kind, "outcome" => outcome)
                .increment(0);
        }
    }
    for reason in crate::budget::REFUSALS {
        counter!("tollgate_budget_refusals_total", "domain" => name(), "reason" => *reason).increment(0);
    }
    for kind in crate::budget::Kind::ALL {
        counter!("tollgate_budget_usage_capped_total", "domain" => name(), "kind" => kind.name())
            .increment(0);
    }
    counter!("tollgate_budget_denials_total", "domain" => name(), "level" => "token_bucket").increment(0);
    for (level, alerts) in domain.budget_levels() {
        counter!("tollgate_budget_denials_total", "domain" => name(), "level" => level.to_owned())
            .increment(0);
        for fraction in alerts {
            counter!("tollgate_budget_alerts_total", "domain" => name(), "level" => level.to_owned(), "threshold" => fraction.fraction_text())
                .increment(0);
        }
    }
}

/// Counts a lease op on a shared bucket by `outcome` (set, failed).
pub fn count_rlqs_lease(outcome: &'static str) {
    counter!("tollgate_rlqs_leases_total", "outcome" => outcome).increment(1);
    // The old name, so that dashboards keep working for a release (docs: Upgrading).
    counter!("tollgate_rlqs_holds_total", "outcome" => outcome).increment(1);
}

/// Moves the count of this replica's (bucket, stream) leaseholders by `delta`.
pub fn add_rlqs_leaseholders(delta: f64) {
    gauge!("tollgate_rlqs_leaseholders").increment(delta);
    // The old name, as above.
    gauge!("tollgate_rlqs_holders").increment(delta);
}

fn register_at_zero() {
    gauge!("tollgate_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    for (name, labels) in AT_ZERO {
        let labels: Vec<metrics::Label> = labels.iter().map(|(k, v)| metrics::Label::new(*k, *v)).collect();
        match METRICS.iter().find(|(n, _, _)| n == name).map(|(_, kind, _)| kind) {
            Some(Kind::Counter) => counter!(*name, labels).increment(0),
            Some(Kind::Gauge) => gauge!(*name, labels).increment(0.0),
            Some(Kind::Histogram) => drop(metrics::histogram!(*name, labels)),
            None => debug_assert!(false, "{name} is not in METRICS"),
        }
    }
}

fn describe() {
    for (name, kind, help) in METRICS {
        match kind {
            Kind::Counter => describe_counter!(*name, *help),
            Kind::Gauge => describe_gauge!(*name, *help),
            Kind::Histogram => describe_histogram!(*name, Unit::Seconds, *help),
        }
    }
}

/// The decision label of an answer the failure mode gave.
pub fn failure_label(mode: FailureMode) -> &'static str {
    match mode {
        FailureMode::Allow => "failed_open",
        FailureMode::Deny => "failed_closed",
        FailureMode::Error => "error",
    }
}
