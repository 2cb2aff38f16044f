//! The test kit (cargo feature `testing`): the application's own messenger
//! configuration run without a broker, under tokio's paused clock,
//! recording what became of every message — what MassTransit's test
//! harness, `Oban.Testing` and `rivertest` give their users.
//!
//! [`TestKit::new`] takes the [`MessengerBuilder`] the application builds
//! its messenger from and swaps every transport for an in-memory one
//! (`in-memory://?serialize=true`: messages are encoded on the way in and
//! decoded on the way out, as a broker would make them), keeping the
//! handlers, buses, middleware, routes, retry strategies and failure
//! transports as configured: the production configuration is what is
//! tested. The sync transport (`sync://`) is kept, as it needs no broker; a
//! sender registered on its own becomes an in-memory transport that is
//! only sent to; a custom sender dispatcher (an outbox) is left out, so
//! messages go straight to the transports.
//!
//! [`TestKit::run_until_idle`] runs a [`Worker`] over every transport but
//! the failure transports and the senders' until none holds a message (due
//! or delayed) and nothing is in flight. Retries wait out their delays on
//! tokio's clock, which the kit pauses: while nothing else can run, tokio
//! moves a paused clock straight to the next timer, so a retry due in an
//! hour is handled at once, in virtual time, and a message retried forever
//! ends in its failure transport as the retry strategy says.
//!
//! The kit records, in order, what was dispatched, sent (to which
//! transport), handled (by which handler, with its result), retried
//! (attempt and delay) and parked (in which failure transport, and why):
//! [`records`](TestKit::records), typed views by message type
//! ([`handled`](TestKit::handled), [`sent`](TestKit::sent),
//! [`retried`](TestKit::retried), [`parked`](TestKit::parked), …) and
//! assertions that panic with a listing of what was recorded
//! ([`assert_handled`](TestKit::assert_handled), …).
//!
//! # The clock
//!
//! Tests run on tokio's current-thread runtime, the one `#[tokio::test]`
//! starts. Write them `#[tokio::test(start_paused = true)]`, or let
//! [`TestKit::new`] pause the clock when it is not paused yet (from then
//! on, for the rest of the test). A multi-threaded runtime cannot pause
//! its clock: the kit refuses it ([`KitError::MultiThreadRuntime`]).
//!
//! ```
//! use envoi_core::failure::MultiplierRetryStrategy;
//! use envoi_core::testing::TestKit;
//! use envoi_core::{Command, Message, Messenger, MessengerBuilder};
//! use serde::{Deserialize, Serialize};
//! use std::time::Duration;
//!
//! #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
//! struct ChargeCard { order: u32 }
//! impl Message for ChargeCard { const NAME: &'static str = "ChargeCard"; }
//! impl Command for ChargeCard { type Output = (); type Error = GatewayDown; }
//!
//! #[derive(Debug, thiserror::Error)]
//! #[error("the payment gateway is down")]
//! struct GatewayDown;
//!
//! /// The application's configuration, as `main` builds it.
//! fn app() -> MessengerBuilder {
//!     Messenger::builder()
//!         .command_handler(|_: ChargeCard| async { Err::<(), _>(GatewayDown) })
//!         .transport_dsn("payments", "redis://cache.internal:6379/payments")
//!         .transport_dsn("failed", "redis://cache.internal:6379/failed")
//!         .route::<ChargeCard>("payments")
//!         .retry_strategy("payments", MultiplierRetryStrategy {
//!             max_retries: 3,
//!             delay: Duration::from_secs(60),
//!             multiplier: 2.0,
//!             max_delay: None,
//!             jitter: 0.0,
//!         })
//!         .failure_transport("failed")
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let kit = TestKit::new(app()).await.unwrap();
//! kit.dispatcher().dispatch(ChargeCard { order: 7 }).await.unwrap();
//! kit.assert_sent_to::<ChargeCard>("payments", 1);
//! let started = tokio::time::Instant::now();
//! kit.run_until_idle().await;
//! kit.assert_handled::<ChargeCard>(0);
//! kit.assert_retried::<ChargeCard>(3);
//! kit.assert_parked::<ChargeCard>(1);
//! let delays: Vec<Duration> = kit.retried::<ChargeCard>().iter().map(|r| r.delay).collect();
//! assert_eq!(delays, [60, 120, 240].map(Duration::from_secs));
//! // Seven minutes went by on the paused clock, none on the wall's.
//! assert!(started.elapsed() >= Duration::from_secs(420));
//! # });
//! ```
//!
//! [`Worker`]: crate::worker::Worker

mod assert;
mod journal;
mod views;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::messenger::{BuildError, Messenger, MessengerBuilder};
use crate::transport::in_memory::{InMemoryConfig, InMemoryTransport};
use crate::transport::Transport;
use crate::typed::Dispatcher;
use crate::worker::{StopReason, Worker, WorkerEvent, WorkerReport, WorkerStats};

pub use journal::{Activity, Record};
pub use views::{Handled, Parked, Retried};

use journal::{Journal, Recorder};

/// What [`TestKit::new`] can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KitError {
    /// The configuration does not build, without its brokers.
    #[error("the messenger does not build: {0}")]
    Build(#[from] BuildError),
    /// The runtime is multi-threaded, and its clock cannot be paused.
    #[error(
        "the test kit pauses tokio's clock, which only the current-thread runtime can do: \
         write the test `#[tokio::test(start_paused = true)]`, not with \
         `flavor = \"multi_thread\"`"
    )]
    MultiThreadRuntime,
    /// Not called inside a tokio runtime.
    #[error("the test kit runs inside a tokio runtime: write the test `#[tokio::test(start_paused = true)]`")]
    NoRuntime,
}

/// The application's messenger on in-memory transports, with a worker
/// run on demand and a record of what became of each message; see the
/// [module documentation](self).
pub struct TestKit {
    messenger: Messenger,
    journal: Journal,
    /// The transports the worker consumes: all but the failure transports,
    /// the senders' and those with nothing to consume (`sync://`).
    receivers: Vec<String>,
    message_limit: u64,
    time_limit: Duration,
}

impl fmt::Debug for TestKit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestKit")
            .field("messenger", &self.messenger)
            .field("consumes", &self.receivers)
            .field("records", &self.journal.records().len())
            .finish_non_exhaustive()
    }
}

impl TestKit {
    /// How many messages one [`run_until_idle`](Self::run_until_idle)
    /// handles at most, unless told otherwise
    /// ([`with_message_limit`](Self::with_message_limit)).
    pub const MESSAGE_LIMIT: u64 = 10_000;

    /// How much virtual time one [`run_until_idle`](Self::run_until_idle)
    /// lets pass at most, unless told otherwise
    /// ([`with_time_limit`](Self::with_time_limit)): a week.
    pub const TIME_LIMIT: Duration = Duration::from_secs(7 * 24 * 3600);

    /// Builds the messenger `builder` configures with every transport
    /// swapped for an in-memory one (see the [module documentation](self)),
    /// records on each of its buses, and pauses tokio's clock if it is not
    /// paused yet.
    ///
    /// Fails when the configuration does not build (the same mistakes
    /// [`MessengerBuilder::build`] refuses), or when the runtime is not
    /// tokio's current-thread one.
    pub async fn new(builder: MessengerBuilder) -> Result<TestKit, KitError> {
        pause_clock()?;
        let (builder, send_only) = builder.without_brokers(|| {
            let config = InMemoryConfig {
                serialize: true,
                ..InMemoryConfig::default()
            };
            Arc::new(InMemoryTransport::with_config(config)) as Arc<dyn Transport>
        });
        let messenger = builder.build_async().await?;
        let journal = Journal::default();
        for bus in messenger.buses() {
            bus.add_middleware(Arc::new(Recorder {
                journal: journal.clone(),
                bus: bus.name().to_string(),
            }));
        }
        let failure = messenger.failure_transports();
        let receivers = messenger
            .transports()
            .filter(|(name, transport)| {
                transport.as_receiver().is_some()
                    && !failure.contains(name)
                    && !send_only.iter().any(|s| s == name)
            })
            .map(|(name, _)| name.to_string())
            .collect();
        Ok(TestKit {
            messenger,
            journal,
            receivers,
            message_limit: Self::MESSAGE_LIMIT,
            time_limit: Self::TIME_LIMIT,
        })
    }

    /// Lets one [`run_until_idle`](Self::run_until_idle) handle up to `n`
    /// messages (retries and parked messages count) before it takes the
    /// transports for never idle and panics.
    #[must_use]
    pub fn with_message_limit(mut self, n: u64) -> Self {
        self.message_limit = n.max(1);
        self
    }

    /// Lets one [`run_until_idle`](Self::run_until_idle) run for up to
    /// `limit` of virtual time before it panics: raise it for messages
    /// delayed further than a week.
    #[must_use]
    pub fn with_time_limit(mut self, limit: Duration) -> Self {
        self.time_limit = limit;
        self
    }

    /// The messenger, on its in-memory transports.
    pub fn messenger(&self) -> &Messenger {
        &self.messenger
    }

    /// A typed dispatcher on the default bus, to dispatch as the
    /// application does.
    pub fn dispatcher(&self) -> Dispatcher {
        self.messenger.dispatcher()
    }

    /// The transports [`run_until_idle`](Self::run_until_idle) consumes,
    /// sorted: every transport but the failure transports, those that
    /// replace senders registered on their own, and those that handle
    /// messages when they are sent (`sync://`).
    pub fn consumed_transports(&self) -> &[String] {
        &self.receivers
    }

    /// Handles every message the consumed transports hold, and what
    /// handling them sends there, retries included, until none holds a
    /// message, due or delayed, and nothing is in flight; returns the
    /// worker's report (its `elapsed` is virtual time).
    ///
    /// Delays pass on tokio's paused clock: a retry due in an hour is
    /// handled at once. Panics, listing the last records, when the
    /// transports are still busy after
    /// [`MESSAGE_LIMIT`](Self::MESSAGE_LIMIT) messages (a handler that
    /// keeps dispatching, say) or [`TIME_LIMIT`](Self::TIME_LIMIT) of
    /// virtual time (a handler that never finishes).
    pub async fn run_until_idle(&self) -> WorkerReport {
        if self.receivers.is_empty() {
            return WorkerReport {
                reason: StopReason::Empty,
                stats: WorkerStats::default(),
                elapsed: Duration::ZERO,
            };
        }
        let journal = self.journal.clone();
        let worker = Worker::builder(&self.messenger)
            .receivers(self.receivers.iter().cloned())
            .stop_when_empty()
            .message_limit(self.message_limit)
            .time_limit(self.time_limit)
            .listener(move |event: &WorkerEvent| journal.on_worker_event(event))
            .build();
        let worker = match worker {
            Ok(worker) => worker,
            Err(e) => panic!("the test kit cannot consume its transports: {e}"),
        };
        let report = worker.run().await;
        match report.reason {
            StopReason::Empty => report,
            StopReason::MessageLimit => panic!(
                "run_until_idle: the transports were still busy after {} messages \
                 ({:?}): does a handler keep dispatching? (raise the limit with \
                 `with_message_limit`)\n{}",
                self.message_limit,
                report.stats,
                assert::listing(&self.records(), |_| false),
            ),
            reason => panic!(
                "run_until_idle: the transports were still busy after {:?} of virtual \
                 time (the worker stopped: {reason:?}, {:?}): does a handler never \
                 finish, or is a message delayed further? (raise the limit with \
                 `with_time_limit`)\n{}",
                report.elapsed,
                report.stats,
                assert::listing(&self.records(), |_| false),
            ),
        }
    }

    /// Everything recorded so far, in order.
    pub fn records(&self) -> Vec<Record> {
        self.journal.records()
    }

    /// Forgets everything recorded so far (the transports keep what they
    /// hold).
    pub fn clear(&self) {
        self.journal.clear();
    }
}

/// Pauses tokio's clock unless it is paused already; refuses a runtime
/// whose clock cannot be paused.
fn pause_clock() -> Result<(), KitError> {
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| KitError::NoRuntime)?;
    if runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
        return Err(KitError::MultiThreadRuntime);
    }
    if !clock_is_paused() {
        tokio::time::pause();
    }
    Ok(())
}

/// Whether tokio's clock is paused: it then stands still while real time
/// passes (tokio has no call that says so, and pausing a paused clock
/// panics). Nothing can move a paused clock meanwhile: it moves only while
/// the runtime waits, or when `advance` is awaited, and this runs on the
/// runtime's one thread without awaiting.
fn clock_is_paused() -> bool {
    let before = tokio::time::Instant::now();
    let real = std::time::Instant::now();
    while real.elapsed() < Duration::from_micros(20) {
        std::hint::spin_loop();
    }
    tokio::time::Instant::now() == before
}
