//! DSN parsing: `nats://[user:password@|token@]host:port?stream=..&subject=..&..`.

use std::path::PathBuf;
use std::time::Duration;

use envoi_core::transport::support::{DsnQuery, DEFAULT_CONNECT_TIMEOUT};
use envoi_core::TransportError;
use url::Url;

use crate::auth::{mask, user_info};

/// Where the messages of a JetStream stream live on the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Storage {
    /// On disk: messages survive a server restart (the default).
    File,
    /// In memory: faster, lost when the server stops.
    Memory,
}

/// How a [`NatsTransport`](crate::NatsTransport) connects and what it
/// creates. Build it from a DSN with [`NatsConfig::from_dsn`]; fields can be
/// adjusted afterwards.
///
/// | DSN option        | Field               | Default                     |
/// |-------------------|---------------------|-----------------------------|
/// | `stream`          | `stream`            | `envoi-<name>`              |
/// | `subject`         | `subject`           | `envoi.<name>`              |
/// | `consumer`        | `consumer`          | `envoi-<name>`              |
/// | `lease`           | `lease`             | `30s`                       |
/// | `batch`           | `batch`             | `500`                       |
/// | `wait`            | `wait`              | `250ms`                     |
/// | `storage`         | `storage`           | `file` (`file` or `memory`) |
/// | `double_ack`      | `double_ack`        | `false`                     |
/// | `dedup`           | `dedup`             | `false`                     |
/// | `max_ack_pending` | `max_ack_pending`   | `-1` (unlimited)            |
/// | `auto_setup`      | `auto_setup`        | `true`                      |
/// | `connect_timeout` | `connect_timeout`   | `5s`                        |
/// | `token`           | `token`             | none                        |
/// | `nkey_seed_file`  | `nkey_seed_file`    | none                        |
/// | `creds_file`      | `creds_file`        | none                        |
/// | `tls`             | `tls`               | `false`                     |
/// | `tls_ca_file`     | `tls_ca_file`       | none (the system's roots)   |
/// | `tls_cert_file`   | `tls_cert_file`     | none                        |
/// | `tls_key_file`    | `tls_key_file`      | none                        |
///
/// Options are read by [`DsnQuery`], as on every transport: an unknown
/// option or one given twice is refused; booleans are `true`/`false`,
/// `1`/`0`, `yes`/`no` or `on`/`off`; durations are `1500ms`, `2s`, `1m`,
/// `1h30m` or plain (decimal) seconds.
///
/// # Credentials and TLS
///
/// One way to authenticate, at most:
///
/// * a user and password in the user information,
///   `nats://user:password@host:port` (percent-encode `@`, `:`, `/`, `%`
///   and spaces in them, such as `p%40ss` for `p@ss`);
/// * a token, as NATS URLs give one: the user information without a
///   password, `nats://TOKEN@host:port`, or the `token` option (`+` reads
///   as a space there: write `%2B`);
/// * `nkey_seed_file`: a file holding an NKey seed (`SU…`), alone or in the
///   decorated block `nsc` and `nk` write;
/// * `creds_file`: a `.creds` file (a user JWT and its NKey seed).
///
/// `tls=true` requires TLS (a server that requires it gets it anyway).
/// `tls_ca_file` names the PEM certificates of the authorities the
/// server's certificate is checked against (the system's roots by default);
/// `tls_cert_file` and `tls_key_file`, given together, the client's PEM
/// certificate and key, for a server that verifies clients. Files are read
/// when the transport connects; one that cannot be read or used is a
/// [`TransportError::InvalidDsn`] naming it.
///
/// Passwords and tokens never show: `Debug` masks them, and so does every
/// error naming the DSN (`nats://u:***@host`, `nats://***@host`,
/// `token=***`).
///
/// ```
/// use envoi_nats::NatsConfig;
///
/// let config = NatsConfig::from_dsn("nats://app:s3cr%40t@127.0.0.1:4222").unwrap();
/// assert_eq!(config.server, "nats://127.0.0.1:4222");
/// assert_eq!(config.user.as_deref(), Some("app"));
/// assert_eq!(config.password.as_deref(), Some("s3cr@t"));
/// assert!(!format!("{config:?}").contains("s3cr"));
///
/// let config = NatsConfig::from_dsn("nats://t0k3n@127.0.0.1:4222").unwrap();
/// assert_eq!(config.token.as_deref(), Some("t0k3n"));
/// ```
///
/// `stream`, `subject` and `consumer` are `None` unless the DSN names them:
/// the transport then derives them from its name, `<name>` being the
/// transport name with characters that JetStream does not allow in names
/// (`.`, `*`, `>`, `/`, `\`, whitespace and control characters) replaced
/// by `_`. [`NatsTransport::config`](crate::NatsTransport::config) shows
/// the names in use.
///
/// ```
/// use std::time::Duration;
/// use envoi_nats::NatsConfig;
///
/// let config = NatsConfig::from_dsn("nats://127.0.0.1:4222?lease=2s&batch=50").unwrap();
/// assert_eq!(config.stream, None, "derived from the transport name");
/// assert_eq!(config.lease, Duration::from_secs(2));
/// assert_eq!(config.batch, 50);
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NatsConfig {
    /// The server URL without credentials or query (`nats://host:port`).
    pub server: String,
    /// The user to authenticate as, with `password`: the DSN's user
    /// information (`nats://user:password@host`), percent-decoded.
    pub user: Option<String>,
    /// The password of `user`, percent-decoded. `Debug` masks it.
    pub password: Option<String>,
    /// A token to authenticate with: the DSN's user information when it
    /// has no password (`nats://TOKEN@host`), or the `token` option.
    /// `Debug` masks it.
    pub token: Option<String>,
    /// A file holding the NKey seed to authenticate with.
    pub nkey_seed_file: Option<PathBuf>,
    /// A `.creds` file (a user JWT and its NKey seed) to authenticate with.
    pub creds_file: Option<PathBuf>,
    /// How long connecting may take before it fails with
    /// [`TransportError::Unreachable`].
    pub connect_timeout: Duration,
    /// The JetStream stream holding the messages; `None`: `envoi-<name>`.
    pub stream: Option<String>,
    /// The subject messages are published to (the stream captures it);
    /// `None`: `envoi.<name>`.
    pub subject: Option<String>,
    /// The durable pull consumer shared by every handle on this transport;
    /// `None`: `envoi-<name>`.
    pub consumer: Option<String>,
    /// How long a handed-out message stays leased before JetStream delivers
    /// it again: the consumer's `ack_wait`.
    pub lease: Duration,
    /// The largest number of messages one fetch asks for.
    pub batch: usize,
    /// How long a fetch waits for a message when none is available.
    pub wait: Duration,
    /// Where the stream keeps its messages.
    pub storage: Storage,
    /// Have the server confirm each acknowledgement with a request of its
    /// own. Off, acks are confirmed all the same, one answer for a batch
    /// (the consumer applies the acks of one connection in order).
    pub double_ack: bool,
    /// Give every publish a `Nats-Msg-Id`, so that a publish retried after
    /// its acknowledgement was lost is stored once (within the stream's
    /// duplicate window). Off, such a retry can store the message twice,
    /// which at-least-once delivery allows; on, the server checks and keeps
    /// every id for the duplicate window, and each message carries it.
    pub dedup: bool,
    /// The consumer's `max_ack_pending` (`-1` for no limit). Delayed
    /// messages count against it until they are due.
    pub max_ack_pending: i64,
    /// Create the stream and consumer on first use.
    pub auto_setup: bool,
    /// Require TLS.
    pub tls: bool,
    /// The PEM certificates of the authorities the server's certificate is
    /// checked against, instead of the system's roots.
    pub tls_ca_file: Option<PathBuf>,
    /// The client's PEM certificate, for a server that verifies clients
    /// (with `tls_key_file`).
    pub tls_cert_file: Option<PathBuf>,
    /// The private key of `tls_cert_file`, in PEM.
    pub tls_key_file: Option<PathBuf>,
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("server", &mask(&self.server))
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("creds_file", &self.creds_file)
            .field("connect_timeout", &self.connect_timeout)
            .field("stream", &self.stream)
            .field("subject", &self.subject)
            .field("consumer", &self.consumer)
            .field("lease", &self.lease)
            .field("batch", &self.batch)
            .field("wait", &self.wait)
            .field("storage", &self.storage)
            .field("double_ack", &self.double_ack)
            .field("dedup", &self.dedup)
            .field("max_ack_pending", &self.max_ack_pending)
            .field("auto_setup", &self.auto_setup)
            .field("tls", &self.tls)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .finish()
    }
}

/// The longest fetch wait accepted (JetStream pull requests can wait longer,
/// but `get` is meant to return promptly).
const MAX_WAIT: Duration = Duration::from_secs(30);

/// The longest lease taken: a year.
const MAX_LEASE: Duration = Duration::from_secs(365 * 86_400);

/// The stream, subject and consumer a transport uses: those of its
/// configuration, or those derived from its name.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    pub(crate) stream: String,
    pub(crate) subject: String,
    pub(crate) consumer: String,
}

impl NatsConfig {
    /// The host and port of [`server`](Self::server), the port 4222 when
    /// it names none; `None` for a server URL that names no host.
    pub(crate) fn server_address(&self) -> Option<(String, u16)> {
        let url = Url::parse(&self.server).ok()?;
        let host = url.host_str().filter(|h| !h.is_empty())?;
        Some((host.to_string(), url.port().unwrap_or(4222)))
    }

    /// Parses `dsn`. Fails with [`TransportError::InvalidDsn`] (password
    /// and token masked) when the DSN or one of its options is not
    /// understood, an option is given twice, or the credentials contradict
    /// each other.
    pub fn from_dsn(dsn: &str) -> Result<Self, TransportError> {
        // `DsnQuery` masks passwords only: name the DSN with its token
        // masked too.
        Self::parse(dsn).map_err(|error| match error {
            TransportError::InvalidDsn { reason, .. } => TransportError::InvalidDsn {
                dsn: mask(dsn),
                reason,
            },
            other => other,
        })
    }

    fn parse(dsn: &str) -> Result<Self, TransportError> {
        let invalid = |reason: String| TransportError::InvalidDsn {
            dsn: mask(dsn),
            reason,
        };
        let url = Url::parse(dsn).map_err(|e| invalid(e.to_string()))?;
        if url.scheme() != "nats" {
            return Err(invalid(format!(
                "scheme must be `nats`, not `{}`",
                url.scheme()
            )));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(invalid("a host is required".into()));
        }
        if !matches!(url.path(), "" | "/") {
            return Err(invalid(format!(
                "unexpected path `{}`; options go in the query",
                url.path()
            )));
        }
        let user_info = user_info(&url, dsn).map_err(invalid)?;
        let mut config = NatsConfig {
            server: server_url(&url),
            user: user_info.user,
            password: user_info.password,
            token: user_info.token,
            nkey_seed_file: None,
            creds_file: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            stream: None,
            subject: None,
            consumer: None,
            lease: Duration::from_secs(30),
            batch: 500,
            wait: Duration::from_millis(250),
            storage: Storage::File,
            double_ack: false,
            dedup: false,
            max_ack_pending: -1,
            auto_setup: true,
            tls: false,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
        };
        let mut query = DsnQuery::parse(dsn)?;
        config.read_options(&mut query)?;
        query.finish()?;
        config.validate().map_err(invalid)?;
        Ok(config)
    }

    /// Takes every option this transport knows from `query`. Ranges are
    /// checked by [`validate`](Self::validate).
    fn read_options(&mut self, query: &mut DsnQuery) -> Result<(), TransportError> {
        self.stream = query.string("stream");
        self.subject = query.string("subject");
        self.consumer = query.string("consumer");
        if let Some(lease) = query.duration("lease")? {
            self.lease = lease;
        }
        if let Some(batch) = query.number("batch")? {
            self.batch = batch;
        }
        if let Some(wait) = query.duration("wait")? {
            self.wait = wait;
        }
        if let Some(storage) = query.string("storage") {
            self.storage = match storage.as_str() {
                "file" => Storage::File,
                "memory" => Storage::Memory,
                _ => {
                    return Err(
                        query.invalid(format!("`storage={storage}` must be `file` or `memory`"))
                    )
                }
            };
        }
        let flags: [(&'static str, &mut bool); 4] = [
            ("double_ack", &mut self.double_ack),
            ("dedup", &mut self.dedup),
            ("auto_setup", &mut self.auto_setup),
            ("tls", &mut self.tls),
        ];
        for (name, flag) in flags {
            if let Some(value) = query.bool(name)? {
                *flag = value;
            }
        }
        if let Some(max) = query.number("max_ack_pending")? {
            self.max_ack_pending = max;
        }
        self.connect_timeout = query.connect_timeout()?;
        if let Some(token) = query.string("token") {
            if self.token.is_some() {
                return Err(query.invalid(
                    "a token is given twice: as the user information and as `token`".into(),
                ));
            }
            self.token = Some(token);
        }
        let files: [(&'static str, &mut Option<PathBuf>); 5] = [
            ("nkey_seed_file", &mut self.nkey_seed_file),
            ("creds_file", &mut self.creds_file),
            ("tls_ca_file", &mut self.tls_ca_file),
            ("tls_cert_file", &mut self.tls_cert_file),
            ("tls_key_file", &mut self.tls_key_file),
        ];
        for (name, file) in files {
            if let Some(path) = query.string(name) {
                if path.is_empty() {
                    return Err(query.invalid(format!("`{name}` names no file")));
                }
                *file = Some(PathBuf::from(path));
            }
        }
        Ok(())
    }

    /// Checks what [`from_dsn`](Self::from_dsn) checks, for a configuration
    /// changed or built in code: the names given, the lease, wait, batch,
    /// `max_ack_pending` and `connect_timeout` ranges, and the credentials.
    pub(crate) fn validate(&self) -> Result<(), String> {
        self.validate_credentials()?;
        if self.connect_timeout.is_zero() {
            return Err("`connect_timeout` must be longer than zero".into());
        }
        if let Some(stream) = &self.stream {
            name_option("stream", stream)?;
        }
        if let Some(consumer) = &self.consumer {
            name_option("consumer", consumer)?;
        }
        if let Some(subject) = &self.subject {
            subject_option(subject)?;
        }
        // JetStream keeps `ack_wait` in nanoseconds: past about 292 years it
        // overflows and no consumer can be made.
        if self.lease < Duration::from_millis(100) || self.lease > MAX_LEASE {
            return Err(format!(
                "`lease` must be at least 100ms and at most 365 days, not {:?}",
                self.lease
            ));
        }
        if self.wait < Duration::from_millis(10) || self.wait > MAX_WAIT {
            return Err(format!(
                "`wait` must be between 10ms and 30s, not {:?}",
                self.wait
            ));
        }
        if !(1..=100_000).contains(&self.batch) {
            return Err(format!(
                "`batch` must be a number from 1 to 100000, not {}",
                self.batch
            ));
        }
        if self.max_ack_pending != -1 && self.max_ack_pending <= 0 {
            return Err(format!(
                "`max_ack_pending` must be -1 or a positive number, not {}",
                self.max_ack_pending
            ));
        }
        Ok(())
    }

    /// At most one way to authenticate; a user with a password; a client
    /// certificate with its key.
    fn validate_credentials(&self) -> Result<(), String> {
        if self.user.is_some() != self.password.is_some() {
            return Err("a user needs a password (`nats://user:password@host`)".into());
        }
        let ways: Vec<&str> = [
            (self.user.is_some(), "a user and password"),
            (self.token.is_some(), "a token"),
            (self.nkey_seed_file.is_some(), "`nkey_seed_file`"),
            (self.creds_file.is_some(), "`creds_file`"),
        ]
        .into_iter()
        .filter_map(|(given, way)| given.then_some(way))
        .collect();
        if ways.len() > 1 {
            return Err(format!(
                "give one way to authenticate, not {}",
                ways.join(" and ")
            ));
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err("`tls_cert_file` and `tls_key_file` go together".into());
        }
        Ok(())
    }

    /// The names the transport called `name` uses, checked as the DSN's
    /// would be (a name derived from a transport name JetStream does not
    /// accept is refused too).
    pub(crate) fn names(&self, name: &str) -> Result<Names, String> {
        let token = sanitize_token(name);
        let names = Names {
            stream: self
                .stream
                .clone()
                .unwrap_or_else(|| format!("envoi-{token}")),
            subject: self
                .subject
                .clone()
                .unwrap_or_else(|| format!("envoi.{token}")),
            consumer: self
                .consumer
                .clone()
                .unwrap_or_else(|| format!("envoi-{token}")),
        };
        name_option("stream", &names.stream)?;
        name_option("consumer", &names.consumer)?;
        subject_option(&names.subject)?;
        Ok(names)
    }
}

/// `nats://host:port`: `url` without credentials, path or query.
fn server_url(url: &Url) -> String {
    let mut server = url.clone();
    server.set_query(None);
    server.set_fragment(None);
    // Cannot fail: the URL has a host (checked before).
    let _ = server.set_password(None);
    let _ = server.set_username("");
    let mut s = server.to_string();
    if s.ends_with('/') {
        s.pop();
    }
    s
}

/// Replaces what JetStream forbids in stream and consumer names and in a
/// subject token.
fn sanitize_token(name: &str) -> String {
    let token: String = name
        .chars()
        .map(|c| {
            if c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\') || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect();
    if token.is_empty() {
        "default".to_string()
    } else {
        token
    }
}

fn name_option(key: &str, value: &str) -> Result<(), String> {
    let valid = !value.is_empty()
        && value.len() <= 255
        && value
            .chars()
            .all(|c| c.is_ascii_graphic() && !matches!(c, '.' | '*' | '>' | '/' | '\\'));
    if valid {
        Ok(())
    } else {
        Err(format!(
            "`{key}={value}` is not a valid JetStream name (printable ASCII without `.`, `*`, `>`, `/`)"
        ))
    }
}

fn subject_option(value: &str) -> Result<(), String> {
    let valid = !value.is_empty()
        && value.split('.').all(|token| {
            !token.is_empty()
                && token != "*"
                && token != ">"
                && token
                    .chars()
                    .all(|c| c.is_ascii_graphic() && c != '*' && c != '>')
        });
    if valid {
        Ok(())
    } else {
        Err(format!(
            "`subject={value}` must be a literal subject (dot-separated tokens, no wildcards)"
        ))
    }
}

/// Whether the literal `subject` is captured by the stream subject `filter`
/// (which may use `*` and `>` wildcards).
pub(crate) fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut filter_tokens = filter.split('.');
    let mut subject_tokens = subject.split('.');
    loop {
        match (filter_tokens.next(), subject_tokens.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(f), Some(s)) if f == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_derived_from_the_transport_name() {
        let config = NatsConfig::from_dsn("nats://127.0.0.1:4222").unwrap();
        assert_eq!(config.server, "nats://127.0.0.1:4222");
        assert_eq!(config.stream, None);
        assert_eq!(config.subject, None);
        assert_eq!(config.consumer, None);
        let names = config.names("my orders.v2").unwrap();
        assert_eq!(names.stream, "envoi-my_orders_v2");
        assert_eq!(names.subject, "envoi.my_orders_v2");
        assert_eq!(names.consumer, "envoi-my_orders_v2");
        assert_eq!(config.names("").unwrap().stream, "envoi-default");
        assert_eq!(config.lease, Duration::from_secs(30));
        assert_eq!(config.batch, 500);
        assert_eq!(config.wait, Duration::from_millis(250));
        assert_eq!(config.storage, Storage::File);
        assert!(!config.double_ack);
        assert!(!config.dedup);
        assert!(config.auto_setup);
        assert_eq!(config.max_ack_pending, -1);
    }

    #[test]
    fn a_transport_name_jetstream_does_not_accept_is_refused() {
        let config = NatsConfig::from_dsn("nats://127.0.0.1:4222").unwrap();
        let why = config.names("commandes-é").unwrap_err();
        assert!(why.contains("stream"), "{why}");
        // Named in the DSN, the stream and consumer need no derived name.
        let config =
            NatsConfig::from_dsn("nats://127.0.0.1:4222?stream=S&consumer=C&subject=a.b").unwrap();
        let names = config.names("x").unwrap();
        assert_eq!(
            (names.stream.as_str(), names.subject.as_str()),
            ("S", "a.b")
        );
        assert_eq!(names.consumer, "C");
    }

    #[test]
    fn every_option_is_read_from_the_query() {
        let config = NatsConfig::from_dsn(
            "nats://u:p@nats.local:4223/?stream=S1&subject=a.b.c&consumer=C1&lease=1500ms\
             &batch=7&wait=0.1&storage=memory&double_ack=true&dedup=on&max_ack_pending=64\
             &auto_setup=false&tls=1",
        )
        .unwrap();
        assert_eq!(config.server, "nats://nats.local:4223");
        assert_eq!(config.user.as_deref(), Some("u"));
        assert_eq!(config.password.as_deref(), Some("p"));
        assert_eq!(config.stream.as_deref(), Some("S1"));
        assert_eq!(config.subject.as_deref(), Some("a.b.c"));
        assert_eq!(config.consumer.as_deref(), Some("C1"));
        assert_eq!(config.lease, Duration::from_millis(1500));
        assert_eq!(config.batch, 7);
        assert_eq!(config.wait, Duration::from_millis(100));
        assert_eq!(config.storage, Storage::Memory);
        assert!(config.double_ack);
        assert!(config.dedup);
        assert_eq!(config.max_ack_pending, 64);
        assert!(!config.auto_setup);
        assert!(config.tls);
    }

    #[test]
    fn durations_take_the_same_spellings_as_every_other_transport() {
        let config = NatsConfig::from_dsn("nats://127.0.0.1:4222?lease=1h&wait=1s500ms").unwrap();
        assert_eq!(config.lease, Duration::from_secs(3600));
        assert_eq!(config.wait, Duration::from_millis(1500));
    }

    #[test]
    fn booleans_take_the_same_spellings_as_every_other_transport() {
        for (value, expected) in [
            ("true", true),
            ("YES", true),
            ("on", true),
            ("1", true),
            ("false", false),
            ("no", false),
            ("Off", false),
            ("0", false),
        ] {
            let config =
                NatsConfig::from_dsn(&format!("nats://127.0.0.1:4222?double_ack={value}")).unwrap();
            assert_eq!(config.double_ack, expected, "{value}");
        }
    }

    fn reason(dsn: &str) -> (String, String) {
        match NatsConfig::from_dsn(dsn) {
            Err(TransportError::InvalidDsn { dsn, reason }) => (dsn, reason),
            other => panic!("expected InvalidDsn for {dsn}, got {other:?}"),
        }
    }

    #[test]
    fn bad_dsns_are_rejected_with_the_password_masked() {
        let (dsn, why) = reason("nats://user:hunter2@127.0.0.1:4222?lease=soon");
        assert!(!dsn.contains("hunter2"), "{dsn}");
        assert!(dsn.contains("user:***@"), "{dsn}");
        assert!(why.contains("lease"), "{why}");

        assert!(reason("redis://127.0.0.1:6379").1.contains("scheme"));
        let (_, why) = reason("nats://127.0.0.1:4222?colour=red");
        assert!(why.contains("unknown option `colour`"), "{why}");
        assert!(why.contains("stream") && why.contains("tls"), "{why}");
        assert!(reason("nats://127.0.0.1:4222?stream=a.b")
            .1
            .contains("stream"));
        assert!(reason("nats://127.0.0.1:4222?subject=a.*")
            .1
            .contains("subject"));
        assert!(reason("nats://127.0.0.1:4222?subject=a..b")
            .1
            .contains("subject"));
        assert!(reason("nats://127.0.0.1:4222?batch=0").1.contains("batch"));
        assert!(reason("nats://127.0.0.1:4222?batch=none")
            .1
            .contains("batch"));
        assert!(reason("nats://127.0.0.1:4222?wait=5m").1.contains("wait"));
        assert!(reason("nats://127.0.0.1:4222?lease=10ms")
            .1
            .contains("lease"));
        // Past about 292 years JetStream's nanosecond ack_wait overflows and
        // the consumer cannot be made; a year is the most taken.
        let (_, why) = reason("nats://127.0.0.1:4222?lease=9300000000s");
        assert!(why.contains("at most 365 days"), "{why}");
        assert!(NatsConfig::from_dsn("nats://127.0.0.1:4222?lease=31536000s").is_ok());
        assert!(reason("nats://127.0.0.1:4222?storage=tape")
            .1
            .contains("storage"));
        assert!(reason("nats://127.0.0.1:4222?double_ack=maybe")
            .1
            .contains("double_ack"));
        assert!(reason("nats://127.0.0.1:4222?dedup=2").1.contains("dedup"));
        assert!(reason("nats://127.0.0.1:4222?max_ack_pending=0")
            .1
            .contains("max_ack_pending"));
        assert!(reason("nats://127.0.0.1:4222/queue").1.contains("path"));
        assert!(reason("not a dsn").0.contains("not a dsn"));
    }

    #[test]
    fn an_option_given_twice_is_rejected_rather_than_the_last_one_winning() {
        let (_, why) = reason("nats://127.0.0.1:4222?batch=5&batch=7");
        assert!(why.contains("option `batch` is given twice"), "{why}");
        // The same option, once percent-encoded.
        let (_, why) = reason("nats://127.0.0.1:4222?dedup=true&d%65dup=false");
        assert!(why.contains("option `dedup` is given twice"), "{why}");
    }

    #[test]
    fn credentials_come_from_the_user_information_or_the_options() {
        let config = NatsConfig::from_dsn("nats://app:p%40ss%3Aw%2Frd@h:4222").unwrap();
        assert_eq!(config.server, "nats://h:4222");
        assert_eq!(config.user.as_deref(), Some("app"));
        assert_eq!(config.password.as_deref(), Some("p@ss:w/rd"));
        assert_eq!(config.token, None);

        let config = NatsConfig::from_dsn("nats://s3cr3t@h:4222").unwrap();
        assert_eq!(config.server, "nats://h:4222");
        assert_eq!(
            (config.user.as_deref(), config.token.as_deref()),
            (None, Some("s3cr3t"))
        );
        let config = NatsConfig::from_dsn("nats://h:4222?token=s3%2Bcr3t").unwrap();
        assert_eq!(config.token.as_deref(), Some("s3+cr3t"));

        let config = NatsConfig::from_dsn(
            "nats://h:4222?nkey_seed_file=/etc/nats/user.nk&tls=true&tls_ca_file=/ca.pem\
             &tls_cert_file=/c.pem&tls_key_file=/k.pem&connect_timeout=750ms",
        )
        .unwrap();
        assert_eq!(
            config.nkey_seed_file,
            Some(PathBuf::from("/etc/nats/user.nk"))
        );
        assert!(config.tls);
        assert_eq!(config.tls_ca_file, Some(PathBuf::from("/ca.pem")));
        assert_eq!(config.tls_cert_file, Some(PathBuf::from("/c.pem")));
        assert_eq!(config.tls_key_file, Some(PathBuf::from("/k.pem")));
        assert_eq!(config.connect_timeout, Duration::from_millis(750));
        let config =
            NatsConfig::from_dsn("nats://h:4222?creds_file=%2Fhome%2Fa%20b.creds").unwrap();
        assert_eq!(config.creds_file, Some(PathBuf::from("/home/a b.creds")));

        let config = NatsConfig::from_dsn("nats://h:4222").unwrap();
        assert_eq!(config.connect_timeout, Duration::from_secs(5));
        assert_eq!(
            (config.user, config.password, config.token),
            (None, None, None)
        );
        assert_eq!((config.nkey_seed_file, config.creds_file), (None, None));
        assert_eq!(
            (
                config.tls_ca_file,
                config.tls_cert_file,
                config.tls_key_file
            ),
            (None, None, None)
        );
    }

    #[test]
    fn contradicting_credentials_are_refused() {
        for (dsn, expected) in [
            ("nats://t@h?token=u", "a token is given twice"),
            (
                "nats://u:p@h?token=t",
                "not a user and password and a token",
            ),
            (
                "nats://t@h?creds_file=/a.creds",
                "not a token and `creds_file`",
            ),
            (
                "nats://h?nkey_seed_file=/a.nk&creds_file=/a.creds",
                "`nkey_seed_file` and `creds_file`",
            ),
            ("nats://h?tls_cert_file=/c.pem", "go together"),
            ("nats://h?tls_key_file=/k.pem", "go together"),
            ("nats://h?tls_ca_file=", "names no file"),
            ("nats://h?connect_timeout=0s", "connect_timeout"),
            ("nats://h?connect_timeout=soon", "connect_timeout"),
        ] {
            let (_, why) = reason(dsn);
            assert!(why.contains(expected), "{dsn}: {why}");
        }
        let mut config = NatsConfig::from_dsn("nats://h").unwrap();
        config.user = Some("u".into());
        assert!(config.validate().unwrap_err().contains("needs a password"));
    }

    #[test]
    fn passwords_and_tokens_never_show_in_debug_or_errors() {
        for dsn in [
            "nats://u:hunter2@h:4222?lease=1s",
            "nats://hunter2@h:4222",
            "nats://h:4222?token=hunter2",
        ] {
            let config = NatsConfig::from_dsn(dsn).unwrap();
            let debug = format!("{config:?}");
            assert!(!debug.contains("hunter2"), "{debug}");
            assert!(debug.contains("***"), "{debug}");
            let (shown, _) = reason(&format!("{dsn}&colour=red").replacen("4222&", "4222?", 1));
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("***"), "{shown}");
        }
    }

    #[test]
    fn stream_subject_wildcards_are_matched_token_by_token() {
        assert!(subject_matches("envoi.q", "envoi.q"));
        assert!(subject_matches("envoi.*", "envoi.q"));
        assert!(subject_matches("envoi.>", "envoi.q.r"));
        assert!(subject_matches(">", "a"));
        assert!(!subject_matches("envoi.*", "envoi.q.r"));
        assert!(!subject_matches("envoi.q", "envoi.r"));
        assert!(!subject_matches("envoi.q.r", "envoi.q"));
    }
}
