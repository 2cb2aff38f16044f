//! The shared conformance suite against the real JetStream server in
//! `ENVOI_NATS_URL`, with a 2 s lease.
//!
//! The suite opens transports by name and may drop every handle on a name
//! and open it again (a restart), so a stream cannot be deleted as soon as
//! its last handle goes. Instead each stream is deleted shortly after its
//! last handle is dropped unless the name is opened again in the meantime,
//! and streams left behind by earlier runs (say, a run that was killed) are
//! swept when the first transport is made.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use envoi_core::transport::{
    Browse, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown, Transport, WakeUp,
};
use envoi_core::{BoxFuture, TransportError};
use envoi_nats::NatsTransport;
use futures_util::StreamExt;

/// Streams made here are called `envoi-conformance-<name>`.
const PREFIX: &str = "envoi-conformance-";

fn url() -> Option<String> {
    envoi_core::testing::broker_url("ENVOI_NATS_URL", "conformance")
}

/// Per stream: how many handles are open, and how many were ever opened.
#[derive(Default)]
struct Usage {
    open: usize,
    opened: usize,
}

fn usage() -> std::sync::MutexGuard<'static, HashMap<String, Usage>> {
    static USAGE: OnceLock<Mutex<HashMap<String, Usage>>> = OnceLock::new();
    USAGE
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Runs `work` on a runtime of its own, on a thread of its own: usable from
/// `Drop` and from any test's runtime.
fn on_own_runtime<F: std::future::Future<Output = ()> + Send + 'static>(work: F) {
    std::thread::spawn(move || {
        if let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            runtime.block_on(work);
        }
    });
}

async fn delete_stream(server: &str, stream: &str) {
    if let Ok(client) = async_nats::connect(server).await {
        let _ = async_nats::jetstream::new(client)
            .delete_stream(stream)
            .await;
    }
}

/// Deletes conformance streams older than ten minutes (left by earlier runs).
async fn sweep(server: String) {
    let Ok(client) = async_nats::connect(server.as_str()).await else {
        return;
    };
    let js = async_nats::jetstream::new(client);
    let cutoff = std::time::SystemTime::now() - Duration::from_secs(600);
    let mut streams = js.streams();
    let mut stale = Vec::new();
    while let Some(Ok(info)) = streams.next().await {
        let created = std::time::UNIX_EPOCH
            + Duration::from_nanos(u64::try_from(info.created.unix_timestamp_nanos()).unwrap_or(0));
        if info.config.name.starts_with(PREFIX) && created < cutoff {
            stale.push(info.config.name.clone());
        }
    }
    for name in stale {
        let _ = js.delete_stream(&name).await;
    }
}

/// A [`NatsTransport`] that deletes its stream once the name is no longer
/// in use.
struct Cleaned(NatsTransport);

impl Drop for Cleaned {
    fn drop(&mut self) {
        let stream = self.0.stream().to_string();
        let server = self.0.config().server.clone();
        let opened_so_far = {
            let mut usage = usage();
            let entry = usage.entry(stream.clone()).or_default();
            entry.open = entry.open.saturating_sub(1);
            (entry.open == 0).then_some(entry.opened)
        };
        if let Some(opened_so_far) = opened_so_far {
            on_own_runtime(async move {
                // Reopened within this grace period (a restart): keep it.
                tokio::time::sleep(Duration::from_millis(500)).await;
                let unused = usage()
                    .get(&stream)
                    .is_none_or(|u| u.open == 0 && u.opened == opened_so_far);
                if unused {
                    delete_stream(&server, &stream).await;
                }
            });
        }
    }
}

impl Transport for Cleaned {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        self.0.send(message, delay)
    }
    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        self.0.send_batch(messages)
    }
    fn as_receiver(&self) -> Option<&dyn Receiver> {
        self.0.as_receiver()
    }
    fn as_keepalive(&self) -> Option<&dyn Keepalive> {
        self.0.as_keepalive()
    }
    fn as_setup(&self) -> Option<&dyn Setup> {
        self.0.as_setup()
    }
    fn as_message_count(&self) -> Option<&dyn MessageCount> {
        self.0.as_message_count()
    }
    fn as_browse(&self) -> Option<&dyn Browse> {
        self.0.as_browse()
    }
    fn as_teardown(&self) -> Option<&dyn Teardown> {
        self.0.as_teardown()
    }
    fn as_wake_up(&self) -> Option<&dyn WakeUp> {
        self.0.as_wake_up()
    }
}

async fn make(name: String) -> Option<Arc<dyn Transport>> {
    let url = url()?;
    static SWEPT: OnceLock<()> = OnceLock::new();
    let stream = format!("{PREFIX}{name}");
    // Counted before connecting, so a pending clean-up sees the reopening.
    {
        let mut usage = usage();
        let entry = usage.entry(stream.clone()).or_default();
        entry.open += 1;
        entry.opened += 1;
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    let dsn = format!("{url}{separator}lease=2s&stream={stream}");
    let transport = NatsTransport::connect(&name, &dsn)
        .await
        .unwrap_or_else(|e| panic!("connecting to {dsn}: {e}"));
    if SWEPT.set(()).is_ok() {
        on_own_runtime(sweep(transport.config().server.clone()));
    }
    Some(Arc::new(Cleaned(transport)))
}

// A file-backed stream keeps its messages when every handle goes
// (persistent); one consumer gets them in order; delays are honoured by
// deferring early deliveries; redeliveries are marked from JetStream's
// delivery count.
envoi_transport_tests::conformance!(
    make,
    envoi_transport_tests::Options {
        persistent: true,
        ordered: true,
        delay: true,
        marks_redeliveries: true,
        ..envoi_transport_tests::Options::default()
    },
    env = "ENVOI_NATS_URL"
);
