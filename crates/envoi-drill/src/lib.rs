//! Fault drills: a worker process (`drill-worker`) consumes a queue on a
//! real broker while the drill kills it (`SIGKILL`, or `SIGTERM` for a
//! graceful stop) and starts it again, and breaks its connections from the
//! server side; at the end every message id is counted. Nothing may be
//! lost; duplicates (a message handled, then the worker killed before its
//! acknowledgement reached the broker) are reported, as at-least-once
//! delivery allows them.
//!
//! The worker records each id it handles by appending a line to a file
//! before the handler returns, so a record survives the process being
//! killed (the kernel keeps what was written).

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use envoi::{Event, Message};
use serde::{Deserialize, Serialize};

/// The message every drill sends: its id is what is counted.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    /// Unique within one drill, from 0 to the number produced.
    pub id: u64,
    /// Padding to a realistic size (about 100 bytes of JSON).
    pub note: String,
}

impl Message for Job {
    const NAME: &'static str = "DrillJob";
}

impl Event for Job {
    type Error = std::io::Error;
}

/// Appends `id` to the record at `path`, one line per handling.
///
/// # Errors
/// When the file cannot be opened or written.
pub fn record(path: &Path, id: u64) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    file.write_all(format!("{id}\n").as_bytes())
}

/// `prefix` made unique to this run (the process id and the clock's
/// nanoseconds), so that drills never share a queue, a stream or a table.
/// Letters, digits and `_` only, as every transport takes in a name.
pub fn unique_name(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("{prefix}_{}_{nanos}", std::process::id())
}

/// What a drill found: how often each id was handled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Count {
    /// Messages produced (ids `0..produced`).
    pub produced: u64,
    /// Handlings recorded, duplicates included.
    pub handled: u64,
    /// Ids never handled.
    pub lost: Vec<u64>,
    /// Handlings beyond the first, over all ids.
    pub duplicated: u64,
}

impl Count {
    /// Reads the record at `path` for ids `0..produced`. A line that is
    /// not an id (a write cut short by a kill) is not counted.
    ///
    /// # Errors
    /// When the record cannot be read.
    pub fn read(path: &Path, produced: u64) -> std::io::Result<Count> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        let mut seen: HashMap<u64, u64> = HashMap::new();
        let mut handled = 0;
        for id in text.lines().filter_map(|l| l.trim().parse::<u64>().ok()) {
            *seen.entry(id).or_default() += 1;
            handled += 1;
        }
        let lost = (0..produced).filter(|id| !seen.contains_key(id)).collect();
        let duplicated = seen.values().map(|n| n - 1).sum();
        Ok(Count {
            produced,
            handled,
            lost,
            duplicated,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_counts_lost_and_duplicated_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids");
        for id in [0, 1, 1, 3, 3, 3] {
            record(&path, id).unwrap();
        }
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"4")
            .unwrap();
        let count = Count::read(&path, 5).unwrap();
        assert_eq!(count.handled, 7);
        assert_eq!(count.lost, vec![2]);
        assert_eq!(count.duplicated, 3);
    }
}
