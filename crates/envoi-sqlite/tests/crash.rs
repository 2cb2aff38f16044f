//! Crash safety of a worker on the SQLite transport, with real processes.
//!
//! The test binary runs itself as the worker process (selected by the
//! `ENVOI_CRASH_CHILD` environment variable): a `Messenger` and a `Worker`
//! consuming a SQLite file, with a handler that appends the id of each
//! message it handles to a record file before returning, so before the
//! worker acknowledges it. The parent sends the messages, kills or stops
//! the worker, and counts the records by message id.
//!
//! * SIGKILL, again and again: every message is handled at least once;
//!   the duplicates are at most what a killed worker had handled but not
//!   acknowledged yet.
//! * SIGTERM: the worker finishes what it started, acknowledges it and
//!   exits 0; everything else is waiting, claimable at once, and nothing
//!   was handled twice.
//!
//! The worker processes pause at a given point (their handlers wait), so
//! every kill and every signal lands while there is work left, however
//! loaded the machine is; nothing depends on how long anything takes.

#![cfg(unix)]

use envoi_core::testing::Within;

/// The longest a test waits for a worker to stop before it fails (real
/// time, whatever the tokio clock does).
const WAIT: std::time::Duration = std::time::Duration::from_secs(120);

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::testing::Abilities;
use envoi_core::worker::{StopHandle, StopReason, Worker, WorkerReport};
use envoi_core::{Message, Messenger};
use envoi_sqlite::SqliteTransportFactory;
use serde::{Deserialize, Serialize};

/// The message: its id is what the records count.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Job {
    id: u32,
}
impl Message for Job {
    const NAME: &'static str = "Job";
}
impl envoi_core::Command for Job {
    type Output = ();
    type Error = Infallible;
}

/// The transport (and so the table) the jobs go through.
const QUEUE: &str = "jobs";

/// Which worker the child process runs: `kill` or `term`.
const CHILD: &str = "ENVOI_CRASH_CHILD";
/// The DSN of the queue.
const CHILD_DSN: &str = "ENVOI_CRASH_DSN";
/// The file the handler appends handled ids to.
const CHILD_RECORD: &str = "ENVOI_CRASH_RECORD";
/// How many handlers may start before the others wait.
const CHILD_PAUSE: &str = "ENVOI_CRASH_PAUSE";
/// (SIGTERM test) the file a handler writes its id to when it starts
/// waiting.
const CHILD_GATE: &str = "ENVOI_CRASH_GATE";

/// Handlers at once in a worker process.
const CONCURRENCY: usize = 4;
/// Messages a worker process fetches at a time.
const BATCH: usize = 16;

/// The longest the parent waits for a worker process to do something.
const PATIENCE: Duration = Duration::from_secs(240);

fn test_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join("envoi-sqlite-tests")
        .join(format!(
            "{test}-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
    std::fs::create_dir_all(&dir).expect("create the test directory");
    dir
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("the worker process needs {name}"))
}

/// Appends `line` and a newline in one `write`, unbuffered: once it
/// returns, the line is in the file even if the process is killed next.
fn append(file: &std::fs::File, line: impl std::fmt::Display) {
    let mut file = file;
    file.write_all(format!("{line}\n").as_bytes())
        .expect("append to a record file");
}

fn open_append(path: &Path) -> Arc<std::fs::File> {
    Arc::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("open a record file"),
    )
}

/// The complete lines of a record file (a line cut short by a kill has no
/// newline and is left out: its message was not acknowledged, so it is
/// handled, and recorded, again).
fn complete_lines(path: &Path) -> Vec<String> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => panic!("reading {}: {e}", path.display()),
    };
    let mut lines: Vec<String> = text.split('\n').map(str::to_string).collect();
    lines.pop(); // after the last newline: empty, or a line cut short
    lines
}

fn ids(path: &Path) -> Vec<u32> {
    complete_lines(path)
        .iter()
        .map(|l| {
            l.parse()
                .unwrap_or_else(|_| panic!("`{l}` in {} is not an id", path.display()))
        })
        .collect()
}

/// A worker process; killed when dropped, so a failing test leaves none
/// behind.
struct WorkerProcess {
    child: Child,
    log: PathBuf,
}

impl WorkerProcess {
    /// Runs `test` of this binary as a worker process.
    fn spawn(test: &str, role: &str, log: PathBuf, vars: &[(&str, String)]) -> Self {
        let out = std::fs::File::create(&log).expect("create the worker log");
        let err = out.try_clone().expect("clone the worker log");
        let child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, role)
            .envs(vars.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("spawn a worker process");
        WorkerProcess { child, log }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `done` holds, failing if the process exits first or
    /// takes longer than [`PATIENCE`].
    async fn wait_until(&mut self, what: &str, mut done: impl FnMut() -> bool) {
        let started = Instant::now();
        while !done() {
            if let Some(status) = self.child.try_wait().expect("poll the worker process") {
                panic!(
                    "the worker process exited ({status}) before {what}; its output:\n{}",
                    self.log()
                );
            }
            assert!(
                started.elapsed() < PATIENCE,
                "the worker process did not get to {what}; its output:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits for the process to exit on its own.
    async fn exit(&mut self) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("poll the worker process") {
                return status;
            }
            assert!(
                started.elapsed() < PATIENCE,
                "the worker process did not exit; its output:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGKILL, then reaps it.
    fn kill(&mut self) {
        assert!(
            self.child
                .try_wait()
                .expect("poll the worker process")
                .is_none(),
            "the worker process exited before it was killed; its output:\n{}",
            self.log()
        );
        self.child.kill().expect("SIGKILL the worker process");
        let status = self.child.wait().expect("reap the worker process");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9),
            "the worker process was not killed by SIGKILL: {status}"
        );
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The messenger of the parent (which only sends) and of the worker
/// processes (which handle with `handler`).
async fn messenger<F, Fut>(dsn: &str, handler: F) -> Messenger
where
    F: Fn(Job) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), Infallible>> + Send + 'static,
{
    Messenger::builder()
        .command_handler(handler)
        .transport_factory(SqliteTransportFactory)
        .transport_dsn(QUEUE, dsn)
        .route::<Job>(QUEUE)
        .build_async()
        .await
        .expect("messenger")
}

async fn send_jobs(messenger: &Messenger, n: u32) {
    let dispatcher = messenger.dispatcher();
    for id in 0..n {
        dispatcher.dispatch(Job { id }).await.expect("send a job");
    }
    let count = messenger
        .transport(QUEUE)
        .expect("the queue")
        .counter()
        .message_count()
        .await
        .expect("count");
    assert_eq!(count, u64::from(n), "every job is stored before the test");
}

/// The job ids of the messages in the queue.
async fn waiting_ids(messenger: &Messenger, n: u32) -> Vec<u32> {
    let rows = messenger
        .transport(QUEUE)
        .expect("the queue")
        .browser()
        .list(n as usize + 1)
        .await
        .expect("list");
    rows.iter()
        .map(|d| {
            serde_json::from_slice::<Job>(&d.raw.body)
                .expect("a stored job")
                .id
        })
        .collect()
}

// --- SIGKILL -------------------------------------------------------------

/// The worker process of the SIGKILL test: handles jobs, recording each
/// one before its handler returns; after `pause` handlers have started the
/// others wait for ever (until the kill). With no pause it runs until the
/// queue is empty.
async fn kill_test_worker() {
    let record = open_append(Path::new(&env(CHILD_RECORD)));
    let pause: u64 = env(CHILD_PAUSE).parse().expect("a pause count");
    let started = Arc::new(AtomicU64::new(0));
    let messenger = messenger(&env(CHILD_DSN), move |job: Job| {
        let (record, started) = (record.clone(), started.clone());
        async move {
            if started.fetch_add(1, Ordering::SeqCst) >= pause {
                std::future::pending::<()>().await;
            }
            // Let other handlers, fetches and acks interleave.
            tokio::time::sleep(Duration::from_millis(1)).await;
            append(&record, job.id);
            Ok(())
        }
    })
    .await;
    let mut worker = Worker::builder(&messenger)
        .receiver(QUEUE)
        .concurrency(CONCURRENCY)
        .batch_size(BATCH)
        .keepalive_interval(Some(Duration::from_millis(250)))
        .idle_sleep(Duration::from_millis(50));
    if pause == u64::MAX {
        worker = worker.stop_when_empty();
    }
    let report = worker
        .build()
        .expect("worker")
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    println!("worker report: {report:?}");
    assert_eq!(report.reason, StopReason::Empty);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_with_sigkill_again_and_again_loses_no_message() {
    const TEST: &str = "a_worker_killed_with_sigkill_again_and_again_loses_no_message";
    if std::env::var(CHILD).as_deref() == Ok("kill") {
        return kill_test_worker().await;
    }
    const N: u32 = 2_000;
    // Each run: the parent kills the worker once it has recorded `kill_at`
    // messages; the worker's handlers wait from the `pause_at`-th on, so
    // the kill lands before the queue is drained. Where the two are equal
    // the kill finds the worker paused (handlers waiting, fetched messages
    // held, acknowledgements pending); elsewhere most likely in full flow.
    const RUNS: [(usize, u64); 5] = [(1, 1), (120, 170), (40, 40), (250, 330), (75, 110)];

    let dir = test_dir("crash-sigkill");
    // A short lease, so the messages a killed worker held come back soon.
    let dsn = format!(
        "sqlite://{}?lease=3s&poll=20ms",
        dir.join("queue.db").display()
    );
    let parent = messenger(&dsn, |_: Job| async { Ok(()) }).await;
    send_jobs(&parent, N).await;

    let mut records = Vec::new();
    for (run, &(kill_at, pause_at)) in RUNS.iter().enumerate() {
        let record = dir.join(format!("handled-{run}.txt"));
        let mut worker = WorkerProcess::spawn(
            TEST,
            "kill",
            dir.join(format!("worker-{run}.log")),
            &[
                (CHILD_DSN, dsn.clone()),
                (CHILD_RECORD, record.display().to_string()),
                (CHILD_PAUSE, pause_at.to_string()),
            ],
        );
        worker
            .wait_until(&format!("handling {kill_at} messages"), || {
                complete_lines(&record).len() >= kill_at
            })
            .await;
        worker.kill();
        println!(
            "run {run}: killed after {} recorded",
            complete_lines(&record).len()
        );
        records.push(record);
    }

    // The last worker runs until the queue is empty, the messages the
    // killed ones held included (once their leases run out).
    let record = dir.join("handled-last.txt");
    let mut last = WorkerProcess::spawn(
        TEST,
        "kill",
        dir.join("worker-last.log"),
        &[
            (CHILD_DSN, dsn.clone()),
            (CHILD_RECORD, record.display().to_string()),
            (CHILD_PAUSE, u64::MAX.to_string()),
        ],
    );
    let status = last.exit().await;
    assert!(
        status.success(),
        "the last worker failed ({status}); its output:\n{}",
        last.log()
    );
    records.push(record);

    let mut times: BTreeMap<u32, usize> = BTreeMap::new();
    for record in &records {
        for id in ids(record) {
            *times.entry(id).or_default() += 1;
        }
    }
    let lost: Vec<u32> = (0..N).filter(|id| !times.contains_key(id)).collect();
    assert!(lost.is_empty(), "{} messages lost: {lost:?}", lost.len());
    let unknown: Vec<u32> = times.keys().copied().filter(|&id| id >= N).collect();
    assert!(
        unknown.is_empty(),
        "ids never sent were recorded: {unknown:?}"
    );
    assert_eq!(
        parent
            .transport(QUEUE)
            .expect("the queue")
            .counter()
            .message_count()
            .await
            .expect("count"),
        0,
        "messages left in the queue"
    );
    let twice: usize = times.values().map(|n| n - 1).sum();
    let most = times.values().copied().max().unwrap_or(0);
    println!(
        "{N} messages, {} kills: {twice} handled more than once (at most {most} times)",
        RUNS.len()
    );
    // A message is handled again only if a killed worker had recorded it
    // but not acknowledged it: acknowledgements wait until a batch is full
    // (up to BATCH - 1, plus up to CONCURRENCY that finish together and
    // overfill it), and up to CONCURRENCY handlers may have recorded but
    // not returned.
    let bound = RUNS.len() * (BATCH + 2 * CONCURRENCY);
    assert!(
        twice <= bound,
        "{twice} messages handled twice, more than the {bound} the kills can explain: {:?}",
        times.iter().filter(|(_, &n)| n > 1).collect::<Vec<_>>()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// --- SIGTERM -------------------------------------------------------------

/// The worker process of the SIGTERM test: stopped by signals; its first
/// `pause` handlers run freely (20 ms each), the next ones write their id
/// to the gate file and wait for the stop before they finish.
async fn term_test_worker() {
    let record = open_append(Path::new(&env(CHILD_RECORD)));
    let gate = open_append(Path::new(&env(CHILD_GATE)));
    let pause: u64 = env(CHILD_PAUSE).parse().expect("a pause count");
    let started = Arc::new(AtomicU64::new(0));
    let stop = StopHandle::new();
    stop.stop_on_signals().expect("handle SIGTERM");
    let stopped = stop.clone();
    let messenger = messenger(&env(CHILD_DSN), move |job: Job| {
        let (record, gate, started, stopped) = (
            record.clone(),
            gate.clone(),
            started.clone(),
            stopped.clone(),
        );
        async move {
            if started.fetch_add(1, Ordering::SeqCst) >= pause {
                append(&gate, job.id);
                stopped.stopped().await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            append(&record, job.id);
            Ok(())
        }
    })
    .await;
    let report: WorkerReport = Worker::builder(&messenger)
        .receiver(QUEUE)
        .concurrency(CONCURRENCY)
        .batch_size(BATCH)
        .grace_period(Duration::from_secs(120))
        .stop_handle(stop)
        .build()
        .expect("worker")
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    println!("worker report: {report:?}");
    assert_eq!(report.reason, StopReason::Stopped);
    assert!(
        report.stats.released > 0,
        "the test means to stop a worker holding fetched messages it has not started"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_with_sigterm_finishes_in_flight_work_and_loses_nothing() {
    const TEST: &str = "a_worker_stopped_with_sigterm_finishes_in_flight_work_and_loses_nothing";
    if std::env::var(CHILD).as_deref() == Ok("term") {
        return term_test_worker().await;
    }
    const N: u32 = 400;
    // Not a multiple of the batch size: the stop finds fetched messages
    // not started yet, to give back.
    const PAUSE: usize = 50;

    let dir = test_dir("crash-sigterm");
    // A long lease: a message left leased by the stop would stay out of
    // reach for the rest of the test.
    let dsn = format!(
        "sqlite://{}?lease=10m&poll=20ms",
        dir.join("queue.db").display()
    );
    let parent = messenger(&dsn, |_: Job| async { Ok(()) }).await;
    send_jobs(&parent, N).await;

    let record = dir.join("handled.txt");
    let gate = dir.join("gate.txt");
    let mut worker = WorkerProcess::spawn(
        TEST,
        "term",
        dir.join("worker.log"),
        &[
            (CHILD_DSN, dsn.clone()),
            (CHILD_RECORD, record.display().to_string()),
            (CHILD_GATE, gate.display().to_string()),
            (CHILD_PAUSE, PAUSE.to_string()),
        ],
    );
    // Signal once a full set of handlers is in flight, waiting at the gate.
    worker
        .wait_until(&format!("{CONCURRENCY} handlers in flight"), || {
            complete_lines(&gate).len() >= CONCURRENCY
        })
        .await;
    let sent = Command::new("kill")
        .args(["-TERM", &worker.pid().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success(), "kill -TERM failed: {sent}");
    let status = worker.exit().await;
    assert!(
        status.success(),
        "the worker did not exit cleanly on SIGTERM ({status}); its output:\n{}",
        worker.log()
    );

    let handled = ids(&record);
    let in_flight = ids(&gate);
    let handled_set: BTreeSet<u32> = handled.iter().copied().collect();
    assert_eq!(
        handled.len(),
        handled_set.len(),
        "a message was handled twice: {handled:?}"
    );
    assert_eq!(in_flight.len(), CONCURRENCY, "handlers at the gate");
    for id in &in_flight {
        assert!(
            handled_set.contains(id),
            "message {id} was in flight at the signal and never finished"
        );
    }
    assert_eq!(
        handled.len(),
        PAUSE + CONCURRENCY,
        "the worker started messages after the signal"
    );

    // Handled means acknowledged: none of them is in the queue; everything
    // else is.
    let waiting = waiting_ids(&parent, N).await;
    let waiting_set: BTreeSet<u32> = waiting.iter().copied().collect();
    assert_eq!(
        waiting.len(),
        waiting_set.len(),
        "a message is stored twice"
    );
    let both: Vec<&u32> = handled_set.intersection(&waiting_set).collect();
    assert!(both.is_empty(), "handled but not acknowledged: {both:?}");
    let all: BTreeSet<u32> = handled_set.union(&waiting_set).copied().collect();
    let lost: Vec<u32> = (0..N).filter(|id| !all.contains(id)).collect();
    assert!(lost.is_empty(), "messages lost: {lost:?}");
    assert_eq!(handled.len() + waiting.len(), N as usize);
    let queue = parent.transport(QUEUE).expect("the queue");
    assert_eq!(
        queue.counter().message_count().await.expect("count"),
        waiting.len() as u64
    );

    // None is stuck under a lease (which would last 10 minutes): one claim
    // gets every one of them.
    let claimed = queue.receiver().get(N as usize).await.expect("get");
    assert_eq!(
        claimed.len(),
        waiting.len(),
        "messages the stopped worker fetched were left leased"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
