//! Emptying and removing what a transport stores: [`Teardown`].

use std::sync::atomic::Ordering;

use envoi_core::transport::Teardown;
use envoi_core::{BoxFuture, TransportError};

use super::RedisTransport;
use crate::scripts;

/// Keys per `DEL`.
const DELETE_CHUNK: usize = 500;

impl RedisTransport {
    /// Deletes every message waiting for the group (see [`Teardown::purge`]);
    /// returns how many there were.
    async fn purge_all(&self) -> Result<u64, TransportError> {
        let mut invocation = scripts::PURGE.prepare_invoke();
        invocation
            .key(&self.keys.stream)
            .key(&self.keys.delayed)
            .arg(&self.keys.group)
            .arg(&self.keys.payload_prefix);
        let purged: i64 = self
            .shared
            .run("purging messages", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        // What was read ahead is acknowledged now.
        self.ahead.abort();
        self.trim_acknowledged().await?;
        Ok(u64::try_from(purged).unwrap_or(0))
    }

    /// Deletes the stream (with every consumer group), the delay set and
    /// the delayed payloads.
    async fn delete_all(&self) -> Result<(), TransportError> {
        let delayed: Vec<String> = self
            .shared
            .run("listing delayed messages", |mut c| {
                let key = &self.keys.delayed;
                async move {
                    redis::cmd("ZRANGE")
                        .arg(key)
                        .arg(0)
                        .arg(-1)
                        .query_async(&mut c)
                        .await
                }
            })
            .await?;
        let mut keys: Vec<String> = delayed.iter().map(|id| self.keys.payload(id)).collect();
        keys.push(self.keys.stream.clone());
        keys.push(self.keys.delayed.clone());
        for chunk in keys.chunks(DELETE_CHUNK) {
            self.shared
                .run("deleting the transport's keys", |mut c| async move {
                    redis::cmd("DEL").arg(chunk).exec_async(&mut c).await
                })
                .await?;
        }
        self.ready.store(false, Ordering::SeqCst);
        self.ahead.abort();
        Ok(())
    }
}

impl Teardown for RedisTransport {
    /// Deletes the delayed messages, and the group's pending entries and
    /// those it has not read yet (it acknowledges the first and moves past
    /// the others; what no other group needs is then trimmed from the
    /// stream). Returns how many messages there were, as
    /// [`message_count`](envoi_core::transport::MessageCount::message_count)
    /// counts them. The stream and the group stay.
    fn purge(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(self.purge_all())
    }

    /// Deletes the stream with every consumer group, the delay set and the
    /// delayed payloads. The next `get` (or `setup`) creates the stream and
    /// group again.
    fn delete(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(self.delete_all())
    }
}
