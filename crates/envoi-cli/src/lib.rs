//! # envoi-cli
//!
//! Command-line tools for [envoi](envoi_core) that an application embeds in
//! its own binary, because the handlers a worker runs live there. Build the
//! application's [`Messenger`] as usual, then hand it the arguments:
//!
//! ```no_run
//! use envoi_core::Messenger;
//! use std::process::ExitCode;
//!
//! # fn configure() -> Messenger { Messenger::builder().build().unwrap() }
//! #[tokio::main]
//! async fn main() -> ExitCode {
//!     let messenger = configure(); // handlers, transports, routes
//!     envoi_cli::run(&messenger, std::env::args_os()).await
//! }
//! ```
//!
//! ## Commands
//!
//! | command | what it does |
//! |---|---|
//! | `consume <transports…>` | runs a [`Worker`](envoi_core::worker::Worker) on the transports, in priority order, with a progress bar and a live rate; `--limit N`, `--time-limit 30s`, `--memory-limit 128MB`, `--failure-limit N`, `--concurrency N` (1 by default), `--batch-size N`, `--grace-period 10s`, `--stop-when-empty`, `-q`/`--quiet` (no line per failed message or failed transport operation); stops gracefully on SIGINT / SIGTERM, and at once on a second one (releasing what is in flight); fails when nothing was read and a fetch failed |
//! | `failed show [id]` | a table of the messages in the failure transport (id, message, error, retries, failed at), or one message in detail with its error chain and stamps; `--max N`, `--transport NAME`, `--format text\|json` (`--json` for short) |
//! | `failed retry <ids…>` / `--all` | handles failed messages again (see below) |
//! | `failed remove <ids…>` / `--all` | deletes failed messages |
//! | `stats [transports…]` | messages waiting per transport (a transport that cannot count its messages says so, without failing the command); `--format text\|json` (`--json` for short) |
//! | `setup-transports [transports…]` | creates tables, queues and streams, and brings a table made by an older version up to date (a transport with nothing to create says so) |
//! | `debug` | each bus's pipeline, the routes, transports and handlers |
//!
//! Errors — an unknown transport, a missing id, a transport that cannot be
//! reached — print one line to standard error and exit with status 1; a
//! command line clap cannot parse (an unknown flag, a bad duration or
//! number, a zero limit) prints clap's message and exits with status 2. Output
//! written into a closed pipe (`failed show | head -1`) is not an error: the
//! command ends there and exits with status 0.
//!
//! The `failed` commands work on a failure transport: the only one
//! configured, or the one `--transport` names. When the messenger has
//! failure transports, naming any other transport is an error, so `failed
//! remove --all --transport orders` cannot delete waiting work; a messenger
//! without any accepts the transport `--transport` names.
//!
//! Each command works through the abilities a transport hands out (see
//! [`Transport`](envoi_core::transport::Transport)): `failed show` lists
//! and finds messages through its
//! [`Browse`](envoi_core::transport::Browse), `failed retry` and `failed
//! remove` also remove them through its
//! [`Receiver`](envoi_core::transport::Receiver), `stats` counts through
//! [`MessageCount`](envoi_core::transport::MessageCount) and
//! `setup-transports` sets up through
//! [`Setup`](envoi_core::transport::Setup). A failure transport without the
//! ability a `failed` command needs is an error of one line naming the
//! command, before anything is done.
//!
//! `consume` on a failure transport prints a warning on standard error:
//! messages that fail there again are parked in it again under a new id, due
//! 1 s later, then 2 s, 4 s … up to an hour, so they keep coming back, less
//! and less often; with `--stop-when-empty` it stops once each message there
//! has been tried. `failed retry` handles each failed message once.
//!
//! ## Retrying failed messages
//!
//! `failed retry` takes each message from the failure transport and handles
//! it as a worker consuming that transport would
//! ([`handle_one`](envoi_core::worker::handle_one)): it dispatches it as a
//! message received from there, with a
//! [`ReceivedStamp`](envoi_core::stamp::ReceivedStamp) naming the failure
//! transport. The pipeline's `FailedMessageProcessing` step then treats it
//! like its original delivery, with a fresh retry budget:
//!
//! * handled — it is removed from the failure transport; a dispatch its
//!   handlers deferred that fails is parked there on its own (the table
//!   says so), as the worker does, and the message removed all the same;
//!   when one cannot be parked, the message stays, to be handled again;
//! * a deferred dispatch parked because it could not be sent to its
//!   transport (an `UnsentStamp`) — it is sent there (and to the
//!   transports routed after it) and removed, not handled; the table says
//!   where it was sent, and the summary counts it apart; a transport that
//!   refuses it for good (it does not exist, or the message is too large
//!   for it) has it parked again, as failed again, naming that transport;
//! * failed with retries left — the retry step sends it back to its original
//!   transport with a delay (a worker consuming that transport handles it),
//!   and it is removed from the failure transport;
//! * failed for good — the retry step parks it in the failure transport
//!   again (under a new id, due 1 s later, doubling each time it comes
//!   back) and the old copy is removed; so does the worker when it fails
//!   otherwise (no handler, a middleware's error, a panic); dispatches
//!   its handlers that succeeded deferred that fail are parked too;
//! * anything else (it does not decode, a transport error, parking it
//!   fails, there is no failure transport for its origin) — it stays where
//!   it is and the command exits with status 1.
//!
//! When the old copy of a retried message cannot be removed, the table says
//! so and the command exits with status 1: the message is still in the
//! failure transport, and another retry would handle it again.
//!
//! `failed remove` lists what it removed. When the failure transport could
//! delete only some of the messages, it lists those, names the ones still
//! there, and exits with status 1.
//!
//! ## Embedding the commands in a larger command line
//!
//! [`Command`] is a clap subcommand enum, so an application can flatten it
//! into its own, then run one with [`execute`]:
//!
//! ```no_run
//! use clap::Parser;
//! use envoi_cli::{Console, execute};
//!
//! #[derive(Parser)]
//! enum App {
//!     /// Serves the HTTP API.
//!     Serve,
//!     #[command(flatten)]
//!     Envoi(envoi_cli::Command),
//! }
//!
//! # async fn main_(messenger: envoi_core::Messenger) {
//! match App::parse() {
//!     App::Serve => { /* … */ }
//!     App::Envoi(command) => {
//!         if let Err(e) = execute(&messenger, command, &mut Console::stdout()).await {
//!             eprintln!("error: {e}");
//!             std::process::exit(1);
//!         }
//!     }
//! }
//! # }
//! ```

#![forbid(unsafe_code)]

mod consume;
mod detail;
mod failed;
mod inspect;
mod parse;
mod stats;
mod table;

use std::ffi::OsString;
use std::fmt;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use envoi_core::worker::{StopHandle, WorkerError};
use envoi_core::{Messenger, TransportError};

pub use consume::ConsumeArgs;
pub use failed::{FailedCommand, RemoveArgs, RetryArgs, ShowArgs};
pub use parse::{parse_duration, parse_size};
pub use stats::{SetupArgs, StatsArgs};

/// The command line: one of the [`Command`]s.
#[derive(Debug, Parser)]
#[command(
    about = "Operate an envoi application's transports: consume messages, inspect and retry failures, count what is waiting.",
    disable_help_subcommand = true
)]
pub struct Cli {
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands; see the [crate documentation](crate).
#[derive(Debug, Subcommand)]
#[non_exhaustive]
pub enum Command {
    /// Consume messages from transports, in priority order (first given, first read).
    Consume(ConsumeArgs),
    /// Inspect, retry or remove messages in a failure transport.
    Failed(FailedArgs),
    /// Show how many messages wait in each transport.
    Stats(StatsArgs),
    /// Create what the transports need (tables, queues, streams), or bring it up to date.
    SetupTransports(SetupArgs),
    /// Show each bus's pipeline, the routes, transports and handlers.
    Debug,
}

/// `failed` and its subcommand.
#[derive(Debug, Args)]
pub struct FailedArgs {
    /// What to do with the failed messages.
    #[command(subcommand)]
    pub command: FailedCommand,
}

/// The output format of `stats` and `failed show`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Tables and text for people.
    #[default]
    Text,
    /// One JSON document for scripts.
    Json,
}

impl Format {
    /// The format asked for with `--format`, or JSON when `--json` was given.
    pub(crate) fn or_json(self, json: bool) -> Format {
        if json {
            Format::Json
        } else {
            self
        }
    }
}

/// What a command can fail with. Each prints as one line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// A transport name the messenger does not know.
    #[error("unknown transport `{name}` (configured: {known})")]
    UnknownTransport {
        /// The name given.
        name: String,
        /// The configured transports, comma-separated.
        known: String,
    },
    /// A `failed` command without a failure transport to work on.
    #[error("no failure transport is configured; name a transport with --transport")]
    NoFailureTransport,
    /// Several failure transports and no `--transport`.
    #[error("several failure transports are configured ({0}); choose one with --transport")]
    AmbiguousFailureTransport(String),
    /// `--transport` names a transport that is not a configured failure
    /// transport.
    #[error("`{name}` is not a failure transport (failure transports: {failure})")]
    NotAFailureTransport {
        /// The name given.
        name: String,
        /// The configured failure transports, comma-separated.
        failure: String,
    },
    /// No message has this id.
    #[error("no message with id `{id}` in `{transport}`{}", retried_note(now.as_deref()))]
    MessageNotFound {
        /// The transport searched.
        transport: String,
        /// The id.
        id: String,
        /// The id of the copy parked when this message was retried and
        /// failed again, when that copy is still there.
        now: Option<String>,
    },
    /// The transport lacks an ability the command needs, such as listing
    /// its messages for `failed show`.
    #[error("`{command}` needs a transport that can {ability}; `{transport}` cannot")]
    Unable {
        /// The command.
        command: &'static str,
        /// The transport.
        transport: String,
        /// What the command needs it to do, such as "list its messages".
        ability: &'static str,
    },
    /// A transport operation failed.
    #[error("transport `{transport}`: {source}")]
    Transport {
        /// The transport.
        transport: String,
        /// What it failed with.
        #[source]
        source: TransportError,
    },
    /// The worker could not be configured.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// Some transports could not be set up or counted (each is reported
    /// above the error).
    #[error("{failed} of {total} transport(s) failed; see above")]
    TransportsFailed {
        /// How many failed.
        failed: usize,
        /// How many were tried.
        total: usize,
    },
    /// `consume` read nothing: every fetch from a transport failed.
    #[error(
        "nothing could be read: transport `{transport}` failed {times} time(s), last with: {error}"
    )]
    NothingRead {
        /// The transport that failed last.
        transport: String,
        /// How many fetches failed.
        times: u64,
        /// The last error.
        error: String,
    },
    /// Some messages could not be retried and stay where they were.
    #[error("{kept} message(s) could not be retried and stay in `{transport}`; see above")]
    RetryIncomplete {
        /// How many stay.
        kept: usize,
        /// The failure transport.
        transport: String,
    },
    /// Some messages were retried but could not be removed from the
    /// failure transport afterwards, so they are still there: another
    /// retry would handle them again.
    #[error("{copies} retried message(s) could not be removed from `{transport}` and are still there; see above")]
    RetriedNotRemoved {
        /// How many are still there.
        copies: usize,
        /// The failure transport.
        transport: String,
    },
    /// Writing the output failed. [`execute`] never returns it for a
    /// closed pipe (see [`CliError::is_closed_output`]).
    #[error("writing the output failed: {0}")]
    Output(#[from] std::io::Error),
}

/// `: it was retried, failed again and is now <id>`, when it was.
fn retried_note(now: Option<&str>) -> String {
    match now {
        Some(id) => format!(": it was retried, failed again and is now `{id}`"),
        None => String::new(),
    }
}

impl CliError {
    /// Whether this is output written into a closed pipe (the reader, such
    /// as `head`, stopped reading): the normal end of a command whose output
    /// nobody wants any more, not a failure.
    pub fn is_closed_output(&self) -> bool {
        matches!(self, CliError::Output(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
    }

    pub(crate) fn transport(transport: &str) -> impl FnOnce(TransportError) -> CliError + '_ {
        move |source| CliError::Transport {
            transport: transport.to_string(),
            source,
        }
    }
}

/// Where a command writes, and whether it draws progress bars.
///
/// Results (tables, summaries, JSON) go to the writer; warnings go to
/// standard error (or the writer given to
/// [`with_warnings`](Self::with_warnings)); progress bars are drawn on
/// standard error, only when enabled.
pub struct Console<'a> {
    pub(crate) out: Box<dyn Write + Send + 'a>,
    pub(crate) warnings: Box<dyn Write + Send + 'a>,
    pub(crate) progress: bool,
    pub(crate) stop: Option<StopHandle>,
}

impl fmt::Debug for Console<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Console")
            .field("progress", &self.progress)
            .finish_non_exhaustive()
    }
}

impl Console<'static> {
    /// Standard output, with warnings on standard error and progress bars
    /// when standard error is a terminal.
    pub fn stdout() -> Self {
        Console {
            out: Box::new(std::io::stdout()),
            warnings: Box::new(std::io::stderr()),
            progress: std::io::stderr().is_terminal(),
            stop: None,
        }
    }
}

impl<'a> Console<'a> {
    /// Writes to `out`, without progress bars; warnings go to standard
    /// error.
    pub fn new(out: impl Write + Send + 'a) -> Self {
        Console {
            out: Box::new(out),
            warnings: Box::new(std::io::stderr()),
            progress: false,
            stop: None,
        }
    }

    /// Writes warnings (one line each) to `warnings` instead of standard
    /// error.
    #[must_use]
    pub fn with_warnings(mut self, warnings: impl Write + Send + 'a) -> Self {
        self.warnings = Box::new(warnings);
        self
    }

    /// Draws progress bars on standard error (or not).
    #[must_use]
    pub fn with_progress(mut self, progress: bool) -> Self {
        self.progress = progress;
        self
    }

    /// Lets `consume` also be stopped with `stop`, besides SIGINT and
    /// SIGTERM.
    #[must_use]
    pub fn with_stop_handle(mut self, stop: StopHandle) -> Self {
        self.stop = Some(stop);
        self
    }
}

/// Parses `args` (the first is the program name) and runs the command on
/// standard output. Prints errors as one line on standard error; returns
/// the exit status: 0 on success, 1 when the command failed, 2 for a command
/// line that does not parse.
pub async fn run<I, T>(messenger: &Messenger, args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match Cli::parse_args(args) {
        Ok(cli) => cli.run(messenger).await,
        Err(code) => ExitCode::from(code),
    }
}

impl Cli {
    /// Parses `args` (the first is the program name) without running
    /// anything, so an application can build its [`Messenger`] — open
    /// databases, connect to brokers — only for a command that will run:
    ///
    /// ```no_run
    /// use envoi_cli::Cli;
    /// use std::process::ExitCode;
    ///
    /// # async fn connect() -> envoi_core::Messenger { envoi_core::Messenger::builder().build().unwrap() }
    /// # async fn main_() -> ExitCode {
    /// let cli = match Cli::parse_args(std::env::args_os()) {
    ///     Ok(cli) => cli,
    ///     Err(status) => return ExitCode::from(status), // --help, or a bad command line
    /// };
    /// let messenger = connect().await;
    /// cli.run(&messenger).await
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// For `--help` or a command line that does not parse, prints clap's
    /// text (help on standard output, errors on standard error) and returns
    /// the exit status to end with: 0 for help, 2 for an error. There is no
    /// `--version` flag: it is refused like any unknown flag.
    pub fn parse_args<I, T>(args: I) -> Result<Cli, u8>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        Cli::try_parse_from(args).map_err(|e| {
            let _ = e.print();
            exit_status(&e)
        })
    }

    /// Runs the parsed command on standard output, as [`run`] does: prints
    /// an error as one line on standard error and returns 1, or 0 on
    /// success.
    pub async fn run(self, messenger: &Messenger) -> ExitCode {
        match execute(messenger, self.command, &mut Console::stdout()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        }
    }
}

/// Like [`run`], writing results to `out` and warnings and errors to `err`
/// (no progress bars); returns the exit status. For tests and for
/// applications that capture the output.
pub async fn run_with<I, T>(
    messenger: &Messenger,
    args: I,
    out: &mut (dyn Write + Send),
    err: &mut (dyn Write + Send),
) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match Cli::try_parse_from(args) {
        Ok(cli) => {
            let mut console = Console::new(out).with_warnings(&mut *err);
            let result = execute(messenger, cli.command, &mut console).await;
            drop(console);
            match result {
                Ok(()) => 0,
                Err(e) => {
                    let _ = writeln!(err, "error: {e}");
                    1
                }
            }
        }
        Err(e) => {
            let code = exit_status(&e);
            let text = e.render().to_string();
            let _ = if code == 0 {
                write!(out, "{text}")
            } else {
                write!(err, "{text}")
            };
            code
        }
    }
}

fn exit_status(e: &clap::Error) -> u8 {
    if e.use_stderr() {
        2
    } else {
        0
    }
}

/// Runs one command.
///
/// Output written into a closed pipe ends the command without an error: a
/// reader such as `head` that stopped reading is not a failure.
///
/// # Errors
///
/// See [`CliError`]; everything the command managed to do before failing
/// is written to the console first.
pub async fn execute(
    messenger: &Messenger,
    command: Command,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    match run_command(messenger, command, console).await {
        Err(e) if e.is_closed_output() => Ok(()),
        result => result,
    }
}

async fn run_command(
    messenger: &Messenger,
    command: Command,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    match command {
        Command::Consume(args) => consume::run(messenger, args, console).await,
        Command::Failed(FailedArgs { command }) => failed::run(messenger, command, console).await,
        Command::Stats(args) => stats::stats(messenger, args, console).await,
        Command::SetupTransports(args) => stats::setup(messenger, args, console).await,
        Command::Debug => {
            write!(console.out, "{}", messenger.debug())?;
            Ok(())
        }
    }
}

/// A transport with its name.
pub(crate) type Named<'m> = (
    &'m str,
    &'m std::sync::Arc<dyn envoi_core::transport::Transport>,
);

/// The transports called `names`, or every transport when `names` is
/// empty; an unknown name is an error listing the configured ones.
pub(crate) fn resolve_transports<'m>(
    messenger: &'m Messenger,
    names: &[String],
) -> Result<Vec<Named<'m>>, CliError> {
    if names.is_empty() {
        return Ok(messenger.transports().collect());
    }
    names
        .iter()
        .map(|name| {
            messenger
                .transports()
                .find(|(n, _)| *n == name.as_str())
                .ok_or_else(|| unknown_transport(messenger, name))
        })
        .collect()
}

pub(crate) fn unknown_transport(messenger: &Messenger, name: &str) -> CliError {
    let known = messenger.transport_names();
    CliError::UnknownTransport {
        name: name.to_string(),
        known: if known.is_empty() {
            "none".to_string()
        } else {
            known.join(", ")
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn only_a_broken_pipe_counts_as_a_closed_output() {
        use std::io::{Error, ErrorKind};
        assert!(CliError::Output(Error::from(ErrorKind::BrokenPipe)).is_closed_output());
        for kind in [
            ErrorKind::WriteZero,
            ErrorKind::PermissionDenied,
            ErrorKind::Other,
        ] {
            assert!(!CliError::Output(Error::from(kind)).is_closed_output());
        }
        assert!(!CliError::NoFailureTransport.is_closed_output());
    }
}
