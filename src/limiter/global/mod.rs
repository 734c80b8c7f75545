//! Global limits in a region (`--global-url`): the buckets of rules marked `global: true` are
//! decided on this replica's shares of them ([`Share`]), which it leases from the global tier
//! and renews (`docs/src/design/global-limits.md`).
//!
//! Each replica is a leaseholder of its own (`<region>/<replica>` at the global tier), so one
//! renewal per bucket is in flight at a time by construction (the discipline's last rule). A
//! share is sized by this replica's demand beside what the others' leases record: its part of
//! the bucket, at least a sixteenth; one already near that size is renewed only every few
//! seconds. A bucket nobody here asked for lately is **parked**: its share shrinks to one
//! request's tokens with no rate, which the global tier lets live a minute, so that an idle
//! bucket costs a renewal every 40 s or so and its next request is still answered at once (and
//! sizes the share by demand again at the next round); one not asked for in five minutes is
//! given back (after ten seconds once the table is nearly full). A request for a bucket with no
//! live share here waits for a first lease, briefly (not at all while the rounds fail); one still
//! without (the global tier out of reach past the share's life) falls back: to its
//! `global_fallback: {split: N}` part in the region's store, else to a denial (the bound then
//! holds with no slack).
//!
//! The renewal loop and its protocol live in the edge (`crate::edge::region::client`); this is
//! what it renews and what decisions take (`decide`: how a request takes from it).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

mod decide;

pub(in crate::limiter) use decide::mark_fallbacks;

use crate::bucket::{is_parked, Ask, Asked, BucketSpec, Share};

/// How often shares are renewed.
pub const RENEW_EVERY: Duration = Duration::from_secs(1);
/// Most buckets held at once; a new one beyond it is denied (and counted).
pub const MAX_SHARES: usize = 100_000;
/// The smallest part of a bucket a share asks for.
const FLOOR: f64 = 1.0 / 16.0;
/// A bucket not asked for this long is given back (and forgotten after twice as long)...
const IDLE_MS: u64 = 300_000;
/// ...or this long, once the table holds nine tenths of [`MAX_SHARES`]: quiet buckets make room
/// for new ones, which would otherwise be refused.
const CROWDED_IDLE_MS: u64 = 10_000;
/// A parked share is renewed once it has less than this left to live.
const PARKED_RENEW_BEFORE_MS: u64 = 20_000;
/// A share within this part of the size its demand wants is settled: it is renewed only once it
/// has less than [`SETTLED_RENEW_BEFORE_MS`] left to live, not every round, so that a steadily
/// asked bucket costs the global tier a renewal every few seconds. A shrink beyond it is sent at
/// once (the others grow by it), and so is a growth.
const SETTLED: f64 = 0.1;
const SETTLED_RENEW_BEFORE_MS: u64 = 6_000;
/// A lease below this part of what was asked is short.
const SHORT: f64 = 0.8;
/// The window a replica's demand is counted in (over the last one and the current one). Shares
/// are renewed every second, so a demand that moves is sized by within a round or two; RLQS's
/// longer windows smooth Envoys' reports, which come every few seconds.
const DEMAND_WINDOW_MS: u64 = 1_000;

// What taking from a share found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Taken {
    /// Taken; the share's tokens after, its capacity and rate.
    Yes { tokens: f64, capacity: f64, rate: f64 },
    /// Not enough; the share's tokens, capacity and rate.
    No { tokens: f64, capacity: f64, rate: f64 },
    /// No live share here (none yet, or it lapsed).
    NoShare,
}

/// One renewal of a round.
#[derive(Debug, Clone)]
pub struct Renewal {
    /// The bucket's key.
    pub key: String,
    /// The domain and entries naming it at the global tier.
    pub domain: String,
    /// The descriptor entries.
    pub entries: Vec<(String, String)>,
    /// What is asked.
    pub ask: Ask,
    /// This replica's demand, tokens per second.
    pub demand: f64,
}

/// The global tier's answer for one bucket.
#[derive(Debug, Clone, Copy)]
pub struct Granted {
    /// The bucket: capacity, rate, tokens per request.
    pub bucket: (f64, f64, u64),
    /// The lease set.
    pub capacity: f64,
    /// Its rate.
    pub rate: f64,
    /// What the other leaseholders and RLS at the global tier asked lately, per second.
    pub others_demand: f64,
    /// How long the lease lives at the global tier after the renewal arrived, in milliseconds.
    pub ttl_ms: u64,
}

/// This replica's shares of global buckets.
pub struct GlobalShares {
    leaseholder: String,
    first_lease_wait: Duration,
    table: Mutex<HashMap<String, Entry>>,
    /// Woken when a bucket wants its first lease now.
    pub wanted: tokio::sync::Notify,
    /// Sent after every round (its time, ms).
    pub renewed: tokio::sync::watch::Sender<u64>,
    // Since when the replica has been cut off, in clock ms: once a round fails, the time of the
    // last one answered (0: the last one reached the global tier).
    cut_off_since_ms: AtomicU64,
    // When a round was last answered (ms; 0: never).
    answered_ms: AtomicU64,
}

#[derive(Debug)]
struct Entry {
    domain: String,
    entries: Vec<(String, String)>,
    share: Option<Share>,
    // The bucket as this region's rule states it, and the first request's tokens: what its
    // first lease is sized by, before the global tier has told the bucket.
    first: (BucketSpec, f64),
    asked: Asked<DEMAND_WINDOW_MS>,
    pending: Option<Ask>,
    // From the last answer: the bucket and the others' demand.
    bucket: Option<(f64, f64, u64)>,
    others_demand: f64,
    used_ms: u64,
}

impl GlobalShares {
    /// Shares leased as `leaseholder` (`<region>/<replica>`), a request for a bucket without a
    /// live share waiting up to `first_lease_wait` for its first lease.
    pub fn new(leaseholder: String, first_lease_wait: Duration) -> Self {
        GlobalShares {
            leaseholder,
            first_lease_wait,
            table: Mutex::default(),
            wanted: tokio::sync::Notify::new(),
            renewed: tokio::sync::watch::Sender::new(0),
            cut_off_since_ms: AtomicU64::new(0),
            answered_ms: AtomicU64::new(0),
        }
    }

    /// The name this replica leases under.
    pub fn leaseholder(&self) -> &str {
        &self.leaseholder
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    // Takes `need` tokens of bucket `key` (named `entries` in `domain` at the global tier, `spec`
    // as this region's rule states it) at `now_ms`, counting them as demand.
    fn take(
        &self,
        key: &str,
        (domain, entries): (&str, &[(&str, &str)]),
        spec: BucketSpec,
        need: f64,
        now_ms: u64,
    ) -> Taken {
        let mut table = self.table();
        if !table.contains_key(key) {
            if table.len() >= MAX_SHARES {
                metrics::counter!("tollgate_global_shares_refused_total").increment(1);
                return Taken::NoShare;
            }
            let owned = entries.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
            table.insert(
                key.to_owned(),
                Entry {
                    domain: domain.to_owned(),
                    entries: owned,
                    share: None,
                    first: (spec, need),
                    asked: Asked::default(),
                    pending: None,
                    bucket: None,
                    others_demand: 0.0,
                    used_ms: now_ms,
                },
            );
        }
        let entry = table.get_mut(key).expect("inserted");
        entry.used_ms = now_ms;
        entry.asked.record(now_ms, need.max(0.0));
        let Some(share) = entry.share.as_mut().filter(|s| s.alive(now_ms)) else { return Taken::NoShare };
        let taken = share.take(need, now_ms);
        let (tokens, capacity, rate) = (share.tokens, share.capacity, share.refill_per_second);
        if taken {
            Taken::Yes { tokens, capacity, rate }
        } else {
            Taken::No { tokens, capacity, rate }
        }
    }

    // Gives back `tokens` a request took from bucket `key` and did not use.
    fn give_back(&self, key: &str, tokens: f64, now_ms: u64) {
        if let Some(share) = self.table().get_mut(key).and_then(|e| e.share.as_mut()) {
            share.give_back(tokens, now_ms);
        }
    }

    /// The round's renewals at `now_ms`: every bucket asked for lately, sized by demand (shrinks
    /// applied to the shares now, before they are asked for); a parking of each one with a live
    /// share that nothing asked for lately, and a renewal of a parked one near its end; a release
    /// of each one idle for [`IDLE_MS`] (then forgotten).
    pub fn due(&self, now_ms: u64) -> Vec<Renewal> {
        let mut table = self.table();
        let mut renewals = Vec::new();
        let idle_ms = if table.len() * 10 >= MAX_SHARES * 9 { CROWDED_IDLE_MS } else { IDLE_MS };
        table.retain(|_, e| e.used_ms + 2 * idle_ms > now_ms || e.pending.is_some());
        for (key, e) in table.iter_mut().filter(|(_, e)| e.pending.is_none()) {
            let demand = e.asked.per_second(now_ms);
            let idle = e.used_ms + idle_ms <= now_ms;
            if idle && e.share.is_none() {
                continue;
            }
            let live = e.share.filter(|s| s.alive(now_ms));
            let (capacity, rate) = match e.bucket {
                _ if idle => (0.0, 0.0),
                // Not answered yet: a young share, as an RLQS replica's first lease: a sixteenth of
                // the bucket (at least the first request's tokens) beside its whole rate, of which
                // the global tier gives a fresh lease most of what the others leave. Every
                // region's replicas ask for a new bucket at once, and the first to arrive took the
                // whole capacity when it asked for all of it, whatever its demand: a quiet
                // region's share then lost it when it shrank to its part (measured: a bucket of
                // 50 asked 80/15/5 by three regions at 3x its rate admitted 11 in its first
                // second, 0.943 of its bound over 30 s, when ap's replica took it, 65 and 0.987
                // when eu's did). Its answer is followed by a round at once, sized by demand.
                None => {
                    let (spec, need) = e.first;
                    ((spec.capacity() * FLOOR).max(need).min(spec.capacity()), spec.refill_per_second())
                }
                // Quiet: parked, until its next request; nothing to park without a live share.
                Some((_, _, cost)) if demand <= 0.0 => match live {
                    None => continue,
                    Some(s)
                        if is_parked(s.capacity, s.refill_per_second, cost)
                            && s.until_ms > now_ms + PARKED_RENEW_BEFORE_MS =>
                    {
                        continue
                    }
                    Some(_) => (cost as f64, 0.0),
                },
                Some((c, r, cost)) => {
                    let total = demand + e.others_demand;
                    let part = if total <= 0.0 { FLOOR } else { (demand / total).max(FLOOR) };
                    let want = ((c * part).max(cost as f64).min(c), r * part);
                    let near = |have: f64, want: f64| (want - have).abs() <= SETTLED * have.max(want);
                    match live {
                        Some(s)
                            if near(s.capacity, want.0)
                                && near(s.refill_per_second, want.1)
                                && s.until_ms > now_ms + SETTLED_RENEW_BEFORE_MS =>
                        {
                            continue
                        }
                        _ => want,
                    }
                }
            };
            let ask = Share::ask(&mut e.share, capacity, rate, now_ms);
            if idle {
                e.share = None;
            }
            e.pending = Some(ask);
            renewals.push(Renewal {
                key: key.clone(),
                domain: e.domain.clone(),
                entries: e.entries.clone(),
                ask,
                demand,
            });
        }
        renewals
    }

    /// The answers to a round's renewals (`None`: none for that bucket), arriving at `now_ms`.
    /// True when a lease came back short of what was asked (the others hold it, or a first lease
    /// could not be sized): the next round should come soon, since the others shrink theirs at
    /// their own rounds.
    pub fn answered(&self, answers: Vec<(String, Option<Granted>)>, now_ms: u64) -> bool {
        let mut table = self.table();
        let mut short = false;
        for (key, granted) in answers {
            let Some(e) = table.get_mut(&key) else { continue };
            let Some(ask) = e.pending.take() else { continue };
            match granted {
                Some(g) => {
                    // A young share's answer: sized by demand at the next round, soon.
                    short |= e.bucket.is_none();
                    e.bucket = Some(g.bucket);
                    e.others_demand = g.others_demand;
                    short |= g.capacity < ask.capacity * SHORT || g.rate < ask.refill_per_second * SHORT;
                    if ask.capacity > 0.0 || ask.refill_per_second > 0.0 {
                        Share::answer(&mut e.share, &ask, g.capacity, g.rate, now_ms, g.ttl_ms);
                    }
                }
                // No global rule limits it (there): no share, asked again next round.
                None => e.share = None,
            }
        }
        metrics::gauge!("tollgate_global_shares")
            .set(table.values().filter(|e| e.share.is_some()).count() as f64);
        drop(table);
        self.cut_off_since_ms.store(0, Ordering::Relaxed);
        self.answered_ms.store(now_ms, Ordering::Relaxed);
        self.renewed.send_replace(now_ms);
        short
    }

    /// How long, as of `now_ms`, this replica's rounds have not reached the global tier (`None`:
    /// the last one did).
    pub fn cut_off_for_ms(&self, now_ms: u64) -> Option<u64> {
        let since = self.cut_off_since_ms.load(Ordering::Relaxed);
        (since > 0).then(|| now_ms.saturating_sub(since))
    }

    /// A round, at `now_ms`, that got no answer: its renewals are dropped (the shares keep their
    /// life), and the replica counts as cut off since the last round that was answered (rounds
    /// are sparse while the shares need none: counting from the first failed round read 4 s ten
    /// seconds into a cut), or since now if none ever was.
    pub fn failed(&self, renewals: &[Renewal], now_ms: u64) {
        let since = match self.answered_ms.load(Ordering::Relaxed) {
            0 => now_ms,
            answered => answered,
        };
        let _ = self.cut_off_since_ms.compare_exchange(0, since.max(1), Ordering::Relaxed, Ordering::Relaxed);
        let mut table = self.table();
        for r in renewals {
            if let Some(e) = table.get_mut(&r.key) {
                e.pending = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> BucketSpec {
        BucketSpec::new(10.0, 1.0).unwrap()
    }

    // Every bucket taken once at 0 and granted a share of (1 token, 0.1/s) of a (10, 1) bucket.
    fn shares_with(buckets: usize) -> GlobalShares {
        let shares = GlobalShares::new("eu/r".into(), Duration::ZERO);
        for i in 0..buckets {
            shares.take(&format!("k{i}"), ("api", &[("tenant", "t")]), spec(), 1.0, 0);
        }
        let granted =
            Granted { bucket: (10.0, 1.0, 1), capacity: 1.0, rate: 0.1, others_demand: 0.0, ttl_ms: 60_000 };
        let answers = shares.due(0).into_iter().map(|r| (r.key, Some(granted))).collect();
        shares.answered(answers, 100);
        shares
    }

    #[test]
    fn cut_off_counts_from_the_last_round_answered() {
        let shares = shares_with(1);
        assert_eq!(shares.cut_off_for_ms(4_000), None, "the last round was answered");
        shares.failed(&[], 5_000);
        shares.failed(&[], 7_000);
        assert_eq!(
            shares.cut_off_for_ms(8_000),
            Some(7_900),
            "since the answer at 100, not the first failure"
        );
        shares.answered(Vec::new(), 9_000);
        assert_eq!(shares.cut_off_for_ms(9_500), None);
        let never = GlobalShares::new("eu/r".into(), Duration::ZERO);
        never.failed(&[], 1_000);
        assert_eq!(never.cut_off_for_ms(3_000), Some(2_000), "never answered: since the first failure");
    }

    #[test]
    fn quiet_buckets_are_parked_and_given_back_sooner_when_the_table_is_nearly_full() {
        // Few buckets: quiet ones are parked (one request's tokens, no rate), not given back.
        let roomy = shares_with(10);
        let asks: Vec<Ask> = roomy.due(15_000).into_iter().map(|r| r.ask).collect();
        assert_eq!(asks.len(), 10);
        assert!(asks.iter().all(|a| (a.capacity, a.refill_per_second) == (1.0, 0.0)), "{:?}", asks[0]);
        // Nine tenths of the most: quiet for 10 s is enough to be given back.
        let crowded = shares_with(MAX_SHARES * 9 / 10);
        let asks: Vec<Ask> = crowded.due(15_000).into_iter().map(|r| r.ask).collect();
        assert_eq!(asks.len(), MAX_SHARES * 9 / 10);
        assert!(asks.iter().all(|a| (a.capacity, a.refill_per_second) == (0.0, 0.0)), "{:?}", asks[0]);
    }

    #[test]
    fn a_settled_share_is_renewed_only_near_its_end() {
        // One bucket, asked steadily, holding all of it: what its demand wants.
        let shares = GlobalShares::new("eu/r".into(), Duration::ZERO);
        let ask = |at: u64| shares.take("k", ("api", &[("tenant", "t")]), spec(), 1.0, at);
        ask(0);
        let whole =
            Granted { bucket: (10.0, 1.0, 1), capacity: 10.0, rate: 1.0, others_demand: 0.0, ttl_ms: 10_000 };
        let first = shares.due(0).into_iter().map(|r| (r.key, Some(whole))).collect();
        shares.answered(first, 100);
        let mut renewed_at = Vec::new();
        for at in (1_000..=9_000).step_by(1_000) {
            ask(at - 500);
            if !shares.due(at).is_empty() {
                renewed_at.push(at);
                break;
            }
        }
        assert_eq!(renewed_at, [4_000], "settled: renewed once no more than 6 s of its 10 s life is left");
    }
}
