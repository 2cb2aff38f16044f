//! Stamps: small typed values that travel with an [`Envelope`](crate::Envelope).
//!
//! A stamp records something that happened to a message or something a
//! middleware wants the next one to know: which bus it went through, which
//! transport it was sent to, how many times it was retried. Stamps are plain
//! serde values with a stable wire [`NAME`](Stamp::NAME); several stamps of
//! one type are allowed and kept in the order they were added.
//!
//! ```
//! use envoi_core::{Envelope, stamp::{SentStamp, BusNameStamp}};
//!
//! #[derive(Debug)]
//! struct Ping;
//! impl envoi_core::Message for Ping { const NAME: &'static str = "Ping"; }
//!
//! let envelope = Envelope::new(Ping)
//!     .with(BusNameStamp::new("command.bus"))
//!     .with(SentStamp::new("async"))
//!     .with(SentStamp::new("audit"));
//! assert_eq!(envelope.all::<SentStamp>().count(), 2);
//! assert_eq!(envelope.last::<SentStamp>().unwrap().transport, "audit");
//! ```
//!
//! # Writing your own stamp
//!
//! ```
//! use envoi_core::Stamp;
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Clone, Serialize, Deserialize)]
//! struct TenantStamp { tenant: String }
//!
//! impl Stamp for TenantStamp {
//!     const NAME: &'static str = "Tenant";
//! }
//! ```

use std::any::{Any, TypeId};
use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt::{self, Write as _};
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A typed value attached to an [`Envelope`](crate::Envelope).
///
/// Implement it for plain data (no references, no interior mutability) that
/// serde can write and read. [`NAME`](Stamp::NAME) is the stable wire name
/// used in the `X-Message-Stamp-<NAME>` header; never change it once
/// messages carrying it exist in a transport.
pub trait Stamp: Any + fmt::Debug + Clone + Send + Sync + Serialize + DeserializeOwned {
    /// Stable wire name of this stamp type.
    const NAME: &'static str;
    /// Whether the stamp crosses a transport. Non-sendable stamps (a handler
    /// result, for instance) are dropped by the serializer.
    const SENDABLE: bool = true;
}

/// Object-safe view of a stamp, used for storage and serialization.
pub trait ErasedStamp: Any + fmt::Debug + Send + Sync {
    /// The stamp's wire name.
    fn name(&self) -> &'static str;
    /// Whether it crosses a transport.
    fn sendable(&self) -> bool;
    /// The stamp as JSON, or `None` if it is not sendable.
    fn to_json(&self) -> Option<serde_json::Value>;
    /// Upcast for downcasting.
    fn as_any(&self) -> &dyn Any;
}

impl<S: Stamp> ErasedStamp for S {
    fn name(&self) -> &'static str {
        S::NAME
    }
    fn sendable(&self) -> bool {
        S::SENDABLE
    }
    fn to_json(&self) -> Option<serde_json::Value> {
        if S::SENDABLE {
            serde_json::to_value(self).ok()
        } else {
            None
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// One stored stamp. The stamps every dispatch adds are stored inline so that
/// the hot path does not allocate for them; any other stamp is shared behind
/// an `Arc`.
#[derive(Clone)]
pub(crate) enum StampEntry {
    BusName(BusNameStamp),
    Handled(HandledStamp),
    Received(ReceivedStamp),
    /// A [`TransportMessageIdStamp`]. An in-process transport's id is a
    /// number: the entry is then left empty and its text is made from the
    /// envelope's local key (see [`Self::erased`]) when first read, which
    /// most messages never are.
    TransportId(OnceLock<TransportMessageIdStamp>),
    /// A [`SentStamp`]: shared, as a send step makes one per transport and
    /// adds it to every envelope it sends there.
    Sent(Arc<SentStamp>),
    Other(Arc<dyn ErasedStamp>),
}

impl StampEntry {
    pub(crate) fn new<S: Stamp>(stamp: S) -> Self {
        // Route the built-in hot stamps to their inline slots, moving them
        // (no clone, no reference-count traffic).
        let mut slot = Some(stamp);
        let any: &mut dyn Any = &mut slot;
        if let Some(s) = any.downcast_mut::<Option<BusNameStamp>>() {
            if let Some(s) = s.take() {
                return StampEntry::BusName(s);
            }
        } else if let Some(s) = any.downcast_mut::<Option<HandledStamp>>() {
            if let Some(s) = s.take() {
                return StampEntry::Handled(s);
            }
        } else if let Some(s) = any.downcast_mut::<Option<ReceivedStamp>>() {
            if let Some(s) = s.take() {
                return StampEntry::Received(s);
            }
        } else if let Some(s) = any.downcast_mut::<Option<TransportMessageIdStamp>>() {
            if let Some(s) = s.take() {
                return StampEntry::TransportId(OnceLock::from(s));
            }
        } else if let Some(s) = any.downcast_mut::<Option<SentStamp>>() {
            if let Some(s) = s.take() {
                return StampEntry::Sent(Arc::new(s));
            }
        }
        match slot {
            Some(stamp) => StampEntry::Other(Arc::new(stamp)),
            None => unreachable!("a built-in stamp returned above"),
        }
    }

    /// An already type-erased stamp: a built-in one goes to its inline
    /// slot, so lookups by type find it whichever way it was added.
    pub(crate) fn from_erased(stamp: Arc<dyn ErasedStamp>) -> Self {
        let any = (*stamp).as_any();
        if let Some(s) = any.downcast_ref::<BusNameStamp>() {
            StampEntry::BusName(s.clone())
        } else if let Some(s) = any.downcast_ref::<HandledStamp>() {
            StampEntry::Handled(s.clone())
        } else if let Some(s) = any.downcast_ref::<ReceivedStamp>() {
            StampEntry::Received(s.clone())
        } else if let Some(s) = any.downcast_ref::<TransportMessageIdStamp>() {
            StampEntry::TransportId(OnceLock::from(s.clone()))
        } else {
            let any: Arc<dyn Any + Send + Sync> = stamp.clone();
            match any.downcast::<SentStamp>() {
                Ok(sent) => StampEntry::Sent(sent),
                Err(_) => StampEntry::Other(stamp),
            }
        }
    }

    /// The bit every stamp type without an inline kind shares (see
    /// [`bit`](Self::bit)).
    pub(crate) const OTHER: u8 = 8;

    /// The entry's bit in an envelope's summary of the stamp kinds it
    /// holds: one per inline kind, one ([`Self::OTHER`]) shared by every
    /// other stamp type.
    #[inline]
    pub(crate) fn bit(&self) -> u8 {
        match self {
            StampEntry::BusName(_) => 1,
            StampEntry::Handled(_) => 2,
            StampEntry::Received(_) => 4,
            StampEntry::Other(_) => Self::OTHER,
            StampEntry::TransportId(_) => 16,
            StampEntry::Sent(_) => 32,
        }
    }

    /// The bit entries of stamp type `S` carry (see [`bit`](Self::bit)).
    #[inline]
    pub(crate) fn bit_of<S: Stamp>() -> u8 {
        let id = TypeId::of::<S>();
        if id == TypeId::of::<BusNameStamp>() {
            1
        } else if id == TypeId::of::<HandledStamp>() {
            2
        } else if id == TypeId::of::<ReceivedStamp>() {
            4
        } else if id == TypeId::of::<TransportMessageIdStamp>() {
            16
        } else if id == TypeId::of::<SentStamp>() {
            32
        } else {
            Self::OTHER
        }
    }

    /// The stamp. `local` is the envelope's local key, which an empty
    /// transport-id entry takes its text from.
    pub(crate) fn erased(&self, local: Option<NonZeroU64>) -> &dyn ErasedStamp {
        match self {
            StampEntry::BusName(s) => s,
            StampEntry::Handled(s) => s,
            StampEntry::Received(s) => s,
            StampEntry::TransportId(s) => s.get_or_init(|| {
                TransportMessageIdStamp::new(crate::envelope::local_id::decimal(
                    local.map_or(0, NonZeroU64::get),
                ))
            }),
            StampEntry::Sent(s) => &**s,
            StampEntry::Other(s) => &**s,
        }
    }

    /// Whether the stamp crosses a transport (without making the text of
    /// an empty transport-id entry).
    #[inline]
    pub(crate) fn sendable(&self) -> bool {
        match self {
            StampEntry::BusName(_) => BusNameStamp::SENDABLE,
            StampEntry::Handled(_) => HandledStamp::SENDABLE,
            StampEntry::Received(_) => ReceivedStamp::SENDABLE,
            StampEntry::TransportId(_) => TransportMessageIdStamp::SENDABLE,
            StampEntry::Sent(_) => SentStamp::SENDABLE,
            StampEntry::Other(s) => s.sendable(),
        }
    }

    /// Whether this is a transport-id entry still waiting for its text.
    #[inline]
    pub(crate) fn is_unmade_id(&self) -> bool {
        matches!(self, StampEntry::TransportId(s) if s.get().is_none())
    }

    #[inline]
    pub(crate) fn type_id(&self) -> TypeId {
        match self {
            StampEntry::BusName(_) => TypeId::of::<BusNameStamp>(),
            StampEntry::Handled(_) => TypeId::of::<HandledStamp>(),
            StampEntry::Received(_) => TypeId::of::<ReceivedStamp>(),
            StampEntry::TransportId(_) => TypeId::of::<TransportMessageIdStamp>(),
            StampEntry::Sent(_) => TypeId::of::<SentStamp>(),
            StampEntry::Other(s) => (**s).as_any().type_id(),
        }
    }

    /// The stamp if it is an `S`. The inline kinds are told apart by
    /// their variant, with no dynamic call.
    #[inline]
    pub(crate) fn downcast<S: Stamp>(&self, local: Option<NonZeroU64>) -> Option<&S> {
        // Each arm knows its type, so the check folds to a constant.
        match self {
            StampEntry::BusName(s) => (s as &dyn Any).downcast_ref::<S>(),
            StampEntry::Handled(s) => (s as &dyn Any).downcast_ref::<S>(),
            StampEntry::Received(s) => (s as &dyn Any).downcast_ref::<S>(),
            StampEntry::Sent(s) => (&**s as &dyn Any).downcast_ref::<S>(),
            StampEntry::TransportId(_) => {
                if TypeId::of::<S>() != TypeId::of::<TransportMessageIdStamp>() {
                    return None;
                }
                self.erased(local).as_any().downcast_ref::<S>()
            }
            StampEntry::Other(s) => (**s).as_any().downcast_ref::<S>(),
        }
    }
}

/// Milliseconds since the Unix epoch, the time unit stamps use on the wire.
pub(crate) fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Names the bus a message was dispatched on. Added by the first step of the
/// canonical pipeline when missing, so a message received from a transport
/// goes back through the bus it was sent from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BusNameStamp {
    /// Name of the bus. A bus stamps its name as a `'static` string, so
    /// stamping and dropping the stamp is free of reference counting.
    pub bus: Cow<'static, str>,
}

impl BusNameStamp {
    /// A stamp naming `bus`.
    pub fn new(bus: impl Into<Cow<'static, str>>) -> Self {
        Self { bus: bus.into() }
    }
}

impl Stamp for BusNameStamp {
    const NAME: &'static str = "BusName";
}

/// Marks an envelope as received from a transport. Its presence makes the
/// send step a no-op, so the receiver pipeline reaches the handlers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceivedStamp {
    /// Name of the transport the message came from.
    pub transport: Arc<str>,
}

impl ReceivedStamp {
    /// A stamp naming `transport`.
    pub fn new(transport: impl Into<Arc<str>>) -> Self {
        Self {
            transport: transport.into(),
        }
    }
}

impl Stamp for ReceivedStamp {
    const NAME: &'static str = "Received";
    const SENDABLE: bool = false;
}

/// Added when a `before_consuming` filter stopped the message: its handlers
/// did not run, and it was not a failure. A worker counts such a message
/// as stopped by a filter, not as handled; it never crosses a transport.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct StoppedByFilterStamp {
    /// The stage whose filter stopped it (`before_consuming`).
    pub stage: Cow<'static, str>,
}

impl StoppedByFilterStamp {
    /// A stamp naming `stage`.
    pub fn new(stage: impl Into<Cow<'static, str>>) -> Self {
        Self {
            stage: stage.into(),
        }
    }
}

impl Stamp for StoppedByFilterStamp {
    const NAME: &'static str = "StoppedByFilter";
    const SENDABLE: bool = false;
}

/// Marks an envelope received from a transport that said it had handed the
/// message out before and it was not acknowledged: a consumer took it and
/// died, or gave it back, before it was handled (RabbitMQ's `redelivered`
/// flag, for one). The transport marks the `Delivery` it hands out and the
/// worker turns the mark into this stamp when it decodes the message; it
/// never crosses a transport.
///
/// `Deduplicate` handles such a message when its key is only claimed by an
/// attempt still in processing (whose process may have died) instead of
/// taking it for a duplicate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RedeliveredStamp {}

impl RedeliveredStamp {
    /// The stamp.
    pub fn new() -> Self {
        Self {}
    }
}

impl Stamp for RedeliveredStamp {
    const NAME: &'static str = "Redelivered";
    const SENDABLE: bool = false;
}

/// Records that the envelope was sent to a transport; one per transport.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentStamp {
    /// Name of the transport.
    pub transport: String,
}

impl SentStamp {
    /// A stamp naming `transport`.
    pub fn new(transport: impl Into<String>) -> Self {
        Self {
            transport: transport.into(),
        }
    }
}

impl Stamp for SentStamp {
    const NAME: &'static str = "Sent";
    const SENDABLE: bool = false;
}

/// The value a handler returned, stored once and shared by every clone of the
/// envelope.
#[derive(Clone, Default)]
pub struct HandlerResult(pub(crate) Option<Arc<dyn Any + Send + Sync>>);

impl HandlerResult {
    /// Wraps a value. `()` is stored without allocating.
    pub fn new<T: Any + Send + Sync>(value: T) -> Self {
        if TypeId::of::<T>() == TypeId::of::<()>() {
            HandlerResult(None)
        } else {
            HandlerResult(Some(Arc::new(value)))
        }
    }

    /// Borrows the value if it is a `T`.
    pub fn downcast_ref<T: Any>(&self) -> Option<&T> {
        match &self.0 {
            Some(v) => (**v).downcast_ref::<T>(),
            None => (&() as &dyn Any).downcast_ref::<T>(),
        }
    }

    /// Takes the value out if it is a `T`; clones it when the result is
    /// shared with another clone of the envelope.
    pub fn take<T: Any + Send + Sync + Clone>(self) -> Option<T> {
        match self.0 {
            Some(v) => match v.downcast::<T>() {
                Ok(arc) => Some(Arc::try_unwrap(arc).unwrap_or_else(|a| (*a).clone())),
                Err(_) => None,
            },
            None => (&() as &dyn Any).downcast_ref::<T>().cloned(),
        }
    }
}

impl fmt::Debug for HandlerResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            None => f.write_str("()"),
            Some(_) => f.write_str("<value>"),
        }
    }
}

/// Added by the handle step, once per handler that ran successfully.
///
/// Only the handler's name crosses a transport (the result is dropped at the
/// wire), so a retried event does not run again the handlers that already
/// succeeded.
#[derive(Debug, Clone)]
pub struct HandledStamp {
    /// Name of the handler.
    pub handler: Cow<'static, str>,
    /// What it returned (empty after a transport round trip).
    pub result: HandlerResult,
}

impl HandledStamp {
    /// A stamp for `handler` with its `result`.
    pub fn new(handler: impl Into<Cow<'static, str>>, result: HandlerResult) -> Self {
        Self {
            handler: handler.into(),
            result,
        }
    }
}

impl Serialize for HandledStamp {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.handler)
    }
}

impl<'de> Deserialize<'de> for HandledStamp {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let handler = String::deserialize(deserializer)?;
        Ok(HandledStamp::new(handler, HandlerResult::default()))
    }
}

impl Stamp for HandledStamp {
    const NAME: &'static str = "Handled";
}

/// Counts redeliveries; added by the retry step before re-sending.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RedeliveryStamp {
    /// 1 for the first retry, 2 for the second, …
    pub retry_count: u32,
    /// When the retry was scheduled, in milliseconds since the Unix epoch.
    pub at: u64,
}

impl RedeliveryStamp {
    /// A stamp for retry number `retry_count`, scheduled now.
    pub fn new(retry_count: u32) -> Self {
        Self {
            retry_count,
            at: now_millis(),
        }
    }
}

impl Stamp for RedeliveryStamp {
    const NAME: &'static str = "Redelivery";
}

/// Asks the transport to deliver the message no sooner than `ms` from now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelayStamp {
    /// The delay in milliseconds.
    pub ms: u64,
}

impl DelayStamp {
    /// A delay of `delay`, at most `u64::MAX` milliseconds.
    pub fn new(delay: Duration) -> Self {
        Self {
            ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// The delay as a [`Duration`].
    pub fn duration(&self) -> Duration {
        Duration::from_millis(self.ms)
    }
}

impl Stamp for DelayStamp {
    const NAME: &'static str = "Delay";
}

/// Describes why handling a message failed; added before it goes to the
/// failure transport.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetailsStamp {
    /// A short classification, such as the error's type or `decode`.
    pub kind: String,
    /// The error's message.
    pub message: String,
    /// The error's `source()` chain, outermost first.
    pub chain: Vec<String>,
}

impl ErrorDetailsStamp {
    /// The longest `message` (and `kind`) kept, in bytes; a longer text is
    /// cut at a character boundary and says how much was cut. A message
    /// keeps up to the serializer's `STAMP_HISTORY` (16)
    /// of these stamps, one per failure, in a header, so an error that
    /// prints a whole response body must not make it too large to park.
    pub const MAX_MESSAGE_LEN: usize = 4096;
    /// The most `source()` errors kept in `chain`, outermost first; a line
    /// after them says how many more were cut.
    pub const MAX_CHAIN: usize = 8;
    /// The longest entry of `chain` kept, in bytes (cut as `message` is).
    pub const MAX_CHAIN_ENTRY_LEN: usize = 1024;

    /// Details of `error`, classified as `kind`, its texts cut to the
    /// limits above.
    pub fn from_error(kind: impl Into<String>, error: &(dyn std::error::Error + 'static)) -> Self {
        let mut chain = Vec::new();
        let mut cut = 0usize;
        let mut source = error.source();
        // Counted up to a bound: a source chain that loops back on itself
        // must not hang the worker.
        while let Some(e) = source {
            if chain.len() < Self::MAX_CHAIN {
                chain.push(truncated(e.to_string(), Self::MAX_CHAIN_ENTRY_LEN));
            } else if cut == MAX_COUNTED_SOURCES {
                break;
            } else {
                cut += 1;
            }
            source = e.source();
        }
        match cut {
            0 => {}
            MAX_COUNTED_SOURCES => chain.push(format!("… and over {cut} more sources")),
            _ => chain.push(format!("… and {cut} more sources")),
        }
        Self {
            kind: truncated(kind.into(), Self::MAX_MESSAGE_LEN),
            message: truncated(error.to_string(), Self::MAX_MESSAGE_LEN),
            chain,
        }
    }

    /// Details from a plain message, cut to [`MAX_MESSAGE_LEN`](Self::MAX_MESSAGE_LEN).
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            kind: truncated(kind.into(), Self::MAX_MESSAGE_LEN),
            message: truncated(message.into(), Self::MAX_MESSAGE_LEN),
            chain: Vec::new(),
        }
    }
}

/// How many sources past [`ErrorDetailsStamp::MAX_CHAIN`] are counted
/// before the walk stops (a chain may loop).
const MAX_COUNTED_SOURCES: usize = 1000;

/// `text` cut to at most `max` bytes (at a character boundary), followed by
/// how many bytes were cut; unchanged when it fits.
fn truncated(mut text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let total = text.len();
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    let _ = write!(text, "… [{} more bytes]", total - end);
    text
}

impl Stamp for ErrorDetailsStamp {
    const NAME: &'static str = "ErrorDetails";
}

/// The id a transport gave the message when it was sent or received.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportMessageIdStamp {
    /// The transport-specific id.
    pub id: String,
}

impl TransportMessageIdStamp {
    /// A stamp carrying `id`.
    pub fn new(id: impl Into<String>) -> Self {
        Self { id: id.into() }
    }
}

impl Stamp for TransportMessageIdStamp {
    const NAME: &'static str = "TransportMessageId";
    const SENDABLE: bool = false;
}

/// Marks a message that was moved to the failure transport, remembering where
/// it came from so a retry from there behaves as the original delivery did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentToFailureTransportStamp {
    /// The transport the message was received from when it failed.
    pub original_transport: String,
}

impl SentToFailureTransportStamp {
    /// A stamp naming the original transport.
    pub fn new(original_transport: impl Into<String>) -> Self {
        Self {
            original_transport: original_transport.into(),
        }
    }
}

impl Stamp for SentToFailureTransportStamp {
    const NAME: &'static str = "SentToFailureTransport";
}

/// Marks a message parked in the failure transport because sending it to
/// `transport` failed (a dispatch a handler deferred, routed there): it was
/// never received, so, retried from the failure transport, it is sent to
/// `transport` again (without this stamp) rather than handled, and to the
/// transports its type is routed to after `transport`, which the failed
/// send never reached. Its
/// [`SentToFailureTransportStamp`] names `transport` too, so once it arrives
/// there it is handled as any message of that transport.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct UnsentStamp {
    /// The transport the message could not be sent to.
    pub transport: String,
}

impl UnsentStamp {
    /// A stamp naming the transport the message could not be sent to.
    pub fn new(transport: impl Into<String>) -> Self {
        Self {
            transport: transport.into(),
        }
    }
}

impl Stamp for UnsentStamp {
    const NAME: &'static str = "Unsent";
}

/// Defers a dispatch made while a handler runs until the dispatch running
/// that handler has finished successfully (a dispatch made outside any
/// handler runs at once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchAfterCurrentBusStamp;

impl Stamp for DispatchAfterCurrentBusStamp {
    const NAME: &'static str = "DispatchAfterCurrentBus";
    const SENDABLE: bool = false;
}

/// A unique id for a message, kept across transports and retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MessageIdStamp {
    /// The id.
    pub id: uuid::Uuid,
}

impl MessageIdStamp {
    /// A fresh, time-ordered id.
    pub fn generate() -> Self {
        Self {
            id: uuid::Uuid::now_v7(),
        }
    }
}

impl Stamp for MessageIdStamp {
    const NAME: &'static str = "MessageId";
}

/// Bus names as `'static` strings, each kept once for the life of the
/// program: buses are named when they are built, so the set stays as small
/// as the number of distinct bus names.
pub(crate) fn intern_bus_name(name: &str) -> &'static str {
    static NAMES: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(|p| p.into_inner());
    let names = names.get_or_insert_with(HashSet::new);
    match names.get(name) {
        Some(interned) => interned,
        None => {
            let interned: &'static str = Box::leak(name.into());
            names.insert(interned);
            interned
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error whose message is `text` and whose source is `source`.
    #[derive(Debug)]
    struct Layer(String, Option<Box<Layer>>);
    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(&self.0)
        }
    }
    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn error_details_cut_long_texts_and_long_chains_and_say_so() {
        let mut error = Layer("é".repeat(3000), None);
        for i in 0..20 {
            error = Layer(
                format!("layer {i}: {}", "x".repeat(5000)),
                Some(Box::new(error)),
            );
        }
        let d = ErrorDetailsStamp::from_error("handler", &error);
        assert!(d.message.len() < ErrorDetailsStamp::MAX_MESSAGE_LEN + 40);
        assert!(d.message.starts_with("layer 19: xxx"));
        assert!(d.message.ends_with("more bytes]"), "{}", &d.message[4000..]);
        assert_eq!(d.chain.len(), ErrorDetailsStamp::MAX_CHAIN + 1);
        assert!(d.chain[0].starts_with("layer 18: "));
        assert!(d
            .chain
            .iter()
            .take(ErrorDetailsStamp::MAX_CHAIN)
            .all(|c| c.len() < ErrorDetailsStamp::MAX_CHAIN_ENTRY_LEN + 40));
        assert_eq!(d.chain[8], "… and 12 more sources");

        // A chain that loops back on itself ends.
        #[derive(Debug)]
        struct Loop;
        impl fmt::Display for Loop {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("again")
            }
        }
        impl std::error::Error for Loop {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&Loop)
            }
        }
        let d = ErrorDetailsStamp::from_error("handler", &Loop);
        assert_eq!(d.chain.len(), ErrorDetailsStamp::MAX_CHAIN + 1);
        assert_eq!(d.chain[8], "… and over 1000 more sources");

        // Cut at a character boundary: 3000 two-byte characters.
        let d = ErrorDetailsStamp::new("decode", "é".repeat(3000));
        assert!(d.message.starts_with(&"é".repeat(2048)));
        assert!(
            d.message.ends_with("… [1904 more bytes]"),
            "{}",
            &d.message[4000..]
        );

        // Short texts are kept as they are.
        let d = ErrorDetailsStamp::new("decode", "bad body");
        assert_eq!(
            (d.kind.as_str(), d.message.as_str()),
            ("decode", "bad body")
        );
    }

    #[test]
    fn unit_handler_results_are_stored_without_a_value() {
        let r = HandlerResult::new(());
        assert!(r.0.is_none());
        assert_eq!(r.downcast_ref::<()>(), Some(&()));
        assert_eq!(r.take::<()>(), Some(()));
    }

    #[test]
    fn handler_results_downcast_to_their_own_type_only() {
        let r = HandlerResult::new(42u32);
        assert_eq!(r.downcast_ref::<u32>(), Some(&42));
        assert_eq!(r.downcast_ref::<i64>(), None);
        assert_eq!(r.take::<u32>(), Some(42));
    }

    #[test]
    fn error_details_keep_the_source_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] std::io::Error);
        let e = Outer(std::io::Error::other("inner"));
        let d = ErrorDetailsStamp::from_error("io", &e);
        assert_eq!(d.message, "outer");
        assert_eq!(d.chain, vec!["inner".to_string()]);
    }

    #[test]
    fn handled_stamp_sends_the_handler_name_but_not_the_result() {
        let s = HandledStamp::new("h", HandlerResult::new(1u8));
        assert_eq!(ErasedStamp::to_json(&s), Some(serde_json::json!("h")));
        let back: HandledStamp = serde_json::from_value(serde_json::json!("h")).unwrap();
        assert_eq!(back.handler, "h");
        assert!(back.result.downcast_ref::<u8>().is_none());
        assert!(ErasedStamp::to_json(&ReceivedStamp::new("a")).is_none());
    }
}
