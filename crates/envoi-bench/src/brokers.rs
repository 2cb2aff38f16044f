//! Broker end-to-end scenarios: the same round trip as
//! [`envoi_round_trip`] — N jobs sent by [`PRODUCERS`] concurrent
//! dispatchers, then consumed by the real worker — on PostgreSQL, Redis
//! Streams, RabbitMQ and NATS JetStream, each against the raw client doing
//! the minimum equivalent work in the same run: the same N, the same JSON
//! bodies (with the `type` and `kind` headers envoi adds), [`PRODUCERS`]
//! concurrent senders that each wait for their message to be stored, then
//! batched reads with acknowledgements.
//!
//! Tuning, the same on both sides of each scenario:
//!
//! * Worker: concurrency 64 (the handler is a no-op counter, so this only
//!   bounds how many dispatches are interleaved) and a batch of [`BATCH`]:
//!   one `get` asks for that many messages and the acknowledgements go out
//!   as one `ack_batch` once the batch is handled.
//! * PostgreSQL: `batch=500` (rows per claim), `max_connections=16` for
//!   both pools, so both sides commit up to 16 inserts at once.
//! * Redis: `XREADGROUP COUNT 500`; both sides send on one multiplexed
//!   connection.
//! * RabbitMQ: quorum queues (envoi's default) on both sides, persistent
//!   messages, `prefetch=1000` so the broker keeps two batches in flight.
//! * NATS: file storage (envoi's default), `batch=500` per pull request,
//!   unlimited `max_ack_pending` on both consumers.
//!
//! Each scenario uses unique table / stream / queue names and removes them
//! at the end, whether the run succeeded or not. Without its URL variable
//! a scenario prints `<scenario>: skipped: ENVOI_X_URL is not set` and
//! succeeds.
//!
//! `ENVOI_BENCH_ROUNDS=r` runs each side `r` times, alternating, and keeps
//! each side's best round (a shared machine is noisy; one round by default).
//!
//! Besides the summary line, each side reports on stderr how long it took
//! to send and to consume, the CPU this process used and its allocations
//! per message (plus the broker's CPU when `ENVOI_BENCH_SERVER_PIDS` lists
//! the broker's process ids, comma-separated), and the envoi side how the
//! worker fetched and acknowledged: how many `get`s, how full, and the time
//! spent in `get` and `ack_batch`. They tell a transport that lacks batching
//! from a client that is short of CPU.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use std::sync::atomic::{AtomicU64, Ordering};

use envoi_core::middleware::BoxFuture;
use envoi_core::transport::{
    Browse, Delivery, DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown,
    Transport, TransportBinding, WakeUp,
};
use envoi_core::TransportError;
use futures_util::StreamExt;

use crate::e2e::{
    envoi_round_trip, job, job_messenger, n_messages, peak_rss_mb, rounds, runtime, warmup, Job,
    PRODUCERS,
};
use crate::report;

/// Messages per fetch and per acknowledgement batch, envoi and baselines.
const BATCH: usize = 500;
/// How many messages the worker handles at once.
const CONCURRENCY: usize = 64;
/// Pool size of both PostgreSQL sides.
const PG_CONNECTIONS: u32 = 16;
/// RabbitMQ prefetch of both consumers.
const AMQP_PREFETCH: u16 = 1000;
/// The headers envoi's serializer adds to every [`Job`].
const TYPE: &str = "Job";
const KIND: &str = "command";

/// The broker URL in `var`, or `None` after printing the skip line.
fn broker_url(scenario: &str, var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            println!("{scenario}: skipped: {var} is not set");
            None
        }
    }
}

/// A lower-case suffix unique to this run: process id and clock.
fn unique() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}_{}", std::process::id(), nanos % 1_000_000_000_000)
}

/// `url` with `options` appended to its query string.
fn with_options(url: &str, options: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{options}")
}

fn body(id: u64) -> Result<Vec<u8>, String> {
    serde_json::to_vec(&job(id)).map_err(|e| e.to_string())
}

/// Decodes a consumed body the way the worker does, so the baseline pays
/// for it too.
fn consume_body(bytes: &[u8]) -> Result<(), String> {
    let job: Job = serde_json::from_slice(bytes).map_err(|e| format!("bad body: {e}"))?;
    std::hint::black_box(job.id);
    Ok(())
}

/// Runs `send(id)` for every id below `n` on [`PRODUCERS`] concurrent tasks,
/// each awaiting its send before the next.
async fn send_all<F, Fut>(n: u64, send: F) -> Result<(), String>
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<(), String>> + Send,
{
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let send = send.clone();
        producers.push(tokio::spawn(async move {
            let mut id = p;
            while id < n {
                send(id).await?;
                id += PRODUCERS;
            }
            Ok::<_, String>(())
        }));
    }
    for p in producers {
        p.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

/// CPU seconds used so far by process `pid` (`self` for this one), from
/// `/proc/<pid>/stat`; `None` where that cannot be read.
fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let mut fields = rest.split_whitespace().skip(11);
    let user: f64 = fields.next()?.parse().ok()?;
    let system: f64 = fields.next()?.parse().ok()?;
    Some((user + system) / 100.0)
}

/// CPU used by this process (and by the server processes listed in
/// `ENVOI_BENCH_SERVER_PIDS`, if any) between its creation and
/// [`Meter::report`].
struct Meter {
    allocations: stats_alloc::Region<'static, std::alloc::System>,
    client: Option<f64>,
    servers: Vec<(String, Option<f64>)>,
}

impl Meter {
    fn start() -> Self {
        let servers = std::env::var("ENVOI_BENCH_SERVER_PIDS")
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| (p.to_string(), cpu_seconds(p)))
            .collect();
        Self {
            allocations: stats_alloc::Region::new(&stats_alloc::INSTRUMENTED_SYSTEM),
            client: cpu_seconds("self"),
            servers,
        }
    }

    fn report(&self, side: &str, n: u64) {
        let used = |pid: &str, before: Option<f64>| {
            cpu_seconds(pid)
                .zip(before)
                .map_or("?".to_string(), |(a, b)| format!("{:.2}s", a - b))
        };
        let change = self.allocations.change();
        let allocations = change.allocations + change.reallocations;
        let mut line = format!(
            "  {side}: client cpu {}, {:.1} allocations/msg",
            used("self", self.client),
            allocations as f64 / n.max(1) as f64
        );
        if !self.servers.is_empty() {
            let total: Option<f64> = self
                .servers
                .iter()
                .map(|(pid, before)| cpu_seconds(pid).zip(*before).map(|(a, b)| a - b))
                .sum();
            line.push_str(&format!(
                ", server cpu {}",
                total.map_or("?".to_string(), |t| format!("{t:.2}s"))
            ));
        }
        eprintln!("{line}");
    }
}

/// Awaits `run`, then reports the CPU it used (see [`Meter`]).
async fn metered<T>(side: &str, n: u64, run: impl Future<Output = T>) -> T {
    let meter = Meter::start();
    let value = run.await;
    meter.report(side, n);
    value
}

fn log_baseline(n: u64, start: Instant, sent: Duration) {
    let total = start.elapsed();
    eprintln!(
        "  baseline: sent {n} in {:.2}s, consumed in {:.2}s",
        sent.as_secs_f64(),
        (total - sent).as_secs_f64()
    );
}

/// Runs `body`, then `cleanup` whatever happened; the first error wins.
async fn and_then_clean<T>(
    body: impl Future<Output = Result<T, String>>,
    cleanup: impl Future<Output = Result<(), String>>,
) -> Result<T, String> {
    let result = body.await;
    let cleaned = cleanup.await;
    let value = result?;
    cleaned?;
    Ok(value)
}

/// Removes what `transport` created (its [`Teardown::delete`]), then awaits
/// `close`, the transport's own `close()`. A failed delete is the error;
/// closing only gives back what was read ahead of a run that is over, so
/// its outcome is not.
pub(crate) async fn delete_then_close(
    transport: &dyn Teardown,
    close: impl Future<Output = Result<(), TransportError>>,
) -> Result<(), String> {
    let deleted = transport.delete().await.map_err(|e| e.to_string());
    let _ = close.await;
    deleted
}

/// `ENVOI_BENCH_ONLY`: `envoi` or `baseline` runs only that side of a
/// broker scenario, once and without a warm-up, to profile it.
fn only_side() -> Result<Option<String>, String> {
    match std::env::var("ENVOI_BENCH_ONLY") {
        Err(_) => Ok(None),
        Ok(side) if side == "envoi" || side == "baseline" => Ok(Some(side)),
        Ok(other) => Err(format!(
            "ENVOI_BENCH_ONLY must be `envoi` or `baseline`, not `{other}`"
        )),
    }
}

/// One side of a scenario: moves `n` messages through the broker at the
/// URL and returns messages per second.
type Side =
    for<'a> fn(&'a str, u64) -> std::pin::Pin<Box<dyn Future<Output = Result<f64, String>> + 'a>>;

/// A broker scenario: its name, the variable holding the broker's URL, and
/// its two sides.
struct Broker {
    scenario: &'static str,
    url_var: &'static str,
    envoi: Side,
    baseline: Side,
}

/// Runs both sides of `broker` [`rounds`] times, alternating, and prints
/// the summary line with the best round of each.
fn run_scenario(broker: Broker) -> Result<(), String> {
    let Some(url) = broker_url(broker.scenario, broker.url_var) else {
        return Ok(());
    };
    let n = n_messages();
    let rounds = rounds();
    let warmup = warmup(n);
    if let Some(side) = only_side()? {
        // A profiling aid: one side, once, and no summary line.
        let run = if side == "envoi" {
            broker.envoi
        } else {
            broker.baseline
        };
        let rate = runtime()?.block_on(run(&url, n))?;
        println!("{}: only {side}: {rate:.0}msg/s n={n}", broker.scenario);
        return Ok(());
    }
    runtime()?.block_on(async {
        if warmup > 0 {
            (broker.envoi)(&url, warmup).await?;
            (broker.baseline)(&url, warmup).await?;
        }
        let (mut envoi, mut baseline, mut rss) = (0.0f64, 0.0f64, None);
        for _ in 0..rounds {
            envoi = envoi.max((broker.envoi)(&url, n).await?);
            // The envoi side's footprint, before the baseline adds to it.
            rss.get_or_insert_with(peak_rss_mb);
            baseline = baseline.max(metered("baseline", n, (broker.baseline)(&url, n)).await?);
        }
        report::line(
            broker.scenario,
            envoi,
            baseline,
            "msg/s",
            &[
                ("peak_rss_mb", format!("{:.0}", rss.unwrap_or(0.0))),
                ("n", n.to_string()),
                ("rounds", rounds.to_string()),
                ("warmup", warmup.to_string()),
            ],
        );
        Ok(())
    })
}

// ----- PostgreSQL -------------------------------------------------------

/// `postgres_e2e`: the PostgreSQL transport against plain sqlx statements
/// on the same schema.
pub(crate) fn postgres() -> Result<(), String> {
    run_scenario(Broker {
        scenario: "postgres_e2e",
        url_var: "ENVOI_POSTGRES_URL",
        envoi: |url, n| Box::pin(postgres_envoi(url, n)),
        baseline: |url, n| Box::pin(postgres_baseline(url, n)),
    })
}

async fn postgres_envoi(url: &str, n: u64) -> Result<f64, String> {
    let table = format!("envoi_bench_{}", unique());
    let dsn = with_options(
        url,
        &format!("table={table}&batch={BATCH}&max_connections={PG_CONNECTIONS}"),
    );
    let transport = envoi_postgres::PostgresTransport::connect("jobs", &dsn)
        .await
        .map_err(|e| e.to_string())?;
    and_then_clean(
        async {
            transport.setup().await.map_err(|e| e.to_string())?;
            envoi_side(Arc::new(transport.clone()), n).await
        },
        // The table is this run's own: deleting the queue drops it.
        delete_then_close(&transport, transport.close()),
    )
    .await
}

/// [`PRODUCERS`] concurrent single-row `INSERT`s on envoi's schema, then
/// claims of [`BATCH`] rows (`UPDATE … WHERE id = ANY(ARRAY(SELECT … FOR
/// UPDATE SKIP LOCKED)) RETURNING`) each followed by one `DELETE`.
async fn postgres_baseline(url: &str, n: u64) -> Result<f64, String> {
    use sqlx::postgres::PgPoolOptions;
    use sqlx::{AssertSqlSafe, Row};

    let table: &str = &format!("envoi_bench_{}_raw", unique());
    let pool = PgPoolOptions::new()
        .max_connections(PG_CONNECTIONS)
        .test_before_acquire(false)
        .connect(url)
        .await
        .map_err(|e| format!("connecting to postgres: {e}"))?;
    let t = format!("\"{table}\"");
    let run = async {
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE {t} (id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, \
             queue_name TEXT NOT NULL, body BYTEA NOT NULL, headers JSONB NOT NULL DEFAULT '{{}}', \
             created_at TIMESTAMPTZ NOT NULL DEFAULT now(), \
             available_at TIMESTAMPTZ NOT NULL DEFAULT now(), leased_until TIMESTAMPTZ, \
             delivery_count INTEGER NOT NULL DEFAULT 0)"
        )))
        .execute(&pool)
        .await
        .map_err(|e| e.to_string())?;
        sqlx::query(AssertSqlSafe(format!(
            "CREATE INDEX \"{table}_idx\" ON {t} (queue_name, available_at, id)"
        )))
        .execute(&pool)
        .await
        .map_err(|e| e.to_string())?;
        let headers = format!(r#"{{"kind":"{KIND}","type":"{TYPE}"}}"#);
        let insert: Arc<str> =
            format!("INSERT INTO {t} (queue_name, body, headers) VALUES ('jobs', $1, $2::jsonb)")
                .into();
        let claim: Arc<str> = format!(
            "UPDATE {t} SET leased_until = now() + interval '300 seconds', \
             delivery_count = delivery_count + 1 WHERE id = ANY(ARRAY(\
             SELECT id FROM {t} WHERE queue_name = 'jobs' AND available_at <= now() \
             AND (leased_until IS NULL OR leased_until <= now()) \
             ORDER BY available_at, id LIMIT $1 FOR UPDATE SKIP LOCKED)) RETURNING id, body"
        )
        .into();
        let delete: Arc<str> = format!("DELETE FROM {t} WHERE id = ANY($1)").into();

        let start = Instant::now();
        let (p, h, i) = (pool.clone(), Arc::<str>::from(headers), insert);
        send_all(n, move |id| {
            let (pool, headers, insert) = (p.clone(), h.clone(), i.clone());
            async move {
                sqlx::query(AssertSqlSafe(insert))
                    .bind(body(id)?)
                    .bind(&*headers)
                    .execute(&pool)
                    .await
                    .map(drop)
                    .map_err(|e| format!("insert failed: {e}"))
            }
        })
        .await?;
        let sent = start.elapsed();
        let mut consumed = 0u64;
        while consumed < n {
            let rows = sqlx::query(AssertSqlSafe(claim.clone()))
                .bind(BATCH as i64)
                .fetch_all(&pool)
                .await
                .map_err(|e| format!("claim failed: {e}"))?;
            if rows.is_empty() {
                return Err(format!("baseline ran dry after {consumed} of {n}"));
            }
            let mut ids = Vec::with_capacity(rows.len());
            for row in &rows {
                consume_body(row.get::<&[u8], _>(1))?;
                ids.push(row.get::<i64, _>(0));
            }
            sqlx::query(AssertSqlSafe(delete.clone()))
                .bind(&ids)
                .execute(&pool)
                .await
                .map_err(|e| format!("delete failed: {e}"))?;
            consumed += rows.len() as u64;
        }
        log_baseline(n, start, sent);
        Ok(n as f64 / start.elapsed().as_secs_f64())
    };
    let drop_table = async {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
            .execute(&pool)
            .await
            .map(drop)
            .map_err(|e| format!("dropping table {table}: {e}"))
    };
    let result = and_then_clean(run, drop_table).await;
    pool.close().await;
    result
}

// ----- Probe ------------------------------------------------------------

/// Counts what the worker asks of the transport (fetches, their sizes and
/// durations, acknowledgement batches), so a slow run shows whether it
/// lacks batching or spends its time elsewhere. Sends go straight through.
///
/// `T` is the transport itself, which is its own [`Receiver`] (as every
/// broker transport is), so the probe delegates to it directly.
struct Probe<T> {
    inner: Arc<T>,
    gets: AtomicU64,
    empty_gets: AtomicU64,
    fetched: AtomicU64,
    get_nanos: AtomicU64,
    ack_batches: AtomicU64,
    ack_nanos: AtomicU64,
}

type Fut<'a, T> = BoxFuture<'a, Result<T, TransportError>>;

impl<T> Probe<T> {
    fn new(inner: Arc<T>) -> Self {
        Self {
            inner,
            gets: AtomicU64::new(0),
            empty_gets: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            get_nanos: AtomicU64::new(0),
            ack_batches: AtomicU64::new(0),
            ack_nanos: AtomicU64::new(0),
        }
    }

    fn report(&self) {
        let gets = self.gets.load(Ordering::Relaxed);
        eprintln!(
            "  envoi: {gets} gets ({} empty, {:.0} messages each, {:.2}s), \
             {} ack batches ({:.2}s)",
            self.empty_gets.load(Ordering::Relaxed),
            self.fetched.load(Ordering::Relaxed) as f64 / gets.max(1) as f64,
            self.get_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            self.ack_batches.load(Ordering::Relaxed),
            self.ack_nanos.load(Ordering::Relaxed) as f64 / 1e9,
        );
    }
}

fn nanos_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Sends go straight to the wrapped transport; its receiving side is the
/// probe's own (counted), every other ability is the wrapped transport's.
impl<T: Transport + Receiver> Transport for Probe<T> {
    fn send(&self, message: RawMessage, delay: Option<Duration>) -> Fut<'_, String> {
        self.inner.send(message, delay)
    }

    fn as_receiver(&self) -> Option<&dyn Receiver> {
        Some(self)
    }

    fn as_keepalive(&self) -> Option<&dyn Keepalive> {
        self.inner.as_keepalive()
    }

    fn as_setup(&self) -> Option<&dyn Setup> {
        self.inner.as_setup()
    }

    fn as_message_count(&self) -> Option<&dyn MessageCount> {
        self.inner.as_message_count()
    }

    fn as_browse(&self) -> Option<&dyn Browse> {
        self.inner.as_browse()
    }

    fn as_teardown(&self) -> Option<&dyn Teardown> {
        self.inner.as_teardown()
    }

    fn as_wake_up(&self) -> Option<&dyn WakeUp> {
        self.inner.as_wake_up()
    }

    fn bind(&self, binding: &TransportBinding) {
        self.inner.bind(binding);
    }
}

impl<T: Transport + Receiver> Receiver for Probe<T> {
    fn get(&self, max: usize) -> Fut<'_, Vec<Delivery>> {
        Box::pin(async move {
            let start = Instant::now();
            let got = self.inner.get(max).await;
            self.get_nanos
                .fetch_add(nanos_since(start), Ordering::Relaxed);
            self.gets.fetch_add(1, Ordering::Relaxed);
            if let Ok(batch) = &got {
                if batch.is_empty() {
                    self.empty_gets.fetch_add(1, Ordering::Relaxed);
                }
                self.fetched
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
            }
            got
        })
    }

    fn ack<'a>(&'a self, id: &'a DeliveryId) -> Fut<'a, ()> {
        self.inner.ack(id)
    }

    fn ack_batch<'a>(&'a self, ids: &'a [DeliveryId]) -> Fut<'a, ()> {
        Box::pin(async move {
            let start = Instant::now();
            let acked = self.inner.ack_batch(ids).await;
            self.ack_nanos
                .fetch_add(nanos_since(start), Ordering::Relaxed);
            self.ack_batches.fetch_add(1, Ordering::Relaxed);
            acked
        })
    }

    fn reject<'a>(&'a self, id: &'a DeliveryId) -> Fut<'a, ()> {
        self.inner.reject(id)
    }

    fn release<'a>(&'a self, id: &'a DeliveryId) -> Fut<'a, ()> {
        self.inner.release(id)
    }
}

/// [`envoi_round_trip`] on `transport` (behind a [`Probe`]), metered.
async fn envoi_side<T: Transport + Receiver>(transport: Arc<T>, n: u64) -> Result<f64, String> {
    let probe = Arc::new(Probe::new(transport));
    let (messenger, handled) = job_messenger("jobs", probe.clone())?;
    let rate = metered(
        "envoi",
        n,
        envoi_round_trip(&messenger, "jobs", &handled, n, CONCURRENCY, BATCH),
    )
    .await;
    probe.report();
    rate
}

// ----- Redis ------------------------------------------------------------

/// `redis_e2e`: the Redis Streams transport against raw `XADD`,
/// `XREADGROUP` and `XACK`.
pub(crate) fn redis() -> Result<(), String> {
    run_scenario(Broker {
        scenario: "redis_e2e",
        url_var: "ENVOI_REDIS_URL",
        envoi: |url, n| Box::pin(redis_envoi(url, n)),
        baseline: |url, n| Box::pin(redis_baseline(url, n)),
    })
}

async fn redis_envoi(url: &str, n: u64) -> Result<f64, String> {
    let stream = format!("envoi-bench:{}", unique());
    let dsn = with_options(url, &format!("stream={stream}&group=bench"));
    let transport = Arc::new(
        envoi_redis::RedisTransport::connect("jobs", &dsn)
            .await
            .map_err(|e| e.to_string())?,
    );
    and_then_clean(
        async {
            transport.setup().await.map_err(|e| e.to_string())?;
            envoi_side(transport.clone(), n).await
        },
        delete_then_close(&*transport, transport.close()),
    )
    .await
}

/// The `headers` field of the baseline's entries: [`KIND`] and [`TYPE`]
/// laid out as envoi's Redis transport lays out headers (netstrings, name
/// then value), written once rather than per message.
const REDIS_HEADERS: &str = "4:kind7:command4:type3:Job";

/// Entries of one `XREADGROUP` reply: `[[stream, [[id, [field, value, …]], …]]]`.
type StreamReply = Option<Vec<(String, Vec<(String, Vec<Vec<u8>>)>)>>;

/// [`PRODUCERS`] concurrent `XADD`s of a `body` and a `headers` field (the
/// layout of envoi's entries) on one multiplexed connection, then
/// `XREADGROUP COUNT` [`BATCH`] each followed by one `XACK` of the batch.
async fn redis_baseline(url: &str, n: u64) -> Result<f64, String> {
    let stream: &str = &format!("envoi-bench:{}:raw", unique());
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("connecting to redis: {e}"))?;
    let run = async {
        let mut c = conn.clone();
        redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg("bench")
            .arg("0")
            .arg("MKSTREAM")
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| e.to_string())?;

        let start = Instant::now();
        let (key, sender): (Arc<str>, _) = (stream.into(), conn.clone());
        send_all(n, move |id| {
            let (key, mut c) = (key.clone(), sender.clone());
            async move {
                redis::cmd("XADD")
                    .arg(&*key)
                    .arg("*")
                    .arg("body")
                    .arg(body(id)?)
                    .arg("headers")
                    .arg(REDIS_HEADERS)
                    .query_async::<String>(&mut c)
                    .await
                    .map(drop)
                    .map_err(|e| format!("XADD failed: {e}"))
            }
        })
        .await?;
        let sent = start.elapsed();
        let mut consumed = 0u64;
        while consumed < n {
            let reply: StreamReply = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg("bench")
                .arg("raw")
                .arg("COUNT")
                .arg(BATCH)
                .arg("STREAMS")
                .arg(stream)
                .arg(">")
                .query_async(&mut c)
                .await
                .map_err(|e| format!("XREADGROUP failed: {e}"))?;
            let entries: Vec<_> = reply
                .into_iter()
                .flatten()
                .flat_map(|(_, entries)| entries)
                .collect();
            if entries.is_empty() {
                return Err(format!("baseline ran dry after {consumed} of {n}"));
            }
            let mut ack = redis::cmd("XACK");
            ack.arg(stream).arg("bench");
            for (id, fields) in &entries {
                let body = fields
                    .chunks(2)
                    .find(|kv| kv.len() == 2 && kv[0] == b"body")
                    .map(|kv| kv[1].as_slice())
                    .ok_or_else(|| format!("entry {id} has no body"))?;
                consume_body(body)?;
                ack.arg(id);
            }
            ack.query_async::<u64>(&mut c)
                .await
                .map_err(|e| format!("XACK failed: {e}"))?;
            consumed += entries.len() as u64;
        }
        log_baseline(n, start, sent);
        Ok(n as f64 / start.elapsed().as_secs_f64())
    };
    let mut cleaner = conn.clone();
    let delete = async move {
        redis::cmd("DEL")
            .arg(stream)
            .query_async::<()>(&mut cleaner)
            .await
            .map_err(|e| format!("deleting stream {stream}: {e}"))
    };
    and_then_clean(run, delete).await
}

// ----- RabbitMQ ---------------------------------------------------------

/// `amqp_e2e`: the RabbitMQ transport against raw lapin publishing with
/// confirms and consuming with acks.
pub(crate) fn amqp() -> Result<(), String> {
    run_scenario(Broker {
        scenario: "amqp_e2e",
        url_var: "ENVOI_AMQP_URL",
        envoi: |url, n| Box::pin(amqp_envoi(url, n)),
        baseline: |url, n| Box::pin(amqp_baseline(url, n)),
    })
}

async fn amqp_envoi(url: &str, n: u64) -> Result<f64, String> {
    let queue = format!("envoi-bench-{}", unique());
    // `expires` only removes the queues should the run die before deleting
    // them.
    let dsn = with_options(
        url,
        &format!("queue={queue}&exchange={queue}&prefetch={AMQP_PREFETCH}&expires=10m"),
    );
    let transport = envoi_amqp::AmqpTransport::connect("jobs", &dsn)
        .await
        .map_err(|e| e.to_string())?;
    let transport = Arc::new(transport);
    and_then_clean(
        async {
            transport.setup().await.map_err(|e| e.to_string())?;
            envoi_side(transport.clone(), n).await
        },
        delete_then_close(&*transport, transport.close()),
    )
    .await
}

/// [`PRODUCERS`] concurrent publishers on one confirm-mode channel, each
/// awaiting its confirm, into a durable quorum queue (persistent messages);
/// then `basic.consume` with a prefetch of [`AMQP_PREFETCH`], acking every
/// delivery (the frames envoi sends too), the acks of what arrived together
/// sent together.
async fn amqp_baseline(url: &str, n: u64) -> Result<f64, String> {
    use lapin::options::{
        BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
        ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
    use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};

    let queue: &str = &format!("envoi-bench-{}-raw", unique());
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("connecting to rabbitmq: {e}"))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    let short = |s: &str| ShortString::try_new(s).map_err(|e| e.to_string());
    let run = async {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        args.insert("x-expires".into(), AMQPValue::LongLongInt(600_000));
        channel
            .queue_declare(
                short(queue)?,
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                args,
            )
            .await
            .map_err(|e| e.to_string())?;
        let publisher = connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        let mut headers = FieldTable::default();
        headers.insert("type".into(), AMQPValue::LongString(LongString::from(TYPE)));
        headers.insert("kind".into(), AMQPValue::LongString(LongString::from(KIND)));
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        let routing_key = short(queue)?;

        let start = Instant::now();
        send_all(n, move |id| {
            let (publisher, properties, key) =
                (publisher.clone(), properties.clone(), routing_key.clone());
            async move {
                let confirm = publisher
                    .basic_publish(
                        ShortString::from(""),
                        key,
                        BasicPublishOptions::default(),
                        &body(id)?,
                        properties,
                    )
                    .await
                    .map_err(|e| format!("publish failed: {e}"))?
                    .await
                    .map_err(|e| format!("confirm failed: {e}"))?;
                match confirm {
                    Confirmation::Ack(_) => Ok(()),
                    other => Err(format!("publish not confirmed: {other:?}")),
                }
            }
        })
        .await?;
        let sent = start.elapsed();

        channel
            .basic_qos(AMQP_PREFETCH, BasicQosOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        let consumer = channel
            .basic_consume(
                short(queue)?,
                short("bench-raw")?,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| e.to_string())?;
        let mut batches = consumer.ready_chunks(BATCH);
        let mut consumed = 0u64;
        while consumed < n {
            let Some(batch) = batches.next().await else {
                return Err(format!("consumer ended after {consumed} of {n}"));
            };
            let mut acks = Vec::with_capacity(batch.len());
            for delivery in batch {
                let delivery = delivery.map_err(|e| format!("consume failed: {e}"))?;
                consume_body(&delivery.data)?;
                acks.push(channel.basic_ack(delivery.delivery_tag, BasicAckOptions::default()));
            }
            consumed += acks.len() as u64;
            for result in futures_util::future::join_all(acks).await {
                result.map_err(|e| format!("ack failed: {e}"))?;
            }
        }
        log_baseline(n, start, sent);
        Ok(n as f64 / start.elapsed().as_secs_f64())
    };
    let delete = async {
        channel
            .queue_delete(short(queue)?, QueueDeleteOptions::default())
            .await
            .map(drop)
            .map_err(|e| format!("deleting queue {queue}: {e}"))
    };
    let result = and_then_clean(run, delete).await;
    let _ = connection.close(200, "done".into()).await;
    result
}

// ----- NATS JetStream ---------------------------------------------------

/// `nats_e2e`: the NATS JetStream transport against raw async-nats
/// publishing with acks and pulling with acks.
pub(crate) fn nats() -> Result<(), String> {
    run_scenario(Broker {
        scenario: "nats_e2e",
        url_var: "ENVOI_NATS_URL",
        envoi: |url, n| Box::pin(nats_envoi(url, n)),
        baseline: |url, n| Box::pin(nats_baseline(url, n)),
    })
}

async fn nats_envoi(url: &str, n: u64) -> Result<f64, String> {
    let name = format!("envoi-bench-{}", unique());
    let dsn = with_options(
        url,
        &format!(
            "stream={name}&subject={subject}&consumer={name}&batch={BATCH}",
            subject = name.replace('-', ".")
        ),
    );
    let transport = envoi_nats::NatsTransport::connect("jobs", &dsn)
        .await
        .map_err(|e| e.to_string())?;
    let transport = Arc::new(transport);
    and_then_clean(
        async {
            transport.setup().await.map_err(|e| e.to_string())?;
            envoi_side(transport.clone(), n).await
        },
        delete_then_close(&*transport, transport.close()),
    )
    .await
}

/// [`PRODUCERS`] concurrent JetStream publishers, each awaiting its publish
/// ack, into a file-backed work-queue stream; then pull requests for
/// [`BATCH`] messages on a durable consumer, acking each message.
async fn nats_baseline(url: &str, n: u64) -> Result<f64, String> {
    use async_nats::jetstream::{self, consumer, stream};

    let name: &str = &format!("envoi-bench-{}-raw", unique());
    let client = async_nats::connect(url)
        .await
        .map_err(|e| format!("connecting to nats: {e}"))?;
    let js = jetstream::new(client.clone());
    let subject = name.replace('-', ".");
    let run = async {
        let stream = js
            .create_stream(stream::Config {
                name: name.to_string(),
                subjects: vec![subject.clone()],
                retention: stream::RetentionPolicy::WorkQueue,
                storage: stream::StorageType::File,
                num_replicas: 1,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating stream {name}: {e}"))?;
        let consumer = stream
            .create_consumer(consumer::pull::Config {
                durable_name: Some(name.to_string()),
                ack_policy: consumer::AckPolicy::Explicit,
                max_ack_pending: -1,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating consumer {name}: {e}"))?;
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("type", TYPE);
        headers.insert("kind", KIND);

        let start = Instant::now();
        let (js2, subject2) = (js.clone(), subject.clone());
        send_all(n, move |id| {
            let (js, subject, headers) = (js2.clone(), subject2.clone(), headers.clone());
            async move {
                js.publish_with_headers(subject, headers, body(id)?.into())
                    .await
                    .map_err(|e| format!("publish failed: {e}"))?
                    .await
                    .map(drop)
                    .map_err(|e| format!("publish ack failed: {e}"))
            }
        })
        .await?;
        let sent = start.elapsed();
        let mut consumed = 0u64;
        while consumed < n {
            let mut messages = consumer
                .fetch()
                .max_messages(BATCH)
                .messages()
                .await
                .map_err(|e| format!("fetch failed: {e}"))?;
            let before = consumed;
            while let Some(message) = messages.next().await {
                let message = message.map_err(|e| format!("fetch failed: {e}"))?;
                consume_body(&message.payload)?;
                message
                    .ack()
                    .await
                    .map_err(|e| format!("ack failed: {e}"))?;
                consumed += 1;
            }
            if consumed == before {
                return Err(format!("baseline ran dry after {consumed} of {n}"));
            }
        }
        log_baseline(n, start, sent);
        Ok(n as f64 / start.elapsed().as_secs_f64())
    };
    let delete = async {
        js.delete_stream(name)
            .await
            .map(drop)
            .map_err(|e| format!("deleting stream {name}: {e}"))
    };
    let result = and_then_clean(run, delete).await;
    let _ = client.flush().await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_redis_baseline_writes_the_body_and_the_type_and_kind_headers_envoi_writes() {
        let serializer = envoi_core::serializer::Serializer::builder()
            .message::<crate::e2e::Job>()
            .build()
            .unwrap();
        let raw = serializer
            .encode(&envoi_core::Envelope::new(crate::e2e::job(7)))
            .unwrap();
        // envoi's own stamp headers (the bus name, once dispatched) are
        // bookkeeping the minimum equivalent work does without.
        let packed: String = raw
            .headers
            .iter()
            .filter(|(name, _)| !name.starts_with("X-Message-Stamp-"))
            .map(|(name, value)| format!("{}:{name}{}:{value}", name.len(), value.len()))
            .collect();
        assert_eq!(REDIS_HEADERS, packed);
        assert_eq!(body(7).unwrap(), raw.body);
    }

    #[test]
    fn options_are_appended_to_the_query_string() {
        assert_eq!(
            with_options("redis://127.0.0.1:6379", "stream=s"),
            "redis://127.0.0.1:6379?stream=s"
        );
        assert_eq!(
            with_options("postgres://u@h/db?sslmode=disable", "table=t"),
            "postgres://u@h/db?sslmode=disable&table=t"
        );
    }

    #[test]
    fn a_missing_url_variable_skips_the_scenario() {
        assert_eq!(
            broker_url("test_e2e", "ENVOI_BENCH_TEST_URL_THAT_IS_NEVER_SET"),
            None
        );
    }

    #[test]
    fn run_names_are_unique_valid_postgres_tables() {
        let a = format!("envoi_bench_{}", unique());
        std::thread::sleep(Duration::from_millis(1));
        let b = format!("envoi_bench_{}", unique());
        assert_ne!(a, b);
        for table in [&a, &format!("{b}_raw")] {
            assert!(table.len() <= 48, "{table} is too long");
            assert!(table
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
        }
    }
}
