//! Typed results that cannot lie: a command or query waiting for an output
//! that a transport never gives back is refused before anything is sent;
//! `send` says where a message went; a filter's stop is told apart from a
//! failure.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use envoi_core::middleware::stage::{as_filter, FilterAction, PipelineStage, StagePipeline};
use envoi_core::testing::Abilities;
use envoi_core::transport::in_memory::InMemoryTransport;
use envoi_core::{BusError, Command, Message, Messenger, Query};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Charge {
    cents: u64,
}
impl Message for Charge {
    const NAME: &'static str = "Charge";
}
impl Command for Charge {
    type Output = u64;
    type Error = Infallible;
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Notify;
impl Message for Notify {
    const NAME: &'static str = "Notify";
}
impl Command for Notify {
    type Output = ();
    type Error = Infallible;
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Balance;
impl Message for Balance {
    const NAME: &'static str = "Balance";
}
impl Query for Balance {
    type Output = u64;
    type Error = Infallible;
}

fn routed() -> (Messenger, Arc<InMemoryTransport>) {
    let payments = Arc::new(InMemoryTransport::new());
    let messenger = Messenger::builder()
        .transport("payments", payments.clone())
        .route::<Charge>("payments")
        .route::<Notify>("payments")
        .route::<Balance>("payments")
        .build()
        .unwrap();
    (messenger, payments)
}

async fn waiting(t: &InMemoryTransport) -> u64 {
    t.counter().message_count().await.unwrap()
}

#[tokio::test]
async fn a_routed_command_with_an_output_is_refused_and_nothing_is_sent() {
    let (messenger, payments) = routed();
    let error = messenger
        .dispatcher()
        .dispatch(Charge { cents: 5 })
        .await
        .unwrap_err();
    match error.infrastructure() {
        Some(BusError::ExpectsResult {
            message,
            transports,
        }) => {
            assert_eq!(*message, "Charge");
            assert_eq!(transports, &["payments".to_string()]);
        }
        other => panic!("expected ExpectsResult, got {other:?}"),
    }
    assert!(error.to_string().contains("nothing was sent"), "{error}");
    assert_eq!(waiting(&payments).await, 0, "nothing was sent");
}

#[tokio::test]
async fn a_routed_query_is_refused_and_nothing_is_sent() {
    let (messenger, payments) = routed();
    let error = messenger.dispatcher().ask(Balance).await.unwrap_err();
    assert!(
        matches!(error.infrastructure(), Some(BusError::ExpectsResult { .. })),
        "{error:?}"
    );
    assert_eq!(waiting(&payments).await, 0);
}

#[tokio::test]
async fn a_routed_command_without_an_output_is_sent_and_reports_success() {
    let (messenger, payments) = routed();
    messenger.dispatcher().dispatch(Notify).await.unwrap();
    assert_eq!(waiting(&payments).await, 1);
}

#[tokio::test]
async fn send_stores_the_command_and_says_where_it_went() {
    let (messenger, payments) = routed();
    let sent = messenger
        .dispatcher()
        .send(Charge { cents: 5 })
        .await
        .unwrap();
    assert_eq!(sent.receipts.len(), 1);
    assert_eq!(sent.receipts[0].transport, "payments");
    let stored = payments.receiver().get(10).await.unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(
        sent.receipts[0].id.as_deref(),
        Some(stored[0].id.as_str()),
        "the receipt's id is the transport's"
    );
}

#[tokio::test]
async fn send_refuses_a_command_routed_nowhere_and_runs_nothing() {
    let ran = Arc::new(AtomicU32::new(0));
    let seen = ran.clone();
    let messenger = Messenger::builder()
        .command_handler(move |c: Charge| {
            seen.fetch_add(1, Ordering::Relaxed);
            async move { Ok::<_, Infallible>(c.cents) }
        })
        .build()
        .unwrap();
    let error = messenger
        .dispatcher()
        .send(Charge { cents: 5 })
        .await
        .unwrap_err();
    assert!(
        matches!(error, BusError::NotRouted { message: "Charge" }),
        "{error:?}"
    );
    assert_eq!(ran.load(Ordering::Relaxed), 0);
    // Dispatched, it is handled in process with its output.
    assert_eq!(
        messenger
            .dispatcher()
            .dispatch(Charge { cents: 5 })
            .await
            .unwrap(),
        5
    );
}

#[tokio::test]
async fn a_command_a_filter_stopped_is_told_apart_from_a_failure() {
    let messenger = Messenger::builder()
        .command_handler(|c: Charge| async move { Ok::<_, Infallible>(c.cents) })
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
    let error = messenger
        .dispatcher()
        .dispatch(Charge { cents: 5 })
        .await
        .unwrap_err();
    match error.infrastructure() {
        Some(BusError::StoppedByFilter { message, stage }) => {
            assert_eq!((*message, stage.as_str()), ("Charge", "before_consuming"));
        }
        other => panic!("expected StoppedByFilter, got {other:?}"),
    }
}

#[test]
fn a_query_with_its_handler_routed_to_a_transport_is_a_build_error() {
    let error = Messenger::builder()
        .query_handler(|_: Balance| async { Ok::<_, Infallible>(7) })
        .transport("payments", Arc::new(InMemoryTransport::new()))
        .route::<Balance>("payments")
        .build()
        .unwrap_err();
    match error {
        envoi_core::BuildError::QueryRoutedToTransport { message, transport } => {
            assert_eq!((message, transport.as_str()), ("Balance", "payments"));
        }
        other => panic!("expected QueryRoutedToTransport, got {other:?}"),
    }
}

#[tokio::test]
async fn a_query_routed_through_the_sync_transport_is_answered() {
    let messenger = Messenger::builder()
        .query_handler(|_: Balance| async { Ok::<_, Infallible>(7) })
        .transport(
            "inline",
            Arc::new(envoi_core::transport::sync::SyncTransport::new()),
        )
        .route::<Balance>("inline")
        .build()
        .unwrap();
    assert_eq!(messenger.dispatcher().ask(Balance).await.unwrap(), 7);
}
