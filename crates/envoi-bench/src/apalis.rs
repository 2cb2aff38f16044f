//! `*_vs_apalis` scenarios: envoi's round trip (N jobs sent by
//! [`PRODUCERS`](crate::e2e::PRODUCERS) concurrent dispatchers, then
//! consumed by the worker) against apalis 1.0 doing the same work on the
//! same backend: the same N, the same JSON bodies, a no-op handler, 64
//! handlers in flight and the same fetch batch on both sides.
//!
//! apalis runs in a child process, the `apalis-baseline` binary of the
//! standalone project `crates/envoi-bench/apalis-baseline` (its own
//! dependency graph and lock file, so apalis and its backends never enter
//! envoi's workspace). It is built once per run with `cargo build
//! --release` into this binary's target directory, or taken from
//! `ENVOI_APALIS_BASELINE` (a path to a built `apalis-baseline`). It prints
//! `apalis_msgs_per_sec=<v>`: N over the time from its first push to its
//! worker's exit, every job acknowledged — what envoi's side measures too.
//! If the baseline cannot be built, each scenario prints
//! `<scenario>: skipped: <why>` and succeeds.
//!
//! Both sides get the same resources and the same shape of run: the same
//! connection counts (16 on PostgreSQL; on SQLite 3, envoi's writer and two
//! readers), the same prefetch on RabbitMQ, and on Redis both run their
//! worker while the jobs are sent, keeping at most 5,000 unhandled (all
//! apalis-redis can consume). apalis is set up as its documentation and
//! its own setup intend: its SQLite pragmas on every pooled connection
//! rather than the one its setup reaches, and `ANALYZE` at setup on a
//! database that has served jobs before (see `run_sqlite` in the baseline). The
//! [harness] runs the sides: warm-ups, ABBA rounds,
//! medians.
//!
//! Each scenario uses unique table / stream / queue names (SQLite: files
//! of its own) on both sides and removes them at the end. Without its URL
//! variable a broker scenario prints `<scenario>: skipped: ENVOI_X_URL is
//! not set` and succeeds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use envoi_core::transport::Setup;

use crate::brokers::{and_then_clean, broker_url, delete_then_close, unique, with_options};
use crate::e2e::{envoi_round_trip, envoi_trip, job_messenger, runtime, Phases, Trip};
use crate::harness::{self, Plan};
use crate::sqlite::sqlite_envoi;

/// Handlers in flight, both sides.
const CONCURRENCY: usize = 64;
/// Messages per fetch on SQLite, both sides (as in `sqlite_e2e`).
const SQLITE_BATCH: usize = 256;
/// Messages per fetch (envoi) / fetch batch or prefetch (apalis) on the
/// brokers, as in the `*_e2e` scenarios.
const BROKER_BATCH: usize = 500;
/// Pool size of envoi's PostgreSQL transport (as in `postgres_e2e`).
const PG_CONNECTIONS: u32 = 16;
/// RabbitMQ prefetch of both consumers (envoi's as in `amqp_e2e`;
/// apalis's `--batch` is its prefetch count).
const AMQP_PREFETCH: u16 = 1000;
/// Jobs sent but not handled yet that the producers of `redis_vs_apalis`
/// allow on both sides.
const REDIS_BACKLOG: u64 = 5000;

/// The `apalis-baseline` binary, built on first use; `Err` says why it is
/// not available.
fn baseline_binary() -> Result<PathBuf, String> {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BINARY.get_or_init(build_baseline).clone()
}

fn build_baseline() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("ENVOI_APALIS_BASELINE") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "ENVOI_APALIS_BASELINE={} is not a file",
                path.display()
            ))
        };
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("apalis-baseline/Cargo.toml");
    // This binary lives in <target>/<profile>/: build into the same <target>.
    let target_dir = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => std::env::current_exe()
            .map_err(|e| format!("cannot locate the target directory: {e}"))?
            .parent()
            .and_then(Path::parent)
            .map(Path::to_path_buf)
            .ok_or("cannot locate the target directory")?,
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!(
        "  building apalis-baseline (cargo build --release --manifest-path {})",
        manifest.display()
    );
    let status = Command::new(&cargo)
        .args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .env("CARGO_TARGET_DIR", &target_dir)
        .status()
        .map_err(|e| format!("cannot run cargo to build apalis-baseline: {e}"))?;
    if !status.success() {
        return Err(format!(
            "apalis-baseline did not build (cargo build --release --manifest-path {} exited with {status})",
            manifest.display()
        ));
    }
    let binary = target_dir.join("release").join("apalis-baseline");
    if binary.is_file() {
        Ok(binary)
    } else {
        Err(format!(
            "apalis-baseline built but {} is missing",
            binary.display()
        ))
    }
}

/// Runs `apalis-baseline <args>` and returns its messages per second.
fn run_baseline(binary: &Path, args: &[String]) -> Result<f64, String> {
    let output = Command::new(binary)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", binary.display()))?;
    if !output.status.success() {
        return Err(format!(
            "apalis-baseline {} exited with {}",
            args.join(" "),
            output.status
        ));
    }
    parse_rate(&String::from_utf8_lossy(&output.stdout))
}

/// The value of the `apalis_msgs_per_sec=<v>` line in `stdout`.
fn parse_rate(stdout: &str) -> Result<f64, String> {
    stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("apalis_msgs_per_sec="))
        .ok_or_else(|| format!("no apalis_msgs_per_sec line in {stdout:?}"))?
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
        .ok_or_else(|| format!("bad apalis_msgs_per_sec line in {stdout:?}"))
}

/// The common tail of the baseline's command line.
fn baseline_args(kind: &str, n: u64, batch: usize) -> Vec<String> {
    vec![
        kind.to_owned(),
        "--n".to_owned(),
        n.to_string(),
        "--concurrency".to_owned(),
        CONCURRENCY.to_string(),
        "--batch".to_owned(),
        batch.to_string(),
    ]
}

/// The baseline binary, or `None` after printing the skip line.
fn baseline_or_skip(scenario: &str) -> Option<PathBuf> {
    match baseline_binary() {
        Ok(path) => Some(path),
        Err(why) => {
            println!("{scenario}: skipped: {why}");
            None
        }
    }
}

/// Runs envoi's side (`envoi`) against the apalis baseline (the binary
/// run with `args(n)`) as the [harness] plans, and prints
/// the summary line.
fn compare_with_apalis(
    scenario: &str,
    binary: &Path,
    envoi: impl FnMut(u64) -> Result<f64, String>,
    args: impl Fn(u64) -> Vec<String>,
) -> Result<(), String> {
    let plan = Plan::from_env()?;
    let outcome = harness::compare(&plan, envoi, |n| run_baseline(binary, &args(n)))?;
    harness::summary(scenario, &plan, &outcome, "msg/s", &[]);
    Ok(())
}

/// `sqlite_vs_apalis`: envoi's SQLite transport against apalis-sqlite.
/// Each side keeps its database file for the whole scenario (warm-up and
/// rounds), as a database in service is kept; apalis's worker keeps its
/// name from run to run, as a deployment's does. apalis gets envoi's
/// connection count (one writer and two readers: `--connections 3`), its
/// own pragmas on every connection, and `ANALYZE` once its jobs are
/// pushed, on a database given a history of at least N jobs first
/// ([`prime_history`]; see `run_sqlite` in the baseline for why).
pub(crate) fn sqlite() -> Result<(), String> {
    const SCENARIO: &str = "sqlite_vs_apalis";
    let Some(binary) = baseline_or_skip(SCENARIO) else {
        return Ok(());
    };
    let rt = runtime()?;
    let plan = Plan::from_env()?;
    let dir = std::env::temp_dir().join(format!("envoi-bench-apalis-{}", unique()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let (envoi_db, apalis_db) = (dir.join("envoi.db"), dir.join("apalis.db"));
    let apalis_args = |n: u64| {
        let mut args = baseline_args("sqlite", n, SQLITE_BATCH);
        args.extend(["--connections".into(), "3".into(), "--analyze".into()]);
        args.extend(["true".into(), "--worker".into(), "envoi-bench".into()]);
        args.extend(["--path".into(), apalis_db.display().to_string()]);
        args
    };
    let result = prime_history(&binary, plan.n, apalis_args).and_then(|()| {
        compare_with_apalis(
            SCENARIO,
            &binary,
            |n| rt.block_on(sqlite_envoi(&envoi_db, n)),
            apalis_args,
        )
    });
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Runs the apalis baseline, untimed, until its database holds at least
/// `n` jobs done: first 2,000 (on no statistics: the slow plan), then
/// three quarters of the history each time, so that every `ANALYZE` sees
/// more jobs done than pending, as in a database in service.
fn prime_history(binary: &Path, n: u64, args: impl Fn(u64) -> Vec<String>) -> Result<(), String> {
    let mut history = 0;
    while history < n {
        let next = if history == 0 { 2000 } else { history * 3 / 4 };
        eprintln!("  priming apalis's database: {next} jobs on a history of {history}, untimed");
        run_baseline(binary, &args(next))?;
        history += next;
    }
    Ok(())
}

/// envoi's side of `postgres_vs_apalis`, on a table of its own.
async fn postgres_envoi(url: &str, n: u64) -> Result<f64, String> {
    let table = format!("envoi_bench_apalis_{}", unique());
    let dsn = with_options(
        url,
        &format!("table={table}&batch={BROKER_BATCH}&max_connections={PG_CONNECTIONS}"),
    );
    let transport = envoi_postgres::PostgresTransport::connect("jobs", &dsn)
        .await
        .map_err(|e| e.to_string())?;
    and_then_clean(
        async {
            transport.setup().await.map_err(|e| e.to_string())?;
            let (messenger, handled) = job_messenger("jobs", Arc::new(transport.clone()))?;
            envoi_round_trip(&messenger, "jobs", &handled, n, CONCURRENCY, BROKER_BATCH).await
        },
        // The table is this run's own: deleting the queue drops it.
        delete_then_close(&transport, transport.close()),
    )
    .await
}

/// `postgres_vs_apalis`: envoi's PostgreSQL transport against
/// apalis-postgres, both with [`PG_CONNECTIONS`] pooled connections.
pub(crate) fn postgres() -> Result<(), String> {
    const SCENARIO: &str = "postgres_vs_apalis";
    let Some(url) = broker_url(SCENARIO, "ENVOI_POSTGRES_URL") else {
        return Ok(());
    };
    let Some(binary) = baseline_or_skip(SCENARIO) else {
        return Ok(());
    };
    let rt = runtime()?;
    compare_with_apalis(
        SCENARIO,
        &binary,
        |n| rt.block_on(postgres_envoi(&url, n)),
        |n| {
            let mut args = baseline_args("postgres", n, BROKER_BATCH);
            args.extend(["--connections".into(), PG_CONNECTIONS.to_string()]);
            args.extend(["--url".into(), url.clone()]);
            args
        },
    )
}

/// envoi's side of `redis_vs_apalis`: its worker runs while the jobs are
/// sent, the producers keeping at most [`REDIS_BACKLOG`] unhandled, as
/// apalis's side must.
async fn redis_envoi(url: &str, n: u64) -> Result<f64, String> {
    let stream = format!("envoi-bench-apalis:{}", unique());
    let dsn = with_options(url, &format!("stream={stream}&group=bench"));
    let transport = Arc::new(
        envoi_redis::RedisTransport::connect("jobs", &dsn)
            .await
            .map_err(|e| e.to_string())?,
    );
    let trip = Trip {
        n,
        concurrency: CONCURRENCY,
        batch: BROKER_BATCH,
        phases: Phases::Overlapped {
            max_backlog: REDIS_BACKLOG,
        },
    };
    and_then_clean(
        async {
            transport.setup().await.map_err(|e| e.to_string())?;
            let (messenger, handled) = job_messenger("jobs", transport.clone())?;
            envoi_trip(&messenger, "jobs", &handled, trip).await
        },
        delete_then_close(&*transport, transport.close()),
    )
    .await
}

/// `redis_vs_apalis`: envoi's Redis Streams transport against
/// apalis-redis, both sending and consuming at once with the same backlog
/// (apalis-redis cannot consume a larger one, see the baseline's
/// `run_redis`).
pub(crate) fn redis() -> Result<(), String> {
    const SCENARIO: &str = "redis_vs_apalis";
    let Some(url) = broker_url(SCENARIO, "ENVOI_REDIS_URL") else {
        return Ok(());
    };
    let Some(binary) = baseline_or_skip(SCENARIO) else {
        return Ok(());
    };
    let rt = runtime()?;
    compare_with_apalis(
        SCENARIO,
        &binary,
        |n| rt.block_on(redis_envoi(&url, n)),
        |n| {
            let mut args = baseline_args("redis", n, BROKER_BATCH);
            args.extend(["--overlap".into(), "true".into(), "--max-backlog".into()]);
            args.extend([REDIS_BACKLOG.to_string(), "--url".into(), url.clone()]);
            args
        },
    )
}

/// envoi's side of `amqp_vs_apalis`, on queues of its own.
async fn amqp_envoi(url: &str, n: u64) -> Result<f64, String> {
    let queue = format!("envoi-bench-apalis-{}", unique());
    // `expires` only removes the queues should the run die before deleting
    // them.
    let dsn = with_options(
        url,
        &format!(
            "queue={queue}&exchange={queue}&queue_type=quorum&prefetch={AMQP_PREFETCH}&expires=10m"
        ),
    );
    let transport = Arc::new(
        envoi_amqp::AmqpTransport::connect("jobs", &dsn)
            .await
            .map_err(|e| e.to_string())?,
    );
    and_then_clean(
        async {
            transport.setup().await.map_err(|e| e.to_string())?;
            let (messenger, handled) = job_messenger("jobs", transport.clone())?;
            envoi_round_trip(&messenger, "jobs", &handled, n, CONCURRENCY, BROKER_BATCH).await
        },
        delete_then_close(&*transport, transport.close()),
    )
    .await
}

/// `amqp_vs_apalis`: envoi's RabbitMQ transport against apalis-amqp, both
/// on quorum queues with a prefetch of [`AMQP_PREFETCH`].
pub(crate) fn amqp() -> Result<(), String> {
    const SCENARIO: &str = "amqp_vs_apalis";
    let Some(url) = broker_url(SCENARIO, "ENVOI_AMQP_URL") else {
        return Ok(());
    };
    let Some(binary) = baseline_or_skip(SCENARIO) else {
        return Ok(());
    };
    let rt = runtime()?;
    compare_with_apalis(
        SCENARIO,
        &binary,
        |n| rt.block_on(amqp_envoi(&url, n)),
        |n| {
            let mut args = baseline_args("amqp", n, usize::from(AMQP_PREFETCH));
            args.extend(["--url".into(), url.clone()]);
            args
        },
    )
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_rate_reads_the_summary_line_among_others() {
        let out = "noise\napalis_msgs_per_sec=1234.5\n";
        assert_eq!(parse_rate(out), Ok(1234.5));
    }

    #[test]
    fn parse_rate_rejects_missing_or_bad_values() {
        assert!(parse_rate("").is_err());
        assert!(parse_rate("apalis_msgs_per_sec=fast\n").is_err());
        assert!(parse_rate("apalis_msgs_per_sec=0\n").is_err());
        assert!(parse_rate("apalis_msgs_per_sec=NaN\n").is_err());
    }

    #[test]
    fn baseline_args_carry_backend_count_and_tuning() {
        let args = baseline_args("redis", 7, 500);
        assert_eq!(
            args,
            ["redis", "--n", "7", "--concurrency", "64", "--batch", "500"]
        );
    }
}
