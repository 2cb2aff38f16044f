//! Durations that may be too long to add to an `Instant`.

use std::time::Duration;

/// Thirty years: a time limit, lease, delay or cool-down at least this long
/// is as good as none, and adding it to an `Instant` cannot overflow (a
/// duration such as `Duration::MAX` would, and `Instant`'s `+` panics).
pub(crate) const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);

/// `d`, at most [`FAR`].
#[inline]
pub(crate) fn clamp(d: Duration) -> Duration {
    d.min(FAR)
}
