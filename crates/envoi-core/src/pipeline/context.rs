//! The context of a handler call: the bus the handler runs on, the envelope
//! it handles, the shared state registered on the builder, and the signal
//! of a worker that is stopping.
//!
//! A handler function takes it beside its message, or takes what it needs
//! from it: any of [`Context`], [`State<T>`] or another [`FromContext`]
//! type, up to four, after the message. A handler type implements
//! [`ContextHandler`](super::handler::ContextHandler) to get it. Handlers
//! that take none of them never have one made.
//!
//! ```
//! use envoi_core::{Command, Context, Event, Message, Messenger, State};
//! use std::convert::Infallible;
//! use std::sync::{Arc, Mutex};
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
//! /// What the application shares with its handlers (a database pool, say).
//! #[derive(Clone, Default)]
//! struct Warehouse(Arc<Mutex<Vec<u32>>>);
//!
//! async fn ship(cmd: Ship, ctx: Context, State(warehouse): State<Warehouse>) -> Result<(), Infallible> {
//!     warehouse.0.lock().unwrap().push(cmd.order);
//!     // Published once this dispatch has succeeded.
//!     ctx.publish_after_current(Shipped { order: cmd.order }).await.unwrap();
//!     Ok(())
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let warehouse = Warehouse::default();
//! let messenger = Messenger::builder()
//!     .state(warehouse.clone())
//!     .command_handler(ship)
//!     .event_handler(|e: Shipped, State(w): State<Warehouse>| async move {
//!         w.0.lock().unwrap().push(e.order + 1000);
//!         Ok(())
//!     })
//!     .build()
//!     .unwrap();
//! messenger.dispatcher().dispatch(Ship { order: 7 }).await.unwrap();
//! assert_eq!(*warehouse.0.lock().unwrap(), [7, 1007]);
//! # });
//! ```

use std::any::{type_name, TypeId};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Weak};

use tokio::sync::watch;
use uuid::Uuid;

use crate::envelope::stamp::{
    MessageIdStamp, ReceivedStamp, RedeliveredStamp, RedeliveryStamp, Stamp,
};
use crate::envelope::Envelope;
use crate::error::{BoxError, Unrecoverable};
use crate::middleware::correlation::{CausationIdStamp, CorrelationIdStamp};
use crate::pipeline::bus::{BusInner, MessageBus};

/// What a handler can reach while it handles one message: the bus it runs
/// on, the envelope with its stamps, the shared state registered on the
/// builder, and whether the worker handling the message is stopping.
/// Cheap to make and to clone; a handler takes it by value.
///
/// Dispatching through it ([`dispatch`](Self::dispatch),
/// [`ask`](Self::ask), [`publish`](Self::publish), and
/// [`dispatch_after_current`](Self::dispatch_after_current) /
/// [`publish_after_current`](Self::publish_after_current), which wait for
/// the current dispatch to succeed) goes through the bus the handler runs
/// on, with all its middleware.
///
/// ```
/// use envoi_core::{Command, Context, Message, Messenger, Query};
/// use std::convert::Infallible;
///
/// #[derive(Debug, Clone)]
/// struct Price { sku: String }
/// impl Message for Price { const NAME: &'static str = "Price"; }
/// impl Query for Price { type Output = u64; type Error = Infallible; }
///
/// #[derive(Debug, Clone)]
/// struct Quote { sku: String, quantity: u64 }
/// impl Message for Quote { const NAME: &'static str = "Quote"; }
/// impl Command for Quote { type Output = u64; type Error = Infallible; }
///
/// async fn quote(cmd: Quote, ctx: Context) -> Result<u64, Infallible> {
///     assert_eq!(ctx.attempt(), 1);
///     assert_eq!(ctx.transport(), None, "dispatched in this process");
///     let unit = ctx.ask(Price { sku: cmd.sku }).await.unwrap();
///     Ok(unit * cmd.quantity)
/// }
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let messenger = Messenger::builder()
///     .query_handler(|_: Price| async { Ok(250) })
///     .command_handler(quote)
///     .build()
///     .unwrap();
/// let total = messenger.dispatcher().dispatch(Quote { sku: "pen".into(), quantity: 4 }).await;
/// assert_eq!(total.unwrap(), 1000);
/// # });
/// ```
#[derive(Clone)]
pub struct Context {
    bus: MessageBus,
    envelope: Envelope,
    stop: Option<StopSignal>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("bus", &self.bus.name())
            .field("message", &self.envelope.message_name())
            .field("message_id", &self.message_id())
            .field("attempt", &self.attempt())
            .field("transport", &self.transport())
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}

impl Context {
    /// The context of a handler called on the bus `bus` links to, for
    /// `envelope`; `None` when the step runs outside a bus.
    pub(crate) fn of_call(bus: &Weak<BusInner>, envelope: &Envelope) -> Option<Self> {
        Some(Self {
            bus: MessageBus::upgrade(bus)?,
            envelope: envelope.clone(),
            stop: StopSignal::current(),
        })
    }

    /// The bus the handler runs on.
    pub fn bus(&self) -> &MessageBus {
        &self.bus
    }

    /// The envelope being handled, as it reached the handler: with the
    /// stamps the steps before added.
    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// The newest stamp of type `S` on the envelope.
    pub fn stamp<S: Stamp>(&self) -> Option<&S> {
        self.envelope.last::<S>()
    }

    /// The message's id ([`MessageIdStamp`]), when it has one: every
    /// message a transport carries does, and the
    /// [`Correlation`](crate::middleware::correlation::Correlation)
    /// middleware gives one to every message.
    pub fn message_id(&self) -> Option<Uuid> {
        self.stamp::<MessageIdStamp>().map(|s| s.id)
    }

    /// The conversation the message belongs to
    /// ([`CorrelationIdStamp`]), when it has one.
    pub fn correlation_id(&self) -> Option<Uuid> {
        self.stamp::<CorrelationIdStamp>().map(|s| s.id)
    }

    /// The id of the message whose handler dispatched this one
    /// ([`CausationIdStamp`]), when it has one.
    pub fn causation_id(&self) -> Option<Uuid> {
        self.stamp::<CausationIdStamp>().map(|s| s.id)
    }

    /// Which delivery of the message this is, from 1: one more than the
    /// retries the retry step scheduled ([`RedeliveryStamp`]), plus one when
    /// its transport says it delivered it before
    /// ([`RedeliveredStamp`]: a consumer died or gave it back), which it
    /// counts once as it does not say how often. A message taken from a
    /// failure transport starts a fresh count, as its retries do.
    pub fn attempt(&self) -> u32 {
        let retries = self.stamp::<RedeliveryStamp>().map_or(0, |r| r.retry_count);
        let redelivered = u32::from(self.envelope.has::<RedeliveredStamp>());
        1u32.saturating_add(retries).saturating_add(redelivered)
    }

    /// The transport the message was received from
    /// ([`ReceivedStamp`]); `None` when it was dispatched in this process.
    /// For a message taken from a failure transport, the transport it
    /// failed on, which its retries go back to.
    pub fn transport(&self) -> Option<&str> {
        self.stamp::<ReceivedStamp>().map(|r| &*r.transport)
    }

    /// The shared state of type `T` registered with
    /// `MessengerBuilder::state`, if any.
    /// A handler function taking [`State<T>`] is refused by
    /// `MessengerBuilder::build` when there is none.
    pub fn state<T: Send + Sync + 'static>(&self) -> Option<&T> {
        self.bus.handle_step().registry().state::<T>()
    }

    /// Whether the worker handling this message is stopping: see
    /// [`cancelled`](Self::cancelled).
    pub fn is_cancelled(&self) -> bool {
        self.stop.as_ref().is_some_and(StopSignal::is_raised)
    }

    /// Resolves once the worker handling this message begins to stop (a
    /// `StopHandle` was used, or a limit was
    /// reached): it no longer fetches, and gives the handlers in flight its
    /// grace period to finish. A long handler can wind down then, and
    /// return (or fail, to be retried) before the grace period ends and it
    /// is dropped, its message released. Never resolves for a message
    /// dispatched in this process outside a worker.
    ///
    /// The signal reaches what the worker's task runs: a handler, and the
    /// handlers of what it dispatches in process. Work spawned onto another
    /// task takes a clone of the context with it.
    pub fn cancelled(&self) -> impl Future<Output = ()> + Send + 'static {
        let stop = self.stop.clone();
        async move {
            match stop {
                Some(stop) => stop.raised().await,
                None => std::future::pending().await,
            }
        }
    }
}

/// A worker's signal that it is stopping, which the contexts of the
/// handlers it runs wait for ([`Context::cancelled`]). The worker raises
/// it when it begins to stop, and sets it around its run with
/// [`scope`](Self::scope).
#[derive(Clone, Debug)]
pub(crate) struct StopSignal(Arc<watch::Sender<bool>>);

tokio::task_local! {
    /// The stop signal of the worker whose task polls this.
    static STOPPING: StopSignal;
}

impl StopSignal {
    /// A signal not raised yet.
    pub(crate) fn new() -> Self {
        Self(Arc::new(watch::Sender::new(false)))
    }

    /// Raises the signal; raising it again changes nothing.
    pub(crate) fn raise(&self) {
        self.0
            .send_if_modified(|raised| !std::mem::replace(raised, true));
    }

    fn is_raised(&self) -> bool {
        *self.0.borrow()
    }

    async fn raised(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives in `self`: waiting cannot fail.
        let _ = rx.wait_for(|raised| *raised).await;
    }

    /// Runs `future` with this signal as the one contexts made while it is
    /// polled take.
    pub(crate) fn scope<F: Future>(self, future: F) -> impl Future<Output = F::Output> {
        STOPPING.scope(self, future)
    }

    /// The signal of the worker polling this, if a worker is.
    fn current() -> Option<Self> {
        STOPPING.try_with(Clone::clone).ok()
    }
}

/// Why a handler could not be given what it takes from its [`Context`].
/// Returned as the handler's error, marked [`Unrecoverable`]: retrying
/// would fail the same way.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ContextError {
    /// The handler takes a context, but its
    /// [`HandleMessage`](super::handle_message::HandleMessage) step was
    /// assembled by hand, outside a bus: there is no bus to dispatch on.
    #[error(
        "handler `{handler}` takes a context, but its `HandleMessage` step is not part of a bus"
    )]
    NoBus {
        /// The handler's name.
        handler: &'static str,
    },
    /// The handler takes a shared state of a type that was not registered.
    /// `MessengerBuilder::build` refuses a handler function
    /// taking a [`State<T>`] no one registered, so this comes from a
    /// [`FromContext`] type of the application's own that did not list it
    /// in [`required_state`](FromContext::required_state).
    #[error("no shared state of type `{state}` is registered; add it with `Messenger::builder().state(…)`")]
    MissingState {
        /// The type's name.
        state: &'static str,
    },
}

impl ContextError {
    /// The error as a handler's error, marked unrecoverable.
    pub(crate) fn into_handler_error(self) -> BoxError {
        Box::new(Unrecoverable::new(self))
    }
}

/// A type of shared state a handler needs, which
/// `MessengerBuilder::build` checks was
/// registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequiredState {
    /// The type's id.
    pub type_id: TypeId,
    /// The type's name.
    pub type_name: &'static str,
}

impl RequiredState {
    /// Shared state of type `T`.
    pub fn of<T: 'static>() -> Self {
        Self {
            type_id: TypeId::of::<T>(),
            type_name: type_name::<T>(),
        }
    }
}

/// What a handler function can take from its [`Context`], after the
/// message: the context itself, a [`State<T>`], or a type of the
/// application's own.
///
/// ```
/// use envoi_core::{BoxError, Command, Context, FromContext, Message, Messenger};
/// use std::convert::Infallible;
///
/// /// The tenant a message was sent for, from its `tenant` header.
/// struct Tenant(String);
///
/// impl FromContext for Tenant {
///     fn from_context(ctx: &Context) -> Result<Self, BoxError> {
///         match ctx.envelope().header("tenant") {
///             Some(t) => Ok(Tenant(t.to_string())),
///             None => Err("the message has no `tenant` header".into()),
///         }
///     }
/// }
///
/// #[derive(Debug, Clone)]
/// struct Close;
/// impl Message for Close { const NAME: &'static str = "Close"; }
/// impl Command for Close { type Output = String; type Error = Infallible; }
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let messenger = Messenger::builder()
///     .command_handler(|_: Close, Tenant(t): Tenant| async move { Ok(t) })
///     .build()
///     .unwrap();
/// let out = messenger
///     .bus()
///     .dispatch(envoi_core::Envelope::new(Close).with_header("tenant", "acme"))
///     .await
///     .unwrap();
/// assert_eq!(out.into_last_handled().unwrap().result.take::<String>().unwrap(), "acme");
/// # });
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be taken from a handler's context",
    note = "after the message, a handler function takes up to four of `Context`, `State<T>` or types implementing `FromContext`"
)]
pub trait FromContext: Sized + Send + 'static {
    /// Takes the value from the context of the call. An error fails the
    /// handler with it, without calling it.
    fn from_context(ctx: &Context) -> Result<Self, BoxError>;

    /// The shared state it reads, which
    /// `MessengerBuilder::build` checks was registered;
    /// none by default.
    fn required_state() -> Option<RequiredState> {
        None
    }
}

impl FromContext for Context {
    fn from_context(ctx: &Context) -> Result<Self, BoxError> {
        Ok(ctx.clone())
    }
}

/// A clone of the shared state of type `T` registered with
/// `MessengerBuilder::state`, taken by a
/// handler function after its message. A handler taking a state that was
/// not registered is refused by `MessengerBuilder::build`
/// (`BuildError::MissingState`), not
/// when its first message comes.
///
/// ```
/// use envoi_core::{BuildError, Command, Message, Messenger, State};
/// use std::convert::Infallible;
///
/// #[derive(Clone)]
/// struct Greeting(&'static str);
///
/// #[derive(Debug, Clone)]
/// struct Greet { name: String }
/// impl Message for Greet { const NAME: &'static str = "Greet"; }
/// impl Command for Greet { type Output = String; type Error = Infallible; }
///
/// async fn greet(cmd: Greet, State(greeting): State<Greeting>) -> Result<String, Infallible> {
///     Ok(format!("{} {}", greeting.0, cmd.name))
/// }
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let messenger = Messenger::builder()
///     .state(Greeting("hello"))
///     .command_handler(greet)
///     .build()
///     .unwrap();
/// let out = messenger.dispatcher().dispatch(Greet { name: "Ada".into() }).await;
/// assert_eq!(out.unwrap(), "hello Ada");
///
/// let refused = Messenger::builder().command_handler(greet).build();
/// assert!(matches!(refused, Err(BuildError::MissingState { message: "Greet", .. })));
/// # });
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct State<T>(pub T);

impl<T: Clone + Send + Sync + 'static> FromContext for State<T> {
    fn from_context(ctx: &Context) -> Result<Self, BoxError> {
        match ctx.state::<T>() {
            Some(value) => Ok(State(value.clone())),
            None => Err(ContextError::MissingState {
                state: type_name::<T>(),
            }
            .into_handler_error()),
        }
    }

    fn required_state() -> Option<RequiredState> {
        Some(RequiredState::of::<T>())
    }
}

impl<T> std::ops::Deref for State<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> std::ops::DerefMut for State<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}
