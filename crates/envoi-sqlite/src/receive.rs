//! Taking messages: [`Receiver`] (claims, acks, rejects, releases),
//! [`Keepalive`] and [`WakeUp`].

use std::pin::pin;
use std::sync::atomic::Ordering;
use std::time::Duration;

use envoi_core::transport::{Delivery, DeliveryId, Keepalive, Receiver, WakeUp};
use envoi_core::{BoxFuture, TransportError};

use crate::config::MAX_BATCH;
use crate::op::Op;
use crate::transport::{ceil_ms, now_ms, parse_id, Inner, SqliteTransport};

/// The row id of `id`, or [`TransportError::NotFound`] for an id this
/// transport never made.
fn row_id(id: &DeliveryId) -> Result<i64, TransportError> {
    parse_id(id.as_str()).ok_or_else(|| TransportError::NotFound(id.to_string()))
}

impl Inner {
    /// Claims up to `max` rows (at least `batch`), keeping those beyond
    /// `max` for the next calls.
    async fn claim(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        let take = max.max(self.config.batch).min(MAX_BATCH);
        let now = now_ms();
        let until = now.saturating_add(ceil_ms(self.config.lease));
        let mut deliveries = self
            .write("claiming messages", |reply| Op::Claim {
                take,
                now,
                until,
                reply,
            })
            .await?;
        if deliveries.len() > max {
            self.prefetched.keep(deliveries.split_off(max), now);
        }
        Ok(deliveries)
    }

    /// Claims up to `max` rows, waiting up to `poll` for a send in this
    /// process when none is available.
    async fn claim_or_wait(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        // Listen before looking, so a send between the claim and the wait
        // still wakes us.
        let mut notified = pin!(self.signal.notify.notified());
        notified.as_mut().enable();
        // A claim that comes back empty records the generation it saw, so
        // `wait_for_messages` knows whether anything came since.
        let generation = self.signal.generation();
        let claimed = self.claim(max).await?;
        if !claimed.is_empty() {
            return Ok(claimed);
        }
        if self.config.poll.is_zero() {
            self.empty_at.store(generation, Ordering::SeqCst);
            return Ok(claimed);
        }
        let _ = tokio::time::timeout(self.config.poll, notified).await;
        let generation = self.signal.generation();
        let claimed = self.claim(max).await?;
        if claimed.is_empty() {
            self.empty_at.store(generation, Ordering::SeqCst);
        }
        Ok(claimed)
    }

    /// Deletes the rows `ids` (acknowledged or rejected); an id this
    /// transport never made is [`TransportError::NotFound`], after the
    /// others are deleted.
    async fn remove(&self, context: &str, ids: &[DeliveryId]) -> Result<(), TransportError> {
        let mut rows = Vec::with_capacity(ids.len());
        let mut unknown = None;
        for id in ids {
            match parse_id(id.as_str()) {
                Some(row) => rows.push(row),
                None => unknown = unknown.or(Some(id)),
            }
        }
        if !rows.is_empty() {
            self.ensure_setup().await?;
            self.write(context, |reply| Op::Remove(rows, reply)).await?;
        }
        match unknown {
            Some(id) => Err(TransportError::NotFound(id.to_string())),
            None => Ok(()),
        }
    }
}

impl Receiver for SqliteTransport {
    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            if max == 0 {
                return Ok(Vec::new());
            }
            let inner = &*self.inner;
            inner.ensure_setup().await?;
            let kept = inner.take_prefetched(max).await?;
            if !kept.is_empty() {
                return Ok(kept);
            }
            inner.claim_or_wait(max).await
        })
    }

    fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.inner
                .remove("acknowledging a message", std::slice::from_ref(id))
                .await
        })
    }

    fn ack_batch<'a>(&'a self, ids: &'a [DeliveryId]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.inner.remove("acknowledging messages", ids).await })
    }

    /// Deletes the row, as `ack` does: the failure transport, not the
    /// table, is where a worker keeps what it gives up on.
    fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.inner
                .remove("rejecting a message", std::slice::from_ref(id))
                .await
        })
    }

    fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let row = row_id(id)?;
            inner.ensure_setup().await?;
            let now = now_ms();
            inner
                .write("releasing a message", |reply| Op::Release {
                    ids: vec![row],
                    now,
                    claim: None,
                    reply: Some(reply),
                })
                .await
        })
    }
}

impl Keepalive for SqliteTransport {
    fn keepalive<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let row = row_id(id)?;
            inner.ensure_setup().await?;
            let until = now_ms().saturating_add(ceil_ms(inner.config.lease));
            inner
                .write("extending a lease", |reply| Op::Keepalive {
                    id: row,
                    until,
                    reply,
                })
                .await
        })
    }
}

impl WakeUp for SqliteTransport {
    /// Resolves at once when messages were sent or released in this process
    /// since `get` last came back empty (or are prefetched), otherwise on the
    /// next such send or release, or after `timeout` (sends from other
    /// processes are seen by polling).
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let inner = &*self.inner;
            let mut notified = pin!(inner.signal.notify.notified());
            notified.as_mut().enable();
            if !inner.prefetched.is_empty()
                || inner.signal.generation() != inner.empty_at.load(Ordering::SeqCst)
            {
                return;
            }
            let _ = tokio::time::timeout(timeout, notified).await;
        })
    }
}
