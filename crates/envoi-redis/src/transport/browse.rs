//! Counting, listing and finding waiting messages without taking them:
//! the group's pending entries, those it has not read yet, and the delayed
//! ones.

use envoi_core::transport::{Browse, Delivery, DeliveryId, MessageCount};
use envoi_core::{BoxFuture, TransportError};
use redis::Value;
use uuid::Uuid;

use super::RedisTransport;
use crate::codec;
use crate::scripts;

impl RedisTransport {
    async fn count(&self) -> Result<u64, TransportError> {
        let mut invocation = scripts::COUNT.prepare_invoke();
        invocation
            .key(&self.keys.stream)
            .key(&self.keys.delayed)
            .arg(&self.keys.group);
        let n: i64 = self
            .shared
            .run("counting messages", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// The delayed messages `ids` still waiting, by their payload hashes.
    async fn delayed_payloads(&self, ids: Vec<String>) -> Result<Vec<Delivery>, TransportError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.cmd("HGETALL").arg(self.keys.payload(id));
        }
        let replies: Vec<Value> = self
            .shared
            .run("reading delayed messages", |mut c| {
                let pipe = &pipe;
                async move { pipe.query_async(&mut c).await }
            })
            .await?;
        let mut out = Vec::with_capacity(ids.len());
        for (id, reply) in ids.into_iter().zip(replies) {
            let fields = match reply {
                Value::Array(fields) => fields,
                Value::Map(pairs) => pairs.into_iter().flat_map(|(k, v)| [k, v]).collect(),
                other => {
                    return Err(TransportError::backend(
                        "reading delayed messages",
                        codec::unexpected("HGETALL", &other),
                    ))
                }
            };
            // Moved into the stream between the two reads.
            if fields.is_empty() {
                continue;
            }
            let raw = codec::decode_fields(fields)
                .map_err(|e| TransportError::backend("reading delayed messages", e))?;
            out.push(Delivery::new(id, raw));
        }
        Ok(out)
    }

    async fn list_some(&self, limit: usize) -> Result<Vec<Delivery>, TransportError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut invocation = scripts::LIST.prepare_invoke();
        invocation
            .key(&self.keys.stream)
            .arg(&self.keys.group)
            .arg(limit);
        let reply: Value = self
            .shared
            .run("listing messages", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        let mut out = codec::decode_entries(reply, "listing messages")
            .map_err(|e| TransportError::backend("listing messages", e))?
            .deliveries;
        if out.len() < limit {
            let room = limit - out.len();
            let ids: Vec<String> = self
                .shared
                .run("listing delayed messages", |mut c| async move {
                    redis::cmd("ZRANGE")
                        .arg(&self.keys.delayed)
                        .arg(0)
                        .arg(room.saturating_sub(1))
                        .query_async(&mut c)
                        .await
                })
                .await?;
            out.extend(self.delayed_payloads(ids).await?);
        }
        Ok(out)
    }

    async fn find_one(&self, id: &DeliveryId) -> Result<Option<Delivery>, TransportError> {
        if codec::is_stream_id(id.as_str()) {
            let mut invocation = scripts::FIND.prepare_invoke();
            invocation
                .key(&self.keys.stream)
                .arg(&self.keys.group)
                .arg(id.as_str());
            let reply: Value = self
                .shared
                .run("finding a message", |mut c| {
                    let invocation = &invocation;
                    async move { invocation.invoke_async(&mut c).await }
                })
                .await?;
            let entries = codec::decode_entries(reply, "finding a message")
                .map_err(|e| TransportError::backend("finding a message", e))?;
            Ok(entries.deliveries.into_iter().find(|d| d.id == *id))
        } else if Uuid::parse_str(id.as_str()).is_ok() {
            Ok(self
                .delayed_payloads(vec![id.as_str().to_string()])
                .await?
                .pop())
        } else {
            Ok(None)
        }
    }
}

impl MessageCount for RedisTransport {
    /// The group's pending entries, plus those it has not read yet, plus
    /// the delayed messages.
    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(self.count())
    }
}

impl Browse for RedisTransport {
    /// The group's pending entries, then those it has not read yet, then
    /// the delayed messages (by the id `send` returned), oldest first.
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(self.list_some(limit))
    }

    /// A waiting entry by its stream id, or a delayed message by the id
    /// `send` returned; `None` once it is settled (or moved into the
    /// stream, for a delayed one).
    fn find<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        Box::pin(self.find_one(id))
    }
}
