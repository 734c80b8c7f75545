//! Series follow the config: what keeps `/metrics` bounded when domains and rules come and go.
//!
//! Every domain and rule of a config gets its series at 0 ([`super::register_domains`]); the
//! Prometheus recorder has no way to delete one, so a config that drops a domain would leave its
//! series forever, and a control plane pushing new names (Envoy Gateway names descriptor keys
//! after routes) would grow memory without bound. Instead the recorder forgets counters and
//! gauges left untouched for a window (`--metrics-idle`, [`DEFAULT_IDLE`]), and [`Telemetry::keep_series`] touches every series of
//! the config in force four times a window, so only series of what a swap dropped (and
//! per-tenant series of tenants idle that long) go. A forgotten counter that comes back starts
//! at 0 again, which Prometheus reads as a counter reset.
//!
//! The recorder forgets a series only when it renders, so the task also renders (and drops the
//! text). What a swap retires is written in a ledger ([`Churn`]); [`Churn::room`] tells a push how long to wait until the series of the rules it replaces plus its own
//! fit the budget, so that churn is paced rather than accumulated: at most `budget`
//! (domain, rule) pairs have series at any time.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use tokio_util::task::AbortOnDropHandle;

use super::Telemetry;
use crate::config::RuleSet;

/// How long a counter or gauge may go untouched before the recorder forgets it, by default
/// (`--metrics-idle`).
pub const DEFAULT_IDLE: Duration = Duration::from_secs(120);

/// How often the series of the config in force are touched (and idle ones pruned): four times
/// in each idle window.
pub fn touch_every(idle: Duration) -> Duration {
    idle / 4
}

// When the series a swap retired are certainly gone: idle that long, then pruned at the next
// touch.
fn gone_after(idle: Duration) -> Duration {
    idle + touch_every(idle) + Duration::from_secs(1)
}

/// The (domain, rule) pairs that have series in `rules`: each domain's (rule `""`) and each of
/// its rules'.
pub fn pairs(rules: &RuleSet) -> HashSet<(&str, &str)> {
    let mut pairs = HashSet::new();
    for domain in rules.domains() {
        pairs.insert((domain.name.as_str(), ""));
        for rule in &domain.rules {
            pairs.insert((domain.name.as_str(), rule.path.as_str()));
        }
    }
    pairs
}

/// What swaps retired, oldest first (when, and how many (domain, rule) pairs), kept by whoever
/// swaps configs in (the reloader).
#[derive(Debug)]
pub struct Churn {
    retired: VecDeque<(Instant, usize)>,
    gone_after: Duration,
}

impl Churn {
    /// A ledger for a recorder that forgets series idle for `idle`.
    pub fn new(idle: Duration) -> Churn {
        Churn { retired: VecDeque::new(), gone_after: gone_after(idle) }
    }

    /// Whether swapping `current` for `next` keeps at most `budget` pairs with series, counting
    /// those earlier swaps retired that the recorder may still hold: `Ok` with the number of
    /// pairs the swap retires (to pass to [`Churn::retire`]), or how long to wait until it fits.
    pub fn room(
        &mut self,
        current: &RuleSet,
        next: &RuleSet,
        budget: usize,
        now: Instant,
    ) -> Result<usize, Duration> {
        let (before, after) = (pairs(current), pairs(next));
        let retiring = before.difference(&after).count();
        while self.retired.front().is_some_and(|(at, _)| now.duration_since(*at) >= self.gone_after) {
            self.retired.pop_front();
        }
        let mut live = after.len() + retiring + self.retired.iter().map(|(_, n)| n).sum::<usize>();
        if live <= budget {
            return Ok(retiring);
        }
        // The earliest time enough of the ledger is gone.
        for (at, n) in &self.retired {
            live -= n;
            if live <= budget {
                return Err((*at + self.gone_after).saturating_duration_since(now));
            }
        }
        // Not even an empty ledger makes room: the caps on domains and rules keep a config
        // itself within the budget, so this is one swap replacing more than the budget at once.
        Ok(retiring)
    }

    /// Notes that a swap at `now` retired `count` pairs' series.
    pub fn retire(&mut self, count: usize, now: Instant) {
        if count > 0 {
            self.retired.push_back((now, count));
        }
    }
}

impl Telemetry {
    /// Touches every series of the rules in force four times a window, so that the recorder
    /// forgets only those of domains and rules no longer configured; stops when dropped.
    pub fn keep_series(self: &Arc<Self>, rules: Arc<ArcSwap<RuleSet>>) -> AbortOnDropHandle<()> {
        let telemetry = self.clone();
        AbortOnDropHandle::new(tokio::spawn(async move {
            let mut every = tokio::time::interval(touch_every(telemetry.series_idle()));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                telemetry.touch_series(&rules.load());
                // The recorder forgets idle series only as it renders.
                telemetry.prune_series();
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Domain `d` with one rule per key.
    fn rules(keys: &[&str]) -> RuleSet {
        let mut yaml = String::from("domain: d\ndescriptors:\n");
        for k in keys {
            yaml.push_str(&format!("  - key: {k}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"));
        }
        RuleSet::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap()
    }

    #[test]
    fn churn_beyond_the_budget_waits_until_retired_series_are_gone() {
        let t0 = Instant::now();
        let (a, b, c) = (rules(&["a1", "a2", "a3"]), rules(&["b1", "b2", "b3"]), rules(&["c1", "c2", "c3"]));
        // Each config: the domain and 3 rules = 4 pairs; a swap retires the 3 rules. Budget 8.
        let mut churn = Churn::new(DEFAULT_IDLE);
        let gone = gone_after(DEFAULT_IDLE);
        assert_eq!(churn.room(&a, &b, 8, t0), Ok(3));
        churn.retire(3, t0);
        // b -> c would hold a's 3 retired, b's 3 retiring and c's 4: wait until a's are gone.
        let wait = churn.room(&b, &c, 8, t0 + Duration::from_secs(1)).unwrap_err();
        assert_eq!(wait, gone - Duration::from_secs(1));
        assert_eq!(churn.room(&b, &c, 8, t0 + gone), Ok(3), "room once they are gone");
        assert_eq!(churn.room(&b, &b, 8, t0 + gone), Ok(0), "the same config retires nothing");
    }
}
