//! Money as integers: nano-units of a currency (1e-9), read from decimal text exactly and
//! priced per token with one rounding up.
//!
//! Budgets and prices are written as decimals (`20.00`, `0.30`); a binary float cannot hold most
//! of them, and a sum of floats drifts. Every amount here is a whole number of nano-units in a
//! `u128`, wide enough that a budget of 10^9 currency units (10^18 nano-units) and a count of
//! 10^12 tokens at any price in the table multiply without overflow.

use std::fmt;

/// Nano-units per currency unit.
pub const NANOS: u128 = 1_000_000_000;
/// Tokens a price is quoted for.
pub const PRICE_PER_TOKENS: u128 = 1_000_000;
/// The largest amount a budget or a price may be, in currency units: well inside what the Lua
/// twin's limbs and this type's multiplications carry exactly.
pub const MAX_UNITS: u128 = 1_000_000_000;
/// The largest token count priced exactly (per request and usage kind).
pub const MAX_TOKENS: u64 = 1_000_000_000_000;

/// An amount of money in nano-units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct Money(pub u128);

/// Why a decimal was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoneyError {
    /// Not digits with at most one decimal point.
    #[error("'{0}' is not a decimal amount (digits, an optional point and up to 9 decimals)")]
    NotDecimal(String),
    /// More decimals than a nano-unit.
    #[error("'{0}' has more than 9 decimals")]
    TooPrecise(String),
    /// Above [`MAX_UNITS`].
    #[error("'{0}' is above the largest amount, {MAX_UNITS}")]
    TooLarge(String),
}

impl Money {
    /// Zero.
    pub const ZERO: Money = Money(0);

    /// Reads a non-negative decimal (`12`, `0.30`, `2.500000001`) exactly.
    pub fn parse(text: &str) -> Result<Money, MoneyError> {
        let t = text.trim();
        let (whole, fraction) = t.split_once('.').unwrap_or((t, ""));
        let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if whole.is_empty() || !digits(whole) || !digits(fraction) || (t.contains('.') && fraction.is_empty())
        {
            return Err(MoneyError::NotDecimal(text.to_owned()));
        }
        if fraction.len() > 9 {
            return Err(MoneyError::TooPrecise(text.to_owned()));
        }
        let whole = whole.trim_start_matches('0');
        if whole.len() > 10 {
            return Err(MoneyError::TooLarge(text.to_owned()));
        }
        let units: u128 = if whole.is_empty() { 0 } else { whole.parse().expect("digits") };
        let nanos: u128 = format!("{fraction:0<9}").parse().expect("digits");
        let money = Money(units * NANOS + nanos);
        if money.0 > MAX_UNITS * NANOS {
            return Err(MoneyError::TooLarge(text.to_owned()));
        }
        Ok(money)
    }

    /// `self - other`, or zero when `other` is larger.
    pub fn saturating_sub(self, other: Money) -> Money {
        Money(self.0.saturating_sub(other.0))
    }

    /// The decimal integer of nano-units, as the stores keep it.
    pub fn nanos(self) -> String {
        self.0.to_string()
    }

    /// A fraction in nano-units of one (`alert_at`) as its shortest decimal: 800,000,000 is
    /// `0.8`.
    pub fn fraction_text(self) -> String {
        let text = self.to_string();
        let text = text.trim_end_matches('0');
        text.strip_suffix('.').unwrap_or(text).to_owned()
    }

    /// Reads the decimal integer of nano-units [`Money::nanos`] writes.
    pub fn from_nanos(text: &str) -> Option<Money> {
        text.parse().ok().map(Money)
    }
}

impl std::ops::Add for Money {
    type Output = Money;
    fn add(self, other: Money) -> Money {
        Money(self.0 + other.0)
    }
}

/// With all nine decimals: `19.987650000`.
impl fmt::Display for Money {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:09}", self.0 / NANOS, self.0 % NANOS)
    }
}

/// What `tokens` cost at `price` (money per [`PRICE_PER_TOKENS`] tokens), rounded up to a whole
/// nano-unit: the one rounding a charge gets.
pub fn cost(tokens: u64, price: Money) -> Money {
    Money((u128::from(tokens) * price.0).div_ceil(PRICE_PER_TOKENS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_are_read_exactly() {
        assert_eq!(Money::parse("2.50"), Ok(Money(2_500_000_000)));
        assert_eq!(Money::parse("0.000000001"), Ok(Money(1)));
        assert_eq!(Money::parse("1000"), Ok(Money(1_000 * NANOS)));
        assert_eq!(Money::parse("0.1").unwrap().to_string(), "0.100000000");
        assert_eq!(Money::parse("1000000000").unwrap().0, MAX_UNITS * NANOS);
        for bad in ["", "-1", "1.", ".5", "1e3", "1,5", "0x10", "1.2.3"] {
            assert!(matches!(Money::parse(bad), Err(MoneyError::NotDecimal(_))), "{bad}");
        }
        assert!(matches!(Money::parse("0.0000000001"), Err(MoneyError::TooPrecise(_))));
        assert!(matches!(Money::parse("1000000000.000000001"), Err(MoneyError::TooLarge(_))));
        assert!(matches!(Money::parse("99999999999999999999999"), Err(MoneyError::TooLarge(_))));
    }

    #[test]
    fn a_charge_rounds_up_once() {
        // $2.50 per million tokens: 2,500 nano-units a token.
        assert_eq!(cost(1_000, Money::parse("2.50").unwrap()), Money(2_500_000));
        // $0.30 per million: 300 nano-units a token.
        assert_eq!(cost(7, Money::parse("0.30").unwrap()), Money(2_100));
        // 300 nano-units per million: 7 tokens cost 0.0021 of one, charged 1; 10^6 tokens 300.
        assert_eq!(cost(7, Money::parse("0.0000003").unwrap()), Money(1));
        assert_eq!(cost(1_000_000, Money::parse("0.0000003").unwrap()), Money(300));
        assert_eq!(cost(1_000_001, Money::parse("0.0000003").unwrap()), Money(301));
        assert_eq!(cost(0, Money::parse("15").unwrap()), Money::ZERO);
        // The widest product is exact: 10^12 tokens at 10^9 units per million.
        let widest = cost(MAX_TOKENS, Money(MAX_UNITS * NANOS));
        assert_eq!(widest.0, u128::from(MAX_TOKENS) * MAX_UNITS * NANOS / PRICE_PER_TOKENS);
    }
}
