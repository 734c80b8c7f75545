//! `tollgate explain`: the rule, bucket, limit and origin of each descriptor, and the balance
//! read from a real Redis without debiting it.

mod common;

use std::process::Command;

use common::*;

const CONFIG: &str = r#"
domain: ex
default_tier: free
tiers:
  free:
    default: {capacity: 10, refill_per_second: 0.01}
tenants:
  vip: {tier: free, overrides: {default: {capacity: 1000, refill_per_second: 1}}}
descriptors:
  - key: tenant
    quota: tenant
  - key: path
    rate_limit: {name: per_path, unit: minute, requests_per_unit: 5}
  - key: fast
    rate_limit: {name: fast, unit: second, requests_per_unit: 100, replaces: [{name: per_path}]}
  - key: trial
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: health
    rate_limit: {unlimited: true}
"#;

fn explain(config: &std::path::Path, redis: Option<&Redis>, descriptors: &[&str]) -> String {
    let url = redis.map(|r| r.url());
    let store = url.as_ref().map(|u| ["--redis-url", u.as_str()]);
    explain_with(config, store.as_ref().map_or(&[][..], |s| &s[..]), descriptors)
}

fn explain_with(config: &std::path::Path, store: &[&str], descriptors: &[&str]) -> String {
    let mut cmd = Command::new(tollgate_bin());
    cmd.args(["explain", "--config", config.to_str().unwrap(), "--domain", "ex"]).env("RUST_LOG", "off");
    for d in descriptors {
        cmd.args(["--descriptor", d]);
    }
    cmd.args(store);
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn explain_names_rule_bucket_origin_and_balance_without_debiting() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let file = config.display().to_string();

    // Origins, positions, keys and slots, before any traffic: nothing stored, nothing created.
    let text = explain(
        &config,
        Some(&redis),
        &["tenant=t1", "tenant=vip", "path=/a", "trial=x", "health=1", "other=1"],
    );
    println!("{text}");
    assert!(text.contains(&format!("descriptor 0 [tenant=t1]\n  rule:     tenant at {file}:10:")), "{text}");
    assert!(text.contains("  bucket:   rl:{t1}:ex:tenant=t1   slot "), "{text}");
    assert!(text.contains(&format!("   slot {}   tenant t1", tenant_slot("t1"))), "{text}");
    assert!(
        text.contains("capacity 10, refill 0.01/s") && text.contains("from tier 'free', class 'default'"),
        "{text}"
    );
    assert!(text.contains("from the tenant's override for class 'default'"), "{text}");
    assert!(
        text.contains(&format!("rule:     path at {file}:12:")) && text.contains("(name per_path)"),
        "{text}"
    );
    assert!(text.contains("(5/minute)   from the rule"), "{text}");
    assert!(text.contains("shadow mode: counted, never denies"), "{text}");
    assert!(text.contains("unlimited: always OK"), "{text}");
    assert!(text.contains("descriptor 5 [other=1]\n  no rule with a limit matches"), "{text}");
    assert!(text.contains("balance:  10 of 10 (no bucket stored: full)"), "{text}");
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut redis.connection()).unwrap();
    assert!(keys.is_empty(), "explain stored nothing: {keys:?}");

    // `replaces`: the fast rule matched beside per_path removes it for that request.
    let text = explain(&config, None, &["path=/a", "fast=1"]);
    assert!(text.contains("replaced by fast (name fast): no limit for this request"), "{text}");
    assert!(text.contains("balance:  not read"), "{text}");

    // After 3 admitted hits through a server, explain reads 7 left, twice: it takes nothing.
    let server = Tollgate::start(&config, &Backend::Redis(redis.url()), &["--no-precheck"]);
    for _ in 0..3 {
        assert_eq!(ask(&server.addr(), req("ex", &["tenant=t1"], 1)).await.unwrap().overall_code, OK);
    }
    for _ in 0..2 {
        let text = explain(&config, Some(&redis), &["tenant=t1"]);
        let balance = text.lines().find(|l| l.contains("balance:")).unwrap();
        let tokens: f64 = balance.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!((7.0..7.1).contains(&tokens), "{balance}");
        assert!(balance.contains("of 10 now (Redis clock), full in "), "{balance}");
    }
    let stored = stored_tokens(&mut redis.connection(), "rl:{t1}:ex:tenant=t1");
    assert!((stored - 7.0).abs() < 0.05, "the stored balance is untouched: {stored}");
}

/// On a Cluster the balance is read on the node that owns the bucket's slot.
#[tokio::test(flavor = "multi_thread")]
async fn explain_reads_the_owning_node_of_a_cluster() {
    let cluster = RedisCluster::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Cluster(cluster.seeds()), &["--no-precheck"]);
    for _ in 0..2 {
        assert_eq!(ask(&server.addr(), req("ex", &["tenant=t7"], 1)).await.unwrap().overall_code, OK);
    }
    let text = explain_with(&config, &["--redis-cluster", &cluster.seeds()], &["tenant=t7"]);
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg("rl:{t7}:ex:tenant=t7")
        .query(&mut cluster.connection())
        .unwrap();
    assert!(
        text.contains(&format!("  bucket:   rl:{{t7}}:ex:tenant=t7   slot {slot}   tenant t7")),
        "{text}"
    );
    let balance = text.lines().find(|l| l.contains("balance:")).unwrap();
    let tokens: f64 = balance.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!((8.0..8.1).contains(&tokens), "{balance}");
}

/// A domain the config does not have is most likely a typo: said, and a non-zero exit.
#[test]
fn an_unknown_domain_exits_non_zero() {
    let (_dir, config) = config_file(CONFIG);
    let out = Command::new(tollgate_bin())
        .args(["explain", "--config", config.to_str().unwrap(), "--domain", "typo", "--descriptor", "k=v"])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("domain typo: not configured"), "{stdout}");
    assert!(stderr.contains("domain typo is not in"), "{stderr}");
}

// A descriptor ending in the request id takes a slot of every concurrency limit on its path, and
// is limited by its path's rule; the same with `release` gives the slot back and charges nothing.
#[test]
fn explain_names_the_concurrency_limits_a_descriptor_takes_from() {
    let (_dir, config) = config_file(
        "domain: ex\ndescriptors:\n  - key: tenant\n    concurrency: {max: 4, ttl: 90s}\n    token_bucket: {capacity: 9, refill_per_second: 1}\n",
    );
    let take = explain(&config, None, &["tenant=acme,request_id=r1"]);
    assert!(
        take.contains(
            "slots:    takes a slot of tenant (at most 4 in flight, a slot not given back freed after 90s)"
        ),
        "{take}"
    );
    assert!(take.contains("set rl:{acme}:ex:tenant=acme:slots in Cluster slot"), "{take}");
    assert!(take.contains("limit:    capacity 9, refill 1/s"), "{take}");
    let give = explain(&config, None, &["tenant=acme,request_id=r1,release=1"]);
    assert!(give.contains("slots:    gives back its slot of tenant"), "{give}");
    assert!(!give.contains("rule:") && !give.contains("bucket:"), "a give-back charges nothing: {give}");
    // Given a Redis, the set's open slots now: one live, one expired (gone for a take too).
    let redis = Redis::start();
    let far = 4_102_444_800_000u64; // 2100-01-01, in ms
    let set = "rl:{acme}:ex:tenant=acme:slots";
    let _: () = redis::cmd("ZADD")
        .arg(set)
        .arg(far)
        .arg("live")
        .arg(1)
        .arg("gone")
        .query(&mut redis.connection())
        .unwrap();
    let read = explain(&config, Some(&redis), &["tenant=acme,request_id=r2"]);
    assert!(read.contains("1 of 4 slots open now"), "{read}");
}
