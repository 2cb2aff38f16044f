//! Rate limits: a token bucket per transport.

use std::time::Duration;

use tokio::time::Instant;

/// `messages` per `per` from one transport, on average: a token bucket
/// holding up to `messages` tokens, one per message taken, refilled at one
/// every `per / messages`.
///
/// A full bucket lets a burst of `messages` through at once, and the refill
/// goes on meanwhile, so a window of one `per` can see up to about twice
/// `messages` (a burst, then the steady pace); over longer runs the pace is
/// `messages` per `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// How many messages…
    pub messages: u32,
    /// …per how long.
    pub per: Duration,
}

impl RateLimit {
    /// `messages` per `per`.
    pub fn new(messages: u32, per: Duration) -> Self {
        Self { messages, per }
    }

    /// `messages` per second.
    pub fn per_second(messages: u32) -> Self {
        Self::new(messages, Duration::from_secs(1))
    }
}

/// A token bucket holding up to `messages` tokens, refilled continuously.
pub(super) struct Bucket {
    capacity: f64,
    tokens: f64,
    per_token: Duration,
    last: Instant,
}

impl Bucket {
    pub(super) fn new(limit: RateLimit, now: Instant) -> Self {
        let messages = limit.messages.max(1);
        Self {
            capacity: f64::from(messages),
            tokens: f64::from(messages),
            per_token: limit.per / messages,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last);
        if !self.per_token.is_zero() {
            let add = elapsed.as_secs_f64() / self.per_token.as_secs_f64();
            self.tokens = (self.tokens + add).min(self.capacity);
        } else {
            self.tokens = self.capacity;
        }
        self.last = now;
    }

    pub(super) fn available(&mut self, now: Instant) -> usize {
        self.refill(now);
        self.tokens.floor() as usize
    }

    /// Takes `n` tokens at `now`: those that came since the bucket was
    /// last looked at (a long `get` may have been waiting) first, up to the
    /// capacity.
    pub(super) fn take(&mut self, n: usize, now: Instant) {
        self.refill(now);
        self.tokens = (self.tokens - n as f64).max(0.0);
    }

    /// How long until one token is available.
    pub(super) fn wait(&self) -> Duration {
        let missing = (1.0 - self.tokens).max(0.0);
        self.per_token.mul_f64(missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_refills_one_token_per_period_share() {
        let start = Instant::now();
        let mut b = Bucket::new(RateLimit::new(4, Duration::from_secs(1)), start);
        assert_eq!(b.available(start), 4);
        b.take(4, start);
        assert_eq!(b.available(start), 0);
        assert_eq!(b.wait(), Duration::from_millis(250));
        assert_eq!(b.available(start + Duration::from_millis(500)), 2);
        assert_eq!(b.available(start + Duration::from_secs(10)), 4, "capped");
    }
}
