//! The onion pipeline: [`Middleware`], [`Next`] and [`MiddlewareStack`].
//!
//! Every behaviour that is not "call the handler" lives in a middleware:
//! routing, retries, logging, metrics, validation, deduplication. A
//! middleware receives an [`Envelope`], may add stamps, calls
//! [`next.run(envelope)`](Next::run) to continue (or does not, to
//! short-circuit), may look at or stamp the envelope that comes back, and
//! returns it. Code before `next` runs on the way in, code after it on the
//! way out.
//!
//! ```
//! use envoi_core::middleware::{Middleware, MiddlewareStack, Next, BoxFuture};
//! use envoi_core::{Envelope, Message, Result};
//! use envoi_core::stamp::DelayStamp;
//! use std::sync::Arc;
//!
//! /// Adds a one-second delay to every message.
//! struct Later;
//!
//! impl Middleware for Later {
//!     fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
//!         Box::pin(async move { next.run(envelope.with(DelayStamp { ms: 1000 })).await })
//!     }
//! }
//!
//! #[derive(Debug)]
//! struct Ping;
//! impl Message for Ping { const NAME: &'static str = "Ping"; }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let stack = MiddlewareStack::new([Arc::new(Later) as Arc<dyn Middleware>]);
//! let out = stack.run(Envelope::new(Ping)).await.unwrap();
//! assert_eq!(out.last::<DelayStamp>().unwrap().ms, 1000);
//! # });
//! ```
//!
//! A closure makes a middleware too, with no annotations and no box:
//! [`from_fn`] hands it an owned handle to the rest of the pipeline
//! ([`OwnedNext`]) its future can keep.
//!
//! ```
//! use envoi_core::middleware::from_fn;
//! use envoi_core::stamp::DelayStamp;
//!
//! let later = from_fn("later", |envelope, next| async move {
//!     next.run(envelope.with(DelayStamp { ms: 1000 })).await
//! });
//! # let _ = later;
//! ```
//!
//! # `next` runs at most once
//!
//! [`Next::run`] takes `self`, so a middleware cannot run the rest of the
//! pipeline twice; the second call does not compile:
//!
//! ```compile_fail
//! use envoi_core::middleware::{Middleware, Next, BoxFuture};
//! use envoi_core::{Envelope, Result};
//!
//! struct Twice;
//! impl Middleware for Twice {
//!     fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
//!         Box::pin(async move {
//!             let first = next.run(envelope.clone()).await?;
//!             next.run(first).await // error[E0382]: use of moved value: `next`
//!         })
//!     }
//! }
//! ```

pub mod circuit_breaker;
pub mod correlation;
pub mod dedup;
mod from_fn;
pub mod hook;
pub mod logging;
mod relay;
pub mod stage;
pub mod validation;

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::envelope::stamp::RedeliveryStamp;
use crate::envelope::Envelope;
use crate::error::Result;

pub use crate::BoxFuture;
pub use from_fn::{from_fn, FnMiddleware, OwnedNext};
pub use relay::{OwnedNextError, OwnedNextFuture};

/// One layer of the onion.
///
/// # Contract
///
/// * Call [`next.run(envelope)`](Next::run) at most once (enforced: it
///   consumes `next`), or not at all to short-circuit.
/// * Never remove a stamp; add new ones with [`Envelope::with`].
/// * Await `next` inside the returned future; errors travel back through
///   `Result`.
///
/// # Errors
///
/// Return a [`BusError`](crate::BusError); use
/// [`BusError::Middleware`](crate::BusError::Middleware) for a failure of
/// the middleware's own.
pub trait Middleware: Send + Sync + 'static {
    /// Processes `envelope`, usually by calling `next.run(envelope)`.
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>>;

    /// A name for diagnostics and pipeline listings; the type name by
    /// default.
    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed(short_type_name(std::any::type_name::<Self>()))
    }

    /// Releases resources when the middleware is removed from a bus or the
    /// bus is disposed. Should be idempotent. Does nothing by default.
    fn dispose(&self) {}

    /// Whether this middleware has anything to do for `envelope`; `true` by
    /// default.
    ///
    /// A middleware that returns `false` promises that its
    /// [`handle`](Middleware::handle) would only pass `envelope` on
    /// unchanged (`next.run(envelope)`). Before running its user middleware
    /// a bus asks them in order and starts the chain at the first that takes
    /// part; when none does, it skips the chain and takes its fast path, as
    /// if it had no user middleware. The middleware after the first that
    /// takes part are not asked: their `handle` runs as usual. It is asked
    /// at most once per dispatch, so it should be cheap.
    fn takes_part(&self, envelope: &Envelope) -> bool {
        let _ = envelope;
        true
    }
}

/// Strips the module path from a type name (`a::b::Foo<c::D>` → `Foo<c::D>`);
/// a closure keeps the name of the function it is in (`a::main::{{closure}}`
/// → `main::{{closure}}`).
pub(crate) fn short_type_name(full: &'static str) -> &'static str {
    let end = full.find('<').unwrap_or(full.len());
    let head = &full[..end];
    let mut cut = head.len();
    // Walk back over closure segments to the first named one.
    while let Some(i) = head[..cut].rfind("::") {
        if head[i + 2..cut].starts_with("{{") {
            cut = i;
            continue;
        }
        return &full[i + 2..];
    }
    full
}

/// What a [`Next`] runs once the middleware chain is exhausted.
///
/// The bus's own steps implement it; tests implement it to record what
/// reached the end of a chain (see the `testing` module).
pub trait Endpoint: Send + Sync {
    /// Runs the endpoint.
    fn call(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope>>;

    /// Whether running `envelope` would send it to a transport instead of
    /// handling it here. `false` unless the endpoint routes messages.
    fn sends(&self, envelope: &Envelope) -> bool {
        let _ = envelope;
        false
    }
}

/// The rest of the pipeline, handed to a middleware.
///
/// Running it consumes it, so it runs at most once.
#[must_use = "a middleware that drops `next` short-circuits the pipeline"]
pub struct Next<'a> {
    chain: &'a [Arc<dyn Middleware>],
    endpoint: Option<&'a dyn Endpoint>,
    /// The middleware this was handed to already said it takes part.
    caller_takes_part: bool,
}

impl<'a> Next<'a> {
    /// A `Next` running `chain` and then `endpoint` (or returning the envelope
    /// unchanged when `endpoint` is `None`).
    pub fn new(chain: &'a [Arc<dyn Middleware>], endpoint: Option<&'a dyn Endpoint>) -> Self {
        Self {
            chain,
            endpoint,
            caller_takes_part: false,
        }
    }

    /// Like [`new`](Self::new), handed to a middleware whose
    /// [`takes_part`](Middleware::takes_part) just returned `true` for the
    /// envelope it is about to handle.
    pub(crate) fn after_asking(
        chain: &'a [Arc<dyn Middleware>],
        endpoint: Option<&'a dyn Endpoint>,
    ) -> Self {
        Self {
            caller_takes_part: true,
            ..Self::new(chain, endpoint)
        }
    }

    /// A `Next` that runs only `endpoint`.
    pub fn to_endpoint(endpoint: &'a dyn Endpoint) -> Self {
        Self::new(&[], Some(endpoint))
    }

    /// A `Next` that returns the envelope unchanged.
    pub fn passthrough() -> Self {
        Self::new(&[], None)
    }

    /// Whether the middleware this `Next` was handed to was asked
    /// [`takes_part`](Middleware::takes_part) for this envelope just before
    /// and said yes, so it need not decide again.
    pub(crate) fn caller_takes_part(&self) -> bool {
        self.caller_takes_part
    }

    /// Whether the rest of the pipeline would send `envelope` to a transport
    /// (it is routed and was not received from one) rather than handle it in
    /// this process. Stage adapters use it to run the sender-side stages only.
    pub fn sends(&self, envelope: &Envelope) -> bool {
        self.endpoint.is_some_and(|e| e.sends(envelope))
    }

    /// Runs the rest of the pipeline with `envelope`.
    pub fn run(self, envelope: Envelope) -> NextFuture<'a> {
        match self.chain.split_first() {
            Some((first, rest)) => NextFuture(Inner::Boxed(
                first.handle(envelope, Next::new(rest, self.endpoint)),
            )),
            None => match self.endpoint {
                Some(endpoint) => NextFuture(Inner::Boxed(endpoint.call(envelope))),
                None => NextFuture(Inner::Ready(Some(envelope))),
            },
        }
    }
}

impl fmt::Debug for Next<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Next")
            .field("remaining", &self.chain.len())
            .field("endpoint", &self.endpoint.is_some())
            .finish()
    }
}

/// The future returned by [`Next::run`].
#[must_use = "futures do nothing unless awaited"]
pub struct NextFuture<'a>(Inner<'a>);

enum Inner<'a> {
    // The passthrough's envelope (only ever a success): an `Envelope`, not
    // a `Result`, keeps this future — held by every caller of `run` — at
    // three words.
    Ready(Option<Envelope>),
    Boxed(BoxFuture<'a, Result<Envelope>>),
}

impl Future for NextFuture<'_> {
    type Output = Result<Envelope>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            Inner::Ready(v) => {
                Poll::Ready(Ok(v.take().expect("NextFuture polled after completion")))
            }
            Inner::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

impl<'a> NextFuture<'a> {
    /// The future as a [`BoxFuture`], without boxing it a second time: a
    /// middleware that decides to pass the envelope straight on can return
    /// `next.run(envelope).boxed()` and add no allocation of its own.
    pub fn boxed(self) -> BoxFuture<'a, Result<Envelope>> {
        match self.0 {
            Inner::Boxed(f) => f,
            Inner::Ready(v) => Box::pin(std::future::ready(Ok(
                v.expect("NextFuture polled after completion")
            ))),
        }
    }
}

impl fmt::Debug for NextFuture<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NextFuture")
    }
}

/// Runs a fixed list of middlewares in order, then returns the envelope.
///
/// This is Symfony Messenger's plain runner: `MiddlewareStack::new(list).run(e)`.
/// A `MessageBus` assembles its own, faster pipeline in
/// the canonical order; use a stack to test middlewares together or to build
/// a pipeline by hand.
#[derive(Clone)]
pub struct MiddlewareStack {
    chain: Arc<[Arc<dyn Middleware>]>,
}

impl MiddlewareStack {
    /// A stack running `middlewares` in the given order.
    pub fn new(middlewares: impl IntoIterator<Item = Arc<dyn Middleware>>) -> Self {
        Self {
            chain: middlewares.into_iter().collect(),
        }
    }

    /// Runs the stack; once every middleware has called `next`, the envelope
    /// comes back unchanged.
    pub async fn run(&self, envelope: Envelope) -> Result<Envelope> {
        Next::new(&self.chain, None).run(envelope).await
    }

    /// Runs the stack, then `endpoint`.
    pub async fn run_with(&self, envelope: Envelope, endpoint: &dyn Endpoint) -> Result<Envelope> {
        Next::new(&self.chain, Some(endpoint)).run(envelope).await
    }

    /// The names of the middlewares, in order.
    pub fn names(&self) -> Vec<String> {
        self.chain.iter().map(|m| m.name().into_owned()).collect()
    }
}

impl fmt::Debug for MiddlewareStack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

/// A stack is an endpoint too: what runs once a chain is exhausted can be
/// a whole pipeline (the steps after step 2, where deferred dispatches go).
impl Endpoint for MiddlewareStack {
    fn call(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope>> {
        Box::pin(self.run(envelope))
    }
}

/// Whether `after`, the successful result of dispatching `before`, was
/// scheduled for a retry by the retry step rather than handled. (Parking in
/// the failure transport returns an error, never a success.)
pub fn was_retried(before: &Envelope, after: &Envelope) -> bool {
    after.all::<RedeliveryStamp>().count() > before.all::<RedeliveryStamp>().count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::message::Message;
    use crate::envelope::stamp::{SentStamp, Stamp};
    use std::sync::Mutex;

    #[derive(Debug)]
    struct Ping;
    impl Message for Ping {
        const NAME: &'static str = "Ping";
    }

    /// Records its name on the way in and on the way out.
    struct Trace {
        name: &'static str,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Middleware for Trace {
        fn handle<'a>(&'a self, e: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
            Box::pin(async move {
                self.log.lock().unwrap().push(format!("{} in", self.name));
                let out = next.run(e.with(SentStamp::new(self.name))).await;
                self.log.lock().unwrap().push(format!("{} out", self.name));
                out
            })
        }
    }

    struct Stop;
    impl Middleware for Stop {
        fn handle<'a>(&'a self, e: Envelope, _next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
            Box::pin(async move { Ok(e) })
        }
    }

    fn trace(name: &'static str, log: &Arc<Mutex<Vec<String>>>) -> Arc<dyn Middleware> {
        Arc::new(Trace {
            name,
            log: log.clone(),
        })
    }

    #[tokio::test]
    async fn onion_runs_inbound_in_order_and_outbound_in_reverse() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let stack = MiddlewareStack::new([trace("a", &log), trace("b", &log), trace("c", &log)]);
        let out = stack.run(Envelope::new(Ping)).await.unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            ["a in", "b in", "c in", "c out", "b out", "a out"]
        );
        let sent: Vec<_> = out
            .all::<SentStamp>()
            .map(|s| s.transport.clone())
            .collect();
        assert_eq!(sent, ["a", "b", "c"]);
    }

    #[tokio::test]
    async fn a_middleware_that_does_not_call_next_short_circuits() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let stack = MiddlewareStack::new([trace("a", &log), Arc::new(Stop), trace("c", &log)]);
        stack.run(Envelope::new(Ping)).await.unwrap();
        assert_eq!(*log.lock().unwrap(), ["a in", "a out"]);
    }

    #[tokio::test]
    async fn an_empty_stack_returns_the_envelope_unchanged() {
        let out = MiddlewareStack::new([])
            .run(Envelope::new(Ping))
            .await
            .unwrap();
        assert_eq!(out.stamps().count(), 0);
        assert_eq!(out.message_name(), Ping::NAME);
    }

    #[test]
    fn short_type_names_drop_the_path() {
        assert_eq!(short_type_name("a::b::Foo"), "Foo");
        assert_eq!(short_type_name("a::Foo<b::C>"), "Foo<b::C>");
        assert_eq!(short_type_name("Foo"), "Foo");
        assert_eq!(short_type_name("a::main::{{closure}}"), "main::{{closure}}");
        assert_eq!(
            short_type_name("a::main::{{closure}}::{{closure}}"),
            "main::{{closure}}::{{closure}}"
        );
        let _ = SentStamp::NAME;
    }
}
