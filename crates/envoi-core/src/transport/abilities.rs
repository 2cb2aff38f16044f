//! The abilities a transport may have beside sending and receiving, each a
//! trait of its own that [`Transport`](super::Transport) hands out when the
//! transport has it.

use std::time::Duration;

use super::raw::{Delivery, DeliveryId};
use crate::error::TransportError;
use crate::BoxFuture;

/// Extends the lease of a message still being handled, so that a slow but
/// live handler's message is not handed to another consumer.
pub trait Keepalive: Send + Sync {
    /// Extends the lease of the message handed out as `id`.
    fn keepalive<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>>;
}

/// Creates what the transport needs: tables, queues, streams.
pub trait Setup: Send + Sync {
    /// Creates what is missing and brings what is there up to date.
    /// Idempotent.
    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>>;
}

/// Counts the messages waiting.
pub trait MessageCount: Send + Sync {
    /// How many messages are waiting, including delayed and leased ones.
    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>>;
}

/// Lists and finds stored messages without taking them: what the failure
/// commands and an operator's board read.
pub trait Browse: Send + Sync {
    /// Up to `limit` stored messages, oldest first, without leasing them.
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>>;

    /// The stored message with this id, without leasing it.
    fn find<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>>;
}

/// Tells a waiting worker that messages may have arrived.
pub trait WakeUp: Send + Sync {
    /// Resolves when messages may have become available, or after
    /// `timeout`, whichever comes first.
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()>;
}

/// Empties or removes what a transport stores: what tests and an
/// operator's `purge` use.
///
/// Where several transports share their storage (the queues of one SQL
/// table, the consumer groups of one stream), each acts on its own part:
/// `purge` removes this transport's messages, and `delete` removes the
/// shared storage only once no other transport has anything left in it. A
/// broker cannot take back what another connection holds unsettled: such
/// messages are not purged.
pub trait Teardown: Send + Sync {
    /// Deletes the messages the transport holds (waiting, delayed, and
    /// leased to this handle); returns how many it deleted.
    fn purge(&self) -> BoxFuture<'_, Result<u64, TransportError>>;

    /// Deletes what [`Setup::setup`] created (the table, queue or stream),
    /// with every message in it (see above for storage others share).
    /// Idempotent.
    fn delete(&self) -> BoxFuture<'_, Result<(), TransportError>>;
}
