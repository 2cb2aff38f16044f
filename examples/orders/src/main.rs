//! Run with: `cargo run --release -p example-orders`
//!
//! envoi's main example, on the embedded SQLite transport (no broker): it
//! dispatches 5,000 `PlaceOrder` commands to the `orders` transport; a worker
//! in this process handles them, each publishing an `OrderPlaced` event to
//! the `events` transport for two more handlers. Some handlers fail once and
//! succeed on a retry; a few fail for good and are parked in the `failed`
//! transport. It ends with a summary: handled, retried, failed, throughput
//! and latency from dispatch to handled.
//!
//! Given arguments, the binary runs envoi's command line on the same
//! messenger and database instead, to look at what the last run left:
//!
//! ```sh
//! cargo run --release -p example-orders -- failed show
//! cargo run --release -p example-orders -- failed retry --all
//! cargo run --release -p example-orders -- stats
//! ```
//!
//! `EXAMPLE_ORDERS_DB` sets the database file (by default
//! `example-orders-data/envoi.db` in the cargo target directory; the main
//! job deletes it at the start, and refuses a file that is not an SQLite
//! database) and `EXAMPLE_ORDERS_COUNT` the number of orders. Ctrl-C stops
//! the job gracefully, a second Ctrl-C at once. While the job runs, the
//! command line refuses its database, and the other way round.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use example_orders::{
    database_path, database_variable, lock_database, messenger, run, thousands, Access, FlowConfig,
    FlowError, EVENTS, FAILED, ORDERS,
};

/// How to run the command line on the database just used: with its path
/// when `EXAMPLE_ORDERS_DB` chose it, quoted for a POSIX shell so that the
/// line works when pasted.
fn command() -> String {
    let db = database_variable()
        .map(|p| format!("EXAMPLE_ORDERS_DB={} ", shell_quote(&p.to_string_lossy())))
        .unwrap_or_default();
    format!("{db}cargo run --release -p example-orders --")
}

/// `text` in single quotes, each `'` in it written as `'\''`, so that a
/// POSIX shell reads it back unchanged.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// Prints a line on standard output; a closed pipe (`| head`) is not an error.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

#[tokio::main]
async fn main() -> ExitCode {
    let database = database_path();
    if std::env::args_os().len() > 1 {
        // Parsed first: `--help` or a bad command line needs no database.
        let cli = match envoi_cli::Cli::parse_args(std::env::args_os()) {
            Ok(cli) => cli,
            Err(status) => return ExitCode::from(status),
        };
        // The command line looks at what a run left: it makes no database.
        if !database.exists() {
            eprintln!(
                "error: no database at `{}`: run the main job first ({}), or set EXAMPLE_ORDERS_DB",
                database.display(),
                command().trim_end_matches(" --")
            );
            return ExitCode::FAILURE;
        }
        let _lock = match lock_database(&database, Access::Shared) {
            Ok(lock) => lock,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        return match messenger(&database, Duration::from_millis(100)).await {
            Ok(messenger) => cli.run(&messenger).await,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let _lock = match lock_database(&database, Access::Exclusive) {
        Ok(lock) => lock,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut config = FlowConfig::new(&database).progress(std::io::stderr().is_terminal());
    // Ctrl-C or SIGTERM: stop gracefully, and say what is left.
    if let Err(e) = config.stop.stop_on_signals() {
        eprintln!("warning: Ctrl-C will not stop the run gracefully: {e}");
    }
    if let Some(count) = std::env::var_os("EXAMPLE_ORDERS_COUNT") {
        match count.to_str().and_then(|c| c.parse::<u64>().ok()) {
            Some(n) => config = config.orders(n),
            None => {
                eprintln!("error: EXAMPLE_ORDERS_COUNT must be a whole number, not {count:?}");
                return ExitCode::FAILURE;
            }
        }
    }
    say!(
        "Placing {} orders{} through SQLite at {}\n(worker concurrency {}, retries after {} ms)\n",
        thousands(config.orders),
        config
            .rate
            .map(|r| format!(" at {} a second", thousands(r)))
            .unwrap_or_default(),
        database.display(),
        config.concurrency,
        config.retry_delay.as_millis()
    );
    match run(&config).await {
        Ok(summary) => {
            say!("{summary}\n");
            if summary.in_failure_transport > 0 {
                say!(
                    "{} message(s) wait in the `{FAILED}` transport. Inspect them with the command line built into this example:\n",
                    thousands(summary.in_failure_transport)
                );
                let command = command();
                say!("  {command} failed show          # list them");
                say!("  {command} failed show <id>     # one in detail: error chain, stamps, body");
                say!("  {command} failed retry --all   # handle them again (those failing for good come back)");
                say!("  {command} failed remove --all  # delete them");
                say!("  {command} stats                # messages waiting per transport");
                say!("  {command} --help               # every command");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            if let FlowError::Incomplete { .. } = e {
                eprintln!(
                    "What is left waits in the database: `{} consume {EVENTS} {ORDERS} --stop-when-empty` handles it.",
                    command()
                );
            }
            ExitCode::FAILURE
        }
    }
}
