//! Opening the database file: the write connection and the read pool.

use std::time::{Duration, Instant};

use envoi_core::transport::support::Backoff;
use envoi_core::TransportError;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::ConnectOptions;

use crate::config::SqliteConfig;

/// The connections of a transport.
pub(crate) struct Connections {
    /// The one connection the writer task writes through.
    pub(crate) writer: SqliteConnection,
    /// Up to two connections for listing and counting.
    pub(crate) reader: SqlitePool,
}

/// Opens the database at `config.path` (creating the file and its
/// directory if missing) in WAL mode.
pub(crate) async fn open(config: &SqliteConfig) -> Result<Connections, TransportError> {
    let path = &config.path;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| {
            TransportError::backend(format!("creating the directory of `{}`", path.display()), e)
        })?;
    }
    let connect = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(config.busy_timeout);
    let writer = connect_while_busy(&connect, config.busy_timeout)
        .await
        .map_err(|e| {
            TransportError::backend(format!("opening SQLite database `{}`", path.display()), e)
        })?;
    let reader = SqlitePoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(60))
        .connect_lazy_with(connect);
    Ok(Connections { writer, reader })
}

/// Connects, retrying for up to `busy_timeout` while the database is
/// locked: switching a file to WAL while other connections use it can
/// report it as locked without waiting on the busy handler. The waits
/// double from 10 ms up to 200 ms.
async fn connect_while_busy(
    connect: &SqliteConnectOptions,
    busy_timeout: Duration,
) -> Result<SqliteConnection, sqlx::Error> {
    let started = Instant::now();
    let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(200));
    loop {
        match connect.connect().await {
            Ok(conn) => return Ok(conn),
            Err(e) if is_busy(&e) && started.elapsed() < busy_timeout => {
                let left = busy_timeout.saturating_sub(started.elapsed());
                tokio::time::sleep(backoff.next_wait().min(left)).await;
            }
            Err(e) => return Err(e),
        }
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
