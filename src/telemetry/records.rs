//! The budget request records a replica wrote and the store may still keep, for sizing: a record
//! lives a hold's `hold_ttl` plus an hour after it is written, one per priced request, so the
//! store's records follow the request rate over that span (bytes per record in the book's
//! sizing). Neither store can count them cheaply (in Redis they are keys among all others), so
//! each replica counts what it wrote, by when it may be gone: summed over the replicas, the
//! records kept.
//!
//! A count is an upper bound per record: a settlement extends its record's life from the
//! settlement, so a record is counted from its write for its life and its `hold_ttl` (the time
//! within which its stream ends); only a settlement later than that outlives its count.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Records by domain and by the second (since `start`) they may be gone in.
pub struct RecordsKept {
    start: Instant,
    by_domain: Mutex<HashMap<String, BTreeMap<u64, u64>>>,
}

impl RecordsKept {
    pub fn new() -> RecordsKept {
        RecordsKept { start: Instant::now(), by_domain: Mutex::default() }
    }

    /// One record of `domain` written now, which may be kept for `kept`.
    pub fn written(&self, domain: &str, kept: Duration) {
        self.written_at(self.start.elapsed(), domain, kept);
    }

    /// Sets `tollgate_budget_records` of every domain that wrote any to what may still be kept.
    pub fn refresh(&self) {
        for (domain, kept) in self.kept_at(self.start.elapsed()) {
            metrics::gauge!("tollgate_budget_records", "domain" => domain).set(kept as f64);
        }
    }

    fn written_at(&self, now: Duration, domain: &str, kept: Duration) {
        let gone = (now + kept).as_secs() + 1;
        let mut by_domain = self.by_domain.lock().unwrap_or_else(|p| p.into_inner());
        match by_domain.get_mut(domain) {
            Some(by_second) => *by_second.entry(gone).or_default() += 1,
            None => {
                by_domain.insert(domain.to_owned(), BTreeMap::from([(gone, 1)]));
            }
        }
    }

    // Per domain that wrote any, the records that may still be kept at `now`. The entries are
    // one per second of a record's life at most, dropped as they pass.
    fn kept_at(&self, now: Duration) -> Vec<(String, u64)> {
        let now = now.as_secs();
        let mut by_domain = self.by_domain.lock().unwrap_or_else(|p| p.into_inner());
        by_domain
            .iter_mut()
            .map(|(domain, by_second)| {
                *by_second = by_second.split_off(&(now + 1));
                (domain.clone(), by_second.values().sum())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_count_until_they_may_be_gone() {
        let kept = RecordsKept::new();
        let s = Duration::from_secs;
        kept.written_at(s(0), "llm", s(10));
        kept.written_at(s(5), "llm", s(10));
        kept.written_at(s(5), "other", s(2));
        let at = |t| {
            let mut v = kept.kept_at(s(t));
            v.sort();
            v
        };
        assert_eq!(at(1), [("llm".to_owned(), 2), ("other".to_owned(), 1)]);
        // Gone at the latest a second after their life: 7 + 1 for "other", 10 + 1 for the first.
        assert_eq!(at(8), [("llm".to_owned(), 2), ("other".to_owned(), 0)]);
        assert_eq!(at(11), [("llm".to_owned(), 1), ("other".to_owned(), 0)]);
        assert_eq!(at(16), [("llm".to_owned(), 0), ("other".to_owned(), 0)]);
    }
}
