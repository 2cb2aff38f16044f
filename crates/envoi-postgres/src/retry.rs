//! Errors and retries: the first operation makes sure the server answers
//! (within `connect_timeout`); a statement whose connection was lost runs
//! again on another one, and with `auto_setup` one that finds the table
//! missing runs again once the table is created; every other failure
//! becomes a [`TransportError`] naming the transport and its table.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use envoi_core::transport::support::{connect_within, Backoff};
use envoi_core::TransportError;
use sqlx::Connection;

use crate::transport::Inner;

/// Retries on a lost connection that are run at once, each on another
/// pooled connection (a pool the server killed holds several dead ones);
/// the ones after wait, longer each time.
const IMMEDIATE_RETRIES: u32 = 2;

/// Whether `error` says the table does not exist (`42P01`, undefined
/// table): the statement did nothing, and runs again once it is created.
pub(crate) fn is_missing_table(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "42P01")
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

impl Inner {
    /// `error`, met while doing `what`, as a transport error.
    pub(crate) fn error(&self, what: &str, error: sqlx::Error) -> TransportError {
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

    /// Makes sure the server answers, the first time the transport is
    /// used: within `connect_timeout`, a connection opened from
    /// `config.connect` (when the pool is the transport's own, since its
    /// pool would retry a refused connection silently until
    /// `acquire_timeout`), or one taken from the pool. A server that
    /// refuses, fails the attempt or gives no answer in time gives
    /// [`TransportError::Unreachable`] naming the masked DSN; the next
    /// operation tries again.
    pub(crate) async fn reach(&self) -> Result<(), TransportError> {
        if self.reached.load(Ordering::Acquire) {
            return Ok(());
        }
        if self.pool.is_closed() {
            return Err(TransportError::Closed);
        }
        let timeout = self.config.connect_timeout;
        let reached = if self.own_pool {
            let connect = async {
                let connection = sqlx::PgConnection::connect_with(&self.config.connect).await?;
                // Only the answer mattered; a failed goodbye changes nothing.
                let _ = connection.close().await;
                Ok::<_, sqlx::Error>(())
            };
            connect_within(&self.dsn, timeout, connect).await
        } else {
            connect_within(&self.dsn, timeout, self.pool.acquire())
                .await
                .map(drop)
        };
        match reached {
            Ok(()) => {
                self.reached.store(true, Ordering::Release);
                Ok(())
            }
            Err(TransportError::Unreachable { source, .. })
                if matches!(
                    source.downcast_ref::<sqlx::Error>(),
                    Some(sqlx::Error::PoolClosed)
                ) =>
            {
                Err(TransportError::Closed)
            }
            Err(error) => Err(error),
        }
    }

    /// Runs `op` once the server answered ([`reach`](Self::reach)), again
    /// on another connection when it failed because its connection was
    /// lost, and (with `auto_setup`) again once the table is created when
    /// it found none.
    pub(crate) async fn retrying<T, F, Fut>(&self, what: &str, op: F) -> Result<T, TransportError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        self.reach().await?;
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
        let attempt = tokio::time::timeout(
            self.config.connect_timeout,
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

    /// [`retrying`](Self::retrying) without waiting for the server first,
    /// keeping the last error as it is: at most `max_retries` retries on a
    /// lost connection, none started after `acquire_timeout`, and with
    /// `auto_setup` one more run after creating a missing table.
    pub(crate) async fn retrying_raw<T, F, Fut>(&self, mut op: F) -> Result<T, sqlx::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let started = Instant::now();
        let mut attempt = 0u32;
        let mut created = false;
        let mut pause = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
        loop {
            let error = match op().await {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            let error = if self.config.auto_setup && !created && is_missing_table(&error) {
                created = true;
                tracing::debug!(transport = %self.name, table = %self.config.table, "postgres: no table yet, creating it");
                match self.create_table().await {
                    Ok(()) => continue,
                    // Lost on the way: the statement runs again, finds no
                    // table again and creates it again.
                    Err(error) => {
                        created = false;
                        error
                    }
                }
            } else {
                error
            };
            if is_connection_error(&error)
                && attempt < self.max_retries
                && started.elapsed() < self.config.acquire_timeout
            {
                attempt += 1;
                tracing::debug!(%error, attempt, transport = %self.name, "postgres: connection lost, retrying");
                if attempt > IMMEDIATE_RETRIES {
                    pause.wait().await;
                }
                continue;
            }
            return Err(error);
        }
    }
}
