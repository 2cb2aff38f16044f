//! `stats` and `setup-transports`.

use std::io::Write;

use clap::Args;
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

pub(crate) async fn stats(
    messenger: &Messenger,
    args: StatsArgs,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    let transports = resolve_transports(messenger, &args.transports)?;
    let failure = messenger.failure_transports();
    let mut rows = Vec::with_capacity(transports.len());
    for (name, transport) in &transports {
        rows.push((*name, transport.message_count().await));
    }
    let failed = rows
        .iter()
        .filter(|(_, r)| matches!(r, Err(e) if !matches!(e, TransportError::Unsupported(_))))
        .count();
    let out = &mut console.out;
    match args.format.or_json(args.json) {
        Format::Json => {
            let list: Vec<_> = rows
                .iter()
                .map(|(name, count)| {
                    let mut v = json!({
                        "name": name,
                        "messages": count.as_ref().ok(),
                        "failure_transport": failure.contains(name),
                    });
                    if let (Err(e), Some(map)) = (count, v.as_object_mut()) {
                        map.insert("error".into(), json!(e.to_string()));
                    }
                    v
                })
                .collect();
            serde_json::to_writer_pretty(&mut *out, &json!({ "transports": list }))
                .map_err(std::io::Error::from)?;
            writeln!(out)?;
        }
        Format::Text => {
            if rows.is_empty() {
                writeln!(out, "No transports are configured.")?;
            } else {
                let mut table = Table::new(&["TRANSPORT", "MESSAGES", "NOTE"]);
                for (name, count) in &rows {
                    let (messages, note) = match count {
                        Ok(n) => (n.to_string(), String::new()),
                        Err(TransportError::Unsupported(_)) => {
                            ("-".to_string(), "cannot count".to_string())
                        }
                        Err(e) => ("?".to_string(), format!("error: {e}")),
                    };
                    let note = if failure.contains(name) {
                        if note.is_empty() {
                            "failure transport".to_string()
                        } else {
                            format!("failure transport; {note}")
                        }
                    } else {
                        note
                    };
                    table.row(vec![name.to_string(), messages, note]);
                }
                write!(out, "{}", table.render())?;
            }
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

pub(crate) async fn setup(
    messenger: &Messenger,
    args: SetupArgs,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    let transports = resolve_transports(messenger, &args.transports)?;
    let out = &mut console.out;
    let mut failed = 0;
    for (name, transport) in &transports {
        match transport.setup().await {
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
