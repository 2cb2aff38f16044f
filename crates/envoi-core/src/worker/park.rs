//! Parking what fails outside the retry step: a message that did not
//! decode, failed on its way (no handler, a middleware's error, a panic),
//! or a dispatch its handlers deferred that failed; and pausing a receiver
//! whose messages cannot be parked.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::events::{bump, panic_message, WorkerEvent};
use super::fetch::MessageId;
use super::handle::Ctx;
use super::settle::{Action, Done};
use crate::envelope::stamp::{
    ErrorDetailsStamp, RedeliveryStamp, SentToFailureTransportStamp, Stamp,
    TransportMessageIdStamp, UnsentStamp,
};
use crate::envelope::Envelope;
use crate::error::{BusError, TransportError};
use crate::failure::park::{append_stamp_header, park, parked_again_delay};
use crate::messenger::Messenger;
use crate::pipeline::dispatch_after_current_bus::FailedDispatch;
use crate::transport::serializer::STAMP_HEADER_PREFIX;
use crate::transport::RawMessage;
use crate::BoxFuture;

/// The first pause in fetching from a receiver after one of its messages
/// could not be parked; it doubles with each failure in a row, up to
/// [`MAX_PARK_BACKOFF`]. The other receivers are read meanwhile.
const PARK_BACKOFF: Duration = Duration::from_millis(100);
/// The longest pause in fetching from a receiver while parking its
/// messages keeps failing.
const MAX_PARK_BACKOFF: Duration = Duration::from_secs(5);

/// The transport that refused a message for good, when `error` says one
/// did: it does not exist, or would refuse the message on every try (too
/// large, not encodable, not supported), as opposed to being out of reach
/// for now.
pub(super) fn refused_for_good(error: &BusError) -> Option<&str> {
    match error {
        BusError::Transport {
            transport,
            source:
                TransportError::UnknownTransport(_)
                | TransportError::TooLarge { .. }
                | TransportError::Serialization(_)
                | TransportError::Unsupported(_),
            ..
        } => Some(transport),
        _ => None,
    }
}

/// Where to park a message that failed outside the retry step: the failure
/// transport of the transport it originally came from (`origin`, when it
/// was parked before) or else of `source`.
pub(super) fn failure_target<'m>(
    messenger: &'m Messenger,
    source: &str,
    origin: Option<String>,
) -> (String, Option<&'m str>) {
    let origin = origin.unwrap_or_else(|| source.to_string());
    let failure = messenger.failure_transport_for(&origin);
    (origin, failure)
}

impl Ctx {
    /// Notes whether parking a message of `receiver` (or sending its
    /// retry, which the retry step does) worked.
    pub(super) fn parked(&self, receiver: usize, worked: bool) {
        if worked {
            self.park_failures[receiver].store(0, Ordering::Relaxed);
        } else {
            self.park_failures[receiver].fetch_add(1, Ordering::Relaxed);
            self.park_failed[receiver].store(true, Ordering::Relaxed);
            self.any_park_failed.store(true, Ordering::Relaxed);
        }
    }

    /// Whether parking failed for any receiver since the last call (then
    /// [`Ctx::park_backoff`] tells which).
    pub(super) fn take_park_failed(&self) -> bool {
        self.any_park_failed.swap(false, Ordering::Relaxed)
    }

    /// How long to pause fetching from `receiver` when parking one of its
    /// messages failed since the last call: a message that could not be
    /// parked is released, and fetched again at once it would fail again
    /// at once, in a loop as fast as the transports go. Only its receiver
    /// pauses: a message that can never be parked (too large for the
    /// failure transport, say) must not hold up the others' work.
    pub(super) fn park_backoff(&self, receiver: usize) -> Option<Duration> {
        if !self.park_failed[receiver].swap(false, Ordering::Relaxed) {
            return None;
        }
        let failures = self.park_failures[receiver].load(Ordering::Relaxed).max(1);
        let factor = 1u32 << (failures - 1).min(16);
        Some((PARK_BACKOFF * factor).min(MAX_PARK_BACKOFF))
    }

    /// Parks in the failure transport of the received message `envelope`,
    /// each as a message of its own, the dispatches deferred by its
    /// handlers that failed (`failed`), with why: they are
    /// consequences of handling that happened and will not happen again
    /// (the message is acknowledged, or its retry, or parked copy, carries
    /// the `HandledStamp`s of the handlers that deferred them). Each gets a
    /// [`Failed`](crate::worker::WorkerEvent::Failed) event and counts as failed. Returns
    /// `None` when every one was parked; otherwise what to do with the
    /// received message instead of acknowledging it: release it, so its
    /// handlers run and defer them again, when one could not be parked (and
    /// its receiver pauses, as when parking fails); reject it when there is
    /// no failure transport. When `kept` — the message lives on as its
    /// retry or parked copy, whose handlers that deferred them do not run
    /// again — it is always `None`: given back too, the message would be
    /// handled twice and retried or parked twice, so a deferred dispatch
    /// that cannot be parked is dropped, with an error log.
    pub(super) fn park_deferred<'a>(
        &'a self,
        receiver: usize,
        id: &'a MessageId,
        envelope: &'a Envelope,
        failed: Vec<FailedDispatch>,
        kept: bool,
    ) -> BoxFuture<'a, Option<Action>> {
        Box::pin(async move {
            let transport = &self.receivers[receiver].name;
            let origin = envelope
                .last::<SentToFailureTransportStamp>()
                .map(|s| s.original_transport.clone());
            let (origin, failure) = failure_target(&self.messenger, transport, origin);
            let id = id.text();
            let mut action = None;
            for FailedDispatch {
                envelope: deferred,
                error,
                ..
            } in failed
            {
                bump(&self.counters.failed);
                let details = ErrorDetailsStamp::from_error(error.kind(), &error);
                // One that could not be sent comes from where it was going:
                // retried, it is sent there.
                let origin = deferred
                    .last::<UnsentStamp>()
                    .map_or_else(|| origin.clone(), |u| u.transport.clone());
                let how = Failure {
                    receiver,
                    transport,
                    id: &id,
                    message: deferred.message_name(),
                    kind: &details.kind,
                    error: details.message.clone(),
                    what: "was deferred by a handler and failed",
                    release: !kept,
                };
                let (outcome, _) = self
                    .park_copy(how, deferred, &details, failure, origin)
                    .await;
                match outcome {
                    // The message lives on as its retry or parked copy: it
                    // is acknowledged whatever became of this dispatch.
                    _ if kept => {}
                    Action::Ack => {}
                    Action::Reject => action = Some(Action::Reject),
                    Action::Release => return Some(Action::Release),
                }
            }
            action
        })
    }

    /// Reports a message whose retry, or park, the retry step could not
    /// send (`error`), or a message parked because it could not be sent
    /// ([`UnsentStamp`]) that could not be sent again: it is released and
    /// kept, and, fetched again at once,
    /// it would be handled and fail again at once, so fetching from its
    /// receiver pauses as when the worker cannot park.
    #[cold]
    #[inline(never)]
    pub(super) fn not_sent(
        &self,
        receiver: usize,
        id: &MessageId,
        envelope: &Envelope,
        error: BusError,
    ) {
        bump(&self.counters.failed);
        self.parked(receiver, false);
        let transport = &self.receivers[receiver].name;
        let origin = envelope
            .last::<SentToFailureTransportStamp>()
            .map(|s| s.original_transport.clone());
        let (_, failure) = failure_target(&self.messenger, transport, origin);
        let error = match &error {
            BusError::Transport { transport: to, .. } if envelope.has::<UnsentStamp>() => {
                format!("it could not be sent to `{to}` again: {error}")
            }
            BusError::Transport { transport: to, .. } if failure == Some(to.as_str()) => {
                format!("it failed and could not be parked in `{to}`: {error}")
            }
            BusError::Transport { transport: to, .. } => {
                format!("it failed and its retry could not be sent to `{to}`: {error}")
            }
            _ => error.to_string(),
        };
        tracing::error!(
            transport = %transport,
            id = %id.text(),
            message = envelope.message_name(),
            error = %error,
            "message released and kept: fetching from its transport pauses, the others are read"
        );
        self.events.emit(|| WorkerEvent::Failed {
            transport: transport.clone(),
            id: id.text().into_owned(),
            message: Cow::Borrowed(envelope.message_name()),
            kind: Cow::Borrowed("transport"),
            error,
            parked_in: None,
            released: true,
            envelope: Some(envelope.clone()),
        });
    }

    /// Parks a message whose dispatch failed with `error` outside the
    /// retry step. Boxed, and made without keeping the error: the future of
    /// every message holds what this one awaits.
    pub(super) fn park_failed<'a>(
        &'a self,
        receiver: usize,
        id: &MessageId,
        envelope: Envelope,
        error: BusError,
    ) -> BoxFuture<'a, (Action, Option<String>)> {
        let details = ErrorDetailsStamp::from_error(error.kind(), &error);
        let envelope = error.envelope().cloned().unwrap_or(envelope);
        let id = id.text().into_owned();
        Box::pin(async move { self.park(receiver, &id, envelope, details).await })
    }

    /// Parks `envelope` (which failed outside the retry step) in its failure
    /// transport; rejects it when there is none; releases it when parking
    /// fails. Also returns the id of the parked copy when it went back into
    /// the transport it came from.
    async fn park(
        &self,
        receiver: usize,
        id: &str,
        envelope: Envelope,
        details: ErrorDetailsStamp,
    ) -> (Action, Option<String>) {
        bump(&self.counters.failed);
        let transport = &self.receivers[receiver].name;
        let origin = envelope
            .last::<SentToFailureTransportStamp>()
            .map(|s| s.original_transport.clone());
        let (origin, failure) = failure_target(&self.messenger, transport, origin);
        let how = Failure {
            receiver,
            transport,
            id,
            message: envelope.message_name(),
            kind: &details.kind,
            error: details.message.clone(),
            what: "failed",
            release: true,
        };
        self.park_copy(how, envelope, &details, failure, origin)
            .await
    }

    /// Parks a copy of `envelope` in `failure` with `details` of why, as a
    /// message from `origin`, settles it as `how` says (rejected when there
    /// is no failure transport; released or dropped when parking fails),
    /// and reports it with a [`Failed`](crate::worker::WorkerEvent::Failed) event. Returns
    /// what to do with the received message, and the id of the parked copy
    /// when it went back into the transport it came from.
    pub(super) async fn park_copy(
        &self,
        how: Failure<'_>,
        envelope: Envelope,
        details: &ErrorDetailsStamp,
        failure: Option<&str>,
        origin: String,
    ) -> (Action, Option<String>) {
        let transport = &self.receivers[how.receiver].name;
        let (id, message) = (how.id, envelope.message_name());
        let mut outcome = self
            .settle_failure(
                how,
                failure.map(|failure| {
                    // Back into the transport it came from: later, not at
                    // once, or a worker consuming it would spin on it.
                    let back = failure == &**transport;
                    let dispatcher = &**self.messenger.sender_dispatcher();
                    let sent = park(
                        dispatcher,
                        failure,
                        envelope.clone(),
                        details.clone(),
                        origin,
                        back,
                    );
                    (failure, async move {
                        sent.await
                            .map(|e| e.last::<TransportMessageIdStamp>().map(|s| s.id.clone()))
                    })
                }),
            )
            .await;
        let again = outcome.again(transport);
        self.events.emit(|| WorkerEvent::Failed {
            transport: transport.clone(),
            id: id.to_string(),
            message: Cow::Borrowed(message),
            kind: Cow::Owned(details.kind.clone()),
            error: outcome.error,
            parked_in: outcome.parked_in,
            released: outcome.released,
            envelope: Some(envelope),
        });
        (outcome.action, again)
    }

    /// Moves a message that did not decode to the failure transport as it
    /// is, with `ErrorDetails`, `SentToFailureTransport` and `Redelivery`
    /// stamp headers added.
    pub(super) async fn park_raw(
        &self,
        receiver: usize,
        id: &str,
        mut raw: RawMessage,
        error: crate::error::SerializationError,
    ) -> Done {
        bump(&self.counters.failed);
        let transport = &self.receivers[receiver].name;
        let details = ErrorDetailsStamp::from_error(format!("decode:{}", error.kind()), &error);
        let message = raw
            .header(crate::transport::serializer::TYPE_HEADER)
            .unwrap_or("?")
            .to_string();
        let parks = raw
            .header(&format!(
                "{STAMP_HEADER_PREFIX}{}",
                SentToFailureTransportStamp::NAME
            ))
            .and_then(|v| serde_json::from_str::<Vec<SentToFailureTransportStamp>>(v).ok())
            .unwrap_or_default();
        let origin = parks.last().map(|s| s.original_transport.clone());
        let (origin, failure) = failure_target(&self.messenger, transport, origin);
        // A failure transport that is only a sender (it takes envelopes)
        // cannot take this message: parking fails and it is kept.
        let target = failure.map(|f| (f, self.messenger.transport(f)));
        let mut outcome = self
            .settle_failure(
                Failure {
                    receiver,
                    transport,
                    id,
                    message: &message,
                    kind: &details.kind,
                    error: error.to_string(),
                    what: "did not decode",
                    release: true,
                },
                target.map(|(name, failure)| {
                    append_stamp_header(&mut raw, &details);
                    append_stamp_header(&mut raw, &SentToFailureTransportStamp::new(origin));
                    append_stamp_header(&mut raw, &RedeliveryStamp::new(0));
                    // Back into the transport it came from: later.
                    let delay = (name == &**transport).then(|| parked_again_delay(parks.len()));
                    let sent = match failure {
                        Some(failure) => failure.send(raw, delay),
                        None => Box::pin(std::future::ready(Err(TransportError::Unsupported(
                            "taking a message that does not decode (this failure transport is only a sender)",
                        )))),
                    };
                    (name, async move { sent.await.map(Some) })
                }),
            )
            .await;
        let again = outcome.again(transport);
        self.events.emit(|| WorkerEvent::Failed {
            transport: transport.clone(),
            id: id.to_string(),
            message: Cow::Owned(message),
            kind: Cow::Owned(details.kind),
            error: outcome.error,
            parked_in: outcome.parked_in,
            released: outcome.released,
            envelope: None,
        });
        Done {
            receiver,
            action: outcome.action,
            again,
        }
    }

    /// The ending both kinds of parking share: without a failure transport
    /// the message is rejected (with a warning); otherwise `send` parks it
    /// and it is acknowledged, or, when that fails, released (with an
    /// error) and fetching pauses.
    async fn settle_failure<E: fmt::Display>(
        &self,
        failed: Failure<'_>,
        send: Option<(&str, impl Future<Output = Result<Option<String>, E>>)>,
    ) -> Settled {
        let Some((name, send)) = send else {
            return self.unparkable(failed);
        };
        // A failure transport whose `send` panics leaves the message where
        // it is, like one whose `send` fails: caught here, the panic neither
        // brings the worker down nor goes unreported.
        let sent = match futures_util::FutureExt::catch_unwind(AssertUnwindSafe(send)).await {
            Ok(sent) => sent.map_err(|e| e.to_string()),
            Err(panic) => Err(format!("it panicked: {}", panic_message(&*panic))),
        };
        match sent {
            Ok(id) => {
                self.parked(failed.receiver, true);
                Settled {
                    action: Action::Ack,
                    parked_in: Some(name.to_string()),
                    id,
                    released: false,
                    error: failed.error,
                }
            }
            Err(e) => self.not_parked(failed, name, &e),
        }
    }

    /// A failed message with no failure transport to go to: rejected, with
    /// a warning.
    fn unparkable(&self, failed: Failure<'_>) -> Settled {
        let Failure {
            transport,
            id,
            message,
            kind,
            error,
            what,
            ..
        } = failed;
        tracing::warn!(
            transport = %transport,
            id,
            message,
            kind,
            error = %error,
            "message rejected: it {what} and no failure transport is configured"
        );
        Settled {
            action: Action::Reject,
            parked_in: None,
            id: None,
            released: false,
            error,
        }
    }

    /// A failed message that `failure` did not take (`why`): released and
    /// kept, or dropped when it lives on elsewhere; fetching from its
    /// receiver pauses either way.
    fn not_parked(&self, failed: Failure<'_>, failure: &str, why: &str) -> Settled {
        let Failure {
            receiver,
            transport,
            id,
            message,
            error,
            what,
            release,
            ..
        } = failed;
        self.parked(receiver, false);
        if !release {
            let error = format!("{error}; parking in `{failure}` failed, so it is dropped: {why}");
            tracing::error!(
                transport = %transport,
                id,
                message,
                error = %error,
                "message dropped: it {what} and could not be parked"
            );
            return Settled {
                action: Action::Ack,
                parked_in: None,
                id: None,
                released: false,
                error,
            };
        }
        let error = format!("{error}; parking in `{failure}` failed: {why}");
        tracing::error!(
            transport = %transport,
            id,
            message,
            error = %error,
            "message released: it {what} and could not be parked"
        );
        Settled {
            action: Action::Release,
            parked_in: None,
            id: None,
            released: true,
            error,
        }
    }

    /// Parks the envelope of a handler that panicked.
    pub(super) async fn park_panicked(
        &self,
        receiver: usize,
        id: &str,
        envelope: Option<Envelope>,
        message: String,
    ) -> Done {
        match envelope {
            Some(envelope) => {
                let details = ErrorDetailsStamp::new("panic", message);
                let (action, again) = self.park(receiver, id, envelope, details).await;
                Done {
                    receiver,
                    action,
                    again,
                }
            }
            // Only a raw park can have no envelope: the failure transport's
            // send panicked. The message is given back rather than lost, and
            // fetching pauses as when parking fails, or it would be fetched
            // and panic again at once.
            None => {
                self.parked(receiver, false);
                let transport = &self.receivers[receiver].name;
                let error = format!("parking it panicked: {message}");
                tracing::error!(
                    transport = %transport,
                    id,
                    error = %error,
                    "message released: it did not decode and could not be parked"
                );
                self.events.emit(|| WorkerEvent::Failed {
                    transport: transport.clone(),
                    id: id.to_string(),
                    message: Cow::Borrowed("?"),
                    kind: Cow::Borrowed("panic"),
                    error,
                    parked_in: None,
                    released: true,
                    envelope: None,
                });
                Done::new(receiver, Action::Release)
            }
        }
    }
}

impl Settled {
    /// The id of the copy parked back into `transport`, the transport the
    /// message came from.
    fn again(&mut self, transport: &str) -> Option<String> {
        if self.parked_in.as_deref() == Some(transport) {
            self.id.take()
        } else {
            None
        }
    }
}

/// A message that failed, as the worker logs it.
pub(super) struct Failure<'a> {
    /// The receiver it came from.
    pub(super) receiver: usize,
    pub(super) transport: &'a str,
    pub(super) id: &'a str,
    pub(super) message: &'a str,
    pub(super) kind: &'a str,
    pub(super) error: String,
    /// What went wrong, for the log: "failed", "did not decode".
    pub(super) what: &'static str,
    /// Whether it is released, kept where it is, when it cannot be parked;
    /// otherwise it is dropped (a deferred dispatch of a message that lives
    /// on as its retry or parked copy: released, the message would be
    /// duplicated).
    pub(super) release: bool,
}

/// What became of a message that failed.
struct Settled {
    action: Action,
    parked_in: Option<String>,
    /// The id of the parked copy, when the transport told it.
    id: Option<String>,
    released: bool,
    /// The error, with why parking failed when it did.
    error: String,
}
