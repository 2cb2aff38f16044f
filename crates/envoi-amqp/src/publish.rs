//! Publishing with confirms: every publish of a batch is pipelined on the
//! confirm channel and the confirms awaited together; what the broker did
//! not confirm is published again (with the same message ids) until
//! `reconnect_timeout`, and a message returned as unroutable makes the
//! handle declare its topology again first.

use std::time::{Duration, Instant};

use envoi_core::transport::support::Backoff;
use envoi_core::transport::RawMessage;
use envoi_core::{Headers, TransportError};
use lapin::options::BasicPublishOptions;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation};
use smallvec::SmallVec;

use crate::error::AmqpError;
use crate::headers;
use crate::link::{Link, FIRST_BACKOFF, MAX_BACKOFF};
use crate::shared::{backend, short, Shared};
use crate::topology::forget_declarations;

/// How often a batch is retried when the broker keeps returning it as
/// unroutable although the topology was declared again.
const UNROUTABLE_ATTEMPTS: usize = 3;
/// Bytes of the content header besides the header table (properties,
/// message id); used to refuse headers that cannot fit in one frame.
const PROPERTIES_OVERHEAD: usize = 512;
/// AMQP persistent delivery mode.
const PERSISTENT: u8 = 2;

/// Positions in a batch of outgoing messages.
type Indices = SmallVec<[usize; 1]>;

/// A message being published: kept until its publish is confirmed, so it can
/// be published again.
pub(crate) struct Outgoing {
    body: Vec<u8>,
    /// The message's headers, encoded again for a second attempt.
    headers: Headers,
    /// The encoded headers of the first attempt.
    table: Option<FieldTable>,
    header_size: usize,
    delay_ms: Option<u64>,
    /// The AMQP `message-id`: what `send` returns.
    pub(crate) id: String,
}

impl Outgoing {
    /// `message`, to be published with `delay`.
    pub(crate) fn new(
        message: RawMessage,
        delay: Option<Duration>,
    ) -> Result<Self, TransportError> {
        let (table, header_size) =
            headers::encode(&message.headers).map_err(|e| backend("encoding headers", e))?;
        let delay_ms = delay.filter(|d| !d.is_zero()).map(|d| {
            // Never early: round up to the next millisecond.
            let ms = d.as_nanos().div_ceil(1_000_000);
            u64::try_from(ms).unwrap_or(u64::MAX)
        });
        Ok(Self {
            body: message.body,
            headers: message.headers,
            table: Some(table),
            header_size,
            delay_ms,
            // Encoded directly: `to_string` would go through the formatting
            // machinery, once per message.
            id: uuid::Uuid::now_v7()
                .hyphenated()
                .encode_lower(&mut uuid::Uuid::encode_buffer())
                .to_owned(),
        })
    }

    /// The header table for the next attempt.
    fn take_table(&mut self) -> Result<FieldTable, TransportError> {
        match self.table.take() {
            Some(table) => Ok(table),
            None => headers::encode(&self.headers)
                .map(|(table, _)| table)
                .map_err(|e| backend("encoding headers", e)),
        }
    }
}

/// What became of one round of publishes.
#[derive(Default)]
struct Round {
    /// Not confirmed (a negative confirm, or the channel broke).
    failed: Indices,
    /// Returned by the broker as unroutable.
    returned: Indices,
    /// Why the last of `failed` failed, unless the broker refused it.
    last_error: Option<TransportError>,
    /// Whether the broker refused one (a negative confirm).
    nacked: bool,
    /// The broker's reply text for a returned message.
    reply: Option<String>,
}

impl Round {
    /// Whether every message of the round was confirmed.
    fn confirmed(&self) -> bool {
        self.failed.is_empty() && self.returned.is_empty()
    }

    /// Why publishing failed, once there is no time left to try again.
    fn into_error(self) -> TransportError {
        let failed = self.failed.len();
        self.last_error.unwrap_or_else(|| {
            backend(format!("publishing {failed} message(s)"), AmqpError::Nacked)
        })
    }

    /// The messages to publish again, in order.
    fn retry(self) -> Indices {
        let mut pending = self.failed;
        pending.extend(self.returned);
        pending.sort_unstable();
        pending
    }
}

impl Shared {
    /// Publishes `outgoing` with confirms, again (with the same message
    /// ids) what the broker did not confirm, until `reconnect_timeout`.
    pub(crate) async fn publish(&self, outgoing: &mut [Outgoing]) -> Result<(), TransportError> {
        if outgoing.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + self.config.reconnect_timeout;
        // Most sends publish one message: the bookkeeping below then stays
        // on the stack.
        let mut pending: Indices = (0..outgoing.len()).collect();
        let mut unroutable_rounds = 0;
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        loop {
            let link = self.link().await?;
            check_header_sizes(&link, outgoing, &pending)?;
            // Delay queues first, so every publish below is routable.
            if let Err(e) = self.ensure_delay_queues(&link, outgoing, &pending).await {
                if link.healthy() || Instant::now() >= deadline {
                    return Err(e);
                }
                self.invalidate(&link);
                continue;
            }
            let round = self.publish_round(&link, outgoing, &pending).await?;
            if round.confirmed() {
                return Ok(());
            }
            if !round.returned.is_empty() {
                unroutable_rounds += 1;
                // Boxed, like every rare path here, to keep the future of a
                // send small.
                Box::pin(self.recover_unroutable(&link, outgoing, &round, unroutable_rounds))
                    .await?;
            }
            if !link.healthy() {
                self.invalidate(&link);
            }
            if Instant::now() >= deadline {
                return Err(round.into_error());
            }
            if round.nacked || !round.failed.is_empty() {
                tracing::debug!(transport = %self.name, retrying = round.failed.len() + round.returned.len(), "retrying unconfirmed publishes");
                backoff.wait().await;
            }
            pending = round.retry();
        }
    }

    /// Declares the delay queues the `pending` messages need.
    async fn ensure_delay_queues(
        &self,
        link: &Link,
        outgoing: &[Outgoing],
        pending: &[usize],
    ) -> Result<(), TransportError> {
        let mut delays: Vec<u64> = pending
            .iter()
            .filter_map(|&i| outgoing[i].delay_ms)
            .collect();
        delays.sort_unstable();
        delays.dedup();
        for ms in delays {
            Box::pin(self.ensure_delay_queue(link, ms)).await?;
        }
        Ok(())
    }

    /// Publishes the `pending` messages on `link`, all at once, then
    /// collects their confirms.
    async fn publish_round(
        &self,
        link: &Link,
        outgoing: &mut [Outgoing],
        pending: &[usize],
    ) -> Result<Round, TransportError> {
        let mut round = Round::default();
        let mut confirms: SmallVec<[_; 1]> = SmallVec::with_capacity(pending.len());
        for (n, &i) in pending.iter().enumerate() {
            let o = &mut outgoing[i];
            let (exchange, routing_key) = self.names.route(o.delay_ms)?;
            let properties = BasicProperties::default()
                .with_delivery_mode(PERSISTENT)
                .with_message_id(short(&o.id)?)
                .with_headers(o.take_table()?);
            let mandatory = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            let published = link
                .publisher
                .basic_publish(exchange, routing_key, mandatory, &o.body, properties)
                .await;
            match published {
                Ok(confirm) => confirms.push((i, confirm)),
                Err(e) => {
                    round.failed.extend(pending[n..].iter().copied());
                    round.last_error = Some(backend("publishing", e));
                    break;
                }
            }
        }
        for (i, confirm) in confirms {
            match confirm.await {
                Ok(Confirmation::Ack(None)) | Ok(Confirmation::NotRequested) => {}
                Ok(Confirmation::Ack(Some(message))) => {
                    round.reply = Some(message.reply_text.to_string());
                    round.returned.push(i);
                }
                Ok(Confirmation::Nack(_)) => {
                    round.nacked = true;
                    round.failed.push(i);
                }
                Err(e) => {
                    round.failed.push(i);
                    round.last_error = Some(backend("waiting for the publisher confirm", e));
                }
            }
        }
        Ok(round)
    }

    /// The queue, binding or a delay queue is gone: declares the topology
    /// again, unless the broker returned messages `rounds` times already.
    async fn recover_unroutable(
        &self,
        link: &Link,
        outgoing: &[Outgoing],
        round: &Round,
        rounds: usize,
    ) -> Result<(), TransportError> {
        if rounds >= UNROUTABLE_ATTEMPTS {
            let (exchange, routing_key) = match outgoing[round.returned[0]].delay_ms {
                Some(ms) => (String::new(), self.names.delay_queue(ms)),
                None => (self.names.exchange.clone(), self.names.queue.clone()),
            };
            return Err(backend(
                format!("publishing {} message(s)", round.returned.len()),
                AmqpError::Unroutable {
                    exchange,
                    routing_key,
                    reply: round.reply.clone().unwrap_or_default(),
                },
            ));
        }
        forget_declarations(&self.delay_queues);
        match self.declare(link).await {
            Err(e) if link.healthy() => Err(e),
            _ => Ok(()),
        }
    }
}

/// Refuses a message whose headers cannot fit in one frame of `link`.
fn check_header_sizes(
    link: &Link,
    outgoing: &[Outgoing],
    pending: &[usize],
) -> Result<(), TransportError> {
    let limit = link.frame_max().saturating_sub(PROPERTIES_OVERHEAD);
    match pending
        .iter()
        .map(|&i| &outgoing[i])
        .find(|o| o.header_size > limit)
    {
        Some(o) => Err(TransportError::TooLarge {
            size: o.header_size,
            limit,
        }),
        None => Ok(()),
    }
}
