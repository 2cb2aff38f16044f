//! [`SqliteTransport`]: the queue in a SQLite table.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use envoi_core::middleware::BoxFuture;
use envoi_core::transport::{Capabilities, Delivery, RawMessage, Transport};
use envoi_core::{Headers, TransportError};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, ConnectOptions};
use tokio::sync::{mpsc, oneshot, Notify, OnceCell};

use crate::options::{default_table, SqliteOptions, MAX_BATCH, MAX_POLL};
use crate::sql::Statements;
use crate::writer::{decode_row, NewRow, Op, Writer};

/// Operations waiting for the writer before senders wait for room.
const WRITER_QUEUE: usize = 1024;

/// A transport storing its messages in a SQLite table.
///
/// See the [crate docs](crate) for the schema, the DSN and what it
/// guarantees. Cloning is cheap and gives another handle on the same
/// connections.
///
/// Each transport runs a writer task on the Tokio runtime it was opened in;
/// use it from that runtime.
#[derive(Clone)]
pub struct SqliteTransport {
    inner: Arc<Inner>,
}

struct Inner {
    queue: Arc<str>,
    table: String,
    options: SqliteOptions,
    /// The writer task's queue: sends, claims, acks, releases, keepalives.
    writer: mpsc::Sender<Op>,
    /// Listing and counting, which need not wait for writes.
    reader: SqlitePool,
    sql: Arc<Statements>,
    /// Raised by sends and releases of every handle on the same queue in
    /// this process.
    signal: Arc<Signal>,
    /// The signal's generation when a claim last came back empty.
    empty_at: AtomicU64,
    setup_done: OnceCell<()>,
    /// Rows claimed beyond what `get` asked for, leased to this handle.
    buffer: Mutex<VecDeque<Buffered>>,
}

struct Buffered {
    delivery: Delivery,
    claimed_at: Instant,
    /// The claim's time, its `delivered_at`: the row is still leased to
    /// this handle while `delivered_at` holds it (a later claim by anyone
    /// sets a later time).
    claim: i64,
}

/// Rows kept by a handle, by the claim that leased them: `(claim, ids)`.
fn by_claim(held: Vec<(i64, i64)>) -> Vec<(i64, Vec<i64>)> {
    let mut claims: Vec<(i64, Vec<i64>)> = Vec::new();
    for (id, claim) in held {
        match claims.iter_mut().find(|(c, _)| *c == claim) {
            Some((_, ids)) => ids.push(id),
            None => claims.push((claim, vec![id])),
        }
    }
    claims
}

fn q(sql: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(sql))
}

fn db_error<'a>(
    context: &'a str,
    table: &'a str,
) -> impl FnOnce(sqlx::Error) -> TransportError + 'a {
    move |e| {
        // A table that is not there, or was made before a column existed:
        // `setup` makes it, or adds the column.
        let text = e.to_string();
        let hint = if text.contains("no such table") || text.contains("no such column") {
            "; set the transport up first (`setup`, `setup-transports`)"
        } else {
            ""
        };
        TransportError::backend(format!("{context} (SQLite table `{table}`{hint})"), e)
    }
}

/// Milliseconds since the Unix epoch: the clock every process sharing the
/// database agrees on.
pub(crate) fn now_ms() -> i64 {
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

fn encode_headers(headers: &Headers) -> Result<String, TransportError> {
    if headers.is_empty() {
        return Ok("{}".to_string());
    }
    serde_json::to_string(headers).map_err(|e| TransportError::backend("encoding headers", e))
}

/// Raised when messages may have become available: a [`Notify`] for
/// waiters and a generation counter, so a wait that starts after the raise
/// (but after an empty claim) still sees it.
#[derive(Default)]
pub(crate) struct Signal {
    notify: Notify,
    generation: AtomicU64,
}

impl Signal {
    pub(crate) fn wake(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }
}

/// One [`Signal`] per queue per process, so a send through one handle wakes
/// consumers waiting on another.
fn shared_signal(key: String) -> Arc<Signal> {
    static SIGNALS: OnceLock<Mutex<HashMap<String, Weak<Signal>>>> = OnceLock::new();
    let mut map = SIGNALS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(s) = map.get(&key).and_then(Weak::upgrade) {
        return s;
    }
    map.retain(|_, w| w.strong_count() > 0);
    let s = Arc::new(Signal::default());
    map.insert(key, Arc::downgrade(&s));
    s
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
    /// [`TransportError::InvalidDsn`] for a bad table name, lease, poll,
    /// batch size or busy timeout (checked as [`SqliteOptions::from_dsn`]
    /// checks them),
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
        crate::options::validate_busy_timeout(options.busy_timeout).map_err(invalid)?;
        if options.lease < Duration::from_millis(1) {
            return Err(invalid(format!(
                "`lease` must be at least 1ms, not {:?}",
                options.lease
            )));
        }
        if options.poll > MAX_POLL {
            return Err(invalid(format!(
                "`poll` must be at most 1m, not {:?}",
                options.poll
            )));
        }
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
        // Switching a file to WAL while other connections use it can report
        // the database as locked without waiting on the busy handler: such
        // an open is retried for up to `busy_timeout`, like any busy write.
        let started = std::time::Instant::now();
        let conn: SqliteConnection = loop {
            match connect.connect().await {
                Ok(conn) => break conn,
                Err(e) if is_busy(&e) && started.elapsed() < options.busy_timeout => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(opening(e)),
            }
        };
        let reader = SqlitePoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(60))
            .connect_lazy_with(connect);
        let canonical =
            std::fs::canonicalize(&options.path).unwrap_or_else(|_| options.path.clone());
        let signal = shared_signal(format!("{}\0{table}\0{name}", canonical.display()));
        let queue: Arc<str> = Arc::from(name);
        let sql = Arc::new(Statements::new(&table));
        let (tx, rx) = mpsc::channel(WRITER_QUEUE);
        tokio::spawn(
            Writer {
                conn,
                sql: Arc::clone(&sql),
                queue: Arc::clone(&queue),
                signal: Arc::clone(&signal),
                rx,
            }
            .run(),
        );
        Ok(SqliteTransport {
            inner: Arc::new(Inner {
                queue,
                sql,
                table,
                options,
                writer: tx,
                reader,
                empty_at: AtomicU64::new(signal.generation()),
                signal,
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

    /// Gives back the messages claimed but not yet handed out, and closes
    /// the read connections. Dropping the last handle gives them back too,
    /// and stops the writer once its queue is empty.
    pub async fn close(&self) {
        let held = self.inner.drain_buffer();
        if !held.is_empty() {
            if let Err(e) = self.inner.give_back(held).await {
                tracing::warn!(table = %self.inner.table, error = %e, "releasing prefetched messages failed");
            }
        }
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

    /// Takes the kept rows out of the buffer: `(id, claim)`.
    fn drain_buffer(&self) -> Vec<(i64, i64)> {
        self.lock_buffer()
            .drain(..)
            .filter_map(|b| Some((parse_id(&b.delivery.id)?, b.claim)))
            .collect()
    }

    /// Queues `op` for the writer and waits for its outcome.
    async fn write<T>(
        &self,
        context: &str,
        op: impl FnOnce(oneshot::Sender<Result<T, sqlx::Error>>) -> Op,
    ) -> Result<T, TransportError> {
        let (reply, outcome) = oneshot::channel();
        self.writer
            .send(op(reply))
            .await
            .map_err(|_| TransportError::Closed)?;
        outcome
            .await
            .map_err(|_| TransportError::Closed)?
            .map_err(db_error(context, &self.table))
    }

    async fn ensure_setup(&self) -> Result<(), TransportError> {
        if self.options.auto_setup {
            self.setup_done
                .get_or_try_init(|| self.write("creating the table", Op::Setup))
                .await
                .map(|_| ())
        } else {
            Ok(())
        }
    }

    /// Hands out up to `max` buffered deliveries, giving back those held so
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
                    stale.push((id, b.claim));
                }
            }
            (out, stale)
        };
        if !stale.is_empty() {
            self.give_back(stale).await?;
        }
        Ok(out)
    }

    async fn claim(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        let take = max.max(self.options.batch).min(MAX_BATCH);
        let now = now_ms();
        let until = now.saturating_add(ceil_ms(self.options.lease));
        let mut deliveries = self
            .write("claiming messages", |reply| Op::Claim {
                take,
                now,
                until,
                reply,
            })
            .await?;
        if deliveries.len() > max {
            let claimed_at = Instant::now();
            let rest = deliveries.split_off(max);
            self.lock_buffer()
                .extend(rest.into_iter().map(|delivery| Buffered {
                    delivery,
                    claimed_at,
                    claim: now,
                }));
        }
        Ok(deliveries)
    }

    async fn release_ids(&self, ids: Vec<i64>) -> Result<(), TransportError> {
        let now = now_ms();
        self.write("releasing messages", |reply| Op::Release {
            ids,
            now,
            claim: None,
            reply: Some(reply),
        })
        .await
    }

    /// Gives back rows kept by this handle, `(id, claim)`, those still
    /// leased under the claim that kept them: a row whose lease ran out
    /// may have been claimed by another consumer since, and stays its.
    async fn give_back(&self, held: Vec<(i64, i64)>) -> Result<(), TransportError> {
        for (claim, ids) in by_claim(held) {
            let now = now_ms();
            self.write("releasing messages", |reply| Op::Release {
                ids,
                now,
                claim: Some(claim),
                reply: Some(reply),
            })
            .await?;
        }
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Give prefetched messages back at once rather than after the lease.
        for (claim, ids) in by_claim(self.drain_buffer()) {
            let _ = self.writer.try_send(Op::Release {
                ids,
                now: now_ms(),
                claim: Some(claim),
                reply: None,
            });
        }
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
            let now = now_ms();
            let row = NewRow {
                headers: encode_headers(&message.headers)?,
                body: message.body,
                created_at: now,
                available_at: now.saturating_add(delay.map_or(0, ceil_ms)),
            };
            let ids = inner
                .write("inserting a message", |reply| Op::Insert(vec![row], reply))
                .await?;
            ids.first()
                .map(i64::to_string)
                .ok_or_else(|| TransportError::backend("inserting a message", "no id returned"))
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
                rows.push(NewRow {
                    headers: encode_headers(&message.headers)?,
                    body: message.body,
                    created_at: now,
                    available_at: now.saturating_add(delay.map_or(0, ceil_ms)),
                });
            }
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
            let mut notified = pin!(inner.signal.notify.notified());
            notified.as_mut().enable();
            // A claim that comes back empty records the generation it saw,
            // so `wait_for_messages` knows whether anything came since.
            let generation = inner.signal.generation();
            let claimed = inner.claim(max).await?;
            if !claimed.is_empty() {
                return Ok(claimed);
            }
            if inner.options.poll.is_zero() {
                inner.empty_at.store(generation, Ordering::SeqCst);
                return Ok(claimed);
            }
            let _ = tokio::time::timeout(inner.options.poll, notified).await;
            let generation = inner.signal.generation();
            let claimed = inner.claim(max).await?;
            if claimed.is_empty() {
                inner.empty_at.store(generation, Ordering::SeqCst);
            }
            Ok(claimed)
        })
    }

    fn ack<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let row = parse_id(id).ok_or_else(|| TransportError::NotFound(id.to_string()))?;
            inner.ensure_setup().await?;
            inner
                .write("acknowledging a message", |reply| {
                    Op::Delete(vec![row], reply)
                })
                .await
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
                inner
                    .write("acknowledging messages", |reply| Op::Delete(rows, reply))
                    .await?;
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
            inner.release_ids(vec![row]).await
        })
    }

    fn keepalive<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let row = parse_id(id).ok_or_else(|| TransportError::NotFound(id.to_string()))?;
            inner.ensure_setup().await?;
            let until = now_ms().saturating_add(ceil_ms(inner.options.lease));
            inner
                .write("extending a lease", |reply| Op::Keepalive {
                    id: row,
                    until,
                    reply,
                })
                .await
        })
    }

    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.write("creating the table", Op::Setup).await?;
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

    /// Resolves at once when messages were sent or released in this process
    /// since `get` last came back empty (or are prefetched), otherwise on the
    /// next such send or release, or after `timeout` (sends from other
    /// processes are seen by polling).
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let inner = &*self.inner;
            let mut notified = pin!(inner.signal.notify.notified());
            notified.as_mut().enable();
            if !inner.lock_buffer().is_empty()
                || inner.signal.generation() != inner.empty_at.load(Ordering::SeqCst)
            {
                return;
            }
            let _ = tokio::time::timeout(timeout, notified).await;
        })
    }
}

/// Whether `e` is SQLite's "database is locked" (`SQLITE_BUSY`, any of its
/// extended codes).
fn is_busy(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .and_then(|code| code.parse::<u32>().ok())
        .is_some_and(|code| code & 0xff == 5)
}
