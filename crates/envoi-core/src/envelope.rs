//! The [`Envelope`]: a message plus the stamps and headers that travel with it.

use std::any::{Any, TypeId};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::message::{Message, MessageKind};
use crate::stamp::{Stamp, StampEntry};

/// Object-safe view of a message inside an envelope.
pub(crate) trait ErasedMessage: Any + fmt::Debug + Send + Sync {
    fn as_any(&self) -> &dyn Any;
}

impl<M: Message> ErasedMessage for M {
    fn as_any(&self) -> &dyn Any {
        self
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
#[derive(Clone)]
pub struct Envelope {
    // One pointer: envelopes move through every step of the pipeline, so
    // keeping them small keeps the pipeline's futures small.
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    message: Arc<dyn ErasedMessage>,
    name: &'static str,
    kind: MessageKind,
    stamps: SmallVec<[StampEntry; 4]>,
    headers: Option<Arc<BTreeMap<String, String>>>,
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

    /// Wraps a message of the given kind.
    pub fn with_kind<M: Message>(message: M, kind: MessageKind) -> Self {
        Self::from_arc(Arc::new(message), kind)
    }

    /// Rebuilds an envelope around an already shared message, used by
    /// deserializers that produce the message behind an `Arc`.
    pub fn from_arc<M: Message>(message: Arc<M>, kind: MessageKind) -> Self {
        Self {
            inner: Arc::new(Inner {
                message,
                name: M::NAME,
                kind,
                stamps: SmallVec::new(),
                headers: None,
            }),
        }
    }

    /// Mutable access for the consuming builders; copies the stamps only when
    /// another clone shares them.
    #[inline]
    fn inner_mut(&mut self) -> &mut Inner {
        Arc::make_mut(&mut self.inner)
    }

    /// Returns a new envelope carrying `stamp` after the existing ones.
    #[must_use = "an envelope is immutable: `with` returns the stamped copy"]
    #[inline]
    pub fn with<S: Stamp>(mut self, stamp: S) -> Self {
        self.inner_mut().stamps.push(StampEntry::new(stamp));
        self
    }

    /// Returns a new envelope with header `key` set to `value`.
    #[must_use = "an envelope is immutable: `with_header` returns the new copy"]
    pub fn with_header(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        let headers = self
            .inner_mut()
            .headers
            .get_or_insert_with(Default::default);
        Arc::make_mut(headers).insert(key.into(), value.into());
        self
    }

    /// The most recently added stamp of type `S`.
    pub fn last<S: Stamp>(&self) -> Option<&S> {
        self.inner
            .stamps
            .iter()
            .rev()
            .find_map(|e| e.downcast::<S>())
    }

    /// Every stamp of type `S`, oldest first.
    pub fn all<S: Stamp>(&self) -> impl DoubleEndedIterator<Item = &S> + '_ {
        self.inner.stamps.iter().filter_map(|e| e.downcast::<S>())
    }

    /// Whether at least one stamp of type `S` is present.
    #[inline]
    pub fn has<S: Stamp>(&self) -> bool {
        let id = TypeId::of::<S>();
        self.inner.stamps.iter().any(|e| e.type_id() == id)
    }

    /// Every stamp, oldest first, as object-safe views (for serializers and
    /// debugging).
    pub fn stamps(&self) -> impl Iterator<Item = &dyn crate::stamp::ErasedStamp> + '_ {
        self.inner.stamps.iter().map(|e| e.erased())
    }

    /// Adds an already type-erased stamp (used by deserializers).
    #[must_use = "an envelope is immutable: `with_erased` returns the stamped copy"]
    pub fn with_erased(mut self, stamp: Arc<dyn crate::stamp::ErasedStamp>) -> Self {
        self.inner_mut().stamps.push(StampEntry::Other(stamp));
        self
    }

    /// The message, if it is an `M`.
    pub fn message<M: Message>(&self) -> Option<&M> {
        (*self.inner.message).as_any().downcast_ref::<M>()
    }

    /// The message as `&dyn Any`.
    pub fn message_any(&self) -> &dyn Any {
        (*self.inner.message).as_any()
    }

    /// The [`TypeId`] of the message.
    #[inline]
    pub fn message_type_id(&self) -> TypeId {
        (*self.inner.message).as_any().type_id()
    }

    /// The message's stable name ([`Message::NAME`]).
    pub fn message_name(&self) -> &'static str {
        self.inner.name
    }

    /// Whether the message was dispatched as a command, query or event.
    pub fn kind(&self) -> MessageKind {
        self.inner.kind
    }

    /// Header `key`, if set.
    pub fn header(&self, key: &str) -> Option<&str> {
        self.inner.headers.as_ref()?.get(key).map(String::as_str)
    }

    /// Every header.
    pub fn headers(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        self.inner
            .headers
            .iter()
            .flat_map(|h| h.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }

    /// This envelope with only its sendable stamps: what it looks like after
    /// a round trip through a transport. Used by in-process transports that
    /// store envelopes without encoding them.
    pub(crate) fn into_sendable(mut self) -> Self {
        if self.inner.stamps.iter().any(|e| !e.erased().sendable()) {
            self.inner_mut().stamps.retain(|e| e.erased().sendable());
        }
        self
    }

    /// Removes and returns the dispatches a handler deferred (internal to
    /// the dispatch-after-current-bus step).
    pub(crate) fn take_deferred(
        &mut self,
    ) -> Vec<crate::middleware::dispatch_after_current_bus::Deferred> {
        use crate::middleware::dispatch_after_current_bus::DeferredDispatches;
        if !self.has::<DeferredDispatches>() {
            return Vec::new();
        }
        let inner = self.inner_mut();
        let mut out = Vec::new();
        inner
            .stamps
            .retain(|e| match e.downcast::<DeferredDispatches>() {
                Some(d) => {
                    out.extend(d.0.iter().cloned());
                    false
                }
                None => true,
            });
        out
    }

    /// A copy of this envelope without any stamps, keeping message, kind and
    /// headers. Used when a message is sent again from scratch.
    pub fn without_stamps(&self) -> Self {
        Self {
            inner: Arc::new(Inner {
                message: self.inner.message.clone(),
                name: self.inner.name,
                kind: self.inner.kind,
                stamps: SmallVec::new(),
                headers: self.inner.headers.clone(),
            }),
        }
    }
}

impl fmt::Debug for Envelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &*self.inner;
        f.debug_struct("Envelope")
            .field("name", &i.name)
            .field("kind", &i.kind)
            .field("message", &i.message)
            .field("stamps", &i.stamps)
            .field("headers", &i.headers)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stamp::{BusNameStamp, DelayStamp, HandledStamp, HandlerResult, SentStamp};

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
    fn headers_are_copy_on_write() {
        let a = Envelope::event(Ping(1)).with_header("tenant", "acme");
        let b = a.clone().with_header("tenant", "other");
        assert_eq!(a.header("tenant"), Some("acme"));
        assert_eq!(b.header("tenant"), Some("other"));
        assert_eq!(a.kind(), MessageKind::Event);
    }
}
