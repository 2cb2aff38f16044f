//! Settling handed-out messages: acknowledging and rejecting (both delete
//! the row), releasing (ends its lease), keeping alive (renews it).

use envoi_core::transport::DeliveryId;
use envoi_core::TransportError;
use sqlx::AssertSqlSafe;

use crate::rows::parse_id;
use crate::transport::Inner;

/// The row id of `id`, or [`TransportError::NotFound`].
fn row_id(id: &DeliveryId) -> Result<i64, TransportError> {
    parse_id(id).ok_or_else(|| TransportError::NotFound(id.to_string()))
}

impl Inner {
    /// Deletes the row of `id`, doing `what`. Deleting a row that is
    /// already gone is fine: a consumer whose lease expired may settle a
    /// message after another consumer did.
    async fn delete_row(&self, what: &str, id: &DeliveryId) -> Result<(), TransportError> {
        let key = row_id(id)?;
        self.retrying(what, || {
            sqlx::query(AssertSqlSafe(self.sql.delete.clone()))
                .bind(key)
                .bind(self.name.as_str())
                .execute(&self.pool)
        })
        .await
        .map(|_| ())
    }

    /// The message was handled: its row goes.
    pub(crate) async fn ack(&self, id: &DeliveryId) -> Result<(), TransportError> {
        self.delete_row("acknowledging a message", id).await
    }

    /// The message must not be handled again: its row goes (the worker
    /// parks it in the failure transport first, if there is one).
    pub(crate) async fn reject(&self, id: &DeliveryId) -> Result<(), TransportError> {
        self.delete_row("rejecting a message", id).await
    }

    /// One `DELETE … WHERE id = ANY($1)`. An id that names no row of this
    /// transport does not keep the others from being acknowledged; it is
    /// the error returned.
    pub(crate) async fn ack_batch(&self, ids: &[DeliveryId]) -> Result<(), TransportError> {
        let keys: Vec<i64> = ids.iter().filter_map(parse_id).collect();
        if !keys.is_empty() {
            self.retrying("acknowledging messages", || {
                sqlx::query(AssertSqlSafe(self.sql.delete_batch.clone()))
                    .bind(&keys)
                    .bind(self.name.as_str())
                    .execute(&self.pool)
            })
            .await?;
        }
        match ids.iter().find(|id| parse_id(id).is_none()) {
            Some(bad) => Err(TransportError::NotFound(bad.to_string())),
            None => Ok(()),
        }
    }

    /// Ends the lease of `id` at once, so that the message is handed out
    /// again (in its place in line), and wakes consumers.
    pub(crate) async fn release(&self, id: &DeliveryId) -> Result<(), TransportError> {
        let key = row_id(id)?;
        let result = self
            .retrying("releasing a message", || {
                sqlx::query(AssertSqlSafe(self.sql.release.clone()))
                    .bind(key)
                    .bind(self.name.as_str())
                    .execute(&self.pool)
            })
            .await?;
        if result.rows_affected() == 0 {
            return Err(TransportError::NotFound(id.to_string()));
        }
        self.notify_consumers();
        Ok(())
    }

    /// Renews the lease of `id` for a whole lease from now.
    pub(crate) async fn keepalive(&self, id: &DeliveryId) -> Result<(), TransportError> {
        let key = row_id(id)?;
        let result = self
            .retrying("renewing a lease", || {
                sqlx::query(AssertSqlSafe(self.sql.keepalive.clone()))
                    .bind(key)
                    .bind(self.name.as_str())
                    .bind(self.lease_secs)
                    .execute(&self.pool)
            })
            .await?;
        if result.rows_affected() == 0 {
            return Err(TransportError::NotFound(id.to_string()));
        }
        Ok(())
    }
}
