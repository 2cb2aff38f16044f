//! Sending envelopes: the envelope-level [`Sender`], and the
//! [`SenderDispatcher`] that decides how the send step's sends happen.

use std::sync::Arc;

use super::Transport;
use crate::envelope::Envelope;
use crate::error::{Result, TransportError};
use crate::BoxFuture;

/// A failed send; hands the envelope back so nothing is lost.
#[derive(Debug, thiserror::Error)]
#[error("sending `{}` failed: {source}", envelope.message_name())]
pub struct SendError {
    /// The envelope that was not sent.
    pub envelope: Box<Envelope>,
    /// Why.
    #[source]
    pub source: TransportError,
}

/// Sends envelopes to one transport.
pub trait Sender: Send + Sync + 'static {
    /// Sends `envelope`; on success returns it stamped with a
    /// [`TransportMessageIdStamp`](crate::envelope::stamp::TransportMessageIdStamp).
    fn send(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope, SendError>>;
}

/// Decides how the send step's sends happen. The default sends at once; a
/// transactional outbox can hold sends until its transaction commits.
pub trait SenderDispatcher: Send + Sync + 'static {
    /// Sends `envelope` to the transport called `transport`.
    fn send<'a>(
        &'a self,
        transport: &'a str,
        envelope: Envelope,
    ) -> BoxFuture<'a, Result<Envelope>>;

    /// The names of the transports it can send to.
    fn transports(&self) -> Vec<String>;

    /// The transport called `transport` when sending to it through this
    /// dispatcher is exactly [`TransportSender::send_envelope`](crate::transport::registry::TransportSender::send_envelope)
    /// (so the send step may send to it directly); `None` otherwise, which
    /// is the default.
    fn direct(&self, transport: &str) -> Option<Arc<dyn Transport>> {
        let _ = transport;
        None
    }
}
