//! Typed dispatch: results typed by the message definition.
//!
//! [`Dispatcher::dispatch`], [`ask`](Dispatcher::ask) and
//! [`publish`](Dispatcher::publish) return
//! `Result<Output, DispatchError<Error>>` where `Output` and `Error` come
//! from the message's [`Command`], [`Query`] or [`Event`] implementation. The
//! domain error sits in [`DispatchError::Domain`]; every infrastructure
//! failure (no handler, cancellation, deadline, transport) sits in
//! [`DispatchError::Infrastructure`]. Middleware sees envelopes and
//! [`BusError`]s only, so it cannot widen the domain error a caller matches
//! on.
//!
//! ```
//! use envoi_core::{Command, DispatchError, Message, Messenger};
//!
//! #[derive(Debug, Clone)]
//! struct Withdraw { amount: u64 }
//! impl Message for Withdraw { const NAME: &'static str = "Withdraw"; }
//!
//! #[derive(Debug, thiserror::Error, PartialEq)]
//! enum BankError { #[error("insufficient funds")] InsufficientFunds }
//! impl Command for Withdraw { type Output = u64; type Error = BankError; }
//!
//! async fn withdraw(cmd: Withdraw) -> Result<u64, BankError> {
//!     if cmd.amount > 100 { Err(BankError::InsufficientFunds) } else { Ok(100 - cmd.amount) }
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let messenger = Messenger::builder().command_handler(withdraw).build().unwrap();
//! let bank = messenger.dispatcher();
//! assert_eq!(bank.dispatch(Withdraw { amount: 30 }).await.unwrap(), 70);
//! match bank.dispatch(Withdraw { amount: 300 }).await {
//!     Err(DispatchError::Domain(BankError::InsufficientFunds)) => {}
//!     other => panic!("unexpected {other:?}"),
//! }
//! # });
//! ```

use std::fmt;
use std::sync::Arc;

use crate::bus::MessageBus;
use crate::envelope::Envelope;
use crate::error::{BusError, HandlerError, Result};
use crate::message::{Command, Event, MessageKind, Query};
use crate::middleware::BoxFuture;
use crate::stamp::{HandledStamp, HandlerResult, SentStamp};

/// The error of a typed dispatch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DispatchError<E> {
    /// The handler's own error, as the message definition declares it.
    #[error(transparent)]
    Domain(E),
    /// Anything else: no handler, cancelled, deadline exceeded, transport
    /// failure, an error of a middleware.
    #[error(transparent)]
    Infrastructure(BusError),
}

impl<E> DispatchError<E> {
    /// The domain error, if that is what this is.
    pub fn domain(&self) -> Option<&E> {
        match self {
            DispatchError::Domain(e) => Some(e),
            DispatchError::Infrastructure(_) => None,
        }
    }

    /// The infrastructure error, if that is what this is.
    pub fn infrastructure(&self) -> Option<&BusError> {
        match self {
            DispatchError::Domain(_) => None,
            DispatchError::Infrastructure(e) => Some(e),
        }
    }
}

/// The errors of the event handlers that failed, in handler order.
#[derive(Debug)]
pub struct EventErrors<E>(pub Vec<E>);

impl<E: fmt::Display> fmt::Display for EventErrors<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            fmt::Display::fmt(e, f)?;
        }
        Ok(())
    }
}

impl<E: std::error::Error> std::error::Error for EventErrors<E> {}

/// `tag` and `side` of a typed dispatch, as seed-001 middleware sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchContext {
    /// The message name.
    pub tag: &'static str,
    /// Command, query or event.
    pub side: MessageKind,
}

/// A seed-001 middleware: wraps a whole typed dispatch.
///
/// It receives the dispatch context and a [`DispatchNext`] it may run (more
/// than once, to retry; or not at all, to short-circuit with an
/// infrastructure error). What it returns is the untyped result; the
/// dispatcher turns it into the message's own `Output` and `Error`, so a
/// middleware cannot change those types.
///
/// ```
/// use envoi_core::typed::{DispatchContext, DispatchMiddleware, DispatchNext};
/// use envoi_core::middleware::BoxFuture;
/// use envoi_core::{Envelope, Result};
/// use std::sync::{Arc, Mutex};
///
/// /// Records the tag and side of every successful dispatch.
/// struct AuditLog(Arc<Mutex<Vec<String>>>);
///
/// impl DispatchMiddleware for AuditLog {
///     fn wrap<'a>(&'a self, ctx: DispatchContext, next: DispatchNext<'a>) -> BoxFuture<'a, Result<Envelope>> {
///         Box::pin(async move {
///             let out = next.run().await;
///             if out.is_ok() {
///                 self.0.lock().unwrap().push(format!("{}.{}", ctx.side, ctx.tag));
///             }
///             out
///         })
///     }
/// }
/// ```
pub trait DispatchMiddleware: Send + Sync + 'static {
    /// Wraps one dispatch.
    fn wrap<'a>(
        &'a self,
        ctx: DispatchContext,
        next: DispatchNext<'a>,
    ) -> BoxFuture<'a, Result<Envelope>>;
}

/// The rest of a typed dispatch, handed to a [`DispatchMiddleware`].
pub struct DispatchNext<'a> {
    bus: &'a MessageBus,
    rest: &'a [Arc<dyn DispatchMiddleware>],
    ctx: DispatchContext,
    envelope: &'a Envelope,
}

impl<'a> DispatchNext<'a> {
    /// Runs the rest of the dispatch. May be called again (to retry); each
    /// run starts from the original envelope.
    pub fn run(&self) -> BoxFuture<'a, Result<Envelope>> {
        run_layers(self.bus, self.rest, self.ctx, self.envelope)
    }

    /// The envelope being dispatched.
    pub fn envelope(&self) -> &Envelope {
        self.envelope
    }
}

impl fmt::Debug for DispatchNext<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DispatchNext")
            .field("ctx", &self.ctx)
            .field("remaining", &self.rest.len())
            .finish()
    }
}

fn run_layers<'a>(
    bus: &'a MessageBus,
    layers: &'a [Arc<dyn DispatchMiddleware>],
    ctx: DispatchContext,
    envelope: &'a Envelope,
) -> BoxFuture<'a, Result<Envelope>> {
    match layers.split_first() {
        Some((first, rest)) => first.wrap(
            ctx,
            DispatchNext {
                bus,
                rest,
                ctx,
                envelope,
            },
        ),
        None => Box::pin(bus.dispatch(envelope.clone())),
    }
}

/// Dispatches typed messages on a [`MessageBus`] through seed-001
/// middleware (applied in the order given, outermost first).
#[derive(Clone)]
pub struct Dispatcher {
    bus: MessageBus,
    layers: Arc<[Arc<dyn DispatchMiddleware>]>,
}

impl fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("bus", &self.bus.name())
            .field("layers", &self.layers.len())
            .finish()
    }
}

impl Dispatcher {
    /// A dispatcher on `bus` with no middleware of its own.
    pub fn new(bus: MessageBus) -> Self {
        Self {
            bus,
            layers: Arc::from(Vec::new()),
        }
    }

    /// A copy with `middleware` added after (inside) the existing ones.
    #[must_use]
    pub fn with(&self, middleware: impl DispatchMiddleware) -> Self {
        let mut layers: Vec<_> = self.layers.to_vec();
        layers.push(Arc::new(middleware));
        Self {
            bus: self.bus.clone(),
            layers: layers.into(),
        }
    }

    /// The underlying bus.
    pub fn bus(&self) -> &MessageBus {
        &self.bus
    }

    /// Runs `envelope` through the layers and the bus.
    pub async fn run(&self, envelope: Envelope) -> Result<Envelope> {
        if self.layers.is_empty() {
            return self.bus.dispatch(envelope).await;
        }
        let ctx = DispatchContext {
            tag: envelope.message_name(),
            side: envelope.kind(),
        };
        run_layers(&self.bus, &self.layers, ctx, &envelope).await
    }

    /// Dispatches a command and returns its handler's output.
    pub async fn dispatch<C: Command>(
        &self,
        command: C,
    ) -> Result<C::Output, DispatchError<C::Error>> {
        let out = self.run(Envelope::new(command)).await;
        output::<C::Output, C::Error>(out)
    }

    /// Asks a query and returns its handler's answer.
    pub async fn ask<Q: Query>(&self, query: Q) -> Result<Q::Output, DispatchError<Q::Error>> {
        let out = self.run(Envelope::query(query)).await;
        output::<Q::Output, Q::Error>(out)
    }

    /// Publishes an event to all its handlers (or its transports).
    pub async fn publish<E: Event>(
        &self,
        event: E,
    ) -> Result<(), DispatchError<EventErrors<E::Error>>> {
        match self.run(Envelope::event(event)).await {
            Ok(_) => Ok(()),
            Err(BusError::HandlerFailed { envelope, errors }) => {
                let (domain, other) = split_errors::<E::Error>(errors);
                if other.is_empty() {
                    Err(DispatchError::Domain(EventErrors(domain)))
                } else {
                    Err(DispatchError::Infrastructure(BusError::HandlerFailed {
                        envelope,
                        errors: other,
                    }))
                }
            }
            Err(e) => Err(DispatchError::Infrastructure(e)),
        }
    }
}

fn split_errors<E: std::error::Error + 'static>(
    errors: Vec<HandlerError>,
) -> (Vec<E>, Vec<HandlerError>) {
    let mut domain = Vec::new();
    let mut other = Vec::new();
    for e in errors {
        match e.error.downcast::<E>() {
            Ok(d) => domain.push(*d),
            Err(error) => other.push(HandlerError {
                handler: e.handler,
                error,
            }),
        }
    }
    (domain, other)
}

fn output<T, E>(out: Result<Envelope>) -> Result<T, DispatchError<E>>
where
    T: Clone + Send + Sync + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    match out {
        Ok(envelope) => {
            let name = envelope.message_name();
            let sent = envelope.has::<SentStamp>();
            match envelope.into_last_handled() {
                Some(handled) => handled.result.take::<T>(),
                // Sent to a transport: only a unit output can be produced.
                None if sent => HandlerResult::default().take::<T>(),
                None => None,
            }
            .ok_or(DispatchError::Infrastructure(BusError::NoResult {
                message: name,
            }))
        }
        Err(BusError::HandlerFailed { envelope, errors }) => {
            let (mut domain, other) = split_errors::<E>(errors);
            if other.is_empty() && domain.len() == 1 {
                Err(DispatchError::Domain(domain.remove(0)))
            } else {
                let mut errors: Vec<HandlerError> = domain
                    .into_iter()
                    .map(|e| HandlerError {
                        handler: "<domain>",
                        error: Box::new(e),
                    })
                    .collect();
                errors.extend(other);
                Err(DispatchError::Infrastructure(BusError::HandlerFailed {
                    envelope,
                    errors,
                }))
            }
        }
        Err(e) => Err(DispatchError::Infrastructure(e)),
    }
}

impl Envelope {
    /// Consumes the envelope and returns its newest [`HandledStamp`].
    pub fn into_last_handled(self) -> Option<HandledStamp> {
        self.last::<HandledStamp>().cloned()
    }
}
