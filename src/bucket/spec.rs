//! A bucket's size: capacity and refill rate, and the waits and lifetimes that follow from them.
//!
//! Only [`BucketSpec::new`] makes a spec, so every spec in the program is finite, refills at a
//! rate both the Rust and the Lua arithmetic represent alike, and yields bounded waits.

use serde::Serialize;

/// Capacity (largest burst) and sustained refill rate of one bucket.
///
/// Only [`BucketSpec::new`] makes one, so every spec in the program is finite and sane.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BucketSpec {
    capacity: f64,
    refill_per_second: f64,
}

/// Largest accepted capacity: beyond 2^53 a balance is no longer exact in an f64.
pub const MAX_CAPACITY: f64 = 1e15;

/// Longest wait, reset or TTL reported or stored, in milliseconds (2^52 ms, about 142,000
/// years). An expiry time (now + TTL) then stays below 2^53, exact in an f64 and in Lua's
/// numbers and far inside what Redis's `PEXPIREAT` accepts, so a bucket that would take longer
/// to fill keeps its state for good instead of overflowing.
pub const MAX_WAIT_MS: u64 = 1 << 52;

/// Smallest accepted refill rate, in tokens per second: one token in about 31.7 years. Slower
/// rates would leave the per-millisecond rate, and what it adds over an interval, at the edge of
/// what a double represents, where the two twins of the arithmetic could round apart; the
/// slowest rate a `rate_limit` can say (1 per year) is 30 times this.
pub const MIN_REFILL_PER_SECOND: f64 = 1e-9;

/// Why a capacity and rate make no bucket.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// The capacity is negative, not finite, or above [`MAX_CAPACITY`].
    #[error("capacity must be between 0 and {MAX_CAPACITY:e}, got {0}")]
    Capacity(f64),
    /// The rate is negative or not finite.
    #[error("refill_per_second must be a non-negative number, got {0}")]
    Rate(f64),
    /// A rate above zero but below [`MIN_REFILL_PER_SECOND`].
    #[error("refill_per_second must be 0 or at least {MIN_REFILL_PER_SECOND:e} (one token in about 31.7 years), got {0:e}")]
    TooSlow(f64),
    /// A bucket with tokens that never refills.
    #[error(
        "refill_per_second must be above 0 (a bucket that never refills is an allowance, not a rate limit)"
    )]
    NeverRefills,
}

impl BucketSpec {
    /// A checked bucket: finite, non-negative, and refilling unless it is empty for good.
    pub fn new(capacity: f64, refill_per_second: f64) -> Result<BucketSpec, SpecError> {
        if !capacity.is_finite() || !(0.0..=MAX_CAPACITY).contains(&capacity) {
            return Err(SpecError::Capacity(capacity));
        }
        if !refill_per_second.is_finite() || refill_per_second < 0.0 {
            return Err(SpecError::Rate(refill_per_second));
        }
        if refill_per_second > 0.0 && refill_per_second < MIN_REFILL_PER_SECOND {
            return Err(SpecError::TooSlow(refill_per_second));
        }
        if refill_per_second == 0.0 && capacity > 0.0 {
            return Err(SpecError::NeverRefills);
        }
        Ok(BucketSpec { capacity, refill_per_second })
    }

    /// Most tokens the bucket can hold; a new bucket starts full.
    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    /// Tokens added per second while the bucket is below capacity.
    pub fn refill_per_second(&self) -> f64 {
        self.refill_per_second
    }

    /// Tokens per millisecond, the unit the algorithm works in.
    pub fn rate_per_ms(&self) -> f64 {
        self.refill_per_second / 1000.0
    }

    /// Milliseconds until a balance of `from` tokens has grown to `to` (0 if it already has);
    /// `None` if it never will (`to` above the capacity, or no refill).
    pub fn wait_ms(&self, from: f64, to: f64) -> Option<u64> {
        wait_between(self.capacity, self.rate_per_ms(), from, to)
    }

    /// Milliseconds until a balance of `from` tokens is full again.
    pub fn reset_ms(&self, from: f64) -> u64 {
        self.wait_ms(from, self.capacity).unwrap_or(0)
    }
}

/// Milliseconds until a balance of `from` tokens has grown to `to` in a bucket of `capacity`
/// refilling `rate_per_ms` (0 if it already has); `None` if it never will.
pub(super) fn wait_between(capacity: f64, rate_per_ms: f64, from: f64, to: f64) -> Option<u64> {
    if from >= to {
        return Some(0);
    }
    if to > capacity || rate_per_ms <= 0.0 {
        return None;
    }
    Some(wait(to - from, rate_per_ms))
}

/// ceil(deficit / rate) in whole milliseconds, capped at [`MAX_WAIT_MS`]; the Lua script computes
/// the same.
pub(super) fn wait(deficit: f64, rate_per_ms: f64) -> u64 {
    let ms = (deficit / rate_per_ms).ceil();
    if ms >= MAX_WAIT_MS as f64 {
        MAX_WAIT_MS
    } else {
        ms as u64
    }
}
