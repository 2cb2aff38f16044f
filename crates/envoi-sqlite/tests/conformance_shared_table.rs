//! The shared conformance suite against SQLite with every transport in one
//! table (rows told apart by `queue_name`) claiming 16 rows at a time (`batch=16`).

use std::sync::Arc;

use envoi_core::transport::Transport;
use envoi_sqlite::SqliteTransport;

async fn make(name: String) -> Option<Arc<dyn Transport>> {
    let dir = std::env::temp_dir().join("envoi-sqlite-tests");
    let path = dir.join(format!("shared-table-{}.db", std::process::id()));
    let dsn = format!(
        "sqlite://{}?table=messages&batch=16&lease=2s&poll=50ms&busy_timeout=30s",
        path.display()
    );
    match SqliteTransport::connect(&name, &dsn).await {
        Ok(t) => Some(Arc::new(t)),
        Err(e) => panic!("opening {dsn} failed: {e}"),
    }
}

// What SQLite promises: messages outlive their handles (persistent), one
// consumer gets them in send order (ordered), delays are honoured, a lease
// that runs out hands the message out again marked as redelivered. The
// lease is the DSN's.
envoi_transport_tests::conformance!(
    make,
    envoi_transport_tests::Options {
        lease: std::time::Duration::from_secs(2),
        lease_expiry: true,
        marks_redeliveries: true,
        binary_bodies: true,
        persistent: true,
        ordered: true,
        delay: true,
        ..envoi_transport_tests::Options::default()
    }
);
