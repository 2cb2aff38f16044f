//! Helpers shared by the SQLite integration tests.

use std::path::{Path, PathBuf};

/// A fresh database path for `test`, under the system's temporary folder.
pub(crate) fn db_path(test: &str) -> PathBuf {
    std::env::temp_dir()
        .join("envoi-sqlite-tests")
        .join(format!(
            "{test}-{}-{}.db",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ))
}

/// A plain sqlx pool on the database at `path`, to read or write it as
/// another program would.
pub(crate) async fn raw_pool(path: &Path) -> sqlx::SqlitePool {
    sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("raw pool")
}

/// Waits for `future` at most `limit`; past it, fails naming `what` it
/// waited for, rather than hang the test run.
#[allow(dead_code)]
pub(crate) async fn within<T>(
    limit: std::time::Duration,
    what: &str,
    future: impl std::future::Future<Output = T>,
) -> T {
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("timed out after {limit:?} waiting for {what}"))
}
