//! Step 6 of the canonical pipeline: retry failed handling, or park the
//! message in the failure transport.
//!
//! Only a message received from a transport is retried, and only when its
//! handlers failed ([`BusError::HandlerFailed`]); transport and serialization
//! errors go back to the caller untouched. A retry is re-sent to the
//! transport the message came from (its [`ReceivedStamp`]) with a
//! [`RedeliveryStamp`] and a [`DelayStamp`]; the worker then acknowledges the
//! original. Out of budget, the message goes to the failure transport with an
//! [`ErrorDetailsStamp`] and a [`SentToFailureTransportStamp`].
//!
//! An event's handlers that succeeded beside one that failed keep their
//! `HandledStamp`s on the retry or the parked message, so they do not run
//! again; what they deferred with a
//! [`DispatchAfterCurrentBusStamp`](crate::stamp::DispatchAfterCurrentBusStamp)
//! is therefore dispatched once the retry is sent or the message parked
//! (by [step 2](super::dispatch_after_current_bus)), not dropped.
//!
//! A message sent to the failure transport also gets a `RedeliveryStamp`
//! with a count of zero, so when it is retried from there it starts with a
//! fresh budget — and if it fails again, it returns there.
//!
//! It returns there later, not at once: available again after
//! [`parked_again_delay`] — 1 s the first time, doubling each time it comes
//! back, up to an hour — whether it failed for good straight from the
//! failure transport (a worker consuming it, or `failed retry`) or after
//! being sent back from there to its origin and running out of retries
//! again. So a worker consuming a failure transport, alone or with the
//! origin, does not spin on a message that keeps failing for good.
//!
//! Errors can steer this. In each failing handler's error and its
//! `source()` chain, the first [`Unrecoverable`](crate::Unrecoverable) or
//! [`Recoverable`](crate::Recoverable) found is what counts (an
//! `Unrecoverable` wrapped in a `Recoverable` is recoverable). When it is
//! `Unrecoverable` for every failing handler, the retries are skipped; a
//! `Recoverable` is retried (within the budget) after its own delay if it
//! names one.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::dispatch_after_current_bus::{DeferredDispatches, ParkedWithDeferred};
use super::{BoxFuture, Middleware, Next};
use crate::envelope::Envelope;
use crate::error::{BusError, HandlerError, Result, RetryHint, StepResult};
use crate::stamp::{
    DelayStamp, ErrorDetailsStamp, ReceivedStamp, RedeliveryStamp, SentStamp,
    SentToFailureTransportStamp,
};
use crate::transport::SenderDispatcher;

/// Decides whether and when a failed message is retried.
pub trait RetryStrategy: Send + Sync + 'static {
    /// Whether retry number `attempt` (1 for the first retry) may happen.
    fn is_retryable(&self, envelope: &Envelope, errors: &[HandlerError], attempt: u32) -> bool;
    /// How long to wait before retry number `attempt`.
    fn delay(&self, envelope: &Envelope, attempt: u32) -> Duration;
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
        seed = crate::stamp::now_millis() | 1;
    }
    let next = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    STATE.store(next, Ordering::Relaxed);
    let mut z = next;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Retry strategies and failure transports per transport.
#[derive(Clone)]
pub struct RetryConfig {
    strategies: BTreeMap<String, Arc<dyn RetryStrategy>>,
    default_strategy: Arc<dyn RetryStrategy>,
    failure_transports: BTreeMap<String, String>,
    default_failure_transport: Option<String>,
    without_retry: BTreeSet<String>,
    dispatcher: Arc<dyn SenderDispatcher>,
}

impl fmt::Debug for RetryConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryConfig")
            .field("strategies", &self.strategies.keys().collect::<Vec<_>>())
            .field("failure_transports", &self.failure_transports)
            .field("default_failure_transport", &self.default_failure_transport)
            .finish()
    }
}

impl RetryConfig {
    /// Sends retries and failures through `dispatcher`; every transport uses
    /// the default [`MultiplierRetryStrategy`] and no failure transport.
    pub fn new(dispatcher: Arc<dyn SenderDispatcher>) -> Self {
        Self {
            strategies: BTreeMap::new(),
            default_strategy: Arc::new(MultiplierRetryStrategy::default()),
            failure_transports: BTreeMap::new(),
            default_failure_transport: None,
            without_retry: BTreeSet::new(),
            dispatcher,
        }
    }

    /// Never retries nor parks messages received from `transport`: their
    /// failure goes straight back to the caller. Used for the sync
    /// transport, which handles messages while they are sent. A message
    /// parked after failing on `transport` (when it was another kind of
    /// transport) and retried from its failure transport is not retried
    /// either, but parked again when it fails.
    pub fn without_retry(mut self, transport: impl Into<String>) -> Self {
        self.without_retry.insert(transport.into());
        self
    }

    /// The failure transports configured, without duplicates, sorted.
    pub fn failure_transports(&self) -> Vec<&str> {
        let mut all: Vec<&str> = self
            .failure_transports
            .values()
            .chain(self.default_failure_transport.iter())
            .map(String::as_str)
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// Uses `strategy` for messages received from `transport`.
    pub fn strategy(
        mut self,
        transport: impl Into<String>,
        strategy: Arc<dyn RetryStrategy>,
    ) -> Self {
        self.strategies.insert(transport.into(), strategy);
        self
    }

    /// Uses `strategy` for transports without their own.
    pub fn default_strategy(mut self, strategy: Arc<dyn RetryStrategy>) -> Self {
        self.default_strategy = strategy;
        self
    }

    /// Parks messages from `transport` that are out of retries in `failure`.
    pub fn failure_transport_for(
        mut self,
        transport: impl Into<String>,
        failure: impl Into<String>,
    ) -> Self {
        self.failure_transports
            .insert(transport.into(), failure.into());
        self
    }

    /// Parks messages from any other transport in `failure`.
    pub fn failure_transport(mut self, failure: impl Into<String>) -> Self {
        self.default_failure_transport = Some(failure.into());
        self
    }

    fn strategy_for(&self, transport: &str) -> &dyn RetryStrategy {
        self.strategies
            .get(transport)
            .map(|s| &**s)
            .unwrap_or(&*self.default_strategy)
    }

    /// The failure transport for messages received from `transport`.
    pub fn failure_for(&self, transport: &str) -> Option<&str> {
        self.failure_transports
            .get(transport)
            .or(self.default_failure_transport.as_ref())
            .map(String::as_str)
    }

    async fn on_failure(
        &self,
        transport: &str,
        envelope: Envelope,
        errors: Vec<HandlerError>,
    ) -> Result<Envelope> {
        let attempt = envelope
            .last::<RedeliveryStamp>()
            .map_or(0, |r| r.retry_count)
            // A count read from a header may be anything: never wrap.
            .saturating_add(1);
        let hint = combined_hint(&errors);
        let strategy = self.strategy_for(transport);
        // A retry cannot be sent to a transport that handles on send.
        let retry = hint != RetryHint::Unrecoverable
            && !self.without_retry.contains(transport)
            && strategy.is_retryable(&envelope, &errors, attempt);
        if retry {
            let delay = match hint {
                RetryHint::Recoverable(Some(d)) => d,
                _ => strategy.delay(&envelope, attempt),
            };
            let retry = envelope
                .with(RedeliveryStamp::new(attempt))
                .with(DelayStamp::new(delay));
            let sent = self.dispatcher.send(transport, retry).await?;
            return Ok(sent.with(SentStamp::new(transport)));
        }
        let Some(failure) = self.failure_for(transport) else {
            return Err(BusError::HandlerFailed {
                envelope: Box::new(envelope),
                errors,
            });
        };
        // Received from `failure` itself (the newest `ReceivedStamp` names
        // the original transport, added by `FailedMessageProcessing`).
        let again = envelope
            .all::<ReceivedStamp>()
            .any(|r| &*r.transport == failure);
        let parked = parked_copy(envelope, error_details(&errors), transport, again);
        let sent = self.dispatcher.send(failure, parked).await?;
        let mut parked = sent.with(SentStamp::new(failure));
        // What the handlers that succeeded deferred is dispatched by step 2,
        // as for a retry: they will not run again.
        if parked.has::<DeferredDispatches>() {
            parked = parked.with(ParkedWithDeferred);
        }
        Err(BusError::HandlerFailed {
            envelope: Box::new(parked),
            errors,
        })
    }
}

/// The longest [`parked_again_delay`].
pub const MAX_PARKED_AGAIN_DELAY: Duration = Duration::from_secs(3600);

/// How long a message that failed again after being received from its
/// failure transport waits there before it is handed out again, given how
/// many times it was parked before (its [`SentToFailureTransportStamp`]s):
/// 1 s after one, 2 s after two, doubling up to
/// [`MAX_PARKED_AGAIN_DELAY`].
///
/// ```
/// use envoi_core::middleware::retry::parked_again_delay;
/// use std::time::Duration;
///
/// assert_eq!(parked_again_delay(1), Duration::from_secs(1));
/// assert_eq!(parked_again_delay(3), Duration::from_secs(4));
/// assert_eq!(parked_again_delay(40), Duration::from_secs(3600));
/// ```
pub fn parked_again_delay(times_parked: usize) -> Duration {
    let doublings = u32::try_from(times_parked.saturating_sub(1))
        .unwrap_or(u32::MAX)
        .min(12);
    Duration::from_secs(1u64 << doublings).min(MAX_PARKED_AGAIN_DELAY)
}

/// The delay of `envelope` parked in its failure transport: none the first
/// time, [`parked_again_delay`] by the parks it carries when it was parked
/// before (whether it failed again straight from the failure transport or
/// after being sent back from there to its origin), or when it goes `back`
/// into the failure transport it was received from.
pub(crate) fn park_delay(envelope: &Envelope, back: bool) -> Duration {
    let parks = envelope.all::<SentToFailureTransportStamp>().count();
    if back || parks > 0 {
        parked_again_delay(parks)
    } else {
        Duration::ZERO
    }
}

/// `envelope` as it is parked in its failure transport: with why
/// (`details`), where it came from (`origin`, where a retry from the failure
/// transport sends it), a fresh retry budget, and the delay of
/// [`park_delay`] (`back`: it goes back into the failure transport it was
/// received from).
pub(crate) fn parked_copy(
    envelope: Envelope,
    details: ErrorDetailsStamp,
    origin: impl Into<String>,
    back: bool,
) -> Envelope {
    let delay = park_delay(&envelope, back);
    envelope
        .with(details)
        .with(SentToFailureTransportStamp::new(origin))
        .with(RedeliveryStamp::new(0))
        .with(DelayStamp::new(delay))
}

/// Unrecoverable only when every error is; otherwise the first recoverable
/// hint, or the default.
fn combined_hint(errors: &[HandlerError]) -> RetryHint {
    let hints: Vec<_> = errors.iter().map(HandlerError::retry_hint).collect();
    if !hints.is_empty() && hints.iter().all(|h| *h == RetryHint::Unrecoverable) {
        return RetryHint::Unrecoverable;
    }
    hints
        .into_iter()
        .find(|h| matches!(h, RetryHint::Recoverable(_)))
        .unwrap_or(RetryHint::Default)
}

/// One [`ErrorDetailsStamp`] describing every handler failure.
pub fn error_details(errors: &[HandlerError]) -> ErrorDetailsStamp {
    match errors {
        [one] => {
            let mut d = ErrorDetailsStamp::from_error("handler", one);
            d.kind = format!("handler:{}", one.handler);
            d
        }
        many => ErrorDetailsStamp::new(
            "handler",
            many.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        ),
    }
}

/// The retry step. Without a [`RetryConfig`] it only calls `next`.
#[derive(Clone, Debug, Default)]
pub struct Retry {
    config: Option<Arc<RetryConfig>>,
}

impl Retry {
    /// The step with `config`.
    pub fn new(config: Option<Arc<RetryConfig>>) -> Self {
        Self { config }
    }

    /// The configuration, if any.
    pub fn config(&self) -> Option<&RetryConfig> {
        self.config.as_deref()
    }

    #[inline]
    pub(crate) async fn process<F, Fut>(&self, envelope: Envelope, next: F) -> StepResult
    where
        F: FnOnce(Envelope) -> Fut,
        Fut: std::future::Future<Output = StepResult>,
    {
        let (Some(config), Some(received)) = (&self.config, envelope.last::<ReceivedStamp>())
        else {
            return next(envelope).await;
        };
        let transport = received.transport.clone();
        if !config.without_retry.is_empty()
            && config.without_retry.contains(&*transport)
            && !from_failure_transport(&envelope, &transport)
        {
            return next(envelope).await;
        }
        match next(envelope).await {
            Err(error) => match *error {
                BusError::HandlerFailed { envelope, errors } => config
                    .on_failure(&transport, *envelope, errors)
                    .await
                    .map_err(Box::new),
                other => Err(Box::new(other)),
            },
            ok => ok,
        }
    }
}

/// Whether `envelope`, marked received from `transport`, was in fact
/// received from a failure transport it was parked in after failing on
/// `transport` (the mark is [`FailedMessageProcessing`]'s).
///
/// [`FailedMessageProcessing`]: super::failed_message_processing::FailedMessageProcessing
fn from_failure_transport(envelope: &Envelope, transport: &str) -> bool {
    envelope
        .last::<SentToFailureTransportStamp>()
        .is_some_and(|s| s.original_transport == transport)
        && envelope
            .all::<ReceivedStamp>()
            .any(|r| &*r.transport != transport)
}

impl Middleware for Retry {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(async move {
            self.process(envelope, move |e| async move {
                next.run(e).await.map_err(Box::new)
            })
            .await
            .map_err(|e| *e)
        })
    }
}

/// Whether `after`, the successful result of dispatching `before`, was
/// scheduled for a retry by the retry step rather than handled. (Parking in
/// the failure transport returns an error, never a success.)
pub fn was_retried(before: &Envelope, after: &Envelope) -> bool {
    after.all::<RedeliveryStamp>().count() > before.all::<RedeliveryStamp>().count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Unrecoverable;
    use crate::testing::{FailingEndpoint, Ping, RecordingEndpoint, RecordingSenders};

    fn retry(senders: &RecordingSenders, max: u32) -> Retry {
        let cfg = RetryConfig::new(Arc::new(senders.clone()))
            .default_strategy(Arc::new(MultiplierRetryStrategy {
                max_retries: max,
                jitter: 0.0,
                ..Default::default()
            }))
            .failure_transport("failed");
        Retry::new(Some(Arc::new(cfg)))
    }

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

    #[tokio::test]
    async fn a_failed_received_message_is_resent_to_its_origin_with_redelivery_and_delay() {
        let senders = RecordingSenders::default();
        let e = Envelope::new(Ping).with(ReceivedStamp::new("async"));
        let out = retry(&senders, 3)
            .handle(e, FailingEndpoint::plain().next())
            .await
            .unwrap();
        assert_eq!(senders.sent_to(), ["async"]);
        let sent = &senders.envelopes()[0];
        assert_eq!(sent.last::<RedeliveryStamp>().unwrap().retry_count, 1);
        assert_eq!(sent.last::<DelayStamp>().unwrap().ms, 1000);
        assert!(was_retried(&Envelope::new(Ping), &out));
    }

    #[tokio::test]
    async fn out_of_budget_the_message_is_parked_with_error_details() {
        let senders = RecordingSenders::default();
        let e = Envelope::new(Ping)
            .with(ReceivedStamp::new("async"))
            .with(RedeliveryStamp::new(3));
        let err = retry(&senders, 3)
            .handle(e, FailingEndpoint::plain().next())
            .await
            .unwrap_err();
        assert!(matches!(err, BusError::HandlerFailed { .. }));
        assert_eq!(senders.sent_to(), ["failed"]);
        let parked = &senders.envelopes()[0];
        assert_eq!(
            parked
                .last::<SentToFailureTransportStamp>()
                .unwrap()
                .original_transport,
            "async"
        );
        assert!(parked
            .last::<ErrorDetailsStamp>()
            .unwrap()
            .message
            .contains("boom"));
        assert_eq!(parked.last::<RedeliveryStamp>().unwrap().retry_count, 0);
        assert_eq!(parked.last::<DelayStamp>().unwrap().ms, 0);
    }

    #[tokio::test]
    async fn a_retry_count_at_its_maximum_is_out_of_budget_instead_of_wrapping() {
        // A count read from a header can be anything; adding one must not
        // overflow (a panic in debug builds, a fresh budget in release).
        let senders = RecordingSenders::default();
        let e = Envelope::new(Ping)
            .with(ReceivedStamp::new("async"))
            .with(RedeliveryStamp::new(u32::MAX));
        retry(&senders, 3)
            .handle(e, FailingEndpoint::plain().next())
            .await
            .unwrap_err();
        assert_eq!(senders.sent_to(), ["failed"]);
    }

    #[tokio::test]
    async fn a_delay_too_long_for_a_delay_stamp_saturates_instead_of_wrapping() {
        // Retry 64 of 1 s doubling is 2^63 s, more milliseconds than a
        // `u64` holds: the retry must not come back at once.
        let senders = RecordingSenders::default();
        let e = Envelope::new(Ping)
            .with(ReceivedStamp::new("async"))
            .with(RedeliveryStamp::new(63));
        retry(&senders, u32::MAX)
            .handle(e, FailingEndpoint::plain().next())
            .await
            .unwrap();
        let sent = &senders.envelopes()[0];
        assert_eq!(sent.last::<RedeliveryStamp>().unwrap().retry_count, 64);
        assert_eq!(sent.last::<DelayStamp>().unwrap().ms, u64::MAX);
        assert_eq!(DelayStamp::new(Duration::MAX).ms, u64::MAX);
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

    #[tokio::test]
    async fn unrecoverable_errors_skip_the_retries() {
        let senders = RecordingSenders::default();
        let e = Envelope::new(Ping).with(ReceivedStamp::new("async"));
        let end = FailingEndpoint::new(|| Box::new(Unrecoverable::new("bad card")));
        retry(&senders, 3).handle(e, end.next()).await.unwrap_err();
        assert_eq!(senders.sent_to(), ["failed"]);
    }

    #[tokio::test]
    async fn the_first_marker_in_the_chain_counts_so_a_wrapped_unrecoverable_is_retried() {
        let senders = RecordingSenders::default();
        let e = Envelope::new(Ping).with(ReceivedStamp::new("async"));
        let end = FailingEndpoint::new(|| {
            Box::new(crate::error::Recoverable::new(Unrecoverable::new(
                "bad card",
            )))
        });
        retry(&senders, 3).handle(e, end.next()).await.unwrap();
        assert_eq!(senders.sent_to(), ["async"]);
    }

    #[tokio::test]
    async fn messages_dispatched_in_process_are_not_retried() {
        let senders = RecordingSenders::default();
        let err = retry(&senders, 3)
            .handle(Envelope::new(Ping), FailingEndpoint::plain().next())
            .await
            .unwrap_err();
        assert!(matches!(err, BusError::HandlerFailed { .. }));
        assert!(senders.sent_to().is_empty());
    }

    /// A message that fails for good on every round trip through its
    /// failure transport (a worker consuming both, or `failed retry` run
    /// again and again) gains stamps each time; what crosses the wire must
    /// stay bounded, or it ends up too large for the transport to store
    /// (an AMQP frame, a NATS payload) and can no longer be parked.
    #[tokio::test]
    async fn a_message_cycling_through_its_failure_transport_keeps_bounded_headers() {
        use crate::middleware::failed_message_processing::FailedMessageProcessing;
        use crate::serializer::Serializer;

        let serializer = Serializer::builder().message::<Ping>().build().unwrap();
        let senders = RecordingSenders::default();
        let step = retry(&senders, 3);
        let end = FailingEndpoint::new(|| "duplicate key value violates constraint".into());
        let header_bytes = |e: &Envelope| -> usize {
            let raw = serializer.encode(e).unwrap();
            raw.headers.iter().map(|(k, v)| k.len() + v.len()).sum()
        };
        let mut stored = Envelope::new(Ping);
        let mut from = "async".to_string();
        let mut sizes = Vec::new();
        for cycle in 1..=60 {
            // Three retries from the origin, then parked.
            for _ in 0..4 {
                let received =
                    FailedMessageProcessing::apply(stored.clone().with(ReceivedStamp::new(from)));
                let before = (
                    received.all::<RedeliveryStamp>().count(),
                    received.all::<SentToFailureTransportStamp>().count(),
                );
                let out = step.handle(received, end.next()).await;
                let sent = senders.envelopes().pop().unwrap();
                // What the worker and `failed retry` tell a retry and a
                // park by: one more stamp than the message arrived with.
                match out {
                    Ok(_) => assert!(sent.all::<RedeliveryStamp>().count() > before.0),
                    Err(_) => {
                        assert!(sent.all::<SentToFailureTransportStamp>().count() > before.1)
                    }
                }
                from = senders.sent_to().pop().unwrap();
                stored = serializer
                    .decode(&serializer.encode(&sent).unwrap())
                    .unwrap();
            }
            assert_eq!(from, "failed", "cycle {cycle}");
            sizes.push(header_bytes(&stored));
        }
        // Parked many times, it comes back an hour later at most.
        assert_eq!(
            park_delay(&stored, true),
            MAX_PARKED_AGAIN_DELAY,
            "the park history still reaches the longest delay"
        );
        assert_eq!(
            stored
                .last::<SentToFailureTransportStamp>()
                .unwrap()
                .original_transport,
            "async"
        );
        assert_eq!(stored.last::<RedeliveryStamp>().unwrap().retry_count, 0);
        assert!(
            sizes[59] <= sizes[29],
            "headers keep growing: {} bytes after 30 cycles, {} after 60",
            sizes[29],
            sizes[59]
        );
    }

    #[tokio::test]
    async fn success_passes_through() {
        let senders = RecordingSenders::default();
        let end = RecordingEndpoint::new();
        let e = Envelope::new(Ping).with(ReceivedStamp::new("async"));
        retry(&senders, 3).handle(e, end.next()).await.unwrap();
        assert_eq!(end.calls().len(), 1);
        assert!(senders.sent_to().is_empty());
    }
}
