//! What the transport stores its messages in: creating the table and its
//! index (by `setup`, or with `auto_setup` when a statement finds it
//! missing), emptying its queue, and removing them.

use envoi_core::TransportError;
use sqlx::{AssertSqlSafe, PgConnection};

use crate::transport::Inner;

impl Inner {
    /// Creates the table and its claim index, if missing. Concurrent setups
    /// (`CREATE … IF NOT EXISTS` races with itself) wait for each other.
    pub(crate) async fn setup(&self) -> Result<(), TransportError> {
        self.retrying("creating the table", || self.create_table())
            .await
    }

    /// [`setup`](Self::setup) once, without retrying: in one transaction
    /// holding the setup lock, so that processes creating the table at the
    /// same moment (`CREATE TABLE IF NOT EXISTS` alone can fail on a unique
    /// violation in `pg_type` then) take turns, and the later ones find it
    /// made. Also run by a statement that finds no table, with
    /// `auto_setup`.
    pub(crate) async fn create_table(&self) -> Result<(), sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        self.lock_setup(&mut tx).await?;
        sqlx::query(AssertSqlSafe(self.sql.create_table.clone()))
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(self.sql.create_index.clone()))
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    /// Takes the advisory lock, held until the transaction ends, that
    /// serializes the setups and deletes of one table.
    async fn lock_setup(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(self.sql.setup_lock.clone()))
            .bind(self.config.table.as_str())
            .execute(tx)
            .await
            .map(drop)
    }

    /// Deletes every row of this queue, leased ones included (and what was
    /// claimed ahead); returns how many.
    pub(crate) async fn purge(&self) -> Result<u64, TransportError> {
        // What was claimed ahead is about to be deleted.
        drop(self.ahead.drain().await);
        self.retrying("purging messages", || {
            sqlx::query(AssertSqlSafe(self.sql.purge.clone()))
                .bind(self.name.as_str())
                .execute(&self.pool)
        })
        .await
        .map(|r| r.rows_affected())
    }

    /// Deletes every row of this queue, and the table with its index once
    /// no other queue has a row in it. The table is locked meanwhile, so
    /// nothing is sent to it between the check and the drop. Deleting a
    /// table that is gone does nothing.
    pub(crate) async fn delete(&self) -> Result<(), TransportError> {
        drop(self.ahead.drain().await);
        self.retrying("deleting the queue", || async {
            let mut tx = self.pool.begin().await?;
            self.lock_setup(&mut tx).await?;
            let exists: bool = sqlx::query_scalar(AssertSqlSafe(self.sql.table_exists.clone()))
                .fetch_one(&mut *tx)
                .await?;
            if exists {
                self.delete_locked(&mut tx).await?;
            }
            tx.commit().await
        })
        .await
    }

    /// [`delete`](Self::delete), in a transaction holding the setup lock,
    /// for a table that exists.
    async fn delete_locked(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(self.sql.lock_table.clone()))
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(self.sql.purge.clone()))
            .bind(self.name.as_str())
            .execute(&mut *tx)
            .await?;
        let others: bool = sqlx::query_scalar(AssertSqlSafe(self.sql.any_row.clone()))
            .fetch_one(&mut *tx)
            .await?;
        if !others {
            sqlx::query(AssertSqlSafe(self.sql.drop_table.clone()))
                .execute(&mut *tx)
                .await?;
        }
        Ok(())
    }
}
