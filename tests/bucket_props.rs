//! Properties of the bucket arithmetic for all finite inputs: balances stay within
//! [floor, capacity] (floor 0, or -max_debt for buckets charged always), spending never raises
//! the balance, time never lowers it, and waits and TTLs stay within the bound Redis accepts.
//! And for one bucket written under several specs (replicas in the middle of a quota change):
//! the bucket never expires before it is full at the largest capacity refilling at the slowest
//! rate, and the tokens admitted in any window of T seconds stay within
//! `largest capacity + fastest refill × T`. And with replicas' held shares (RLQS): RLS requests
//! on the shared part plus Envoys admitting from local buckets the size of their replicas' holds
//! stay within `capacity + refill × T` too.

use proptest::prelude::*;
use tollgate::bucket::{
    evaluate, lease, refill, BucketOp, BucketSpec, BucketState, Charge, LeaseOp, Role, MAX_WAIT_MS,
};

fn spec() -> impl Strategy<Value = BucketSpec> {
    prop_oneof![
        (0.0f64..1e15, 1e-9f64..1e9).prop_map(|(c, r)| BucketSpec::new(c, r).unwrap()),
        (1u32..1_000, 1u32..1_000).prop_map(|(c, r)| BucketSpec::new(f64::from(c), f64::from(r)).unwrap()),
        Just(BucketSpec::new(0.0, 0.0).unwrap()),
    ]
}

fn state(spec: BucketSpec) -> impl Strategy<Value = Option<BucketState>> {
    proptest::option::of((0.0..=1.0f64, 0u64..u64::MAX / 2).prop_map(move |(f, last)| BucketState {
        tokens: f * spec.capacity(),
        last_refill_ms: last,
        fastest_refill: spec.refill_per_second(),
        ..Default::default()
    }))
}

fn charge() -> impl Strategy<Value = Charge> {
    prop_oneof![
        Just(Charge::Admitted),
        (0.0f64..1e12).prop_map(|max_debt| Charge::Always { max_debt }),
        Just(Charge::Always { max_debt: 0.0 }),
    ]
}

fn op(spec: BucketSpec, need: f64, charge: Charge) -> BucketOp {
    BucketOp { key: "k".into(), spec, need, unseen: 0.0, role: Role::Enforced, charge }
}

fn need() -> impl Strategy<Value = f64> {
    prop_oneof![0.0f64..1e6, Just(0.0), Just(1.0), (1u64..u64::MAX).prop_map(|n| n as f64), -1e6f64..0.0]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn balances_stay_between_the_floor_and_capacity(
        (spec, st) in spec().prop_flat_map(|s| (Just(s), state(s))),
        charge in charge(),
        steps in proptest::collection::vec((need(), 0u64..10_000_000), 1..20),
        start in 0u64..u64::MAX / 2,
    ) {
        let mut stored = st;
        let mut now = start;
        let floor = charge.floor();
        for (need, dt) in steps {
            now = now.saturating_add(dt);
            let e = evaluate(&[vec![op(spec, need, charge)]], now, |_| stored.clone().map(|s| (s, u64::MAX)));
            let v = e.groups[0].verdicts[0];
            prop_assert!(v.tokens >= floor && v.tokens <= spec.capacity(), "{v:?} outside [{floor}, {}]", spec.capacity());
            prop_assert!(v.tokens.is_finite() && v.forgiven >= 0.0);
            prop_assert!(v.reset_ms <= MAX_WAIT_MS && v.retry_after_ms.is_none_or(|r| r <= MAX_WAIT_MS));
            if let Some(w) = e.writes.first() {
                prop_assert!(w.state.tokens >= floor && w.state.tokens <= spec.capacity());
                prop_assert!(w.ttl_ms > 0 && w.ttl_ms <= MAX_WAIT_MS);
                stored = Some(w.state.clone());
            }
        }
    }

    #[test]
    fn spending_never_raises_the_balance(
        spec in spec(),
        needs in proptest::collection::vec(0.0f64..1e4, 1..20),
        now in 0u64..u64::MAX / 2,
    ) {
        let mut stored: Option<BucketState> = None;
        let mut previous = spec.capacity();
        for need in needs {
            let e = evaluate(&[vec![op(spec, need, Charge::Admitted)]], now, |_| stored.clone().map(|s| (s, u64::MAX)));
            let tokens = e.groups[0].verdicts[0].tokens;
            prop_assert!(tokens <= previous, "{tokens} > {previous}");
            previous = tokens;
            if let Some(w) = e.writes.first() {
                stored = Some(w.state.clone());
            }
        }
    }

    #[test]
    fn refill_is_monotone_in_time(
        (spec, st) in spec().prop_flat_map(|s| (Just(s), state(s))),
        t1 in 0u64..u64::MAX / 2,
        dt in 0u64..u64::MAX / 4,
    ) {
        let t2 = t1 + dt;
        let a = refill(st.as_ref(), &spec, t1);
        let b = refill(st.as_ref(), &spec, t2);
        prop_assert!(a.tokens <= b.tokens, "{a:?} then {b:?}");
        prop_assert!(b.tokens <= spec.capacity().max(st.as_ref().map_or(0.0, |s| s.tokens)));
        prop_assert!(a.last_refill_ms <= b.last_refill_ms);
    }
}

// The first window of `admitted` (when, tokens) that holds more than `capacity + rate x T`.
fn over_the_bound(admitted: &[(u64, f64)], capacity: f64, rate: f64) -> Option<String> {
    for (i, &(from, _)) in admitted.iter().enumerate() {
        let mut sum = 0.0;
        for &(to, n) in &admitted[i..] {
            sum += n;
            let bound = capacity + rate * (to - from) as f64 / 1000.0;
            if sum > bound + 1e-6 {
                return Some(format!("{sum} admitted in [{from}, {to}] > {bound}"));
            }
        }
    }
    None
}

// Two or three specs of one bucket, as replicas that disagree hold them.
fn specs() -> impl Strategy<Value = Vec<BucketSpec>> {
    proptest::collection::vec(
        (1u32..200, prop_oneof![1u32..50, Just(1_000)])
            .prop_map(|(c, r)| BucketSpec::new(f64::from(c), f64::from(r) / 10.0).unwrap()),
        2..=3,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    #[test]
    fn a_bucket_under_several_specs_keeps_its_debt_and_the_bound(
        specs in specs(),
        steps in proptest::collection::vec((0usize..3, 1u32..200, prop_oneof![0u64..2_000, 0u64..200_000]), 1..60),
    ) {
        let largest = specs.iter().map(BucketSpec::capacity).fold(0.0, f64::max);
        let fastest = specs.iter().map(BucketSpec::refill_per_second).fold(0.0, f64::max);
        // The bucket as a store holds it: state and expiry; gone once its expiry has passed.
        let mut stored: Option<(BucketState, u64)> = None;
        let mut admitted: Vec<(u64, f64)> = Vec::new();
        let mut now = 1_000_000u64;
        for (which, need, dt) in steps {
            now += dt;
            stored = stored.filter(|(_, at)| *at >= now);
            let spec = specs[which % specs.len()];
            let e = evaluate(&[vec![op(spec, f64::from(need), Charge::Admitted)]], now, |_| stored.clone());
            if e.groups[0].admitted {
                admitted.push((now, f64::from(need)));
            }
            if let Some(w) = e.writes.first() {
                let at = now + w.ttl_ms;
                prop_assert!(stored.as_ref().is_none_or(|(_, before)| at >= *before), "expiry moved earlier");
                prop_assert!(w.state.largest_capacity >= spec.capacity());
                stored = Some((w.state.clone(), at));
            }
            if let Some((s, at)) = &stored {
                // At its expiry, the balance has refilled to the largest capacity at the slowest rate.
                let full_by = s.tokens + (at - s.last_refill_ms) as f64 * s.slowest_refill / 1000.0;
                prop_assert!(full_by >= s.largest_capacity, "expires at {at} with {full_by} < {}: {s:?}", s.largest_capacity);
            }
        }
        let over = over_the_bound(&admitted, largest, fastest);
        prop_assert!(over.is_none(), "{}: {specs:?}", over.unwrap_or_default());
    }
}

// An Envoy's local token bucket for one assignment, as Envoy 1.40 keeps it: the first starts
// full, an identical one is carried over, a changed one is rebuilt at the old fill ratio; it
// refills continuously and is gone when the assignment expires.
#[derive(Debug, Clone, Copy)]
struct Local {
    capacity: f64,
    per_ms: f64,
    tokens: f64,
    at: u64,
    until: u64,
}

impl Local {
    fn refill(&mut self, now: u64) {
        self.tokens = self.capacity.min(self.tokens + (now - self.at) as f64 * self.per_ms);
        self.at = now;
    }
}

// An assignment of `capacity` tokens refilling `rate` per second until `until` reaches an Envoy
// whose bucket was `old`.
fn assign(old: Option<Local>, capacity: f64, rate: f64, now: u64, until: u64) -> Option<Local> {
    let capacity = capacity.floor();
    if capacity < 1.0 {
        return None;
    }
    let per_ms = rate / 1000.0;
    let tokens = match old.filter(|l| l.until > now) {
        Some(mut l) => {
            l.refill(now);
            if l.capacity == capacity && l.per_ms == per_ms {
                l.tokens
            } else {
                l.tokens / l.capacity * capacity
            }
        }
        None => capacity,
    };
    Some(Local { capacity, per_ms, tokens, at: now, until })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    #[test]
    fn leases_and_rls_together_keep_the_bound(
        (capacity, rate) in (1u32..200, 1u32..200).prop_map(|(c, r)| (f64::from(c), f64::from(r) / 10.0)),
        steps in proptest::collection::vec(
            (0usize..6, 0.0..=1.0f64, 0.0..=1.0f64, 1u32..30, prop_oneof![0u64..500, 0u64..20_000]),
            1..80,
        ),
    ) {
        let spec = BucketSpec::new(capacity, rate).unwrap();
        let mut stored: Option<(BucketState, u64)> = None;
        let mut locals: [Option<Local>; 3] = [None; 3];
        let mut admitted: Vec<(u64, f64)> = Vec::new();
        let mut now = 1_000_000u64;
        for (what, c, r, n, dt) in steps {
            now += dt;
            stored = stored.filter(|(_, at)| *at >= now);
            match what {
                // A replica sets its hold (ttl 5 s) and its Envoy gets the assignment.
                0..=2 => {
                    let op = LeaseOp {
                        key: "k".into(),
                        spec,
                        replica: what.to_string(),
                        capacity: (c * capacity).floor(),
                        unit: 1.0,
                        refill_per_second: r * rate,
                        of_unleased: if c < 0.5 { 0.5 } else { 1.0 },
                        ttl_ms: 5_000,
                        demand: 0.0,
                        // An Envoy whose assignment expired starts a new one full.
                        fresh: locals[what].is_none_or(|l| l.until <= now),
                    };
                    let (outcome, write) = lease(stored.as_ref().map(|(s, at)| (s, *at)), &op, now);
                    prop_assert!(outcome.capacity <= op.capacity && outcome.refill_per_second <= op.refill_per_second);
                    if let Some(w) = write {
                        let at = now + w.ttl_ms;
                        prop_assert!(stored.as_ref().is_none_or(|(_, before)| at >= *before), "expiry moved earlier");
                        stored = Some((w.state, at));
                    }
                    locals[what] = assign(locals[what], outcome.capacity, outcome.refill_per_second, now, now + 5_000);
                }
                // An Envoy admits up to n requests from its local bucket.
                3..=5 => {
                    if let Some(l) = locals[what - 3].as_mut().filter(|l| l.until > now) {
                        l.refill(now);
                        let take = l.tokens.floor().min(f64::from(n));
                        l.tokens -= take;
                        if take > 0.0 {
                            admitted.push((now, take));
                        }
                    }
                    // And RLS asks the shared part for the same n, one at a time.
                    for _ in 0..n {
                        let e = evaluate(&[vec![op(spec, 1.0, Charge::Admitted)]], now, |_| stored.clone());
                        if !e.groups[0].admitted {
                            break;
                        }
                        admitted.push((now, 1.0));
                        if let Some(w) = e.writes.first() {
                            stored = Some((w.state.clone(), now + w.ttl_ms));
                        }
                    }
                }
                _ => unreachable!(),
            }
        }
        let over = over_the_bound(&admitted, capacity, rate);
        prop_assert!(over.is_none(), "{}", over.unwrap_or_default());
    }
}
