//! The fault drill on every transport: produce N messages, then start the
//! worker process, kill it after 1–3 s (`SIGKILL`, every third time
//! `SIGTERM`), and start it again, a few times over, while the server side
//! breaks the worker's connections where the broker allows it; then one
//! last worker runs until the queue is empty. Every id must have been
//! handled; duplicates are reported.
//!
//! Where the broker cannot close one client's connections (NATS), a
//! broker of the drill's own is stopped and started again instead, three
//! times during the run.
//!
//! Broker drills read their URL from `ENVOI_POSTGRES_URL`,
//! `ENVOI_REDIS_URL`, `ENVOI_AMQP_URL` and `ENVOI_NATS_URL`; without it a
//! drill is reported as ignored, with the reason (or fails, with
//! `ENVOI_REQUIRE_BROKERS=1`). The SQLite drill always runs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use envoi::{Messenger, MessengerBuilderExt};
use envoi_drill::{unique_name, Count, Job};

/// The `nats-server` the NATS transport's own tests start and restart.
#[allow(dead_code, unreachable_pub)]
#[path = "../../envoi-nats/tests/common/server.rs"]
mod nats_server;

/// Messages each drill produces.
const PRODUCED: u64 = 12_000;
/// Times the worker is stopped and started again.
const ROUNDS: u32 = 6;
/// The longest the last worker may take to empty the queue.
const FINISH: Duration = Duration::from_secs(60);

fn unique(transport: &str) -> String {
    unique_name(&format!("drill_{transport}"))
}

/// A pseudo-random wait of 1–3 s (no seed needed: the drill only wants
/// kills at varied points).
fn wait_before_kill(round: u32) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    Duration::from_millis(1_000 + u64::from((nanos ^ round.wrapping_mul(7919)) % 2_000))
}

fn worker(name: &str, dsn: &str, record: &Path, until_empty: bool) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_drill-worker"));
    command.arg(name).arg(dsn).arg(record);
    if until_empty {
        command.arg("--until-empty");
    }
    command
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the drill worker starts")
}

/// Stops `child`: `SIGKILL`, or `SIGTERM` and a wait of up to 30 s for it
/// to finish what it holds (then `SIGKILL`).
fn stop(child: &mut Child, graceful: bool) {
    if graceful {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("drill: the worker ignored SIGTERM for 30 s; killing it");
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Sends `PRODUCED` jobs to the transport `name` at `dsn`; returns the
/// producer's messenger, whose transport deletes the queue at the end.
async fn produce(name: &str, dsn: &str) -> Messenger {
    let messenger = Messenger::builder()
        .with_transport_factories()
        .transport_dsn(name, dsn)
        .route::<Job>(name)
        .build_async()
        .await
        .expect("the producer's messenger builds");
    for (name, result) in messenger.setup_transports().await {
        result.unwrap_or_else(|e| panic!("setting up `{name}` failed: {e}"));
    }
    let dispatcher = messenger.dispatcher();
    for id in 0..PRODUCED {
        let job = Job {
            id,
            note: format!("order {id:>8} for the fault drill, padded to a usual size"),
        };
        dispatcher
            .publish(job)
            .await
            .unwrap_or_else(|e| panic!("producing job {id} failed: {e}"));
    }
    messenger
}

/// Runs the drill on `transport` at `dsn`; `break_connections` is called
/// in the middle of some rounds to break the worker's connections from
/// the server side. Returns what was counted.
async fn drill(transport: &str, dsn: &str, break_connections: Option<&(dyn Fn() + Sync)>) -> Count {
    let name = unique(transport);
    let dir = tempfile::tempdir().unwrap();
    let record: PathBuf = dir.path().join("handled");
    let producer = produce(&name, dsn).await;
    let started = Instant::now();
    let mut kills = 0;
    // Stops after which every message had been handled: they tested less.
    let mut finished_before_stop = 0;
    let mut breaks = 0;
    for round in 0..ROUNDS {
        let mut child = worker(&name, dsn, &record, false);
        let wait = wait_before_kill(round);
        if let (Some(breaker), true) = (break_connections, round % 2 == 1) {
            tokio::time::sleep(wait / 2).await;
            breaker();
            breaks += 1;
            tokio::time::sleep(wait / 2).await;
        } else {
            tokio::time::sleep(wait).await;
        }
        stop(&mut child, round % 3 == 2);
        kills += 1;
        let so_far = Count::read(&record, PRODUCED).unwrap();
        if so_far.handled > 0 && so_far.lost.is_empty() {
            finished_before_stop += 1;
        }
    }
    let mut last = worker(&name, dsn, &record, true);
    let deadline = Instant::now() + FINISH;
    let status = loop {
        if let Some(status) = last.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            stop(&mut last, false);
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let count = Count::read(&record, PRODUCED).unwrap();
    if let Some(teardown) = producer.transport(&name).and_then(|t| t.as_teardown()) {
        if let Err(e) = teardown.delete().await {
            eprintln!("drill: deleting `{name}` failed: {e}");
        }
    }
    println!(
        "drill {transport}: produced={} handled={} lost={} duplicated={} stops={kills} \
         server_side_breaks={breaks} elapsed={:.1}s",
        count.produced,
        count.handled,
        count.lost.len(),
        count.duplicated,
        started.elapsed().as_secs_f64()
    );
    assert!(
        finished_before_stop < ROUNDS / 2,
        "the worker was done before {finished_before_stop} of {ROUNDS} stops: produce more"
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "the last worker did not empty `{name}` within {FINISH:?} (status {status:?})"
    );
    count
}

fn assert_nothing_lost(count: &Count) {
    assert!(
        count.lost.is_empty(),
        "{} of {} ids were never handled, first ones: {:?}",
        count.lost.len(),
        count.produced,
        &count.lost[..count.lost.len().min(20)]
    );
}

/// Runs `program` with `args`, for breaking connections from the server
/// side; a failure is reported, not fatal (the drill still counts).
fn run(program: &str, args: &[&str]) {
    match Command::new(program).args(args).output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => eprintln!(
            "drill: `{program}` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => eprintln!("drill: cannot run `{program}`: {e}"),
    }
}

/// Closes, from the server side, the RabbitMQ connections of the drill's
/// transports (named `envoi-drill_…`), and no other.
fn close_drill_connections() {
    let listed = Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "pid",
            "client_properties",
            "-q",
            "--no-table-headers",
        ])
        .output();
    let listed = match listed {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        Ok(out) => {
            eprintln!(
                "drill: listing RabbitMQ connections failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return;
        }
        Err(e) => {
            eprintln!("drill: cannot run rabbitmqctl: {e}");
            return;
        }
    };
    // One line per connection: its pid, a tab, its client properties
    // (which hold the connection name).
    let mut closed = 0;
    for line in listed.lines() {
        let Some((pid, properties)) = line.split_once('\t') else {
            continue;
        };
        if properties.contains("envoi-drill_rabbitmq_") {
            run(
                "rabbitmqctl",
                &[
                    "close_connection",
                    pid,
                    "drill: connection closed by the server",
                ],
            );
            closed += 1;
        }
    }
    if closed == 0 {
        eprintln!("drill: no RabbitMQ connection of the drill was open to close");
    }
}

async fn sqlite_loses_nothing_when_its_worker_is_killed_again_and_again() {
    let dir = tempfile::tempdir().unwrap();
    let dsn = format!("sqlite://{}/drill.db?lease=2s", dir.path().display());
    let count = drill("sqlite", &dsn, None).await;
    assert_nothing_lost(&count);
}

async fn postgres_loses_nothing_when_its_worker_is_killed_and_its_connections_cut(url: String) {
    let name = unique("pg");
    let separator = if url.contains('?') { '&' } else { '?' };
    let dsn = format!("{url}{separator}table={name}&lease=2s");
    let breaker = || {
        run(
            "psql",
            &[
                &url,
                "-qAtc",
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE pid <> pg_backend_pid() AND backend_type = 'client backend' \
                 AND query LIKE '%drill_pg_%'",
            ],
        )
    };
    let count = drill("postgres", &dsn, Some(&breaker)).await;
    assert_nothing_lost(&count);
    run(
        "psql",
        &[&url, "-qAtc", &format!("DROP TABLE IF EXISTS {name}")],
    );
}

async fn redis_loses_nothing_when_its_worker_is_killed_and_its_connections_cut(url: String) {
    let separator = if url.contains('?') { '&' } else { '?' };
    let dsn = format!("{url}{separator}lease=2s");
    let breaker = || {
        run(
            "redis-cli",
            &["-u", &url, "CLIENT", "KILL", "TYPE", "normal"],
        )
    };
    let count = drill("redis", &dsn, Some(&breaker)).await;
    assert_nothing_lost(&count);
}

async fn rabbitmq_loses_nothing_when_its_worker_is_killed_and_its_connections_closed(url: String) {
    let separator = if url.contains('?') { '&' } else { '?' };
    let dsn = format!("{url}{separator}lease=2s&expires=10m");
    let count = drill("rabbitmq", &dsn, Some(&close_drill_connections)).await;
    assert_nothing_lost(&count);
}

async fn nats_loses_nothing_when_its_worker_is_killed_again_and_again(url: String) {
    let separator = if url.contains('?') { '&' } else { '?' };
    let dsn = format!("{url}{separator}lease=2s");
    let count = drill("nats", &dsn, None).await;
    assert_nothing_lost(&count);
}

async fn nats_loses_nothing_when_its_broker_restarts_mid_run(binary: PathBuf) {
    let server = std::sync::Mutex::new(nats_server::Server::start(&binary, &[]));
    let dsn = format!("{}?lease=2s", server.lock().unwrap().url());
    let restart = || {
        let mut server = server.lock().unwrap();
        server.stop();
        server.start_again();
    };
    let count = drill("nats_restarted", &dsn, Some(&restart)).await;
    assert_nothing_lost(&count);
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_POSTGRES_URL", tests = [
        postgres_loses_nothing_when_its_worker_is_killed_and_its_connections_cut,
    ];
    env = "ENVOI_REDIS_URL", tests = [
        redis_loses_nothing_when_its_worker_is_killed_and_its_connections_cut,
    ];
    env = "ENVOI_AMQP_URL", tests = [
        rabbitmq_loses_nothing_when_its_worker_is_killed_and_its_connections_closed,
    ];
    env = "ENVOI_NATS_URL", tests = [
        nats_loses_nothing_when_its_worker_is_killed_again_and_again,
    ];
    needs = nats_server::binary, tests = [
        nats_loses_nothing_when_its_broker_restarts_mid_run,
    ];
    tests = [
        sqlite_loses_nothing_when_its_worker_is_killed_again_and_again,
    ];
}
