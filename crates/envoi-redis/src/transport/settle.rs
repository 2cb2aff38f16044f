//! Settling entries handed out: acknowledging (`XACK`), rejecting (`XACK`
//! and `XDEL`), giving back (re-added at the end of the stream) and
//! keeping alive (`XCLAIM ... JUSTID`).

use envoi_core::transport::{Delivery, DeliveryId, Keepalive};
use envoi_core::{BoxFuture, TransportError};

use super::RedisTransport;
use crate::codec;
use crate::keys::Keys;
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

    /// Gives `id` back: fails with [`TransportError::NotFound`] when it is
    /// not pending (settled already, or never handed out).
    pub(super) async fn release_one(&self, id: &str) -> Result<(), TransportError> {
        if !codec::is_stream_id(id) {
            return Err(TransportError::NotFound(id.to_string()));
        }
        match release(&self.shared, &self.keys, &[id]).await? {
            0 => Err(TransportError::NotFound(id.to_string())),
            _ => Ok(()),
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
        given_back += release(link, keys, chunk).await?;
    }
    Ok(given_back)
}

/// Runs the release script on `ids`; returns how many were re-added.
async fn release(link: &Link, keys: &Keys, ids: &[&str]) -> Result<u64, TransportError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let mut invocation = scripts::RELEASE.prepare_invoke();
    invocation
        .key(&keys.stream)
        .arg(&keys.group)
        .arg(&keys.trim)
        .arg(ids);
    let readded: i64 = link
        .run("releasing messages", |mut c| {
            let invocation = &invocation;
            async move { invocation.invoke_async(&mut c).await }
        })
        .await?;
    Ok(u64::try_from(readded).unwrap_or(0))
}
