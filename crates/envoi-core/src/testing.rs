//! Helpers for testing middlewares and transports without a broker.
//!
//! Symfony Messenger's advice: test a middleware in isolation with a fake `next` that
//! records whether and with which envelope it was called, using real
//! envelopes and stamps.
//!
//! ```
//! use envoi_core::testing::RecordingEndpoint;
//! use envoi_core::middleware::Middleware;
//! use envoi_core::pipeline::add_bus_name::AddBusNameStamp;
//! use envoi_core::{Envelope, Message, stamp::BusNameStamp};
//!
//! #[derive(Debug)]
//! struct Ping;
//! impl Message for Ping { const NAME: &'static str = "Ping"; }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let next = RecordingEndpoint::new();
//! AddBusNameStamp::new("bus").handle(Envelope::new(Ping), next.next()).await.unwrap();
//! assert_eq!(next.calls().len(), 1);
//! assert!(next.calls()[0].has::<BusNameStamp>());
//! # });
//! ```

use std::fmt;
use std::sync::{Arc, Mutex};

use crate::envelope::stamp::TransportMessageIdStamp;
use crate::envelope::Envelope;
use crate::error::{BoxError, BusError, HandlerError, Result, TransportError};
use crate::middleware::{Endpoint, Next};
use crate::transport::{Browse, Keepalive, MessageCount, Receiver, SenderDispatcher, Transport};
use crate::BoxFuture;

/// An endpoint that records every envelope it receives and returns it.
#[derive(Debug, Default, Clone)]
pub struct RecordingEndpoint {
    calls: Arc<Mutex<Vec<Envelope>>>,
}

impl RecordingEndpoint {
    /// A new, empty recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// A [`Next`] that ends in this recorder.
    pub fn next(&self) -> Next<'_> {
        Next::to_endpoint(self)
    }

    /// The envelopes received so far.
    pub fn calls(&self) -> Vec<Envelope> {
        self.calls.lock().expect("poisoned").clone()
    }

    /// The one envelope received; panics unless exactly one was.
    pub fn single(&self) -> Envelope {
        let calls = self.calls();
        assert_eq!(calls.len(), 1, "expected exactly one call of next");
        calls.into_iter().next().expect("one call")
    }
}

impl Endpoint for RecordingEndpoint {
    fn call(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope>> {
        self.calls.lock().expect("poisoned").push(envelope.clone());
        Box::pin(async move { Ok(envelope) })
    }
}

/// An endpoint that fails like a handler would, with a fresh error each call.
pub struct FailingEndpoint {
    make: Box<dyn Fn() -> BoxError + Send + Sync>,
}

impl FailingEndpoint {
    /// Fails with the errors `make` returns.
    pub fn new(make: impl Fn() -> BoxError + Send + Sync + 'static) -> Self {
        Self {
            make: Box::new(make),
        }
    }

    /// Fails with the message "boom".
    pub fn plain() -> Self {
        Self::new(|| "boom".into())
    }

    /// A [`Next`] that ends in this endpoint.
    pub fn next(&self) -> Next<'_> {
        Next::to_endpoint(self)
    }
}

impl fmt::Debug for FailingEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FailingEndpoint")
    }
}

impl Endpoint for FailingEndpoint {
    fn call(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope>> {
        let error = (self.make)();
        Box::pin(async move {
            Err(BusError::HandlerFailed {
                envelope: Box::new(envelope),
                errors: vec![HandlerError {
                    handler: "failing",
                    error,
                }],
            })
        })
    }
}

type EndpointFn = dyn Fn(Envelope) -> BoxFuture<'static, Result<Envelope>> + Send + Sync;

/// An endpoint made from a closure.
pub struct FnEndpoint {
    f: Box<EndpointFn>,
}

impl FnEndpoint {
    /// Wraps `f`.
    pub fn new(
        f: impl Fn(Envelope) -> BoxFuture<'static, Result<Envelope>> + Send + Sync + 'static,
    ) -> Self {
        Self { f: Box::new(f) }
    }
}

impl fmt::Debug for FnEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnEndpoint")
    }
}

impl Endpoint for FnEndpoint {
    fn call(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope>> {
        (self.f)(envelope)
    }
}

/// A [`SenderDispatcher`] that records what it was asked to send and
/// succeeds, stamping a [`TransportMessageIdStamp`]. Transports named in
/// [`failing`](Self::failing) fail instead, handing the envelope back.
#[derive(Debug, Default, Clone)]
pub struct RecordingSenders {
    sent: Arc<Mutex<Vec<(String, Envelope)>>>,
    failing: Arc<Mutex<Vec<String>>>,
}

impl RecordingSenders {
    /// Makes sends to `transport` fail.
    pub fn failing(&self, transport: &str) {
        self.failing
            .lock()
            .expect("poisoned")
            .push(transport.into());
    }

    /// The transports sent to, in order.
    pub fn sent_to(&self) -> Vec<String> {
        self.sent
            .lock()
            .expect("poisoned")
            .iter()
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// The envelopes sent, in order.
    pub fn envelopes(&self) -> Vec<Envelope> {
        self.sent
            .lock()
            .expect("poisoned")
            .iter()
            .map(|(_, e)| e.clone())
            .collect()
    }
}

impl SenderDispatcher for RecordingSenders {
    fn send<'a>(
        &'a self,
        transport: &'a str,
        envelope: Envelope,
    ) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(async move {
            if self
                .failing
                .lock()
                .expect("poisoned")
                .iter()
                .any(|t| t == transport)
            {
                return Err(BusError::Transport {
                    transport: transport.into(),
                    envelope: Some(Box::new(envelope)),
                    source: TransportError::Closed,
                });
            }
            let mut sent = self.sent.lock().expect("poisoned");
            let id = sent.len().to_string();
            sent.push((transport.to_string(), envelope.clone()));
            Ok(envelope.with(TransportMessageIdStamp::new(id)))
        })
    }

    fn transports(&self) -> Vec<String> {
        Vec::new()
    }
}

/// A transport's abilities in one call, for tests: each panics, naming the
/// ability, when the transport lacks it.
///
/// ```
/// use envoi_core::testing::Abilities;
/// use envoi_core::transport::in_memory::InMemoryTransport;
/// use envoi_core::transport::{RawMessage, Transport};
/// use std::sync::Arc;
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let queue: Arc<dyn Transport> = Arc::new(InMemoryTransport::new());
/// queue.send(RawMessage::default(), None).await.unwrap();
/// assert_eq!(queue.counter().message_count().await.unwrap(), 1);
/// let got = queue.receiver().get(1).await.unwrap();
/// queue.receiver().ack(&got[0].id).await.unwrap();
/// # });
/// ```
pub trait Abilities {
    /// The receiving side.
    fn receiver(&self) -> &dyn Receiver;
    /// Counting the messages waiting.
    fn counter(&self) -> &dyn MessageCount;
    /// Listing and finding messages.
    fn browser(&self) -> &dyn Browse;
    /// Extending leases.
    fn keeper(&self) -> &dyn Keepalive;
}

impl<T: Transport + ?Sized> Abilities for T {
    fn receiver(&self) -> &dyn Receiver {
        self.as_receiver()
            .expect("the transport has no receiving side")
    }

    fn counter(&self) -> &dyn MessageCount {
        self.as_message_count()
            .expect("the transport cannot count its messages")
    }

    fn browser(&self) -> &dyn Browse {
        self.as_browse()
            .expect("the transport cannot list messages")
    }

    fn keeper(&self) -> &dyn Keepalive {
        self.as_keepalive()
            .expect("the transport cannot extend leases")
    }
}

/// Set to `1` to make every broker test fail, rather than skip, when its
/// URL variable is missing (`.ci/run` sets it).
pub const REQUIRE_BROKERS: &str = "ENVOI_REQUIRE_BROKERS";

/// The broker URL in the environment variable `variable` (empty counts as
/// unset). Without it, prints that `test` is skipped and why and returns
/// `None` — or, when [`REQUIRE_BROKERS`] is set, fails the test, so that a
/// run meant to talk to every broker cannot pass by skipping.
///
/// ```
/// use envoi_core::testing::broker_url;
///
/// std::env::set_var("ENVOI_DOC_EXAMPLE_URL", "redis://127.0.0.1:6379");
/// let Some(url) = broker_url("ENVOI_DOC_EXAMPLE_URL", "this example") else {
///     return; // skipped: it said why
/// };
/// assert_eq!(url, "redis://127.0.0.1:6379");
/// ```
pub fn broker_url(variable: &str, test: &str) -> Option<String> {
    match std::env::var(variable) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ if std::env::var_os(REQUIRE_BROKERS).is_some_and(|v| v == "1") => panic!(
            "{test}: {variable} is not set, and {REQUIRE_BROKERS}=1 asks every broker test to run"
        ),
        _ => {
            eprintln!("skipped {test}: {variable} is not set");
            None
        }
    }
}

/// Awaits `future` for at most `limit` of real time, whatever the tokio
/// clock does (paused or not); past it, prints that the test timed out
/// waiting for `what` and ends the process with a failure, so a test that
/// would hang fails and says what it was waiting for.
///
/// The limit is real time on purpose: under a paused clock a hung worker
/// either spins virtual time forever or parks the runtime for good, and a
/// tokio timeout catches neither reliably.
///
/// ```
/// use envoi_core::testing::within;
/// use std::time::Duration;
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let answer = within(Duration::from_secs(60), "the answer", async { 42 }).await;
/// assert_eq!(answer, 42);
/// # });
/// ```
pub async fn within<F: std::future::Future>(
    limit: std::time::Duration,
    what: &str,
    future: F,
) -> F::Output {
    let _watchdog = Watchdog::start(limit, what);
    future.await
}

/// [`within`] as a method: `worker.run().within(limit, "the worker to drain").await`.
pub trait Within: std::future::Future + Sized {
    /// See [`within`].
    fn within(
        self,
        limit: std::time::Duration,
        what: &str,
    ) -> impl std::future::Future<Output = Self::Output> {
        within(limit, what, self)
    }
}

impl<F: std::future::Future> Within for F {}

/// A thread that ends the process unless dropped within its limit.
#[derive(Debug)]
struct Watchdog {
    /// Dropped with the watchdog, which lets its thread go.
    _cancel: std::sync::mpsc::Sender<()>,
}

impl Watchdog {
    fn start(limit: std::time::Duration, what: &str) -> Watchdog {
        let (cancel, cancelled) = std::sync::mpsc::channel::<()>();
        let what = what.to_string();
        let test = std::thread::current()
            .name()
            .unwrap_or("a test")
            .to_string();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = cancelled.recv_timeout(limit) {
                eprintln!("{test}: timed out after {limit:?} waiting for {what}");
                std::process::exit(101);
            }
        });
        Watchdog { _cancel: cancel }
    }
}

#[cfg(test)]
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Ping;

#[cfg(test)]
impl crate::envelope::message::Message for Ping {
    const NAME: &'static str = "Ping";
}

#[cfg(feature = "testing")]
pub mod kit;
#[cfg(feature = "testing")]
pub use kit::{Activity, Handled, KitError, Parked, Record, Retried, TestKit};
