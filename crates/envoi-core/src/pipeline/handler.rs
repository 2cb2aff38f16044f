//! Handlers: plain async functions or types implementing [`Handler`].
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

use std::any::TypeId;
use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::envelope::message::{Message, MessageKind};
use crate::envelope::stamp::HandlerResult;
use crate::envelope::type_map::TypeMap;
use crate::envelope::Envelope;
use crate::error::BoxError;
use crate::middleware::short_type_name;
use crate::BoxFuture;

/// Handles messages of type `M`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a handler for `{M}`",
    note = "a handler is a type implementing `Handler<{M}>`, or an async function `async fn(M) -> Result<Output, Error>` where `{M}: Clone`"
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

/// Turns a value into a [`Handler`]; implemented for handler types and for
/// async functions taking the message by value. The `Marker` parameter only
/// keeps the two blanket implementations apart.
pub trait IntoHandler<M: Message, Marker>: Send + Sync + 'static {
    /// The handler.
    type Handler: Handler<M>;
    /// Performs the conversion.
    fn into_handler(self) -> Self::Handler;
}

#[doc(hidden)]
#[derive(Debug)]
pub enum IsHandler {}

#[doc(hidden)]
#[derive(Debug)]
pub enum IsFn {}

impl<M: Message, H: Handler<M>> IntoHandler<M, IsHandler> for H {
    type Handler = H;
    fn into_handler(self) -> H {
        self
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
    type Handler = FnHandler<F, M>;
    fn into_handler(self) -> Self::Handler {
        FnHandler {
            f: self,
            _m: PhantomData,
        }
    }
}

/// A handler with its message type erased, as the registry stores it.
pub(crate) trait ErasedHandler: Send + Sync {
    fn call<'a>(&'a self, envelope: &'a Envelope)
        -> BoxFuture<'a, Result<HandlerResult, BoxError>>;
    fn name(&self) -> &'static str;
}

struct Typed<M, H> {
    handler: H,
    name: &'static str,
    _m: PhantomData<fn(M)>,
}

/// The envelope holds a message of another type than the handler expects.
#[derive(Debug, thiserror::Error)]
#[error("handler for `{expected}` received a `{got}`")]
struct WrongMessageType {
    expected: &'static str,
    got: &'static str,
}

impl<M: Message, H: Handler<M>> ErasedHandler for Typed<M, H> {
    fn call<'a>(
        &'a self,
        envelope: &'a Envelope,
    ) -> BoxFuture<'a, Result<HandlerResult, BoxError>> {
        Box::pin(async move {
            let Some(message) = envelope.message::<M>() else {
                return Err(Box::new(WrongMessageType {
                    expected: M::NAME,
                    got: envelope.message_name(),
                }) as BoxError);
            };
            match self.handler.handle(message).await {
                Ok(v) => Ok(HandlerResult::new(v)),
                Err(e) => Err(Box::new(e) as BoxError),
            }
        })
    }

    fn name(&self) -> &'static str {
        self.name
    }
}

/// The handlers of a [`HandleMessage`](super::handle_message::HandleMessage)
/// step, by message type: what a messenger's builder collects, for a
/// pipeline assembled by hand.
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
        H: IntoHandler<C, Marker>,
        H::Handler: Handler<C, Output = C::Output, Error = C::Error>,
    {
        self.0
            .add::<C, _>(MessageKind::Command, handler.into_handler());
        self
    }

    /// Adds the handler of query `Q`.
    pub fn query<Q, H, Marker>(mut self, handler: H) -> Self
    where
        Q: crate::Query,
        H: IntoHandler<Q, Marker>,
        H::Handler: Handler<Q, Output = Q::Output, Error = Q::Error>,
    {
        self.0
            .add::<Q, _>(MessageKind::Query, handler.into_handler());
        self
    }

    /// Adds a handler of event `E`.
    pub fn event<E, H, Marker>(mut self, handler: H) -> Self
    where
        E: crate::Event,
        H: IntoHandler<E, Marker>,
        H::Handler: Handler<E, Output = (), Error = E::Error>,
    {
        self.0
            .add::<E, _>(MessageKind::Event, handler.into_handler());
        self
    }
}

/// The handlers registered for one message type.
pub(crate) struct Registration {
    pub(crate) kind: MessageKind,
    pub(crate) name: &'static str,
    pub(crate) handlers: Vec<Arc<dyn ErasedHandler>>,
}

/// Every handler of a messenger, by message type.
#[derive(Default)]
pub(crate) struct HandlerRegistry {
    pub(crate) by_type: TypeMap<Registration>,
}

impl HandlerRegistry {
    pub(crate) fn add<M: Message, H: Handler<M>>(&mut self, kind: MessageKind, handler: H) {
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
        }
        entry.handlers.push(Arc::new(Typed {
            handler,
            name,
            _m: PhantomData,
        }));
    }

    #[inline]
    pub(crate) fn get(&self, type_id: TypeId) -> Option<&Registration> {
        self.by_type.get(&type_id)
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
