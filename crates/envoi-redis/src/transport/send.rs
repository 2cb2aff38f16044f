//! Sending: `XADD` now, or a delayed message stored until it is due.

use std::time::{Duration, Instant};

use envoi_core::transport::RawMessage;
use envoi_core::TransportError;
use redis::Value;
use uuid::Uuid;

use super::RedisTransport;
use crate::codec;
use crate::keys::millis;

/// Commands per pipeline in `send_batch`.
const SEND_CHUNK: usize = 500;
/// The longest delay accepted (about 100 years), in ms.
const MAX_DELAY_MS: u64 = 100 * 365 * 24 * 3600 * 1000;

impl RedisTransport {
    pub(super) async fn send_one(
        &self,
        raw: RawMessage,
        delay: Option<Duration>,
    ) -> Result<String, TransportError> {
        match delay_ms(delay) {
            None => {
                let cmd = self.keys.xadd(&raw);
                self.shared
                    .run("XADD", |mut c| {
                        let cmd = &cmd;
                        async move { cmd.query_async(&mut c).await }
                    })
                    .await
            }
            Some(ms) => {
                let id = Uuid::now_v7().to_string();
                let cmd = self.keys.send_delayed(&raw, ms, &id);
                self.shared
                    .run("storing a delayed message", |mut c| {
                        let cmd = &cmd;
                        async move { cmd.exec_async(&mut c).await }
                    })
                    .await?;
                self.expect_due(ms);
                Ok(id)
            }
        }
    }

    /// Up to [`SEND_CHUNK`] messages per pipeline: one round trip each.
    pub(super) async fn send_many(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> Result<Vec<String>, TransportError> {
        let mut ids = Vec::with_capacity(messages.len());
        for chunk in messages.chunks(SEND_CHUNK) {
            ids.extend(self.send_chunk(chunk).await?);
        }
        Ok(ids)
    }

    async fn send_chunk(
        &self,
        chunk: &[(RawMessage, Option<Duration>)],
    ) -> Result<Vec<String>, TransportError> {
        let mut pipe = redis::pipe();
        // The id of each delayed message, `None` for those the stream names.
        let mut planned: Vec<Option<String>> = Vec::with_capacity(chunk.len());
        let mut soonest: Option<u64> = None;
        for (raw, delay) in chunk {
            match delay_ms(*delay) {
                None => {
                    pipe.add_command(self.keys.xadd(raw));
                    planned.push(None);
                }
                Some(ms) => {
                    let id = Uuid::now_v7().to_string();
                    pipe.add_command(self.keys.send_delayed(raw, ms, &id));
                    planned.push(Some(id));
                    soonest = Some(soonest.map_or(ms, |s| s.min(ms)));
                }
            }
        }
        let replies: Vec<Value> = self
            .shared
            .run("XADD (batch)", |mut c| {
                let pipe = &pipe;
                async move { pipe.query_async(&mut c).await }
            })
            .await?;
        if let Some(ms) = soonest {
            self.expect_due(ms);
        }
        if replies.len() != planned.len() {
            return Err(TransportError::backend(
                "XADD (batch)",
                format!("{} replies for {} commands", replies.len(), planned.len()),
            ));
        }
        replies
            .into_iter()
            .zip(planned)
            .map(|(reply, planned)| match planned {
                Some(id) => Ok(id),
                None => codec::string(reply.clone()).ok_or_else(|| {
                    TransportError::backend("XADD (batch)", codec::unexpected("XADD", &reply))
                }),
            })
            .collect()
    }

    /// Makes this handle look for due messages no later than `delay_ms` from
    /// now.
    fn expect_due(&self, delay_ms: u64) {
        // Thirty years at most: a longer delay would overflow an `Instant`.
        let delay = Duration::from_millis(delay_ms).min(Duration::from_secs(86_400 * 365 * 30));
        self.chores().expect_due(Instant::now() + delay);
    }
}

/// A delay worth storing (at least 1 ms), capped at about a century.
fn delay_ms(delay: Option<Duration>) -> Option<u64> {
    delay
        .filter(|d| !d.is_zero())
        .map(|d| millis(d).clamp(1, MAX_DELAY_MS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_round_up_to_a_millisecond_and_zero_means_none() {
        assert_eq!(delay_ms(None), None);
        assert_eq!(delay_ms(Some(Duration::ZERO)), None);
        assert_eq!(delay_ms(Some(Duration::from_micros(10))), Some(1));
        assert_eq!(delay_ms(Some(Duration::from_secs(2))), Some(2000));
        assert_eq!(delay_ms(Some(Duration::MAX)), Some(MAX_DELAY_MS));
    }
}
