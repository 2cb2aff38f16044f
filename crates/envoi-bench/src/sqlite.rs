//! `sqlite_e2e`: the SQLite transport against the same work written with
//! plain sqlx the way a competent user writes it for one SQLite file.
//!
//! SQLite has one writer per database, so the baseline does what envoi's
//! transport does: one task owns the one write connection and commits
//! everything that queued while it was busy (up to 256 operations) in one
//! `BEGIN IMMEDIATE` transaction (group commit). It opens the file with
//! the same pragmas (WAL, `synchronous = NORMAL`), creates envoi's table
//! and claim index, and runs envoi's statements: single-row inserts from
//! [`PRODUCERS`] concurrent senders, each waiting for its commit; claims of
//! 256 rows (`UPDATE … RETURNING`, counting deliveries); and
//! `DELETE … json_each` of each handled batch, overlapped with the next
//! claim as the worker overlaps them (see [`pipeline`]).
//! Every job must come back exactly once, and the deletes must remove as
//! many rows as were consumed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use envoi_core::transport::Setup;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqliteSynchronous};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Row};
use tokio::sync::{mpsc, oneshot};

use crate::e2e::{envoi_round_trip, job, job_messenger, runtime, PRODUCERS};
use crate::harness::{self, Plan};
use crate::pipeline;
use crate::tally::{settled, Tally};

/// Rows per claim and per worker batch, both sides.
const BATCH: usize = 256;
/// Most operations one commit holds, as in envoi's writer.
const MAX_GROUP: usize = 256;
/// The lease of a claimed row, as envoi's default.
const LEASE_MS: i64 = 60_000;
/// The headers envoi's serializer adds to every job, as JSON.
const HEADERS: &str = r#"{"type":"Job","kind":"command"}"#;

/// `sqlite_e2e`: both sides on a fresh database file per run.
pub(crate) fn sqlite() -> Result<(), String> {
    let rt = runtime()?;
    let plan = Plan::from_env()?;
    let dir = std::env::temp_dir().join(format!("envoi-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let runs = std::cell::Cell::new(0);
    let fresh = |side: &str| {
        runs.set(runs.get() + 1);
        dir.join(format!("{side}-{}.db", runs.get()))
    };
    let outcome = harness::compare(
        &plan,
        |n| with_file(&fresh("envoi"), |path| rt.block_on(sqlite_envoi(path, n))),
        |n| {
            with_file(&fresh("baseline"), |path| {
                rt.block_on(sqlite_baseline(path, n))
            })
        },
    );
    let _ = std::fs::remove_dir_all(&dir);
    harness::summary("sqlite_e2e", &plan, &outcome?, "msg/s", &[]);
    Ok(())
}

/// Runs `side` on the database at `path`, then removes the file and its
/// WAL whatever happened.
fn with_file(path: &Path, side: impl FnOnce(&Path) -> Result<f64, String>) -> Result<f64, String> {
    let result = side(path);
    for suffix in ["", "-wal", "-shm"] {
        let mut file = PathBuf::from(path).into_os_string();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
    result
}

pub(crate) async fn sqlite_envoi(path: &Path, n: u64) -> Result<f64, String> {
    let dsn = format!("sqlite://{}?batch={BATCH}", path.display());
    let transport = envoi_sqlite::SqliteTransport::connect("jobs", &dsn)
        .await
        .map_err(|e| e.to_string())?;
    transport.setup().await.map_err(|e| e.to_string())?;
    let (messenger, handled) = job_messenger("jobs", Arc::new(transport))?;
    envoi_round_trip(&messenger, "jobs", &handled, n, 64, BATCH).await
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Claimed rows: `(id, body)`.
type Rows = Vec<(i64, Vec<u8>)>;

/// What the writer task is asked to do.
enum Op {
    /// Insert one row.
    Insert(Vec<u8>, oneshot::Sender<Result<(), String>>),
    /// Lease up to [`BATCH`] rows; answers `(id, body)`.
    Claim(oneshot::Sender<Result<Rows, String>>),
    /// Delete rows; answers how many went.
    Delete(Vec<i64>, oneshot::Sender<Result<u64, String>>),
}

/// What applying an operation gave.
enum Done {
    Inserted,
    Claimed(Rows),
    Deleted(u64),
}

/// envoi's table, its claim index and the three statements it runs here.
struct Statements {
    create: [String; 2],
    insert: Arc<str>,
    claim: Arc<str>,
    delete: Arc<str>,
}

impl Statements {
    fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        Self {
            create: [
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (id INTEGER PRIMARY KEY AUTOINCREMENT, \
                     queue_name TEXT NOT NULL, body BLOB NOT NULL, headers TEXT NOT NULL, \
                     created_at INTEGER NOT NULL, \
                     available_at INTEGER NOT NULL CHECK (typeof(available_at) = 'integer'), \
                     delivered_at INTEGER, lease_until INTEGER, \
                     delivery_count INTEGER NOT NULL DEFAULT 0)"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{table}:claim\" ON {t} (queue_name, available_at, id)"
                ),
            ],
            insert: format!(
                "INSERT INTO {t} (queue_name, body, headers, created_at, available_at) \
                 VALUES (?, ?, ?, ?, ?)"
            )
            .into(),
            claim: format!(
                "UPDATE {t} SET delivered_at = ?1, lease_until = ?2, available_at = ?2, \
                 delivery_count = delivery_count + 1 WHERE id IN (SELECT id FROM {t} \
                 WHERE queue_name = ?3 AND available_at <= ?1 ORDER BY available_at, id \
                 LIMIT ?4) RETURNING id, body, headers, delivery_count"
            )
            .into(),
            delete: format!(
                "DELETE FROM {t} WHERE +queue_name = ?2 AND id IN (SELECT value FROM json_each(?1))"
            )
            .into(),
        }
    }
}

/// Runs `op` on `conn` (the write connection, or a transaction on it).
async fn apply(conn: &mut SqliteConnection, sql: &Statements, op: &Op) -> sqlx::Result<Done> {
    match op {
        Op::Insert(body, _) => {
            let now = now_ms();
            sqlx::query(AssertSqlSafe(sql.insert.clone()))
                .bind("jobs")
                .bind(body.as_slice())
                .bind(HEADERS)
                .bind(now)
                .bind(now)
                .execute(&mut *conn)
                .await?;
            Ok(Done::Inserted)
        }
        Op::Claim(_) => {
            let now = now_ms();
            let rows = sqlx::query(AssertSqlSafe(sql.claim.clone()))
                .bind(now)
                .bind(now + LEASE_MS)
                .bind("jobs")
                .bind(BATCH as i64)
                .fetch_all(&mut *conn)
                .await?;
            let rows = rows
                .iter()
                .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                .collect::<sqlx::Result<_>>()?;
            Ok(Done::Claimed(rows))
        }
        Op::Delete(ids, _) => {
            let list = serde_json::to_string(ids).map_err(|e| sqlx::Error::Encode(e.into()))?;
            let deleted = sqlx::query(AssertSqlSafe(sql.delete.clone()))
                .bind(list)
                .bind("jobs")
                .execute(&mut *conn)
                .await?;
            Ok(Done::Deleted(deleted.rows_affected()))
        }
    }
}

/// Answers the caller of `op` with `outcome`.
fn reply(op: Op, outcome: Result<Done, String>) {
    let mismatch = || "the writer answered another operation".to_string();
    match op {
        Op::Insert(_, tx) => {
            let _ = tx.send(outcome.and_then(|d| match d {
                Done::Inserted => Ok(()),
                _ => Err(mismatch()),
            }));
        }
        Op::Claim(tx) => {
            let _ = tx.send(outcome.and_then(|d| match d {
                Done::Claimed(rows) => Ok(rows),
                _ => Err(mismatch()),
            }));
        }
        Op::Delete(_, tx) => {
            let _ = tx.send(outcome.and_then(|d| match d {
                Done::Deleted(n) => Ok(n),
                _ => Err(mismatch()),
            }));
        }
    }
}

/// The writer: takes what queued (up to [`MAX_GROUP`] operations), runs it
/// in one transaction (a lone operation on its own), answers each after
/// the commit; ends when every sender is gone.
async fn writer(mut conn: SqliteConnection, sql: Statements, mut rx: mpsc::Receiver<Op>) {
    let mut group = Vec::with_capacity(MAX_GROUP);
    while rx.recv_many(&mut group, MAX_GROUP).await > 0 {
        let outcomes = if let [op] = group.as_slice() {
            vec![apply(&mut conn, &sql, op).await.map_err(|e| e.to_string())]
        } else {
            commit_group(&mut conn, &sql, &group).await
        };
        for (op, outcome) in group.drain(..).zip(outcomes) {
            reply(op, outcome);
        }
    }
    let _ = conn.close().await;
}

/// Runs `group` in one `BEGIN IMMEDIATE` transaction: every outcome, or
/// the error for each when anything failed (nothing is then committed).
async fn commit_group(
    conn: &mut SqliteConnection,
    sql: &Statements,
    group: &[Op],
) -> Vec<Result<Done, String>> {
    let run = async {
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        let mut done = Vec::with_capacity(group.len());
        for op in group {
            done.push(apply(&mut tx, sql, op).await?);
        }
        tx.commit().await?;
        Ok::<_, sqlx::Error>(done)
    };
    match run.await {
        Ok(done) => done.into_iter().map(Ok).collect(),
        Err(e) => group.iter().map(|_| Err(e.to_string())).collect(),
    }
}

/// Sends `op` (built around its reply channel) to the writer and waits for
/// the answer.
async fn ask<T>(
    writer: &mpsc::Sender<Op>,
    op: impl FnOnce(oneshot::Sender<Result<T, String>>) -> Op,
) -> Result<T, String> {
    let (tx, rx) = oneshot::channel();
    writer
        .send(op(tx))
        .await
        .map_err(|_| "the writer is gone".to_string())?;
    rx.await.map_err(|_| "the writer is gone".to_string())?
}

/// Opens the file as envoi does (WAL, `synchronous = NORMAL`), creates
/// envoi's table and index, and starts the writer.
async fn open_writer(path: &Path) -> Result<mpsc::Sender<Op>, String> {
    let mut conn = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    let sql = Statements::new("envoi_jobs");
    for ddl in &sql.create {
        sqlx::query(AssertSqlSafe(ddl.clone()))
            .execute(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
    }
    let (tx, rx) = mpsc::channel(1024);
    tokio::spawn(writer(conn, sql, rx));
    Ok(tx)
}

/// The baseline: [`PRODUCERS`] senders through the writer, then claims and
/// deletes through it, fetched ahead and overlapped.
async fn sqlite_baseline(path: &Path, n: u64) -> Result<f64, String> {
    let writer = open_writer(path).await?;
    let start = Instant::now();
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let writer = writer.clone();
        producers.push(tokio::spawn(async move {
            let mut id = p;
            while id < n {
                let body = serde_json::to_vec(&job(id)).map_err(|e| e.to_string())?;
                ask(&writer, |tx| Op::Insert(body, tx)).await?;
                id += PRODUCERS;
            }
            Ok::<_, String>(())
        }));
    }
    for p in producers {
        p.await.map_err(|e| e.to_string())??;
    }
    let sent = start.elapsed();
    let mut tally = Tally::new(n);
    let (claims, deletes) = (writer.clone(), writer.clone());
    let done = pipeline::consume(
        n,
        move || {
            let writer = claims.clone();
            async move { ask(&writer, Op::Claim).await }
        },
        |(id, body): (i64, Vec<u8>)| tally.body(&body).map(|()| id),
        move |ids| {
            let writer = deletes.clone();
            async move { ask(&writer, |tx| Op::Delete(ids, tx)).await }
        },
    )
    .await?;
    let elapsed = start.elapsed();
    tally.finish()?;
    settled("deleted", done.settled, done.messages)?;
    eprintln!(
        "  baseline: sent {n} in {:.3}s, consumed in {:.3}s",
        sent.as_secs_f64(),
        (elapsed - sent).as_secs_f64()
    );
    Ok(n as f64 / elapsed.as_secs_f64())
}
