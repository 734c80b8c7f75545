//! Time units of envoyproxy/ratelimit limits, and the bridge between "N per unit" and buckets.
//!
//! A `rate_limit` of N per unit becomes a bucket holding N tokens that refills N per unit. A
//! limit keeps the N and the unit it was written with ([`RatePerUnit`]), so that responses echo
//! exactly what was configured. Buckets defined by capacity and rate (`token_bucket`, tenant
//! quotas) are described by [`RatePerUnit::of_rate`]: their sustained rate as whole requests per
//! the smallest unit that makes it whole (2/s, not 120/min).

use serde::Serialize;

use crate::bucket::BucketSpec;

/// A unit of time of envoyproxy/ratelimit's `rate_limit` (and of Envoy's override `unit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3,600 s.
    Hour,
    /// 86,400 s.
    Day,
    /// 7 days.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

/// Units from smallest to largest, with their length in seconds (a month is 30 days and a year
/// 365, as in envoyproxy/ratelimit).
const UNITS: [(Unit, u64); 7] = [
    (Unit::Second, 1),
    (Unit::Minute, 60),
    (Unit::Hour, 3_600),
    (Unit::Day, 86_400),
    (Unit::Week, 604_800),
    (Unit::Month, 2_592_000),
    (Unit::Year, 31_536_000),
];

impl Unit {
    /// Parses a config unit name, case-insensitively.
    pub fn parse(name: &str) -> Option<Unit> {
        UNITS.iter().map(|(u, _)| *u).find(|u| u.name().eq_ignore_ascii_case(name))
    }

    /// The unit's lower-case name, as written in config files.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// The unit's length in seconds.
    pub fn seconds(self) -> u64 {
        UNITS.iter().find(|(u, _)| *u == self).map(|(_, s)| *s).expect("every unit is listed")
    }
}

/// "N requests per unit", as configured or as sent in an override.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct RatePerUnit {
    /// N.
    pub requests_per_unit: u32,
    /// The unit.
    pub unit: Unit,
}

impl RatePerUnit {
    /// The bucket for this limit: full at N, refilling N per unit.
    pub fn bucket(self) -> BucketSpec {
        let n = f64::from(self.requests_per_unit);
        BucketSpec::new(n, n / self.unit.seconds() as f64).expect("N per unit is a valid bucket")
    }

    /// A refill rate as whole requests per the smallest unit that keeps it whole (within float
    /// noise); rates that are whole in no unit are rounded per year.
    pub fn of_rate(refill_per_second: f64) -> RatePerUnit {
        for (unit, seconds) in UNITS {
            let n = refill_per_second * seconds as f64;
            let whole = n.round();
            if whole >= 1.0 && (n - whole).abs() <= 1e-9 * whole {
                return RatePerUnit { requests_per_unit: whole.min(f64::from(u32::MAX)) as u32, unit };
            }
        }
        let per_year = (refill_per_second * 31_536_000.0).round();
        RatePerUnit { requests_per_unit: per_year.min(f64::from(u32::MAX)) as u32, unit: Unit::Year }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(n: u32, unit: Unit) -> RatePerUnit {
        RatePerUnit { requests_per_unit: n, unit }
    }

    #[test]
    fn parse_is_case_insensitive_and_rejects_unknown() {
        assert_eq!(Unit::parse("Minute"), Some(Unit::Minute));
        assert_eq!(Unit::parse("YEAR"), Some(Unit::Year));
        assert_eq!(Unit::parse("unknown"), None);
        assert_eq!(Unit::parse("fortnight"), None);
    }

    #[test]
    fn buckets_and_rates() {
        let b = rate(20, Unit::Minute).bucket();
        assert_eq!(b.capacity(), 20.0);
        assert_eq!(RatePerUnit::of_rate(b.refill_per_second()), rate(20, Unit::Minute));
        assert_eq!(
            RatePerUnit::of_rate(rate(120, Unit::Minute).bucket().refill_per_second()),
            rate(2, Unit::Second)
        );
        assert_eq!(RatePerUnit::of_rate(50.0), rate(50, Unit::Second));
        assert_eq!(RatePerUnit::of_rate(0.5), rate(30, Unit::Minute));
        assert_eq!(RatePerUnit::of_rate(rate(7, Unit::Day).bucket().refill_per_second()), rate(7, Unit::Day));
        assert_eq!(rate(0, Unit::Second).bucket().capacity(), 0.0);
    }
}
