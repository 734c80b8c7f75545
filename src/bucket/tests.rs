//! The bucket arithmetic through [`evaluate`], case by case; `tests/equivalence.rs` keeps it
//! equal to the Lua twin.

use super::*;

fn spec(capacity: f64, refill_per_second: f64) -> BucketSpec {
    BucketSpec::new(capacity, refill_per_second).unwrap()
}

// A stored bucket whose expiry has come: whatever a test writes sets the expiry alone.
fn stored(state: BucketState) -> Option<(BucketState, u64)> {
    Some((state, 0))
}

fn op(key: &str, spec: BucketSpec, need: f64) -> BucketOp {
    BucketOp { key: key.into(), spec, need, unseen: 0.0, role: Role::Enforced, charge: Charge::Admitted }
}

fn always(key: &str, spec: BucketSpec, need: f64, max_debt: f64) -> BucketOp {
    BucketOp { charge: Charge::Always { max_debt }, ..op(key, spec, need) }
}

#[test]
fn new_bucket_starts_full_and_debits() {
    let e = evaluate(&[vec![op("a", spec(10.0, 1.0), 3.0)]], 1_000, |_| None);
    let v = e.groups[0].verdicts[0];
    assert!(e.groups[0].admitted && v.allowed);
    assert_eq!(v.tokens, 7.0);
    assert_eq!(v.reset_ms, 3_000);
    assert_eq!(
        e.writes,
        vec![Write {
            key: "a".into(),
            state: BucketState {
                tokens: 7.0,
                last_refill_ms: 1_000,
                fastest_refill: 1.0,
                largest_capacity: 10.0,
                slowest_refill: 1.0,
                ..Default::default()
            },
            ttl_ms: 11_000,
        }]
    );
}

#[test]
fn refill_is_lazy_capped_and_ignores_clock_steps_back() {
    let s = BucketState { tokens: 2.0, last_refill_ms: 10_000, ..Default::default() };
    assert_eq!(refill(Some(&s), &spec(10.0, 2.0), 12_000).tokens, 6.0);
    assert_eq!(refill(Some(&s), &spec(10.0, 2.0), 60_000).tokens, 10.0);
    let back = refill(Some(&s), &spec(10.0, 2.0), 5_000);
    assert_eq!(back, BucketState { tokens: 2.0, last_refill_ms: 10_000, ..Default::default() });
}

#[test]
fn denial_reports_wait_and_writes_nothing() {
    let s = BucketState { tokens: 1.0, last_refill_ms: 0, ..Default::default() };
    let e = evaluate(&[vec![op("a", spec(10.0, 2.0), 4.0)]], 0, |_| stored(s.clone()));
    let v = e.groups[0].verdicts[0];
    assert!(!e.groups[0].admitted && !v.allowed);
    assert_eq!(v.retry_after_ms, Some(1_500));
    assert_eq!(v.tokens, 1.0);
    assert!(e.writes.is_empty());
}

#[test]
fn need_above_capacity_never_succeeds() {
    let e = evaluate(&[vec![op("a", spec(10.0, 2.0), 11.0)]], 0, |_| None);
    assert_eq!(e.groups[0].verdicts[0].retry_after_ms, None);
}

#[test]
fn group_is_all_or_nothing() {
    let empty = BucketState { tokens: 0.0, last_refill_ms: 0, ..Default::default() };
    let e =
        evaluate(&[vec![op("tenant", spec(10.0, 1.0), 1.0), op("export", spec(5.0, 1.0), 5.0)]], 0, |k| {
            (k == "export").then_some((empty.clone(), u64::MAX))
        });
    assert!(!e.groups[0].admitted);
    assert!(e.groups[0].verdicts[0].allowed);
    assert_eq!(e.groups[0].verdicts[0].tokens, 10.0, "tenant bucket not debited");
    assert!(e.writes.is_empty());
}

#[test]
fn shadow_denial_does_not_deny_the_group() {
    let shadow = BucketOp { role: Role::Shadow, ..op("s", spec(1.0, 1.0), 2.0) };
    let e = evaluate(&[vec![op("a", spec(5.0, 1.0), 1.0), shadow]], 0, |_| None);
    assert!(e.groups[0].admitted);
    assert!(!e.groups[0].verdicts[1].allowed);
    assert_eq!(e.writes.len(), 1);
}

#[test]
fn quota_mode_denies_only_when_every_quota_bucket_is_short() {
    let empty = BucketState { tokens: 0.0, last_refill_ms: 0, ..Default::default() };
    let quota_mode = |key: &str| BucketOp { role: Role::QuotaMode, ..op(key, spec(5.0, 1.0), 1.0) };
    let load = |k: &str| (k == "q1").then_some((empty.clone(), u64::MAX));
    let e = evaluate(&[vec![quota_mode("q1"), quota_mode("q2")]], 0, load);
    assert!(e.groups[0].admitted, "q2 has tokens");
    assert_eq!((e.groups[0].verdicts[0].allowed, e.groups[0].verdicts[1].tokens), (false, 4.0));
    let e = evaluate(&[vec![quota_mode("q1")]], 0, load);
    assert!(!e.groups[0].admitted, "the only quota-mode bucket is short");
    let short_enforced = op("q1", spec(5.0, 1.0), 1.0);
    let e = evaluate(&[vec![quota_mode("q2"), short_enforced]], 0, load);
    assert!(!e.groups[0].admitted, "an enforced bucket still denies");
    assert_eq!(e.groups[0].verdicts[0].tokens, 5.0);
}

#[test]
fn same_key_twice_in_one_group_is_charged_twice() {
    let s = spec(10.0, 1.0);
    let e = evaluate(&[vec![op("a", s, 6.0), op("a", s, 6.0)]], 0, |_| None);
    assert!(!e.groups[0].admitted, "12 tokens from a 10-token bucket");
    let e = evaluate(&[vec![op("a", s, 4.0), op("a", s, 4.0)]], 0, |_| None);
    assert_eq!(e.groups[0].verdicts[1].tokens, 2.0);
    assert_eq!(e.writes[0].state.tokens, 2.0);
}

#[test]
fn later_groups_see_earlier_debits() {
    let s = spec(3.0, 1.0);
    let batch = [vec![op("a", s, 2.0)], vec![op("a", s, 2.0)]];
    let e = evaluate(&batch, 0, |_| None);
    assert!(e.groups[0].admitted);
    assert!(!e.groups[1].admitted);
    assert_eq!(e.groups[1].verdicts[0].tokens, 1.0);
}

#[test]
fn credit_and_check_only() {
    let s = BucketState { tokens: 1.0, last_refill_ms: 0, ..Default::default() };
    let e = evaluate(&[vec![op("a", spec(5.0, 1.0), -10.0)]], 0, |_| stored(s.clone()));
    assert_eq!(e.groups[0].verdicts[0].tokens, 5.0, "credit is capped at capacity");
    let e = evaluate(&[vec![op("a", spec(5.0, 1.0), 0.0)]], 0, |_| stored(s.clone()));
    assert!(e.groups[0].verdicts[0].allowed);
    assert!(e.writes.is_empty(), "a check changes nothing");
}

#[test]
fn zero_capacity_denies_forever_without_dividing_by_zero() {
    let e = evaluate(&[vec![op("a", BucketSpec::new(0.0, 0.0).unwrap(), 1.0)]], 0, |_| None);
    let v = e.groups[0].verdicts[0];
    assert_eq!((v.allowed, v.retry_after_ms, v.reset_ms), (false, None, 0));
}

#[test]
fn charge_always_goes_into_debt_down_to_the_floor() {
    let s = spec(1_000.0, 10.0);
    // Check, charge 600, check, charge 600: the second charge goes into debt.
    let start = BucketState { tokens: 1_000.0, last_refill_ms: 0, ..Default::default() };
    let e = evaluate(&[vec![always("a", s, 600.0, 1_000.0)]], 0, |_| stored(start.clone()));
    assert_eq!(e.groups[0].verdicts[0].tokens, 400.0);
    let at = BucketState { tokens: 400.0, last_refill_ms: 0, ..Default::default() };
    let e = evaluate(&[vec![always("a", s, 600.0, 1_000.0)]], 0, |_| stored(at.clone()));
    let v = e.groups[0].verdicts[0];
    assert!(!v.allowed && !e.groups[0].admitted, "600 > 400: denied, yet charged");
    assert_eq!((v.tokens, v.forgiven), (-200.0, 0.0));
    assert_eq!(e.writes[0].state.tokens, -200.0);
    assert_eq!(e.writes[0].ttl_ms, 201_000, "lives until full from the floor");
    // A check while in debt is denied until the balance is back to zero.
    let debt = BucketState { tokens: -200.0, last_refill_ms: 0, ..Default::default() };
    let e = evaluate(&[vec![always("a", s, 0.0, 1_000.0)]], 0, |_| stored(debt.clone()));
    let v = e.groups[0].verdicts[0];
    assert_eq!((v.allowed, v.retry_after_ms), (false, Some(20_000)));
    assert!(e.writes.is_empty());
    // Past the floor the rest is forgiven.
    let e = evaluate(&[vec![always("a", s, 5_000.0, 1_000.0)]], 0, |_| stored(debt.clone()));
    let v = e.groups[0].verdicts[0];
    assert_eq!((v.tokens, v.forgiven, v.retry_after_ms), (-1_000.0, 4_200.0, None));
}

#[test]
fn a_shallow_floor_never_lifts_a_deeper_debt() {
    let debt = BucketState { tokens: -50.0, last_refill_ms: 0, ..Default::default() };
    let e = evaluate(&[vec![always("a", spec(100.0, 1.0), 10.0, 0.0)]], 0, |_| stored(debt.clone()));
    let v = e.groups[0].verdicts[0];
    assert_eq!((v.tokens, v.forgiven), (-50.0, 10.0));
}

#[test]
fn a_denied_group_still_takes_what_is_charged_always() {
    let s = spec(10.0, 1.0);
    let empty = BucketState { tokens: 0.0, last_refill_ms: 0, ..Default::default() };
    let e = evaluate(
        &[vec![op("plain", s, 1.0), always("metered", s, 3.0, 10.0), op("short", s, 1.0)]],
        0,
        |k| (k == "short").then_some((empty.clone(), u64::MAX)),
    );
    let g = &e.groups[0];
    assert!(!g.admitted);
    assert_eq!(g.verdicts[0].tokens, 10.0, "admitted-charge bucket untouched");
    assert_eq!(g.verdicts[1].tokens, 7.0, "always-charge bucket debited");
    assert_eq!(e.writes.len(), 1);
    assert_eq!(e.writes[0].key, "metered");
}

#[test]
fn a_refund_gives_back_what_admission_took() {
    let s = spec(10.0, 1.0);
    let group = vec![op("a", s, 3.0), always("m", s, 2.0, 10.0), op("c", s, -1.0), op("z", s, 0.0)];
    let e = evaluate(std::slice::from_ref(&group), 0, |_| None);
    let back: Group = refund(&group, &e.groups[0]).into_iter().map(|(_, op)| op).collect();
    assert_eq!(
        back.iter().map(|o| (o.key.as_str(), o.need)).collect::<Vec<_>>(),
        vec![("a", -3.0), ("c", 1.0)]
    );
    let after =
        evaluate(&[back], 0, |k| e.writes.iter().find(|w| w.key == k).map(|w| (w.state.clone(), w.ttl_ms)));
    assert_eq!(after.groups[0].verdicts[0].tokens, 10.0);
    let denied = GroupOutcome { admitted: false, ..e.groups[0].clone() };
    assert!(refund(&group, &denied).is_empty(), "a denied group took nothing");
}

#[test]
fn extreme_specs_keep_state_and_bounded_numbers() {
    let s = spec(1e12, 0.0001);
    let e = evaluate(&[vec![op("a", s, 6e11)]], 0, |_| None);
    assert_eq!(e.writes[0].ttl_ms, MAX_WAIT_MS);
    assert_eq!(e.groups[0].verdicts[0].reset_ms, MAX_WAIT_MS);
    let at = e.writes[0].state.clone();
    let e = evaluate(&[vec![op("a", s, 6e11)]], 5, |_| stored(at.clone()));
    assert_eq!(e.groups[0].verdicts[0].retry_after_ms, Some(MAX_WAIT_MS));
}
// Stored as `evaluate` wrote it: (state, expiry at).
fn written(e: &Evaluation, now_ms: u64) -> Option<(BucketState, u64)> {
    e.writes.first().map(|w| (w.state.clone(), now_ms + w.ttl_ms))
}

#[test]
fn a_write_never_moves_the_expiry_earlier() {
    let (slow, fast) = (spec(100.0, 1.0), spec(100.0, 100.0));
    let e = evaluate(&[vec![op("a", slow, 100.0)]], 0, |_| None);
    assert_eq!(e.writes[0].ttl_ms, 101_000);
    // Written before any spec was recorded (an older version's state): the write keeps it.
    let bare = BucketState { tokens: 0.0, last_refill_ms: 0, ..Default::default() };
    let e = evaluate(&[vec![op("a", fast, 1.0)]], 50_000, |_| Some((bare.clone(), 400_000)));
    assert_eq!(e.writes[0].ttl_ms, 350_000, "what was left of its life");
    assert_eq!(e.groups[0].verdicts[0].kept_ms, 350_000);
    let e = evaluate(&[vec![op("a", fast, 1.0)]], 50_000, |_| Some((bare.clone(), 51_000)));
    assert_eq!(e.writes[0].ttl_ms, 2_000, "its own life when longer");
}

#[test]
fn a_bucket_lives_until_full_at_its_largest_capacity_and_slowest_rate() {
    // The small spec alone would keep the bucket 2 s; the large one needs 100 s from empty.
    let (large, small) = (spec(100.0, 1.0), spec(1.0, 1.0));
    let mut at = written(&evaluate(&[vec![op("a", large, 100.0)]], 0, |_| None), 0);
    for t in (1..=100u64).map(|s| s * 1_000) {
        let e = evaluate(&[vec![op("a", small, 1.0)]], t, |_| at.clone());
        assert!(e.groups[0].admitted, "one token a second at {t} ms");
        at = written(&e, t);
    }
    let (state, expires) = at.clone().unwrap();
    assert_eq!((state.largest_capacity, state.slowest_refill), (100.0, 1.0));
    assert_eq!(expires, 100_000 + 101_000, "empty at 100 s: full at the large capacity 100 s later");
    // Just before it expires, the large spec finds 100 tokens refilled, never more.
    let e = evaluate(&[vec![op("a", large, 100.0)]], expires - 1_000, |_| at.clone());
    assert!(e.groups[0].admitted);
    let e = evaluate(&[vec![op("a", large, 1.0)]], expires - 1_000, |_| written(&e, expires - 1_000));
    assert!(!e.groups[0].admitted, "no second burst");
}

#[test]
fn a_faster_rate_takes_effect_after_the_raise_delay() {
    let (slow, fast) = (spec(1_000.0, 1.0), spec(1_000.0, 100.0));
    let at = written(&evaluate(&[vec![op("a", slow, 1_000.0)]], 0, |_| None), 0);
    // The fast spec's first charge is pending: the bucket still refills at 1 per second.
    let e = evaluate(&[vec![op("a", fast, 1.0)]], 1_000, |_| at.clone());
    let state = e.writes[0].state.clone();
    assert_eq!((state.tokens, state.fastest_refill, state.pending_refill), (0.0, 1.0, 100.0));
    assert_eq!(state.pending_from_ms, 1_000 + RATE_RAISE_DELAY_MS);
    assert_eq!(e.groups[0].verdicts[0].fastest_refill, 100.0, "the ceiling a bound must use");
    let at = written(&e, 1_000);
    let before = refill(at.as_ref().map(|(s, _)| s), &fast, 1_000 + RATE_RAISE_DELAY_MS);
    assert_eq!(before.tokens, 6.0, "1 per second until the raise");
    let after = refill(at.as_ref().map(|(s, _)| s), &fast, 2_000 + RATE_RAISE_DELAY_MS);
    assert_eq!((after.tokens, after.fastest_refill, after.pending_refill), (106.0, 100.0, 0.0));
    // The slow spec keeps its own rate, under the raised ceiling too.
    assert_eq!(refill(at.as_ref().map(|(s, _)| s), &slow, 2_000 + RATE_RAISE_DELAY_MS).tokens, 7.0);
}

#[test]
fn a_denied_request_under_a_faster_rate_starts_the_raise() {
    let (slow, fast) = (spec(1.0, 0.001), spec(1.0, 10.0));
    let at = written(&evaluate(&[vec![op("a", slow, 1.0)]], 0, |_| None), 0);
    let e = evaluate(&[vec![op("a", fast, 1.0)]], 500, |_| at.clone());
    assert!(!e.groups[0].admitted, "the old rate is in force");
    let noted = e.writes[0].state.clone();
    assert_eq!((noted.tokens, noted.last_refill_ms), (0.0, 0), "the balance is not rewritten");
    assert_eq!((noted.pending_refill, noted.pending_from_ms), (10.0, 500 + RATE_RAISE_DELAY_MS));
    assert_eq!(e.writes[0].ttl_ms, 1_001_000, "a full life under its recorded specs");
    let later = 600 + RATE_RAISE_DELAY_MS;
    let e = evaluate(&[vec![op("a", fast, 1.0)]], later, |_| Some((noted.clone(), 1_000_500)));
    assert!(e.groups[0].admitted, "a tenth of a second at 10 per second");
}
