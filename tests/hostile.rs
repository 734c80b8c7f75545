//! Hostile and malformed requests: each gets a defined answer, the server stays up, and no
//! other tenant's bucket changes.

mod common;

use common::*;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use tonic::Code;

const CONFIG: &str = r#"
domain: h
default_tier: t
tiers:
  t:
    default: {capacity: 10, refill_per_second: 0.001}
    export: {capacity: 100, refill_per_second: 0.001}
descriptors:
  - key: tenant
    quota: tenant
    descriptors:
      - key: class
        value: export
        class: export
        cost: 25
        quota: tenant
"#;

/// What a case must produce.
#[derive(Debug)]
enum Expect {
    Invalid,
    Code(i32),
    /// OVER_LIMIT that retrying cannot fix: no Retry-After.
    NeverAdmitted,
}

fn tenant_request(tenant: &str) -> RateLimitRequest {
    let mut r = req("h", &["tenant=placeholder"], 1);
    r.descriptors[0].entries[0].value = tenant.to_owned();
    r
}

#[tokio::test(flavor = "multi_thread")]
async fn every_bad_request_gets_a_defined_answer_and_harms_no_one() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    let addr = server.addr();
    // A bystander with a known balance.
    ask(&addr, req("h", &["tenant=bystander"], 3)).await.unwrap();
    let mut con = redis.connection();
    let bystander = |con: &mut redis::Connection| -> Vec<String> {
        redis::cmd("HGETALL").arg("rl:{bystander}:h:tenant=bystander").query(con).unwrap()
    };
    let before = bystander(&mut con);

    let mut cases: Vec<(&str, RateLimitRequest, Expect)> = vec![
        ("empty domain", req("", &["tenant=a"], 1), Expect::Invalid),
        ("no descriptors", req("h", &[], 1), Expect::Invalid),
        ("10,000 descriptors", req("h", &vec!["tenant=many"; 10_000], 1), Expect::Invalid),
        ("1 MB value", tenant_request(&"v".repeat(1 << 20)), Expect::Invalid),
        ("1025-byte key", req("h", &[&format!("{}=v", "k".repeat(1025))], 1), Expect::Invalid),
        ("NUL and control characters", tenant_request("a\0b\u{1}\u{7f}"), Expect::Code(OK)),
        ("unicode look-alikes and RTL marks", tenant_request("bystаnder\u{202e}\u{feff}"), Expect::Code(OK)),
        ("hash tag and separators", tenant_request("{bystander}:default%"), Expect::Code(OK)),
        ("glob and newline", tenant_request("*\nbystander"), Expect::Code(OK)),
        ("closing brace first", tenant_request("}{"), Expect::Code(OK)),
        ("empty tenant", tenant_request(""), Expect::Code(OK)),
        ("hits_addend u32::MAX", req("h", &["tenant=huge"], u32::MAX), Expect::NeverAdmitted),
        ("cost overflow", req("h", &["tenant=overflow,class=export"], 1), Expect::NeverAdmitted),
        ("unit UNKNOWN override", req("h", &["tenant=o"], 1), Expect::Invalid),
        ("zero requests_per_unit override", req("h", &["tenant=zero"], 1), Expect::NeverAdmitted),
        ("unknown unit number", req("h", &["tenant=o"], 1), Expect::Invalid),
    ];
    let mut empty_key = req("h", &["tenant=a"], 1);
    empty_key.descriptors[0].entries.push(Entry { key: String::new(), value: "v".into() });
    cases.push(("empty key", empty_key, Expect::Invalid));
    for (name, request, _) in cases.iter_mut() {
        match *name {
            "cost overflow" => request.descriptors[0].hits_addend = Some(UInt64Value { value: u64::MAX }),
            "unit UNKNOWN override" => {
                request.descriptors[0].limit = Some(RateLimitOverride { requests_per_unit: 5, unit: 0 })
            }
            "zero requests_per_unit override" => {
                request.descriptors[0].limit = Some(RateLimitOverride { requests_per_unit: 0, unit: 1 })
            }
            "unknown unit number" => {
                request.descriptors[0].limit = Some(RateLimitOverride { requests_per_unit: 5, unit: 99 })
            }
            _ => {}
        }
    }

    for (name, request, expect) in cases {
        let answer = ask(&addr, request).await;
        match (&expect, &answer) {
            (Expect::Invalid, Err(status)) => {
                assert_eq!(status.code(), Code::InvalidArgument, "{name}: {status:?}");
                assert!(!status.message().is_empty(), "{name}");
            }
            (Expect::Code(code), Ok(r)) => assert_eq!(r.overall_code, *code, "{name}"),
            (Expect::NeverAdmitted, Ok(r)) => {
                assert_eq!(r.overall_code, OVER_LIMIT, "{name}");
                assert_eq!(header(r, "Retry-After"), None, "{name}: retrying cannot help");
            }
            _ => panic!("{name}: expected {expect:?}, got {answer:?}"),
        }
        // Still up, and nobody else was touched.
        let health = http_get(server.http, "/healthz").expect("still serving");
        assert_eq!(health.0, 200, "{name}");
        assert_eq!(bystander(&mut con), before, "{name} changed another tenant's bucket");
    }
    // Hostile tenant ids each got their own bucket, each in one slot, none escaped its tag.
    let keys: Vec<String> = redis::cmd("KEYS").arg("rl:*").query(&mut con).unwrap();
    for key in &keys {
        assert!(
            key.starts_with("rl:{") && key.matches('{').count() == 1 && key.matches('}').count() == 1,
            "{key:?}"
        );
    }
    assert!(
        keys.contains(&"rl:{%7Bbystander%7D%3Adefault%25}:h:tenant=%7Bbystander%7D%3Adefault%25".to_string()),
        "{keys:?}"
    );
}

/// A descriptor value that is not UTF-8 does not decode as a `RateLimitRequest` (protobuf strings
/// are UTF-8): the call is the client's fault, INVALID_ARGUMENT, not INTERNAL.
#[tokio::test(flavor = "multi_thread")]
async fn a_string_that_is_not_utf8_is_an_invalid_argument() {
    // RateLimitRequest's wire shape, with bytes where the .proto has strings.
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawEntry {
        #[prost(bytes = "vec", tag = "1")]
        key: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawDescriptor {
        #[prost(message, repeated, tag = "1")]
        entries: Vec<RawEntry>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawRequest {
        #[prost(string, tag = "1")]
        domain: String,
        #[prost(message, repeated, tag = "2")]
        descriptors: Vec<RawDescriptor>,
    }
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Memory, &[]);
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let request = RawRequest {
        domain: "h".into(),
        descriptors: vec![RawDescriptor {
            entries: vec![RawEntry { key: b"tenant".to_vec(), value: vec![b'a', 0xFF, 0xFE] }],
        }],
    };
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    );
    let codec = tonic_prost::ProstCodec::<RawRequest, RateLimitResponse>::default();
    let status =
        grpc.unary(tonic::Request::new(request), path, codec).await.expect_err("not a valid request");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // The server answers the next one as usual.
    let r = ask(&server.addr(), tenant_request("ok")).await.unwrap();
    assert_eq!(r.overall_code, OK);
}
