//! The ServiceConnect-style stage pipeline on a real bus — the specification's example word for
//! word, `Stop` semantics per stage, and which stages run on the sender and
//! on the receiver side of a transport.

use envoi_core::testing::Within;

/// The longest a test waits for a worker to stop before it fails (real
/// time, whatever the tokio clock does).
const WAIT: std::time::Duration = std::time::Duration::from_secs(120);

use envoi_core::testing::Abilities;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoi_core::middleware::stage::{
    as_filter, as_middleware, FilterAction, PipelineStage, StagePipeline,
};
use envoi_core::stamp::{HandledStamp, ReceivedStamp};
use envoi_core::testing::RecordingSenders;
use envoi_core::{BusError, Command, DispatchError, Envelope, Message, Messenger};

type Log = Arc<Mutex<Vec<String>>>;

fn entries(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Invoice {
    amount: u32,
}
impl Message for Invoice {
    const NAME: &'static str = "Invoice";
}
#[derive(Debug, thiserror::Error)]
#[error("rejected")]
struct Rejected;
impl Command for Invoice {
    type Output = ();
    type Error = Rejected;
}

/// The `metrics` object of the specification's example: collects observations.
#[derive(Clone, Default)]
struct Metrics(Arc<Mutex<Vec<Duration>>>);

impl Metrics {
    fn observe(&self, elapsed: Duration) {
        self.0.lock().unwrap().push(elapsed);
    }
    fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

fn invoice_handler(log: &Log) -> impl Fn(Invoice) -> std::future::Ready<Result<(), Rejected>> {
    let log = log.clone();
    move |invoice: Invoice| {
        log.lock().unwrap().push("handler".into());
        std::future::ready(if invoice.amount == 0 {
            Err(Rejected)
        } else {
            Ok(())
        })
    }
}

/// The specification's example: middleware first, filter second in the call.
fn seed_example(metrics: &Metrics, log: &Log) -> StagePipeline {
    let metrics = metrics.clone();
    let (log_m, log_f) = (log.clone(), log.clone());
    StagePipeline::new().use_(
        PipelineStage::BeforeConsuming,
        [
            as_middleware(move |envelope, next| {
                let metrics = metrics.clone();
                let log = log_m.clone();
                async move {
                    log.lock().unwrap().push("timing middleware".into());
                    let start = Instant::now();
                    // try { await next() } finally { metrics.observe(...) }
                    let out = next.run(envelope).await;
                    metrics.observe(start.elapsed());
                    out
                }
            }),
            as_filter(move |envelope| {
                log_f.lock().unwrap().push("tenant filter".into());
                if envelope.header("tenant").is_some() {
                    FilterAction::Continue
                } else {
                    FilterAction::Stop
                }
            }),
        ],
    )
}

#[tokio::test]
async fn seed_example_the_filter_runs_first_although_given_second_and_the_message_is_timed() {
    let (metrics, log) = (Metrics::default(), Log::default());
    let m = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .middleware(seed_example(&metrics, &log))
        .build()
        .unwrap();
    let out = m
        .bus()
        .dispatch(Envelope::new(Invoice { amount: 5 }).with_header("tenant", "acme"))
        .await
        .unwrap();
    assert!(out.has::<HandledStamp>());
    assert_eq!(
        entries(&log),
        ["tenant filter", "timing middleware", "handler"]
    );
    assert_eq!(metrics.count(), 1);
}

#[tokio::test]
async fn seed_example_without_a_tenant_the_filter_stops_and_the_timing_middleware_is_skipped_entirely(
) {
    let (metrics, log) = (Metrics::default(), Log::default());
    let m = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .middleware(seed_example(&metrics, &log))
        .build()
        .unwrap();
    let out = m
        .bus()
        .dispatch(Envelope::new(Invoice { amount: 5 }))
        .await
        .expect("a before_consuming stop is not an error");
    assert!(!out.has::<HandledStamp>(), "the handler must not run");
    assert_eq!(entries(&log), ["tenant filter"]);
    assert_eq!(metrics.count(), 0);
}

fn mark(log: &Log, name: &'static str) -> envoi_core::middleware::stage::StageItem {
    let log = log.clone();
    as_middleware(move |envelope, next| {
        log.lock().unwrap().push(name.to_string());
        next.run(envelope)
    })
}

fn four_stages(log: &Log) -> StagePipeline {
    StagePipeline::new()
        .use_(PipelineStage::Outgoing, [mark(log, "outgoing")])
        .use_(
            PipelineStage::BeforeConsuming,
            [mark(log, "before_consuming")],
        )
        .use_(
            PipelineStage::AfterConsuming,
            [mark(log, "after_consuming")],
        )
        .use_(
            PipelineStage::OnConsumedSuccessfully,
            [mark(log, "on_consumed_successfully")],
        )
}

#[tokio::test]
async fn in_process_dispatch_runs_all_four_stages_around_the_handler() {
    let log = Log::default();
    let m = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .middleware(four_stages(&log))
        .build()
        .unwrap();
    m.dispatcher()
        .dispatch(Invoice { amount: 1 })
        .await
        .unwrap();
    assert_eq!(
        entries(&log),
        [
            "outgoing",
            "before_consuming",
            "handler",
            "after_consuming",
            "on_consumed_successfully"
        ]
    );
}

#[tokio::test]
async fn after_consuming_runs_when_the_handler_fails_but_on_consumed_successfully_does_not() {
    let log = Log::default();
    let m = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .middleware(four_stages(&log))
        .build()
        .unwrap();
    let err = m
        .dispatcher()
        .dispatch(Invoice { amount: 0 })
        .await
        .unwrap_err();
    assert!(matches!(err, DispatchError::Domain(Rejected)));
    assert_eq!(
        entries(&log),
        ["outgoing", "before_consuming", "handler", "after_consuming"]
    );
}

#[tokio::test]
async fn an_outgoing_stop_fails_at_the_call_site_with_outgoing_filters_blocked() {
    let log = Log::default();
    let senders = RecordingSenders::default();
    let m = Messenger::builder()
        .route::<Invoice>("async")
        .sender_dispatcher(Arc::new(senders.clone()))
        .middleware(four_stages(&log).use_(
            PipelineStage::Outgoing,
            [as_filter(|e| {
                if e.message::<Invoice>().is_some_and(|i| i.amount > 1000) {
                    FilterAction::Stop
                } else {
                    FilterAction::Continue
                }
            })],
        ))
        .build()
        .unwrap();
    let err = m
        .dispatcher()
        .dispatch(Invoice { amount: 5000 })
        .await
        .unwrap_err();
    match err {
        DispatchError::Infrastructure(BusError::OutgoingFiltersBlocked { message }) => {
            assert_eq!(message, "Invoice")
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(senders.sent_to().is_empty(), "nothing may be sent");
    assert!(
        entries(&log).is_empty(),
        "outgoing middleware is skipped too"
    );
}

#[tokio::test]
async fn with_a_transport_outgoing_runs_on_the_sender_and_the_consuming_stages_on_the_receiver() {
    let log = Log::default();
    let senders = RecordingSenders::default();
    let stamp_origin =
        as_middleware(|envelope, next| next.run(envelope.with_header("origin", "billing")));
    let m = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .route::<Invoice>("async")
        .sender_dispatcher(Arc::new(senders.clone()))
        .middleware(four_stages(&log).use_(PipelineStage::Outgoing, [stamp_origin]))
        .build()
        .unwrap();

    // Sender side.
    m.bus()
        .dispatch(Envelope::new(Invoice { amount: 3 }))
        .await
        .unwrap();
    assert_eq!(entries(&log), ["outgoing"]);
    assert_eq!(senders.sent_to(), ["async"]);
    let sent = senders.envelopes().remove(0);
    assert_eq!(sent.header("origin"), Some("billing"));

    // Receiver side, as a worker dispatches what it consumed.
    log.lock().unwrap().clear();
    let received = sent.with(ReceivedStamp::new("async"));
    let out = m.bus().dispatch(received).await.unwrap();
    assert!(out.has::<HandledStamp>());
    assert_eq!(
        entries(&log),
        [
            "before_consuming",
            "handler",
            "after_consuming",
            "on_consumed_successfully"
        ]
    );
    assert_eq!(senders.sent_to(), ["async"], "not sent again");
}

#[tokio::test]
async fn a_before_consuming_stop_on_the_receiver_ends_processing_without_error_so_the_message_is_acked(
) {
    let (metrics, log) = (Metrics::default(), Log::default());
    let m = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .middleware(seed_example(&metrics, &log))
        .build()
        .unwrap();
    let received = Envelope::new(Invoice { amount: 1 }).with(ReceivedStamp::new("async"));
    let out = m.bus().dispatch(received).await;
    assert!(
        out.is_ok(),
        "an error would make the worker reject or retry"
    );
    assert_eq!(entries(&log), ["tenant filter"]);
}

async fn drain(messenger: &Messenger, transport: &str) -> envoi_core::worker::WorkerReport {
    envoi_core::worker::Worker::builder(messenger)
        .receiver(transport)
        .stop_when_empty()
        .idle_sleep(Duration::from_millis(5))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await
}

#[tokio::test]
async fn through_a_real_transport_and_worker_outgoing_runs_when_sending_and_the_consuming_stages_when_consuming(
) {
    let log = Log::default();
    let m = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .transport_dsn("async", "in-memory://?serialize=true")
        .route::<Invoice>("async")
        .middleware(four_stages(&log))
        .build_async()
        .await
        .unwrap();
    m.dispatcher()
        .dispatch(Invoice { amount: 2 })
        .await
        .unwrap();
    assert_eq!(entries(&log), ["outgoing"]);
    log.lock().unwrap().clear();
    drain(&m, "async").await;
    assert_eq!(
        entries(&log),
        [
            "before_consuming",
            "handler",
            "after_consuming",
            "on_consumed_successfully"
        ]
    );
}

#[tokio::test]
async fn a_consumed_message_stopped_before_consuming_is_acked_not_failed() {
    let (metrics, log) = (Metrics::default(), Log::default());
    let m = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .transport_dsn("async", "in-memory://?serialize=true")
        .transport_dsn("failed", "in-memory://")
        .failure_transport("failed")
        .route::<Invoice>("async")
        .middleware(seed_example(&metrics, &log))
        .build_async()
        .await
        .unwrap();
    // No tenant header: the receiver's filter stops it.
    m.dispatcher()
        .dispatch(Invoice { amount: 2 })
        .await
        .unwrap();
    drain(&m, "async").await;
    assert_eq!(entries(&log), ["tenant filter"], "no handler, no timing");
    assert_eq!(metrics.count(), 0);
    let queue = m.transport("async").unwrap();
    let failed = m.transport("failed").unwrap();
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        0,
        "acknowledged"
    );
    assert_eq!(
        failed.counter().message_count().await.unwrap(),
        0,
        "not failed"
    );
}

#[tokio::test]
async fn on_consumed_successfully_does_not_run_for_a_received_message_whose_handler_failed_and_is_retried(
) {
    let log = Log::default();
    let senders = RecordingSenders::default();
    let m = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .route::<Invoice>("async")
        .sender_dispatcher(Arc::new(senders.clone()))
        .middleware(four_stages(&log))
        .build()
        .unwrap();
    let received = Envelope::new(Invoice { amount: 0 }).with(ReceivedStamp::new("async"));
    m.bus()
        .dispatch(received)
        .await
        .expect("scheduled for a retry");
    assert_eq!(senders.sent_to(), ["async"], "sent back for a retry");
    assert_eq!(
        entries(&log),
        ["before_consuming", "handler", "after_consuming"],
        "the handler failed"
    );
}

#[tokio::test]
async fn a_filter_added_to_a_live_bus_runs_before_the_stage_middleware_added_at_build_time() {
    let log: Log = Arc::default();
    let seen = log.clone();
    let messenger = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .stages(StagePipeline::new().use_(
            PipelineStage::BeforeConsuming,
            [as_middleware(move |e, next| {
                seen.lock().unwrap().push("middleware".into());
                next.run(e)
            })],
        ))
        .build()
        .unwrap();
    let bus = messenger.bus();
    bus.dispatch(Envelope::new(Invoice { amount: 1 }))
        .await
        .unwrap();
    assert_eq!(entries(&log), ["middleware", "handler"]);
    log.lock().unwrap().clear();

    let filtered = log.clone();
    bus.use_stage(
        PipelineStage::BeforeConsuming,
        [as_filter(move |_| {
            filtered.lock().unwrap().push("filter".into());
            FilterAction::Stop
        })],
    );
    bus.dispatch(Envelope::new(Invoice { amount: 1 }))
        .await
        .unwrap();
    // One stage pipeline: the new filter stops the stage before the
    // middleware added at build time runs, and the handler never runs.
    assert_eq!(entries(&log), ["filter"]);
}

#[tokio::test]
async fn stage_middleware_added_to_a_live_bus_runs_after_the_filters_added_at_build_time() {
    let log: Log = Arc::default();
    let filtered = log.clone();
    let messenger = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .stages(StagePipeline::new().use_(
            PipelineStage::BeforeConsuming,
            [as_filter(move |e| {
                filtered.lock().unwrap().push("filter".into());
                if e.header("tenant").is_some() {
                    FilterAction::Continue
                } else {
                    FilterAction::Stop
                }
            })],
        ))
        .build()
        .unwrap();
    let seen = log.clone();
    messenger.bus().use_stage(
        PipelineStage::BeforeConsuming,
        [as_middleware(move |e, next| {
            seen.lock().unwrap().push("middleware".into());
            next.run(e)
        })],
    );
    messenger
        .bus()
        .dispatch(Envelope::new(Invoice { amount: 1 }))
        .await
        .unwrap();
    assert_eq!(entries(&log), ["filter"], "stopped before the middleware");
    log.lock().unwrap().clear();
    messenger
        .bus()
        .dispatch(Envelope::new(Invoice { amount: 1 }).with_header("tenant", "acme"))
        .await
        .unwrap();
    assert_eq!(entries(&log), ["filter", "middleware", "handler"]);
    assert_eq!(
        messenger
            .bus()
            .pipeline()
            .iter()
            .filter(|s| *s == "StagePipeline")
            .count(),
        1,
        "one stage pipeline: {:?}",
        messenger.bus().pipeline()
    );
}

#[tokio::test]
async fn a_worker_counts_a_message_a_filter_stopped_apart_from_the_handled_ones() {
    let log: Log = Arc::default();
    let queue = Arc::new(envoi_core::transport::in_memory::InMemoryTransport::new());
    let messenger = Messenger::builder()
        .command_handler(invoice_handler(&log))
        .transport("invoices", queue.clone())
        .route::<Invoice>("invoices")
        .stages(StagePipeline::new().use_(
            PipelineStage::BeforeConsuming,
            [as_filter(|e| {
                if e.header("tenant").is_some() {
                    FilterAction::Continue
                } else {
                    FilterAction::Stop
                }
            })],
        ))
        .build()
        .unwrap();
    let bus = messenger.bus();
    bus.dispatch(Envelope::new(Invoice { amount: 1 }).with_header("tenant", "acme"))
        .await
        .unwrap();
    bus.dispatch(Envelope::new(Invoice { amount: 2 }))
        .await
        .unwrap();
    let report = envoi_core::worker::Worker::builder(&messenger)
        .receiver("invoices")
        .stop_when_empty()
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(entries(&log), ["handler"], "only the tenant's invoice ran");
    assert_eq!(report.stats.handled, 1, "{:?}", report.stats);
    assert_eq!(report.stats.stopped_by_filter, 1, "{:?}", report.stats);
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        0,
        "both acknowledged"
    );
}
