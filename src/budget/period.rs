//! Calendar periods: the windows a money budget resets at, in a time zone.
//!
//! A budget resets at the start of each calendar minute, hour, day, week (ISO: Monday), month or
//! year in its zone (IANA, from the tz database built into the binary, so that every replica
//! reads the same rules whatever its host has installed). A period is a half-open span of
//! instants `[start, end)`; the periods of one calendar partition time. Civil times are turned
//! into instants as jiff's `compatible` disambiguation does: a period that starts in a gap (a
//! daylight-saving jump) starts after it, and a civil hour or minute that happens twice is one
//! period, as long as both.
//!
//! The store decides by its own clock (Redis `TIME`), which tollgate's host does not read: so a
//! request carries the periods around its host's now ([`Calendar::around`]) and the store picks
//! the one its clock falls in.

use std::fmt;

use jiff::civil::DateTime;
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

/// How long a budget's period is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Per {
    /// A calendar minute.
    Minute,
    /// A calendar hour.
    Hour,
    /// A calendar day.
    Day,
    /// An ISO week, from Monday.
    Week,
    /// A calendar month.
    Month,
    /// A calendar year.
    Year,
}

impl Per {
    /// Reads `minute | hour | day | week | month | year`.
    pub fn parse(text: &str) -> Option<Per> {
        Some(match text {
            "minute" => Per::Minute,
            "hour" => Per::Hour,
            "day" => Per::Day,
            "week" => Per::Week,
            "month" => Per::Month,
            "year" => Per::Year,
            _ => return None,
        })
    }
}

impl fmt::Display for Per {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Per::Minute => "minute",
            Per::Hour => "hour",
            Per::Day => "day",
            Per::Week => "week",
            Per::Month => "month",
            Per::Year => "year",
        })
    }
}

/// A period: milliseconds since the Unix epoch, `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Its first instant.
    pub start_ms: i64,
    /// The first instant of the next period.
    pub end_ms: i64,
}

/// A budget's periods: their length and time zone.
#[derive(Debug, Clone, PartialEq)]
pub struct Calendar {
    /// How long a period is.
    pub per: Per,
    /// The zone's IANA name, as configured.
    pub zone_name: String,
    zone: TimeZone,
}

/// A time zone name the tz database does not know.
#[derive(Debug, Clone, thiserror::Error)]
#[error("unknown time zone '{0}' (an IANA name such as Europe/Berlin or UTC)")]
pub struct UnknownZone(pub String);

impl Calendar {
    /// The calendar of `per` in the zone named `zone` (IANA).
    pub fn new(per: Per, zone: &str) -> Result<Calendar, UnknownZone> {
        let tz = jiff::tz::db().get(zone).map_err(|_| UnknownZone(zone.to_owned()))?;
        Ok(Calendar { per, zone_name: zone.to_owned(), zone: tz })
    }

    /// The same calendar with periods of `per` (a budget override's period), in the same zone.
    pub fn with_per(&self, per: Per) -> Calendar {
        Calendar { per, ..self.clone() }
    }

    /// The period `at_ms` falls in.
    pub fn window(&self, at_ms: i64) -> Window {
        let at = Timestamp::from_millisecond(at_ms).unwrap_or(Timestamp::UNIX_EPOCH);
        let civil = self.zone.to_datetime(at);
        let start = self.civil_start(civil);
        let next = match self.per {
            Per::Minute => start.checked_add(1.minute()),
            Per::Hour => start.checked_add(1.hour()),
            Per::Day => start.checked_add(1.day()),
            Per::Week => start.checked_add(1.week()),
            Per::Month => start.checked_add(1.month()),
            Per::Year => start.checked_add(1.year()),
        }
        .unwrap_or(DateTime::MAX);
        let instant = |dt: DateTime| {
            self.zone
                .to_ambiguous_zoned_datetime(dt)
                .compatible()
                .map_or(i64::MAX, |z| z.timestamp().as_millisecond())
        };
        Window { start_ms: instant(start), end_ms: instant(next) }
    }

    /// The periods before, at and after `now_ms`'s, as the store picks from them: the previous
    /// period's start, this one's start and end, and the next one's end.
    pub fn around(&self, now_ms: i64) -> [i64; 4] {
        let this = self.window(now_ms);
        let previous = self.window(this.start_ms - 1);
        let next = self.window(this.end_ms);
        [previous.start_ms, this.start_ms, this.end_ms, next.end_ms]
    }

    // The civil time the period containing `civil` starts at.
    fn civil_start(&self, civil: DateTime) -> DateTime {
        let date = civil.date();
        let midnight = |d: jiff::civil::Date| d.to_datetime(jiff::civil::Time::midnight());
        match self.per {
            Per::Minute => civil.with().second(0).subsec_nanosecond(0).build().unwrap_or(civil),
            Per::Hour => civil.with().minute(0).second(0).subsec_nanosecond(0).build().unwrap_or(civil),
            Per::Day => midnight(date),
            Per::Week => {
                let back = i64::from(date.weekday().to_monday_zero_offset());
                midnight(date.checked_sub(back.days()).unwrap_or(date))
            }
            Per::Month => midnight(date.first_of_month()),
            Per::Year => midnight(date.first_of_year()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(text: &str) -> i64 {
        text.parse::<Timestamp>().unwrap().as_millisecond()
    }

    fn window(per: Per, zone: &str, at: &str) -> (i64, i64) {
        let w = Calendar::new(per, zone).unwrap().window(ms(at));
        (w.start_ms, w.end_ms)
    }

    #[test]
    fn periods_follow_the_zone_calendar() {
        let berlin = "Europe/Berlin";
        // 2026-12-04 is a Friday; Berlin is UTC+1 in winter.
        assert_eq!(
            window(Per::Day, berlin, "2026-12-04T23:30:00Z"),
            (ms("2026-12-04T23:00:00Z"), ms("2026-12-05T23:00:00Z"))
        );
        assert_eq!(
            window(Per::Week, berlin, "2026-12-04T12:00:00Z"),
            (ms("2026-11-29T23:00:00Z"), ms("2026-12-06T23:00:00Z"))
        );
        assert_eq!(
            window(Per::Month, berlin, "2026-12-04T12:00:00Z"),
            (ms("2026-11-30T23:00:00Z"), ms("2026-12-31T23:00:00Z"))
        );
        assert_eq!(
            window(Per::Year, "UTC", "2026-12-04T12:00:00Z"),
            (ms("2026-01-01T00:00:00Z"), ms("2027-01-01T00:00:00Z"))
        );
        assert_eq!(
            window(Per::Minute, "UTC", "2026-12-04T12:00:59.999Z"),
            (ms("2026-12-04T12:00:00Z"), ms("2026-12-04T12:01:00Z"))
        );
        // India is UTC+5:30: its hours start at half past in UTC.
        assert_eq!(
            window(Per::Hour, "Asia/Kolkata", "2026-12-04T12:10:00Z"),
            (ms("2026-12-04T11:30:00Z"), ms("2026-12-04T12:30:00Z"))
        );
        // A month with the spring change is an hour short (March 2026 in Berlin).
        let (s, e) = window(Per::Month, berlin, "2026-03-15T00:00:00Z");
        assert_eq!(e - s, (31 * 24 - 1) * 3_600_000);
    }

    #[test]
    fn a_repeated_hour_is_one_period_and_periods_partition_time() {
        // Berlin's autumn change, 2026-10-25: 02:00-03:00 local happens twice (00:00-02:00 UTC).
        let cal = Calendar::new(Per::Hour, "Europe/Berlin").unwrap();
        let first = cal.window(ms("2026-10-25T00:30:00Z"));
        let second = cal.window(ms("2026-10-25T01:30:00Z"));
        assert_eq!(first, second);
        assert_eq!((first.start_ms, first.end_ms), (ms("2026-10-25T00:00:00Z"), ms("2026-10-25T02:00:00Z")));
        // Walking the day period by period covers every instant once.
        let mut at = ms("2026-10-24T20:00:00Z");
        for _ in 0..12 {
            let w = cal.window(at);
            assert!(w.start_ms <= at && at < w.end_ms);
            assert_eq!(cal.window(w.end_ms).start_ms, w.end_ms, "the next period starts where this ends");
            at = w.end_ms;
        }
    }

    #[test]
    fn around_gives_the_neighbours() {
        let cal = Calendar::new(Per::Minute, "UTC").unwrap();
        let now = ms("2026-12-04T12:00:30Z");
        assert_eq!(cal.around(now), [now - 90_000, now - 30_000, now + 30_000, now + 90_000]);
        assert!(Calendar::new(Per::Day, "Mars/Olympus").is_err());
    }
}
