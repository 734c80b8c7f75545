//! `POST /json`: envoyproxy/ratelimit's JSON form of the RLS call, for services that are not
//! behind Envoy. Decisions are the gRPC edge's, balances are read back from Redis.

mod common;

use common::*;

const CONFIG: &str =
    "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";

fn post(server: &Tollgate, body: &str) -> (HttpResponse, serde_json::Value) {
    let r = http_post(server.http, "/json", body.as_bytes());
    let json = serde_json::from_str(&r.body).unwrap_or(serde_json::Value::Null);
    (r, json)
}

#[test]
fn json_decisions_debit_the_same_buckets_as_grpc() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);

    // The reference's own example shape: camelCase, a value per entry.
    let (r, json) =
        post(&server, r#"{"domain": "d", "descriptors": [{"entries": [{"key": "k", "value": "v"}]}]}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(json["overallCode"], "OK");
    assert_eq!(json["statuses"][0]["code"], "OK");
    assert_eq!(
        json["statuses"][0]["currentLimit"],
        serde_json::json!({"requestsPerUnit": 5, "unit": "MINUTE"})
    );
    assert_eq!(json["statuses"][0]["limitRemaining"], 4);
    assert!(json["statuses"][0]["durationUntilReset"].as_str().unwrap().ends_with('s'), "{json}");
    assert_eq!(r.header("x-ratelimit-remaining"), Some("4"), "the headers are set on the HTTP answer too");

    // The .proto's own field names, and a 64-bit number as a string: 3 more hits.
    let (r, json) = post(
        &server,
        r#"{"domain": "d", "descriptors": [{"entries": [{"key": "k", "value": "v"}], "hits_addend": "3"}]}"#,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(json["statuses"][0]["limitRemaining"], 1);

    // Two more: OVER_LIMIT is 429, with Retry-After, and takes nothing.
    let (r, json) = post(
        &server,
        r#"{"domain": "d", "hitsAddend": 2, "descriptors": [{"entries": [{"key": "k", "value": "v"}]}]}"#,
    );
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(json["overallCode"], "OVER_LIMIT");
    assert_eq!(json["statuses"][0]["limitRemaining"], 1, "a denial takes nothing: {json}");
    assert!(r.header("retry-after").is_some(), "{:?}", r.headers);

    // The last token: remaining 0 is left out, as protojson leaves out default values.
    let (r, json) =
        post(&server, r#"{"domain": "d", "descriptors": [{"entries": [{"key": "k", "value": "v"}]}]}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(json["statuses"][0].get("limitRemaining").is_none(), "{json}");

    // The bucket in Redis holds what the admitted requests took: 1 + 3 + 1 of 5 (a minute's
    // refill is 5 tokens a minute: well under 0.1 over this test).
    let mut con = redis.connection();
    let tokens = stored_tokens(&mut con, "rl:d:k=v");
    assert!(tokens < 0.1, "{tokens}");
}

#[test]
fn bad_bodies_get_a_clear_400_or_413_and_change_nothing() {
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, &[]);
    let cases = [
        ("{", "not a RateLimitRequest"),
        (
            r#"{"domain": "d", "descriptors": [{"entries": [{"key": "k"}]}], "bogus": 1}"#,
            "unknown field `bogus`",
        ),
        (
            r#"{"domain": "d", "descriptors": [{"entries": [{"key": "k"}], "hitsAddend": "many"}]}"#,
            "'many' is not an unsigned integer",
        ),
        (
            r#"{"domain": "d", "descriptors": [{"entries": [{"key": "k"}], "limit": {"requestsPerUnit": 1, "unit": "FORTNIGHT"}}]}"#,
            "unknown unit 'FORTNIGHT'",
        ),
        (r#"{"domain": "", "descriptors": [{"entries": [{"key": "k"}]}]}"#, "domain must not be empty"),
        (r#"{"domain": "d", "descriptors": []}"#, "at least one descriptor is required"),
    ];
    for (body, expected) in cases {
        let (r, _) = post(&server, body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert!(r.body.contains(expected), "{body}: expected {expected:?} in {}", r.body);
    }
    // The gRPC edge's limits: 65 descriptors are refused the same way.
    let many: Vec<String> =
        (0..65).map(|i| format!(r#"{{"entries": [{{"key": "k", "value": "{i}"}}]}}"#)).collect();
    let (r, _) = post(&server, &format!(r#"{{"domain": "d", "descriptors": [{}]}}"#, many.join(",")));
    assert_eq!(r.status, 400);
    assert!(r.body.contains("at most 64 descriptors"), "{}", r.body);
    // Past 4 MiB: 413 before anything is parsed.
    let huge = format!(r#"{{"domain": "{}"}}"#, "x".repeat(5 << 20));
    let (r, _) = post(&server, &huge);
    assert_eq!(r.status, 413);
    // Nothing was debited by any of them: the bucket is full.
    let (r, json) =
        post(&server, r#"{"domain": "d", "descriptors": [{"entries": [{"key": "k", "value": "0"}]}]}"#);
    assert_eq!(r.status, 200);
    assert_eq!(json["statuses"][0]["limitRemaining"], 4);
    assert!(sample(&server.metrics(), "tollgate_invalid_requests_total", &[]) >= 7.0);
}

/// A body a browser could send cross-site without a preflight (a form, plain text) is refused
/// with 415 and debits nothing: `POST /json` takes `Content-Type: application/json` only.
#[test]
fn json_needs_its_content_type() {
    use std::io::Write as _;
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, &[]);
    let body = r#"{"domain": "d", "descriptors": [{"entries": [{"key": "k", "value": "ct"}]}]}"#;
    let post_as = |content_type: &str| {
        let mut stream = std::net::TcpStream::connect(server.http).unwrap();
        write!(
            stream,
            "POST /json HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        parse_response(stream)
    };
    for content_type in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
    {
        let r = post_as(content_type);
        assert_eq!(r.status, 415, "{content_type}: {}", r.body);
    }
    let r = post_as("Application/JSON; charset=utf-8");
    assert_eq!(r.status, 200, "{}", r.body);
    let json: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(json["statuses"][0]["limitRemaining"], 4, "the refused posts took nothing");
}
