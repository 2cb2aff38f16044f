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
//! * If deferred messages fail, the others still run, and the outer dispatch
//!   returns [`BusError::DelayedHandlingFailed`] with every error.
//! * Messages deferred while handling a deferred message are handled after
//!   it, in order.
//! * Only stamped messages wait: a handler that asks a query (or dispatches
//!   an unstamped command) needs its answer now, so it gets it now.
//!
//! Use [`MessageBus::dispatch_after_current`](crate::MessageBus::dispatch_after_current)
//! or add the stamp yourself.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{BoxFuture, Endpoint, Middleware, Next};
use crate::envelope::Envelope;
use crate::error::{BusError, Result};
use crate::stamp::{DispatchAfterCurrentBusStamp, Stamp};

/// A dispatch waiting for the outer one, with where to run it.
#[derive(Clone)]
pub(crate) struct Deferred {
    envelope: Envelope,
    target: Arc<dyn Endpoint>,
}

/// Carries the dispatches deferred by a handler from the handle step back
/// out to step 2, which runs them (or hands them to an enclosing handler's
/// scope). Never sent: it is removed before the envelope leaves the bus.
#[derive(Clone, Default)]
pub(crate) struct DeferredDispatches(pub(crate) Vec<Deferred>);

impl fmt::Debug for DeferredDispatches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeferredDispatches({})", self.0.len())
    }
}

impl Serialize for DeferredDispatches {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_unit()
    }
}

impl<'de> Deserialize<'de> for DeferredDispatches {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        <()>::deserialize(deserializer)?;
        Ok(Self::default())
    }
}

impl Stamp for DeferredDispatches {
    const NAME: &'static str = "DeferredDispatches";
    const SENDABLE: bool = false;
}

#[derive(Default)]
struct Scope {
    queue: RefCell<Vec<Deferred>>,
}

tokio::task_local! {
    static SCOPE: Scope;
}

/// Whether a handler is running on this task (so a dispatch now is nested).
fn in_scope() -> bool {
    SCOPE.try_with(|_| ()).is_ok()
}

/// Runs a handler's future in a scope that collects the stamped dispatches
/// it makes; returns its output and what it deferred.
#[inline]
pub(crate) async fn scoped<F: Future>(handler: F) -> (F::Output, Vec<Deferred>) {
    SCOPE
        .scope(Scope::default(), async move {
            let out = handler.await;
            (out, SCOPE.with(|s| s.queue.take()))
        })
        .await
}

/// Runs `next` as step 2: defers a stamped dispatch made inside a handler to
/// `target`; after `next`, hands deferred dispatches to the enclosing
/// handler's scope, or — at the outermost dispatch — runs them.
#[inline]
pub(crate) async fn run<F, Fut>(
    envelope: Envelope,
    target: impl FnOnce() -> Arc<dyn Endpoint>,
    next: F,
) -> Result<Envelope>
where
    F: FnOnce(Envelope) -> Fut,
    Fut: Future<Output = Result<Envelope>>,
{
    if envelope.has::<DispatchAfterCurrentBusStamp>() && in_scope() {
        let deferred = Deferred {
            envelope: envelope.clone(),
            target: target(),
        };
        SCOPE.with(|s| s.queue.borrow_mut().push(deferred));
        return Ok(envelope);
    }
    let mut out = next(envelope).await?;
    if !out.has::<DeferredDispatches>() {
        return Ok(out);
    }
    let deferred = out.take_deferred();
    if in_scope() {
        SCOPE.with(|s| s.queue.borrow_mut().extend(deferred));
        return Ok(out);
    }
    drain(out, deferred).await
}

async fn drain(envelope: Envelope, deferred: Vec<Deferred>) -> Result<Envelope> {
    let mut queue: VecDeque<Deferred> = deferred.into();
    let mut errors = Vec::new();
    while let Some(d) = queue.pop_front() {
        match d.target.call(d.envelope).await {
            Ok(mut handled) => queue.extend(handled.take_deferred()),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(envelope)
    } else {
        Err(BusError::DelayedHandlingFailed {
            envelope: Box::new(envelope),
            errors,
        })
    }
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
        Box::pin(run(envelope, || self.target.clone(), move |e| next.run(e)))
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
                if fail {
                    return Err(BusError::Disposed("outer".into()));
                }
                Ok(e.with(DeferredDispatches(deferred)))
            })
        })
    }

    #[tokio::test]
    async fn deferred_dispatches_run_after_the_outer_one_and_leave_no_stamp() {
        let target = Arc::new(RecordingEndpoint::new());
        let mw = DispatchAfterCurrentBus::new(target.clone());
        let outer = deferring_endpoint(target.clone(), false);
        let out = mw
            .handle(Envelope::new(Ping), Next::to_endpoint(&outer))
            .await
            .unwrap();
        assert_eq!(target.calls().len(), 1);
        assert!(!out.has::<DeferredDispatches>());
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
