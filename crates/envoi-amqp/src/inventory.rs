//! Counting and emptying what a handle's queues hold: the queue's ready
//! messages, what waits in the delay queues the handle used, and what the
//! handle itself holds unsettled.

use std::time::Instant;

use envoi_core::TransportError;
use futures_util::future::join_all;
use lapin::options::{BasicAckOptions, QueueDeclareOptions, QueuePurgeOptions};
use lapin::types::FieldTable;

use crate::link::Link;
use crate::shared::{backend, lock, short, Shared};

impl Shared {
    /// The queue's ready messages (passive declare) plus what waits in the
    /// delay queues this handle used plus what this handle holds unsettled.
    pub(crate) async fn message_count(&self) -> Result<u64, TransportError> {
        let link = self.link().await?;
        let channel = link.side_channel().await?;
        let queue = channel
            .queue_declare(
                short(&self.names.queue)?,
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| backend(format!("counting queue `{}`", self.names.queue), e))?;
        let _ = channel.close(200, "counted".into()).await;
        let mut total = u64::from(queue.message_count());
        for ms in self.known_delays() {
            total += self.declare_delay_queue(&link, ms).await?;
        }
        let mut state = lock(&self.consume);
        if state.epoch == link.epoch {
            // What the consumer received but no fetch took yet counts too.
            state.drain(&self.on_arrival, &self.name);
            total += (state.buffer.len() + state.leased.len()) as u64;
        }
        Ok(total)
    }

    /// Deletes what [`message_count`](Self::message_count) counts: purges
    /// the queue and the delay queues this handle used, and acknowledges
    /// what this handle holds (prefetched or handed out). Returns how many
    /// messages that was. Messages other handles hold unsettled are theirs.
    pub(crate) async fn purge(&self) -> Result<u64, TransportError> {
        let link = self.link().await?;
        let mut total = self.purge_queue(&link, &self.names.queue).await?;
        for ms in self.known_delays() {
            // Declared first: a delay queue unused for a while has expired.
            self.declare_delay_queue(&link, ms).await?;
            total += self.purge_queue(&link, &self.names.delay_queue(ms)).await?;
        }
        Ok(total + self.ack_held(&link).await?)
    }

    /// Purges `queue`; returns how many messages it deleted.
    async fn purge_queue(&self, link: &Link, queue: &str) -> Result<u64, TransportError> {
        let channel = link.side_channel().await?;
        let purged = channel
            .queue_purge(short(queue)?, QueuePurgeOptions::default())
            .await
            .map_err(|e| backend(format!("purging queue `{queue}`"), e))?;
        let _ = channel.close(200, "purged".into()).await;
        Ok(u64::from(purged))
    }

    /// Acknowledges every message this handle holds on `link`, prefetched
    /// or handed out: the broker deletes them. Returns how many.
    pub(crate) async fn ack_held(&self, link: &Link) -> Result<u64, TransportError> {
        let tags = {
            let mut state = lock(&self.consume);
            if state.epoch != link.epoch {
                return Ok(0);
            }
            state.drain(&self.on_arrival, &self.name);
            state.take_held()
        };
        if tags.is_empty() {
            return Ok(0);
        }
        let sent = join_all(
            tags.iter()
                .map(|&tag| link.consumer.basic_ack(tag, BasicAckOptions::default())),
        )
        .await;
        lock(&self.consume).settled(link.epoch, &tags);
        *lock(&self.last_settle) = Some(Instant::now());
        match sent.into_iter().find_map(Result::err) {
            Some(e) => Err(backend(
                format!("acknowledging {} message(s)", tags.len()),
                e,
            )),
            None => Ok(tags.len() as u64),
        }
    }
}
