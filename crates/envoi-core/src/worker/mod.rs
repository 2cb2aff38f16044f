//! The [`Worker`]: consumes transports and dispatches what it receives on
//! the bus the message was sent from.
//!
//! ```
//! use envoi_core::transport::in_memory::InMemoryTransport;
//! use envoi_core::worker::{StopReason, Worker};
//! use envoi_core::{Command, Message, Messenger};
//! use serde::{Deserialize, Serialize};
//! use std::convert::Infallible;
//! use std::sync::Arc;
//!
//! #[derive(Debug, Clone, Serialize, Deserialize)]
//! struct SendInvoice { id: u32 }
//! impl Message for SendInvoice { const NAME: &'static str = "SendInvoice"; }
//! impl Command for SendInvoice { type Output = (); type Error = Infallible; }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let messenger = Messenger::builder()
//!     .command_handler(|_: SendInvoice| async { Ok::<_, Infallible>(()) })
//!     .transport("async", Arc::new(InMemoryTransport::new()))
//!     .route::<SendInvoice>("async")
//!     .build()
//!     .unwrap();
//! for id in 0..10 {
//!     messenger.dispatcher().dispatch(SendInvoice { id }).await.unwrap();
//! }
//! let report = Worker::builder(&messenger)
//!     .receiver("async")
//!     .stop_when_empty()
//!     .build()
//!     .unwrap()
//!     .run()
//!     .await;
//! assert_eq!(report.reason, StopReason::Empty);
//! assert_eq!(report.stats.handled, 10);
//! # });
//! ```
//!
//! # What happens to a message
//!
//! The worker asks its receivers for messages **in priority order**: the
//! first receiver is asked first, and after every batch it starts again from
//! the first, so a lower-priority receiver is only read while those before it
//! are empty, held back by their [rate limit](WorkerBuilder::rate_limit), or
//! paused because one of their messages could not be parked (see below).
//! Each message is decoded (messages stored as envelopes by an
//! in-process transport need no decoding), stamped with a
//! [`ReceivedStamp`] naming the transport and a [`TransportMessageIdStamp`],
//! and dispatched on the bus named by its [`BusNameStamp`] (the default bus
//! when it has none or names a bus this messenger does not have). Then:
//!
//! | outcome of the dispatch | the worker | event |
//! |---|---|---|
//! | success | acknowledges it | [`Handled`](WorkerEvent::Handled) |
//! | success, scheduled for a retry by the retry step | acknowledges it (the retry is a new message) | [`Retried`](WorkerEvent::Retried) |
//! | handled, or scheduled for a retry, but dispatches its handlers [deferred](crate::pipeline::dispatch_after_current_bus) failed ([`BusError::DelayedHandlingFailed`]) | parks each deferred message that failed in the failure transport, as a message of its own with an `ErrorDetails` stamp saying why (and an [`UnsentStamp`] when it could not be sent: see below), then acknowledges the message (it is not parked itself: the handlers that deferred them would be skipped there, and a retry already holds it). A handled message is rejected when there is no failure transport, and released, so its handlers run and defer them again, when one cannot be parked (fetching from its receiver then pauses); a retried one is acknowledged all the same, its retry holding it, and a deferred message that cannot be parked is dropped with an error log | [`Handled`](WorkerEvent::Handled) or [`Retried`](WorkerEvent::Retried), and a [`Failed`](WorkerEvent::Failed) for each deferred message, naming it |
//! | handler failure, parked in the failure transport by the retry step | acknowledges it; dispatches deferred by its handlers that succeeded that then failed are parked too, each on its own, as above (the message is acknowledged all the same: one that cannot be parked is dropped with an error log, as the parked message holds the handlers that deferred it) | [`Failed`](WorkerEvent::Failed) |
//! | handler failure, no failure transport | rejects it | [`Failed`](WorkerEvent::Failed) |
//! | not dispatched: it carries an [`UnsentStamp`] (a deferred message parked because it could not be sent to its transport) | sends it to that transport, without the stamp, and to those its type is routed to after that one (the failed send stopped before them), and acknowledges it; when a send fails (the ones before it get it again on its next delivery), releases it and pauses fetching from its receiver, as for a transport failure; when a transport refuses it for good (it does not exist, or the message is too large, cannot be encoded or is not supported there), parks it again, naming that transport in its `UnsentStamp`, with an `ErrorDetails` stamp saying why and the growing delay of a message parked again, and acknowledges it | [`Handled`](WorkerEvent::Handled), or [`Failed`](WorkerEvent::Failed) |
//! | transport failure (the retry step could not send the retry, or park the message) | releases it, so it is delivered again, and pauses fetching from its receiver as when parking fails; when the transport its retry was to go to refuses it for good (it does not exist, or the message is too large, cannot be encoded or is not supported there), parks it instead, as for any other error (below) | [`Failed`](WorkerEvent::Failed), saying where it could not be parked or retried and why |
//! | any other error (no handler, a middleware's error, a panic) | parks it like the retry step would, then acknowledges it; rejects it when there is no failure transport | [`Failed`](WorkerEvent::Failed) |
//! | it does not decode (unknown type, malformed, too large) | sends the raw message to the failure transport with an `ErrorDetails` stamp header saying why, then acknowledges it; rejects it when there is no failure transport | [`Failed`](WorkerEvent::Failed) |
//!
//! Parking keeps messages: only a message that cannot be parked because no
//! failure transport is configured is rejected, and the event says so. A
//! message the failure transport does not take (it is down, or refuses the
//! message: too large for it, say) is released, kept where it is, and
//! reported by a `Failed` event and an error log saying why; fetching from
//! the receiver it came from then pauses — 100 ms, doubling with each
//! failure in a row up to 5 s — so it is not handled again in a tight
//! loop, while the other receivers are read and handled as usual. A
//! message taken from a failure transport is handled as if it came from its
//! original transport: when its handler fails, the retry step starts a fresh
//! round of retries on that transport; once it fails for good again (or
//! fails outside the retry step), it goes back to the failure transport, to
//! be handed out again only after a growing delay
//! ([`parked_again_delay`]).
//!
//! Acknowledgements are sent in batches, after the events above: one that
//! fails is reported by a [`TransportFailed`](WorkerEvent::TransportFailed)
//! event, and the message may be delivered again when its lease ends.
//!
//! # Stopping
//!
//! The worker stops when a [`StopHandle`] is used (for instance by
//! [`StopHandle::stop_on_signals`] on SIGINT or SIGTERM), or when a limit is
//! reached: messages, time, memory (resident set size, read from
//! `/proc/self/status` on Linux and ignored elsewhere), failures, or — with
//! [`stop_when_empty`](WorkerBuilder::stop_when_empty) — when every receiver
//! is empty. Stopping is graceful: the worker stops fetching (a fetch still
//! waiting for messages, as a broker's long poll does, is given the grace
//! period to return, and what it brings is released), releases the
//! messages it fetched but did not start, lets the handlers in flight finish
//! within the [grace period](WorkerBuilder::grace_period), then releases what
//! did not finish so it is delivered again.
//! [`StopHandle::stop_now`] (a second signal) cuts the grace period short:
//! the handlers in flight are dropped and their messages released at once.
//! Nothing is lost.
//!
//! # Concurrency, leases and rate limits
//!
//! Up to [`concurrency`](WorkerBuilder::concurrency) messages are handled at
//! once, on the worker's own task (run several workers for several cores).
//! While a message is held — fetched or being handled — the worker extends
//! its lease with [`Keepalive::keepalive`](crate::transport::Keepalive::keepalive) every
//! [`keepalive_interval`](WorkerBuilder::keepalive_interval), so a slow but
//! live handler is not redelivered to another worker. The first extension
//! comes within one and a half intervals of the fetch, so leases must be
//! longer than that (the transports' defaults are 30 s or more, the
//! interval's 5 s). A
//! [rate limit](WorkerBuilder::rate_limit) caps the pace at which the worker
//! takes messages from one transport: a token bucket, which lets a burst of
//! up to [`messages`](RateLimit::messages) through at once (at the start,
//! or after a quiet spell), then one every `per / messages`.
//!
//! # Events
//!
//! [`WorkerEvent`]s go to [listeners](WorkerBuilder::listener) (called in
//! line, so keep them quick; a listener that panics is logged and the
//! worker goes on) and to [`Worker::subscribe`]rs. Events are only
//! built when someone listens. For counters only (a progress bar),
//! [`Worker::progress`] is cheaper.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fmt;
use std::future::{poll_fn, Future};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

use crate::envelope::stamp::{
    BusNameStamp, DelayStamp, ErrorDetailsStamp, ReceivedStamp, RedeliveredStamp, RedeliveryStamp,
    SentStamp, SentToFailureTransportStamp, Stamp, TransportMessageIdStamp, UnsentStamp,
};
use crate::envelope::Envelope;
use crate::error::{BusError, TransportError};
use crate::failure::park::{parked_again_delay, parked_copy};
use crate::far;
use crate::messenger::Messenger;
use crate::pipeline::bus::MessageBus;
use crate::pipeline::dispatch_after_current_bus::{take_deferred_of, FailedDeferred};
use crate::transport::serializer::STAMP_HEADER_PREFIX;
use crate::transport::{DeliveryId, LocalId, Payload, RawMessage, Transport};
use crate::BoxFuture;

/// A configuration mistake found by [`WorkerBuilder::build`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// No receiver was given.
    #[error("a worker needs at least one transport to consume")]
    NoReceivers,
    /// A receiver names no transport registered with the messenger.
    #[error("unknown transport `{0}`")]
    UnknownTransport(String),
    /// The transport handles messages when they are sent (`sync://`), so
    /// there is nothing to consume.
    #[error("transport `{0}` handles messages when they are sent; there is nothing to consume")]
    NotConsumable(String),
    /// An option is out of range.
    #[error("invalid worker option: {0}")]
    InvalidOption(String),
    /// A transport operation failed.
    #[error("transport `{transport}` failed: {error}")]
    Transport {
        /// The transport.
        transport: String,
        /// The error.
        error: String,
    },
}

/// Why a worker stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// A [`StopHandle`] asked it to (a signal, for instance).
    Stopped,
    /// It processed as many messages as its message limit, whatever
    /// became of them (handled, retried or failed).
    MessageLimit,
    /// It ran for its time limit.
    TimeLimit,
    /// Its resident memory exceeded the memory limit.
    MemoryLimit,
    /// As many messages failed as its failure limit.
    FailureLimit,
    /// Every receiver was empty ([`WorkerBuilder::stop_when_empty`]).
    Empty,
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StopReason::Stopped => "stop requested",
            StopReason::MessageLimit => "message limit reached",
            StopReason::TimeLimit => "time limit reached",
            StopReason::MemoryLimit => "memory limit exceeded",
            StopReason::FailureLimit => "failure limit reached",
            StopReason::Empty => "no more messages",
        })
    }
}

/// Counters of a worker's run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerStats {
    /// Messages taken from the receivers and started.
    pub received: u64,
    /// Messages handled successfully.
    pub handled: u64,
    /// Messages whose handling failed and that were scheduled for a retry.
    pub retried: u64,
    /// Messages that failed: parked, rejected, or released after a
    /// transport failure; also each dispatch a handler deferred that
    /// failed (parked on its own, or not).
    pub failed: u64,
    /// Messages given back to their transport at a graceful stop.
    pub released: u64,
}

/// What [`Worker::run`] returns.
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
    /// A message was handled; its acknowledgement goes with the next batch
    /// of them, and should that fail a
    /// [`TransportFailed`](WorkerEvent::TransportFailed) event for `ack`
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
    /// A message failed; see [`parked_in`](WorkerEvent::Failed::parked_in)
    /// and [`released`](WorkerEvent::Failed::released) for where it went.
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
    /// [`Failed`](WorkerEvent::Failed) event instead, with `released` set
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

/// Stops one or more workers; cheap to clone.
///
/// [`stop`](Self::stop) is graceful: a worker stops fetching and lets the
/// handlers in flight finish within its
/// [grace period](WorkerBuilder::grace_period). [`stop_now`](Self::stop_now)
/// does not wait: the handlers in flight are dropped and their messages
/// given back, to be delivered again.
///
/// ```
/// use envoi_core::worker::StopHandle;
///
/// let stop = StopHandle::new();
/// let same = stop.clone();
/// same.stop();
/// assert!(stop.is_stopped());
/// assert!(!stop.is_stopped_now());
/// same.stop_now();
/// assert!(stop.is_stopped_now());
/// ```
#[derive(Clone)]
pub struct StopHandle {
    tx: Arc<watch::Sender<u8>>,
}

/// [`StopHandle`] levels: asked to stop gracefully, then at once.
const STOP: u8 = 1;
const STOP_NOW: u8 = 2;

impl Default for StopHandle {
    fn default() -> Self {
        Self {
            tx: Arc::new(watch::channel(0).0),
        }
    }
}

impl fmt::Debug for StopHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StopHandle")
            .field("stopped", &self.is_stopped())
            .field("now", &self.is_stopped_now())
            .finish()
    }
}

impl StopHandle {
    /// A handle that has not been used.
    pub fn new() -> Self {
        Self::default()
    }

    fn raise(&self, level: u8) {
        self.tx.send_if_modified(|current| {
            let raised = *current < level;
            *current = (*current).max(level);
            raised
        });
    }

    /// Asks every worker using this handle to stop gracefully.
    pub fn stop(&self) {
        self.raise(STOP);
    }

    /// Asks every worker using this handle to stop at once, even during the
    /// grace period of a graceful stop: the handlers in flight are dropped
    /// and their messages given back to their transports.
    pub fn stop_now(&self) {
        self.raise(STOP_NOW);
    }

    /// Whether [`stop`](Self::stop) or [`stop_now`](Self::stop_now) was
    /// called.
    pub fn is_stopped(&self) -> bool {
        *self.tx.borrow() >= STOP
    }

    /// Whether [`stop_now`](Self::stop_now) was called.
    pub fn is_stopped_now(&self) -> bool {
        *self.tx.borrow() >= STOP_NOW
    }

    /// Resolves once [`stop`](Self::stop) (or
    /// [`stop_now`](Self::stop_now)) is called.
    pub async fn stopped(&self) {
        self.reached(STOP).await;
    }

    /// Resolves once [`stop_now`](Self::stop_now) is called.
    async fn stopped_now(&self) {
        self.reached(STOP_NOW).await;
    }

    /// Resolves once the handle is at `level` or above.
    async fn reached(&self, level: u8) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|current| *current >= level).await;
    }

    /// Spawns a task that calls [`stop`](Self::stop) on SIGINT (Ctrl-C) or,
    /// on Unix, SIGTERM, and [`stop_now`](Self::stop_now) on a second one.
    /// Must be called inside a tokio runtime; fails when the signal
    /// handlers cannot be installed.
    pub fn stop_on_signals(&self) -> std::io::Result<tokio::task::JoinHandle<()>> {
        #[cfg(unix)]
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let handle = self.clone();
        Ok(tokio::spawn(async move {
            for level in [STOP, STOP_NOW] {
                #[cfg(unix)]
                tokio::select! {
                    r = tokio::signal::ctrl_c() => { if r.is_err() { term.recv().await; } }
                    _ = term.recv() => {}
                }
                #[cfg(not(unix))]
                if tokio::signal::ctrl_c().await.is_err() {
                    return;
                }
                handle.raise(level);
            }
        }))
    }
}

#[derive(Default)]
struct Counters {
    received: AtomicU64,
    handled: AtomicU64,
    retried: AtomicU64,
    failed: AtomicU64,
    released: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> WorkerStats {
        WorkerStats {
            received: self.received.load(Ordering::Relaxed),
            handled: self.handled.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
        }
    }
}

/// Counts one more. A worker's counters have one writer, the worker's task
/// (others only read them), so no atomic read-modify-write is needed.
fn bump(counter: &AtomicU64) {
    counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
}

/// Live counters of a worker, readable while it runs; see
/// [`Worker::progress`].
#[derive(Clone)]
pub struct WorkerProgress(Arc<Counters>);

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

/// `messages` per `per` from one transport, on average: a token bucket
/// holding up to `messages` tokens, one per message taken, refilled at one
/// every `per / messages`.
///
/// A full bucket lets a burst of `messages` through at once, and the refill
/// goes on meanwhile, so a window of one `per` can see up to about twice
/// `messages` (a burst, then the steady pace); over longer runs the pace is
/// `messages` per `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// How many messages…
    pub messages: u32,
    /// …per how long.
    pub per: Duration,
}

impl RateLimit {
    /// `messages` per `per`.
    pub fn new(messages: u32, per: Duration) -> Self {
        Self { messages, per }
    }

    /// `messages` per second.
    pub fn per_second(messages: u32) -> Self {
        Self::new(messages, Duration::from_secs(1))
    }
}

/// A token bucket holding up to `messages` tokens, refilled continuously.
struct Bucket {
    capacity: f64,
    tokens: f64,
    per_token: Duration,
    last: Instant,
}

impl Bucket {
    fn new(limit: RateLimit, now: Instant) -> Self {
        let messages = limit.messages.max(1);
        Self {
            capacity: f64::from(messages),
            tokens: f64::from(messages),
            per_token: limit.per / messages,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last);
        if !self.per_token.is_zero() {
            let add = elapsed.as_secs_f64() / self.per_token.as_secs_f64();
            self.tokens = (self.tokens + add).min(self.capacity);
        } else {
            self.tokens = self.capacity;
        }
        self.last = now;
    }

    fn available(&mut self, now: Instant) -> usize {
        self.refill(now);
        self.tokens.floor() as usize
    }

    /// Takes `n` tokens at `now`: those that came since the bucket was
    /// last looked at (a long `get` may have been waiting) first, up to the
    /// capacity.
    fn take(&mut self, n: usize, now: Instant) {
        self.refill(now);
        self.tokens = (self.tokens - n as f64).max(0.0);
    }

    /// How long until one token is available.
    fn wait(&self) -> Duration {
        let missing = (1.0 - self.tokens).max(0.0);
        self.per_token.mul_f64(missing)
    }
}

#[derive(Debug, Clone)]
struct Options {
    concurrency: usize,
    batch_size: usize,
    message_limit: Option<u64>,
    time_limit: Option<Duration>,
    memory_limit: Option<u64>,
    failure_limit: Option<u64>,
    grace_period: Duration,
    keepalive_interval: Option<Duration>,
    idle_sleep: Duration,
    stop_when_empty: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            concurrency: 1,
            batch_size: 32,
            message_limit: None,
            time_limit: None,
            memory_limit: None,
            failure_limit: None,
            grace_period: Duration::from_secs(10),
            keepalive_interval: Some(Duration::from_secs(5)),
            idle_sleep: Duration::from_millis(250),
            stop_when_empty: false,
        }
    }
}

/// Configures a [`Worker`]; see [`Worker::builder`].
#[must_use = "a builder does nothing until `build` is called"]
pub struct WorkerBuilder {
    messenger: Messenger,
    receivers: Vec<String>,
    rate_limits: Vec<(String, RateLimit)>,
    options: Options,
    listeners: Vec<Arc<dyn WorkerListener>>,
    stop: Option<StopHandle>,
    event_capacity: usize,
}

impl fmt::Debug for WorkerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("receivers", &self.receivers)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl WorkerBuilder {
    /// Consumes `transport`, after the receivers added before it (priority
    /// order: first added, first read).
    pub fn receiver(mut self, transport: impl Into<String>) -> Self {
        self.receivers.push(transport.into());
        self
    }

    /// Consumes each of `transports`, in priority order.
    pub fn receivers<I, S>(mut self, transports: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.receivers
            .extend(transports.into_iter().map(Into::into));
        self
    }

    /// Handles up to `n` messages at once (default 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.options.concurrency = n;
        self
    }

    /// Asks a transport for up to `n` messages at a time (default 32).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.options.batch_size = n;
        self
    }

    /// Stops after `n` messages, whatever became of them: handled, retried
    /// or failed all count.
    pub fn message_limit(mut self, n: u64) -> Self {
        self.options.message_limit = Some(n);
        self
    }

    /// Stops after running for `limit` (thirty years or more: no limit).
    pub fn time_limit(mut self, limit: Duration) -> Self {
        self.options.time_limit = Some(far::clamp(limit));
        self
    }

    /// Stops when the process's resident memory exceeds `bytes` (Linux
    /// only). It is checked at start, then at most once a second, between
    /// the worker's steps: while every slot holds a slow handler, it is
    /// next checked when one finishes or a keepalive tick comes.
    pub fn memory_limit(mut self, bytes: u64) -> Self {
        self.options.memory_limit = Some(bytes);
        self
    }

    /// Stops after `n` failed messages. Messages already in flight then
    /// still finish within the grace period, and may fail too: with a
    /// concurrency above 1 the report can count more than `n` failures.
    pub fn failure_limit(mut self, n: u64) -> Self {
        self.options.failure_limit = Some(n);
        self
    }

    /// How long handlers in flight may take to finish once the worker stops
    /// (default 10 s); what has not finished then is released.
    pub fn grace_period(mut self, grace: Duration) -> Self {
        self.options.grace_period = far::clamp(grace);
        self
    }

    /// Extends the lease of held messages this often (default 5 s); `None`
    /// never does. A message's first extension comes within one and a half
    /// intervals of its fetch: a transport's lease must be longer.
    pub fn keepalive_interval(mut self, interval: Option<Duration>) -> Self {
        self.options.keepalive_interval = interval.map(far::clamp);
        self
    }

    /// The longest wait before asking empty receivers again (default
    /// 250 ms). Transports that can tell when a message arrives wake the
    /// worker earlier.
    pub fn idle_sleep(mut self, sleep: Duration) -> Self {
        self.options.idle_sleep = far::clamp(sleep);
        self
    }

    /// Stops once every receiver is empty (no message waiting, delayed or
    /// leased) and nothing is in flight. Emptiness is read from
    /// [`MessageCount`](crate::transport::MessageCount); a transport without that ability
    /// counts as empty as soon as it hands out nothing, whatever it still
    /// holds delayed or leased. A receiver paused because one of its
    /// messages could not be parked is asked again, once its pause is
    /// over, before the worker stops.
    ///
    /// Messages this worker parked back into a receiver they came from — a
    /// failure transport it consumes, where a message failing for good again
    /// returns for later — do not count: consuming a failure transport with
    /// this option tries each message there once, then stops.
    pub fn stop_when_empty(mut self) -> Self {
        self.options.stop_when_empty = true;
        self
    }

    /// Paces how fast messages are taken from `transport`: `limit` per
    /// period on average, after a first burst of up to `limit.messages`
    /// (see [`RateLimit`]).
    pub fn rate_limit(mut self, transport: impl Into<String>, limit: RateLimit) -> Self {
        let limit = RateLimit::new(limit.messages, far::clamp(limit.per));
        self.rate_limits.push((transport.into(), limit));
        self
    }

    /// Adds a listener for the worker's events.
    pub fn listener(mut self, listener: impl WorkerListener) -> Self {
        self.listeners.push(Arc::new(listener));
        self
    }

    /// Stops the worker with `handle` (a handle of its own is made
    /// otherwise; see [`Worker::stop_handle`]).
    pub fn stop_handle(mut self, handle: StopHandle) -> Self {
        self.stop = Some(handle);
        self
    }

    /// How many events a [`Worker::subscribe`]r may fall behind before it
    /// misses some (default 1024).
    pub fn event_capacity(mut self, n: usize) -> Self {
        self.event_capacity = n.max(1);
        self
    }

    /// Checks the configuration.
    pub fn build(self) -> Result<Worker, WorkerError> {
        if self.receivers.is_empty() {
            return Err(WorkerError::NoReceivers);
        }
        if self.options.concurrency == 0 {
            return Err(WorkerError::InvalidOption(
                "concurrency must be at least 1".into(),
            ));
        }
        if self.options.batch_size == 0 {
            return Err(WorkerError::InvalidOption(
                "batch size must be at least 1".into(),
            ));
        }
        let mut limits: BTreeMap<String, RateLimit> = BTreeMap::new();
        for (name, limit) in self.rate_limits {
            if limit.messages == 0 {
                return Err(WorkerError::InvalidOption(format!(
                    "the rate limit of `{name}` must allow at least one message"
                )));
            }
            limits.insert(name, limit);
        }
        let mut receivers = Vec::new();
        for name in self.receivers {
            if receivers.iter().any(|r: &Receiver| *r.name == *name) {
                continue;
            }
            let transport = self
                .messenger
                .transport(&name)
                .ok_or_else(|| WorkerError::UnknownTransport(name.clone()))?
                .clone();
            if transport.as_receiver().is_none() {
                return Err(WorkerError::NotConsumable(name));
            }
            receivers.push(Receiver {
                rate: limits.remove(&name),
                name: Arc::from(name.as_str()),
                transport,
            });
        }
        if let Some(name) = limits.into_keys().next() {
            return Err(WorkerError::InvalidOption(format!(
                "rate limit for `{name}`, which the worker does not consume"
            )));
        }
        Ok(Worker {
            messenger: self.messenger,
            receivers,
            options: self.options,
            listeners: self.listeners,
            events: broadcast::channel(self.event_capacity).0,
            stop: self.stop.unwrap_or_default(),
            counters: Arc::new(Counters::default()),
        })
    }
}

struct Receiver {
    name: Arc<str>,
    transport: Arc<dyn Transport>,
    rate: Option<RateLimit>,
}

impl Receiver {
    /// Up to `max` messages.
    async fn get(&self, max: usize) -> Result<Batch, TransportError> {
        Ok(match self.transport.as_local_receiver() {
            Some(local) => Batch::Local(local.get_local(max).await?),
            None => Batch::Remote(self.receiver()?.get(max).await?),
        })
    }

    /// The transport's receiving side (a worker only consumes transports
    /// that have one).
    fn receiver(&self) -> Result<&dyn crate::transport::Receiver, TransportError> {
        receiving(&self.transport)
    }
}

/// The receiving side of `transport`, or why there is none.
fn receiving(
    transport: &Arc<dyn Transport>,
) -> Result<&dyn crate::transport::Receiver, TransportError> {
    transport
        .as_receiver()
        .ok_or(TransportError::Unsupported("receiving messages"))
}

/// Messages as a receiver's transport handed them out.
enum Batch {
    Local(Vec<crate::transport::LocalDelivery>),
    Remote(Vec<crate::transport::Delivery>),
}

impl Batch {
    fn len(&self) -> usize {
        match self {
            Batch::Local(got) => got.len(),
            Batch::Remote(got) => got.len(),
        }
    }

    /// Adds the messages to `buffer`, held by receiver number `receiver`
    /// from now.
    fn hold(self, receiver: usize, buffer: &mut VecDeque<Held>) {
        let since = Instant::now();
        match self {
            Batch::Local(got) => buffer.extend(got.into_iter().map(|d| Held {
                receiver,
                id: MessageId::Local(d.id),
                payload: d.payload,
                redelivered: d.redelivered,
                since,
            })),
            Batch::Remote(got) => buffer.extend(got.into_iter().map(|d| Held {
                receiver,
                id: MessageId::Remote(d.id),
                payload: Payload::Raw(d.raw),
                redelivered: d.redelivered,
                since,
            })),
        }
    }
}

/// Consumes transports; see the [module documentation](self).
pub struct Worker {
    messenger: Messenger,
    receivers: Vec<Receiver>,
    options: Options,
    listeners: Vec<Arc<dyn WorkerListener>>,
    events: broadcast::Sender<WorkerEvent>,
    stop: StopHandle,
    counters: Arc<Counters>,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field(
                "receivers",
                &self.receivers.iter().map(|r| &*r.name).collect::<Vec<_>>(),
            )
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Starts configuring a worker for `messenger`.
    pub fn builder(messenger: &Messenger) -> WorkerBuilder {
        WorkerBuilder {
            messenger: messenger.clone(),
            receivers: Vec::new(),
            rate_limits: Vec::new(),
            options: Options::default(),
            listeners: Vec::new(),
            stop: None,
            event_capacity: 1024,
        }
    }

    /// The handle that stops this worker.
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// A receiver of this worker's events. Subscribe before
    /// [`run`](Self::run); a subscriber that falls more than the
    /// [event capacity](WorkerBuilder::event_capacity) behind misses events
    /// (it is told how many).
    pub fn subscribe(&self) -> broadcast::Receiver<WorkerEvent> {
        self.events.subscribe()
    }

    /// Live counters, readable while the worker runs.
    pub fn progress(&self) -> WorkerProgress {
        WorkerProgress(self.counters.clone())
    }

    /// Runs until a stop condition is met; see the
    /// [module documentation](self).
    pub async fn run(self) -> WorkerReport {
        let subscribed = self.events.receiver_count() > 0;
        let ctx = Ctx::new(
            self.messenger,
            Events {
                listeners: self.listeners,
                tx: subscribed.then_some(self.events),
            },
            self.counters,
            self.receivers,
        );
        Run::new(&ctx, self.options, self.stop, Ctx::process)
            .run()
            .await
    }
}

/// What became of a message handled by [`consume_one`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Outcome {
    /// It was handled and acknowledged.
    Handled,
    /// It failed and the retry step scheduled a retry; it was acknowledged.
    Retried {
        /// Which retry it is.
        retry_count: u32,
    },
    /// It failed: parked (and acknowledged), rejected, or released to be
    /// delivered again.
    Failed {
        /// Why.
        error: String,
        /// The failure transport it went to, if any.
        parked_in: Option<String>,
        /// Whether it was released rather than removed.
        released: bool,
    },
}

/// What the transport of a message handled by [`handle_one`] is to do
/// with it, as a worker would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settlement {
    /// Remove it: it was handled, its retry sent, or it was parked.
    Ack,
    /// Reject it: it failed, or a dispatch its handlers deferred failed,
    /// and there is no failure transport.
    Reject,
    /// Give it back, to be delivered again: it could not be parked (or a
    /// dispatch its handlers deferred could not be), or sent.
    Release,
}

/// A message handled by [`handle_one`], not yet settled with its transport.
#[derive(Debug, Clone)]
#[non_exhaustive]
#[must_use = "the message is not settled with its transport: apply `settlement`"]
pub struct HandledOne {
    /// What became of it.
    pub outcome: Outcome,
    /// What its transport is to do with it.
    pub settlement: Settlement,
    /// The [`Handled`](WorkerEvent::Handled),
    /// [`Retried`](WorkerEvent::Retried) and [`Failed`](WorkerEvent::Failed)
    /// events, in order: a dispatch its handlers deferred that failed, and
    /// was parked on its own (or could not be), has a `Failed` event of its
    /// own, before the message's. A message given back because such a
    /// dispatch could not be parked has no event of its own: the last one
    /// is that dispatch's, which [`outcome`](Self::outcome) reports.
    pub events: Vec<WorkerEvent>,
}

/// Handles one message of `transport` exactly as a worker would — decode,
/// dispatch with a [`ReceivedStamp`] (or send one parked because it could
/// not be sent), park it or what its handlers deferred that failed — but
/// leaves settling it with the transport to the caller: what a worker
/// would do is [`HandledOne::settlement`]. [`consume_one`] does it too.
///
/// Fails with [`WorkerError::UnknownTransport`] for a transport the
/// messenger does not have.
///
/// ```
/// # use std::sync::Arc;
/// # use envoi_core::transport::in_memory::InMemoryTransport;
/// # use envoi_core::transport::{MessageCount, Receiver};
/// # use envoi_core::worker::{handle_one, Outcome, Settlement};
/// # use envoi_core::{Command, Envelope, Message, Messenger};
/// # #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
/// # struct Ping;
/// # impl Message for Ping { const NAME: &'static str = "Ping"; }
/// # impl Command for Ping { type Output = (); type Error = std::convert::Infallible; }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let queue = Arc::new(InMemoryTransport::new());
/// let messenger = Messenger::builder()
///     .command_handler(|_: Ping| async { Ok::<_, std::convert::Infallible>(()) })
///     .transport("async", queue.clone())
///     .route::<Ping>("async")
///     .build()
///     .unwrap();
/// messenger.bus().dispatch(Envelope::new(Ping)).await.unwrap();
/// let delivery = queue.get(1).await.unwrap().remove(0);
/// let id = delivery.id.clone();
/// let handled = handle_one(&messenger, "async", delivery).await.unwrap();
/// assert!(matches!(handled.outcome, Outcome::Handled));
/// // Settled as a worker would.
/// match handled.settlement {
///     Settlement::Ack => queue.ack(&id).await.unwrap(),
///     Settlement::Reject => queue.reject(&id).await.unwrap(),
///     Settlement::Release => queue.release(&id).await.unwrap(),
///     _ => unreachable!(),
/// }
/// assert_eq!(queue.message_count().await.unwrap(), 0);
/// # }
/// ```
pub async fn handle_one(
    messenger: &Messenger,
    transport: &str,
    delivery: crate::transport::Delivery,
) -> Result<HandledOne, WorkerError> {
    let t = messenger
        .transport(transport)
        .ok_or_else(|| WorkerError::UnknownTransport(transport.to_string()))?
        .clone();
    let events = Arc::new(std::sync::Mutex::new(Vec::<WorkerEvent>::new()));
    let record = events.clone();
    let ctx = Ctx::new(
        messenger.clone(),
        Events {
            listeners: vec![Arc::new(move |e: &WorkerEvent| {
                if matches!(
                    e,
                    WorkerEvent::Handled { .. }
                        | WorkerEvent::Retried { .. }
                        | WorkerEvent::Failed { .. }
                ) {
                    record
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(e.clone());
                }
            })],
            tx: None,
        },
        Arc::new(Counters::default()),
        vec![Receiver {
            name: Arc::from(transport),
            transport: t,
            rate: None,
        }],
    );
    let mut in_flight = InFlight::new();
    let (task, work) = ctx.begin(Held {
        receiver: 0,
        id: MessageId::Remote(delivery.id),
        payload: Payload::Raw(delivery.raw),
        redelivered: delivery.redelivered,
        since: Instant::now(),
    });
    let future = ctx.process(0, task.id.clone(), work);
    let finished = match in_flight.start(task, future) {
        Some(finished) => finished,
        None => in_flight.next().await,
    };
    let done = match finished {
        Finished::Done(done, _) => done,
        Finished::Panicked {
            receiver,
            id,
            envelope,
            message,
        } => {
            ctx.park_panicked(receiver, &id.text(), envelope, message)
                .await
        }
    };
    let events = std::mem::take(&mut *events.lock().unwrap_or_else(|p| p.into_inner()));
    let outcome = match events.last() {
        Some(WorkerEvent::Retried { retry_count, .. }) => Outcome::Retried {
            retry_count: *retry_count,
        },
        Some(WorkerEvent::Failed {
            error,
            parked_in,
            released,
            ..
        }) => Outcome::Failed {
            error: error.clone(),
            parked_in: parked_in.clone(),
            released: *released,
        },
        _ => Outcome::Handled,
    };
    let settlement = match done.action {
        Action::Ack => Settlement::Ack,
        Action::Reject => Settlement::Reject,
        Action::Release => Settlement::Release,
    };
    Ok(HandledOne {
        outcome,
        settlement,
        events,
    })
}

/// Handles one message of `transport` exactly as a worker would — decode,
/// dispatch with a [`ReceivedStamp`], then acknowledge, reject, release or
/// park it — and says what became of it. This is how a command line retries
/// one message from a failure transport: [`find`](crate::transport::Browse::find) it, then
/// hand it here (or to [`handle_one`], to settle it itself).
///
/// Fails with [`WorkerError::UnknownTransport`] for a transport the
/// messenger does not have, and with [`WorkerError::Transport`] when
/// acknowledging, rejecting or releasing it fails.
pub async fn consume_one(
    messenger: &Messenger,
    transport: &str,
    delivery: crate::transport::Delivery,
) -> Result<Outcome, WorkerError> {
    let id = delivery.id.clone();
    let handled = handle_one(messenger, transport, delivery).await?;
    let t = messenger
        .transport(transport)
        .ok_or_else(|| WorkerError::UnknownTransport(transport.to_string()))?;
    let result = match receiving(t) {
        Ok(r) => match handled.settlement {
            Settlement::Ack => r.ack(&id).await,
            Settlement::Reject => r.reject(&id).await,
            Settlement::Release => r.release(&id).await,
        },
        Err(e) => Err(e),
    };
    result.map_err(|e| WorkerError::Transport {
        transport: transport.to_string(),
        error: e.to_string(),
    })?;
    Ok(handled.outcome)
}

struct Events {
    listeners: Vec<Arc<dyn WorkerListener>>,
    tx: Option<broadcast::Sender<WorkerEvent>>,
}

impl Events {
    #[inline]
    fn enabled(&self) -> bool {
        !self.listeners.is_empty() || self.tx.is_some()
    }

    #[inline]
    fn emit(&self, make: impl FnOnce() -> WorkerEvent) {
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

struct Ctx {
    messenger: Messenger,
    events: Events,
    counters: Arc<Counters>,
    receivers: Vec<Receiver>,
    /// The messenger has only the default bus: every message goes there.
    single_bus: bool,
    /// Per receiver, the attempts to park its messages that failed in a
    /// row (reset by one that works).
    park_failures: Vec<AtomicU32>,
    /// Per receiver, whether parking one of its messages failed since
    /// [`Ctx::park_backoff`] last looked.
    park_failed: Vec<AtomicBool>,
    /// Whether parking failed for any receiver since
    /// [`Ctx::take_park_failed`] last looked.
    any_park_failed: AtomicBool,
}

/// The first pause in fetching from a receiver after one of its messages
/// could not be parked; it doubles with each failure in a row, up to
/// [`MAX_PARK_BACKOFF`]. The other receivers are read meanwhile.
const PARK_BACKOFF: Duration = Duration::from_millis(100);
/// The longest pause in fetching from a receiver while parking its
/// messages keeps failing.
const MAX_PARK_BACKOFF: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Ack,
    Reject,
    Release,
}

struct Done {
    receiver: usize,
    action: Action,
    /// The id of the copy parked back into the transport the message came
    /// from (a failure transport being consumed).
    again: Option<String>,
}

impl Done {
    fn new(receiver: usize, action: Action) -> Self {
        Done {
            receiver,
            action,
            again: None,
        }
    }
}

/// The id of a held message.
#[derive(Clone)]
enum MessageId {
    /// From an in-process transport: a number.
    Local(LocalId),
    /// From any other transport.
    Remote(DeliveryId),
}

impl MessageId {
    fn text(&self) -> Cow<'_, str> {
        match self {
            MessageId::Local(id) => Cow::Owned(id.to_string()),
            MessageId::Remote(id) => Cow::Borrowed(id.as_str()),
        }
    }

    /// The id the transport's [`Receiver`](crate::transport::Receiver)
    /// takes.
    fn delivery_id(&self) -> Cow<'_, DeliveryId> {
        match self {
            MessageId::Local(id) => Cow::Owned(DeliveryId::from(id.to_string())),
            MessageId::Remote(id) => Cow::Borrowed(id),
        }
    }

    /// `envelope` with the [`TransportMessageIdStamp`] of this id.
    fn stamp(&self, envelope: Envelope) -> Envelope {
        match self {
            MessageId::Local(id) => envelope.with_local_id(*id),
            MessageId::Remote(id) => {
                envelope.with(TransportMessageIdStamp::new(id.as_str().to_owned()))
            }
        }
    }
}

/// A message fetched and not started yet.
struct Held {
    receiver: usize,
    id: MessageId,
    payload: Payload,
    /// The transport handed it out before (see
    /// [`Delivery::redelivered`](crate::transport::Delivery::redelivered)).
    redelivered: bool,
    since: Instant,
}

/// What to do with a message once started.
enum Work {
    /// Dispatch the envelope (as the transport handed it out).
    Dispatch(Envelope),
    /// It did not decode: park it as it is.
    /// (Boxed: it is rare, and every started message's future holds a
    /// `Work`.)
    Park(Box<(RawMessage, crate::error::SerializationError)>),
}

/// A message being handled.
struct TaskInfo {
    receiver: usize,
    id: MessageId,
    since: Instant,
    /// The envelope, to park it if its handler panics.
    envelope: Option<Envelope>,
}

enum Finished {
    Done(Done, MessageId),
    Panicked {
        receiver: usize,
        id: MessageId,
        envelope: Option<Envelope>,
        message: String,
    },
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The slots woken since they were last polled, and the waker of the task
/// polling the in-flight set.
#[derive(Default)]
struct ReadyQueue {
    inner: Mutex<ReadyInner>,
}

#[derive(Default)]
struct ReadyInner {
    slots: Vec<usize>,
    parent: Option<Waker>,
}

/// The waker of one slot: queues the slot and wakes the worker's task.
struct SlotWaker {
    slot: usize,
    queued: AtomicBool,
    queue: Arc<ReadyQueue>,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let parent = {
            let mut inner = lock(&self.queue.inner);
            inner.slots.push(self.slot);
            inner.parent.clone()
        };
        if let Some(parent) = parent {
            parent.wake();
        }
    }
}

/// Room for one message being handled. Its future lives in a box made once
/// and reused, so starting a message allocates nothing.
struct Slot<F> {
    future: Pin<Box<Option<F>>>,
    waker: Waker,
    wake: Arc<SlotWaker>,
    task: Option<TaskInfo>,
}

/// The messages being handled, polled on the worker's task: each is polled
/// once when it starts (most handlers finish then), and afterwards only
/// when its waker says it can make progress.
struct InFlight<F> {
    slots: Vec<Slot<F>>,
    free: Vec<usize>,
    len: usize,
    queue: Arc<ReadyQueue>,
    /// Woken slots taken from the queue and not polled yet.
    polling: VecDeque<usize>,
}

impl<F: Future<Output = Done>> InFlight<F> {
    fn new() -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
            queue: Arc::new(ReadyQueue::default()),
            polling: VecDeque::new(),
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The messages being handled.
    fn tasks(&self) -> impl Iterator<Item = &TaskInfo> + '_ {
        self.slots.iter().filter_map(|s| s.task.as_ref())
    }

    /// Starts `future` and polls it once; returns what it gave if it
    /// finished at once.
    fn start(&mut self, task: TaskInfo, future: F) -> Option<Finished> {
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                let wake = Arc::new(SlotWaker {
                    slot: self.slots.len(),
                    queued: AtomicBool::new(false),
                    queue: self.queue.clone(),
                });
                self.slots.push(Slot {
                    future: Box::pin(None),
                    waker: Waker::from(wake.clone()),
                    wake,
                    task: None,
                });
                self.slots.len() - 1
            }
        };
        let slot = &mut self.slots[i];
        slot.future.set(Some(future));
        slot.task = Some(task);
        self.len += 1;
        self.poll_slot(i)
    }

    /// Polls slot `i` with its own waker; frees it when its future
    /// finished (or panicked).
    fn poll_slot(&mut self, i: usize) -> Option<Finished> {
        let slot = &mut self.slots[i];
        slot.task.as_ref()?;
        let future = slot.future.as_mut().as_pin_mut()?;
        let mut cx = Context::from_waker(&slot.waker);
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| future.poll(&mut cx)));
        let finished = match polled {
            Ok(Poll::Pending) => return None,
            Ok(Poll::Ready(done)) => Finished::Done(done, slot.task.take()?.id),
            Err(panic) => {
                let task = slot.task.take()?;
                Finished::Panicked {
                    receiver: task.receiver,
                    id: task.id,
                    envelope: task.envelope,
                    message: panic_message(&*panic),
                }
            }
        };
        slot.future.set(None);
        self.free.push(i);
        self.len -= 1;
        Some(finished)
    }

    /// Polls the woken messages until one finishes.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Finished> {
        if self.len == 0 {
            return Poll::Pending;
        }
        self.take_woken(Some(cx.waker()));
        // A future that wakes itself at once would keep this loop going:
        // after as many polls as there are messages, let the runtime run
        // others first.
        let mut polls = self.len + 1;
        while let Some(i) = self.polling.pop_front() {
            self.slots[i].wake.queued.store(false, Ordering::Release);
            if let Some(finished) = self.poll_slot(i) {
                return Poll::Ready(finished);
            }
            polls -= 1;
            if polls == 0 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if self.polling.is_empty() {
                self.take_woken(None);
            }
        }
        Poll::Pending
    }

    /// Moves the woken slots to `polling`, registering `parent` to be woken
    /// next time.
    fn take_woken(&mut self, parent: Option<&Waker>) {
        let mut inner = lock(&self.queue.inner);
        if let Some(parent) = parent {
            if !inner.parent.as_ref().is_some_and(|w| w.will_wake(parent)) {
                inner.parent = Some(parent.clone());
            }
        }
        self.polling.extend(inner.slots.drain(..));
    }

    /// The next message to finish; pending forever when there is none.
    fn next(&mut self) -> impl Future<Output = Finished> + '_ {
        poll_fn(move |cx| self.poll_next(cx))
    }

    /// A message that finished, without waiting for one.
    fn try_next(&mut self) -> impl Future<Output = Option<Finished>> + '_ {
        poll_fn(move |cx| {
            Poll::Ready(match self.poll_next(cx) {
                Poll::Ready(finished) => Some(finished),
                Poll::Pending => None,
            })
        })
    }

    /// Drops every message being handled; returns them.
    fn abandon(&mut self) -> Vec<TaskInfo> {
        let mut out = Vec::with_capacity(self.len);
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(task) = slot.task.take() {
                slot.future.set(None);
                self.free.push(i);
                out.push(task);
            }
        }
        self.len = 0;
        out
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a handler panicked".to_string()
    }
}

/// Resolves when any of `futures` does.
async fn any(mut futures: Vec<BoxFuture<'_, ()>>) {
    poll_fn(|cx| {
        for f in &mut futures {
            if f.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    })
    .await
}

/// The resident set size of this process, in bytes (Linux only).
fn resident_memory() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// The transport that refused a message for good, when `error` says one
/// did: it does not exist, or would refuse the message on every try (too
/// large, not encodable, not supported), as opposed to being out of reach
/// for now.
fn refused_for_good(error: &BusError) -> Option<&str> {
    match error {
        BusError::Transport {
            transport,
            source:
                TransportError::UnknownTransport(_)
                | TransportError::TooLarge { .. }
                | TransportError::Serialization(_)
                | TransportError::Unsupported(_),
            ..
        } => Some(transport),
        _ => None,
    }
}

/// Where to park a message that failed outside the retry step: the failure
/// transport of the transport it originally came from (`origin`, when it
/// was parked before) or else of `source`.
fn failure_target<'m>(
    messenger: &'m Messenger,
    source: &str,
    origin: Option<String>,
) -> (String, Option<&'m str>) {
    let origin = origin.unwrap_or_else(|| source.to_string());
    let failure = messenger.failure_transport_for(&origin);
    (origin, failure)
}

impl Ctx {
    fn new(
        messenger: Messenger,
        events: Events,
        counters: Arc<Counters>,
        receivers: Vec<Receiver>,
    ) -> Self {
        let single_bus = messenger.buses().nth(1).is_none();
        Self {
            single_bus,
            messenger,
            events,
            counters,
            park_failures: receivers.iter().map(|_| AtomicU32::new(0)).collect(),
            park_failed: receivers.iter().map(|_| AtomicBool::new(false)).collect(),
            any_park_failed: AtomicBool::new(false),
            receivers,
        }
    }

    /// Notes whether parking a message of `receiver` (or sending its
    /// retry, which the retry step does) worked.
    fn parked(&self, receiver: usize, worked: bool) {
        if worked {
            self.park_failures[receiver].store(0, Ordering::Relaxed);
        } else {
            self.park_failures[receiver].fetch_add(1, Ordering::Relaxed);
            self.park_failed[receiver].store(true, Ordering::Relaxed);
            self.any_park_failed.store(true, Ordering::Relaxed);
        }
    }

    /// Whether parking failed for any receiver since the last call (then
    /// [`Ctx::park_backoff`] tells which).
    fn take_park_failed(&self) -> bool {
        self.any_park_failed.swap(false, Ordering::Relaxed)
    }

    /// How long to pause fetching from `receiver` when parking one of its
    /// messages failed since the last call: a message that could not be
    /// parked is released, and fetched again at once it would fail again
    /// at once, in a loop as fast as the transports go. Only its receiver
    /// pauses: a message that can never be parked (too large for the
    /// failure transport, say) must not hold up the others' work.
    fn park_backoff(&self, receiver: usize) -> Option<Duration> {
        if !self.park_failed[receiver].swap(false, Ordering::Relaxed) {
            return None;
        }
        let failures = self.park_failures[receiver].load(Ordering::Relaxed).max(1);
        let factor = 1u32 << (failures - 1).min(16);
        Some((PARK_BACKOFF * factor).min(MAX_PARK_BACKOFF))
    }

    fn bus_for(&self, envelope: &Envelope) -> &MessageBus {
        if self.single_bus {
            return self.messenger.bus();
        }
        envelope
            .last::<BusNameStamp>()
            .and_then(|b| self.messenger.bus_named(&b.bus))
            .unwrap_or_else(|| self.messenger.bus())
    }

    /// Counts a held message as received and decodes it: returns what to
    /// record about it while it is handled, and what to do with it.
    fn begin(&self, held: Held) -> (TaskInfo, Work) {
        let Held {
            receiver,
            id,
            payload,
            redelivered,
            since,
        } = held;
        bump(&self.counters.received);
        // The transport's mark of a redelivery becomes a stamp, which lets
        // deduplication take over the claim of a consumer that died.
        let marked = |e: Envelope| {
            if redelivered {
                e.with(RedeliveredStamp::new())
            } else {
                e
            }
        };
        let (work, envelope) = match payload {
            Payload::Envelope(e) => {
                let e = marked(e);
                (Work::Dispatch(e.clone()), Some(e))
            }
            Payload::Raw(raw) => match self.messenger.serializer().decode(&raw) {
                Ok(e) => {
                    let e = marked(e);
                    (Work::Dispatch(e.clone()), Some(e))
                }
                Err(error) => (Work::Park(Box::new((raw, error))), None),
            },
        };
        let task = TaskInfo {
            receiver,
            id,
            since,
            envelope,
        };
        (task, work)
    }

    /// Handles one started message.
    ///
    /// Parking (rare) is awaited through a box: a future holds the state of
    /// everything it awaits inline, and this one is moved into its slot for
    /// every message.
    async fn process(&self, receiver: usize, id: MessageId, work: Work) -> Done {
        match work {
            Work::Dispatch(envelope) => self.handle(receiver, id, envelope).await,
            Work::Park(parked) => {
                let (raw, error) = *parked;
                Box::pin(self.park_raw(receiver, &id.text(), raw, error)).await
            }
        }
    }

    async fn handle(&self, receiver: usize, id: MessageId, envelope: Envelope) -> Done {
        let transport = &self.receivers[receiver].name;
        self.events.emit(|| WorkerEvent::Received {
            transport: transport.clone(),
            id: id.text().into_owned(),
            message: envelope.message_name(),
        });
        // Parked because it could not be sent: it is sent, not handled.
        if envelope.has::<UnsentStamp>() {
            return Box::pin(self.send_unsent(receiver, id, envelope)).await;
        }
        let redeliveries = envelope.all::<RedeliveryStamp>().count();
        let parked = envelope.all::<SentToFailureTransportStamp>().count();
        // `envelope` is shared (with the transport's lease, with the copy
        // kept in case the handler panics) and is kept as received; the
        // dispatched copy takes the stamps of the receipt (one copy of the
        // stamps, which the pipeline then adds to in place).
        let stamped = id.stamp(envelope.clone().with(ReceivedStamp {
            transport: transport.clone(),
        }));
        let started = self.events.enabled().then(Instant::now);
        let bus = self.bus_for(&stamped);
        let result = if bus.receives_inline(&stamped) {
            bus.dispatch_received(stamped).await
        } else {
            bus.dispatch(stamped).await
        };
        let duration = started.map(|s| s.elapsed()).unwrap_or_default();
        let mut again = None;
        let action = match result {
            Ok(after) => self.succeeded(receiver, &id, after, redeliveries, duration),
            // The message was handled, or its retry sent, but dispatches its
            // handlers deferred failed: those are parked, each on its own,
            // and the message is acknowledged as if they had not failed.
            Err(BusError::DelayedHandlingFailed {
                envelope: mut after,
                ..
            }) if after.has::<FailedDeferred>() => {
                let retried = after.all::<RedeliveryStamp>().count() > redeliveries;
                match self
                    .park_deferred(receiver, &id, &envelope, &mut after, retried)
                    .await
                {
                    // Given back: it is handled again.
                    Some(Action::Release) => Action::Release,
                    // Handled (or retried) all the same, so counted and
                    // reported as such; rejected when a deferred dispatch
                    // had nowhere to be parked.
                    rejected => {
                        let acked = self.succeeded(receiver, &id, *after, redeliveries, duration);
                        rejected.unwrap_or(acked)
                    }
                }
            }
            Err(BusError::HandlerFailed {
                envelope: mut failed,
                errors,
            }) => {
                bump(&self.counters.failed);
                let parked_in = (failed.all::<SentToFailureTransportStamp>().count() > parked)
                    .then(|| failed.last::<SentStamp>().map(|s| s.transport.clone()))
                    .flatten();
                let action = if parked_in.is_some() {
                    self.parked(receiver, true);
                    Action::Ack
                } else {
                    Action::Reject
                };
                // Parked, with dispatches its handlers that succeeded
                // deferred that failed: those are parked too.
                if parked_in.is_some() && failed.has::<FailedDeferred>() {
                    // The message is parked: it is acknowledged whatever
                    // becomes of them.
                    self.park_deferred(receiver, &id, &envelope, &mut failed, true)
                        .await;
                }
                if parked_in.as_deref() == Some(&**transport) {
                    again = failed
                        .last::<TransportMessageIdStamp>()
                        .map(|s| s.id.clone());
                }
                self.events.emit(|| WorkerEvent::Failed {
                    transport: transport.clone(),
                    id: id.text().into_owned(),
                    message: Cow::Borrowed(failed.message_name()),
                    kind: Cow::Borrowed("handler"),
                    error: BusError::HandlerFailed {
                        envelope: failed.clone(),
                        errors,
                    }
                    .to_string(),
                    parked_in,
                    released: false,
                    envelope: Some(*failed),
                });
                action
            }
            // Its retry refused for good by the transport it was to go
            // back to (gone from the configuration, or the message too
            // large for it) is parked below, as sending it again would fail
            // again.
            Err(error @ BusError::Transport { .. })
                if !self.refused_for_good_before_parking(transport, &error) =>
            {
                self.not_sent(receiver, &id, &envelope, error);
                Action::Release
            }
            Err(error) => {
                let (action, parked_again) = self.park_failed(receiver, &id, envelope, error).await;
                again = parked_again;
                action
            }
        };
        Done {
            receiver,
            action,
            again,
        }
    }

    /// Sends a message parked because it could not be sent ([`UnsentStamp`])
    /// to the transport it was going to, without that stamp, instead of
    /// handling it: it was never received. The transports its message type
    /// is routed to after that one are sent to as well: the failed send
    /// stopped before them. Sent, it is acknowledged, and
    /// counted and reported as handled; otherwise it is released and kept,
    /// and fetching from its receiver pauses, as when a retry cannot be
    /// sent.
    #[cold]
    async fn send_unsent(&self, receiver: usize, id: MessageId, envelope: Envelope) -> Done {
        let started = self.events.enabled().then(Instant::now);
        let redeliveries = envelope.all::<RedeliveryStamp>().count();
        let mut unsent = envelope.clone();
        let to = unsent
            .last::<UnsentStamp>()
            .map(|u| u.transport.clone())
            .unwrap_or_default();
        unsent.remove_last::<UnsentStamp>();
        // Not delayed by its park.
        if unsent.last::<DelayStamp>().is_some_and(|d| d.ms > 0) {
            unsent = unsent.with(DelayStamp::new(Duration::ZERO));
        }
        // The routes after `to` were not sent to either: the failed send
        // stopped there.
        let after: Vec<Arc<str>> = self
            .bus_for(&unsent)
            .send_step()
            .and_then(|step| step.routes().get(unsent.message_type_id()))
            .map(|routes| {
                routes
                    .iter()
                    .skip_while(|route| ***route != *to)
                    .skip(1)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let mut sent = Ok(unsent);
        for target in std::iter::once(&*to).chain(after.iter().map(|t| &**t)) {
            let Ok(envelope) = sent else { break };
            sent = self
                .messenger
                .sender_dispatcher()
                .send(target, envelope)
                .await
                .map(|e| e.with(SentStamp::new(target)));
        }
        let action = match sent {
            Ok(sent) => {
                let duration = started.map(|s| s.elapsed()).unwrap_or_default();
                self.succeeded(receiver, &id, sent, redeliveries, duration)
            }
            Err(error) => match refused_for_good(&error).map(str::to_owned) {
                Some(to) => {
                    return Box::pin(self.park_unsent(receiver, &id, envelope, error, to)).await;
                }
                None => {
                    self.not_sent(receiver, &id, &envelope, error);
                    Action::Release
                }
            },
        };
        Done {
            receiver,
            action,
            again: None,
        }
    }

    /// Whether `error` is a transport refusing for good the retry of a
    /// message received from `transport`, and not its failure transport
    /// (parking it there would fail the same way).
    fn refused_for_good_before_parking(&self, transport: &str, error: &BusError) -> bool {
        let Some(to) = refused_for_good(error) else {
            return false;
        };
        let origin = error
            .envelope()
            .and_then(|e| e.last::<SentToFailureTransportStamp>())
            .map(|s| s.original_transport.clone());
        failure_target(&self.messenger, transport, origin).1 != Some(to)
    }

    /// Parks again a message parked because it could not be sent
    /// ([`UnsentStamp`]) that transport `refused_by` refused for good
    /// (`error`: it does not exist, or the message is too large for it):
    /// sent again, it would be refused again, and released, it would be
    /// fetched, refused and released over and over, pausing its receiver
    /// each time. The parked copy names the transport that refused it, is
    /// handed out again later (the delay grows with each park), and says
    /// why; the received message is acknowledged. When it cannot be parked,
    /// it is released and fetching from its receiver pauses, as for any
    /// message that cannot be parked.
    #[cold]
    async fn park_unsent(
        &self,
        receiver: usize,
        id: &MessageId,
        envelope: Envelope,
        error: BusError,
        refused_by: String,
    ) -> Done {
        bump(&self.counters.failed);
        let transport = &self.receivers[receiver].name;
        let details = ErrorDetailsStamp::from_error(error.kind(), &error);
        let mut parked = envelope;
        parked.remove_last::<UnsentStamp>();
        let parked = parked.with(UnsentStamp::new(refused_by.clone()));
        let (origin, failure) = failure_target(&self.messenger, transport, Some(refused_by));
        let id = id.text();
        let how = Failure {
            receiver,
            transport,
            id: &id,
            message: parked.message_name(),
            kind: &details.kind,
            error: details.message.clone(),
            what: "could not be sent again",
            release: true,
        };
        let (action, again) = self.park_copy(how, parked, &details, failure, origin).await;
        Done {
            receiver,
            action,
            again,
        }
    }

    /// Counts and reports a message whose dispatch succeeded (`after`):
    /// handled, or scheduled for a retry by the retry step. It is
    /// acknowledged.
    fn succeeded(
        &self,
        receiver: usize,
        id: &MessageId,
        after: Envelope,
        redeliveries: usize,
        duration: Duration,
    ) -> Action {
        let transport = &self.receivers[receiver].name;
        if after.all::<RedeliveryStamp>().count() > redeliveries {
            bump(&self.counters.retried);
            self.parked(receiver, true);
            self.events.emit(|| WorkerEvent::Retried {
                transport: transport.clone(),
                id: id.text().into_owned(),
                retry_count: after.last::<RedeliveryStamp>().map_or(0, |r| r.retry_count),
                envelope: after,
                duration,
            });
        } else {
            bump(&self.counters.handled);
            self.events.emit(|| WorkerEvent::Handled {
                transport: transport.clone(),
                id: id.text().into_owned(),
                envelope: after,
                duration,
            });
        }
        Action::Ack
    }

    /// Parks in the failure transport of the received message `envelope`,
    /// each as a message of its own, the dispatches deferred by its
    /// handlers that failed, with why ([`FailedDeferred`] on `after`, taken
    /// off it): they are
    /// consequences of handling that happened and will not happen again
    /// (the message is acknowledged, or its retry, or parked copy, carries
    /// the `HandledStamp`s of the handlers that deferred them). Each gets a
    /// [`Failed`](WorkerEvent::Failed) event and counts as failed. Returns
    /// `None` when every one was parked; otherwise what to do with the
    /// received message instead of acknowledging it: release it, so its
    /// handlers run and defer them again, when one could not be parked (and
    /// its receiver pauses, as when parking fails); reject it when there is
    /// no failure transport. When `kept` — the message lives on as its
    /// retry or parked copy, whose handlers that deferred them do not run
    /// again — it is always `None`: given back too, the message would be
    /// handled twice and retried or parked twice, so a deferred dispatch
    /// that cannot be parked is dropped, with an error log.
    #[cold]
    fn park_deferred<'a>(
        &'a self,
        receiver: usize,
        id: &'a MessageId,
        envelope: &'a Envelope,
        after: &mut Envelope,
        kept: bool,
    ) -> BoxFuture<'a, Option<Action>> {
        let failed = after
            .last::<FailedDeferred>()
            .map(|f| f.0.clone())
            .unwrap_or_default();
        after.remove_last::<FailedDeferred>();
        Box::pin(async move {
            let transport = &self.receivers[receiver].name;
            let origin = envelope
                .last::<SentToFailureTransportStamp>()
                .map(|s| s.original_transport.clone());
            let (origin, failure) = failure_target(&self.messenger, transport, origin);
            let id = id.text();
            let mut action = None;
            for (mut deferred, details) in failed {
                bump(&self.counters.failed);
                drop(take_deferred_of(&mut deferred));
                // One that could not be sent comes from where it was going:
                // retried, it is sent there.
                let origin = deferred
                    .last::<UnsentStamp>()
                    .map_or_else(|| origin.clone(), |u| u.transport.clone());
                let how = Failure {
                    receiver,
                    transport,
                    id: &id,
                    message: deferred.message_name(),
                    kind: &details.kind,
                    error: details.message.clone(),
                    what: "was deferred by a handler and failed",
                    release: !kept,
                };
                let (outcome, _) = self
                    .park_copy(how, deferred, &details, failure, origin)
                    .await;
                match outcome {
                    // The message lives on as its retry or parked copy: it
                    // is acknowledged whatever became of this dispatch.
                    _ if kept => {}
                    Action::Ack => {}
                    Action::Reject => action = Some(Action::Reject),
                    Action::Release => return Some(Action::Release),
                }
            }
            action
        })
    }

    /// Reports a message whose retry, or park, the retry step could not
    /// send (`error`), or a message parked because it could not be sent
    /// ([`UnsentStamp`]) that could not be sent again: it is released and
    /// kept, and, fetched again at once,
    /// it would be handled and fail again at once, so fetching from its
    /// receiver pauses as when the worker cannot park.
    #[cold]
    #[inline(never)]
    fn not_sent(&self, receiver: usize, id: &MessageId, envelope: &Envelope, error: BusError) {
        bump(&self.counters.failed);
        self.parked(receiver, false);
        let transport = &self.receivers[receiver].name;
        let origin = envelope
            .last::<SentToFailureTransportStamp>()
            .map(|s| s.original_transport.clone());
        let (_, failure) = failure_target(&self.messenger, transport, origin);
        let error = match &error {
            BusError::Transport { transport: to, .. } if envelope.has::<UnsentStamp>() => {
                format!("it could not be sent to `{to}` again: {error}")
            }
            BusError::Transport { transport: to, .. } if failure == Some(to.as_str()) => {
                format!("it failed and could not be parked in `{to}`: {error}")
            }
            BusError::Transport { transport: to, .. } => {
                format!("it failed and its retry could not be sent to `{to}`: {error}")
            }
            _ => error.to_string(),
        };
        tracing::error!(
            transport = %transport,
            id = %id.text(),
            message = envelope.message_name(),
            error = %error,
            "message released and kept: fetching from its transport pauses, the others are read"
        );
        self.events.emit(|| WorkerEvent::Failed {
            transport: transport.clone(),
            id: id.text().into_owned(),
            message: Cow::Borrowed(envelope.message_name()),
            kind: Cow::Borrowed("transport"),
            error,
            parked_in: None,
            released: true,
            envelope: Some(envelope.clone()),
        });
    }

    /// Parks a message whose dispatch failed with `error` outside the
    /// retry step. Boxed, and made without keeping the error: the future of
    /// every message holds what this one awaits.
    fn park_failed<'a>(
        &'a self,
        receiver: usize,
        id: &MessageId,
        envelope: Envelope,
        error: BusError,
    ) -> BoxFuture<'a, (Action, Option<String>)> {
        let details = ErrorDetailsStamp::from_error(error.kind(), &error);
        let envelope = error.envelope().cloned().unwrap_or(envelope);
        let id = id.text().into_owned();
        Box::pin(async move { self.park(receiver, &id, envelope, details).await })
    }

    /// Parks `envelope` (which failed outside the retry step) in its failure
    /// transport; rejects it when there is none; releases it when parking
    /// fails. Also returns the id of the parked copy when it went back into
    /// the transport it came from.
    async fn park(
        &self,
        receiver: usize,
        id: &str,
        envelope: Envelope,
        details: ErrorDetailsStamp,
    ) -> (Action, Option<String>) {
        bump(&self.counters.failed);
        let transport = &self.receivers[receiver].name;
        let origin = envelope
            .last::<SentToFailureTransportStamp>()
            .map(|s| s.original_transport.clone());
        let (origin, failure) = failure_target(&self.messenger, transport, origin);
        let how = Failure {
            receiver,
            transport,
            id,
            message: envelope.message_name(),
            kind: &details.kind,
            error: details.message.clone(),
            what: "failed",
            release: true,
        };
        self.park_copy(how, envelope, &details, failure, origin)
            .await
    }

    /// Parks a copy of `envelope` in `failure` with `details` of why, as a
    /// message from `origin`, settles it as `how` says (rejected when there
    /// is no failure transport; released or dropped when parking fails),
    /// and reports it with a [`Failed`](WorkerEvent::Failed) event. Returns
    /// what to do with the received message, and the id of the parked copy
    /// when it went back into the transport it came from.
    async fn park_copy(
        &self,
        how: Failure<'_>,
        envelope: Envelope,
        details: &ErrorDetailsStamp,
        failure: Option<&str>,
        origin: String,
    ) -> (Action, Option<String>) {
        let transport = &self.receivers[how.receiver].name;
        let (id, message) = (how.id, envelope.message_name());
        let mut outcome = self
            .settle_failure(
                how,
                failure.map(|failure| {
                    // Back into the transport it came from: later, not at
                    // once, or a worker consuming it would spin on it.
                    let back = failure == &**transport;
                    let parked = parked_copy(envelope.clone(), details.clone(), origin, back);
                    let sent = self.messenger.sender_dispatcher().send(failure, parked);
                    (failure, async move {
                        sent.await
                            .map(|e| e.last::<TransportMessageIdStamp>().map(|s| s.id.clone()))
                    })
                }),
            )
            .await;
        let again = outcome.again(transport);
        self.events.emit(|| WorkerEvent::Failed {
            transport: transport.clone(),
            id: id.to_string(),
            message: Cow::Borrowed(message),
            kind: Cow::Owned(details.kind.clone()),
            error: outcome.error,
            parked_in: outcome.parked_in,
            released: outcome.released,
            envelope: Some(envelope),
        });
        (outcome.action, again)
    }

    /// Moves a message that did not decode to the failure transport as it
    /// is, with `ErrorDetails`, `SentToFailureTransport` and `Redelivery`
    /// stamp headers added.
    async fn park_raw(
        &self,
        receiver: usize,
        id: &str,
        mut raw: RawMessage,
        error: crate::error::SerializationError,
    ) -> Done {
        bump(&self.counters.failed);
        let transport = &self.receivers[receiver].name;
        let details = ErrorDetailsStamp::from_error(format!("decode:{}", error.kind()), &error);
        let message = raw
            .header(crate::transport::serializer::TYPE_HEADER)
            .unwrap_or("?")
            .to_string();
        let parks = raw
            .header(&format!(
                "{STAMP_HEADER_PREFIX}{}",
                SentToFailureTransportStamp::NAME
            ))
            .and_then(|v| serde_json::from_str::<Vec<SentToFailureTransportStamp>>(v).ok())
            .unwrap_or_default();
        let origin = parks.last().map(|s| s.original_transport.clone());
        let (origin, failure) = failure_target(&self.messenger, transport, origin);
        // A failure transport that is only a sender (it takes envelopes)
        // cannot take this message: parking fails and it is kept.
        let target = failure.map(|f| (f, self.messenger.transport(f)));
        let mut outcome = self
            .settle_failure(
                Failure {
                    receiver,
                    transport,
                    id,
                    message: &message,
                    kind: &details.kind,
                    error: error.to_string(),
                    what: "did not decode",
                    release: true,
                },
                target.map(|(name, failure)| {
                    append_stamp_header(&mut raw, &details);
                    append_stamp_header(&mut raw, &SentToFailureTransportStamp::new(origin));
                    append_stamp_header(&mut raw, &RedeliveryStamp::new(0));
                    // Back into the transport it came from: later.
                    let delay = (name == &**transport).then(|| parked_again_delay(parks.len()));
                    let sent = match failure {
                        Some(failure) => failure.send(raw, delay),
                        None => Box::pin(std::future::ready(Err(TransportError::Unsupported(
                            "taking a message that does not decode (this failure transport is only a sender)",
                        )))),
                    };
                    (name, async move { sent.await.map(Some) })
                }),
            )
            .await;
        let again = outcome.again(transport);
        self.events.emit(|| WorkerEvent::Failed {
            transport: transport.clone(),
            id: id.to_string(),
            message: Cow::Owned(message),
            kind: Cow::Owned(details.kind),
            error: outcome.error,
            parked_in: outcome.parked_in,
            released: outcome.released,
            envelope: None,
        });
        Done {
            receiver,
            action: outcome.action,
            again,
        }
    }

    /// The ending both kinds of parking share: without a failure transport
    /// the message is rejected (with a warning); otherwise `send` parks it
    /// and it is acknowledged, or, when that fails, released (with an
    /// error) and fetching pauses.
    async fn settle_failure<E: fmt::Display>(
        &self,
        failed: Failure<'_>,
        send: Option<(&str, impl Future<Output = Result<Option<String>, E>>)>,
    ) -> Settled {
        let Failure {
            receiver,
            transport,
            id,
            message,
            kind,
            mut error,
            what,
            release,
        } = failed;
        let Some((name, send)) = send else {
            tracing::warn!(
                transport = %transport,
                id,
                message,
                kind,
                error = %error,
                "message rejected: it {what} and no failure transport is configured"
            );
            return Settled {
                action: Action::Reject,
                parked_in: None,
                id: None,
                released: false,
                error,
            };
        };
        // A failure transport whose `send` panics leaves the message where
        // it is, like one whose `send` fails: caught here, the panic neither
        // brings the worker down nor goes unreported.
        let sent = match futures_util::FutureExt::catch_unwind(AssertUnwindSafe(send)).await {
            Ok(sent) => sent.map_err(|e| e.to_string()),
            Err(panic) => Err(format!("it panicked: {}", panic_message(&*panic))),
        };
        match sent {
            Ok(id) => {
                self.parked(receiver, true);
                Settled {
                    action: Action::Ack,
                    parked_in: Some(name.to_string()),
                    id,
                    released: false,
                    error,
                }
            }
            Err(e) if !release => {
                self.parked(receiver, false);
                error = format!("{error}; parking in `{name}` failed, so it is dropped: {e}");
                tracing::error!(
                    transport = %transport,
                    id,
                    message,
                    error = %error,
                    "message dropped: it {what} and could not be parked"
                );
                Settled {
                    action: Action::Ack,
                    parked_in: None,
                    id: None,
                    released: false,
                    error,
                }
            }
            Err(e) => {
                self.parked(receiver, false);
                error = format!("{error}; parking in `{name}` failed: {e}");
                tracing::error!(
                    transport = %transport,
                    id,
                    message,
                    error = %error,
                    "message released: it {what} and could not be parked"
                );
                Settled {
                    action: Action::Release,
                    parked_in: None,
                    id: None,
                    released: true,
                    error,
                }
            }
        }
    }

    /// Parks the envelope of a handler that panicked.
    async fn park_panicked(
        &self,
        receiver: usize,
        id: &str,
        envelope: Option<Envelope>,
        message: String,
    ) -> Done {
        match envelope {
            Some(envelope) => {
                let details = ErrorDetailsStamp::new("panic", message);
                let (action, again) = self.park(receiver, id, envelope, details).await;
                Done {
                    receiver,
                    action,
                    again,
                }
            }
            // Only a raw park can have no envelope: the failure transport's
            // send panicked. The message is given back rather than lost, and
            // fetching pauses as when parking fails, or it would be fetched
            // and panic again at once.
            None => {
                self.parked(receiver, false);
                let transport = &self.receivers[receiver].name;
                let error = format!("parking it panicked: {message}");
                tracing::error!(
                    transport = %transport,
                    id,
                    error = %error,
                    "message released: it did not decode and could not be parked"
                );
                self.events.emit(|| WorkerEvent::Failed {
                    transport: transport.clone(),
                    id: id.to_string(),
                    message: Cow::Borrowed("?"),
                    kind: Cow::Borrowed("panic"),
                    error,
                    parked_in: None,
                    released: true,
                    envelope: None,
                });
                Done::new(receiver, Action::Release)
            }
        }
    }
}

impl Settled {
    /// The id of the copy parked back into `transport`, the transport the
    /// message came from.
    fn again(&mut self, transport: &str) -> Option<String> {
        if self.parked_in.as_deref() == Some(transport) {
            self.id.take()
        } else {
            None
        }
    }
}

/// A message that failed, as the worker logs it.
struct Failure<'a> {
    /// The receiver it came from.
    receiver: usize,
    transport: &'a str,
    id: &'a str,
    message: &'a str,
    kind: &'a str,
    error: String,
    /// What went wrong, for the log: "failed", "did not decode".
    what: &'static str,
    /// Whether it is released, kept where it is, when it cannot be parked;
    /// otherwise it is dropped (a deferred dispatch of a message that lives
    /// on as its retry or parked copy: released, the message would be
    /// duplicated).
    release: bool,
}

/// What became of a message that failed.
struct Settled {
    action: Action,
    parked_in: Option<String>,
    /// The id of the parked copy, when the transport told it.
    id: Option<String>,
    released: bool,
    /// The error, with why parking failed when it did.
    error: String,
}

/// Adds `stamp` to its `X-Message-Stamp-<name>` header's array, keeping
/// only the newest [`STAMP_HISTORY`](crate::transport::serializer::STAMP_HISTORY) of a
/// retry-history stamp, as the serializer does. A header that is not a JSON
/// array is kept under `X-Malformed-Stamp-<name>`.
fn append_stamp_header<S: Stamp>(raw: &mut RawMessage, stamp: &S) {
    let key = format!("{STAMP_HEADER_PREFIX}{}", S::NAME);
    let Ok(value) = serde_json::to_value(stamp) else {
        return;
    };
    let mut values = match raw.headers.remove(&key) {
        None => Vec::new(),
        Some(existing) => match serde_json::from_str::<Vec<serde_json::Value>>(&existing) {
            Ok(values) => values,
            Err(_) => {
                raw.headers
                    .insert(format!("X-Malformed-Stamp-{}", S::NAME), existing);
                Vec::new()
            }
        },
    };
    values.push(value);
    if crate::transport::serializer::is_history(S::NAME) {
        let excess = values
            .len()
            .saturating_sub(crate::transport::serializer::STAMP_HISTORY);
        values.drain(..excess);
    }
    if let Ok(json) = serde_json::to_string(&values) {
        raw.headers.insert(key, json);
    }
}

/// The acknowledgements of one receiver waiting to be sent.
#[derive(Default)]
struct Acks {
    /// Keys of messages from an in-process transport.
    local: Vec<u64>,
    /// Ids of messages from any other transport.
    remote: Vec<DeliveryId>,
}

impl Acks {
    fn len(&self) -> usize {
        self.local.len() + self.remote.len()
    }

    fn push(&mut self, id: MessageId) {
        match id {
            MessageId::Local(id) => self.local.push(id.key()),
            MessageId::Remote(id) => self.remote.push(id),
        }
    }
}

/// Acknowledges messages of an in-process transport by key, or by their text
/// ids when it cannot take keys.
async fn ack_local(transport: &Arc<dyn Transport>, keys: &[u64]) -> Result<(), TransportError> {
    if let Some(local) = transport.as_local_receiver() {
        return local.ack_local(keys);
    }
    let ids: Vec<DeliveryId> = keys
        .iter()
        .map(|k| DeliveryId::from(k.to_string()))
        .collect();
    receiving(transport)?.ack_batch(&ids).await
}

/// The acknowledgement lists, emptied, and what failed (by receiver).
type SentAcks = (Vec<Acks>, Vec<(usize, TransportError)>);

/// Sends every receiver's acknowledgements.
async fn send_acks(ctx: &Ctx, mut acks: Vec<Acks>) -> SentAcks {
    let mut failed = Vec::new();
    for (receiver, acks) in acks.iter_mut().enumerate() {
        let transport = &ctx.receivers[receiver].transport;
        if !acks.local.is_empty() {
            if let Err(e) = ack_local(transport, &acks.local).await {
                failed.push((receiver, e));
            }
            acks.local.clear();
        }
        if !acks.remote.is_empty() {
            let result = match receiving(transport) {
                Ok(r) if acks.remote.len() == 1 => r.ack(&acks.remote[0]).await,
                Ok(r) => r.ack_batch(&acks.remote).await,
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                failed.push((receiver, e));
            }
            acks.remote.clear();
        }
    }
    (acks, failed)
}

/// Makes the future handling a started message.
type Start<'a, F> = fn(&'a Ctx, usize, MessageId, Work) -> F;

/// The state of one [`Worker::run`].
struct Run<'a, F> {
    ctx: &'a Ctx,
    start: Start<'a, F>,
    options: Options,
    stop: StopHandle,
    buffer: VecDeque<Held>,
    in_flight: InFlight<F>,
    acks: Vec<Acks>,
    /// Lists to record acknowledgements in while the others are sent.
    spare_acks: Vec<Acks>,
    rejects: Vec<(usize, MessageId)>,
    releases: Vec<(usize, MessageId)>,
    panicked: Vec<(usize, MessageId, Option<Envelope>, String)>,
    buckets: Vec<Option<Bucket>>,
    /// The next batch, asked for while the current one is handled.
    ahead: Option<Ahead<'a>>,
    processed: u64,
    started: Instant,
    /// Per receiver, no fetching from it before this: parking one of its
    /// messages failed (see [`Ctx::park_backoff`]).
    fetch_after: Vec<Option<Instant>>,
    /// Per receiver, the ids of messages this run parked back into it (a
    /// failure transport being consumed) and has not fetched again: they
    /// do not count as waiting work for [`WorkerBuilder::stop_when_empty`]
    /// (and are kept only with that option).
    again: Vec<HashSet<String>>,
    /// How often leases are extended; `None` for never.
    keepalive_every: Option<Duration>,
    /// Ticks every `keepalive_every` (never without it).
    ticker: tokio::time::Interval,
    /// A keepalive tick came since the acknowledgements were last sent:
    /// those waiting go now, as no keepalive extends their leases.
    settle: bool,
}

/// A batch asked for ahead of time, or a `get` still out when the worker
/// had to stop (always of a transport that is not an in-process one).
struct Ahead<'a> {
    /// The receiver asked.
    receiver: usize,
    /// How many messages were asked for.
    want: usize,
    get: BoxFuture<'a, Result<Vec<crate::transport::Delivery>, TransportError>>,
}

/// Polls the batch asked for ahead of time, if any; once it arrives, its
/// messages join the buffer (where keepalives and a stop see them) and
/// take their receiver's rate-limit tokens.
fn poll_ahead(
    ahead: &mut Option<Ahead<'_>>,
    buffer: &mut VecDeque<Held>,
    buckets: &mut [Option<Bucket>],
    ctx: &Ctx,
    cx: &mut Context<'_>,
) -> Poll<()> {
    let Some(a) = ahead else {
        return Poll::Pending;
    };
    let Poll::Ready(got) = a.get.as_mut().poll(cx) else {
        return Poll::Pending;
    };
    let receiver = a.receiver;
    *ahead = None;
    match got {
        Ok(got) => {
            if let Some(bucket) = &mut buckets[receiver] {
                bucket.take(got.len(), Instant::now());
            }
            Batch::Remote(got).hold(receiver, buffer);
        }
        Err(e) => ctx.events.emit(|| WorkerEvent::TransportFailed {
            transport: ctx.receivers[receiver].name.clone(),
            operation: "get",
            error: e.to_string(),
        }),
    }
    Poll::Ready(())
}

impl<'a, F: Future<Output = Done> + 'a> Run<'a, F> {
    fn new(ctx: &'a Ctx, options: Options, stop: StopHandle, start: Start<'a, F>) -> Self {
        let now = Instant::now();
        let keepalive_every = options.keepalive_interval.filter(|d| !d.is_zero());
        let mut ticker = tokio::time::interval_at(
            now + keepalive_every.unwrap_or(far::FAR),
            keepalive_every.unwrap_or(far::FAR),
        );
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self {
            ctx,
            start,
            buckets: ctx
                .receivers
                .iter()
                .map(|r| r.rate.map(|l| Bucket::new(l, now)))
                .collect(),
            acks: ctx.receivers.iter().map(|_| Acks::default()).collect(),
            spare_acks: ctx.receivers.iter().map(|_| Acks::default()).collect(),
            options,
            stop,
            buffer: VecDeque::new(),
            ahead: None,
            in_flight: InFlight::new(),
            rejects: Vec::new(),
            releases: Vec::new(),
            panicked: Vec::new(),
            processed: 0,
            started: now,
            fetch_after: ctx.receivers.iter().map(|_| None).collect(),
            again: ctx.receivers.iter().map(|_| HashSet::new()).collect(),
            keepalive_every,
            ticker,
            settle: false,
        }
    }

    /// Starts handling `held`; records it at once if it finished.
    fn start(&mut self, held: Held) {
        let ctx = self.ctx;
        let again = &mut self.again[held.receiver];
        if !again.is_empty() {
            again.remove(&*held.id.text());
        }
        let (task, work) = ctx.begin(held);
        let future = (self.start)(ctx, task.receiver, task.id.clone(), work);
        if let Some(finished) = self.in_flight.start(task, future) {
            self.record(finished);
        }
    }

    fn record(&mut self, finished: Finished) {
        match finished {
            Finished::Done(done, id) => {
                self.processed += 1;
                // Only a worker that stops when empty needs them; one that
                // runs on would keep ids of messages others may delete.
                if let (Some(again), Action::Ack, true) =
                    (done.again, done.action, self.options.stop_when_empty)
                {
                    self.again[done.receiver].insert(again);
                }
                match done.action {
                    Action::Ack => self.acks[done.receiver].push(id),
                    Action::Reject => self.rejects.push((done.receiver, id)),
                    Action::Release => self.releases.push((done.receiver, id)),
                }
            }
            Finished::Panicked {
                receiver,
                id,
                envelope,
                message,
            } => self.panicked.push((receiver, id, envelope, message)),
        }
    }

    fn pending_acks(&self) -> usize {
        self.acks.iter().map(Acks::len).sum()
    }

    /// Whether handled messages wait to be acknowledged, rejected,
    /// released or parked.
    fn has_outcomes(&self) -> bool {
        self.pending_acks() > 0
            || !self.rejects.is_empty()
            || !self.releases.is_empty()
            || !self.panicked.is_empty()
    }

    fn transport_failed(&self, receiver: usize, operation: &'static str, error: &TransportError) {
        self.ctx.events.emit(|| WorkerEvent::TransportFailed {
            transport: self.ctx.receivers[receiver].name.clone(),
            operation,
            error: error.to_string(),
        });
    }

    /// Parks panicked messages, then sends acknowledgements, rejections and
    /// releases.
    async fn flush(&mut self) {
        for (receiver, id, envelope, message) in std::mem::take(&mut self.panicked) {
            let done = self
                .ctx
                .park_panicked(receiver, &id.text(), envelope, message)
                .await;
            self.record(Finished::Done(done, id));
        }
        if self.pending_acks() > 0 {
            let acks = self.take_acks();
            let sent = send_acks(self.ctx, acks).await;
            self.acks_sent(sent);
        }
        for (receiver, id) in std::mem::take(&mut self.rejects) {
            let result = match self.ctx.receivers[receiver].receiver() {
                Ok(r) => r.reject(&id.delivery_id()).await,
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                self.transport_failed(receiver, "reject", &e);
            }
        }
        for (receiver, id) in std::mem::take(&mut self.releases) {
            let result = match self.ctx.receivers[receiver].receiver() {
                Ok(r) => r.release(&id.delivery_id()).await,
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                self.transport_failed(receiver, "release", &e);
            }
        }
        if self.ctx.take_park_failed() {
            let now = Instant::now();
            for (receiver, after) in self.fetch_after.iter_mut().enumerate() {
                if let Some(pause) = self.ctx.park_backoff(receiver) {
                    *after = Some(now + pause);
                }
            }
        }
    }

    /// When fetching from `receiver` pauses after a failed park, and it is
    /// not over yet: its end.
    #[inline]
    fn paused(&self, receiver: usize, now: Instant) -> Option<Instant> {
        self.fetch_after[receiver].filter(|until| now < *until)
    }

    /// When fetching from every receiver pauses after a failed park: the
    /// soonest end of those pauses.
    fn all_paused(&self) -> Option<Instant> {
        if self.fetch_after.iter().any(Option::is_none) {
            return None;
        }
        let now = Instant::now();
        let mut soonest: Option<Instant> = None;
        for receiver in 0..self.fetch_after.len() {
            let until = self.paused(receiver, now)?;
            soonest = Some(soonest.map_or(until, |s| s.min(until)));
        }
        soonest
    }

    /// The pending acknowledgements, to be sent; new ones go to the spare
    /// lists meanwhile.
    fn take_acks(&mut self) -> Vec<Acks> {
        self.settle = false;
        let spare = std::mem::take(&mut self.spare_acks);
        std::mem::replace(&mut self.acks, spare)
    }

    /// Keeps the lists of sent acknowledgements (emptied) as the spare ones
    /// and reports what failed.
    fn acks_sent(&mut self, (acks, failed): SentAcks) {
        self.spare_acks = acks;
        for (receiver, e) in failed {
            self.transport_failed(receiver, "ack", &e);
        }
    }

    /// Gives back a message that will not be handled now.
    fn give_back(&mut self, receiver: usize, id: MessageId) {
        bump(&self.ctx.counters.released);
        self.ctx.events.emit(|| WorkerEvent::Released {
            transport: self.ctx.receivers[receiver].name.clone(),
            id: id.text().into_owned(),
        });
        self.releases.push((receiver, id));
    }

    /// Extends the leases of messages held for half the keepalive interval
    /// or longer: one fetched just after a tick is extended at the next,
    /// one fetched just before it at the one after, so no lease goes more
    /// than one and a half intervals without.
    async fn keepalive(&mut self) {
        let Some(every) = self.keepalive_every else {
            return;
        };
        let interval = every / 2;
        if self.pending_acks() > 0 {
            self.settle = true;
        }
        let now = Instant::now();
        let held: Vec<(usize, MessageId)> = self
            .buffer
            .iter()
            .map(|h| (h.receiver, &h.id, h.since))
            .chain(self.in_flight.tasks().map(|t| (t.receiver, &t.id, t.since)))
            .filter(|(_, _, since)| now.saturating_duration_since(*since) >= interval)
            .map(|(r, id, _)| (r, id.clone()))
            .collect();
        for (receiver, id) in held {
            // A transport that leases nothing has nothing to extend.
            let Some(keepalive) = self.ctx.receivers[receiver].transport.as_keepalive() else {
                continue;
            };
            if let Err(e) = keepalive.keepalive(&id.delivery_id()).await {
                self.transport_failed(receiver, "keepalive", &e);
            }
        }
    }

    /// Asks the receivers, in priority order, for a batch while the
    /// pending acknowledgements are sent (a broker round trip each, and a
    /// transport that groups writes commits them together); keeps the
    /// messages in flight going meanwhile. Returns how many arrived, and the
    /// shortest wait for a rate-limited receiver's next token. The
    /// acknowledgements have been sent when it returns.
    async fn fetch(&mut self, budget: u64) -> (usize, Option<Duration>) {
        let ctx = self.ctx;
        let pending = self.pending_acks() > 0;
        let acks = if pending {
            self.take_acks()
        } else {
            Vec::new()
        };
        let acking = send_acks(ctx, acks);
        tokio::pin!(acking);
        // `Some` once the acknowledgements are sent.
        let mut sent: Option<SentAcks> = None;
        let fetched = if let Some(asked) = self.ahead.as_ref().map(|a| a.receiver) {
            // Asked for already: wait for it, unless the worker must stop
            // first (then a stop gives it back when it arrives).
            let must_stop = self.must_stop();
            tokio::pin!(must_stop);
            let arrived = loop {
                tokio::select! {
                    biased;
                    _ = poll_fn(|cx| poll_ahead(&mut self.ahead, &mut self.buffer, &mut self.buckets, ctx, cx)) => {
                        break true;
                    }
                    () = &mut must_stop => break false,
                    done = acking.as_mut(), if pending && sent.is_none() => sent = Some(done),
                    finished = self.in_flight.next(), if !self.in_flight.is_empty() => {
                        self.record(finished);
                    }
                    _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
                }
                // What finished meanwhile is settled now, not when the
                // batch arrives (a long poll may outlast its leases).
                if (!pending || sent.is_some()) && self.has_outcomes() {
                    break false;
                }
            };
            if arrived && self.buffer.is_empty() {
                // It brought nothing: the round goes on with the receivers
                // after the one asked, as if its `get` had been awaited in
                // line (a `get` settled early is often a receiver's).
                let budget = self.budget();
                self.fetch_batch(budget, asked + 1, &mut acking, &mut sent, pending)
                    .await
            } else {
                (self.buffer.len(), None)
            }
        } else {
            self.fetch_batch(budget, 0, &mut acking, &mut sent, pending)
                .await
        };
        if fetched.0 > 0 {
            self.ask_ahead();
        }
        if pending {
            let sent = match sent {
                Some(sent) => sent,
                None => loop {
                    tokio::select! {
                        biased;
                        sent = &mut acking => break sent,
                        finished = self.in_flight.next(), if !self.in_flight.is_empty() => {
                            self.record(finished);
                        }
                    }
                },
            };
            self.acks_sent(sent);
        }
        fetched
    }

    /// Asks the receivers from number `from` on, in priority order, for a
    /// batch; see [`fetch`](Self::fetch).
    async fn fetch_batch<A>(
        &mut self,
        budget: u64,
        from: usize,
        acking: &mut Pin<&mut A>,
        sent: &mut Option<SentAcks>,
        pending: bool,
    ) -> (usize, Option<Duration>)
    where
        A: Future<Output = SentAcks>,
    {
        let mut wait: Option<Duration> = None;
        for receiver in from..self.ctx.receivers.len() {
            // Paused after one of its messages could not be parked: the
            // receivers after it are read meanwhile.
            if self.fetch_after[receiver].is_some() {
                if self.paused(receiver, Instant::now()).is_some() {
                    continue;
                }
                self.fetch_after[receiver] = None;
            }
            let mut want = self
                .options
                .batch_size
                .min(budget.min(usize::MAX as u64) as usize);
            if let Some(bucket) = &mut self.buckets[receiver] {
                let tokens = bucket.available(Instant::now());
                if tokens == 0 {
                    let w = bucket.wait();
                    wait = Some(wait.map_or(w, |x: Duration| x.min(w)));
                    continue;
                }
                want = want.min(tokens);
            }
            if want == 0 {
                break;
            }
            let ctx = self.ctx;
            let got = if ctx.receivers[receiver]
                .transport
                .as_local_receiver()
                .is_none()
            {
                // A broker's `get` may wait long for a message (a long
                // poll): it must not hold up a stop or the time limit.
                let mut get = match ctx.receivers[receiver].receiver() {
                    Ok(r) => r.get(want),
                    Err(e) => Box::pin(std::future::ready(Err(e))),
                };
                let must_stop = self.must_stop();
                tokio::pin!(must_stop);
                let got = loop {
                    tokio::select! {
                        biased;
                        got = get.as_mut() => break Some(got),
                        done = acking.as_mut(), if pending && sent.is_none() => *sent = Some(done),
                        finished = self.in_flight.next(), if !self.in_flight.is_empty() => {
                            self.record(finished);
                        }
                        // A long poll must not let the leases of what is
                        // in flight run out.
                        _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
                        () = &mut must_stop => break None,
                    }
                    // What finished meanwhile is settled now, not when the
                    // poll ends (it may outlast their leases).
                    if (!pending || sent.is_some()) && self.has_outcomes() {
                        break None;
                    }
                };
                match got {
                    Some(got) => got.map(Batch::Remote),
                    None => {
                        // The `get` goes on as the batch asked for ahead:
                        // a stop gives back what it brings.
                        self.ahead = Some(Ahead {
                            receiver,
                            want,
                            get,
                        });
                        return (0, wait);
                    }
                }
            } else {
                let get = ctx.receivers[receiver].get(want);
                tokio::pin!(get);
                loop {
                    tokio::select! {
                        biased;
                        got = &mut get => break got,
                        done = acking.as_mut(), if pending && sent.is_none() => *sent = Some(done),
                        finished = self.in_flight.next(), if !self.in_flight.is_empty() => {
                            self.record(finished);
                        }
                    }
                }
            };
            match got {
                Ok(batch) if batch.len() > 0 => {
                    if let Some(bucket) = &mut self.buckets[receiver] {
                        bucket.take(batch.len(), Instant::now());
                    }
                    let n = batch.len();
                    batch.hold(receiver, &mut self.buffer);
                    return (n, wait);
                }
                Ok(_) => {}
                Err(e) => self.transport_failed(receiver, "get", &e),
            }
        }
        (0, wait)
    }

    /// How many more messages may be asked for within the message limit:
    /// those handled, in flight, fetched and asked for ahead count.
    fn budget(&self) -> u64 {
        let asked = self.ahead.as_ref().map_or(0, |a| a.want) as u64;
        self.options.message_limit.map_or(u64::MAX, |n| {
            n.saturating_sub(
                self.processed + self.in_flight.len() as u64 + self.buffer.len() as u64 + asked,
            )
        })
    }

    /// Resolves once the worker must stop: asked to, or out of time.
    fn must_stop(&self) -> impl Future<Output = ()> + 'static {
        let stop = self.stop.clone();
        let deadline = self.options.time_limit.map(|t| self.started + t);
        async move {
            let out_of_time = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stop.stopped() => {}
                () = out_of_time => {}
            }
        }
    }

    /// Asks for the next batch now, so it arrives while the current one is
    /// handled: with one receiver only (several must be read in priority
    /// order after each batch), a transport with round trips (not an
    /// in-process one) and no rate limit, within the message limit.
    fn ask_ahead(&mut self) {
        let ctx = self.ctx;
        let budget = self.options.message_limit.map_or(u64::MAX, |n| {
            n.saturating_sub(
                self.processed + self.in_flight.len() as u64 + self.buffer.len() as u64,
            )
        });
        let want = self
            .options
            .batch_size
            .min(budget.min(usize::MAX as u64) as usize);
        if want == 0
            || self.ahead.is_some()
            || ctx.receivers.len() != 1
            || self.buckets[0].is_some()
            || ctx.receivers[0].transport.as_local_receiver().is_some()
            || self.stop.is_stopped()
        {
            return;
        }
        let Ok(receiver) = ctx.receivers[0].receiver() else {
            return;
        };
        self.ahead = Some(Ahead {
            receiver: 0,
            want,
            get: receiver.get(want),
        });
    }

    /// Whether every receiver is empty (a receiver that cannot count is
    /// taken as empty once `get` returned nothing).
    async fn all_empty(&mut self) -> bool {
        for (i, r) in self.ctx.receivers.iter().enumerate() {
            // A receiver that cannot count is taken as empty once `get`
            // returned nothing.
            let Some(counter) = r.transport.as_message_count() else {
                continue;
            };
            match counter.message_count().await {
                // What this run parked back into the transport waits there
                // for later; it is not work left to do now.
                Ok(n) if n <= self.again[i].len() as u64 => {}
                Ok(_) => return false,
                Err(e) => {
                    self.transport_failed(i, "count", &e);
                    return false;
                }
            }
        }
        true
    }

    fn limit_reached(&self, last_memory_check: &mut Option<Instant>) -> Option<StopReason> {
        if self.stop.is_stopped() {
            return Some(StopReason::Stopped);
        }
        let o = &self.options;
        if o.message_limit.is_some_and(|n| self.processed >= n) {
            return Some(StopReason::MessageLimit);
        }
        if o.failure_limit
            .is_some_and(|n| self.ctx.counters.failed.load(Ordering::Relaxed) >= n)
        {
            return Some(StopReason::FailureLimit);
        }
        let now = Instant::now();
        if o.time_limit
            .is_some_and(|t| now.saturating_duration_since(self.started) >= t)
        {
            return Some(StopReason::TimeLimit);
        }
        if let Some(limit) = o.memory_limit {
            if last_memory_check
                .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1))
            {
                *last_memory_check = Some(now);
                if resident_memory().is_some_and(|rss| rss > limit) {
                    return Some(StopReason::MemoryLimit);
                }
            }
        }
        None
    }

    async fn run(mut self) -> WorkerReport {
        let ctx = self.ctx;
        ctx.events.emit(|| WorkerEvent::Started {
            transports: ctx.receivers.iter().map(|r| r.name.to_string()).collect(),
        });
        let mut stopped = self.stop.tx.subscribe();
        let deadline =
            tokio::time::sleep_until(self.started + self.options.time_limit.unwrap_or(far::FAR));
        tokio::pin!(deadline);
        // Checked at once, then about every second.
        let mut memory_checked = None;
        let reason = loop {
            if let Some(reason) = self.limit_reached(&mut memory_checked) {
                break reason;
            }
            // A worker kept busy (handlers that finish at once, a free slot,
            // messages to fetch) never reaches a wait that watches the
            // ticker: extend the leases of what it holds here too.
            if self.keepalive_every.is_some()
                && poll_fn(|cx| Poll::Ready(self.ticker.poll_tick(cx).is_ready())).await
            {
                self.keepalive().await;
            }
            // Start what the buffer holds, up to the concurrency (at most
            // that many per round, though most finish at once, so the stop
            // conditions are checked as often as before).
            let room = self
                .options
                .concurrency
                .saturating_sub(self.in_flight.len());
            for _ in 0..room {
                let Some(held) = self.buffer.pop_front() else {
                    break;
                };
                self.start(held);
                // Let the runtime run other tasks now and then.
                tokio::task::consume_budget().await;
            }
            // Harvest whatever finished without waiting (the batch asked
            // for ahead is sent on its way by its first poll here).
            if self.ahead.is_some() {
                poll_fn(|cx| {
                    let _ = poll_ahead(
                        &mut self.ahead,
                        &mut self.buffer,
                        &mut self.buckets,
                        ctx,
                        cx,
                    );
                    Poll::Ready(())
                })
                .await;
            }
            while !self.in_flight.is_empty() {
                match self.in_flight.try_next().await {
                    Some(finished) => self.record(finished),
                    None => break,
                }
            }
            let budget = self.budget();
            let fetching = self.buffer.is_empty()
                && self.in_flight.len() < self.options.concurrency
                && (budget > 0 || self.ahead.is_some());
            // Acknowledgements wait for a batch's worth, for the buffer to
            // run dry, or for a keepalive tick; then they go with the next
            // fetch, if there is one.
            let pending = self.pending_acks();
            if !self.panicked.is_empty()
                || !self.rejects.is_empty()
                || !self.releases.is_empty()
                || (pending >= self.options.batch_size && !self.buffer.is_empty())
                // No keepalive extends a handled message's lease: it waits
                // for the others one keepalive interval at most.
                || (pending > 0 && self.settle)
                || (pending > 0 && self.buffer.is_empty() && !fetching)
            {
                self.flush().await;
                continue;
            }
            if !self.buffer.is_empty() && self.in_flight.len() < self.options.concurrency {
                // Room freed up while harvesting: start more first.
                continue;
            }
            if fetching {
                if let Some(until) = self.all_paused() {
                    // Parking failed for every receiver: wait before
                    // fetching (the messages given back) again, handling
                    // what is in flight.
                    tokio::select! {
                        finished = self.in_flight.next(), if !self.in_flight.is_empty() => self.record(finished),
                        _ = stopped.changed() => {}
                        _ = &mut deadline, if self.options.time_limit.is_some() => {}
                        _ = tokio::time::sleep_until(until) => {}
                        // The pause (up to 5 s) must not let the leases of
                        // what is in flight run out.
                        _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
                    }
                    continue;
                }
                let (n, token_wait) = self.fetch(budget).await;
                // A `get` still out: the worker must stop, or settle what
                // finished while it waits.
                if n > 0 || self.ahead.is_some() {
                    continue;
                }
                if self.in_flight.is_empty() && self.buffer.is_empty() {
                    self.flush().await;
                    // A receiver paused after a failed park holds the
                    // message given back, and was not asked since: it is
                    // not known to be empty (it may not count).
                    if self.options.stop_when_empty
                        && self.panicked.is_empty()
                        && self.fetch_after.iter().all(Option::is_none)
                        && self.all_empty().await
                    {
                        break StopReason::Empty;
                    }
                }
                let idle = token_wait.map_or(self.options.idle_sleep, |w| {
                    w.max(Duration::from_millis(1)).min(self.options.idle_sleep)
                });
                let now = Instant::now();
                let waits: Vec<BoxFuture<'_, ()>> = ctx
                    .receivers
                    .iter()
                    .enumerate()
                    .map(|(i, r)| {
                        // A paused receiver (holding the message it could
                        // not park) wakes us when its pause ends, not at
                        // once; a rate-limited one not before its next
                        // token.
                        if let Some(until) = self.paused(i, now) {
                            Box::pin(tokio::time::sleep_until(until)) as BoxFuture<'_, ()>
                        } else if self.buckets[i].is_some() {
                            Box::pin(tokio::time::sleep(idle)) as BoxFuture<'_, ()>
                        } else if let Some(wake_up) = r.transport.as_wake_up() {
                            wake_up.wait_for_messages(idle)
                        } else {
                            Box::pin(tokio::time::sleep(idle)) as BoxFuture<'_, ()>
                        }
                    })
                    .collect();
                tokio::select! {
                    finished = self.in_flight.next(), if !self.in_flight.is_empty() => self.record(finished),
                    _ = stopped.changed() => {}
                    _ = &mut deadline, if self.options.time_limit.is_some() => {}
                    _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
                    _ = any(waits) => {}
                }
                continue;
            }
            // Full, or out of budget: wait for a message to finish.
            tokio::select! {
                finished = self.in_flight.next(), if !self.in_flight.is_empty() => self.record(finished),
                _ = poll_fn(|cx| poll_ahead(&mut self.ahead, &mut self.buffer, &mut self.buckets, ctx, cx)), if self.ahead.is_some() => {}
                _ = stopped.changed() => {}
                _ = &mut deadline, if self.options.time_limit.is_some() => {}
                _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
            }
        };
        self.shut_down().await;
        let report = WorkerReport {
            reason,
            stats: ctx.counters.snapshot(),
            elapsed: self.started.elapsed(),
        };
        ctx.events.emit(|| WorkerEvent::Stopped { report });
        report
    }

    /// Gives back the messages fetched and not started.
    fn give_back_buffer(&mut self) {
        for held in std::mem::take(&mut self.buffer) {
            self.give_back(held.receiver, held.id);
        }
    }

    /// Releases what was not started, lets what is in flight finish within
    /// the grace period (cut short by [`StopHandle::stop_now`]), releases
    /// the rest, and flushes.
    async fn shut_down(&mut self) {
        let stop = self.stop.clone();
        let period = self.options.grace_period;
        let grace = async move {
            tokio::select! {
                () = tokio::time::sleep(period) => {}
                () = stop.stopped_now() => {}
            }
        };
        tokio::pin!(grace);
        // A batch asked for ahead (or a `get` still out when the stop came)
        // is given back with the buffer when it arrives, while the handlers
        // in flight go on; should it not arrive within the grace period,
        // its messages come back when their leases expire.
        let ctx = self.ctx;
        self.give_back_buffer();
        while !self.in_flight.is_empty() || self.ahead.is_some() {
            // What was given back or finished is settled at once: the grace
            // period may outlast the leases of messages no longer held.
            if self.has_outcomes() {
                self.flush().await;
                continue;
            }
            tokio::select! {
                _ = poll_fn(|cx| poll_ahead(&mut self.ahead, &mut self.buffer, &mut self.buckets, ctx, cx)), if self.ahead.is_some() => {
                    self.give_back_buffer();
                }
                finished = self.in_flight.next(), if !self.in_flight.is_empty() => self.record(finished),
                _ = &mut grace => break,
                _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
            }
        }
        self.ahead = None;
        for task in self.in_flight.abandon() {
            self.give_back(task.receiver, task.id);
        }
        self.flush().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{MessageCount, Receiver as _};

    #[test]
    fn every_stop_reason_reads_as_a_reason() {
        // Shown as "Stopped (<reason>)": no reason may just repeat the verb.
        let reasons = [
            StopReason::Stopped,
            StopReason::MessageLimit,
            StopReason::TimeLimit,
            StopReason::MemoryLimit,
            StopReason::FailureLimit,
            StopReason::Empty,
        ];
        for reason in reasons {
            let text = reason.to_string();
            assert!(text.contains(' ') && text != "stopped", "{text}");
        }
    }

    fn assert_send<T: Send>(_: &T) {}

    #[test]
    fn run_is_a_send_future_so_a_worker_can_be_spawned() {
        let messenger = Messenger::builder()
            .transport(
                "async",
                Arc::new(crate::transport::in_memory::InMemoryTransport::new()),
            )
            .build()
            .unwrap();
        let worker = Worker::builder(&messenger)
            .receiver("async")
            .build()
            .unwrap();
        let run = worker.run();
        assert_send(&run);
    }

    #[test]
    fn a_bucket_refills_one_token_per_period_share() {
        let start = Instant::now();
        let mut b = Bucket::new(RateLimit::new(4, Duration::from_secs(1)), start);
        assert_eq!(b.available(start), 4);
        b.take(4, start);
        assert_eq!(b.available(start), 0);
        assert_eq!(b.wait(), Duration::from_millis(250));
        assert_eq!(b.available(start + Duration::from_millis(500)), 2);
        assert_eq!(b.available(start + Duration::from_secs(10)), 4, "capped");
    }

    #[test]
    fn appending_a_stamp_header_keeps_what_was_there() {
        let mut raw = RawMessage::default();
        raw.headers.insert("X-Message-Stamp-Delay", r#"[{"ms":1}]"#);
        append_stamp_header(&mut raw, &DelayStamp { ms: 2 });
        assert_eq!(
            raw.header("X-Message-Stamp-Delay"),
            Some(r#"[{"ms":1},{"ms":2}]"#)
        );
        raw.headers.insert("X-Message-Stamp-Delay", "garbage");
        append_stamp_header(&mut raw, &DelayStamp { ms: 3 });
        assert_eq!(raw.header("X-Message-Stamp-Delay"), Some(r#"[{"ms":3}]"#));
        assert_eq!(raw.header("X-Malformed-Stamp-Delay"), Some("garbage"));
    }

    #[test]
    fn appending_a_retry_history_stamp_header_keeps_only_the_newest() {
        let mut raw = RawMessage::default();
        for n in 0..40 {
            append_stamp_header(
                &mut raw,
                &RedeliveryStamp {
                    retry_count: n,
                    at: 0,
                },
            );
        }
        let kept: Vec<RedeliveryStamp> =
            serde_json::from_str(raw.header("X-Message-Stamp-Redelivery").unwrap()).unwrap();
        let counts: Vec<u32> = kept.iter().map(|r| r.retry_count).collect();
        let newest: Vec<u32> =
            (40 - crate::transport::serializer::STAMP_HISTORY as u32..40).collect();
        assert_eq!(counts, newest);
    }

    fn task(key: u64) -> TaskInfo {
        TaskInfo {
            receiver: 0,
            id: MessageId::Local(LocalId::new(key)),
            since: Instant::now(),
            envelope: None,
        }
    }

    fn done() -> Done {
        Done::new(0, Action::Ack)
    }

    fn finished_key(finished: Finished) -> String {
        match finished {
            Finished::Done(_, id) => id.text().into_owned(),
            Finished::Panicked { id, message, .. } => {
                format!("{} panicked: {message}", id.text())
            }
        }
    }

    #[tokio::test]
    async fn messages_that_wait_are_polled_again_when_woken_and_their_slots_reused() {
        let mut in_flight = InFlight::new();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let mut rx = Some(rx);
        let mut make = |wait: bool| {
            let rx = if wait { rx.take() } else { None };
            async move {
                if let Some(rx) = rx {
                    let _ = rx.await;
                }
                tokio::task::yield_now().await;
                done()
            }
        };
        assert!(in_flight.start(task(1), make(true)).is_none());
        assert!(in_flight.start(task(2), make(false)).is_none());
        assert_eq!(in_flight.len(), 2);
        // Only the one that can make progress finishes.
        assert_eq!(finished_key(in_flight.next().await), "2");
        assert!(in_flight.try_next().await.is_none());
        tx.send(()).unwrap();
        assert_eq!(finished_key(in_flight.next().await), "1");
        assert!(in_flight.is_empty());
        // A finished message's slot takes the next one.
        assert!(in_flight.start(task(3), make(false)).is_none());
        assert_eq!(in_flight.slots.len(), 2);
        assert_eq!(finished_key(in_flight.next().await), "3");
    }

    #[tokio::test]
    async fn a_message_that_always_wakes_itself_does_not_keep_the_worker_busy() {
        let mut in_flight = InFlight::new();
        let spin = poll_fn(|cx| {
            cx.waker().wake_by_ref();
            Poll::<Done>::Pending
        });
        assert!(in_flight.start(task(1), spin).is_none());
        // Polled a bounded number of times, then handed back to the runtime.
        assert!(in_flight.try_next().await.is_none());
        assert_eq!(in_flight.abandon().len(), 1);
        assert!(in_flight.is_empty());
    }

    #[tokio::test]
    async fn a_panicking_message_is_reported_with_its_id() {
        let mut in_flight = InFlight::new();
        let boom = async {
            tokio::task::yield_now().await;
            panic!("boom");
        };
        assert!(in_flight.start(task(7), boom).is_none());
        assert_eq!(finished_key(in_flight.next().await), "7 panicked: boom");
        assert!(in_flight.is_empty());
    }

    #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
    struct Job(u64);

    impl crate::Message for Job {
        const NAME: &'static str = "Job";
    }

    impl crate::Command for Job {
        type Output = ();
        type Error = std::convert::Infallible;
    }

    /// An encoding in-memory queue whose gets and acknowledgements take a
    /// while, as a broker's round trips do.
    struct Slow(crate::transport::in_memory::InMemoryTransport);

    impl Transport for Slow {
        fn send(
            &self,
            message: RawMessage,
            delay: Option<Duration>,
        ) -> BoxFuture<'_, Result<String, TransportError>> {
            self.0.send(message, delay)
        }

        fn as_receiver(&self) -> Option<&dyn crate::transport::Receiver> {
            Some(self)
        }

        fn as_message_count(&self) -> Option<&dyn crate::transport::MessageCount> {
            self.0.as_message_count()
        }

        fn bind(&self, binding: &crate::transport::TransportBinding) {
            self.0.bind(binding);
        }
    }

    impl crate::transport::Receiver for Slow {
        fn get(
            &self,
            max: usize,
        ) -> BoxFuture<'_, Result<Vec<crate::transport::Delivery>, TransportError>> {
            // Claimed at once; the answer takes a while to come back.
            Box::pin(async move {
                let got = self.0.get(max).await;
                tokio::time::sleep(Duration::from_millis(3)).await;
                got
            })
        }

        fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                self.0.ack(id).await
            })
        }

        fn ack_batch<'a>(
            &'a self,
            ids: &'a [DeliveryId],
        ) -> BoxFuture<'a, Result<(), TransportError>> {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                self.0.ack_batch(ids).await
            })
        }

        fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
            self.0.reject(id)
        }

        fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
            self.0.release(id)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn acknowledgements_recorded_while_others_are_sent_are_sent_too() {
        let queue = Arc::new(Slow(
            crate::transport::in_memory::InMemoryTransport::with_config(
                crate::transport::in_memory::InMemoryConfig {
                    serialize: true,
                    ..Default::default()
                },
            ),
        ));
        let messenger = Messenger::builder()
            .command_handler(|job: Job| async move {
                // Handlers finish while gets and acknowledgements are out.
                tokio::time::sleep(Duration::from_millis(job.0 % 5)).await;
                Ok::<_, std::convert::Infallible>(())
            })
            .transport("slow", queue.clone())
            .route::<Job>("slow")
            .build()
            .unwrap();
        for n in 0..30 {
            messenger.dispatcher().dispatch(Job(n)).await.unwrap();
        }
        let report = Worker::builder(&messenger)
            .receiver("slow")
            .concurrency(3)
            .batch_size(4)
            .message_limit(30)
            .build()
            .unwrap()
            .run()
            .await;
        assert_eq!(report.stats.handled, 30);
        assert_eq!(queue.0.acknowledged(), 30);
        assert_eq!(queue.0.message_count().await.unwrap(), 0);
    }

    fn slow_messenger(stop: Option<(StopHandle, u64)>) -> (Messenger, Arc<Slow>) {
        let queue = Arc::new(Slow(
            crate::transport::in_memory::InMemoryTransport::with_config(
                crate::transport::in_memory::InMemoryConfig {
                    serialize: true,
                    ..Default::default()
                },
            ),
        ));
        let messenger = Messenger::builder()
            .command_handler(move |job: Job| {
                let stop = stop.clone();
                async move {
                    if let Some((stop, at)) = stop {
                        if job.0 == at {
                            stop.stop();
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    Ok::<_, std::convert::Infallible>(())
                }
            })
            .transport("slow", queue.clone())
            .route::<Job>("slow")
            .build()
            .unwrap();
        (messenger, queue)
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_asked_for_ahead_stays_within_the_message_limit() {
        let (messenger, queue) = slow_messenger(None);
        for n in 0..30 {
            messenger.dispatcher().dispatch(Job(n)).await.unwrap();
        }
        let report = Worker::builder(&messenger)
            .receiver("slow")
            .batch_size(4)
            .message_limit(10)
            .build()
            .unwrap()
            .run()
            .await;
        assert_eq!((report.stats.handled, report.stats.released), (10, 0));
        // Nothing else was taken: the other 20 are available at once.
        assert_eq!(queue.0.get(100).await.unwrap().len(), 20);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_gives_back_the_batch_asked_for_ahead() {
        let stop = StopHandle::new();
        let (messenger, queue) = slow_messenger(Some((stop.clone(), 1)));
        for n in 0..20 {
            messenger.dispatcher().dispatch(Job(n)).await.unwrap();
        }
        let report = Worker::builder(&messenger)
            .receiver("slow")
            .batch_size(4)
            .stop_handle(stop)
            .build()
            .unwrap()
            .run()
            .await;
        assert_eq!(report.reason, StopReason::Stopped);
        let handled = report.stats.handled;
        assert!(report.stats.released > 0, "{:?}", report.stats);
        assert_eq!(queue.0.acknowledged(), handled);
        // Everything not handled is available again at once, not leased.
        assert_eq!(queue.0.get(100).await.unwrap().len() as u64, 20 - handled);
    }

    #[test]
    fn resident_memory_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(resident_memory().is_some_and(|b| b > 0));
        }
    }
}
