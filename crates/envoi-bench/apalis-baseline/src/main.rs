//! The apalis 1.0 side of envoi-bench's `*_vs_apalis` scenarios.
//!
//! `apalis-baseline <sqlite|postgres|redis|amqp> --n N [--url URL | --path FILE]`
//! pushes N jobs shaped like envoi-bench's `Job` (`{"id":u64,"payload":"order-00000001"}`)
//! with the backend's bulk push, then runs one apalis worker with a no-op
//! handler until all N have been processed and acknowledged, and prints
//! `apalis_msgs_per_sec=<v>` (N divided by the time from the first push to
//! the worker's exit). Setup (connecting, migrations, queue declaration) is
//! not timed, as on envoi's side. Progress goes to stderr; any error exits
//! non-zero.
//!
//! Tuning flags (defaults in brackets): `--concurrency` [64] in-flight
//! handlers, `--batch` [256] tasks fetched per query (SQL and Redis
//! backends) or AMQP prefetch, `--producers` [4] concurrent pushers,
//! `--chunk` [1000; for amqp all of a producer's share] tasks per bulk push, `--queue-type` [quorum] of the
//! RabbitMQ queue (`quorum` or `classic`), `--overlap` [true for redis,
//! false otherwise] runs the worker while the jobs are being pushed (the
//! only way apalis-redis 1.0 gets through more than ~8,000 jobs, see
//! `run_redis`), `--poll-ms` [10] the Redis worker's poll interval,
//! `--connections` [3 for sqlite, 16 for postgres] the pool size, and
//! `--analyze` [true for sqlite] runs `ANALYZE` once the jobs are pushed,
//! off the clock (see `run_sqlite`), and `--worker` [the queue's name, unique to the run] the
//! worker's name.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use apalis::prelude::*;
use serde::{Deserialize, Serialize};

/// The job every scenario moves: the same JSON shape as envoi-bench's `Job`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Job {
    id: u64,
    payload: String,
}

fn job(id: u64) -> Job {
    Job {
        id,
        payload: format!("order-{id:08}"),
    }
}

/// The no-op handler.
async fn handle(job: Job) -> Result<(), BoxDynError> {
    std::hint::black_box(job.id);
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Sqlite,
    Postgres,
    Redis,
    Amqp,
}

#[derive(Debug, Clone)]
struct Opts {
    kind: Kind,
    n: u64,
    url: Option<String>,
    path: Option<String>,
    concurrency: usize,
    batch: usize,
    producers: u64,
    chunk: u64,
    queue_type: String,
    overlap: bool,
    max_backlog: u64,
    poll_ms: u64,
    connections: u32,
    analyze: bool,
    worker: Option<String>,
}

const USAGE: &str = "usage: apalis-baseline <sqlite|postgres|redis|amqp> --n N \
[--url URL | --path FILE] [--concurrency C] [--batch B] [--producers P] [--chunk K] \
[--queue-type quorum|classic] [--overlap true|false] [--max-backlog B] [--poll-ms MS] \
[--connections C] [--analyze true|false] [--worker NAME]";

fn parse_args(args: &[String]) -> Result<Opts, String> {
    let kind = match args.first().map(String::as_str) {
        Some("sqlite") => Kind::Sqlite,
        Some("postgres") => Kind::Postgres,
        Some("redis") => Kind::Redis,
        Some("amqp") => Kind::Amqp,
        Some(other) => return Err(format!("unknown backend `{other}`\n{USAGE}")),
        None => return Err(USAGE.to_owned()),
    };
    let mut opts = Opts {
        kind,
        n: 0,
        url: None,
        path: None,
        concurrency: 64,
        batch: 256,
        producers: 4,
        chunk: 0,
        queue_type: "quorum".to_owned(),
        // apalis-redis cannot consume a backlog of more than ~8,000 jobs
        // (see `run_redis`), so its worker runs while the jobs are pushed.
        overlap: kind == Kind::Redis,
        max_backlog: if kind == Kind::Redis { 5000 } else { 0 },
        poll_ms: 10,
        // envoi's SQLite transport has one write connection and up to two
        // for reading; its PostgreSQL side in the scenarios has 16.
        connections: if kind == Kind::Sqlite { 3 } else { 16 },
        analyze: kind == Kind::Sqlite,
        worker: None,
    };
    let mut rest = args[1..].iter();
    while let Some(flag) = rest.next() {
        let value = rest
            .next()
            .ok_or_else(|| format!("`{flag}` needs a value\n{USAGE}"))?;
        let number = || {
            value
                .parse::<u64>()
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| format!("`{flag}` needs a positive integer, got `{value}`"))
        };
        match flag.as_str() {
            "--n" => opts.n = number()?,
            "--url" => opts.url = Some(value.clone()),
            "--path" => opts.path = Some(value.clone()),
            "--concurrency" => opts.concurrency = number()? as usize,
            "--batch" => opts.batch = number()? as usize,
            "--producers" => opts.producers = number()?,
            "--chunk" => opts.chunk = number()?,
            "--overlap" if value == "true" || value == "false" => opts.overlap = value == "true",
            "--poll-ms" => opts.poll_ms = number()?,
            "--connections" => {
                opts.connections = u32::try_from(number()?)
                    .map_err(|_| format!("`--connections` is too large: `{value}`"))?
            }
            "--analyze" if value == "true" || value == "false" => opts.analyze = value == "true",
            "--worker" => opts.worker = Some(value.clone()),
            "--max-backlog" => {
                opts.max_backlog = value
                    .parse()
                    .map_err(|_| format!("`--max-backlog` needs an integer, got `{value}`"))?
            }
            "--queue-type" if value == "quorum" || value == "classic" => {
                opts.queue_type = value.clone()
            }
            other => return Err(format!("unknown flag `{other}`\n{USAGE}")),
        }
    }
    complete(opts)
}

/// Fills in the defaults that depend on other options and refuses
/// combinations that cannot run.
fn complete(mut opts: Opts) -> Result<Opts, String> {
    let kind = opts.kind;
    if opts.n == 0 {
        return Err(format!("--n is required\n{USAGE}"));
    }
    if opts.chunk == 0 {
        opts.chunk = match kind {
            // apalis-amqp 1.0 opens a channel (and declares the queue) on
            // every `poll_ready` of its sink, replacing the one the last
            // publishes went out on; publishing without confirms, it can
            // then lose the tail of the previous chunk. One `push_bulk` per
            // producer, its sink kept until the run ends, loses nothing.
            Kind::Amqp => opts.n.div_ceil(opts.producers),
            _ => 1000,
        };
    }
    if opts.analyze && kind != Kind::Sqlite {
        return Err("--analyze applies to sqlite only".into());
    }
    if opts.analyze && opts.overlap {
        return Err("--analyze runs between pushing and consuming: not with --overlap".into());
    }
    if opts.max_backlog > 0 && !opts.overlap {
        return Err(
            "--max-backlog needs --overlap true (the worker must run while pushing)".into(),
        );
    }
    match kind {
        Kind::Sqlite if opts.path.is_none() => Err("sqlite needs --path FILE".to_owned()),
        Kind::Postgres | Kind::Redis | Kind::Amqp if opts.url.is_none() => {
            Err(format!("{kind:?} needs --url URL").to_lowercase())
        }
        _ => Ok(opts),
    }
}

/// A queue name no earlier run used, so runs never see each other's jobs.
fn unique_queue() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("envoi_bench_apalis_{}_{nanos}", std::process::id())
}

/// Starts `producers` tasks that push jobs `0..n` through clones of
/// `$backend`, each sending its share with `push_bulk` in chunks of `chunk`;
/// returns their handles (see [`join_pushers`]). With `max_backlog`, a
/// chunk waits until no more than that many jobs are pushed but not yet
/// processed (`$done` counts the processed ones).
macro_rules! spawn_pushers {
    ($backend:expr, $opts:expr, $done:expr) => {{
        let opts: &Opts = $opts;
        let (n, producers, chunk, max_backlog) =
            (opts.n, opts.producers, opts.chunk, opts.max_backlog);
        let reserved = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for p in 0..producers {
            let mut sink = $backend.clone();
            let (reserved, done) = (reserved.clone(), Arc::clone(&$done));
            tasks.push(tokio::spawn(async move {
                let mut id = p * chunk;
                while id < n {
                    let end = (id + chunk).min(n);
                    if max_backlog > 0 {
                        // Reserve first, so that concurrent producers
                        // together never exceed the backlog.
                        reserved.fetch_add(end - id, Ordering::SeqCst);
                        while reserved.load(Ordering::SeqCst) - done.load(Ordering::SeqCst)
                            > max_backlog
                        {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                    sink.push_bulk((id..end).map(job).collect())
                        .await
                        .map_err(|e| format!("push failed: {e}"))?;
                    id += producers * chunk;
                }
                // Handed back and kept until the run ends: apalis-amqp
                // publishes without confirms, and closing a clone's channel
                // right away can drop its last publishes.
                Ok::<_, String>(sink)
            }));
        }
        tasks
    }};
}

/// Waits for every pusher and returns their sinks; the first error wins.
async fn join_pushers<T>(tasks: Vec<JoinHandle<Result<T, String>>>) -> Result<Vec<T>, String> {
    let mut sinks = Vec::with_capacity(tasks.len());
    for t in tasks {
        sinks.push(t.await.map_err(|e| e.to_string())??);
    }
    Ok(sinks)
}

/// Runs a worker over `$backend` until `n` tasks succeeded (then stops it and
/// waits for it to flush its acknowledgements and exit); `$done` counts
/// them. Evaluates to `Result<(), String>`.
macro_rules! consume_all {
    ($backend:expr, $opts:expr, $name:expr, $done:expr) => {
        async {
            let opts: &Opts = $opts;
            let n = opts.n;
            let done: Arc<AtomicU64> = Arc::clone(&$done);
            let failed = Arc::new(AtomicBool::new(false));
            let error = Arc::new(Mutex::new(None::<String>));
            let (d, f, e) = (done.clone(), failed.clone(), error.clone());
            let worker = WorkerBuilder::new($name)
                .backend($backend)
                .concurrency(opts.concurrency)
                .on_event(move |ctx, ev| match ev {
                    Event::Success(_) => {
                        let processed = d.fetch_add(1, Ordering::SeqCst) + 1;
                        if processed == n {
                            let _ = ctx.stop();
                        }
                    }
                    Event::Error(err) => {
                        if let Ok(mut slot) = e.lock() {
                            slot.get_or_insert_with(|| err.to_string());
                        }
                        f.store(true, Ordering::SeqCst);
                        let _ = ctx.stop();
                    }
                    _ => {}
                })
                .build(handle);
            // Progress for long runs; a run that makes no progress for a
            // minute fails instead of hanging.
            let watchdog = {
                let done = done.clone();
                async move {
                    let mut last = 0;
                    let mut still = 0;
                    loop {
                        tokio::time::sleep(Duration::from_secs(10)).await;
                        let now = done.load(Ordering::SeqCst);
                        eprintln!("  apalis: {now} of {n} processed");
                        still = if now == last { still + 1 } else { 0 };
                        last = now;
                        if still == 6 {
                            return now;
                        }
                    }
                }
            };
            tokio::select! {
                ran = worker.run() => ran.map_err(|e| format!("worker failed: {e}"))?,
                stalled_at = watchdog => {
                    let hint = "jobs lost by the backend?";
                    return Err(format!(
                        "worker stalled at {stalled_at} of {n} jobs for a minute ({hint})"
                    ));
                }
            }
            if failed.load(Ordering::SeqCst) {
                let msg = error
                    .lock()
                    .ok()
                    .and_then(|mut s| s.take())
                    .unwrap_or_default();
                return Err(format!("a job failed: {msg}"));
            }
            let got = done.load(Ordering::SeqCst);
            if got != n {
                return Err(format!("worker processed {got} of {n} jobs"));
            }
            Ok::<(), String>(())
        }
    };
}

/// Times push + consume: pushes everything, then consumes it with a worker
/// over `$worker` (with `opts.overlap`, runs the worker while pushing).
/// `$between` (a future of `Result<(), String>`) runs after the pushes and
/// before the worker starts, off the clock (maintenance, not work per job).
/// Returns (seconds spent pushing before the worker started, if it waited;
/// total seconds).
macro_rules! timed_round_trip {
    ($backend:expr, $worker:expr, $opts:expr, $name:expr) => {
        timed_round_trip!($backend, $worker, $opts, $name, async {
            Ok::<(), String>(())
        })
    };
    ($backend:expr, $worker:expr, $opts:expr, $name:expr, $between:expr) => {{
        let opts: &Opts = $opts;
        let done = Arc::new(AtomicU64::new(0));
        let mut start = Instant::now();
        let pushers = spawn_pushers!($backend, opts, done);
        let (pushed, pushers, mut sinks) = if opts.overlap {
            (None, pushers, Vec::new())
        } else {
            let sinks = join_pushers(pushers).await?;
            let pushed = start.elapsed();
            let paused = Instant::now();
            $between.await?;
            // The clock goes on from where it stopped.
            start = Instant::now().checked_sub(pushed).unwrap_or(start);
            let off = paused.elapsed().as_secs_f64();
            if off >= 0.001 {
                eprintln!("  apalis: {off:.3}s between pushing and consuming, not timed");
            }
            (Some(pushed.as_secs_f64()), Vec::new(), sinks)
        };
        let consumed = consume_all!($worker, opts, $name, done).await;
        if consumed.is_err() {
            for p in &pushers {
                p.abort();
            }
        }
        consumed?;
        sinks.extend(join_pushers(pushers).await?);
        let total = start.elapsed().as_secs_f64();
        drop(sinks);
        (pushed, total)
    }};
}

/// apalis-sqlite's `setup` sets its pragmas (WAL, `synchronous = OFF`,
/// an in-memory temp store, a 64,000-page cache, a journal size limit)
/// with one statement each on the pool, which reaches one pooled
/// connection only; here every connection opens with them.
///
/// Its statements are planned with whatever statistics `ANALYZE` last
/// gathered. Without any, SQLite plans the acknowledgement (`UPDATE Jobs …
/// WHERE Jobs.id = j.task_id AND Jobs.lock_by = ?`) as a search of the
/// `lock_by` index, which every job this worker fetched shares, so each
/// acknowledgement walks all of them and the run time grows with the
/// square of N. With `--analyze` (the default here) `ANALYZE` runs once the
/// jobs are pushed, off the clock, as the periodic maintenance of a
/// database in service would. That fixes the plan when the statistics show
/// more jobs done under the worker's name than jobs pending (measured with
/// SQLite 3.51: 14,000 rows of which 4,000 pending, or 45,000 of which
/// 20,000, planned key lookups; 10,000 of which 8,000, or 105,000 of which
/// 100,000, kept the `lock_by` search), as in a database in service, whose
/// history outgrows its backlog. envoi-bench therefore runs
/// `sqlite_vs_apalis` on one file, under one worker name (`--worker`),
/// after giving it such a history.
async fn run_sqlite(opts: &Opts) -> Result<(Option<f64>, f64), String> {
    use apalis_sqlite::{Config, SqliteConnectOptions, SqlitePoolOptions, SqliteStorage};
    use sqlx::sqlite::{SqliteJournalMode, SqliteSynchronous};

    let path = opts.path.as_deref().unwrap_or_default();
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .busy_timeout(Duration::from_secs(30))
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Off)
        .pragma("temp_store", "MEMORY")
        .pragma("cache_size", "64000")
        .pragma("journal_size_limit", "67108864");
    let pool = SqlitePoolOptions::new()
        .max_connections(opts.connections)
        .connect_with(options)
        .await
        .map_err(|e| format!("cannot open {path}: {e}"))?;
    SqliteStorage::setup(&pool)
        .await
        .map_err(|e| format!("setup failed: {e}"))?;
    let queue = unique_queue();
    let config = Config::default().queue(&queue).batch_size(opts.batch);
    let backend: SqliteStorage<Job> = SqliteStorage::new(&pool).with_config(config);
    let worker = opts.worker.clone().unwrap_or_else(|| queue.clone());
    let analyze = async {
        if opts.analyze {
            sqlx::query("ANALYZE")
                .execute(&pool)
                .await
                .map_err(|e| format!("ANALYZE failed: {e}"))?;
        }
        Ok::<(), String>(())
    };
    let times = timed_round_trip!(backend, backend.clone(), opts, worker.as_str(), analyze);
    // The worker is gone: a run started right after may take its name
    // (apalis refuses a name whose worker was seen within the heartbeat
    // interval).
    sqlx::query("UPDATE Workers SET last_seen = 0 WHERE id = ?")
        .bind(&worker)
        .execute(&pool)
        .await
        .map_err(|e| format!("retiring worker {worker}: {e}"))?;
    let done: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM Jobs WHERE job_type = ? AND status = 'Done'")
            .bind(&queue)
            .fetch_one(&pool)
            .await
            .map_err(|e| format!("verification query failed: {e}"))?;
    check_done(done, opts.n)?;
    pool.close().await;
    Ok(times)
}

/// Connects to a database of its own (`envoi_bench_apalis`, created on first
/// use) on the server `url` points at, so apalis's schema and migration table
/// stay out of the test database; uses `url` itself if it cannot create one.
async fn postgres_pool(url: &str, connections: u32) -> Result<apalis_postgres::PgPool, String> {
    use apalis_postgres::{PgConnectOptions, PgPool};
    use sqlx::ConnectOptions;

    let base: PgConnectOptions = url.parse().map_err(|e| format!("bad postgres url: {e}"))?;
    let admin = PgPool::connect_with(base.clone())
        .await
        .map_err(|e| format!("cannot connect to postgres: {e}"))?;
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'envoi_bench_apalis')",
    )
    .fetch_one(&admin)
    .await
    .map_err(|e| format!("postgres query failed: {e}"))?;
    let created = exists
        || sqlx::query("CREATE DATABASE envoi_bench_apalis")
            .execute(&admin)
            .await
            .is_ok();
    admin.close().await;
    let options = if created {
        base.database("envoi_bench_apalis")
    } else {
        eprintln!("  apalis: cannot create database envoi_bench_apalis, using {url}");
        base
    };
    let options = options.log_statements(log::LevelFilter::Off);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .connect_with(options)
        .await
        .map_err(|e| format!("cannot connect to postgres: {e}"))
}

async fn run_postgres(opts: &Opts) -> Result<(Option<f64>, f64), String> {
    use apalis_postgres::{Config, PostgresStorage};

    let pool = postgres_pool(opts.url.as_deref().unwrap_or_default(), opts.connections).await?;
    PostgresStorage::setup(&pool)
        .await
        .map_err(|e| format!("setup failed: {e}"))?;
    let queue = unique_queue();
    let config = Config::default().queue(&queue).batch_size(opts.batch);
    let backend: PostgresStorage<Job> = PostgresStorage::new(&pool).with_config(config);
    let result = async {
        let times = timed_round_trip!(backend, backend.clone(), opts, queue.as_str());
        let done: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM apalis.jobs WHERE job_type = $1 AND status = 'Done'",
        )
        .bind(&queue)
        .fetch_one(&pool)
        .await
        .map_err(|e| format!("verification query failed: {e}"))?;
        check_done(done, opts.n)?;
        Ok::<_, String>(times)
    }
    .await;
    // Leave nothing behind whatever happened.
    let _ = sqlx::query("DELETE FROM apalis.jobs WHERE job_type = $1")
        .bind(&queue)
        .execute(&pool)
        .await;
    let _ = sqlx::query("DELETE FROM apalis.workers WHERE id = $1")
        .bind(&queue)
        .execute(&pool)
        .await;
    pool.close().await;
    result
}

/// apalis-redis 1.0 stores every pushed job in its scheduled set (run at
/// "now"), and each fetch moves all due jobs to the active list with one
/// `RPUSH key unpack(ids)` in a Lua script, which fails with "too many
/// results to unpack" past Lua's ~8,000 stack slots. A backlog of 20,000
/// pushed jobs therefore cannot be consumed at all; with the worker running
/// while the jobs are pushed, each fetch moves only what arrived since the
/// last one. The worker polls every `--poll-ms` (10 ms) when it finds the
/// queue empty.
async fn run_redis(opts: &Opts) -> Result<(Option<f64>, f64), String> {
    use apalis_redis::{Config, RedisStorage};

    let url = opts.url.as_deref().unwrap_or_default();
    let conn = apalis_redis::connect(url)
        .await
        .map_err(|e| format!("cannot connect to redis: {e}"))?;
    let queue = unique_queue();
    let config = Config::default().queue(&queue).batch_size(opts.batch);
    let backend: RedisStorage<Job> = RedisStorage::new(conn.clone()).with_config(config);
    let result = async {
        // Jobs arriving while the worker waits on an empty queue are picked
        // up at the next poll.
        let worker = backend
            .clone()
            .poll_with_interval(Duration::from_millis(opts.poll_ms));
        let times = timed_round_trip!(backend, worker, opts, queue.as_str());
        let mut c = conn.clone();
        let done: i64 = redis::cmd("SCARD")
            .arg(format!("{queue}:done"))
            .query_async(&mut c)
            .await
            .map_err(|e| format!("verification query failed: {e}"))?;
        check_done(done, opts.n)?;
        Ok::<_, String>(times)
    }
    .await;
    // Leave nothing behind whatever happened.
    let mut c = conn.clone();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{queue}:*"))
        .query_async(&mut c)
        .await
        .unwrap_or_default();
    for chunk in keys.chunks(500) {
        let _: Result<i64, _> = redis::cmd("DEL").arg(chunk).query_async(&mut c).await;
    }
    // apalis's registry of queues.
    let _: Result<i64, _> = redis::cmd("ZREM")
        .arg("core:apalis:queues:list")
        .arg(format!("{queue}:workers"))
        .query_async(&mut c)
        .await;
    result
}

async fn run_amqp(opts: &Opts) -> Result<(Option<f64>, f64), String> {
    use apalis_amqp::{AmqpBackend, Config};

    let url = opts.url.as_deref().unwrap_or_default();
    let queue = unique_queue();
    let prefetch = u16::try_from(opts.batch).unwrap_or(u16::MAX);
    let mut config = Config::default()
        .queue(queue.as_str())
        .prefetch_count(prefetch);
    // The queue type envoi's side uses (its default): quorum, unless asked
    // otherwise. Quorum queues store every message durably.
    config.declare_arguments.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString(opts.queue_type.as_str().into()),
    );
    let mut backend: AmqpBackend<Job> = AmqpBackend::new_from_addr(url)
        .map_err(|e| format!("bad amqp url: {e}"))?
        .with_config(config);
    // Declare the queue before the clock starts. This also gives the
    // worker's backend its channel: apalis-amqp 1.0's worker only starts a
    // consumer on a backend that already has one (one that pushed), and
    // panics in `poll_next` otherwise.
    futures::future::poll_fn(|cx| {
        futures::Sink::<apalis_amqp::AmqpTask>::poll_ready(std::pin::Pin::new(&mut backend), cx)
    })
    .await
    .map_err(|e| format!("cannot declare queue: {e}"))?;
    let result = async {
        Ok::<_, String>(timed_round_trip!(
            backend,
            backend.clone(),
            opts,
            queue.as_str()
        ))
    }
    .await;
    // Leave nothing behind whatever happened.
    if let Ok(conn) = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await
    {
        if let Ok(channel) = conn.create_channel().await {
            let _ = channel
                .queue_delete(
                    queue.as_str().into(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await;
        }
        let _ = conn.close(200, "bye".into()).await;
    }
    result
}

fn check_done(done: i64, n: u64) -> Result<(), String> {
    if u64::try_from(done).ok() == Some(n) {
        Ok(())
    } else {
        Err(format!("backend records {done} of {n} jobs as done"))
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("apalis-baseline: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match opts.kind {
            Kind::Sqlite => run_sqlite(&opts).await,
            Kind::Postgres => run_postgres(&opts).await,
            Kind::Redis => run_redis(&opts).await,
            Kind::Amqp => run_amqp(&opts).await,
        }
    });
    match result {
        Ok((pushed, total)) => {
            match pushed {
                Some(pushed) => eprintln!(
                    "  apalis: pushed {} in {pushed:.2}s, consumed in {:.2}s",
                    opts.n,
                    total - pushed
                ),
                None => eprintln!(
                    "  apalis: pushed and consumed {} concurrently in {total:.2}s",
                    opts.n
                ),
            }
            println!("apalis_msgs_per_sec={:.1}", opts.n as f64 / total);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("apalis-baseline: {e}");
            ExitCode::FAILURE
        }
    }
}
