//! Lending the borrowed rest of a pipeline to a closure through an owned
//! handle.
//!
//! [`Next`](super::Next) and [`StageNext`](super::stage::StageNext) borrow
//! the chain they run, so the future of a middleware that holds one depends
//! on a lifetime. A closure returning `async move { … }` cannot say that its
//! future depends on the lifetime of an argument, which is why closures used
//! to need annotated arguments and a `Box::pin` of their own. The closure
//! adapters ([`from_fn`](super::from_fn), [`stage::as_middleware`](super::stage::as_middleware))
//! hand the closure an owned, `'static` handle instead, and keep the
//! borrowed rest themselves:
//!
//! * the handle's [`run`](super::OwnedNext::run) returns an
//!   [`OwnedNextFuture`], which, when first polled, leaves the envelope in a
//!   [`Link`] the handle shares with the adapter's future ([`relay`]);
//! * the adapter's future polls the closure's future and, once it finds an
//!   envelope in the link, starts the borrowed rest with it and polls that
//!   too, within its own poll; when the rest returns, it leaves the result
//!   in the link and the handle's future returns it.
//!
//! The rest of the pipeline is therefore always polled by the middleware's
//! own future, in the task and the dispatch frame of the dispatch, wherever
//! the closure moved its handle. What the handle asked for but no longer
//! wants is not run: dropping the handle without running it short-circuits
//! the pipeline, as a middleware that does not call `next`; dropping its
//! future while the rest runs drops the rest. A handle run once its
//! middleware has finished fails with [`OwnedNextError::Gone`], handing the
//! envelope back.
//!
//! A wake-up goes only where it is needed: the handle does not wake the
//! adapter while the adapter is polling the closure (it looks at the link
//! right after), and the adapter wakes the handle's task only when that
//! task did not take the result while the adapter polled the closure again.

use std::fmt;
use std::future::{poll_fn, Future};
use std::mem;
use std::pin::{pin, Pin};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use crate::envelope::Envelope;
use crate::error::{BusError, Result};

/// What an owned handle to the rest of a pipeline ([`OwnedNext`](super::OwnedNext),
/// [`OwnedStageNext`](super::stage::OwnedStageNext)) fails with when it cannot
/// run it. Comes wrapped in [`BusError::Middleware`], named after the
/// middleware the handle was handed to.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OwnedNextError {
    /// The middleware the handle was handed to had finished (its future
    /// completed or was dropped) before the rest of the pipeline returned,
    /// so nothing runs the rest any more. Run the handle within the
    /// middleware's future: move it into a spawned task only if the
    /// middleware awaits that task.
    #[error(
        "the middleware had finished, so the rest of the pipeline no longer runs; await `next` before the middleware's future completes"
    )]
    Gone {
        /// The envelope the handle was run with, when the rest had not
        /// started with it.
        envelope: Option<Box<Envelope>>,
    },
    /// The [`OwnedNextFuture`] was polled again after it completed.
    #[error("an `OwnedNextFuture` was polled after it completed")]
    PolledAfterCompletion,
}

/// Where the handle's run stands.
enum State {
    /// The handle has not run.
    Idle,
    /// The handle asks for the rest to run with this envelope.
    Asked(Envelope),
    /// The adapter runs the rest.
    Running,
    /// The rest returned this.
    Done(Result<Envelope>),
    /// The handle's future was dropped before the result came.
    Abandoned,
    /// The adapter finished before the handle had a result.
    Closed {
        /// The name of the middleware the handle was handed to.
        middleware: String,
        /// The envelope the handle asked to run, if the rest had not
        /// started with it.
        envelope: Option<Envelope>,
    },
    /// The handle took the result.
    Taken,
}

struct Shared {
    state: State,
    /// Whether the adapter is polling the closure's future now: it looks
    /// at the link when that poll returns, so the handle need not wake it.
    polling: bool,
    /// The adapter's task, woken when the handle asks or abandons.
    relay: Option<Waker>,
    /// The task of the handle's future, woken when the result is there or
    /// the adapter finished.
    handle: Option<Waker>,
}

/// What a handle and its adapter share: one allocation per call of a
/// closure middleware.
pub(crate) struct Link(Mutex<Shared>);

/// What the adapter is to do after polling the closure.
enum Request {
    /// Start the rest with this envelope.
    Run(Envelope),
    /// Drop the rest: the handle's future no longer wants it.
    Drop,
    /// Nothing new.
    Wait,
}

impl Link {
    /// A link whose handle has not run yet.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Link(Mutex::new(Shared {
            state: State::Idle,
            polling: false,
            relay: None,
            handle: None,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // Nothing panics while the lock is held, and the state is whole
        // between statements, so a poisoned lock is still usable.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The handle's side of a poll: asks for the rest to run with
    /// `envelope` on the first poll, then returns the result once it is
    /// there.
    fn poll_result(&self, envelope: Option<Envelope>, waker: &Waker) -> Poll<Result<Envelope>> {
        let mut shared = self.lock();
        let mut wake = None;
        if let Some(envelope) = envelope {
            match &mut shared.state {
                State::Idle => {
                    shared.state = State::Asked(envelope);
                    if !shared.polling {
                        wake = shared.relay.take();
                    }
                }
                State::Closed { middleware, .. } => {
                    return Poll::Ready(Err(gone(mem::take(middleware), Some(envelope))));
                }
                // A handle runs once: its first poll finds the link idle or
                // closed.
                _ => return Poll::Ready(Err(polled_after_completion())),
            }
        }
        let out = match mem::replace(&mut shared.state, State::Taken) {
            State::Done(out) => Poll::Ready(out),
            State::Closed {
                middleware,
                envelope,
            } => Poll::Ready(Err(gone(middleware, envelope))),
            waiting @ (State::Asked(_) | State::Running) => {
                shared.state = waiting;
                register(&mut shared.handle, waker);
                Poll::Pending
            }
            other => {
                shared.state = other;
                Poll::Ready(Err(polled_after_completion()))
            }
        };
        drop(shared);
        if let Some(relay) = wake {
            relay.wake();
        }
        out
    }

    /// The handle's future is dropped after it asked: the rest is no longer
    /// wanted.
    fn abandon(&self) {
        let mut shared = self.lock();
        let (old, wake) = match shared.state {
            State::Asked(_) | State::Running => {
                let old = mem::replace(&mut shared.state, State::Abandoned);
                let wake = if shared.polling {
                    None
                } else {
                    shared.relay.take()
                };
                (old, wake)
            }
            State::Done(_) => (mem::replace(&mut shared.state, State::Taken), None),
            _ => return,
        };
        drop(shared);
        // The envelope or the result is dropped outside the lock.
        drop(old);
        if let Some(relay) = wake {
            relay.wake();
        }
    }

    /// Marks the adapter as polling the closure's future.
    fn start_poll(&self) {
        self.lock().polling = true;
    }

    /// After the adapter polled the closure's future: wakes the handle's
    /// task if it was handed a result during the poll before and did not
    /// take it in this one, and, unless the closure `finished` (then
    /// [`close`](Self::close) hands back what the handle asked), says what
    /// the handle asked.
    fn end_poll(&self, waker: &Waker, handed: Option<Waker>, finished: bool) -> Request {
        let mut shared = self.lock();
        shared.polling = false;
        let wake = handed.filter(|_| matches!(shared.state, State::Done(_)));
        let request = match mem::replace(&mut shared.state, State::Running) {
            State::Asked(envelope) if !finished => Request::Run(envelope),
            other => {
                let abandoned = matches!(other, State::Abandoned);
                shared.state = other;
                if abandoned {
                    Request::Drop
                } else {
                    Request::Wait
                }
            }
        };
        register(&mut shared.relay, waker);
        drop(shared);
        if let Some(handle) = wake {
            handle.wake();
        }
        request
    }

    /// Hands the rest's result to the handle, unless it no longer wants
    /// it. Returns the handle's waker, to wake only if the next poll of the
    /// closure does not take the result.
    fn complete(&self, out: Result<Envelope>) -> Option<Waker> {
        let mut shared = self.lock();
        if matches!(shared.state, State::Running) {
            shared.state = State::Done(out);
            shared.handle.take()
        } else {
            drop(shared);
            drop(out);
            None
        }
    }

    /// The adapter finished: a handle still waiting, or yet to run, learns
    /// that nothing will run the rest.
    fn close(self: &Arc<Self>, middleware: &str) {
        if Arc::strong_count(self) == 1 {
            // No handle and no handle's future is left to tell.
            return;
        }
        let mut shared = self.lock();
        let envelope = match mem::replace(&mut shared.state, State::Taken) {
            State::Idle | State::Running => None,
            State::Asked(envelope) => Some(envelope),
            other => {
                shared.state = other;
                return;
            }
        };
        shared.state = State::Closed {
            middleware: middleware.to_owned(),
            envelope,
        };
        let wake = shared.handle.take();
        drop(shared);
        if let Some(handle) = wake {
            handle.wake();
        }
    }
}

/// Keeps `waker` in `slot`, unless what is there wakes the same task.
fn register(slot: &mut Option<Waker>, waker: &Waker) {
    match slot {
        Some(old) if old.will_wake(waker) => {}
        _ => *slot = Some(waker.clone()),
    }
}

fn gone(middleware: String, envelope: Option<Envelope>) -> BusError {
    BusError::Middleware {
        middleware,
        source: Box::new(OwnedNextError::Gone {
            envelope: envelope.map(Box::new),
        }),
    }
}

fn polled_after_completion() -> BusError {
    BusError::Middleware {
        middleware: "OwnedNext".to_owned(),
        source: Box::new(OwnedNextError::PolledAfterCompletion),
    }
}

/// The future of an owned handle's `run`: the rest of the pipeline's
/// result. It asks for the rest to run when first polled, like any future
/// does nothing until polled; dropping it while the rest runs drops the
/// rest.
#[must_use = "futures do nothing unless awaited"]
pub struct OwnedNextFuture {
    link: Arc<Link>,
    /// The envelope to hand over, until the first poll.
    envelope: Option<Envelope>,
}

impl OwnedNextFuture {
    pub(crate) fn new(link: Arc<Link>, envelope: Envelope) -> Self {
        Self {
            link,
            envelope: Some(envelope),
        }
    }
}

impl Future for OwnedNextFuture {
    type Output = Result<Envelope>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        this.link.poll_result(this.envelope.take(), cx.waker())
    }
}

impl Drop for OwnedNextFuture {
    fn drop(&mut self) {
        if self.envelope.is_none() {
            self.link.abandon();
        }
    }
}

impl fmt::Debug for OwnedNextFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OwnedNextFuture")
    }
}

/// Tells the link the adapter finished, however it finishes: completed,
/// dropped while pending, or dropped before it was first polled.
struct CloseOnDrop<'a> {
    link: Arc<Link>,
    middleware: &'a str,
}

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.link.close(self.middleware);
    }
}

/// The adapter's future: polls the closure's future `fut`, whose handle
/// shares `link`, and runs the rest (`start(envelope)`) for the handle when
/// it asks. `middleware` names the middleware in the error of a handle run
/// too late.
pub(crate) fn relay<'a, Fut, Start, Rest>(
    link: Arc<Link>,
    fut: Fut,
    start: Start,
    middleware: &'a str,
) -> impl Future<Output = Result<Envelope>> + 'a
where
    Fut: Future<Output = Result<Envelope>> + 'a,
    Start: FnOnce(Envelope) -> Rest + 'a,
    Rest: Future<Output = Result<Envelope>> + 'a,
{
    // Made before the future, so that a future dropped unpolled (whose
    // closure may have handed its handle on already) closes the link too.
    let close = CloseOnDrop { link, middleware };
    async move {
        // Bound in the body, so that the closure's future (and the handle
        // it may own) is dropped before the link is closed.
        let close = close;
        let link = &close.link;
        run(link, fut, start).await
    }
}

/// The loop of [`relay`].
async fn run<Fut, Start, Rest>(link: &Link, fut: Fut, start: Start) -> Result<Envelope>
where
    Fut: Future<Output = Result<Envelope>>,
    Start: FnOnce(Envelope) -> Rest,
    Rest: Future<Output = Result<Envelope>>,
{
    let mut fut = pin!(fut);
    let mut rest = pin!(None::<Rest>);
    let mut start = Some(start);
    // The handle's waker, when the rest returned and the closure has not
    // been polled since.
    let mut handed: Option<Waker> = None;
    poll_fn(|cx| loop {
        link.start_poll();
        let polled = fut.as_mut().poll(cx);
        let request = link.end_poll(cx.waker(), handed.take(), polled.is_ready());
        if polled.is_ready() {
            return polled;
        }
        match request {
            // A handle runs once, so `start` is there.
            Request::Run(envelope) => {
                if let Some(start) = start.take() {
                    rest.set(Some(start(envelope)));
                }
            }
            Request::Drop => rest.set(None),
            Request::Wait => {}
        }
        let Some(running) = rest.as_mut().as_pin_mut() else {
            return Poll::Pending;
        };
        let Poll::Ready(out) = running.poll(cx) else {
            return Poll::Pending;
        };
        rest.set(None);
        // Poll the closure again: it is likely awaiting the result.
        handed = link.complete(out);
    })
    .await
}
