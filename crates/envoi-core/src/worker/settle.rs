//! What becomes of a handled message: its verdict mapped to an
//! acknowledgement, a rejection or a release, in one place.

use std::borrow::Cow;
use std::time::Duration;

use super::events::{bump, WorkerEvent};
use super::fetch::MessageId;
use super::handle::Ctx;
use crate::envelope::stamp::TransportMessageIdStamp;
use crate::envelope::Envelope;
use crate::error::BusError;
use crate::pipeline::verdict::{Fate, Verdict};

/// What the transport of a message is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    /// Remove it: handled, retried or parked.
    Ack,
    /// Remove it for good, unhandled: it failed and has nowhere to go.
    Reject,
    /// Give it back, to be delivered again.
    Release,
}

/// A message settled: its receiver, what to do with it, and where a copy
/// of it went.
pub(super) struct Done {
    pub(super) receiver: usize,
    pub(super) action: Action,
    /// The id of the copy parked back into the transport the message came
    /// from (a failure transport being consumed).
    pub(super) again: Option<String>,
}

impl Done {
    pub(super) fn new(receiver: usize, action: Action) -> Self {
        Done {
            receiver,
            action,
            again: None,
        }
    }
}

impl Ctx {
    /// Settles a message received from `receiver` by what its dispatch
    /// did: the one place a verdict becomes an acknowledgement, a rejection
    /// or a release (parking what failed outside the retry step, and the
    /// dispatches its handlers deferred that failed, on the way).
    pub(super) async fn settle(
        &self,
        receiver: usize,
        id: MessageId,
        envelope: &Envelope,
        verdict: Verdict,
        duration: Duration,
    ) -> Done {
        let Verdict {
            fate,
            failed_deferred,
            ..
        } = verdict;
        let (action, again) = match fate {
            Fate::Handled(after) => {
                // What its handlers deferred that failed is parked on its
                // own; one that cannot be parked is kept by giving the
                // message back (its handlers defer it again).
                let instead = if failed_deferred.is_empty() {
                    None
                } else {
                    self.park_deferred(receiver, &id, envelope, failed_deferred, false)
                        .await
                };
                let action = match instead {
                    Some(Action::Release) => Action::Release,
                    rejected => {
                        let acked = self.handled(receiver, &id, after, duration);
                        rejected.unwrap_or(acked)
                    }
                };
                (action, None)
            }
            Fate::Retried {
                envelope: after,
                attempt,
                ..
            } => {
                // The retry holds the message: it is acknowledged whatever
                // becomes of what its handlers deferred.
                if !failed_deferred.is_empty() {
                    self.park_deferred(receiver, &id, envelope, failed_deferred, true)
                        .await;
                }
                let after = after.unwrap_or_else(|| envelope.clone());
                (self.retried(receiver, &id, after, attempt, duration), None)
            }
            Fate::Parked {
                envelope: parked,
                failure_transport,
                reason,
            } => {
                if !failed_deferred.is_empty() {
                    self.park_deferred(receiver, &id, envelope, failed_deferred, true)
                        .await;
                }
                let message = envelope.message_name();
                self.parked_by_retry(receiver, &id, message, parked, failure_transport, reason)
            }
            Fate::Failed(error) => self.failed(receiver, &id, envelope, error).await,
        };
        Done {
            receiver,
            action,
            again,
        }
    }

    /// Counts and reports a message the retry step parked, and says to
    /// acknowledge it; returns the id of the copy when it went back into
    /// the transport it came from.
    fn parked_by_retry(
        &self,
        receiver: usize,
        id: &MessageId,
        message: &'static str,
        parked: Option<Envelope>,
        failure_transport: String,
        reason: String,
    ) -> (Action, Option<String>) {
        let transport = &self.receivers[receiver].name;
        bump(&self.counters.failed);
        self.parked(receiver, true);
        let again = (failure_transport == **transport)
            .then(|| parked.as_ref()?.last::<TransportMessageIdStamp>())
            .flatten()
            .map(|s| s.id.clone());
        self.events.emit(|| WorkerEvent::Failed {
            transport: transport.clone(),
            id: id.text().into_owned(),
            message: Cow::Borrowed(message),
            kind: Cow::Borrowed("handler"),
            error: reason,
            parked_in: Some(failure_transport),
            released: false,
            envelope: parked,
        });
        (Action::Ack, again)
    }

    /// Settles a message that failed and went nowhere: rejected when its
    /// handlers failed with no failure transport; kept when its retry or
    /// park could not be sent for now; parked otherwise.
    async fn failed(
        &self,
        receiver: usize,
        id: &MessageId,
        envelope: &Envelope,
        error: BusError,
    ) -> (Action, Option<String>) {
        let transport = &self.receivers[receiver].name;
        match error {
            error @ BusError::HandlerFailed { .. } => {
                bump(&self.counters.failed);
                self.events.emit(|| WorkerEvent::Failed {
                    transport: transport.clone(),
                    id: id.text().into_owned(),
                    message: Cow::Borrowed(envelope.message_name()),
                    kind: Cow::Borrowed("handler"),
                    error: error.to_string(),
                    parked_in: None,
                    released: false,
                    envelope: error.envelope().cloned(),
                });
                (Action::Reject, None)
            }
            // One refused for good by the transport it was to go back to
            // (gone from the configuration, or the message too large for
            // it) is parked below, as sending it again would fail again.
            error @ BusError::Transport { .. }
                if !self.refused_for_good_before_parking(transport, &error) =>
            {
                self.not_sent(receiver, id, envelope, error);
                (Action::Release, None)
            }
            error => {
                self.park_failed(receiver, id, envelope.clone(), error)
                    .await
            }
        }
    }
}
