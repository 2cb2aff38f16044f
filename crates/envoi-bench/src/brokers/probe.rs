//! The envoi side of the broker scenarios: the transport behind a
//! [`Probe`] that counts what the worker asks of it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::middleware::BoxFuture;
use envoi_core::transport::{
    Browse, Delivery, DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown,
    Transport, TransportBinding, WakeUp,
};
use envoi_core::TransportError;

use super::{metered, BATCH, CONCURRENCY};
use crate::e2e::{envoi_round_trip, job_messenger};

/// Counts what the worker asks of the transport (fetches, their sizes and
/// durations, acknowledgement batches), so a slow run shows whether it
/// lacks batching or spends its time elsewhere. Sends go straight through.
///
/// `T` is the transport itself, which is its own [`Receiver`] (as every
/// broker transport is), so the probe delegates to it directly.
struct Probe<T> {
    inner: Arc<T>,
    gets: AtomicU64,
    empty_gets: AtomicU64,
    fetched: AtomicU64,
    get_nanos: AtomicU64,
    ack_batches: AtomicU64,
    ack_nanos: AtomicU64,
}

type Fut<'a, T> = BoxFuture<'a, Result<T, TransportError>>;

impl<T> Probe<T> {
    fn new(inner: Arc<T>) -> Self {
        Self {
            inner,
            gets: AtomicU64::new(0),
            empty_gets: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            get_nanos: AtomicU64::new(0),
            ack_batches: AtomicU64::new(0),
            ack_nanos: AtomicU64::new(0),
        }
    }

    fn report(&self) {
        let gets = self.gets.load(Ordering::Relaxed);
        eprintln!(
            "  envoi: {gets} gets ({} empty, {:.0} messages each, {:.2}s), \
             {} ack batches ({:.2}s)",
            self.empty_gets.load(Ordering::Relaxed),
            self.fetched.load(Ordering::Relaxed) as f64 / gets.max(1) as f64,
            self.get_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            self.ack_batches.load(Ordering::Relaxed),
            self.ack_nanos.load(Ordering::Relaxed) as f64 / 1e9,
        );
    }
}

fn nanos_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Sends go straight to the wrapped transport; its receiving side is the
/// probe's own (counted), every other ability is the wrapped transport's.
impl<T: Transport + Receiver> Transport for Probe<T> {
    fn send(&self, message: RawMessage, delay: Option<Duration>) -> Fut<'_, String> {
        self.inner.send(message, delay)
    }

    fn as_receiver(&self) -> Option<&dyn Receiver> {
        Some(self)
    }

    fn as_keepalive(&self) -> Option<&dyn Keepalive> {
        self.inner.as_keepalive()
    }

    fn as_setup(&self) -> Option<&dyn Setup> {
        self.inner.as_setup()
    }

    fn as_message_count(&self) -> Option<&dyn MessageCount> {
        self.inner.as_message_count()
    }

    fn as_browse(&self) -> Option<&dyn Browse> {
        self.inner.as_browse()
    }

    fn as_teardown(&self) -> Option<&dyn Teardown> {
        self.inner.as_teardown()
    }

    fn as_wake_up(&self) -> Option<&dyn WakeUp> {
        self.inner.as_wake_up()
    }

    fn bind(&self, binding: &TransportBinding) {
        self.inner.bind(binding);
    }
}

impl<T: Transport + Receiver> Receiver for Probe<T> {
    fn get(&self, max: usize) -> Fut<'_, Vec<Delivery>> {
        Box::pin(async move {
            let start = Instant::now();
            let got = self.inner.get(max).await;
            self.get_nanos
                .fetch_add(nanos_since(start), Ordering::Relaxed);
            self.gets.fetch_add(1, Ordering::Relaxed);
            if let Ok(batch) = &got {
                if batch.is_empty() {
                    self.empty_gets.fetch_add(1, Ordering::Relaxed);
                }
                self.fetched
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
            }
            got
        })
    }

    fn ack<'a>(&'a self, id: &'a DeliveryId) -> Fut<'a, ()> {
        self.inner.ack(id)
    }

    fn ack_batch<'a>(&'a self, ids: &'a [DeliveryId]) -> Fut<'a, ()> {
        Box::pin(async move {
            let start = Instant::now();
            let acked = self.inner.ack_batch(ids).await;
            self.ack_nanos
                .fetch_add(nanos_since(start), Ordering::Relaxed);
            self.ack_batches.fetch_add(1, Ordering::Relaxed);
            acked
        })
    }

    fn reject<'a>(&'a self, id: &'a DeliveryId) -> Fut<'a, ()> {
        self.inner.reject(id)
    }

    fn release<'a>(&'a self, id: &'a DeliveryId) -> Fut<'a, ()> {
        self.inner.release(id)
    }
}

/// [`envoi_round_trip`] on `transport` (behind a [`Probe`]), metered.
pub(super) async fn envoi_side<T: Transport + Receiver>(
    transport: Arc<T>,
    n: u64,
) -> Result<f64, String> {
    let probe = Arc::new(Probe::new(transport));
    let (messenger, handled) = job_messenger("jobs", probe.clone())?;
    let rate = metered(
        "envoi",
        n,
        envoi_round_trip(&messenger, "jobs", &handled, n, CONCURRENCY, BATCH),
    )
    .await;
    probe.report();
    rate
}
