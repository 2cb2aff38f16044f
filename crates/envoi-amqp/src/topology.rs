//! What a handle declares on the broker and deletes again: the exchange,
//! the queue and its dead-letter queue, and one delay queue per delay
//! ([`Names`] names them all).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use envoi_core::TransportError;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, ExchangeKind};

use crate::config::QueueType;
use crate::link::Link;
use crate::shared::{backend, lock, short, Shared};

/// A delay queue lives this much longer than its delay once unused.
const DELAY_QUEUE_GRACE: Duration = Duration::from_secs(60);
/// A delay queue is declared again (renewing its expiry) when its last
/// declaration is older than this; must stay below [`DELAY_QUEUE_GRACE`].
const DELAY_REDECLARE: Duration = Duration::from_secs(30);

/// The names of what a handle publishes to and consumes from.
pub(crate) struct Names {
    pub(crate) queue: String,
    pub(crate) exchange: String,
    /// The quorum queue's dead-letter queue.
    pub(crate) dead: String,
    /// `exchange` and `queue` as AMQP short strings, built once (`None`
    /// when a name is too long for one, which publishing then reports).
    exchange_short: Option<ShortString>,
    queue_short: Option<ShortString>,
}

impl Names {
    /// The names of queue `queue` and exchange `exchange`.
    pub(crate) fn new(queue: String, exchange: String) -> Self {
        Self {
            dead: format!("{queue}.dead"),
            exchange_short: ShortString::try_new(exchange.as_str()).ok(),
            queue_short: ShortString::try_new(queue.as_str()).ok(),
            queue,
            exchange,
        }
    }

    /// The queue messages delayed by `ms` wait in.
    pub(crate) fn delay_queue(&self, ms: u64) -> String {
        format!("{}.delay.{ms}", self.queue)
    }

    /// The exchange and routing key a message with `delay_ms` is published
    /// with.
    pub(crate) fn route(
        &self,
        delay_ms: Option<u64>,
    ) -> Result<(ShortString, ShortString), TransportError> {
        match delay_ms {
            Some(ms) => Ok((ShortString::default(), short(&self.delay_queue(ms))?)),
            None => Ok((
                match &self.exchange_short {
                    Some(exchange) => exchange.clone(),
                    None => short(&self.exchange)?,
                },
                match &self.queue_short {
                    Some(queue) => queue.clone(),
                    None => short(&self.queue)?,
                },
            )),
        }
    }
}

/// Marks every delay queue of `known` as to be declared again before use.
pub(crate) fn forget_declarations(known: &Mutex<HashMap<u64, Option<Instant>>>) {
    for at in lock(known).values_mut() {
        *at = None;
    }
}

/// Durable, not passive.
fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

/// `value` as a signed AMQP long, saturating.
fn long(value: u64) -> AMQPValue {
    AMQPValue::LongLongInt(i64::try_from(value).unwrap_or(i64::MAX))
}

impl Shared {
    /// The arguments of the queue consumed from.
    fn main_queue_arguments(&self) -> FieldTable {
        let mut args = FieldTable::default();
        let mut text = |name: &str, value: &str| {
            args.insert(name.into(), AMQPValue::LongString(value.into()));
        };
        text("x-queue-type", self.config.queue_type.as_str());
        if self.config.queue_type == QueueType::Quorum {
            text("x-dead-letter-exchange", "");
            text("x-dead-letter-routing-key", &self.names.dead);
            text("x-dead-letter-strategy", "at-least-once");
            text("x-overflow", "reject-publish");
            args.insert(
                "x-delivery-limit".into(),
                long(u64::from(self.config.delivery_limit)),
            );
        }
        self.expires(&mut args);
        args
    }

    /// Adds `x-expires` to `args`, if the queues expire.
    fn expires(&self, args: &mut FieldTable) {
        if let Some(expires) = self.config.expires {
            let ms = u64::try_from(expires.as_millis()).unwrap_or(u64::MAX);
            args.insert("x-expires".into(), long(ms));
        }
    }

    /// The arguments of the delay queue for `ms`.
    fn delay_queue_arguments(&self, ms: u64) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("classic".into()),
        );
        args.insert("x-message-ttl".into(), long(ms));
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(self.names.exchange.as_str().into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(self.names.queue.as_str().into()),
        );
        let grace = u64::try_from(DELAY_QUEUE_GRACE.as_millis()).unwrap_or(u64::MAX);
        args.insert("x-expires".into(), long(grace.saturating_add(ms)));
        args
    }

    /// Declares the topology on the current link, and again on every
    /// reconnection from now on.
    pub(crate) async fn setup(&self) -> Result<(), TransportError> {
        let link = self.link().await?;
        self.declare(&link).await?;
        self.setup_done.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Declares the exchange, the dead-letter queue (quorum), the queue and
    /// its binding, on a channel of its own so a refusal does not break the
    /// link.
    pub(crate) async fn declare(&self, link: &Link) -> Result<(), TransportError> {
        let channel = link
            .connection
            .create_channel()
            .await
            .map_err(|e| backend("opening a channel for setup", e))?;
        let names = &self.names;
        if !names.exchange.is_empty() {
            channel
                .exchange_declare(
                    short(&names.exchange)?,
                    ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| backend(format!("declaring exchange `{}`", names.exchange), e))?;
        }
        if self.config.queue_type == QueueType::Quorum {
            let mut args = FieldTable::default();
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
            self.expires(&mut args);
            declare_queue(&channel, &names.dead, args).await?;
        }
        declare_queue(&channel, &names.queue, self.main_queue_arguments()).await?;
        if !names.exchange.is_empty() {
            self.bind(&channel).await?;
        }
        let _ = channel.close(200, "setup done".into()).await;
        Ok(())
    }

    /// Binds the queue to the exchange with its own name as routing key.
    async fn bind(&self, channel: &Channel) -> Result<(), TransportError> {
        let names = &self.names;
        channel
            .queue_bind(
                short(&names.queue)?,
                short(&names.exchange)?,
                short(&names.queue)?,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                backend(
                    format!("binding queue `{}` to `{}`", names.queue, names.exchange),
                    e,
                )
            })
    }

    /// Declares the delay queue for `ms` unless it was declared recently.
    pub(crate) async fn ensure_delay_queue(
        &self,
        link: &Link,
        ms: u64,
    ) -> Result<(), TransportError> {
        let fresh = {
            let mut known = lock(&self.delay_queues);
            // Forget queues that have expired by now (unless another handle
            // kept them alive, in which case they are counted there).
            known.retain(|ms, at| {
                at.is_none_or(|at| at.elapsed() < DELAY_QUEUE_GRACE + Duration::from_millis(*ms))
            });
            known
                .get(&ms)
                .copied()
                .flatten()
                .is_some_and(|at| at.elapsed() < DELAY_REDECLARE)
        };
        if !fresh {
            self.declare_delay_queue(link, ms).await?;
            lock(&self.delay_queues).insert(ms, Some(Instant::now()));
        }
        Ok(())
    }

    /// Declares the delay queue for `ms` (renewing its expiry); returns how
    /// many messages wait in it.
    pub(crate) async fn declare_delay_queue(
        &self,
        link: &Link,
        ms: u64,
    ) -> Result<u64, TransportError> {
        let channel = link.side_channel().await?;
        let name = self.names.delay_queue(ms);
        let queue = channel
            .queue_declare(short(&name)?, durable(), self.delay_queue_arguments(ms))
            .await
            .map_err(|e| backend(format!("declaring delay queue `{name}`"), e))?;
        let _ = channel.close(200, "declared".into()).await;
        Ok(u64::from(queue.message_count()))
    }

    /// The delays whose queues this handle declared.
    pub(crate) fn known_delays(&self) -> Vec<u64> {
        lock(&self.delay_queues).keys().copied().collect()
    }

    /// Deletes the queue, its dead-letter queue, the delay queues this
    /// handle used and (unless it is the default one) the exchange, with
    /// every message in them. What this handle holds is acknowledged first.
    /// Deleting what is not there is no error.
    pub(crate) async fn delete(&self) -> Result<(), TransportError> {
        let link = self.link().await?;
        self.ack_held(&link).await?;
        let channel = link.side_channel().await?;
        let names = &self.names;
        let delays = self
            .known_delays()
            .into_iter()
            .map(|ms| names.delay_queue(ms));
        for queue in [names.queue.clone(), names.dead.clone()]
            .into_iter()
            .chain(delays)
        {
            channel
                .queue_delete(short(&queue)?, Default::default())
                .await
                .map_err(|e| backend(format!("deleting queue `{queue}`"), e))?;
        }
        if !names.exchange.is_empty() {
            channel
                .exchange_delete(short(&names.exchange)?, Default::default())
                .await
                .map_err(|e| backend(format!("deleting exchange `{}`", names.exchange), e))?;
        }
        let _ = channel.close(200, "deleted".into()).await;
        lock(&self.delay_queues).clear();
        self.setup_done.store(false, Ordering::SeqCst);
        Ok(())
    }
}

/// Declares the durable queue `name` with `args`.
async fn declare_queue(
    channel: &Channel,
    name: &str,
    args: FieldTable,
) -> Result<(), TransportError> {
    channel
        .queue_declare(short(name)?, durable(), args)
        .await
        .map(drop)
        .map_err(|e| backend(format!("declaring queue `{name}`"), e))
}
