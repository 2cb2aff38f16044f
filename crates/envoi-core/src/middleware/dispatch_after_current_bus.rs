//! Step 2 of the canonical pipeline: defer nested dispatches until the outer
//! one has finished.
//!
//! A handler that dispatches a message carrying a
//! [`DispatchAfterCurrentBusStamp`] while the outer dispatch is still running
//! (on the same task) does not get it handled at once: it is queued, and
//! handled after the outer dispatch — on the bus it was dispatched on — once
//! the outer one has succeeded. The nested `dispatch` call returns the
//! envelope straight away.
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
use std::future::Future;
use std::sync::Arc;

use super::{BoxFuture, Endpoint, Middleware, Next};
use crate::envelope::Envelope;
use crate::error::{BusError, Result};
use crate::stamp::DispatchAfterCurrentBusStamp;

struct Deferred {
    envelope: Envelope,
    target: Arc<dyn Endpoint>,
}

#[derive(Default)]
struct Scope {
    queue: RefCell<VecDeque<Deferred>>,
}

tokio::task_local! {
    static SCOPE: Scope;
}

/// Whether a dispatch is already running on this task.
fn in_scope() -> bool {
    SCOPE.try_with(|_| ()).is_ok()
}

/// Runs `next` as step 2: defers a stamped nested dispatch to `target`,
/// runs a nested unstamped one at once, and wraps a root dispatch in a scope
/// that handles the deferred ones afterwards.
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
    if in_scope() {
        if envelope.has::<DispatchAfterCurrentBusStamp>() {
            let deferred = Deferred {
                envelope: envelope.clone(),
                target: target(),
            };
            SCOPE.with(|s| s.queue.borrow_mut().push_back(deferred));
            return Ok(envelope);
        }
        return next(envelope).await;
    }
    SCOPE
        .scope(Scope::default(), async move {
            match next(envelope).await {
                Ok(envelope) => drain(envelope).await,
                Err(e) => {
                    SCOPE.with(|s| s.queue.borrow_mut().clear());
                    Err(e)
                }
            }
        })
        .await
}

async fn drain(envelope: Envelope) -> Result<Envelope> {
    let mut errors = Vec::new();
    while let Some(d) = SCOPE.with(|s| s.queue.borrow_mut().pop_front()) {
        if let Err(e) = d.target.call(d.envelope).await {
            errors.push(e);
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
    use crate::testing::{Ping, RecordingEndpoint};

    #[tokio::test]
    async fn a_stamped_dispatch_outside_any_dispatch_runs_at_once() {
        let end = RecordingEndpoint::new();
        let target = Arc::new(RecordingEndpoint::new());
        let mw = DispatchAfterCurrentBus::new(target.clone());
        let e = Envelope::new(Ping).with(DispatchAfterCurrentBusStamp);
        mw.handle(e, end.next()).await.unwrap();
        assert_eq!(end.calls().len(), 1);
        assert!(target.calls().is_empty());
    }

    #[tokio::test]
    async fn a_stamped_nested_dispatch_waits_for_the_outer_one() {
        let target = Arc::new(RecordingEndpoint::new());
        let mw = Arc::new(DispatchAfterCurrentBus::new(target.clone()));
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (mw2, order2, target2) = (mw.clone(), order.clone(), target.clone());
        let outer = crate::testing::FnEndpoint::new(move |e: Envelope| {
            let (mw, order, target) = (mw2.clone(), order2.clone(), target2.clone());
            Box::pin(async move {
                let nested = Envelope::new(Ping).with(DispatchAfterCurrentBusStamp);
                let never = RecordingEndpoint::new();
                mw.handle(nested, never.next()).await.unwrap();
                assert!(never.calls().is_empty(), "deferred, not run now");
                assert!(target.calls().is_empty(), "not yet handled");
                order.lock().unwrap().push("outer done");
                Ok(e)
            })
        });
        mw.handle(Envelope::new(Ping), Next::to_endpoint(&outer))
            .await
            .unwrap();
        assert_eq!(*order.lock().unwrap(), ["outer done"]);
        assert_eq!(target.calls().len(), 1);
    }

    #[tokio::test]
    async fn deferred_dispatches_are_dropped_when_the_outer_fails() {
        let target = Arc::new(RecordingEndpoint::new());
        let mw = Arc::new(DispatchAfterCurrentBus::new(target.clone()));
        let mw2 = mw.clone();
        let outer = crate::testing::FnEndpoint::new(move |_e: Envelope| {
            let mw = mw2.clone();
            Box::pin(async move {
                let nested = Envelope::new(Ping).with(DispatchAfterCurrentBusStamp);
                mw.handle(nested, Next::passthrough()).await.unwrap();
                Err(BusError::Disposed("x".into()))
            })
        });
        let err = mw
            .handle(Envelope::new(Ping), Next::to_endpoint(&outer))
            .await
            .unwrap_err();
        assert!(matches!(err, BusError::Disposed(_)));
        assert!(target.calls().is_empty());
    }
}
