//! `deadline(d)` stops work in progress: a handler writing inside a SQLite
//! transaction is dropped when the limit passes, the transaction is rolled
//! back, and nothing it wrote is visible afterwards.

use std::path::PathBuf;
use std::time::Duration;

use envoi::typed::deadline::deadline;
use envoi::{BusError, Command, DispatchError, Handler, Message, Messenger};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use tokio::sync::mpsc;

#[derive(Debug, Clone)]
struct RecordPayment {
    id: i64,
    /// Whether the handler then waits on a slow call, still inside the
    /// transaction.
    slow: bool,
}

impl Message for RecordPayment {
    const NAME: &'static str = "RecordPayment";
}

#[derive(Debug, thiserror::Error)]
#[error("payment store failed: {0}")]
struct PaymentError(#[from] sqlx::Error);

impl Command for RecordPayment {
    type Output = ();
    type Error = PaymentError;
}

struct RecordPaymentHandler {
    pool: SqlitePool,
    /// Told how many rows the transaction sees after its insert.
    written: mpsc::UnboundedSender<i64>,
}

impl Handler<RecordPayment> for RecordPaymentHandler {
    type Output = ();
    type Error = PaymentError;

    async fn handle(&self, cmd: &RecordPayment) -> Result<(), PaymentError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("INSERT INTO payments (id) VALUES (?)")
            .bind(cmd.id)
            .execute(&mut *tx)
            .await?;
        let seen: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments")
            .fetch_one(&mut *tx)
            .await?;
        let _ = self.written.send(seen);
        if cmd.slow {
            // A slow downstream call made while the transaction is open.
            tokio::time::sleep(Duration::from_secs(120)).await;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// A database file of its own, removed when dropped.
struct TempDb(PathBuf);

impl TempDb {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        Self(std::env::temp_dir().join(format!("envoi-deadline-{}-{nanos}.db", std::process::id())))
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut p = self.0.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}

async fn pool(db: &TempDb) -> SqlitePool {
    // One connection: if the transaction were not rolled back, the next
    // query on that same connection would see its row.
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&db.0)
                .create_if_missing(true),
        )
        .await
        .expect("open the test database");
    sqlx::query("CREATE TABLE payments (id INTEGER PRIMARY KEY)")
        .execute(&pool)
        .await
        .expect("create the table");
    pool
}

async fn rows(pool: &SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM payments")
        .fetch_one(pool)
        .await
        .expect("count rows")
}

#[tokio::test]
async fn a_deadline_rolls_back_the_transaction_the_handler_was_running_in() {
    let db = TempDb::new();
    let pool = pool(&db).await;
    let (written, mut seen) = mpsc::unbounded_channel();
    let messenger = Messenger::builder()
        .command_handler(RecordPaymentHandler {
            pool: pool.clone(),
            written,
        })
        .build()
        .unwrap();
    let payments = messenger
        .dispatcher()
        .with(deadline(Duration::from_secs(2)));

    let err = payments
        .dispatch(RecordPayment { id: 1, slow: true })
        .await
        .unwrap_err();
    match err {
        DispatchError::Infrastructure(BusError::DeadlineExceeded { tag, side, after }) => {
            assert_eq!(
                (tag, side, after),
                ("RecordPayment", "command", Duration::from_secs(2))
            );
        }
        other => panic!("expected DeadlineExceeded, got {other:?}"),
    }
    assert_eq!(
        seen.recv().await,
        Some(1),
        "the handler had written its row inside the transaction"
    );
    assert_eq!(
        rows(&pool).await,
        0,
        "the dropped transaction was rolled back"
    );

    // The same handler within its deadline commits.
    payments
        .dispatch(RecordPayment { id: 2, slow: false })
        .await
        .unwrap();
    assert_eq!(seen.recv().await, Some(1));
    assert_eq!(rows(&pool).await, 1);
    pool.close().await;
}
