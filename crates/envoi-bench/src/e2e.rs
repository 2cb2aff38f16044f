//! What every end-to-end scenario shares (the job, envoi's round trip with
//! the real worker) and `memory_e2e`: send N messages through a transport,
//! then consume them all with the worker, against the strongest reasonable
//! code a user writes for the same work, in the same process.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::transport::in_memory::InMemoryTransport;
use envoi_core::transport::Transport;
use envoi_core::worker::Worker;
use envoi_core::{Command, Message, Messenger};
use serde::{Deserialize, Serialize};

use crate::alloc;
use crate::harness::{self, Plan};

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

/// How many dispatches run at once on the sending side.
pub(crate) const PRODUCERS: u64 = 64;

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
}

/// How the sends and the worker of envoi's round trip share the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phases {
    /// Every job is sent first, then the worker consumes them all.
    SendThenConsume,
    /// The worker runs while the jobs are sent, and the producers keep at
    /// most `max_backlog` jobs sent but not handled yet.
    Overlapped { max_backlog: u64 },
}

/// The shape of one round trip: jobs, and the worker's concurrency and
/// batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Trip {
    pub(crate) n: u64,
    pub(crate) concurrency: usize,
    pub(crate) batch: usize,
    pub(crate) phases: Phases,
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
    let trip = Trip {
        n,
        concurrency,
        batch,
        phases: Phases::SendThenConsume,
    };
    envoi_trip(messenger, transport, handled, trip).await
}

/// [`envoi_round_trip`] laid out as `trip.phases` says.
pub(crate) async fn envoi_trip(
    messenger: &Messenger,
    transport: &str,
    handled: &Arc<AtomicU64>,
    trip: Trip,
) -> Result<f64, String> {
    let n = trip.n;
    let start = Instant::now();
    let worker = Worker::builder(messenger)
        .receiver(transport)
        .concurrency(trip.concurrency)
        .batch_size(trip.batch)
        .message_limit(n)
        .time_limit(Duration::from_secs(600))
        .build()
        .map_err(|e| e.to_string())?;
    let report = match trip.phases {
        Phases::SendThenConsume => {
            join_producers(spawn_producers(messenger, n, None)).await?;
            let sent = start.elapsed();
            let report = worker.run().await;
            eprintln!(
                "  envoi: sent {n} in {:.3}s, consumed in {:.3}s",
                sent.as_secs_f64(),
                (start.elapsed() - sent).as_secs_f64()
            );
            report
        }
        Phases::Overlapped { max_backlog } => {
            let gate = Some((handled.clone(), max_backlog));
            let producers = spawn_producers(messenger, n, gate);
            let report = worker.run().await;
            for p in &producers {
                p.abort();
            }
            join_producers(producers).await?;
            eprintln!(
                "  envoi: sent and consumed {n} concurrently in {:.3}s",
                start.elapsed().as_secs_f64()
            );
            report
        }
    };
    let total = start.elapsed();
    let got = handled.load(Ordering::Relaxed);
    if got != n || report.stats.handled != n {
        return Err(format!(
            "envoi handled {got} of {n} messages (worker: {:?}, stopped: {:?})",
            report.stats, report.reason
        ));
    }
    Ok(n as f64 / total.as_secs_f64())
}

/// Starts [`PRODUCERS`] tasks dispatching jobs `0..n` between them. With a
/// `gate` (the handled counter and a backlog), each job waits until no more
/// than the backlog is sent but not handled.
fn spawn_producers(
    messenger: &Messenger,
    n: u64,
    gate: Option<(Arc<AtomicU64>, u64)>,
) -> Vec<tokio::task::JoinHandle<Result<(), String>>> {
    let reserved = Arc::new(AtomicU64::new(0));
    (0..PRODUCERS)
        .map(|p| {
            let dispatcher = messenger.dispatcher();
            let (gate, reserved) = (gate.clone(), reserved.clone());
            tokio::spawn(async move {
                let mut id = p;
                while id < n {
                    if let Some((handled, backlog)) = &gate {
                        // Reserve first, so that the producers together
                        // never exceed the backlog.
                        let mine = reserved.fetch_add(1, Ordering::SeqCst) + 1;
                        while mine.saturating_sub(handled.load(Ordering::SeqCst)) > *backlog {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                    dispatcher
                        .dispatch(job(id))
                        .await
                        .map_err(|e| format!("dispatch failed: {e}"))?;
                    id += PRODUCERS;
                }
                Ok::<_, String>(())
            })
        })
        .collect()
}

/// Waits for every producer; the first error wins (an aborted producer,
/// one the worker no longer needed, is no error).
async fn join_producers(
    producers: Vec<tokio::task::JoinHandle<Result<(), String>>>,
) -> Result<(), String> {
    for p in producers {
        match p.await {
            Ok(sent) => sent?,
            Err(e) if e.is_cancelled() => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
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

/// `memory_e2e`: the in-memory transport against a plain tokio mpsc loop,
/// run by the [harness] (warm-ups, ABBA rounds, medians).
/// The allocations reported are those of each side's last timed run.
pub(crate) fn memory() -> Result<(), String> {
    let rt = runtime()?;
    let plan = Plan::from_env()?;
    let n = plan.n;
    let (mut envoi_allocs, mut baseline_allocs) = (0, 0);
    let outcome = harness::compare(
        &plan,
        |n| {
            let (rate, allocs) = rt.block_on(alloc::count_async(memory_envoi(n)));
            envoi_allocs = allocs;
            rate
        },
        |n| {
            let (rate, allocs) = rt.block_on(alloc::count_async(memory_baseline(n)));
            baseline_allocs = allocs;
            rate
        },
    )?;
    let per_message = |allocs: usize| format!("{:.1}", allocs as f64 / n as f64);
    harness::summary(
        "memory_e2e",
        &plan,
        &outcome,
        "msg/s",
        &[
            ("allocs", per_message(envoi_allocs)),
            ("baseline_allocs", per_message(baseline_allocs)),
        ],
    );
    Ok(())
}

/// Profiling aid: only envoi's side of `memory_e2e`, once, with
/// `ENVOI_BENCH_N` messages.
pub(crate) fn profile_memory() -> Result<(), String> {
    let n = Plan::from_env()?.n;
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
