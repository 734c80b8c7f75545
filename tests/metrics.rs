//! `/metrics` after known traffic, parsed with a Prometheus text-format parser; and bounded
//! cardinality under 100,000 distinct tenants.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;

const CONFIG: &str = r#"
domain: m
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: tenant
    token_bucket: {capacity: 0, refill_per_second: 0}
    descriptors:
      - key: watched
        detailed_metric: true
        token_bucket: {capacity: 1, refill_per_second: 0.001}
"#;

#[tokio::test(flavor = "multi_thread")]
async fn counts_after_known_traffic() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    let addr = server.addr();

    // 3 requests of 2 hits on a 5-token bucket: 4 hits admitted, then 2 denied.
    for _ in 0..3 {
        ask(&addr, req("m", &["k=a"], 2)).await.unwrap();
    }
    // 3 shadow requests: 1 ok, 2 shadow_over_limit.
    for _ in 0..3 {
        ask(&addr, req("m", &["shadow=a"], 1)).await.unwrap();
    }
    // An unknown domain and a descriptor without a rule.
    ask(&addr, req("elsewhere", &["k=a"], 1)).await.unwrap();
    ask(&addr, req("m", &["nothing=here"], 1)).await.unwrap();
    // An invalid request.
    assert!(ask(&addr, req("", &["k=a"], 1)).await.is_err());

    let m = server.metrics();
    let decisions = |domain: &str, rule: &str, decision: &str| {
        sample(&m, "tollgate_decisions_total", &[("domain", domain), ("rule", rule), ("decision", decision)])
    };
    assert_eq!(decisions("m", "k", "ok"), 4.0);
    assert_eq!(decisions("m", "k", "over_limit"), 2.0);
    assert_eq!(decisions("m", "shadow", "ok"), 1.0);
    assert_eq!(decisions("m", "shadow", "shadow_over_limit"), 2.0);
    assert_eq!(decisions("(unknown)", "", "ok"), 1.0);
    assert_eq!(decisions("m", "", "ok"), 1.0);
    assert_eq!(sample(&m, "tollgate_invalid_requests_total", &[]), 1.0);
    // Every answered request is timed; every script call is timed at the client. Of the 6
    // bucket requests, 3 find a bucket already known to be short (the third `k`, the second and
    // third `shadow`): the pre-check answers those without Redis. The unknown domain and the
    // rule-less descriptor never reach Redis.
    assert_eq!(sample(&m, "tollgate_request_duration_seconds", &[]), 9.0);
    assert_eq!(sample(&m, "tollgate_store_duration_seconds", &[]), 3.0);
    assert_eq!(sample(&m, "tollgate_store_calls_total", &[]), 3.0);
    assert_eq!(sample(&m, "tollgate_store_call_groups_total", &[]), 3.0);
    assert_eq!(sample(&m, "tollgate_precheck_answers_total", &[]), 3.0);
    assert_eq!(sample(&m, "tollgate_build_info", &[("version", env!("CARGO_PKG_VERSION"))]), 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn store_errors_are_labeled_with_the_failure_mode() {
    let (_dir, config) = config_file(&format!("failure_mode: deny\n{CONFIG}"));
    let dead = format!("redis://127.0.0.1:{}", free_port());
    let server = Tollgate::start_unready(&config, &Backend::Redis(dead), &["--redis-timeout", "50ms"]);
    for _ in 0..3 {
        let r = ask(&server.addr(), req("m", &["k=a"], 1)).await.unwrap();
        assert_eq!(r.overall_code, OVER_LIMIT);
    }
    let m = server.metrics();
    let errors = sample(&m, "tollgate_store_errors_total", &[("domain", "m"), ("failure_mode", "deny")]);
    assert_eq!(errors, 3.0);
    assert_eq!(sample(&m, "tollgate_decisions_total", &[("rule", "k"), ("decision", "failed_closed")]), 3.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn cardinality_stays_bounded_with_100k_tenants() {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(
        &config,
        &Backend::Memory,
        &["--top-denied-tenants", "5", "--top-denied-window", "2s", "--detailed-metric-series", "100"],
    );
    let addr = server.addr();
    let start = Instant::now();
    // 100,000 distinct tenants, 29 per request (and 29 detailed, 5 abusers: 63 descriptors), each denied once by the empty tenant bucket and
    // admitted once by the detailed rule. Every request also carries five abusers, denied with
    // 5, 4, 3, 2 and 1 hits: within any window they outweigh what Space-Saving can overestimate.
    let abusers = [("abuser-a", 5), ("abuser-b", 4), ("abuser-c", 3), ("abuser-d", 2), ("abuser-e", 1)];
    let flood: Vec<String> = (0..100_000).map(|i| format!("tenant=t{i}")).collect();
    let watched: Vec<String> = (0..100_000).map(|i| format!("tenant=t{i},watched=x")).collect();
    let concurrency = 8;
    let requests: Vec<_> = flood
        .chunks(29)
        .zip(watched.chunks(29))
        .map(|(f, w)| {
            let mut descriptors: Vec<&str> = f.iter().chain(w).map(String::as_str).collect();
            let names: Vec<String> = abusers.iter().map(|(a, _)| format!("tenant={a}")).collect();
            descriptors.extend(names.iter().map(String::as_str));
            let mut request = req("m", &descriptors, 1);
            for (d, (_, hits)) in request.descriptors.iter_mut().rev().zip(abusers.iter().rev()) {
                d.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: *hits });
            }
            request
        })
        .collect();
    for chunk in requests.chunks(concurrency) {
        let calls: Vec<_> = chunk
            .iter()
            .cloned()
            .map(|request| {
                let addr = addr.clone();
                tokio::spawn(async move { ask(&addr, request).await.unwrap() })
            })
            .collect();
        for c in calls {
            assert_eq!(c.await.unwrap().overall_code, OVER_LIMIT);
        }
    }
    println!("100k tenants sent in {:?}", start.elapsed());

    // The last complete window's top list: the abusers, in order.
    let deadline = Instant::now() + Duration::from_secs(10);
    let top = loop {
        let m = server.metrics();
        let mut top: Vec<(String, f64)> = m
            .samples
            .iter()
            .filter(|s| s.metric == "tollgate_top_denied_tenant_hits")
            .map(|s| {
                (
                    s.labels.get("tenant").unwrap().to_owned(),
                    sample(&m, &s.metric, &[("rank", s.labels.get("rank").unwrap())]),
                )
            })
            .collect();
        if !top.is_empty() {
            top.sort_by(|a, b| b.1.total_cmp(&a.1));
            break top;
        }
        assert!(Instant::now() < deadline, "no top-denied list after the window");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let names: Vec<&str> = top.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(names, abusers.iter().map(|(a, _)| *a).collect::<Vec<_>>(), "{top:?}");

    // The per-tenant series of the detailed rule stop at the budget; the rest is (other).
    let m = server.metrics();
    let detailed: HashSet<&str> = m
        .samples
        .iter()
        .filter(|s| s.metric == "tollgate_tenant_decisions_total")
        .map(|s| s.labels.get("tenant").unwrap())
        .collect();
    assert_eq!(detailed.len(), 101, "100 tenants and (other)");
    assert!(detailed.contains("(other)"));
    let other = sample(&m, "tollgate_tenant_decisions_total", &[("tenant", "(other)")]);
    assert_eq!(other, 99_900.0);
    let admitted = sample(&m, "tollgate_tenant_decisions_total", &[("decision", "ok")]);
    assert_eq!(admitted, 100_000.0, "each tenant's watched bucket admitted once");
    let series = m.samples.len();
    println!("{series} series in /metrics after 100k tenants");
    assert!(series < 1_000, "{series} series");
}

#[test]
fn dashboard_and_readme_cover_exactly_the_exported_metrics() {
    let exported: HashSet<&str> = tollgate::telemetry::METRICS.iter().map(|m| m.0).collect();
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../dashboards/tollgate.json")).expect("dashboard JSON");
    let mut used = HashSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if let Some(name) = word.strip_prefix("tollgate_") {
                    let name = format!("tollgate_{name}");
                    let base = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|s| name.strip_suffix(s))
                        .unwrap_or(&name)
                        .to_owned();
                    assert!(exported.contains(base.as_str()), "dashboard uses unknown metric {name}");
                    used.insert(base);
                }
            }
        }
    }
    for key in [
        "tollgate_decisions_total",
        "tollgate_top_denied_tenant_hits",
        "tollgate_store_duration_seconds",
        "tollgate_store_errors_total",
    ] {
        assert!(used.contains(key), "the dashboard lacks {key}");
    }
    let readme = include_str!("../docs/src/operations/metrics.md");
    for name in &exported {
        assert!(readme.contains(name), "the book's metrics page does not document {name}");
    }
}

/// Every documented metric is in `/metrics` before any traffic, so dashboards show 0, not "no
/// data"; only the series labelled by what traffic brings (domain, rule, tenant) wait for it.
#[test]
fn every_metric_is_exported_at_zero_at_startup() {
    let (_dir, config) = config_file(
        "domain: d\nfailure_mode: deny\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 3}\n",
    );
    let server = Tollgate::start(&config, &Backend::Memory, &[]);
    let (status, body) = http_get(server.http, "/metrics").unwrap();
    assert_eq!(status, 200);
    let mut missing = Vec::new();
    for (name, kind, _) in tollgate::telemetry::METRICS {
        // Budget series belong to priced domains (tests/budget.rs checks them), slot series to
        // domains with concurrency limits (tests/concurrency.rs).
        if tollgate::telemetry::LABELLED_BY_TRAFFIC.contains(name)
            || name.starts_with("tollgate_budget_")
            || name.starts_with("tollgate_concurrency_")
        {
            continue;
        }
        // Counters and histograms start at 0; gauges at what they measure (1 for "last reload
        // successful").
        let (series, zero) = match kind {
            tollgate::telemetry::Kind::Histogram => (format!("{name}_count"), true),
            tollgate::telemetry::Kind::Counter => ((*name).to_owned(), true),
            tollgate::telemetry::Kind::Gauge => ((*name).to_owned(), false),
        };
        let exported =
            body.lines().any(|l| l.split([' ', '{']).next() == Some(&series) && (!zero || l.ends_with(" 0")));
        if !exported {
            missing.push(series);
        }
    }
    assert!(missing.is_empty(), "not exported at startup: {missing:?}\n{body}");
    // The loaded domain's and rule's labelled series, each decision its rule can make.
    for series in [
        r#"tollgate_decisions_total{domain="d",rule="a",decision="ok"} 0"#,
        r#"tollgate_decisions_total{domain="d",rule="a",decision="over_limit"} 0"#,
        r#"tollgate_decisions_total{domain="d",rule="a",decision="failed_closed"} 0"#,
        r#"tollgate_store_errors_total{domain="d",kind="timeout",failure_mode="deny"} 0"#,
        r#"tollgate_debt_forgiven_tokens_total{domain="d"} 0"#,
    ] {
        assert!(body.lines().any(|l| l == series), "{series} missing:\n{body}");
    }
    // A domain a reload brings in gets its series at once.
    std::fs::write(
        &config,
        "domain: e\ndescriptors:\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 3}\n",
    )
    .unwrap();
    let reloaded = r#"tollgate_decisions_total{domain="e",rule="b",decision="failed_open"} 0"#;
    wait_until("the reloaded domain's series", 250, Duration::from_millis(20), || {
        http_get(server.http, "/metrics").is_some_and(|(_, body)| body.lines().any(|l| l == reloaded))
    });
}
