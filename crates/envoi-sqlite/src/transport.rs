//! [`SqliteTransport`]: the queue in a SQLite table, its constructors and
//! how its handles reach the writer task.

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use envoi_core::TransportError;
use sqlx::sqlite::SqlitePool;
use tokio::sync::{mpsc, oneshot};

use crate::config::SqliteConfig;
use crate::op::Op;
use crate::prefetch::{by_claim, Prefetched};
use crate::setup::SetupState;
use crate::signal::Signal;
use crate::sql::Statements;
use crate::writer::Writer;

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
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) queue: Arc<str>,
    pub(crate) table: String,
    pub(crate) config: SqliteConfig,
    /// The writer task's queue: sends, claims, acks, releases, keepalives.
    pub(crate) writer: mpsc::Sender<Op>,
    /// Listing and counting, which need not wait for writes.
    pub(crate) reader: SqlitePool,
    pub(crate) sql: Arc<Statements>,
    /// Raised by sends and releases of every handle on the same queue in
    /// this process.
    pub(crate) signal: Arc<Signal>,
    /// The signal's generation when a claim last came back empty.
    pub(crate) empty_at: AtomicU64,
    pub(crate) setup: SetupState,
    /// Rows claimed beyond what `get` asked for, leased to this handle.
    pub(crate) prefetched: Prefetched,
}

/// The error for `e`, met while doing `context` on `table`.
pub(crate) fn db_error<'a>(
    context: &'a str,
    table: &'a str,
) -> impl FnOnce(sqlx::Error) -> TransportError + 'a {
    move |e| {
        if matches!(e, sqlx::Error::PoolClosed) {
            return TransportError::Closed;
        }
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
pub(crate) fn ceil_ms(d: Duration) -> i64 {
    i64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(i64::MAX)
}

/// The row id of a delivery id; `None` for an id this transport never made.
pub(crate) fn parse_id(id: &str) -> Option<i64> {
    id.parse().ok()
}

impl SqliteTransport {
    /// Opens the transport called `name` from a DSN such as
    /// `sqlite://var/envoi.db?lease=30s` (see [`SqliteConfig::from_dsn`]).
    ///
    /// # Errors
    ///
    /// [`TransportError::InvalidDsn`] for a DSN it cannot use,
    /// [`TransportError::Backend`] when the database cannot be opened.
    pub async fn connect(name: &str, dsn: &str) -> Result<Self, TransportError> {
        Self::with_config(name, SqliteConfig::from_dsn(dsn)?).await
    }

    /// Opens the transport called `name` with `config`. The database file
    /// (and its directory) is created if missing; the table is created by
    /// [`setup`](envoi_core::transport::Setup::setup), or on first use with
    /// `auto_setup`.
    ///
    /// # Errors
    ///
    /// [`TransportError::InvalidDsn`] for a bad table name, lease, poll,
    /// batch size or busy timeout (checked as [`SqliteConfig::from_dsn`]
    /// checks them),
    /// [`TransportError::Backend`] when the database cannot be opened.
    pub async fn with_config(name: &str, config: SqliteConfig) -> Result<Self, TransportError> {
        config
            .check()
            .map_err(|reason| TransportError::InvalidDsn {
                dsn: format!("sqlite://{}", config.path.display()),
                reason,
            })?;
        let table = config.table_for(name);
        let connections = crate::open::open(&config).await?;
        let canonical = std::fs::canonicalize(&config.path).unwrap_or_else(|_| config.path.clone());
        let signal = Signal::shared(format!("{}\0{table}\0{name}", canonical.display()));
        let queue: Arc<str> = Arc::from(name);
        let sql = Arc::new(Statements::new(&table));
        let (tx, rx) = mpsc::channel(WRITER_QUEUE);
        tokio::spawn(
            Writer {
                conn: connections.writer,
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
                prefetched: Prefetched::new(config.lease),
                config,
                writer: tx,
                reader: connections.reader,
                empty_at: AtomicU64::new(signal.generation()),
                signal,
                setup: SetupState::default(),
            }),
        })
    }

    /// The table holding this transport's messages.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// The transport's name (the `queue_name` of its rows).
    pub fn name(&self) -> &str {
        &self.inner.queue
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &SqliteConfig {
        &self.inner.config
    }

    /// Gives back the messages claimed but not yet handed out, stops the
    /// writer task once what was queued before is written, and closes the
    /// connections. Every handle on this transport (its clones) fails with
    /// [`TransportError::Closed`] afterwards. Closing again does nothing.
    /// Dropping the last handle gives the messages back too, and stops the
    /// writer once its queue is empty.
    ///
    /// # Errors
    ///
    /// [`TransportError::Backend`] when giving the messages back failed
    /// (they come back when their lease runs out); the transport is closed
    /// all the same.
    pub async fn close(&self) -> Result<(), TransportError> {
        let inner = &*self.inner;
        let held = inner.prefetched.drain();
        let given_back = match inner.give_back(held).await {
            Err(TransportError::Closed) => Ok(()),
            other => other,
        };
        let (done, closed) = oneshot::channel();
        if inner.writer.send(Op::Close(done)).await.is_ok() {
            let _ = closed.await;
        }
        inner.reader.close().await;
        given_back
    }
}

impl fmt::Debug for SqliteTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTransport")
            .field("name", &self.inner.queue)
            .field("table", &self.inner.table)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Inner {
    /// Queues `op` for the writer and waits for its outcome.
    pub(crate) async fn write<T>(
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
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Give prefetched messages back at once rather than after the lease.
        for (claim, ids) in by_claim(self.prefetched.drain()) {
            let _ = self.writer.try_send(Op::Release {
                ids,
                now: now_ms(),
                claim: Some(claim),
                reply: None,
            });
        }
    }
}
