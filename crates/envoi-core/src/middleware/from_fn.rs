//! Middleware made from a closure: [`from_fn`], with an owned handle to the
//! rest of the pipeline ([`OwnedNext`]). The closure's arguments need no
//! annotation and its future no box: the handle it gets is `'static`, so
//! the future may own it. How the adapter runs the borrowed rest for it is
//! told in `relay.rs`, what that costs on [`from_fn`].

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use super::relay::{relay, Link, OwnedNextFuture};
use super::{BoxFuture, Middleware, Next};
use crate::envelope::Envelope;
use crate::error::Result;

/// A middleware made from a closure; see [`from_fn`].
pub struct FnMiddleware<F> {
    name: Cow<'static, str>,
    f: F,
}

/// Makes a middleware named `name` from a closure taking the envelope and
/// an owned handle to the rest of the pipeline ([`OwnedNext`]), and
/// returning a future of the envelope that comes back.
///
/// The closure behaves as [`Middleware::handle`]: code before
/// [`next.run(envelope)`](OwnedNext::run) runs on the way in, code after it
/// on the way out; not running `next` (dropping it) short-circuits the
/// pipeline; an error travels back through the `Result`.
///
/// ```
/// use envoi_core::middleware::{from_fn, MiddlewareStack};
/// use envoi_core::stamp::{DelayStamp, SentStamp};
/// use envoi_core::{Envelope, Message};
/// use std::sync::Arc;
///
/// #[derive(Debug)]
/// struct Ping;
/// impl Message for Ping { const NAME: &'static str = "Ping"; }
///
/// let log = from_fn("log", |envelope, next| async move {
///     let name = envelope.message_name();
///     let out = next.run(envelope.with(DelayStamp { ms: 10 })).await;
///     println!("{name}: {}", if out.is_ok() { "ok" } else { "failed" });
///     out.map(|envelope| envelope.with(SentStamp::new("log")))
/// });
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let out = MiddlewareStack::new([Arc::new(log) as _]).run(Envelope::new(Ping)).await.unwrap();
/// assert!(out.has::<DelayStamp>() && out.has::<SentStamp>());
/// # });
/// ```
///
/// # Cost
///
/// Only closures pay for the convenience; a type implementing
/// [`Middleware`] costs what it did. Each call of a closure middleware
/// makes one heap allocation more than a middleware type that boxes its
/// future (the link its handle and the boxed future share), and takes an
/// uncontended lock a few times. The rest of the pipeline runs in the
/// middleware's own future, in the dispatch's task, even when the closure
/// moves its handle elsewhere; see [`OwnedNext`].
pub fn from_fn<F, Fut>(name: impl Into<Cow<'static, str>>, f: F) -> FnMiddleware<F>
where
    F: Fn(Envelope, OwnedNext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Envelope>> + Send + 'static,
{
    FnMiddleware {
        name: name.into(),
        f,
    }
}

impl<F, Fut> Middleware for FnMiddleware<F>
where
    F: Fn(Envelope, OwnedNext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Envelope>> + Send + 'static,
{
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        let link = Link::new();
        let handle = OwnedNext {
            sends: next.sends(&envelope),
            link: link.clone(),
        };
        let fut = (self.f)(envelope, handle);
        Box::pin(relay(
            link,
            fut,
            move |envelope| next.run(envelope),
            &self.name,
        ))
    }

    fn name(&self) -> Cow<'static, str> {
        self.name.clone()
    }
}

impl<F> fmt::Debug for FnMiddleware<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnMiddleware")
            .field("name", &self.name)
            .finish()
    }
}

/// The rest of the pipeline, handed to a [`from_fn`] closure: the owned,
/// `'static` counterpart of [`Next`], which the closure's future can own.
///
/// Running it consumes it, so it runs at most once; dropping it without
/// running it short-circuits the pipeline. The rest runs in the
/// middleware's own future: a closure may move its handle into another
/// task, as long as it awaits that task before it returns; a handle run
/// once its middleware has finished fails with
/// [`OwnedNextError::Gone`](super::OwnedNextError::Gone), which hands the
/// envelope back.
///
/// Like [`Next`], it cannot run twice; the second call does not compile:
///
/// ```compile_fail
/// use envoi_core::middleware::from_fn;
///
/// let twice = from_fn("twice", |envelope, next| async move {
///     let first = next.run(envelope.clone()).await?;
///     next.run(first).await // error[E0382]: use of moved value: `next`
/// });
/// ```
#[must_use = "a middleware that drops `next` short-circuits the pipeline"]
pub struct OwnedNext {
    link: Arc<Link>,
    sends: bool,
}

impl OwnedNext {
    /// Whether the rest of the pipeline would send the envelope this
    /// middleware was handed to a transport (it is routed and was not
    /// received from one) rather than handle it in this process; see
    /// [`Next::sends`]. It answers for the envelope as it came in, which
    /// still holds for that envelope with stamps or headers added, unless
    /// one of them is a [`ReceivedStamp`](crate::stamp::ReceivedStamp).
    pub fn sends(&self) -> bool {
        self.sends
    }

    /// Runs the rest of the pipeline with `envelope`, once the returned
    /// future is first polled.
    pub fn run(self, envelope: Envelope) -> OwnedNextFuture {
        OwnedNextFuture::new(self.link, envelope)
    }
}

impl fmt::Debug for OwnedNext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedNext")
            .field("sends", &self.sends)
            .finish()
    }
}
