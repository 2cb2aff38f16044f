//! [`Messenger`] and its builder: the configuration layer that registers
//! handlers, buses, user middleware, routes, senders and retry policies and
//! assembles each bus in the canonical order.
//!
//! ```
//! use envoi_core::{Command, Event, Message, Messenger};
//! use std::convert::Infallible;
//!
//! #[derive(Debug, Clone)]
//! struct Ship { order: u32 }
//! impl Message for Ship { const NAME: &'static str = "Ship"; }
//! impl Command for Ship { type Output = (); type Error = Infallible; }
//!
//! #[derive(Debug, Clone)]
//! struct Shipped { order: u32 }
//! impl Message for Shipped { const NAME: &'static str = "Shipped"; }
//! impl Event for Shipped { type Error = Infallible; }
//!
//! let messenger = Messenger::builder()
//!     .command_handler(|_: Ship| async { Ok::<_, Infallible>(()) })
//!     .event_handler(|_: Shipped| async { Ok::<_, Infallible>(()) })
//!     .event_handler(|_: Shipped| async { Ok::<_, Infallible>(()) })
//!     .bus("event.bus", |bus| bus)
//!     .build()
//!     .unwrap();
//! assert_eq!(messenger.bus().name(), "default");
//! assert!(messenger.bus_named("event.bus").is_some());
//! println!("{}", messenger.debug());
//! ```

use std::any::TypeId;
use std::collections::BTreeMap;
use std::fmt;
use std::fmt::Write as _;
use std::sync::{Arc, Weak};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::envelope::message::{Command, Event, Message, MessageKind, Query};
use crate::envelope::stamp::BusNameStamp;
use crate::envelope::stamp::Stamp;
use crate::envelope::Envelope;
use crate::error::{BusError, TransportError};
use crate::failure::{RetryConfig, RetryStrategy};
use crate::middleware::Middleware;
use crate::pipeline::bus::MessageBus;
use crate::pipeline::handle_message::HandleMessage;
use crate::pipeline::handler::{Handler, HandlerRegistry, IntoHandler};
use crate::pipeline::retry::Retry;
use crate::pipeline::send_message::{Routes, SendMessage};
use crate::transport::registry::{Senders, TransportFactories, TransportSender};
use crate::transport::serializer::{RegistryError, Serializer, SerializerBuilder};
use crate::transport::{
    Inbox, Sender, SenderDispatcher, Transport, TransportBinding, TransportFactory,
};
use crate::typed::Dispatcher;
use crate::BoxFuture;

/// A configuration mistake found by [`MessengerBuilder::build`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// A command or query got a second handler.
    #[error("{kind} `{message}` already has a handler; a {kind} has exactly one")]
    DuplicateHandler {
        /// The message name.
        message: &'static str,
        /// Its kind.
        kind: MessageKind,
    },
    /// One message type was registered as two kinds.
    #[error("`{message}` is registered both as {first} and as {second}")]
    KindConflict {
        /// The message name.
        message: &'static str,
        /// The first kind.
        first: MessageKind,
        /// The second kind.
        second: MessageKind,
    },
    /// Two buses have one name.
    #[error("bus `{0}` is defined twice")]
    DuplicateBus(String),
    /// A route names a transport with no sender.
    #[error("`{message}` is routed to `{transport}`, which is not a configured transport")]
    UnknownTransport {
        /// The message name.
        message: &'static str,
        /// The transport name.
        transport: String,
    },
    /// A failure transport is not a configured transport.
    #[error("failure transport `{0}` is not a configured transport")]
    UnknownFailureTransport(String),
    /// A failure transport handles messages when they are sent
    /// (`sync://`): parking a message there would handle it again at once,
    /// fail again and park it again, without end.
    #[error(
        "failure transport `{0}` handles messages when they are sent (`sync://`); \
         a failure transport must store them"
    )]
    FailureTransportHandlesOnSend(String),
    /// Two transports (or a transport and a sender) have one name.
    #[error("transport `{0}` is defined twice")]
    DuplicateTransport(String),
    /// Two message or stamp types share a wire name.
    #[error(transparent)]
    Serializer(#[from] RegistryError),
    /// A transport could not be created from its DSN.
    #[error("transport `{name}`: {reason}")]
    Transport {
        /// The transport's name.
        name: String,
        /// Why (the DSN in it has its password masked).
        reason: String,
    },
    /// A transport is configured by DSN, which needs
    /// [`MessengerBuilder::build_async`].
    #[error("transport `{0}` is configured by DSN; build with `build_async().await`")]
    NeedsAsyncBuild(String),
}

/// The configuration of one bus; see [`MessengerBuilder::bus`].
#[derive(Default)]
pub struct BusBuilder {
    middleware: Vec<Arc<dyn Middleware>>,
}

impl BusBuilder {
    /// Appends a user middleware (step 4 of the canonical order,
    /// registration order).
    pub fn middleware(mut self, middleware: impl Middleware) -> Self {
        self.middleware.push(Arc::new(middleware));
        self
    }

    /// Appends a shared user middleware.
    pub fn middleware_arc(mut self, middleware: Arc<dyn Middleware>) -> Self {
        self.middleware.push(middleware);
        self
    }
}

impl fmt::Debug for BusBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BusBuilder")
            .field(
                "middleware",
                &self.middleware.iter().map(|m| m.name()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// Builds a [`Messenger`]; see [`Messenger::builder`].
#[must_use = "a builder does nothing until `build` is called"]
pub struct MessengerBuilder {
    registry: HandlerRegistry,
    errors: Vec<BuildError>,
    default_bus: String,
    buses: Vec<(String, BusBuilder)>,
    default_middleware: Vec<Arc<dyn Middleware>>,
    routes: Routes,
    route_checks: Vec<(&'static str, String)>,
    senders: Vec<(String, Arc<dyn Sender>)>,
    transports: Vec<(String, TransportSpec)>,
    factories: TransportFactories,
    serializer: SerializerBuilder,
    sender_dispatcher: Option<Arc<dyn SenderDispatcher>>,
    retry_strategies: Vec<(Option<String>, Arc<dyn RetryStrategy>)>,
    failure_transports: Vec<(Option<String>, String)>,
}

enum TransportSpec {
    Ready(Arc<dyn Transport>),
    Dsn(String),
}

impl Default for MessengerBuilder {
    fn default() -> Self {
        Self {
            registry: HandlerRegistry::default(),
            errors: Vec::new(),
            default_bus: "default".into(),
            buses: Vec::new(),
            default_middleware: Vec::new(),
            routes: Routes::new(),
            route_checks: Vec::new(),
            senders: Vec::new(),
            transports: Vec::new(),
            factories: TransportFactories::default(),
            serializer: SerializerBuilder::default(),
            sender_dispatcher: None,
            retry_strategies: Vec::new(),
            failure_transports: Vec::new(),
        }
    }
}

impl fmt::Debug for MessengerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessengerBuilder")
            .field("handlers", &self.registry)
            .field("routes", &self.routes)
            .finish_non_exhaustive()
    }
}

impl MessengerBuilder {
    fn register<M: Message, H: Handler<M>>(&mut self, kind: MessageKind, handler: H) {
        if let Some(existing) = self.registry.get(TypeId::of::<M>()) {
            if existing.kind != kind {
                self.errors.push(BuildError::KindConflict {
                    message: M::NAME,
                    first: existing.kind,
                    second: kind,
                });
                return;
            }
            if kind != MessageKind::Event {
                self.errors.push(BuildError::DuplicateHandler {
                    message: M::NAME,
                    kind,
                });
                return;
            }
        }
        self.registry.add::<M, H>(kind, handler);
    }

    /// Registers the handler of command `C` (exactly one per command).
    pub fn command_handler<C, H, Marker>(mut self, handler: H) -> Self
    where
        C: Command,
        H: IntoHandler<C, Marker>,
        H::Handler: Handler<C, Output = C::Output, Error = C::Error>,
    {
        self.register::<C, _>(MessageKind::Command, handler.into_handler());
        self
    }

    /// Registers the handler of query `Q` (exactly one per query).
    pub fn query_handler<Q, H, Marker>(mut self, handler: H) -> Self
    where
        Q: Query,
        H: IntoHandler<Q, Marker>,
        H::Handler: Handler<Q, Output = Q::Output, Error = Q::Error>,
    {
        self.register::<Q, _>(MessageKind::Query, handler.into_handler());
        self
    }

    /// Adds a handler of event `E` (any number per event, run in
    /// registration order).
    pub fn event_handler<E, H, Marker>(mut self, handler: H) -> Self
    where
        E: Event,
        H: IntoHandler<E, Marker>,
        H::Handler: Handler<E, Output = (), Error = E::Error>,
    {
        self.register::<E, _>(MessageKind::Event, handler.into_handler());
        self
    }

    /// Renames the default bus (`"default"` unless renamed).
    pub fn default_bus(mut self, name: impl Into<String>) -> Self {
        self.default_bus = name.into();
        self
    }

    /// Appends a user middleware to the default bus.
    pub fn middleware(mut self, middleware: impl Middleware) -> Self {
        self.default_middleware.push(Arc::new(middleware));
        self
    }

    /// Appends a shared user middleware to the default bus.
    pub fn middleware_arc(mut self, middleware: Arc<dyn Middleware>) -> Self {
        self.default_middleware.push(middleware);
        self
    }

    /// Defines another bus. Every bus shares the handlers, routes and
    /// transports; each has its own name and user middleware.
    pub fn bus(
        mut self,
        name: impl Into<String>,
        configure: impl FnOnce(BusBuilder) -> BusBuilder,
    ) -> Self {
        self.buses
            .push((name.into(), configure(BusBuilder::default())));
        self
    }

    /// Sends messages of type `M` to `transport` instead of handling them in
    /// process. May be called several times for several transports.
    ///
    /// Registers `M` with the serializer, so it can be encoded here and
    /// decoded by the worker.
    pub fn route<M>(mut self, transport: impl Into<String>) -> Self
    where
        M: Message + Serialize + DeserializeOwned,
    {
        let transport = transport.into();
        self.route_checks.push((M::NAME, transport.clone()));
        self.routes.add::<M>(transport);
        self.serializer.add_message::<M>();
        self
    }

    /// Registers message type `M` with the serializer without routing it:
    /// for types this process only receives from a transport. Only
    /// registered types decode.
    pub fn message<M>(mut self) -> Self
    where
        M: Message + Serialize + DeserializeOwned,
    {
        self.serializer.add_message::<M>();
        self
    }

    /// Registers stamp type `S` with the serializer, so its header decodes
    /// to `S` (unregistered stamp headers are kept as
    /// [`OpaqueStamp`](crate::transport::serializer::OpaqueStamp)s).
    pub fn stamp<S: Stamp>(mut self) -> Self {
        self.serializer.add_stamp::<S>();
        self
    }

    /// Limits the size of an encoded message body, in bytes (16 MiB by
    /// default). Larger messages fail to send; received ones go to the
    /// failure transport.
    pub fn max_body_size(mut self, bytes: usize) -> Self {
        self.serializer.set_max_body_size(bytes);
        self
    }

    /// Limits the size of an encoded message's headers, in bytes: every
    /// header name and value added up, stamp headers included (1 MiB by
    /// default). Messages with larger headers fail to send; received ones
    /// go to the failure transport.
    pub fn max_headers_size(mut self, bytes: usize) -> Self {
        self.serializer.set_max_headers_size(bytes);
        self
    }

    /// Registers the sender of `transport`.
    pub fn sender(mut self, transport: impl Into<String>, sender: Arc<dyn Sender>) -> Self {
        self.senders.push((transport.into(), sender));
        self
    }

    /// Registers `transport` under `name`: routes, retries and failure
    /// transports can name it, workers can consume it, and
    /// [`Messenger::transport`] hands it out.
    pub fn transport(mut self, name: impl Into<String>, transport: Arc<dyn Transport>) -> Self {
        self.transports
            .push((name.into(), TransportSpec::Ready(transport)));
        self
    }

    /// Registers a transport created from `dsn` (`in-memory://`, `sync://`,
    /// or any scheme of a registered [`TransportFactory`]) when the
    /// messenger is built with [`build_async`](Self::build_async).
    pub fn transport_dsn(mut self, name: impl Into<String>, dsn: impl Into<String>) -> Self {
        self.transports
            .push((name.into(), TransportSpec::Dsn(dsn.into())));
        self
    }

    /// Registers a factory for [`transport_dsn`](Self::transport_dsn);
    /// it is asked before the built-in ones.
    pub fn transport_factory(mut self, factory: impl TransportFactory) -> Self {
        self.factories.register(Arc::new(factory));
        self
    }

    /// Creates the transports configured by DSN, then builds as
    /// [`build`](Self::build) does. A DSN that no factory supports or that
    /// its factory refuses is a [`BuildError::Transport`].
    pub async fn build_async(mut self) -> Result<Messenger, BuildError> {
        let specs = std::mem::take(&mut self.transports);
        let mut ready = Vec::with_capacity(specs.len());
        for (name, spec) in specs {
            let transport = match spec {
                TransportSpec::Ready(t) => t,
                TransportSpec::Dsn(dsn) => {
                    self.factories
                        .create(&name, &dsn)
                        .await
                        .map_err(|e| BuildError::Transport {
                            name: name.clone(),
                            reason: e.to_string(),
                        })?
                }
            };
            ready.push((name, TransportSpec::Ready(transport)));
        }
        self.transports = ready;
        self.build()
    }

    /// Replaces "send now" with another [`SenderDispatcher`] (a
    /// transactional outbox, for instance). Routes and failure transports
    /// are then not checked against registered transports and senders.
    pub fn sender_dispatcher(mut self, dispatcher: Arc<dyn SenderDispatcher>) -> Self {
        self.sender_dispatcher = Some(dispatcher);
        self
    }

    /// Uses `strategy` for messages received from `transport`.
    pub fn retry_strategy(
        mut self,
        transport: impl Into<String>,
        strategy: impl RetryStrategy,
    ) -> Self {
        self.retry_strategies
            .push((Some(transport.into()), Arc::new(strategy)));
        self
    }

    /// Uses `strategy` for transports without their own.
    pub fn default_retry_strategy(mut self, strategy: impl RetryStrategy) -> Self {
        self.retry_strategies.push((None, Arc::new(strategy)));
        self
    }

    /// Parks messages that are out of retries in `transport`.
    pub fn failure_transport(mut self, transport: impl Into<String>) -> Self {
        self.failure_transports.push((None, transport.into()));
        self
    }

    /// Parks messages from `transport` that are out of retries in `failure`.
    pub fn failure_transport_for(
        mut self,
        transport: impl Into<String>,
        failure: impl Into<String>,
    ) -> Self {
        self.failure_transports
            .push((Some(transport.into()), failure.into()));
        self
    }

    /// Checks the configuration and assembles every bus. Transports
    /// configured by DSN need [`build_async`](Self::build_async).
    pub fn build(mut self) -> Result<Messenger, BuildError> {
        if let Some(e) = self.errors.into_iter().next() {
            return Err(e);
        }
        let serializer = self.serializer.build()?;
        let mut transports: BTreeMap<String, Arc<dyn Transport>> = BTreeMap::new();
        let mut senders = Senders::new();
        for (name, spec) in self.transports {
            let transport = match spec {
                TransportSpec::Ready(t) => t,
                TransportSpec::Dsn(_) => return Err(BuildError::NeedsAsyncBuild(name)),
            };
            if transports.contains_key(&name) {
                return Err(BuildError::DuplicateTransport(name));
            }
            senders.insert_transport(
                name.clone(),
                TransportSender::new(name.as_str(), transport.clone(), serializer.clone()),
            );
            transports.insert(name, transport);
        }
        for (name, sender) in self.senders {
            if senders.contains(&name) {
                return Err(BuildError::DuplicateTransport(name));
            }
            senders.insert_sender(name, sender);
        }
        for (_, failure) in &self.failure_transports {
            if transports
                .get(failure)
                .and_then(|t| t.as_local_sender())
                .is_some_and(|l| l.handles_on_send())
            {
                return Err(BuildError::FailureTransportHandlesOnSend(failure.clone()));
            }
        }
        let dispatcher: Arc<dyn SenderDispatcher> = match self.sender_dispatcher.take() {
            Some(d) => d,
            None => {
                for (message, transport) in &self.route_checks {
                    if !senders.contains(transport) {
                        return Err(BuildError::UnknownTransport {
                            message,
                            transport: transport.clone(),
                        });
                    }
                }
                for (_, failure) in &self.failure_transports {
                    if !senders.contains(failure) {
                        return Err(BuildError::UnknownFailureTransport(failure.clone()));
                    }
                }
                Arc::new(senders)
            }
        };
        let has_transports = !dispatcher.transports().is_empty()
            || !self.routes.is_empty()
            || !transports.is_empty();
        let mut retry_config = None;
        let retry = if has_transports {
            let mut cfg = RetryConfig::new(dispatcher.clone());
            for (name, transport) in &transports {
                if transport
                    .as_local_sender()
                    .is_some_and(|l| l.handles_on_send())
                {
                    cfg = cfg.without_retry(name.clone());
                }
            }
            for (transport, strategy) in self.retry_strategies {
                cfg = match transport {
                    Some(t) => cfg.strategy(t, strategy),
                    None => cfg.default_strategy(strategy),
                };
            }
            for (transport, failure) in self.failure_transports {
                cfg = match transport {
                    Some(t) => cfg.failure_transport_for(t, failure),
                    None => cfg.failure_transport(failure),
                };
            }
            let cfg = Arc::new(cfg);
            retry_config = Some(cfg.clone());
            Retry::new(Some(cfg))
        } else {
            Retry::new(None)
        };
        let send = if self.routes.is_empty() {
            None
        } else {
            Some(SendMessage::new(Arc::new(self.routes), dispatcher.clone()))
        };
        let handle = HandleMessage::with_registry(Arc::new(self.registry));

        let mut specs = vec![(
            self.default_bus.clone(),
            BusBuilder {
                middleware: self.default_middleware,
            },
        )];
        specs.extend(self.buses);
        let mut buses = BTreeMap::new();
        let mut order = Vec::new();
        for (name, spec) in specs {
            if buses.contains_key(&name) {
                return Err(BuildError::DuplicateBus(name));
            }
            let bus = MessageBus::new(
                Arc::from(name.as_str()),
                spec.middleware,
                send.clone(),
                retry.clone(),
                handle.clone(),
            );
            order.push(name.clone());
            buses.insert(name, bus);
        }
        let default = buses[&self.default_bus].clone();
        let messenger = Messenger {
            inner: Arc::new(MessengerInner {
                buses,
                order,
                default,
                dispatcher,
                transports,
                serializer,
                retry: retry_config,
            }),
        };
        let inbox: Weak<dyn Inbox> = Arc::downgrade(&messenger.inner) as Weak<dyn Inbox>;
        for (name, transport) in &messenger.inner.transports {
            transport.bind(&TransportBinding::new(
                Arc::from(name.as_str()),
                messenger.inner.serializer.clone(),
                inbox.clone(),
            ));
        }
        Ok(messenger)
    }
}

impl Inbox for MessengerInner {
    fn dispatch_received(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope, BusError>> {
        let bus = envelope
            .last::<BusNameStamp>()
            .and_then(|b| self.buses.get(&*b.bus))
            .unwrap_or(&self.default);
        Box::pin(bus.dispatch(envelope))
    }
}

struct MessengerInner {
    buses: BTreeMap<String, MessageBus>,
    order: Vec<String>,
    default: MessageBus,
    dispatcher: Arc<dyn SenderDispatcher>,
    transports: BTreeMap<String, Arc<dyn Transport>>,
    serializer: Serializer,
    retry: Option<Arc<RetryConfig>>,
}

/// A handle to a [`Messenger`] that does not keep it alive; transports that
/// dispatch (the sync transport) hold one.
#[derive(Clone, Default)]
pub struct WeakMessenger(Weak<MessengerInner>);

impl WeakMessenger {
    /// The messenger, if it still exists.
    pub fn upgrade(&self) -> Option<Messenger> {
        self.0.upgrade().map(|inner| Messenger { inner })
    }
}

impl fmt::Debug for WeakMessenger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WeakMessenger")
    }
}

/// A configured application: its buses, handlers, routes and senders. Cheap
/// to clone.
#[derive(Clone)]
pub struct Messenger {
    inner: Arc<MessengerInner>,
}

impl fmt::Debug for Messenger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Messenger")
            .field("buses", &self.inner.order)
            .finish()
    }
}

impl Messenger {
    /// Starts a configuration.
    pub fn builder() -> MessengerBuilder {
        MessengerBuilder::default()
    }

    /// The default bus.
    pub fn bus(&self) -> &MessageBus {
        &self.inner.default
    }

    /// The bus called `name`.
    pub fn bus_named(&self, name: &str) -> Option<&MessageBus> {
        self.inner.buses.get(name)
    }

    /// Every bus, default first, then in definition order.
    pub fn buses(&self) -> impl Iterator<Item = &MessageBus> + '_ {
        self.inner.order.iter().map(move |n| &self.inner.buses[n])
    }

    /// A typed dispatcher on the default bus.
    pub fn dispatcher(&self) -> Dispatcher {
        Dispatcher::new(self.inner.default.clone())
    }

    /// The sender dispatcher every bus sends through.
    pub fn sender_dispatcher(&self) -> &Arc<dyn SenderDispatcher> {
        &self.inner.dispatcher
    }

    /// The transport registered as `name`.
    pub fn transport(&self, name: &str) -> Option<&Arc<dyn Transport>> {
        self.inner.transports.get(name)
    }

    /// Every registered transport with its name, sorted by name.
    pub fn transports(&self) -> impl Iterator<Item = (&str, &Arc<dyn Transport>)> + '_ {
        self.inner.transports.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// The names of the registered transports, sorted.
    pub fn transport_names(&self) -> Vec<&str> {
        self.inner.transports.keys().map(String::as_str).collect()
    }

    /// The serializer transports and workers encode and decode with.
    pub fn serializer(&self) -> &Serializer {
        &self.inner.serializer
    }

    /// The retry configuration, when the messenger has transports.
    pub fn retry_config(&self) -> Option<&RetryConfig> {
        self.inner.retry.as_deref()
    }

    /// The failure transport of messages received from `transport`.
    pub fn failure_transport_for(&self, transport: &str) -> Option<&str> {
        self.inner.retry.as_ref()?.failure_for(transport)
    }

    /// Every configured failure transport, sorted, without duplicates.
    pub fn failure_transports(&self) -> Vec<&str> {
        self.inner
            .retry
            .as_ref()
            .map(|r| r.failure_transports())
            .unwrap_or_default()
    }

    /// Sets up every registered transport that needs it
    /// ([`Setup::setup`](crate::transport::Setup::setup)), in name order,
    /// and returns each one's result (`Ok` for a transport with nothing to
    /// set up).
    pub async fn setup_transports(&self) -> Vec<(String, Result<(), TransportError>)> {
        let mut out = Vec::with_capacity(self.inner.transports.len());
        for (name, transport) in &self.inner.transports {
            let result = match transport.as_setup() {
                Some(setup) => setup.setup().await,
                None => Ok(()),
            };
            out.push((name.clone(), result));
        }
        out
    }

    /// A handle that does not keep the messenger alive.
    pub fn downgrade(&self) -> WeakMessenger {
        WeakMessenger(Arc::downgrade(&self.inner))
    }

    /// A readable listing of each bus's pipeline, the routes and the
    /// handlers.
    pub fn debug(&self) -> String {
        let mut out = String::new();
        for bus in self.buses() {
            let _ = writeln!(out, "bus {}", bus.name());
            for (i, step) in bus.pipeline().iter().enumerate() {
                let _ = writeln!(out, "  {}. {}", i + 1, step);
            }
        }
        let bus = self.bus();
        if let Some(send) = bus.send_step() {
            let _ = writeln!(out, "routes");
            for (message, transports) in send.routes().describe() {
                let _ = writeln!(out, "  {message} -> {}", transports.join(", "));
            }
        }
        if !self.inner.transports.is_empty() {
            let _ = writeln!(out, "transports");
            for (name, transport) in &self.inner.transports {
                let mut notes = Vec::new();
                if let Some(f) = self.failure_transport_for(name) {
                    if f != name {
                        notes.push(format!("failures -> {f}"));
                    }
                }
                if self.failure_transports().contains(&name.as_str()) {
                    notes.push("failure transport".into());
                }
                if transport.as_local_sender().is_some() {
                    notes.push("in process".into());
                }
                if transport.as_receiver().is_none() {
                    notes.push("nothing to consume".into());
                }
                let _ = if notes.is_empty() {
                    writeln!(out, "  {name}")
                } else {
                    writeln!(out, "  {name} ({})", notes.join(", "))
                };
            }
        }
        let _ = writeln!(out, "handlers");
        for (message, kind, handlers) in bus.handle_step().registry().describe() {
            let _ = writeln!(out, "  {kind} {message}: {}", handlers.join(", "));
        }
        out
    }
}
