//! Reading without taking: [`MessageCount`] and [`Browse`], on the read
//! connections, so they need not wait for writes.

use envoi_core::transport::{Browse, Delivery, DeliveryId, MessageCount};
use envoi_core::{BoxFuture, TransportError};

use crate::apply::q;
use crate::row::decode_row;
use crate::transport::{db_error, parse_id, SqliteTransport};

/// Counts waiting, delayed and leased messages.
impl MessageCount for SqliteTransport {
    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.ensure_setup().await?;
            let n: i64 = sqlx::query_scalar(q(&inner.sql.count))
                .bind(&*inner.queue)
                .fetch_one(&inner.reader)
                .await
                .map_err(db_error("counting messages", &inner.table))?;
            Ok(u64::try_from(n).unwrap_or(0))
        })
    }
}

/// Lists and finds waiting, delayed and leased messages, in id order,
/// without leasing them; a row not stored as envoi stores rows is read as
/// `get` reads it, with the reason.
impl Browse for SqliteTransport {
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.ensure_setup().await?;
            let rows = sqlx::query(q(&inner.sql.list))
                .bind(&*inner.queue)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(&inner.reader)
                .await
                .map_err(db_error("listing messages", &inner.table))?;
            rows.iter()
                .map(decode_row)
                .collect::<Result<_, _>>()
                .map_err(db_error("reading listed messages", &inner.table))
        })
    }

    fn find<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let Some(row) = parse_id(id.as_str()) else {
                return Ok(None);
            };
            inner.ensure_setup().await?;
            let found = sqlx::query(q(&inner.sql.find))
                .bind(row)
                .bind(&*inner.queue)
                .fetch_optional(&inner.reader)
                .await
                .map_err(db_error("finding a message", &inner.table))?;
            found
                .as_ref()
                .map(decode_row)
                .transpose()
                .map_err(db_error("reading a found message", &inner.table))
        })
    }
}
