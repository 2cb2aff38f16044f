//! The SQL, written once per table when a transport is opened.

use std::sync::Arc;

use crate::apply::INSERT_CHUNK;

/// Every statement, written once per table.
pub(crate) struct Statements {
    /// Creating, migrating and dropping the table.
    pub(crate) schema: Schema,
    pub(crate) insert: Arc<str>,
    pub(crate) insert_chunk: Arc<str>,
    pub(crate) claim: Arc<str>,
    pub(crate) ack: Arc<str>,
    pub(crate) ack_many: Arc<str>,
    pub(crate) release: Arc<str>,
    pub(crate) release_many: Arc<str>,
    pub(crate) release_claimed: Arc<str>,
    pub(crate) keepalive: Arc<str>,
    pub(crate) count: Arc<str>,
    pub(crate) list: Arc<str>,
    pub(crate) find: Arc<str>,
    pub(crate) purge: Arc<str>,
}

/// The statements that create, migrate and drop the table.
pub(crate) struct Schema {
    pub(crate) create_table: Arc<str>,
    pub(crate) create_index: Arc<str>,
    /// Whether the table still has the claim index under its former name.
    pub(crate) has_legacy_index: Arc<str>,
    pub(crate) drop_legacy_index: Arc<str>,
    /// Whether the table has the `delivery_count` column (a table set up
    /// before it was added does not).
    pub(crate) has_delivery_count: Arc<str>,
    pub(crate) add_delivery_count: Arc<str>,
    /// Whether the table exists.
    pub(crate) table_exists: Arc<str>,
    /// Whether the table holds any row, of any queue.
    pub(crate) has_rows: Arc<str>,
    pub(crate) drop_table: Arc<str>,
}

fn s(sql: String) -> Arc<str> {
    Arc::from(sql)
}

impl Schema {
    fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        // Tables and indexes share one name space: `:` cannot be in a table
        // name, so this cannot be the table of another transport (as
        // `{table}_claim`, the former name, was for `<name>_claim`).
        let index = format!("\"{table}:claim\"");
        let legacy = format!("{table}_claim");
        Schema {
            create_table: s(format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    queue_name TEXT NOT NULL,
                    body BLOB NOT NULL,
                    headers TEXT NOT NULL,
                    created_at INTEGER NOT NULL,
                    available_at INTEGER NOT NULL CHECK (typeof(available_at) = 'integer'),
                    delivered_at INTEGER,
                    lease_until INTEGER,
                    delivery_count INTEGER NOT NULL DEFAULT 0
                )"
            )),
            create_index: s(format!(
                "CREATE INDEX IF NOT EXISTS {index} ON {t} (queue_name, available_at, id)"
            )),
            has_legacy_index: s(format!(
                "SELECT count(*) FROM sqlite_master WHERE type = 'index' \
                 AND name = '{legacy}' COLLATE NOCASE AND tbl_name = '{table}' COLLATE NOCASE"
            )),
            drop_legacy_index: s(format!("DROP INDEX IF EXISTS \"{legacy}\"")),
            has_delivery_count: s(format!(
                "SELECT count(*) FROM pragma_table_info('{table}') WHERE name = 'delivery_count'"
            )),
            add_delivery_count: s(format!(
                "ALTER TABLE {t} ADD COLUMN delivery_count INTEGER NOT NULL DEFAULT 0"
            )),
            table_exists: s(format!(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' \
                 AND name = '{table}' COLLATE NOCASE"
            )),
            has_rows: s(format!("SELECT EXISTS (SELECT 1 FROM {t})")),
            // Its indexes go with it.
            drop_table: s(format!("DROP TABLE IF EXISTS {t}")),
        }
    }
}

// `+queue_name` keeps SQLite from scanning the claim index for a queue's
// rows when the rows are known by id (or wanted in id order): lookups by
// rowid, with the queue as a filter.
impl Statements {
    pub(crate) fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        let row = "(?, ?, ?, ?, ?)";
        let rows = vec![row; INSERT_CHUNK].join(", ");
        Statements {
            schema: Schema::new(table),
            insert: s(format!(
                "INSERT INTO {t} (queue_name, body, headers, created_at, available_at) VALUES {row}"
            )),
            insert_chunk: s(format!(
                "INSERT INTO {t} (queue_name, body, headers, created_at, available_at) VALUES {rows} RETURNING id"
            )),
            // ?1 now, ?2 lease end, ?3 queue, ?4 how many. A row claimed
            // before (its count above 1 after this claim) was handed out
            // and not acknowledged: its lease ran out, or it was released.
            claim: s(format!(
                "UPDATE {t} SET delivered_at = ?1, lease_until = ?2, available_at = ?2,
                     delivery_count = delivery_count + 1
                 WHERE id IN (
                     SELECT id FROM {t}
                     WHERE queue_name = ?3 AND available_at <= ?1
                     ORDER BY available_at, id
                     LIMIT ?4
                 )
                 RETURNING id, body, headers, delivery_count"
            )),
            ack: s(format!("DELETE FROM {t} WHERE id = ?1 AND queue_name = ?2")),
            ack_many: s(format!(
                "DELETE FROM {t} WHERE +queue_name = ?2 AND id IN (SELECT value FROM json_each(?1))"
            )),
            release: s(format!(
                "UPDATE {t} SET available_at = ?3, lease_until = NULL, delivered_at = NULL
                 WHERE id = ?1 AND queue_name = ?2 AND lease_until IS NOT NULL"
            )),
            release_many: s(format!(
                "UPDATE {t} SET available_at = ?3, lease_until = NULL, delivered_at = NULL
                 WHERE +queue_name = ?2 AND lease_until IS NOT NULL
                   AND id IN (SELECT value FROM json_each(?1))"
            )),
            // Only rows still leased by the claim made at ?4. They were
            // never handed out: that claim does not count as a delivery.
            release_claimed: s(format!(
                "UPDATE {t} SET available_at = ?3, lease_until = NULL, delivered_at = NULL,
                     delivery_count = max(delivery_count - 1, 0)
                 WHERE +queue_name = ?2 AND delivered_at = ?4
                   AND id IN (SELECT value FROM json_each(?1))"
            )),
            keepalive: s(format!(
                "UPDATE {t} SET lease_until = ?3, available_at = ?3
                 WHERE id = ?1 AND queue_name = ?2 AND lease_until IS NOT NULL"
            )),
            count: s(format!("SELECT COUNT(*) FROM {t} WHERE queue_name = ?1")),
            list: s(format!(
                "SELECT id, body, headers FROM {t} WHERE +queue_name = ?1 ORDER BY id LIMIT ?2"
            )),
            find: s(format!(
                "SELECT id, body, headers FROM {t} WHERE id = ?1 AND queue_name = ?2"
            )),
            purge: s(format!("DELETE FROM {t} WHERE queue_name = ?1")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::{AssertSqlSafe, Connection, Row};

    /// What SQLite plans to do for `sql` (bound to placeholder values).
    async fn plan(conn: &mut sqlx::SqliteConnection, sql: &str, binds: usize) -> String {
        let explain = format!("EXPLAIN QUERY PLAN {sql}");
        let mut query = sqlx::query(AssertSqlSafe(explain));
        for i in 0..binds {
            query = if i == 0 && sql.contains("json_each(?1)") {
                query.bind("[1,2]")
            } else if i == 1 || (i == 2 && sql.contains("?3 AND")) {
                query.bind("q")
            } else {
                query.bind(1_i64)
            };
        }
        query
            .fetch_all(&mut *conn)
            .await
            .expect("explain")
            .iter()
            .map(|r| r.get::<String, _>(3))
            .collect::<Vec<_>>()
            .join("; ")
    }

    #[tokio::test]
    async fn statements_by_id_use_the_primary_key_and_the_claim_uses_its_index() {
        let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
            .await
            .expect("memory db");
        let sql = Statements::new("jobs");
        for ddl in [&sql.schema.create_table, &sql.schema.create_index] {
            sqlx::query(AssertSqlSafe(ddl.to_string()))
                .execute(&mut conn)
                .await
                .expect("ddl");
        }
        for (name, stmt, binds) in [
            ("ack", &sql.ack, 2),
            ("ack_many", &sql.ack_many, 2),
            ("release", &sql.release, 3),
            ("release_many", &sql.release_many, 3),
            ("release_claimed", &sql.release_claimed, 4),
            ("keepalive", &sql.keepalive, 3),
            ("find", &sql.find, 2),
        ] {
            let p = plan(&mut conn, stmt, binds).await;
            assert!(
                p.contains("INTEGER PRIMARY KEY") && !p.contains("jobs:claim"),
                "{name} should look rows up by id: {p}"
            );
        }
        let p = plan(&mut conn, &sql.purge, 1).await;
        assert!(
            p.contains("jobs:claim (queue_name=?)"),
            "purge should find the queue's rows by the claim index: {p}"
        );
        let p = plan(&mut conn, &sql.claim, 4).await;
        assert!(
            p.contains("jobs:claim (queue_name=? AND available_at<?)")
                && !p.contains("TEMP B-TREE"),
            "the claim should range-scan its index in order: {p}"
        );
    }
}
