//! `deadline(duration)` (Effect): a time limit for every dispatch.
//!
//! When the limit passes, the future running the rest of the dispatch — the
//! handler's included — is dropped, so the work in progress stops at its
//! current `.await`: a database transaction the handler had open is rolled
//! back when it is dropped, a request it was waiting for is abandoned. The
//! dispatch then fails with
//! [`BusError::DeadlineExceeded { tag, side, after }`](BusError::DeadlineExceeded),
//! which the typed dispatcher reports as
//! [`DispatchError::Infrastructure`](crate::DispatchError::Infrastructure):
//! no message definition declares a deadline, so it never appears in the
//! message's own error type.
//!
//! It is opt-in, because what a sensible limit is — and whether abandoning
//! work partway is better than finishing it — are decisions only the host
//! can make. Added as a bus [`Middleware`] it limits every dispatch on that
//! bus, messages a worker receives included; added to a
//! [`Dispatcher`](crate::Dispatcher) with
//! [`with`](crate::Dispatcher::with), as below, it limits only the
//! dispatches made through that dispatcher. A dispatch is not otherwise
//! uncancellable: dropping the dispatch future (a caller's own
//! `tokio::time::timeout`, a client hanging up) stops the handler just the
//! same.
//!
//! The deadline needs a Tokio runtime with the time driver enabled
//! (`#[tokio::main]` and `#[tokio::test]` enable it).
//!
//! ```
//! use envoi_core::typed::deadline::deadline;
//! use envoi_core::{BusError, Command, DispatchError, Message, Messenger};
//! use std::{convert::Infallible, time::Duration};
//!
//! #[derive(Debug, Clone)]
//! struct Report;
//! impl Message for Report { const NAME: &'static str = "Report"; }
//! impl Command for Report { type Output = (); type Error = Infallible; }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
//! let messenger = Messenger::builder()
//!     .command_handler(|_: Report| async {
//!         tokio::time::sleep(Duration::from_secs(60)).await;
//!         Ok::<_, Infallible>(())
//!     })
//!     .build()
//!     .unwrap();
//! let reports = messenger.dispatcher().with(deadline(Duration::from_secs(5)));
//! match reports.dispatch(Report).await {
//!     Err(DispatchError::Infrastructure(BusError::DeadlineExceeded { tag, side, after })) => {
//!         assert_eq!((tag, side, after), ("Report", "command", Duration::from_secs(5)));
//!     }
//!     other => panic!("unexpected {other:?}"),
//! }
//! # });
//! ```

use std::borrow::Cow;
use std::time::Duration;

use crate::envelope::message::MessageKind;
use crate::envelope::Envelope;
use crate::error::{BusError, Result};
use crate::middleware::{Middleware, Next};
use crate::typed::{DispatchContext, DispatchMiddleware, DispatchNext};
use crate::BoxFuture;

/// The `deadline(duration)` layer; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    after: Duration,
}

/// A time limit of `after` for every dispatch.
pub fn deadline(after: Duration) -> Deadline {
    Deadline { after }
}

impl Deadline {
    /// The limit.
    pub fn after(&self) -> Duration {
        self.after
    }

    /// The error of a dispatch of `tag` on `side` that ran out of time.
    pub(crate) fn exceeded(&self, tag: &'static str, side: MessageKind) -> BusError {
        BusError::DeadlineExceeded {
            tag,
            side: side.as_str(),
            after: self.after,
        }
    }

    async fn run<F>(&self, tag: &'static str, side: MessageKind, fut: F) -> Result<Envelope>
    where
        F: std::future::Future<Output = Result<Envelope>>,
    {
        // The inner future is dropped as soon as the limit passes.
        let timed = tokio::time::timeout(self.after, fut).await;
        timed.unwrap_or_else(|_| Err(self.exceeded(tag, side)))
    }
}

impl DispatchMiddleware for Deadline {
    fn wrap<'a>(
        &'a self,
        ctx: DispatchContext,
        next: DispatchNext<'a>,
    ) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(async move { self.run(ctx.tag, ctx.side, next.run()).await })
    }
}

impl Middleware for Deadline {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        let (tag, side) = (envelope.message_name(), envelope.kind());
        Box::pin(async move { self.run(tag, side, next.run(envelope)).await })
    }

    fn name(&self) -> Cow<'static, str> {
        Cow::Owned(format!("Deadline({:?})", self.after))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FnEndpoint, Ping, RecordingEndpoint};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Sets its flag when dropped.
    struct DropFlag(Arc<AtomicBool>);
    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_deadline_drops_the_work_and_names_tag_side_and_limit() {
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = dropped.clone();
        let slow = FnEndpoint::new(move |e| {
            let guard = DropFlag(flag.clone());
            Box::pin(async move {
                tokio::time::sleep(Duration::from_secs(10)).await;
                drop(guard);
                Ok(e)
            })
        });
        let err = deadline(Duration::from_secs(2))
            .handle(Envelope::query(Ping), Next::to_endpoint(&slow))
            .await
            .unwrap_err();
        match err {
            BusError::DeadlineExceeded { tag, side, after } => {
                assert_eq!(tag, "Ping");
                assert_eq!(side, "query");
                assert_eq!(after, Duration::from_secs(2));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(dropped.load(Ordering::SeqCst), "the work must be dropped");
    }

    #[tokio::test(start_paused = true)]
    async fn a_dispatch_within_its_deadline_passes_through() {
        let end = RecordingEndpoint::new();
        deadline(Duration::from_secs(1))
            .handle(Envelope::new(Ping), end.next())
            .await
            .unwrap();
        assert_eq!(end.calls().len(), 1);
        assert_eq!(deadline(Duration::from_millis(5)).name(), "Deadline(5ms)");
    }
}
