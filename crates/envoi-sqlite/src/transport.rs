//! [`SqliteTransport`]: the queue in a SQLite table.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::path::Path;
use std::pin::pin;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use envoi_core::middleware::BoxFuture;
use envoi_core::transport::{Capabilities, Delivery, RawMessage, Transport};
use envoi_core::TransportError;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Row};
use tokio::sync::{Notify, OnceCell};

use crate::options::{default_table, SqliteOptions, MAX_BATCH};

/// Rows per multi-row `INSERT` in [`Transport::send_batch`]; the remainder
/// goes through the single-row statement, so only two statements are ever
/// prepared for inserting.
const INSERT_CHUNK: usize = 64;

/// A transport storing its messages in a SQLite table.
///
/// See the [crate docs](crate) for the schema, the DSN and what it
/// guarantees. Cloning is cheap and gives another handle on the same
/// connections.
#[derive(Clone)]
pub struct SqliteTransport {
    inner: Arc<Inner>,
}

struct Inner {
    queue: String,
    table: String,
    options: SqliteOptions,
    /// One connection: SQLite has one writer, and queuing writers here is
    /// cheaper than letting them wait on each other's locks.
    writer: SqlitePool,
    /// Listing and counting, which need not wait for writes.
    reader: SqlitePool,
    sql: Statements,
    /// Woken by sends and releases of every handle on the same queue in
    /// this process.
    notify: Arc<Notify>,
    setup_done: OnceCell<()>,
    /// Rows claimed beyond what `get` asked for, leased to this handle.
    buffer: Mutex<VecDeque<Buffered>>,
}

struct Buffered {
    delivery: Delivery,
    claimed_at: Instant,
}

struct Statements {
    create_table: Arc<str>,
    create_index: Arc<str>,
    insert: Arc<str>,
    insert_chunk: Arc<str>,
    claim: Arc<str>,
    ack: Arc<str>,
    ack_many: Arc<str>,
    release: Arc<str>,
    release_many: Arc<str>,
    keepalive: Arc<str>,
    count: Arc<str>,
    list: Arc<str>,
    find: Arc<str>,
}

impl Statements {
    fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        let index = format!("\"{table}_claim\"");
        let row = "(?, ?, ?, ?, ?)";
        let rows = vec![row; INSERT_CHUNK].join(", ");
        let s = |sql: String| Arc::<str>::from(sql);
        Statements {
            create_table: s(format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    queue_name TEXT NOT NULL,
                    body BLOB NOT NULL,
                    headers TEXT NOT NULL,
                    created_at INTEGER NOT NULL,
                    available_at INTEGER NOT NULL,
                    delivered_at INTEGER,
                    lease_until INTEGER
                )"
            )),
            create_index: s(format!(
                "CREATE INDEX IF NOT EXISTS {index} ON {t} (queue_name, available_at, id)"
            )),
            insert: s(format!(
                "INSERT INTO {t} (queue_name, body, headers, created_at, available_at) VALUES {row}"
            )),
            insert_chunk: s(format!(
                "INSERT INTO {t} (queue_name, body, headers, created_at, available_at) VALUES {rows} RETURNING id"
            )),
            // ?1 now, ?2 lease end, ?3 queue, ?4 how many.
            claim: s(format!(
                "UPDATE {t} SET delivered_at = ?1, lease_until = ?2, available_at = ?2
                 WHERE id IN (
                     SELECT id FROM {t}
                     WHERE queue_name = ?3 AND available_at <= ?1
                     ORDER BY available_at, id
                     LIMIT ?4
                 )
                 RETURNING id, body, headers"
            )),
            ack: s(format!("DELETE FROM {t} WHERE id = ?1 AND queue_name = ?2")),
            ack_many: s(format!(
                "DELETE FROM {t} WHERE queue_name = ?2 AND id IN (SELECT value FROM json_each(?1))"
            )),
            release: s(format!(
                "UPDATE {t} SET available_at = ?3, lease_until = NULL, delivered_at = NULL
                 WHERE id = ?1 AND queue_name = ?2 AND lease_until IS NOT NULL"
            )),
            release_many: s(format!(
                "UPDATE {t} SET available_at = ?3, lease_until = NULL, delivered_at = NULL
                 WHERE queue_name = ?2 AND lease_until IS NOT NULL
                   AND id IN (SELECT value FROM json_each(?1))"
            )),
            keepalive: s(format!(
                "UPDATE {t} SET lease_until = ?3, available_at = ?3
                 WHERE id = ?1 AND queue_name = ?2 AND lease_until IS NOT NULL"
            )),
            count: s(format!("SELECT COUNT(*) FROM {t} WHERE queue_name = ?1")),
            list: s(format!(
                "SELECT id, body, headers FROM {t} WHERE queue_name = ?1 ORDER BY id LIMIT ?2"
            )),
            find: s(format!(
                "SELECT id, body, headers FROM {t} WHERE id = ?1 AND queue_name = ?2"
            )),
        }
    }
}

fn q(sql: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(sql))
}

fn db_error<'a>(
    context: &'a str,
    table: &'a str,
) -> impl FnOnce(sqlx::Error) -> TransportError + 'a {
    move |e| TransportError::backend(format!("{context} (SQLite table `{table}`)"), e)
}

/// Milliseconds since the Unix epoch: the clock every process sharing the
/// database agrees on.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// `d` in whole milliseconds, rounded up so a delay is never shortened.
fn ceil_ms(d: Duration) -> i64 {
    i64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(i64::MAX)
}

fn parse_id(id: &str) -> Option<i64> {
    id.parse().ok()
}

fn encode_headers(headers: &BTreeMap<String, String>) -> Result<String, TransportError> {
    if headers.is_empty() {
        return Ok("{}".to_string());
    }
    serde_json::to_string(headers).map_err(|e| TransportError::backend("encoding headers", e))
}

/// The header set on a delivery whose stored headers are not a JSON object
/// of strings (the row was written by something else). The message is still
/// handed out, so the worker can move it to the failure transport instead
/// of the row blocking the queue.
pub const INVALID_HEADERS: &str = "X-Envoi-Invalid-Headers";

fn decode_row(row: &SqliteRow) -> Result<Delivery, sqlx::Error> {
    let id: i64 = row.try_get(0)?;
    let body: Vec<u8> = row.try_get(1)?;
    let headers: &str = row.try_get(2)?;
    let headers = if headers == "{}" {
        BTreeMap::new()
    } else {
        serde_json::from_str(headers).unwrap_or_else(|e| {
            BTreeMap::from([(
                INVALID_HEADERS.to_string(),
                format!("stored headers are not a JSON object of strings: {e}"),
            )])
        })
    };
    Ok(Delivery {
        id: id.to_string(),
        raw: RawMessage { body, headers },
    })
}

/// One [`Notify`] per queue per process, so a send through one handle wakes
/// consumers waiting on another.
fn shared_notify(key: String) -> Arc<Notify> {
    static NOTIFIES: OnceLock<Mutex<HashMap<String, Weak<Notify>>>> = OnceLock::new();
    let mut map = NOTIFIES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(n) = map.get(&key).and_then(Weak::upgrade) {
        return n;
    }
    map.retain(|_, w| w.strong_count() > 0);
    let n = Arc::new(Notify::new());
    map.insert(key, Arc::downgrade(&n));
    n
}

impl SqliteTransport {
    /// Opens the transport called `name` from a DSN such as
    /// `sqlite://var/envoi.db?lease=30s` (see [`SqliteOptions::from_dsn`]).
    ///
    /// # Errors
    ///
    /// [`TransportError::InvalidDsn`] for a DSN it cannot use,
    /// [`TransportError::Backend`] when the database cannot be opened.
    pub async fn connect(name: &str, dsn: &str) -> Result<Self, TransportError> {
        Self::open(name, SqliteOptions::from_dsn(dsn)?).await
    }

    /// Opens the transport called `name` with `options`. The database file
    /// (and its directory) is created if missing; the table is created by
    /// [`setup`](Transport::setup), or on first use with `auto_setup`.
    ///
    /// # Errors
    ///
    /// [`TransportError::InvalidDsn`] for a bad table name or batch size,
    /// [`TransportError::Backend`] when the database cannot be opened.
    pub async fn open(name: &str, options: SqliteOptions) -> Result<Self, TransportError> {
        let table = match &options.table {
            Some(t) => t.clone(),
            None => default_table(name),
        };
        let invalid = |reason: String| TransportError::InvalidDsn {
            dsn: format!("sqlite://{}", options.path.display()),
            reason,
        };
        crate::options::validate_table(&table).map_err(invalid)?;
        if !(1..=MAX_BATCH).contains(&options.batch) {
            return Err(invalid(format!(
                "`batch` must be from 1 to {MAX_BATCH}, not {}",
                options.batch
            )));
        }
        if let Some(dir) = options.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                TransportError::backend(
                    format!("creating the directory of `{}`", options.path.display()),
                    e,
                )
            })?;
        }
        let connect = SqliteConnectOptions::new()
            .filename(&options.path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(options.busy_timeout);
        let opening = |e: sqlx::Error| {
            TransportError::backend(
                format!("opening SQLite database `{}`", options.path.display()),
                e,
            )
        };
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(connect.clone())
            .await
            .map_err(opening)?;
        let reader = SqlitePoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(60))
            .connect_lazy_with(connect);
        let canonical = std::fs::canonicalize(&options.path)
            .unwrap_or_else(|_| Path::new(&options.path).to_path_buf());
        let notify = shared_notify(format!("{}\0{table}\0{name}", canonical.display()));
        Ok(SqliteTransport {
            inner: Arc::new(Inner {
                queue: name.to_string(),
                sql: Statements::new(&table),
                table,
                options,
                writer,
                reader,
                notify,
                setup_done: OnceCell::new(),
                buffer: Mutex::new(VecDeque::new()),
            }),
        })
    }

    /// The table holding this transport's messages.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// The transport's name (the `queue_name` of its rows).
    pub fn queue_name(&self) -> &str {
        &self.inner.queue
    }

    /// The options it was opened with.
    pub fn options(&self) -> &SqliteOptions {
        &self.inner.options
    }

    /// Closes the connections after releasing the messages claimed but not
    /// yet handed out. Dropping the last handle does the same in the
    /// background.
    pub async fn close(&self) {
        let held = self.inner.drain_buffer();
        if !held.is_empty() {
            if let Err(e) = self.inner.release_ids(&held).await {
                tracing::warn!(table = %self.inner.table, error = %e, "releasing prefetched messages failed");
            }
        }
        self.inner.writer.close().await;
        self.inner.reader.close().await;
    }
}

impl fmt::Debug for SqliteTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTransport")
            .field("queue", &self.inner.queue)
            .field("table", &self.inner.table)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl Inner {
    fn lock_buffer(&self) -> std::sync::MutexGuard<'_, VecDeque<Buffered>> {
        self.buffer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn drain_buffer(&self) -> Vec<i64> {
        self.lock_buffer()
            .drain(..)
            .filter_map(|b| parse_id(&b.delivery.id))
            .collect()
    }

    async fn ensure_setup(&self) -> Result<(), TransportError> {
        if self.options.auto_setup {
            self.setup_done
                .get_or_try_init(|| self.create())
                .await
                .map(|_| ())
        } else {
            Ok(())
        }
    }

    async fn create(&self) -> Result<(), TransportError> {
        let mut tx = self
            .writer
            .begin()
            .await
            .map_err(db_error("starting setup", &self.table))?;
        sqlx::query(q(&self.sql.create_table))
            .execute(&mut *tx)
            .await
            .map_err(db_error("creating the table", &self.table))?;
        sqlx::query(q(&self.sql.create_index))
            .execute(&mut *tx)
            .await
            .map_err(db_error("creating the claim index", &self.table))?;
        tx.commit()
            .await
            .map_err(db_error("committing setup", &self.table))
    }

    /// Hands out up to `max` buffered deliveries, releasing those held so
    /// long that their lease may be running out.
    async fn take_buffered(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        let (out, stale) = {
            let mut buffer = self.lock_buffer();
            if buffer.is_empty() {
                return Ok(Vec::new());
            }
            let fresh_for = self.options.lease / 2;
            let mut stale = Vec::new();
            let mut out = Vec::new();
            while out.len() < max {
                let Some(b) = buffer.pop_front() else { break };
                if b.claimed_at.elapsed() < fresh_for {
                    out.push(b.delivery);
                } else if let Some(id) = parse_id(&b.delivery.id) {
                    stale.push(id);
                }
            }
            (out, stale)
        };
        if !stale.is_empty() {
            self.release_ids(&stale).await?;
        }
        Ok(out)
    }

    async fn claim(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        let take = max.max(self.options.batch).min(MAX_BATCH);
        let now = now_ms();
        let rows = sqlx::query(q(&self.sql.claim))
            .bind(now)
            .bind(now.saturating_add(ceil_ms(self.options.lease)))
            .bind(&self.queue)
            .bind(i64::try_from(take).unwrap_or(i64::MAX))
            .fetch_all(&self.writer)
            .await
            .map_err(db_error("claiming messages", &self.table))?;
        let claimed_at = Instant::now();
        let mut deliveries = Vec::with_capacity(rows.len());
        let mut ids = Vec::with_capacity(rows.len());
        for row in &rows {
            match decode_row(row) {
                Ok(d) => deliveries.push(d),
                Err(e) => {
                    // A row that does not decode cannot be handed out; give it
                    // back and report, instead of keeping it leased in silence.
                    if let Ok(id) = row.try_get::<i64, _>(0) {
                        ids.push(id);
                    }
                    tracing::error!(table = %self.table, error = %e, "a claimed row does not decode");
                }
            }
        }
        if !ids.is_empty() {
            self.release_ids(&ids).await?;
        }
        // RETURNING gives no order: hand out oldest first.
        deliveries.sort_by_key(|d| parse_id(&d.id).unwrap_or(i64::MAX));
        if deliveries.len() > max {
            let rest = deliveries.split_off(max);
            self.lock_buffer()
                .extend(rest.into_iter().map(|delivery| Buffered {
                    delivery,
                    claimed_at,
                }));
        }
        Ok(deliveries)
    }

    async fn release_ids(&self, ids: &[i64]) -> Result<(), TransportError> {
        let list =
            serde_json::to_string(ids).map_err(|e| TransportError::backend("encoding ids", e))?;
        sqlx::query(q(&self.sql.release_many))
            .bind(list)
            .bind(&self.queue)
            .bind(now_ms())
            .execute(&self.writer)
            .await
            .map_err(db_error("releasing messages", &self.table))?;
        self.notify.notify_waiters();
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let held = self.drain_buffer();
        if held.is_empty() {
            return;
        }
        // Give prefetched messages back at once rather than after the lease.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (Ok(list), writer, sql, queue, notify) = (
            serde_json::to_string(&held),
            self.writer.clone(),
            Arc::clone(&self.sql.release_many),
            self.queue.clone(),
            Arc::clone(&self.notify),
        ) else {
            return;
        };
        runtime.spawn(async move {
            let released = sqlx::query(AssertSqlSafe(sql))
                .bind(list)
                .bind(queue)
                .bind(now_ms())
                .execute(&writer)
                .await;
            if released.is_ok() {
                notify.notify_waiters();
            }
            writer.close().await;
        });
    }
}

impl Transport for SqliteTransport {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.ensure_setup().await?;
            let headers = encode_headers(&message.headers)?;
            let now = now_ms();
            let available = now.saturating_add(delay.map_or(0, ceil_ms));
            let done = sqlx::query(q(&inner.sql.insert))
                .bind(&inner.queue)
                .bind(message.body)
                .bind(headers)
                .bind(now)
                .bind(available)
                .execute(&inner.writer)
                .await
                .map_err(db_error("inserting a message", &inner.table))?;
            if available <= now {
                inner.notify.notify_waiters();
            }
            Ok(done.last_insert_rowid().to_string())
        })
    }

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
            let mut rows = Vec::with_capacity(messages.len());
            for (message, delay) in messages {
                let headers = encode_headers(&message.headers)?;
                let available = now.saturating_add(delay.map_or(0, ceil_ms));
                rows.push((message.body, headers, available));
            }
            let error = |what| db_error(what, &inner.table);
            let mut tx = inner
                .writer
                .begin()
                .await
                .map_err(error("starting a batch"))?;
            let mut ids: Vec<i64> = Vec::with_capacity(rows.len());
            let mut rows = rows.into_iter().peekable();
            let mut remaining = rows.len();
            while remaining >= INSERT_CHUNK {
                let mut query = sqlx::query(q(&inner.sql.insert_chunk));
                for (body, headers, available) in rows.by_ref().take(INSERT_CHUNK) {
                    query = query
                        .bind(&inner.queue)
                        .bind(body)
                        .bind(headers)
                        .bind(now)
                        .bind(available);
                }
                let mut chunk: Vec<i64> = query
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(error("inserting a batch"))?
                    .iter()
                    .map(|r| r.try_get::<i64, _>(0))
                    .collect::<Result<_, _>>()
                    .map_err(error("reading the ids of a batch"))?;
                // Ids grow in insertion order; RETURNING promises no order.
                chunk.sort_unstable();
                ids.extend(chunk);
                remaining -= INSERT_CHUNK;
            }
            for (body, headers, available) in rows {
                let done = sqlx::query(q(&inner.sql.insert))
                    .bind(&inner.queue)
                    .bind(body)
                    .bind(headers)
                    .bind(now)
                    .bind(available)
                    .execute(&mut *tx)
                    .await
                    .map_err(error("inserting a batch"))?;
                ids.push(done.last_insert_rowid());
            }
            tx.commit().await.map_err(error("committing a batch"))?;
            inner.notify.notify_waiters();
            Ok(ids.into_iter().map(|id| id.to_string()).collect())
        })
    }

    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            if max == 0 {
                return Ok(Vec::new());
            }
            let inner = &*self.inner;
            inner.ensure_setup().await?;
            let buffered = inner.take_buffered(max).await?;
            if !buffered.is_empty() {
                return Ok(buffered);
            }
            // Listen before looking, so a send between the claim and the
            // wait still wakes us.
            let mut notified = pin!(inner.notify.notified());
            notified.as_mut().enable();
            let claimed = inner.claim(max).await?;
            if !claimed.is_empty() || inner.options.poll.is_zero() {
                return Ok(claimed);
            }
            let _ = tokio::time::timeout(inner.options.poll, notified).await;
            inner.claim(max).await
        })
    }

    fn ack<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let row = parse_id(id).ok_or_else(|| TransportError::NotFound(id.to_string()))?;
            inner.ensure_setup().await?;
            sqlx::query(q(&inner.sql.ack))
                .bind(row)
                .bind(&inner.queue)
                .execute(&inner.writer)
                .await
                .map_err(db_error("acknowledging a message", &inner.table))?;
            Ok(())
        })
    }

    fn ack_batch<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let mut rows = Vec::with_capacity(ids.len());
            let mut unknown = None;
            for id in ids {
                match parse_id(id) {
                    Some(row) => rows.push(row),
                    None => unknown = unknown.or(Some(id)),
                }
            }
            if !rows.is_empty() {
                inner.ensure_setup().await?;
                let list = serde_json::to_string(&rows)
                    .map_err(|e| TransportError::backend("encoding ids", e))?;
                sqlx::query(q(&inner.sql.ack_many))
                    .bind(list)
                    .bind(&inner.queue)
                    .execute(&inner.writer)
                    .await
                    .map_err(db_error("acknowledging messages", &inner.table))?;
            }
            match unknown {
                Some(id) => Err(TransportError::NotFound(id.clone())),
                None => Ok(()),
            }
        })
    }

    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let row = parse_id(id).ok_or_else(|| TransportError::NotFound(id.to_string()))?;
            inner.ensure_setup().await?;
            sqlx::query(q(&inner.sql.release))
                .bind(row)
                .bind(&inner.queue)
                .bind(now_ms())
                .execute(&inner.writer)
                .await
                .map_err(db_error("releasing a message", &inner.table))?;
            inner.notify.notify_waiters();
            Ok(())
        })
    }

    fn keepalive<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let row = parse_id(id).ok_or_else(|| TransportError::NotFound(id.to_string()))?;
            inner.ensure_setup().await?;
            sqlx::query(q(&inner.sql.keepalive))
                .bind(row)
                .bind(&inner.queue)
                .bind(now_ms().saturating_add(ceil_ms(inner.options.lease)))
                .execute(&inner.writer)
                .await
                .map_err(db_error("extending a lease", &inner.table))?;
            Ok(())
        })
    }

    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.create().await?;
            let _ = inner.setup_done.set(());
            Ok(())
        })
    }

    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.ensure_setup().await?;
            let n: i64 = sqlx::query_scalar(q(&inner.sql.count))
                .bind(&inner.queue)
                .fetch_one(&inner.reader)
                .await
                .map_err(db_error("counting messages", &inner.table))?;
            Ok(u64::try_from(n).unwrap_or(0))
        })
    }

    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.ensure_setup().await?;
            let rows = sqlx::query(q(&inner.sql.list))
                .bind(&inner.queue)
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

    fn find<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let Some(row) = parse_id(id) else {
                return Ok(None);
            };
            inner.ensure_setup().await?;
            let found = sqlx::query(q(&inner.sql.find))
                .bind(row)
                .bind(&inner.queue)
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

    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }
}
