//! Time units of envoyproxy/ratelimit limits, and the bridge between "N per unit" and buckets.
//!
//! A `rate_limit` of N per unit becomes a bucket holding N tokens that refills N per unit. The
//! way back, for `current_limit` in responses, writes a bucket's rate as a whole number of
//! requests per the smallest unit that makes it whole (2/s, not 120/min).

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;

use crate::bucket::BucketSpec;

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

/// Parses a config unit name, case-insensitively.
pub fn parse(name: &str) -> Option<Unit> {
    Unit::from_str_name(&name.to_ascii_uppercase()).filter(|u| *u != Unit::Unknown)
}

/// The unit's length in seconds; `None` for `UNKNOWN`.
pub fn seconds(unit: Unit) -> Option<u64> {
    UNITS.iter().find(|(u, _)| *u == unit).map(|(_, s)| *s)
}

/// The bucket for "`requests_per_unit` per `unit`": full at N, refilling N per unit.
pub fn bucket(requests_per_unit: u32, unit: Unit) -> BucketSpec {
    let seconds = seconds(unit).expect("a known unit") as f64;
    BucketSpec {
        capacity: f64::from(requests_per_unit),
        refill_per_second: f64::from(requests_per_unit) / seconds,
    }
}

/// A refill rate as whole requests per the smallest unit that keeps it whole (within float
/// noise); rates that are whole in no unit are rounded per year.
pub fn requests_per_unit(refill_per_second: f64) -> (u32, Unit) {
    for (unit, seconds) in UNITS {
        let n = refill_per_second * seconds as f64;
        let whole = n.round();
        if whole >= 1.0 && (n - whole).abs() <= 1e-9 * whole {
            return (whole.min(f64::from(u32::MAX)) as u32, unit);
        }
    }
    let per_year = (refill_per_second * 31_536_000.0).round();
    (per_year.min(f64::from(u32::MAX)) as u32, Unit::Year)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_is_case_insensitive_and_rejects_unknown() {
        assert_eq!(parse("Minute"), Some(Unit::Minute));
        assert_eq!(parse("YEAR"), Some(Unit::Year));
        assert_eq!(parse("unknown"), None);
        assert_eq!(parse("fortnight"), None);
    }

    #[test]
    fn round_trip_through_smallest_whole_unit() {
        let b = bucket(20, Unit::Minute);
        assert_eq!(b.capacity, 20.0);
        assert_eq!(requests_per_unit(b.refill_per_second), (20, Unit::Minute));
        assert_eq!(requests_per_unit(bucket(120, Unit::Minute).refill_per_second), (2, Unit::Second));
        assert_eq!(requests_per_unit(50.0), (50, Unit::Second));
        assert_eq!(requests_per_unit(0.5), (30, Unit::Minute));
        assert_eq!(requests_per_unit(bucket(7, Unit::Day).refill_per_second), (7, Unit::Day));
    }
}
