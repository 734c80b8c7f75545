//! The arithmetic of leases, free of protocol and I/O: demand estimates, splitting a grant among
//! Envoys, and what an Envoy can provably no longer use.
//!
//! Every number here is in requests (one request takes `cost` tokens of the bucket), and every
//! time in milliseconds of an injected [`crate::clock::Clock`].
//!
//! **Grants.** Each tick, an Envoy gets a fresh local bucket of `g` requests that does not refill
//! (Envoy: DENY_ALL, then a token bucket of `g` in the same response, which starts full). So
//! between two ticks it admits at most `g`, and `g` requests' worth of tokens were taken from the
//! shared bucket before the grant was sent: whatever any Envoy admits is covered.
//!
//! **Refunds.** When a grant is replaced, what the Envoy did not use of it is lost to it; the
//! server learns how much it used only from the next usage report, which counts every request
//! allowed since the previous report. [`Ledger::take_refundable`] is what the reports prove unused:
//! the grants replaced before a report, minus everything the reports say was allowed, minus what
//! was refunded already. The reports count usage of the live grant too, so this never exceeds
//! the truth.
//!
//! **Streams that close.** What an Envoy may still have used when its stream closes
//! ([`Ledger::unsettled`]) is parked; a later stream of the same Envoy whose first report counts
//! everything since the closed stream's last one takes it as its first grant, so the same
//! arithmetic settles it.

use std::collections::HashMap;
use std::hash::Hash;

/// How much of the last estimate survives a new report (an exponential moving average).
const SMOOTHING: f64 = 0.5;

/// An Envoy's demand for one bucket, in requests per second (allowed and denied alike).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    rate: f64,
    known: bool,
}

impl Demand {
    /// Before any report with a duration: assume `guess` (the bucket's own rate: it may want
    /// everything).
    pub fn unknown(guess: f64) -> Demand {
        Demand { rate: guess, known: false }
    }

    /// Folds in a report of `allowed + denied` requests over `elapsed_ms`.
    pub fn report(&mut self, requests: u64, elapsed_ms: u64) {
        if elapsed_ms == 0 {
            return;
        }
        let observed = requests as f64 * 1000.0 / elapsed_ms as f64;
        self.rate = if self.known { SMOOTHING * self.rate + (1.0 - SMOOTHING) * observed } else { observed };
        self.known = true;
    }

    /// Requests per second.
    pub fn rate(&self) -> f64 {
        self.rate
    }
}

/// Splits `total` requests among members in proportion to their demands, never giving one
/// more than its cap. What a member is owed or was given beyond its share (fractions of a
/// request) is carried to the next split in `owed`, so that small shares add up over ticks
/// instead of rounding to nothing. Whole requests go to the most entitled members first, and
/// those left after everyone's whole share to the largest fractions, so that when a tick brings
/// fewer requests than members, who waited longest gets them. What caps leave is returned as
/// the second value.
pub fn split<K: Eq + Hash + Clone>(
    total: u64,
    members: &[(K, f64, u64)],
    owed: &mut HashMap<K, f64>,
) -> (Vec<(K, u64)>, u64) {
    let demand: f64 = members.iter().map(|(_, d, _)| d.max(0.0)).sum();
    let entitled: Vec<f64> = members
        .iter()
        .map(|(key, d, _)| {
            let share = if demand > 0.0 {
                total as f64 * d.max(0.0) / demand
            } else {
                total as f64 / members.len() as f64
            };
            owed.get(key).copied().unwrap_or(0.0) + share
        })
        .collect();
    let mut grants = vec![0u64; members.len()];
    let mut left = total;
    let mut order: Vec<usize> = (0..members.len()).collect();
    order.sort_by(|&a, &b| entitled[b].total_cmp(&entitled[a]));
    for &i in &order {
        let whole = (entitled[i].max(0.0).floor() as u64).min(members[i].2).min(left);
        grants[i] = whole;
        left -= whole;
    }
    let fractions: Vec<f64> = entitled.iter().zip(&grants).map(|(e, g)| e - *g as f64).collect();
    order.sort_by(|&a, &b| fractions[b].total_cmp(&fractions[a]));
    for &i in &order {
        if left > 0 && grants[i] < members[i].2 && fractions[i] > 0.0 {
            grants[i] += 1;
            left -= 1;
        }
    }
    for (i, (key, _, _)) in members.iter().enumerate() {
        owed.insert(key.clone(), (entitled[i] - grants[i] as f64).clamp(-1.0, 1.0));
    }
    owed.retain(|k, _| members.iter().any(|(m, _, _)| m == k));
    (members.iter().zip(grants).map(|((key, _, _), g)| (key.clone(), g)).collect(), left)
}

/// One Envoy's account with one bucket: grants sent, usage reported, refunds made.
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    // (when sent, requests), oldest first; a grant is dead once the next one is sent.
    grants: Vec<(u64, u64)>,
    // Requests in grants that were replaced, and everything reported allowed, since the start.
    dead: u64,
    allowed: u64,
    refunded: u64,
}

impl Ledger {
    /// A grant of `requests` sent at `at_ms`, replacing the previous one.
    pub fn granted(&mut self, at_ms: u64, requests: u64) {
        self.grants.push((at_ms, requests));
    }

    /// A report, received at `at_ms`, of `allowed` requests since the previous one. Grants
    /// replaced more than `margin_ms` before it (so that the Envoy had the replacement before it
    /// counted) are settled: their requests count as dead.
    pub fn reported(&mut self, at_ms: u64, allowed: u64, margin_ms: u64) {
        self.allowed = self.allowed.saturating_add(allowed);
        let settled = at_ms.saturating_sub(margin_ms);
        // Every grant but the last whose successor was sent before `settled` is dead.
        while self.grants.len() > 1 && self.grants[1].0 <= settled {
            self.dead = self.dead.saturating_add(self.grants.remove(0).1);
        }
    }

    /// Requests that the reports prove unused and that were not refunded yet; records them as
    /// refunded.
    pub fn take_refundable(&mut self) -> u64 {
        let unused = self.dead.saturating_sub(self.allowed).saturating_sub(self.refunded);
        self.refunded += unused;
        unused
    }

    /// Requests granted and neither reported used nor refunded: what the Envoy may still have
    /// used, or may still use, of its grants.
    pub fn unsettled(&self) -> u64 {
        self.total_granted().saturating_sub(self.allowed).saturating_sub(self.refunded)
    }

    /// Requests granted in all.
    pub fn total_granted(&self) -> u64 {
        self.grants.iter().fold(self.dead, |sum, (_, r)| sum.saturating_add(*r))
    }

    /// Requests reported allowed in all.
    pub fn total_allowed(&self) -> u64 {
        self.allowed
    }
}

/// The most requests one Envoy is given for one tick: twice what it asked for in a tick, at
/// least one, so that a quiet Envoy does not sit on budget others could use.
pub fn cap(demand: f64, tick_ms: u64) -> u64 {
    (demand * tick_ms as f64 / 1000.0 * 2.0).ceil().max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demand_is_smoothed_per_second() {
        let mut d = Demand::unknown(10.0);
        d.report(1, 0);
        assert_eq!(d.rate(), 10.0, "a report without a duration tells nothing");
        d.report(500, 5_000);
        assert_eq!(d.rate(), 100.0);
        d.report(0, 5_000);
        assert_eq!(d.rate(), 50.0);
    }

    #[test]
    fn splits_follow_demand_and_carry_fractions() {
        let mut owed = HashMap::new();
        let members = [("a", 90.0, 100), ("b", 5.0, 100), ("c", 5.0, 100)];
        let mut totals: HashMap<&str, u64> = HashMap::new();
        for _ in 0..10 {
            let (grants, left) = split(10, &members, &mut owed);
            for (k, g) in grants {
                *totals.entry(k).or_default() += g;
            }
            assert!(left <= 1);
        }
        assert_eq!(totals["a"], 90);
        assert!(totals["b"] >= 4 && totals["c"] >= 4, "small shares add up: {totals:?}");
    }

    #[test]
    fn a_request_a_tick_alternates_between_equal_members() {
        // One request per tick for two members of equal demand: each gets every other one,
        // whatever their order.
        let mut owed = HashMap::new();
        let mut totals: HashMap<&str, u64> = HashMap::new();
        for _ in 0..10 {
            let (grants, left) = split(1, &[("a", 5.0, 5), ("b", 5.0, 5)], &mut owed);
            assert_eq!(left, 0, "the request is given out");
            for (k, g) in grants {
                *totals.entry(k).or_default() += g;
            }
        }
        assert_eq!((totals["a"], totals["b"]), (5, 5));
    }

    #[test]
    fn caps_hold_and_return_the_rest() {
        let mut owed = HashMap::new();
        let (grants, left) = split(10, &[("a", 1.0, 2), ("b", 1.0, 3)], &mut owed);
        assert_eq!(grants, vec![("a", 2), ("b", 3)]);
        assert_eq!(left, 5);
    }

    #[test]
    fn only_settled_unused_grants_are_refundable() {
        let mut l = Ledger::default();
        l.granted(0, 10);
        l.granted(1_000, 10);
        l.granted(2_000, 10);
        // A report at 2.1 s: grant 1 (replaced at 1 s) is settled; grant 2 was replaced at 2 s,
        // within the margin, so it is not. 7 allowed so far.
        l.reported(2_100, 7, 200);
        assert_eq!(l.take_refundable(), 3);
        assert_eq!(l.take_refundable(), 0, "refunded once");
        l.reported(5_000, 12, 200);
        assert_eq!(l.take_refundable(), 0, "grant 2's 10 minus the 12 more allowed");
        assert_eq!((l.total_granted(), l.total_allowed()), (30, 19));
        assert_eq!(l.unsettled(), 8, "30 granted, 19 used, 3 refunded");
    }

    #[test]
    fn a_parked_lease_settles_as_a_first_grant() {
        // A closed stream left 12 unsettled; the next stream's first report says 5 were used
        // since, then a grant of 4 replaces the parked one; the report after settles it.
        let mut l = Ledger::default();
        l.granted(0, 12);
        l.reported(100, 5, 200);
        assert_eq!(l.take_refundable(), 0, "the parked grant is still live");
        l.granted(200, 4);
        l.reported(5_000, 3, 200);
        assert_eq!(l.take_refundable(), 4, "12 parked, 5 + 3 used: 4 unused");
        assert_eq!(l.unsettled(), 4, "the live grant");
    }
}
