//! The DSN `sqlite://<path>[?option=value&…]` and what it configures.

use std::path::PathBuf;
use std::time::Duration;

use envoi_core::transport::support::DsnQuery;
use envoi_core::transport::{dsn_has_scheme, mask_dsn};
use envoi_core::TransportError;

/// How a [`SqliteTransport`](crate::SqliteTransport) is configured; parsed
/// from a DSN by [`SqliteConfig::from_dsn`], or built in code from
/// [`SqliteConfig::new`] and given to
/// [`SqliteTransport::with_config`](crate::SqliteTransport::with_config).
///
/// | option | default | meaning |
/// |---|---|---|
/// | `table` | `envoi_<name>` | the table; several transports may share one (rows carry their `queue_name`). The default lower-cases the transport name and turns every character but ASCII letters and digits into `_`; a given name is 1 to 64 ASCII letters, digits or `_`, not starting with a digit or `sqlite_` |
/// | `lease` | `60s` | how long a handed-out message stays leased before it is handed out again, at least `1ms` |
/// | `poll` | `50ms` | how long `get` waits for a message when none is available, at most `1m` (an idle worker asked to stop may wait this long) |
/// | `batch` | `1` | rows claimed at least per round trip (1–10000); rows beyond what `get` asked for are kept, leased, for the next `get` |
/// | `busy_timeout` | `5s` | how long a statement waits for another connection's write lock, at most `596h` (SQLite's limit) |
/// | `auto_setup` | `true` | create the table on first use |
///
/// Options are read by [`DsnQuery`], as on every transport: durations such
/// as `1500ms`, `1.5` (seconds), `2s`, `1m` or `1h30m`; booleans `true`,
/// `false`, `1`, `0`, `yes`, `no`, `on` or `off`; values percent-decoded;
/// an unknown option or one given twice is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteConfig {
    /// The database file; created if missing.
    pub path: PathBuf,
    /// The table, or `None` for `envoi_<transport name>`.
    pub table: Option<String>,
    /// How long a handed-out message stays leased.
    pub lease: Duration,
    /// How long `get` waits when nothing is available.
    pub poll: Duration,
    /// The fewest rows a claim takes (prefetching for consumers that ask
    /// for fewer).
    pub batch: usize,
    /// How long a statement waits for a lock held by another connection.
    pub busy_timeout: Duration,
    /// Whether the table is created on first use.
    pub auto_setup: bool,
}

impl SqliteConfig {
    /// The default configuration for the database at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            table: None,
            lease: Duration::from_secs(60),
            poll: Duration::from_millis(50),
            batch: 1,
            busy_timeout: Duration::from_secs(5),
            auto_setup: true,
        }
    }

    /// Parses `sqlite://<path>[?option=value&…]` (also `sqlite:<path>`).
    /// `sqlite:///abs/path.db` is absolute, `sqlite://data/envoi.db`
    /// relative to the working directory.
    ///
    /// ```
    /// use envoi_sqlite::SqliteConfig;
    /// use std::time::Duration;
    ///
    /// let c = SqliteConfig::from_dsn("sqlite://var/envoi.db?lease=2s&batch=64").unwrap();
    /// assert_eq!(c.path, std::path::Path::new("var/envoi.db"));
    /// assert_eq!(c.lease, Duration::from_secs(2));
    /// assert_eq!(c.batch, 64);
    /// assert!(SqliteConfig::from_dsn("sqlite://x.db?lease=soon").is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// [`TransportError::InvalidDsn`] for another scheme, an empty path, an
    /// in-memory database, an unknown option, an option given twice or a
    /// bad value.
    pub fn from_dsn(dsn: &str) -> Result<Self, TransportError> {
        let invalid = |reason: &str| TransportError::InvalidDsn {
            dsn: mask_dsn(dsn),
            reason: reason.to_string(),
        };
        // The scheme, in any case, then `//` if present.
        if !dsn_has_scheme(dsn, "sqlite:") {
            return Err(invalid("expected `sqlite://<path>`"));
        }
        let rest = &dsn["sqlite:".len()..];
        let rest = rest.strip_prefix("//").unwrap_or(rest);
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        if path.is_empty() {
            return Err(invalid("the database path is empty"));
        }
        let memory_mode = query.split('&').any(|pair| pair == "mode=memory");
        if path == ":memory:" || path.starts_with("file:") || memory_mode {
            return Err(invalid(
                "in-memory and URI databases are not supported (each pooled connection would \
                 see its own database); use a file path, or the `in-memory://` transport",
            ));
        }
        let mut q = DsnQuery::parse(dsn)?;
        let mut config = SqliteConfig::new(path);
        config.table = q.string("table");
        if let Some(lease) = q.duration("lease")? {
            config.lease = lease;
        }
        if let Some(poll) = q.duration("poll")? {
            config.poll = poll;
        }
        if let Some(batch) = q.number("batch")? {
            config.batch = batch;
        }
        if let Some(timeout) = q.duration("busy_timeout")? {
            config.busy_timeout = timeout;
        }
        if let Some(auto_setup) = q.bool("auto_setup")? {
            config.auto_setup = auto_setup;
        }
        q.finish()?;
        config.check().map_err(|reason| invalid(&reason))?;
        Ok(config)
    }

    /// The table of the transport called `name`: the one given, or
    /// `envoi_<name>`.
    pub(crate) fn table_for(&self, name: &str) -> String {
        self.table.clone().unwrap_or_else(|| default_table(name))
    }

    /// Whether every value is one the transport can use: a valid table
    /// name, a lease of at least 1 ms, a poll of at most 1 m, a batch of 1
    /// to 10000 rows and a busy timeout SQLite can take. Says what is wrong
    /// otherwise.
    pub(crate) fn check(&self) -> Result<(), String> {
        if let Some(table) = &self.table {
            validate_table(table)?;
        }
        if self.lease < Duration::from_millis(1) {
            return Err(format!(
                "`lease` must be at least 1ms, not {:?}",
                self.lease
            ));
        }
        if self.poll > MAX_POLL {
            return Err(format!(
                "`poll` must be at most 1m (an idle worker asked to stop waits up to this \
                 long), not {:?}",
                self.poll
            ));
        }
        if !(1..=MAX_BATCH).contains(&self.batch) {
            return Err(format!(
                "`batch` must be from 1 to {MAX_BATCH}, not {}",
                self.batch
            ));
        }
        validate_busy_timeout(self.busy_timeout)
    }
}

/// The longest `poll`: an idle worker waits this long in `get` before it
/// sees that it was asked to stop.
const MAX_POLL: Duration = Duration::from_secs(60);

/// The longest busy timeout: SQLite takes it in milliseconds as a C `int`.
const MAX_BUSY_TIMEOUT_MS: u128 = i32::MAX as u128;

/// A busy timeout SQLite can take: at most `i32::MAX` milliseconds (about
/// 596 hours).
fn validate_busy_timeout(timeout: Duration) -> Result<(), String> {
    if timeout.as_millis() > MAX_BUSY_TIMEOUT_MS {
        return Err(format!(
            "`busy_timeout` must be at most {MAX_BUSY_TIMEOUT_MS}ms (596h), not {timeout:?}"
        ));
    }
    Ok(())
}

/// The most rows one claim may take.
pub(crate) const MAX_BATCH: usize = 10_000;

/// A table name must be a plain identifier: ASCII letters, digits and `_`,
/// not starting with a digit, at most 64 characters.
fn validate_table(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && !name.to_ascii_lowercase().starts_with("sqlite_");
    if ok {
        Ok(())
    } else {
        Err(format!(
            "table name `{name}` must be 1 to 64 ASCII letters, digits or `_`, not start with a \
             digit nor with `sqlite_`"
        ))
    }
}

/// The default table for the transport called `name`: `envoi_` followed by
/// the name with every character other than ASCII letters and digits
/// replaced by `_`, cut to 64 characters.
fn default_table(name: &str) -> String {
    let mut table: String = "envoi_".to_string();
    table.extend(name.chars().map(|c| {
        if c.is_ascii_alphanumeric() {
            c.to_ascii_lowercase()
        } else {
            '_'
        }
    }));
    table.truncate(64);
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dsn_options_are_parsed() {
        let o = SqliteConfig::from_dsn(
            "sqlite:///tmp/q.db?table=jobs&lease=1500ms&poll=0.1&batch=8&busy_timeout=1m&auto_setup=false",
        )
        .unwrap();
        assert_eq!(o.path, PathBuf::from("/tmp/q.db"));
        assert_eq!(o.table.as_deref(), Some("jobs"));
        assert_eq!(o.lease, Duration::from_millis(1500));
        assert_eq!(o.poll, Duration::from_millis(100));
        assert_eq!(o.batch, 8);
        assert_eq!(o.busy_timeout, Duration::from_secs(60));
        assert!(!o.auto_setup);
        let o = SqliteConfig::from_dsn("sqlite:envoi.db").unwrap();
        assert_eq!(o, SqliteConfig::new("envoi.db"));
    }

    #[test]
    fn the_scheme_is_read_in_any_case() {
        for dsn in ["SQLITE://envoi.db", "Sqlite:envoi.db"] {
            let o = SqliteConfig::from_dsn(dsn).unwrap();
            assert_eq!(o, SqliteConfig::new("envoi.db"), "{dsn}");
        }
        for dsn in ["sqlit://envoi.db", "sqlite", "é"] {
            assert!(SqliteConfig::from_dsn(dsn).is_err(), "{dsn}");
        }
    }

    #[test]
    fn bad_dsns_are_invalid_with_a_reason() {
        for (dsn, reason) in [
            ("postgres://x", "expected `sqlite://<path>`"),
            ("sqlite://", "path is empty"),
            ("sqlite://?lease=1s", "path is empty"),
            ("sqlite::memory:", "in-memory"),
            ("sqlite://:memory:", "in-memory"),
            ("sqlite://file:x?mode=memory", "in-memory"),
            ("sqlite://x.db?mode=memory", "in-memory"),
            ("sqlite://x.db?lease=soon", "`lease` must be a duration"),
            ("sqlite://x.db?lease=0s", "at least 1ms"),
            ("sqlite://x.db?poll=-1", "`poll` must be a duration"),
            ("sqlite://x.db?poll=61s", "`poll` must be at most 1m"),
            ("sqlite://x.db?poll=1000000000", "`poll` must be at most 1m"),
            ("sqlite://x.db?poll=1e9", "`poll` must be a duration"),
            (
                "sqlite://x.db?busy_timeout=1000h",
                "`busy_timeout` must be at most",
            ),
            ("sqlite://x.db?batch=0", "`batch` must be"),
            ("sqlite://x.db?batch=many", "`batch` must be"),
            ("sqlite://x.db?table=drop%20table", "table name"),
            ("sqlite://x.db?table=1abc", "table name"),
            ("sqlite://x.db?table=sqlite_master", "table name"),
            ("sqlite://x.db?auto_setup=maybe", "`auto_setup`"),
            (
                "sqlite://x.db?colour=blue",
                "unknown option `colour` (known: table, lease, poll, batch, busy_timeout, \
                 auto_setup)",
            ),
            ("sqlite://x.db?mode=rwc", "unknown option `mode`"),
            ("sqlite://x.db?lease", "`lease` must be a duration"),
            (
                "sqlite://x.db?lease=1s&lease=5s",
                "option `lease` is given twice",
            ),
            (
                "sqlite://x.db?table=a&batch=2&table=b",
                "option `table` is given twice",
            ),
        ] {
            match SqliteConfig::from_dsn(dsn) {
                Err(TransportError::InvalidDsn { reason: r, .. }) => {
                    assert!(
                        r.contains(reason),
                        "{dsn}: `{r}` does not mention `{reason}`"
                    )
                }
                other => panic!("{dsn}: expected InvalidDsn, got {other:?}"),
            }
        }
    }

    #[test]
    fn default_table_is_a_safe_identifier() {
        assert_eq!(default_table("orders"), "envoi_orders");
        assert_eq!(default_table("Async-Jobs.v2"), "envoi_async_jobs_v2");
        assert!(validate_table(&default_table(&"ü".repeat(100))).is_ok());
    }
}
