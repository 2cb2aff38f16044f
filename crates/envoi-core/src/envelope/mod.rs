//! The [`Envelope`]: a message plus the stamps and headers that travel with it.

pub mod headers;
pub mod local_id;
pub mod message;
pub mod stamp;
pub(crate) mod type_map;

use std::any::{Any, TypeId};
use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU64;
use std::sync::{Arc, OnceLock};

use smallvec::SmallVec;

use crate::envelope::local_id::LocalId;
use crate::envelope::message::{Message, MessageKind};
use crate::envelope::stamp::{Stamp, StampEntry, TransportMessageIdStamp};

/// Object-safe view of a message inside an envelope.
pub(crate) trait ErasedMessage: Any + fmt::Debug + Send + Sync {
    fn as_any(&self) -> &dyn Any;

    /// The body that really holds the message, when this one only points
    /// at it.
    fn shared(&self) -> Option<&Arc<Body>> {
        None
    }
}

impl<M: Message> ErasedMessage for M {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A message that arrived behind an `Arc` (see [`Envelope::from_arc`]).
struct ArcMessage<M>(Arc<M>);

impl<M: Message> fmt::Debug for ArcMessage<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl<M: Message> ErasedMessage for ArcMessage<M> {
    fn as_any(&self) -> &dyn Any {
        &*self.0
    }
}

/// The message of another body: what a copy-on-write copy holds, since a
/// type-erased message cannot be cloned.
struct SharedMessage(Arc<Body>);

impl fmt::Debug for SharedMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0.message, f)
    }
}

impl ErasedMessage for SharedMessage {
    fn as_any(&self) -> &dyn Any {
        self.0.message.as_any()
    }

    fn shared(&self) -> Option<&Arc<Body>> {
        Some(&self.0)
    }
}

/// Stamps, headers and the message in one allocation.
pub(crate) struct Body<M: ?Sized = dyn ErasedMessage> {
    meta: Meta,
    message: M,
}

/// The name and [`TypeId`] of a message type: one static per type, so an
/// envelope holds one pointer for both.
struct MessageType {
    name: &'static str,
    type_id: TypeId,
}

/// Gives every message type its [`MessageType`].
trait HasMessageType {
    const TYPE: &'static MessageType;
}

impl<M: Message> HasMessageType for M {
    const TYPE: &'static MessageType = &MessageType {
        name: M::NAME,
        type_id: TypeId::of::<M>(),
    };
}

#[derive(Clone)]
struct Meta {
    /// The message's name and type, kept here so the hot lookups by type
    /// (handlers, routes) need no dynamic call.
    ty: &'static MessageType,
    kind: MessageKind,
    stamps: SmallVec<[StampEntry; 4]>,
    /// The union of the stamps' [`StampEntry::bit`]s: lets a lookup of a
    /// stamp type the envelope does not hold return without a scan.
    kinds: u8,
    /// The key an in-process transport gave the message, which its empty
    /// transport-id entry takes its text from (see
    /// [`StampEntry::TransportId`]).
    local: Option<NonZeroU64>,
    headers: Option<Arc<BTreeMap<String, String>>>,
}

impl Meta {
    #[inline]
    fn push(&mut self, entry: StampEntry) {
        self.kinds |= entry.bit();
        self.stamps.push(entry);
    }

    /// Recomputes `kinds` after stamps were removed.
    fn recount(&mut self) {
        self.kinds = self.stamps.iter().fold(0, |k, e| k | e.bit());
        if !self.stamps.iter().any(StampEntry::is_unmade_id) {
            self.local = None;
        }
    }

    /// Adds the id `key` of an in-process transport, as an entry whose
    /// text is made when first read.
    fn push_local_id(&mut self, key: u64) {
        let Some(key) = NonZeroU64::new(key) else {
            self.push(StampEntry::new(TransportMessageIdStamp::new("0")));
            return;
        };
        // One local key per envelope: an earlier id still waiting for its
        // text gets it now, from the key it was given.
        if let Some(old) = self.local {
            for e in self.stamps.iter().filter(|e| e.is_unmade_id()) {
                e.erased(Some(old));
            }
        }
        self.local = Some(key);
        self.push(StampEntry::TransportId(OnceLock::new()));
    }
}

/// A message with its stamps and headers.
///
/// An envelope is immutable: [`with`](Envelope::with) consumes it and returns
/// a new one carrying one more stamp, so a middleware can add information but
/// can never remove a stamp another middleware added. Clones share the message
/// and the stamps; adding a stamp to one clone does not change the others.
///
/// ```
/// use envoi_core::{Envelope, Message, stamp::DelayStamp};
///
/// #[derive(Debug)]
/// struct SendInvoice { id: u32 }
/// impl Message for SendInvoice { const NAME: &'static str = "SendInvoice"; }
///
/// let first = Envelope::new(SendInvoice { id: 7 });
/// let second = first.clone().with(DelayStamp { ms: 1000 });
/// assert!(first.last::<DelayStamp>().is_none());
/// assert_eq!(second.last::<DelayStamp>().unwrap().ms, 1000);
/// assert_eq!(second.message::<SendInvoice>().unwrap().id, 7);
/// ```
///
/// There is no public way to take stamps off an envelope, so this does not
/// compile:
///
/// ```compile_fail
/// use envoi_core::{Envelope, Message, stamp::DelayStamp};
///
/// #[derive(Debug)]
/// struct SendInvoice { id: u32 }
/// impl Message for SendInvoice { const NAME: &'static str = "SendInvoice"; }
///
/// let stamped = Envelope::new(SendInvoice { id: 7 }).with(DelayStamp { ms: 1000 });
/// let bare: Envelope = stamped.without_stamps();
/// ```
#[derive(Clone)]
pub struct Envelope {
    // One pointer to one allocation holding the message and its stamps (the
    // headers, which few envelopes have, sit behind a pointer of their own):
    // envelopes move through every step of the pipeline, so keeping them
    // small keeps the pipeline's futures small.
    body: Arc<Body>,
}

impl Envelope {
    /// Wraps a message dispatched as a command (the default kind).
    pub fn new<M: Message>(message: M) -> Self {
        Self::with_kind(message, MessageKind::Command)
    }

    /// Wraps a message dispatched as a query.
    pub fn query<M: Message>(message: M) -> Self {
        Self::with_kind(message, MessageKind::Query)
    }

    /// Wraps a message dispatched as an event.
    pub fn event<M: Message>(message: M) -> Self {
        Self::with_kind(message, MessageKind::Event)
    }

    fn meta_for<M: Message>(kind: MessageKind) -> Meta {
        Meta {
            ty: M::TYPE,
            kind,
            stamps: SmallVec::new(),
            kinds: 0,
            local: None,
            headers: None,
        }
    }

    /// Wraps a message of the given kind.
    pub fn with_kind<M: Message>(message: M, kind: MessageKind) -> Self {
        let body: Arc<Body> = Arc::new(Body {
            meta: Self::meta_for::<M>(kind),
            message,
        });
        Self { body }
    }

    /// Rebuilds an envelope around an already shared message, used by
    /// deserializers that produce the message behind an `Arc`.
    pub fn from_arc<M: Message>(message: Arc<M>, kind: MessageKind) -> Self {
        let body: Arc<Body> = Arc::new(Body {
            meta: Self::meta_for::<M>(kind),
            message: ArcMessage(message),
        });
        Self { body }
    }

    /// Mutable access for the consuming builders. When another clone shares
    /// the body, the stamps and headers are copied into a new body that
    /// points at the original message.
    #[inline]
    fn meta_mut(&mut self) -> &mut Meta {
        // Envelope bodies are never downgraded, so a strong count of one
        // means unique. Checking it with a plain load keeps the common path
        // to one `get_mut` (an atomic compare-exchange) instead of two.
        if Arc::strong_count(&self.body) != 1 {
            self.unshare();
        }
        match Arc::get_mut(&mut self.body) {
            Some(body) => &mut body.meta,
            None => unreachable!("an envelope body is never downgraded"),
        }
    }

    /// Gives this envelope a body of its own that points at the shared
    /// message.
    #[cold]
    fn unshare(&mut self) {
        let root = match self.body.message.shared() {
            Some(root) => root.clone(),
            None => self.body.clone(),
        };
        self.body = Arc::new(Body {
            meta: self.body.meta.clone(),
            message: SharedMessage(root),
        });
    }

    /// Returns a new envelope carrying `stamp` after the existing ones.
    #[must_use = "an envelope is immutable: `with` returns the stamped copy"]
    #[inline]
    pub fn with<S: Stamp>(mut self, stamp: S) -> Self {
        self.meta_mut().push(StampEntry::new(stamp));
        self
    }

    /// Returns a new envelope with header `key` set to `value`.
    #[must_use = "an envelope is immutable: `with_header` returns the new copy"]
    pub fn with_header(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        let headers = self.meta_mut().headers.get_or_insert_with(Default::default);
        Arc::make_mut(headers).insert(key.into(), value.into());
        self
    }

    /// The most recently added stamp of type `S`.
    pub fn last<S: Stamp>(&self) -> Option<&S> {
        let local = self.body.meta.local;
        self.candidates::<S>()
            .iter()
            .rev()
            .find_map(|e| e.downcast::<S>(local))
    }

    /// Every stamp of type `S`, oldest first.
    pub fn all<S: Stamp>(&self) -> impl DoubleEndedIterator<Item = &S> + '_ {
        let local = self.body.meta.local;
        self.candidates::<S>()
            .iter()
            .filter_map(move |e| e.downcast::<S>(local))
    }

    /// Whether at least one stamp of type `S` is present.
    #[inline]
    pub fn has<S: Stamp>(&self) -> bool {
        let bit = StampEntry::bit_of::<S>();
        let meta = &self.body.meta;
        if meta.kinds & bit == 0 {
            return false;
        }
        // A built-in kind's bit is its own: set only while an entry of
        // that kind is there. Every other stamp type shares one bit.
        if bit != StampEntry::OTHER {
            return true;
        }
        let id = TypeId::of::<S>();
        meta.stamps.iter().any(|e| e.type_id() == id)
    }

    /// The entries that may hold an `S`: none when no entry of its kind is
    /// there, so most lookups on a fresh envelope do not scan.
    #[inline]
    fn candidates<S: Stamp>(&self) -> &[StampEntry] {
        let meta = &self.body.meta;
        if meta.kinds & StampEntry::bit_of::<S>() == 0 {
            &[]
        } else {
            &meta.stamps
        }
    }

    /// Every stamp, oldest first, as object-safe views (for serializers and
    /// debugging).
    pub fn stamps(&self) -> impl Iterator<Item = &dyn crate::envelope::stamp::ErasedStamp> + '_ {
        let local = self.body.meta.local;
        self.body.meta.stamps.iter().map(move |e| e.erased(local))
    }

    /// How many stamps the envelope carries.
    pub(crate) fn stamp_count(&self) -> usize {
        self.body.meta.stamps.len()
    }

    /// Adds an already type-erased stamp (used by deserializers).
    #[must_use = "an envelope is immutable: `with_erased` returns the stamped copy"]
    pub fn with_erased(mut self, stamp: Arc<dyn crate::envelope::stamp::ErasedStamp>) -> Self {
        self.meta_mut().push(StampEntry::from_erased(stamp));
        self
    }

    /// Adds an entry made beforehand (a stamp shared by many envelopes).
    #[must_use = "an envelope is immutable: `with_entry` returns the stamped copy"]
    #[inline]
    pub(crate) fn with_entry(mut self, entry: StampEntry) -> Self {
        self.meta_mut().push(entry);
        self
    }

    /// Adds the [`TransportMessageIdStamp`] of an in-process transport's
    /// id, without making its text until it is read.
    #[must_use = "an envelope is immutable: `with_local_id` returns the stamped copy"]
    #[inline]
    pub(crate) fn with_local_id(mut self, id: LocalId) -> Self {
        self.meta_mut().push_local_id(id.key());
        self
    }

    /// The message, if it is an `M`.
    pub fn message<M: Message>(&self) -> Option<&M> {
        self.body.message.as_any().downcast_ref::<M>()
    }

    /// The message as `&dyn Any`.
    pub fn message_any(&self) -> &dyn Any {
        self.body.message.as_any()
    }

    /// The message, to print with `{:?}` (the test kit lists what it saw
    /// with it).
    #[cfg(feature = "testing")]
    pub(crate) fn message_debug(&self) -> &dyn fmt::Debug {
        &self.body.message
    }

    /// The [`TypeId`] of the message.
    #[inline]
    pub fn message_type_id(&self) -> TypeId {
        self.body.meta.ty.type_id
    }

    /// The message's stable name ([`Message::NAME`]).
    pub fn message_name(&self) -> &'static str {
        self.body.meta.ty.name
    }

    /// Whether the message was dispatched as a command, query or event.
    pub fn kind(&self) -> MessageKind {
        self.body.meta.kind
    }

    /// Header `key`, if set.
    pub fn header(&self, key: &str) -> Option<&str> {
        self.body
            .meta
            .headers
            .as_ref()?
            .get(key)
            .map(String::as_str)
    }

    /// Every header.
    pub fn headers(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        self.body
            .meta
            .headers
            .iter()
            .flat_map(|h| h.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }

    /// This envelope with only its sendable stamps: what it looks like after
    /// a round trip through a transport. Used by in-process transports that
    /// store envelopes without encoding them.
    pub(crate) fn into_sendable(mut self) -> Self {
        self.make_sendable();
        self
    }

    /// Removes the non-sendable stamps, in place when no clone shares
    /// this envelope (see [`into_sendable`](Self::into_sendable)).
    pub(crate) fn make_sendable(&mut self) {
        if self.body.meta.stamps.iter().any(|e| !e.sendable()) {
            let meta = self.meta_mut();
            meta.stamps.retain(|e| e.sendable());
            meta.recount();
        }
    }

    /// Removes the last stamp of type `S`, if any.
    pub(crate) fn remove_last<S: Stamp>(&mut self) {
        let id = std::any::TypeId::of::<S>();
        let Some(at) = self
            .candidates::<S>()
            .iter()
            .rposition(|e| e.type_id() == id)
        else {
            return;
        };
        let meta = self.meta_mut();
        meta.stamps.remove(at);
        meta.recount();
    }
}

/// The stamps of an envelope, for its `Debug` output.
struct StampList<'a>(&'a Envelope);

impl fmt::Debug for StampList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.0.stamps()).finish()
    }
}

impl fmt::Debug for Envelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.body.meta;
        f.debug_struct("Envelope")
            .field("name", &m.ty.name)
            .field("kind", &m.kind)
            .field("message", &&self.body.message)
            .field("stamps", &StampList(self))
            .field("headers", &m.headers)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::stamp::{
        BusNameStamp, DelayStamp, HandledStamp, HandlerResult, SentStamp,
    };

    #[derive(Debug, PartialEq)]
    struct Ping(u8);
    impl Message for Ping {
        const NAME: &'static str = "Ping";
    }

    #[test]
    fn with_keeps_every_stamp_of_a_type_in_order() {
        let e = Envelope::new(Ping(1))
            .with(SentStamp::new("a"))
            .with(DelayStamp { ms: 1 })
            .with(SentStamp::new("b"))
            .with(SentStamp::new("c"));
        let names: Vec<_> = e.all::<SentStamp>().map(|s| s.transport.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!(e.last::<SentStamp>().unwrap().transport, "c");
        assert!(e.has::<DelayStamp>());
    }

    #[test]
    fn clones_do_not_see_each_others_new_stamps() {
        let a = Envelope::new(Ping(1)).with(BusNameStamp::new("bus"));
        let b = a.clone().with(DelayStamp { ms: 9 });
        assert!(a.last::<DelayStamp>().is_none());
        assert_eq!(b.last::<BusNameStamp>().unwrap().bus.as_ref(), "bus");
    }

    #[test]
    fn inline_and_shared_stamps_downcast_alike() {
        let e = Envelope::new(Ping(1))
            .with(HandledStamp::new("h", HandlerResult::new(5u8)))
            .with(DelayStamp { ms: 3 });
        assert_eq!(e.last::<HandledStamp>().unwrap().handler, "h");
        assert!(e.last::<SentStamp>().is_none());
        assert_eq!(e.stamps().count(), 2);
    }

    #[test]
    fn message_downcasts_only_to_its_type() {
        let e = Envelope::new(Ping(3));
        assert_eq!(e.message::<Ping>(), Some(&Ping(3)));
        assert_eq!(e.message_name(), "Ping");
        assert_eq!(e.kind(), MessageKind::Command);
    }

    #[test]
    fn lookups_follow_stamps_added_and_removed() {
        use crate::envelope::stamp::RedeliveredStamp;
        let e = Envelope::new(Ping(1));
        assert!(!e.has::<DelayStamp>() && !e.has::<BusNameStamp>());
        let e = e
            .with(BusNameStamp::new("bus"))
            .with(RedeliveredStamp::new())
            .with(DelayStamp::new(std::time::Duration::from_millis(5)));
        assert!(e.has::<BusNameStamp>() && e.has::<RedeliveredStamp>() && e.has::<DelayStamp>());
        assert!(!e.has::<HandledStamp>() && !e.has::<SentStamp>());
        // Removing the non-sendable stamp keeps the other stamps findable.
        let e = e.into_sendable();
        assert!(!e.has::<RedeliveredStamp>());
        assert!(e.has::<DelayStamp>() && e.has::<BusNameStamp>());
        assert_eq!(e.all::<DelayStamp>().count(), 1);
    }

    #[test]
    fn a_stamped_copy_of_a_shared_envelope_keeps_the_message_and_the_original_stamps() {
        let a = Envelope::new(Ping(7)).with(SentStamp::new("a"));
        let b = a.clone().with(SentStamp::new("b"));
        let c = b.clone().with(SentStamp::new("c"));
        assert_eq!(c.message::<Ping>(), Some(&Ping(7)));
        assert_eq!(c.message_type_id(), TypeId::of::<Ping>());
        assert_eq!(c.all::<SentStamp>().count(), 3);
        assert_eq!(a.all::<SentStamp>().count(), 1);
        assert_eq!(b.all::<SentStamp>().count(), 2);
        // Copies point at the original message, not at each other.
        assert!(c
            .body
            .message
            .shared()
            .is_some_and(|r| Arc::ptr_eq(r, &a.body)));
    }

    #[test]
    fn envelopes_from_shared_messages_downcast_to_the_message_type() {
        let e = Envelope::from_arc(Arc::new(Ping(2)), MessageKind::Query);
        assert_eq!(e.message::<Ping>(), Some(&Ping(2)));
        assert_eq!(e.kind(), MessageKind::Query);
        assert!(format!("{e:?}").contains("Ping(2)"));
    }

    #[test]
    fn headers_are_copy_on_write() {
        let a = Envelope::event(Ping(1)).with_header("tenant", "acme");
        let b = a.clone().with_header("tenant", "other");
        assert_eq!(a.header("tenant"), Some("acme"));
        assert_eq!(b.header("tenant"), Some("other"));
        assert_eq!(a.kind(), MessageKind::Event);
    }

    #[test]
    fn stamp_entries_and_bodies_stay_small() {
        assert!(std::mem::size_of::<StampEntry>() <= 40);
        // What an in-memory queue holds per message, besides the message.
        assert!(std::mem::size_of::<Meta>() <= 200);
    }

    #[test]
    fn built_in_stamps_added_type_erased_are_found_by_type() {
        use crate::envelope::stamp::{ReceivedStamp, TransportMessageIdStamp};
        let e = Envelope::new(Ping(1))
            .with_erased(Arc::new(BusNameStamp::new("bus")))
            .with_erased(Arc::new(ReceivedStamp::new("async")))
            .with_erased(Arc::new(TransportMessageIdStamp::new("9")))
            .with_erased(Arc::new(DelayStamp { ms: 4 }))
            .with_erased(Arc::new(SentStamp::new("async")));
        assert_eq!(e.last::<BusNameStamp>().unwrap().bus, "bus");
        assert_eq!(e.last::<SentStamp>().unwrap().transport, "async");
        assert_eq!(&*e.last::<ReceivedStamp>().unwrap().transport, "async");
        assert_eq!(e.last::<TransportMessageIdStamp>().unwrap().id, "9");
        assert_eq!(e.last::<DelayStamp>().unwrap().ms, 4);
        let names: Vec<_> = e.stamps().map(|s| s.name()).collect();
        assert_eq!(
            names,
            ["BusName", "Received", "TransportMessageId", "Delay", "Sent"]
        );
    }

    #[test]
    fn local_ids_read_as_transport_message_id_stamps() {
        use crate::envelope::stamp::TransportMessageIdStamp;
        let a = Envelope::new(Ping(1)).with_local_id(LocalId::new(42));
        // A copy made before the text is read reads the same id.
        let b = a.clone().with_local_id(LocalId::new(7));
        let c = b.clone().with(TransportMessageIdStamp::new("remote"));
        assert_eq!(a.last::<TransportMessageIdStamp>().unwrap().id, "42");
        let ids: Vec<_> = c
            .all::<TransportMessageIdStamp>()
            .map(|s| s.id.as_str())
            .collect();
        assert_eq!(ids, ["42", "7", "remote"]);
        let ids: Vec<_> = b
            .all::<TransportMessageIdStamp>()
            .map(|s| s.id.as_str())
            .collect();
        assert_eq!(ids, ["42", "7"]);
        assert!(format!("{c:?}").contains("\"7\""));
        assert!(!c.into_sendable().has::<TransportMessageIdStamp>());
        let zero = Envelope::new(Ping(1)).with_local_id(LocalId::new(0));
        assert_eq!(zero.last::<TransportMessageIdStamp>().unwrap().id, "0");
    }

    #[test]
    fn making_an_unshared_envelope_sendable_keeps_its_body() {
        use crate::envelope::stamp::{ReceivedStamp, TransportMessageIdStamp};
        let mut e = Envelope::new(Ping(1))
            .with(BusNameStamp::new("bus"))
            .with(ReceivedStamp::new("async"))
            .with_local_id(LocalId::new(3));
        let before = Arc::as_ptr(&e.body);
        e.make_sendable();
        assert!(std::ptr::addr_eq(before, Arc::as_ptr(&e.body)));
        assert!(!e.has::<ReceivedStamp>() && !e.has::<TransportMessageIdStamp>());
        assert!(e.has::<BusNameStamp>());
        // A shared one is copied, and the other clone keeps its stamps.
        let other = e.clone().with(ReceivedStamp::new("b"));
        let mut shared = other.clone();
        shared.make_sendable();
        assert!(other.has::<ReceivedStamp>() && !shared.has::<ReceivedStamp>());
    }

    #[test]
    fn remove_last_removes_only_the_newest_of_its_type() {
        let mut e = Envelope::new(Ping(1))
            .with(SentStamp::new("a"))
            .with(DelayStamp { ms: 1 })
            .with(SentStamp::new("b"));
        e.remove_last::<SentStamp>();
        let sent: Vec<_> = e.all::<SentStamp>().map(|s| s.transport.as_str()).collect();
        assert_eq!(sent, ["a"]);
        e.remove_last::<HandledStamp>();
        assert_eq!(e.stamps().count(), 2);
    }
}
