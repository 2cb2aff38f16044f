//! Step 5 of the canonical pipeline: send routed messages to their
//! transports and stop there.

use std::any::TypeId;
use std::sync::Arc;

use crate::envelope::message::Message;
use crate::envelope::stamp::{ReceivedStamp, SentStamp, StampEntry};
use crate::envelope::type_map::TypeMap;
use crate::envelope::Envelope;
use crate::error::{BusError, Result};
use crate::middleware::{Middleware, Next};
use crate::transport::{handles_on_send, LocalFuture, SenderDispatcher, Transport};
use crate::BoxFuture;

/// Which transports each message type is sent to.
#[derive(Debug, Default, Clone)]
pub struct Routes {
    by_type: TypeMap<(&'static str, Vec<Arc<str>>)>,
}

impl Routes {
    /// No routes: everything is handled in process.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sends messages of type `M` to `transport` (in addition to any
    /// transport already routed).
    pub fn add<M: Message>(&mut self, transport: impl Into<Arc<str>>) {
        let entry = self
            .by_type
            .entry(TypeId::of::<M>())
            .or_insert_with(|| (M::NAME, Vec::new()));
        let transport = transport.into();
        if !entry.1.contains(&transport) {
            entry.1.push(transport);
        }
    }

    /// The transports for a message type.
    #[inline]
    pub fn get(&self, type_id: TypeId) -> Option<&[Arc<str>]> {
        self.by_type.get(&type_id).map(|(_, t)| t.as_slice())
    }

    /// Whether any route exists.
    pub fn is_empty(&self) -> bool {
        self.by_type.is_empty()
    }

    /// (message name, transports), sorted by name.
    pub fn describe(&self) -> Vec<(&'static str, Vec<String>)> {
        let mut out: Vec<_> = self
            .by_type
            .values()
            .map(|(n, t)| (*n, t.iter().map(|s| s.to_string()).collect()))
            .collect();
        out.sort();
        out
    }
}

/// One transport a message type is sent to, resolved when the step is built.
#[derive(Clone)]
pub(crate) struct Route {
    transport: Arc<str>,
    /// Its [`SentStamp`], made once and shared by every envelope sent there.
    sent: StampEntry,
    /// The transport, when the dispatcher would send to it through its
    /// in-process side anyway: the step then does so itself, without a
    /// boxed future.
    local: Option<Arc<dyn Transport>>,
    /// Whether the transport handles on send and hands the results back.
    answers: bool,
}

impl Route {
    /// The transport's name.
    pub(crate) fn transport(&self) -> &Arc<str> {
        &self.transport
    }

    /// Whether the transport hands the handlers' results back when it is
    /// sent to (it handles on send, as `sync://` does).
    pub(crate) fn answers(&self) -> bool {
        self.answers
    }

    fn new(transport: &Arc<str>, dispatcher: &dyn SenderDispatcher) -> Self {
        let direct = dispatcher.direct(transport);
        let answers = direct.as_deref().is_some_and(handles_on_send);
        let local = direct.filter(|t| t.as_local_sender().is_some() && !handles_on_send(&**t));
        Self {
            transport: transport.clone(),
            sent: StampEntry::new(SentStamp::new(transport.to_string())),
            local,
            answers,
        }
    }
}

/// If the message is routed and was not received from a transport, sends it
/// to every routed transport (adding one [`SentStamp`] each) and returns
/// without calling `next`. Otherwise calls `next`.
///
/// Sends go through a [`SenderDispatcher`], so a transactional outbox can
/// replace "send now".
#[derive(Clone)]
pub struct SendMessage {
    routes: Arc<Routes>,
    resolved: Arc<Resolved>,
    dispatcher: Arc<dyn SenderDispatcher>,
}

/// The routes by message type: a few are found faster by comparing type
/// ids than by hashing one (this runs for every dispatch).
enum Resolved {
    Few(Vec<(TypeId, Vec<Route>)>),
    Many(TypeMap<Vec<Route>>),
}

impl Resolved {
    /// Up to this many routed types are scanned.
    const FEW: usize = 8;

    fn new(routes: Vec<(TypeId, Vec<Route>)>) -> Self {
        if routes.len() <= Self::FEW {
            Resolved::Few(routes)
        } else {
            Resolved::Many(routes.into_iter().collect())
        }
    }

    #[inline]
    fn is_empty(&self) -> bool {
        match self {
            Resolved::Few(routes) => routes.is_empty(),
            Resolved::Many(routes) => routes.is_empty(),
        }
    }

    #[inline]
    fn get(&self, type_id: TypeId) -> Option<&[Route]> {
        match self {
            Resolved::Few(routes) => routes
                .iter()
                .find(|(id, _)| *id == type_id)
                .map(|(_, r)| r.as_slice()),
            Resolved::Many(routes) => routes.get(&type_id).map(Vec::as_slice),
        }
    }
}

impl std::fmt::Debug for SendMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendMessage")
            .field("routes", &self.routes.describe())
            .finish()
    }
}

impl SendMessage {
    /// The step with these routes and dispatcher.
    pub fn new(routes: Arc<Routes>, dispatcher: Arc<dyn SenderDispatcher>) -> Self {
        let resolved: Vec<(TypeId, Vec<Route>)> = routes
            .by_type
            .iter()
            .map(|(id, (_, transports))| {
                let routes = transports
                    .iter()
                    .map(|t| Route::new(t, &*dispatcher))
                    .collect();
                (*id, routes)
            })
            .collect();
        Self {
            routes,
            resolved: Arc::new(Resolved::new(resolved)),
            dispatcher,
        }
    }

    /// The routes.
    pub fn routes(&self) -> &Routes {
        &self.routes
    }

    /// The dispatcher.
    pub fn dispatcher(&self) -> &Arc<dyn SenderDispatcher> {
        &self.dispatcher
    }

    /// The transports `envelope` must be sent to, or `None` when it goes on
    /// to the handlers.
    #[inline]
    pub(crate) fn targets(&self, envelope: &Envelope) -> Option<&[Route]> {
        if self.resolved.is_empty() || envelope.has::<ReceivedStamp>() {
            return None;
        }
        self.resolved.get(envelope.message_type_id())
    }

    /// Starts sending `envelope` to `targets`. One transport in this
    /// process that stores the envelope at once (the in-memory transport)
    /// is sent to right here, with nothing to box; anything else is left
    /// to a boxed [`Self::send`].
    #[inline]
    pub(crate) fn start<'a>(&'a self, envelope: Envelope, targets: &'a [Route]) -> Started<'a> {
        if let [route] = targets {
            if let Some(local) = route.local.as_ref().and_then(|t| t.as_local_sender()) {
                return match local.send_envelope(envelope.with_entry(route.sent.clone())) {
                    LocalFuture::Ready(Some(result)) => Started::Done(result.map_err(unsent)),
                    pending => {
                        Started::Pending(Box::pin(async move { pending.await.map_err(unsent) }))
                    }
                };
            }
        }
        Started::Pending(Box::pin(self.send(envelope, targets)))
    }

    pub(crate) async fn send(&self, mut envelope: Envelope, targets: &[Route]) -> Result<Envelope> {
        for route in targets {
            envelope = match route.local.as_ref().and_then(|t| t.as_local_sender()) {
                // Stamped before it is sent: the transport stores the
                // envelope it returns (dropping the non-sendable stamps when
                // it hands it out), so a stamp added afterwards would copy
                // the stamps of a shared envelope.
                Some(local) => local
                    .send_envelope(envelope.with_entry(route.sent.clone()))
                    .await
                    .map_err(unsent)?,
                None => self
                    .dispatcher
                    .send(&route.transport, envelope)
                    .await?
                    .with_entry(route.sent.clone()),
            };
        }
        Ok(envelope)
    }
}

/// What [`SendMessage::start`] left to do.
pub(crate) enum Started<'a> {
    /// Sent: the envelope as sent, or why it was not.
    Done(Result<Envelope>),
    /// Still sending.
    Pending(BoxFuture<'a, Result<Envelope>>),
}

/// A failed send's error, its envelope without the [`SentStamp`] added
/// before the send.
#[cold]
fn unsent(mut error: BusError) -> BusError {
    match &mut error {
        BusError::HandlerFailed { envelope, .. }
        | BusError::DelayedHandlingFailed { envelope, .. }
        | BusError::Transport {
            envelope: Some(envelope),
            ..
        } => envelope.remove_last::<SentStamp>(),
        _ => {}
    }
    error
}

impl Middleware for SendMessage {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(async move {
            match self.targets(&envelope) {
                Some(targets) => self.send(envelope, targets).await,
                None => next.run(envelope).await,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Ping, RecordingEndpoint, RecordingSenders};

    fn step(senders: &RecordingSenders) -> SendMessage {
        let mut routes = Routes::new();
        routes.add::<Ping>("async");
        routes.add::<Ping>("audit");
        SendMessage::new(Arc::new(routes), Arc::new(senders.clone()))
    }

    #[tokio::test]
    async fn a_routed_message_is_sent_to_each_transport_and_next_is_not_called() {
        let senders = RecordingSenders::default();
        let end = RecordingEndpoint::new();
        let out = step(&senders)
            .handle(Envelope::new(Ping), end.next())
            .await
            .unwrap();
        assert!(end.calls().is_empty());
        let sent: Vec<_> = out
            .all::<SentStamp>()
            .map(|s| s.transport.clone())
            .collect();
        assert_eq!(sent, ["async", "audit"]);
        assert_eq!(senders.sent_to(), ["async", "audit"]);
    }

    #[tokio::test]
    async fn a_received_message_goes_on_to_next() {
        let senders = RecordingSenders::default();
        let end = RecordingEndpoint::new();
        let e = Envelope::new(Ping).with(ReceivedStamp::new("async"));
        step(&senders).handle(e, end.next()).await.unwrap();
        assert_eq!(end.calls().len(), 1);
        assert!(senders.sent_to().is_empty());
    }

    #[tokio::test]
    async fn a_message_routed_to_an_in_memory_transport_is_stored_and_stamped() {
        use crate::envelope::stamp::TransportMessageIdStamp;
        use crate::transport::in_memory::InMemoryTransport;
        use crate::transport::registry::{Senders, TransportSender};
        use crate::transport::{LocalReceiver, Payload};

        let queue = Arc::new(InMemoryTransport::new());
        let mut senders = Senders::new();
        senders.insert_transport(
            "async",
            TransportSender::new(
                "async",
                queue.clone(),
                crate::transport::serializer::Serializer::builder()
                    .build()
                    .unwrap(),
            ),
        );
        let mut routes = Routes::new();
        routes.add::<Ping>("async");
        let step = SendMessage::new(Arc::new(routes), Arc::new(senders));
        let end = RecordingEndpoint::new();
        let out = step.handle(Envelope::new(Ping), end.next()).await.unwrap();
        assert!(end.calls().is_empty());
        assert_eq!(out.last::<SentStamp>().unwrap().transport, "async");
        let id = out.last::<TransportMessageIdStamp>().unwrap().id.clone();
        let got = queue.get_local(10).await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].id.to_string(), id);
        let Payload::Envelope(handed_out) = &got[0].payload else {
            panic!("expected an envelope")
        };
        assert!(!handed_out.has::<SentStamp>());
        assert!(!handed_out.has::<TransportMessageIdStamp>());
        let Payload::Envelope(stored) = &queue.stored()[0].payload else {
            panic!("expected an envelope")
        };
        assert!(!stored.has::<SentStamp>());
        assert!(!stored.has::<TransportMessageIdStamp>());
        assert!(stored.message::<Ping>().is_some());
        // The envelope the step returned keeps its stamps.
        assert_eq!(out.last::<SentStamp>().unwrap().transport, "async");
        assert_eq!(out.last::<TransportMessageIdStamp>().unwrap().id, id);
    }

    /// An in-process transport whose sends fail, handing the envelope back.
    struct Refusing;

    impl crate::transport::LocalSender for Refusing {
        fn send_envelope(
            &self,
            envelope: Envelope,
        ) -> crate::transport::LocalFuture<'_, Result<Envelope>> {
            crate::transport::LocalFuture::ready(Err(BusError::Transport {
                transport: "refusing".into(),
                envelope: Some(Box::new(envelope)),
                source: crate::error::TransportError::Unsupported("send"),
            }))
        }

        fn handles_on_send(&self) -> bool {
            false
        }
    }

    impl Transport for Refusing {
        fn send(
            &self,
            _message: crate::transport::RawMessage,
            _delay: Option<std::time::Duration>,
        ) -> BoxFuture<'_, Result<String, crate::error::TransportError>> {
            Box::pin(async { Err(crate::error::TransportError::Unsupported("send")) })
        }

        fn as_receiver(&self) -> Option<&dyn crate::transport::Receiver> {
            None
        }

        fn as_local_sender(&self) -> Option<&dyn crate::transport::LocalSender> {
            Some(self)
        }
    }

    #[tokio::test]
    async fn a_failed_local_send_hands_back_the_envelope_without_its_sent_stamp() {
        use crate::transport::registry::{Senders, TransportSender};

        let mut senders = Senders::new();
        senders.insert_transport(
            "refusing",
            TransportSender::new(
                "refusing",
                Arc::new(Refusing),
                crate::transport::serializer::Serializer::builder()
                    .build()
                    .unwrap(),
            ),
        );
        let mut routes = Routes::new();
        routes.add::<Ping>("refusing");
        let step = SendMessage::new(Arc::new(routes), Arc::new(senders));
        let end = RecordingEndpoint::new();
        let sent_before = Envelope::new(Ping).with(SentStamp::new("earlier"));
        let err = step.handle(sent_before, end.next()).await.unwrap_err();
        let BusError::Transport {
            envelope: Some(envelope),
            ..
        } = err
        else {
            panic!("expected a transport error, got {err:?}")
        };
        let sent: Vec<_> = envelope
            .all::<SentStamp>()
            .map(|s| s.transport.as_str())
            .collect();
        assert_eq!(sent, ["earlier"]);
        assert!(end.calls().is_empty());
    }

    #[test]
    fn routes_are_found_however_many_types_are_routed() {
        macro_rules! messages {
            ($($name:ident),*) => {$(
                #[derive(Debug)]
                struct $name;
                impl Message for $name {
                    const NAME: &'static str = stringify!($name);
                }
            )*};
        }
        messages!(A, B, C, D, E, F, G, H, I);
        let mut few = Routes::new();
        few.add::<A>("a");
        few.add::<B>("b");
        let mut many = few.clone();
        many.add::<C>("c");
        many.add::<D>("d");
        many.add::<E>("e");
        many.add::<F>("f");
        many.add::<G>("g");
        many.add::<H>("h");
        many.add::<I>("i");
        for routes in [few, many.clone()] {
            let n = routes.by_type.len();
            let step = SendMessage::new(Arc::new(routes), Arc::new(RecordingSenders::default()));
            let to = |e: Envelope| step.targets(&e).map(|r| r[0].transport.to_string());
            assert_eq!(to(Envelope::new(B)).as_deref(), Some("b"), "{n} routed");
            assert_eq!(to(Envelope::new(Ping)), None, "{n} routed");
            assert_eq!(to(Envelope::new(B).with(ReceivedStamp::new("b"))), None);
        }
        let step = SendMessage::new(Arc::new(many), Arc::new(RecordingSenders::default()));
        assert!(matches!(*step.resolved, Resolved::Many(_)));
        assert_eq!(
            step.targets(&Envelope::new(I)).unwrap()[0]
                .transport
                .as_ref(),
            "i"
        );
    }

    #[tokio::test]
    async fn an_unrouted_message_goes_on_to_next() {
        let senders = RecordingSenders::default();
        let end = RecordingEndpoint::new();
        let s = SendMessage::new(Arc::new(Routes::new()), Arc::new(senders.clone()));
        s.handle(Envelope::new(Ping), end.next()).await.unwrap();
        assert_eq!(end.calls().len(), 1);
    }
}
