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
use std::sync::Arc;

use crate::bus::MessageBus;
use crate::handler::{Handler, HandlerRegistry, IntoHandler};
use crate::message::{Command, Event, Message, MessageKind, Query};
use crate::middleware::handle_message::HandleMessage;
use crate::middleware::retry::{Retry, RetryConfig, RetryStrategy};
use crate::middleware::send_message::{Routes, SendMessage};
use crate::middleware::Middleware;
use crate::transport::{DirectSenders, Sender, SenderDispatcher};
use crate::typed::Dispatcher;

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
    senders: DirectSenders,
    sender_dispatcher: Option<Arc<dyn SenderDispatcher>>,
    retry_strategies: Vec<(Option<String>, Arc<dyn RetryStrategy>)>,
    failure_transports: Vec<(Option<String>, String)>,
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
            senders: DirectSenders::new(),
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
    pub fn route<M: Message>(mut self, transport: impl Into<String>) -> Self {
        let transport = transport.into();
        self.route_checks.push((M::NAME, transport.clone()));
        self.routes.add::<M>(transport);
        self
    }

    /// Registers the sender of `transport`.
    pub fn sender(mut self, transport: impl Into<String>, sender: Arc<dyn Sender>) -> Self {
        self.senders.insert(transport, sender);
        self
    }

    /// Replaces "send now" with another [`SenderDispatcher`] (a
    /// transactional outbox, for instance). Routes are then not checked
    /// against registered senders.
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

    /// Checks the configuration and assembles every bus.
    pub fn build(mut self) -> Result<Messenger, BuildError> {
        if let Some(e) = self.errors.into_iter().next() {
            return Err(e);
        }
        let dispatcher: Arc<dyn SenderDispatcher> = match self.sender_dispatcher.take() {
            Some(d) => d,
            None => {
                for (message, transport) in &self.route_checks {
                    if self.senders.get(transport).is_none() {
                        return Err(BuildError::UnknownTransport {
                            message,
                            transport: transport.clone(),
                        });
                    }
                }
                Arc::new(self.senders.clone())
            }
        };
        let has_transports = !dispatcher.transports().is_empty() || !self.routes.is_empty();
        let retry = if has_transports {
            let mut cfg = RetryConfig::new(dispatcher.clone());
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
            Retry::new(Some(Arc::new(cfg)))
        } else {
            Retry::new(None)
        };
        let send = if self.routes.is_empty() {
            None
        } else {
            Some(SendMessage::new(Arc::new(self.routes), dispatcher.clone()))
        };
        let handle = HandleMessage::new(Arc::new(self.registry));

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
        Ok(Messenger {
            inner: Arc::new(MessengerInner {
                buses,
                order,
                default,
                dispatcher,
            }),
        })
    }
}

struct MessengerInner {
    buses: BTreeMap<String, MessageBus>,
    order: Vec<String>,
    default: MessageBus,
    dispatcher: Arc<dyn SenderDispatcher>,
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
        let _ = writeln!(out, "handlers");
        for (message, kind, handlers) in bus.handle_step().registry().describe() {
            let _ = writeln!(out, "  {kind} {message}: {}", handlers.join(", "));
        }
        out
    }
}
