//! The service in-process: `App` wired from `Settings` as `serve` wires it, on listeners the test
//! bound, with every store and the quota database real; and when it stops, nothing it started is
//! left running.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tollgate::app::{App, QuotaSettings, RedisSettings, Settings};
use tollgate::server::{self, Shutdown};
use tollgate::store::{RedisTarget, RedisTls};

const CONFIG: &str = r#"
domain: app
default_tier: free
tiers:
  free:
    default: {capacity: 3, refill_per_second: 0.001}
descriptors:
  - key: tenant
    quota: tenant
"#;

fn alive() -> usize {
    tokio::runtime::Handle::current().metrics().num_alive_tasks()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_app_leaves_no_task_running() {
    let redis = Redis::start();
    let pg = Postgres::start();
    let migrated = std::process::Command::new(tollgate_bin())
        .args(["quota", "migrate", "--quota-store", &pg.url()])
        .output()
        .unwrap();
    assert!(migrated.status.success(), "{}", String::from_utf8_lossy(&migrated.stderr));
    let (_dir, config) = config_file(CONFIG);
    let before = alive();

    let mut settings = Settings::new(&config);
    settings.watch = true;
    settings.redis = Some(RedisSettings {
        target: RedisTarget::Standalone(redis.url()),
        tls: RedisTls::default(),
        timeout: Duration::from_millis(500),
        coalesce_delay: Duration::from_micros(500),
        precheck_buckets: Some(1000),
    });
    settings.quotas =
        Some(QuotaSettings { url: pg.url(), ca: None, cache_ttl: Duration::from_secs(60), cache_size: 100 });
    let app = App::start(&settings).expect("starts");
    let grpc = server::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let http = server::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = grpc.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(app.serve(grpc, http, None, async move {
        let _ = stopped.await;
        Shutdown::Immediate
    }));

    // Decisions through every part: the quota database, the pre-check, coalescing, Redis.
    let mut codes = Vec::new();
    for _ in 0..5 {
        codes.push(ask(&addr, req("app", &["tenant=t1"], 1)).await.unwrap().overall_code);
    }
    assert_eq!(codes, [OK, OK, OK, OVER_LIMIT, OVER_LIMIT]);
    // One bucket in Redis, emptied by the three admitted (it refills 0.001 a second).
    let mut conn = redis.connection();
    let keys: Vec<String> = redis::cmd("KEYS").arg("rl:{t1}:*").query(&mut conn).unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let tokens = stored_tokens(&mut conn, &keys[0]);
    assert!(tokens < 0.1, "{tokens}");
    assert!(alive() > before, "the app runs tasks while serving");

    stop.send(()).unwrap();
    serving.await.unwrap().expect("served and stopped cleanly");
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive() > before {
        assert!(Instant::now() < deadline, "{} tasks still alive after the app stopped", alive() - before);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
