//! [`PostgresTransport`]: creating, closing and dropping it, and the state
//! its handles share.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, OnceLock};

use envoi_core::transport::support::ReadAhead;
use envoi_core::transport::Delivery;
use envoi_core::TransportError;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio::task::JoinHandle;

use crate::claim::give_back_later;
use crate::config::{ConfigError, PostgresConfig};
use crate::listener::{ListenerTask, NotifierTask, Wake};
use crate::sql::Statements;
use crate::writer::Writer;

/// A transport storing messages in a PostgreSQL table.
///
/// Every queue (transport name) is a set of rows in a shared table
/// (`envoi_messages` unless the DSN says `table=`), so one table can serve
/// many transports. Cloning is cheap and gives another handle on the same
/// pool and listener.
///
/// It has every ability of a durable queue: a
/// [`Receiver`](envoi_core::transport::Receiver),
/// [`Keepalive`](envoi_core::transport::Keepalive),
/// [`Setup`](envoi_core::transport::Setup) (the table and its index, also
/// created on first use with `auto_setup`),
/// [`MessageCount`](envoi_core::transport::MessageCount),
/// [`Browse`](envoi_core::transport::Browse),
/// [`Teardown`](envoi_core::transport::Teardown) and
/// [`WakeUp`](envoi_core::transport::WakeUp) (`LISTEN/NOTIFY`).
///
/// ```no_run
/// use envoi_core::transport::{Setup, Transport};
/// use envoi_postgres::PostgresTransport;
///
/// # async fn run() -> Result<(), envoi_core::TransportError> {
/// let orders =
///     PostgresTransport::connect("orders", "postgres://app@127.0.0.1:5432/shop?lease=60s").await?;
/// orders.setup().await?;
/// assert!(orders.as_receiver().is_some() && orders.as_wake_up().is_some());
/// orders.close().await?;
/// # Ok(()) }
/// ```
///
/// # Delivery
///
/// [`get`](envoi_core::transport::Receiver::get) leases a batch with one
/// statement, `UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED LIMIT n) RETURNING …`:
/// concurrent consumers never block each other nor receive the same row. A
/// leased message is invisible until its lease (`lease=`, 300 s by default)
/// passes, then handed out again, marked as
/// [`redelivered`](Delivery::redelivered) (its row's `delivery_count` says
/// it was handed out before), so a consumer that dies loses nothing.
/// [`keepalive`](envoi_core::transport::Keepalive::keepalive) renews the
/// lease; [`ack`](envoi_core::transport::Receiver::ack) and
/// [`reject`](envoi_core::transport::Receiver::reject) delete the row;
/// [`release`](envoi_core::transport::Receiver::release) ends the lease at
/// once.
///
/// # Sending
///
/// Concurrent [`send`](envoi_core::transport::Transport::send)s are grouped:
/// a background writer of the transport value takes every send waiting for
/// it and stores them with one multi-row `INSERT` (up to 1,000 rows), with
/// a few such statements in flight at once. Each `send` returns once the
/// statement holding its row has committed, so an acknowledged send is as
/// durable as a single-row insert, and a lone send is not delayed: the
/// writer starts a statement as soon as there is a send and room for one.
/// Should a grouped statement fail for a reason other than a lost
/// connection, its rows are stored one by one, so only the message at fault
/// fails.
///
/// # Claiming ahead
///
/// A consumer fetches, handles and acknowledges a batch before it fetches
/// the next. When a `get` of at least 100 messages comes back full, the
/// claim of the next batch starts at once (through core's
/// [`ReadAhead`]), so it runs while the caller handles this one; the next
/// `get` hands it out (a smaller one keeps the rest for the following
/// `get`s). Rows claimed ahead are leased like the ones handed out; they
/// are given back (their lease ended) when they have waited for a `get`
/// longer than half a lease, and by [`close`](PostgresTransport::close) or
/// dropping the last handle, unless their lease has run out by then:
/// another consumer may hold them.
///
/// # Waking consumers
///
/// After a send commits, a background task of the transport runs `NOTIFY`
/// (coalesced: one notification however many sends completed while the
/// previous one was on its way). One listener connection per transport value
/// (shared by all its consumers and clones, opened by the first `get`) turns
/// notifications for this queue into wake-ups. An empty `get` waits up to
/// `wait=` (250 ms; `0` returns at once) for one;
/// [`wait_for_messages`](envoi_core::transport::WakeUp::wait_for_messages)
/// waits up to `poll=` (500 ms). Notifications missed while the listener
/// reconnects, delays that come due and leases that expire are caught by
/// that polling.
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
    pub(crate) inner: Arc<Inner>,
}

/// What every handle of one transport value shares.
pub(crate) struct Inner {
    pub(crate) name: String,
    pub(crate) config: PostgresConfig,
    pub(crate) pool: PgPool,
    listener_pool: Option<PgPool>,
    pub(crate) sql: Statements,
    pub(crate) wake: Arc<Wake>,
    listener: OnceLock<AbortOnDrop>,
    /// Signals the notifier task that messages became available.
    notify_signal: Arc<tokio::sync::Notify>,
    notifier: OnceLock<AbortOnDrop>,
    /// The writer grouping concurrent sends, started by the first send.
    pub(crate) writer: OnceLock<Writer>,
    /// Rows claimed ahead of the next `get`.
    pub(crate) ahead: ReadAhead<Delivery>,
    /// The wake generation when the latest claim started.
    pub(crate) claimed_generation: AtomicU64,
    pub(crate) lease_secs: f64,
    pub(crate) max_retries: u32,
    /// The DSN errors name, password masked.
    pub(crate) dsn: String,
    /// Whether `pool` was made from `config.connect` (so a connection
    /// opened from it reaches the same server).
    pub(crate) own_pool: bool,
    /// Whether the server answered once: until then, each operation first
    /// makes sure it does, within `connect_timeout`.
    pub(crate) reached: AtomicBool,
}

/// Aborts a background task when the transport is dropped.
pub(crate) struct AbortOnDrop(pub(crate) JoinHandle<()>);

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
    /// before the first operation, so a server that is down is reported by
    /// that operation, within `connect_timeout` (5 s by default), as
    /// [`TransportError::Unreachable`]. With `auto_setup` (the default) the
    /// first operation that finds the table missing creates it. Must be
    /// called within a Tokio runtime.
    pub async fn connect(name: &str, dsn: &str) -> Result<Self, TransportError> {
        Self::with_config(name, PostgresConfig::from_dsn(dsn)?).await
    }

    /// The transport called `name` with `config`, on a pool of its own.
    /// Connects lazily. Must be called within a Tokio runtime.
    pub async fn with_config(name: &str, config: PostgresConfig) -> Result<Self, TransportError> {
        require_runtime()?;
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(config.acquire_timeout)
            // A dead connection is noticed by the statement that uses it and
            // the statement retried; pinging before every use would cost a
            // round trip per operation.
            .test_before_acquire(false)
            .connect_lazy_with(config.connect.clone());
        Self::build(name, pool, config, true)
    }

    /// The transport called `name` on an existing `pool` (shared with the
    /// application, for instance). `config.connect` is used only by the
    /// listener connection, which is never taken from `pool`. The first
    /// operation waits up to `config.connect_timeout` for a connection of
    /// `pool`. Must be called within a Tokio runtime.
    pub async fn with_pool(
        name: &str,
        pool: PgPool,
        config: PostgresConfig,
    ) -> Result<Self, TransportError> {
        Self::build(name, pool, config, false)
    }

    /// The transport called `name` on `pool`, which was made from
    /// `config.connect` when `own_pool`.
    fn build(
        name: &str,
        pool: PgPool,
        config: PostgresConfig,
        own_pool: bool,
    ) -> Result<Self, TransportError> {
        require_runtime()?;
        let invalid = |e: ConfigError| TransportError::backend("invalid postgres transport", e);
        // Also checks the table name, which is spliced into the SQL.
        config.validate().map_err(invalid)?;
        if name.is_empty() || name.contains('\0') {
            return Err(invalid(ConfigError::InvalidName(name.to_string())));
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
        let dsn = config.dsn_for_errors();
        Ok(Self {
            inner: Arc::new(Inner {
                sql: Statements::new(&config.table),
                lease_secs: config.lease.as_secs_f64(),
                ahead: ReadAhead::new(config.lease),
                name: name.to_string(),
                config,
                pool,
                listener_pool,
                wake: Arc::new(Wake::new()),
                listener: OnceLock::new(),
                notify_signal: Arc::new(tokio::sync::Notify::new()),
                notifier: OnceLock::new(),
                writer: OnceLock::new(),
                claimed_generation: AtomicU64::new(0),
                max_retries,
                dsn,
                own_pool,
                reached: AtomicBool::new(false),
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

    /// Gives back the rows claimed ahead of the next `get` (those still
    /// within their lease), stops the listener, the notifier and the
    /// writer, and closes the connections, waiting for them to finish.
    /// Every handle on this transport fails with
    /// [`TransportError::Closed`] afterwards. Closing again does nothing.
    pub async fn close(&self) -> Result<(), TransportError> {
        let inner = &*self.inner;
        let ahead = inner.ahead.drain().await;
        inner.unclaim(ahead).await;
        for task in [
            inner.listener.get(),
            inner.notifier.get(),
            inner.writer.get().map(|w| &w.task),
        ]
        .into_iter()
        .flatten()
        {
            task.0.abort();
        }
        inner.pool.close().await;
        if let Some(pool) = &inner.listener_pool {
            pool.close().await;
        }
        Ok(())
    }
}

fn require_runtime() -> Result<(), TransportError> {
    tokio::runtime::Handle::try_current()
        .map(|_| ())
        .map_err(|e| TransportError::backend("the postgres transport needs a Tokio runtime", e))
}

impl Inner {
    /// Starts the listener task, unless it runs or `listen=false`.
    pub(crate) fn ensure_listener(&self) {
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
    pub(crate) fn notify_consumers(&self) {
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
}

impl Drop for Inner {
    /// Gives back what was claimed ahead and not handed out (what is still
    /// within its lease), rather than leave it leased until its lease ends.
    fn drop(&mut self) {
        let Some(rows) = self.ahead.drain_later() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(give_back_later(
            rows,
            self.pool.clone(),
            Arc::clone(&self.sql.unclaim),
            self.name.clone(),
        ));
    }
}
