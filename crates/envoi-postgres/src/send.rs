//! Sending: checking that a message can be stored, then storing it through
//! the writer (one `send`) or with one statement (`send_batch`).

use std::sync::Arc;
use std::time::Duration;

use envoi_core::transport::support::encode_json_headers;
use envoi_core::transport::RawMessage;
use envoi_core::{Headers, TransportError};
use sqlx::AssertSqlSafe;
use tokio::sync::oneshot;

use crate::transport::Inner;
use crate::writer::{PendingSend, Writer};

/// A message that PostgreSQL cannot store as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// A header key or value contains a NUL character (`jsonb` cannot hold it).
    #[error("header `{key}` contains a NUL character, which PostgreSQL text cannot hold")]
    NulInHeader {
        /// The header's key (NULs shown as `\0`).
        key: String,
    },
}

/// `delay` in seconds, as the statements take it.
fn delay_secs(delay: Option<Duration>) -> f64 {
    delay.map_or(0.0, |d| d.as_secs_f64())
}

impl Inner {
    /// `headers` as the JSON text of the `headers` column; refused when a
    /// key or value holds a NUL, which `jsonb` cannot store.
    fn encode_headers(&self, headers: &Headers) -> Result<String, TransportError> {
        if let Some((key, _)) = headers
            .iter()
            .find(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(TransportError::backend(
                format!(
                    "postgres: cannot store a message of transport `{}`",
                    self.name
                ),
                MessageError::NulInHeader {
                    key: key.replace('\0', "\\0"),
                },
            ));
        }
        encode_json_headers(headers)
    }

    /// Refuses a body larger than `max_body`.
    fn check_size(&self, message: &RawMessage) -> Result<(), TransportError> {
        if message.body.len() > self.config.max_body {
            return Err(TransportError::TooLarge {
                size: message.body.len(),
                limit: self.config.max_body,
            });
        }
        Ok(())
    }

    /// Sends one message through the writer, which groups it with the
    /// sends waiting at the same time; returns once its row is committed.
    pub(crate) async fn send(
        self: &Arc<Self>,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> Result<String, TransportError> {
        self.check_size(&message)?;
        let headers = self.encode_headers(&message.headers)?;
        // The writer's statements do not wait for the server first.
        self.reach().await?;
        let (reply, stored) = oneshot::channel();
        let pending = PendingSend {
            body: message.body,
            headers,
            delay: delay_secs(delay),
            reply,
        };
        let writer = self.writer.get_or_init(|| Writer::start(self));
        if writer.queue.send(pending).is_err() {
            return Err(TransportError::Closed);
        }
        match stored.await {
            Ok(Ok(id)) => Ok(id.to_string()),
            Ok(Err(error)) => Err(error),
            // The writer stopped: the transport was closed.
            Err(_) => Err(TransportError::Closed),
        }
    }

    /// Stores one message with a single-row `INSERT`.
    pub(crate) async fn insert_one(
        &self,
        body: &[u8],
        headers: &str,
        delay: f64,
    ) -> Result<i64, TransportError> {
        self.retrying("sending a message", || {
            sqlx::query_scalar(AssertSqlSafe(self.sql.insert.clone()))
                .bind(self.name.as_str())
                .bind(body)
                .bind(headers)
                .bind(delay)
                .fetch_one(&self.pool)
        })
        .await
    }

    /// One multi-row `INSERT … SELECT … FROM UNNEST(…)`, then one
    /// (coalesced) `NOTIFY`. Nothing is stored when one message cannot be.
    pub(crate) async fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> Result<Vec<String>, TransportError> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let mut bodies = Vec::with_capacity(messages.len());
        let mut headers = Vec::with_capacity(messages.len());
        let mut delays = Vec::with_capacity(messages.len());
        for (message, delay) in messages {
            self.check_size(&message)?;
            headers.push(self.encode_headers(&message.headers)?);
            bodies.push(message.body);
            delays.push(delay_secs(delay));
        }
        let ids: Vec<i64> = self
            .retrying("sending a batch", || {
                sqlx::query_scalar(AssertSqlSafe(self.sql.insert_batch.clone()))
                    .bind(self.name.as_str())
                    .bind(&bodies)
                    .bind(&headers)
                    .bind(&delays)
                    .fetch_all(&self.pool)
            })
            .await?;
        if ids.len() != bodies.len() {
            return Err(TransportError::backend(
                "postgres: sending a batch",
                format!("stored {} rows for {} messages", ids.len(), bodies.len()),
            ));
        }
        if delays.iter().any(|d| *d <= 0.0) {
            self.notify_consumers();
        }
        Ok(ids.into_iter().map(|id| id.to_string()).collect())
    }
}
