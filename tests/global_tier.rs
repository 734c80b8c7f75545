//! The global tier of limits that hold across regions (`--global-tier`): regions lease the
//! buckets of rules marked `global: true` over `tollgate.region.v1.RegionLeases`, a neutral gRPC
//! client standing in for a region here. Leases are read back from Redis: each region's lease
//! recorded in the bucket, the capacity of the leases and of the balance within the bucket's,
//! a renewal sent twice taking nothing more, and RLS requests at the global tier spending only
//! what the leases leave. Bad input is refused whole; without `--global-tier` the service is not
//! served.

mod common;

use common::*;
use tollgate::edge::region::proto::region_leases_client::RegionLeasesClient;
use tollgate::edge::region::proto::{BucketLease, BucketRenewal, Entry, RenewRequest};

const CONFIG: &str = r#"
domain: api
tenant_key: tenant
descriptors:
  - key: tenant
    token_bucket: {capacity: 100, refill_per_second: 10}
    global: true
    descriptors:
      - key: route
        rate_limit: {unit: second, requests_per_unit: 5}
"#;

const BUCKET: &str = "rl:{acme}:api:tenant=acme";

fn renewal(entries: &[(&str, &str)], capacity: f64, rate: f64, fresh: bool) -> BucketRenewal {
    BucketRenewal {
        domain: "api".into(),
        entries: entries.iter().map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() }).collect(),
        capacity,
        refill_per_second: rate,
        demand: rate,
        fresh,
        ..BucketRenewal::default()
    }
}

async fn renew(
    addr: &str,
    region: &str,
    buckets: Vec<BucketRenewal>,
) -> Result<Vec<BucketLease>, tonic::Status> {
    let mut client = RegionLeasesClient::connect(format!("http://{addr}")).await.expect("connects");
    let answer = client.renew(RenewRequest { region: region.into(), buckets }).await?.into_inner();
    assert_eq!(answer.ttl_ms, 10_000);
    Ok(answer.leases)
}

#[tokio::test(flavor = "multi_thread")]
async fn regions_lease_a_global_bucket_and_rls_spends_the_rest() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let server = regions::global_tier(&config, &Backend::Redis(redis.url()));
    let addr = server.addr();
    let acme = [("tenant", "acme")];

    // A first lease gets what it asks of the capacity, at most three quarters of the rate the
    // others leave (all of the 6 asked).
    let eu = renew(&addr, "eu", vec![renewal(&acme, 60.0, 6.0, true)]).await.unwrap();
    assert!(eu[0].known);
    assert_eq!((eu[0].bucket_capacity, eu[0].bucket_refill_per_second, eu[0].cost), (100.0, 10.0, 1));
    assert_eq!((eu[0].capacity, eu[0].refill_per_second), (60.0, 6.0));
    // The second region finds 40 tokens left, and three quarters of the 4 a second eu leaves.
    let us = renew(&addr, "us", vec![renewal(&acme, 60.0, 6.0, true)]).await.unwrap();
    assert_eq!((us[0].capacity, us[0].refill_per_second), (40.0, 3.0));
    assert_eq!((us[0].others_capacity, us[0].others_refill_per_second), (60.0, 6.0));
    // A renewal of what the region holds, sent twice (a retry after a lost answer): the same
    // lease, nothing more taken.
    for _ in 0..2 {
        let again = renew(&addr, "us", vec![renewal(&acme, 40.0, 3.0, false)]).await.unwrap();
        assert_eq!((again[0].capacity, again[0].refill_per_second), (40.0, 3.0));
    }

    // Both leases are in the bucket, and its balance is what they left: nothing, so the global
    // tier's own RLS request is denied (1 token a second is unleased: none refilled yet).
    let mut con = redis.connection();
    let leases: String = redis::cmd("HGET").arg(BUCKET).arg("h").query(&mut con).unwrap();
    assert!(leases.contains("region:eu ") && leases.contains("region:us "), "{leases}");
    let tokens: f64 = redis::cmd("HGET").arg(BUCKET).arg("t").query(&mut con).unwrap();
    assert!(tokens < 1.0, "the leases took the capacity: {tokens} left");
    // `tollgate explain` on the global tier's Redis shows each region's share.
    let explained = regions::explain(&config, "api", "tenant=acme", &redis.url());
    assert!(explained.contains("global: one bucket for every region"), "{explained}");
    assert!(explained.contains("leased:   60.000 tokens, 6.000/s to region:eu"), "{explained}");
    assert!(explained.contains("leased:   40.000 tokens, 3.000/s to region:us"), "{explained}");
    let rls = ask(&addr, req("api", &["tenant=acme"], 1)).await.unwrap();
    assert_eq!(rls.overall_code, OVER_LIMIT);

    // A region gives its lease back (capacity and rate 0): RLS refills at the rate it returned.
    let back = renew(&addr, "eu", vec![renewal(&acme, 0.0, 0.0, false)]).await.unwrap();
    assert_eq!((back[0].capacity, back[0].refill_per_second), (0.0, 0.0));
    let leases: String = redis::cmd("HGET").arg(BUCKET).arg("h").query(&mut con).unwrap();
    assert!(!leases.contains("region:eu ") && leases.contains("region:us "), "{leases}");
    wait_until("the returned rate refills the balance", 300, std::time::Duration::from_millis(10), || {
        futures::executor::block_on(ask(&addr, req("api", &["tenant=acme"], 1))).unwrap().overall_code == OK
    });

    // Buckets no global rule limits get nothing: a rule without `global`, an unknown domain.
    let unknown = renew(
        &addr,
        "eu",
        vec![
            renewal(&[("tenant", "acme"), ("route", "/a")], 5.0, 5.0, true),
            BucketRenewal { domain: "nope".into(), ..renewal(&acme, 1.0, 1.0, true) },
        ],
    )
    .await
    .unwrap();
    assert!(unknown.iter().all(|l| !l.known && l.capacity == 0.0), "{unknown:?}");
    let m = server.metrics();
    assert_eq!(sample(&m, "tollgate_global_renewals_total", &[("outcome", "ok")]), 5.0);
    assert_eq!(sample(&m, "tollgate_global_renewals_total", &[("outcome", "unknown")]), 2.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_renewals_are_refused_whole_and_the_service_is_off_by_default() {
    let (_dir, config) = config_file(CONFIG);
    let server = regions::global_tier(&config, &Backend::Memory);
    let addr = server.addr();
    let acme = [("tenant", "acme")];
    let refused = |r: Result<Vec<BucketLease>, tonic::Status>| r.unwrap_err().code();
    for region in ["", "a b", &"x".repeat(257)] {
        let r = renew(&addr, region, vec![renewal(&acme, 1.0, 1.0, true)]).await;
        assert_eq!(refused(r), tonic::Code::InvalidArgument, "region {region:?}");
    }
    for (capacity, rate) in [(f64::NAN, 1.0), (1.0, f64::INFINITY), (-1.0, 1.0)] {
        let r = renew(&addr, "eu", vec![renewal(&acme, capacity, rate, true)]).await;
        assert_eq!(refused(r), tonic::Code::InvalidArgument, "{capacity} {rate}");
    }
    let bad: [(&str, BucketRenewal); 6] = [
        ("holder with a space", BucketRenewal { holder: "s 1".into(), ..renewal(&acme, 1.0, 1.0, true) }),
        ("holder too long", BucketRenewal { holder: "h".repeat(257), ..renewal(&acme, 1.0, 1.0, true) }),
        ("a life under a second", BucketRenewal { ttl_ms: 999, ..renewal(&acme, 1.0, 1.0, true) }),
        ("a life over a minute", BucketRenewal { ttl_ms: 60_001, ..renewal(&acme, 1.0, 1.0, true) }),
        ("a part over all", BucketRenewal { of_unleased: 1.5, ..renewal(&acme, 1.0, 1.0, true) }),
        ("a part not a number", BucketRenewal { of_unleased: f64::NAN, ..renewal(&acme, 1.0, 1.0, true) }),
    ];
    for (what, b) in bad {
        assert_eq!(refused(renew(&addr, "eu", vec![b]).await), tonic::Code::InvalidArgument, "{what}");
    }
    let many = vec![renewal(&acme, 1.0, 1.0, true); 10_001];
    assert_eq!(refused(renew(&addr, "eu", many).await), tonic::Code::InvalidArgument);
    // One call naming more leaseholders than a bucket may have (one naming 3,000 ran a script for
    // 11.8 s): refused whole, before any script runs.
    let crowd: Vec<BucketRenewal> = (0..=tollgate::bucket::MAX_LEASEHOLDERS)
        .map(|h| BucketRenewal { holder: format!("r{h}"), ..renewal(&acme, 1.0, 1.0, true) })
        .collect();
    assert_eq!(refused(renew(&addr, "eu", crowd).await), tonic::Code::InvalidArgument, "too many holders");
    assert!(sample(&server.metrics(), "tollgate_leaseholders_refused_total", &[("by", "region")]) >= 1.0);
    // Nothing was leased by the refused calls: a whole-bucket lease still finds all of it.
    let whole = renew(&addr, "eu", vec![renewal(&acme, 100.0, 10.0, false)]).await.unwrap();
    assert_eq!(whole[0].capacity, 100.0);

    // gRPC health names the service where it is served.
    let health = |addr: std::net::SocketAddr| async move {
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let request =
            tonic_health::pb::HealthCheckRequest { service: "tollgate.region.v1.RegionLeases".into() };
        tonic_health::pb::health_client::HealthClient::new(channel)
            .check(request)
            .await
            .map(|r| r.into_inner().status)
    };
    assert_eq!(
        health(server.grpc).await.ok(),
        Some(tonic_health::pb::health_check_response::ServingStatus::Serving as i32)
    );

    let (_dir2, config2) = config_file(CONFIG);
    let regional = Tollgate::start(&config2, &Backend::Memory, &[]);
    assert_eq!(
        health(regional.grpc).await.map_err(|s| s.code()),
        Err(tonic::Code::NotFound),
        "not served: unknown"
    );
    let off = renew(&regional.addr(), "eu", vec![renewal(&acme, 1.0, 1.0, true)]).await;
    assert_eq!(refused(off), tonic::Code::Unimplemented);
}

// A leaseholder beneath a region (an RLQS stream of one of its replicas) holds a lease of its own,
// living as long as it asks, taking the part of the unleased rate it asks.
#[tokio::test(flavor = "multi_thread")]
async fn a_leaseholder_beneath_a_region_holds_its_own_lease_for_the_life_it_asks() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let server = regions::global_tier(&config, &Backend::Redis(redis.url()));
    let addr = server.addr();
    let acme = [("tenant", "acme")];
    let region = renew(&addr, "eu", vec![renewal(&acme, 20.0, 2.0, true)]).await.unwrap();
    assert_eq!((region[0].capacity, region[0].refill_per_second, region[0].ttl_ms), (20.0, 2.0, 10_000));
    let stream = BucketRenewal {
        holder: "r1#7".into(),
        ttl_ms: 60_000,
        of_unleased: 0.5,
        ..renewal(&acme, 30.0, 8.0, true)
    };
    let leased = renew(&addr, "eu", vec![stream]).await.unwrap();
    // Half of the 8 a second the region's lease leaves; the capacity asked.
    assert_eq!((leased[0].capacity, leased[0].refill_per_second, leased[0].ttl_ms), (30.0, 4.0, 60_000));
    assert_eq!((leased[0].others_capacity, leased[0].others_refill_per_second), (20.0, 2.0));

    let mut con = redis.connection();
    let field: String = redis::cmd("HGET").arg(BUCKET).arg("h").query(&mut con).unwrap();
    let leases = tollgate::store::parse_leases(&field).unwrap();
    let now_ms = redis_ms(&mut con);
    let life = |holder: &str| {
        let lease =
            leases.iter().find(|l| l.replica == holder).unwrap_or_else(|| panic!("{holder}: {leases:?}"));
        lease.expires_at_ms.saturating_sub(now_ms)
    };
    assert!((9_000..=10_000).contains(&life("region:eu")), "{leases:?}");
    assert!((59_000..=60_000).contains(&life("region:eu/r1#7")), "{leases:?}");
}

/// `validate` and `explain` say which rules are global.
#[test]
fn validate_and_explain_name_the_global_rules() {
    let (_dir, config) = config_file(CONFIG);
    let run = |args: &[&str]| {
        let out =
            std::process::Command::new(tollgate_bin()).args(args).env("RUST_LOG", "off").output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let path = config.to_str().unwrap();
    let validated = run(&["validate", path]);
    assert!(
        validated.contains("  global: tenant (one bucket for every region; cut off, a region denies it)"),
        "{validated}"
    );
    assert!(!validated.contains("global: tenant.route"), "{validated}");
    let explained = run(&["explain", "--config", path, "--domain", "api", "--descriptor", "tenant=acme"]);
    assert!(
        explained.contains("(global: one bucket for every region; cut off, a region denies it)"),
        "{explained}"
    );
    let (_dir, split) =
        config_file(&CONFIG.replacen("global: true", "global: true\n    global_fallback: {split: 3}", 1));
    let validated = run(&["validate", split.to_str().unwrap()]);
    assert!(validated.contains("cut off, a region decides on 1/3 of it in its own store"), "{validated}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_region_reaches_a_global_tier_behind_mutual_tls_with_its_client_certificate() {
    let redis = Redis::start();
    let pki = TestPki::new();
    let (_dir, config) = config_file(CONFIG);
    // Without mutual TLS, or without the regions' names, the global tier does not start.
    let mtls = pki.mtls_args();
    let without_names: Vec<&str> = mtls.iter().map(String::as_str).chain(["--global-tier"]).collect();
    for (flags, says) in [(vec!["--global-tier"], "mutual TLS only"), (without_names, "--global-region-san")]
    {
        let out = std::process::Command::new(tollgate_bin())
            .args(["serve", "--config", config.to_str().unwrap(), "--grpc-addr", "127.0.0.1:0"])
            .args(["--http-addr", "127.0.0.1:0"])
            .args(&flags)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && said.contains(says), "{flags:?}: {said}");
    }
    // Region eu's certificate is the PKI's client certificate, valid for the name "client".
    let mut flags: Vec<String> = pki.mtls_args();
    flags.extend([
        "--global-tier".into(),
        "--global-region-san".into(),
        "eu=client,us=us.regions.example".into(),
    ]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let global = Tollgate::start(&config, &Backend::Redis(redis.url()), &flags);
    let url = format!("https://127.0.0.1:{}", global.grpc.port());
    let region = |name: &str, with_certificate: bool| {
        let mut flags = vec!["--global-url", &url, "--region", name, "--global-first-lease-wait", "1s"];
        let (ca, cert, key) =
            (pki.path_str("ca.pem"), pki.path_str("client.pem"), pki.path_str("client.key"));
        flags.extend(["--global-tls-ca", &ca]);
        if with_certificate {
            flags.extend(["--global-tls-cert", &cert, "--global-tls-key", &key]);
        }
        Tollgate::start(&config, &Backend::Memory, &flags)
    };

    let eu = region("eu", true);
    let answer = ask(&eu.addr(), req("api", &["tenant=acme"], 1)).await.unwrap();
    assert_eq!(answer.overall_code, OK, "eu leased its share over mutual TLS: {}", global.log());
    let mut con = redis.connection();
    let leases: String = redis::cmd("HGET").arg(BUCKET).arg("h").query(&mut con).unwrap();
    assert!(leases.contains("region:eu/"), "{leases}");

    // eu's certificate does not make its holder us: refused, counted, no share.
    let posing = region("us", true);
    let answer = ask(&posing.addr(), req("api", &["tenant=acme"], 1)).await.unwrap();
    assert_eq!(answer.overall_code, OVER_LIMIT, "a region cannot renew as another");
    assert!(sample(&global.metrics(), "tollgate_global_renewals_refused_total", &[]) >= 1.0);
    let leases: String = redis::cmd("HGET").arg(BUCKET).arg("h").query(&mut con).unwrap();
    assert!(!leases.contains("region:us"), "{leases}");
    drop(posing);

    // Without a client certificate the global tier refuses the handshake: no share, denied.
    let us = region("us", false);
    let answer = ask(&us.addr(), req("api", &["tenant=acme"], 1)).await.unwrap();
    assert_eq!(answer.overall_code, OVER_LIMIT, "us has no share without a client certificate");
    let failed = sample(&us.metrics(), "tollgate_global_rounds_total", &[("outcome", "failed")]);
    assert!(failed >= 1.0, "{failed} failed rounds");
}
