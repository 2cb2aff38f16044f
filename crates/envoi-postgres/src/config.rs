//! Configuration of a [`PostgresTransport`](crate::PostgresTransport) and its
//! DSN syntax.
//!
//! A DSN is an ordinary PostgreSQL URL (`postgres://` or `postgresql://`)
//! whose query string may carry envoi's options next to the driver's own
//! (`sslmode`, `application_name`, `options`, …). envoi's options are taken
//! out before the rest is handed to sqlx:
//!
//! ```
//! use std::time::Duration;
//! use envoi_postgres::PostgresConfig;
//!
//! let config = PostgresConfig::from_dsn(
//!     "postgres://app:secret@db.internal:5432/shop?table=jobs&lease=30s&batch=500&sslmode=prefer",
//! )
//! .unwrap();
//! assert_eq!(config.table, "jobs");
//! assert_eq!(config.lease, Duration::from_secs(30));
//! assert_eq!(config.batch, 500);
//! assert_eq!(config.connect.get_database(), Some("shop"));
//! ```
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `table` | `envoi_messages` | table holding the messages (`[a-z_][a-z0-9_]*`, at most 48 characters); also the `LISTEN/NOTIFY` channel |
//! | `lease` | `300s` | how long a handed-out message stays invisible before it is redelivered; `keepalive` renews it |
//! | `batch` | `256` | most messages one `get` claims, whatever it is asked for (1–10000) |
//! | `wait` | `250ms` | longest wait of an empty `get` for a notification; `0` returns at once (a worker with several receivers then waits in `wait_for_messages` instead) |
//! | `poll` | `500ms` | longest wait of `wait_for_messages`, hence the polling period of an idle worker when a notification is missed, the listener is down, a delay comes due or a lease expires |
//! | `listen` | `true` | `false` disables `LISTEN/NOTIFY` (for poolers in transaction mode): pure polling |
//! | `max_connections` | `10` | size of the connection pool (the listener has one connection of its own) |
//! | `acquire_timeout` | `10s` | longest wait for a pooled connection |
//! | `max_body` | `1000000000` | largest body `send` accepts, in bytes |
//! | `auto_setup` | `true` | create the table and its index when a statement finds the table missing (the first use on a new database, or after `delete`), as `setup` does; `false` leaves that to `setup` (`setup-transports`) and a statement on a missing table fails, saying so |
//! | `connect_timeout` | `5s` | longest wait for the server when the transport first uses it (opening a connection, for a pool of its own); a server that refuses or gives no answer within it makes the operation fail with [`TransportError::Unreachable`] naming the masked DSN |
//!
//! The options are read by [`DsnQuery`], as on every transport: durations
//! are what [`envoi_core::transport::parse_duration`] reads (`250ms`, `2s`,
//! `1.5` seconds, `5m`, `1h`, `1h30m`), booleans `true`/`false`, `1`/`0`,
//! `yes`/`no` or `on`/`off`, values percent-decoded. Any other query
//! parameter must be one sqlx understands
//! (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`, `statement-cache-capacity`,
//! `host`, `hostaddr`, `port`, `dbname`, `user`, `password`,
//! `application_name`, `options`); an unknown one is an error rather than a
//! silently ignored typo, and so is an option given twice, under one
//! spelling or two (`sslmode` and `ssl-mode`), rather than the last one
//! silently winning. Without `application_name` the connections
//! are named `envoi`, which is how they show up in `pg_stat_activity`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use envoi_core::transport::mask_dsn;
use envoi_core::transport::support::{DsnQuery, DEFAULT_CONNECT_TIMEOUT};
use envoi_core::TransportError;
use sqlx::postgres::PgConnectOptions;

/// The default table.
pub const DEFAULT_TABLE: &str = "envoi_messages";

/// The longest table name accepted: index names add a suffix of their own
/// and PostgreSQL truncates identifiers beyond 63 bytes.
pub const MAX_TABLE_LEN: usize = 48;

/// The default `application_name` of the transport's connections.
pub const DEFAULT_APPLICATION_NAME: &str = "envoi";

/// Query parameters the sqlx PostgreSQL driver understands.
const DRIVER_PARAMS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// How a [`PostgresTransport`](crate::PostgresTransport) connects and
/// behaves. Build it with [`PostgresConfig::from_dsn`], or from
/// [`Default`] and a [`PgConnectOptions`] of your own.
#[derive(Clone)]
#[non_exhaustive]
pub struct PostgresConfig {
    /// How to reach the server (host, credentials, TLS, `application_name`).
    pub connect: PgConnectOptions,
    /// The table holding the messages, also the notification channel.
    /// Checked by [`validate_table`] when the transport is created.
    pub table: String,
    /// How long a handed-out message stays leased before it is redelivered.
    pub lease: Duration,
    /// The most messages one [`get`](envoi_core::transport::Receiver::get) claims.
    pub batch: usize,
    /// The longest an empty [`get`](envoi_core::transport::Receiver::get)
    /// waits for a notification; zero returns at once.
    pub wait: Duration,
    /// The longest wait of
    /// [`wait_for_messages`](envoi_core::transport::WakeUp::wait_for_messages):
    /// the polling period of an idle consumer.
    pub poll_interval: Duration,
    /// Whether to wake consumers with `LISTEN/NOTIFY` (otherwise: polling only).
    pub listen: bool,
    /// Size of the connection pool used for queries.
    pub max_connections: u32,
    /// The longest wait for a pooled connection.
    pub acquire_timeout: Duration,
    /// The largest body `send` accepts, in bytes.
    pub max_body: usize,
    /// Whether a statement that finds the table missing creates it (with
    /// its index, as [`Setup`](envoi_core::transport::Setup) does) and runs
    /// again.
    pub auto_setup: bool,
    /// The longest wait for the server when the transport first uses it;
    /// then [`TransportError::Unreachable`].
    pub connect_timeout: Duration,
    /// The DSN this configuration was read from, password masked, for
    /// errors.
    masked_dsn: Option<String>,
}

impl Default for PostgresConfig {
    fn default() -> Self {
        Self {
            connect: PgConnectOptions::new().application_name(DEFAULT_APPLICATION_NAME),
            table: DEFAULT_TABLE.to_string(),
            lease: Duration::from_secs(300),
            batch: 256,
            wait: Duration::from_millis(250),
            poll_interval: Duration::from_millis(500),
            listen: true,
            max_connections: 10,
            acquire_timeout: Duration::from_secs(10),
            max_body: 1_000_000_000,
            auto_setup: true,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            masked_dsn: None,
        }
    }
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The connect options hold the password: show only where they lead.
        f.debug_struct("PostgresConfig")
            .field("host", &self.connect.get_host())
            .field("port", &self.connect.get_port())
            .field("database", &self.connect.get_database())
            .field("username", &self.connect.get_username())
            .field("application_name", &self.connect.get_application_name())
            .field("table", &self.table)
            .field("lease", &self.lease)
            .field("batch", &self.batch)
            .field("wait", &self.wait)
            .field("poll_interval", &self.poll_interval)
            .field("listen", &self.listen)
            .field("max_connections", &self.max_connections)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("max_body", &self.max_body)
            .field("auto_setup", &self.auto_setup)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

/// The one name of an option the driver takes under several spellings:
/// given under two of them, the last would win.
fn same_option(key: &str) -> &str {
    match key {
        "ssl-mode" => "sslmode",
        "ssl-root-cert" | "ssl-ca" => "sslrootcert",
        "ssl-cert" => "sslcert",
        "ssl-key" => "sslkey",
        other => other,
    }
}

/// Whether `name` is an option the driver reads (handed on to sqlx).
fn is_driver_option(name: &str) -> bool {
    DRIVER_PARAMS.contains(&name) || name.starts_with("options[")
}

impl PostgresConfig {
    /// Parses a `postgres://` or `postgresql://` DSN, envoi's options
    /// included (see the [module docs](self)).
    ///
    /// Fails with [`TransportError::InvalidDsn`] (password masked) for
    /// another scheme, a malformed URL, an unknown or malformed option, an
    /// option given twice, or a table name that is not a plain identifier.
    pub fn from_dsn(dsn: &str) -> Result<Self, TransportError> {
        let invalid = |reason: String| TransportError::InvalidDsn {
            dsn: mask_dsn(dsn),
            reason,
        };
        let mut url = url::Url::parse(dsn).map_err(|e| invalid(format!("not a URL: {e}")))?;
        if !is_postgres_scheme(url.scheme()) {
            return Err(invalid(format!(
                "scheme `{}` is not `postgres` or `postgresql`",
                url.scheme()
            )));
        }
        let mut query = DsnQuery::parse(dsn)?;
        let mut config = PostgresConfig::default();
        config.read_options(&mut query)?;
        let driver_params = query.take_matching(is_driver_option);
        if let Some(reason) = given_twice(&driver_params) {
            return Err(query.invalid(reason));
        }
        query.finish()?;

        let has_application_name = driver_params.iter().any(|(k, _)| k == "application_name");
        if driver_params.is_empty() {
            url.set_query(None);
        } else {
            url.query_pairs_mut().clear().extend_pairs(driver_params);
        }
        let mut connect = PgConnectOptions::from_str(url.as_str())
            .map_err(|e| invalid(format!("rejected by the driver: {e}")))?;
        if !has_application_name {
            connect = connect.application_name(DEFAULT_APPLICATION_NAME);
        }
        config.connect = connect;
        config.masked_dsn = Some(mask_dsn(dsn));
        config.validate().map_err(|e| invalid(e.to_string()))?;
        Ok(config)
    }

    /// The DSN errors name: the one this configuration was read from, or
    /// one made of the connect options (without the password); masked.
    pub(crate) fn dsn_for_errors(&self) -> String {
        if let Some(dsn) = &self.masked_dsn {
            return dsn.clone();
        }
        let c = &self.connect;
        let database = c.get_database().unwrap_or_default();
        format!(
            "postgres://{}@{}:{}/{database}",
            c.get_username(),
            c.get_host(),
            c.get_port()
        )
    }

    /// Takes envoi's own options out of `query`.
    fn read_options(&mut self, query: &mut DsnQuery) -> Result<(), TransportError> {
        if let Some(table) = query.string("table") {
            self.table = table;
        }
        if let Some(lease) = query.duration("lease")? {
            self.lease = lease;
        }
        if let Some(batch) = query.number("batch")? {
            self.batch = batch;
        }
        if let Some(wait) = query.duration("wait")? {
            self.wait = wait;
        }
        if let Some(poll) = query.duration("poll")? {
            self.poll_interval = poll;
        }
        if let Some(listen) = query.bool("listen")? {
            self.listen = listen;
        }
        if let Some(max) = query.number("max_connections")? {
            self.max_connections = max;
        }
        if let Some(timeout) = query.duration("acquire_timeout")? {
            self.acquire_timeout = timeout;
        }
        if let Some(max) = query.number("max_body")? {
            self.max_body = max;
        }
        if let Some(auto_setup) = query.bool("auto_setup")? {
            self.auto_setup = auto_setup;
        }
        self.connect_timeout = query.connect_timeout()?;
        Ok(())
    }

    /// Checks the values: a valid table name, a lease of at least one
    /// millisecond, a batch of 1–10000, a wait of at most 1 h, a poll
    /// interval of 10 ms–1 h,
    /// 1–1000 connections, a connect timeout longer than zero.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_table(&self.table)?;
        let check = |ok: bool, option: &'static str, expected: &'static str| {
            if ok {
                Ok(())
            } else {
                Err(ConfigError::OutOfRange { option, expected })
            }
        };
        check(
            self.lease >= Duration::from_millis(1)
                && self.lease <= Duration::from_secs(86_400 * 365),
            "lease",
            "between 1ms and 365 days",
        )?;
        check(
            (1..=10_000).contains(&self.batch),
            "batch",
            "between 1 and 10000",
        )?;
        check(self.wait <= Duration::from_secs(3600), "wait", "at most 1h")?;
        check(
            self.poll_interval >= Duration::from_millis(10)
                && self.poll_interval <= Duration::from_secs(3600),
            "poll",
            "between 10ms and 1h",
        )?;
        check(
            (1..=1000).contains(&self.max_connections),
            "max_connections",
            "between 1 and 1000",
        )?;
        check(
            self.acquire_timeout >= Duration::from_millis(1),
            "acquire_timeout",
            "at least 1ms",
        )?;
        check(
            !self.connect_timeout.is_zero(),
            "connect_timeout",
            "longer than zero",
        )?;
        check(self.max_body >= 1, "max_body", "at least 1")
    }
}

/// Whether `scheme` names PostgreSQL.
pub(crate) fn is_postgres_scheme(scheme: &str) -> bool {
    scheme.eq_ignore_ascii_case("postgres") || scheme.eq_ignore_ascii_case("postgresql")
}

/// A configuration value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The table name is not a plain lower-case identifier.
    #[error(
        "table name `{0}` is not an identifier of the form [a-z_][a-z0-9_]* of at most {MAX_TABLE_LEN} characters"
    )]
    InvalidTable(String),
    /// The transport name is empty or contains a NUL character.
    #[error("transport name `{0}` must be non-empty and contain no NUL character")]
    InvalidName(String),
    /// A value is out of its range.
    #[error("option `{option}` must be {expected}")]
    OutOfRange {
        /// The option.
        option: &'static str,
        /// What it accepts.
        expected: &'static str,
    },
}

/// Checks that `table` is a lower-case identifier (`[a-z_][a-z0-9_]*`, at
/// most [`MAX_TABLE_LEN`] characters), so it can be spliced into SQL and
/// used as a notification channel without quoting surprises.
pub fn validate_table(table: &str) -> Result<(), ConfigError> {
    let mut chars = table.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if first_ok && rest_ok && table.len() <= MAX_TABLE_LEN {
        Ok(())
    } else {
        Err(ConfigError::InvalidTable(table.to_string()))
    }
}

/// Why `driver_params` are refused, when one driver option is given under
/// two of its spellings (`sslmode` and `ssl-mode`): the last would win.
/// (The same spelling twice is refused by [`DsnQuery::parse`].)
fn given_twice(driver_params: &[(String, String)]) -> Option<String> {
    driver_params.iter().enumerate().find_map(|(i, (key, _))| {
        driver_params[..i]
            .iter()
            .find(|(first, _)| same_option(first) == same_option(key))
            .map(|(first, _)| format!("option `{key}` is given twice (as `{first}`)"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(dsn: &str) -> String {
        match PostgresConfig::from_dsn(dsn) {
            Err(TransportError::InvalidDsn { reason, .. }) => reason,
            other => panic!("expected InvalidDsn for {dsn}, got {other:?}"),
        }
    }

    #[test]
    fn dsn_without_options_uses_the_defaults_and_names_connections_envoi() {
        let config = PostgresConfig::from_dsn("postgres://postgres@127.0.0.1:5432/test").unwrap();
        assert_eq!(config.table, DEFAULT_TABLE);
        assert_eq!(config.lease, Duration::from_secs(300));
        assert_eq!(config.batch, 256);
        assert_eq!(config.wait, Duration::from_millis(250));
        assert_eq!(config.poll_interval, Duration::from_millis(500));
        assert!(config.listen);
        assert_eq!(config.connect.get_host(), "127.0.0.1");
        assert_eq!(config.connect.get_port(), 5432);
        assert_eq!(config.connect.get_username(), "postgres");
        assert_eq!(config.connect.get_database(), Some("test"));
        assert_eq!(config.connect.get_application_name(), Some("envoi"));
        assert!(config.auto_setup);
        assert_eq!(config.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
    }

    #[test]
    fn envoi_options_are_read_and_driver_options_passed_on() {
        let config = PostgresConfig::from_dsn(
            "postgresql://u:p%40ss@db:6543/app?table=jobs_2&lease=1500ms&batch=50&poll=2s&wait=0\
             &listen=false&max_connections=3&max_body=1024&acquire_timeout=1m\
             &auto_setup=false&connect_timeout=1500ms\
             &application_name=billing&sslmode=disable",
        )
        .unwrap();
        assert_eq!(config.table, "jobs_2");
        assert_eq!(config.lease, Duration::from_millis(1500));
        assert_eq!(config.batch, 50);
        assert_eq!(config.poll_interval, Duration::from_secs(2));
        assert_eq!(config.wait, Duration::ZERO);
        assert!(!config.listen);
        assert_eq!(config.max_connections, 3);
        assert_eq!(config.max_body, 1024);
        assert_eq!(config.acquire_timeout, Duration::from_secs(60));
        assert!(!config.auto_setup);
        assert_eq!(config.connect_timeout, Duration::from_millis(1500));
        assert_eq!(config.connect.get_application_name(), Some("billing"));
        assert_eq!(config.connect.get_port(), 6543);
        assert_eq!(config.connect.get_database(), Some("app"));
        assert!(matches!(
            config.connect.get_ssl_mode(),
            sqlx::postgres::PgSslMode::Disable
        ));
    }

    #[test]
    fn durations_accept_units_and_bare_seconds() {
        let lease = |value: &str| {
            PostgresConfig::from_dsn(&format!("postgres://h/db?lease={value}")).map(|c| c.lease)
        };
        assert_eq!(lease("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(lease("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(lease("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(lease("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(lease("1h").unwrap(), Duration::from_secs(3600));
        for bad in ["soon", "-1s", ""] {
            assert!(reason(&format!("postgres://h/db?lease={bad}")).contains("`lease`"));
        }
    }

    #[test]
    fn an_option_given_twice_is_rejected_rather_than_the_last_one_winning() {
        assert!(
            reason("postgres://h/db?lease=1s&lease=5s").contains("option `lease` is given twice")
        );
        assert!(reason("postgres://h/db?sslmode=require&sslmode=disable")
            .contains("option `sslmode` is given twice"));
        // The same option, once percent-encoded.
        assert!(
            reason("postgres://h/db?batch=1&b%61tch=2").contains("option `batch` is given twice")
        );
        // Two spellings of one driver option.
        assert!(reason("postgres://h/db?sslmode=require&ssl-mode=disable")
            .contains("option `ssl-mode` is given twice (as `sslmode`)"));
        assert!(reason("postgres://h/db?ssl-ca=/a.pem&sslrootcert=/b.pem")
            .contains("option `sslrootcert` is given twice (as `ssl-ca`)"));
    }

    #[test]
    fn unknown_option_is_rejected_by_name() {
        let reason = reason("postgres://h/db?lease_s=3");
        assert!(reason.contains("unknown option `lease_s`"), "{reason}");
        assert!(reason.contains("known: table, lease, batch"), "{reason}");
    }

    #[test]
    fn malformed_option_values_are_rejected_with_the_option_name() {
        assert!(reason("postgres://h/db?batch=many").contains("`batch`"));
        assert!(reason("postgres://h/db?batch=0").contains("`batch`"));
        assert!(reason("postgres://h/db?lease=later").contains("`lease`"));
        assert!(reason("postgres://h/db?listen=maybe").contains("`listen`"));
        assert!(reason("postgres://h/db?auto_setup=maybe").contains("`auto_setup`"));
        assert!(reason("postgres://h/db?connect_timeout=0s").contains("`connect_timeout`"));
        assert!(reason("postgres://h/db?poll=1ms").contains("`poll`"));
        assert!(reason("postgres://h/db?wait=2h").contains("`wait`"));
        assert!(reason("postgres://h/db?sslmode=sometimes").contains("driver"));
    }

    #[test]
    fn table_names_must_be_plain_identifiers() {
        for bad in [
            "",
            "1jobs",
            "Jobs",
            "jobs-x",
            "jobs;drop table x",
            "\"jobs\"",
            "public.jobs",
            &"x".repeat(MAX_TABLE_LEN + 1),
        ] {
            assert!(validate_table(bad).is_err(), "{bad:?} accepted");
        }
        for good in [
            "jobs",
            "_jobs",
            "envoi_messages_2",
            &"x".repeat(MAX_TABLE_LEN),
        ] {
            assert!(validate_table(good).is_ok(), "{good:?} rejected");
        }
        assert!(reason("postgres://h/db?table=a%3Bb").contains("table name"));
    }

    #[test]
    fn invalid_dsn_masks_the_password() {
        let err = PostgresConfig::from_dsn("postgres://u:hunter2@h/db?bogus=1").unwrap_err();
        let text = err.to_string();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("u:***@h"), "{text}");
    }

    #[test]
    fn other_schemes_and_non_urls_are_rejected() {
        assert!(reason("mysql://h/db").contains("scheme"));
        assert!(reason("not a dsn").contains("not a URL"));
    }

    #[test]
    fn errors_name_the_dsn_masked_or_one_made_of_the_connect_options() {
        let config = PostgresConfig::from_dsn("postgres://u:hunter2@h:6000/db?lease=1s").unwrap();
        assert_eq!(
            config.dsn_for_errors(),
            "postgres://u:***@h:6000/db?lease=1s"
        );
        let built = PostgresConfig {
            connect: PgConnectOptions::new()
                .host("db")
                .port(5433)
                .username("app")
                .password("hunter2")
                .database("shop"),
            ..PostgresConfig::default()
        };
        assert_eq!(built.dsn_for_errors(), "postgres://app@db:5433/shop");
    }

    #[test]
    fn debug_output_never_shows_the_password() {
        let config = PostgresConfig::from_dsn("postgres://u:hunter2@h/db").unwrap();
        assert!(!format!("{config:?}").contains("hunter2"));
    }
}
