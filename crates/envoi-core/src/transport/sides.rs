//! The two sides of a transport: [`Transport`], what a messenger registers
//! and sends through, and [`Receiver`], what a worker takes messages from.

use std::fmt;
use std::time::Duration;

use super::abilities::{Browse, Keepalive, MessageCount, Setup, Teardown, WakeUp};
use super::binding::TransportBinding;
use super::local::{LocalReceiver, LocalSender};
use super::raw::{Delivery, DeliveryId, RawMessage};
use crate::error::TransportError;
use crate::BoxFuture;

/// A transport: it stores the messages sent to it until a [`Receiver`]
/// takes them.
///
/// The sending side is the trait's own: [`send`](Self::send) and
/// [`send_batch`](Self::send_batch). Everything else is an ability the
/// transport has or does not have, each a small trait of its own that the
/// transport hands out from one of the `as_*` methods:
///
/// | ability | trait | without it |
/// |---|---|---|
/// | receiving ([`as_receiver`](Self::as_receiver)) | [`Receiver`]: get, ack, ack batch, reject, release | a worker cannot consume it (the sync transport handles messages while they are sent) |
/// | extending leases ([`as_keepalive`](Self::as_keepalive)) | [`Keepalive`] | a worker does not extend the leases of slow handlers' messages |
/// | creating what it needs ([`as_setup`](Self::as_setup)) | [`Setup`] | there is nothing to create |
/// | counting ([`as_message_count`](Self::as_message_count)) | [`MessageCount`] | `stats` says it cannot count |
/// | listing and finding ([`as_browse`](Self::as_browse)) | [`Browse`] | `failed show` says it cannot list |
/// | emptying and removing what it stores ([`as_teardown`](Self::as_teardown)) | [`Teardown`] | `purge` says it cannot |
/// | waking a waiting worker ([`as_wake_up`](Self::as_wake_up)) | [`WakeUp`] | an idle worker polls it |
/// | moving envelopes in process ([`as_local_sender`](Self::as_local_sender), [`as_local_receiver`](Self::as_local_receiver)) | [`LocalSender`], [`LocalReceiver`] | messages are encoded |
///
/// An ability a transport lacks is `None`, never a method that quietly
/// does something else.
///
/// Delivery is at least once: a message handed out by [`Receiver::get`]
/// that is neither acknowledged nor rejected (its consumer died) becomes
/// available again after the transport's lease or visibility timeout;
/// [`Keepalive::keepalive`] extends the lease of a message still being
/// worked on.
///
/// ```
/// use envoi_core::transport::in_memory::InMemoryTransport;
/// use envoi_core::transport::{RawMessage, Receiver, Transport};
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let queue = InMemoryTransport::new();
/// queue.send(RawMessage { body: b"{}".to_vec(), ..Default::default() }, None).await.unwrap();
/// let receiver = queue.as_receiver().expect("an in-memory queue can be consumed");
/// let delivery = receiver.get(10).await.unwrap().remove(0);
/// receiver.ack(&delivery.id).await.unwrap();
/// assert!(queue.as_setup().is_none(), "nothing to create");
/// # });
/// ```
pub trait Transport: Send + Sync + 'static {
    /// Stores `message`, to be handed out no sooner than `delay` from now.
    /// Returns the transport's id for it.
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>>;

    /// Stores several messages; returns their ids in order. By default they
    /// are sent one after the other; a transport that can write a batch in
    /// one round trip overrides it.
    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        Box::pin(async move {
            let mut ids = Vec::with_capacity(messages.len());
            for (message, delay) in messages {
                ids.push(self.send(message, delay).await?);
            }
            Ok(ids)
        })
    }

    /// The receiving side, or `None` for a transport nothing can be taken
    /// from (it handles what is sent to it at once).
    fn as_receiver(&self) -> Option<&dyn Receiver>;

    /// Extending the lease of a message still being handled, if the
    /// transport leases messages it hands out. `None` by default.
    fn as_keepalive(&self) -> Option<&dyn Keepalive> {
        None
    }

    /// Creating what the transport needs (tables, queues, streams), if it
    /// needs anything. `None` by default.
    fn as_setup(&self) -> Option<&dyn Setup> {
        None
    }

    /// Counting the messages waiting, if the transport can. `None` by
    /// default.
    fn as_message_count(&self) -> Option<&dyn MessageCount> {
        None
    }

    /// Listing and finding stored messages without taking them, if the
    /// transport can. `None` by default.
    fn as_browse(&self) -> Option<&dyn Browse> {
        None
    }

    /// Emptying and removing what the transport stores, if it can. `None`
    /// by default.
    fn as_teardown(&self) -> Option<&dyn Teardown> {
        None
    }

    /// Telling a waiting worker that messages may have arrived, if the
    /// transport can. `None` by default: a worker whose receivers came back
    /// empty then sleeps before asking again.
    fn as_wake_up(&self) -> Option<&dyn WakeUp> {
        None
    }

    /// Sending envelopes without encoding them, for a transport that lives
    /// in this process. `None` by default.
    fn as_local_sender(&self) -> Option<&dyn LocalSender> {
        None
    }

    /// Handing out envelopes without decoding them, for a transport that
    /// lives in this process. `None` by default.
    fn as_local_receiver(&self) -> Option<&dyn LocalReceiver> {
        None
    }

    /// What observability tools are told about the transport: its
    /// messaging system and the server it talks to. A transport that does
    /// not say is `unknown`, with no server.
    ///
    /// ```
    /// use envoi_core::transport::in_memory::InMemoryTransport;
    /// use envoi_core::transport::Transport;
    ///
    /// let described = InMemoryTransport::new().describe();
    /// assert_eq!(described.system, "in_memory");
    /// assert_eq!(described.server, None);
    /// ```
    fn describe(&self) -> TransportDescription {
        TransportDescription::new("unknown")
    }

    /// Called when a messenger is built with this transport registered.
    /// A transport that needs the serializer or the messenger itself keeps
    /// what it needs from `binding`; one that needs neither keeps nothing,
    /// which is the default.
    fn bind(&self, binding: &TransportBinding) {
        let _ = binding;
    }
}

/// What a transport is to observability tools ([`Transport::describe`]),
/// in the terms of the OpenTelemetry messaging conventions.
///
/// ```
/// use envoi_core::transport::TransportDescription;
///
/// let described = TransportDescription::new("rabbitmq").with_server("mq.internal", 5672);
/// assert_eq!(described.system, "rabbitmq");
/// assert_eq!(described.server, Some(("mq.internal".to_string(), 5672)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportDescription {
    /// The messaging system (`messaging.system`): the conventions'
    /// well-known value where there is one (`rabbitmq`), the system's name
    /// in lower case otherwise (`redis`, `nats`, `postgresql`, `sqlite`,
    /// `in_memory`).
    pub system: &'static str,
    /// The server's host and port (`server.address`, `server.port`), for a
    /// transport that talks to one.
    pub server: Option<(String, u16)>,
}

impl TransportDescription {
    /// A transport of `system` that talks to no server.
    pub fn new(system: &'static str) -> Self {
        Self {
            system,
            server: None,
        }
    }

    /// The same, talking to the server at `host`:`port`.
    #[must_use]
    pub fn with_server(mut self, host: impl Into<String>, port: u16) -> Self {
        self.server = Some((host.into(), port));
        self
    }
}

/// Writes the `as_*` methods of [`Transport`] for abilities a transport
/// has by implementing their traits itself: each returns `Some(self)`.
/// Used inside `impl Transport for …`, naming the abilities: `receiver`,
/// `keepalive`, `setup`, `message_count`, `browse`, `teardown`, `wake_up`,
/// `local_sender`, `local_receiver`.
///
/// ```
/// use envoi_core::transport::{Delivery, DeliveryId, RawMessage, Receiver, Transport};
/// use envoi_core::{BoxFuture, TransportError};
/// use std::time::Duration;
///
/// /// Takes nothing, hands out nothing.
/// struct Void;
///
/// impl Transport for Void {
///     fn send(&self, _: RawMessage, _: Option<Duration>) -> BoxFuture<'_, Result<String, TransportError>> {
///         Box::pin(async { Err(TransportError::Closed) })
///     }
///     envoi_core::abilities!(receiver);
/// }
///
/// impl Receiver for Void {
///     fn get(&self, _: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
///         Box::pin(async { Ok(Vec::new()) })
///     }
///     fn ack<'a>(&'a self, _: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
///         Box::pin(async { Ok(()) })
///     }
///     fn reject<'a>(&'a self, _: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
///         Box::pin(async { Ok(()) })
///     }
///     fn release<'a>(&'a self, _: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
///         Box::pin(async { Ok(()) })
///     }
/// }
///
/// assert!(Void.as_receiver().is_some());
/// assert!(Void.as_setup().is_none());
/// ```
#[macro_export]
macro_rules! abilities {
    ($($ability:ident),* $(,)?) => {
        $( $crate::__ability!($ability); )*
    };
}

/// One method of [`abilities!`](crate::abilities).
#[doc(hidden)]
#[macro_export]
macro_rules! __ability {
    (receiver) => {
        fn as_receiver(&self) -> Option<&dyn $crate::transport::Receiver> {
            Some(self)
        }
    };
    (keepalive) => {
        fn as_keepalive(&self) -> Option<&dyn $crate::transport::Keepalive> {
            Some(self)
        }
    };
    (setup) => {
        fn as_setup(&self) -> Option<&dyn $crate::transport::Setup> {
            Some(self)
        }
    };
    (message_count) => {
        fn as_message_count(&self) -> Option<&dyn $crate::transport::MessageCount> {
            Some(self)
        }
    };
    (browse) => {
        fn as_browse(&self) -> Option<&dyn $crate::transport::Browse> {
            Some(self)
        }
    };
    (teardown) => {
        fn as_teardown(&self) -> Option<&dyn $crate::transport::Teardown> {
            Some(self)
        }
    };
    (wake_up) => {
        fn as_wake_up(&self) -> Option<&dyn $crate::transport::WakeUp> {
            Some(self)
        }
    };
    (local_sender) => {
        fn as_local_sender(&self) -> Option<&dyn $crate::transport::LocalSender> {
            Some(self)
        }
    };
    (local_receiver) => {
        fn as_local_receiver(&self) -> Option<&dyn $crate::transport::LocalReceiver> {
            Some(self)
        }
    };
}

/// The receiving side of a transport: messages handed out, leased to the
/// caller, then settled by their [`DeliveryId`].
pub trait Receiver: Send + Sync {
    /// Hands out up to `max` available messages, leasing them to the caller.
    /// Returns an empty vector when none is available (it may wait briefly
    /// for one first).
    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>>;

    /// The message was handled: remove it for good.
    fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Acknowledges several messages. By default one after the other; a
    /// transport that can do it in one round trip overrides it. Every
    /// message is acknowledged that can be (one that fails does not leave
    /// the others to be handed out again); the first error is returned.
    fn ack_batch<'a>(&'a self, ids: &'a [DeliveryId]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let mut first = None;
            for id in ids {
                if let Err(e) = self.ack(id).await {
                    first.get_or_insert(e);
                }
            }
            first.map_or(Ok(()), Err)
        })
    }

    /// The message must not be handled again: remove it for good (or move
    /// it aside, for a transport with its own dead-letter place).
    fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Gives the message back so it is handed out again (graceful stop).
    fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>>;
}

/// The abilities a transport has, by name: what its debug output and
/// listings show.
fn abilities(transport: &dyn Transport) -> Vec<&'static str> {
    [
        ("receiver", transport.as_receiver().is_some()),
        ("keepalive", transport.as_keepalive().is_some()),
        ("setup", transport.as_setup().is_some()),
        ("message count", transport.as_message_count().is_some()),
        ("browse", transport.as_browse().is_some()),
        ("teardown", transport.as_teardown().is_some()),
        ("wake-up", transport.as_wake_up().is_some()),
        ("local sender", transport.as_local_sender().is_some()),
        ("local receiver", transport.as_local_receiver().is_some()),
    ]
    .into_iter()
    .filter_map(|(name, has)| has.then_some(name))
    .collect()
}

impl fmt::Debug for dyn Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transport")
            .field("abilities", &abilities(self))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Acknowledges every id but `"bad"`, recording them.
    #[derive(Default)]
    struct Acks(std::sync::Mutex<Vec<String>>);

    impl Receiver for Acks {
        fn get(&self, _: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
            Box::pin(async { Ok(Vec::new()) })
        }
        fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
            Box::pin(async move {
                if id.as_str() == "bad" {
                    return Err(TransportError::NotFound(id.to_string()));
                }
                self.0.lock().unwrap().push(id.to_string());
                Ok(())
            })
        }
        fn reject<'a>(&'a self, _: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
            Box::pin(async { Ok(()) })
        }
        fn release<'a>(&'a self, _: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
            Box::pin(async { Ok(()) })
        }
    }

    #[tokio::test]
    async fn the_default_ack_batch_acknowledges_past_a_failure_and_returns_it() {
        let t = Acks::default();
        let ids: Vec<DeliveryId> = ["1", "bad", "2"].map(DeliveryId::from).to_vec();
        let err = t.ack_batch(&ids).await.unwrap_err();
        assert!(
            matches!(err, TransportError::NotFound(ref id) if id.as_str() == "bad"),
            "{err}"
        );
        assert_eq!(*t.0.lock().unwrap(), ["1", "2"]);
    }
}
