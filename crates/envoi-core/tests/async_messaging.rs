//! Sending through transports and receiving with a worker: routing, the
//! sender and receiver pipelines, DSNs, the sync transport and retries.

use envoi_core::testing::Within;

/// The longest a test waits for a worker to stop before it fails (real
/// time, whatever the tokio clock does).
const WAIT: std::time::Duration = std::time::Duration::from_secs(120);

use envoi_core::testing::Abilities;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoi_core::failure::MultiplierRetryStrategy;
use envoi_core::middleware::from_fn;
use envoi_core::stamp::{
    DelayStamp, ErrorDetailsStamp, ReceivedStamp, RedeliveryStamp, SentStamp,
    SentToFailureTransportStamp, TransportMessageIdStamp,
};
use envoi_core::transport::in_memory::InMemoryTransport;
use envoi_core::transport::{LocalFuture, LocalSender, Payload, RawMessage, Transport};
use envoi_core::worker::{StopReason, Worker, WorkerEvent};
use envoi_core::{
    BuildError, BusError, Command, DispatchError, Envelope, Message, Messenger, Query,
    TransportError, Unrecoverable,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Charge {
    order: u32,
}
impl Message for Charge {
    const NAME: &'static str = "Charge";
}

#[derive(Debug, thiserror::Error)]
#[error("payment gateway unavailable")]
struct GatewayDown;

impl Command for Charge {
    type Output = ();
    type Error = GatewayDown;
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Total(u32, u32);
impl Message for Total {
    const NAME: &'static str = "Total";
}
impl Query for Total {
    type Output = u32;
    type Error = Infallible;
}

fn memory() -> Arc<InMemoryTransport> {
    Arc::new(InMemoryTransport::new())
}

fn fast_retries(max_retries: u32) -> MultiplierRetryStrategy {
    MultiplierRetryStrategy {
        max_retries,
        delay: Duration::from_millis(5),
        jitter: 0.0,
        ..Default::default()
    }
}

async fn drain(messenger: &Messenger, transports: &[&str]) -> envoi_core::worker::WorkerReport {
    Worker::builder(messenger)
        .receivers(transports.iter().copied())
        .stop_when_empty()
        .idle_sleep(Duration::from_millis(5))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await
}

#[tokio::test]
async fn a_routed_command_is_sent_not_handled_then_the_worker_handles_it_once() {
    let handled = Arc::new(Mutex::new(Vec::new()));
    let seen = handled.clone();
    let queue = memory();
    let messenger = Messenger::builder()
        .command_handler(move |c: Charge| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(c.order);
                Ok::<_, GatewayDown>(())
            }
        })
        .transport("async", queue.clone())
        .route::<Charge>("async")
        .build()
        .unwrap();

    let sent = messenger
        .bus()
        .dispatch(Envelope::new(Charge { order: 1 }))
        .await
        .unwrap();
    assert_eq!(sent.last::<SentStamp>().unwrap().transport, "async");
    assert!(sent.has::<TransportMessageIdStamp>());
    assert!(handled.lock().unwrap().is_empty());
    assert_eq!(queue.counter().message_count().await.unwrap(), 1);

    let report = drain(&messenger, &["async"]).await;
    assert_eq!(report.reason, StopReason::Empty);
    assert_eq!(report.stats.handled, 1);
    assert_eq!(*handled.lock().unwrap(), [1]);
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);
    assert_eq!(queue.acknowledged(), 1);
}

#[tokio::test]
async fn user_middleware_runs_on_the_sender_side_and_on_the_receiver_side() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let record = log.clone();
    let counting = from_fn("counting", move |envelope, next| {
        let side = match envelope.last::<ReceivedStamp>() {
            Some(r) => format!("received from {}", r.transport),
            None => "dispatched".to_string(),
        };
        record.lock().unwrap().push(side);
        next.run(envelope)
    });
    let messenger = Messenger::builder()
        .command_handler(|_: Charge| async { Ok::<_, GatewayDown>(()) })
        .middleware(counting)
        .transport("async", memory())
        .route::<Charge>("async")
        .build()
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(Charge { order: 1 })
        .await
        .unwrap();
    assert_eq!(*log.lock().unwrap(), ["dispatched"]);
    drain(&messenger, &["async"]).await;
    assert_eq!(*log.lock().unwrap(), ["dispatched", "received from async"]);
}

#[tokio::test]
async fn a_message_routed_to_two_transports_is_stored_in_both() {
    let (a, b) = (memory(), memory());
    let messenger = Messenger::builder()
        .transport("a", a.clone())
        .transport("b", b.clone())
        .route::<Charge>("a")
        .route::<Charge>("b")
        .build()
        .unwrap();
    let out = messenger
        .bus()
        .dispatch(Envelope::new(Charge { order: 2 }))
        .await
        .unwrap();
    let sent: Vec<_> = out
        .all::<SentStamp>()
        .map(|s| s.transport.as_str())
        .collect();
    assert_eq!(sent, ["a", "b"]);
    assert_eq!(a.counter().message_count().await.unwrap(), 1);
    assert_eq!(b.counter().message_count().await.unwrap(), 1);
}

#[tokio::test]
async fn serialize_true_round_trips_every_message_through_the_serializer() {
    let handled = Arc::new(Mutex::new(Vec::new()));
    let seen = handled.clone();
    let messenger = Messenger::builder()
        .command_handler(move |c: Charge| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(c);
                Ok::<_, GatewayDown>(())
            }
        })
        .transport_dsn("async", "in-memory://?serialize=true")
        .route::<Charge>("async")
        .build_async()
        .await
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(Charge { order: 9 })
        .await
        .unwrap();
    let stored = messenger
        .transport("async")
        .unwrap()
        .browser()
        .list(10)
        .await
        .unwrap();
    assert_eq!(stored[0].raw.header("type"), Some("Charge"));
    assert_eq!(stored[0].raw.body, br#"{"order":9}"#);
    drain(&messenger, &["async"]).await;
    assert_eq!(*handled.lock().unwrap(), [Charge { order: 9 }]);
}

#[tokio::test]
async fn without_serialize_the_in_memory_transport_keeps_envelopes() {
    let queue = memory();
    let messenger = Messenger::builder()
        .transport("async", queue.clone())
        .route::<Charge>("async")
        .build()
        .unwrap();
    messenger
        .bus()
        .dispatch(Envelope::new(Charge { order: 3 }))
        .await
        .unwrap();
    let stored = queue.stored();
    assert!(
        matches!(&stored[0].payload, Payload::Envelope(e) if e.message::<Charge>() == Some(&Charge { order: 3 }))
    );
    // Raw reads still work, encoded by the messenger's serializer.
    let listed = queue.browser().list(10).await.unwrap();
    assert_eq!(listed[0].raw.header("type"), Some("Charge"));
}

#[tokio::test(start_paused = true)]
async fn sending_honours_the_last_delay_stamp() {
    let queue = memory();
    let messenger = Messenger::builder()
        .transport("async", queue.clone())
        .route::<Charge>("async")
        .build()
        .unwrap();
    messenger
        .bus()
        .dispatch(
            Envelope::new(Charge { order: 1 })
                .with(DelayStamp { ms: 60_000 })
                .with(DelayStamp { ms: 2_000 }),
        )
        .await
        .unwrap();
    assert!(queue.receiver().get(1).await.unwrap().is_empty());
    tokio::time::advance(Duration::from_millis(1_999)).await;
    assert!(queue.receiver().get(1).await.unwrap().is_empty());
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(queue.receiver().get(1).await.unwrap().len(), 1);
}

#[tokio::test]
async fn the_sync_transport_handles_at_once_and_returns_results_and_errors() {
    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let messenger = Messenger::builder()
        .query_handler(|q: Total| async move { Ok::<_, Infallible>(q.0 + q.1) })
        .command_handler(move |_: Charge| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>(GatewayDown) }
        })
        .transport_dsn("sync", "sync://")
        .transport_dsn("failed", "in-memory://")
        .failure_transport("failed")
        .route::<Total>("sync")
        .route::<Charge>("sync")
        .build_async()
        .await
        .unwrap();
    let answer = messenger.dispatcher().ask(Total(2, 40)).await.unwrap();
    assert_eq!(answer, 42);
    match messenger.dispatcher().dispatch(Charge { order: 1 }).await {
        Err(DispatchError::Domain(GatewayDown)) => {}
        other => panic!("expected the handler's error, got {other:?}"),
    }
    // Not retried, not parked.
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let failed = messenger.transport("failed").unwrap();
    assert_eq!(failed.counter().message_count().await.unwrap(), 0);
    assert!(matches!(
        Worker::builder(&messenger).receiver("sync").build(),
        Err(envoi_core::worker::WorkerError::NotConsumable(_))
    ));
}

#[tokio::test]
async fn a_transport_that_handles_on_send_cannot_be_a_failure_transport() {
    // Parking in it would handle the message again at once, as received
    // from its origin, fail again and park it again: without end.
    for (failure, sync_name) in [(None, "sync"), (Some("async"), "sync")] {
        let builder = Messenger::builder()
            .command_handler(|_: Charge| async { Err::<(), _>(GatewayDown) })
            .transport("async", memory())
            .transport_dsn(sync_name, "sync://")
            .route::<Charge>("async");
        let builder = match failure {
            None => builder.failure_transport(sync_name),
            Some(source) => builder.failure_transport_for(source, sync_name),
        };
        let err = builder.build_async().await.unwrap_err();
        assert_eq!(
            err,
            BuildError::FailureTransportHandlesOnSend("sync".into())
        );
        assert!(err.to_string().contains("`sync`"), "{err}");
    }
}

#[tokio::test]
async fn a_parked_message_whose_origin_became_a_sync_transport_is_parked_again_when_it_fails() {
    // `orders` was an asynchronous transport when the message was parked;
    // it has since been switched to `sync://` by configuration.
    let calls = Arc::new(AtomicU32::new(0));
    let failed = memory();
    let messenger = Messenger::builder()
        .command_handler(flaky_handler(u32::MAX, calls.clone()))
        .transport_dsn("orders", "sync://")
        .transport("failed", failed.clone())
        .route::<Charge>("orders")
        .default_retry_strategy(fast_retries(3))
        .failure_transport("failed")
        .build_async()
        .await
        .unwrap();
    let parked = Envelope::new(Charge { order: 1 })
        .with(SentToFailureTransportStamp::new("orders"))
        .with(RedeliveryStamp::new(0));
    let LocalFuture::Ready(Some(Ok(_))) = failed.send_envelope(parked) else {
        panic!("the in-memory transport stores a message at once");
    };
    let report = Worker::builder(&messenger)
        .receiver("failed")
        .stop_when_empty()
        .idle_sleep(Duration::from_millis(5))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    // Tried once (a retry cannot be sent to a transport that handles on
    // send), then back in the failure transport, not dropped.
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(report.stats.failed, 1);
    assert_eq!((failed.acknowledged(), failed.rejected()), (1, 0));
    let stored = failed.stored();
    assert_eq!(stored.len(), 1, "parked again");
    let Payload::Envelope(e) = &stored[0].payload else {
        panic!("expected an envelope")
    };
    assert_eq!(e.all::<SentToFailureTransportStamp>().count(), 2);
    assert_eq!(
        e.last::<SentToFailureTransportStamp>()
            .unwrap()
            .original_transport,
        "orders"
    );
    // A message sent to the sync transport still fails straight back.
    assert!(messenger
        .dispatcher()
        .dispatch(Charge { order: 2 })
        .await
        .is_err());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(failed.stored().len(), 1);
}

#[tokio::test]
async fn a_bad_dsn_fails_the_build_with_a_clear_error_and_the_password_masked() {
    let err = Messenger::builder()
        .transport_dsn("orders", "postgres://app:hunter2@db/app")
        .build_async()
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, BuildError::Transport { ref name, .. } if name == "orders"));
    assert!(text.contains("postgres://app:***@db/app"), "{text}");
    assert!(!text.contains("hunter2"), "{text}");

    let err = Messenger::builder()
        .transport_dsn("async", "in-memory://?serialize=sometimes")
        .build_async()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("serialize"), "{err}");
}

#[tokio::test]
async fn transports_given_by_dsn_need_an_async_build() {
    let err = Messenger::builder()
        .transport_dsn("async", "in-memory://")
        .build()
        .unwrap_err();
    assert_eq!(err, BuildError::NeedsAsyncBuild("async".into()));
}

#[tokio::test]
async fn routes_and_failure_transports_must_name_configured_transports() {
    let err = Messenger::builder()
        .route::<Charge>("nowhere")
        .build()
        .unwrap_err();
    assert!(matches!(err, BuildError::UnknownTransport { .. }));
    let err = Messenger::builder()
        .transport("async", memory())
        .failure_transport("failed")
        .build()
        .unwrap_err();
    assert_eq!(err, BuildError::UnknownFailureTransport("failed".into()));
    let err = Messenger::builder()
        .transport("async", memory())
        .transport("async", memory())
        .build()
        .unwrap_err();
    assert_eq!(err, BuildError::DuplicateTransport("async".into()));
}

#[tokio::test]
async fn with_a_sender_dispatcher_of_its_own_routes_and_failure_transports_are_not_checked() {
    let senders = envoi_core::testing::RecordingSenders::default();
    Messenger::builder()
        .transport("async", memory())
        .route::<Charge>("nowhere")
        .failure_transport("failed")
        .sender_dispatcher(Arc::new(senders))
        .build()
        .expect("the dispatcher decides where sends go");
}

#[tokio::test]
async fn the_messenger_exposes_its_transports_serializer_and_failure_transports() {
    let messenger = Messenger::builder()
        .transport("async", memory())
        .transport("failed", memory())
        .transport("audit", memory())
        .failure_transport("failed")
        .failure_transport_for("audit", "async")
        .route::<Charge>("async")
        .build()
        .unwrap();
    assert_eq!(messenger.transport_names(), ["async", "audit", "failed"]);
    assert!(messenger.transport("async").is_some());
    assert!(messenger.transport("nope").is_none());
    assert_eq!(messenger.failure_transport_for("async"), Some("failed"));
    assert_eq!(messenger.failure_transport_for("audit"), Some("async"));
    assert_eq!(messenger.failure_transports(), ["async", "failed"]);
    assert!(messenger.serializer().is_registered("Charge"));
    let setup: Vec<(String, bool)> = messenger
        .setup_transports()
        .await
        .into_iter()
        .map(|(name, result)| (name, result.is_ok()))
        .collect();
    assert_eq!(
        setup,
        [
            ("async".to_string(), true),
            ("audit".to_string(), true),
            ("failed".to_string(), true)
        ]
    );
    let debug = messenger.debug();
    assert!(debug.contains("transports"), "{debug}");
    assert!(
        debug.contains("failed (failure transport, in process)"),
        "{debug}"
    );
}

/// A transport whose sends can be switched off, to simulate an outage.
struct Flaky {
    inner: InMemoryTransport,
    down: std::sync::atomic::AtomicBool,
}

impl Flaky {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            inner: InMemoryTransport::new(),
            down: Default::default(),
        })
    }
}

impl Transport for Flaky {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> envoi_core::middleware::BoxFuture<'_, Result<String, TransportError>> {
        if self.down.load(Ordering::SeqCst) {
            return Box::pin(async { Err(TransportError::Closed) });
        }
        self.inner.send(message, delay)
    }
    fn as_receiver(&self) -> Option<&dyn envoi_core::transport::Receiver> {
        self.inner.as_receiver()
    }
    fn as_message_count(&self) -> Option<&dyn envoi_core::transport::MessageCount> {
        self.inner.as_message_count()
    }
}

#[tokio::test]
async fn a_failed_send_hands_the_envelope_back() {
    let flaky = Flaky::new();
    flaky.down.store(true, Ordering::SeqCst);
    let messenger = Messenger::builder()
        .transport("async", flaky)
        .route::<Charge>("async")
        .build()
        .unwrap();
    match messenger
        .bus()
        .dispatch(Envelope::new(Charge { order: 4 }))
        .await
    {
        Err(BusError::Transport {
            transport,
            envelope: Some(envelope),
            source: TransportError::Closed,
        }) => {
            assert_eq!(transport, "async");
            assert_eq!(envelope.message::<Charge>(), Some(&Charge { order: 4 }));
        }
        other => panic!("expected a transport error with the envelope, got {other:?}"),
    }
}

/// Runs a worker on `transports` for half a second.
async fn consume_for_half_a_second(
    messenger: &Messenger,
    transports: &[&str],
) -> envoi_core::worker::WorkerReport {
    Worker::builder(messenger)
        .receivers(transports.iter().copied())
        .time_limit(Duration::from_millis(500))
        .idle_sleep(Duration::from_millis(5))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await
}

/// A `Charge` handler failing its first `failures` calls.
fn flaky_handler(
    failures: u32,
    calls: Arc<AtomicU32>,
) -> impl Fn(Charge) -> std::future::Ready<Result<(), GatewayDown>> + Send + Sync + 'static {
    move |_: Charge| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready(if n < failures {
            Err(GatewayDown)
        } else {
            Ok(())
        })
    }
}

/// A messenger routing `Charge` to the in-memory transport `async`, its
/// handler failing its first `failures` calls (counted in `calls`), with
/// `retries` quick retries and the failure transport `failed`.
fn charge_messenger(
    failures: u32,
    calls: &Arc<AtomicU32>,
    retries: u32,
    async_queue: Arc<InMemoryTransport>,
    failed: Arc<InMemoryTransport>,
) -> Messenger {
    Messenger::builder()
        .command_handler(flaky_handler(failures, calls.clone()))
        .transport("async", async_queue)
        .transport("failed", failed)
        .route::<Charge>("async")
        .default_retry_strategy(fast_retries(retries))
        .failure_transport("failed")
        .build()
        .unwrap()
}

fn events(log: &Arc<Mutex<Vec<String>>>) -> impl Fn(&WorkerEvent) + Send + Sync + 'static {
    let log = log.clone();
    move |e: &WorkerEvent| {
        let name = match e {
            WorkerEvent::Handled { .. } => "handled",
            WorkerEvent::Retried { .. } => "retried",
            WorkerEvent::Failed { .. } => "failed",
            _ => return,
        };
        log.lock().unwrap().push(name.to_string());
    }
}

#[tokio::test]
async fn a_transient_failure_succeeds_on_retry() {
    let calls = Arc::new(AtomicU32::new(0));
    let async_queue = memory();
    let failed = memory();
    let messenger = charge_messenger(2, &calls, 3, async_queue.clone(), failed.clone());
    messenger
        .dispatcher()
        .dispatch(Charge { order: 1 })
        .await
        .unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let report = Worker::builder(&messenger)
        .receiver("async")
        .stop_when_empty()
        .idle_sleep(Duration::from_millis(5))
        .listener(events(&log))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(*log.lock().unwrap(), ["retried", "retried", "handled"]);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!((report.stats.retried, report.stats.handled), (2, 1));
    assert_eq!(async_queue.counter().message_count().await.unwrap(), 0);
    assert_eq!(failed.counter().message_count().await.unwrap(), 0);
}

#[tokio::test]
async fn a_permanent_failure_lands_in_the_failure_transport_and_the_original_is_acknowledged() {
    let calls = Arc::new(AtomicU32::new(0));
    let async_queue = memory();
    let failed = memory();
    let messenger = charge_messenger(u32::MAX, &calls, 2, async_queue.clone(), failed.clone());
    messenger
        .dispatcher()
        .dispatch(Charge { order: 7 })
        .await
        .unwrap();
    let report = drain(&messenger, &["async"]).await;
    assert_eq!(calls.load(Ordering::SeqCst), 3, "first try and two retries");
    assert_eq!((report.stats.retried, report.stats.failed), (2, 1));
    assert_eq!(async_queue.counter().message_count().await.unwrap(), 0);
    assert_eq!(async_queue.acknowledged(), 3);
    let parked = failed.stored();
    assert_eq!(parked.len(), 1);
    let Payload::Envelope(e) = &parked[0].payload else {
        panic!("expected an envelope")
    };
    assert_eq!(e.message::<Charge>(), Some(&Charge { order: 7 }));
    assert!(e
        .last::<ErrorDetailsStamp>()
        .unwrap()
        .message
        .contains("payment gateway unavailable"));
    assert_eq!(
        e.last::<SentToFailureTransportStamp>()
            .unwrap()
            .original_transport,
        "async"
    );
}

/// A refund whose handler always fails for good (an `Unrecoverable` error).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Refund(u32);
impl Message for Refund {
    const NAME: &'static str = "Refund";
}
impl Command for Refund {
    type Output = ();
    type Error = Unrecoverable;
}

/// A messenger routing [`Refund`] to `async`, parking in `failed`, and the
/// refunds its handler was called with, in order.
fn refund_messenger(failed: Arc<InMemoryTransport>) -> (Messenger, Arc<Mutex<Vec<u32>>>) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let counted = calls.clone();
    let messenger = Messenger::builder()
        .command_handler(move |r: Refund| {
            counted.lock().unwrap().push(r.0);
            // `Unrecoverable`: the retry step skips the retries.
            async { Err::<(), _>(Unrecoverable::new("card stolen")) }
        })
        .transport("async", memory())
        .transport("failed", failed)
        .route::<Refund>("async")
        .default_retry_strategy(fast_retries(3))
        .failure_transport("failed")
        .build()
        .unwrap();
    (messenger, calls)
}

#[tokio::test]
async fn an_unrecoverable_error_skips_the_retries() {
    let failed = memory();
    let (messenger, calls) = refund_messenger(failed.clone());
    messenger.dispatcher().dispatch(Refund(1)).await.unwrap();
    let report = drain(&messenger, &["async"]).await;
    assert_eq!(*calls.lock().unwrap(), [1]);
    assert_eq!((report.stats.retried, report.stats.failed), (0, 1));
    assert_eq!(failed.counter().message_count().await.unwrap(), 1);
}

#[tokio::test]
async fn a_message_retried_from_the_failure_transport_gets_a_fresh_budget_and_returns_there() {
    let calls = Arc::new(AtomicU32::new(0));
    let failed = memory();
    let messenger = charge_messenger(u32::MAX, &calls, 2, memory(), failed.clone());
    messenger
        .dispatcher()
        .dispatch(Charge { order: 5 })
        .await
        .unwrap();
    drain(&messenger, &["async"]).await;
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(failed.counter().message_count().await.unwrap(), 1);

    // Retry it from the failure transport (one message, as `failed retry`
    // does): one try there, then the origin's full budget of two retries,
    // then back to the failure transport.
    let report = Worker::builder(&messenger)
        .receiver("failed")
        .message_limit(1)
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.stats.retried, 1);
    assert_eq!(failed.counter().message_count().await.unwrap(), 0);
    drain(&messenger, &["async"]).await;
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    let parked = failed.stored();
    assert_eq!(parked.len(), 1);
    let Payload::Envelope(e) = &parked[0].payload else {
        panic!("expected an envelope")
    };
    assert_eq!(e.all::<SentToFailureTransportStamp>().count(), 2);
    assert_eq!(e.last::<RedeliveryStamp>().unwrap().retry_count, 0);
    // Parked a second time, from its origin: due in a second, so a worker
    // consuming both transports does not cycle it between them at once.
    assert_eq!(
        e.last::<DelayStamp>().unwrap().duration(),
        Duration::from_secs(1)
    );
    assert!(
        failed.receiver().get(1).await.unwrap().is_empty(),
        "not due yet"
    );
    assert_eq!(
        failed.counter().message_count().await.unwrap(),
        1,
        "nothing lost"
    );
}

#[tokio::test]
async fn a_message_failing_for_good_on_every_round_trip_is_not_cycled_at_once() {
    let calls = Arc::new(AtomicU32::new(0));
    let messenger = charge_messenger(u32::MAX, &calls, 1, memory(), memory());
    messenger
        .dispatcher()
        .dispatch(Charge { order: 9 })
        .await
        .unwrap();
    // One worker on both: parked at once after two calls; taken from the
    // failure transport, called, and sent back to its origin with a fresh
    // budget; called there, out of budget again, and parked for a second.
    // Without that delay it would go round and round for the whole half
    // second.
    let report = consume_for_half_a_second(&messenger, &["failed", "async"]).await;
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_eq!((report.stats.failed, report.stats.retried), (2, 2));
}

#[tokio::test]
async fn a_message_failing_for_good_again_from_the_failure_transport_goes_back_there_for_later() {
    let failed = memory();
    let (messenger, calls) = refund_messenger(failed.clone());
    messenger.dispatcher().dispatch(Refund(1)).await.unwrap();
    drain(&messenger, &["async"]).await;
    assert_eq!(calls.lock().unwrap().len(), 1);
    let delay_of_parked = || {
        let stored = failed.stored();
        assert_eq!(stored.len(), 1);
        let Payload::Envelope(e) = &stored[0].payload else {
            panic!("expected an envelope")
        };
        (
            e.all::<SentToFailureTransportStamp>().count(),
            e.last::<DelayStamp>().unwrap().duration(),
        )
    };
    // Parked from its own transport: available at once.
    assert_eq!(delay_of_parked(), (1, Duration::ZERO));

    // A worker on the failure transport for half a second tries it once:
    // it goes back there, due in a second, instead of being handed out
    // again and again.
    let report = consume_for_half_a_second(&messenger, &["failed"]).await;
    assert_eq!(calls.lock().unwrap().len(), 2);
    assert_eq!(report.stats.failed, 1);
    assert_eq!(delay_of_parked(), (2, Duration::from_secs(1)));
    assert!(
        failed.receiver().get(1).await.unwrap().is_empty(),
        "not due yet"
    );
    assert_eq!(
        failed.counter().message_count().await.unwrap(),
        1,
        "nothing lost"
    );
}

#[tokio::test]
async fn stop_when_empty_on_the_failure_transport_tries_each_message_once_then_stops() {
    let failed = memory();
    let (messenger, calls) = refund_messenger(failed.clone());
    for n in 0..3 {
        messenger.dispatcher().dispatch(Refund(n)).await.unwrap();
    }
    drain(&messenger, &["async"]).await;
    assert_eq!(failed.counter().message_count().await.unwrap(), 3);
    calls.lock().unwrap().clear();

    let report = tokio::time::timeout(Duration::from_secs(5), drain(&messenger, &["failed"]))
        .await
        .expect("the worker stops");
    assert_eq!(report.reason, StopReason::Empty);
    let mut tried = calls.lock().unwrap().clone();
    tried.sort_unstable();
    assert_eq!(tried, [0, 1, 2], "each tried once");
    assert_eq!(report.stats.failed, 3);
    assert_eq!(
        failed.counter().message_count().await.unwrap(),
        3,
        "all kept for later"
    );
}

#[tokio::test]
async fn a_retry_that_cannot_be_sent_releases_the_message_for_redelivery() {
    let flaky = Flaky::new();
    let messenger = Messenger::builder()
        .command_handler(|_: Charge| async { Err::<(), _>(GatewayDown) })
        .transport("async", flaky.clone())
        .route::<Charge>("async")
        .default_retry_strategy(fast_retries(3))
        .build()
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(Charge { order: 1 })
        .await
        .unwrap();
    flaky.down.store(true, Ordering::SeqCst);
    let log = Arc::new(Mutex::new(Vec::new()));
    let record = log.clone();
    let report = Worker::builder(&messenger)
        .receiver("async")
        .message_limit(1)
        .listener(move |e: &WorkerEvent| {
            if let WorkerEvent::Failed { released, kind, .. } = e {
                record.lock().unwrap().push((kind.to_string(), *released));
            }
        })
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::MessageLimit);
    assert_eq!(*log.lock().unwrap(), [("transport".to_string(), true)]);
    assert_eq!(
        flaky.counter().message_count().await.unwrap(),
        1,
        "still there"
    );
    assert_eq!(
        flaky.receiver().get(1).await.unwrap().len(),
        1,
        "and available again"
    );
}

#[tokio::test]
async fn only_handler_failures_are_retried_a_missing_handler_is_parked_at_once() {
    let failed = memory();
    let messenger = Messenger::builder()
        .transport("async", memory())
        .transport("failed", failed.clone())
        .route::<Charge>("async")
        .default_retry_strategy(fast_retries(3))
        .failure_transport("failed")
        .build()
        .unwrap();
    messenger
        .bus()
        .dispatch(Envelope::new(Charge { order: 1 }))
        .await
        .unwrap();
    let report = drain(&messenger, &["async"]).await;
    assert_eq!((report.stats.retried, report.stats.failed), (0, 1));
    let parked = failed.stored();
    let Payload::Envelope(e) = &parked[0].payload else {
        panic!("expected an envelope")
    };
    assert_eq!(e.last::<ErrorDetailsStamp>().unwrap().kind, "no_handler");
}

#[tokio::test]
async fn the_worker_dispatches_on_the_bus_the_message_was_sent_from() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let record = log.clone();
    let messenger = Messenger::builder()
        .command_handler(|_: Charge| async { Ok::<_, GatewayDown>(()) })
        .bus("payments", |bus| {
            bus.middleware(from_fn("payments-only", move |e, next| {
                record.lock().unwrap().push(e.has::<ReceivedStamp>());
                next.run(e)
            }))
        })
        .transport("async", memory())
        .route::<Charge>("async")
        .build()
        .unwrap();
    messenger
        .bus_named("payments")
        .unwrap()
        .dispatch(Envelope::new(Charge { order: 1 }))
        .await
        .unwrap();
    drain(&messenger, &["async"]).await;
    assert_eq!(*log.lock().unwrap(), [false, true]);
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Upload;
impl Message for Upload {
    const NAME: &'static str = "Upload";
}

/// An error that prints a whole (large) response body.
#[derive(Debug, thiserror::Error)]
#[error("storage refused the upload: {0}")]
struct Refused(String);

impl Command for Upload {
    type Output = ();
    type Error = Refused;
}

#[tokio::test]
async fn a_handler_error_larger_than_the_header_limit_still_lets_the_message_be_parked() {
    let messenger = Messenger::builder()
        .command_handler(|_: Upload| async { Err::<(), _>(Refused("x".repeat(2 << 20))) })
        .transport("async", memory())
        .transport_dsn("failed", "in-memory://?serialize=true")
        .route::<Upload>("async")
        .default_retry_strategy(fast_retries(0))
        .failure_transport("failed")
        .build_async()
        .await
        .unwrap();
    messenger.dispatcher().dispatch(Upload).await.unwrap();
    let report = drain(&messenger, &["async"]).await;
    assert_eq!(report.stats.failed, 1);
    let async_queue = messenger.transport("async").unwrap();
    assert_eq!(
        async_queue.counter().message_count().await.unwrap(),
        0,
        "parked, not kept"
    );
    let parked = messenger
        .transport("failed")
        .unwrap()
        .browser()
        .list(10)
        .await
        .unwrap();
    assert_eq!(parked.len(), 1);
    let details = parked[0]
        .raw
        .header("X-Message-Stamp-ErrorDetails")
        .expect("the error details travel with it");
    assert!(details.len() < 8 * 1024, "{} bytes", details.len());
    assert!(details.contains("storage refused the upload: xxx"));
    assert!(details.contains("more bytes]"));
}
