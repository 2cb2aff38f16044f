//! Postboy-style hook middleware on a real bus — the behavioural matrix, the
//! cancellation error, runtime add/remove and disposal.

use std::borrow::Cow;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use envoi_core::middleware::hook::{Decision, Hook, HookContext, HookMiddleware};
use envoi_core::stamp::{HandlerResult, MessageIdStamp};
use envoi_core::{
    BusError, Command, DispatchError, Envelope, Event, Message, Messenger, Middleware, Query, Stage,
};

type Log = Arc<Mutex<Vec<String>>>;

fn entries(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

#[derive(Debug, Clone)]
struct PlaceOrder {
    quantity: u32,
}
impl Message for PlaceOrder {
    const NAME: &'static str = "PlaceOrder";
}
#[derive(Debug, thiserror::Error)]
#[error("out of stock")]
struct OutOfStock;
impl Command for PlaceOrder {
    type Output = u32;
    type Error = OutOfStock;
}

#[derive(Debug, Clone)]
struct Stock;
impl Message for Stock {
    const NAME: &'static str = "Stock";
}
impl Query for Stock {
    type Output = u32;
    type Error = Infallible;
}

#[derive(Debug, Clone)]
struct OrderPlaced;
impl Message for OrderPlaced {
    const NAME: &'static str = "OrderPlaced";
}
impl Event for OrderPlaced {
    type Error = Infallible;
}

/// A hook that records every call and behaves as configured.
struct Recorder {
    name: &'static str,
    can_handle: bool,
    interrupt: Option<&'static str>,
    log: Log,
}

impl Recorder {
    fn new(name: &'static str, log: &Log) -> Self {
        Self {
            name,
            can_handle: true,
            interrupt: None,
            log: log.clone(),
        }
    }
    fn skipping(mut self) -> Self {
        self.can_handle = false;
        self
    }
    fn interrupting(mut self, reason: &'static str) -> Self {
        self.interrupt = Some(reason);
        self
    }
    fn push(&self, entry: String) {
        self.log.lock().unwrap().push(entry);
    }
}

impl Hook for Recorder {
    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed(self.name)
    }
    fn can_handle(&self, ctx: &HookContext<'_>) -> bool {
        self.push(format!("{} can_handle {}", self.name, ctx.stage()));
        self.can_handle
    }
    fn before(&self, ctx: &HookContext<'_>) -> Decision {
        self.push(format!("{} before {}", self.name, ctx.message_name()));
        match self.interrupt {
            Some(reason) => Decision::interrupt(reason),
            None => Decision::Continue,
        }
    }
    fn after(&self, _ctx: &HookContext<'_>, result: Option<&HandlerResult>) {
        match result.and_then(|r| r.downcast_ref::<u32>()) {
            Some(v) => self.push(format!("{} after {v}", self.name)),
            None => self.push(format!("{} after", self.name)),
        }
    }
    fn dispose(&self) {
        self.push(format!("{} dispose", self.name));
    }
}

fn messenger(log: &Log, hooks: Vec<Recorder>) -> Messenger {
    let handler_log = log.clone();
    let mut builder = Messenger::builder()
        .command_handler(move |c: PlaceOrder| {
            let log = handler_log.clone();
            async move {
                log.lock().unwrap().push("handler".into());
                if c.quantity == 0 {
                    Err(OutOfStock)
                } else {
                    Ok(c.quantity * 10)
                }
            }
        })
        .query_handler(|_: Stock| async { Ok::<_, Infallible>(3) })
        .event_handler(|_: OrderPlaced| async { Ok::<_, Infallible>(()) });
    for hook in hooks {
        builder = builder.middleware(HookMiddleware::new(hook));
    }
    builder.build().unwrap()
}

#[tokio::test]
async fn hooks_run_in_registration_order_and_after_follows_registration_order_too() {
    let log = Log::default();
    let m = messenger(
        &log,
        vec![
            Recorder::new("first", &log),
            Recorder::new("second", &log),
            Recorder::new("third", &log),
        ],
    );
    assert_eq!(
        m.dispatcher()
            .dispatch(PlaceOrder { quantity: 2 })
            .await
            .unwrap(),
        20
    );
    assert_eq!(
        entries(&log),
        [
            "first can_handle Execute",
            "first before PlaceOrder",
            "second can_handle Execute",
            "second before PlaceOrder",
            "third can_handle Execute",
            "third before PlaceOrder",
            "handler",
            "first after 20",
            "second after 20",
            "third after 20",
        ]
    );
}

#[tokio::test]
async fn can_handle_is_called_once_per_middleware_per_operation_and_false_skips_before_and_after() {
    let log = Log::default();
    let m = messenger(
        &log,
        vec![
            Recorder::new("a", &log).skipping(),
            Recorder::new("b", &log),
        ],
    );
    m.dispatcher()
        .dispatch(PlaceOrder { quantity: 1 })
        .await
        .unwrap();
    m.dispatcher()
        .dispatch(PlaceOrder { quantity: 1 })
        .await
        .unwrap();
    let log = entries(&log);
    assert_eq!(
        log.iter().filter(|l| *l == "a can_handle Execute").count(),
        2
    );
    assert_eq!(
        log.iter().filter(|l| *l == "b can_handle Execute").count(),
        2
    );
    assert!(!log
        .iter()
        .any(|l| l.starts_with("a before") || l.starts_with("a after")));
    assert_eq!(log.iter().filter(|l| *l == "b after 10").count(), 2);
}

#[tokio::test]
async fn the_stage_is_execute_for_commands_callback_for_queries_and_publish_for_events() {
    let log = Log::default();
    let m = messenger(&log, vec![Recorder::new("h", &log).skipping()]);
    let bus = m.dispatcher();
    bus.dispatch(PlaceOrder { quantity: 1 }).await.unwrap();
    bus.ask(Stock).await.unwrap();
    bus.publish(OrderPlaced).await.unwrap();
    let stages: Vec<_> = entries(&log)
        .into_iter()
        .filter(|l| l.starts_with("h can_handle"))
        .collect();
    assert_eq!(
        stages,
        [
            "h can_handle Execute",
            "h can_handle Callback",
            "h can_handle Publish"
        ]
    );
}

#[tokio::test]
async fn an_interrupt_cancels_at_once_later_hooks_and_the_handler_do_not_run_and_no_after_is_called(
) {
    let log = Log::default();
    let m = messenger(
        &log,
        vec![
            Recorder::new("auth", &log),
            Recorder::new("quota", &log).interrupting("over quota"),
            Recorder::new("audit", &log),
        ],
    );
    let err = m
        .dispatcher()
        .dispatch(PlaceOrder { quantity: 1 })
        .await
        .unwrap_err();
    match err {
        DispatchError::Infrastructure(BusError::Cancelled {
            stage,
            message_id,
            middleware,
            reason,
        }) => {
            assert_eq!(stage, Stage::Execute);
            assert!(
                uuid::Uuid::parse_str(&message_id).is_ok(),
                "id {message_id:?}"
            );
            assert_eq!(middleware, "quota");
            assert_eq!(reason.as_deref(), Some("over quota"));
        }
        other => panic!("expected a cancellation, got {other:?}"),
    }
    assert_eq!(
        entries(&log),
        [
            "auth can_handle Execute",
            "auth before PlaceOrder",
            "quota can_handle Execute",
            "quota before PlaceOrder",
        ]
    );
}

#[tokio::test]
async fn the_cancellation_error_carries_the_message_id_of_the_envelope() {
    let log = Log::default();
    let m = messenger(&log, vec![Recorder::new("deny", &log).interrupting("no")]);
    let id = MessageIdStamp::generate();
    let err = m
        .bus()
        .dispatch(Envelope::event(OrderPlaced).with(id))
        .await
        .unwrap_err();
    let text = err.to_string();
    match err {
        BusError::Cancelled {
            stage, message_id, ..
        } => {
            assert_eq!(stage, Stage::Publish);
            assert_eq!(message_id, id.id.to_string());
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        text,
        format!(
            "Publish of message {} cancelled by middleware `deny`: no",
            id.id
        )
    );
}

#[tokio::test]
async fn after_is_not_called_when_the_handler_fails() {
    let log = Log::default();
    let m = messenger(
        &log,
        vec![Recorder::new("a", &log), Recorder::new("b", &log)],
    );
    let err = m
        .dispatcher()
        .dispatch(PlaceOrder { quantity: 0 })
        .await
        .unwrap_err();
    assert!(matches!(err, DispatchError::Domain(OutOfStock)));
    let log = entries(&log);
    assert!(log.contains(&"handler".to_string()));
    assert!(!log.iter().any(|l| l.contains("after")), "{log:?}");
}

#[tokio::test]
async fn a_hook_added_at_runtime_takes_part_and_a_removed_one_is_disposed_and_stops() {
    let log = Log::default();
    let m = messenger(&log, vec![Recorder::new("static", &log)]);
    let bus = m.bus().clone();
    let id = bus.add_middleware(Arc::new(HookMiddleware::new(Recorder::new("live", &log))));
    m.dispatcher()
        .dispatch(PlaceOrder { quantity: 1 })
        .await
        .unwrap();
    assert!(entries(&log).contains(&"live after 10".to_string()));

    log.lock().unwrap().clear();
    assert!(bus.remove_middleware(id));
    assert_eq!(entries(&log), ["live dispose"]);
    assert!(!bus.remove_middleware(id), "already removed");

    log.lock().unwrap().clear();
    m.dispatcher()
        .dispatch(PlaceOrder { quantity: 1 })
        .await
        .unwrap();
    let log = entries(&log);
    assert!(log.iter().all(|l| !l.starts_with("live")), "{log:?}");
    assert!(log.contains(&"static after 10".to_string()));
}

#[tokio::test]
async fn disposing_the_bus_disposes_every_hook_once_and_clears_the_chain() {
    let log = Log::default();
    let m = messenger(
        &log,
        vec![Recorder::new("a", &log), Recorder::new("b", &log)],
    );
    let bus = m.bus().clone();
    bus.add_middleware(Arc::new(HookMiddleware::new(Recorder::new("c", &log))));
    bus.dispose();
    assert_eq!(entries(&log), ["a dispose", "b dispose", "c dispose"]);
    assert!(bus.middleware_ids().is_empty());
    bus.dispose();
    assert_eq!(entries(&log).len(), 3, "dispose is idempotent");
    let err = m
        .dispatcher()
        .dispatch(PlaceOrder { quantity: 1 })
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        DispatchError::Infrastructure(BusError::Disposed(_))
    ));
}

#[tokio::test]
async fn a_hook_middleware_disposes_its_hook_at_most_once() {
    let log = Log::default();
    let mw = HookMiddleware::new(Recorder::new("once", &log));
    mw.dispose();
    mw.dispose();
    assert!(mw.is_disposed());
    assert_eq!(entries(&log), ["once dispose"]);
}

#[tokio::test]
async fn a_dispatch_in_flight_finishes_on_the_chain_it_started_with() {
    let log = Log::default();
    let (release, wait) = tokio::sync::oneshot::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let wait = Arc::new(Mutex::new(Some((wait, started_tx))));
    let m = Messenger::builder()
        .command_handler(move |c: PlaceOrder| {
            let wait = wait.clone();
            async move {
                let pending = wait.lock().unwrap().take();
                if let Some((wait, started)) = pending {
                    let _ = started.send(());
                    let _ = wait.await;
                }
                Ok::<_, OutOfStock>(c.quantity)
            }
        })
        .build()
        .unwrap();
    let bus = m.bus().clone();
    let id = bus.add_middleware(Arc::new(HookMiddleware::new(Recorder::new(
        "removed", &log,
    ))));

    let dispatcher = m.dispatcher();
    let in_flight =
        tokio::spawn(async move { dispatcher.dispatch(PlaceOrder { quantity: 4 }).await });
    started.await.unwrap();
    assert!(bus.remove_middleware(id));
    release.send(()).unwrap();
    assert_eq!(in_flight.await.unwrap().unwrap(), 4);
    assert_eq!(
        entries(&log),
        [
            "removed can_handle Execute",
            "removed before PlaceOrder",
            "removed dispose",
            "removed after 4",
        ]
    );

    log.lock().unwrap().clear();
    m.dispatcher()
        .dispatch(PlaceOrder { quantity: 5 })
        .await
        .unwrap();
    assert!(
        entries(&log).is_empty(),
        "a new dispatch uses the new chain"
    );
}

#[tokio::test]
async fn a_dispatch_from_inside_a_handler_is_an_operation_of_its_own() {
    let log = Log::default();
    let handler_bus: Arc<Mutex<Option<envoi_core::Dispatcher>>> = Arc::default();
    let hb = handler_bus.clone();
    let m = Messenger::builder()
        .command_handler(move |c: PlaceOrder| {
            let hb = hb.clone();
            async move {
                let bus = hb.lock().unwrap().clone();
                let stock = match bus {
                    Some(bus) => bus.ask(Stock).await.map_err(|_| OutOfStock)?,
                    None => 0,
                };
                Ok::<_, OutOfStock>(c.quantity + stock)
            }
        })
        .query_handler(|_: Stock| async { Ok::<_, Infallible>(100) })
        .middleware(HookMiddleware::new(Recorder::new("one", &log)))
        .middleware(HookMiddleware::new(Recorder::new("two", &log)))
        .build()
        .unwrap();
    *handler_bus.lock().unwrap() = Some(m.dispatcher());
    assert_eq!(
        m.dispatcher()
            .dispatch(PlaceOrder { quantity: 1 })
            .await
            .unwrap(),
        101
    );
    assert_eq!(
        entries(&log),
        [
            "one can_handle Execute",
            "one before PlaceOrder",
            "two can_handle Execute",
            "two before PlaceOrder",
            "one can_handle Callback",
            "one before Stock",
            "two can_handle Callback",
            "two before Stock",
            "one after 100",
            "two after 100",
            "one after 101",
            "two after 101",
        ]
    );
    // Break the cycle between the messenger and the handler.
    handler_bus.lock().unwrap().take();
}

#[tokio::test]
async fn can_handle_is_called_once_for_a_message_dispatched_after_the_current_one() {
    let log = Log::default();
    let m = messenger(
        &log,
        vec![
            Recorder::new("a", &log).skipping(),
            Recorder::new("b", &log),
        ],
    );
    m.bus()
        .dispatch_after_current(Envelope::new(PlaceOrder { quantity: 1 }))
        .await
        .unwrap();
    assert_eq!(
        entries(&log),
        [
            "a can_handle Execute",
            "b can_handle Execute",
            "b before PlaceOrder",
            "handler",
            "b after 10",
        ]
    );
}

/// Routed, so the messenger has a retry step.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Ship;
impl Message for Ship {
    const NAME: &'static str = "Ship";
}

#[tokio::test]
async fn after_is_not_called_for_a_received_message_whose_handler_failed_and_is_retried() {
    let log = Log::default();
    let senders = envoi_core::testing::RecordingSenders::default();
    let handler_log = log.clone();
    let m = Messenger::builder()
        .command_handler(move |_: PlaceOrder| {
            let log = handler_log.clone();
            async move {
                log.lock().unwrap().push("handler".into());
                Err::<u32, _>(OutOfStock)
            }
        })
        .route::<Ship>("async")
        .sender_dispatcher(Arc::new(senders.clone()))
        .middleware(HookMiddleware::new(Recorder::new("a", &log)))
        .build()
        .unwrap();
    let received = Envelope::new(PlaceOrder { quantity: 0 })
        .with(envoi_core::stamp::ReceivedStamp::new("async"));
    m.bus()
        .dispatch(received)
        .await
        .expect("scheduled for a retry");
    assert_eq!(senders.sent_to(), ["async"], "sent back for a retry");
    assert_eq!(
        entries(&log),
        ["a can_handle Execute", "a before PlaceOrder", "handler"],
        "the handler failed: no after"
    );
}

/// Records, per stage, whether `after` was given a result, and its type.
struct ResultProbe(Log);

impl Hook for ResultProbe {
    fn after(&self, ctx: &HookContext<'_>, result: Option<&HandlerResult>) {
        let seen = match result {
            None => "none",
            Some(r) if r.downcast_ref::<()>().is_some() => "unit",
            Some(r) if r.downcast_ref::<u32>().is_some() => "u32",
            Some(_) => "other",
        };
        self.0
            .lock()
            .unwrap()
            .push(format!("{} {}", ctx.message_name(), seen));
    }
}

#[tokio::test]
async fn after_gets_a_result_whenever_a_handler_ran_here_events_included() {
    let log = Log::default();
    let m = Messenger::builder()
        .query_handler(|_: Stock| async { Ok::<_, Infallible>(3) })
        .event_handler(|_: OrderPlaced| async { Ok::<_, Infallible>(()) })
        .transport(
            "async",
            Arc::new(envoi_core::transport::in_memory::InMemoryTransport::new()),
        )
        .route::<Ship>("async")
        .middleware(HookMiddleware::new(ResultProbe(log.clone())))
        .build()
        .unwrap();
    m.dispatcher().ask(Stock).await.unwrap();
    m.dispatcher().publish(OrderPlaced).await.unwrap();
    m.bus().dispatch(Envelope::new(Ship)).await.unwrap();
    assert_eq!(
        entries(&log),
        ["Stock u32", "OrderPlaced unit", "Ship none"],
        "an event handled here has its handler's `()`; a message sent to a transport has none"
    );
}
