//! [`PostgresTransport`]: the [`Transport`] implementation.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use envoi_core::middleware::BoxFuture;
use envoi_core::transport::{Capabilities, Delivery, RawMessage, Transport, REDELIVERED_HEADER};
use envoi_core::{Headers, TransportError};
use sqlx::postgres::{PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Row};
use tokio::sync::{mpsc, oneshot};
use tokio::task::{JoinHandle, JoinSet};

use crate::config::{ConfigError, PostgresConfig};
use crate::listener::{ListenerTask, NotifierTask, Wake};
use crate::sql::Statements;

/// A `get` this large that comes back full claims the next batch at once
/// (see [`Ahead`]); smaller ones never do.
const CLAIM_AHEAD_MIN: usize = 100;
/// Most rows one grouped `INSERT` stores.
const GROUP_ROWS: usize = 1000;
/// Sends that must be waiting before a second grouped `INSERT` starts
/// while one runs.
const JOIN_ROWS: usize = 16;
/// Most body bytes one grouped `INSERT` carries (a bigger group is split).
const GROUP_BYTES: usize = 8 * 1024 * 1024;

/// The header a delivery gets, holding the stored text, when the stored
/// headers are not a JSON object (a row written by hand, for instance): the
/// message is still handed out, with
/// [`envoi_core::serializer::INVALID_HEADERS_HEADER`] saying what is wrong,
/// so that it does not decode and the worker parks it with the reason.
pub const INVALID_HEADERS_HEADER: &str = "X-Envoi-Postgres-Invalid-Headers";

/// A message that PostgreSQL cannot store as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// A header key or value contains a NUL character (`jsonb` cannot hold it).
    #[error("header `{key}` contains a NUL character, which PostgreSQL text cannot hold")]
    NulInHeader {
        /// The header's key (NULs shown as `\0`).
        key: String,
    },
}

/// A transport storing messages in a PostgreSQL table.
///
/// Every queue (transport name) is a set of rows in a shared table
/// (`envoi_messages` unless the DSN says `table=`), so one table can serve
/// many transports. Cloning is cheap and gives another handle on the same
/// pool and listener.
///
/// # Delivery
///
/// [`get`](Transport::get) leases a batch with one statement,
/// `UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED LIMIT n) RETURNING …`:
/// concurrent consumers never block each other nor receive the same row. A
/// leased message is invisible until its lease (`lease=`, 300 s by default)
/// passes, then handed out again, so a consumer that dies loses nothing.
/// [`keepalive`](Transport::keepalive) renews the lease;
/// [`ack`](Transport::ack) and [`reject`](Transport::reject) delete the row;
/// [`release`](Transport::release) ends the lease at once.
///
/// # Sending
///
/// Concurrent [`send`](Transport::send)s are grouped: a background writer
/// of the transport value takes every send waiting for it and stores them
/// with one multi-row `INSERT` (up to 1,000 rows), with a few such
/// statements in flight at once. Each `send` returns once the statement
/// holding its row has committed, so an acknowledged send is as durable as
/// a single-row insert, and a lone send is not delayed: the writer starts a
/// statement as soon as there is a send and room for one. Should a grouped
/// statement fail for a reason other than a lost connection, its rows are
/// stored one by one, so only the message at fault fails.
///
/// # Claiming ahead
///
/// A consumer fetches, handles and acknowledges a batch before it fetches
/// the next. When a `get` of at least 100 messages comes back full, the
/// claim of the next batch starts at once, so it runs while the caller
/// handles this one; the next `get` hands it out (a smaller one keeps the
/// rest for the following `get`s). Rows claimed ahead are leased like the
/// ones handed out; they are given back (their lease ended) when they have
/// waited for a `get` longer than half a lease, and by
/// [`close`](PostgresTransport::close) or dropping the last handle, unless
/// their lease has run out by then: another consumer may hold them.
///
/// # Waking consumers
///
/// After a send commits, a background task of the transport runs `NOTIFY`
/// (coalesced: one notification however many sends completed while the
/// previous one was on its way). One listener connection per transport value
/// (shared by all its consumers and clones, opened by the first `get`) turns
/// notifications for this queue into wake-ups. An empty `get` waits up to
/// `wait=` (250 ms; `0` returns at once) for one;
/// [`wait_for_messages`](Transport::wait_for_messages) waits up to `poll=`
/// (500 ms). Notifications missed while the listener reconnects, delays that
/// come due and leases that expire are caught by that polling.
///
/// # Connection loss
///
/// A statement that fails because its connection was lost (killed by
/// `pg_terminate_backend`, a restart, a network cut) is retried on a fresh
/// connection, a few times within `acquire_timeout`. A retried `send` whose
/// first attempt committed just before the connection dropped stores the
/// message twice: delivery is at least once.
#[derive(Clone)]
pub struct PostgresTransport {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    config: PostgresConfig,
    pool: PgPool,
    listener_pool: Option<PgPool>,
    sql: Statements,
    wake: Arc<Wake>,
    listener: OnceLock<AbortOnDrop>,
    /// Signals the notifier task that messages became available.
    notify_signal: Arc<tokio::sync::Notify>,
    notifier: OnceLock<AbortOnDrop>,
    /// The writer grouping concurrent sends, started by the first send.
    writer: OnceLock<Writer>,
    /// Rows claimed ahead of the next `get`.
    ahead: Mutex<Ahead>,
    /// The wake generation when the latest claim started.
    claimed_generation: AtomicU64,
    lease_secs: f64,
    max_retries: u32,
}

/// Aborts the listener task when the transport is dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl fmt::Debug for PostgresTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresTransport")
            .field("name", &self.inner.name)
            .field("config", &self.inner.config)
            .finish()
    }
}

impl PostgresTransport {
    /// The transport called `name` described by `dsn` (see
    /// [`PostgresConfig::from_dsn`]). Connects lazily: nothing is opened
    /// before the first operation. Must be called within a Tokio runtime.
    ///
    /// ```no_run
    /// use envoi_core::transport::Transport;
    /// use envoi_postgres::PostgresTransport;
    ///
    /// # async fn run() -> Result<(), envoi_core::TransportError> {
    /// let orders = PostgresTransport::from_dsn(
    ///     "orders",
    ///     "postgres://app@127.0.0.1:5432/shop?lease=60s",
    /// )?;
    /// orders.setup().await?;
    /// # Ok(()) }
    /// ```
    pub fn from_dsn(name: impl Into<String>, dsn: &str) -> Result<Self, TransportError> {
        Self::new(name, PostgresConfig::from_dsn(dsn)?)
    }

    /// The transport called `name` with `config`, on a pool of its own.
    /// Connects lazily. Must be called within a Tokio runtime.
    pub fn new(name: impl Into<String>, config: PostgresConfig) -> Result<Self, TransportError> {
        require_runtime()?;
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(config.acquire_timeout)
            // A dead connection is noticed by the statement that uses it and
            // the statement retried; pinging before every use would cost a
            // round trip per operation.
            .test_before_acquire(false)
            .connect_lazy_with(config.connect.clone());
        Self::with_pool(name, pool, config)
    }

    /// The transport called `name` on an existing `pool` (shared with the
    /// application, for instance). `config.connect` is used only by the
    /// listener connection, which is never taken from `pool`. Must be called
    /// within a Tokio runtime.
    pub fn with_pool(
        name: impl Into<String>,
        pool: PgPool,
        config: PostgresConfig,
    ) -> Result<Self, TransportError> {
        require_runtime()?;
        let name = name.into();
        let invalid = |e: ConfigError| TransportError::backend("invalid postgres transport", e);
        // Also checks the table name, which is spliced into the SQL.
        config.validate().map_err(invalid)?;
        if name.is_empty() || name.contains('\0') {
            return Err(invalid(ConfigError::InvalidName(name)));
        }
        let listener_pool = config.listen.then(|| {
            PgPoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .acquire_timeout(config.acquire_timeout)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_lazy_with(config.connect.clone())
        });
        let max_retries = pool.options().get_max_connections().saturating_add(2);
        Ok(Self {
            inner: Arc::new(Inner {
                sql: Statements::new(&config.table),
                lease_secs: config.lease.as_secs_f64(),
                name,
                config,
                pool,
                listener_pool,
                wake: Arc::new(Wake::new()),
                listener: OnceLock::new(),
                notify_signal: Arc::new(tokio::sync::Notify::new()),
                notifier: OnceLock::new(),
                writer: OnceLock::new(),
                ahead: Mutex::new(Ahead::default()),
                claimed_generation: AtomicU64::new(0),
                max_retries,
            }),
        })
    }

    /// The transport's name (the `queue_name` of its rows).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Its configuration.
    pub fn config(&self) -> &PostgresConfig {
        &self.inner.config
    }

    /// The pool its statements run on.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// Deletes every message of this transport, leased ones included;
    /// returns how many.
    pub async fn purge(&self) -> Result<u64, TransportError> {
        let inner = &*self.inner;
        // What was claimed ahead is about to be deleted.
        let _ = inner.take_ahead_rows().await;
        inner
            .retrying("purging messages", || {
                sqlx::query(AssertSqlSafe(inner.sql.purge.clone()))
                    .bind(inner.name.as_str())
                    .execute(&inner.pool)
            })
            .await
            .map(|r| r.rows_affected())
    }

    /// Gives back the rows claimed ahead of the next `get`, stops the
    /// listener and closes the connections, waiting for them to finish. Every handle on this transport fails with
    /// [`TransportError::Closed`] afterwards.
    pub async fn close(&self) {
        let ahead = self.inner.take_ahead_rows().await;
        self.inner.unclaim(ahead).await;
        for task in [
            self.inner.listener.get(),
            self.inner.notifier.get(),
            self.inner.writer.get().map(|w| &w.task),
        ]
        .into_iter()
        .flatten()
        {
            task.0.abort();
        }
        self.inner.pool.close().await;
        if let Some(pool) = &self.inner.listener_pool {
            pool.close().await;
        }
    }
}

fn require_runtime() -> Result<(), TransportError> {
    tokio::runtime::Handle::try_current()
        .map(|_| ())
        .map_err(|e| TransportError::backend("the postgres transport needs a Tokio runtime", e))
}

/// Whether `error` means the connection is gone (so a retry on another
/// connection may succeed), as opposed to a problem with the statement.
pub(crate) fn is_connection_error(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
        // Class 08: connection exception; 57P01-57P05: the server is
        // terminating the session (pg_terminate_backend, shutdown, restart).
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|code| code.starts_with("08") || code.starts_with("57P")),
        _ => false,
    }
}

fn parse_id(id: &str) -> Option<i64> {
    id.parse::<i64>().ok().filter(|id| *id > 0)
}

fn delay_secs(delay: Option<Duration>) -> f64 {
    delay.map_or(0.0, |d| d.as_secs_f64())
}

fn decode_headers(text: &str) -> Headers {
    if let Ok(headers) = serde_json::from_str::<Headers>(text) {
        return headers;
    }
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        _ => Headers::from([
            (INVALID_HEADERS_HEADER, text.to_string()),
            (
                envoi_core::serializer::INVALID_HEADERS_HEADER,
                format!("the stored headers are not a JSON object: {text}"),
            ),
        ]),
    }
}

/// A row as a delivery. A row whose body or headers are NULL (a table
/// whose constraints were changed, written by hand) is still handed out,
/// marked so that it does not decode, rather than failing the whole claim
/// and holding up every row claimed with it.
fn row_to_delivery(row: &PgRow) -> Result<Delivery, sqlx::Error> {
    let id: i64 = row.try_get(0)?;
    let body: Option<Vec<u8>> = row.try_get(1)?;
    let headers: Option<String> = row.try_get(2)?;
    let mut headers = headers.as_deref().map(decode_headers).unwrap_or_else(|| {
        Headers::from([(
            envoi_core::serializer::INVALID_HEADERS_HEADER,
            "the stored headers are NULL",
        )])
    });
    if body.is_none() {
        headers.insert(
            envoi_core::serializer::INVALID_BODY_HEADER,
            "the stored body is NULL",
        );
    }
    // The mark is the transport's to set, from the row's delivery count,
    // not a stored header's (envoi never stores it).
    headers.remove(REDELIVERED_HEADER);
    Ok(Delivery {
        id: id.to_string(),
        raw: RawMessage {
            body: body.unwrap_or_default(),
            headers,
        },
    })
}

/// A claim running in the background.
type Claim = JoinHandle<Result<Vec<Delivery>, TransportError>>;

/// Rows claimed ahead of the next `get` (see "Claiming ahead" on
/// [`PostgresTransport`]).
#[derive(Default)]
struct Ahead {
    /// The claim in flight, and when it started.
    claiming: Option<(Claim, Instant)>,
    /// Claimed and not handed out yet.
    spare: VecDeque<Delivery>,
    /// When the claim that gave `spare` started.
    claimed_at: Option<Instant>,
}

impl Ahead {
    /// Everything claimed ahead and not handed out whose lease has not run
    /// out, waiting for a claim in flight. Past its lease, a row may be
    /// someone else's by now, and giving it back would end that consumer's
    /// lease; it is left alone.
    async fn into_fresh_rows(self, lease: Duration) -> Vec<Delivery> {
        let mut rows: Vec<Delivery> = match self.claimed_at {
            Some(at) if at.elapsed() >= lease => Vec::new(),
            _ => self.spare.into(),
        };
        if let Some((claiming, started)) = self.claiming {
            if let Ok(Ok(claimed)) = claiming.await {
                if started.elapsed() < lease {
                    rows.extend(claimed);
                }
            }
        }
        rows
    }
}

/// A claim ahead a `get` is waiting for: put back when that `get` is
/// dropped before it finished (joined with the claim another `get` of the
/// handle started meanwhile, if any).
struct PendingClaim<'a> {
    inner: &'a Inner,
    claiming: Option<(Claim, Instant)>,
}

impl Drop for PendingClaim<'_> {
    fn drop(&mut self) {
        let Some((mine, started)) = self.claiming.take() else {
            return;
        };
        let mut ahead = self.inner.ahead();
        match ahead.claiming.take() {
            None => ahead.claiming = Some((mine, started)),
            Some((theirs, at)) => {
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    ahead.claiming = Some((theirs, at));
                    return;
                };
                let joined = runtime.spawn(async move {
                    let mut rows = Vec::new();
                    for claim in [mine, theirs] {
                        if let Ok(Ok(claimed)) = claim.await {
                            rows.extend(claimed);
                        }
                    }
                    Ok(rows)
                });
                ahead.claiming = Some((joined, started.min(at)));
            }
        }
    }
}

impl Drop for Inner {
    /// Gives back what was claimed ahead and not handed out, rather than
    /// leave it leased until its lease ends.
    fn drop(&mut self) {
        let ahead = std::mem::take(self.ahead.get_mut().unwrap_or_else(PoisonError::into_inner));
        if ahead.claiming.is_none() && ahead.spare.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (pool, sql, name, lease) = (
            self.pool.clone(),
            Arc::clone(&self.sql.unclaim),
            self.name.clone(),
            self.config.lease,
        );
        runtime.spawn(async move {
            let rows = ahead.into_fresh_rows(lease).await;
            let ids: Vec<i64> = rows.iter().filter_map(|d| parse_id(&d.id)).collect();
            if ids.is_empty() {
                return;
            }
            let given_back = sqlx::query(AssertSqlSafe(sql))
                .bind(&ids)
                .bind(name.as_str())
                .execute(&pool)
                .await;
            if let Err(error) = given_back {
                tracing::debug!(%error, "postgres: could not give back rows claimed ahead; they wait for their lease to end");
            }
        });
    }
}

/// A send waiting for the writer.
struct PendingSend {
    body: Vec<u8>,
    headers: String,
    delay: f64,
    reply: oneshot::Sender<Result<i64, TransportError>>,
}

/// The writer of one transport value: a task storing the sends queued on
/// `queue`, grouped.
struct Writer {
    queue: mpsc::UnboundedSender<PendingSend>,
    task: AbortOnDrop,
}

impl Writer {
    /// Grouped statements in flight at once.
    fn parallelism(inner: &Inner) -> usize {
        let connections = inner.pool.options().get_max_connections() as usize;
        (connections / 4).clamp(1, 2)
    }

    fn start(inner: &Arc<Inner>) -> Self {
        let (queue, pending) = mpsc::unbounded_channel();
        let parallel = Self::parallelism(inner);
        let task = tokio::spawn(Self::run(Arc::downgrade(inner), pending, parallel));
        Self {
            queue,
            task: AbortOnDrop(task),
        }
    }

    /// Collects the queued sends and stores them, grouped, until the
    /// transport is gone. A statement starts at once when none runs; another
    /// one joins it (up to `parallel`) only once [`JOIN_ROWS`] sends wait, so
    /// that groups stay large rather than splitting the waiting sends into
    /// many small statements. Holds the transport only while a statement
    /// runs, so dropping the last handle ends the task.
    async fn run(
        inner: Weak<Inner>,
        mut pending: mpsc::UnboundedReceiver<PendingSend>,
        parallel: usize,
    ) {
        let mut running = JoinSet::new();
        let mut group = Vec::new();
        let mut open = true;
        while open || !group.is_empty() || !running.is_empty() {
            let start = !group.is_empty()
                && (running.is_empty() || (running.len() < parallel && group.len() >= JOIN_ROWS));
            if start {
                // Let the senders that are ready now queue too: one
                // statement for them rather than one for the first alone.
                tokio::task::yield_now().await;
                while group.len() < GROUP_ROWS {
                    match pending.try_recv() {
                        Ok(send) => group.push(send),
                        Err(_) => break,
                    }
                }
                let Some(inner) = inner.upgrade() else {
                    // Gone: dropping the group tells its senders.
                    break;
                };
                let group = std::mem::take(&mut group);
                running.spawn(async move { inner.write_group(group).await });
                continue;
            }
            let room = GROUP_ROWS - group.len();
            tokio::select! {
                biased;
                Some(_) = running.join_next(), if !running.is_empty() => {}
                taken = pending.recv_many(&mut group, room), if open && room > 0 => {
                    if taken == 0 {
                        open = false;
                    }
                }
            }
        }
    }
}

impl Inner {
    fn error(&self, what: &str, error: sqlx::Error) -> TransportError {
        match error {
            sqlx::Error::PoolClosed => TransportError::Closed,
            error => {
                // No such table (42P01), or a column it lacks (42703):
                // `setup` makes it.
                let code = error
                    .as_database_error()
                    .and_then(|e| e.code().map(|c| c.into_owned()));
                let hint = match code.as_deref() {
                    Some("42P01" | "42703") => {
                        "; set the transport up first (`setup`, `setup-transports`)"
                    }
                    _ => "",
                };
                TransportError::backend(
                    format!(
                        "postgres: {what} (transport `{}`, table `{}`{hint})",
                        self.name, self.config.table
                    ),
                    error,
                )
            }
        }
    }

    /// Runs `op`, again on another connection when it failed because its
    /// connection was lost.
    async fn retrying<T, F, Fut>(&self, what: &str, op: F) -> Result<T, TransportError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        match self.retrying_raw(op).await {
            Ok(value) => Ok(value),
            Err(sqlx::Error::PoolTimedOut) => Err(self.pool_timed_out(what).await),
            Err(error) => Err(self.error(what, error)),
        }
    }

    /// The error of an operation that got no pooled connection in time. The
    /// pool reports a server it cannot reach (refused, wrong port) only as
    /// a timeout: one direct attempt tells the cause.
    #[cold]
    async fn pool_timed_out(&self, what: &str) -> TransportError {
        use sqlx::Connection;
        let attempt = tokio::time::timeout(
            Duration::from_secs(5),
            sqlx::PgConnection::connect_with(&self.config.connect),
        )
        .await;
        match attempt {
            Ok(Err(cause)) => self.error(
                &format!(
                    "{what}: no connection within {:?}",
                    self.config.acquire_timeout
                ),
                cause,
            ),
            Ok(Ok(connection)) => {
                // The server answers: the pool was only busy.
                let _ = connection.close().await;
                self.error(what, sqlx::Error::PoolTimedOut)
            }
            Err(_) => self.error(what, sqlx::Error::PoolTimedOut),
        }
    }

    /// [`retrying`](Self::retrying), keeping the last error as it is.
    async fn retrying_raw<T, F, Fut>(&self, mut op: F) -> Result<T, sqlx::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let started = Instant::now();
        let mut attempt = 0u32;
        loop {
            match op().await {
                Ok(value) => return Ok(value),
                Err(error)
                    if is_connection_error(&error)
                        && attempt < self.max_retries
                        && started.elapsed() < self.config.acquire_timeout =>
                {
                    attempt += 1;
                    tracing::debug!(%error, attempt, transport = %self.name, "postgres: connection lost, retrying");
                    // The first retries are immediate: each takes another
                    // pooled connection, and a killed pool has several dead ones.
                    if attempt > 2 {
                        let pause = Duration::from_millis(20 * u64::from(attempt));
                        tokio::time::sleep(pause.min(Duration::from_millis(500))).await;
                    }
                }
                Err(error) => return Err(error),
            }
        }
    }

    fn ensure_listener(&self) {
        let Some(pool) = &self.listener_pool else {
            return;
        };
        self.listener.get_or_init(|| {
            let task = ListenerTask {
                pool: pool.clone(),
                channel: self.config.table.clone(),
                queue: self.name.clone(),
                wake: Arc::clone(&self.wake),
            };
            AbortOnDrop(tokio::spawn(task.run()))
        });
    }

    /// Wakes this transport's consumers at once and, through the notifier
    /// task, everyone listening for this queue.
    fn notify_consumers(&self) {
        self.wake.wake();
        self.notifier.get_or_init(|| {
            let task = NotifierTask {
                pool: self.pool.clone(),
                sql: Arc::clone(&self.sql.notify),
                queue: self.name.clone(),
                signal: Arc::clone(&self.notify_signal),
            };
            AbortOnDrop(tokio::spawn(task.run()))
        });
        self.notify_signal.notify_one();
    }

    fn encode_headers(&self, headers: &Headers) -> Result<String, TransportError> {
        if let Some((key, _)) = headers
            .iter()
            .find(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(TransportError::backend(
                format!(
                    "postgres: cannot store a message of transport `{}`",
                    self.name
                ),
                MessageError::NulInHeader {
                    key: key.replace('\0', "\\0"),
                },
            ));
        }
        serde_json::to_string(headers)
            .map_err(|e| TransportError::backend("postgres: encoding headers", e))
    }

    fn check_size(&self, message: &RawMessage) -> Result<(), TransportError> {
        if message.body.len() > self.config.max_body {
            return Err(TransportError::TooLarge {
                size: message.body.len(),
                limit: self.config.max_body,
            });
        }
        Ok(())
    }

    /// Sends one message through the writer, which groups it with the
    /// sends waiting at the same time; returns once its row is committed.
    async fn send(
        self: &Arc<Self>,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> Result<String, TransportError> {
        self.check_size(&message)?;
        let headers = self.encode_headers(&message.headers)?;
        let (reply, stored) = oneshot::channel();
        let pending = PendingSend {
            body: message.body,
            headers,
            delay: delay_secs(delay),
            reply,
        };
        let writer = self.writer.get_or_init(|| Writer::start(self));
        if writer.queue.send(pending).is_err() {
            return Err(TransportError::Closed);
        }
        match stored.await {
            Ok(Ok(id)) => Ok(id.to_string()),
            Ok(Err(error)) => Err(error),
            // The writer stopped: the transport was closed.
            Err(_) => Err(TransportError::Closed),
        }
    }

    /// Stores one message with a single-row `INSERT`.
    async fn insert_one(
        &self,
        body: &[u8],
        headers: &str,
        delay: f64,
    ) -> Result<i64, TransportError> {
        self.retrying("sending a message", || {
            sqlx::query_scalar(AssertSqlSafe(self.sql.insert.clone()))
                .bind(self.name.as_str())
                .bind(body)
                .bind(headers)
                .bind(delay)
                .fetch_one(&self.pool)
        })
        .await
    }

    /// Stores `group` (sends taken by the writer) and answers each: with one
    /// multi-row `INSERT` per [`GROUP_BYTES`] of bodies, or row by row when
    /// a grouped statement fails for another reason than a lost connection.
    async fn write_group(&self, group: Vec<PendingSend>) {
        let mut rest = group.as_slice();
        let mut replies: Vec<Result<i64, TransportError>> = Vec::with_capacity(group.len());
        while !rest.is_empty() {
            let mut bytes = 0;
            let take = rest
                .iter()
                .position(|p| {
                    bytes += p.body.len();
                    bytes > GROUP_BYTES
                })
                .map_or(rest.len(), |n| n.max(1));
            let (chunk, after) = rest.split_at(take);
            rest = after;
            if chunk.len() == 1 {
                let p = &chunk[0];
                replies.push(self.insert_one(&p.body, &p.headers, p.delay).await);
                continue;
            }
            let bodies: Vec<&[u8]> = chunk.iter().map(|p| p.body.as_slice()).collect();
            let headers: Vec<&str> = chunk.iter().map(|p| p.headers.as_str()).collect();
            let delays: Vec<f64> = chunk.iter().map(|p| p.delay).collect();
            let stored = self
                .retrying_raw(|| {
                    sqlx::query_scalar::<_, i64>(AssertSqlSafe(self.sql.insert_batch.clone()))
                        .bind(self.name.as_str())
                        .bind(&bodies)
                        .bind(&headers)
                        .bind(&delays)
                        .fetch_all(&self.pool)
                })
                .await;
            match stored {
                Ok(ids) if ids.len() == chunk.len() => replies.extend(ids.into_iter().map(Ok)),
                Ok(ids) => {
                    // Cannot happen (one row per element); never guess which
                    // message got which id.
                    for _ in chunk {
                        replies.push(Err(TransportError::backend(
                            "postgres: sending a message",
                            format!(
                                "a grouped insert stored {} rows for {}",
                                ids.len(),
                                chunk.len()
                            ),
                        )));
                    }
                }
                Err(sqlx::Error::PoolClosed) => {
                    replies.extend(chunk.iter().map(|_| Err(TransportError::Closed)));
                }
                Err(error) if is_connection_error(&error) => {
                    let error = error.to_string();
                    for _ in chunk {
                        replies.push(Err(TransportError::backend(
                            format!(
                                "postgres: sending a message (transport `{}`, table `{}`)",
                                self.name, self.config.table
                            ),
                            error.clone(),
                        )));
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, rows = chunk.len(), transport = %self.name, "postgres: grouped insert failed; storing its rows one by one");
                    for p in chunk {
                        replies.push(self.insert_one(&p.body, &p.headers, p.delay).await);
                    }
                }
            }
        }
        if group
            .iter()
            .zip(&replies)
            .any(|(p, r)| r.is_ok() && p.delay <= 0.0)
        {
            self.notify_consumers();
        }
        for (pending, reply) in group.into_iter().zip(replies) {
            // A sender that went away meanwhile no longer waits for the answer.
            let _ = pending.reply.send(reply);
        }
    }

    async fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> Result<Vec<String>, TransportError> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let mut bodies = Vec::with_capacity(messages.len());
        let mut headers = Vec::with_capacity(messages.len());
        let mut delays = Vec::with_capacity(messages.len());
        for (message, delay) in messages {
            self.check_size(&message)?;
            headers.push(self.encode_headers(&message.headers)?);
            bodies.push(message.body);
            delays.push(delay_secs(delay));
        }
        let ids: Vec<i64> = self
            .retrying("sending a batch", || {
                sqlx::query_scalar(AssertSqlSafe(self.sql.insert_batch.clone()))
                    .bind(self.name.as_str())
                    .bind(&bodies)
                    .bind(&headers)
                    .bind(&delays)
                    .fetch_all(&self.pool)
            })
            .await?;
        if ids.len() != bodies.len() {
            return Err(TransportError::backend(
                "postgres: sending a batch",
                format!("stored {} rows for {} messages", ids.len(), bodies.len()),
            ));
        }
        if delays.iter().any(|d| *d <= 0.0) {
            self.notify_consumers();
        }
        Ok(ids.into_iter().map(|id| id.to_string()).collect())
    }

    /// One claim statement: leases up to `limit` available messages, in
    /// queue order.
    async fn claim(&self, limit: i64) -> Result<Vec<Delivery>, TransportError> {
        let rows = self
            .retrying("claiming messages", || {
                sqlx::query(AssertSqlSafe(self.sql.claim.clone()))
                    .bind(self.name.as_str())
                    .bind(limit)
                    .bind(self.lease_secs)
                    .fetch_all(&self.pool)
            })
            .await?;
        // RETURNING does not keep the sub-select's order: sort by
        // (available_at, id) again.
        let mut keyed = Vec::with_capacity(rows.len());
        for row in &rows {
            let at: i64 = row
                .try_get(3)
                .map_err(|e| self.error("reading claimed messages", e))?;
            let mut delivery =
                row_to_delivery(row).map_err(|e| self.error("reading claimed messages", e))?;
            // Claimed before and not acknowledged: its lease ran out, or it
            // was released.
            if row.try_get::<i32, _>(4).is_ok_and(|count| count > 1) {
                delivery = delivery.redelivered();
            }
            let id: i64 = row
                .try_get(0)
                .map_err(|e| self.error("reading claimed messages", e))?;
            keyed.push(((at, id), delivery));
        }
        keyed.sort_by_key(|(key, _)| *key);
        Ok(keyed.into_iter().map(|(_, d)| d).collect())
    }

    async fn get(self: &Arc<Self>, max: usize) -> Result<Vec<Delivery>, TransportError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let want = max.min(self.config.batch);
        let limit = i64::try_from(want).unwrap_or(i64::MAX);
        self.ensure_listener();
        let ahead = self.take_ahead(want).await?;
        if !ahead.is_empty() {
            self.claim_ahead(want, ahead.len());
            return Ok(ahead);
        }
        let deadline = Instant::now() + self.config.wait;
        loop {
            // Subscribe before claiming: a wake that arrives while the claim
            // runs makes the wait below return at once.
            let mut wakes = self.wake.subscribe();
            self.claimed_generation
                .store(*wakes.borrow_and_update(), Ordering::Relaxed);
            let got = self.claim(limit).await?;
            if !got.is_empty() {
                self.claim_ahead(want, got.len());
                return Ok(got);
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Ok(got);
            }
            match tokio::time::timeout(remaining, wakes.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) | Err(_) => return Ok(got),
            }
        }
    }

    fn ahead(&self) -> MutexGuard<'_, Ahead> {
        self.ahead.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Up to `want` rows claimed ahead, waiting for a claim in flight. Rows
    /// that waited longer than half a lease are given back instead.
    async fn take_ahead(&self, want: usize) -> Result<Vec<Delivery>, TransportError> {
        let claiming = self.ahead().claiming.take();
        if let Some(claiming) = claiming {
            // Should this `get` be dropped while the claim runs, the guard
            // puts the claim back, so that the next `get` hands its rows
            // out (or `close` or the drop gives them back) rather than
            // leave them leased until the lease ends.
            let mut waiting = PendingClaim {
                inner: self,
                claiming: Some(claiming),
            };
            let (claimed, started) = match waiting.claiming.as_mut() {
                Some((claiming, started)) => (claiming.await, *started),
                None => return Ok(Vec::new()),
            };
            waiting.claiming = None;
            // An aborted claim (the transport is closing) leaves nothing.
            if let Ok(claimed) = claimed {
                let claimed = claimed?;
                let mut ahead = self.ahead();
                ahead.spare.extend(claimed);
                ahead.claimed_at = Some(started);
            }
        }
        let (taken, stale) = {
            let mut ahead = self.ahead();
            let lease = self.config.lease;
            match ahead.claimed_at.map(|at| at.elapsed()) {
                Some(age) if age > lease / 2 && !ahead.spare.is_empty() => {
                    let stale: Vec<Delivery> = ahead.spare.drain(..).collect();
                    // Past its lease, a row may be someone else's by now.
                    (Vec::new(), if age < lease { stale } else { Vec::new() })
                }
                _ => {
                    let n = want.min(ahead.spare.len());
                    (ahead.spare.drain(..n).collect(), Vec::new())
                }
            }
        };
        self.unclaim(stale).await;
        Ok(taken)
    }

    /// Everything claimed ahead and not handed out whose lease has not run
    /// out (past it, a row may be another consumer's), waiting for a claim
    /// in flight.
    async fn take_ahead_rows(&self) -> Vec<Delivery> {
        let ahead = std::mem::take(&mut *self.ahead());
        ahead.into_fresh_rows(self.config.lease).await
    }

    /// Ends the leases of `rows`, claimed but never handed out.
    async fn unclaim(&self, rows: Vec<Delivery>) {
        let ids: Vec<i64> = rows.iter().filter_map(|d| parse_id(&d.id)).collect();
        if ids.is_empty() {
            return;
        }
        let given_back = self
            .retrying("giving back rows claimed ahead", || {
                sqlx::query(AssertSqlSafe(self.sql.unclaim.clone()))
                    .bind(&ids)
                    .bind(self.name.as_str())
                    .execute(&self.pool)
            })
            .await;
        match given_back {
            Ok(_) => self.notify_consumers(),
            Err(error) => {
                tracing::debug!(%error, "postgres: rows claimed ahead wait for their lease to end")
            }
        }
    }

    /// After a `get` of `want` (at least [`CLAIM_AHEAD_MIN`]) that handed out
    /// `got == want` rows, claims the next `want` in the background.
    fn claim_ahead(self: &Arc<Self>, want: usize, got: usize) {
        if want < CLAIM_AHEAD_MIN || got < want {
            return;
        }
        let mut ahead = self.ahead();
        if ahead.claiming.is_some() || !ahead.spare.is_empty() {
            return;
        }
        let inner = Arc::clone(self);
        let limit = i64::try_from(want).unwrap_or(i64::MAX);
        let started = Instant::now();
        let claiming = tokio::spawn(async move { inner.claim(limit).await });
        ahead.claiming = Some((claiming, started));
    }

    async fn wait_for_messages(&self, timeout: Duration) {
        self.ensure_listener();
        let mut wakes = self.wake.subscribe();
        if *wakes.borrow_and_update() != self.claimed_generation.load(Ordering::Relaxed) {
            // Woken since the latest claim started: there may be messages.
            return;
        }
        // Delays coming due and leases expiring send no notification: poll.
        let timeout = timeout.min(self.config.poll_interval);
        let _ = tokio::time::timeout(timeout, wakes.changed()).await;
    }

    async fn ack(&self, id: &str) -> Result<(), TransportError> {
        let Some(key) = parse_id(id) else {
            return Err(TransportError::NotFound(id.to_string()));
        };
        // Deleting a message that is already gone is fine: a consumer whose
        // lease expired may ack after another consumer did.
        self.retrying("acknowledging a message", || {
            sqlx::query(AssertSqlSafe(self.sql.delete.clone()))
                .bind(key)
                .bind(self.name.as_str())
                .execute(&self.pool)
        })
        .await
        .map(|_| ())
    }

    async fn ack_batch(&self, ids: &[String]) -> Result<(), TransportError> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut keys = Vec::with_capacity(ids.len());
        for id in ids {
            keys.push(parse_id(id).ok_or_else(|| TransportError::NotFound(id.clone()))?);
        }
        self.retrying("acknowledging messages", || {
            sqlx::query(AssertSqlSafe(self.sql.delete_batch.clone()))
                .bind(&keys)
                .bind(self.name.as_str())
                .execute(&self.pool)
        })
        .await
        .map(|_| ())
    }

    async fn release(&self, id: &str) -> Result<(), TransportError> {
        let Some(key) = parse_id(id) else {
            return Err(TransportError::NotFound(id.to_string()));
        };
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

    async fn keepalive(&self, id: &str) -> Result<(), TransportError> {
        let Some(key) = parse_id(id) else {
            return Err(TransportError::NotFound(id.to_string()));
        };
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

    async fn setup(&self) -> Result<(), TransportError> {
        self.retrying("creating the table", || async {
            let mut tx = self.pool.begin().await?;
            // CREATE … IF NOT EXISTS races with itself: serialize setups.
            sqlx::query(AssertSqlSafe(self.sql.setup_lock.clone()))
                .bind(self.config.table.as_str())
                .execute(&mut *tx)
                .await?;
            sqlx::query(AssertSqlSafe(self.sql.create_table.clone()))
                .execute(&mut *tx)
                .await?;
            sqlx::query(AssertSqlSafe(self.sql.create_index.clone()))
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        })
        .await
    }

    async fn message_count(&self) -> Result<u64, TransportError> {
        let count: i64 = self
            .retrying("counting messages", || {
                sqlx::query_scalar(AssertSqlSafe(self.sql.count.clone()))
                    .bind(self.name.as_str())
                    .fetch_one(&self.pool)
            })
            .await?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    async fn list(&self, limit: usize) -> Result<Vec<Delivery>, TransportError> {
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

    async fn find(&self, id: &str) -> Result<Option<Delivery>, TransportError> {
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

impl Transport for PostgresTransport {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(Inner::send(&self.inner, message, delay))
    }

    /// One multi-row `INSERT … SELECT … FROM UNNEST(…)`, then one
    /// (coalesced) `NOTIFY`.
    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        Box::pin(self.inner.send_batch(messages))
    }

    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(Inner::get(&self.inner, max))
    }

    fn ack<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.ack(id))
    }

    /// One `DELETE … WHERE id = ANY($1)`.
    fn ack_batch<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.ack_batch(ids))
    }

    fn reject<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.ack(id))
    }

    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.release(id))
    }

    fn keepalive<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.keepalive(id))
    }

    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(self.inner.setup())
    }

    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(self.inner.message_count())
    }

    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(self.inner.list(limit))
    }

    fn find<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        Box::pin(self.inner.find(id))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }

    /// Returns when a notification for this queue arrived since the latest
    /// `get` started, or after `timeout` capped at the poll interval (delays
    /// coming due and expired leases are not notified).
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(self.inner.wait_for_messages(timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_positive_integers_only() {
        assert_eq!(parse_id("42"), Some(42));
        for bad in ["", "0", "-3", "1-0", "abc", "💥", "99999999999999999999"] {
            assert_eq!(parse_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn stored_headers_decode_leniently_and_never_vanish() {
        assert_eq!(
            decode_headers(r#"{"type":"A","n":"1"}"#),
            Headers::from([("type", "A"), ("n", "1")])
        );
        assert_eq!(
            decode_headers(r#"{"n":1,"ok":true}"#),
            Headers::from([("n", "1"), ("ok", "true")])
        );
        let odd = decode_headers("[1,2]");
        assert_eq!(odd.get(INVALID_HEADERS_HEADER), Some("[1,2]"));
        assert_eq!(
            odd.get(envoi_core::serializer::INVALID_HEADERS_HEADER),
            Some("the stored headers are not a JSON object: [1,2]")
        );
    }
}
