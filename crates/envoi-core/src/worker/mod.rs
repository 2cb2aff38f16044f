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
//! [`ReceivedStamp`]: crate::envelope::stamp::ReceivedStamp
//! [`TransportMessageIdStamp`]: crate::envelope::stamp::TransportMessageIdStamp
//! [`RedeliveredStamp`]: crate::envelope::stamp::RedeliveredStamp
//! [`BusNameStamp`]: crate::envelope::stamp::BusNameStamp
//! [`UnsentStamp`]: crate::envelope::stamp::UnsentStamp
//! [`MessageBus::receive`]: crate::pipeline::bus::MessageBus::receive
//! [`Verdict`]: crate::pipeline::verdict::Verdict
//! [`Verdict::failed_deferred`]: crate::pipeline::verdict::Verdict::failed_deferred
//!
//! # What happens to a message
//!
//! The worker asks its receivers for messages **in priority order**: the
//! first receiver is asked first, and after every batch it starts again from
//! the first, so a lower-priority receiver is only read while those before it
//! are empty, held back by their [rate limit](crate::worker::WorkerBuilder::rate_limit), or
//! paused because one of their messages could not be parked (see below).
//! Each message is decoded (messages stored as envelopes by an
//! in-process transport need no decoding), stamped with a
//! [`ReceivedStamp`] naming the transport and a [`TransportMessageIdStamp`]
//! (and a [`RedeliveredStamp`] when its transport marked it as a
//! redelivery), and dispatched on the bus named by its [`BusNameStamp`]
//! (the default bus when it has none or names a bus this messenger does not
//! have) with [`MessageBus::receive`], which returns its
//! [`Verdict`]: what became of it, and the dispatches its handlers deferred
//! that failed. The worker settles the message by the verdict, in one place:
//!
//! | verdict | the worker | event |
//! |---|---|---|
//! | [handled](crate::pipeline::verdict::Fate::Handled) | acknowledges it | [`Handled`](crate::worker::WorkerEvent::Handled) |
//! | [retried](crate::pipeline::verdict::Fate::Retried) by the retry step | acknowledges it (the retry is a new message) | [`Retried`](crate::worker::WorkerEvent::Retried) |
//! | handled, or retried, with dispatches its handlers [deferred](crate::pipeline::dispatch_after_current_bus) that failed ([`Verdict::failed_deferred`]) | parks each deferred message that failed in the failure transport, as a message of its own with an `ErrorDetails` stamp saying why (and an [`UnsentStamp`] when it could not be sent: see below), then acknowledges the message (it is not parked itself: the handlers that deferred them would be skipped there, and a retry already holds it). A handled message is rejected when there is no failure transport, and released, so its handlers run and defer them again, when one cannot be parked (fetching from its receiver then pauses); a retried one is acknowledged all the same, its retry holding it, and a deferred message that cannot be parked is dropped with an error log | [`Handled`](crate::worker::WorkerEvent::Handled) or [`Retried`](crate::worker::WorkerEvent::Retried), and a [`Failed`](crate::worker::WorkerEvent::Failed) for each deferred message, naming it |
//! | [parked](crate::pipeline::verdict::Fate::Parked) in the failure transport by the retry step | acknowledges it; dispatches deferred by its handlers that succeeded that then failed are parked too, each on its own, as above (the message is acknowledged all the same: one that cannot be parked is dropped with an error log, as the parked message holds the handlers that deferred it) | [`Failed`](crate::worker::WorkerEvent::Failed) |
//! | [failed](crate::pipeline::verdict::Fate::Failed): its handlers failed and there is no failure transport | rejects it | [`Failed`](crate::worker::WorkerEvent::Failed) |
//! | not dispatched: it carries an [`UnsentStamp`] (a deferred message parked because it could not be sent to its transport) | sends it to that transport, without the stamp, and to those its type is routed to after that one (the failed send stopped before them), and acknowledges it; when a send fails (the ones before it get it again on its next delivery), releases it and pauses fetching from its receiver, as for a transport failure; when a transport refuses it for good (it does not exist, or the message is too large, cannot be encoded or is not supported there), parks it again, naming that transport in its `UnsentStamp`, with an `ErrorDetails` stamp saying why and the growing delay of a message parked again, and acknowledges it | [`Handled`](crate::worker::WorkerEvent::Handled), or [`Failed`](crate::worker::WorkerEvent::Failed) |
//! | failed: the retry step could not send the retry, or park the message (a transport failure) | releases it, so it is delivered again, and pauses fetching from its receiver as when parking fails; when the transport its retry was to go to refuses it for good (it does not exist, or the message is too large, cannot be encoded or is not supported there), parks it instead, as for any other error (below) | [`Failed`](crate::worker::WorkerEvent::Failed), saying where it could not be parked or retried and why |
//! | failed for any other reason (no handler, a middleware's error), or a panic | parks it like the retry step would, then acknowledges it; rejects it when there is no failure transport | [`Failed`](crate::worker::WorkerEvent::Failed) |
//! | it does not decode (unknown type, malformed, too large) | sends the raw message to the failure transport with an `ErrorDetails` stamp header saying why, then acknowledges it; rejects it when there is no failure transport | [`Failed`](crate::worker::WorkerEvent::Failed) |
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
//! ([`parked_again_delay`](crate::failure::parked_again_delay)).
//!
//! Acknowledgements are sent in batches, after the events above: one that
//! fails is reported by a [`TransportFailed`](crate::worker::WorkerEvent::TransportFailed)
//! event, and the message may be delivered again when its lease ends.
//!
//! # Stopping
//!
//! The worker stops when a [`StopHandle`] is used (for instance by
//! [`StopHandle::stop_on_signals`] on SIGINT or SIGTERM), or when a limit is
//! reached: messages, time, memory (resident set size, read from
//! `/proc/self/status` on Linux and ignored elsewhere), failures, or — with
//! [`stop_when_empty`](crate::worker::WorkerBuilder::stop_when_empty) — when every receiver
//! is empty. Stopping is graceful: the worker stops fetching (a fetch still
//! waiting for messages, as a broker's long poll does, is given the grace
//! period to return, and what it brings is released), releases the
//! messages it fetched but did not start, lets the handlers in flight finish
//! within the [grace period](crate::worker::WorkerBuilder::grace_period), then releases what
//! did not finish so it is delivered again. A handler that takes its
//! [`Context`](crate::Context) learns that the worker is stopping from
//! [`Context::cancelled`](crate::Context::cancelled), and can wind down
//! (or fail, to be retried) within the grace period.
//! [`StopHandle::stop_now`] (a second signal) cuts the grace period short:
//! the handlers in flight are dropped and their messages released at once.
//! Nothing is lost.
//!
//! # Concurrency, leases and rate limits
//!
//! Up to [`concurrency`](crate::worker::WorkerBuilder::concurrency) messages are handled at
//! once, on the worker's own task (run several workers for several cores).
//! While a message is held — fetched or being handled — the worker extends
//! its lease with [`Keepalive::keepalive`](crate::transport::Keepalive::keepalive) every
//! [`keepalive_interval`](crate::worker::WorkerBuilder::keepalive_interval), so a slow but
//! live handler is not redelivered to another worker. The first extension
//! comes within one and a half intervals of the fetch, so leases must be
//! longer than that (the transports' defaults are 30 s or more, the
//! interval's 5 s). A
//! [rate limit](crate::worker::WorkerBuilder::rate_limit) caps the pace at which the worker
//! takes messages from one transport: a token bucket, which lets a burst of
//! up to [`messages`](crate::worker::RateLimit::messages) through at once (at the start,
//! or after a quiet spell), then one every `per / messages`.
//!
//! # Events
//!
//! [`WorkerEvent`]s go to [listeners](crate::worker::WorkerBuilder::listener) (called in
//! line, so keep them quick; a listener that panics is logged and the
//! worker goes on) and to [`Worker::subscribe`]rs. Events are only
//! built when someone listens. For counters only (a progress bar),
//! [`Worker::progress`] is cheaper.

mod acks;
mod builder;
mod error;
mod events;
mod fetch;
mod handle;
mod in_flight;
mod one_shot;
mod park;
mod rate;
mod run;
mod settle;
mod stop;
mod unsent;

use std::fmt;
use std::sync::Arc;

use tokio::sync::broadcast;

pub use builder::WorkerBuilder;
pub use error::WorkerError;
pub use events::{WorkerEvent, WorkerListener, WorkerProgress, WorkerReport, WorkerStats};
pub use one_shot::{consume_one, handle_one, HandledOne, Outcome, Settlement};
pub use rate::RateLimit;
pub use stop::{StopHandle, StopReason};

use crate::messenger::Messenger;
use crate::pipeline::context::StopSignal;
use builder::Options;
use events::{Counters, Events};
use fetch::Source;
use handle::Ctx;
use run::Run;

/// Consumes transports; see the [module documentation](self).
pub struct Worker {
    messenger: Messenger,
    receivers: Vec<Source>,
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
    /// [event capacity](crate::worker::WorkerBuilder::event_capacity) behind misses events
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
        let stopping = StopSignal::new();
        let run = Run::new(
            &ctx,
            self.options,
            self.stop,
            stopping.clone(),
            Ctx::process,
        )
        .run();
        // What the worker's task polls (the handlers in flight among it)
        // makes contexts that wait for its stop.
        stopping.scope(run).await
    }
}
