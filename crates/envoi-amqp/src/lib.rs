//! # envoi-amqp
//!
//! The RabbitMQ transport of envoi, on [lapin](https://docs.rs/lapin)
//! (AMQP 0-9-1).
//!
//! ```no_run
//! use envoi_amqp::AmqpTransport;
//! use envoi_core::transport::{RawMessage, Receiver, Setup, Transport};
//!
//! # async fn run() -> Result<(), envoi_core::TransportError> {
//! let orders = AmqpTransport::connect(
//!     "orders",
//!     "amqp://guest:guest@127.0.0.1:5672/%2f?prefetch=200&queue_type=quorum",
//! )
//! .await?;
//! orders.setup().await?;
//! orders.send(RawMessage { body: b"{}".to_vec(), ..RawMessage::default() }, None).await?;
//! for delivery in orders.get(10).await? {
//!     orders.ack(&delivery.id).await?;
//! }
//! orders.close().await?;
//! # Ok(())
//! # }
//! ```
//!
//! [`AmqpTransport`] is a [`Transport`] with the abilities RabbitMQ has:
//! [`Receiver`], [`Setup`], [`MessageCount`], [`Browse`] (see
//! [Browsing](#browsing)), [`Teardown`], [`WakeUp`], and [`Keepalive`] when
//! it leases what it hands out (`lease` is not `off`).
//!
//! ## Topology
//!
//! `setup` (and, with `auto_setup`, every connection) declares:
//!
//! * a durable **direct exchange** (default: the transport name);
//! * a durable **queue** (default: the transport name) bound to it with its
//!   own name as routing key. A quorum queue (the default) gets an explicit
//!   `x-delivery-limit` and dead-letters, at least once, to the quorum queue
//!   `<queue>.dead`, so the broker never drops a message by itself;
//! * on demand, one **delay queue** per distinct delay, `<queue>.delay.<ms>`:
//!   a classic durable queue with `x-message-ttl = ms`, dead-lettering back to
//!   the exchange with the queue's routing key, and `x-expires = ms + 60 s`
//!   so that unused ones vanish. No plugin is needed.
//!
//! Every declaration is idempotent; declaring a queue that exists with other
//! arguments fails with the broker's `PRECONDITION_FAILED`.
//!
//! ## Delivery
//!
//! * **Sending** publishes persistent messages, `mandatory`, on a channel in
//!   confirm mode, and returns once the broker confirmed them. An unroutable
//!   message makes the transport declare its topology again and retry; a
//!   lost connection makes it reconnect and publish again whatever was not
//!   confirmed (so a message can be stored twice, never lost).
//! * **Consuming** runs `basic.consume` with the `prefetch` count while `get`
//!   is being called and buffers deliveries; `get(max)` takes up to `max`
//!   from the buffer, waiting up to 200 ms for a first one. When `get` has
//!   not been called for `consumer_idle`, the consumer is cancelled and its
//!   buffered messages are given back, so an idle handle does not hold
//!   messages other consumers could take.
//! * **Redeliveries**: a delivery RabbitMQ flags `redelivered` (handed out
//!   before and not acknowledged) is handed out with
//!   [`Delivery::redelivered`] set.
//! * **Settling**: `ack` → `basic.ack`, `reject` → `basic.reject(requeue=false)`
//!   (dead-lettered to `<queue>.dead` on quorum queues, discarded on classic
//!   ones), `release` → `basic.nack(requeue=true)`, by delivery tag. `ack`
//!   and `reject` also take the id a listing shows (see
//!   [Browsing](#browsing)): what `failed retry` and `failed remove` do.
//! * **Leases**: see [`AmqpTransport`]. `keepalive` restarts a lease.
//!   RabbitMQ's own `consumer_timeout` (30 minutes by default) still closes
//!   the channel of a consumer that holds a message longer than that.
//! * `message_count` is the queue's ready messages (passive declare) plus
//!   what this handle holds unsettled plus what waits in the delay queues
//!   this handle used. Messages other handles hold unsettled are not counted.
//! * **Teardown**: `purge` deletes what `message_count` counts and returns
//!   how many; `delete` deletes the queue, its dead-letter queue, the delay
//!   queues this handle used and the exchange. [`AmqpTransport::close`]
//!   closes the connection, giving back what the handle held.
//!
//! ## Browsing
//!
//! AMQP cannot read a queue without taking messages out of it, so
//! [`Browse`] *browses* it: it consumes messages on a channel of its own,
//! never acknowledges them, and closes the channel, and the broker puts
//! them back. `list(limit)` shows first what this handle holds (prefetched
//! or handed out, oldest delivery first), then the queue's messages in
//! their order, each by its AMQP `message-id` (the id `send` returned; a
//! message without one is shown as `digest-` and a hash of its content).
//! `find(id)` browses until it meets that id. `ack(id)` and `reject(id)`
//! with such an id settle that one message: through the delivery when this
//! handle holds it, otherwise by browsing to it and settling it on the
//! browse's channel; an id no message has gives
//! [`TransportError::NotFound`](envoi_core::TransportError::NotFound).
//!
//! What browsing guarantees, checked against RabbitMQ 3.10:
//!
//! * **Nothing is lost.** A browsed message is acknowledged only when it is
//!   the one being removed, or once a confirmed copy of it is in the queue
//!   (below); anything else (an error, a dropped call, a lost connection)
//!   closes the channel and the broker puts it back.
//! * **Nothing moves.** A classic queue puts every message back in its
//!   place. A quorum queue puts back what one consumer held, in delivery
//!   order, ahead of the messages never delivered but behind those put back
//!   earlier and not taken since (and puts back what `basic.get` took in
//!   the text order of its internal tags: 1, 10, 11, 2, …, which is why the
//!   transport consumes instead). So on a quorum queue a browse takes every
//!   ready message, whatever it looks for, and the whole queue goes back in
//!   order. After closing its channel, a browse waits (up to 2 s) until the
//!   broker counts the messages as ready again, so that the next one does
//!   not start while the head of the queue is on its way back; browses of
//!   one handle run one at a time.
//! * **No dead-lettering.** Before RabbitMQ 4.3 a quorum queue counts each
//!   message put back as a delivery and dead-letters one put back more than
//!   `delivery_limit` times. A browse that holds a message at the limit
//!   publishes confirmed copies of everything it holds, in order, before
//!   acknowledging the originals: they stay listed, with their ids, behind
//!   whatever was published meanwhile. This resets their delivery counts.
//!
//! What it costs, and its limits:
//!
//! * A browse of a quorum queue takes every ready message (at most 65,535,
//!   the largest prefetch count) and holds them in memory for the pass, so
//!   `list`, `find` and removing by id cost one pass over the queue each; `failed retry` of *n* messages makes *n*
//!   passes. On a classic queue `list(limit)` takes `limit` messages and a
//!   search stops at the message it looks for. Each browse also waits for
//!   the put-back, typically a few milliseconds.
//! * While a browse holds them, the messages are invisible to consumers,
//!   which may meanwhile receive later messages first.
//! * A browsed message carries AMQP's `redelivered` flag from then on, so
//!   a consumer receives it with [`Delivery::redelivered`] set; on a quorum
//!   queue (before RabbitMQ 4.3) the browse counts toward its delivery
//!   count.
//! * Messages other handles hold unsettled, or on their way to a consumer,
//!   are not shown; nor are delayed messages (they wait in delay queues).
//! * On a quorum queue with more than 65,535 ready messages, or while other
//!   clients give back messages or browse at the same time, the broker may
//!   put messages back out of order.
//! * Keeping what it holds listable costs the handle a copy of the body of
//!   every message it hands out, until it is settled.
//!
//! ## Performance notes
//!
//! * `send_batch` pipelines every publish of the batch on the confirm
//!   channel and then awaits all their confirms together: one round trip per
//!   batch. Concurrent `send`s on one handle pipeline the same way.
//! * Consuming is push-based: the broker keeps up to `prefetch` messages in
//!   the handle's buffer, and `get(max)` takes up to `max` of them without a
//!   round trip. `get` polls the consumer itself: a delivery reaches the
//!   fetching task with one wake-up from the connection's I/O thread, with
//!   no task in between. [`wait_for_messages`] wakes as soon as one arrives.
//! * `ack_batch` (and the lease and idle give-backs) send all their frames at
//!   once and await them together.
//! * Raise `prefetch` for fast handlers; lower it (and `consumer_idle`) when
//!   handlers are slow and several workers share a queue.
//!
//! ## Reconnection
//!
//! [`AmqpTransport::connect`] reaches the broker within `connect_timeout`
//! (5 s by default) or fails with [`TransportError::Unreachable`], naming
//! the DSN with its password masked.
//!
//! When the connection or one of its channels breaks, the next operation
//! reconnects (with back-off, for up to `reconnect_timeout`), declares the
//! topology again and, on the next `get`, consumes again. Unconfirmed
//! publishes are published again. Deliveries handed out before the break are
//! void: the broker requeued them, and settling them fails with
//! [`AmqpError::StaleDelivery`].
//!
//! [`Transport`]: envoi_core::transport::Transport
//! [`TransportError::Unreachable`]: envoi_core::TransportError::Unreachable
//! [`Receiver`]: envoi_core::transport::Receiver
//! [`Setup`]: envoi_core::transport::Setup
//! [`MessageCount`]: envoi_core::transport::MessageCount
//! [`Teardown`]: envoi_core::transport::Teardown
//! [`WakeUp`]: envoi_core::transport::WakeUp
//! [`Keepalive`]: envoi_core::transport::Keepalive
//! [`Browse`]: envoi_core::transport::Browse
//! [`TransportError::NotFound`]: envoi_core::TransportError::NotFound
//! [`Delivery::redelivered`]: envoi_core::transport::Delivery::redelivered
//! [`wait_for_messages`]: envoi_core::transport::WakeUp::wait_for_messages

#![forbid(unsafe_code)]

pub mod config;
pub mod error;
mod factory;
mod headers;

mod browse;
mod consume;
mod housekeeping;
mod inventory;
mod link;
mod publish;
mod settle;
mod shared;
mod topology;
mod transport;

pub use config::{AmqpConfig, QueueType};
pub use error::AmqpError;
pub use factory::AmqpTransportFactory;
pub use transport::AmqpTransport;
