//! [`RedisOptions`]: what a `redis://` DSN configures.

use std::fmt;
use std::time::Duration;

use envoi_core::transport::{mask_dsn, parse_duration};
use envoi_core::TransportError;

/// The options a [`RedisTransport`](crate::RedisTransport) runs with.
///
/// Usually parsed from a DSN with [`RedisOptions::from_dsn`]; the fields are
/// public so code can adjust them afterwards.
///
/// ```
/// use std::time::Duration;
/// use envoi_redis::RedisOptions;
///
/// let options = RedisOptions::from_dsn(
///     "orders",
///     "redis://127.0.0.1:6379/2?group=billing&lease=2s&trim=100000",
/// )
/// .unwrap();
/// assert_eq!(options.stream, "envoi:orders");
/// assert_eq!(options.group, "billing");
/// assert_eq!(options.lease, Duration::from_secs(2));
/// assert_eq!(options.trim, Some(100_000));
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisOptions {
    /// The server to connect to, as the `redis` crate understands it
    /// (`redis://[user:password@]host[:port][/db]`, without the envoi
    /// options). Never shown unmasked by `Debug`.
    pub url: String,
    /// The stream key. Default: `envoi:<transport name>`. The delay set and
    /// delayed payloads live next to it under `<stream>:delayed`.
    pub stream: String,
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

impl RedisOptions {
    /// Options for the transport called `name` with every default, on `url`.
    fn defaults(name: &str, url: String) -> Self {
        Self {
            url,
            stream: format!("envoi:{name}"),
            group: "envoi".to_string(),
            consumer: "consumer".to_string(),
            lease: DEFAULT_LEASE,
            block: DEFAULT_BLOCK,
            trim: None,
        }
    }

    /// Parses `redis://[user:password@]host[:port][/db][?option=value&...]`
    /// for the transport called `name`.
    ///
    /// Options: `stream`, `group`, `consumer` (names), `lease` (at most 365
    /// days) and `block` (at most 60 s), durations such as `1500ms`, `2s`,
    /// `1.5s`, `5m` or `1h30m` (a bare number is seconds; see
    /// [`envoi_core::transport::parse_duration`]), and `trim` (an entry count from 1 to
    /// `i64::MAX`). An unknown option, a bad value or a
    /// scheme other than `redis` gives [`TransportError::InvalidDsn`] with
    /// the password masked.
    pub fn from_dsn(name: &str, dsn: &str) -> Result<Self, TransportError> {
        let invalid = |reason: String| TransportError::InvalidDsn {
            dsn: mask_dsn(dsn),
            reason,
        };
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
        let mut connection = parsed.clone();
        connection.set_query(None);
        let mut options = Self::defaults(name, connection.to_string());

        let mut seen: Vec<String> = Vec::new();
        for (key, value) in parsed.query_pairs() {
            if seen.iter().any(|k| *k == key) {
                return Err(invalid(format!("option `{key}` is given twice")));
            }
            seen.push(key.to_string());
            let value = value.into_owned();
            match key.as_ref() {
                "stream" => options.stream = non_empty("stream", value).map_err(invalid)?,
                "group" => options.group = non_empty("group", value).map_err(invalid)?,
                "consumer" => options.consumer = non_empty("consumer", value).map_err(invalid)?,
                "lease" => {
                    options.lease = parse_duration(&value)
                        .filter(|d| *d >= Duration::from_millis(1) && *d <= MAX_LEASE)
                        .ok_or_else(|| {
                            invalid(format!(
                                "`lease={value}` is not a duration between 1ms and 365 days \
                                 such as `30s` or `1500ms`"
                            ))
                        })?;
                }
                "block" => {
                    options.block = parse_duration(&value)
                        .filter(|d| *d >= Duration::from_millis(1) && *d <= MAX_BLOCK)
                        .ok_or_else(|| {
                            invalid(format!(
                                "`block={value}` is not a duration between 1ms and 60s"
                            ))
                        })?;
                }
                "trim" => {
                    options.trim = Some(
                        value
                            .parse::<usize>()
                            .ok()
                            .filter(|n| *n > 0 && *n <= MAX_TRIM)
                            .ok_or_else(|| {
                                invalid(format!(
                                    "`trim={value}` is not an entry count from 1 to {MAX_TRIM}"
                                ))
                            })?,
                    );
                }
                other => {
                    return Err(invalid(format!(
                    "unknown option `{other}` (known: stream, group, consumer, lease, block, trim)"
                )))
                }
            }
        }
        options.validate().map_err(invalid)?;
        Ok(options)
    }

    /// Checks what [`from_dsn`](Self::from_dsn) checks, for options changed
    /// or built in code: names not empty, `lease`, `block` and `trim` in
    /// the ranges Redis can take.
    pub(crate) fn validate(&self) -> Result<(), String> {
        for (option, value) in [
            ("stream", &self.stream),
            ("group", &self.group),
            ("consumer", &self.consumer),
        ] {
            if value.is_empty() {
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
        if let Some(trim) = self.trim.filter(|n| *n == 0 || *n > MAX_TRIM) {
            return Err(format!(
                "`trim` must be an entry count from 1 to {MAX_TRIM}, not {trim}"
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &mask_dsn(&self.url))
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("lease", &self.lease)
            .field("block", &self.block)
            .field("trim", &self.trim)
            .finish()
    }
}

fn non_empty(option: &str, value: String) -> Result<String, String> {
    if value.is_empty() {
        Err(format!("option `{option}` is empty"))
    } else {
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(result: Result<RedisOptions, TransportError>) -> (String, String) {
        match result {
            Err(TransportError::InvalidDsn { dsn, reason }) => (dsn, reason),
            other => panic!("expected InvalidDsn, got {other:?}"),
        }
    }

    #[test]
    fn durations_take_fractions_and_compounds_like_every_other_transport() {
        let o =
            RedisOptions::from_dsn("x", "redis://127.0.0.1:6379?lease=1.5s&block=1s500ms").unwrap();
        assert_eq!(o.lease, Duration::from_millis(1500));
        assert_eq!(o.block, Duration::from_millis(1500));
    }

    #[test]
    fn defaults_use_the_transport_name_for_the_stream() {
        let o = RedisOptions::from_dsn("async", "redis://127.0.0.1:6379").unwrap();
        assert_eq!(o.stream, "envoi:async");
        assert_eq!(o.group, "envoi");
        assert_eq!(o.consumer, "consumer");
        assert_eq!(o.lease, Duration::from_secs(30));
        assert_eq!(o.block, Duration::from_millis(200));
        assert_eq!(o.trim, None);
        assert_eq!(o.url, "redis://127.0.0.1:6379");
    }

    #[test]
    fn every_option_is_read_and_stripped_from_the_connection_url() {
        let o = RedisOptions::from_dsn(
            "x",
            "redis://user:pw@localhost:6380/3?stream=s1&group=g1&consumer=c1&lease=1500ms&block=50ms&trim=10",
        )
        .unwrap();
        assert_eq!(o.url, "redis://user:pw@localhost:6380/3");
        assert_eq!(o.stream, "s1");
        assert_eq!(o.group, "g1");
        assert_eq!(o.consumer, "c1");
        assert_eq!(o.lease, Duration::from_millis(1500));
        assert_eq!(o.block, Duration::from_millis(50));
        assert_eq!(o.trim, Some(10));
    }

    #[test]
    fn percent_encoded_option_values_are_decoded() {
        let o = RedisOptions::from_dsn("x", "redis://h?stream=app%3Aorders%20eu").unwrap();
        assert_eq!(o.stream, "app:orders eu");
    }

    #[test]
    fn bad_dsns_are_invalid_with_the_password_masked() {
        let (dsn, why) = reason(RedisOptions::from_dsn(
            "x",
            "redis://user:hunter2@h:6379?lease=forever",
        ));
        assert!(!dsn.contains("hunter2"), "password leaked: {dsn}");
        assert!(dsn.contains("user:***@"), "{dsn}");
        assert!(why.contains("lease=forever"), "{why}");

        let (_, why) = reason(RedisOptions::from_dsn("x", "amqp://h"));
        assert!(why.contains("scheme `amqp`"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn("x", "redis://h/notadb"));
        assert!(why.contains("database number"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn("x", "redis://h?lease=0"));
        assert!(why.contains("lease=0"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn("x", "redis://h?block=0ms"));
        assert!(why.contains("block=0ms"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn("x", "redis://h?block=2m"));
        assert!(why.contains("block=2m"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn("x", "redis://h?trim=0"));
        assert!(why.contains("trim=0"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn("x", "redis://h?strem=s"));
        assert!(why.contains("unknown option `strem`"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn("x", "redis://h?group=a&group=b"));
        assert!(why.contains("twice"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn("x", "redis://h?group="));
        assert!(why.contains("empty"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn("x", "not a dsn"));
        assert!(!why.is_empty());
    }

    #[test]
    fn a_lease_or_trim_redis_cannot_take_is_refused() {
        // Redis takes XAUTOCLAIM's min-idle-time and XADD's MAXLEN as
        // signed 64-bit numbers: beyond them every get or send would fail.
        let (_, why) = reason(RedisOptions::from_dsn(
            "x",
            "redis://h?lease=1900000000000000000",
        ));
        assert!(why.contains("lease=1900000000000000000"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn("x", "redis://h?lease=8761h"));
        assert!(why.contains("lease=8761h"), "{why}");
        let (_, why) = reason(RedisOptions::from_dsn(
            "x",
            "redis://h?trim=9223372036854775808",
        ));
        assert!(why.contains("trim=9223372036854775808"), "{why}");
        let o =
            RedisOptions::from_dsn("x", "redis://h?lease=8760h&trim=9223372036854775807").unwrap();
        assert_eq!(o.lease, Duration::from_secs(365 * 86_400));
        assert_eq!(o.trim, Some(9_223_372_036_854_775_807));
    }

    #[test]
    fn debug_masks_the_password() {
        let o = RedisOptions::from_dsn("x", "redis://u:topsecret@h:1").unwrap();
        let shown = format!("{o:?}");
        assert!(!shown.contains("topsecret"), "{shown}");
    }
}
