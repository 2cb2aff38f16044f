//! Plain-text tables and a UTC clock.

use std::fmt::Write as _;

/// Columns separated by two spaces, headers in capitals, the last column
/// not padded. Each row is one line: line breaks and other control
/// characters in a cell (a stored message's headers can hold anything)
/// become spaces.
#[derive(Debug)]
pub(crate) struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(headers: &[&'static str]) -> Self {
        Table {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells.iter().map(|c| flatten(c)).collect());
    }

    pub(crate) fn render(&self) -> String {
        let columns = self.headers.len();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate().take(columns) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let line = |out: &mut String, cells: &mut dyn Iterator<Item = &str>| {
            let mut text = String::new();
            for (i, cell) in cells.enumerate().take(columns) {
                if i + 1 < columns {
                    let pad = widths[i] - cell.chars().count();
                    let _ = write!(text, "{cell}{}  ", " ".repeat(pad));
                } else {
                    text.push_str(cell);
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        line(&mut out, &mut self.headers.iter().copied());
        for row in &self.rows {
            line(&mut out, &mut row.iter().map(String::as_str));
        }
        out
    }
}

/// `text` cut to `max` characters, with `…` when cut; newlines become
/// spaces.
pub(crate) fn truncate(text: &str, max: usize) -> String {
    let flat = flatten(text);
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// `text` on one line: each control character (a line break, a tab, the
/// escape that starts a terminal sequence) becomes a space.
pub(crate) fn flatten(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Milliseconds since the Unix epoch as an RFC 3339 UTC time,
/// `2024-05-01T12:34:56.789Z`.
pub(crate) fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// The proleptic Gregorian date of a day number (days since 1970-01-01),
/// after Howard Hinnant's `civil_from_days`.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_aligned_and_the_last_is_not_padded() {
        let mut t = Table::new(&["ID", "MESSAGE", "ERROR"]);
        t.row(vec!["1".into(), "PlaceOrder".into(), "boom".into()]);
        t.row(vec!["1234".into(), "X".into(), String::new()]);
        assert_eq!(
            t.render(),
            "ID    MESSAGE     ERROR\n1     PlaceOrder  boom\n1234  X\n"
        );
    }

    #[test]
    fn long_text_is_cut_with_an_ellipsis_and_flattened() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("a\nb", 10), "a b");
        assert_eq!(truncate("abcdefghijkl", 5), "abcd…");
    }

    #[test]
    fn utc_times_match_known_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(utc(1_714_566_896_789), "2024-05-01T12:34:56.789Z");
    }
}
