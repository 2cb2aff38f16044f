//! Looking at stored messages without taking them: counting, listing,
//! finding one by id.

use envoi_core::transport::{Delivery, DeliveryId};
use envoi_core::TransportError;
use sqlx::AssertSqlSafe;

use crate::rows::{parse_id, row_to_delivery};
use crate::transport::Inner;

impl Inner {
    /// The rows of this queue: waiting, delayed and leased.
    pub(crate) async fn message_count(&self) -> Result<u64, TransportError> {
        let count: i64 = self
            .retrying("counting messages", || {
                sqlx::query_scalar(AssertSqlSafe(self.sql.count.clone()))
                    .bind(self.name.as_str())
                    .fetch_one(&self.pool)
            })
            .await?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    /// Up to `limit` rows of this queue, oldest first, without leasing them.
    pub(crate) async fn list(&self, limit: usize) -> Result<Vec<Delivery>, TransportError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .retrying("listing messages", || {
                sqlx::query(AssertSqlSafe(self.sql.list.clone()))
                    .bind(self.name.as_str())
                    .bind(limit)
                    .fetch_all(&self.pool)
            })
            .await?;
        rows.iter()
            .map(|row| row_to_delivery(row).map_err(|e| self.error("reading listed messages", e)))
            .collect()
    }

    /// The row `id` of this queue, without leasing it.
    pub(crate) async fn find(&self, id: &DeliveryId) -> Result<Option<Delivery>, TransportError> {
        let Some(key) = parse_id(id) else {
            return Ok(None);
        };
        let row = self
            .retrying("finding a message", || {
                sqlx::query(AssertSqlSafe(self.sql.find.clone()))
                    .bind(key)
                    .bind(self.name.as_str())
                    .fetch_optional(&self.pool)
            })
            .await?;
        row.as_ref()
            .map(row_to_delivery)
            .transpose()
            .map_err(|e| self.error("reading a found message", e))
    }
}
