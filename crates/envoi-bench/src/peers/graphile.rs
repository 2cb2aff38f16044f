//! graphile-worker 0.18 (npm) on PostgreSQL: `postgres_vs_graphile` and
//! `postgres_vs_graphile_unbatched`.
//!
//! The side is `peers/graphile/bench.mjs`: it forks [`WORKERS`] worker
//! processes (one per core), each `run()`ning graphile-worker with the
//! preset of its own perfTest (concurrentJobs 24, maxPoolSize 25), and
//! enqueues from its main process. "Batched" is what graphile-worker's
//! performance page calls batching: `addJobs` (chunks of 1,000 jobs) to
//! enqueue, and the workers' local queue (500 jobs, refetch delay 10 ms)
//! and batched completion (`completeJobBatchDelay` / `failJobBatchDelay`
//! 0). "Unbatched" turns those off (-1, the defaults) and enqueues with one
//! `addJob` per job from 64 concurrent producers. Each round uses its own
//! schema and drops it at the end.

use std::process::Command;

use super::{install, unique};

/// Worker processes: one per core of the 2-core machine.
const WORKERS: u32 = 2;

/// Installs graphile-worker (`npm ci`) if needed.
pub(super) fn prepare() -> Result<(), String> {
    install::npm("graphile").map(|_| ())
}

fn command(mode: &str, url: &str, n: u64) -> Result<Command, String> {
    let dir = install::cache_dir("graphile")?;
    let mut cmd = Command::new("node");
    cmd.arg(dir.join("bench.mjs"))
        .args(["--mode", mode, "--n", &n.to_string(), "--url", url])
        .args(["--schema", &format!("envoi_bench_gw_{}", unique())])
        .args(["--workers", &WORKERS.to_string()])
        .current_dir(dir);
    Ok(cmd)
}

/// One round of `postgres_vs_graphile`.
pub(super) fn batched(url: &str, n: u64) -> Result<Command, String> {
    command("batched", url, n)
}

/// One round of `postgres_vs_graphile_unbatched`.
pub(super) fn unbatched(url: &str, n: u64) -> Result<Command, String> {
    command("unbatched", url, n)
}
