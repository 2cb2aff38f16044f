//! The canonical order is declared once: the bus lists its pipeline in it,
//! and a `MiddlewareStack` assembled by hand from the bus's public steps
//! (`MessageBus::stack`) does what the bus does, message for message.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use envoi_core::failure::MultiplierRetryStrategy;
use envoi_core::middleware::{from_fn, MiddlewareStack};
use envoi_core::pipeline::canonical::{Step, CANONICAL};
use envoi_core::stamp::{BusNameStamp, ReceivedStamp};
use envoi_core::testing::Abilities;
use envoi_core::transport::in_memory::InMemoryTransport;
use envoi_core::{Command, Envelope, Event, Message, MessageBus, Messenger, Result};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Charge(u32);
impl Message for Charge {
    const NAME: &'static str = "Charge";
}
impl Command for Charge {
    type Output = u32;
    type Error = Declined;
}

#[derive(Debug, thiserror::Error)]
#[error("declined")]
struct Declined;

/// Routed to `queue`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Ship;
impl Message for Ship {
    const NAME: &'static str = "Ship";
}
impl Command for Ship {
    type Output = ();
    type Error = Declined;
}

/// Two handlers: one defers a `Charge(0)`, the other fails when asked.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Placed {
    fail: bool,
}
impl Message for Placed {
    const NAME: &'static str = "Placed";
}
impl Event for Placed {
    type Error = Declined;
}

struct World {
    messenger: Messenger,
    queue: Arc<InMemoryTransport>,
    failed: Arc<InMemoryTransport>,
    charges: Arc<AtomicUsize>,
    /// What the user middleware saw on the way in: whether the bus name
    /// was stamped (step 1 runs before it).
    saw: Arc<Mutex<Vec<bool>>>,
}

fn world(max_retries: u32) -> World {
    let queue = Arc::new(InMemoryTransport::new());
    let failed = Arc::new(InMemoryTransport::new());
    let charges = Arc::new(AtomicUsize::new(0));
    let saw: Arc<Mutex<Vec<bool>>> = Arc::default();
    let slot: Arc<Mutex<Option<MessageBus>>> = Arc::default();
    let counted = charges.clone();
    let deferring = slot.clone();
    let seen = saw.clone();
    let messenger = Messenger::builder()
        .command_handler(move |c: Charge| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if c.0 == 13 {
                    Err(Declined)
                } else {
                    Ok(c.0 * 2)
                }
            }
        })
        .command_handler(|_: Ship| async { Ok(()) })
        .event_handler(move |_: Placed| {
            let slot = deferring.clone();
            async move {
                let bus = slot.lock().unwrap().clone().expect("set");
                bus.dispatch_after_current(Envelope::new(Charge(0)))
                    .await
                    .expect("deferred");
                Ok(())
            }
        })
        .event_handler(|p: Placed| async move {
            if p.fail {
                Err(Declined)
            } else {
                Ok(())
            }
        })
        .middleware(from_fn("watch", move |e, next| {
            seen.lock().unwrap().push(e.has::<BusNameStamp>());
            next.run(e)
        }))
        .transport("queue", queue.clone())
        .transport("failed", failed.clone())
        .route::<Ship>("queue")
        .message::<Placed>()
        .default_retry_strategy(MultiplierRetryStrategy {
            max_retries,
            delay: std::time::Duration::ZERO,
            jitter: 0.0,
            ..Default::default()
        })
        .failure_transport("failed")
        .build()
        .unwrap();
    *slot.lock().unwrap() = Some(messenger.bus().clone());
    World {
        messenger,
        queue,
        failed,
        charges,
        saw,
    }
}

/// What a dispatch did, comparable between the bus and its stack: the
/// stamp names of the envelope that came back (or the error's kind), the
/// messages stored per transport, the charges handled, and what the user
/// middleware saw.
#[derive(Debug, PartialEq)]
struct Effects {
    result: std::result::Result<Vec<&'static str>, &'static str>,
    queued: u64,
    parked: u64,
    charges: usize,
    saw: Vec<bool>,
}

async fn effects(w: &World, out: Result<Envelope>) -> Effects {
    Effects {
        result: out
            .map(|e| e.stamps().map(|s| s.name()).collect())
            .map_err(|e| e.kind()),
        queued: w.queue.counter().message_count().await.unwrap(),
        parked: w.failed.counter().message_count().await.unwrap(),
        charges: w.charges.load(Ordering::SeqCst),
        saw: std::mem::take(&mut *w.saw.lock().unwrap()),
    }
}

/// Dispatches `envelope` on a fresh world's bus and, separately, through a
/// fresh world's hand-assembled stack; both must have the same effects.
async fn same(max_retries: u32, envelope: impl Fn() -> Envelope) -> Effects {
    let by_bus = world(max_retries);
    let out = by_bus.messenger.bus().dispatch(envelope()).await;
    let bus = effects(&by_bus, out).await;

    let by_stack = world(max_retries);
    let stack: MiddlewareStack = by_stack.messenger.bus().stack();
    let out = stack.run(envelope()).await;
    let stacked = effects(&by_stack, out).await;
    assert_eq!(bus, stacked, "the bus and its stack part ways");
    bus
}

#[tokio::test]
async fn a_command_handled_in_process_is_the_same_through_the_stack() {
    let e = same(0, || Envelope::new(Charge(2))).await;
    assert_eq!(e.result, Ok(vec!["BusName", "Handled"]));
    assert_eq!(e.charges, 1);
    assert_eq!(e.saw, [true], "step 1 ran before the user middleware");
}

#[tokio::test]
async fn a_handler_failure_is_the_same_through_the_stack() {
    let e = same(0, || Envelope::new(Charge(13))).await;
    assert_eq!(e.result, Err("handler"));
}

#[tokio::test]
async fn a_routed_message_is_sent_the_same_through_the_stack() {
    let e = same(0, || Envelope::new(Ship)).await;
    assert_eq!(e.queued, 1);
    assert!(
        matches!(&e.result, Ok(stamps) if stamps.contains(&"Sent")),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_received_failure_is_retried_the_same_through_the_stack() {
    let e = same(1, || {
        Envelope::event(Placed { fail: true }).with(ReceivedStamp::new("queue"))
    })
    .await;
    assert_eq!(e.queued, 1, "the retry");
    assert_eq!(e.charges, 1, "what the handler that succeeded deferred ran");
}

#[tokio::test]
async fn a_received_failure_out_of_retries_is_parked_the_same_through_the_stack() {
    let e = same(0, || {
        Envelope::event(Placed { fail: true }).with(ReceivedStamp::new("queue"))
    })
    .await;
    assert_eq!(e.result, Err("handler"));
    assert_eq!((e.queued, e.parked), (0, 1));
    assert_eq!(e.charges, 1);
}

#[tokio::test]
async fn deferred_dispatches_run_after_success_and_are_dropped_after_failure_through_both() {
    let ok = same(0, || Envelope::event(Placed { fail: false })).await;
    assert_eq!(ok.charges, 1);
    // The deferred charge went through the user middleware too.
    assert_eq!(ok.saw, [true, true]);
    let failed = same(0, || Envelope::event(Placed { fail: true })).await;
    assert_eq!(failed.result, Err("handler"));
    assert_eq!(failed.charges, 0);
}

#[tokio::test]
async fn the_pipeline_listing_follows_the_declared_order() {
    let w = world(0);
    let listed = w.messenger.bus().pipeline();
    let declared: Vec<&str> = CANONICAL
        .iter()
        .filter(|s| **s != Step::User)
        .map(|s| s.name())
        .collect();
    let names: Vec<String> = listed.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        names,
        [
            declared[0],
            declared[1],
            declared[2],
            "watch",
            declared[3],
            declared[4],
            declared[5]
        ]
    );
    let stack_names = w.messenger.bus().stack().names();
    assert_eq!(stack_names.len(), 7, "{stack_names:?}");
    assert_eq!(stack_names[3], "watch");
}
