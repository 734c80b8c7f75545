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
    let out = Command::new(tollgate_bin()).args(args).env("RUST_LOG", "off").output().unwrap();
    (
        out.status.success(),
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

#[test]
fn validate_and_serve_reject_a_bad_config_precisely() {
    let (_dir, path) = config_file(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
    );
    let (ok, _, stderr) = tollgate(&["validate", path.to_str().unwrap()]);
    assert!(!ok);
    let expected = format!("{}:3:10: descriptors[0](a): invalid rate limit unit 'fortnight'", path.display());
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

#[tokio::test(flavor = "multi_thread")]
async fn ask_prints_codes_statuses_and_headers() {
    let example = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tollgate.yaml"));
    let server = Tollgate::start(example, &Backend::Memory, &[]);
    let ask = |hits: &str| {
        tollgate(&[
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
    let (ok, stdout, stderr) = ask("1");
    assert!(ok, "{stderr}");
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
    let (_, stdout, _) = ask("4");
    assert!(stdout.starts_with("overall: OVER_LIMIT\n"), "{stdout}");
    assert!(stdout.contains("Retry-After: 25"), "{stdout}");
    // A malformed descriptor is the user's error, reported as such.
    let (ok, _, stderr) =
        tollgate(&["ask", "--addr", &server.addr(), "--domain", "d", "--descriptor", "novalue"]);
    assert!(!ok && stderr.contains("'novalue' is not key=value"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn side_endpoints_and_grpc_health() {
    let redis = Redis::start();
    let (_dir, config) = config_file(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 3}\n",
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
