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

/// Waits for `future` at most `limit` (real time); past it, fails naming
/// `what` it waited for, rather than hang the test run.
#[allow(unused_imports)]
pub(crate) use envoi_core::testing::within;
