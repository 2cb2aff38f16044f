//! A handler's context and the shared state handlers take: dispatching from
//! a handler, deferring until the current dispatch succeeded, reading the
//! envelope's ids and delivery attempt, taking registered state (and a
//! build refusing state no one registered), and a worker's stop reaching a
//! handler that waits for it.

use std::sync::{Arc, Mutex};

use envoi_core::middleware::correlation::Correlation;
use envoi_core::middleware::MiddlewareStack;
use envoi_core::pipeline::context::ContextError;
use envoi_core::pipeline::handle_message::HandleMessage;
use envoi_core::pipeline::handler::Handlers;
use envoi_core::pipeline::verdict::Fate;
use envoi_core::transport::in_memory::InMemoryTransport;
use envoi_core::transport::MessageCount;
use envoi_core::worker::{StopReason, Worker};
use envoi_core::{
    BuildError, BusError, Command, Context, ContextHandler, Envelope, Event, Message, Messenger,
    RequiredState, State,
};
use futures_util::FutureExt;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PlaceOrder {
    id: u32,
    fail: bool,
}
impl Message for PlaceOrder {
    const NAME: &'static str = "PlaceOrder";
}
impl Command for PlaceOrder {
    type Output = ();
    type Error = OrderFailed;
}

#[derive(Debug, thiserror::Error)]
#[error("the order failed")]
struct OrderFailed;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Reserve {
    id: u32,
}
impl Message for Reserve {
    const NAME: &'static str = "Reserve";
}
impl Command for Reserve {
    type Output = u32;
    type Error = std::convert::Infallible;
}

#[derive(Debug, Clone)]
struct OrderPlaced {
    id: u32,
}
impl Message for OrderPlaced {
    const NAME: &'static str = "OrderPlaced";
}
impl Event for OrderPlaced {
    type Error = std::convert::Infallible;
}

/// What a handler saw, one entry per call.
type Record<T> = Arc<Mutex<Vec<T>>>;

/// What the handlers of a test saw, in order.
#[derive(Clone, Default)]
struct Journal(Arc<Mutex<Vec<String>>>);

impl Journal {
    fn write(&self, line: impl Into<String>) {
        self.0.lock().unwrap().push(line.into());
    }

    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

#[tokio::test]
async fn a_handler_dispatches_another_command_through_its_context_and_it_is_handled() {
    let journal = Journal::default();
    let messenger = Messenger::builder()
        .state(journal.clone())
        .command_handler(|cmd: Reserve, State(j): State<Journal>| async move {
            j.write(format!("reserved {}", cmd.id));
            Ok(cmd.id * 10)
        })
        .command_handler(
            |cmd: PlaceOrder, ctx: Context, State(j): State<Journal>| async move {
                let reserved = ctx.dispatch(Reserve { id: cmd.id }).await.unwrap();
                j.write(format!("placed {} with {reserved}", cmd.id));
                Ok(())
            },
        )
        .build()
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(PlaceOrder { id: 4, fail: false })
        .await
        .unwrap();
    assert_eq!(journal.lines(), ["reserved 4", "placed 4 with 40"]);
}

/// Defers an [`OrderPlaced`] through its context, then fails when asked to.
async fn place_deferring(
    cmd: PlaceOrder,
    ctx: Context,
    State(journal): State<Journal>,
) -> Result<(), OrderFailed> {
    ctx.publish_after_current(OrderPlaced { id: cmd.id })
        .await
        .unwrap();
    journal.write(format!("handler of {} returns", cmd.id));
    if cmd.fail {
        Err(OrderFailed)
    } else {
        Ok(())
    }
}

fn deferring_messenger(journal: &Journal) -> Messenger {
    Messenger::builder()
        .state(journal.clone())
        .command_handler(place_deferring)
        .event_handler(|e: OrderPlaced, State(j): State<Journal>| async move {
            j.write(format!("placed {}", e.id));
            Ok(())
        })
        .build()
        .unwrap()
}

#[tokio::test]
async fn an_event_deferred_through_the_context_runs_once_the_handler_succeeded() {
    let journal = Journal::default();
    let messenger = deferring_messenger(&journal);
    messenger
        .dispatcher()
        .dispatch(PlaceOrder { id: 1, fail: false })
        .await
        .unwrap();
    assert_eq!(journal.lines(), ["handler of 1 returns", "placed 1"]);
}

#[tokio::test]
async fn an_event_deferred_through_the_context_is_dropped_when_the_handler_fails() {
    let journal = Journal::default();
    let messenger = deferring_messenger(&journal);
    let out = messenger
        .dispatcher()
        .dispatch(PlaceOrder { id: 2, fail: true })
        .await;
    assert!(out.unwrap_err().domain().is_some());
    assert_eq!(journal.lines(), ["handler of 2 returns"]);
}

#[tokio::test]
async fn a_deferred_event_carries_the_conversation_of_the_message_that_deferred_it() {
    let seen: Record<(Option<Uuid>, Option<Uuid>, Option<Uuid>)> = Arc::default();
    let record = seen.clone();
    let messenger = Messenger::builder()
        .middleware(Correlation)
        .command_handler(|cmd: PlaceOrder, ctx: Context| async move {
            ctx.publish_after_current(OrderPlaced { id: cmd.id })
                .await
                .unwrap();
            Ok(())
        })
        .event_handler(move |_: OrderPlaced, ctx: Context| {
            let record = record.clone();
            async move {
                let ids = (ctx.message_id(), ctx.correlation_id(), ctx.causation_id());
                record.lock().unwrap().push(ids);
                Ok(())
            }
        })
        .build()
        .unwrap();
    let out = messenger
        .bus()
        .dispatch(Envelope::new(PlaceOrder { id: 3, fail: false }))
        .await
        .unwrap();
    let order = out.last::<envoi_core::stamp::MessageIdStamp>().unwrap().id;
    let seen = seen.lock().unwrap().clone();
    let [(event_id, correlation, causation)] = seen[..] else {
        panic!("the event was handled {} times", seen.len());
    };
    assert_ne!(event_id, Some(order));
    assert_eq!(
        correlation,
        Some(order),
        "the conversation the order started"
    );
    assert_eq!(causation, Some(order), "caused by the order");
}

#[tokio::test]
async fn a_message_dispatched_in_process_reads_its_ids_and_a_first_attempt() {
    let seen: Arc<Mutex<Option<String>>> = Arc::default();
    let record = seen.clone();
    let messenger = Messenger::builder()
        .middleware(Correlation)
        .command_handler(move |_: PlaceOrder, ctx: Context| {
            let record = record.clone();
            async move {
                let id = ctx.message_id().unwrap();
                assert_eq!(ctx.correlation_id(), Some(id), "it starts a conversation");
                assert_eq!(ctx.causation_id(), None);
                let line = format!(
                    "attempt {} transport {:?} bus {} cancelled {}",
                    ctx.attempt(),
                    ctx.transport(),
                    ctx.bus().name(),
                    ctx.is_cancelled()
                );
                *record.lock().unwrap() = Some(line);
                Ok(())
            }
        })
        .build()
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(PlaceOrder { id: 1, fail: false })
        .await
        .unwrap();
    assert_eq!(
        seen.lock().unwrap().as_deref(),
        Some("attempt 1 transport None bus default cancelled false")
    );
}

/// What a handler read from its context on one call.
#[derive(Debug, Clone, PartialEq)]
struct Delivery {
    attempt: u32,
    transport: Option<String>,
    message_id: Option<Uuid>,
    correlation_id: Option<Uuid>,
}

#[tokio::test(start_paused = true)]
async fn a_retried_message_is_handled_as_its_second_attempt_from_its_transport() {
    let seen: Record<Delivery> = Arc::default();
    let record = seen.clone();
    let queue = Arc::new(InMemoryTransport::new());
    let messenger = Messenger::builder()
        .middleware(Correlation)
        .command_handler(move |_: PlaceOrder, ctx: Context| {
            let record = record.clone();
            async move {
                let attempt = ctx.attempt();
                record.lock().unwrap().push(Delivery {
                    attempt,
                    transport: ctx.transport().map(str::to_string),
                    message_id: ctx.message_id(),
                    correlation_id: ctx.correlation_id(),
                });
                if attempt == 1 {
                    return Err(OrderFailed);
                }
                Ok(())
            }
        })
        .transport("async", queue.clone())
        .route::<PlaceOrder>("async")
        .default_retry_strategy(envoi_core::failure::MultiplierRetryStrategy {
            max_retries: 3,
            delay: std::time::Duration::ZERO,
            jitter: 0.0,
            ..Default::default()
        })
        .build()
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(PlaceOrder { id: 1, fail: false })
        .await
        .unwrap();
    let report = Worker::builder(&messenger)
        .receiver("async")
        .stop_when_empty()
        .build()
        .unwrap()
        .run()
        .await;
    assert_eq!((report.stats.retried, report.stats.handled), (1, 1));
    let seen = seen.lock().unwrap().clone();
    let [first, second] = &seen[..] else {
        panic!("handled {} times", seen.len());
    };
    assert_eq!((first.attempt, second.attempt), (1, 2));
    assert_eq!(first.transport.as_deref(), Some("async"));
    assert_eq!(second.transport.as_deref(), Some("async"));
    assert!(second.message_id.is_some());
    assert_eq!(
        second.message_id, first.message_id,
        "a retry keeps the message id"
    );
    assert_eq!(second.correlation_id, first.message_id);
}

#[tokio::test]
async fn a_redelivered_message_counts_one_more_attempt() {
    let attempts: Arc<Mutex<Vec<u32>>> = Arc::default();
    let record = attempts.clone();
    let messenger = Messenger::builder()
        .command_handler(move |_: PlaceOrder, ctx: Context| {
            let record = record.clone();
            async move {
                record.lock().unwrap().push(ctx.attempt());
                Ok(())
            }
        })
        .build()
        .unwrap();
    let received = |e: Envelope| e.with(envoi_core::stamp::ReceivedStamp::new("queue"));
    let order = || Envelope::new(PlaceOrder { id: 1, fail: false });
    let redelivered = received(order().with(envoi_core::stamp::RedeliveredStamp::new()));
    let retried_twice = received(order().with(envoi_core::stamp::RedeliveryStamp::new(2)));
    for envelope in [redelivered, retried_twice] {
        let verdict = messenger.bus().receive(envelope).await;
        assert!(matches!(verdict.fate, Fate::Handled(_)), "{verdict:?}");
    }
    assert_eq!(*attempts.lock().unwrap(), [2, 3]);
}

#[derive(Clone, Debug, PartialEq)]
struct Pool(&'static str);

#[derive(Clone, Debug, PartialEq)]
struct Limits(u32);

#[tokio::test]
async fn a_state_handler_receives_the_registered_values() {
    let journal = Journal::default();
    let messenger = Messenger::builder()
        .state(Pool("orders-db"))
        .state(Limits(5))
        .state(journal.clone())
        .command_handler(
            |cmd: PlaceOrder,
             State(pool): State<Pool>,
             State(limits): State<Limits>,
             ctx: Context,
             State(j): State<Journal>| async move {
                assert_eq!(ctx.state::<Pool>(), Some(&pool));
                j.write(format!(
                    "{} {} {} {}",
                    cmd.id,
                    pool.0,
                    limits.0,
                    ctx.bus().name()
                ));
                Ok(())
            },
        )
        .build()
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(PlaceOrder { id: 9, fail: false })
        .await
        .unwrap();
    assert_eq!(journal.lines(), ["9 orders-db 5 default"]);
}

async fn place_with_pool(_: PlaceOrder, _: State<Pool>) -> Result<(), OrderFailed> {
    Ok(())
}

#[test]
fn build_refuses_a_handler_taking_a_state_no_one_registered() {
    let refused = Messenger::builder()
        .state(Limits(1))
        .command_handler(place_with_pool)
        .build()
        .unwrap_err();
    let BuildError::MissingState {
        handler,
        message,
        state,
    } = &refused
    else {
        panic!("unexpected {refused:?}");
    };
    assert_eq!(*message, "PlaceOrder");
    assert_eq!(*handler, "place_with_pool");
    assert_eq!(*state, std::any::type_name::<Pool>());
    let text = refused.to_string();
    assert!(
        text.contains("place_with_pool") && text.contains("Pool"),
        "{text}"
    );
}

#[test]
fn build_refuses_a_state_registered_twice() {
    let refused = Messenger::builder()
        .state(Pool("a"))
        .state(Pool("b"))
        .build()
        .unwrap_err();
    assert_eq!(
        refused,
        BuildError::DuplicateState(std::any::type_name::<Pool>())
    );
}

/// A handler type that needs the context and a shared state.
struct Cashier;

impl ContextHandler<Reserve> for Cashier {
    type Output = u32;
    type Error = std::convert::Infallible;

    async fn handle(&self, cmd: &Reserve, ctx: Context) -> Result<u32, Self::Error> {
        let limits = ctx.state::<Limits>().expect("checked by build");
        Ok(cmd.id + limits.0)
    }

    fn required_state(&self) -> Vec<RequiredState> {
        vec![RequiredState::of::<Limits>()]
    }
}

#[tokio::test]
async fn a_handler_type_takes_its_context_and_build_checks_the_state_it_lists() {
    let messenger = Messenger::builder()
        .state(Limits(100))
        .command_handler(Cashier)
        .build()
        .unwrap();
    let reserved = messenger.dispatcher().dispatch(Reserve { id: 2 }).await;
    assert_eq!(reserved.unwrap(), 102);
    let refused = Messenger::builder()
        .command_handler(Cashier)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            refused,
            BuildError::MissingState {
                handler: "Cashier",
                ..
            }
        ),
        "{refused:?}"
    );
}

#[tokio::test]
async fn a_handler_on_a_named_bus_dispatches_on_that_bus() {
    let journal = Journal::default();
    let messenger = Messenger::builder()
        .state(journal.clone())
        .bus("orders", |bus| bus)
        .command_handler(
            |cmd: Reserve, ctx: Context, State(j): State<Journal>| async move {
                j.write(format!("reserve {} on {}", cmd.id, ctx.bus().name()));
                Ok(cmd.id)
            },
        )
        .command_handler(|cmd: PlaceOrder, ctx: Context| async move {
            ctx.dispatch(Reserve { id: cmd.id }).await.unwrap();
            Ok(())
        })
        .build()
        .unwrap();
    let orders = messenger.bus_named("orders").unwrap();
    orders
        .dispatch(Envelope::new(PlaceOrder { id: 5, fail: false }))
        .await
        .unwrap();
    assert_eq!(journal.lines(), ["reserve 5 on orders"]);
}

#[tokio::test]
async fn a_context_handler_outside_a_bus_fails_as_unrecoverable() {
    let stack = MiddlewareStack::new([Arc::new(HandleMessage::new(
        Handlers::new().command(|_: PlaceOrder, _: Context| async { Ok(()) }),
    )) as Arc<dyn envoi_core::Middleware>]);
    let error = stack
        .run(Envelope::new(PlaceOrder { id: 1, fail: false }))
        .await
        .unwrap_err();
    let BusError::HandlerFailed { errors, .. } = error else {
        panic!("unexpected {error:?}");
    };
    assert_eq!(errors[0].retry_hint(), envoi_core::RetryHint::Unrecoverable);
    let cause =
        std::error::Error::source(&*errors[0].error).and_then(|e| e.downcast_ref::<ContextError>());
    assert!(
        matches!(cause, Some(ContextError::NoBus { .. })),
        "{:?}",
        errors[0].error
    );
}

#[tokio::test]
async fn a_context_outside_a_worker_is_never_cancelled() {
    let messenger = Messenger::builder()
        .command_handler(|_: PlaceOrder, ctx: Context| async move {
            assert!(!ctx.is_cancelled());
            assert!(
                ctx.cancelled().now_or_never().is_none(),
                "cancelled outside a worker"
            );
            Ok(())
        })
        .build()
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(PlaceOrder { id: 1, fail: false })
        .await
        .unwrap();
}

#[tokio::test]
async fn a_handler_waiting_for_cancellation_finishes_when_its_worker_stops_gracefully() {
    let (started_tx, started) = oneshot::channel::<()>();
    let started_tx = Arc::new(Mutex::new(Some(started_tx)));
    let journal = Journal::default();
    let queue = Arc::new(InMemoryTransport::new());
    let messenger = Messenger::builder()
        .state(journal.clone())
        .command_handler(move |cmd: PlaceOrder, ctx: Context| {
            let started_tx = started_tx.clone();
            async move {
                let journal = ctx.state::<Journal>().unwrap().clone();
                journal.write(format!(
                    "started {} cancelled {}",
                    cmd.id,
                    ctx.is_cancelled()
                ));
                if let Some(tx) = started_tx.lock().unwrap().take() {
                    let _ = tx.send(());
                }
                ctx.cancelled().await;
                journal.write(format!(
                    "wound down {} cancelled {}",
                    cmd.id,
                    ctx.is_cancelled()
                ));
                Ok::<_, OrderFailed>(())
            }
        })
        .transport("async", queue.clone())
        .route::<PlaceOrder>("async")
        .build()
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(PlaceOrder { id: 7, fail: false })
        .await
        .unwrap();
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .build()
        .unwrap();
    let stop = worker.stop_handle();
    let running = tokio::spawn(worker.run());
    started.await.unwrap();
    stop.stop();
    let report = running.await.unwrap();
    assert_eq!(report.reason, StopReason::Stopped);
    assert_eq!((report.stats.handled, report.stats.released), (1, 0));
    assert_eq!(
        journal.lines(),
        ["started 7 cancelled false", "wound down 7 cancelled true"]
    );
    assert_eq!(queue.acknowledged(), 1, "settled, not given back");
    assert_eq!(queue.message_count().await.unwrap(), 0);
}

#[tokio::test]
async fn a_handler_that_fails_when_cancelled_is_retried_not_lost() {
    let (started_tx, started) = oneshot::channel::<()>();
    let started_tx = Arc::new(Mutex::new(Some(started_tx)));
    let queue = Arc::new(InMemoryTransport::new());
    let messenger = Messenger::builder()
        .command_handler(move |_: PlaceOrder, ctx: Context| {
            let started_tx = started_tx.clone();
            async move {
                if let Some(tx) = started_tx.lock().unwrap().take() {
                    let _ = tx.send(());
                }
                ctx.cancelled().await;
                Err(OrderFailed)
            }
        })
        .transport("async", queue.clone())
        .route::<PlaceOrder>("async")
        .default_retry_strategy(envoi_core::failure::MultiplierRetryStrategy {
            max_retries: 3,
            delay: std::time::Duration::from_secs(60),
            jitter: 0.0,
            ..Default::default()
        })
        .build()
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(PlaceOrder { id: 8, fail: false })
        .await
        .unwrap();
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .build()
        .unwrap();
    let stop = worker.stop_handle();
    let running = tokio::spawn(worker.run());
    started.await.unwrap();
    stop.stop();
    let report = running.await.unwrap();
    assert_eq!((report.stats.retried, report.stats.released), (1, 0));
    assert_eq!(
        queue.message_count().await.unwrap(),
        1,
        "its retry waits in the queue"
    );
}
