//! Symfony Messenger 5.4 (Debian packages) with its AMQP, Redis and Doctrine
//! transports: `amqp_vs_symfony`, `redis_vs_symfony` and
//! `postgres_vs_symfony`.
//!
//! The side is `peers/symfony/bench.php`: it starts [`WORKERS`] worker
//! processes (one per core, as Symfony's deployment docs suggest running
//! several `messenger:consume` under a supervisor), each running
//! Messenger's own `messenger:consume` command, then dispatches N messages
//! through a bus whose routing sends them to the transport. Each round
//! uses its own queue / stream / table and removes it at the end.

use std::process::Command;

use super::{install, unique};

/// Worker processes: one per core of the 2-core machine.
const WORKERS: u32 = 2;

/// The Debian packages the side needs: PHP, Messenger and its three
/// transports with the PHP extensions they use.
const PACKAGES: &[&str] = &[
    "php-cli",
    "php-amqp",
    "php-redis",
    "php-pgsql",
    "php-symfony-messenger",
    "php-symfony-amqp-messenger",
    "php-symfony-redis-messenger",
    "php-symfony-doctrine-messenger",
    "php-symfony-console",
    "php-symfony-event-dispatcher",
    "php-symfony-dependency-injection",
    "php-doctrine-dbal",
];

/// Installs PHP and Symfony Messenger (`apt-get install`) if missing.
pub(super) fn prepare() -> Result<(), String> {
    install::apt("symfony", PACKAGES).map(|_| ())
}

fn command(transport: &str, url: &str, n: u64) -> Result<Command, String> {
    let dir = install::cache_dir("symfony")?;
    let mut cmd = Command::new("php");
    cmd.arg(dir.join("bench.php"))
        .args([
            "--transport",
            transport,
            "--n",
            &n.to_string(),
            "--url",
            url,
        ])
        .args(["--queue", &format!("envoi_bench_sf_{}", unique())])
        .args(["--workers", &WORKERS.to_string()])
        .current_dir(dir);
    Ok(cmd)
}

/// One round of `amqp_vs_symfony`.
pub(super) fn amqp(url: &str, n: u64) -> Result<Command, String> {
    command("amqp", url, n)
}

/// One round of `redis_vs_symfony`.
pub(super) fn redis(url: &str, n: u64) -> Result<Command, String> {
    command("redis", url, n)
}

/// One round of `postgres_vs_symfony` (the Doctrine transport).
pub(super) fn doctrine(url: &str, n: u64) -> Result<Command, String> {
    command("doctrine", url, n)
}
