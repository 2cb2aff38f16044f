//! Sending a command to the transports it is routed to without waiting
//! for its handler: what comes back is where it went, never an output
//! that cannot exist.

use std::future::Future;

use super::Dispatcher;
use crate::envelope::message::Command;
use crate::envelope::stamp::{SentStamp, TransportMessageIdStamp};
use crate::envelope::Envelope;
use crate::error::BusError;

/// Where a sent message went: one receipt per transport, in routing order.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sent {
    /// Each transport the message was stored in.
    pub receipts: Vec<Receipt>,
}

/// One transport a message was stored in.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Receipt {
    /// The transport's name.
    pub transport: String,
    /// The transport's id of the stored message, when it gave one.
    pub id: Option<String>,
}

impl Sent {
    /// The receipts of `envelope` as the send step returned it.
    fn of(envelope: &Envelope) -> Sent {
        let sent: Vec<&SentStamp> = envelope.all::<SentStamp>().collect();
        let ids: Vec<&TransportMessageIdStamp> =
            envelope.all::<TransportMessageIdStamp>().collect();
        // Each transport adds its id, then the send step its `SentStamp`;
        // ids are paired with transports only when each gave one.
        let paired = ids.len() == sent.len();
        let receipts = sent
            .iter()
            .enumerate()
            .map(|(i, s)| Receipt {
                transport: s.transport.clone(),
                id: paired.then(|| ids[i].id.clone()),
            })
            .collect();
        Sent { receipts }
    }
}

impl Dispatcher {
    /// Sends `command` to the transports it is routed to, through the
    /// whole pipeline as [`dispatch`](Self::dispatch) would, and returns
    /// where it went; its handler runs later, in a worker. Refused before
    /// anything runs when the command is routed to no transport
    /// ([`BusError::NotRouted`]).
    ///
    /// ```
    /// use envoi_core::transport::in_memory::InMemoryTransport;
    /// use envoi_core::{BusError, Command, Message, Messenger};
    /// use std::sync::Arc;
    ///
    /// #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
    /// struct Charge { cents: u64 }
    /// impl Message for Charge { const NAME: &'static str = "Charge"; }
    /// impl Command for Charge { type Output = u64; type Error = std::convert::Infallible; }
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let messenger = Messenger::builder()
    ///     .transport("payments", Arc::new(InMemoryTransport::new()))
    ///     .route::<Charge>("payments")
    ///     .build()
    ///     .unwrap();
    /// let bus = messenger.dispatcher();
    /// let sent = bus.send(Charge { cents: 500 }).await.unwrap();
    /// assert_eq!(sent.receipts[0].transport, "payments");
    /// // Waiting for a `u64` that a transport never gives back is refused,
    /// // and nothing is sent.
    /// let refused = bus.dispatch(Charge { cents: 500 }).await.unwrap_err();
    /// assert!(matches!(refused.infrastructure(), Some(BusError::ExpectsResult { .. })));
    /// # });
    /// ```
    pub fn send<C: Command>(
        &self,
        command: C,
    ) -> impl Future<Output = Result<Sent, BusError>> + Send + '_ {
        let envelope = Envelope::new(command);
        let routed = self.bus().is_routed(&envelope);
        async move {
            if !routed {
                return Err(BusError::NotRouted {
                    message: envelope.message_name(),
                });
            }
            let sent = self.run(envelope).await?;
            Ok(Sent::of(&sent))
        }
    }
}
