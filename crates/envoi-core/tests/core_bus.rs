//! The canonical pipeline through a real bus: order, handlers, nested
//! dispatch, runtime middleware changes and typed results.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use envoi_core::middleware::{from_fn, BoxFuture, Middleware, Next};
use envoi_core::stamp::{BusNameStamp, HandledStamp, SentStamp};
use envoi_core::testing::RecordingSenders;
use envoi_core::{
    BuildError, BusError, Command, DispatchError, Envelope, Event, Message, MessageBus,
    MessageKind, Messenger, Query,
};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Deposit(u64);
impl Message for Deposit {
    const NAME: &'static str = "Deposit";
}
impl Command for Deposit {
    type Output = u64;
    type Error = BankError;
}

#[derive(Debug, thiserror::Error, PartialEq)]
enum BankError {
    #[error("amount must be positive")]
    Zero,
    #[error("account frozen")]
    Frozen,
}

#[derive(Debug, Clone)]
struct Balance;
impl Message for Balance {
    const NAME: &'static str = "Balance";
}
impl Query for Balance {
    type Output = String;
    type Error = Infallible;
}

#[derive(Debug, Clone)]
struct Deposited;
impl Message for Deposited {
    const NAME: &'static str = "Deposited";
}
impl Event for Deposited {
    type Error = NotifyError;
}

#[derive(Debug, thiserror::Error)]
#[error("notification failed")]
struct NotifyError;

async fn deposit(cmd: Deposit) -> Result<u64, BankError> {
    match cmd.0 {
        0 => Err(BankError::Zero),
        13 => Err(BankError::Frozen),
        n => Ok(n * 2),
    }
}

/// Logs `<name> in` / `<name> out` around next.
struct Trace(&'static str, Arc<Mutex<Vec<String>>>);

impl Middleware for Trace {
    fn handle<'a>(
        &'a self,
        e: Envelope,
        next: Next<'a>,
    ) -> BoxFuture<'a, envoi_core::Result<Envelope>> {
        Box::pin(async move {
            self.1.lock().unwrap().push(format!("{} in", self.0));
            let out = next.run(e).await;
            self.1.lock().unwrap().push(format!("{} out", self.0));
            out
        })
    }

    fn name(&self) -> std::borrow::Cow<'static, str> {
        self.0.into()
    }
}

#[tokio::test]
async fn a_command_reaches_its_handler_and_is_stamped_with_bus_and_handler() {
    let messenger = Messenger::builder()
        .command_handler(deposit)
        .build()
        .unwrap();
    let out = messenger
        .bus()
        .dispatch(Envelope::new(Deposit(5)))
        .await
        .unwrap();
    assert_eq!(&*out.last::<BusNameStamp>().unwrap().bus, "default");
    let handled = out.last::<HandledStamp>().unwrap();
    assert_eq!(handled.handler, "deposit");
    assert_eq!(handled.result.downcast_ref::<u64>(), Some(&10));
}

#[tokio::test]
async fn user_middleware_runs_in_registration_order_around_the_handler() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let log2 = log.clone();
    let messenger = Messenger::builder()
        .command_handler(move |cmd: Deposit| {
            let log = log2.clone();
            async move {
                log.lock().unwrap().push("handler".into());
                deposit(cmd).await
            }
        })
        .middleware(Trace("a", log.clone()))
        .middleware(Trace("b", log.clone()))
        .build()
        .unwrap();
    messenger.dispatcher().dispatch(Deposit(1)).await.unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        ["a in", "b in", "handler", "b out", "a out"]
    );
    let pipeline = messenger.bus().pipeline();
    assert_eq!(
        pipeline,
        [
            "AddBusNameStamp",
            "DispatchAfterCurrentBus",
            "FailedMessageProcessing",
            "a",
            "b",
            "SendMessage (no routes)",
            "Retry (not configured)",
            "HandleMessage"
        ]
    );
}

#[tokio::test]
async fn callers_match_on_their_domain_error_after_a_stack_of_middlewares() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let messenger = Messenger::builder()
        .command_handler(deposit)
        .middleware(Trace("a", log.clone()))
        .middleware(Trace("b", log.clone()))
        .middleware(from_fn("passthrough", |e, next| next.run(e)))
        .build()
        .unwrap();
    let bank = messenger.dispatcher();
    assert_eq!(bank.dispatch(Deposit(4)).await.unwrap(), 8);
    match bank.dispatch(Deposit(13)).await {
        Err(DispatchError::Domain(BankError::Frozen)) => {}
        other => panic!("expected the domain error, got {other:?}"),
    }
    match bank.dispatch(Deposit(0)).await {
        Err(DispatchError::Domain(e)) => assert_eq!(e, BankError::Zero),
        other => panic!("expected the domain error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_command_or_query_without_handler_is_an_infrastructure_error() {
    let messenger = Messenger::builder().build().unwrap();
    match messenger.dispatcher().dispatch(Deposit(1)).await {
        Err(DispatchError::Infrastructure(BusError::NoHandler { message, kind })) => {
            assert_eq!(message, "Deposit");
            assert_eq!(kind, MessageKind::Command);
        }
        other => panic!("expected NoHandler, got {other:?}"),
    }
    match messenger.dispatcher().ask(Balance).await {
        Err(DispatchError::Infrastructure(BusError::NoHandler { kind, .. })) => {
            assert_eq!(kind, MessageKind::Query)
        }
        other => panic!("expected NoHandler, got {other:?}"),
    }
}

#[tokio::test]
async fn an_event_may_have_no_handler() {
    let messenger = Messenger::builder().build().unwrap();
    messenger.dispatcher().publish(Deposited).await.unwrap();
}

#[tokio::test]
async fn a_query_returns_its_handlers_answer() {
    let messenger = Messenger::builder()
        .query_handler(|_: Balance| async { Ok::<_, Infallible>("100 EUR".to_string()) })
        .build()
        .unwrap();
    assert_eq!(
        messenger.dispatcher().ask(Balance).await.unwrap(),
        "100 EUR"
    );
}

#[tokio::test]
async fn every_event_handler_runs_and_failures_are_collected() {
    let ran = Arc::new(AtomicUsize::new(0));
    let (r1, r2, r3) = (ran.clone(), ran.clone(), ran.clone());
    let messenger = Messenger::builder()
        .event_handler(move |_: Deposited| {
            let r = r1.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(NotifyError)
            }
        })
        .event_handler(move |_: Deposited| {
            let r = r2.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                Ok::<(), NotifyError>(())
            }
        })
        .event_handler(move |_: Deposited| {
            let r = r3.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(NotifyError)
            }
        })
        .build()
        .unwrap();
    let err = messenger
        .bus()
        .dispatch(Envelope::event(Deposited))
        .await
        .unwrap_err();
    assert_eq!(ran.load(Ordering::SeqCst), 3);
    match err {
        BusError::HandlerFailed { envelope, errors } => {
            assert_eq!(errors.len(), 2);
            assert_eq!(
                envelope.all::<HandledStamp>().count(),
                1,
                "the one that succeeded"
            );
        }
        other => panic!("expected HandlerFailed, got {other:?}"),
    }
    match messenger.dispatcher().publish(Deposited).await {
        Err(DispatchError::Domain(errors)) => assert_eq!(errors.0.len(), 2),
        other => panic!("expected domain errors, got {other:?}"),
    }
}

#[test]
fn a_second_handler_for_a_command_fails_the_build() {
    let err = Messenger::builder()
        .command_handler(deposit)
        .command_handler(deposit)
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        BuildError::DuplicateHandler {
            message: "Deposit",
            kind: MessageKind::Command
        }
    );
    assert!(err.to_string().contains("exactly one"));
}

#[test]
fn a_route_to_an_unknown_transport_fails_the_build() {
    let err = Messenger::builder()
        .route::<Deposit>("nowhere")
        .build()
        .unwrap_err();
    assert!(
        matches!(err, BuildError::UnknownTransport { .. }),
        "{err:?}"
    );
}

#[test]
fn two_buses_with_one_name_fail_the_build() {
    let err = Messenger::builder()
        .bus("default", |b| b)
        .build()
        .unwrap_err();
    assert_eq!(err, BuildError::DuplicateBus("default".into()));
}

#[tokio::test]
async fn named_buses_stamp_their_own_name_and_have_their_own_middleware() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let messenger = Messenger::builder()
        .command_handler(deposit)
        .bus("audit.bus", |b| b.middleware(Trace("audit", log.clone())))
        .build()
        .unwrap();
    let audit = messenger.bus_named("audit.bus").unwrap();
    let out = audit.dispatch(Envelope::new(Deposit(1))).await.unwrap();
    assert_eq!(&*out.last::<BusNameStamp>().unwrap().bus, "audit.bus");
    assert_eq!(*log.lock().unwrap(), ["audit in", "audit out"]);
    messenger
        .bus()
        .dispatch(Envelope::new(Deposit(1)))
        .await
        .unwrap();
    assert_eq!(log.lock().unwrap().len(), 2, "the default bus has no audit");
    assert!(messenger.debug().contains("bus audit.bus"));
}

#[tokio::test]
async fn a_routed_message_is_sent_not_handled() {
    let senders = RecordingSenders::default();
    let handled = Arc::new(AtomicUsize::new(0));
    let h = handled.clone();
    let messenger = Messenger::builder()
        .command_handler(move |cmd: Deposit| {
            let h = h.clone();
            async move {
                h.fetch_add(1, Ordering::SeqCst);
                deposit(cmd).await
            }
        })
        .route::<Deposit>("async")
        .sender_dispatcher(Arc::new(senders.clone()))
        .build()
        .unwrap();
    let out = messenger
        .bus()
        .dispatch(Envelope::new(Deposit(3)))
        .await
        .unwrap();
    assert_eq!(out.last::<SentStamp>().unwrap().transport, "async");
    assert_eq!(senders.sent_to(), ["async"]);
    assert_eq!(handled.load(Ordering::SeqCst), 0);
}

/// A command whose handler dispatches another one, stamped to wait.
#[derive(Debug, Clone)]
struct Open;
impl Message for Open {
    const NAME: &'static str = "Open";
}
impl Command for Open {
    type Output = ();
    type Error = BankError;
}

type Log = Arc<Mutex<Vec<String>>>;
type BusSlot = Arc<Mutex<Option<MessageBus>>>;

fn nested_setup(fail_outer: bool) -> (Messenger, Log, BusSlot) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let bus_slot: BusSlot = Arc::new(Mutex::new(None));
    let (l1, l2, slot) = (log.clone(), log.clone(), bus_slot.clone());
    let messenger = Messenger::builder()
        .command_handler(move |_: Open| {
            let (log, slot) = (l1.clone(), slot.clone());
            async move {
                let bus = slot.lock().unwrap().clone().expect("bus set");
                bus.dispatch_after_current(Envelope::new(Deposit(1)))
                    .await
                    .expect("deferred dispatch is accepted");
                log.lock().unwrap().push("open handled".to_string());
                if fail_outer {
                    Err(BankError::Frozen)
                } else {
                    Ok(())
                }
            }
        })
        .command_handler(move |cmd: Deposit| {
            let log = l2.clone();
            async move {
                log.lock().unwrap().push("deposit handled".to_string());
                deposit(cmd).await
            }
        })
        .middleware(Trace("outer", log.clone()))
        .build()
        .unwrap();
    *bus_slot.lock().unwrap() = Some(messenger.bus().clone());
    (messenger, log, bus_slot)
}

#[tokio::test]
async fn a_deferred_dispatch_is_handled_after_the_outer_dispatch_finishes() {
    let (messenger, log, _slot) = nested_setup(false);
    messenger.dispatcher().dispatch(Open).await.unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        [
            "outer in",
            "open handled",
            "outer out",
            "outer in",
            "deposit handled",
            "outer out"
        ]
    );
}

#[tokio::test]
async fn deferred_dispatches_are_dropped_when_the_outer_dispatch_fails() {
    let (messenger, log, _slot) = nested_setup(true);
    let err = messenger.dispatcher().dispatch(Open).await.unwrap_err();
    assert!(matches!(err, DispatchError::Domain(BankError::Frozen)));
    assert!(!log.lock().unwrap().iter().any(|l| l == "deposit handled"));
}

/// Blocks the handler until the test releases it.
struct Gate {
    entered: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

#[tokio::test]
async fn middleware_can_be_added_and_removed_at_runtime_without_affecting_dispatches_in_flight() {
    let gate = Arc::new(Gate {
        entered: tokio::sync::Notify::new(),
        release: tokio::sync::Notify::new(),
    });
    let g = gate.clone();
    let messenger = Messenger::builder()
        .command_handler(move |cmd: Deposit| {
            let g = g.clone();
            async move {
                if cmd.0 == 99 {
                    g.entered.notify_one();
                    g.release.notified().await;
                }
                deposit(cmd).await
            }
        })
        .build()
        .unwrap();
    let bus = messenger.bus().clone();
    let log = Arc::new(Mutex::new(Vec::new()));
    let id = bus.add_middleware(Arc::new(Trace("live", log.clone())));

    // A dispatch starts with the chain [live] and blocks in its handler.
    let in_flight = tokio::spawn({
        let bus = bus.clone();
        async move { bus.dispatch(Envelope::new(Deposit(99))).await }
    });
    gate.entered.notified().await;
    assert!(bus.remove_middleware(id));
    assert!(!bus.remove_middleware(id), "already removed");
    gate.release.notify_one();
    in_flight.await.unwrap().unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        ["live in", "live out"],
        "finished on its chain"
    );

    // New dispatches no longer see it.
    bus.dispatch(Envelope::new(Deposit(1))).await.unwrap();
    assert_eq!(log.lock().unwrap().len(), 2);
    assert!(bus.middleware_ids().is_empty());
}

/// Counts dispose calls.
struct Disposable(Arc<AtomicUsize>);

impl Middleware for Disposable {
    fn handle<'a>(
        &'a self,
        e: Envelope,
        next: Next<'a>,
    ) -> BoxFuture<'a, envoi_core::Result<Envelope>> {
        Box::pin(next.run(e))
    }
    fn dispose(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn disposing_a_bus_disposes_its_middleware_once_and_refuses_dispatches() {
    let disposed = Arc::new(AtomicUsize::new(0));
    let messenger = Messenger::builder()
        .command_handler(deposit)
        .middleware(Disposable(disposed.clone()))
        .build()
        .unwrap();
    let bus = messenger.bus();
    bus.add_middleware(Arc::new(Disposable(disposed.clone())));
    bus.dispose();
    bus.dispose();
    assert_eq!(disposed.load(Ordering::SeqCst), 2);
    assert!(bus.middleware_ids().is_empty());
    assert!(matches!(
        bus.dispatch(Envelope::new(Deposit(1))).await,
        Err(BusError::Disposed(_))
    ));
}

/// A handler type, borrowing the message.
struct Teller {
    fee: u64,
}

impl envoi_core::Handler<Deposit> for Teller {
    type Output = u64;
    type Error = BankError;
    async fn handle(&self, cmd: &Deposit) -> Result<u64, BankError> {
        Ok(cmd.0 - self.fee)
    }
}

#[tokio::test]
async fn handler_types_work_like_functions_and_are_named_after_their_type() {
    let messenger = Messenger::builder()
        .command_handler(Teller { fee: 1 })
        .build()
        .unwrap();
    let out = messenger
        .bus()
        .dispatch(Envelope::new(Deposit(10)))
        .await
        .unwrap();
    let handled = out.last::<HandledStamp>().unwrap();
    assert_eq!(handled.handler, "Teller");
    assert_eq!(handled.result.downcast_ref::<u64>(), Some(&9));
}

/// Takes part only in deposits of more than 100, and records what it saw.
struct BigDepositsOnly(Arc<Mutex<Vec<u64>>>);

impl Middleware for BigDepositsOnly {
    fn takes_part(&self, envelope: &Envelope) -> bool {
        envelope.message::<Deposit>().is_some_and(|d| d.0 > 100)
    }

    fn handle<'a>(
        &'a self,
        e: Envelope,
        next: Next<'a>,
    ) -> BoxFuture<'a, Result<Envelope, BusError>> {
        if let Some(d) = e.message::<Deposit>() {
            self.0.lock().unwrap().push(d.0);
        }
        Box::pin(next.run(e))
    }
}

#[tokio::test]
async fn a_middleware_that_takes_no_part_is_skipped_and_the_dispatch_still_completes() {
    let messenger = Messenger::builder()
        .command_handler(deposit)
        .build()
        .unwrap();
    let bus = messenger.bus().clone();
    let seen = Arc::new(Mutex::new(Vec::new()));
    bus.add_middleware(Arc::new(BigDepositsOnly(seen.clone())));

    // Not taking part: the chain is skipped, the handler still runs.
    let out = bus.dispatch(Envelope::new(Deposit(5))).await.unwrap();
    assert!(out.has::<HandledStamp>());
    assert_eq!(out.last::<BusNameStamp>().map(|s| &*s.bus), Some("default"));
    assert!(seen.lock().unwrap().is_empty(), "skipped");

    // Taking part: the chain runs as usual.
    let out = bus.dispatch(Envelope::new(Deposit(500))).await.unwrap();
    assert!(out.has::<HandledStamp>());
    assert_eq!(*seen.lock().unwrap(), [500]);

    // A failing handler behind a skipped chain still reports its error.
    let err = bus.dispatch(Envelope::new(Deposit(13))).await.unwrap_err();
    assert!(matches!(err, BusError::HandlerFailed { .. }), "{err:?}");
    assert_eq!(*seen.lock().unwrap(), [500]);
}

#[tokio::test]
async fn the_chain_starts_at_the_first_middleware_that_takes_part() {
    let messenger = Messenger::builder()
        .command_handler(deposit)
        .build()
        .unwrap();
    let bus = messenger.bus().clone();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::new(Mutex::new(Vec::new()));
    bus.add_middleware(Arc::new(BigDepositsOnly(seen.clone())));
    bus.add_middleware(Arc::new(Trace("trace", log.clone())));

    bus.dispatch(Envelope::new(Deposit(5))).await.unwrap();
    assert!(seen.lock().unwrap().is_empty(), "the idle one is skipped");
    assert_eq!(*log.lock().unwrap(), ["trace in", "trace out"]);

    bus.dispatch(Envelope::new(Deposit(200))).await.unwrap();
    assert_eq!(*seen.lock().unwrap(), [200]);
    assert_eq!(log.lock().unwrap().len(), 4, "both ran");
}

/// A command carrying a token: while anything keeps the command, the token
/// is alive.
#[derive(Debug, Clone)]
struct Note(Arc<()>);
impl Message for Note {
    const NAME: &'static str = "Note";
}
impl Command for Note {
    type Output = ();
    type Error = Infallible;
}

/// A messenger whose `Open` handler (and, for events, the first of two
/// `Deposited` handlers) defers a `Note` and then fails; the weak tokens of
/// the deferred notes are collected in the returned list.
fn deferring_then_failing(
    with_middleware: bool,
) -> (Messenger, Arc<Mutex<Vec<std::sync::Weak<()>>>>) {
    let tokens: Arc<Mutex<Vec<std::sync::Weak<()>>>> = Arc::default();
    let slot: BusSlot = Arc::default();
    let defer_and_fail = {
        let (tokens, slot) = (tokens.clone(), slot.clone());
        move || {
            let (tokens, slot) = (tokens.clone(), slot.clone());
            async move {
                let token = Arc::new(());
                tokens.lock().unwrap().push(Arc::downgrade(&token));
                let bus = slot.lock().unwrap().clone().expect("bus set");
                bus.dispatch_after_current(Envelope::new(Note(token)))
                    .await
                    .expect("deferred dispatch is accepted");
            }
        }
    };
    let (open, event) = (defer_and_fail.clone(), defer_and_fail);
    let mut builder = Messenger::builder()
        .command_handler(move |_: Open| {
            let defer = open();
            async move {
                defer.await;
                Err::<(), _>(BankError::Frozen)
            }
        })
        .event_handler(move |_: Deposited| {
            let defer = event();
            async move {
                defer.await;
                Err::<(), _>(NotifyError)
            }
        })
        .event_handler(|_: Deposited| async { Ok::<(), NotifyError>(()) })
        .command_handler(|note: Note| async move {
            drop(note.0);
            Ok::<_, Infallible>(())
        });
    if with_middleware {
        builder = builder.middleware(from_fn("pass", |e, next| next.run(e)));
    }
    let messenger = builder.build().unwrap();
    *slot.lock().unwrap() = Some(messenger.bus().clone());
    (messenger, tokens)
}

#[tokio::test]
async fn what_a_failed_handler_deferred_is_dropped_not_kept() {
    for with_middleware in [false, true] {
        let (messenger, tokens) = deferring_then_failing(with_middleware);
        messenger
            .bus()
            .dispatch(Envelope::new(Open))
            .await
            .unwrap_err();
        messenger
            .bus()
            .dispatch(Envelope::event(Deposited))
            .await
            .unwrap_err();
        let tokens = tokens.lock().unwrap();
        assert_eq!(tokens.len(), 2);
        for (i, token) in tokens.iter().enumerate() {
            assert!(
                token.upgrade().is_none(),
                "deferred message {i} (middleware: {with_middleware}) is still held"
            );
        }
    }
}

#[test]
fn debug_names_a_closure_handler_by_the_function_it_was_written_in() {
    fn configure() -> Messenger {
        Messenger::builder()
            .command_handler(|d: Deposit| async move { Ok::<_, BankError>(d.0) })
            .build()
            .unwrap()
    }
    let listing = configure().debug();
    assert!(!listing.contains("{{closure}}"), "{listing}");
    assert!(
        listing.contains("Deposit: closure in configure"),
        "{listing}"
    );
}
