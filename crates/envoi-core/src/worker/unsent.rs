//! Messages parked because they could not be sent: retried from the
//! failure transport, they are sent, not handled.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::events::bump;
use super::fetch::MessageId;
use super::handle::Ctx;
use super::park::{failure_target, refused_for_good, Failure};
use super::settle::{Action, Done};
use crate::envelope::stamp::{
    DelayStamp, ErrorDetailsStamp, SentStamp, SentToFailureTransportStamp, UnsentStamp,
};
use crate::envelope::Envelope;
use crate::error::BusError;

impl Ctx {
    /// Sends a message parked because it could not be sent ([`UnsentStamp`])
    /// to the transport it was going to, without that stamp, instead of
    /// handling it: it was never received. The transports its message type
    /// is routed to after that one are sent to as well: the failed send
    /// stopped before them. Sent, it is acknowledged, and
    /// counted and reported as handled; otherwise it is released and kept,
    /// and fetching from its receiver pauses, as when a retry cannot be
    /// sent.
    #[cold]
    pub(super) async fn send_unsent(
        &self,
        receiver: usize,
        id: MessageId,
        envelope: Envelope,
    ) -> Done {
        let started = self.events.enabled().then(Instant::now);
        let mut unsent = envelope.clone();
        let to = unsent
            .last::<UnsentStamp>()
            .map(|u| u.transport.clone())
            .unwrap_or_default();
        unsent.remove_last::<UnsentStamp>();
        // Not delayed by its park.
        if unsent.last::<DelayStamp>().is_some_and(|d| d.ms > 0) {
            unsent = unsent.with(DelayStamp::new(Duration::ZERO));
        }
        // The routes after `to` were not sent to either: the failed send
        // stopped there.
        let after: Vec<Arc<str>> = self
            .bus_for(&unsent)
            .send_step()
            .and_then(|step| step.routes().get(unsent.message_type_id()))
            .map(|routes| {
                routes
                    .iter()
                    .skip_while(|route| ***route != *to)
                    .skip(1)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let mut sent = Ok(unsent);
        for target in std::iter::once(&*to).chain(after.iter().map(|t| &**t)) {
            let Ok(envelope) = sent else { break };
            sent = self
                .messenger
                .sender_dispatcher()
                .send(target, envelope)
                .await
                .map(|e| e.with(SentStamp::new(target)));
        }
        let action = match sent {
            Ok(sent) => {
                let duration = started.map(|s| s.elapsed()).unwrap_or_default();
                self.handled(receiver, &id, sent, duration)
            }
            Err(error) => match refused_for_good(&error).map(str::to_owned) {
                Some(to) => {
                    return Box::pin(self.park_unsent(receiver, &id, envelope, error, to)).await;
                }
                None => {
                    self.not_sent(receiver, &id, &envelope, error);
                    Action::Release
                }
            },
        };
        Done {
            receiver,
            action,
            again: None,
        }
    }

    /// Whether `error` is a transport refusing for good the retry of a
    /// message received from `transport`, and not its failure transport
    /// (parking it there would fail the same way).
    pub(super) fn refused_for_good_before_parking(
        &self,
        transport: &str,
        error: &BusError,
    ) -> bool {
        let Some(to) = refused_for_good(error) else {
            return false;
        };
        let origin = error
            .envelope()
            .and_then(|e| e.last::<SentToFailureTransportStamp>())
            .map(|s| s.original_transport.clone());
        failure_target(&self.messenger, transport, origin).1 != Some(to)
    }

    /// Parks again a message parked because it could not be sent
    /// ([`UnsentStamp`]) that transport `refused_by` refused for good
    /// (`error`: it does not exist, or the message is too large for it):
    /// sent again, it would be refused again, and released, it would be
    /// fetched, refused and released over and over, pausing its receiver
    /// each time. The parked copy names the transport that refused it, is
    /// handed out again later (the delay grows with each park), and says
    /// why; the received message is acknowledged. When it cannot be parked,
    /// it is released and fetching from its receiver pauses, as for any
    /// message that cannot be parked.
    #[cold]
    async fn park_unsent(
        &self,
        receiver: usize,
        id: &MessageId,
        envelope: Envelope,
        error: BusError,
        refused_by: String,
    ) -> Done {
        bump(&self.counters.failed);
        let transport = &self.receivers[receiver].name;
        let details = ErrorDetailsStamp::from_error(error.kind(), &error);
        let mut parked = envelope;
        parked.remove_last::<UnsentStamp>();
        let parked = parked.with(UnsentStamp::new(refused_by.clone()));
        let (origin, failure) = failure_target(&self.messenger, transport, Some(refused_by));
        let id = id.text();
        let how = Failure {
            receiver,
            transport,
            id: &id,
            message: parked.message_name(),
            kind: &details.kind,
            error: details.message.clone(),
            what: "could not be sent again",
            release: true,
        };
        let (action, again) = self.park_copy(how, parked, &details, failure, origin).await;
        Done {
            receiver,
            action,
            again,
        }
    }
}
