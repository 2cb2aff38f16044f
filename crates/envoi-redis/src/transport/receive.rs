//! Handing entries out: [`Receiver::get`] with its read ahead, and the
//! [`Receiver`] ability as a whole.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::transport::{Delivery, DeliveryId, Receiver};
use envoi_core::{BoxFuture, TransportError};
use redis::{Cmd, Value};

use super::RedisTransport;
use crate::codec;
use crate::keys::Keys;
use crate::link::{redis_code, Link};

/// A `get` this large that comes back full reads the next batch ahead;
/// smaller ones never do.
const READ_AHEAD_MIN: usize = 100;

impl RedisTransport {
    async fn get_some(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let got = match self.get_once(max).await {
            Err(e) if redis_code(&e) == Some("NOGROUP") => {
                // The stream or group was deleted under us: recreate it.
                self.ready.store(false, Ordering::SeqCst);
                self.get_once(max).await
            }
            other => other,
        };
        self.get_failed.store(got.is_err(), Ordering::SeqCst);
        got
    }

    /// Entries whose lease ran out first, then (after the chores that are
    /// due) entries given back to the group, entries read ahead, then new
    /// entries read now, and after a read that found none (or was woken by
    /// a release of this handle) entries given back meanwhile.
    async fn get_once(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        self.ensure_ready().await?;
        let now = Instant::now();
        if let Some(claimed) = self.reclaim_if_due(now, max).await? {
            return Ok(claimed);
        }
        self.maybe_trim(now).await;
        self.maybe_move_due(now).await?;
        if let Some(released) = self.claim_released_if_due(now, max).await? {
            return Ok(released);
        }

        // Entries read ahead more than half a lease ago (`stale`) are not
        // handed out with so little of their lease left, nor given back:
        // they stay pending for this consumer, and are claimed again once
        // their lease has passed.
        let ahead = self.ahead.take(max).await?.fresh;
        if !ahead.is_empty() {
            self.read_ahead(max, ahead.len());
            return Ok(ahead);
        }

        // Do not sleep through the moment a known delayed message is due.
        let block = self.chores().block_for(self.config.block);
        let got = self.read_new(max, block).await?;
        if got.is_empty() {
            if let Some(released) = self.claim_released_if_due(Instant::now(), max).await? {
                return Ok(released);
            }
        }
        self.read_ahead(max, got.len());
        Ok(got)
    }

    /// Up to `max` new entries, waiting up to `block` for one.
    async fn read_new(&self, max: usize, block: Duration) -> Result<Vec<Delivery>, TransportError> {
        let _reading = self.read_lock.lock().await;
        let entries = read(&self.blocking, self.keys.read_new(max, Some(block))).await?;
        self.drop_deleted(&entries).await?;
        Ok(entries.deliveries)
    }

    /// After a `get` of `max` (at least [`READ_AHEAD_MIN`]) that handed out
    /// `got == max` entries, reads the next `max` new entries in the
    /// background, unless some are still kept from the last read.
    fn read_ahead(&self, max: usize, got: usize) {
        if max < READ_AHEAD_MIN || got < max {
            return;
        }
        // On the reading connection: a large reply there does not hold up
        // the acknowledgements on the shared one.
        self.ahead.fetch_ahead(read_ahead(
            Arc::clone(&self.blocking),
            Arc::clone(&self.keys),
            self.keys.read_new(max, None),
        ));
    }
}

/// Runs an `XREADGROUP` on `link` and decodes its reply.
async fn read(link: &Link, cmd: Cmd) -> Result<codec::Entries, TransportError> {
    let reply: Value = link
        .run("XREADGROUP", |mut c| {
            let cmd = &cmd;
            async move { cmd.query_async(&mut c).await }
        })
        .await?;
    codec::decode_read(reply).map_err(|e| TransportError::backend("XREADGROUP", e))
}

/// A read ahead, run in the background: the entries of `cmd`, with those
/// deleted while pending acknowledged.
async fn read_ahead(
    link: Arc<Link>,
    keys: Arc<Keys>,
    cmd: Cmd,
) -> Result<Vec<Delivery>, TransportError> {
    let entries = read(&link, cmd).await?;
    if !entries.deleted.is_empty() {
        let ids: Vec<&str> = entries.deleted.iter().map(String::as_str).collect();
        let ack = keys.xack(&ids);
        let _acked: i64 = link
            .run("XACK", |mut c| {
                let ack = &ack;
                async move { ack.query_async(&mut c).await }
            })
            .await?;
    }
    Ok(entries.deliveries)
}

impl Receiver for RedisTransport {
    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(self.get_some(max))
    }

    fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.settle(&[id.as_str()]).await })
    }

    /// One `XACK` for every id.
    fn ack_batch<'a>(&'a self, ids: &'a [DeliveryId]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let ids: Vec<&str> = ids.iter().map(DeliveryId::as_str).collect();
            self.settle(&ids).await
        })
    }

    /// Acknowledges the entry and deletes it from the stream at once
    /// (unless another consumer group on the stream still needs it).
    fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.reject_one(id.as_str()))
    }

    /// Gives the entry back to the group: it stays pending (for the group's
    /// release consumer, not for this handle) and the next `get` of a
    /// handle in the group takes it, marked as redelivered; the stream, and
    /// so every other group on it, is left alone. Fails with
    /// [`TransportError::NotFound`] when it is not pending for this handle.
    fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.release_one(id.as_str()))
    }
}
