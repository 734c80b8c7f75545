//! The command line and the side endpoints, as an operator meets them.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

async fn health_client(addr: std::net::SocketAddr) -> HealthClient<tonic::transport::Channel> {
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    HealthClient::new(channel)
}

fn tollgate(args: &[&str]) -> (bool, String, String) {
    let (code, stdout, stderr) = tollgate_code(args);
    (code == 0, stdout, stderr)
}

/// Runs the binary; its exit code, stdout and stderr.
fn tollgate_code(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(tollgate_bin()).args(args).env("RUST_LOG", "off").output().unwrap();
    (
        out.status.code().expect("exited"),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn validate_summarises_the_example_config() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tollgate.yaml");
    let (ok, stdout, stderr) = tollgate(&["validate", example]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("domain api-gateway: 5 rules"), "{stdout}");
}

/// A reader that goes away (`tollgate validate ... | head -1`) ends a command quietly, with
/// success, as it ends `cat`: no panic about a broken pipe. The pipe's reading end is closed before
/// the command starts, so its first write meets the broken pipe whatever the timing.
#[test]
fn output_to_a_closed_pipe_ends_the_command_quietly() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tollgate.yaml");
    for args in
        [&["validate", example][..], &["render", "envoy", "--config", example, "--domain", "api-gateway"]]
    {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out =
            Command::new(tollgate_bin()).args(args).env("RUST_LOG", "off").stdout(writer).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?} {stderr}", out.status);
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
    }
}

#[test]
fn validate_and_serve_reject_a_bad_config_precisely() {
    let (_dir, path) = config_file(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
    );
    let (ok, _, stderr) = tollgate(&["validate", path.to_str().unwrap()]);
    assert!(!ok);
    // The position is the `unit:` value's, not the rule's.
    let expected = format!("{}:4:24: descriptors[0](a): invalid rate limit unit 'fortnight'", path.display());
    assert!(stderr.contains(&expected), "{stderr}");
    // `serve` refuses to start on the same file, with the same message.
    let (ok, _, stderr) = tollgate(&[
        "serve",
        "--config",
        path.to_str().unwrap(),
        "--grpc-addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
    ]);
    assert!(!ok);
    assert!(stderr.contains(&expected), "{stderr}");
}

/// Every problem in `file:line:column: path: problem` form, one line each, every bad file of a
/// directory reported (issue 14, item 7).
#[test]
fn validate_reports_every_bad_file_in_one_form() {
    let dir = tempfile::tempdir().unwrap();
    let files = [
        ("a.yaml", "domain: a\ndescriptors:\n  - key: a\n    bogus: 1\n", "a.yaml:4:5: descriptors[0](a): unknown field `bogus`, expected one of"),
        ("b.yaml", "domain: b\ndescriptors:\n  - key: a\n   rate_limit: x\n", "b.yaml:4:4: descriptors[0](a): "),
        (
            "c.yaml",
            "domain: c\ndefault_tier: gold\ntiers:\n  free:\n    default: {capacity: 10, refill_per_second: 1}\n",
            "c.yaml:2:15: default_tier: unknown tier 'gold'",
        ),
        (
            "d.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {requests_per_unit: 1}\n",
            "d.yaml:4:17: descriptors[0](a): missing unit",
        ),
        (
            "e.yaml",
            "domain: e\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: -1\n",
            "e.yaml:6:26: descriptors[0](a): requests_per_unit must be a non-negative integer",
        ),
        // At the offending field, not at the node's `key:` (issue 33).
        (
            "g.yaml",
            "domain: g\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    charge: sometimes\n",
            "g.yaml:5:13: descriptors[0](a): unknown charge 'sometimes'",
        ),
        (
            "h.yaml",
            "domain: h\ndescriptors:\n  - key: a\n    shadow_mode: maybe\n",
            "h.yaml:4:18: descriptors[0](a): shadow_mode: invalid boolean",
        ),
        (
            "i.yaml",
            "domain: i\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    token_bucket: {capacity: 1, refill_per_second: 1}\n",
            "i.yaml:5:19: descriptors[0](a): rate_limit, token_bucket and quota are mutually exclusive",
        ),
        ("f.yaml", "domain: f\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n", ""),
    ];
    for (name, text, _) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let (code, stdout, stderr) = tollgate_code(&["validate", dir.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{stdout}{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 8, "one line per bad file: {stderr}");
    assert!(lines.iter().all(|l| l.starts_with("tollgate: ")), "every line in one form: {stderr}");
    for (name, _, expected) in files.iter().filter(|f| !f.2.is_empty()) {
        let expected = format!("{}{expected}", dir.path().join("").display());
        assert!(lines.iter().any(|l| l.contains(&expected)), "{name}: {expected}\n{stderr}");
        assert!(!stderr.contains("<input>"), "no parser snippet: {stderr}");
    }
    // `--config` as `serve` and `render` take it; "1 rule", not "1 rules".
    let f = dir.path().join("f.yaml");
    let (code, stdout, stderr) = tollgate_code(&["validate", "--config", f.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("domain f: 1 rule ("), "{stdout}");
}

/// One cause, said once (issue 14, item 6).
#[test]
fn errors_say_their_cause_once() {
    let (code, _, stderr) = tollgate_code(&["validate", "/nonexistent/tollgate.yaml"]);
    assert_eq!(code, 1);
    assert_eq!(stderr.matches("No such file or directory").count(), 1, "{stderr}");
    let port = free_port();
    let (code, _, stderr) = tollgate_code(&[
        "ask",
        "--addr",
        &format!("127.0.0.1:{port}"),
        "--domain",
        "d",
        "--descriptor",
        "a=1",
    ]);
    assert_eq!(code, 2, "an error is exit code 2: {stderr}");
    assert_eq!(stderr.matches("Connection refused").count(), 1, "{stderr}");
    assert!(!stderr.contains("transport error: transport error"), "{stderr}");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (_dir, config) = config_file("domain: d\n");
    let (code, _, stderr) = tollgate_code(&[
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--grpc-addr",
        &busy.local_addr().unwrap().to_string(),
        "--http-addr",
        "127.0.0.1:0",
    ]);
    assert_ne!(code, 0);
    assert_eq!(stderr.matches("Address already in use").count(), 1, "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn ask_prints_codes_statuses_and_headers() {
    let example = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tollgate.yaml"));
    let server = Tollgate::start(example, &Backend::Memory, &[]);
    let ask = |hits: &str| {
        tollgate_code(&[
            "ask",
            "--addr",
            &server.addr(),
            "--domain",
            "api-gateway",
            "--descriptor",
            "tenant=newbie",
            "--descriptor",
            "tenant=newbie,class=export",
            "--hits",
            hits,
        ])
    };
    let (code, stdout, stderr) = ask("1");
    assert_eq!(code, 0, "OK is exit code 0: {stderr}");
    assert!(stdout.starts_with("overall: OK\n"), "{stdout}");
    assert!(stdout.contains("descriptor 0 [tenant=newbie]: OK  limit=2/SECOND remaining=19"), "{stdout}");
    assert!(
        stdout.contains(
            "descriptor 1 [tenant=newbie,class=export]: OK  limit=1/SECOND name=export remaining=75"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("X-RateLimit-Remaining: 19"), "{stdout}");
    // Four more exports would need 100 tokens of the 75 left: denied, nothing debited.
    let (code, stdout, _) = ask("4");
    assert_eq!(code, 1, "OVER_LIMIT is exit code 1");
    assert!(stdout.starts_with("overall: OVER_LIMIT\n"), "{stdout}");
    assert!(stdout.contains("Retry-After: 25"), "{stdout}");
    // Nothing limits a descriptor no rule matches, or a domain not loaded: said, exit 0.
    for domain in ["api-gateway", "no-such-domain"] {
        let (code, stdout, _) =
            tollgate_code(&["ask", "--addr", &server.addr(), "--domain", domain, "--descriptor", "nobody=1"]);
        assert_eq!(code, 0);
        assert!(stdout.contains("OK  (no limit applied: no rule matched"), "{domain}: {stdout}");
    }
    // A malformed descriptor is the user's error, reported as such.
    let (code, _, stderr) =
        tollgate_code(&["ask", "--addr", &server.addr(), "--domain", "d", "--descriptor", "novalue"]);
    assert!(code == 2 && stderr.contains("'novalue' is not key=value"), "{stderr}");
}

/// An answer the failure mode gave is marked, for `ask` and for Envoy's clients.
#[tokio::test(flavor = "multi_thread")]
async fn ask_marks_an_answer_the_failure_mode_gave() {
    let (_dir, config) = config_file("domain: d\nfailure_mode: allow\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 3}\n");
    let closed = format!("redis://127.0.0.1:{}", free_port());
    let server = Tollgate::start_unready(&config, &Backend::Memory, &["--redis-url", &closed]);
    let (code, stdout, _) =
        tollgate_code(&["ask", "--addr", &server.addr(), "--domain", "d", "--descriptor", "a=1"]);
    println!("{stdout}");
    assert_eq!(code, 0);
    assert!(
        stdout.contains("answered by the failure mode (allow): the server's store did not answer"),
        "{stdout}"
    );
    assert!(stdout.contains("X-Tollgate-Failure-Mode: allow"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread")]
async fn side_endpoints_and_grpc_health() {
    let redis = Redis::start();
    let (_dir, config) = config_file(
        "domain: d\ndefault_tier: zeta\ntiers:\n  zeta: {default: {capacity: 1, refill_per_second: 1}}\n  alpha: {default: {capacity: 2, refill_per_second: 1}}\ntenants:\n  t9: {tier: alpha}\n  t1: {tier: zeta}\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 3}\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 3}\n",
    );
    let password_url = format!("redis://default:s3cret-pw@127.0.0.1:{}", redis.port);
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("s3cret-pw")
        .query(&mut redis.connection())
        .unwrap();
    let server = Tollgate::start(&config, &Backend::Redis(password_url), &[]);

    assert_eq!(http_get(server.http, "/healthz").unwrap(), (200, "ok\n".into()));
    assert_eq!(http_get(server.http, "/readyz").unwrap(), (200, "ready\n".into()));
    let (status, body) = http_get(server.http, "/config").unwrap();
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(json["domains"][0]["domain"], "d");
    assert_eq!(json["domains"][0]["rules"][0]["limit"]["bucket"]["capacity"], 3.0);
    assert!(!body.contains("s3cret-pw"), "no credentials in /config");
    // In file order, not sorted or hashed: what an operator compares with the file.
    let order = |words: &[&str]| {
        let at: Vec<usize> =
            words.iter().map(|w| body.find(w).unwrap_or_else(|| panic!("{w}: {body}"))).collect();
        at.windows(2).all(|w| w[0] < w[1])
    };
    assert!(order(&["\"zeta\"", "\"alpha\""]), "tiers in file order: {body}");
    assert!(order(&["\"t9\"", "\"t1\""]), "tenants in file order: {body}");

    let mut health = health_client(server.grpc).await;
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
        let r = health.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
    }
    assert_eq!(ask(&server.addr(), req("d", &["a=1"], 1)).await.unwrap().overall_code, OK);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_goes_unready_before_it_stops() {
    let (_dir, config) = config_file("domain: d\n");
    let mut server = Tollgate::start(&config, &Backend::Memory, &["--drain-delay", "2s"]);
    server.proc.signal("TERM");
    wait_until("/readyz 503 while draining", 100, Duration::from_millis(10), || {
        http_get(server.http, "/readyz").is_some_and(|(s, _)| s == 503)
    });
    let mut health = health_client(server.grpc).await;
    let r = health.check(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
    assert_eq!(r.status, ServingStatus::NotServing as i32);
    // Still answering rate-limit requests during the drain delay.
    assert_eq!(ask(&server.addr(), req("d", &["a=1"], 1)).await.unwrap().overall_code, OK);
    let status = server.proc.wait_exit(Duration::from_secs(10)).expect("exits after the drain");
    assert!(status.success(), "{status:?}");
}

/// Ctrl-C drains like SIGTERM; a second Ctrl-C exits at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_sigint_exits_at_once() {
    let (_dir, config) = config_file("domain: d\n");
    let mut server = Tollgate::start(&config, &Backend::Memory, &["--drain-delay", "30s"]);
    server.proc.signal("INT");
    wait_until("/readyz 503 while draining", 100, Duration::from_millis(10), || {
        http_get(server.http, "/readyz").is_some_and(|(s, _)| s == 503)
    });
    assert_eq!(ask(&server.addr(), req("d", &["a=1"], 1)).await.unwrap().overall_code, OK, "still serving");
    let second = std::time::Instant::now();
    server.proc.signal("INT");
    let status = server.proc.wait_exit(Duration::from_secs(5)).expect("exits at once, not after 30 s");
    println!(
        "Ctrl-C then Ctrl-C with a 30 s drain delay: exit {status:?} {:?} after the second",
        second.elapsed()
    );
    assert_eq!(status.code(), Some(130));
}

/// The usage lines name what a newcomer needs: `explain`'s names `--hits`, `serve --help` says
/// what Ctrl-C and a second Ctrl-C do.
#[test]
fn usage_names_hits_and_ctrl_c() {
    let (_, explain, _) = tollgate(&["explain", "--help"]);
    let usage = explain.lines().find(|l| l.starts_with("Usage:")).unwrap_or_default();
    assert!(usage.contains("--hits"), "{usage}");
    let (_, serve, _) = tollgate(&["serve", "--help"]);
    assert!(serve.contains("Ctrl-C") && serve.contains("a second Ctrl-C exits at once"), "{serve}");
}
