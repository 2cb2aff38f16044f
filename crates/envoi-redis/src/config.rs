//! [`RedisConfig`]: what a `redis://` DSN configures.

use std::fmt;
use std::time::Duration;

use envoi_core::transport::mask_dsn;
use envoi_core::transport::support::{DsnQuery, DEFAULT_CONNECT_TIMEOUT};
use envoi_core::TransportError;

/// The configuration a [`RedisTransport`](crate::RedisTransport) runs with.
///
/// Usually parsed from a DSN with [`RedisConfig::from_dsn`]; the fields are
/// public so code can adjust them afterwards (and
/// [`RedisTransport::with_config`](crate::RedisTransport::with_config)
/// checks them again).
///
/// | option | default | meaning |
/// |---|---|---|
/// | `stream` | `envoi:<transport name>` | the stream key; the delay set is `<stream>:delayed`, delayed payloads `<stream>:delayed:<id>` |
/// | `group` | `envoi` | the consumer group every handle joins |
/// | `consumer` | `consumer` | prefix of the consumer name; each handle appends a random suffix |
/// | `lease` | `30s` | how long a handed-out message may stay unacknowledged before another consumer claims it (1 ms – 365 days) |
/// | `block` | `200ms` | how long `get` waits in `XREADGROUP ... BLOCK` when nothing is available (1 ms – 60 s) |
/// | `trim` | none | cap the stream at about this many entries (`XADD ... MAXLEN ~ n`) |
/// | `connect_timeout` | `5s` | how long opening a connection (and naming it) may take before the operation fails with [`TransportError::Unreachable`] |
///
/// ```
/// use std::time::Duration;
/// use envoi_redis::RedisConfig;
///
/// let config = RedisConfig::from_dsn(
///     "redis://127.0.0.1:6379/2?group=billing&lease=2s&trim=100000",
/// )
/// .unwrap();
/// assert_eq!(config.stream, None, "`envoi:<transport name>`");
/// assert_eq!(config.group, "billing");
/// assert_eq!(config.lease, Duration::from_secs(2));
/// assert_eq!(config.trim, Some(100_000));
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisConfig {
    /// The server to connect to, as the `redis` crate understands it
    /// (`redis://[user:password@]host[:port][/db]`, without the envoi
    /// options). Never shown unmasked by `Debug`.
    pub url: String,
    /// The stream key; `None` for the default, `envoi:<transport name>`.
    /// The delay set and delayed payloads live next to it under
    /// `<stream>:delayed`.
    pub stream: Option<String>,
    /// The consumer group every handle on this stream joins. Default: `envoi`.
    pub group: String,
    /// The prefix of this handle's consumer name; a random suffix makes every
    /// handle a distinct consumer in the group. Default: `consumer`.
    pub consumer: String,
    /// How long a message handed out by `get` stays leased without a
    /// `keepalive` before another consumer may claim it (the `XAUTOCLAIM`
    /// min-idle-time). Default: 30 s.
    pub lease: Duration,
    /// How long `get` blocks in `XREADGROUP ... BLOCK` when nothing is
    /// available. Default: 200 ms.
    pub block: Duration,
    /// Cap the stream at about this many entries (`XADD ... MAXLEN ~ n`).
    /// Entries beyond the cap are dropped by Redis even if no consumer has
    /// handled them, so leave it unset unless losing the oldest messages is
    /// acceptable. Default: none (acknowledged entries are trimmed anyway).
    pub trim: Option<usize>,
    /// How long opening a connection may take (the TCP connection, then
    /// naming it); an operation that cannot get one within it fails with
    /// [`TransportError::Unreachable`]. Default: 5 s
    /// ([`DEFAULT_CONNECT_TIMEOUT`]).
    pub connect_timeout: Duration,
}

/// Default lease.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Default blocking time of a read.
const DEFAULT_BLOCK: Duration = Duration::from_millis(200);
/// The longest blocking read accepted.
const MAX_BLOCK: Duration = Duration::from_secs(60);
/// The longest lease accepted: a year. Redis takes the lease in
/// milliseconds as a signed 64-bit number (`XAUTOCLAIM`'s min-idle-time);
/// a longer one would make every `get` fail.
const MAX_LEASE: Duration = Duration::from_secs(365 * 86_400);
/// The largest `trim` accepted: Redis takes `MAXLEN` as a signed 64-bit
/// number, and refuses every `XADD` with a larger one.
const MAX_TRIM: usize = i64::MAX as usize;

impl RedisConfig {
    /// A configuration with every default, on `url`.
    fn defaults(url: String) -> Self {
        Self {
            url,
            stream: None,
            group: "envoi".to_string(),
            consumer: "consumer".to_string(),
            lease: DEFAULT_LEASE,
            block: DEFAULT_BLOCK,
            trim: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
        }
    }

    /// Parses `redis://[user:password@]host[:port][/db][?option=value&...]`.
    ///
    /// Options: `stream`, `group`, `consumer` (names), `lease` (at most 365
    /// days), `block` (at most 60 s) and `connect_timeout` (longer than
    /// zero), durations such as `1500ms`, `2s`,
    /// `1.5s`, `5m` or `1h30m` (a bare number is seconds; see
    /// [`envoi_core::transport::parse_duration`]), and `trim` (an entry count
    /// from 1 to `i64::MAX`). The options follow the rules of
    /// [`DsnQuery`] (percent-decoded values; an option given twice or
    /// unknown is refused). An unknown option, a bad value or a scheme other
    /// than `redis` gives [`TransportError::InvalidDsn`] with the password
    /// masked.
    pub fn from_dsn(dsn: &str) -> Result<Self, TransportError> {
        let mut query = DsnQuery::parse(dsn)?;
        let mut config = Self::defaults(server_url(dsn, &query)?);
        config.stream = query.string("stream");
        if let Some(group) = query.string("group") {
            config.group = group;
        }
        if let Some(consumer) = query.string("consumer") {
            config.consumer = consumer;
        }
        if let Some(lease) = query.duration("lease")? {
            config.lease = lease;
        }
        if let Some(block) = query.duration("block")? {
            config.block = block;
        }
        config.trim = query.number::<usize>("trim")?;
        config.connect_timeout = query.connect_timeout()?;
        query.finish()?;
        config
            .validate()
            .map_err(|reason| TransportError::InvalidDsn {
                dsn: mask_dsn(dsn),
                reason,
            })?;
        Ok(config)
    }

    /// Checks what [`from_dsn`](Self::from_dsn) checks, for a configuration
    /// changed or built in code: names not empty, `lease`, `block` and
    /// `trim` in the ranges Redis can take, a `connect_timeout` longer than
    /// zero.
    pub(crate) fn validate(&self) -> Result<(), String> {
        for (option, value) in [
            ("stream", self.stream.as_deref()),
            ("group", Some(self.group.as_str())),
            ("consumer", Some(self.consumer.as_str())),
        ] {
            if value.is_some_and(str::is_empty) {
                return Err(format!("option `{option}` is empty"));
            }
        }
        if self.lease < Duration::from_millis(1) || self.lease > MAX_LEASE {
            return Err(format!(
                "`lease` must be between 1ms and 365 days, not {:?}",
                self.lease
            ));
        }
        if self.block < Duration::from_millis(1) || self.block > MAX_BLOCK {
            return Err(format!(
                "`block` must be between 1ms and 60s, not {:?}",
                self.block
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err("`connect_timeout` must be longer than zero".to_string());
        }
        if let Some(trim) = self.trim.filter(|n| *n == 0 || *n > MAX_TRIM) {
            return Err(format!(
                "`trim` must be an entry count from 1 to {MAX_TRIM}, not {trim}"
            ));
        }
        Ok(())
    }

    /// The stream key for the transport called `name`.
    pub(crate) fn stream_for(&self, name: &str) -> String {
        self.stream
            .clone()
            .unwrap_or_else(|| format!("envoi:{name}"))
    }

    /// The host and port of the server ([`url`](Self::url)), the port 6379
    /// when it names none; `None` for a URL that names no host.
    pub(crate) fn server(&self) -> Option<(String, u16)> {
        let url = url::Url::parse(&self.url).ok()?;
        let host = url.host_str().filter(|h| !h.is_empty())?;
        Some((host.to_string(), url.port().unwrap_or(6379)))
    }
}

/// The server part of `dsn` (scheme, user, host, port, database), checked,
/// without the query.
fn server_url(dsn: &str, query: &DsnQuery) -> Result<String, TransportError> {
    let invalid = |reason: String| query.invalid(reason);
    let parsed = url::Url::parse(dsn).map_err(|e| invalid(e.to_string()))?;
    if parsed.scheme() != "redis" {
        return Err(invalid(format!(
            "scheme `{}` is not supported; use `redis://`",
            parsed.scheme()
        )));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(invalid("the host is missing".to_string()));
    }
    let db = parsed.path().trim_matches('/');
    if !db.is_empty() && db.parse::<u32>().is_err() {
        return Err(invalid(format!(
            "the path must be a database number, not `{db}`"
        )));
    }
    if parsed.fragment().is_some() {
        return Err(invalid("a fragment (`#...`) is not supported".to_string()));
    }
    let mut server = parsed;
    server.set_query(None);
    Ok(server.to_string())
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &mask_dsn(&self.url))
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("lease", &self.lease)
            .field("block", &self.block)
            .field("trim", &self.trim)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(result: Result<RedisConfig, TransportError>) -> (String, String) {
        match result {
            Err(TransportError::InvalidDsn { dsn, reason }) => (dsn, reason),
            other => panic!("expected InvalidDsn, got {other:?}"),
        }
    }

    #[test]
    fn durations_take_fractions_and_compounds_like_every_other_transport() {
        let o = RedisConfig::from_dsn("redis://127.0.0.1:6379?lease=1.5s&block=1s500ms").unwrap();
        assert_eq!(o.lease, Duration::from_millis(1500));
        assert_eq!(o.block, Duration::from_millis(1500));
    }

    #[test]
    fn defaults_use_the_transport_name_for_the_stream() {
        let o = RedisConfig::from_dsn("redis://127.0.0.1:6379").unwrap();
        assert_eq!(o.stream, None);
        assert_eq!(o.stream_for("async"), "envoi:async");
        assert_eq!(o.group, "envoi");
        assert_eq!(o.consumer, "consumer");
        assert_eq!(o.lease, Duration::from_secs(30));
        assert_eq!(o.block, Duration::from_millis(200));
        assert_eq!(o.trim, None);
        assert_eq!(o.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(o.url, "redis://127.0.0.1:6379");
    }

    #[test]
    fn every_option_is_read_and_stripped_from_the_connection_url() {
        let o = RedisConfig::from_dsn(
            "redis://user:pw@localhost:6380/3?stream=s1&group=g1&consumer=c1&lease=1500ms&block=50ms&trim=10&connect_timeout=750ms",
        )
        .unwrap();
        assert_eq!(o.url, "redis://user:pw@localhost:6380/3");
        assert_eq!(o.stream.as_deref(), Some("s1"));
        assert_eq!(o.stream_for("x"), "s1");
        assert_eq!(o.group, "g1");
        assert_eq!(o.consumer, "c1");
        assert_eq!(o.lease, Duration::from_millis(1500));
        assert_eq!(o.block, Duration::from_millis(50));
        assert_eq!(o.trim, Some(10));
        assert_eq!(o.connect_timeout, Duration::from_millis(750));
    }

    #[test]
    fn percent_encoded_option_values_are_decoded() {
        let o = RedisConfig::from_dsn("redis://h?stream=app%3Aorders%20eu").unwrap();
        assert_eq!(o.stream.as_deref(), Some("app:orders eu"));
    }

    #[test]
    fn bad_dsns_are_invalid_with_the_password_masked() {
        let (dsn, why) = reason(RedisConfig::from_dsn(
            "redis://user:hunter2@h:6379?lease=forever",
        ));
        assert!(!dsn.contains("hunter2"), "password leaked: {dsn}");
        assert!(dsn.contains("user:***@"), "{dsn}");
        assert!(
            why.contains("`lease`") && why.contains("`forever`"),
            "{why}"
        );

        let (_, why) = reason(RedisConfig::from_dsn("amqp://h"));
        assert!(why.contains("scheme `amqp`"), "{why}");
        let (_, why) = reason(RedisConfig::from_dsn("redis://h/notadb"));
        assert!(why.contains("database number"), "{why}");
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?lease=0"));
        assert!(
            why.contains("`lease` must be between 1ms and 365 days"),
            "{why}"
        );
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?block=0ms"));
        assert!(why.contains("`block` must be between 1ms and 60s"), "{why}");
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?block=2m"));
        assert!(
            why.contains("`block` must be between 1ms and 60s, not 120s"),
            "{why}"
        );
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?connect_timeout=0s"));
        assert!(why.contains("`connect_timeout`"), "{why}");
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?trim=0"));
        assert!(why.contains("`trim` must be an entry count"), "{why}");
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?strem=s"));
        assert!(
            why.contains(
                "unknown option `strem` (known: stream, group, consumer, lease, block, trim, connect_timeout)"
            ),
            "{why}"
        );
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?stream="));
        assert!(why.contains("option `stream` is empty"), "{why}");
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?group=a&group=b"));
        assert!(why.contains("twice"), "{why}");
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?group="));
        assert!(why.contains("empty"), "{why}");
        let (_, why) = reason(RedisConfig::from_dsn("not a dsn"));
        assert!(!why.is_empty());
    }

    #[test]
    fn a_lease_or_trim_redis_cannot_take_is_refused() {
        // Redis takes XAUTOCLAIM's min-idle-time and XADD's MAXLEN as
        // signed 64-bit numbers: beyond them every get or send would fail.
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?lease=1900000000000000000"));
        assert!(
            why.contains("`lease` must be between 1ms and 365 days, not 1900000000000000000s"),
            "{why}"
        );
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?lease=8761h"));
        assert!(
            why.contains("`lease` must be between 1ms and 365 days"),
            "{why}"
        );
        let (_, why) = reason(RedisConfig::from_dsn("redis://h?trim=9223372036854775808"));
        assert!(
            why.contains("`trim` must be an entry count from 1 to 9223372036854775807, not 9223372036854775808"),
            "{why}"
        );
        let o = RedisConfig::from_dsn("redis://h?lease=8760h&trim=9223372036854775807").unwrap();
        assert_eq!(o.lease, Duration::from_secs(365 * 86_400));
        assert_eq!(o.trim, Some(9_223_372_036_854_775_807));
    }

    #[test]
    fn debug_masks_the_password() {
        let o = RedisConfig::from_dsn("redis://u:topsecret@h:1").unwrap();
        let shown = format!("{o:?}");
        assert!(!shown.contains("topsecret"), "{shown}");
    }
}
