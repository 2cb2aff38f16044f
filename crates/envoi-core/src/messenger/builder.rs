//! The configuration of a messenger: a [`MessengerBuilder`] registers
//! handlers, buses ([`BusBuilder`]), user middleware, routes, transports,
//! senders and retry policies, checks them and assembles each bus in the
//! canonical order.

use std::any::TypeId;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Weak};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{BuildError, Messenger, MessengerInner};
use crate::envelope::message::{Command, Event, Message, MessageKind, Query};
use crate::envelope::stamp::Stamp;
use crate::failure::{FailurePolicy, RetryStrategy};
use crate::middleware::stage::StagePipeline;
use crate::middleware::Middleware;
use crate::pipeline::bus::MessageBus;
use crate::pipeline::handle_message::HandleMessage;
use crate::pipeline::handler::{BoxedHandler, HandlerRegistry, IntoHandler};
use crate::pipeline::retry::Retry;
use crate::pipeline::send_message::{Routes, SendMessage};
use crate::transport::registry::{Senders, TransportFactories, TransportSender};
use crate::transport::serializer::{Serializer, SerializerBuilder};
use crate::transport::{
    handles_on_send, Inbox, Sender, SenderDispatcher, Transport, TransportBinding, TransportFactory,
};

/// The configuration of one bus; see [`MessengerBuilder::bus`].
#[derive(Default)]
pub struct BusBuilder {
    middleware: Vec<Arc<dyn Middleware>>,
    stages: StagePipeline,
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

    /// Adds the filters and middleware of `stages` to the bus's stage
    /// pipeline, which runs after the user middleware. Within each stage
    /// every filter runs before any middleware, whatever was added when,
    /// here or later with [`MessageBus::use_stage`](crate::MessageBus::use_stage).
    pub fn stages(mut self, stages: StagePipeline) -> Self {
        self.stages = std::mem::take(&mut self.stages).merge(stages);
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
    default_stages: StagePipeline,
    routes: Routes,
    route_checks: Vec<(&'static str, TypeId, String)>,
    senders: Vec<(String, Arc<dyn Sender>)>,
    transports: Vec<(String, TransportSpec)>,
    factories: TransportFactories,
    serializer: SerializerBuilder,
    sender_dispatcher: Option<Arc<dyn SenderDispatcher>>,
    failure_policy: FailurePolicy,
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
            default_stages: StagePipeline::new(),
            routes: Routes::new(),
            route_checks: Vec::new(),
            senders: Vec::new(),
            transports: Vec::new(),
            factories: TransportFactories::default(),
            serializer: SerializerBuilder::default(),
            sender_dispatcher: None,
            failure_policy: FailurePolicy::new(),
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
    fn register<M: Message>(&mut self, kind: MessageKind, handler: BoxedHandler<M>) {
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
        self.registry.add(kind, handler);
    }

    /// Registers the handler of command `C` (exactly one per command).
    pub fn command_handler<C, H, Marker>(mut self, handler: H) -> Self
    where
        C: Command,
        H: IntoHandler<C, Marker, Output = C::Output, Error = C::Error>,
    {
        self.register(MessageKind::Command, handler.into_handler());
        self
    }

    /// Registers the handler of query `Q` (exactly one per query).
    pub fn query_handler<Q, H, Marker>(mut self, handler: H) -> Self
    where
        Q: Query,
        H: IntoHandler<Q, Marker, Output = Q::Output, Error = Q::Error>,
    {
        self.register(MessageKind::Query, handler.into_handler());
        self
    }

    /// Adds a handler of event `E` (any number per event, run in
    /// registration order).
    pub fn event_handler<E, H, Marker>(mut self, handler: H) -> Self
    where
        E: Event,
        H: IntoHandler<E, Marker, Output = (), Error = E::Error>,
    {
        self.register(MessageKind::Event, handler.into_handler());
        self
    }

    /// Shares `value` with every handler (a database pool, a client, the
    /// application's configuration): a handler function takes a clone of
    /// it as a [`State<T>`](crate::State) argument after its message, and
    /// any handler taking a [`Context`](crate::Context) reads it with
    /// [`Context::state`](crate::Context::state). One value per type: a
    /// second one is a [`BuildError::DuplicateState`], and a handler taking
    /// a state no one registered a [`BuildError::MissingState`].
    ///
    /// ```
    /// use envoi_core::{Command, Message, Messenger, State};
    /// use std::convert::Infallible;
    /// use std::sync::{Arc, Mutex};
    ///
    /// /// Stands for a connection pool: cheap to clone, shared inside.
    /// #[derive(Clone, Default)]
    /// struct Db(Arc<Mutex<Vec<String>>>);
    ///
    /// #[derive(Debug, Clone)]
    /// struct Register { email: String }
    /// impl Message for Register { const NAME: &'static str = "Register"; }
    /// impl Command for Register { type Output = (); type Error = Infallible; }
    ///
    /// async fn register(cmd: Register, State(db): State<Db>) -> Result<(), Infallible> {
    ///     db.0.lock().unwrap().push(cmd.email);
    ///     Ok(())
    /// }
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let db = Db::default();
    /// let messenger = Messenger::builder()
    ///     .state(db.clone())
    ///     .command_handler(register)
    ///     .build()
    ///     .unwrap();
    /// messenger.dispatcher().dispatch(Register { email: "ada@example.com".into() }).await.unwrap();
    /// assert_eq!(db.0.lock().unwrap().len(), 1);
    /// # });
    /// ```
    pub fn state<T: Clone + Send + Sync + 'static>(mut self, value: T) -> Self {
        if !self.registry.insert_state(value) {
            self.errors
                .push(BuildError::DuplicateState(std::any::type_name::<T>()));
        }
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

    /// Adds the filters and middleware of `stages` to the default bus's
    /// stage pipeline, which runs after the user middleware. Within each
    /// stage every filter runs before any middleware, whatever was added
    /// when, here or later with
    /// [`MessageBus::use_stage`](crate::MessageBus::use_stage).
    pub fn stages(mut self, stages: StagePipeline) -> Self {
        self.default_stages = std::mem::take(&mut self.default_stages).merge(stages);
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
        self.route_checks
            .push((M::NAME, TypeId::of::<M>(), transport.clone()));
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

    /// Uses `policy` for what happens to messages whose handlers fail
    /// (retry strategies and failure transports), replacing what the
    /// methods below set so far.
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = policy;
        self
    }

    /// Uses `strategy` for messages received from `transport`; see
    /// [`FailurePolicy::retry_strategy`].
    pub fn retry_strategy(
        mut self,
        transport: impl Into<String>,
        strategy: impl RetryStrategy,
    ) -> Self {
        self.failure_policy = self.failure_policy.retry_strategy(transport, strategy);
        self
    }

    /// Uses `strategy` for transports without their own; see
    /// [`FailurePolicy::default_retry_strategy`].
    pub fn default_retry_strategy(mut self, strategy: impl RetryStrategy) -> Self {
        self.failure_policy = self.failure_policy.default_retry_strategy(strategy);
        self
    }

    /// Parks messages that are out of retries in `transport`; see
    /// [`FailurePolicy::failure_transport`].
    pub fn failure_transport(mut self, transport: impl Into<String>) -> Self {
        self.failure_policy = self.failure_policy.failure_transport(transport);
        self
    }

    /// Parks messages from `transport` that are out of retries in
    /// `failure`; see [`FailurePolicy::failure_transport_for`].
    pub fn failure_transport_for(
        mut self,
        transport: impl Into<String>,
        failure: impl Into<String>,
    ) -> Self {
        self.failure_policy = self
            .failure_policy
            .failure_transport_for(transport, failure);
        self
    }

    /// Checks the configuration and assembles every bus. Transports
    /// configured by DSN need [`build_async`](Self::build_async).
    pub fn build(self) -> Result<Messenger, BuildError> {
        let MessengerBuilder {
            registry,
            errors,
            default_bus,
            buses,
            default_middleware,
            default_stages,
            routes,
            route_checks,
            senders,
            transports,
            factories: _,
            serializer,
            sender_dispatcher,
            failure_policy,
        } = self;
        if let Some(e) = errors.into_iter().next() {
            return Err(e);
        }
        if let Some((message, handler, state)) = registry.missing_state() {
            return Err(BuildError::MissingState {
                handler,
                message,
                state,
            });
        }
        let serializer = serializer.build()?;
        let (transports, senders) = assemble_senders(transports, senders, &serializer)?;
        check_failure_transports(&failure_policy, &transports)?;
        check_query_routes(&route_checks, &registry, &transports)?;
        let dispatcher: Arc<dyn SenderDispatcher> = match sender_dispatcher {
            Some(d) => d,
            None => {
                check_destinations(&route_checks, &failure_policy, &senders)?;
                Arc::new(senders)
            }
        };
        let has_transports =
            !dispatcher.transports().is_empty() || !routes.is_empty() || !transports.is_empty();
        let policy = has_transports.then(|| Arc::new(without_retry(failure_policy, &transports)));
        let retry = match &policy {
            Some(policy) => Retry::shared(policy.clone(), dispatcher.clone()),
            None => Retry::disabled(),
        };
        let send = if routes.is_empty() {
            None
        } else {
            Some(SendMessage::new(Arc::new(routes), dispatcher.clone()))
        };
        let handle = HandleMessage::with_registry(Arc::new(registry));

        let mut specs = vec![(
            default_bus.clone(),
            BusBuilder {
                middleware: default_middleware,
                stages: default_stages,
            },
        )];
        specs.extend(buses);
        let (buses, order) = assemble_buses(specs, send.as_ref(), &retry, &handle)?;
        let default = buses[&default_bus].clone();
        let messenger = Messenger {
            inner: Arc::new(MessengerInner {
                buses,
                order,
                default,
                dispatcher,
                transports,
                serializer,
                retry: policy,
            }),
        };
        bind_transports(&messenger);
        Ok(messenger)
    }
}

/// The registered transports, by name.
type Transports = BTreeMap<String, Arc<dyn Transport>>;

/// The transports, each with a sender that encodes for it, then the
/// senders registered on their own. A transport configured by DSN (not
/// created, as [`MessengerBuilder::build_async`] would) and a name given
/// twice are refused.
fn assemble_senders(
    specs: Vec<(String, TransportSpec)>,
    own_senders: Vec<(String, Arc<dyn Sender>)>,
    serializer: &Serializer,
) -> Result<(Transports, Senders), BuildError> {
    let mut transports = Transports::new();
    let mut senders = Senders::new();
    for (name, spec) in specs {
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
    for (name, sender) in own_senders {
        if senders.contains(&name) {
            return Err(BuildError::DuplicateTransport(name));
        }
        senders.insert_sender(name, sender);
    }
    Ok((transports, senders))
}

/// Refuses a failure transport that handles messages when they are sent
/// (`sync://`), which would handle a parked message again at once.
fn check_failure_transports(
    policy: &FailurePolicy,
    transports: &Transports,
) -> Result<(), BuildError> {
    for failure in policy.failure_transports() {
        if transports
            .get(failure)
            .is_some_and(|t| handles_on_send(&**t))
        {
            return Err(BuildError::FailureTransportHandlesOnSend(
                failure.to_string(),
            ));
        }
    }
    Ok(())
}

/// Refuses a query routed to a transport that does not hand results back
/// (all but `sync://`): its answer would never reach the caller.
fn check_query_routes(
    route_checks: &[(&'static str, TypeId, String)],
    registry: &HandlerRegistry,
    transports: &Transports,
) -> Result<(), BuildError> {
    for (message, type_id, transport) in route_checks {
        let is_query = registry
            .get(*type_id)
            .is_some_and(|r| r.kind == MessageKind::Query);
        let answers = transports
            .get(transport)
            .is_some_and(|t| handles_on_send(&**t));
        if is_query && !answers {
            return Err(BuildError::QueryRoutedToTransport {
                message,
                transport: transport.clone(),
            });
        }
    }
    Ok(())
}

/// Refuses a route or a failure transport that names neither a transport
/// nor a sender of `senders`, when the messenger sends through them (no
/// other [`SenderDispatcher`] was given).
fn check_destinations(
    route_checks: &[(&'static str, TypeId, String)],
    policy: &FailurePolicy,
    senders: &Senders,
) -> Result<(), BuildError> {
    for (message, _, transport) in route_checks {
        if !senders.contains(transport) {
            return Err(BuildError::UnknownTransport {
                message,
                transport: transport.clone(),
            });
        }
    }
    for failure in policy.failure_transports() {
        if !senders.contains(failure) {
            return Err(BuildError::UnknownFailureTransport(failure.to_string()));
        }
    }
    Ok(())
}

/// `policy`, with the transports that handle messages while they are
/// sent (the sync transport) left out of retrying and parking.
fn without_retry(mut policy: FailurePolicy, transports: &Transports) -> FailurePolicy {
    for (name, transport) in transports {
        if handles_on_send(&**transport) {
            policy = policy.without_retry(name.clone());
        }
    }
    policy
}

/// Each bus with its own name and user middleware around the shared
/// steps, by name, and the bus names in definition order. A name given
/// twice is refused.
fn assemble_buses(
    specs: Vec<(String, BusBuilder)>,
    send: Option<&SendMessage>,
    retry: &Retry,
    handle: &HandleMessage,
) -> Result<(BTreeMap<String, MessageBus>, Vec<String>), BuildError> {
    let mut buses = BTreeMap::new();
    let mut order = Vec::new();
    for (name, spec) in specs {
        if buses.contains_key(&name) {
            return Err(BuildError::DuplicateBus(name));
        }
        let bus = MessageBus::new(
            Arc::from(name.as_str()),
            spec.middleware,
            spec.stages,
            send.cloned(),
            retry.clone(),
            handle.clone(),
        );
        order.push(name.clone());
        buses.insert(name, bus);
    }
    Ok((buses, order))
}

/// Binds every transport of `messenger` to it: its name, the serializer
/// and the messenger as the inbox of what it dispatches.
fn bind_transports(messenger: &Messenger) {
    let inbox: Weak<dyn Inbox> = Arc::downgrade(&messenger.inner) as Weak<dyn Inbox>;
    for (name, transport) in &messenger.inner.transports {
        transport.bind(&TransportBinding::new(
            Arc::from(name.as_str()),
            messenger.inner.serializer.clone(),
            inbox.clone(),
        ));
    }
}

#[cfg(feature = "testing")]
impl MessengerBuilder {
    /// The configuration with its brokers left out, for the test kit:
    /// every transport but those that handle messages when they are sent
    /// (`sync://`, in process already) becomes what `in_memory` makes,
    /// and so does every sender registered on its own; a custom
    /// [`SenderDispatcher`] is dropped, so messages go straight to those
    /// transports. Handlers, buses, routes, retry strategies and failure
    /// transports stay as configured. Returns the names of the senders
    /// replaced: destinations this process only sends to.
    pub(crate) fn without_brokers(
        mut self,
        in_memory: impl Fn() -> Arc<dyn Transport>,
    ) -> (Self, Vec<String>) {
        for (_, spec) in &mut self.transports {
            let in_process = match spec {
                TransportSpec::Ready(t) => handles_on_send(&**t),
                TransportSpec::Dsn(dsn) => crate::transport::dsn_has_scheme(dsn, "sync://"),
            };
            if !in_process {
                *spec = TransportSpec::Ready(in_memory());
            }
        }
        let senders: Vec<String> = self.senders.drain(..).map(|(name, _)| name).collect();
        for name in &senders {
            self.transports
                .push((name.clone(), TransportSpec::Ready(in_memory())));
        }
        self.sender_dispatcher = None;
        (self, senders)
    }
}
