//! A region's share of a global bucket: the regional bucket sized by the lease its region holds
//! on the bucket at the global tier ([`super::lease`]), for limits that hold across regions
//! (`docs/src/design/global-limits.md`).
//!
//! The global tier sets every region's lease so that its own balance plus every lease's capacity
//! stays within the bucket's capacity, and their rates within its rate. A share keeps its region
//! inside its lease whatever the delays between them, by a discipline each of whose rules
//! `tests/global_props.rs` shows to be needed:
//!
//! * **Shrinks first**: [`Share::ask`] applies a smaller capacity or rate before the renewal that
//!   asks for it leaves, and [`Share::answer`] applies a growth only when the global tier's answer
//!   arrives, crediting the tokens the lease grew by (which the global tier took from its balance).
//! * **Local life from the send**: a share stops counting `ttl` after the renewal that set it was
//!   sent; the global tier's lease lives `ttl` after that renewal arrived, so the region always
//!   stops spending first, with no delay bound to configure.
//! * **Fresh after a lapse**: a region with no live share asks `fresh`; the global tier takes the
//!   lease's whole capacity again and the share starts full.
//! * **One renewal in flight**: answers apply in the order their renewals were sent (the caller
//!   keeps one outstanding and drops answers to older ones).
//!
//! A share refills at exactly its lease's rate and holds at most its capacity: unlike a bucket
//! written under several specs ([`super`]), it has one spec, the lease's, which only the region
//! changes.

/// A region's bucket for one global bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share {
    /// Tokens it holds at most: the lease's capacity.
    pub capacity: f64,
    /// Tokens per second it refills: the lease's rate.
    pub refill_per_second: f64,
    /// Tokens it holds, as of `at_ms`.
    pub tokens: f64,
    /// When `tokens` was brought up to date, in clock milliseconds.
    pub at_ms: u64,
    /// When it stops counting: `ttl` after the renewal that set it was sent.
    pub until_ms: u64,
}

/// A renewal, as [`Share::ask`] makes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask {
    /// The capacity asked for.
    pub capacity: f64,
    /// The rate asked for, per second.
    pub refill_per_second: f64,
    /// The region has no live share: the global tier takes the lease's whole capacity again.
    pub fresh: bool,
    /// When it was sent, in clock milliseconds.
    pub sent_ms: u64,
}

/// Whether a lease of `capacity` and `refill_per_second` on a bucket taking `cost` tokens a
/// request is parked: no rate, at most one request's tokens. A region keeps such a share of a
/// bucket nothing asked for lately, and the global tier lets such a lease live longer.
pub fn is_parked(capacity: f64, refill_per_second: f64, cost: u64) -> bool {
    refill_per_second == 0.0 && capacity <= cost as f64
}

impl Share {
    /// Whether the share counts at `now_ms`.
    pub fn alive(&self, now_ms: u64) -> bool {
        self.until_ms > now_ms
    }

    fn refill(&mut self, now_ms: u64) {
        if now_ms > self.at_ms {
            let added = (now_ms - self.at_ms) as f64 * self.refill_per_second / 1000.0;
            self.tokens = self.capacity.min(self.tokens + added);
            self.at_ms = now_ms;
        }
    }

    /// A renewal asking for `capacity` and `refill_per_second`, sent at `now_ms`: what it asks,
    /// with any shrink applied to `share` first.
    pub fn ask(share: &mut Option<Share>, capacity: f64, refill_per_second: f64, now_ms: u64) -> Ask {
        let live = share.as_mut().filter(|s| s.alive(now_ms));
        let fresh = live.is_none();
        if let Some(s) = live {
            s.refill(now_ms);
            if capacity < s.capacity {
                s.capacity = capacity;
                s.tokens = s.tokens.min(capacity);
            }
            s.refill_per_second = s.refill_per_second.min(refill_per_second);
        }
        Ask { capacity, refill_per_second, fresh, sent_ms: now_ms }
    }

    /// The global tier's answer to `ask` (the lease it set: `capacity`, `refill_per_second`),
    /// arriving at `now_ms`, the lease living `ttl_ms` at the global tier.
    pub fn answer(
        share: &mut Option<Share>,
        ask: &Ask,
        capacity: f64,
        refill_per_second: f64,
        now_ms: u64,
        ttl_ms: u64,
    ) {
        let until_ms = ask.sent_ms.saturating_add(ttl_ms);
        match share.as_mut().filter(|_| !ask.fresh) {
            // A growth brings the tokens the global tier took for it.
            Some(s) => {
                s.refill(now_ms);
                let grew = (capacity - s.capacity).max(0.0);
                s.capacity = capacity;
                s.tokens = capacity.min(s.tokens + grew);
                s.refill_per_second = refill_per_second;
                s.until_ms = until_ms;
            }
            // A fresh lease: the global tier took its whole capacity.
            None => {
                *share =
                    Some(Share { capacity, refill_per_second, tokens: capacity, at_ms: now_ms, until_ms })
            }
        }
    }

    /// Takes `need` tokens at `now_ms` if the share is alive and holds them.
    pub fn take(&mut self, need: f64, now_ms: u64) -> bool {
        if !self.alive(now_ms) {
            return false;
        }
        self.refill(now_ms);
        if self.tokens < need {
            return false;
        }
        self.tokens -= need;
        true
    }

    /// Gives back `tokens` a request took and did not use (it was denied elsewhere), up to the
    /// capacity.
    pub fn give_back(&mut self, tokens: f64, now_ms: u64) {
        self.refill(now_ms);
        self.tokens = self.capacity.min(self.tokens + tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_growth_credits_what_it_grew_by_and_a_shrink_applies_before_it_is_asked() {
        let mut share = None;
        let first = Share::ask(&mut share, 10.0, 2.0, 0);
        assert!(first.fresh);
        Share::answer(&mut share, &first, 4.0, 2.0, 100, 10_000);
        let s = share.unwrap();
        assert_eq!((s.tokens, s.until_ms), (4.0, 10_000), "fresh: full, alive from the send");
        assert!(share.as_mut().unwrap().take(4.0, 100));
        let grow = Share::ask(&mut share, 10.0, 2.0, 1_100);
        assert!(!grow.fresh);
        // 2 tokens refilled by the answer at 1,600 (1.5 s at 2/s = 3), and 6 grown.
        Share::answer(&mut share, &grow, 10.0, 2.0, 1_600, 10_000);
        assert_eq!(share.unwrap().tokens, 3.0 + 6.0);
        let shrink = Share::ask(&mut share, 1.0, 0.5, 2_000);
        let s = share.unwrap();
        assert_eq!((s.capacity, s.tokens, s.refill_per_second), (1.0, 1.0, 0.5), "before the answer");
        Share::answer(&mut share, &shrink, 1.0, 0.5, 2_300, 10_000);
        assert!(!share.unwrap().alive(12_000), "10 s after the send");
        assert!(!share.as_mut().unwrap().take(1.0, 12_000));
    }
}
