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

mod context;
pub mod deadline;
pub mod metrics;
mod send;
pub mod span;

pub use send::{Receipt, Sent};

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use futures_util::future::Either;
use futures_util::FutureExt;
use smallvec::SmallVec;
use tracing::Instrument;

use crate::envelope::message::{Command, Event, MessageKind, Query};
use crate::envelope::stamp::{HandledStamp, HandlerResult, SentStamp, StoppedByFilterStamp};
use crate::envelope::Envelope;
use crate::error::{BusError, HandlerError, Result};
use crate::pipeline::bus::MessageBus;
use crate::typed::deadline::Deadline;
use crate::typed::metrics::{Metrics, MetricsGuard};
use crate::typed::span::SpanAttributes;
use crate::BoxFuture;

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

/// `tag` and `side` of a typed dispatch, as Effect-style middleware sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchContext {
    /// The message name.
    pub tag: &'static str,
    /// Command, query or event.
    pub side: MessageKind,
}

/// An Effect-style middleware: wraps a whole typed dispatch.
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

/// Which message kinds get a dispatch span.
#[derive(Debug, Clone, Copy)]
struct SpanKinds {
    commands: bool,
    queries: bool,
    events: bool,
}

impl SpanKinds {
    #[inline]
    fn covers(self, side: MessageKind) -> bool {
        match side {
            MessageKind::Command => self.commands,
            MessageKind::Query => self.queries,
            MessageKind::Event => self.events,
        }
    }
}

/// A built-in layer, run inline without a box of its own.
#[derive(Debug, Clone)]
enum Builtin {
    Metrics(Metrics),
    Deadline(Deadline),
}

impl Builtin {
    /// Whether the layer has anything to do for a dispatch now: a deadline
    /// always, metrics only while a recorder records.
    #[inline]
    fn active(&self) -> bool {
        match self {
            Builtin::Metrics(_) => metrics::recording(),
            Builtin::Deadline(_) => true,
        }
    }
}

#[derive(Clone)]
struct Options {
    span: SpanKinds,
    attributes: SpanAttributes,
    /// The built-in layers given before any custom one, outermost first.
    builtins: Vec<Builtin>,
    /// Everything from the first custom layer on, outermost first.
    layers: Arc<[Arc<dyn DispatchMiddleware>]>,
}

/// Dispatches typed messages on a [`MessageBus`] through Effect-style
/// middleware.
///
/// * The dispatch span ([`crate::typed::span`]) is installed by
///   default, outermost, for commands and queries; events opt in with
///   [`span_events`](Self::span_events). Per-tag attributes come from
///   [`span_attributes`](Self::span_attributes).
/// * [`with`](Self::with) adds a [`DispatchMiddleware`]; middleware is
///   applied in the order given, outermost first, inside the span.
///   [`metrics()`](crate::typed::metrics::metrics) and
///   [`deadline(d)`](crate::typed::deadline::deadline) are the
///   built-in ones.
///
/// Configuring returns a new dispatcher and leaves the original as it was.
///
/// ```
/// use envoi_core::typed::{deadline::deadline, metrics::metrics, span::SpanAttributes};
/// use envoi_core::{Command, Message, Messenger};
/// use std::{convert::Infallible, time::Duration};
///
/// #[derive(Debug, Clone)]
/// struct PlaceOrder { quantity: u32 }
/// impl Message for PlaceOrder { const NAME: &'static str = "PlaceOrder"; }
/// impl Command for PlaceOrder { type Output = (); type Error = Infallible; }
///
/// let messenger = Messenger::builder()
///     .command_handler(|_: PlaceOrder| async { Ok::<_, Infallible>(()) })
///     .build()
///     .unwrap();
/// let orders = messenger
///     .dispatcher()
///     .span_attributes(
///         SpanAttributes::new().tag(|p: &PlaceOrder| [("order.quantity", p.quantity.into())]),
///     )
///     .with(metrics())
///     .with(deadline(Duration::from_secs(5)));
/// # let _ = orders;
/// ```
#[derive(Clone)]
pub struct Dispatcher {
    bus: MessageBus,
    options: Arc<Options>,
}

impl fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("bus", &self.bus.name())
            .field("span", &self.options.span)
            .field("builtins", &self.options.builtins)
            .field("layers", &self.options.layers.len())
            .finish()
    }
}

impl Dispatcher {
    /// A dispatcher on `bus` with the default dispatch span (commands and
    /// queries) and no middleware of its own.
    pub fn new(bus: MessageBus) -> Self {
        Self {
            bus,
            options: Arc::new(Options {
                span: SpanKinds {
                    commands: true,
                    queries: true,
                    events: false,
                },
                attributes: SpanAttributes::new(),
                builtins: Vec::new(),
                layers: Arc::from(Vec::new()),
            }),
        }
    }

    fn configure(&self, f: impl FnOnce(&mut Options)) -> Self {
        let mut options = (*self.options).clone();
        f(&mut options);
        Self {
            bus: self.bus.clone(),
            options: Arc::new(options),
        }
    }

    /// A copy with `middleware` added after (inside) the existing ones.
    #[must_use = "`with` returns a new dispatcher"]
    pub fn with<M: DispatchMiddleware>(&self, middleware: M) -> Self {
        let mut slot = Some(middleware);
        let any = &mut slot as &mut dyn Any;
        if let Some(m) = any.downcast_mut::<Option<Metrics>>().and_then(Option::take) {
            return self.push_builtin(Builtin::Metrics(m));
        }
        if let Some(d) = any
            .downcast_mut::<Option<Deadline>>()
            .and_then(Option::take)
        {
            return self.push_builtin(Builtin::Deadline(d));
        }
        match slot {
            Some(m) => self.with_arc(Arc::new(m)),
            None => self.clone(),
        }
    }

    /// A copy with a shared `middleware` added after (inside) the existing
    /// ones.
    #[must_use = "`with_arc` returns a new dispatcher"]
    pub fn with_arc(&self, middleware: Arc<dyn DispatchMiddleware>) -> Self {
        self.configure(|o| {
            let mut layers = o.layers.to_vec();
            layers.push(middleware);
            o.layers = layers.into();
        })
    }

    fn push_builtin(&self, builtin: Builtin) -> Self {
        if !self.options.layers.is_empty() {
            // Inside a custom layer: keep the order, run it as a layer.
            return match builtin {
                Builtin::Metrics(m) => self.with_arc(Arc::new(m)),
                Builtin::Deadline(d) => self.with_arc(Arc::new(d)),
            };
        }
        self.configure(|o| o.builtins.push(builtin))
    }

    /// A copy whose dispatch spans carry the attributes `attributes`
    /// extracts (replacing any set before).
    #[must_use = "`span_attributes` returns a new dispatcher"]
    pub fn span_attributes(&self, attributes: SpanAttributes) -> Self {
        self.configure(|o| o.attributes = attributes)
    }

    /// A copy that opens a dispatch span for events too (`true`) or not
    /// (`false`, the default).
    #[must_use = "`span_events` returns a new dispatcher"]
    pub fn span_events(&self, enabled: bool) -> Self {
        self.configure(|o| o.span.events = enabled)
    }

    /// A copy that opens no dispatch span at all.
    #[must_use = "`without_span` returns a new dispatcher"]
    pub fn without_span(&self) -> Self {
        self.configure(|o| {
            o.span = SpanKinds {
                commands: false,
                queries: false,
                events: false,
            }
        })
    }

    /// The underlying bus.
    pub fn bus(&self) -> &MessageBus {
        &self.bus
    }

    /// Runs `envelope` through the span, the layers and the bus.
    ///
    /// The span is opened when this is called, like an
    /// [`instrument`](tracing::Instrument::instrument)ed future's: the
    /// returned future then runs inside it.
    pub fn run(&self, envelope: Envelope) -> impl Future<Output = Result<Envelope>> + Send + '_ {
        let o = &*self.options;
        let (tag, side) = (envelope.message_name(), envelope.kind());
        let span = if o.span.covers(side) {
            span::open(side, tag, &envelope, &o.attributes)
        } else {
            None
        };
        // Nobody listening and nothing to run around the bus: the bus's own
        // future, without the observed path's future (and its box).
        if span.is_none() && o.layers.is_empty() && !o.builtins.iter().any(Builtin::active) {
            return Either::Left(self.bus.dispatch(envelope));
        }
        Either::Right(Box::pin(self.run_observed(
            DispatchContext { tag, side },
            span,
            envelope,
        )))
    }

    async fn run_observed(
        &self,
        ctx: DispatchContext,
        span: Option<tracing::Span>,
        envelope: Envelope,
    ) -> Result<Envelope> {
        let builtins = &self.options.builtins;
        let inner = async move {
            if builtins.is_empty() {
                self.run_custom(ctx, envelope).await
            } else {
                run_builtins(builtins, ctx, self.run_custom(ctx, envelope)).await
            }
        };
        match span {
            None => inner.await,
            Some(span) => {
                let out = inner.instrument(span.clone()).await;
                span::close(&span, &out);
                out
            }
        }
    }

    async fn run_custom(&self, ctx: DispatchContext, envelope: Envelope) -> Result<Envelope> {
        if self.options.layers.is_empty() {
            self.bus.dispatch(envelope).await
        } else {
            run_layers(&self.bus, &self.options.layers, ctx, &envelope).await
        }
    }

    /// Dispatches a command and returns its handler's output.
    ///
    /// A command routed to a transport is sent there, and `Ok(())` comes
    /// back when its output is `()`. One with any other output is refused
    /// before anything is sent ([`BusError::ExpectsResult`]): no result
    /// comes back from a transport, so use [`send`](Self::send) for it. A
    /// command a `before_consuming` filter stopped fails with
    /// [`BusError::StoppedByFilter`], not with its handler's error.
    pub fn dispatch<C: Command>(
        &self,
        command: C,
    ) -> impl Future<Output = Result<C::Output, DispatchError<C::Error>>> + Send + '_ {
        let envelope = Envelope::new(command);
        match self.refuse_routed::<C::Output, C::Error>(&envelope, false) {
            Some(refused) => Either::Left(std::future::ready(Err(refused))),
            None => Either::Right(self.run(envelope).map(output::<C::Output, C::Error>)),
        }
    }

    /// Asks a query and returns its handler's answer. A query routed to a
    /// transport is refused before anything is sent
    /// ([`BusError::ExpectsResult`]): its answer would never come back.
    pub fn ask<Q: Query>(
        &self,
        query: Q,
    ) -> impl Future<Output = Result<Q::Output, DispatchError<Q::Error>>> + Send + '_ {
        let envelope = Envelope::query(query);
        match self.refuse_routed::<Q::Output, Q::Error>(&envelope, true) {
            Some(refused) => Either::Left(std::future::ready(Err(refused))),
            None => Either::Right(self.run(envelope).map(output::<Q::Output, Q::Error>)),
        }
    }

    /// The refusal of a dispatch waiting for an output of type `T` (of any
    /// type, with `always`) when `envelope` is routed to transports.
    #[inline]
    fn refuse_routed<T: 'static, E>(
        &self,
        envelope: &Envelope,
        always: bool,
    ) -> Option<DispatchError<E>> {
        if !always && std::any::TypeId::of::<T>() == std::any::TypeId::of::<()>() {
            return None;
        }
        let transports = self.bus.routed_without_result(envelope);
        if transports.is_empty() {
            return None;
        }
        Some(DispatchError::Infrastructure(BusError::ExpectsResult {
            message: envelope.message_name(),
            transports: transports.iter().map(|t| t.to_string()).collect(),
        }))
    }

    /// Publishes an event to all its handlers (or its transports).
    pub fn publish<E: Event>(
        &self,
        event: E,
    ) -> impl Future<Output = Result<(), DispatchError<EventErrors<E::Error>>>> + Send + '_ {
        self.run(Envelope::event(event)).map(published::<E::Error>)
    }
}

/// The typed result of publishing an event.
fn published<E>(out: Result<Envelope>) -> Result<(), DispatchError<EventErrors<E>>>
where
    E: std::error::Error + Send + Sync + 'static,
{
    match out {
        Ok(_) => Ok(()),
        Err(BusError::HandlerFailed { envelope, errors }) => {
            let (domain, other) = split_errors::<E>(errors);
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

/// Runs the built-in layers around `inner` in one future: metrics start
/// their clocks outermost first and record innermost first; the earliest
/// deadline (the outermost of equal ones) drops `inner` when it passes, and
/// metrics inside it count the dispatch as cancelled, those outside as
/// failed.
async fn run_builtins<F>(builtins: &[Builtin], ctx: DispatchContext, inner: F) -> Result<Envelope>
where
    F: Future<Output = Result<Envelope>>,
{
    let mut guards: SmallVec<[(usize, MetricsGuard); 2]> = SmallVec::new();
    let mut limit: Option<(usize, &Deadline)> = None;
    for (i, builtin) in builtins.iter().enumerate() {
        match builtin {
            Builtin::Metrics(m) => {
                if let Some(g) = m.start(ctx.tag, ctx.side) {
                    guards.push((i, g));
                }
            }
            Builtin::Deadline(d) => {
                if limit.is_none_or(|(_, cur)| d.after() < cur.after()) {
                    limit = Some((i, d));
                }
            }
        }
    }
    let out = match limit {
        None => inner.await,
        Some((at, d)) => {
            let timed = tokio::time::timeout(d.after(), inner).await;
            match timed {
                Ok(out) => out,
                Err(_) => {
                    for (_, g) in guards.iter_mut().filter(|(i, _)| *i > at) {
                        g.cancel();
                    }
                    Err(d.exceeded(ctx.tag, ctx.side))
                }
            }
        }
    };
    for (_, g) in guards.iter_mut().rev() {
        g.finish(&out);
    }
    out
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
            if let Some(stopped) = envelope.last::<StoppedByFilterStamp>() {
                return Err(DispatchError::Infrastructure(BusError::StoppedByFilter {
                    message: name,
                    stage: stopped.stage.to_string(),
                }));
            }
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
