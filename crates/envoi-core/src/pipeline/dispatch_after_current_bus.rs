//! Step 2 of the canonical pipeline: defer nested dispatches until the outer
//! one has finished.
//!
//! A handler that dispatches a message carrying a
//! [`DispatchAfterCurrentBusStamp`] while the outer dispatch is still running
//! (on the same task) does not get it handled at once: it is queued, and
//! handled after the outer dispatch — on the bus it was dispatched on — once
//! the outer one has succeeded, including every middleware on its way out
//! (so a transaction middleware has committed). The nested `dispatch` call
//! returns the envelope straight away. The queue lives around each handler
//! call, so an outermost dispatch with no nested ones pays nothing for it;
//! a stamped dispatch made outside any handler runs at once.
//!
//! * If the outer dispatch fails, the deferred messages are dropped: they were
//!   consequences of work that did not happen.
//! * Except for the handlers that succeeded beside one that failed, on a
//!   message received from a transport that the [retry step](super::retry)
//!   schedules for a retry or parks in its failure transport: those
//!   handlers will not run again (their `HandledStamp`s travel with the
//!   message), so what they deferred is dispatched here, once, either way —
//!   after a park, before the failure is returned (a deferred message that
//!   then fails is parked by the worker too, on its own, beside the
//!   message: see below).
//! * If deferred messages fail, the others still run. Called from
//!   application code, the outer dispatch returns
//!   [`BusError::DelayedHandlingFailed`] with every error; the caller
//!   decides what to do. For a message a worker received, the
//!   [verdict](super::verdict::Verdict) carries each failed deferred message
//!   instead ([`FailedDispatch`], as it was when it failed: what its own
//!   handlers that succeeded deferred is run too), and the worker parks each
//!   of them in the
//!   failure transport, as a message of its own, and acknowledges the
//!   message: its own handling succeeded (or its retry was sent), and
//!   parked or retried it would skip the handlers that deferred them, so
//!   they would be lost. A failed consequence is therefore kept, at least
//!   once, and the message not duplicated. One that could not be sent to
//!   the transport it is routed to is parked with an [`UnsentStamp`]
//!   naming that transport: retried from the failure transport, it is sent
//!   there again (and to the transports routed after it, which the failed
//!   send did not reach), not handled as received. (One the failure
//!   transport does not take is kept by releasing a handled message, whose
//!   handlers then run again and defer it again, along with the others
//!   they deferred; beside a retry or a parked copy it is dropped, with an
//!   error log, as releasing the message would duplicate it.)
//! * Messages deferred while handling a deferred message are handled after
//!   it, in order.
//! * Only stamped messages wait: a handler that asks a query (or dispatches
//!   an unstamped command) needs its answer now, so it gets it now.
//!
//! What the handlers deferred reaches this step in a record the dispatch
//! keeps beside its future, never on the envelope.
//!
//! Use [`MessageBus::dispatch_after_current`](crate::MessageBus::dispatch_after_current)
//! or add the stamp yourself.

use std::cell::Cell;
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use super::frame::{framed, Frame};
use crate::envelope::stamp::{DispatchAfterCurrentBusStamp, ReceivedStamp, UnsentStamp};
use crate::envelope::Envelope;
use crate::error::{BusError, Result, StepResult};
use crate::middleware::{Endpoint, Middleware, Next};
use crate::BoxFuture;

/// A dispatch waiting for the outer one, with where to run it.
#[derive(Clone)]
pub(crate) struct Deferred {
    envelope: Envelope,
    target: Arc<dyn Endpoint>,
}

/// A dispatch deferred by a handler of a received message that failed once
/// it ran: the worker parks it on its own. Its envelope is as it was when
/// it failed (with the `HandledStamp`s of its own handlers that succeeded),
/// and carries an [`UnsentStamp`] when it could not be sent to its
/// transport.
#[derive(Debug)]
#[non_exhaustive]
pub struct FailedDispatch {
    /// The deferred message.
    pub envelope: Envelope,
    /// Why it failed.
    pub error: BusError,
}

// Which handler scope (if any) the current poll runs in: 0 for none. Set by
// `Scoped` around each poll of a handler's future, so it follows the handler
// across tasks and threads.
thread_local! {
    static SCOPE: Cell<u64> = const { Cell::new(0) };
}

/// Ids for scopes: unique across threads without a shared counter on the
/// hot path (a thread takes a block of ids at a time).
#[inline]
fn next_scope_id() -> u64 {
    static BLOCKS: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NEXT: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    }
    NEXT.with(|n| {
        let (mut next, mut end) = n.get();
        if next == end {
            next = BLOCKS.fetch_add(1, Ordering::Relaxed) << 20;
            end = next + (1 << 20);
        }
        n.set((next + 1, end));
        next
    })
}

/// Dispatches deferred inside a scope, by scope id. Touched only when a
/// dispatch is actually deferred; `PENDING` lets a scope that deferred
/// nothing skip the lock.
static QUEUES: Mutex<BTreeMap<u64, Vec<Deferred>>> = Mutex::new(BTreeMap::new());
static PENDING: AtomicUsize = AtomicUsize::new(0);

fn push_deferred(scope: u64, items: impl IntoIterator<Item = Deferred>) {
    let mut queues = QUEUES.lock().unwrap_or_else(|p| p.into_inner());
    let queue = queues.entry(scope).or_default();
    let before = queue.len();
    queue.extend(items);
    PENDING.fetch_add(queue.len() - before, Ordering::SeqCst);
}

/// What the scope `scope` deferred, oldest first.
///
/// The check for nothing deferred anywhere is inlined into the caller, which
/// then sees an empty vector it need not look at or free; the lookup itself
/// is out of line.
#[inline(always)]
pub(crate) fn take_deferred(scope: u64) -> Vec<Deferred> {
    if PENDING.load(Ordering::SeqCst) == 0 {
        return Vec::new();
    }
    take_queued(scope)
}

#[cold]
#[inline(never)]
fn take_queued(scope: u64) -> Vec<Deferred> {
    let taken = QUEUES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&scope)
        .unwrap_or_default();
    PENDING.fetch_sub(taken.len(), Ordering::SeqCst);
    taken
}

/// The scope a dispatch made now would be nested in, if any.
fn current_scope() -> Option<u64> {
    match SCOPE.with(Cell::get) {
        0 => None,
        id => Some(id),
    }
}

/// A handler's future, polled with its scope marked current.
pub(crate) struct Scoped<F> {
    id: u64,
    /// Set once the handler succeeded: what it deferred is then the
    /// caller's to take (see [`scope`]).
    done: bool,
    inner: F,
}

impl<F, T, E> Future for Scoped<F>
where
    F: Future<Output = std::result::Result<T, E>> + Unpin,
{
    /// The handler's output; on success, with the scope's id.
    type Output = std::result::Result<(T, u64), E>;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let id = self.id;
        let polled = {
            // Put back when the poll ends, or a panic unwinds through it.
            let _in_scope = InScope::enter(id);
            Pin::new(&mut self.inner).poll(cx)
        };
        match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(value)) => {
                self.done = true;
                Poll::Ready(Ok((value, id)))
            }
            // A failed handler's deferred dispatches were consequences of
            // work that did not happen: left to the drop, which frees them.
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
        }
    }
}

impl<F> Drop for Scoped<F> {
    fn drop(&mut self) {
        // A handler that failed, or was dropped before it finished (a
        // deadline, a cancelled dispatch), leaves nothing queued behind.
        if !self.done {
            drop(take_deferred(self.id));
        }
    }
}

/// Wraps a handler's future in a scope that collects the stamped dispatches
/// it makes. Once the future has completed with `Ok`, its output comes with
/// the scope's id, and what it deferred is taken with
/// [`take_deferred`]`(id)`; a failure (or dropping it unfinished) drops what
/// it deferred. The id comes out with the output, not beside the future,
/// so the future is built where it is awaited.
#[inline]
pub(crate) fn scope<F: Future + Unpin>(handler: F) -> Scoped<F> {
    Scoped {
        id: next_scope_id(),
        done: false,
        inner: handler,
    }
}

/// A handler scope made current, and the one it replaced, put back on
/// drop.
struct InScope(u64);

impl InScope {
    #[inline]
    fn enter(id: u64) -> Self {
        Self(SCOPE.with(|c| c.replace(id)))
    }
}

impl Drop for InScope {
    #[inline]
    fn drop(&mut self) {
        SCOPE.with(|c| c.set(self.0));
    }
}

/// Runs a handler's future in a scope; returns its output and what it
/// deferred.
#[cfg(test)]
pub(crate) async fn scoped<F, T, E>(handler: F) -> (std::result::Result<T, E>, Vec<Deferred>)
where
    F: Future<Output = std::result::Result<T, E>> + Unpin,
{
    match scope(handler).await {
        Ok((value, id)) => (Ok(value), take_deferred(id)),
        Err(error) => (Err(error), Vec::new()),
    }
}

/// Runs `next` as step 2: defers a stamped dispatch made inside a handler to
/// `target`; otherwise runs the steps after it in a frame and settles what
/// their handlers deferred ([`settle`]).
pub(crate) async fn run<F, Fut>(
    envelope: Envelope,
    target: impl FnOnce() -> Arc<dyn Endpoint>,
    next: F,
) -> StepResult
where
    F: FnOnce(Envelope) -> Fut,
    Fut: Future<Output = StepResult>,
{
    if envelope.has::<DispatchAfterCurrentBusStamp>() {
        if let Some(scope) = current_scope() {
            let deferred = Deferred {
                envelope: envelope.clone(),
                target: target(),
            };
            push_deferred(scope, [deferred]);
            return Ok(envelope);
        }
    }
    let keep = envelope.has::<ReceivedStamp>();
    let (result, frame) = framed(next(envelope)).await;
    if frame.deferred.is_empty() {
        return result;
    }
    let (result, failed) = settle(result, frame, keep).await;
    into_result(result, failed)
}

/// Step 2 once the steps after it returned `result`, with what their
/// handlers deferred and their retry step decided (`frame`): the deferred
/// dispatches are handed to the enclosing handler's scope or, at the
/// outermost dispatch, run — when the dispatch succeeded, or when the retry
/// step retried or parked the message (its handlers that succeeded will not
/// run again). Otherwise they are dropped with the failure. Those that fail
/// are returned when `keep` (a received message: the worker parks them),
/// and turned into [`BusError::DelayedHandlingFailed`] otherwise.
pub(crate) async fn settle(
    result: StepResult,
    frame: Frame,
    keep: bool,
) -> (StepResult, Vec<FailedDispatch>) {
    let Frame { deferred, retry } = frame;
    let consequences_stand = match &result {
        Ok(_) => true,
        Err(e) => matches!(**e, BusError::HandlerFailed { .. }) && retry.is_some(),
    };
    if deferred.is_empty() || !consequences_stand {
        return (result, Vec::new());
    }
    if let Some(scope) = current_scope() {
        push_deferred(scope, deferred);
        return (result, Vec::new());
    }
    let (errors, failed) = run_all(deferred, keep).await;
    let failures: Vec<String> = errors
        .iter()
        .chain(failed.iter().map(|f| &f.error))
        .map(ToString::to_string)
        .collect();
    if !failures.is_empty() {
        tracing::warn!(
            errors = %failures.join("; "),
            "{} of the dispatches deferred until after the current one failed",
            failures.len()
        );
    }
    match result {
        Ok(out) if !errors.is_empty() && !keep => (
            Err(Box::new(BusError::DelayedHandlingFailed {
                envelope: Box::new(out),
                errors,
            })),
            Vec::new(),
        ),
        result => (result, failed),
    }
}

/// `result`, or a [`BusError::DelayedHandlingFailed`] carrying `failed`
/// when deferred dispatches failed beside a success: what a caller without
/// a verdict gets.
pub(crate) fn into_result(result: StepResult, failed: Vec<FailedDispatch>) -> StepResult {
    match result {
        Ok(out) if !failed.is_empty() => Err(Box::new(BusError::DelayedHandlingFailed {
            envelope: Box::new(out),
            errors: failed.into_iter().map(|f| f.error).collect(),
        })),
        result => result,
    }
}

/// Settles what a handler deferred right after it succeeded, for a stack
/// assembled without step 2 (no frame to hand them to): they run now.
pub(crate) async fn run_now(out: Envelope, deferred: Vec<Deferred>) -> StepResult {
    let frame = Frame {
        deferred,
        retry: None,
    };
    let keep = out.has::<ReceivedStamp>();
    let (result, failed) = settle(Ok(out), frame, keep).await;
    into_result(result, failed)
}

/// Runs `deferred` and what they defer in turn, in order; returns the
/// errors of those that failed or, when `keep`, the failed dispatches
/// (see [`FailedDispatch`]). What the handlers of a failed dispatch that
/// succeeded deferred is run too, as after a park by the retry step: their
/// `HandledStamp`s stay on the envelope kept.
async fn run_all(deferred: Vec<Deferred>, keep: bool) -> (Vec<BusError>, Vec<FailedDispatch>) {
    let mut queue: VecDeque<Deferred> = deferred.into();
    let mut errors = Vec::new();
    let mut failed = Vec::new();
    while let Some(d) = queue.pop_front() {
        let kept = keep.then(|| d.envelope.clone());
        let (result, frame) = framed(d.target.call(d.envelope)).await;
        match result {
            Ok(_) => queue.extend(frame.deferred),
            Err(e) => {
                if let Some(kept) = kept {
                    let mut envelope = e.envelope().cloned().unwrap_or(kept);
                    queue.extend(frame.deferred);
                    // Not sent: parked, it is to be sent there again when
                    // retried, not handled as if it had been received.
                    if let BusError::Transport { transport, .. } = &e {
                        envelope = envelope.with(UnsentStamp::new(transport.clone()));
                    }
                    failed.push(FailedDispatch { envelope, error: e });
                } else {
                    errors.push(e);
                }
            }
        }
    }
    (errors, failed)
}

/// The step as a stand-alone middleware: deferred envelopes are later run
/// through `target` (for a bus, the rest of its pipeline).
#[derive(Clone)]
pub struct DispatchAfterCurrentBus {
    target: Arc<dyn Endpoint>,
}

impl DispatchAfterCurrentBus {
    /// The step, running deferred envelopes through `target`.
    pub fn new(target: Arc<dyn Endpoint>) -> Self {
        Self { target }
    }
}

impl std::fmt::Debug for DispatchAfterCurrentBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DispatchAfterCurrentBus")
    }
}

impl Middleware for DispatchAfterCurrentBus {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(async move {
            run(
                envelope,
                || self.target.clone(),
                move |e| async move { next.run(e).await.map_err(Box::new) },
            )
            .await
            .map_err(|e| *e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FnEndpoint, Ping, RecordingEndpoint};

    #[tokio::test]
    async fn a_stamped_dispatch_outside_any_handler_runs_at_once() {
        let end = RecordingEndpoint::new();
        let target = Arc::new(RecordingEndpoint::new());
        let mw = DispatchAfterCurrentBus::new(target.clone());
        let e = Envelope::new(Ping).with(DispatchAfterCurrentBusStamp);
        mw.handle(e, end.next()).await.unwrap();
        assert_eq!(end.calls().len(), 1);
        assert!(target.calls().is_empty());
    }

    #[tokio::test]
    async fn a_stamped_dispatch_inside_a_handler_is_queued_not_run() {
        let end = RecordingEndpoint::new();
        let target = Arc::new(RecordingEndpoint::new());
        let mw = DispatchAfterCurrentBus::new(target.clone());
        let e = Envelope::new(Ping).with(DispatchAfterCurrentBusStamp);
        let (out, deferred) = scoped(mw.handle(e, end.next())).await;
        out.unwrap();
        assert!(end.calls().is_empty(), "not run inside the handler");
        assert_eq!(deferred.len(), 1);
        assert!(target.calls().is_empty());
    }

    fn deferring_endpoint(target: Arc<RecordingEndpoint>, fail: bool) -> FnEndpoint {
        FnEndpoint::new(move |e: Envelope| {
            let target = target.clone();
            Box::pin(async move {
                let deferred = vec![Deferred {
                    envelope: Envelope::new(Ping),
                    target,
                }];
                // As a handler that succeeded hands them to the frame.
                assert!(super::super::frame::defer(deferred).is_ok(), "framed");
                if fail {
                    return Err(BusError::Disposed("outer".into()));
                }
                Ok(e)
            })
        })
    }

    #[tokio::test]
    async fn deferred_dispatches_run_after_the_outer_one() {
        let target = Arc::new(RecordingEndpoint::new());
        let mw = DispatchAfterCurrentBus::new(target.clone());
        let outer = deferring_endpoint(target.clone(), false);
        let out = mw
            .handle(Envelope::new(Ping), Next::to_endpoint(&outer))
            .await
            .unwrap();
        assert_eq!(target.calls().len(), 1);
        assert_eq!(out.stamps().count(), 0, "nothing rides on the envelope");
    }

    #[tokio::test]
    async fn deferred_dispatches_are_dropped_when_the_outer_fails() {
        let target = Arc::new(RecordingEndpoint::new());
        let mw = DispatchAfterCurrentBus::new(target.clone());
        let outer = deferring_endpoint(target.clone(), true);
        let err = mw
            .handle(Envelope::new(Ping), Next::to_endpoint(&outer))
            .await
            .unwrap_err();
        assert!(matches!(err, BusError::Disposed(_)));
        assert!(target.calls().is_empty());
    }
}
