//! Sending: the [`Transport`] side of [`SqliteTransport`], and the
//! abilities it hands out.

use std::time::Duration;

use envoi_core::transport::support::encode_json_headers;
use envoi_core::transport::{RawMessage, Transport, TransportDescription};
use envoi_core::{BoxFuture, TransportError};

use crate::op::{NewRow, Op};
use crate::transport::{ceil_ms, now_ms, SqliteTransport};

/// `message` as a row, available `delay` after `now`.
fn new_row(
    message: RawMessage,
    delay: Option<Duration>,
    now: i64,
) -> Result<NewRow, TransportError> {
    Ok(NewRow {
        headers: encode_json_headers(&message.headers)?,
        body: message.body,
        created_at: now,
        available_at: now.saturating_add(delay.map_or(0, ceil_ms)),
    })
}

impl Transport for SqliteTransport {
    /// `sqlite`: a local file, no server.
    fn describe(&self) -> TransportDescription {
        TransportDescription::new("sqlite")
    }

    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.ensure_setup().await?;
            let row = new_row(message, delay, now_ms())?;
            let ids = inner
                .write("inserting a message", |reply| Op::Insert(vec![row], reply))
                .await?;
            ids.first()
                .map(i64::to_string)
                .ok_or_else(|| TransportError::backend("inserting a message", "no id returned"))
        })
    }

    /// Inserts 64 rows per statement, all in one transaction: a batch that
    /// fails stores none of its messages.
    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        Box::pin(async move {
            if messages.is_empty() {
                return Ok(Vec::new());
            }
            let inner = &*self.inner;
            inner.ensure_setup().await?;
            let now = now_ms();
            let rows = messages
                .into_iter()
                .map(|(message, delay)| new_row(message, delay, now))
                .collect::<Result<Vec<_>, _>>()?;
            let n = rows.len();
            let ids = inner
                .write("inserting a batch", |reply| Op::Insert(rows, reply))
                .await?;
            if ids.len() != n {
                return Err(TransportError::backend(
                    "inserting a batch",
                    format!("{} ids returned for {n} rows", ids.len()),
                ));
            }
            Ok(ids.into_iter().map(|id| id.to_string()).collect())
        })
    }

    envoi_core::abilities!(
        receiver,
        keepalive,
        setup,
        message_count,
        browse,
        teardown,
        wake_up
    );
}
