//! apalis 1.0 side of envoi-bench's `memory_vs_apalis` scenario.
//!
//!     apalis-memory --n N [--concurrency C] [--producers P]
//!
//! Starts one apalis worker of concurrency C over the in-memory backend
//! (`MemoryStorage`), then starts the clock and pushes N jobs of the bench's
//! ~100-byte payload from P concurrent producers (64 by default, as on
//! envoi's side), each through its own sink onto the storage's channel (one
//! shared `MemorySink` would panic when two producers meet in it, since its
//! `start_send` uses `try_lock().unwrap()`). The no-op handler counts the
//! jobs; when it has counted N it notes the time and stops the worker. It
//! prints `handled=<jobs> seconds=<from the first push to the N-th job>
//! peak_rss_kb=<this process's peak RSS>`.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use apalis::prelude::*;
use apalis_core::backend::memory::{MemorySink, MemoryStorage, MemoryStorageError};
use apalis_core::task::Task;
use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};

/// The bench's payload: the same ~100-byte shape on every side.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    id: u64,
    order: String,
    customer: String,
    amount_cents: u64,
    currency: String,
}

fn payload(id: u64) -> Order {
    Order {
        id,
        order: format!("order-{id:08}"),
        customer: format!("customer-{:05}", id % 1000),
        amount_cents: 1000 + id % 9000,
        currency: "EUR".to_owned(),
    }
}

static HANDLED: AtomicU64 = AtomicU64::new(0);
static TARGET: AtomicU64 = AtomicU64::new(0);
static LAST: OnceLock<Instant> = OnceLock::new();

/// The no-op handler: counts, and stops the worker at the N-th job.
async fn handle(order: Order, worker: WorkerContext) -> Result<(), BoxDynError> {
    std::hint::black_box(order.id);
    if HANDLED.fetch_add(1, Ordering::SeqCst) + 1 == TARGET.load(Ordering::SeqCst) {
        let _ = LAST.set(Instant::now());
        let _ = worker.stop();
    }
    Ok(())
}

struct Opts {
    n: u64,
    concurrency: usize,
    producers: u64,
}

fn parse_args(args: &[String]) -> Result<Opts, String> {
    let mut opts = Opts {
        n: 0,
        concurrency: 64,
        producers: 64,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .parse::<u64>()
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| format!("{flag} needs a positive number"))?;
        match flag.as_str() {
            "--n" => opts.n = value,
            "--concurrency" => opts.concurrency = value as usize,
            "--producers" => opts.producers = value,
            other => return Err(format!("unknown option {other}")),
        }
    }
    if opts.n == 0 {
        return Err("usage: apalis-memory --n N [--concurrency C] [--producers P]".into());
    }
    Ok(opts)
}

type BoxSink = Box<dyn futures::Sink<Task<Order>, Error = MemoryStorageError> + Send + Sync + Unpin>;

/// A sink of its own onto the channel `tx` feeds.
fn sink(tx: &futures::channel::mpsc::UnboundedSender<Task<Order>>) -> MemorySink<Order> {
    let inner: BoxSink = Box::new(tx.clone().sink_map_err(MemoryStorageError::from));
    MemorySink::new(Arc::new(futures::lock::Mutex::new(inner)))
}

async fn run(opts: Opts) -> Result<(u64, f64), String> {
    TARGET.store(opts.n, Ordering::SeqCst);
    let (tx, rx) = futures::channel::mpsc::unbounded::<Task<Order>>();
    let storage = MemoryStorage::new_with(sink(&tx), rx.boxed());
    let worker = WorkerBuilder::new("envoi-bench")
        .backend(storage)
        .concurrency(opts.concurrency)
        .build(handle);
    let start = Instant::now();
    let mut producers = Vec::new();
    for p in 0..opts.producers {
        let mut sink = sink(&tx);
        let (n, step) = (opts.n, opts.producers);
        producers.push(tokio::spawn(async move {
            let mut id = p;
            while id < n {
                sink.send(Task::new(payload(id)))
                    .await
                    .map_err(|e| format!("push failed: {e}"))?;
                id += step;
            }
            Ok::<_, String>(())
        }));
    }
    let ran = tokio::time::timeout(Duration::from_secs(600), worker.run()).await;
    for p in producers {
        p.await.map_err(|e| e.to_string())??;
    }
    ran.map_err(|_| "the worker did not finish within 10 minutes".to_string())?
        .map_err(|e| format!("worker failed: {e}"))?;
    let handled = HANDLED.load(Ordering::SeqCst);
    let last = LAST.get().ok_or(format!("handled {handled} of {}", opts.n))?;
    Ok((handled, (*last - start).as_secs_f64()))
}

/// This process's peak resident set in KiB (`VmHWM`), 0 where unknown.
fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|kb| kb.parse().ok())
        })
        .unwrap_or(0)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("apalis-memory: {e}");
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
            eprintln!("apalis-memory: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(opts)) {
        Ok((handled, seconds)) => {
            println!("handled={handled} seconds={seconds:.6} peak_rss_kb={}", peak_rss_kb());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("apalis-memory: {e}");
            ExitCode::FAILURE
        }
    }
}
