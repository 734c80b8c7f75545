//! The bound of global limits across regions (issue 36, `docs/src/design/global-limits.md`),
//! checked before they are built: regions hold leases of one global bucket (the RLQS lease
//! arithmetic, `tollgate::bucket::lease`, run at the global tier) and decide on their share of
//! it (`tollgate::bucket::Share`, the regional bucket sized by the lease), with delays on every
//! message, lost and repeated messages, and
//! partitions longer than a lease; the global tier's own region decides RLS requests on the
//! shared part of the bucket. The tokens admitted worldwide in any window of T seconds stay
//! within `capacity + rate x T`, with no slack, when a region keeps the design's discipline:
//!
//! * a region applies a shrink (of capacity or rate) before it asks for it, and a growth only
//!   when the answer arrives, crediting the tokens the lease grew by;
//! * a lease's local life starts when its renewal was sent, so it ends before the global tier's
//!   (which starts when the renewal arrived); after it the region denies (the default fallback);
//! * a first lease, or one asked after the region's ran out, is `fresh`: the global tier takes its
//!   whole capacity again, and the region starts full;
//! * one renewal in flight per region and bucket, and answers to older ones dropped: a growth
//!   applied after a shrink the global tier already recorded would hold capacity the global tier
//!   has given back (the regional tier makes one replica the renewer of a bucket).
//!
//! `without_each_rule_of_the_discipline_the_bound_breaks` shows the first two are needed: a run
//! that breaks one goes over the bound.

use proptest::prelude::*;
use tollgate::bucket::{
    evaluate, lease, Ask, BucketOp, BucketSpec, BucketState, Charge, LeaseOp, Role, Share,
};

/// How long a lease lives at the global tier from its last renewal's arrival.
const TTL_MS: u64 = 10_000;
/// How long a region waits for a renewal's answer before it may send another.
const REPLY_TIMEOUT_MS: u64 = 1_000;
/// Regions holding leases (the global tier's own region decides on the shared part).
const REGIONS: usize = 3;

// A renewal in flight: its op, when it reaches the global tier (None: lost), how long its answer
// takes back (None: lost), and once it has arrived, when its answer reaches the region and what
// it says.
#[derive(Debug, Clone)]
struct Pending {
    ask: Ask,
    op: LeaseOp,
    arrives: Option<u64>,
    back_ms: Option<u64>,
    answer: Option<(u64, f64, f64)>,
}

#[derive(Debug, Default)]
struct Region {
    share: Option<Share>,
    pending: Option<Pending>,
    // The partition: messages sent or delivered in it are lost.
    cut: Cut,
}

#[derive(Debug, Default, Clone, Copy)]
struct Cut(u64, u64);

impl Cut {
    fn contains_at(&self, t: u64) -> bool {
        (self.0..self.1).contains(&t)
    }
}

/// The rules a region keeps (all, in the design); the test breaks them one at a time.
#[derive(Debug, Clone, Copy)]
struct Discipline {
    /// Shrinks are applied before they are asked for.
    shrink_first: bool,
    /// A lease's local life starts when its renewal was sent.
    life_from_send: bool,
}

impl Discipline {
    const KEPT: Discipline = Discipline { shrink_first: true, life_from_send: true };
}

struct World {
    spec: BucketSpec,
    discipline: Discipline,
    stored: Option<(BucketState, u64)>,
    regions: Vec<Region>,
    // Renewals sent again (after an answer was lost), arriving whenever they do, even after the
    // region has moved on: when, and what.
    resent: Vec<(u64, LeaseOp)>,
    admitted: Vec<(u64, f64)>,
}

impl World {
    // The global tier sets a region's lease at `at`.
    fn grant(&mut self, op: &LeaseOp, at: u64) -> (f64, f64) {
        self.stored = self.stored.take().filter(|(_, expiry)| *expiry >= at);
        let (outcome, write) = lease(self.stored.as_ref().map(|(s, e)| (s, *e)), op, at);
        if let Some(w) = write {
            self.stored = Some((w.state, at + w.ttl_ms));
        }
        (outcome.capacity, outcome.refill_per_second)
    }

    // Every message due by `now`, in time order: renewals reaching the global tier (first or
    // again), answers reaching their region.
    fn deliver(&mut self, now: u64) {
        loop {
            // (when, region or resent index, what: 0 arrival, 1 answer, 2 resent)
            let mut next: Option<(u64, usize, u8)> = None;
            let mut consider = |t: u64, i: usize, kind: u8| {
                if t <= now && next.is_none_or(|(best, _, _)| t < best) {
                    next = Some((t, i, kind));
                }
            };
            for (i, r) in self.regions.iter().enumerate() {
                match r.pending.as_ref().map(|p| (p.arrives, p.answer)) {
                    Some((Some(t), _)) => consider(t, i, 0),
                    Some((None, Some((t, _, _)))) => consider(t, i, 1),
                    _ => {}
                }
            }
            for (j, (t, _)) in self.resent.iter().enumerate() {
                consider(*t, j, 2);
            }
            let Some((t, i, kind)) = next else { return };
            match kind {
                0 => {
                    let op = self.regions[i].pending.as_ref().expect("due").op.clone();
                    let (capacity, rate) = self.grant(&op, t);
                    let region = &mut self.regions[i];
                    let p = region.pending.as_mut().expect("due");
                    p.arrives = None;
                    // An answer lost on the way back never comes: the region gives up at its
                    // timeout.
                    p.answer = p
                        .back_ms
                        .map(|back| t + back)
                        .filter(|at| !region.cut.contains_at(*at))
                        .map(|at| (at, capacity, rate));
                }
                1 => self.answer(i, t),
                _ => {
                    let (_, op) = self.resent.remove(i);
                    self.grant(&op, t);
                }
            }
        }
    }

    // A renewal's answer reaches region `i` at `t`.
    fn answer(&mut self, i: usize, t: u64) {
        let p = self.regions[i].pending.take().expect("due");
        let (_, capacity, rate) = p.answer.expect("answered");
        // Broken on purpose: the life counted from the answer.
        let ask = if self.discipline.life_from_send { p.ask } else { Ask { sent_ms: t, ..p.ask } };
        Share::answer(&mut self.regions[i].share, &ask, capacity, rate, t, TTL_MS);
    }

    // Region `i` asks for a lease of `capacity` and `rate`; the renewal takes `d1` there and
    // `d2` back, is lost there (bit 0) or back (bit 1), and arrives again `again` later (bit 2).
    fn renew(
        &mut self,
        i: usize,
        now: u64,
        capacity: f64,
        rate: f64,
        (d1, d2): (u64, u64),
        (lost, again): (u8, u64),
    ) {
        let r = &mut self.regions[i];
        if r.pending.as_ref().is_some_and(|p| now < p.ask.sent_ms + REPLY_TIMEOUT_MS) {
            return;
        }
        r.pending = None;
        let ask = if self.discipline.shrink_first {
            Share::ask(&mut r.share, capacity, rate, now)
        } else {
            // Broken on purpose: shrinks wait for the answer.
            let fresh = r.share.is_none_or(|s| !s.alive(now));
            Ask { capacity, refill_per_second: rate, fresh, sent_ms: now }
        };
        let fresh = ask.fresh;
        let op = LeaseOp {
            key: "g".into(),
            spec: self.spec,
            replica: format!("region-{i}"),
            capacity,
            unit: 1.0,
            refill_per_second: rate,
            of_unleased: if fresh { tollgate::limiter::YOUNG_OF_UNLEASED } else { 1.0 },
            ttl_ms: TTL_MS,
            demand: 0.0,
            fresh,
        };
        let arrives =
            (lost & 1 == 0 && !r.cut.contains_at(now) && !r.cut.contains_at(now + d1)).then_some(now + d1);
        let back_ms = (lost & 2 == 0).then_some(d2);
        if lost & 4 != 0 && !r.cut.contains_at(now + d1 + again) {
            self.resent.push((now + d1 + again, op.clone()));
        }
        self.regions[i].pending = Some(Pending { ask, op, arrives, back_ms, answer: None });
    }

    // Region `i` admits up to `n` requests of one token from its share, while it lives.
    fn admit(&mut self, i: usize, now: u64, n: u32) {
        if let Some(s) = self.regions[i].share.as_mut() {
            let mut taken = 0;
            while taken < n && s.take(1.0, now) {
                taken += 1;
            }
            if taken > 0 {
                self.admitted.push((now, f64::from(taken)));
            }
        }
    }

    // The global tier's own region: RLS requests on the shared part, one token each.
    fn rls(&mut self, now: u64, n: u32) {
        let op = BucketOp {
            key: "g".into(),
            spec: self.spec,
            need: 1.0,
            unseen: 0.0,
            role: Role::Enforced,
            charge: Charge::Admitted,
        };
        for _ in 0..n {
            self.stored = self.stored.take().filter(|(_, expiry)| *expiry >= now);
            let e = evaluate(&[vec![op.clone()]], now, |_| self.stored.clone());
            if !e.groups[0].admitted {
                break;
            }
            self.admitted.push((now, 1.0));
            if let Some(w) = e.writes.first() {
                self.stored = Some((w.state.clone(), now + w.ttl_ms));
            }
        }
    }
}

// The largest excess over `capacity + rate x T` of any window, in tokens (0: within).
fn excess(admitted: &[(u64, f64)], capacity: f64, rate: f64) -> (f64, String) {
    let mut worst = (0.0, String::new());
    for (i, &(from, _)) in admitted.iter().enumerate() {
        let mut sum = 0.0;
        for &(to, n) in &admitted[i..] {
            sum += n;
            let over = sum - (capacity + rate * (to - from) as f64 / 1000.0);
            if over > worst.0 {
                worst = (over, format!("{sum} admitted in [{from}, {to}] ms"));
            }
        }
    }
    worst
}

// What a run is: the bucket, each region's partition, and the steps (who acts, the sizes asked
// as fractions, requests, delays there and back, losses and a resend, time to the next step).
type Case = ((f64, f64), Vec<(u64, u64)>, Vec<Step>);
type Step = (usize, (f64, f64), u32, (u64, u64), (u8, u64), u64);

fn cases() -> impl Strategy<Value = Case> {
    (
        (1u32..200, 1u32..200).prop_map(|(c, r)| (f64::from(c), f64::from(r) / 10.0)),
        proptest::collection::vec((0u64..120_000, prop_oneof![0u64..2_000, 5_000u64..40_000]), REGIONS),
        proptest::collection::vec(
            (
                0usize..(2 * REGIONS + 1),
                (0.0..=1.0f64, 0.0..=1.0f64),
                1u32..30,
                // 80-150 ms of delay each way, or anything up to half the reply timeout.
                (prop_oneof![80u64..150, 0u64..500], prop_oneof![80u64..150, 0u64..500]),
                (0u8..8, 0u64..400),
                prop_oneof![0u64..300, 0u64..3_000, 5_000u64..15_000],
            ),
            1..150,
        ),
    )
}

// Runs `case` under `discipline`: the largest excess over the bound, and where.
fn simulate(case: Case, discipline: Discipline) -> (f64, String) {
    let ((capacity, rate), cuts, steps) = case;
    let spec = BucketSpec::new(capacity, rate).unwrap();
    let mut world = World {
        spec,
        discipline,
        stored: None,
        regions: Vec::new(),
        resent: Vec::new(),
        admitted: Vec::new(),
    };
    let start = 1_000_000u64;
    for (from, len) in cuts {
        world.regions.push(Region { cut: Cut(start + from, start + from + len), ..Region::default() });
    }
    let mut now = start;
    for (what, (c, r), n, (d1, d2), (lost, again), dt) in steps {
        now += dt;
        world.deliver(now);
        match what {
            i if i < REGIONS => {
                // Most renewals get through; a few are lost either way or arrive twice.
                let lost = if lost < 5 { 0 } else { lost };
                world.renew(i, now, (c * capacity).floor(), r * rate, (d1, d2), (lost, again));
            }
            i if i < 2 * REGIONS => world.admit(i - REGIONS, now, n),
            _ => world.rls(now, n),
        }
    }
    world.deliver(u64::MAX - 1);
    excess(&world.admitted, capacity, rate)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn regions_on_leases_of_one_global_bucket_keep_its_bound(case in cases()) {
        let (capacity, rate) = case.0;
        let (over, window) = simulate(case, Discipline::KEPT);
        prop_assert!(over <= 1e-6, "{over} tokens over capacity {capacity} + rate {rate} x T: {window}");
    }
}

// A run in which region 0 and the global tier's own region spend all they can every 50 ms for
// `until` ms, region 0 renewing at `renewals` (time, capacity and rate as fractions, delays),
// and region 0 cut off from `cut` on for a minute.
fn saturated(renewals: &[(u64, f64, (u64, u64))], cut: u64, until: u64) -> Case {
    let mut events: Vec<(u64, Step)> = Vec::new();
    for &(at, fraction, delays) in renewals {
        events.push((at, (0, (fraction, fraction), 0, delays, (0, 0), 0)));
    }
    for at in (0..until).step_by(50) {
        events.push((at, (REGIONS, (0.0, 0.0), 30, (0, 0), (0, 0), 0)));
        events.push((at, (2 * REGIONS, (0.0, 0.0), 30, (0, 0), (0, 0), 0)));
    }
    events.sort_by_key(|(at, _)| *at);
    let mut last = 0;
    let steps = events
        .into_iter()
        .map(|(at, mut step)| {
            step.5 = at - last;
            last = at;
            step
        })
        .collect();
    let never = (u64::MAX / 4, 0);
    ((10.0, 10.0), vec![(cut, 60_000), never, never], steps)
}

/// Each rule of the discipline is needed: without it, a region spending all it can admits more
/// than the bound (so the random runs above can catch a region that breaks it). Region 0 takes a
/// lease of the whole bucket (10 tokens, 10 a second: a young lease gets half the rate, the next
/// renewal the rest) while the global tier's region asks for the shared part all along.
#[test]
fn without_each_rule_of_the_discipline_the_bound_breaks() {
    let whole = [(0, 1.0, (100, 100)), (300, 1.0, (100, 100))];
    // Region 0 gives its lease back, the answer taking 450 ms: spending on it meanwhile, at the
    // rate the global tier already gave back to its own region, is over the bound.
    let shrink = saturated(&[whole[0], whole[1], (2_000, 0.0, (50, 450))], u64::MAX / 4, 4_000);
    // Region 0's last renewal arrives after 50 ms, its answer after 450 more, and then it is cut
    // off: a local life counted from the answer outlives the global tier's by 450 ms.
    let expiry = saturated(&[whole[0], whole[1], (1_000, 1.0, (50, 450))], 1_600, 14_000);
    for (what, case, broken) in [
        (
            "a shrink applied when its answer arrives",
            shrink,
            Discipline { shrink_first: false, ..Discipline::KEPT },
        ),
        (
            "a lease's local life counted from its answer",
            expiry,
            Discipline { life_from_send: false, ..Discipline::KEPT },
        ),
    ] {
        let (kept, _) = simulate(case.clone(), Discipline::KEPT);
        assert!(kept <= 1e-6, "{what}: the discipline kept is within the bound, {kept} over");
        let (over, window) = simulate(case, broken);
        assert!(over > 1.0, "{what}: {over} over the bound ({window})");
        println!("{what}: {over:.2} tokens over the bound ({window})");
    }
}
