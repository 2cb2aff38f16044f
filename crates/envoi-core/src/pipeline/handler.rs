//! Handlers: plain async functions, async functions that also take what
//! they need from their [`Context`], or types implementing [`Handler`] (or
//! [`ContextHandler`], for a type that needs the context).
//!
//! ```
//! use envoi_core::{Command, Handler, Message};
//! use std::convert::Infallible;
//!
//! #[derive(Debug, Clone)]
//! struct Greet { name: String }
//! impl Message for Greet { const NAME: &'static str = "Greet"; }
//! impl Command for Greet { type Output = String; type Error = Infallible; }
//!
//! // A plain async function (it receives a clone of the message)…
//! async fn greet(cmd: Greet) -> Result<String, Infallible> {
//!     Ok(format!("hello {}", cmd.name))
//! }
//!
//! // …or a type, which borrows the message.
//! struct Greeter { greeting: &'static str }
//! impl Handler<Greet> for Greeter {
//!     type Output = String;
//!     type Error = Infallible;
//!     async fn handle(&self, cmd: &Greet) -> Result<String, Infallible> {
//!         Ok(format!("{} {}", self.greeting, cmd.name))
//!     }
//! }
//!
//! let _ = envoi_core::Messenger::builder().command_handler(greet);
//! let _ = envoi_core::Messenger::builder().command_handler(Greeter { greeting: "hi" });
//! ```
//!
//! A function may take, after its message, up to four values it takes from
//! its [`Context`]: the context itself, a [`State<T>`](super::context::State)
//! registered on the builder, or any
//! [`FromContext`](super::context::FromContext) type — see
//! [`context`](super::context).

use std::any::{Any, TypeId};
use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, Weak};

use crate::envelope::message::{Message, MessageKind};
use crate::envelope::stamp::HandlerResult;
use crate::envelope::type_map::TypeMap;
use crate::envelope::Envelope;
use crate::error::BoxError;
use crate::middleware::short_type_name;
use crate::pipeline::bus::BusInner;
use crate::pipeline::context::{Context, ContextError, RequiredState};
use crate::BoxFuture;

/// Handles messages of type `M`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a handler for `{M}`",
    note = "a handler is a type implementing `Handler<{M}>` or `ContextHandler<{M}>`, or an async function `async fn(M, …) -> Result<Output, Error>` where `{M}: Clone`, taking after the message up to four of `Context`, `State<T>` or `FromContext` types"
)]
pub trait Handler<M: Message>: Send + Sync + 'static {
    /// What it returns on success.
    type Output: Send + Sync + 'static;
    /// What it returns on failure.
    type Error: StdError + Send + Sync + 'static;

    /// Handles one message.
    fn handle(&self, message: &M)
        -> impl Future<Output = Result<Self::Output, Self::Error>> + Send;

    /// The handler's name, used in [`HandledStamp`](crate::envelope::stamp::HandledStamp)s
    /// and errors; the type name by default.
    fn name(&self) -> &'static str {
        short_type_name(std::any::type_name::<Self>())
    }
}

/// Handles messages of type `M` with the [`Context`] of each call: a
/// [`Handler`] that dispatches on its bus, reads the envelope's stamps or
/// shared state, or winds down when its worker stops.
///
/// ```
/// use envoi_core::{Command, Context, ContextHandler, Event, Message, Messenger};
/// use std::convert::Infallible;
///
/// #[derive(Debug, Clone)]
/// struct Pay { order: u32 }
/// impl Message for Pay { const NAME: &'static str = "Pay"; }
/// impl Command for Pay { type Output = (); type Error = Infallible; }
///
/// #[derive(Debug, Clone)]
/// struct Paid { order: u32 }
/// impl Message for Paid { const NAME: &'static str = "Paid"; }
/// impl Event for Paid { type Error = Infallible; }
///
/// struct Cashier;
///
/// impl ContextHandler<Pay> for Cashier {
///     type Output = ();
///     type Error = Infallible;
///     async fn handle(&self, pay: &Pay, ctx: Context) -> Result<(), Infallible> {
///         // Published once the payment's dispatch has succeeded.
///         ctx.publish_after_current(Paid { order: pay.order }).await.unwrap();
///         Ok(())
///     }
/// }
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let messenger = Messenger::builder()
///     .command_handler(Cashier)
///     .event_handler(|_: Paid| async { Ok(()) })
///     .build()
///     .unwrap();
/// messenger.dispatcher().dispatch(Pay { order: 1 }).await.unwrap();
/// # });
/// ```
pub trait ContextHandler<M: Message>: Send + Sync + 'static {
    /// What it returns on success.
    type Output: Send + Sync + 'static;
    /// What it returns on failure.
    type Error: StdError + Send + Sync + 'static;

    /// Handles one message, with the context of the call.
    fn handle(
        &self,
        message: &M,
        ctx: Context,
    ) -> impl Future<Output = Result<Self::Output, Self::Error>> + Send;

    /// The handler's name, used in [`HandledStamp`](crate::envelope::stamp::HandledStamp)s
    /// and errors; the type name by default.
    fn name(&self) -> &'static str {
        short_type_name(std::any::type_name::<Self>())
    }

    /// The shared state it reads with [`Context::state`], which
    /// `MessengerBuilder::build` checks was registered; none by default.
    fn required_state(&self) -> Vec<RequiredState> {
        Vec::new()
    }
}

/// Turns a value into a handler of `M`, ready to be registered; implemented
/// for [`Handler`] and [`ContextHandler`] types, and for async functions
/// taking the message by value, then up to four
/// [`FromContext`](super::context::FromContext) values. The `Marker`
/// parameter only keeps the implementations apart.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a handler for `{M}`",
    note = "a handler is a type implementing `Handler<{M}>` or `ContextHandler<{M}>`, or an async function `async fn(M, …) -> Result<Output, Error>` where `{M}: Clone`, taking after the message up to four of `Context`, `State<T>` or `FromContext` types"
)]
pub trait IntoHandler<M: Message, Marker>: Send + Sync + 'static {
    /// What the handler returns on success.
    type Output: Send + Sync + 'static;
    /// What it returns on failure.
    type Error: StdError + Send + Sync + 'static;
    /// Performs the conversion.
    fn into_handler(self) -> BoxedHandler<M>;
}

/// A handler of `M` with its type erased, as [`IntoHandler`] makes it.
pub struct BoxedHandler<M> {
    handler: Box<dyn ErasedHandler>,
    _m: PhantomData<fn(M)>,
}

impl<M> BoxedHandler<M> {
    pub(crate) fn new(handler: impl ErasedHandler + 'static) -> Self {
        Self {
            handler: Box::new(handler),
            _m: PhantomData,
        }
    }

    /// The handler's name.
    pub fn name(&self) -> &'static str {
        self.handler.name()
    }
}

impl<M> fmt::Debug for BoxedHandler<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BoxedHandler")
            .field(&self.handler.name())
            .finish()
    }
}

#[doc(hidden)]
#[derive(Debug)]
pub enum IsHandler {}

#[doc(hidden)]
#[derive(Debug)]
pub enum IsContextHandler {}

#[doc(hidden)]
#[derive(Debug)]
pub enum IsFn {}

impl<M: Message, H: Handler<M>> IntoHandler<M, IsHandler> for H {
    type Output = H::Output;
    type Error = H::Error;
    fn into_handler(self) -> BoxedHandler<M> {
        typed(self)
    }
}

impl<M: Message, H: ContextHandler<M>> IntoHandler<M, IsContextHandler> for H {
    type Output = H::Output;
    type Error = H::Error;
    fn into_handler(self) -> BoxedHandler<M> {
        BoxedHandler::new(Contextual {
            name: self.name(),
            handler: self,
            _m: PhantomData::<fn(M)>,
        })
    }
}

/// An async function used as a handler; see [`IntoHandler`].
pub struct FnHandler<F, M> {
    f: F,
    _m: PhantomData<fn(M)>,
}

impl<F, M> fmt::Debug for FnHandler<F, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(short_type_name(std::any::type_name::<F>()))
    }
}

impl<F, Fut, M, T, E> Handler<M> for FnHandler<F, M>
where
    M: Message + Clone,
    F: Fn(M) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, E>> + Send,
    T: Send + Sync + 'static,
    E: StdError + Send + Sync + 'static,
{
    type Output = T;
    type Error = E;

    fn handle(&self, message: &M) -> impl Future<Output = Result<T, E>> + Send {
        (self.f)(message.clone())
    }

    fn name(&self) -> &'static str {
        short_type_name(std::any::type_name::<F>())
    }
}

impl<F, Fut, M, T, E> IntoHandler<M, IsFn> for F
where
    M: Message + Clone,
    F: Fn(M) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, E>> + Send,
    T: Send + Sync + 'static,
    E: StdError + Send + Sync + 'static,
{
    type Output = T;
    type Error = E;
    fn into_handler(self) -> BoxedHandler<M> {
        typed(FnHandler {
            f: self,
            _m: PhantomData,
        })
    }
}

/// A handler with its message type erased, as the registry stores it.
pub(crate) trait ErasedHandler: Send + Sync {
    /// Handles the message of `envelope`; `bus` is the bus the step runs
    /// on, for a handler that takes a [`Context`].
    fn call<'a>(
        &'a self,
        envelope: &'a Envelope,
        bus: &'a Weak<BusInner>,
    ) -> BoxFuture<'a, Result<HandlerResult, BoxError>>;
    fn name(&self) -> &'static str;
    /// Gives the handler another name (one unique among the handlers of
    /// its message).
    fn rename(&mut self, name: &'static str);
    /// The shared state it needs.
    fn required_state(&self) -> Vec<RequiredState> {
        Vec::new()
    }
}

/// The envelope holds a message of another type than the handler expects.
#[derive(Debug, thiserror::Error)]
#[error("handler for `{expected}` received a `{got}`")]
struct WrongMessageType {
    expected: &'static str,
    got: &'static str,
}

/// The message of `envelope`, if it is an `M`.
#[inline]
pub(crate) fn message_of<M: Message>(envelope: &Envelope) -> Result<&M, BoxError> {
    envelope.message::<M>().ok_or_else(|| {
        Box::new(WrongMessageType {
            expected: M::NAME,
            got: envelope.message_name(),
        }) as BoxError
    })
}

/// The context of a call of the handler `handler` on the bus `bus` links
/// to.
pub(crate) fn context_of(
    bus: &Weak<BusInner>,
    envelope: &Envelope,
    handler: &'static str,
) -> Result<Context, BoxError> {
    Context::of_call(bus, envelope)
        .ok_or_else(|| ContextError::NoBus { handler }.into_handler_error())
}

/// `handler`, erased.
fn typed<M: Message, H: Handler<M>>(handler: H) -> BoxedHandler<M> {
    BoxedHandler::new(Typed {
        name: handler.name(),
        handler,
        _m: PhantomData::<fn(M)>,
    })
}

/// A [`Handler`], erased.
struct Typed<M, H> {
    handler: H,
    name: &'static str,
    _m: PhantomData<fn(M)>,
}

impl<M: Message, H: Handler<M>> ErasedHandler for Typed<M, H> {
    fn call<'a>(
        &'a self,
        envelope: &'a Envelope,
        _bus: &'a Weak<BusInner>,
    ) -> BoxFuture<'a, Result<HandlerResult, BoxError>> {
        Box::pin(async move {
            let message = message_of::<M>(envelope)?;
            erase(self.handler.handle(message).await)
        })
    }

    fn name(&self) -> &'static str {
        self.name
    }

    fn rename(&mut self, name: &'static str) {
        self.name = name;
    }
}

/// A handler's typed result, as the bus keeps it: the output in a
/// [`HandlerResult`], the error boxed.
pub(crate) fn erase<T, E>(result: Result<T, E>) -> Result<HandlerResult, BoxError>
where
    T: Send + Sync + 'static,
    E: StdError + Send + Sync + 'static,
{
    result
        .map(HandlerResult::new)
        .map_err(|e| Box::new(e) as BoxError)
}

/// A [`ContextHandler`], erased.
struct Contextual<M, H> {
    handler: H,
    name: &'static str,
    _m: PhantomData<fn(M)>,
}

impl<M: Message, H: ContextHandler<M>> ErasedHandler for Contextual<M, H> {
    fn call<'a>(
        &'a self,
        envelope: &'a Envelope,
        bus: &'a Weak<BusInner>,
    ) -> BoxFuture<'a, Result<HandlerResult, BoxError>> {
        Box::pin(async move {
            let message = message_of::<M>(envelope)?;
            let ctx = context_of(bus, envelope, self.name)?;
            erase(self.handler.handle(message, ctx).await)
        })
    }

    fn name(&self) -> &'static str {
        self.name
    }

    fn rename(&mut self, name: &'static str) {
        self.name = name;
    }

    fn required_state(&self) -> Vec<RequiredState> {
        self.handler.required_state()
    }
}

/// The handlers of a [`HandleMessage`](super::handle_message::HandleMessage)
/// step, by message type: what a messenger's builder collects, for a
/// pipeline assembled by hand. (A handler taking a [`Context`] needs the
/// step to be part of a bus: outside one, it fails with
/// [`ContextError::NoBus`].)
///
/// ```
/// use envoi_core::pipeline::handle_message::HandleMessage;
/// use envoi_core::pipeline::handler::Handlers;
/// use envoi_core::{Command, Message};
/// use std::convert::Infallible;
///
/// #[derive(Debug, Clone)]
/// struct Ping;
/// impl Message for Ping { const NAME: &'static str = "Ping"; }
/// impl Command for Ping { type Output = (); type Error = Infallible; }
///
/// let step = HandleMessage::new(Handlers::new().command(|_: Ping| async { Ok(()) }));
/// # let _ = step;
/// ```
#[derive(Default, Debug)]
pub struct Handlers(pub(crate) HandlerRegistry);

impl Handlers {
    /// No handlers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the handler of command `C`.
    pub fn command<C, H, Marker>(mut self, handler: H) -> Self
    where
        C: crate::Command,
        H: IntoHandler<C, Marker, Output = C::Output, Error = C::Error>,
    {
        self.0.add(MessageKind::Command, handler.into_handler());
        self
    }

    /// Adds the handler of query `Q`.
    pub fn query<Q, H, Marker>(mut self, handler: H) -> Self
    where
        Q: crate::Query,
        H: IntoHandler<Q, Marker, Output = Q::Output, Error = Q::Error>,
    {
        self.0.add(MessageKind::Query, handler.into_handler());
        self
    }

    /// Adds a handler of event `E`.
    pub fn event<E, H, Marker>(mut self, handler: H) -> Self
    where
        E: crate::Event,
        H: IntoHandler<E, Marker, Output = (), Error = E::Error>,
    {
        self.0.add(MessageKind::Event, handler.into_handler());
        self
    }
}

/// The handlers registered for one message type.
pub(crate) struct Registration {
    pub(crate) kind: MessageKind,
    pub(crate) name: &'static str,
    pub(crate) handlers: Vec<Arc<dyn ErasedHandler>>,
}

/// Every handler of a messenger, by message type, and the state they
/// share.
#[derive(Default)]
pub(crate) struct HandlerRegistry {
    pub(crate) by_type: TypeMap<Registration>,
    /// The values shared with every handler, by type.
    state: TypeMap<Box<dyn Any + Send + Sync>>,
}

impl HandlerRegistry {
    pub(crate) fn add<M: Message>(&mut self, kind: MessageKind, handler: BoxedHandler<M>) {
        let mut handler = handler.handler;
        let mut name = handler.name();
        let entry = self
            .by_type
            .entry(TypeId::of::<M>())
            .or_insert_with(|| Registration {
                kind,
                name: M::NAME,
                handlers: Vec::new(),
            });
        // Names identify handlers in `HandledStamp`s (a retried event skips
        // the handlers that already succeeded), so they must be unique per
        // message type: two closures in one function share a type name.
        let taken = |n: &str| entry.handlers.iter().any(|h| h.name() == n);
        if taken(name) {
            let mut i = 2;
            while taken(&format!("{name}#{i}")) {
                i += 1;
            }
            // Registration happens once at start-up; the name lives as long
            // as the program.
            name = Box::leak(format!("{name}#{i}").into_boxed_str());
            handler.rename(name);
        }
        entry.handlers.push(Arc::from(handler));
    }

    #[inline]
    pub(crate) fn get(&self, type_id: TypeId) -> Option<&Registration> {
        self.by_type.get(&type_id)
    }

    /// Shares `value` with every handler; `false` (and nothing changed)
    /// when a value of its type is shared already.
    pub(crate) fn insert_state<T: Send + Sync + 'static>(&mut self, value: T) -> bool {
        match self.state.entry(TypeId::of::<T>()) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(Box::new(value));
                true
            }
        }
    }

    /// The shared value of type `T`.
    pub(crate) fn state<T: 'static>(&self) -> Option<&T> {
        self.state.get(&TypeId::of::<T>())?.downcast_ref()
    }

    /// The first handler that needs shared state no one registered: (message
    /// name, handler name, the state's type name).
    pub(crate) fn missing_state(&self) -> Option<(&'static str, &'static str, &'static str)> {
        let mut registrations: Vec<&Registration> = self.by_type.values().collect();
        // The same answer on every run, whatever the map's order.
        registrations.sort_by_key(|r| r.name);
        registrations.into_iter().find_map(|r| {
            r.handlers.iter().find_map(|h| {
                h.required_state()
                    .into_iter()
                    .find(|s| !self.state.contains_key(&s.type_id))
                    .map(|s| (r.name, h.name(), s.type_name))
            })
        })
    }

    /// (message name, kind, handler names), sorted by message name.
    pub(crate) fn describe(&self) -> Vec<(&'static str, MessageKind, Vec<&'static str>)> {
        let mut out: Vec<_> = self
            .by_type
            .values()
            .map(|r| {
                (
                    r.name,
                    r.kind,
                    r.handlers.iter().map(|h| h.name()).collect(),
                )
            })
            .collect();
        out.sort_by_key(|(n, _, _)| *n);
        out
    }
}

impl fmt::Debug for HandlerRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.describe()).finish()
    }
}
