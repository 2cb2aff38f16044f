//! Messages as transports store them: [`RawMessage`], and [`Delivery`], a
//! message handed out to a receiver with its [`DeliveryId`].

use std::fmt;

use crate::envelope::headers::Headers;

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
}

/// A transport's id for a message it handed out: what
/// [`Receiver::ack`](super::Receiver::ack) and the other settling methods
/// take. Opaque to everyone but the transport that made it (a row id, a
/// stream entry id, a delivery tag, …).
///
/// ```
/// use envoi_core::transport::DeliveryId;
///
/// let id = DeliveryId::from("42");
/// assert_eq!(id.as_str(), "42");
/// assert_eq!(id.to_string(), "42");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DeliveryId(String);

impl DeliveryId {
    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as owned text.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for DeliveryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for DeliveryId {
    fn from(id: String) -> Self {
        Self(id)
    }
}

impl From<&str> for DeliveryId {
    fn from(id: &str) -> Self {
        Self(id.to_string())
    }
}

impl AsRef<str> for DeliveryId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// A message handed out by [`Receiver::get`](super::Receiver::get), to be
/// acknowledged, rejected or released by its [`id`](Self::id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The transport's id for this message.
    pub id: DeliveryId,
    /// The stored message.
    pub raw: RawMessage,
    /// Whether the transport handed this message out before without it
    /// being acknowledged (see [`mark_redelivered`](Self::mark_redelivered)).
    pub redelivered: bool,
}

impl Delivery {
    /// A first delivery of `raw`, known to the transport as `id`.
    pub fn new(id: impl Into<DeliveryId>, raw: RawMessage) -> Self {
        Self {
            id: id.into(),
            raw,
            redelivered: false,
        }
    }

    /// Marks the message as handed out before and not acknowledged: a
    /// consumer took it and died (or gave it back) before it was handled.
    /// A transport that knows it (RabbitMQ's `redelivered` flag, Redis's
    /// `XAUTOCLAIM`, JetStream's delivery count, the SQLite and PostgreSQL
    /// rows' delivery count, the in-memory transport's expired leases)
    /// marks it, and the worker stamps the received envelope with a
    /// [`RedeliveredStamp`](crate::envelope::stamp::RedeliveredStamp), which
    /// lets [`Deduplicate`](crate::middleware::dedup::Deduplicate) handle it
    /// while the attempt of a consumer that died still claims its key. Only
    /// the transport sets the mark: nothing in a stored message does.
    ///
    /// ```
    /// use envoi_core::transport::{Delivery, RawMessage};
    ///
    /// let d = Delivery::new("1", RawMessage::default());
    /// assert!(!d.redelivered);
    /// assert!(d.mark_redelivered().redelivered);
    /// ```
    #[must_use = "`mark_redelivered` returns the marked delivery"]
    pub fn mark_redelivered(mut self) -> Self {
        self.redelivered = true;
        self
    }
}
