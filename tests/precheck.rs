//! The exact local pre-check (`src/store/precheck.rs`) must answer exactly what the store would:
//! replayed operation sequences give identical decisions with it and without it, while a good
//! share of denials never reach the store; through a real Redis, an abusive tenant costs a few
//! script calls instead of one per request.

mod common;

use std::sync::Arc;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::Commands as _;
use tollgate::bucket::{BucketOp, BucketSpec, Charge, Group, Role, RATE_RAISE_DELAY_MS};
use tollgate::clock::ManualClock;
use tollgate::store::{LateReply, MemoryStore, Precheck, Store, MAX_AGE_MS};

const GIVE_BACK: LateReply = LateReply::GiveBack;

fn op(key: &str, capacity: f64, refill_per_second: f64, need: f64) -> BucketOp {
    BucketOp {
        key: key.into(),
        spec: BucketSpec::new(capacity, refill_per_second).unwrap(),
        need,
        unseen: 0.0,
        role: Role::Enforced,
        charge: Charge::Admitted,
    }
}

// Small, slowly refilling buckets hammered often, so that most requests find them short. With
// `debt`, a sixth bucket is charged always (it goes into debt): the pre-check must leave its
// debits to the store, and may use its debt to deny checks early.
fn random_group(rng: &mut StdRng, debt: bool) -> Group {
    let specs = [(1.0, 0.5), (3.0, 2.0), (10.0, 1.0 / 3.0), (5.0, 40.0), (0.0, 0.0)];
    let needs = [1.0, 1.0, 1.0, 2.0, 4.0, 0.0, -1.0, 11.0];
    (0..rng.random_range(1..=3))
        .map(|_| {
            let b = rng.random_range(0..specs.len() + usize::from(debt));
            if b == specs.len() {
                let mut o = op("rl:{t}:metered", 10.0, 1.0 / 3.0, [0.0, 0.0, 6.0][rng.random_range(0..3)]);
                o.charge = Charge::Always { max_debt: 10.0 };
                return o;
            }
            // One bucket changes its capacity now and then, as after a quota change.
            let (capacity, rate) = if b == 1 && rng.random_bool(0.05) { (6.0, 2.0) } else { specs[b] };
            let mut o =
                op(&format!("rl:{{t}}:b{b}"), capacity, rate, needs[rng.random_range(0..needs.len())]);
            o.role = match rng.random_range(0..10) {
                0 => Role::Shadow,
                1 => Role::QuotaMode,
                _ => Role::Enforced,
            };
            o
        })
        .collect()
}

// Replays `seeds` with and without the pre-check; returns the groups it answered locally.
async fn replay(seeds: std::ops::Range<u64>, debt: bool) -> u64 {
    let mut local_answers = 0;
    for seed in seeds {
        let clock = ManualClock::new(1_700_000_000_000);
        let plain = MemoryStore::with_clock(Arc::new(clock.clone()));
        let inner: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
        let checked = Precheck::new(inner, Arc::new(clock.clone()), 1000);
        let mut rng = StdRng::seed_from_u64(seed);
        for step in 0..2000 {
            let batch: Vec<Group> =
                (0..rng.random_range(1..=2)).map(|_| random_group(&mut rng, debt)).collect();
            let expected = plain.evaluate(&batch, GIVE_BACK).await;
            let got = checked.evaluate(&batch, GIVE_BACK).await;
            for (g, (e, o)) in expected.iter().zip(&got).enumerate() {
                let (e, o) = (e.as_ref().unwrap(), o.as_ref().unwrap());
                let what = format!("seed {seed} step {step} group {g}: {:?}", batch[g]);
                assert_eq!(e.admitted, o.admitted, "{what}");
                for (ev, ov) in e.verdicts.iter().zip(&o.verdicts) {
                    assert_eq!(ev.allowed, ov.allowed, "{what}");
                    // A local answer estimates the balance; it never overstates the wait (beyond
                    // a millisecond of rounding: the refill is summed in a different order).
                    assert!(ov.tokens >= ev.tokens - 1e-9, "{what}: {ov:?} vs {ev:?}");
                    if let (Some(e_ms), Some(o_ms)) = (ev.retry_after_ms, ov.retry_after_ms) {
                        assert!(o_ms <= e_ms + 1, "{what}: retry {o_ms} > {e_ms}");
                    }
                }
            }
            clock.advance(rng.random_range(0..400));
        }
        local_answers += checked.answered_locally();
    }
    local_answers
}

#[tokio::test]
async fn decisions_are_identical_with_and_without_the_precheck() {
    let local_answers = replay(0..20, false).await;
    println!("pre-check answered {local_answers} of the groups locally");
    // Only buckets the observing call wrote are remembered (a bucket read but not written may
    // expire and come back full at a larger capacity), which leaves some 3,300 of these 40,000
    // groups to answer locally.
    assert!(local_answers > 3_000, "the pre-check answered only {local_answers} groups");
}

#[tokio::test]
async fn debt_keeps_decisions_identical_and_denies_checks_early() {
    let local_answers = replay(100..110, true).await;
    println!("with a bucket in debt, the pre-check answered {local_answers} of the groups locally");
    assert!(local_answers > 1_000, "the pre-check answered only {local_answers} groups");
}

#[tokio::test]
async fn a_check_on_a_bucket_in_debt_is_denied_locally() {
    let clock = ManualClock::new(1_700_000_000_000);
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let checked = Precheck::new(inner, Arc::new(clock.clone()), 1000);
    let metered = |need| {
        let mut o = op("rl:{t}:tokens", 1_000.0, 10.0, need);
        o.charge = Charge::Always { max_debt: 1_000.0 };
        vec![vec![o]]
    };
    for _ in 0..2 {
        let charged = checked.evaluate(&metered(600.0), GIVE_BACK).await;
        assert!(charged[0].is_ok());
    }
    assert_eq!(checked.answered_locally(), 0, "charges always reach the store");
    let check = checked.evaluate(&metered(0.0), GIVE_BACK).await;
    let v = check[0].as_ref().unwrap().verdicts[0];
    assert!(!v.allowed && v.tokens < 0.0, "{v:?}");
    assert_eq!(checked.answered_locally(), 1, "the check was denied without the store");
    assert_eq!(v.retry_after_ms, Some(20_000), "back to zero after 200 tokens at 10/s");
}

#[tokio::test]
async fn a_changed_quota_is_never_held_to_the_old_observation() {
    let clock = ManualClock::new(1_700_000_000_000);
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let checked = Precheck::new(inner, Arc::new(clock.clone()), 1000);
    let spend = |rate| vec![vec![op("rl:{t}:default", 1.0, rate, 1.0)]];
    assert!(checked.evaluate(&spend(0.001), GIVE_BACK).await[0].as_ref().unwrap().admitted);
    assert!(!checked.evaluate(&spend(0.001), GIVE_BACK).await[0].as_ref().unwrap().admitted);
    assert!(!checked.evaluate(&spend(0.001), GIVE_BACK).await[0].as_ref().unwrap().admitted);
    assert_eq!(checked.answered_locally(), 2, "the empty bucket is denied locally");
    // The quota's rate grows. The store applies a faster rate only RATE_RAISE_DELAY_MS after
    // it is first asked for, so the old observation stays an upper bound meanwhile; once the new
    // rate is in force the store admits, and the pre-check must not have answered for it.
    clock.advance(500);
    assert!(!checked.evaluate(&spend(10.0), GIVE_BACK).await[0].as_ref().unwrap().admitted);
    clock.advance(RATE_RAISE_DELAY_MS + 100);
    assert!(checked.evaluate(&spend(10.0), GIVE_BACK).await[0].as_ref().unwrap().admitted);
    assert_eq!(checked.answered_locally(), 2);
}

#[tokio::test]
async fn a_denial_from_the_store_renews_the_observation() {
    let clock = ManualClock::new(1_700_000_000_000);
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let checked = Precheck::new(inner, Arc::new(clock.clone()), 1000);
    let spend = || vec![vec![op("rl:{t}:default", 1.0, 0.01, 1.0)]];
    assert!(checked.evaluate(&spend(), GIVE_BACK).await[0].as_ref().unwrap().admitted);
    // An abusive tenant for 30 s: past MAX_AGE_MS one request reaches the store, is denied
    // there, and its answer serves the next MAX_AGE_MS locally.
    let mut to_store = 0;
    for _ in 0..300 {
        clock.advance(100);
        let before = checked.answered_locally();
        assert!(!checked.evaluate(&spend(), GIVE_BACK).await[0].as_ref().unwrap().admitted);
        to_store += usize::from(checked.answered_locally() == before);
    }
    let most = 30_000 / MAX_AGE_MS as usize + 1;
    println!("abusive tenant, 300 requests over 30 s: {to_store} reached the store");
    assert!((1..=most).contains(&to_store), "{to_store} of 300 reached the store; at most {most}");
}

#[tokio::test]
async fn a_bucket_the_store_drops_is_not_held_to_an_observation() {
    let clock = ManualClock::new(1_700_000_000_000);
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let checked = Precheck::new(inner.clone(), Arc::new(clock.clone()), 1000);
    let key = "rl:{t}:default";
    // Written empty by a small spec through another replica: kept for its time to full (1 s)
    // plus 1 s.
    assert!(inner.evaluate(&[vec![op(key, 1.0, 1.0, 1.0)]], GIVE_BACK).await[0].as_ref().unwrap().admitted);
    // A larger spec of the same bucket (a quota raised here) is denied 5 tokens by the store,
    // and that denial is remembered.
    assert!(
        !checked.evaluate(&[vec![op(key, 10.0, 1.0, 5.0)]], GIVE_BACK).await[0].as_ref().unwrap().admitted
    );
    clock.advance(1_000);
    assert!(
        !checked.evaluate(&[vec![op(key, 10.0, 1.0, 5.0)]], GIVE_BACK).await[0].as_ref().unwrap().admitted
    );
    assert_eq!(checked.answered_locally(), 1, "answered from the observation");
    // Past the stored bucket's expiry it is missing, so full at the larger capacity: the store
    // admits, though the observation's bound (about 2 tokens) would not.
    clock.advance(1_100);
    assert!(
        checked.evaluate(&[vec![op(key, 10.0, 1.0, 5.0)]], GIVE_BACK).await[0].as_ref().unwrap().admitted
    );
    assert_eq!(checked.answered_locally(), 1);
}

#[tokio::test]
async fn memory_stays_bounded_under_many_empty_buckets() {
    let clock = ManualClock::new(1_700_000_000_000);
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let checked = Precheck::new(inner, Arc::new(clock.clone()), 160);
    // 10,000 empty buckets; only 160 can be remembered, the rest still get correct answers.
    for t in 0..10_000 {
        let key = format!("rl:{{t{t}}}:default");
        assert!(
            !checked.evaluate(&[vec![op(&key, 0.0, 0.0, 1.0)]], GIVE_BACK).await[0]
                .as_ref()
                .unwrap()
                .admitted
        );
    }
    for t in 0..10_000 {
        let key = format!("rl:{{t{t}}}:default");
        assert!(
            !checked.evaluate(&[vec![op(&key, 0.0, 0.0, 1.0)]], GIVE_BACK).await[0]
                .as_ref()
                .unwrap()
                .admitted
        );
    }
    let answered = checked.answered_locally();
    println!("answered locally: {answered} of 10000 repeats");
    assert!((100..=160).contains(&answered), "{answered} observations used; 160 fit");
}

const CONFIG: &str = r#"
domain: abuse
descriptors:
  - key: tenant
    token_bucket: { capacity: 5, refill_per_second: 0.01 }
"#;

// Sends `n` requests for one tenant in order; returns the overall codes and Retry-After values.
async fn hammer(server: &Tollgate, n: usize) -> Vec<(i32, Option<String>)> {
    let mut answers = Vec::new();
    for _ in 0..n {
        let r = ask(&server.addr(), req("abuse", &["tenant=mallory"], 1)).await.expect("answer");
        answers.push((r.overall_code, header(&r, "retry-after").map(str::to_owned)));
    }
    answers
}

#[tokio::test(flavor = "multi_thread")]
async fn an_abusive_tenant_is_denied_locally_with_the_same_answers() {
    let redis = Redis::start();
    let (_dir, config) = config_file(CONFIG);
    let mut runs = Vec::new();
    for flags in [&["--no-precheck"][..], &[]] {
        redis.connection().del::<_, ()>("rl:{mallory}:abuse:tenant=mallory").unwrap();
        let server = Tollgate::start(&config, &Backend::Redis(redis.url()), flags);
        let answers = hammer(&server, 200).await;
        let scrape = server.metrics();
        let calls = sample(&scrape, "tollgate_store_calls_total", &[]);
        let local = sample(&scrape, "tollgate_precheck_answers_total", &[]);
        println!("{flags:?}: {calls} script calls, {local} local answers for 200 requests");
        runs.push((answers, calls, local));
    }
    let (without, with) = (&runs[0], &runs[1]);
    let codes = |run: &Vec<(i32, Option<String>)>| run.iter().map(|a| a.0).collect::<Vec<_>>();
    assert_eq!(codes(&without.0), codes(&with.0), "same decisions with and without the pre-check");
    assert_eq!(codes(&with.0).iter().filter(|c| **c == OK).count(), 5);
    assert_eq!(without.1, 200.0, "without the pre-check every request is a script call");
    assert!(with.1 <= 10.0, "with it, {} script calls", with.1);
    assert!(with.2 >= 190.0);
    // A local denial still says when to come back: one token refills in 100 s.
    for (code, retry) in &with.0[5..] {
        assert_eq!(*code, OVER_LIMIT);
        let secs: u64 = retry.as_deref().expect("retry-after").parse().unwrap();
        assert!((1..=100).contains(&secs), "retry-after {secs}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reloaded_faster_rate_is_never_held_to_an_old_observation() {
    let redis = Redis::start();
    let (dir, config) = config_file(CONFIG);
    let server = Tollgate::start(&config, &Backend::Redis(redis.url()), &[]);
    // Empty mallory's bucket; the next requests are denied locally.
    let answers = hammer(&server, 8).await;
    assert_eq!(answers.iter().filter(|a| a.0 == OK).count(), 5);
    assert!(sample(&server.metrics(), "tollgate_precheck_answers_total", &[]) >= 2.0);

    // Raise the refill rate: a millisecond refills the bucket at the new rate once it is in
    // force, which the observation made under the old rate would rule out.
    std::fs::write(&config, CONFIG.replace("refill_per_second: 0.01", "refill_per_second: 100000")).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while sample(&server.metrics(), "tollgate_config_reloads_total", &[("result", "success")]) < 1.0 {
        assert!(std::time::Instant::now() < deadline, "the config was never reloaded");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The store puts a faster rate in force RATE_RAISE_DELAY_MS after it is first asked for;
    // until then and after, every request reaches it.
    let local = sample(&server.metrics(), "tollgate_precheck_answers_total", &[]);
    let asked = std::time::Instant::now();
    let mut code = OVER_LIMIT;
    while code != OK && asked.elapsed() < std::time::Duration::from_millis(RATE_RAISE_DELAY_MS + 3_000) {
        code = ask(&server.addr(), req("abuse", &["tenant=mallory"], 1)).await.unwrap().overall_code;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    println!("a reloaded faster rate: admitted {:?} after the first request under it", asked.elapsed());
    assert_eq!(code, OK, "the new rate applies");
    assert!(asked.elapsed() >= std::time::Duration::from_millis(RATE_RAISE_DELAY_MS - 500));
    assert_eq!(
        sample(&server.metrics(), "tollgate_precheck_answers_total", &[]),
        local,
        "none answered locally"
    );
    drop(dir);
}

// A memory store whose next answer can be held back after it has been computed, like a Redis
// reply still on the wire, to order a slow call around a credit.
struct HeldStore {
    inner: MemoryStore,
    hold: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
}

impl Store for HeldStore {
    fn evaluate<'a>(
        &'a self,
        batch: &'a tollgate::bucket::Batch,
        _late: LateReply,
    ) -> futures::future::BoxFuture<
        'a,
        Vec<Result<tollgate::bucket::GroupOutcome, tollgate::store::StoreError>>,
    > {
        Box::pin(async move {
            let answer = self.inner.evaluate_now(batch);
            let hold = self.hold.lock().unwrap().take();
            if let Some(released) = hold {
                let _ = released.await;
            }
            answer.into_iter().map(Ok).collect()
        })
    }

    fn lease<'a>(
        &'a self,
        ops: &'a [tollgate::bucket::LeaseOp],
    ) -> futures::future::BoxFuture<
        'a,
        Vec<Result<tollgate::bucket::LeaseOutcome, tollgate::store::StoreError>>,
    > {
        self.inner.lease(ops)
    }

    fn budget<'a>(
        &'a self,
        op: &'a tollgate::budget::BudgetOp,
    ) -> futures::future::BoxFuture<'a, Result<tollgate::budget::BudgetOutcome, tollgate::store::StoreError>>
    {
        self.inner.budget(op)
    }

    fn slots<'a>(
        &'a self,
        op: &'a tollgate::slot::SlotOp,
    ) -> futures::future::BoxFuture<'a, Result<tollgate::slot::SlotOutcome, tollgate::store::StoreError>>
    {
        self.inner.slots(op)
    }

    fn ping(&self) -> futures::future::BoxFuture<'_, Result<(), tollgate::store::StoreError>> {
        Box::pin(async { Ok(()) })
    }

    fn describe(&self) -> String {
        "held memory store".into()
    }
}

#[tokio::test]
async fn a_reply_from_before_a_credit_is_not_remembered() {
    let clock = ManualClock::new(1_700_000_000_000);
    let held = Arc::new(HeldStore {
        inner: MemoryStore::with_clock(Arc::new(clock.clone())),
        hold: std::sync::Mutex::new(None),
    });
    let checked = Arc::new(Precheck::new(held.clone(), Arc::new(clock.clone()), 1000));
    let take = |need| vec![vec![op("rl:{t}:default", 2.0, 0.001, need)]];
    // Emptied by another replica: this one has observed nothing.
    assert!(held.inner.evaluate_now(&take(2.0))[0].admitted);

    // A request finds the bucket empty, but its reply is slow to arrive...
    let (release, released) = tokio::sync::oneshot::channel();
    *held.hold.lock().unwrap() = Some(released);
    let slow = tokio::spawn({
        let checked = checked.clone();
        async move { checked.evaluate(&take(1.0), GIVE_BACK).await[0].as_ref().unwrap().admitted }
    });
    for _ in 0..10_000 {
        if held.hold.lock().unwrap().is_none() {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(held.hold.lock().unwrap().is_none(), "the slow request reached the store");
    // ...and meanwhile a credit gives the bucket its two tokens back.
    assert!(checked.evaluate(&take(-2.0), GIVE_BACK).await[0].as_ref().unwrap().admitted);
    release.send(()).unwrap();
    assert!(!slow.await.unwrap(), "the slow request was denied before the credit");

    // Its stale reply must not turn into a local denial: the bucket has tokens.
    assert!(checked.evaluate(&take(1.0), GIVE_BACK).await[0].as_ref().unwrap().admitted);
    assert_eq!(checked.answered_locally(), 0);
}

/// RLQS holds are sized beside what RLS clients ask of a bucket, and a starved RLS client's
/// requests are mostly answered by the pre-check: what it denies counts too, carried to the store
/// by the next operation on the bucket that reaches it.
#[tokio::test]
async fn denials_answered_locally_count_as_demand_of_a_held_bucket() {
    use tollgate::bucket::LeaseOp;
    let clock = ManualClock::new(1_700_000_000_000);
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let checked = Precheck::new(inner, Arc::new(clock.clone()), 1000);
    let key = "rl:{t}:held";
    let lease_op = |replica: &str, capacity: f64, rate: f64| LeaseOp {
        key: key.into(),
        spec: BucketSpec::new(10.0, 1.0).unwrap(),
        replica: replica.into(),
        capacity,
        unit: 1.0,
        refill_per_second: rate,
        of_unleased: 1.0,
        ttl_ms: 60_000,
        demand: 0.0,
        fresh: false,
    };
    // Replica a holds all of the bucket: RLS requests find it empty.
    checked.lease(&[lease_op("a", 10.0, 1.0)]).await[0].as_ref().unwrap();
    for _ in 0..100 {
        let out = checked.evaluate(&[vec![op(key, 10.0, 1.0, 1.0)]], GIVE_BACK).await;
        assert!(!out[0].as_ref().unwrap().admitted);
        clock.advance(10);
    }
    assert!(checked.answered_locally() >= 90, "answered locally: {}", checked.answered_locally());
    // Once a token may have refilled, a request reaches the store, carrying the denials.
    clock.advance(1_000);
    checked.evaluate(&[vec![op(key, 10.0, 1.0, 1.0)]], GIVE_BACK).await[0].as_ref().unwrap();
    // Replica b learns what the others ask: 101 tokens over the 2 s since the first request,
    // counted in a window that spans 5 s before it.
    let b = checked.lease(&[lease_op("b", 1.0, 0.1)]).await.pop().unwrap().unwrap();
    let expected = 101.0 * 1000.0 / (5_000.0 + 2_000.0);
    assert!(
        (b.others.demand - expected).abs() < 1e-6,
        "RLS demand beside the leases: {} tokens/s, asked {expected}",
        b.others.demand
    );
}
