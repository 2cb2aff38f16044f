//! Broker end-to-end scenarios: the same round trip as
//! [`envoi_round_trip`](crate::e2e::envoi_round_trip) — N jobs sent by
//! [`PRODUCERS`] concurrent dispatchers, then consumed by the real worker —
//! on PostgreSQL, Redis Streams, RabbitMQ and NATS JetStream, each against
//! the strongest reasonable code a competent user writes with the raw
//! client for the same work and the same durability: the same N, the same
//! JSON bodies (with the `type` and `kind` headers envoi adds),
//! [`PRODUCERS`] concurrent senders that each wait for their message to be
//! stored (batched where envoi batches them), then batched reads with the
//! next batch fetched while one is handled and the acknowledgements
//! overlapped with the next fetch, as the worker does
//! ([`pipeline`](crate::pipeline)). Every baseline checks that it consumed
//! each of the N jobs exactly once and that its deletes or acknowledgements
//! add up. One module per broker says what its baseline does and why that
//! is the same work.
//!
//! Tuning, the same on both sides of each scenario:
//!
//! * Worker: concurrency 64 (the handler is a no-op counter, so this only
//!   bounds how many dispatches are interleaved) and a batch of [`BATCH`].
//! * PostgreSQL: `batch=500` (rows per claim), 16 connections a side.
//! * Redis: `XREADGROUP COUNT 500`, sends and acknowledgements on one
//!   multiplexed connection, reads on another.
//! * RabbitMQ: quorum queues (envoi's default) on both sides, persistent
//!   messages, `prefetch=1000`.
//! * NATS: file storage (envoi's default), `batch=500` per pull request,
//!   unlimited `max_ack_pending` on both consumers.
//!
//! Each scenario uses unique table / stream / queue names and removes them
//! at the end, whether the run succeeded or not. Without its URL variable
//! a scenario prints `<scenario>: skipped: ENVOI_X_URL is not set` and
//! succeeds. The [harness] runs the sides (warm-ups, ABBA
//! rounds, medians).
//!
//! Besides the summary line, each side reports on stderr how long it took
//! to send and to consume, the CPU this process used and its allocations
//! per message (plus the broker's CPU when `ENVOI_BENCH_SERVER_PIDS` lists
//! the broker's process ids, comma-separated), and the envoi side how the
//! worker fetched and acknowledged: how many `get`s, how full, and the time
//! spent in `get` and `ack_batch`. They tell a transport that lacks batching
//! from a client that is short of CPU.

pub(crate) mod amqp;
pub(crate) mod nats;
pub(crate) mod postgres;
mod probe;
pub(crate) mod redis;

use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use envoi_core::transport::Teardown;
use envoi_core::TransportError;

use crate::e2e::{job, runtime, PRODUCERS};
use crate::harness::{self, Plan};

/// Messages per fetch and per acknowledgement batch, envoi and baselines.
const BATCH: usize = 500;
/// How many messages the worker handles at once.
const CONCURRENCY: usize = 64;
/// The headers envoi's serializer adds to every [`Job`](crate::e2e::Job).
const TYPE: &str = "Job";
const KIND: &str = "command";

/// The broker URL in `var`, or `None` after printing the skip line.
pub(crate) fn broker_url(scenario: &str, var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            println!("{scenario}: skipped: {var} is not set");
            None
        }
    }
}

/// A lower-case suffix unique to this run: process id and clock.
pub(crate) fn unique() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}_{}", std::process::id(), nanos % 1_000_000_000_000)
}

/// `url` with `options` appended to its query string.
pub(crate) fn with_options(url: &str, options: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{options}")
}

fn body(id: u64) -> Result<Vec<u8>, String> {
    serde_json::to_vec(&job(id)).map_err(|e| e.to_string())
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
pub(crate) async fn and_then_clean<T>(
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

/// Runs both sides of `broker` as the [harness] plans and
/// prints the summary line with each side's median.
fn run_scenario(broker: Broker) -> Result<(), String> {
    let Some(url) = broker_url(broker.scenario, broker.url_var) else {
        return Ok(());
    };
    let plan = Plan::from_env()?;
    let rt = runtime()?;
    if let Some(side) = only_side()? {
        // A profiling aid: one side, once, and no summary line.
        let run = if side == "envoi" {
            broker.envoi
        } else {
            broker.baseline
        };
        let rate = rt.block_on(run(&url, plan.n))?;
        println!(
            "{}: only {side}: {rate:.0}msg/s n={}",
            broker.scenario, plan.n
        );
        return Ok(());
    }
    let outcome = harness::compare(
        &plan,
        |n| rt.block_on((broker.envoi)(&url, n)),
        |n| rt.block_on(metered("baseline", n, (broker.baseline)(&url, n))),
    )?;
    harness::summary(broker.scenario, &plan, &outcome, "msg/s", &[]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
