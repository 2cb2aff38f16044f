//! [`AmqpTransport`]: the [`Transport`] implementation on RabbitMQ, and the
//! abilities it has: [`Receiver`], [`Keepalive`] (with a lease),
//! [`Setup`], [`MessageCount`], [`Teardown`] and [`WakeUp`]; [`Browse`] is
//! in the `browse` module.
//!
//! [`Browse`]: envoi_core::transport::Browse

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use envoi_core::transport::{
    Delivery, DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown,
    Transport, TransportDescription, WakeUp,
};
use envoi_core::{BoxFuture, TransportError};

use crate::config::{AmqpConfig, MAX_QUEUE_NAME};
use crate::housekeeping::housekeeping;
use crate::publish::Outgoing;
use crate::settle::Settle;
use crate::shared::{lock, Shared};
use crate::topology::Names;

/// A RabbitMQ transport: publishes with confirms to a durable exchange and
/// consumes its durable queue with a prefetching consumer.
///
/// Open one with [`AmqpTransport::connect`] (or through
/// [`AmqpTransportFactory`](crate::AmqpTransportFactory)). Each handle owns
/// one connection with two channels: one in confirm mode for publishing, one
/// for consuming and settling. [`close`](Self::close) (or dropping the
/// handle) closes the connection, and the broker puts back every message the
/// handle had not settled.
///
/// # Abilities
///
/// Besides sending, it is a [`Receiver`], and has [`Setup`] (declares the
/// topology), [`MessageCount`], [`Browse`](envoi_core::transport::Browse)
/// (lists and finds messages by browsing the queue and putting every
/// message back in its place; see the [crate docs](crate#browsing)),
/// [`Teardown`] (purges or deletes the queues) and [`WakeUp`]. It has
/// [`Keepalive`] when it leases what it hands out (`lease` is not `off`).
///
/// # Delivery ids
///
/// [`Delivery::id`] is `<connection generation>:<delivery tag>`. Delivery
/// tags are scoped to the channel that delivered the message, so an id is
/// only meaningful on the handle that handed it out and only until that
/// handle reconnects; settling it afterwards fails with
/// [`AmqpError::StaleDelivery`](crate::AmqpError::StaleDelivery) (the broker
/// has already put the message back). The id [`send`](Transport::send)
/// returns is the AMQP `message-id` property (a UUIDv7), not a delivery id:
/// it is the id a listing shows, and `ack` and `reject` take it too (they
/// then find the message; see the [crate docs](crate#browsing)).
///
/// # Leases
///
/// RabbitMQ has no lease: an unsettled message is given back when the
/// channel closes. The transport adds one on the consumer side: a handed-out
/// message not settled within the `lease` is given back with
/// `basic.nack(requeue)`; [`keepalive`](Keepalive::keepalive) restarts it.
///
/// # Redeliveries
///
/// A message the broker hands out again after it was handed out and not
/// acknowledged carries AMQP's `redelivered` flag; the transport hands it
/// out with [`Delivery::redelivered`] set.
pub struct AmqpTransport {
    shared: Arc<Shared>,
}

impl fmt::Debug for AmqpTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpTransport")
            .field("name", &self.shared.name)
            .field("queue", &self.shared.names.queue)
            .field("exchange", &self.shared.names.exchange)
            .field("config", &self.shared.config)
            .finish()
    }
}

impl AmqpTransport {
    /// Connects the transport called `name` as `dsn` describes (see
    /// [`AmqpConfig`] for the options). The queue and exchange default to
    /// `name`. With `auto_setup` (the default) the topology is declared at
    /// once.
    ///
    /// Fails with [`TransportError::InvalidDsn`] for a bad DSN,
    /// [`TransportError::Unreachable`] (naming the DSN with its password
    /// masked) when the broker cannot be reached within `connect_timeout`
    /// (5 s by default; refused connections are tried again until then),
    /// and [`TransportError::Backend`] when the broker refuses the topology.
    /// Once connected, a lost connection is re-established for up to
    /// `reconnect_timeout` by the operation that finds it lost.
    pub async fn connect(name: &str, dsn: &str) -> Result<Self, TransportError> {
        Self::with_config(name, AmqpConfig::from_dsn(dsn)?).await
    }

    /// Like [`connect`](Self::connect) with an already parsed configuration.
    ///
    /// Fails with [`TransportError::InvalidDsn`] as well for a value
    /// [`AmqpConfig::from_dsn`] would refuse (the fields are public, so a
    /// configuration may have been changed in code).
    pub async fn with_config(name: &str, config: AmqpConfig) -> Result<Self, TransportError> {
        let invalid = |reason| TransportError::InvalidDsn {
            dsn: config.masked_dsn().to_string(),
            reason,
        };
        config.validate().map_err(invalid)?;
        let queue = config.queue.clone().unwrap_or_else(|| name.to_string());
        if queue.is_empty() || queue.len() > MAX_QUEUE_NAME || queue.starts_with("amq.") {
            return Err(invalid(format!(
                "`{queue}` cannot name a queue: give 1 to {MAX_QUEUE_NAME} bytes not starting with `amq.` (option `queue`)"
            )));
        }
        let exchange = config.exchange.clone().unwrap_or_else(|| queue.clone());
        let shared = Arc::new(Shared::new(name, config, Names::new(queue, exchange)));
        shared.connect_first().await?;
        tokio::spawn(housekeeping(Arc::downgrade(&shared)));
        Ok(Self { shared })
    }

    /// The queue consumed from.
    pub fn queue(&self) -> &str {
        &self.shared.names.queue
    }

    /// The exchange published to (empty: the default exchange).
    pub fn exchange(&self) -> &str {
        &self.shared.names.exchange
    }

    /// How many times the connection was re-established after it broke
    /// (the first connection does not count).
    pub fn reconnections(&self) -> u64 {
        self.shared.epochs.load(Ordering::SeqCst).saturating_sub(1)
    }

    /// The configuration in use.
    pub fn config(&self) -> &AmqpConfig {
        &self.shared.config
    }

    /// What the handle holds, shared with its background tasks.
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Closes the connection: stops the consumer and the background task,
    /// and every message handed out or prefetched and not settled goes back
    /// to the queue. Later calls fail with [`TransportError::Closed`];
    /// closing again does nothing. Dropping the transport does the same in
    /// the background.
    pub async fn close(&self) -> Result<(), TransportError> {
        self.shared.closed.store(true, Ordering::SeqCst);
        match self.shared.take_link() {
            Some(link) => self.shared.shutdown(link).await,
            None => Ok(()),
        }
    }
}

impl Drop for AmqpTransport {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        let Some(link) = self.shared.take_link() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let shared = Arc::clone(&self.shared);
                runtime.spawn(async move {
                    let _ = shared.shutdown(link).await;
                });
            }
            // Without a runtime, dropping the last handle on the connection
            // closes it.
            Err(_) => {
                for task in std::mem::take(&mut lock(&self.shared.consume).give_backs) {
                    task.abort();
                }
            }
        }
    }
}

impl Transport for AmqpTransport {
    /// `rabbitmq`, at the broker's host and port from the DSN.
    fn describe(&self) -> TransportDescription {
        let authority = &self.shared.config.uri().authority;
        TransportDescription::new("rabbitmq").with_server(authority.host.clone(), authority.port)
    }

    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(async move {
            let mut outgoing = [Outgoing::new(message, delay)?];
            self.shared.publish(&mut outgoing).await?;
            let [sent] = outgoing;
            Ok(sent.id)
        })
    }

    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        Box::pin(async move {
            let mut outgoing = messages
                .into_iter()
                .map(|(message, delay)| Outgoing::new(message, delay))
                .collect::<Result<Vec<_>, _>>()?;
            self.shared.publish(&mut outgoing).await?;
            Ok(outgoing.into_iter().map(|o| o.id).collect())
        })
    }

    fn as_receiver(&self) -> Option<&dyn Receiver> {
        Some(self)
    }

    /// `Some` when handed-out messages are leased (`lease` is not `off`):
    /// then there is a lease to extend.
    fn as_keepalive(&self) -> Option<&dyn Keepalive> {
        self.shared.config.lease.map(|_| self as &dyn Keepalive)
    }

    envoi_core::abilities!(setup, message_count, browse, teardown, wake_up);
}

/// `get` takes up to `max` of the messages the consumer prefetched (starting
/// it if none runs), waiting up to 200 ms for a first one. `ack` is
/// `basic.ack`, `reject` is `basic.reject` without requeue (dead-lettered to
/// `<queue>.dead` on a quorum queue, discarded on a classic one), `release`
/// is `basic.nack` with requeue. `ack` and `reject` also take the id a
/// listing shows a stored message with, and settle that message (see the
/// [crate docs](crate#browsing)).
impl Receiver for AmqpTransport {
    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(self.shared.get(max))
    }

    fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.shared.settle(std::slice::from_ref(id), Settle::Ack))
    }

    fn ack_batch<'a>(&'a self, ids: &'a [DeliveryId]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.shared.settle(ids, Settle::Ack))
    }

    fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.shared.settle(std::slice::from_ref(id), Settle::Reject))
    }

    fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(
            self.shared
                .settle(std::slice::from_ref(id), Settle::Release),
        )
    }
}

/// Restarts the lease of a handed-out message.
impl Keepalive for AmqpTransport {
    fn keepalive<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.shared.keepalive(id) })
    }
}

/// Declares the exchange, the queue (and its dead-letter queue) and the
/// binding; they are declared again on every reconnection from then on.
impl Setup for AmqpTransport {
    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(self.shared.setup())
    }
}

/// The queue's ready messages, plus what waits in the delay queues this
/// handle used, plus what this handle holds unsettled. Messages other
/// handles hold unsettled are not counted.
impl MessageCount for AmqpTransport {
    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(self.shared.message_count())
    }
}

/// `purge` deletes what [`MessageCount`] counts (the queue's ready messages,
/// those of the delay queues this handle used, and those this handle holds,
/// acknowledged); `delete` deletes the queue, its dead-letter queue, the
/// delay queues this handle used and the exchange (unless it is the default
/// one), with every message in them.
impl Teardown for AmqpTransport {
    fn purge(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(self.shared.purge())
    }

    fn delete(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(self.shared.delete())
    }
}

/// Resolves as soon as the consumer delivers a message (starting it if none
/// runs), or after the timeout. Waiting counts as activity: the consumer is
/// not cancelled as idle meanwhile.
impl WakeUp for AmqpTransport {
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(self.shared.wait_for_messages(timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn with_config_refuses_a_configuration_changed_in_code_as_from_dsn_would() {
        // The check comes before connecting: nothing listens on port 1.
        let base = AmqpConfig::from_dsn("amqp://127.0.0.1:1/%2f?auto_setup=false").unwrap();
        type Change = (&'static str, fn(&mut AmqpConfig));
        let changes: [Change; 6] = [
            ("prefetch", |c| c.prefetch = 0),
            ("lease", |c| c.lease = Some(Duration::MAX)),
            ("consumer_idle", |c| c.consumer_idle = Duration::ZERO),
            ("expires", |c| c.expires = Some(Duration::ZERO)),
            ("connect_timeout", |c| c.connect_timeout = Duration::ZERO),
            ("queue", |c| c.queue = Some("amq.mine".into())),
        ];
        for (option, change) in changes {
            let mut config = base.clone();
            change(&mut config);
            match AmqpTransport::with_config("q", config).await {
                Err(TransportError::InvalidDsn { reason, .. }) => {
                    assert!(reason.contains(option), "{option}: {reason}")
                }
                other => panic!("{option}: expected InvalidDsn, got {:?}", other.err()),
            }
        }
    }
}
