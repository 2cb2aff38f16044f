//! What [`PostgresTransport`] is to envoi: a [`Transport`] with every
//! ability a durable queue has, each handed to the module that does it.

use std::time::Duration;

use envoi_core::transport::{
    Browse, Delivery, DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown,
    Transport, TransportDescription, WakeUp,
};
use envoi_core::{BoxFuture, TransportError};

use crate::transport::Inner;
use crate::PostgresTransport;

impl Transport for PostgresTransport {
    /// `postgresql`, at the server's host (or socket directory) and port
    /// from the DSN.
    fn describe(&self) -> TransportDescription {
        let connect = &self.inner.config.connect;
        TransportDescription::new("postgresql").with_server(connect.get_host(), connect.get_port())
    }

    /// Grouped with the sends waiting at the same time into one `INSERT`;
    /// returns once its row is committed.
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(Inner::send(&self.inner, message, delay))
    }

    /// One multi-row `INSERT … SELECT … FROM UNNEST(…)`, then one
    /// (coalesced) `NOTIFY`.
    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        Box::pin(self.inner.send_batch(messages))
    }

    envoi_core::abilities!(
        receiver,
        keepalive,
        setup,
        message_count,
        browse,
        teardown,
        wake_up
    );
}

impl Receiver for PostgresTransport {
    /// Leases up to `min(max, batch)` rows with one `UPDATE … RETURNING`
    /// (or hands out rows claimed ahead); waits up to `wait` for a
    /// notification when none is available.
    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(Inner::get(&self.inner, max))
    }

    /// Deletes the row; a row already gone is no error.
    fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.ack(id))
    }

    /// One `DELETE … WHERE id = ANY($1)`.
    fn ack_batch<'a>(&'a self, ids: &'a [DeliveryId]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.ack_batch(ids))
    }

    /// Deletes the row, as `ack` does: PostgreSQL has no dead-letter place
    /// of its own (the worker parks the message in the failure transport).
    fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.reject(id))
    }

    /// Ends the lease; the message keeps its place in line.
    fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.release(id))
    }
}

impl Keepalive for PostgresTransport {
    /// Moves `leased_until` a whole lease from now.
    fn keepalive<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.keepalive(id))
    }
}

impl Setup for PostgresTransport {
    /// `CREATE TABLE` / `CREATE INDEX … IF NOT EXISTS`, under an advisory
    /// lock.
    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(self.inner.setup())
    }
}

impl MessageCount for PostgresTransport {
    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(self.inner.message_count())
    }
}

impl Browse for PostgresTransport {
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(self.inner.list(limit))
    }

    fn find<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        Box::pin(self.inner.find(id))
    }
}

impl Teardown for PostgresTransport {
    /// Deletes every row of this queue.
    fn purge(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(self.inner.purge())
    }

    /// Deletes every row of this queue, and drops the table once no other
    /// queue has a row in it.
    fn delete(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(self.inner.delete())
    }
}

impl WakeUp for PostgresTransport {
    /// Returns when a notification for this queue arrived since the latest
    /// `get` started, or after `timeout` capped at the poll interval (delays
    /// coming due and expired leases are not notified).
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(self.inner.wait_for_messages(timeout))
    }
}
