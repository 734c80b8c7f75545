//! RLQS in a region for rules marked `global: true`: an Envoy's stream to a region replica is
//! assigned parts of a lease of the global tier's bucket, which the stream holds at the global
//! tier itself (a leaseholder beneath the region, beside the regions' shares), living a minute
//! there and so outliving every assignment made from it. The lease is read back from the global
//! tier's Redis; the global tier's own RLS requests and the region's RLS requests spend only what
//! the leases leave (one bucket, whatever the protocol and the region). Cut off from the global
//! tier, the Envoy keeps its assignment rather than getting the failure mode's answer, and is
//! assigned again once the region reaches the global tier. A lease that a global tier older than
//! the region gives less life than asked is not assigned from.

mod common;

use std::time::Duration;

use common::proxy::Fault;
use common::regions::{global_tier, region};
use common::rlqs::*;
use common::*;
use tollgate::bucket::{BucketSpec, LeaseOp};
use tollgate::edge::client_tls::ClientTlsFiles;
use tollgate::edge::region::client::{endpoint, GlobalLeaseError, GlobalLeases, GlobalName};
use tollgate::edge::region::proto::region_leases_server::{RegionLeases, RegionLeasesServer};
use tollgate::edge::region::proto::{
    BucketLease, BudgetRenewRequest, BudgetRenewResponse, RenewRequest, RenewResponse,
};
use tonic::{Request, Response, Status};

const CONFIG: &str = r#"
domain: api
tenant_key: tenant
descriptors:
  - key: tenant
    token_bucket: {capacity: 20, refill_per_second: 2}
    global: true
"#;

const BUCKET: &str = "rl:{acme}:api:tenant=acme";

#[tokio::test(flavor = "multi_thread")]
async fn an_envoy_in_a_region_is_assigned_a_lease_of_the_global_bucket() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let global = global_tier(&config, &Backend::Redis(redis.url()));
    let delay = Fault::DelayReplies(Duration::from_millis(50));
    let (eu, proxy) = region(&config, &Backend::Memory, &global, ("eu", Duration::from_millis(50)), &[]);

    // An Envoy asks for the tenant's bucket: young first (one request), then, alone, all of it
    // (what the young lease's request left: 19 tokens, or 20 once a token refilled meanwhile).
    let mut stream = Stream::open(&eu.addr()).await;
    let acme = bucket(&[("tenant", "acme")]);
    stream.send("api", vec![report(&acme, 0, 1, 0)]).await;
    let mut seen = Vec::new();
    while !matches!(seen.last(), Some(Said::Tokens(19..))) {
        let said = grant_for(&mut stream, &acme).await;
        assert!(seen.len() < 10, "no whole-bucket assignment after {seen:?}");
        seen.push(said);
    }
    println!("assignments: {seen:?}");
    assert_eq!(seen[0], Said::Tokens(1), "a young lease first");

    // The stream's lease is the global tier's: held beneath the region, living a minute.
    let mut con = redis.connection();
    let field: String = redis::cmd("HGET").arg(BUCKET).arg("h").query(&mut con).unwrap();
    let leases = tollgate::store::parse_leases(&field).unwrap();
    let now_ms = redis_ms(&mut con);
    let stream_lease = leases.iter().find(|l| l.replica.starts_with("region:eu/") && l.replica.contains('#'));
    let stream_lease = stream_lease.unwrap_or_else(|| panic!("no stream's lease: {leases:?}"));
    assert!(stream_lease.capacity >= 19.0 && stream_lease.refill_per_second == 2.0, "{leases:?}");
    assert!(stream_lease.expires_at_ms > now_ms + 50_000, "a minute's life: {leases:?}");

    // Everything is leased to the Envoy: RLS at the global tier and in the region gets nothing.
    let tier = ask(&global.addr(), req("api", &["tenant=acme"], 1)).await.unwrap();
    assert_eq!(tier.overall_code, OVER_LIMIT, "the global tier's RLS: {tier:?}");
    let regional = ask(&eu.addr(), req("api", &["tenant=acme"], 1)).await.unwrap();
    assert_eq!(regional.overall_code, OVER_LIMIT, "the region's RLS: {regional:?}");

    // Cut off: the hot lease (a busy Envoy) is set again within seconds and fails; the Envoy
    // keeps its assignment: no blanket answer comes.
    proxy.set(Fault::Blackhole);
    stream.send("api", vec![report(&acme, 20, 200, 1_000)]).await;
    let failed = || sample(&eu.metrics(), "tollgate_rlqs_leases_total", &[("outcome", "failed")]);
    wait_until("a lease op to fail at the cut-off global tier", 100, Duration::from_millis(100), || {
        failed() >= 1.0
    });
    while let Ok(answer) = tokio::time::timeout(Duration::from_millis(300), stream.answers.message()).await {
        let answer = answer.expect("the stream stands").expect("a message");
        let last = said(&answer).into_iter().rfind(|(b, _)| *b == key(&acme));
        assert!(
            matches!(last, None | Some((_, Said::Tokens(_)))),
            "a blanket answer while cut off: {last:?}"
        );
    }

    // Healed: assigned again.
    proxy.set(delay);
    stream.send("api", vec![report(&acme, 20, 200, 1_000)]).await;
    assert!(matches!(grant_for(&mut stream, &acme).await, Said::Tokens(_)));
}

// A global tier from before leases asked their own life: every lease it sets lives its 10 s.
struct OlderGlobalTier;

#[tonic::async_trait]
impl RegionLeases for OlderGlobalTier {
    async fn renew(&self, request: Request<RenewRequest>) -> Result<Response<RenewResponse>, Status> {
        let leases = (request.into_inner().buckets.iter())
            .map(|b| BucketLease {
                known: true,
                bucket_capacity: 20.0,
                bucket_refill_per_second: 2.0,
                cost: 1,
                capacity: b.capacity,
                refill_per_second: b.refill_per_second,
                ..BucketLease::default()
            })
            .collect();
        Ok(Response::new(RenewResponse { leases, ttl_ms: 10_000 }))
    }

    async fn renew_budgets(
        &self,
        _: Request<BudgetRenewRequest>,
    ) -> Result<Response<BudgetRenewResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lease_given_less_life_than_asked_is_not_assigned_from() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegionLeasesServer::new(OlderGlobalTier))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let global = endpoint(&format!("http://{addr}"), &ClientTlsFiles::default()).unwrap();
    let leases = GlobalLeases::new("eu".into(), vec![global]);
    let name = GlobalName { domain: "api".into(), entries: vec![("tenant".into(), "acme".into())].into() };
    let stream_lease = LeaseOp {
        key: BUCKET.into(),
        spec: BucketSpec::new(20.0, 2.0).unwrap(),
        replica: "r#0".into(),
        capacity: 5.0,
        unit: 1.0,
        refill_per_second: 1.0,
        of_unleased: 1.0,
        ttl_ms: 60_000,
        demand: 1.0,
        fresh: true,
    };
    let refused = leases.lease(&[(stream_lease.clone(), &name)]).await;
    assert!(matches!(refused[0], Err(GlobalLeaseError::ShortLife(10_000, 60_000))), "{refused:?}");
    // Asking no more than it gives, the same lease is used.
    let used = leases.lease(&[(LeaseOp { ttl_ms: 10_000, ..stream_lease }, &name)]).await;
    assert!(used[0].as_ref().is_ok_and(|l| l.capacity == 5.0), "{used:?}");
    server.abort();
}
