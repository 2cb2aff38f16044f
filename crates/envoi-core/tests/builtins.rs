//! The further built-in middleware on a real bus: validation, logging,
//! correlation/causation ids, deduplication and the circuit breaker.

use envoi_core::testing::Within;

/// The longest a test waits for a worker to stop before it fails (real
/// time, whatever the tokio clock does).
const WAIT: std::time::Duration = std::time::Duration::from_secs(120);

use envoi_core::testing::Abilities;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoi_core::error::BoxError;
use envoi_core::failure::MultiplierRetryStrategy;
use envoi_core::middleware::circuit_breaker::CircuitBreaker;
use envoi_core::middleware::correlation::{CausationIdStamp, Correlation, CorrelationIdStamp};
use envoi_core::middleware::dedup::{DedupClaim, DedupStore, Deduplicate, InMemoryDedupStore};
use envoi_core::middleware::from_fn;
use envoi_core::middleware::logging::Logging;
use envoi_core::middleware::validation::{Validate, Validation};
use envoi_core::middleware::BoxFuture;
use envoi_core::stamp::{MessageIdStamp, ReceivedStamp};
use envoi_core::worker::{Outcome, Worker, WorkerEvent};
use envoi_core::{Command, DispatchError, Dispatcher, Envelope, Message, Messenger};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Charge {
    reference: String,
    amount: i64,
}
impl Message for Charge {
    const NAME: &'static str = "Charge";
}
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("gateway down")]
struct GatewayDown;
impl Command for Charge {
    type Output = ();
    type Error = GatewayDown;
}
impl Validate for Charge {
    fn validate(&self) -> Result<(), String> {
        if self.amount > 0 {
            Ok(())
        } else {
            Err(format!("amount must be positive, got {}", self.amount))
        }
    }
}

fn charge(reference: &str, amount: i64) -> Charge {
    Charge {
        reference: reference.into(),
        amount,
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Checkout {
    reference: String,
}
impl Message for Checkout {
    const NAME: &'static str = "Checkout";
}
impl Command for Checkout {
    type Output = ();
    type Error = GatewayDown;
}

/// Counts handled charges.
fn counting_handler(
    count: &Arc<AtomicU32>,
) -> impl Fn(Charge) -> std::future::Ready<Result<(), GatewayDown>> {
    let count = count.clone();
    move |_: Charge| {
        count.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(()))
    }
}

/// A worker that reads `transport` until it is empty.
fn draining(messenger: &Messenger, transport: &str) -> Worker {
    Worker::builder(messenger)
        .receiver(transport)
        .stop_when_empty()
        .idle_sleep(Duration::from_millis(5))
        .build()
        .unwrap()
}

async fn drain(messenger: &Messenger, transport: &str) {
    draining(messenger, transport)
        .run()
        .within(WAIT, "the worker to stop")
        .await;
}

// ----- validation -----

#[tokio::test]
async fn an_invalid_message_is_refused_before_the_handler_with_a_clear_error() {
    let count = Arc::new(AtomicU32::new(0));
    let m = Messenger::builder()
        .command_handler(counting_handler(&count))
        .middleware(Validation::new().message::<Charge>())
        .build()
        .unwrap();
    let err = m.dispatcher().dispatch(charge("r", -3)).await.unwrap_err();
    match err {
        DispatchError::Infrastructure(error) => {
            let invalid = error
                .middleware_error::<envoi_core::middleware::validation::Invalid>()
                .unwrap_or_else(|| panic!("not invalid: {error}"));
            assert_eq!(invalid.message, "Charge");
            assert_eq!(invalid.reason, "amount must be positive, got -3");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(count.load(Ordering::SeqCst), 0);
    m.dispatcher().dispatch(charge("r", 3)).await.unwrap();
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_invalid_routed_message_never_reaches_the_transport() {
    let m = Messenger::builder()
        .transport_dsn("async", "in-memory://")
        .route::<Charge>("async")
        .middleware(Validation::new().message::<Charge>())
        .build_async()
        .await
        .unwrap();
    assert!(m.dispatcher().dispatch(charge("r", 0)).await.is_err());
    let queue = m.transport("async").unwrap();
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);
}

// ----- logging -----

#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<String>>>);

struct Text<'a>(&'a mut String);
impl tracing::field::Visit for Text<'_> {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn fmt::Debug) {
        self.0.push_str(&format!("{}={:?} ", f.name(), v));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() == "envoi::bus" {
            let mut s = format!("{} ", event.metadata().level());
            event.record(&mut Text(&mut s));
            self.0.lock().unwrap().push(s);
        }
    }
}

#[tokio::test]
async fn logging_reports_the_outcome_of_each_dispatch_without_the_payload() {
    use tracing_subscriber::layer::SubscriberExt;
    let events = Events::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(events.clone()));
    let m = Messenger::builder()
        .command_handler(|c: Charge| async move {
            if c.amount > 100 {
                Err(GatewayDown)
            } else {
                Ok(())
            }
        })
        .middleware(Logging::new())
        .build()
        .unwrap();
    m.dispatcher()
        .dispatch(charge("secret-ref", 5))
        .await
        .unwrap();
    m.bus()
        .dispatch(Envelope::new(charge("secret-ref", 500)).with(ReceivedStamp::new("async")))
        .await
        .unwrap_err();
    let events = events.0.lock().unwrap().clone();
    assert_eq!(events.len(), 4, "{events:?}");
    assert!(events[1].starts_with("INFO"), "{}", events[1]);
    assert!(events[1].contains("message=\"Charge\"") && events[1].contains("handled"));
    assert!(events[2].contains("received=\"async\""), "{}", events[2]);
    assert!(events[3].starts_with("WARN") && events[3].contains("gateway down"));
    assert!(
        events.iter().all(|e| !e.contains("secret-ref")),
        "{events:?}"
    );
}

// ----- correlation -----

/// Records every envelope that passes.
fn recorder(log: &Arc<Mutex<Vec<Envelope>>>) -> impl envoi_core::Middleware {
    let log = log.clone();
    from_fn("record", move |envelope, next| {
        log.lock().unwrap().push(envelope.clone());
        next.run(envelope)
    })
}

#[tokio::test]
async fn a_message_dispatched_by_a_handler_carries_its_correlation_and_causation_across_a_transport(
) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let dispatcher: Arc<Mutex<Option<Dispatcher>>> = Arc::default();
    let d = dispatcher.clone();
    let m = Messenger::builder()
        .command_handler(move |c: Checkout| {
            let d = d.lock().unwrap().clone();
            async move {
                match d {
                    Some(d) => d
                        .dispatch(charge(&c.reference, 10))
                        .await
                        .map_err(|_| GatewayDown),
                    None => Err(GatewayDown),
                }
            }
        })
        .command_handler(|_: Charge| async { Ok::<_, GatewayDown>(()) })
        .transport_dsn("async", "in-memory://?serialize=true")
        .route::<Charge>("async")
        .middleware(Correlation)
        .middleware(recorder(&seen))
        .build_async()
        .await
        .unwrap();
    *dispatcher.lock().unwrap() = Some(m.dispatcher());

    m.dispatcher()
        .dispatch(Checkout {
            reference: "o-1".into(),
        })
        .await
        .unwrap();
    drain(&m, "async").await;

    let seen = seen.lock().unwrap().clone();
    let checkout = seen
        .iter()
        .find(|e| e.message::<Checkout>().is_some())
        .unwrap();
    let received = seen
        .iter()
        .find(|e| e.message::<Charge>().is_some() && e.has::<ReceivedStamp>())
        .expect("the worker handled the charge");
    let checkout_id = checkout.last::<MessageIdStamp>().unwrap().id;
    let conversation = checkout.last::<CorrelationIdStamp>().unwrap().id;
    assert_eq!(conversation, checkout_id, "the first message starts it");
    assert_eq!(
        received.last::<CorrelationIdStamp>().unwrap().id,
        conversation
    );
    assert_eq!(received.last::<CausationIdStamp>().unwrap().id, checkout_id);
    assert_ne!(received.last::<MessageIdStamp>().unwrap().id, checkout_id);
    dispatcher.lock().unwrap().take();
}

// ----- deduplication -----

/// Deduplicates charges by their reference for an hour.
fn dedup_by_reference() -> Deduplicate {
    Deduplicate::new(Duration::from_secs(3600)).key(|c: &Charge| c.reference.clone())
}

#[tokio::test]
async fn a_duplicate_delivered_by_a_transport_is_acked_without_running_the_handler() {
    let count = Arc::new(AtomicU32::new(0));
    let m = Messenger::builder()
        .command_handler(counting_handler(&count))
        .transport_dsn("async", "in-memory://?serialize=true")
        .route::<Charge>("async")
        .middleware(dedup_by_reference())
        .build_async()
        .await
        .unwrap();
    let bus = m.dispatcher();
    bus.dispatch(charge("pay-1", 5)).await.unwrap();
    bus.dispatch(charge("pay-1", 5)).await.unwrap();
    bus.dispatch(charge("pay-2", 5)).await.unwrap();
    let queue = m.transport("async").unwrap();
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        3,
        "the sender side does not drop"
    );
    drain(&m, "async").await;
    assert_eq!(count.load(Ordering::SeqCst), 2);
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        0,
        "the duplicate was acked"
    );
}

#[tokio::test]
async fn a_delivery_its_transport_marks_as_redelivered_is_handled_while_a_dead_consumer_claims_its_key(
) {
    let count = Arc::new(AtomicU32::new(0));
    let store = Arc::new(InMemoryDedupStore::new());
    let m = Messenger::builder()
        .command_handler(counting_handler(&count))
        .transport_dsn("async", "in-memory://?serialize=true")
        .route::<Charge>("async")
        .middleware(dedup_by_reference().store_arc(store.clone()))
        .build_async()
        .await
        .unwrap();
    // The consumer that died mid-handling claimed the key.
    let dead = DedupClaim::new(uuid::Uuid::new_v4());
    assert!(store
        .insert("Charge:pay-1", Duration::from_secs(20), dead)
        .await
        .unwrap());
    let bus = m.dispatcher();
    bus.dispatch(charge("pay-1", 5)).await.unwrap();
    bus.dispatch(charge("pay-1", 5)).await.unwrap();
    let mut got = m
        .transport("async")
        .unwrap()
        .receiver()
        .get(2)
        .await
        .unwrap();
    assert_eq!(got.len(), 2);
    let redelivered = got.pop().unwrap().mark_redelivered();
    let copy = got.pop().unwrap();

    let outcome = envoi_core::worker::consume_one(&m, "async", copy)
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Handled), "{outcome:?}");
    assert_eq!(count.load(Ordering::SeqCst), 0, "a copy is a duplicate");
    envoi_core::worker::consume_one(&m, "async", redelivered)
        .await
        .unwrap();
    assert_eq!(count.load(Ordering::SeqCst), 1, "the redelivery is handled");
}

/// Remembers keys in memory but cannot forget them.
struct StuckStore(InMemoryDedupStore);
impl DedupStore for StuckStore {
    fn insert<'a>(
        &'a self,
        key: &'a str,
        window: Duration,
        claim: DedupClaim,
    ) -> BoxFuture<'a, Result<bool, BoxError>> {
        self.0.insert(key, window, claim)
    }
    fn remove<'a>(&'a self, _: &'a str, _: uuid::Uuid) -> BoxFuture<'a, Result<(), BoxError>> {
        Box::pin(async { Err("store down".into()) })
    }
}

#[tokio::test]
async fn a_store_that_cannot_forget_a_failed_message_leaves_the_handler_failure_to_the_worker() {
    let m = Messenger::builder()
        .command_handler(|_: Charge| async { Err::<(), _>(GatewayDown) })
        .transport_dsn("async", "in-memory://")
        .transport_dsn("failed", "in-memory://")
        .route::<Charge>("async")
        .failure_transport("failed")
        .default_retry_strategy(MultiplierRetryStrategy {
            max_retries: 0,
            ..Default::default()
        })
        .middleware(dedup_by_reference().store(StuckStore(InMemoryDedupStore::new())))
        .build_async()
        .await
        .unwrap();
    m.dispatcher().dispatch(charge("pay-1", 5)).await.unwrap();
    let worker = draining(&m, "async");
    let mut events = worker.subscribe();
    worker.run().within(WAIT, "the worker to stop").await;
    let mut failures = Vec::new();
    while let Ok(event) = events.try_recv() {
        if let WorkerEvent::Failed {
            kind, parked_in, ..
        } = event
        {
            failures.push((kind.into_owned(), parked_in));
        }
    }
    assert_eq!(
        failures,
        [("handler".to_string(), Some("failed".to_string()))]
    );
    let failed = m.transport("failed").unwrap();
    assert_eq!(
        failed.counter().message_count().await.unwrap(),
        1,
        "parked once, by the retry step"
    );
}

#[tokio::test]
async fn a_retry_whose_key_could_not_be_forgotten_crosses_the_transport_and_is_handled() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let m = Messenger::builder()
        // Fails the first time, succeeds the second.
        .command_handler(move |_: Charge| {
            let first = c.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    Err(GatewayDown)
                } else {
                    Ok(())
                }
            }
        })
        .transport_dsn("async", "in-memory://?serialize=true")
        .route::<Charge>("async")
        .default_retry_strategy(MultiplierRetryStrategy {
            max_retries: 1,
            delay: Duration::ZERO,
            jitter: 0.0,
            ..Default::default()
        })
        .middleware(dedup_by_reference().store(StuckStore(InMemoryDedupStore::new())))
        .build_async()
        .await
        .unwrap();
    m.dispatcher().dispatch(charge("pay-1", 5)).await.unwrap();
    drain(&m, "async").await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the retry was handled, not acknowledged as a duplicate"
    );
    m.dispatcher().dispatch(charge("pay-1", 5)).await.unwrap();
    drain(&m, "async").await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "another message with the key is a duplicate"
    );
    let queue = m.transport("async").unwrap();
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);
}

// ----- circuit breaker -----

#[tokio::test(start_paused = true)]
async fn the_circuit_opens_after_consecutive_failures_then_lets_a_trial_through_after_the_cool_down(
) {
    let failing = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicU32::new(0));
    let (f, c) = (failing.clone(), calls.clone());
    let m = Messenger::builder()
        .command_handler(move |_: Charge| {
            c.fetch_add(1, Ordering::SeqCst);
            let fail = f.load(Ordering::SeqCst);
            async move {
                if fail {
                    Err(GatewayDown)
                } else {
                    Ok(())
                }
            }
        })
        .middleware(CircuitBreaker::new(3, Duration::from_secs(30)))
        .build()
        .unwrap();
    let bus = m.dispatcher();
    for _ in 0..3 {
        assert_eq!(
            bus.dispatch(charge("r", 1)).await.unwrap_err().domain(),
            Some(&GatewayDown)
        );
    }
    match bus.dispatch(charge("r", 1)).await.unwrap_err() {
        DispatchError::Infrastructure(error)
            if error
                .middleware_error::<envoi_core::middleware::circuit_breaker::CircuitOpen>()
                .is_some() =>
        {
            let open = error
                .middleware_error::<envoi_core::middleware::circuit_breaker::CircuitOpen>()
                .unwrap();
            assert_eq!(open.message, "Charge");
            assert_eq!(open.retry_in, Duration::from_secs(30));
        }
        other => panic!("expected a fast failure, got {other:?}"),
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3, "the handler was spared");

    tokio::time::advance(Duration::from_secs(30)).await;
    failing.store(false, Ordering::SeqCst);
    bus.dispatch(charge("r", 1)).await.unwrap();
    bus.dispatch(charge("r", 1)).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 5);
}
