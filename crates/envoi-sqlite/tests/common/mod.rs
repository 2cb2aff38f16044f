//! Helpers shared by the SQLite integration tests.

use std::path::PathBuf;

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
