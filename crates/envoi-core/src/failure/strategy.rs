//! Retry strategies: whether and when a message whose handlers failed is
//! tried again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::envelope::Envelope;
use crate::error::{HandlerError, RetryHint};

/// Decides whether and when a failed message is retried.
pub trait RetryStrategy: Send + Sync + 'static {
    /// Whether retry number `attempt` (1 for the first retry) may happen.
    fn is_retryable(&self, envelope: &Envelope, errors: &[HandlerError], attempt: u32) -> bool;
    /// How long to wait before retry number `attempt`.
    fn delay(&self, envelope: &Envelope, attempt: u32) -> Duration;
}

/// A shared strategy is a strategy.
impl<T: RetryStrategy + ?Sized> RetryStrategy for std::sync::Arc<T> {
    fn is_retryable(&self, envelope: &Envelope, errors: &[HandlerError], attempt: u32) -> bool {
        (**self).is_retryable(envelope, errors, attempt)
    }

    fn delay(&self, envelope: &Envelope, attempt: u32) -> Duration {
        (**self).delay(envelope, attempt)
    }
}

/// Retries up to `max_retries` times, waiting `delay × multiplier^(n-1)`
/// (capped at `max_delay`, randomised by ± `jitter`) before retry `n`.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiplierRetryStrategy {
    /// How many retries at most. Default 3.
    pub max_retries: u32,
    /// The first delay. Default 1 s.
    pub delay: Duration,
    /// Growth factor per retry; below 1 counts as 1 (delays never shrink).
    /// Default 2.
    pub multiplier: f64,
    /// Upper bound of the delay; `None` for none. Default `None`.
    pub max_delay: Option<Duration>,
    /// Random spread as a fraction of the delay, 0 to 1. Default 0.1.
    pub jitter: f64,
}

impl Default for MultiplierRetryStrategy {
    fn default() -> Self {
        Self {
            max_retries: 3,
            delay: Duration::from_secs(1),
            multiplier: 2.0,
            max_delay: None,
            jitter: 0.1,
        }
    }
}

impl MultiplierRetryStrategy {
    /// The delay before retry `attempt` without jitter.
    pub fn base_delay(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(63) as i32;
        let secs = self.delay.as_secs_f64() * self.multiplier.max(1.0).powi(exp);
        let mut d = Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX);
        if let Some(max) = self.max_delay {
            d = d.min(max);
        }
        d
    }
}

impl RetryStrategy for MultiplierRetryStrategy {
    fn is_retryable(&self, _envelope: &Envelope, _errors: &[HandlerError], attempt: u32) -> bool {
        attempt <= self.max_retries
    }

    fn delay(&self, _envelope: &Envelope, attempt: u32) -> Duration {
        let base = self.base_delay(attempt);
        let jitter = self.jitter.clamp(0.0, 1.0);
        if jitter == 0.0 || base.is_zero() {
            return base;
        }
        // A factor in [1 - jitter, 1 + jitter].
        let factor = 1.0 + jitter * (2.0 * random_unit() - 1.0);
        // Saturating: `Duration::mul_f64` panics past `Duration::MAX`.
        let d = Duration::try_from_secs_f64(base.as_secs_f64() * factor).unwrap_or(Duration::MAX);
        match self.max_delay {
            Some(max) => d.min(max),
            None => d,
        }
    }
}

/// A uniform number in [0, 1) from a shared SplitMix64 sequence.
fn random_unit() -> f64 {
    static STATE: AtomicU64 = AtomicU64::new(0);
    let mut seed = STATE.load(Ordering::Relaxed);
    if seed == 0 {
        seed = crate::envelope::stamp::now_millis() | 1;
    }
    let next = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    STATE.store(next, Ordering::Relaxed);
    let mut z = next;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Unrecoverable only when every error is; otherwise the first recoverable
/// hint, or the default.
pub(crate) fn combined_hint(errors: &[HandlerError]) -> RetryHint {
    let hints: Vec<_> = errors.iter().map(HandlerError::retry_hint).collect();
    if !hints.is_empty() && hints.iter().all(|h| *h == RetryHint::Unrecoverable) {
        return RetryHint::Unrecoverable;
    }
    hints
        .into_iter()
        .find(|h| matches!(h, RetryHint::Recoverable(_)))
        .unwrap_or(RetryHint::Default)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Ping;

    #[test]
    fn multiplier_strategy_grows_and_caps_the_delay() {
        let s = MultiplierRetryStrategy {
            max_delay: Some(Duration::from_secs(5)),
            ..Default::default()
        };
        assert_eq!(s.base_delay(1), Duration::from_secs(1));
        assert_eq!(s.base_delay(2), Duration::from_secs(2));
        assert_eq!(s.base_delay(3), Duration::from_secs(4));
        assert_eq!(s.base_delay(4), Duration::from_secs(5));
        for _ in 0..100 {
            let d = s.delay(&Envelope::new(Ping), 2);
            assert!(
                d >= Duration::from_millis(1800) && d <= Duration::from_millis(2200),
                "{d:?}"
            );
        }
    }

    #[test]
    fn a_multiplier_below_one_keeps_the_delay_from_shrinking() {
        let s = MultiplierRetryStrategy {
            multiplier: 0.5,
            ..Default::default()
        };
        assert_eq!(s.base_delay(1), Duration::from_secs(1));
        assert_eq!(s.base_delay(4), Duration::from_secs(1));
    }

    #[test]
    fn a_jittered_delay_past_the_longest_duration_saturates_instead_of_panicking() {
        let s = MultiplierRetryStrategy {
            max_retries: u32::MAX,
            multiplier: 10.0,
            ..Default::default()
        };
        assert_eq!(s.base_delay(30), Duration::MAX);
        for attempt in [30, 64, u32::MAX] {
            for _ in 0..64 {
                let d = s.delay(&Envelope::new(Ping), attempt);
                assert!(d >= Duration::MAX.mul_f64(0.9), "{d:?}");
            }
        }
    }
}
