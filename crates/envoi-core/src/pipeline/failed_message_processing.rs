//! Step 3 of the canonical pipeline: a message retried from the failure
//! transport behaves as if it came from its original transport.

use std::sync::Arc;

use crate::envelope::stamp::{ReceivedStamp, SentToFailureTransportStamp};
use crate::envelope::Envelope;
use crate::error::Result;
use crate::middleware::{Middleware, Next};
use crate::BoxFuture;

/// When a received envelope carries a [`SentToFailureTransportStamp`], adds a
/// [`ReceivedStamp`] naming the original transport, so routing, retry
/// strategies and the failure transport treat it like the original delivery.
/// (Stamps are never removed; the newest `ReceivedStamp` wins.)
#[derive(Debug, Clone, Copy, Default)]
pub struct FailedMessageProcessing;

impl FailedMessageProcessing {
    #[inline]
    pub(crate) fn apply(envelope: Envelope) -> Envelope {
        if !envelope.has::<ReceivedStamp>() {
            // Not received from a transport: nothing to restore.
            return envelope;
        }
        // Most received messages were never parked: look no further.
        let Some(failed) = envelope.last::<SentToFailureTransportStamp>() else {
            return envelope;
        };
        let original = match envelope.last::<ReceivedStamp>() {
            Some(received) if *received.transport != *failed.original_transport => {
                Arc::<str>::from(failed.original_transport.as_str())
            }
            _ => return envelope,
        };
        envelope.with(ReceivedStamp {
            transport: original,
        })
    }
}

impl Middleware for FailedMessageProcessing {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(next.run(Self::apply(envelope)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Ping, RecordingEndpoint};

    #[tokio::test]
    async fn a_message_from_the_failure_transport_is_marked_received_from_its_origin() {
        let end = RecordingEndpoint::new();
        let e = Envelope::new(Ping)
            .with(SentToFailureTransportStamp::new("async"))
            .with(ReceivedStamp::new("failed"));
        FailedMessageProcessing.handle(e, end.next()).await.unwrap();
        let seen = end.single();
        assert_eq!(&*seen.last::<ReceivedStamp>().unwrap().transport, "async");
        assert_eq!(seen.all::<ReceivedStamp>().count(), 2);
    }

    #[tokio::test]
    async fn other_messages_pass_untouched() {
        let end = RecordingEndpoint::new();
        let e = Envelope::new(Ping).with(ReceivedStamp::new("async"));
        FailedMessageProcessing.handle(e, end.next()).await.unwrap();
        assert_eq!(end.single().all::<ReceivedStamp>().count(), 1);
    }
}
