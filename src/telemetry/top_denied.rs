//! The most-denied tenants, in bounded memory whatever tenant ids arrive.
//!
//! Denied hits are counted per tenant with the Space-Saving algorithm (Metwally et al.): at
//! most `10 × k` counters; a new tenant arriving when all are taken replaces the smallest one
//! and inherits its count, so every tenant whose true count exceeds total/capacity is kept and
//! counts are overestimated by at most the evicted minimum. Counting restarts every window; the
//! top `k` of the last complete window are what `/metrics` exports, so a tenant whose denials
//! suddenly rise appears there within two windows.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::{Clock, SystemClock};

/// Top-k denied tenants per window.
pub struct TopDenied {
    k: usize,
    window_ms: u64,
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
}

struct State {
    started_ms: u64,
    current: SpaceSaving,
    last: Vec<(String, u64)>,
}

struct SpaceSaving {
    capacity: usize,
    counts: HashMap<String, u64>,
}

impl SpaceSaving {
    fn new(capacity: usize) -> Self {
        SpaceSaving { capacity, counts: HashMap::with_capacity(capacity) }
    }

    fn add(&mut self, key: &str, n: u64) {
        if let Some(count) = self.counts.get_mut(key) {
            *count = count.saturating_add(n);
            return;
        }
        let inherited = if self.counts.len() < self.capacity {
            0
        } else {
            let (victim, min) = self
                .counts
                .iter()
                .min_by_key(|(_, c)| **c)
                .map(|(k, c)| (k.clone(), *c))
                .expect("full, so not empty");
            self.counts.remove(&victim);
            min
        };
        self.counts.insert(key.to_owned(), inherited.saturating_add(n));
    }

    fn top(&self, k: usize) -> Vec<(String, u64)> {
        let mut all: Vec<(String, u64)> = self.counts.iter().map(|(t, c)| (t.clone(), *c)).collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        all.truncate(k);
        all
    }
}

impl TopDenied {
    /// Tracks the top `k` tenants over windows of `window`.
    pub fn new(k: usize, window: Duration) -> Self {
        Self::with_clock(k, window, Arc::new(SystemClock))
    }

    /// The same on `clock`, for deterministic tests.
    pub fn with_clock(k: usize, window: Duration, clock: Arc<dyn Clock>) -> Self {
        TopDenied {
            k,
            window_ms: (window.as_millis() as u64).max(1),
            state: Mutex::new(State {
                started_ms: clock.now_ms(),
                current: SpaceSaving::new((k * 10).max(100)),
                last: Vec::new(),
            }),
            clock,
        }
    }

    /// Counts `hits` denied hits of `tenant`.
    pub fn record(&self, tenant: &str, hits: u64) {
        if self.k == 0 {
            return;
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.rotate(&mut state);
        state.current.add(tenant, hits);
    }

    /// The top tenants of the last complete window, most denied first.
    pub fn last_window(&self) -> Vec<(String, u64)> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.rotate(&mut state);
        state.last.clone()
    }

    /// Number of counters held (bounded by 10 × k, at least 100).
    pub fn tracked(&self) -> usize {
        self.state.lock().map(|s| s.current.counts.len()).unwrap_or(0)
    }

    fn rotate(&self, state: &mut State) {
        let elapsed = self.clock.now_ms().saturating_sub(state.started_ms);
        if elapsed < self.window_ms {
            return;
        }
        let windows = elapsed / self.window_ms;
        // The window that just ended is the last complete one only if no full window followed it.
        state.last = if windows == 1 { state.current.top(self.k) } else { Vec::new() };
        state.current = SpaceSaving::new(state.current.capacity);
        state.started_ms += self.window_ms * windows;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavy_hitters_survive_a_flood_of_one_off_tenants() {
        let mut s = SpaceSaving::new(100);
        for i in 0..100_000u64 {
            s.add(&format!("noise-{i}"), 1);
            if i % 10 == 0 {
                s.add("abuser", 5);
            }
        }
        assert!(s.counts.len() <= 100);
        assert_eq!(s.top(1)[0].0, "abuser");
    }

    #[test]
    fn windows_rotate() {
        let clock = crate::clock::ManualClock::new(0);
        let top = TopDenied::with_clock(2, Duration::from_secs(60), Arc::new(clock.clone()));
        top.record("a", 3);
        top.record("b", 1);
        top.record("c", 2);
        assert!(top.last_window().is_empty(), "no complete window yet");
        clock.advance(61_000);
        assert_eq!(top.last_window(), vec![("a".to_string(), 3), ("c".to_string(), 2)]);
        top.record("b", 9);
        clock.advance(60_000);
        assert_eq!(top.last_window(), vec![("b".to_string(), 9)]);
        clock.advance(120_000);
        assert!(top.last_window().is_empty(), "a quiet window clears the list");
    }
}
