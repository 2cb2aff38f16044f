//! # envoi-core
//!
//! The core of envoi, an async message bus: envelopes and stamps, the onion
//! middleware pipeline, named buses assembled in Symfony Messenger's
//! canonical order, handlers, typed dispatch, and the transport traits.
//!
//! This crate knows no SQL, AMQP, command line or terminal output; transports
//! and tools live in crates of their own and depend on it.
//!
//! ```
//! use envoi_core::{Command, Messenger, Message, Query};
//! use std::convert::Infallible;
//!
//! #[derive(Debug, Clone)]
//! struct Add(u32, u32);
//! impl Message for Add { const NAME: &'static str = "Add"; }
//! impl Query for Add { type Output = u32; type Error = Infallible; }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let messenger = Messenger::builder()
//!     .query_handler(|q: Add| async move { Ok::<_, Infallible>(q.0 + q.1) })
//!     .build()
//!     .unwrap();
//! assert_eq!(messenger.dispatcher().ask(Add(2, 3)).await.unwrap(), 5);
//! # });
//! ```
//!
//! # Async messaging
//!
//! Register transports on the builder ([`MessengerBuilder::transport`], or
//! [`transport_dsn`](MessengerBuilder::transport_dsn) with
//! [`build_async`](MessengerBuilder::build_async)), route message types to
//! them ([`MessengerBuilder::route`]), and a dispatch sends instead of
//! handling. A [`worker::Worker`] consumes the transports and handles what it
//! receives on the same buses, retrying failures and parking what keeps
//! failing in the failure transport. The [`serializer`] encodes messages for
//! transports; [`transport::in_memory`] and [`transport::sync`] are the
//! transports core ships; [`transport::registry`] creates transports from
//! DSNs.

#![forbid(unsafe_code)]

mod far;

pub mod envelope;
pub mod error;
pub mod failure;
pub mod messenger;
pub mod middleware;
pub mod pipeline;
pub mod testing;
pub mod transport;
pub mod typed;
pub mod worker;

pub use envelope::headers::{self, Headers};
pub use envelope::message::{Command, Event, Message, MessageKind, Query};
pub use envelope::stamp::{self, Stamp};
pub use envelope::Envelope;
pub use error::{
    BoxError, BusError, HandlerError, Recoverable, Result, RetryHint, SerializationError, Stage,
    TransportError, Unrecoverable,
};
pub use messenger::{BuildError, Messenger, MessengerBuilder, WeakMessenger};
pub use middleware::{Middleware, MiddlewareStack, Next};
pub use pipeline::bus::{MessageBus, MiddlewareId};
pub use pipeline::context::{Context, ContextError, FromContext, RequiredState, State};
pub use pipeline::handler::{ContextHandler, Handler, IntoHandler};
pub use transport::serializer;
pub use typed::span::{SpanAttributeValue, SpanAttributes};
pub use typed::{
    DispatchContext, DispatchError, DispatchMiddleware, DispatchNext, Dispatcher, Receipt, Sent,
};

/// A boxed, `Send` future, the return type of object-safe async methods.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
