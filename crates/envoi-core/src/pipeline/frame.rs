//! What one dispatch records while its inner steps run: what its handlers
//! deferred, and what its retry step decided.
//!
//! The canonical steps 2 to 7 are separated by user middleware, which only
//! pass an envelope or an error along. What the inner steps tell step 2 and
//! a worker about a dispatch does not ride on the envelope: the dispatch
//! runs inside a [`Frame`], made current while its future is polled, and
//! the steps write to it ([`defer`], [`record_retry`]). The dispatch that
//! opened it reads it when its future completes ([`framed`]).

use std::cell::RefCell;
use std::future::Future;
use std::time::Duration;

use super::dispatch_after_current_bus::Deferred;

/// What the retry step did with a message whose handlers failed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RetryRecord {
    /// Sent back to its transport as retry number `attempt`, due after
    /// `delay`.
    Retried {
        /// Which retry (1 for the first).
        attempt: u32,
        /// How long it waits.
        delay: Duration,
    },
    /// Parked in the failure transport `failure`.
    Parked {
        /// The failure transport.
        failure: String,
    },
}

/// The record of one dispatch.
#[derive(Default)]
pub(crate) struct Frame {
    /// Dispatches its handlers that succeeded deferred until it ends.
    pub(crate) deferred: Vec<Deferred>,
    /// What its retry step did, if it acted.
    pub(crate) retry: Option<RetryRecord>,
}

/// A dispatch's record, made only once a step writes to it: most
/// dispatches defer nothing and are not retried, and their futures keep a
/// pointer's room for it.
type Slot = Option<Box<Frame>>;

thread_local! {
    /// The frame of the dispatch being polled on this thread, if any.
    static CURRENT: RefCell<Option<Slot>> = const { RefCell::new(None) };
}

/// Adds `deferred` to the current frame. Hands them back when no dispatch
/// is framed (a stack assembled without step 2).
pub(crate) fn defer(deferred: Vec<Deferred>) -> Result<(), Vec<Deferred>> {
    if deferred.is_empty() {
        return Ok(());
    }
    CURRENT.with(|c| match c.borrow_mut().as_mut() {
        Some(slot) => {
            slot.get_or_insert_with(Box::default)
                .deferred
                .extend(deferred);
            Ok(())
        }
        None => Err(deferred),
    })
}

/// Records what the retry step did in the current frame, if any.
pub(crate) fn record_retry(record: RetryRecord) {
    CURRENT.with(|c| {
        if let Some(slot) = c.borrow_mut().as_mut() {
            slot.get_or_insert_with(Box::default).retry = Some(record);
        }
    });
}

/// Runs `future` with a frame of its own made current whenever it is
/// polled; returns its output and the frame.
pub(crate) async fn framed<F: Future>(future: F) -> (F::Output, Frame) {
    let mut future = std::pin::pin!(future);
    let mut slot: Slot = None;
    let out = std::future::poll_fn(|cx| {
        let entered = Entered::enter(slot.take());
        let polled = future.as_mut().poll(cx);
        slot = entered.leave();
        polled
    })
    .await;
    (out, slot.map(|frame| *frame).unwrap_or_default())
}

/// [`framed`] for a future that need not be pinned in place (a boxed
/// one): the same, in the room of the future and a pointer.
pub(crate) struct Framed<F> {
    slot: Slot,
    inner: F,
}

impl<F> Framed<F> {
    /// `inner`, to run in a frame of its own.
    pub(crate) fn new(inner: F) -> Self {
        Self { slot: None, inner }
    }
}

impl<F: Future + Unpin> Future for Framed<F> {
    type Output = (F::Output, Frame);

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.get_mut();
        let entered = Entered::enter(this.slot.take());
        let polled = std::pin::Pin::new(&mut this.inner).poll(cx);
        this.slot = entered.leave();
        polled.map(|out| {
            (
                out,
                this.slot.take().map(|frame| *frame).unwrap_or_default(),
            )
        })
    }
}

/// A frame made current, and the one it replaced, put back when left, or
/// when a panic unwinds through the poll (so the thread does not keep a
/// dead dispatch's frame).
struct Entered {
    outer: Option<Option<Slot>>,
}

impl Entered {
    fn enter(slot: Slot) -> Self {
        let outer = CURRENT.with(|c| c.replace(Some(slot)));
        Self { outer: Some(outer) }
    }

    fn leave(mut self) -> Slot {
        let outer = self.outer.take().flatten();
        CURRENT.with(|c| c.replace(outer)).flatten()
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        if let Some(outer) = self.outer.take() {
            CURRENT.with(|c| *c.borrow_mut() = outer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_frame_records_what_its_steps_tell_and_nested_frames_keep_their_own() {
        let (inner, outer) = framed(async {
            record_retry(RetryRecord::Parked {
                failure: "failed".into(),
            });
            let ((), inner) = framed(async {
                record_retry(RetryRecord::Retried {
                    attempt: 1,
                    delay: Duration::from_secs(1),
                });
                tokio::task::yield_now().await;
            })
            .await;
            inner
        })
        .await;
        assert_eq!(
            inner.retry,
            Some(RetryRecord::Retried {
                attempt: 1,
                delay: Duration::from_secs(1)
            })
        );
        assert_eq!(
            outer.retry,
            Some(RetryRecord::Parked {
                failure: "failed".into()
            })
        );
        assert!(defer(vec![]).is_ok(), "nothing to defer needs no frame");
        CURRENT.with(|c| assert!(c.borrow().is_none(), "no frame is left current"));
    }

    #[test]
    fn a_panic_inside_a_frame_leaves_no_frame_current() {
        let caught = std::panic::catch_unwind(|| {
            let waker = futures_util::task::noop_waker();
            let mut cx = std::task::Context::from_waker(&waker);
            let mut framed = std::pin::pin!(framed(async { panic!("boom") }));
            let _ = framed.as_mut().poll(&mut cx);
        });
        assert!(caught.is_err());
        CURRENT.with(|c| assert!(c.borrow().is_none(), "the panicked frame is gone"));
    }
}
