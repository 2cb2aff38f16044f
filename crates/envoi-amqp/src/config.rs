//! The transport's configuration and its DSN form.
//!
//! ```text
//! amqp://user:pass@host:port/vhost?exchange=orders&queue=orders&prefetch=100&queue_type=quorum
//! ```
//!
//! The scheme is `amqp` or `amqps` (TLS). The path is the virtual host,
//! percent-encoded (`%2f` is `/`). Query options, all optional:
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `exchange` | the transport name | durable direct exchange messages are published to (empty: the default exchange) |
//! | `queue` | the transport name | durable queue messages are consumed from; bound to the exchange with its own name as routing key |
//! | `queue_type` | `quorum` | `quorum` or `classic` |
//! | `prefetch` | `100` | `basic.qos` prefetch count of the consumer channel (1–65535) |
//! | `delivery_limit` | `100` | quorum only: `x-delivery-limit`; a message returned more often is moved to `<queue>.dead` |
//! | `lease` | `5m` | how long a handed-out message may stay unsettled before it is given back; `0` or `off` disables the timer |
//! | `consumer_idle` | `5s`, at most half the lease | the consumer is cancelled (and its prefetched messages given back) when `get` was not called for this long |
//! | `connect_timeout` | `5s` | how long [`AmqpTransport::connect`](crate::AmqpTransport::connect) tries to reach the broker before it fails with [`TransportError::Unreachable`] |
//! | `reconnect_timeout` | `30s` | how long an operation keeps reconnecting, after a connection was lost, before it fails |
//! | `auto_setup` | `true` | declare the exchange, queues and binding on (re)connect (a boolean) |
//! | `expires` | none | `x-expires` on the queues: they are deleted after being unused this long (temporary queues, tests) |
//! | `connection_name` | `envoi-<transport>` | the connection name shown by the management tools |
//! | `heartbeat`, `frame_max`, `channel_max`, `connection_timeout`, `auth_mechanism` | server's | passed to the AMQP client |
//!
//! Options are read as on every envoi transport ([`DsnQuery`]): values are
//! percent-decoded, a boolean is `true`/`false`, `1`/`0`, `yes`/`no` or
//! `on`/`off`, and an unknown option, or one given twice, is an error.
//!
//! Durations are read by [`envoi_core::transport::parse_duration`], as on
//! every transport: numbers with a unit (`ms`, `s`, `m`, `h`, `d`), such as
//! `1500ms`, `2s`, `5m` or `1h30m`, or a bare number of seconds (`2`, `1.5`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use envoi_core::transport::support::{DsnQuery, DEFAULT_CONNECT_TIMEOUT};
use envoi_core::transport::{dsn_has_scheme, mask_dsn};
use envoi_core::TransportError;
use lapin::uri::AMQPUri;

/// Longest queue name accepted: RabbitMQ names are at most 255 bytes and the
/// transport derives `<queue>.delay.<ms>` names from it.
pub const MAX_QUEUE_NAME: usize = 200;

/// The kind of queue the transport declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// A replicated Raft-based queue: the durable choice. Gets an explicit
    /// `x-delivery-limit` and a dead-letter queue.
    #[default]
    Quorum,
    /// A classic queue.
    Classic,
}

impl QueueType {
    /// The value of the `x-queue-type` argument.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

impl fmt::Display for QueueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Settings of an [`AmqpTransport`](crate::AmqpTransport), usually parsed
/// from a DSN with [`AmqpConfig::from_dsn`]; see the [module docs](self) for
/// each option.
#[derive(Clone)]
#[non_exhaustive]
pub struct AmqpConfig {
    /// The exchange; `None` means the transport name. `Some("")` publishes
    /// through the default exchange.
    pub exchange: Option<String>,
    /// The queue; `None` means the transport name.
    pub queue: Option<String>,
    /// The queue type.
    pub queue_type: QueueType,
    /// The consumer channel's prefetch count.
    pub prefetch: u16,
    /// Quorum queues' `x-delivery-limit`.
    pub delivery_limit: u32,
    /// Lease of a handed-out message; `None` disables the lease timer.
    pub lease: Option<Duration>,
    /// How long without a `get` before the consumer is cancelled.
    pub consumer_idle: Duration,
    /// How long an operation keeps reconnecting before failing.
    pub reconnect_timeout: Duration,
    /// How long the first connection may take, attempts after a refusal
    /// included.
    pub connect_timeout: Duration,
    /// Declare the topology on every (re)connect.
    pub auto_setup: bool,
    /// `x-expires` of the queues, if any.
    pub expires: Option<Duration>,
    /// The connection name reported to the broker; `None` means
    /// `envoi-<transport name>`.
    pub connection_name: Option<String>,
    uri: AMQPUri,
    masked: String,
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("dsn", &self.masked)
            .field("exchange", &self.exchange)
            .field("queue", &self.queue)
            .field("queue_type", &self.queue_type)
            .field("prefetch", &self.prefetch)
            .field("delivery_limit", &self.delivery_limit)
            .field("lease", &self.lease)
            .field("consumer_idle", &self.consumer_idle)
            .field("reconnect_timeout", &self.reconnect_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("auto_setup", &self.auto_setup)
            .field("expires", &self.expires)
            .field("connection_name", &self.connection_name)
            .finish()
    }
}

/// Options the AMQP client itself reads from the query string, with the
/// largest value each takes (`None`: not a number).
const CLIENT_OPTIONS: &[(&str, Option<u64>)] = &[
    ("heartbeat", Some(u16::MAX as u64)),
    ("frame_max", Some(u32::MAX as u64)),
    ("channel_max", Some(u16::MAX as u64)),
    ("connection_timeout", Some(u64::MAX)),
    ("auth_mechanism", None),
];

/// Takes the options the AMQP client reads itself (it parses them from the
/// URI) and checks the numeric ones, whose own errors (`invalid digit found
/// in string`) do not name the option.
fn check_client_options(q: &mut DsnQuery) -> Result<(), TransportError> {
    for &(key, max) in CLIENT_OPTIONS {
        let (Some(value), Some(max)) = (q.string(key), max) else {
            continue;
        };
        if !value.parse::<u64>().is_ok_and(|n| n <= max) {
            return Err(q.invalid(format!(
                "option `{key}`: `{value}` is not a whole number from 0 to {max}"
            )));
        }
    }
    Ok(())
}

/// Takes option `key` as a number `T` that `fits`; `what` says what it must
/// be when it is not one.
fn ranged<T: FromStr>(
    q: &mut DsnQuery,
    key: &'static str,
    what: &str,
    fits: impl Fn(&T) -> bool,
) -> Result<Option<T>, TransportError> {
    let Some(value) = q.string(key) else {
        return Ok(None);
    };
    match value.parse::<T>().ok().filter(|n| fits(n)) {
        Some(n) => Ok(Some(n)),
        None => Err(q.invalid(format!("option `{key}`: `{value}` is not {what}"))),
    }
}

/// Takes option `key` as a duration (see
/// [`envoi_core::transport::parse_duration`]) that `fits` and is under
/// [`MAX_DURATION_SECS`]; `what` says what it must be when it is not one.
fn duration(
    q: &mut DsnQuery,
    key: &'static str,
    what: &str,
    fits: impl Fn(&Duration) -> bool,
) -> Result<Option<Duration>, TransportError> {
    let Some(value) = q.string(key) else {
        return Ok(None);
    };
    match parse_duration(&value).filter(|d| fits(d)) {
        Some(d) => Ok(Some(d)),
        None => Err(q.invalid(format!("option `{key}`: `{value}` is not {what}"))),
    }
}

/// Takes option `key` as the name of an exchange or queue.
fn name(q: &mut DsnQuery, key: &'static str) -> Result<Option<String>, TransportError> {
    match q.string(key) {
        Some(value) => check_name(key, &value).map(Some).map_err(|r| q.invalid(r)),
        None => Ok(None),
    }
}

impl AmqpConfig {
    /// Parses `dsn`. Fails with [`TransportError::InvalidDsn`] (password
    /// masked) for a wrong scheme, a malformed URI, an unknown option, an
    /// option given twice or a bad value.
    ///
    /// ```
    /// use envoi_amqp::{AmqpConfig, QueueType};
    /// use std::time::Duration;
    ///
    /// let c = AmqpConfig::from_dsn(
    ///     "amqp://guest:guest@127.0.0.1:5672/%2f?queue=jobs&queue_type=classic&lease=2s",
    /// )
    /// .unwrap();
    /// assert_eq!(c.queue.as_deref(), Some("jobs"));
    /// assert_eq!(c.queue_type, QueueType::Classic);
    /// assert_eq!(c.lease, Some(Duration::from_secs(2)));
    /// assert!(AmqpConfig::from_dsn("amqp://h/%2f?prefetch=lots").is_err());
    /// ```
    pub fn from_dsn(dsn: &str) -> Result<Self, TransportError> {
        let masked = mask_dsn(dsn);
        if !(dsn_has_scheme(dsn, "amqp://") || dsn_has_scheme(dsn, "amqps://")) {
            return Err(TransportError::InvalidDsn {
                dsn: masked,
                reason: "the scheme must be `amqp` or `amqps`".into(),
            });
        }
        let mut q = DsnQuery::parse(dsn)?;
        check_client_options(&mut q)?;
        let uri = AMQPUri::from_str(dsn).map_err(|e| q.invalid(mask_reason(&e, dsn)))?;
        let mut config = AmqpConfig {
            exchange: None,
            queue: None,
            queue_type: QueueType::Quorum,
            prefetch: 100,
            delivery_limit: 100,
            lease: Some(Duration::from_secs(300)),
            consumer_idle: Duration::from_secs(5),
            reconnect_timeout: Duration::from_secs(30),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            auto_setup: true,
            expires: None,
            connection_name: None,
            uri,
            masked,
        };
        config.read_options(&mut q)?;
        q.finish()?;
        Ok(config)
    }

    /// Sets the fields the query options of `q` give.
    fn read_options(&mut self, q: &mut DsnQuery) -> Result<(), TransportError> {
        self.exchange = name(q, "exchange")?;
        self.queue = name(q, "queue")?;
        if self.queue.as_deref() == Some("") {
            return Err(q.invalid("option `queue` must not be empty".into()));
        }
        if let Some(kind) = q.string("queue_type") {
            self.queue_type = match kind.as_str() {
                "quorum" => QueueType::Quorum,
                "classic" => QueueType::Classic,
                _ => {
                    return Err(q.invalid(format!(
                        "option `queue_type`: `{kind}` is not `quorum` or `classic`"
                    )))
                }
            };
        }
        let positive = |n: &u32| *n > 0;
        if let Some(n) = ranged(q, "prefetch", "a count from 1 to 65535", |n: &u16| *n > 0)? {
            self.prefetch = n;
        }
        if let Some(n) = ranged(q, "delivery_limit", "a positive count", positive)? {
            self.delivery_limit = n;
        }
        match q.string("lease") {
            Some(off) if off == "off" => self.lease = None,
            Some(value) => match parse_duration(&value) {
                Some(d) => self.lease = Some(d).filter(|d| !d.is_zero()),
                None => {
                    return Err(q.invalid(format!("option `lease`: `{value}` is not a duration")))
                }
            },
            None => {}
        }
        let idle = duration(q, "consumer_idle", "a positive duration", |d| !d.is_zero())?;
        if let Some(d) = duration(q, "reconnect_timeout", "a duration", |_| true)? {
            self.reconnect_timeout = d;
        }
        self.connect_timeout = q.connect_timeout()?;
        if self.connect_timeout.as_secs_f64() >= MAX_DURATION_SECS {
            return Err(q.invalid(format!(
                "option `connect_timeout` must be under {MAX_DURATION_SECS} seconds"
            )));
        }
        if let Some(auto_setup) = q.bool("auto_setup")? {
            self.auto_setup = auto_setup;
        }
        self.expires = duration(q, "expires", "a positive duration under 49 days", |d| {
            !d.is_zero() && d.as_millis() <= u128::from(u32::MAX)
        })?;
        self.connection_name = q.string("connection_name");
        self.consumer_idle = match (idle, self.lease) {
            (Some(idle), _) => idle,
            (None, Some(lease)) => self
                .consumer_idle
                .min(lease / 2)
                .max(Duration::from_millis(10)),
            (None, None) => self.consumer_idle,
        };
        Ok(())
    }

    /// Checks what [`from_dsn`](Self::from_dsn) checks of the public fields,
    /// for a configuration changed in code: names, a positive `prefetch`,
    /// `delivery_limit`, `consumer_idle` and `connect_timeout`, a `lease`,
    /// `reconnect_timeout` and `connect_timeout` under 10⁹ seconds (a
    /// longer one would overflow a clock), and `expires` under 49 days.
    pub(crate) fn validate(&self) -> Result<(), String> {
        for (key, name) in [("exchange", &self.exchange), ("queue", &self.queue)] {
            if let Some(name) = name {
                check_name(key, name)?;
            }
        }
        if self.queue.as_deref() == Some("") {
            return Err("option `queue` must not be empty".into());
        }
        if self.prefetch == 0 {
            return Err("option `prefetch` must be from 1 to 65535, not 0".into());
        }
        if self.delivery_limit == 0 {
            return Err("option `delivery_limit` must be a positive count, not 0".into());
        }
        if self.consumer_idle.is_zero() {
            return Err("option `consumer_idle` must be a positive duration, not 0".into());
        }
        if self.connect_timeout.is_zero() {
            return Err("option `connect_timeout` must be a positive duration, not 0".into());
        }
        for (key, value) in [
            ("lease", self.lease),
            ("reconnect_timeout", Some(self.reconnect_timeout)),
            ("connect_timeout", Some(self.connect_timeout)),
        ] {
            if value.is_some_and(|d| d.as_secs_f64() >= MAX_DURATION_SECS) {
                return Err(format!(
                    "option `{key}` must be under {MAX_DURATION_SECS} seconds, not {value:?}"
                ));
            }
        }
        if let Some(expires) = self.expires {
            if expires.is_zero() || expires.as_millis() > u128::from(u32::MAX) {
                return Err(format!(
                    "option `expires` must be a positive duration under 49 days, not {expires:?}"
                ));
            }
        }
        Ok(())
    }

    /// The DSN with its password masked.
    pub fn masked_dsn(&self) -> &str {
        &self.masked
    }

    pub(crate) fn uri(&self) -> &AMQPUri {
        &self.uri
    }
}

fn mask_reason(reason: &str, dsn: &str) -> String {
    // The URI parser may quote its input; never echo a password.
    let masked = mask_dsn(dsn);
    reason.replace(dsn, &masked)
}

fn check_name(key: &str, value: &str) -> Result<String, String> {
    if value.len() > MAX_QUEUE_NAME {
        return Err(format!(
            "option `{key}` is {} bytes long; at most {MAX_QUEUE_NAME} are allowed",
            value.len()
        ));
    }
    if value.starts_with("amq.") {
        return Err(format!(
            "option `{key}`: names starting with `amq.` are reserved by the broker"
        ));
    }
    Ok(value.to_string())
}

/// Parses a duration with [`envoi_core::transport::parse_duration`],
/// refusing one of [`MAX_DURATION_SECS`] or more.
pub(crate) fn parse_duration(s: &str) -> Option<Duration> {
    envoi_core::transport::parse_duration(s).filter(|d| d.as_secs_f64() < MAX_DURATION_SECS)
}

/// Durations are shorter than this many seconds (about 31 years): adding
/// one to a clock cannot overflow.
const MAX_DURATION_SECS: f64 = 1.0e9;

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(dsn: &str) -> String {
        match AmqpConfig::from_dsn(dsn) {
            Err(TransportError::InvalidDsn { dsn, reason }) => {
                assert!(!dsn.contains("s3cret"), "password leaked in `{dsn}`");
                assert!(!reason.contains("s3cret"), "password leaked in `{reason}`");
                reason
            }
            other => panic!("expected InvalidDsn for `{dsn}`, got {other:?}"),
        }
    }

    #[test]
    fn defaults_apply_when_the_query_is_empty() {
        let c = AmqpConfig::from_dsn("amqp://guest:guest@127.0.0.1:5672/%2f").unwrap();
        assert_eq!(c.exchange, None);
        assert_eq!(c.queue, None);
        assert_eq!(c.queue_type, QueueType::Quorum);
        assert_eq!(c.prefetch, 100);
        assert_eq!(c.delivery_limit, 100);
        assert_eq!(c.lease, Some(Duration::from_secs(300)));
        assert_eq!(c.consumer_idle, Duration::from_secs(5));
        assert_eq!(c.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert!(c.auto_setup);
        assert_eq!(c.expires, None);
        assert_eq!(c.uri().vhost, "/");
    }

    #[test]
    fn every_option_is_parsed() {
        let c = AmqpConfig::from_dsn(
            "amqps://u:p@h:5671/v?exchange=ex&queue=q%2Ea&queue_type=classic&prefetch=7\
             &delivery_limit=9&lease=1500ms&consumer_idle=200ms&reconnect_timeout=3\
             &auto_setup=false&expires=1m&connection_name=n+1&heartbeat=10&connect_timeout=750ms",
        )
        .unwrap();
        assert_eq!(c.exchange.as_deref(), Some("ex"));
        assert_eq!(c.queue.as_deref(), Some("q.a"));
        assert_eq!(c.queue_type, QueueType::Classic);
        assert_eq!(c.prefetch, 7);
        assert_eq!(c.delivery_limit, 9);
        assert_eq!(c.lease, Some(Duration::from_millis(1500)));
        assert_eq!(c.consumer_idle, Duration::from_millis(200));
        assert_eq!(c.reconnect_timeout, Duration::from_secs(3));
        assert_eq!(c.connect_timeout, Duration::from_millis(750));
        assert!(!c.auto_setup);
        assert_eq!(c.expires, Some(Duration::from_secs(60)));
        assert_eq!(c.connection_name.as_deref(), Some("n 1"));
        assert_eq!(c.uri().query.heartbeat, Some(10));
        assert_eq!(c.uri().vhost, "v");
    }

    #[test]
    fn consumer_idle_defaults_to_at_most_half_the_lease() {
        let c = AmqpConfig::from_dsn("amqp://h/%2f?lease=2s").unwrap();
        assert_eq!(c.consumer_idle, Duration::from_secs(1));
        let c = AmqpConfig::from_dsn("amqp://h/%2f?lease=off").unwrap();
        assert_eq!(c.lease, None);
        assert_eq!(c.consumer_idle, Duration::from_secs(5));
        let c = AmqpConfig::from_dsn("amqp://h/%2f?lease=0").unwrap();
        assert_eq!(c.lease, None);
    }

    #[test]
    fn bad_dsns_are_rejected_with_the_password_masked() {
        assert!(reason("redis://u:s3cret@h/").contains("scheme"));
        assert!(reason("amqp://u:s3cret@h/%2f?prefetch=0").contains("prefetch"));
        assert!(reason("amqp://u:s3cret@h/%2f?prefetch=70000").contains("prefetch"));
        assert!(reason("amqp://u:s3cret@h/%2f?queue_type=stream").contains("queue_type"));
        assert!(reason("amqp://u:s3cret@h/%2f?lease=soon").contains("lease"));
        assert!(reason("amqp://u:s3cret@h/%2f?connect_timeout=0s").contains("connect_timeout"));
        assert!(reason("amqp://u:s3cret@h/%2f?connect_timeout=soon").contains("connect_timeout"));
        assert!(
            reason("amqp://u:s3cret@h/%2f?connect_timeout=2000000000").contains("connect_timeout")
        );
        assert!(reason("amqp://u:s3cret@h/%2f?colour=blue").contains("unknown option `colour`"));
        assert!(reason("amqp://u:s3cret@h/%2f?queue=").contains("queue"));
        assert!(reason("amqp://u:s3cret@h/%2f?queue=amq.x").contains("reserved"));
        assert!(reason("amqp://u:s3cret@h/%2f?queue=%ZZ").contains("percent"));
        let long = "q".repeat(MAX_QUEUE_NAME + 1);
        assert!(reason(&format!("amqp://u:s3cret@h/%2f?queue={long}")).contains("bytes"));
        reason("amqp://u:s3cret@h:notaport/%2f");
        assert!(reason("amqp://u:s3cret@h/%2f?heartbeat=often")
            .contains("option `heartbeat`: `often` is not a whole number"));
        assert!(reason("amqp://u:s3cret@h/%2f?connection_timeout=abc")
            .contains("option `connection_timeout`"));
        assert!(reason("amqp://u:s3cret@h/%2f?frame_max=-1").contains("option `frame_max`"));
    }

    #[test]
    fn an_option_given_twice_is_rejected_rather_than_the_last_one_winning() {
        assert!(reason("amqp://u:s3cret@h/%2f?prefetch=5&prefetch=7")
            .contains("option `prefetch` is given twice"));
        assert!(reason("amqp://u:s3cret@h/%2f?heartbeat=5&heartbeat=60")
            .contains("option `heartbeat` is given twice"));
    }

    #[test]
    fn booleans_take_the_one_rule_of_every_transport() {
        for (value, expected) in [
            ("true", true),
            ("1", true),
            ("yes", true),
            ("ON", true),
            ("false", false),
            ("0", false),
            ("no", false),
            ("off", false),
        ] {
            let c = AmqpConfig::from_dsn(&format!("amqp://h/%2f?auto_setup={value}")).unwrap();
            assert_eq!(c.auto_setup, expected, "auto_setup={value}");
        }
        assert!(reason("amqp://u:s3cret@h/%2f?auto_setup=maybe").contains("`auto_setup`"));
    }

    #[test]
    fn the_scheme_is_read_in_any_case_as_the_factory_does() {
        let c = AmqpConfig::from_dsn("AMQP://guest:guest@127.0.0.1:5672/%2f?prefetch=3").unwrap();
        assert_eq!(c.prefetch, 3);
        assert_eq!(c.uri().vhost, "/");
    }

    #[test]
    fn an_unknown_option_is_named_with_the_known_ones() {
        let why = reason("amqp://u:s3cret@h/%2f?prefech=5");
        assert!(why.contains("unknown option `prefech`"), "{why}");
        for known in ["prefetch", "queue_type", "lease", "heartbeat"] {
            assert!(why.contains(known), "{known} missing from: {why}");
        }
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("1500ms"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("5m"), Some(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("-1s"), None);
        assert_eq!(parse_duration("1d"), Some(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("1000000000"), None);
        assert_eq!(parse_duration(""), None);
    }
}
