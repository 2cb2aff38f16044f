//! What a worker tells about its work: [`WorkerEvent`]s for listeners and
//! subscribers, and counters for progress.

use std::borrow::Cow;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;

use super::stop::StopReason;
use crate::envelope::Envelope;

/// Counters of a worker's run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerStats {
    /// Messages taken from the receivers and started.
    pub received: u64,
    /// Messages handled successfully.
    pub handled: u64,
    /// Messages a `before_consuming` filter stopped: acknowledged, their
    /// handlers not run, not counted as handled.
    pub stopped_by_filter: u64,
    /// Messages whose handling failed and that were scheduled for a retry.
    pub retried: u64,
    /// Messages that failed: parked, rejected, or released after a
    /// transport failure; also each dispatch a handler deferred that
    /// failed (parked on its own, or not).
    pub failed: u64,
    /// Messages given back to their transport at a graceful stop.
    pub released: u64,
}

/// What [`Worker::run`](crate::worker::Worker::run) returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerReport {
    /// Why it stopped.
    pub reason: StopReason,
    /// Its counters.
    pub stats: WorkerStats,
    /// How long it ran.
    pub elapsed: Duration,
}

/// Something that happened in a worker.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum WorkerEvent {
    /// The worker started.
    Started {
        /// The transports it consumes, in priority order.
        transports: Vec<String>,
    },
    /// A message was taken from a transport and is about to be dispatched.
    Received {
        /// The transport.
        transport: Arc<str>,
        /// The transport's id of the message.
        id: String,
        /// The message name.
        message: &'static str,
    },
    /// A message was handled (or a `before_consuming` filter stopped it:
    /// its envelope then carries a
    /// [`StoppedByFilterStamp`](crate::stamp::StoppedByFilterStamp)); its
    /// acknowledgement goes with the next batch
    /// of them, and should that fail a
    /// [`TransportFailed`](crate::worker::WorkerEvent::TransportFailed) event for `ack`
    /// follows (the message may then be delivered again once its lease
    /// ends).
    Handled {
        /// The transport.
        transport: Arc<str>,
        /// The transport's id of the message.
        id: String,
        /// The envelope as the handlers returned it.
        envelope: Envelope,
        /// How long the dispatch took.
        duration: Duration,
    },
    /// Handling failed and the retry step scheduled a retry.
    Retried {
        /// The transport.
        transport: Arc<str>,
        /// The transport's id of the message.
        id: String,
        /// The retry as it was sent.
        envelope: Envelope,
        /// Which retry it is (1 for the first).
        retry_count: u32,
        /// How long the dispatch took.
        duration: Duration,
    },
    /// A message failed; see [`parked_in`](crate::worker::WorkerEvent::Failed::parked_in)
    /// and [`released`](crate::worker::WorkerEvent::Failed::released) for where it went.
    Failed {
        /// The transport.
        transport: Arc<str>,
        /// The transport's id of the message.
        id: String,
        /// The message name (the `type` header for a message that did not
        /// decode).
        message: Cow<'static, str>,
        /// A short classification of the error (`handler`, `decode:unknown_type`, …).
        kind: Cow<'static, str>,
        /// The error.
        error: String,
        /// The failure transport it was moved to; `None` when it was
        /// rejected or released.
        parked_in: Option<String>,
        /// Whether it was released, to be delivered again.
        released: bool,
        /// The envelope, when it decoded.
        envelope: Option<Envelope>,
    },
    /// A message was given back to its transport at a graceful stop.
    Released {
        /// The transport.
        transport: Arc<str>,
        /// The transport's id of the message.
        id: String,
    },
    /// A transport operation failed; the worker goes on. (A message that
    /// could not be parked is reported by its
    /// [`Failed`](crate::worker::WorkerEvent::Failed) event instead, with `released` set
    /// and why parking failed in its `error`.)
    TransportFailed {
        /// The transport.
        transport: Arc<str>,
        /// `get`, `ack`, `reject`, `release`, `keepalive` or `count`.
        operation: &'static str,
        /// The error.
        error: String,
    },
    /// The worker stopped.
    Stopped {
        /// Why, and its counters.
        report: WorkerReport,
    },
}

/// Receives a worker's events, in line: keep it quick. A panic in
/// [`on_event`](Self::on_event) is logged and otherwise ignored.
pub trait WorkerListener: Send + Sync + 'static {
    /// Called for every event.
    fn on_event(&self, event: &WorkerEvent);
}

impl<F> WorkerListener for F
where
    F: Fn(&WorkerEvent) + Send + Sync + 'static,
{
    fn on_event(&self, event: &WorkerEvent) {
        self(event)
    }
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) received: AtomicU64,
    pub(super) handled: AtomicU64,
    pub(super) stopped_by_filter: AtomicU64,
    pub(super) retried: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) released: AtomicU64,
}

impl Counters {
    pub(super) fn snapshot(&self) -> WorkerStats {
        WorkerStats {
            received: self.received.load(Ordering::Relaxed),
            handled: self.handled.load(Ordering::Relaxed),
            stopped_by_filter: self.stopped_by_filter.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
        }
    }
}

/// Counts one more. A worker's counters have one writer, the worker's task
/// (others only read them), so no atomic read-modify-write is needed.
pub(super) fn bump(counter: &AtomicU64) {
    counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
}

/// Live counters of a worker, readable while it runs; see
/// [`Worker::progress`](crate::worker::Worker::progress).
#[derive(Clone)]
pub struct WorkerProgress(pub(super) Arc<Counters>);

impl WorkerProgress {
    /// The counters now.
    pub fn snapshot(&self) -> WorkerStats {
        self.0.snapshot()
    }
}

impl fmt::Debug for WorkerProgress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.snapshot(), f)
    }
}

pub(super) struct Events {
    pub(super) listeners: Vec<Arc<dyn WorkerListener>>,
    pub(super) tx: Option<broadcast::Sender<WorkerEvent>>,
}

impl Events {
    #[inline]
    pub(super) fn enabled(&self) -> bool {
        !self.listeners.is_empty() || self.tx.is_some()
    }

    #[inline]
    pub(super) fn emit(&self, make: impl FnOnce() -> WorkerEvent) {
        if !self.enabled() {
            return;
        }
        let event = make();
        for l in &self.listeners {
            // A listener's bug must not pass for the message's failure (a
            // handled message parked as panicked) nor bring the worker down
            // with messages still leased.
            if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| l.on_event(&event))) {
                tracing::error!(
                    panic = %panic_message(&*panic),
                    "a worker listener panicked; the worker goes on"
                );
            }
        }
        if let Some(tx) = &self.tx {
            let _ = tx.send(event);
        }
    }
}

pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a handler panicked".to_string()
    }
}
