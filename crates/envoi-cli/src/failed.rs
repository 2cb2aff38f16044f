//! `failed show`, `failed retry` and `failed remove`.

use std::io::Write;

use clap::{ArgGroup, Args, Subcommand};
use envoi_core::stamp::{SentStamp, TransportMessageIdStamp, UnsentStamp};
use envoi_core::transport::{Browse, Delivery, DeliveryId, MessageCount, Receiver};
use envoi_core::worker::{handle_one, Outcome as WorkerOutcome, Settlement, WorkerEvent};
use envoi_core::Messenger;

use crate::detail::{write_detail, Limits};
use crate::inspect::{inspect, Inspected};
use crate::table::{flatten, truncate, Table};
use crate::{unknown_transport, CliError, Console, Format};

/// `failed show`, `failed retry` or `failed remove`.
#[derive(Debug, Subcommand)]
#[non_exhaustive]
pub enum FailedCommand {
    /// List the failed messages, or show one in detail.
    Show(ShowArgs),
    /// Handle failed messages again, as a worker would; those handled or sent for another try leave the failure transport.
    Retry(RetryArgs),
    /// Delete failed messages for good.
    Remove(RemoveArgs),
}

/// The header a message parked again by `failed retry` carries: the id of
/// the copy it was retried from.
pub(crate) const RETRIED_FROM_HEADER: &str = "retried-from";

/// How many parked messages `failed show <id>` looks through for the copy a
/// retried message became.
const RETRIED_SEARCH: usize = 10_000;

/// Arguments of `failed show`.
#[derive(Debug, Args)]
#[non_exhaustive]
pub struct ShowArgs {
    /// Show this message in detail (error chain, stamps, headers, body).
    pub id: Option<String>,
    /// List at most this many messages, oldest first.
    #[arg(
        long,
        default_value_t = 50,
        value_parser = crate::parse::parse_positive,
        allow_hyphen_values = true
    )]
    pub max: usize,
    /// The failure transport (needed when there are several).
    #[arg(long, value_name = "NAME")]
    pub transport: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Short for `--format json`.
    #[arg(long, conflicts_with = "format")]
    pub json: bool,
    /// Show one message whole: as text, long sections (over 50 headers or
    /// stamps, values over 300 characters, bodies over 200 lines) are
    /// otherwise cut, with a note of what was left out. JSON is always
    /// whole.
    #[arg(long)]
    pub full: bool,
}

/// Arguments of `failed retry`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("which").required(true).args(["ids", "all"])))]
#[non_exhaustive]
pub struct RetryArgs {
    /// The ids of the messages to retry.
    #[arg(conflicts_with = "all")]
    pub ids: Vec<String>,
    /// Retry every message in the failure transport.
    #[arg(long)]
    pub all: bool,
    /// The failure transport (needed when there are several).
    #[arg(long, value_name = "NAME")]
    pub transport: Option<String>,
}

/// Arguments of `failed remove`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("which").required(true).args(["ids", "all"])))]
#[non_exhaustive]
pub struct RemoveArgs {
    /// The ids of the messages to remove.
    #[arg(conflicts_with = "all")]
    pub ids: Vec<String>,
    /// Remove every message in the failure transport.
    #[arg(long)]
    pub all: bool,
    /// The failure transport (needed when there are several).
    #[arg(long, value_name = "NAME")]
    pub transport: Option<String>,
}

/// How many messages `--all` reads when the transport cannot count them.
const ALL_WITHOUT_COUNT: usize = 10_000;

pub(crate) async fn run(
    messenger: &Messenger,
    command: FailedCommand,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    match command {
        FailedCommand::Show(args) => show(messenger, args, console).await,
        FailedCommand::Retry(args) => retry(messenger, args, console).await,
        FailedCommand::Remove(args) => remove(messenger, args, console).await,
    }
}

/// The failure transport a `failed` command works on, with the abilities
/// it is read and changed through.
struct Failures<'m> {
    name: &'m str,
    /// Listing and finding its messages, which every `failed` command does.
    browse: &'m dyn Browse,
    /// Counting them, if it can.
    count: Option<&'m dyn MessageCount>,
    /// Removing them, if it can (`failed retry` and `failed remove` need it).
    receiver: Option<&'m dyn Receiver>,
}

impl<'m> Failures<'m> {
    /// The failure transport to work on: `--transport`, or the only one
    /// configured. `command` (such as `failed show`) names the command in
    /// the error for a transport that cannot list and find its messages.
    ///
    /// When failure transports are configured, `--transport` must name one
    /// of them: the commands delete and re-dispatch messages, which must not
    /// happen to the waiting work of an ordinary transport. A messenger
    /// without failure transports cannot tell, and accepts any transport.
    fn choose(
        messenger: &'m Messenger,
        chosen: Option<&str>,
        command: &'static str,
    ) -> Result<Failures<'m>, CliError> {
        let failure = messenger.failure_transports();
        let name = match chosen {
            Some(name) => name,
            None => match failure.as_slice() {
                [] => return Err(CliError::NoFailureTransport),
                [one] => *one,
                many => return Err(CliError::AmbiguousFailureTransport(many.join(", "))),
            },
        };
        let (name, transport) = messenger
            .transports()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| unknown_transport(messenger, name))?;
        if !failure.is_empty() && !failure.contains(&name) {
            return Err(CliError::NotAFailureTransport {
                name: name.to_string(),
                failure: failure.join(", "),
            });
        }
        let browse = transport.as_browse().ok_or_else(|| CliError::Unable {
            command,
            transport: name.to_string(),
            ability: "list and find its messages",
        })?;
        Ok(Failures {
            name,
            browse,
            count: transport.as_message_count(),
            receiver: transport.as_receiver(),
        })
    }

    /// The receiving side `command` removes messages through, or an error
    /// naming the command when the transport has none.
    fn receiver(&self, command: &'static str) -> Result<&'m dyn Receiver, CliError> {
        self.receiver.ok_or_else(|| CliError::Unable {
            command,
            transport: self.name.to_string(),
            ability: "remove messages",
        })
    }

    /// How many messages it holds, when it can count them.
    async fn total(&self) -> Option<u64> {
        self.count?.message_count().await.ok()
    }

    async fn find(&self, id: &str) -> Result<Delivery, CliError> {
        let found = self
            .browse
            .find(&DeliveryId::from(id))
            .await
            .map_err(CliError::transport(self.name))?;
        match found {
            Some(delivery) => Ok(delivery),
            None => Err(CliError::MessageNotFound {
                transport: self.name.to_string(),
                id: id.to_string(),
                now: self.retried_as(id).await,
            }),
        }
    }

    /// The id of the copy parked when the message `id` was retried and
    /// failed again, if it is still here (followed to the newest copy).
    async fn retried_as(&self, id: &str) -> Option<String> {
        let listed = self.browse.list(RETRIED_SEARCH).await.ok()?;
        let mut current = id.to_string();
        let mut found = None;
        // Each retry names the copy before it: follow the chain (bounded,
        // should the headers ever form a loop).
        for _ in 0..listed.len() {
            let Some(next) = listed
                .iter()
                .find(|d| d.raw.header(RETRIED_FROM_HEADER) == Some(current.as_str()))
            else {
                break;
            };
            current = next.id.to_string();
            found = Some(current.clone());
        }
        found
    }

    /// The messages `ids` name (all found, or an error before anything is
    /// done), or every message with `all`.
    ///
    /// Each message is selected once, however many of `ids` name it: repeats
    /// are recognised by the id of the message found, as the transport may
    /// read different texts as the same id (SQLite reads `6`, `06` and `+6`
    /// as 6).
    async fn select(&self, ids: &[String], all: bool) -> Result<Vec<Delivery>, CliError> {
        if all {
            let limit = match self.total().await {
                Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
                None => ALL_WITHOUT_COUNT,
            };
            if limit == 0 {
                return Ok(Vec::new());
            }
            return self
                .browse
                .list(limit)
                .await
                .map_err(CliError::transport(self.name));
        }
        let mut found = Vec::with_capacity(ids.len());
        for id in ids {
            let delivery = self.find(id).await?;
            if !found.iter().any(|d: &Delivery| d.id == delivery.id) {
                found.push(delivery);
            }
        }
        Ok(found)
    }
}

async fn show(
    messenger: &Messenger,
    args: ShowArgs,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    let failures = Failures::choose(messenger, args.transport.as_deref(), "failed show")?;
    let name = failures.name;
    let out = &mut console.out;
    if let Some(id) = &args.id {
        let info = inspect(&failures.find(id).await?);
        match args.format.or_json(args.json) {
            Format::Json => {
                serde_json::to_writer_pretty(&mut *out, &info.detail_json(name))
                    .map_err(std::io::Error::from)?;
                writeln!(out)?;
            }
            Format::Text => {
                let limits = if args.full {
                    Limits::FULL
                } else {
                    Limits::SHORT
                };
                write_detail(out, name, &info, limits)?;
            }
        }
        return Ok(());
    }
    let total = failures.total().await;
    let listed: Vec<Inspected> = failures
        .browse
        .list(args.max)
        .await
        .map_err(CliError::transport(name))?
        .iter()
        .map(inspect)
        .collect();
    if args.format.or_json(args.json) == Format::Json {
        let doc = serde_json::json!({
            "transport": name,
            "total": total,
            "messages": listed.iter().map(Inspected::summary_json).collect::<Vec<_>>(),
        });
        serde_json::to_writer_pretty(&mut *out, &doc).map_err(std::io::Error::from)?;
        writeln!(out)?;
        return Ok(());
    }
    if listed.is_empty() {
        writeln!(out, "No failed messages in `{name}`.")?;
        return Ok(());
    }
    let mut table = Table::new(&["ID", "MESSAGE", "ERROR", "RETRIES", "FAILED AT"]);
    for info in &listed {
        table.row(vec![
            info.id.clone(),
            info.message.clone(),
            truncate(&info.error_line(), 80),
            info.retries.to_string(),
            info.failed_at_text(),
        ]);
    }
    write!(out, "{}", table.render())?;
    let total = total.unwrap_or(listed.len() as u64);
    if total > listed.len() as u64 {
        writeln!(
            out,
            "{} of {total} messages in `{name}` shown (oldest first); raise --max to see more.",
            listed.len()
        )?;
    } else {
        writeln!(out, "{total} message(s) in `{name}`.")?;
    }
    writeln!(
        out,
        "Show one with `failed show <id>`, retry with `failed retry <id>`."
    )?;
    Ok(())
}

/// What became of one retried message.
enum Outcome {
    /// Handled; removed from the failure transport.
    Handled,
    /// Parked because it could not be sent to `transport`: sent there (and
    /// to the transports routed after it), not handled; removed from the
    /// failure transport.
    Sent { transport: String },
    /// Failed with retries left; sent back to `transport` for another try.
    Rescheduled { transport: String },
    /// Failed again and parked (again) under `new_id`.
    FailedAgain { new_id: String, error: String },
    /// Not retried; stays in the failure transport.
    Kept { reason: String },
}

/// Retries one message as a worker consuming the failure transport would
/// ([`handle_one`]): what its handlers deferred that fails is parked on its
/// own, and a message parked because it could not be sent is sent. Also
/// returns a line for each deferred dispatch that failed.
async fn retry_one(
    messenger: &Messenger,
    failure: &str,
    delivery: &Delivery,
) -> (Outcome, Vec<String>) {
    // Kept as it is: parked again, it would only fail again.
    let unsent = match messenger.serializer().decode(&delivery.raw) {
        Ok(envelope) => envelope.last::<UnsentStamp>().map(|u| u.transport.clone()),
        Err(e) => {
            let reason = format!("does not decode: {e}");
            return (Outcome::Kept { reason }, Vec::new());
        }
    };
    // A copy parked again names this one, so `failed show <this id>`
    // can say where it went.
    let mut retried = delivery.clone();
    retried
        .raw
        .headers
        .insert(RETRIED_FROM_HEADER, delivery.id.to_string());
    let handled = match handle_one(messenger, failure, retried).await {
        Ok(handled) => handled,
        Err(e) => {
            let reason = e.to_string();
            return (Outcome::Kept { reason }, Vec::new());
        }
    };
    let (own, deferred) = handled
        .events
        .split_last()
        .map_or((None, &[][..]), |(own, deferred)| (Some(own), deferred));
    let deferred = deferred
        .iter()
        .filter_map(|e| match e {
            WorkerEvent::Failed {
                message,
                error,
                parked_in,
                ..
            } => Some(match parked_in {
                Some(to) => format!("its deferred `{message}` failed, parked in `{to}`: {error}"),
                None => format!("its deferred `{message}` failed and was not parked: {error}"),
            }),
            _ => None,
        })
        .collect();
    let outcome = match (handled.settlement, own) {
        (Settlement::Ack, Some(WorkerEvent::Retried { envelope, .. })) => Outcome::Rescheduled {
            transport: envelope
                .last::<SentStamp>()
                .map_or_else(|| "?".to_string(), |s| s.transport.clone()),
        },
        (
            Settlement::Ack,
            Some(WorkerEvent::Failed {
                error, envelope, ..
            }),
        ) => Outcome::FailedAgain {
            new_id: envelope
                .as_ref()
                .and_then(|e| e.last::<TransportMessageIdStamp>())
                .map_or_else(|| "?".to_string(), |s| s.id.clone()),
            error: error.clone(),
        },
        (Settlement::Ack, _) => match unsent {
            Some(transport) => Outcome::Sent { transport },
            None => Outcome::Handled,
        },
        _ => Outcome::Kept {
            reason: match &handled.outcome {
                WorkerOutcome::Failed { error, .. } => error.clone(),
                _ => "a dispatch its handlers deferred failed and could not be parked".to_string(),
            },
        },
    };
    (outcome, deferred)
}

/// The widest outcome `failed retry` puts in its table; a longer one is
/// cut there and written in full below it.
const OUTCOME_WIDTH: usize = 100;

/// What `failed retry` did, message by message.
struct Retried<'f> {
    /// The failure transport's name.
    name: &'f str,
    /// Each message's id, type and outcome (on one line), in the order
    /// retried.
    rows: Vec<[String; 3]>,
    handled: usize,
    /// Parked because they could not be sent: sent on, not handled.
    sent: usize,
    rescheduled: usize,
    failed_again: usize,
    kept: usize,
    /// Retried, but their old copy could not be removed: still there too.
    not_removed: usize,
    /// The transports messages were sent back to for another try.
    destinations: Vec<String>,
}

impl<'f> Retried<'f> {
    fn new(name: &'f str) -> Self {
        Retried {
            name,
            rows: Vec::new(),
            handled: 0,
            sent: 0,
            rescheduled: 0,
            failed_again: 0,
            kept: 0,
            not_removed: 0,
            destinations: Vec::new(),
        }
    }

    /// Counts `outcome` and says what it was.
    fn count(&mut self, outcome: Outcome) -> String {
        match outcome {
            Outcome::Handled => {
                self.handled += 1;
                "handled".to_string()
            }
            Outcome::Sent { transport } => {
                self.sent += 1;
                format!("sent to `{transport}`, which it could not be sent to before")
            }
            Outcome::Rescheduled { transport } => {
                self.rescheduled += 1;
                let text = format!("failed; sent to `{transport}` for another try");
                if !self.destinations.contains(&transport) {
                    self.destinations.push(transport);
                }
                text
            }
            Outcome::FailedAgain { new_id, error } => {
                self.failed_again += 1;
                format!("failed again, back in `{}` as {new_id}: {error}", self.name)
            }
            Outcome::Kept { reason } => {
                self.kept += 1;
                format!("kept: {reason}")
            }
        }
    }

    /// Adds the row of `delivery`, whose outcome is `text`.
    fn row(&mut self, delivery: &Delivery, text: String) {
        self.rows.push([
            delivery.id.to_string(),
            inspect(delivery).message,
            flatten(&text),
        ]);
    }

    /// Each outcome once: a table when every outcome fits its column, else
    /// one line per message with its outcome in full; then the summary and
    /// what to run next.
    fn write(&self, out: &mut dyn Write, retried: usize) -> std::io::Result<()> {
        let fits = self
            .rows
            .iter()
            .all(|[_, _, text]| text.chars().count() <= OUTCOME_WIDTH);
        if fits {
            let mut table = Table::new(&["ID", "MESSAGE", "OUTCOME"]);
            for [id, message, text] in &self.rows {
                table.row(vec![id.clone(), message.clone(), text.clone()]);
            }
            write!(out, "{}", table.render())?;
        } else {
            for [id, message, text] in &self.rows {
                writeln!(out, "{id} ({message}): {text}")?;
            }
        }
        let sent = if self.sent > 0 {
            format!(", {} sent on to its transport", self.sent)
        } else {
            String::new()
        };
        writeln!(
            out,
            "Retried {retried} message(s) from `{}`: {} handled, {} sent for another try, {} failed again, {} kept{sent}.",
            self.name, self.handled, self.rescheduled, self.failed_again, self.kept
        )?;
        if !self.destinations.is_empty() {
            writeln!(
                out,
                "Run `consume {}` to handle the messages sent for another try.",
                self.destinations.join(" ")
            )?;
        }
        Ok(())
    }

    /// The command's result: messages left behind matter more than output
    /// nobody reads any more.
    fn result(&self, written: std::io::Result<()>) -> Result<(), CliError> {
        if self.kept > 0 {
            return Err(CliError::RetryIncomplete {
                kept: self.kept,
                transport: self.name.to_string(),
            });
        }
        if self.not_removed > 0 {
            return Err(CliError::RetriedNotRemoved {
                copies: self.not_removed,
                transport: self.name.to_string(),
            });
        }
        Ok(written?)
    }
}

async fn retry(
    messenger: &Messenger,
    args: RetryArgs,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    const COMMAND: &str = "failed retry";
    let failures = Failures::choose(messenger, args.transport.as_deref(), COMMAND)?;
    let receiver = failures.receiver(COMMAND)?;
    let name = failures.name;
    let selected = failures.select(&args.ids, args.all).await?;
    let out = &mut console.out;
    if selected.is_empty() {
        writeln!(out, "No failed messages in `{name}`.")?;
        return Ok(());
    }
    let mut retried = Retried::new(name);
    for delivery in &selected {
        let (outcome, deferred) = retry_one(messenger, name, delivery).await;
        let remove = !matches!(outcome, Outcome::Kept { .. });
        let mut text = retried.count(outcome);
        for line in deferred {
            text = format!("{text}; {line}");
        }
        if remove {
            if let Err(e) = receiver.ack(&delivery.id).await {
                retried.not_removed += 1;
                text = format!("{text}; removing the old copy failed: {e}");
            }
        }
        retried.row(delivery, text);
    }
    let written = retried.write(out, selected.len());
    retried.result(written)
}

async fn remove(
    messenger: &Messenger,
    args: RemoveArgs,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    const COMMAND: &str = "failed remove";
    let failures = Failures::choose(messenger, args.transport.as_deref(), COMMAND)?;
    let receiver = failures.receiver(COMMAND)?;
    let name = failures.name;
    let selected = failures.select(&args.ids, args.all).await?;
    let out = &mut console.out;
    if selected.is_empty() {
        writeln!(out, "No failed messages in `{name}`.")?;
        return Ok(());
    }
    let ids: Vec<DeliveryId> = selected.iter().map(|d| d.id.clone()).collect();
    let outcome = receiver.ack_batch(&ids).await;
    // A batch that failed may have removed some (see `Receiver::ack_batch`):
    // those still there are found again.
    let mut still_there = Vec::new();
    if outcome.is_err() {
        for id in &ids {
            if !matches!(failures.browse.find(id).await, Ok(None)) {
                still_there.push(id.as_str());
            }
        }
    }
    let mut table = Table::new(&["ID", "MESSAGE", "ERROR"]);
    for delivery in selected
        .iter()
        .filter(|d| !still_there.contains(&d.id.as_str()))
    {
        let info = inspect(delivery);
        table.row(vec![
            info.id.clone(),
            info.message.clone(),
            truncate(&info.error_line(), 80),
        ]);
    }
    match outcome {
        Ok(()) => {
            write!(out, "{}", table.render())?;
            writeln!(out, "Removed {} message(s) from `{name}`.", ids.len())?;
            Ok(())
        }
        Err(error) => {
            let removed = ids.len() - still_there.len();
            if removed > 0 {
                write!(out, "{}", table.render())?;
            }
            if still_there.is_empty() {
                writeln!(out, "Removed {removed} message(s) from `{name}`.")?;
            } else {
                writeln!(
                    out,
                    "Removed {removed} of {} message(s) from `{name}`; still there: {}.",
                    ids.len(),
                    still_there.join(", ")
                )?;
            }
            Err(CliError::transport(name)(error))
        }
    }
}
