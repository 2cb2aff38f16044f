//! Moving envelopes through a transport that lives in this process (the
//! in-memory and sync transports) without encoding them.

use std::fmt;

use super::raw::RawMessage;
use crate::envelope::local_id::LocalId;
use crate::envelope::Envelope;
use crate::error::{Result, TransportError};
use crate::BoxFuture;

/// A message an in-process transport hands out: still encoded, or the
/// envelope itself when it was sent without encoding.
#[derive(Debug, Clone)]
pub enum Payload {
    /// An encoded message, to be decoded by the serializer.
    Raw(RawMessage),
    /// The envelope as it was sent (non-sendable stamps removed).
    Envelope(Envelope),
}

/// A message handed out by [`LocalReceiver::get_local`].
#[derive(Debug, Clone)]
pub struct LocalDelivery {
    /// The transport's id for it: its text form is what
    /// [`Receiver::ack`](super::Receiver::ack) and friends take,
    /// [`LocalId::key`] what [`LocalReceiver::ack_local`] takes.
    pub id: LocalId,
    /// The message.
    pub payload: Payload,
    /// Whether it was handed out before without being acknowledged (see
    /// [`Delivery::mark_redelivered`](super::Delivery::mark_redelivered)).
    pub redelivered: bool,
}

/// The future of a [`LocalSender`] or [`LocalReceiver`] method: already complete (what an
/// in-memory queue returns, without allocating) or still running.
#[must_use = "futures do nothing unless awaited"]
pub enum LocalFuture<'a, T> {
    /// The result, taken by the first poll.
    Ready(Option<T>),
    /// Work still to do.
    Pending(BoxFuture<'a, T>),
}

impl<'a, T> LocalFuture<'a, T> {
    /// A future that is already complete.
    pub fn ready(value: T) -> Self {
        LocalFuture::Ready(Some(value))
    }

    /// A future still to run.
    pub fn pending(future: impl std::future::Future<Output = T> + Send + 'a) -> Self {
        LocalFuture::Pending(Box::pin(future))
    }
}

// The value is never pinned (only moved out of its `Option`), and the boxed
// future is pinned by its box.
impl<T> Unpin for LocalFuture<'_, T> {}

impl<T> std::future::Future for LocalFuture<'_, T> {
    type Output = T;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<T> {
        match self.get_mut() {
            LocalFuture::Ready(value) => match value.take() {
                Some(v) => std::task::Poll::Ready(v),
                None => std::task::Poll::Pending,
            },
            LocalFuture::Pending(future) => future.as_mut().poll(cx),
        }
    }
}

impl<T> fmt::Debug for LocalFuture<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LocalFuture::Ready(_) => "LocalFuture::Ready",
            LocalFuture::Pending(_) => "LocalFuture::Pending",
        })
    }
}

/// The sending side of a transport that lives in this process: it stores
/// envelopes as they are, or handles them at once.
pub trait LocalSender: Send + Sync {
    /// Stores `envelope` (honouring its last
    /// [`DelayStamp`](crate::envelope::stamp::DelayStamp)) and returns it
    /// with a
    /// [`TransportMessageIdStamp`](crate::envelope::stamp::TransportMessageIdStamp);
    /// or, for a transport that [handles on send](Self::handles_on_send),
    /// handles it now and returns the result of that.
    fn send_envelope(&self, envelope: Envelope) -> LocalFuture<'_, Result<Envelope>>;

    /// Whether sending handles the message at once (the sync transport), so
    /// there is nothing to consume and no retry to schedule.
    fn handles_on_send(&self) -> bool;
}

/// Whether `transport` handles a message while it is sent (the sync
/// transport): it stores nothing, and hands the handlers' results back.
pub(crate) fn handles_on_send(transport: &dyn super::Transport) -> bool {
    transport
        .as_local_sender()
        .is_some_and(|l| l.handles_on_send())
}

/// The receiving side of a transport that lives in this process: it hands
/// out envelopes as they were sent, and takes acknowledgements by key.
/// Rejecting, releasing and extending leases go through
/// [`Receiver`](super::Receiver) as for any transport.
pub trait LocalReceiver: Send + Sync {
    /// Hands out up to `max` available messages, leasing them to the caller.
    fn get_local(&self, max: usize) -> LocalFuture<'_, Result<Vec<LocalDelivery>, TransportError>>;

    /// Acknowledges messages handed out by [`get_local`](Self::get_local)
    /// by their [`LocalId::key`], as
    /// [`Receiver::ack_batch`](super::Receiver::ack_batch) does by their
    /// text ids.
    fn ack_local(&self, keys: &[u64]) -> Result<(), TransportError>;
}
