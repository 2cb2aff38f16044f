//! Transport traits: how messages leave a process and come back.
//!
//! A [`Transport`] stores and hands out [`RawMessage`]s (a body and string
//! headers); the [`Serializer`] turns
//! envelopes into raw messages and back. Keeping transports byte-level means a
//! message that cannot be decoded (unknown type, malformed body) is still a
//! [`Delivery`] the worker can move to the failure transport with the reason,
//! instead of an error that loses it.
//!
//! A [`Sender`] is the envelope-level view the send step uses; [`SenderDispatcher`]
//! decides how a send happens (now, or after a database transaction commits).
//!
//! Register transports with
//! the messenger's builder (`MessengerBuilder::transport`, or by DSN with
//! `transport_dsn` and a [`TransportFactory`]); the messenger then sends to
//! them through
//! [`TransportSender`](crate::transport::registry::TransportSender)s, hands
//! them out by name and calls [`Transport::bind`] on each. A worker
//! consumes them.
//!
//! Transports that live in the process (in-memory, sync) also implement
//! [`LocalTransport`], which moves envelopes without encoding them; every
//! other transport only needs [`Transport`], whose optional methods have
//! defaults.

pub mod in_memory;
pub mod registry;
pub mod serializer;
pub mod sync;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::envelope::headers::Headers;
use crate::envelope::Envelope;
use crate::error::{BusError, Result, TransportError};
use crate::transport::serializer::Serializer;
use crate::BoxFuture;

/// A message as a transport stores it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawMessage {
    /// The encoded message.
    pub body: Vec<u8>,
    /// `type`, `kind` and one `X-Message-Stamp-<name>` header per stamp type.
    pub headers: Headers,
}

impl RawMessage {
    /// Header `key`, if present.
    pub fn header(&self, key: &str) -> Option<&str> {
        self.headers.get(key)
    }

    /// Sets [`REDELIVERED_HEADER`] (see [`Delivery::redelivered`]).
    pub(crate) fn mark_redelivered(&mut self) {
        self.headers.insert(REDELIVERED_HEADER, "true");
    }
}

/// The header a transport sets on a [`Delivery`] it handed out before
/// without it being acknowledged (see [`Delivery::redelivered`]). The
/// serializer turns it into a [`RedeliveredStamp`] when decoding and refuses
/// an envelope header of that name when encoding, so an envoi producer
/// cannot set it. The transports also drop a header of that name on the way
/// in (a row or entry written by hand with it), so only the transport marks
/// a redelivery.
///
/// [`RedeliveredStamp`]: crate::envelope::stamp::RedeliveredStamp
pub const REDELIVERED_HEADER: &str = "X-Envoi-Redelivered";

/// A message handed out by [`Transport::get`], to be acknowledged, rejected
/// or released by its `id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The transport's id for this message.
    pub id: String,
    /// The stored message.
    pub raw: RawMessage,
}

impl Delivery {
    /// Marks the message as handed out before and not acknowledged: a
    /// consumer took it and died (or gave it back) before it was handled.
    /// A transport that knows it (RabbitMQ's `redelivered` flag, Redis's
    /// `XAUTOCLAIM`, JetStream's delivery count, the SQLite and PostgreSQL
    /// rows' delivery count, the in-memory transport's expired leases)
    /// marks it, and the received envelope then carries a
    /// [`RedeliveredStamp`], which lets
    /// [`Deduplicate`](crate::middleware::dedup::Deduplicate) handle it while
    /// the attempt of a consumer that died still claims its key. Sets
    /// [`REDELIVERED_HEADER`].
    ///
    /// ```
    /// use envoi_core::transport::{Delivery, RawMessage};
    ///
    /// let d = Delivery { id: "1".into(), raw: RawMessage::default() };
    /// assert!(!d.is_redelivered());
    /// assert!(d.redelivered().is_redelivered());
    /// ```
    ///
    /// [`RedeliveredStamp`]: crate::envelope::stamp::RedeliveredStamp
    #[must_use = "`redelivered` returns the marked delivery"]
    pub fn redelivered(mut self) -> Self {
        self.raw.mark_redelivered();
        self
    }

    /// Whether the transport marked the message with
    /// [`redelivered`](Self::redelivered).
    pub fn is_redelivered(&self) -> bool {
        self.raw.headers.contains_key(REDELIVERED_HEADER)
    }
}

/// What a transport promises; the conformance suite reads it to decide which
/// tests apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Messages survive a restart of the process.
    pub persistent: bool,
    /// A single consumer receives messages in the order they were sent.
    pub ordered: bool,
    /// `send` honours a delay.
    pub delay: bool,
    /// `list` and `find` work.
    pub listable: bool,
}

impl Capabilities {
    /// Every capability.
    pub const ALL: Capabilities = Capabilities {
        persistent: true,
        ordered: true,
        delay: true,
        listable: true,
    };

    /// Builds capabilities from the four flags.
    pub const fn new(persistent: bool, ordered: bool, delay: bool, listable: bool) -> Self {
        Self {
            persistent,
            ordered,
            delay,
            listable,
        }
    }
}

/// Stores messages and hands them out to consumers.
///
/// Delivery is at least once: a message handed out by [`get`](Self::get)
/// that is neither acknowledged nor rejected (the consumer died) becomes
/// available again after the transport's lease or visibility timeout;
/// [`keepalive`](Self::keepalive) extends the lease of a message still being
/// worked on.
pub trait Transport: Send + Sync + 'static {
    /// Stores `message`, to be handed out no sooner than `delay` from now.
    /// Returns the transport's id for it.
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>>;

    /// Stores several messages; returns their ids in order. Transports that
    /// can write a batch in one round trip override it.
    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        Box::pin(async move {
            let mut ids = Vec::with_capacity(messages.len());
            for (message, delay) in messages {
                ids.push(self.send(message, delay).await?);
            }
            Ok(ids)
        })
    }

    /// Hands out up to `max` available messages, leasing them to the caller.
    /// Returns an empty vector when none is available (it may wait briefly
    /// for one first).
    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>>;

    /// The message was handled: remove it for good.
    fn ack<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Acknowledges several messages; transports that can do it in one round
    /// trip override it. Every message is acknowledged that can be (one
    /// that fails does not leave the others to be handed out again); the
    /// first error is returned.
    fn ack_batch<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let mut first = None;
            for id in ids {
                if let Err(e) = self.ack(id).await {
                    first.get_or_insert(e);
                }
            }
            first.map_or(Ok(()), Err)
        })
    }

    /// The message must not be handled again: remove it for good.
    fn reject<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        self.ack(id)
    }

    /// Gives the message back so it is handed out again (graceful stop).
    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Extends the lease of a message still being handled.
    fn keepalive<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        let _ = id;
        Box::pin(async { Ok(()) })
    }

    /// Creates what the transport needs (tables, queues, streams). Idempotent.
    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async { Ok(()) })
    }

    /// How many messages are waiting (including delayed and leased ones).
    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async { Err(TransportError::Unsupported("message_count")) })
    }

    /// Up to `limit` stored messages, oldest first, without leasing them.
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        let _ = limit;
        Box::pin(async { Err(TransportError::Unsupported("list")) })
    }

    /// The stored message with this id, without leasing it.
    fn find<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        let _ = id;
        Box::pin(async { Err(TransportError::Unsupported("find")) })
    }

    /// What the transport promises.
    fn capabilities(&self) -> Capabilities;

    /// Resolves when messages may have become available, or after
    /// `timeout`. A worker whose receivers all came back empty waits on it
    /// before asking again. The default sleeps for `timeout`; a transport
    /// that can tell when a message arrives resolves earlier.
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(tokio::time::sleep(timeout))
    }

    /// The in-process side of the transport, for transports that live in
    /// this process and can move envelopes without encoding them (the
    /// in-memory and sync transports). `None` by default.
    fn local(&self) -> Option<&dyn LocalTransport> {
        None
    }

    /// Called by `MessengerBuilder::build`
    /// for every transport registered with the messenger. Transports that
    /// need the serializer or the messenger itself keep what they need from
    /// `binding`. Does nothing by default.
    fn bind(&self, binding: &TransportBinding) {
        let _ = binding;
    }
}

/// What a messenger tells a transport registered with it; see
/// [`Transport::bind`].
#[derive(Clone)]
pub struct TransportBinding {
    name: Arc<str>,
    serializer: Serializer,
    inbox: Weak<dyn Inbox>,
}

impl TransportBinding {
    /// The binding of the transport registered as `name`.
    pub fn new(name: Arc<str>, serializer: Serializer, inbox: Weak<dyn Inbox>) -> Self {
        Self {
            name,
            serializer,
            inbox,
        }
    }

    /// The name the transport is registered under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The messenger's serializer.
    pub fn serializer(&self) -> &Serializer {
        &self.serializer
    }

    /// The messenger, to hand it messages received now; `None` once it is
    /// gone (the binding does not keep it alive).
    pub fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        self.inbox.upgrade()
    }
}

impl fmt::Debug for TransportBinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransportBinding")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The messenger as a transport registered with it sees it: it takes a
/// message the transport received and dispatches it now, on the bus its
/// `BusNameStamp` names (the default bus when it names none the messenger
/// has). The sync transport, which handles what is sent to it, uses it.
pub trait Inbox: Send + Sync + 'static {
    /// Dispatches `envelope`, stamped as received, and returns what came
    /// back.
    fn dispatch_received(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope>>;
}

/// A message an in-process transport hands out: still encoded, or the
/// envelope itself when it was sent without encoding.
#[derive(Debug, Clone)]
pub enum Payload {
    /// An encoded message, to be decoded by the serializer.
    Raw(RawMessage),
    /// The envelope as it was sent (non-sendable stamps removed).
    Envelope(Envelope),
}

/// A message handed out by [`LocalTransport::get_local`].
#[derive(Debug, Clone)]
pub struct LocalDelivery {
    /// The transport's id for it: its text form is what
    /// [`Transport::ack`] and friends take, [`LocalId::key`] what
    /// [`LocalTransport::ack_local`] takes.
    pub id: LocalId,
    /// The message.
    pub payload: Payload,
}

pub use crate::envelope::local_id::LocalId;

/// The future of a [`LocalTransport`] method: already complete (what an
/// in-memory queue returns, without allocating) or still running.
#[must_use = "futures do nothing unless awaited"]
pub enum LocalFuture<'a, T> {
    /// The result, taken by the first poll.
    Ready(Option<T>),
    /// Work still to do.
    Pending(BoxFuture<'a, T>),
}

impl<'a, T> LocalFuture<'a, T> {
    /// A future that is already complete.
    pub fn ready(value: T) -> Self {
        LocalFuture::Ready(Some(value))
    }

    /// A future still to run.
    pub fn pending(future: impl std::future::Future<Output = T> + Send + 'a) -> Self {
        LocalFuture::Pending(Box::pin(future))
    }
}

// The value is never pinned (only moved out of its `Option`), and the boxed
// future is pinned by its box.
impl<T> Unpin for LocalFuture<'_, T> {}

impl<T> std::future::Future for LocalFuture<'_, T> {
    type Output = T;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<T> {
        match self.get_mut() {
            LocalFuture::Ready(value) => match value.take() {
                Some(v) => std::task::Poll::Ready(v),
                None => std::task::Poll::Pending,
            },
            LocalFuture::Pending(future) => future.as_mut().poll(cx),
        }
    }
}

impl<T> fmt::Debug for LocalFuture<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LocalFuture::Ready(_) => "LocalFuture::Ready",
            LocalFuture::Pending(_) => "LocalFuture::Pending",
        })
    }
}

/// The in-process side of a transport that lives in this process: it moves
/// envelopes without encoding them, which is what makes the in-memory
/// transport fast. Rejecting, releasing and extending leases go through
/// [`Transport`] as for any transport; acknowledging does too, unless the
/// transport takes keys with [`ack_local`](Self::ack_local) (a worker uses
/// it when it is supported).
pub trait LocalTransport: Send + Sync {
    /// Stores `envelope` (honouring its last
    /// [`DelayStamp`](crate::envelope::stamp::DelayStamp)) and returns it with a
    /// [`TransportMessageIdStamp`](crate::envelope::stamp::TransportMessageIdStamp);
    /// or, for a transport that [handles on send](Self::handles_on_send),
    /// handles it now and returns the result of that.
    fn send_envelope(&self, envelope: Envelope) -> LocalFuture<'_, Result<Envelope>>;

    /// Hands out up to `max` available messages, leasing them to the caller.
    fn get_local(&self, max: usize) -> LocalFuture<'_, Result<Vec<LocalDelivery>, TransportError>>;

    /// Acknowledges messages handed out by
    /// [`get_local`](Self::get_local) by their [`LocalId::key`], as
    /// [`Transport::ack_batch`] does by their text ids. Unsupported by
    /// default.
    fn ack_local(&self, keys: &[u64]) -> Result<(), TransportError> {
        let _ = keys;
        Err(TransportError::Unsupported("ack_local"))
    }

    /// Whether sending handles the message at once (the sync transport), so
    /// there is nothing to consume and no retry to schedule.
    fn handles_on_send(&self) -> bool {
        false
    }
}

impl fmt::Debug for dyn Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transport")
            .field("capabilities", &self.capabilities())
            .finish()
    }
}

/// A failed send; hands the envelope back so nothing is lost.
#[derive(Debug, thiserror::Error)]
#[error("sending `{}` failed: {source}", envelope.message_name())]
pub struct SendError {
    /// The envelope that was not sent.
    pub envelope: Box<Envelope>,
    /// Why.
    #[source]
    pub source: TransportError,
}

/// Sends envelopes to one transport.
pub trait Sender: Send + Sync + 'static {
    /// Sends `envelope`; on success returns it stamped with a
    /// [`TransportMessageIdStamp`](crate::envelope::stamp::TransportMessageIdStamp).
    fn send(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope, SendError>>;
}

/// Decides how the send step's sends happen. The default sends at once; a
/// transactional outbox can hold sends until its transaction commits.
pub trait SenderDispatcher: Send + Sync + 'static {
    /// Sends `envelope` to the transport called `transport`.
    fn send<'a>(
        &'a self,
        transport: &'a str,
        envelope: Envelope,
    ) -> BoxFuture<'a, Result<Envelope>>;

    /// The names of the transports it can send to.
    fn transports(&self) -> Vec<String>;

    /// The transport called `transport` when sending to it through this
    /// dispatcher is exactly [`TransportSender::send_envelope`](crate::transport::registry::TransportSender::send_envelope)
    /// (so the send step may send to it directly); `None` otherwise, which
    /// is the default.
    fn direct(&self, transport: &str) -> Option<Arc<dyn Transport>> {
        let _ = transport;
        None
    }
}

/// A [`SenderDispatcher`] that sends at once through named [`Sender`]s.
///
/// Not what a `Messenger` uses by default: it builds a
/// [`Senders`](crate::transport::registry::Senders), which sends to its registered
/// transports as well as to its senders.
#[derive(Default, Clone)]
pub struct DirectSenders {
    senders: BTreeMap<String, Arc<dyn Sender>>,
}

impl DirectSenders {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the sender for `transport`.
    pub fn insert(&mut self, transport: impl Into<String>, sender: Arc<dyn Sender>) {
        self.senders.insert(transport.into(), sender);
    }

    /// The sender for `transport`.
    pub fn get(&self, transport: &str) -> Option<&Arc<dyn Sender>> {
        self.senders.get(transport)
    }
}

impl fmt::Debug for DirectSenders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.senders.keys()).finish()
    }
}

impl SenderDispatcher for DirectSenders {
    fn send<'a>(
        &'a self,
        transport: &'a str,
        envelope: Envelope,
    ) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(async move {
            let Some(sender) = self.senders.get(transport) else {
                return Err(BusError::Transport {
                    transport: transport.to_string(),
                    envelope: Some(Box::new(envelope)),
                    source: TransportError::UnknownTransport(transport.to_string()),
                });
            };
            sender
                .send(envelope)
                .await
                .map_err(|e| BusError::Transport {
                    transport: transport.to_string(),
                    envelope: Some(e.envelope),
                    source: e.source,
                })
        })
    }

    fn transports(&self) -> Vec<String> {
        self.senders.keys().cloned().collect()
    }
}

/// Creates transports from DSNs such as `sqlite://envoi.db` or
/// `redis://127.0.0.1:6379`. Each transport crate provides one.
pub trait TransportFactory: Send + Sync + 'static {
    /// Whether this factory understands `dsn` (usually by its scheme).
    fn supports(&self, dsn: &str) -> bool;

    /// Creates the transport called `name` from `dsn`. Fails with
    /// [`TransportError::InvalidDsn`] for a DSN it cannot use.
    fn create<'a>(
        &'a self,
        name: &'a str,
        dsn: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Transport>, TransportError>>;
}

/// Whether `dsn` starts with `scheme` (`"redis://"`, `"sqlite:"`), in any
/// case: how a [`TransportFactory`] recognises its DSNs. Never panics,
/// whatever characters the DSN holds.
///
/// ```
/// use envoi_core::transport::dsn_has_scheme;
///
/// assert!(dsn_has_scheme("REDIS://127.0.0.1:6379", "redis://"));
/// assert!(!dsn_has_scheme("nats:/é", "nats://"));
/// assert!(!dsn_has_scheme("", "nats://"));
/// ```
pub fn dsn_has_scheme(dsn: &str, scheme: &str) -> bool {
    dsn.get(..scheme.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(scheme))
}

/// What follows `scheme` in `dsn`, when [`dsn_has_scheme`] says it has it.
pub(crate) fn strip_scheme<'a>(dsn: &'a str, scheme: &str) -> Option<&'a str> {
    dsn_has_scheme(dsn, scheme).then(|| &dsn[scheme.len()..])
}

/// Reads a duration as DSN options and the command line write it: one or
/// more numbers, each with a unit (`ms`, `s`, `m`, `h` or `d`; `sec`,
/// `secs`, `min` and `mins` too), such as `250ms`, `30s`, `1.5m` or
/// `1h30m`, or a bare number of seconds (`2`, `0.5`). Surrounding spaces
/// are ignored. `None` for anything else: no number, an unknown unit, a
/// negative, infinite or not-a-number value, or one too large for a
/// [`Duration`]. Every transport's DSN parser uses it, so one spelling
/// works everywhere; each checks its own range afterwards.
///
/// ```
/// use envoi_core::transport::parse_duration;
/// use std::time::Duration;
///
/// assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
/// assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
/// assert_eq!(parse_duration("1.5"), Some(Duration::from_millis(1500)));
/// assert_eq!(parse_duration("-1s"), None);
/// assert_eq!(parse_duration("soon"), None);
/// ```
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let is_number = |c: char| c.is_ascii_digit() || c == '.';
    if text.chars().all(is_number) {
        // Only digits and a point: `+5`, `-0` or `1e3` are not durations.
        return seconds(text.parse().ok()?);
    }
    let mut total = 0.0f64;
    let mut rest = text;
    while !rest.is_empty() {
        let number_len = rest.find(|c| !is_number(c)).unwrap_or(rest.len());
        if number_len == 0 {
            return None;
        }
        let number: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest.find(is_number).unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ms" => 0.001,
            "s" | "sec" | "secs" => 1.0,
            "m" | "min" | "mins" => 60.0,
            "h" => 3600.0,
            "d" => 86_400.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += number * scale;
    }
    seconds(total)
}

/// `secs` as a [`Duration`] when it is a finite, non-negative number small
/// enough for one.
fn seconds(secs: f64) -> Option<Duration> {
    if secs.is_finite() && secs >= 0.0 {
        Duration::try_from_secs_f64(secs).ok()
    } else {
        None
    }
}

/// Masks the password in a DSN (`scheme://user:secret@host` →
/// `scheme://user:***@host`, and `?password=secret` → `?password=***`,
/// the name in any case) for error messages and listings.
pub fn mask_dsn(dsn: &str) -> String {
    mask_query_password(mask_user_password(dsn))
}

/// Masks the value of every `password` option in the query of `dsn`.
fn mask_query_password(dsn: String) -> String {
    let Some(start) = dsn.find('?') else {
        return dsn;
    };
    let end = dsn[start..].find('#').map_or(dsn.len(), |i| start + i);
    let query = &dsn[start + 1..end];
    fn password_key(pair: &str) -> Option<&str> {
        pair.split_once('=')
            .map(|(key, _)| key)
            .filter(|key| key.eq_ignore_ascii_case("password"))
    }
    if !query.split('&').any(|pair| password_key(pair).is_some()) {
        return dsn;
    }
    let mut out = String::with_capacity(dsn.len());
    out.push_str(&dsn[..=start]);
    for (i, pair) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        match password_key(pair) {
            Some(key) => {
                out.push_str(key);
                out.push_str("=***");
            }
            None => out.push_str(pair),
        }
    }
    out.push_str(&dsn[end..]);
    out
}

/// Masks the password of the user information of `dsn`.
fn mask_user_password(dsn: &str) -> String {
    let Some(scheme_end) = dsn.find("://") else {
        return dsn.to_string();
    };
    let rest = &dsn[scheme_end + 3..];
    // The user information ends at the last `@` before the query: a
    // password may hold a `/` (or an `@`) that was not percent-encoded.
    let before_query = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    let authority = match before_query.rfind('@') {
        Some(at) => &rest[..=at],
        None => &rest[..rest.find('/').unwrap_or(rest.len())],
    };
    // User information comes before any `/` of a path: in
    // `sqlite:///var/a:b@c.db` the `:` and `@` are the file's.
    let path = rest.find('/').unwrap_or(rest.len());
    match (authority.rfind('@'), authority.find(':')) {
        (Some(at), Some(colon)) if colon < at && colon < path => format!(
            "{}{}:***{}",
            &dsn[..scheme_end + 3],
            &authority[..colon],
            &rest[at..]
        ),
        _ => dsn.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_units_compounds_fractions_and_bare_seconds() {
        let d = |text| parse_duration(text);
        assert_eq!(d("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(d("2s"), Some(Duration::from_secs(2)));
        assert_eq!(d("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(d("5m"), Some(Duration::from_secs(300)));
        assert_eq!(d("5min"), Some(Duration::from_secs(300)));
        assert_eq!(d("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(d("2d"), Some(Duration::from_secs(172_800)));
        assert_eq!(d("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(d("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(d(" 10s "), Some(Duration::from_secs(10)));
        assert_eq!(d("2"), Some(Duration::from_secs(2)));
        assert_eq!(d("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(d("0"), Some(Duration::ZERO));
    }

    #[test]
    fn durations_without_a_number_or_unit_or_out_of_range_are_none() {
        for bad in [
            "", " ", "s", "10x", "-5s", "-1", "1..2s", "ms10", "1e400", "inf", "NaN", "soon",
            "1 s", "5ms5", "+5", "-0", "1e3", "1e3s", ".", "1.2.3",
        ] {
            assert_eq!(parse_duration(bad), None, "`{bad}`");
        }
    }

    /// Acknowledges every id but `"bad"`, recording them.
    #[derive(Default)]
    struct Acks(std::sync::Mutex<Vec<String>>);

    impl Transport for Acks {
        fn send(
            &self,
            _: RawMessage,
            _: Option<Duration>,
        ) -> BoxFuture<'_, Result<String, TransportError>> {
            Box::pin(async { Err(TransportError::Unsupported("send")) })
        }
        fn get(&self, _: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
            Box::pin(async { Ok(Vec::new()) })
        }
        fn ack<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
            Box::pin(async move {
                if id == "bad" {
                    return Err(TransportError::NotFound(id.into()));
                }
                self.0.lock().unwrap().push(id.into());
                Ok(())
            })
        }
        fn release<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
            Box::pin(async { Ok(()) })
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities::ALL
        }
    }

    #[tokio::test]
    async fn the_default_ack_batch_acknowledges_past_a_failure_and_returns_it() {
        let t = Acks::default();
        let ids: Vec<String> = ["1", "bad", "2"].map(String::from).to_vec();
        let err = t.ack_batch(&ids).await.unwrap_err();
        assert!(
            matches!(err, TransportError::NotFound(ref id) if id == "bad"),
            "{err}"
        );
        assert_eq!(*t.0.lock().unwrap(), ["1", "2"]);
    }

    #[test]
    fn mask_dsn_hides_only_the_password() {
        assert_eq!(
            mask_dsn("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(mask_dsn("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(mask_dsn("sqlite://envoi.db"), "sqlite://envoi.db");
        assert_eq!(
            mask_dsn("postgres://postgres@h/db"),
            "postgres://postgres@h/db"
        );
    }

    #[test]
    fn mask_dsn_hides_a_password_holding_a_slash_or_an_at_sign() {
        assert_eq!(
            mask_dsn("redis://user:pa/ss@h:6379"),
            "redis://user:***@h:6379"
        );
        assert_eq!(
            mask_dsn("amqp://guest:p@ss/w@127.0.0.1:5672/%2f?heartbeat=5"),
            "amqp://guest:***@127.0.0.1:5672/%2f?heartbeat=5"
        );
        // An `@` in the query is not the end of a password.
        assert_eq!(
            mask_dsn("postgres://h:5432/db?application_name=a@b"),
            "postgres://h:5432/db?application_name=a@b"
        );
        assert_eq!(mask_dsn("sqlite:///var/a@b.db"), "sqlite:///var/a@b.db");
        assert_eq!(
            mask_dsn("sqlite:///tmp/a:b@c.db?lease=zz"),
            "sqlite:///tmp/a:b@c.db?lease=zz"
        );
        assert_eq!(mask_dsn("sqlite://dir/a:b@c.db"), "sqlite://dir/a:b@c.db");
    }

    #[test]
    fn mask_dsn_hides_a_password_given_as_a_query_option() {
        assert_eq!(
            mask_dsn("postgres://u@h/db?password=hunter2&bogus=1"),
            "postgres://u@h/db?password=***&bogus=1"
        );
        assert_eq!(
            mask_dsn("postgres://u:pw@h/db?sslmode=disable&PassWord=hunter2#x"),
            "postgres://u:***@h/db?sslmode=disable&PassWord=***#x"
        );
        assert_eq!(
            mask_dsn("redis://h?password=hunter2"),
            "redis://h?password=***"
        );
        // Other options, and an option merely ending in `password`, stay.
        assert_eq!(
            mask_dsn("postgres://h/db?password_hint=x&table=password"),
            "postgres://h/db?password_hint=x&table=password"
        );
    }
}
