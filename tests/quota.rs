//! Tenant quotas from a real PostgreSQL: the operator CLI, the cache's TTL, single flight,
//! negative caching and expiry, invalid rows, and the database going away.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const CONFIG: &str = r#"
domain: q
default_tier: free
tiers:
  free:
    default: {capacity: 20, refill_per_second: 0.01}
  pro:
    default: {capacity: 200, refill_per_second: 0.01}
tenants:
  inline: {tier: pro}
descriptors:
  - key: tenant
    quota: tenant
"#;

fn quota(pg: &Postgres, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(tollgate_bin())
        .arg("quota")
        .args(args)
        .args(["--quota-store", &pg.url()])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn migrated() -> Postgres {
    let pg = Postgres::start();
    let (ok, stdout, stderr) = quota(&pg, &["migrate"]);
    assert!(ok && stdout.contains("created 3 tollgate table(s)"), "{stdout}{stderr}");
    pg
}

/// The capacity tollgate reports for `tenant` (X-RateLimit-Limit), asking with 0 hits.
async fn capacity(server: &Tollgate, tenant: &str) -> u64 {
    let mut request = req("q", &[&format!("tenant={tenant}")], 1);
    request.descriptors[0].hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
    let r = ask(&server.addr(), request).await.unwrap();
    header(&r, "X-RateLimit-Limit").expect("X-RateLimit-Limit").parse().unwrap()
}

async fn futures_count_ok(
    asks: Vec<tokio::task::JoinHandle<envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse>>,
) -> usize {
    let mut ok = 0;
    for a in asks {
        ok += usize::from(a.await.unwrap().overall_code == OK);
    }
    ok
}

#[test]
fn operator_cli_round_trip() {
    let pg = migrated();
    // Again, with the default log level (PostgreSQL's NOTICEs were logged at INFO).
    let again = Command::new(tollgate_bin())
        .args(["quota", "migrate", "--quota-store", &pg.url()])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(again.status.success(), "migrate is idempotent");
    assert_eq!(
        (&again.stdout[..], &again.stderr[..]),
        (&b""[..], &b""[..]),
        "and silent when there is nothing to do"
    );
    let (ok, stdout, stderr) = quota(&pg, &["set", "--tenant", "t42", "--tier", "pro"]);
    assert!(ok, "{stderr}");
    assert_eq!(stdout, "tenant t42: tier pro\n");
    let (ok, stdout, _) = quota(
        &pg,
        &["set", "--tenant", "t42", "--class", "export", "--capacity", "1000", "--refill-per-second", "10"],
    );
    assert!(ok);
    assert_eq!(stdout, "tenant t42: tier pro\n  export: capacity 1000, refill 10/s\n");
    let (_, stdout, _) = quota(
        &pg,
        &[
            "set",
            "--tenant",
            "solo",
            "--class",
            "default",
            "--capacity",
            "5",
            "--refill-per-second",
            "1",
            "--expires-in",
            "1h",
        ],
    );
    assert!(
        stdout.starts_with("tenant solo: tier (default tier)\n  default: capacity 5, refill 1/s until "),
        "{stdout}"
    );
    let (_, stdout, _) = quota(&pg, &["get", "--tenant", "t42"]);
    assert_eq!(stdout, "tenant t42: tier pro\n  export: capacity 1000, refill 10/s\n");
    let (_, stdout, _) = quota(&pg, &["list"]);
    assert!(stdout.starts_with("tenant solo:") && stdout.contains("tenant t42: tier pro"), "{stdout}");

    // Bad input is refused before it reaches the database.
    let (ok, _, stderr) = quota(
        &pg,
        &["set", "--tenant", "t42", "--class", "x", "--capacity", "-5", "--refill-per-second", "1"],
    );
    assert!(!ok && stderr.contains("capacity must be between 0"), "{stderr}");
    let (ok, _, stderr) = quota(&pg, &["set", "--tenant", "t42"]);
    assert!(!ok && stderr.contains("nothing to set"), "{stderr}");
    let (ok, _, stderr) = quota(&pg, &["set", "--tenant", "t42", "--class", "x"]);
    assert!(!ok && stderr.contains("--capacity"), "{stderr}");
    assert_eq!(pg.sql("SELECT count(*) FROM tollgate_overrides WHERE class = 'x'"), "0");
    // Checked against the servers' rules: a tier or class no domain has is refused, unless forced.
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");
    let (ok, _, stderr) = quota(&pg, &["set", "--tenant", "t42", "--tier", "platinum", "--config", examples]);
    assert!(!ok && stderr.contains("no domain has tier 'platinum' (tiers: free, pro) in "), "{stderr}");
    let exprot =
        ["set", "--tenant", "t42", "--class", "exprot", "--capacity", "5", "--refill-per-second", "1"];
    let (ok, _, stderr) = quota(&pg, &[&exprot[..], &["--config", examples]].concat());
    assert!(!ok && stderr.contains("no rule or tier has class 'exprot'"), "{stderr}");
    assert_eq!(pg.sql("SELECT count(*) FROM tollgate_overrides WHERE class = 'exprot'"), "0");
    let (ok, _, stderr) = quota(&pg, &[&exprot[..], &["--config", examples, "--force"]].concat());
    assert!(ok && stderr.contains("stored anyway (--force)"), "{stderr}");
    let (ok, _, stderr) = quota(&pg, &["set", "--tenant", "t42", "--tier", "pro", "--config", examples]);
    assert!(ok && stderr.is_empty(), "{stderr}");
    let (_, stdout, _) = quota(&pg, &["delete", "--tenant", "t42", "--class", "exprot"]);
    assert_eq!(stdout, "deleted 1 row(s)\n");

    let (_, stdout, _) = quota(&pg, &["delete", "--tenant", "t42", "--class", "export"]);
    assert_eq!(stdout, "deleted 1 row(s)\n");
    let (_, stdout, _) = quota(&pg, &["delete", "--tenant", "t42"]);
    assert_eq!(stdout, "deleted 1 row(s)\n");
    let (_, stdout, _) = quota(&pg, &["get", "--tenant", "t42"]);
    assert!(stdout.contains("no rows in the quota database (it gets its inline record"), "{stdout}");
    let (_, stdout, _) = quota(&pg, &["delete", "--tenant", "solo"]);
    assert!(stdout.starts_with("deleted "), "{stdout}");
    let (_, stdout, _) = quota(&pg, &["list"]);
    assert!(stdout.starts_with("no tenants in the quota database"), "an empty list says so: {stdout}");

    let out = Command::new(tollgate_bin())
        .args(["quota", "list"])
        .env_remove("TOLLGATE_QUOTA_STORE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--quota-store"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_changed_quota_shows_within_the_ttl() {
    let pg = migrated();
    let (_dir, config) = config_file(CONFIG);
    let ttl = Duration::from_secs(2);
    let server =
        Tollgate::start(&config, &Backend::Memory, &["--quota-store", &pg.url(), "--quota-cache-ttl", "2s"]);

    assert_eq!(capacity(&server, "acme").await, 20, "unknown tenant: default tier");
    assert_eq!(capacity(&server, "inline").await, 200, "inline record when the database has none");

    quota(
        &pg,
        &["set", "--tenant", "acme", "--class", "default", "--capacity", "777", "--refill-per-second", "1"],
    );
    let set_at = Instant::now();
    let mut seen = None;
    while set_at.elapsed() < ttl + Duration::from_secs(1) {
        if capacity(&server, "acme").await == 777 {
            seen = Some(set_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = seen.expect("the override shows within TTL + 1 s");
    println!("override visible after {seen:?} (TTL {ttl:?})");

    quota(&pg, &["set", "--tenant", "acme", "--tier", "pro"]);
    quota(&pg, &["delete", "--tenant", "acme", "--class", "default"]);
    let deadline = Instant::now() + ttl + Duration::from_secs(1);
    while capacity(&server, "acme").await != 200 {
        assert!(Instant::now() < deadline, "tier change not visible within TTL + 1 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn single_flight_negative_cache_and_expiry() {
    let pg = migrated();
    let (_dir, config) = config_file(CONFIG);
    let server =
        Tollgate::start(&config, &Backend::Memory, &["--quota-store", &pg.url(), "--quota-cache-ttl", "1h"]);

    // 50 concurrent first requests for one tenant: one query.
    let asks: Vec<_> = (0..50)
        .map(|_| {
            let addr = server.addr();
            tokio::spawn(async move { ask(&addr, req("q", &["tenant=crowd"], 1)).await.unwrap() })
        })
        .collect();
    let admitted = futures_count_ok(asks).await;
    assert_eq!(admitted, 20, "the free tier's 20 tokens, shared by all 50");
    assert_eq!(sample(&server.metrics(), "tollgate_quota_db_queries_total", &[]), 1.0);

    // An unknown tenant asked again and again: still one query for it.
    for _ in 0..10 {
        capacity(&server, "nobody").await;
    }
    assert_eq!(sample(&server.metrics(), "tollgate_quota_db_queries_total", &[]), 2.0);

    // An override that expires: the cache holds it no longer than its expiry.
    quota(
        &pg,
        &[
            "set",
            "--tenant",
            "brief",
            "--class",
            "default",
            "--capacity",
            "55",
            "--refill-per-second",
            "1",
            "--expires-in",
            "2s",
        ],
    );
    assert_eq!(capacity(&server, "brief").await, 55);
    let deadline = Instant::now() + Duration::from_secs(5);
    while capacity(&server, "brief").await != 20 {
        assert!(Instant::now() < deadline, "expired override still served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_rows_are_skipped_and_named() {
    let pg = migrated();
    pg.sql("INSERT INTO tollgate_tenants VALUES ('shady', 'pro')");
    pg.sql("INSERT INTO tollgate_overrides (tenant_id, class, capacity, refill_per_second) VALUES ('shady', 'default', 'NaN', 1)");
    pg.sql("INSERT INTO tollgate_overrides (tenant_id, class, capacity, refill_per_second) VALUES ('shady', 'other', -3, 1)");
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, &["--quota-store", &pg.url()]);
    assert_eq!(capacity(&server, "shady").await, 200, "the bad override is ignored, the tier applies");
    assert_eq!(sample(&server.metrics(), "tollgate_quota_bad_rows_total", &[]), 2.0);
    let log = server.log();
    assert!(
        log.contains("skipping invalid row in tollgate_overrides")
            && log.contains(r#"tenant="shady" class="default""#),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn database_down_serves_cached_quotas_and_tier_defaults() {
    let mut pg = migrated();
    quota(
        &pg,
        &["set", "--tenant", "known", "--class", "default", "--capacity", "333", "--refill-per-second", "1"],
    );
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(
        &config,
        &Backend::Memory,
        &["--quota-store", &pg.url(), "--quota-cache-ttl", "1s", "--redis-timeout", "50ms"],
    );
    assert_eq!(capacity(&server, "known").await, 333);

    pg.stop();
    // Once the TTL has passed the entry is stale, its refresh fails, and the last known quota
    // keeps serving.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        assert_eq!(capacity(&server, "known").await, 333);
        if sample(&server.metrics(), "tollgate_quota_cache_lookups_total", &[("result", "stale")]) > 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the entry never went stale");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..5 {
        let start = Instant::now();
        assert_eq!(capacity(&server, "known").await, 333);
        assert_eq!(capacity(&server, "stranger").await, 20, "never seen: default tier");
        assert!(start.elapsed() < Duration::from_secs(2), "answers do not wait for the database");
    }
    let m = server.metrics();
    assert!(sample(&m, "tollgate_quota_db_errors_total", &[]) >= 1.0);

    // The database returns; fresh answers resume without a restart.
    pg.restart();
    quota(&pg, &["set", "--tenant", "stranger", "--tier", "pro"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while capacity(&server, "stranger").await != 200 {
        assert!(Instant::now() < deadline, "no recovery after the database came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn tls_to_the_quota_database_is_verified() {
    let pki = TestPki::new();
    let pg = Postgres::start_tls(&pki);
    let url = format!("{}?sslmode=require", pg.url());
    let ca = pki.path_str("ca.pem");
    let run = |extra: &[&str]| {
        Command::new(tollgate_bin())
            .args(["quota", "migrate", "--quota-store", &url])
            .args(extra)
            .env("RUST_LOG", "off")
            .output()
            .unwrap()
    };
    let untrusted = run(&[]);
    assert!(!untrusted.status.success(), "a certificate from an unknown CA is refused");
    let stderr = String::from_utf8_lossy(&untrusted.stderr);
    assert!(stderr.to_lowercase().contains("certificate"), "{stderr}");
    let trusted = run(&["--quota-store-ca", &ca]);
    assert!(trusted.status.success(), "{}", String::from_utf8_lossy(&trusted.stderr));
    pg.sql("INSERT INTO tollgate_tenants VALUES ('secure', 'pro')");
    assert_eq!(pg.sql("SELECT count(*) FROM pg_stat_ssl WHERE ssl"), "1", "psql's own connection");

    let (_dir, config) = config_file(CONFIG);
    let server =
        Tollgate::start(&config, &Backend::Memory, &["--quota-store", &url, "--quota-store-ca", &ca]);
    assert_eq!(capacity(&server, "secure").await, 200, "the tier comes over TLS");
}

/// A tenant's quota never depends on whether the bounded cache admits it: with room for 2 and
/// 300 tenants of the pro tier asking in turn, every answer is the pro tier's (issue 14: a tenant
/// the cache declined got the default tier).
#[tokio::test(flavor = "multi_thread")]
async fn a_full_cache_never_changes_a_tenants_quota() {
    let pg = migrated();
    let tenants: Vec<String> = (0..300).map(|i| format!("busy{i}")).collect();
    let values: Vec<String> = tenants.iter().map(|t| format!("('{t}', 'pro')")).collect();
    pg.sql(&format!("INSERT INTO tollgate_tenants VALUES {}", values.join(", ")));
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(
        &config,
        &Backend::Memory,
        &["--quota-store", &pg.url(), "--quota-cache-size", "2", "--quota-cache-ttl", "1h"],
    );
    let mut wrong = Vec::new();
    for (round, group) in tenants.chunks(25).cycle().take(3 * tenants.len() / 25).enumerate() {
        // 25 at once, so that inserts, admissions and evictions interleave with the reads (and
        // the database answers within the 50 ms a decision waits).
        let asks: Vec<_> = group
            .iter()
            .map(|tenant| {
                let (server, tenant) = (&server, tenant.clone());
                async move { (capacity(server, &tenant).await, tenant) }
            })
            .collect();
        for (got, tenant) in futures::future::join_all(asks).await {
            if got != 200 {
                wrong.push(format!("round {round} {tenant}: {got}"));
            }
        }
    }
    let late = sample(&server.metrics(), "tollgate_quota_deadline_exceeded_total", &[]);
    assert!(wrong.len() as f64 <= late, "tenants given another tier than theirs: {wrong:?}");
    assert!(late < 10.0, "{late} lookups past the deadline: the test measures nothing");
    // The cache holds at most 2 (moka may briefly hold a few more while it evicts).
    let queries = sample(&server.metrics(), "tollgate_quota_db_queries_total", &[]);
    println!("{queries} queries for 900 lookups of 300 tenants with room for 2");
    assert!(queries >= 30.0, "each tenant was asked for at least once");
}
