//! BullMQ 6 (npm) on Redis: `redis_vs_bullmq`.
//!
//! The side is `peers/bullmq/bench.mjs`: it forks [`WORKERS`] worker
//! processes (one per core, as BullMQ's parallelism guide has it), each with
//! one `Worker` of concurrency 50, and enqueues from its main process with
//! `Queue.addBulk` in chunks of 1,000 jobs, each removed once completed
//! (`removeOnComplete`). Each round uses its own queue and obliterates it
//! at the end.

use std::process::Command;

use super::{install, unique};

/// Worker processes: one per core of the 2-core machine.
const WORKERS: u32 = 2;

/// Installs BullMQ (`npm ci`) if needed.
pub(super) fn prepare() -> Result<(), String> {
    install::npm("bullmq").map(|_| ())
}

/// One round of `redis_vs_bullmq`.
pub(super) fn command(url: &str, n: u64) -> Result<Command, String> {
    let dir = install::cache_dir("bullmq")?;
    let mut cmd = Command::new("node");
    cmd.arg(dir.join("bench.mjs"))
        .args(["--n", &n.to_string(), "--url", url])
        .args(["--queue", &format!("envoi-bench-bullmq-{}", unique())])
        .args(["--workers", &WORKERS.to_string()])
        .current_dir(dir);
    Ok(cmd)
}
