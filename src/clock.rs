//! Time as the embedded store sees it.
//!
//! The Redis backend never asks this module: its clock is the Redis server's `TIME`, shared by
//! every tollgate replica. The in-process [`MemoryStore`](crate::store::MemoryStore) needs a clock
//! of its own, and tests need to move that clock by hand so that refill arithmetic can be checked
//! without sleeping. Both needs meet in the [`Clock`] trait (the same seam the `governor` crate
//! uses).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of milliseconds.
///
/// The memory store reads milliseconds since the epoch, the unit Redis `TIME` yields in the Lua
/// script, so that bucket state written by either backend means the same thing; the pre-check
/// only subtracts readings and uses a [`MonotonicClock`].
pub trait Clock: Send + Sync + 'static {
    /// The current time in milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// The operating system's wall clock.
///
/// Steps backwards (NTP corrections) are harmless: the bucket math never refills for negative
/// elapsed time.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
    }
}

/// Milliseconds since this clock was made, never going backwards: for measuring elapsed time
/// locally (the pre-check), where a wall-clock step must not look like time passing.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock(Instant);

impl MonotonicClock {
    /// A clock reading 0 now.
    pub fn new() -> Self {
        MonotonicClock(Instant::now())
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
}

/// A clock that only moves when told to; clones share the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A manual clock reading `start_ms`.
    pub fn new(start_ms: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start_ms)))
    }

    /// Sets the time to `ms`, forwards or backwards.
    pub fn set(&self, ms: u64) {
        self.0.store(ms, Ordering::SeqCst);
    }

    /// Moves the time forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}
