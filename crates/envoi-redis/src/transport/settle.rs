//! Settling entries handed out: acknowledging (`XACK`), rejecting (`XACK`
//! and `XDEL`), giving back to the group (kept pending, for the release
//! consumer, until a `get` claims it) and keeping alive (`XCLAIM ...
//! JUSTID`).

use std::time::Instant;

use envoi_core::transport::{Delivery, DeliveryId, Keepalive};
use envoi_core::{BoxFuture, TransportError};

use super::RedisTransport;
use crate::codec;
use crate::keys::{Keys, RELEASE_CONSUMER};
use crate::link::Link;
use crate::scripts;

impl RedisTransport {
    /// Acknowledges the entries among `ids` (ids that are not pending are
    /// ignored by Redis; ids that are not stream ids are skipped).
    pub(super) async fn settle(&self, ids: &[&str]) -> Result<(), TransportError> {
        let valid: Vec<&str> = ids
            .iter()
            .copied()
            .filter(|id| codec::is_stream_id(id))
            .collect();
        if valid.is_empty() {
            return Ok(());
        }
        let cmd = self.keys.xack(&valid);
        let _acked: i64 = self
            .shared
            .run("XACK", |mut c| {
                let cmd = &cmd;
                async move { cmd.query_async(&mut c).await }
            })
            .await?;
        Ok(())
    }

    /// Acknowledges `id` and deletes its entry, unless another group on the
    /// stream still needs it. An id that is not pending is left alone.
    pub(super) async fn reject_one(&self, id: &str) -> Result<(), TransportError> {
        if !codec::is_stream_id(id) {
            return Ok(());
        }
        let mut invocation = scripts::REJECT.prepare_invoke();
        invocation
            .key(&self.keys.stream)
            .arg(&self.keys.group)
            .arg(id);
        let _deleted: i64 = self
            .shared
            .run("rejecting a message", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        Ok(())
    }

    /// Gives `id` back to the group: fails with
    /// [`TransportError::NotFound`] when it is not pending for this handle
    /// (settled already, released already, claimed by another consumer
    /// since, or never handed out). This handle's next `get` takes it
    /// (waking the `get` blocked now, if any); another handle's within its
    /// next `get`s.
    pub(super) async fn release_one(&self, id: &str) -> Result<(), TransportError> {
        if !codec::is_stream_id(id) {
            return Err(TransportError::NotFound(id.to_string()));
        }
        match release(&self.shared, &self.keys, &[id], Given::HandedOut).await? {
            0 => Err(TransportError::NotFound(id.to_string())),
            _ => {
                self.chores().released_at(Instant::now());
                self.wake_blocked_read().await;
                Ok(())
            }
        }
    }

    /// Ends the blocking read this handle has on the server, if any
    /// (`CLIENT UNBLOCK`), so that its `get` looks for what was just given
    /// back rather than wait for a new entry. A failure only means the read
    /// waits out its `block`.
    async fn wake_blocked_read(&self) {
        if self.read_lock.try_lock().is_ok() {
            return;
        }
        let Some(client_id) = self.blocking.client_id() else {
            return;
        };
        let unblocked = self
            .shared
            .run("CLIENT UNBLOCK", |mut c| async move {
                redis::cmd("CLIENT")
                    .arg("UNBLOCK")
                    .arg(client_id)
                    .query_async::<i64>(&mut c)
                    .await
            })
            .await;
        if let Err(e) = unblocked {
            tracing::debug!(stream = %self.keys.stream, error = %e, "could not wake the blocked read");
        }
    }

    async fn keepalive_one(&self, id: &str) -> Result<(), TransportError> {
        if !codec::is_stream_id(id) {
            return Err(TransportError::NotFound(id.to_string()));
        }
        let mut invocation = scripts::KEEPALIVE.prepare_invoke();
        invocation
            .key(&self.keys.stream)
            .arg(&self.keys.group)
            .arg(id)
            .arg(&self.keys.consumer);
        let renewed: i64 = self
            .shared
            .run("XCLAIM (keepalive)", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        match renewed {
            1 => Ok(()),
            -1 => {
                tracing::debug!(id, consumer = %self.keys.consumer, "keepalive: another consumer claimed the message");
                Err(TransportError::NotFound(id.to_string()))
            }
            _ => Err(TransportError::NotFound(id.to_string())),
        }
    }
}

impl Keepalive for RedisTransport {
    /// Resets the idle time of the entry, pending for this consumer, so that
    /// no other consumer claims it for another lease. Fails with
    /// [`TransportError::NotFound`] when it is settled or another consumer
    /// has claimed it since.
    fn keepalive<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.keepalive_one(id.as_str()))
    }
}

/// What entries given back were: whether their consumer had them.
#[derive(Debug, Clone, Copy)]
enum Given {
    /// Handed out by `get`: they come back marked as redelivered.
    HandedOut,
    /// Read ahead and never handed out: they come back unmarked.
    ReadAhead,
}

/// Gives back the entries of `deliveries` (read ahead and never handed out),
/// through `link`; returns how many were still pending.
pub(super) async fn release_entries(
    link: &Link,
    keys: &Keys,
    deliveries: &[Delivery],
) -> Result<u64, TransportError> {
    let ids: Vec<&str> = deliveries
        .iter()
        .map(|d| d.id.as_str())
        .filter(|id| codec::is_stream_id(id))
        .collect();
    let mut given_back = 0;
    // A few hundred ids per script run, so that none runs long.
    for chunk in ids.chunks(200) {
        given_back += release(link, keys, chunk, Given::ReadAhead).await?;
    }
    Ok(given_back)
}

/// Runs the release script on `ids`; returns how many were given back.
async fn release(
    link: &Link,
    keys: &Keys,
    ids: &[&str],
    given: Given,
) -> Result<u64, TransportError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let mut invocation = scripts::RELEASE.prepare_invoke();
    invocation
        .key(&keys.stream)
        .arg(&keys.group)
        .arg(RELEASE_CONSUMER)
        .arg(&keys.consumer)
        .arg(match given {
            Given::HandedOut => "1",
            Given::ReadAhead => "0",
        })
        .arg(ids);
    let released: i64 = link
        .run("releasing messages", |mut c| {
            let invocation = &invocation;
            async move { invocation.invoke_async(&mut c).await }
        })
        .await?;
    Ok(u64::try_from(released).unwrap_or(0))
}
