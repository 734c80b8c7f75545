//! A global limit beside a concurrency limit, in a region: a request's global bucket is taken
//! from the replica's share before its slot, all or nothing. A take refused by a full set, or a
//! request denied by another of its limits, gives its share's tokens back, a retried take
//! (answered from its record) takes none again, and a share that refuses asks for no slot. The region's limiter is driven directly on a manual clock,
//! its share granted by hand as the global tier would grant it (the renewal loop and real tiers
//! are `tests/global_regions.rs`), so every token is counted.

use std::sync::Arc;
use std::time::Duration;

use tollgate::clock::{Clock, ManualClock};
use tollgate::config::RuleSet;
use tollgate::limiter::{
    Code, Decision, GlobalShares, Granted, Limiter, Outcome, Query, QueryDescriptor, ServiceModes,
};
use tollgate::slot::SlotVerdict;
use tollgate::store::MemoryStore;
use tollgate::telemetry::{Telemetry, TelemetryConfig};

// Five tokens worldwide that practically never refill, two exports in flight per tenant, and a
// regional limit per client (in another Cluster slot than the tenant's).
const CONFIG: &str = r#"
domain: exports
tenant_key: tenant
descriptors:
  - key: tenant
    concurrency: {max: 2, ttl: 1m}
    token_bucket: {capacity: 5, refill_per_second: 0.001}
    global: true
  - key: client
    token_bucket: {capacity: 1, refill_per_second: 0.001}
"#;
const START_MS: u64 = 1_797_724_800_000;

struct Region {
    limiter: Limiter,
    shares: Arc<GlobalShares>,
    clock: Arc<ManualClock>,
}

impl Region {
    fn new() -> Region {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("exports.yaml");
        std::fs::write(&path, CONFIG).unwrap();
        let rules = RuleSet::load(&path).unwrap();
        let clock = Arc::new(ManualClock::new(START_MS));
        let shares = Arc::new(GlobalShares::new("eu/a".into(), Duration::ZERO));
        let limiter = Limiter::new(
            Arc::new(arc_swap::ArcSwap::from_pointee(rules)),
            Arc::new(MemoryStore::with_clock(clock.clone())),
            Arc::new(tollgate::quota::EmbeddedQuotas),
            Arc::new(Telemetry::without_exporter(TelemetryConfig::default())),
            ServiceModes::default(),
        )
        .with_clock(clock.clone())
        .with_global_shares(shares.clone());
        Region { limiter, shares, clock }
    }

    // One round: every renewal due granted in full, as a global tier with nobody else would.
    fn round(&self) {
        let now = self.clock.now_ms();
        let answers = self
            .shares
            .due(now)
            .into_iter()
            .map(|r| {
                let granted = Granted {
                    bucket: (5.0, 0.001, 1),
                    capacity: r.ask.capacity,
                    rate: r.ask.refill_per_second,
                    others_demand: 0.0,
                    ttl_ms: 60_000,
                };
                (r.key, Some(granted))
            })
            .collect();
        self.shares.answered(answers, now);
    }

    async fn call(&self, descriptors: &[&[(&str, &str)]]) -> Decision {
        let descriptors = descriptors
            .iter()
            .map(|entries| QueryDescriptor { entries: entries.to_vec(), hits: 1, credit: false, limit: None })
            .collect();
        self.limiter.decide(&Query { domain: "exports", descriptors }).await.unwrap()
    }

    async fn take(&self, id: &str) -> Decision {
        self.call(&[&[("tenant", "acme"), ("request_id", id)]]).await
    }

    // A take with the client's limit beside it.
    async fn take_as_client(&self, id: &str) -> Decision {
        self.call(&[&[("tenant", "acme"), ("request_id", id)], &[("client", "c")]]).await
    }

    // The slots still open after giving back `id`'s.
    async fn give_back(&self, id: &str) -> u64 {
        let decision = self.call(&[&[("tenant", "acme"), ("request_id", id), ("release", "1")]]).await;
        match &decision.descriptors[0].outcome {
            Outcome::Slot(r) => r.sets[0].open,
            other => panic!("a give-back's answer: {other:?}"),
        }
    }
}

// The share's tokens after the decision (the bucket the take's path names; to a hundredth, past
// the refill of the few milliseconds the clock moved), and its slot verdict.
fn seen(decision: &Decision) -> (f64, Option<SlotVerdict>) {
    let (tokens, verdict) = match &decision.descriptors[0].outcome {
        Outcome::Slot(r) => (r.bucket.as_ref().expect("the path's bucket").verdict.tokens, Some(r.verdict)),
        Outcome::Bucket(b) => (b.verdict.tokens, None),
        other => panic!("a take's answer: {other:?}"),
    };
    ((tokens * 100.0).round() / 100.0, verdict)
}

#[tokio::test]
async fn a_global_bucket_and_a_concurrency_limit_are_all_or_nothing() {
    let region = Region::new();
    // No share yet (no first-lease wait here): denied, and no slot is asked for.
    assert_eq!(region.take("a").await.overall, Code::OverLimit);
    // The first lease (young: one request's tokens), then the whole bucket, asked by demand.
    region.round();
    region.clock.advance(200);
    region.round();

    // A request with a client limit too: admitted once (the client's one token), then denied by
    // the client's bucket before its take is asked, its share's token given back.
    let x = region.take_as_client("x").await;
    assert_eq!((x.overall, seen(&x)), (Code::Ok, (4.0, Some(SlotVerdict::Taken))));
    let y = region.take_as_client("y").await;
    assert_eq!(y.overall, Code::OverLimit);
    assert_eq!(region.give_back("x").await, 0);

    // "a" was never taken: a first take now, from the 4 tokens left.
    let a = region.take("a").await;
    assert_eq!((a.overall, seen(&a)), (Code::Ok, (3.0, Some(SlotVerdict::Taken))));
    let b = region.take("b").await;
    assert_eq!((b.overall, seen(&b)), (Code::Ok, (2.0, Some(SlotVerdict::Taken))));
    // A retry of "a": its recorded answer, and its share's token given back.
    let again = region.take("a").await;
    assert_eq!((again.overall, seen(&again).1), (Code::Ok, Some(SlotVerdict::Repeated(true))));
    // Both slots open: "c" is refused by the set, and its share's token given back.
    let c = region.take("c").await;
    assert_eq!((c.overall, seen(&c).1), (Code::OverLimit, Some(SlotVerdict::Refused(Some(0)))));

    // So the share still holds 2: "d" and "e" take them as slots come back.
    assert_eq!(region.give_back("a").await, 1);
    let d = region.take("d").await;
    assert_eq!((d.overall, seen(&d)), (Code::Ok, (1.0, Some(SlotVerdict::Taken))));
    assert_eq!(region.give_back("b").await, 1);
    let e = region.take("e").await;
    assert_eq!((e.overall, seen(&e)), (Code::Ok, (0.0, Some(SlotVerdict::Taken))));

    // The share is spent: "f" is denied by it with a slot free, and takes no slot.
    assert_eq!(region.give_back("d").await, 1);
    let f = region.take("f").await;
    assert_eq!((f.overall, seen(&f).1), (Code::OverLimit, None));
    assert_eq!(region.give_back("e").await, 0, "no slot open: the denied take holds none");
    assert_eq!(region.give_back("f").await, 0);
}
