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
//! transports; [`in_memory`] and [`sync_transport`] are the transports core
//! ships; [`transports`] creates transports from DSNs.

#![forbid(unsafe_code)]

pub mod builder;
pub mod bus;
pub mod envelope;
pub mod error;
mod far;
pub mod handler;
pub mod headers;
pub mod in_memory;
pub mod message;
pub mod middleware;
pub mod serializer;
pub mod stamp;
pub mod sync_transport;
pub mod testing;
pub mod transport;
pub mod transports;
pub mod typed;
pub mod worker;

pub use builder::{BuildError, Messenger, MessengerBuilder, WeakMessenger};
pub use bus::{MessageBus, MiddlewareId};
pub use envelope::Envelope;
pub use error::{
    BoxError, BusError, HandlerError, Recoverable, Result, RetryHint, SerializationError, Stage,
    TransportError, Unrecoverable,
};
pub use handler::{Handler, IntoHandler};
pub use headers::Headers;
pub use message::{Command, Event, Message, MessageKind, Query};
pub use middleware::span::{SpanAttributeValue, SpanAttributes};
pub use middleware::{Middleware, MiddlewareStack, Next};
pub use stamp::Stamp;
pub use typed::{DispatchContext, DispatchError, DispatchMiddleware, DispatchNext, Dispatcher};
