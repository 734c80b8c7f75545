//! Transport security and secrets: gRPC TLS and mTLS with certificate reload, mTLS from a real
//! Envoy, Redis over TLS as a least-privilege ACL user, and no credentials in logs, /config or
//! /metrics.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use tollgate::client::ask_with;

const CONFIG: &str = r#"
domain: s
failure_mode: error
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 2}
"#;

#[tokio::test(flavor = "multi_thread")]
async fn grpc_over_tls_and_mutual_tls() {
    let pki = TestPki::new();
    let (_dir, config) = config_file(CONFIG);
    let tls_args = ["--tls-cert", &pki.path_str("server.pem"), "--tls-key", &pki.path_str("server.key")];
    let server = Tollgate::start(&config, &Backend::Memory, &tls_args);
    let addr = server.addr();
    let r = ask_with(&addr, req("s", &["k=1"], 1), Some(&pki.client_tls(false))).await.unwrap();
    assert_eq!(r.overall_code, OK);
    // Plaintext is refused, and the client says why rather than "operation was cancelled".
    let plaintext = ask_with(&addr, req("s", &["k=1"], 1), None).await.unwrap_err().to_string();
    assert!(
        plaintext.contains("closed the connection without answering: the port may serve TLS"),
        "{plaintext}"
    );

    // mTLS: a client certificate signed by the client CA is required.
    let mtls = Tollgate::start(
        &config,
        &Backend::Memory,
        &[&tls_args[..], &["--tls-client-ca", &pki.path_str("ca.pem")]].concat(),
    );
    let addr = mtls.addr();
    let anonymous = ask_with(&addr, req("s", &["k=1"], 1), Some(&pki.client_tls(false))).await;
    let anonymous = anonymous.expect_err("no client certificate").to_string();
    assert!(
        anonymous.contains("TLS handshake failed") || anonymous.contains("cannot connect"),
        "{anonymous}"
    );
    let stranger = TestPki::new();
    let mut forged = pki.client_tls(true);
    forged.identity_pem = Some((
        std::fs::read(stranger.path("client.pem")).unwrap(),
        std::fs::read(stranger.path("client.key")).unwrap(),
    ));
    assert!(
        ask_with(&addr, req("s", &["k=1"], 1), Some(&forged)).await.is_err(),
        "a certificate from another CA"
    );
    let r = ask_with(&addr, req("s", &["k=1"], 1), Some(&pki.client_tls(true))).await.unwrap();
    assert_eq!(r.overall_code, OK);
    assert!(sample(&mtls.metrics(), "tollgate_tls_handshake_failures_total", &[]) >= 2.0);
}

// envoyproxy/ratelimit's GRPC_CLIENT_TLS_SAN: a certificate the CA signed, for another name, is
// refused; one for the pinned name is served.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_certificate_pinned_to_a_name() {
    let pki = TestPki::new();
    let (_dir, config) = config_file(CONFIG);
    let pinned = |name: &str| {
        let mut args = pki.mtls_args();
        args.extend(["--tls-client-san".to_owned(), name.to_owned()]);
        Tollgate::start(&config, &Backend::Memory, &args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let right = pinned("client");
    let r = ask_with(&right.addr(), req("s", &["k=1"], 1), Some(&pki.client_tls(true))).await.unwrap();
    assert_eq!(r.overall_code, OK);
    let wrong = pinned("billing.internal");
    let refused = ask_with(&wrong.addr(), req("s", &["k=1"], 1), Some(&pki.client_tls(true))).await;
    assert!(refused.is_err(), "a certificate the CA signed for another name");
    assert!(sample(&wrong.metrics(), "tollgate_tls_handshake_failures_total", &[]) >= 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn certificates_are_reloaded_without_a_restart() {
    let old = TestPki::new();
    let live = tempfile::tempdir().unwrap();
    for f in ["server.pem", "server.key"] {
        std::fs::copy(old.path(f), live.path().join(f)).unwrap();
    }
    let (_dir, config) = config_file(CONFIG);
    let cert = live.path().join("server.pem");
    let key = live.path().join("server.key");
    let server = Tollgate::start(
        &config,
        &Backend::Memory,
        &["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()],
    );
    let addr = server.addr();
    assert!(ask_with(&addr, req("s", &["k=1"], 1), Some(&old.client_tls(false))).await.is_ok());
    let tls_reloads = |result| sample(&server.metrics(), "tollgate_tls_reloads_total", &[("result", result)]);
    let quiet = || std::thread::sleep(tollgate::reload::DEBOUNCE * 5);

    // Reading the files (a `cat`, tollgate's own reads) and a `touch` reload nothing: a read used
    // to start a reload every 200 ms, forever.
    std::fs::read(&cert).unwrap();
    assert!(std::process::Command::new("touch").arg(&key).status().unwrap().success());
    quiet();
    assert_eq!(tls_reloads("success"), 0.0);

    // Rotate: a certificate from a new CA, written the way Secret volumes do (rename into place).
    let new = TestPki::new();
    for f in ["server.pem", "server.key"] {
        let staged = live.path().join(format!(".{f}.tmp"));
        std::fs::copy(new.path(f), &staged).unwrap();
        std::fs::rename(&staged, live.path().join(f)).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while ask_with(&addr, req("s", &["k=2"], 1), Some(&new.client_tls(false))).await.is_err() {
        assert!(Instant::now() < deadline, "the new certificate was never served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        ask_with(&addr, req("s", &["k=2"], 1), Some(&old.client_tls(false))).await.is_err(),
        "the old one is gone"
    );
    quiet();
    assert_eq!(tls_reloads("success"), 1.0, "two files renamed together, one reload, and no loop");

    // A broken file is rejected and the current certificate stays.
    std::fs::write(&key, "not a key").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while tls_reloads("failure") < 1.0 {
        assert!(Instant::now() < deadline, "the broken key was never noticed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ask_with(&addr, req("s", &["k=3"], 1), Some(&new.client_tls(false))).await.is_ok());
    quiet();
    assert_eq!(tls_reloads("failure"), 1.0, "a broken key is reported once, not 5 times a second");
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_reaches_tollgate_over_mtls() {
    let pki = TestPki::new();
    let mtls = pki.mtls_args();
    let tollgate = Tollgate::start(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/examples")),
        &Backend::Memory,
        &mtls.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(upstream, axum::Router::new().fallback(|| async { "ok" })).await.unwrap()
    });

    // The shipped front proxy, with its tollgate cluster replaced by the shipped mTLS cluster.
    let mut config = repo_yaml("envoy/front-proxy.yaml");
    let mut cluster = repo_yaml("envoy/tollgate-mtls-cluster.yaml");
    let tls = &mut cluster["transport_socket"]["typed_config"]["common_tls_context"];
    tls["tls_certificates"][0]["certificate_chain"]["filename"] = json!(pki.path_str("client.pem"));
    tls["tls_certificates"][0]["private_key"]["filename"] = json!(pki.path_str("client.key"));
    tls["validation_context"]["trusted_ca"]["filename"] = json!(pki.path_str("ca.pem"));
    tls["validation_context"]["match_typed_subject_alt_names"][0]["matcher"]["exact"] = json!("localhost");
    cluster["transport_socket"]["typed_config"]["sni"] = json!("localhost");
    let socket = |a: std::net::SocketAddr| json!({"address": a.ip().to_string(), "port_value": a.port()});
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] =
        socket(tollgate.grpc);
    let (listener, admin) = (free_port(), free_port());
    config["admin"]["address"]["socket_address"] = json!({"address": "127.0.0.1", "port_value": admin});
    config["static_resources"]["listeners"][0]["address"]["socket_address"] =
        json!({"address": "127.0.0.1", "port_value": listener});
    for c in config["static_resources"]["clusters"].as_array_mut().unwrap() {
        match c["name"].as_str().unwrap() {
            "tollgate" => *c = cluster.clone(),
            _ => {
                c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                    ["socket_address"] = socket(upstream_addr)
            }
        }
    }
    let _envoy = Envoy::start(&config, format!("127.0.0.1:{admin}").parse().unwrap());
    let tokens: serde_json::Value = serde_json::from_str(include_str!("../envoy/demo/tokens.json")).unwrap();
    let bearer = format!("Bearer {}", tokens["acme"].as_str().unwrap());
    let r =
        http_request(format!("127.0.0.1:{listener}").parse().unwrap(), "/", &[("authorization", &bearer)]);
    assert_eq!(r.status, 200, "{r:?}");
    let policy = r.header("ratelimit-policy").unwrap_or_default();
    assert!(policy.contains(r#""tenant";q=200"#), "tollgate answered over mTLS (acme is pro): {r:?}");
    assert_eq!(sample(&tollgate.metrics(), "tollgate_tls_handshake_failures_total", &[]), 0.0);
}

/// The ACL tollgate needs: its scripts' commands on `rl:*` keys, nothing else.
const TOLLGATE_ACL: &str = "user tollgate on >tollgate-secret resetkeys ~rl:* resetchannels &tollgate:raised -@all +publish +subscribe +evalsha +eval +script|load +ping +time +hget +hmget +hset +hexists +hgetall +hdel +del +pexpireat +pexpiretime +pttl +zadd +zcard +zcount +zrange +zrangebyscore +zrem +zremrangebyscore";

// Beside CONFIG, for the ACL tests: a money budget with a concurrency limit, whose scripts use
// every command the ACL allows on keys.
const PRICED: &str = r#"
domain: llm
tenant_key: org
prices:
  version: "1"
  currency: USD
  models:
    m: {input: 1.00, output: 2.00, default_output_tokens: 100}
descriptors:
  - key: org
    budget: {amount: 1.00, per: day}
    concurrency: {max: 2, ttl: 60s}
    descriptors:
      - key: model
        descriptors:
          - key: request_id
"#;

// A directory with CONFIG and PRICED.
fn acl_config() -> (tempfile::TempDir, std::path::PathBuf) {
    let (dir, _) = config_file(CONFIG);
    std::fs::write(dir.path().join("priced.yaml"), PRICED).unwrap();
    let path = dir.path().to_path_buf();
    (dir, path)
}

// A hold, its settlement, and a hold cancelled by nothing (left open): each answered OK.
async fn priced_traffic(addr: &str) {
    for d in [
        "org=o,model=m,request_id=r1",
        "org=o,model=m,request_id=r1,usage=output",
        "org=o,model=m,request_id=r2",
    ] {
        assert_eq!(ask(addr, req("llm", &[d], 1)).await.unwrap().overall_code, OK, "{d}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_over_tls_as_a_least_privilege_acl_user() {
    let pki = TestPki::new();
    let acl = format!(
        "user default off\nuser probe on >probe ~* +ping\nuser admin on >admin ~* &* +@all\n{TOLLGATE_ACL}\n"
    );
    let redis = Redis::start_tls(&pki, &acl);
    let (_dir, config) = acl_config();
    let url = format!("rediss://tollgate:tollgate-secret@127.0.0.1:{}", redis.port);
    // Without the pre-check, so that the denial reaches Redis too (it reads the bucket's expiry).
    let server = Tollgate::start(
        &config,
        &Backend::Redis(url),
        &["--redis-ca", &pki.path_str("ca.pem"), "--no-precheck"],
    );
    // failure_mode: error, so any store failure would surface as UNAVAILABLE.
    for expected in [OK, OK, OVER_LIMIT] {
        assert_eq!(ask(&server.addr(), req("s", &["k=acl"], 1)).await.unwrap().overall_code, expected);
    }
    priced_traffic(&server.addr()).await;
    // A replica with the pre-check subscribes to the raise channel, and a credit publishes on it.
    let url = format!("rediss://tollgate:tollgate-secret@127.0.0.1:{}", redis.port);
    let checked = Tollgate::start(&config, &Backend::Redis(url), &["--redis-ca", &pki.path_str("ca.pem")]);
    wait_until("subscribed", 300, Duration::from_millis(10), || {
        sample(&checked.metrics(), "tollgate_precheck_hearing_raises", &[]) == 1.0
    });
    let mut credit = req("s", &["k=acl"], 1);
    credit.descriptors[0].is_negative_hits = true;
    assert_eq!(ask(&checked.addr(), credit).await.unwrap().overall_code, OK);
    let (ok, log) = redis.tls_cli(&pki, &["--user", "admin", "--pass", "admin", "ACL", "LOG"]);
    assert!(ok && log.trim().is_empty(), "tollgate needed a command outside its ACL: {log}");
    let (_, keys) = redis.tls_cli(&pki, &["--user", "admin", "--pass", "admin", "KEYS", "*"]);
    assert!(keys.lines().any(|k| k == "rl:s:k=acl") && keys.lines().all(|k| k.starts_with("rl:")), "{keys}");
    // The user can do nothing else.
    for denied in
        [vec!["GET", "other"], vec!["FLUSHALL"], vec!["HGETALL", "session:1"], vec!["CONFIG", "GET", "*"]]
    {
        let args = [&["--user", "tollgate", "--pass", "tollgate-secret"][..], &denied].concat();
        let (ok, out) = redis.tls_cli(&pki, &args);
        assert!(!ok && out.contains("NOPERM"), "{denied:?}: {out}");
    }
    // Without the CA, the server's certificate is not trusted.
    let (_dir2, config2) = config_file(CONFIG);
    let untrusted = Tollgate::start_unready(
        &config2,
        &Backend::Redis(format!("rediss://tollgate:tollgate-secret@127.0.0.1:{}", redis.port)),
        &[],
    );
    let err = ask(&untrusted.addr(), req("s", &["k=1"], 1)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn no_credentials_in_logs_config_or_metrics() {
    let redis_password = "redis-pw-7f3a9c";
    let db_password = "db-pw-51be20";
    let jwt = "eyJhbGciOiJSUzI1NiJ9.eyJ0ZW5hbnQiOiJzZWNyZXQifQ.c2lnbmF0dXJlLXNlY3JldA";
    let (_dir, config) = config_file(
        "domain: s\nfailure_mode: error\ndefault_tier: free\ntiers: {free: {default: {capacity: 5, refill_per_second: 1}}}\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: tenant\n    quota: tenant\n",
    );
    // Both stores are unreachable, so every path that reports a store error runs.
    let redis_url = format!("redis://default:{redis_password}@127.0.0.1:{}", free_port());
    let db_url = format!("postgres://tollgate:{db_password}@127.0.0.1:{}/db", free_port());
    let server = Tollgate::start_unready_with_env(
        &config,
        &Backend::Memory,
        &["--quota-store", &db_url],
        &[("RUST_LOG", "debug"), ("TOLLGATE_REDIS_URL", &redis_url)],
    );
    // A token-like value in a descriptor (tollgate never sees Authorization headers; values are
    // the only way one could reach it) must not be logged either.
    for descriptors in [vec!["k=1".to_string()], vec!["tenant=t1".to_string()], vec![format!("k={jwt}")]] {
        let d: Vec<&str> = descriptors.iter().map(String::as_str).collect();
        let _ = ask(&server.addr(), req("s", &d, 1)).await;
    }
    let _ = ask(&server.addr(), req("", &["k=1"], 1)).await;
    let (_, config_json) = http_get(server.http, "/config").unwrap();
    let (_, metrics) = http_get(server.http, "/metrics").unwrap();
    let log = server.log();
    assert!(log.contains("store failed") || log.contains("quota lookup"), "the error paths ran:\n{log}");
    for (what, text) in [("log", &log), ("/config", &config_json), ("/metrics", &metrics)] {
        for secret in [redis_password, db_password, jwt] {
            assert!(!text.contains(secret), "{what} contains a secret ({secret}):\n{text}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_cluster_as_a_least_privilege_acl_user() {
    let cluster = RedisCluster::start();
    let acl_rules = TOLLGATE_ACL.strip_prefix("user tollgate ").unwrap();
    let cluster_extra = "+cluster|slots +asking";
    for port in &cluster.ports {
        let mut args = vec!["ACL", "SETUSER", "tollgate"];
        args.extend(acl_rules.split(' '));
        args.extend(cluster_extra.split(' '));
        let ok: String = node_query(*port, &args).expect("ACL SETUSER");
        assert_eq!(ok, "OK");
    }
    let seeds: Vec<String> = cluster
        .ports
        .iter()
        .take(3)
        .map(|p| format!("redis://tollgate:tollgate-secret@127.0.0.1:{p}"))
        .collect();
    let (_dir, config) = acl_config();
    let server = Tollgate::start(&config, &Backend::Cluster(seeds.join(",")), &[]);
    for i in 0..50 {
        let r = ask(&server.addr(), req("s", &[&format!("k={i}")], 1)).await.unwrap();
        assert_eq!(r.overall_code, OK);
    }
    priced_traffic(&server.addr()).await;
    for port in &cluster.ports {
        let log: Vec<redis::Value> = node_query(*port, &["ACL", "LOG"]).unwrap();
        assert!(log.is_empty(), "node {port}: tollgate needed a command outside its ACL: {log:?}");
    }
}

/// A store that does not answer says why, at startup, in one log line, in `/readyz` and in a
/// metric: a wrong password, a CA that does not sign the server's certificate, a closed port.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_store_says_why() {
    let pki = TestPki::new();
    let acl = format!("user default off\nuser probe on >probe ~* +ping\n{TOLLGATE_ACL}\n");
    let redis = Redis::start_tls(&pki, &acl);
    let other = TestPki::new();
    let cases = [
        (
            "wrong password",
            format!("rediss://tollgate:wrong-pw-3c1d@127.0.0.1:{}", redis.port),
            Some(pki.path_str("ca.pem")),
            "authentication",
            "authentication refused",
        ),
        (
            "wrong CA",
            format!("rediss://tollgate:tollgate-secret@127.0.0.1:{}", redis.port),
            Some(other.path_str("ca.pem")),
            "tls",
            "TLS failed",
        ),
        (
            "closed port",
            format!("redis://127.0.0.1:{}", free_port()),
            None,
            "connection_refused",
            "connection refused",
        ),
    ];
    for (what, url, ca, label, words) in cases {
        let (_dir, config) = config_file(CONFIG);
        let mut args = vec!["--redis-url".to_owned(), url];
        if let Some(ca) = ca {
            args.extend(["--redis-ca".to_owned(), ca]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let server = Tollgate::start_unready(&config, &Backend::Memory, &args);
        wait_until("the cause in the log", 200, Duration::from_millis(20), || server.log().contains(words));
        let (status, body) = http_get(server.http, "/readyz").unwrap();
        let metrics = server.metrics();
        let counted = sample(&metrics, "tollgate_store_down_total", &[("cause", label)]);
        let log = server.log();
        let line = log.lines().find(|l| l.contains("does not answer")).unwrap_or_default().to_owned();
        println!("{what}: /readyz {status} {}; log: {line}", body.trim());
        assert_eq!(status, 503);
        assert!(body.contains(words), "{what}: {body}");
        assert_eq!(counted, 1.0, "{what}: counted once");
        assert_eq!(sample(&metrics, "tollgate_store_up", &[]), 0.0);
        assert_eq!(log.matches("does not answer").count(), 1, "{what}: one line, not one per ping:\n{log}");
        assert!(
            !log.contains("tollgate-secret") && !log.contains("wrong-pw-3c1d"),
            "{what}: no password in the log"
        );
    }
}

/// `curl` over TLS to `url` with `pki`'s CA and, with `identity`, its client certificate;
/// (HTTP status, body), status 0 when the handshake fails.
fn curl_tls(pki: &TestPki, identity: bool, url: &str, body: Option<&str>) -> (u16, String) {
    let mut cmd = std::process::Command::new("curl");
    cmd.args([
        "-s",
        "-o",
        "-",
        "-w",
        "\n%{http_code}",
        "--max-time",
        "5",
        "--cacert",
        &pki.path_str("ca.pem"),
    ]);
    if identity {
        cmd.args(["--cert", &pki.path_str("client.pem"), "--key", &pki.path_str("client.key")]);
    }
    if let Some(body) = body {
        cmd.args(["-H", "content-type: application/json", "--data", body]);
    }
    let out = cmd.arg(url).output().expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (status.trim().parse().unwrap_or(0), body.to_owned())
}

/// With mutual TLS on gRPC, nothing on the plaintext HTTP port spends or reveals a tenant's
/// budget: `POST /json` and `GET /config` are refused there (nothing debited, read back from
/// Redis) and served on the gRPC port to clients with a certificate; probes and `/metrics` stay
/// open. `--http-unauthenticated` opens them on the HTTP port again.
#[tokio::test(flavor = "multi_thread")]
async fn no_side_door_past_mutual_tls() {
    let pki = TestPki::new();
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let mtls = pki.mtls_args();
    let mtls: Vec<&str> = mtls.iter().map(String::as_str).collect();
    let server = Tollgate::start_unready(&config, &Backend::Redis(redis.url()), &mtls);
    let body = r#"{"domain": "s", "descriptors": [{"entries": [{"key": "k", "value": "side"}]}]}"#;
    let key = "rl:s:k=side";
    // The balance, to a hundredth of a token (2 an hour refill a little meanwhile).
    let tokens = || {
        node_query::<Option<String>>(redis.port, &["HGET", key, "t"])
            .flatten()
            .map(|t| format!("{:.2}", t.parse::<f64>().unwrap()))
    };

    let refused = http_post(server.http, "/json", body.as_bytes());
    println!("plaintext POST /json past mTLS: {} {}", refused.status, refused.body.trim());
    assert_eq!(refused.status, 403);
    assert!(refused.body.contains("served on the gRPC port, over mutual TLS"), "{}", refused.body);
    assert_eq!(tokens(), None, "nothing debited");
    let (status, config_body) = http_get(server.http, "/config").unwrap();
    assert_eq!(status, 403, "{config_body}");
    for open in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(http_get(server.http, open).map(|(s, _)| s), Some(200), "{open} needs no certificate");
    }

    // The authenticated way: the gRPC port, with a client certificate.
    let url = format!("https://localhost:{}/json", server.grpc.port());
    let (status, answer) = curl_tls(&pki, true, &url, Some(body));
    println!("POST /json over mTLS on the gRPC port: {status} {answer}");
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("\"overallCode\":\"OK\""), "{answer}");
    assert_eq!(tokens().as_deref(), Some("1.00"), "one of the 2 tokens taken");
    let (status, config_body) =
        curl_tls(&pki, true, &format!("https://localhost:{}/config", server.grpc.port()), None);
    assert!(status == 200 && config_body.contains("\"domain\":\"s\""), "{status} {config_body}");
    let (status, _) = curl_tls(&pki, false, &url, Some(body));
    assert_eq!(status, 0, "no client certificate, no handshake");
    assert_eq!(tokens().as_deref(), Some("1.00"));

    // Opted in: the plaintext port serves it again.
    let (_dir2, config2) = config_file(CONFIG);
    let open = Tollgate::start_unready(
        &config2,
        &Backend::Redis(redis.url()),
        &[&mtls[..], &["--http-unauthenticated"]].concat(),
    );
    assert_eq!(http_post(open.http, "/json", body.as_bytes()).status, 200);
    assert_eq!(tokens().as_deref(), Some("0.00"));
}

/// A client on the wrong side of TLS gets a clear line in tollgate's log, once however often it
/// retries: plaintext on the TLS port, TLS on the plaintext port.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_on_the_wrong_side_of_tls_is_named_in_the_log() {
    let pki = TestPki::new();
    let (_dir, config) = config_file(CONFIG);
    let tls_args = ["--tls-cert", &pki.path_str("server.pem"), "--tls-key", &pki.path_str("server.key")];
    let tls = Tollgate::start(&config, &Backend::Memory, &tls_args);
    let plain = Tollgate::start(&config, &Backend::Memory, &[]);
    for _ in 0..5 {
        assert!(ask_with(&tls.addr(), req("s", &["k=1"], 1), None).await.is_err());
        assert!(ask_with(&plain.addr(), req("s", &["k=1"], 1), Some(&pki.client_tls(false))).await.is_err());
    }
    // Plaintext clients still work on the plaintext port.
    assert_eq!(ask(&plain.addr(), req("s", &["k=1"], 1)).await.unwrap().overall_code, OK);
    wait_until("both lines", 100, Duration::from_millis(20), || {
        tls.log().contains("spoke plaintext to the TLS gRPC port")
            && plain.log().contains("opened TLS on the plaintext gRPC port")
    });
    let (tls_log, plain_log) = (tls.log(), plain.log());
    println!(
        "{}\n{}",
        tls_log.lines().find(|l| l.contains("spoke plaintext")).unwrap(),
        plain_log.lines().find(|l| l.contains("opened TLS")).unwrap()
    );
    assert_eq!(
        tls_log.matches("spoke plaintext to the TLS gRPC port").count(),
        1,
        "rate-limited:\n{tls_log}"
    );
    assert_eq!(
        plain_log.matches("opened TLS on the plaintext gRPC port").count(),
        1,
        "rate-limited:\n{plain_log}"
    );
}
