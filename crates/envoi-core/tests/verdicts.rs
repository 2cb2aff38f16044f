//! What dispatching a message does, verdict by verdict: handled, retried,
//! parked and failed, for a message dispatched in process and for one
//! received from a transport, with and without user middleware — and what
//! becomes of the dispatches its handlers deferred in each case.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use envoi_core::failure::MultiplierRetryStrategy;
use envoi_core::middleware::{from_fn, Middleware};
use envoi_core::pipeline::verdict::{Fate, Verdict};
use envoi_core::stamp::{
    HandledStamp, ReceivedStamp, RedeliveryStamp, SentToFailureTransportStamp,
};
use envoi_core::testing::Abilities;
use envoi_core::transport::in_memory::InMemoryTransport;
use envoi_core::worker::{handle_one, Outcome, Settlement};
use envoi_core::{BusError, Command, Envelope, Event, Message, MessageBus, Messenger};
use serde::{Deserialize, Serialize};

/// An event with two handlers: `record` always succeeds and defers a
/// [`Consequence`]; `judge` fails when `fail` is set.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Happened {
    fail: bool,
}
impl Message for Happened {
    const NAME: &'static str = "Happened";
}
impl Event for Happened {
    type Error = Judged;
}

#[derive(Debug, thiserror::Error)]
#[error("judged wrong")]
struct Judged;

/// What `record` defers: handled in process, counted; it fails while the
/// setup's `doom` is set.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Consequence;
impl Message for Consequence {
    const NAME: &'static str = "Consequence";
}
impl Command for Consequence {
    type Output = ();
    type Error = Judged;
}

/// How the failure policy treats a handler failure.
#[derive(Clone, Copy, Debug)]
enum Policy {
    /// One retry, then a failure transport.
    Retries,
    /// No retry, a failure transport.
    Parks,
    /// No retry, no failure transport.
    Fails,
}

/// A messenger whose bus handles [`Happened`] (routed nowhere: received
/// copies come from `queue`), with `user` middleware that takes part when
/// set; the number of [`Consequence`]s handled, and the transports.
struct Setup {
    messenger: Messenger,
    consequences: Arc<AtomicUsize>,
    queue: Arc<InMemoryTransport>,
    failed: Arc<InMemoryTransport>,
    seen_by_user: Arc<AtomicUsize>,
    doom: Arc<std::sync::atomic::AtomicBool>,
}

fn setup(policy: Policy, user: bool) -> Setup {
    setup_with(policy, user, None)
}

/// [`setup`], with `failure` as the failure transport instead of an
/// in-memory one.
fn setup_with(
    policy: Policy,
    user: bool,
    failure: Option<Arc<dyn envoi_core::transport::Transport>>,
) -> Setup {
    let consequences = Arc::new(AtomicUsize::new(0));
    let queue = Arc::new(InMemoryTransport::new());
    let failed = Arc::new(InMemoryTransport::new());
    let slot: Arc<Mutex<Option<MessageBus>>> = Arc::default();
    let seen_by_user = Arc::new(AtomicUsize::new(0));
    let record = {
        let slot = slot.clone();
        move |_: Happened| {
            let slot = slot.clone();
            async move {
                let bus = slot.lock().unwrap().clone().expect("the bus is set");
                bus.dispatch_after_current(Envelope::new(Consequence))
                    .await
                    .expect("a deferred dispatch is accepted");
                Ok::<_, Judged>(())
            }
        }
    };
    let counted = consequences.clone();
    let doom: Arc<std::sync::atomic::AtomicBool> = Arc::default();
    let doomed = doom.clone();
    let mut builder = Messenger::builder()
        .event_handler(record)
        .event_handler(|e: Happened| async move {
            if e.fail {
                Err(Judged)
            } else {
                Ok(())
            }
        })
        .command_handler(move |_: Consequence| {
            counted.fetch_add(1, Ordering::SeqCst);
            let fails = doomed.load(Ordering::SeqCst);
            async move {
                if fails {
                    Err(Judged)
                } else {
                    Ok(())
                }
            }
        })
        .transport("queue", queue.clone())
        .transport(
            "failed",
            failure.unwrap_or_else(|| failed.clone() as Arc<dyn envoi_core::transport::Transport>),
        )
        .message::<Happened>()
        .default_retry_strategy(MultiplierRetryStrategy {
            max_retries: u32::from(matches!(policy, Policy::Retries)),
            delay: std::time::Duration::ZERO,
            jitter: 0.0,
            ..Default::default()
        });
    if !matches!(policy, Policy::Fails) {
        builder = builder.failure_transport("failed");
    }
    if user {
        let seen = seen_by_user.clone();
        builder = builder.middleware(from_fn("count", move |e, next| {
            seen.fetch_add(1, Ordering::SeqCst);
            next.run(e)
        }));
    }
    let messenger = builder.build().unwrap();
    *slot.lock().unwrap() = Some(messenger.bus().clone());
    Setup {
        messenger,
        consequences,
        queue,
        failed,
        seen_by_user,
        doom,
    }
}

fn received(fail: bool) -> Envelope {
    Envelope::event(Happened { fail }).with(ReceivedStamp::new("queue"))
}

async fn receive(s: &Setup, fail: bool) -> Verdict {
    s.messenger.bus().receive(received(fail)).await
}

fn handled_by(envelope: &Envelope) -> Vec<String> {
    envelope
        .all::<HandledStamp>()
        .map(|h| h.handler.to_string())
        .collect()
}

async fn stored(t: &InMemoryTransport) -> u64 {
    t.counter().message_count().await.unwrap()
}

// ---------------------------------------------------------------- handled

#[tokio::test]
async fn in_process_a_message_handled_runs_what_its_handlers_deferred_with_and_without_middleware()
{
    for user in [false, true] {
        let s = setup(Policy::Parks, user);
        let out = s
            .messenger
            .bus()
            .dispatch(Envelope::event(Happened { fail: false }))
            .await
            .unwrap();
        assert_eq!(handled_by(&out).len(), 2, "user middleware: {user}");
        assert_eq!(s.consequences.load(Ordering::SeqCst), 1, "user: {user}");
        // The message, then its consequence: a deferred dispatch goes
        // through the user middleware too.
        assert_eq!(s.seen_by_user.load(Ordering::SeqCst), 2 * usize::from(user));
    }
}

#[tokio::test]
async fn received_a_message_handled_is_handled_and_runs_what_its_handlers_deferred() {
    for user in [false, true] {
        let s = setup(Policy::Parks, user);
        let verdict = receive(&s, false).await;
        let Fate::Handled(out) = &verdict.fate else {
            panic!("user: {user}: {:?}", verdict.fate)
        };
        assert_eq!(handled_by(out).len(), 2);
        assert!(verdict.failed_deferred.is_empty());
        assert_eq!(s.consequences.load(Ordering::SeqCst), 1, "user: {user}");
        assert_eq!((stored(&s.queue).await, stored(&s.failed).await), (0, 0));
        assert_eq!(s.seen_by_user.load(Ordering::SeqCst), 2 * usize::from(user));
    }
}

// ---------------------------------------------------------------- retried

#[tokio::test]
async fn received_a_message_retried_is_sent_back_and_its_handlers_that_succeeded_keep_their_consequences(
) {
    for user in [false, true] {
        let s = setup(Policy::Retries, user);
        let verdict = receive(&s, true).await;
        let Fate::Retried {
            envelope, attempt, ..
        } = &verdict.fate
        else {
            panic!("user: {user}: {:?}", verdict.fate)
        };
        assert_eq!(*attempt, 1);
        let envelope = envelope.as_ref().expect("the retry as sent");
        assert_eq!(envelope.last::<RedeliveryStamp>().unwrap().retry_count, 1);
        assert_eq!(
            stored(&s.queue).await,
            1,
            "the retry went back to its transport"
        );
        assert_eq!(stored(&s.failed).await, 0);
        // The handler that succeeded will not run again on the retry: what
        // it deferred runs now.
        assert_eq!(s.consequences.load(Ordering::SeqCst), 1, "user: {user}");
    }
}

#[tokio::test]
async fn in_process_a_failing_message_is_never_retried_and_its_consequences_are_dropped() {
    for user in [false, true] {
        let s = setup(Policy::Retries, user);
        let err = s
            .messenger
            .bus()
            .dispatch(Envelope::event(Happened { fail: true }))
            .await
            .unwrap_err();
        assert!(matches!(err, BusError::HandlerFailed { .. }), "{err}");
        assert_eq!(stored(&s.queue).await, 0, "not retried");
        assert_eq!(s.consequences.load(Ordering::SeqCst), 0, "user: {user}");
    }
}

// ----------------------------------------------------------------- parked

#[tokio::test]
async fn received_a_message_parked_goes_to_the_failure_transport_and_its_consequences_run() {
    for user in [false, true] {
        let s = setup(Policy::Parks, user);
        let verdict = receive(&s, true).await;
        let Fate::Parked {
            envelope,
            failure_transport,
            reason,
        } = &verdict.fate
        else {
            panic!("user: {user}: {:?}", verdict.fate)
        };
        assert_eq!(failure_transport, "failed");
        assert!(reason.contains("judged wrong"), "{reason}");
        let envelope = envelope.as_ref().expect("the parked copy as sent");
        assert!(envelope.has::<SentToFailureTransportStamp>());
        assert_eq!((stored(&s.queue).await, stored(&s.failed).await), (0, 1));
        assert_eq!(s.consequences.load(Ordering::SeqCst), 1, "user: {user}");
    }
}

// ----------------------------------------------------------------- failed

#[tokio::test]
async fn received_a_message_that_fails_with_nowhere_to_go_fails_and_its_consequences_are_dropped() {
    for user in [false, true] {
        let s = setup(Policy::Fails, user);
        let verdict = receive(&s, true).await;
        let Fate::Failed(BusError::HandlerFailed { envelope, .. }) = &verdict.fate else {
            panic!("user: {user}: {:?}", verdict.fate)
        };
        assert_eq!(handled_by(envelope).len(), 1, "the handler that succeeded");
        assert!(verdict.failed_deferred.is_empty());
        assert_eq!((stored(&s.queue).await, stored(&s.failed).await), (0, 0));
        // Neither retried nor parked, the message will run again: what its
        // handler that succeeded deferred is dropped, or it would run twice.
        assert_eq!(s.consequences.load(Ordering::SeqCst), 0, "user: {user}");
    }
}

#[tokio::test]
async fn received_a_message_without_a_handler_fails_with_why() {
    #[derive(Debug, Clone)]
    struct Orphan;
    impl Message for Orphan {
        const NAME: &'static str = "Orphan";
    }
    for user in [false, true] {
        let s = setup(Policy::Parks, user);
        let orphan = Envelope::new(Orphan).with(ReceivedStamp::new("queue"));
        let verdict = s.messenger.bus().receive(orphan).await;
        assert!(
            matches!(verdict.fate, Fate::Failed(BusError::NoHandler { .. })),
            "user: {user}: {:?}",
            verdict.fate
        );
    }
}

#[tokio::test]
async fn a_middleware_that_swallows_a_parked_failure_does_not_hide_the_park() {
    let s = setup(Policy::Parks, false);
    s.messenger
        .bus()
        .add_middleware(Arc::new(from_fn("swallow", |e, next| async move {
            let kept = e.clone();
            Ok(next.run(e).await.unwrap_or(kept))
        })) as Arc<dyn Middleware>);
    let verdict = receive(&s, true).await;
    assert!(
        matches!(&verdict.fate, Fate::Parked { failure_transport, .. } if failure_transport == "failed"),
        "{:?}",
        verdict.fate
    );
    assert_eq!(stored(&s.failed).await, 1);
}

// ------------------------------------------------- settled by the worker

/// Handles one copy of `Happened { fail }` taken from the queue as a
/// worker would; returns how it is settled and what became of it.
async fn settle(s: &Setup, fail: bool) -> (Settlement, Outcome) {
    let raw = s
        .messenger
        .serializer()
        .encode(&Envelope::event(Happened { fail }))
        .unwrap();
    envoi_core::transport::Transport::send(&*s.queue, raw, None)
        .await
        .unwrap();
    let delivery = s.queue.receiver().get(1).await.unwrap().remove(0);
    let handled = handle_one(&s.messenger, "queue", delivery).await.unwrap();
    (handled.settlement, handled.outcome)
}

#[tokio::test]
async fn each_verdict_is_settled_with_its_transport_as_the_worker_settles_it() {
    let (settlement, outcome) = settle(&setup(Policy::Parks, false), false).await;
    assert_eq!(settlement, Settlement::Ack);
    assert!(matches!(outcome, Outcome::Handled), "{outcome:?}");

    let (settlement, outcome) = settle(&setup(Policy::Retries, false), true).await;
    assert_eq!(settlement, Settlement::Ack);
    assert!(
        matches!(outcome, Outcome::Retried { retry_count: 1 }),
        "{outcome:?}"
    );

    let (settlement, outcome) = settle(&setup(Policy::Parks, true), true).await;
    assert_eq!(settlement, Settlement::Ack);
    assert!(
        matches!(&outcome, Outcome::Failed { parked_in: Some(f), released: false, .. } if f == "failed"),
        "{outcome:?}"
    );

    let (settlement, outcome) = settle(&setup(Policy::Fails, true), true).await;
    assert_eq!(settlement, Settlement::Reject);
    assert!(
        matches!(
            outcome,
            Outcome::Failed {
                parked_in: None,
                released: false,
                ..
            }
        ),
        "{outcome:?}"
    );
}

/// A failure transport that takes nothing.
struct Refusing;

impl envoi_core::transport::Transport for Refusing {
    fn send(
        &self,
        _: envoi_core::transport::RawMessage,
        _: Option<std::time::Duration>,
    ) -> envoi_core::BoxFuture<'_, Result<String, envoi_core::TransportError>> {
        Box::pin(async { Err(envoi_core::TransportError::backend("sending", "refused")) })
    }

    fn as_receiver(&self) -> Option<&dyn envoi_core::transport::Receiver> {
        None
    }
}

#[tokio::test]
async fn a_consequence_that_fails_is_parked_on_its_own_beside_the_message_handled() {
    let s = setup(Policy::Parks, false);
    s.doom.store(true, Ordering::SeqCst);
    let verdict = receive(&s, false).await;
    assert!(
        matches!(verdict.fate, Fate::Handled(_)),
        "{:?}",
        verdict.fate
    );
    assert_eq!(verdict.failed_deferred.len(), 1);
    assert_eq!(
        verdict.failed_deferred[0].envelope.message_name(),
        "Consequence"
    );

    let (settlement, outcome) = settle(&s, false).await;
    assert_eq!(settlement, Settlement::Ack, "handled: {outcome:?}");
    assert_eq!(stored(&s.failed).await, 1, "the consequence, parked");
}

#[tokio::test]
async fn a_message_handled_whose_failed_consequence_cannot_be_parked_is_given_back() {
    let s = setup_with(Policy::Parks, false, Some(Arc::new(Refusing)));
    s.doom.store(true, Ordering::SeqCst);
    let (settlement, outcome) = settle(&s, false).await;
    // Given back, its handlers run again and defer the consequence again:
    // it is not lost.
    assert_eq!(settlement, Settlement::Release, "{outcome:?}");
    assert!(
        matches!(outcome, Outcome::Failed { released: true, .. }),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn a_message_retried_whose_failed_consequence_cannot_be_parked_is_acknowledged_all_the_same()
{
    let s = setup_with(Policy::Retries, false, Some(Arc::new(Refusing)));
    s.doom.store(true, Ordering::SeqCst);
    let (settlement, _) = settle(&s, true).await;
    // Its retry holds it: given back too, it would live twice.
    assert_eq!(settlement, Settlement::Ack);
    assert_eq!(
        stored(&s.queue).await,
        2,
        "the message, not settled yet, and its retry"
    );
}
