//! Dramatiq 2 (PyPI) on RabbitMQ and on Redis: `amqp_vs_dramatiq` and
//! `redis_vs_dramatiq`.
//!
//! The side is `peers/dramatiq/bench.py`: it starts the `dramatiq` command
//! with Dramatiq's defaults for this machine (one worker process per core,
//! 8 threads each, the broker's default prefetch) and sends one message per
//! `send` (Dramatiq has no bulk enqueue). Each round uses its own queue
//! (RabbitMQ) or key namespace (Redis) and deletes it at the end.

use std::process::Command;

use super::{install, unique};

/// Installs Dramatiq (`pip install --target`) if needed.
pub(super) fn prepare() -> Result<(), String> {
    install::pip("dramatiq").map(|_| ())
}

fn command(broker: &str, url: &str, n: u64) -> Result<Command, String> {
    let dir = install::cache_dir("dramatiq")?;
    let mut cmd = Command::new("python3");
    cmd.arg(dir.join("bench.py"))
        .args(["--broker", broker, "--n", &n.to_string(), "--url", url])
        .args(["--queue", &format!("envoi-bench-dramatiq-{}", unique())])
        .env("PYTHONPATH", dir.join("site"))
        .current_dir(dir);
    Ok(cmd)
}

/// One round of `amqp_vs_dramatiq`.
pub(super) fn rabbitmq(url: &str, n: u64) -> Result<Command, String> {
    command("rabbitmq", url, n)
}

/// One round of `redis_vs_dramatiq`.
pub(super) fn redis(url: &str, n: u64) -> Result<Command, String> {
    command("redis", url, n)
}
