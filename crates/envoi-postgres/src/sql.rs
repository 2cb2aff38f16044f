//! The SQL the transport runs, built once per table.
//!
//! The table name is spliced into the statements, which is why it must pass
//! [`validate_table`](crate::config::validate_table) (a lower-case
//! identifier) first; everything else is a bind parameter. Every statement is
//! a single round trip in autocommit mode, so sqlx caches each as a prepared
//! statement per connection.

use std::sync::Arc;

/// The statements for one table; cheap to clone into queries.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    /// `CREATE TABLE IF NOT EXISTS`.
    pub(crate) create_table: Arc<str>,
    /// The claim index: `(queue_name, available_at, id)`.
    pub(crate) create_index: Arc<str>,
    /// Takes the advisory lock that serializes concurrent `setup`s (and
    /// `delete`s).
    pub(crate) setup_lock: Arc<str>,
    /// One row; `$1` queue, `$2` body, `$3` headers JSON, `$4` delay in seconds.
    pub(crate) insert: Arc<str>,
    /// Many rows through `UNNEST`; `$1` queue, `$2` bodies, `$3` headers
    /// JSON, `$4` delays in seconds. Returns the ids in input order.
    pub(crate) insert_batch: Arc<str>,
    /// Notifies the listeners of queue `$1`. A statement of its own: a
    /// transaction that notifies holds a global lock from its commit until
    /// the commit is flushed, so notifying in the `INSERT`'s transaction
    /// would serialize every sender behind one WAL flush at a time.
    pub(crate) notify: Arc<str>,
    /// Leases up to `$2` available rows of queue `$1` for `$3` seconds.
    pub(crate) claim: Arc<str>,
    /// Deletes row `$1` of queue `$2`.
    pub(crate) delete: Arc<str>,
    /// Deletes rows `$1` (an array) of queue `$2`.
    pub(crate) delete_batch: Arc<str>,
    /// Ends the lease of row `$1` of queue `$2`.
    pub(crate) release: Arc<str>,
    /// Ends the leases of rows `$1` (an array) of queue `$2`, claimed but
    /// never handed out: their delivery does not count.
    pub(crate) unclaim: Arc<str>,
    /// Renews the lease of row `$1` of queue `$2` for `$3` seconds.
    pub(crate) keepalive: Arc<str>,
    /// Rows of queue `$1`.
    pub(crate) count: Arc<str>,
    /// Up to `$2` rows of queue `$1`, oldest first.
    pub(crate) list: Arc<str>,
    /// Row `$1` of queue `$2`.
    pub(crate) find: Arc<str>,
    /// Deletes every row of queue `$1`.
    pub(crate) purge: Arc<str>,
    /// Whether the table exists.
    pub(crate) table_exists: Arc<str>,
    /// Locks the table against every other statement until the
    /// transaction ends: nothing is sent to it while `delete` decides
    /// whether to drop it.
    pub(crate) lock_table: Arc<str>,
    /// Whether the table holds any row (of any queue).
    pub(crate) any_row: Arc<str>,
    /// Drops the table, its index with it.
    pub(crate) drop_table: Arc<str>,
}

impl Statements {
    /// Builds the statements for `table`, which must be a validated
    /// identifier; the notification channel has the same name.
    pub(crate) fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        let channel = format!("'{table}'");
        Self {
            create_table: create_table(&t),
            create_index: format!(
                "CREATE INDEX IF NOT EXISTS \"{table}_queue_available_idx\" \
                 ON {t} (queue_name, available_at, id)"
            )
            .into(),
            setup_lock: "SELECT pg_advisory_xact_lock(hashtext('envoi-postgres setup ' || $1))"
                .into(),
            insert: format!(
                "INSERT INTO {t} (queue_name, body, headers, available_at) \
                 VALUES ($1, $2, $3::jsonb, now() + make_interval(secs => $4)) \
                 RETURNING id"
            )
            .into(),
            insert_batch: insert_batch(&t),
            notify: format!("SELECT pg_notify({channel}, $1)").into(),
            claim: claim(&t),
            delete: format!("DELETE FROM {t} WHERE id = $1 AND queue_name = $2").into(),
            delete_batch: delete_batch(&t),
            release: format!(
                "UPDATE {t} SET leased_until = NULL WHERE id = $1 AND queue_name = $2"
            )
            .into(),
            unclaim: format!(
                "UPDATE {t} SET leased_until = NULL, delivery_count = delivery_count - 1 \
                 WHERE id = ANY($1) AND queue_name = $2"
            )
            .into(),
            keepalive: format!(
                "UPDATE {t} SET leased_until = now() + make_interval(secs => $3) \
                 WHERE id = $1 AND queue_name = $2"
            )
            .into(),
            count: format!("SELECT count(*) FROM {t} WHERE queue_name = $1").into(),
            list: format!(
                "SELECT id, body, headers::text FROM {t} WHERE queue_name = $1 ORDER BY id LIMIT $2"
            )
            .into(),
            find: format!(
                "SELECT id, body, headers::text FROM {t} WHERE id = $1 AND queue_name = $2"
            )
            .into(),
            purge: format!("DELETE FROM {t} WHERE queue_name = $1").into(),
            table_exists: format!("SELECT to_regclass('{t}') IS NOT NULL").into(),
            lock_table: format!("LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE").into(),
            any_row: format!("SELECT EXISTS (SELECT 1 FROM {t})").into(),
            drop_table: format!("DROP TABLE IF EXISTS {t}").into(),
        }
    }
}

/// The table, `t` quoted.
fn create_table(t: &str) -> Arc<str> {
    format!(
        "CREATE TABLE IF NOT EXISTS {t} (\
            id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, \
            queue_name TEXT NOT NULL, \
            body BYTEA NOT NULL, \
            headers JSONB NOT NULL DEFAULT '{{}}', \
            created_at TIMESTAMPTZ NOT NULL DEFAULT now(), \
            available_at TIMESTAMPTZ NOT NULL DEFAULT now(), \
            leased_until TIMESTAMPTZ, \
            delivery_count INTEGER NOT NULL DEFAULT 0)"
    )
    .into()
}

/// Many rows through `UNNEST`. Identity values are drawn in row order
/// (`ORDER BY u.ord`), so sorting the returned ids restores the input
/// order.
fn insert_batch(t: &str) -> Arc<str> {
    format!(
        "WITH ins AS (\
            INSERT INTO {t} (queue_name, body, headers, available_at) \
            SELECT $1, u.body, u.headers::jsonb, now() + make_interval(secs => u.delay) \
            FROM UNNEST($2::bytea[], $3::text[], $4::float8[]) \
                WITH ORDINALITY AS u(body, headers, delay, ord) \
            ORDER BY u.ord \
            RETURNING id) \
         SELECT id FROM ins ORDER BY id"
    )
    .into()
}

/// The claim. The ids are picked with SKIP LOCKED in an uncorrelated
/// sub-select, so concurrent consumers never wait on each other nor claim
/// the same row; `FOR UPDATE` re-checks the condition on the newest row
/// version, so a row claimed (or deleted) meanwhile is skipped.
/// `id = ANY(ARRAY(sub-select))` rather than `id IN (sub-select)`: the
/// sub-select becomes an init plan run once and the update an index scan on
/// the primary key, even in the generic plan of the prepared statement,
/// where `IN` may turn into a hash semi-join over a sequential scan of the
/// table.
fn claim(t: &str) -> Arc<str> {
    format!(
        "UPDATE {t} SET \
            leased_until = now() + make_interval(secs => $3), \
            delivery_count = delivery_count + 1 \
         WHERE id = ANY(ARRAY(\
            SELECT id FROM {t} \
            WHERE queue_name = $1 \
              AND available_at <= now() \
              AND (leased_until IS NULL OR leased_until <= now()) \
            ORDER BY available_at, id \
            LIMIT $2 \
            FOR UPDATE SKIP LOCKED)) \
         RETURNING id, body, headers::text, \
            (extract(epoch FROM available_at) * 1000000)::int8, delivery_count"
    )
    .into()
}

/// Deletes a batch. `(queue_name = $2) IS TRUE` rather than
/// `queue_name = $2`: the same test, which the planner cannot answer with
/// the claim index. Without statistics (a young table: autovacuum analyzes
/// it only after a while), the generic plan of the prepared statement would
/// otherwise AND a bitmap of the primary key with one of every entry of the
/// queue in the claim index, and each acknowledged batch would walk the
/// whole queue.
fn delete_batch(t: &str) -> Arc<str> {
    format!("DELETE FROM {t} WHERE id = ANY($1) AND (queue_name = $2) IS TRUE").into()
}
