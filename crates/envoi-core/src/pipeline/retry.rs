//! Step 6 of the canonical pipeline: retry failed handling, or park the
//! message in the failure transport.
//!
//! Only a message received from a transport is retried, and only when its
//! handlers failed ([`BusError::HandlerFailed`]); transport and serialization
//! errors go back to the caller untouched. A retry is re-sent to the
//! transport the message came from (its [`ReceivedStamp`]) with a
//! [`RedeliveryStamp`] and a [`DelayStamp`]; the worker then acknowledges the
//! original. Out of budget, the message goes to the failure transport with an
//! [`ErrorDetailsStamp`](crate::envelope::stamp::ErrorDetailsStamp) and a [`SentToFailureTransportStamp`].
//!
//! An event's handlers that succeeded beside one that failed keep their
//! `HandledStamp`s on the retry or the parked message, so they do not run
//! again; what they deferred with a
//! [`DispatchAfterCurrentBusStamp`](crate::envelope::stamp::DispatchAfterCurrentBusStamp)
//! is therefore dispatched once the retry is sent or the message parked
//! (by [step 2](super::dispatch_after_current_bus)), not dropped.
//!
//! A message sent to the failure transport also gets a `RedeliveryStamp`
//! with a count of zero, so when it is retried from there it starts with a
//! fresh budget — and if it fails again, it returns there.
//!
//! It returns there later, not at once: available again after
//! [`parked_again_delay`](crate::failure::parked_again_delay) — 1 s the first time, doubling each time it comes
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

use std::sync::Arc;

use super::frame::{self, RetryRecord};
use crate::envelope::stamp::{
    DelayStamp, ReceivedStamp, RedeliveryStamp, SentStamp, SentToFailureTransportStamp,
};
use crate::envelope::Envelope;
use crate::error::{BusError, HandlerError, Result, StepResult};
use crate::failure::park::{error_details, park};
use crate::failure::policy::{Decision, FailurePolicy};
use crate::middleware::{Middleware, Next};
use crate::transport::SenderDispatcher;
use crate::BoxFuture;

/// Retries or parks `envelope`, received from `transport`, whose handlers
/// failed with `errors`, as `config`'s policy decides.
async fn on_failure(
    config: &RetryConfig,
    transport: &str,
    envelope: Envelope,
    errors: Vec<HandlerError>,
) -> Result<Envelope> {
    let failure = match config.decide(transport, &envelope, &errors) {
        Decision::Retry { attempt, delay } => {
            let retry = envelope
                .with(RedeliveryStamp::new(attempt))
                .with(DelayStamp::new(delay));
            let sent = config.dispatcher().send(transport, retry).await?;
            frame::record_retry(RetryRecord::Retried { attempt, delay });
            return Ok(sent.with(SentStamp::new(transport)));
        }
        Decision::Fail => {
            return Err(BusError::HandlerFailed {
                envelope: Box::new(envelope),
                errors,
            })
        }
        Decision::Park { failure } => failure,
    };
    // Received from `failure` itself (the newest `ReceivedStamp` names
    // the original transport, added by `FailedMessageProcessing`).
    let again = envelope
        .all::<ReceivedStamp>()
        .any(|r| &*r.transport == failure);
    let details = error_details(&errors);
    let sent = park(
        config.dispatcher(),
        failure,
        envelope,
        details,
        transport,
        again,
    )
    .await?;
    let parked = sent.with(SentStamp::new(failure));
    // Step 2 then dispatches what the handlers that succeeded deferred, as
    // for a retry (they will not run again), and a worker knows the message
    // is parked.
    frame::record_retry(RetryRecord::Parked {
        failure: failure.to_string(),
    });
    Err(BusError::HandlerFailed {
        envelope: Box::new(parked),
        errors,
    })
}

/// What the retry step works with: the failure policy, and where it sends
/// retries and parked messages.
#[derive(Clone)]
pub(crate) struct RetryConfig {
    policy: Arc<FailurePolicy>,
    dispatcher: Arc<dyn SenderDispatcher>,
}

impl RetryConfig {
    fn decide(
        &self,
        transport: &str,
        envelope: &Envelope,
        errors: &[HandlerError],
    ) -> Decision<'_> {
        self.policy.decide(transport, envelope, errors)
    }

    fn dispatcher(&self) -> &dyn SenderDispatcher {
        &*self.dispatcher
    }
}

/// The retry step: retries or parks a received message whose handlers
/// failed, as its [`FailurePolicy`] says, sending through a
/// [`SenderDispatcher`]. Disabled, it only calls `next`.
#[derive(Clone, Default)]
pub struct Retry {
    config: Option<RetryConfig>,
}

impl std::fmt::Debug for Retry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retry")
            .field("policy", &self.policy())
            .finish()
    }
}

impl Retry {
    /// The step with `policy`, sending retries and parked messages through
    /// `dispatcher`.
    pub fn new(policy: FailurePolicy, dispatcher: Arc<dyn SenderDispatcher>) -> Self {
        Self::shared(Arc::new(policy), dispatcher)
    }

    pub(crate) fn shared(
        policy: Arc<FailurePolicy>,
        dispatcher: Arc<dyn SenderDispatcher>,
    ) -> Self {
        Self {
            config: Some(RetryConfig { policy, dispatcher }),
        }
    }

    /// The step that only calls `next`: nothing is retried or parked.
    pub fn disabled() -> Self {
        Self::default()
    }

    /// The failure policy, unless the step is disabled.
    pub fn policy(&self) -> Option<&FailurePolicy> {
        self.config.as_ref().map(|c| &*c.policy)
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
        if config.policy.skips(&transport) && !from_failure_transport(&envelope, &transport) {
            return next(envelope).await;
        }
        match next(envelope).await {
            Err(error) => match *error {
                BusError::HandlerFailed { envelope, errors } => {
                    on_failure(config, &transport, *envelope, errors)
                        .await
                        .map_err(Box::new)
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::stamp::ErrorDetailsStamp;
    use crate::error::Unrecoverable;
    use crate::failure::park::{park_delay, MAX_PARKED_AGAIN_DELAY};
    use crate::failure::MultiplierRetryStrategy;
    use crate::middleware::was_retried;
    use crate::testing::{FailingEndpoint, Ping, RecordingEndpoint, RecordingSenders};
    use std::time::Duration;

    fn retry(senders: &RecordingSenders, max: u32) -> Retry {
        let policy = FailurePolicy::new()
            .default_retry_strategy(MultiplierRetryStrategy {
                max_retries: max,
                jitter: 0.0,
                ..Default::default()
            })
            .failure_transport("failed");
        Retry::new(policy, Arc::new(senders.clone()))
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
        use crate::pipeline::failed_message_processing::FailedMessageProcessing;
        use crate::transport::serializer::Serializer;

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
