//! The test kit (`testing::TestKit`, cargo feature `testing`): the
//! application's configuration on in-memory transports, a worker run until
//! the transports are idle under tokio's paused clock, and the record of
//! what was dispatched, sent, handled, retried and parked.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoi_core::failure::MultiplierRetryStrategy;
use envoi_core::testing::{Activity, KitError, TestKit, Within};
use envoi_core::transport::{SendError, Sender};
use envoi_core::{
    BoxFuture, Command, Context, Envelope, Event, Message, Messenger, MessengerBuilder, Query,
};
use futures_util::FutureExt;
use serde::{Deserialize, Serialize};

/// The longest a test waits for the kit (real time, whatever the tokio
/// clock does): a kit whose clock were not paused would wait out the
/// retry delays of an hour.
const WAIT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PlaceOrder {
    id: u32,
}
impl Message for PlaceOrder {
    const NAME: &'static str = "PlaceOrder";
}
impl Command for PlaceOrder {
    type Output = ();
    type Error = OrderError;
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SendConfirmation {
    order: u32,
}
impl Message for SendConfirmation {
    const NAME: &'static str = "SendConfirmation";
}
impl Command for SendConfirmation {
    type Output = ();
    type Error = OrderError;
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct OrderPlaced {
    id: u32,
}
impl Message for OrderPlaced {
    const NAME: &'static str = "OrderPlaced";
}
impl Event for OrderPlaced {
    type Error = OrderError;
}

#[derive(Debug, Clone, PartialEq)]
struct Total {
    order: u32,
}
impl Message for Total {
    const NAME: &'static str = "Total";
}
impl Query for Total {
    type Output = u64;
    type Error = OrderError;
}

#[derive(Debug, thiserror::Error)]
enum OrderError {
    #[error("the payment gateway is down")]
    GatewayDown,
    #[error("deferring failed: {0}")]
    Defer(String),
}

/// A retry strategy of `retries` retries, the first after `delay`, each
/// twice as long as the one before, without jitter.
fn doubling(retries: u32, delay: Duration) -> MultiplierRetryStrategy {
    MultiplierRetryStrategy {
        max_retries: retries,
        delay,
        multiplier: 2.0,
        max_delay: None,
        jitter: 0.0,
    }
}

/// A production-like configuration: `PlaceOrder` routed to a broker the
/// test never reaches, failures parked in another.
fn shop() -> MessengerBuilder {
    Messenger::builder()
        .transport_dsn("orders", "amqp://guest:guest@broker.invalid:5672/%2f")
        .transport_dsn("failed", "postgres://app@db.invalid/app?table=failed")
        .route::<PlaceOrder>("orders")
        .retry_strategy("orders", doubling(3, Duration::from_secs(1)))
        .failure_transport("failed")
}

#[tokio::test(start_paused = true)]
async fn a_routed_command_is_recorded_as_sent_and_is_handled_only_once_the_kit_runs() {
    let kit = TestKit::new(shop().command_handler(|_: PlaceOrder| async { Ok(()) }))
        .await
        .unwrap();
    assert_eq!(kit.consumed_transports(), ["orders"]);

    kit.dispatcher()
        .dispatch(PlaceOrder { id: 1 })
        .await
        .unwrap();
    assert_eq!(kit.dispatched::<PlaceOrder>(), [PlaceOrder { id: 1 }]);
    assert_eq!(
        kit.sent::<PlaceOrder>(),
        [("orders".to_string(), PlaceOrder { id: 1 })]
    );
    kit.assert_sent_to::<PlaceOrder>("orders", 1);
    kit.assert_handled::<PlaceOrder>(0);

    let report = kit.run_until_idle().within(WAIT, "the kit").await;
    assert_eq!(report.stats.handled, 1);
    assert_eq!(kit.handled::<PlaceOrder>(), [PlaceOrder { id: 1 }]);
    kit.assert_dispatched::<PlaceOrder>(1);
    kit.assert_nothing_parked();
    let orders = kit.messenger().transport("orders").unwrap();
    assert_eq!(
        orders
            .as_message_count()
            .unwrap()
            .message_count()
            .await
            .unwrap(),
        0
    );
}

#[tokio::test(start_paused = true)]
async fn a_failing_handler_is_retried_with_its_delays_on_the_paused_clock_then_parked() {
    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let kit = TestKit::new(shop().command_handler(move |_: PlaceOrder| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Err::<(), _>(OrderError::GatewayDown) }
    }))
    .await
    .unwrap();

    kit.dispatcher()
        .dispatch(PlaceOrder { id: 2 })
        .await
        .unwrap();
    let report = kit.run_until_idle().within(WAIT, "the kit").await;

    assert_eq!(
        calls.load(Ordering::SeqCst),
        4,
        "tried once, retried 3 times"
    );
    let retries = kit.retried::<PlaceOrder>();
    let seen: Vec<(u32, Duration, &str)> = retries
        .iter()
        .map(|r| (r.attempt, r.delay, r.transport.as_str()))
        .collect();
    let secs = Duration::from_secs;
    assert_eq!(
        seen,
        [
            (1, secs(1), "orders"),
            (2, secs(2), "orders"),
            (3, secs(4), "orders")
        ]
    );
    // The delays passed on the paused clock, in virtual time.
    assert!(report.elapsed >= secs(7), "{:?}", report.elapsed);
    kit.assert_handled::<PlaceOrder>(0);
    kit.assert_parked::<PlaceOrder>(1);
    let parked = kit.parked::<PlaceOrder>().remove(0);
    assert_eq!(parked.message, PlaceOrder { id: 2 });
    assert_eq!(
        (parked.transport.as_str(), parked.failure_transport.as_str()),
        ("orders", "failed")
    );
    assert!(
        parked.error.contains("the payment gateway is down"),
        "{}",
        parked.error
    );
    // Parked for real, in the in-memory failure transport, which the kit
    // does not consume.
    let failed = kit.messenger().transport("failed").unwrap();
    assert_eq!(
        failed
            .as_message_count()
            .unwrap()
            .message_count()
            .await
            .unwrap(),
        1
    );
}

/// A configuration whose `PlaceOrder` handler defers a `SendConfirmation`
/// until it has succeeded, and fails on its first try after deferring.
fn deferring(tries: Arc<AtomicU32>) -> MessengerBuilder {
    shop()
        .route::<SendConfirmation>("orders")
        .command_handler(move |order: PlaceOrder, ctx: Context| {
            let tries = tries.clone();
            async move {
                ctx.dispatch_after_current(SendConfirmation { order: order.id })
                    .await
                    .map_err(|e| OrderError::Defer(e.to_string()))?;
                match tries.fetch_add(1, Ordering::SeqCst) {
                    0 => Err(OrderError::GatewayDown),
                    _ => Ok(()),
                }
            }
        })
        .command_handler(|_: SendConfirmation| async { Ok(()) })
}

#[tokio::test(start_paused = true)]
async fn a_deferred_dispatch_is_recorded_only_after_the_handler_that_deferred_it_succeeded() {
    let tries = Arc::new(AtomicU32::new(0));
    let kit = TestKit::new(deferring(tries.clone())).await.unwrap();

    kit.dispatcher()
        .dispatch(PlaceOrder { id: 3 })
        .await
        .unwrap();
    kit.run_until_idle().within(WAIT, "the kit").await;

    assert_eq!(tries.load(Ordering::SeqCst), 2);
    kit.assert_retried::<PlaceOrder>(1);
    kit.assert_handled::<PlaceOrder>(1);
    // What the failed try deferred was dropped with it: one confirmation.
    assert_eq!(
        kit.dispatched::<SendConfirmation>(),
        [SendConfirmation { order: 3 }]
    );
    kit.assert_sent_to::<SendConfirmation>("orders", 1);
    kit.assert_handled::<SendConfirmation>(1);
    kit.assert_nothing_parked();

    let order: Vec<String> = kit
        .records()
        .iter()
        .map(|r| format!("{} {}", r.activity.verb(), r.message))
        .collect();
    assert_eq!(
        order,
        [
            "dispatched PlaceOrder",
            "sent PlaceOrder",
            "retried PlaceOrder",
            "handled PlaceOrder",
            "dispatched SendConfirmation",
            "sent SendConfirmation",
            "handled SendConfirmation",
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn an_event_is_handled_once_per_handler_and_a_query_with_its_answer() {
    let kit = TestKit::new(
        Messenger::builder()
            .event_handler(|_: OrderPlaced| async { Ok(()) })
            .event_handler(|_: OrderPlaced| async { Ok(()) })
            .query_handler(|t: Total| async move { Ok(u64::from(t.order) * 100) }),
    )
    .await
    .unwrap();
    kit.dispatcher()
        .publish(OrderPlaced { id: 4 })
        .await
        .unwrap();
    assert_eq!(kit.dispatcher().ask(Total { order: 4 }).await.unwrap(), 400);

    kit.assert_handled::<OrderPlaced>(2);
    let handlers: Vec<String> = kit
        .handled_by::<OrderPlaced>()
        .into_iter()
        .map(|h| h.handler)
        .collect();
    assert_eq!(handlers.len(), 2);
    assert_ne!(handlers[0], handlers[1], "two handlers: {handlers:?}");
    let answered = kit.handled_by::<Total>().remove(0);
    assert_eq!(answered.result.downcast_ref::<u64>(), Some(&400));
    // Nothing was routed: nothing to consume, idle at once.
    assert!(kit.consumed_transports().is_empty());
    assert_eq!(kit.run_until_idle().await.stats.handled, 0);
}

#[tokio::test(start_paused = true)]
async fn a_handler_that_succeeded_beside_one_that_failed_is_recorded_once_not_again_on_the_retry() {
    let tries = Arc::new(AtomicU32::new(0));
    let flaky = tries.clone();
    let kit = TestKit::new(
        shop()
            .route::<OrderPlaced>("orders")
            .event_handler(|_: OrderPlaced| async { Ok(()) })
            .event_handler(move |_: OrderPlaced| {
                let first = flaky.fetch_add(1, Ordering::SeqCst) == 0;
                async move {
                    match first {
                        true => Err(OrderError::GatewayDown),
                        false => Ok(()),
                    }
                }
            }),
    )
    .await
    .unwrap();
    kit.dispatcher()
        .publish(OrderPlaced { id: 9 })
        .await
        .unwrap();
    kit.run_until_idle().within(WAIT, "the kit").await;

    assert_eq!(tries.load(Ordering::SeqCst), 2);
    kit.assert_retried::<OrderPlaced>(1);
    let handlers: Vec<String> = kit
        .handled_by::<OrderPlaced>()
        .into_iter()
        .map(|h| h.handler)
        .collect();
    assert_eq!(handlers.len(), 2, "each handler once: {handlers:?}");
    assert_ne!(handlers[0], handlers[1], "{handlers:?}");
    kit.assert_nothing_parked();
}

/// A sender that must never be reached: the kit replaces it.
struct Unreachable;

impl Sender for Unreachable {
    fn send(&self, _: Envelope) -> BoxFuture<'_, Result<Envelope, SendError>> {
        panic!("the test kit sent to a sender of the production configuration")
    }
}

#[tokio::test(start_paused = true)]
async fn senders_become_in_memory_destinations_and_sync_transports_stay() {
    let kit = TestKit::new(
        Messenger::builder()
            .sender("billing", Arc::new(Unreachable))
            .transport_dsn("sync", "sync://")
            .route::<PlaceOrder>("billing")
            .route::<SendConfirmation>("sync")
            .command_handler(|_: SendConfirmation| async { Ok(()) }),
    )
    .await
    .unwrap();
    assert!(kit.consumed_transports().is_empty(), "nothing to consume");

    kit.dispatcher()
        .dispatch(PlaceOrder { id: 5 })
        .await
        .unwrap();
    kit.dispatcher()
        .dispatch(SendConfirmation { order: 5 })
        .await
        .unwrap();
    kit.run_until_idle().await;

    kit.assert_sent_to::<PlaceOrder>("billing", 1);
    kit.assert_handled::<PlaceOrder>(0);
    // The sync transport handled it as it was sent.
    kit.assert_dispatched::<SendConfirmation>(1);
    kit.assert_sent_to::<SendConfirmation>("sync", 1);
    kit.assert_handled::<SendConfirmation>(1);
    let billing = kit.messenger().transport("billing").unwrap();
    assert_eq!(
        billing
            .as_message_count()
            .unwrap()
            .message_count()
            .await
            .unwrap(),
        1,
        "kept where the other process would take it"
    );
}

#[tokio::test]
async fn the_kit_pauses_the_clock_itself_so_an_hour_long_retry_passes_at_once() {
    let kit = TestKit::new(
        shop()
            .retry_strategy("orders", doubling(1, Duration::from_secs(3600)))
            .command_handler(|_: PlaceOrder| async { Err::<(), _>(OrderError::GatewayDown) }),
    )
    .await
    .unwrap();
    kit.dispatcher()
        .dispatch(PlaceOrder { id: 6 })
        .await
        .unwrap();
    let report = kit
        .run_until_idle()
        .within(WAIT, "an hour-long retry on the paused clock")
        .await;
    kit.assert_retried::<PlaceOrder>(1);
    kit.assert_parked::<PlaceOrder>(1);
    assert!(report.elapsed >= Duration::from_secs(3600));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_threaded_runtime_is_refused_as_its_clock_cannot_be_paused() {
    let error = TestKit::new(shop()).await.unwrap_err();
    assert!(matches!(error, KitError::MultiThreadRuntime), "{error:?}");
    assert!(error.to_string().contains("start_paused = true"), "{error}");
}

#[tokio::test(start_paused = true)]
async fn a_configuration_that_does_not_build_is_an_error() {
    let error = TestKit::new(shop().route::<PlaceOrder>("nowhere"))
        .await
        .unwrap_err();
    assert!(matches!(error, KitError::Build(_)), "{error:?}");
    assert!(error.to_string().contains("nowhere"), "{error}");
}

#[tokio::test(start_paused = true)]
#[should_panic(expected = "run_until_idle: the transports were still busy after 50 messages")]
async fn a_handler_that_dispatches_forever_ends_in_a_clear_panic() {
    let kit = TestKit::new(
        shop().command_handler(|order: PlaceOrder, ctx: Context| async move {
            ctx.dispatch(PlaceOrder { id: order.id + 1 }).await.unwrap();
            Ok(())
        }),
    )
    .await
    .unwrap()
    .with_message_limit(50);
    kit.dispatcher()
        .dispatch(PlaceOrder { id: 0 })
        .await
        .unwrap();
    kit.run_until_idle().within(WAIT, "the kit").await;
}

/// The message a failed assertion of `kit` panics with.
fn panic_of(assertion: impl FnOnce()) -> String {
    let panic = std::panic::catch_unwind(AssertUnwindSafe(assertion)).unwrap_err();
    match panic.downcast::<String>() {
        Ok(message) => *message,
        Err(panic) => panic.downcast_ref::<&str>().unwrap().to_string(),
    }
}

#[tokio::test(start_paused = true)]
async fn a_failed_assertion_says_what_it_expected_and_lists_what_was_recorded() {
    let kit = TestKit::new(shop().command_handler(|order: PlaceOrder| async move {
        match order.id {
            1 => Ok(()),
            _ => Err(OrderError::GatewayDown),
        }
    }))
    .await
    .unwrap()
    .with_time_limit(Duration::from_secs(60));
    for id in [1, 2] {
        kit.dispatcher().dispatch(PlaceOrder { id }).await.unwrap();
    }
    kit.run_until_idle().within(WAIT, "the kit").await;

    let message = panic_of(|| kit.assert_handled::<PlaceOrder>(2));
    let mut lines = message.lines();
    assert_eq!(
        lines.next(),
        Some("expected PlaceOrder to be handled 2 times, but it was handled 1 time")
    );
    assert_eq!(
        lines.next(),
        Some("what the test kit recorded (9; `>` marks what was counted):")
    );
    let listed: Vec<&str> = lines.collect();
    assert_eq!(listed.len(), 9, "{message}");
    let marked: Vec<&&str> = listed.iter().filter(|l| l.starts_with('>')).collect();
    assert_eq!(marked.len(), 1, "{message}");
    assert!(
        marked[0].contains("handled    PlaceOrder { id: 1 } by"),
        "{message}"
    );
    assert!(
        listed
            .iter()
            .any(|l| l.contains("retried    PlaceOrder { id: 2 } on `orders`: retry 3 after 4s")),
        "{message}"
    );

    let message = panic_of(|| kit.assert_nothing_parked());
    assert!(
        message.starts_with("expected nothing parked, but 1 message was parked or failed\n"),
        "{message}"
    );
    assert!(
        message.contains(">   9. parked     PlaceOrder { id: 2 } from `orders` in `failed`: "),
        "{message}"
    );

    let message = panic_of(|| kit.assert_sent_to::<PlaceOrder>("failed", 1));
    assert!(
        message.starts_with(
            "expected PlaceOrder to be sent to `failed` 1 time, but it was sent to `failed` 0 times\n"
        ),
        "{message}"
    );

    kit.clear();
    let message = panic_of(|| kit.assert_dispatched::<PlaceOrder>(1));
    assert_eq!(
        message,
        "expected PlaceOrder to be dispatched 1 time, but it was dispatched 0 times\n\
         the test kit recorded nothing"
    );
}

#[tokio::test(start_paused = true)]
#[should_panic(expected = "expected PlaceOrder to be parked 1 time, but it was parked 0 times")]
async fn assert_parked_panics_when_nothing_was_parked() {
    let kit = TestKit::new(shop().command_handler(|_: PlaceOrder| async { Ok(()) }))
        .await
        .unwrap();
    kit.dispatcher()
        .dispatch(PlaceOrder { id: 7 })
        .await
        .unwrap();
    kit.run_until_idle().await;
    kit.assert_parked::<PlaceOrder>(1);
}

#[tokio::test(start_paused = true)]
async fn each_record_names_its_activity() {
    let kit = TestKit::new(shop().command_handler(|_: PlaceOrder| async { Ok(()) }))
        .await
        .unwrap();
    kit.dispatcher()
        .dispatch(PlaceOrder { id: 8 })
        .await
        .unwrap();
    kit.run_until_idle().await;
    let records = kit.records_of::<PlaceOrder>();
    assert!(matches!(
        &records[0].activity,
        Activity::Dispatched { bus } if bus == "default"
    ));
    assert!(matches!(
        &records[1].activity,
        Activity::Sent { transport } if transport == "orders"
    ));
    assert!(matches!(&records[2].activity, Activity::Handled { .. }));
    assert_eq!(records.len(), 3);
    assert!(records
        .iter()
        .all(|r| r.message::<PlaceOrder>() == Some(&PlaceOrder { id: 8 })));
}

#[test]
fn outside_a_runtime_the_kit_says_it_needs_one() {
    let error = TestKit::new(shop())
        .now_or_never()
        .expect("refused before awaiting anything")
        .unwrap_err();
    assert!(matches!(error, KitError::NoRuntime), "{error:?}");
}
