//! The arithmetic of assignments, free of protocol and I/O: demand estimates, and a stream's
//! lease on a bucket as the Envoy's local token bucket.
//!
//! Every demand here is in requests per second; leases are in tokens (one request takes `cost`).
//!
//! **Local buckets.** Each Envoy gets a refilling token bucket the size of its stream's lease:
//! `max_tokens` requests, refilling `tokens_per_fill` per [`FILL_INTERVAL`] (Envoy 1.40 refills
//! continuously at that ratio), rounded down, so it never exceeds the lease. One fill interval for
//! every local bucket, since Envoy compares only `max_tokens`, `tokens_per_fill` and the interval's
//! nanos when it decides that a new assignment is the one it has: a changed rate always changes
//! `tokens_per_fill`.

use std::time::Duration;

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

/// The refill interval of every local bucket: an hour, so that a rate of one request an hour is
/// still a whole token per fill.
pub const FILL_INTERVAL: Duration = Duration::from_secs(3600);

/// An Envoy's local token bucket, in requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalBucket {
    /// Its capacity (Envoy's `max_tokens`); at least 1.
    pub requests: u32,
    /// Requests it refills per [`FILL_INTERVAL`]; at least 1.
    pub per_fill: u32,
}

impl LocalBucket {
    /// The bucket of `tokens` refilling `per_second` (in a bucket's tokens) at `cost` tokens a
    /// request, rounded down; `None` when that is not a whole request or not a request per fill
    /// interval (Envoy's token buckets need both above 0).
    pub fn of(tokens: f64, per_second: f64, cost: u64) -> Option<LocalBucket> {
        let cost = cost.max(1) as f64;
        let requests = (tokens / cost).floor().min(f64::from(u32::MAX));
        let per_fill = (per_second / cost * FILL_INTERVAL.as_secs_f64()).floor().min(f64::from(u32::MAX));
        (requests >= 1.0 && per_fill >= 1.0)
            .then_some(LocalBucket { requests: requests as u32, per_fill: per_fill as u32 })
    }
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
    fn local_buckets_round_down_to_whole_requests() {
        assert_eq!(LocalBucket::of(10.0, 1.0, 1), Some(LocalBucket { requests: 10, per_fill: 3600 }));
        assert_eq!(LocalBucket::of(9.9, 0.5, 3), Some(LocalBucket { requests: 3, per_fill: 600 }));
        assert_eq!(LocalBucket::of(0.9, 1.0, 1), None, "less than a request");
        assert_eq!(LocalBucket::of(5.0, 1e-4, 1), None, "less than a request an hour");
        let a = LocalBucket::of(7.5, 2.0 / 3.0, 1).unwrap();
        assert!(f64::from(a.requests) <= 7.5 && f64::from(a.per_fill) / 3600.0 <= 2.0 / 3.0);
    }
}
