//! Waiting between attempts to reach a backend that is down.

use std::time::Duration;

/// The waits between attempts to reconnect (or to retry an operation) while
/// a backend is out of reach: `first`, doubling after each attempt, up to
/// `max`; back to `first` after a success.
///
/// ```
/// use envoi_core::transport::support::Backoff;
/// use std::time::Duration;
///
/// let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(300));
/// let waits: Vec<_> = (0..4).map(|_| backoff.next_wait().as_millis()).collect();
/// assert_eq!(waits, [100, 200, 300, 300]);
/// backoff.reset();
/// assert_eq!(backoff.next_wait(), Duration::from_millis(100));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Waits of `first`, doubling up to `max` (at least `first`).
    pub const fn new(first: Duration, max: Duration) -> Self {
        let max = if max.as_nanos() < first.as_nanos() {
            first
        } else {
            max
        };
        Self {
            first,
            max,
            next: first,
        }
    }

    /// The wait before the next attempt; the one after it is twice as
    /// long, up to the maximum.
    pub fn next_wait(&mut self) -> Duration {
        let wait = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        wait
    }

    /// The wait [`next_wait`](Self::next_wait) would return, without
    /// moving on.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// Back to the first wait, after an attempt that worked.
    pub fn reset(&mut self) {
        self.next = self.first;
    }

    /// Sleeps for [`next_wait`](Self::next_wait).
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next_wait()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_maximum_below_the_first_wait_is_the_first_wait() {
        let mut b = Backoff::new(Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(b.next_wait(), Duration::from_secs(2));
        assert_eq!(b.next_wait(), Duration::from_secs(2));
    }

    #[test]
    fn doubling_saturates_instead_of_overflowing() {
        let mut b = Backoff::new(Duration::MAX / 2 + Duration::from_secs(1), Duration::MAX);
        b.next_wait();
        assert_eq!(b.next_wait(), Duration::MAX);
    }
}
