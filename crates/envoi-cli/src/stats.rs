//! `stats` and `setup-transports`.

use std::io::Write;

use clap::Args;
use envoi_core::transport::Transport;
use envoi_core::{Messenger, TransportError};
use serde_json::json;

use crate::table::Table;
use crate::{resolve_transports, CliError, Console, Format};

/// Arguments of `stats`.
#[derive(Debug, Args)]
#[non_exhaustive]
pub struct StatsArgs {
    /// Only these transports (all by default).
    #[arg(value_name = "TRANSPORT")]
    pub transports: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Short for `--format json`.
    #[arg(long, conflicts_with = "format")]
    pub json: bool,
}

/// Arguments of `setup-transports`.
#[derive(Debug, Args)]
#[non_exhaustive]
pub struct SetupArgs {
    /// Only these transports (all by default).
    #[arg(value_name = "TRANSPORT")]
    pub transports: Vec<String>,
}

/// What `stats` found for one transport.
enum Waiting {
    /// This many messages wait.
    Messages(u64),
    /// The transport cannot count its messages.
    Uncountable,
    /// Counting failed.
    Failed(TransportError),
}

impl Waiting {
    async fn of(transport: &dyn Transport) -> Waiting {
        match transport.as_message_count() {
            Some(counter) => match counter.message_count().await {
                Ok(n) => Waiting::Messages(n),
                Err(e) => Waiting::Failed(e),
            },
            None => Waiting::Uncountable,
        }
    }

    /// The row's JSON: `messages` is null unless counted, with a `note`
    /// for a transport that cannot count and an `error` for a count that
    /// failed.
    fn json(&self, name: &str, failure_transport: bool) -> serde_json::Value {
        let mut v = json!({
            "name": name,
            "messages": match self {
                Waiting::Messages(n) => Some(*n),
                _ => None,
            },
            "failure_transport": failure_transport,
        });
        if let Some(map) = v.as_object_mut() {
            match self {
                Waiting::Messages(_) => {}
                Waiting::Uncountable => {
                    map.insert("note".into(), json!("cannot count"));
                }
                Waiting::Failed(e) => {
                    map.insert("error".into(), json!(e.to_string()));
                }
            }
        }
        v
    }

    /// The MESSAGES and NOTE cells of the row's text.
    fn cells(&self, failure_transport: bool) -> (String, String) {
        let (messages, note) = match self {
            Waiting::Messages(n) => (n.to_string(), String::new()),
            Waiting::Uncountable => ("-".to_string(), "cannot count".to_string()),
            Waiting::Failed(e) => ("?".to_string(), format!("error: {e}")),
        };
        let note = match (failure_transport, note.is_empty()) {
            (false, _) => note,
            (true, true) => "failure transport".to_string(),
            (true, false) => format!("failure transport; {note}"),
        };
        (messages, note)
    }
}

pub(crate) async fn stats(
    messenger: &Messenger,
    args: StatsArgs,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    let transports = resolve_transports(messenger, &args.transports)?;
    let failure = messenger.failure_transports();
    let mut rows = Vec::with_capacity(transports.len());
    for (name, transport) in &transports {
        rows.push((*name, Waiting::of(transport.as_ref()).await));
    }
    let failed = rows
        .iter()
        .filter(|(_, c)| matches!(c, Waiting::Failed(_)))
        .count();
    let out = &mut console.out;
    match args.format.or_json(args.json) {
        Format::Json => {
            let list: Vec<_> = rows
                .iter()
                .map(|(name, count)| count.json(name, failure.contains(name)))
                .collect();
            serde_json::to_writer_pretty(&mut *out, &json!({ "transports": list }))
                .map_err(std::io::Error::from)?;
            writeln!(out)?;
        }
        Format::Text if rows.is_empty() => writeln!(out, "No transports are configured.")?,
        Format::Text => {
            let mut table = Table::new(&["TRANSPORT", "MESSAGES", "NOTE"]);
            for (name, count) in &rows {
                let (messages, note) = count.cells(failure.contains(name));
                table.row(vec![name.to_string(), messages, note]);
            }
            write!(out, "{}", table.render())?;
        }
    }
    if failed > 0 {
        return Err(CliError::TransportsFailed {
            failed,
            total: rows.len(),
        });
    }
    Ok(())
}

/// Sets up each transport that has something to set up; the others say
/// there is nothing to set up.
pub(crate) async fn setup(
    messenger: &Messenger,
    args: SetupArgs,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    let transports = resolve_transports(messenger, &args.transports)?;
    let out = &mut console.out;
    let mut failed = 0;
    for (name, transport) in &transports {
        let Some(setup) = transport.as_setup() else {
            writeln!(out, "nothing to set up for `{name}`")?;
            continue;
        };
        match setup.setup().await {
            Ok(()) => writeln!(out, "set up `{name}`")?,
            Err(e) => {
                failed += 1;
                writeln!(out, "could not set up `{name}`: {e}")?;
            }
        }
    }
    if transports.is_empty() {
        writeln!(out, "No transports are configured.")?;
    }
    if failed > 0 {
        return Err(CliError::TransportsFailed {
            failed,
            total: transports.len(),
        });
    }
    Ok(())
}
