//! End-to-end scenarios: send N messages through a transport, then consume
//! them all with the worker, against a raw client doing the minimum
//! equivalent work in the same process.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::transport::in_memory::InMemoryTransport;
use envoi_core::transport::{Setup, Transport};
use envoi_core::worker::Worker;
use envoi_core::{Command, Message, Messenger};
use serde::{Deserialize, Serialize};

use crate::{alloc, report};

/// The message every end-to-end scenario sends.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Job {
    pub(crate) id: u64,
    pub(crate) payload: String,
}

impl Message for Job {
    const NAME: &'static str = "Job";
}

impl Command for Job {
    type Output = ();
    type Error = Infallible;
}

pub(crate) fn job(id: u64) -> Job {
    Job {
        id,
        payload: format!("order-{id:08}"),
    }
}

/// How many messages a scenario moves: `ENVOI_BENCH_N`, 100,000 by default.
pub(crate) fn n_messages() -> u64 {
    std::env::var("ENVOI_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

/// How many times each side runs: `ENVOI_BENCH_ROUNDS`, 1 by default. The
/// sides alternate and each keeps its best round, which filters out the
/// moments a shared machine is busy elsewhere.
pub(crate) fn rounds() -> u32 {
    std::env::var("ENVOI_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&r| r > 0)
        .unwrap_or(1)
}

/// Messages each side moves once, untimed, before the timed rounds:
/// `ENVOI_BENCH_WARMUP`, 5,000 by default (at most N), 0 for none. A broker
/// that has been idle (files to create, caches to fill), or a heap not yet
/// grown, would otherwise slow down whichever side runs first.
pub(crate) fn warmup(n: u64) -> u64 {
    std::env::var("ENVOI_BENCH_WARMUP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000)
        .min(n)
}

/// How many dispatches run at once on the sending side.
pub(crate) const PRODUCERS: u64 = 64;

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
}

/// Peak resident set size of this process so far, in MiB.
pub(crate) fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Sends `n` jobs through `messenger` (routed to `transport`) with
/// [`PRODUCERS`] concurrent dispatchers, then consumes them with a worker.
/// Returns messages per second over both phases.
pub(crate) async fn envoi_round_trip(
    messenger: &Messenger,
    transport: &str,
    handled: &Arc<AtomicU64>,
    n: u64,
    concurrency: usize,
    batch: usize,
) -> Result<f64, String> {
    let start = Instant::now();
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let dispatcher = messenger.dispatcher();
        producers.push(tokio::spawn(async move {
            let mut id = p;
            while id < n {
                dispatcher
                    .dispatch(job(id))
                    .await
                    .map_err(|e| format!("dispatch failed: {e}"))?;
                id += PRODUCERS;
            }
            Ok::<_, String>(())
        }));
    }
    for p in producers {
        p.await.map_err(|e| e.to_string())??;
    }
    let sent = start.elapsed();
    let report = Worker::builder(messenger)
        .receiver(transport)
        .concurrency(concurrency)
        .batch_size(batch)
        .message_limit(n)
        .time_limit(Duration::from_secs(600))
        .build()
        .map_err(|e| e.to_string())?
        .run()
        .await;
    let total = start.elapsed();
    let got = handled.load(Ordering::Relaxed);
    if got != n || report.stats.handled != n {
        return Err(format!(
            "envoi handled {got} of {n} messages (worker: {:?}, stopped: {:?})",
            report.stats, report.reason
        ));
    }
    eprintln!(
        "  envoi: sent {n} in {:.3}s, consumed in {:.3}s",
        sent.as_secs_f64(),
        (total - sent).as_secs_f64()
    );
    Ok(n as f64 / total.as_secs_f64())
}

/// A messenger routing [`Job`] to `name` with a counting no-op handler.
pub(crate) fn job_messenger(
    name: &str,
    transport: Arc<dyn Transport>,
) -> Result<(Messenger, Arc<AtomicU64>), String> {
    let handled = Arc::new(AtomicU64::new(0));
    let h = handled.clone();
    let messenger = Messenger::builder()
        .command_handler(move |_: Job| {
            let h = h.clone();
            async move {
                h.fetch_add(1, Ordering::Relaxed);
                Ok::<_, Infallible>(())
            }
        })
        .transport(name, transport)
        .route::<Job>(name)
        .build()
        .map_err(|e| e.to_string())?;
    Ok((messenger, handled))
}

/// `memory_e2e`: the in-memory transport against a plain tokio mpsc loop.
///
/// Both sides first move a warm-up batch untimed (`ENVOI_BENCH_WARMUP`),
/// then run [`rounds`] timed rounds alternately, each keeping its best: a
/// run this short is otherwise dominated by whichever side first grows the
/// process's heap, and envoi runs first.
pub(crate) fn memory() -> Result<(), String> {
    let rt = runtime()?;
    let n = n_messages();
    let rounds = rounds();
    let warmup = warmup(n);
    rt.block_on(async {
        if warmup > 0 {
            memory_envoi(warmup).await?;
            memory_baseline(warmup).await?;
        }
        let (mut envoi, mut baseline) = (0.0f64, 0.0f64);
        let (mut envoi_allocs, mut baseline_allocs) = (0, 0);
        for _ in 0..rounds {
            let (rate, allocs) = alloc::count_async(memory_envoi(n)).await;
            envoi = envoi.max(rate?);
            envoi_allocs = allocs;
            let (rate, allocs) = alloc::count_async(memory_baseline(n)).await;
            baseline = baseline.max(rate?);
            baseline_allocs = allocs;
        }
        let per_message = |allocs: usize| format!("{:.1}", allocs as f64 / n as f64);
        report::line(
            "memory_e2e",
            envoi,
            baseline,
            "msg/s",
            &[
                ("allocs", per_message(envoi_allocs)),
                ("baseline_allocs", per_message(baseline_allocs)),
                ("n", n.to_string()),
                ("rounds", rounds.to_string()),
                ("warmup", warmup.to_string()),
            ],
        );
        Ok(())
    })
}

/// Profiling aid: only envoi's side of `memory_e2e`, once, with
/// `ENVOI_BENCH_N` messages.
pub(crate) fn profile_memory() -> Result<(), String> {
    let n = n_messages();
    let (rate, allocs) = runtime()?.block_on(alloc::count_async(memory_envoi(n)));
    println!(
        "profile_memory: {:.0} msg/s allocs={:.2} n={n}",
        rate?,
        allocs as f64 / n as f64
    );
    Ok(())
}

/// envoi's side of `memory_e2e`: a fresh messenger on a fresh in-memory
/// transport, [`envoi_round_trip`] with 64 handlers at once and batches of
/// 256.
async fn memory_envoi(n: u64) -> Result<f64, String> {
    let (messenger, handled) = job_messenger("memory", Arc::new(InMemoryTransport::new()))?;
    envoi_round_trip(&messenger, "memory", &handled, n, 64, 256).await
}

/// The baseline of `memory_e2e`: the same jobs through an unbounded
/// channel from the same producers, consumed by one task that "handles"
/// each by counting it.
async fn memory_baseline(n: u64) -> Result<f64, String> {
    let start = Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let tx = tx.clone();
        producers.push(tokio::spawn(async move {
            let mut id = p;
            while id < n {
                tx.send(job(id)).map_err(|e| e.to_string())?;
                id += PRODUCERS;
            }
            Ok::<_, String>(())
        }));
    }
    drop(tx);
    for p in producers {
        p.await.map_err(|e| e.to_string())??;
    }
    let sent = start.elapsed();
    let mut count = 0u64;
    while let Some(j) = rx.recv().await {
        std::hint::black_box(j.id);
        count += 1;
    }
    if count != n {
        return Err(format!("baseline received {count} of {n}"));
    }
    eprintln!(
        "  baseline: sent in {:.3}s, consumed in {:.3}s",
        sent.as_secs_f64(),
        (start.elapsed() - sent).as_secs_f64()
    );
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// `sqlite_e2e`: the SQLite transport against plain sqlx statements on the
/// same schema.
pub(crate) fn sqlite() -> Result<(), String> {
    let rt = runtime()?;
    let n = n_messages();
    let dir = std::env::temp_dir().join(format!("envoi-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let result = rt.block_on(async {
        let envoi_db = dir.join("envoi.db");
        let dsn = format!("sqlite://{}?batch=256", envoi_db.display());
        let transport = envoi_sqlite::SqliteTransport::connect("jobs", &dsn)
            .await
            .map_err(|e| e.to_string())?;
        transport.setup().await.map_err(|e| e.to_string())?;
        let (messenger, handled) = job_messenger("jobs", Arc::new(transport))?;
        let envoi = envoi_round_trip(&messenger, "jobs", &handled, n, 64, 256).await?;
        let rss = peak_rss_mb();
        drop(messenger);

        let baseline = sqlite_baseline(&dir.join("baseline.db"), n).await?;
        report::line(
            "sqlite_e2e",
            envoi,
            baseline,
            "msg/s",
            &[("peak_rss_mb", format!("{rss:.0}")), ("n", n.to_string())],
        );
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The minimum equivalent work with plain sqlx on envoi's schema: the same
/// JSON bodies and headers inserted by [`PRODUCERS`] concurrent senders,
/// then claimed 256 at a time with one `UPDATE … RETURNING` and deleted with
/// one `DELETE` per batch.
async fn sqlite_baseline(path: &std::path::Path, n: u64) -> Result<f64, String> {
    use sqlx::sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
    };
    use sqlx::Row;

    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .map_err(|e| e.to_string())?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, queue_name TEXT NOT NULL, \
         body BLOB NOT NULL, headers TEXT NOT NULL, created_at INTEGER NOT NULL, available_at INTEGER NOT NULL, \
         delivered_at INTEGER, lease_until INTEGER, delivery_count INTEGER NOT NULL DEFAULT 0)",
    )
    .execute(&pool)
    .await
    .map_err(|e| e.to_string())?;
    sqlx::query("CREATE INDEX IF NOT EXISTS jobs_claim ON jobs (queue_name, available_at, id)")
        .execute(&pool)
        .await
        .map_err(|e| e.to_string())?;
    let headers = r#"{"type":"Job","kind":"command"}"#;

    let start = Instant::now();
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let pool = pool.clone();
        producers.push(tokio::spawn(async move {
            let mut id = p;
            while id < n {
                let body = serde_json::to_vec(&job(id)).map_err(|e| e.to_string())?;
                sqlx::query(
                    "INSERT INTO jobs (queue_name, body, headers, created_at, available_at) VALUES ('jobs', ?, ?, 0, 0)",
                )
                .bind(body)
                .bind(headers)
                .execute(&pool)
                .await
                .map_err(|e| e.to_string())?;
                id += PRODUCERS;
            }
            Ok::<_, String>(())
        }));
    }
    for p in producers {
        p.await.map_err(|e| e.to_string())??;
    }
    let mut consumed = 0u64;
    while consumed < n {
        let rows = sqlx::query(
            "UPDATE jobs SET delivered_at = 1, lease_until = 60000, available_at = 60000 WHERE id IN \
             (SELECT id FROM jobs WHERE queue_name = 'jobs' AND available_at <= 1 ORDER BY available_at, id LIMIT 256) \
             RETURNING id, body",
        )
        .fetch_all(&pool)
        .await
        .map_err(|e| e.to_string())?;
        if rows.is_empty() {
            return Err(format!("baseline ran dry after {consumed} of {n}"));
        }
        let mut ids = Vec::with_capacity(rows.len());
        for row in &rows {
            let body: Vec<u8> = row.get(1);
            let job: Job = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
            std::hint::black_box(job.id);
            ids.push(row.get::<i64, _>(0));
        }
        let list = serde_json::to_string(&ids).map_err(|e| e.to_string())?;
        sqlx::query("DELETE FROM jobs WHERE id IN (SELECT value FROM json_each(?))")
            .bind(list)
            .execute(&pool)
            .await
            .map_err(|e| e.to_string())?;
        consumed += rows.len() as u64;
    }
    let elapsed = start.elapsed();
    pool.close().await;
    Ok(n as f64 / elapsed.as_secs_f64())
}
