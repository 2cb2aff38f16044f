//! `failed show <id>` as text: every field of one stored message, with
//! long sections cut to a readable size and a note of what was left out
//! (a message can carry 100,000 headers or a body of megabytes).

use std::io::Write;

use crate::inspect::Inspected;
use crate::table::truncate;

/// How much of each section the text shows unless `--full` is given.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Entries shown per section (stamps, headers, error causes).
    pub(crate) entries: usize,
    /// Characters shown per value.
    pub(crate) value_chars: usize,
    /// Lines of the pretty-printed body.
    pub(crate) body_lines: usize,
}

impl Limits {
    /// The default cut: enough for any ordinary message.
    pub(crate) const SHORT: Limits = Limits {
        entries: 50,
        value_chars: 300,
        body_lines: 200,
    };
    /// No cut (`--full`).
    pub(crate) const FULL: Limits = Limits {
        entries: usize::MAX,
        value_chars: usize::MAX,
        body_lines: usize::MAX,
    };
}

/// Writes `info` (stored in `transport`) as labelled fields, cut to
/// `limits`.
pub(crate) fn write_detail(
    out: &mut dyn Write,
    transport: &str,
    info: &Inspected,
    limits: Limits,
) -> std::io::Result<()> {
    let mut cut = Cut::default();
    let value = |text: &str, cut: &mut Cut| {
        if text.chars().count() > limits.value_chars {
            cut.values += 1;
            truncate(text, limits.value_chars)
        } else {
            text.to_string()
        }
    };
    let field =
        |out: &mut dyn Write, label: &str, value: &str| writeln!(out, "{label:<12} {value}");
    field(out, "Id", &info.id)?;
    let message = match &info.kind {
        Some(kind) => format!("{} ({kind})", info.message),
        None => info.message.clone(),
    };
    field(out, "Message", &value(&message, &mut cut))?;
    let origin = match &info.original_transport {
        Some(o) => format!("{transport} (failed in {o})"),
        None => transport.to_string(),
    };
    field(out, "Transport", &origin)?;
    field(out, "Failed at", &info.failed_at_text())?;
    field(out, "Retries", &info.retries.to_string())?;
    match &info.error {
        Some(e) => {
            field(out, "Error", &value(&e.message, &mut cut))?;
            field(out, "Error kind", &e.kind)?;
            if !e.chain.is_empty() {
                writeln!(out, "Caused by")?;
                for (i, cause) in e.chain.iter().take(limits.entries).enumerate() {
                    writeln!(out, "  {}. {}", i + 1, value(cause, &mut cut))?;
                }
                cut.section(out, "causes", e.chain.len(), limits.entries)?;
            }
        }
        None => field(out, "Error", "(no error details)")?,
    }
    if !info.stamps.is_empty() {
        writeln!(out, "Stamps")?;
        for (name, json) in info.stamps.iter().take(limits.entries) {
            writeln!(out, "  {name}: {}", value(&json.to_string(), &mut cut))?;
        }
        cut.section(out, "stamps", info.stamps.len(), limits.entries)?;
    }
    if !info.headers.is_empty() {
        writeln!(out, "Headers")?;
        for (key, text) in info.headers.iter().take(limits.entries) {
            writeln!(out, "  {}: {}", value(key, &mut cut), value(text, &mut cut))?;
        }
        cut.section(out, "headers", info.headers.len(), limits.entries)?;
    }
    let body = serde_json::to_string_pretty(&info.body).unwrap_or_default();
    writeln!(out, "Body")?;
    let lines = body.lines().count();
    for line in body.lines().take(limits.body_lines) {
        writeln!(out, "  {}", value(line, &mut cut))?;
    }
    cut.section(out, "body lines", lines, limits.body_lines)?;
    if cut.any() {
        writeln!(
            out,
            "(cut to a readable size; `--full` or `--format json` shows everything)"
        )?;
    }
    Ok(())
}

/// What was left out.
#[derive(Debug, Default)]
struct Cut {
    /// Sections with entries left out.
    sections: usize,
    /// Values shortened.
    values: usize,
}

impl Cut {
    /// Notes, under a section of `total` entries of which `shown` were
    /// written, how many were left out.
    fn section(
        &mut self,
        out: &mut dyn Write,
        what: &str,
        total: usize,
        shown: usize,
    ) -> std::io::Result<()> {
        if total <= shown {
            return Ok(());
        }
        self.sections += 1;
        writeln!(out, "  … {} more {what} not shown", total - shown)
    }

    fn any(&self) -> bool {
        self.sections > 0 || self.values > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inspect::inspect;
    use envoi_core::transport::{Delivery, RawMessage};

    fn flooded(headers: usize, value_len: usize) -> Inspected {
        let mut raw = RawMessage::default();
        raw.headers.insert("type", "PlaceOrder");
        for i in 0..headers {
            raw.headers
                .insert(format!("x-flood-{i}"), "v".repeat(value_len));
        }
        raw.body = br#"{"id": 7}"#.to_vec();
        inspect(&Delivery::new("1", raw))
    }

    fn text(info: &Inspected, limits: Limits) -> String {
        let mut out = Vec::new();
        write_detail(&mut out, "failed", info, limits).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn a_message_with_100_000_headers_is_shown_in_a_few_kilobytes_with_a_note() {
        let info = flooded(100_000, 10);
        let out = text(&info, Limits::SHORT);
        assert!(out.len() < 16 * 1024, "{} bytes", out.len());
        assert!(out.contains("  x-flood-0: vvvvvvvvvv\n"), "{out}");
        assert!(out.contains("  … 99950 more headers not shown\n"), "{out}");
        assert!(
            out.contains("`--full` or `--format json` shows everything"),
            "{out}"
        );
        assert!(out.contains("\"id\": 7"), "{out}");
    }

    #[test]
    fn a_long_value_is_shortened_and_full_shows_everything() {
        let info = flooded(1, 5_000);
        let short = text(&info, Limits::SHORT);
        assert!(!short.contains(&"v".repeat(301)), "{short}");
        assert!(short.contains("shows everything"), "{short}");
        let full = text(&info, Limits::FULL);
        assert!(full.contains(&"v".repeat(5_000)));
        assert!(!full.contains("not shown") && !full.contains("shows everything"));
    }

    #[test]
    fn an_ordinary_message_is_shown_without_a_note() {
        let out = text(&flooded(3, 10), Limits::SHORT);
        assert!(
            !out.contains("not shown") && !out.contains("shows everything"),
            "{out}"
        );
    }
}
