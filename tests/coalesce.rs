//! Hot-tenant coalescing (`src/store/redis/coalesce.rs`): concurrent requests for one slot share one
//! script call and stay exact. A burst of concurrent requests for one bucket admits exactly its
//! capacity, with coalescing on and off, against a real Redis and a real Redis Cluster, and with
//! coalescing on it takes far fewer script calls than requests.

mod common;

use std::collections::HashMap;

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use futures::future::join_all;

const CONFIG: &str = r#"
domain: hot
descriptors:
  - key: tenant
    token_bucket: { capacity: 30, refill_per_second: 0.001 }
"#;

// Fires `per_tenant` concurrent requests for each tenant over 4 connections; returns the admitted
// count per tenant.
async fn burst(server: &Tollgate, tenants: &[&str], per_tenant: usize) -> HashMap<String, usize> {
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(RateLimitServiceClient::connect(format!("http://{}", server.addr())).await.unwrap());
    }
    let calls = (0..per_tenant).flat_map(|i| tenants.iter().map(move |t| (i, *t))).map(|(i, tenant)| {
        let mut client = clients[i % clients.len()].clone();
        async move {
            let answer = client.should_rate_limit(req("hot", &[&format!("tenant={tenant}")], 1)).await;
            (tenant.to_owned(), answer.expect("an answer").into_inner().overall_code == OK)
        }
    });
    let mut admitted: HashMap<String, usize> = tenants.iter().map(|t| (t.to_string(), 0)).collect();
    for (tenant, ok) in join_all(calls).await {
        *admitted.get_mut(&tenant).unwrap() += usize::from(ok);
    }
    admitted
}

fn calls_and_groups(server: &Tollgate) -> (f64, f64) {
    let scrape = server.metrics();
    (
        sample(&scrape, "tollgate_store_calls_total", &[]),
        sample(&scrape, "tollgate_store_call_groups_total", &[]),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hot_tenant_burst_admits_exactly_its_capacity_in_few_calls() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    for (tenant, delay) in [("hot-on", "500us"), ("hot-off", "0")] {
        let server = Tollgate::start(
            &config,
            &Backend::Redis(redis.url()),
            &["--no-precheck", "--coalesce-delay", delay],
        );
        let admitted = burst(&server, &[tenant], 400).await;
        let (calls, groups) = calls_and_groups(&server);
        println!("coalesce-delay {delay}: 400 requests, {calls} script calls, {groups} groups, admitted {admitted:?}");
        assert_eq!(admitted[tenant], 30, "exactly the capacity is admitted");
        assert_eq!(groups, 400.0);
        if delay == "0" {
            assert_eq!(calls, 400.0, "without coalescing, one call per request");
        } else {
            assert!(calls <= 200.0, "coalescing made {calls} calls for 400 concurrent requests");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn coalescing_stays_exact_per_slot_on_a_cluster() {
    let cluster = RedisCluster::start();
    let (_dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Cluster(cluster.seeds()), &["--no-precheck"]);
    let tenants = ["ann", "bob", "cy", "dee", "eve", "fay"];
    let slots: Vec<u16> = tenants.iter().map(|t| tenant_slot(t)).collect();
    let admitted = burst(&server, &tenants, 100).await;
    let (calls, groups) = calls_and_groups(&server);
    println!("600 requests over slots {slots:?}: {calls} script calls, admitted {admitted:?}");
    for tenant in tenants {
        assert_eq!(admitted[tenant], 30, "{tenant}: exactly the capacity");
    }
    assert_eq!(groups, 600.0);
    assert!(calls < 600.0, "some calls were coalesced: {calls}");
}
