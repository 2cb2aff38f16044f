//! Middleware, stage middleware and filters written as closures with no
//! annotations and no `Box::pin`, on a real bus.
//!
//! Before closures got an owned handle to the rest of the pipeline
//! (`OwnedNext`, `OwnedStageNext`), `from_fn` and `as_middleware` needed
//! `|envelope: Envelope, next: Next<'_>| Box::pin(async move { … })` and
//! `as_filter` needed `|envelope: &Envelope| …`: the closures of the tests
//! marked so would not have compiled.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;

use envoi_core::middleware::stage::{
    as_filter, as_middleware, FilterAction, PipelineStage, StagePipeline,
};
use envoi_core::middleware::{from_fn, Middleware, MiddlewareStack, Next, OwnedNextError};
use envoi_core::stamp::{HandledStamp, StoppedByFilterStamp};
use envoi_core::testing::RecordingSenders;
use envoi_core::{BusError, Command, Envelope, Message, MessageBus, Messenger};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Charge {
    cents: u32,
}
impl Message for Charge {
    const NAME: &'static str = "Charge";
}
impl Command for Charge {
    type Output = u32;
    type Error = Declined;
}

#[derive(Debug, thiserror::Error)]
#[error("card declined")]
struct Declined;

/// Charges of 0 cents are declined.
async fn charge(c: Charge) -> Result<u32, Declined> {
    if c.cents == 0 {
        Err(Declined)
    } else {
        Ok(c.cents)
    }
}

type Log = Arc<Mutex<Vec<String>>>;

fn entries(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

#[derive(Debug, thiserror::Error)]
#[error("over quota")]
struct OverQuota;

/// Would not compile before: the closure's arguments are not annotated and
/// its future is not boxed.
#[tokio::test]
async fn a_closure_middleware_stamps_on_the_way_in_and_reads_the_result_on_the_way_out() {
    let log = Log::default();
    let seen = log.clone();
    let messenger = Messenger::builder()
        .command_handler(charge)
        .middleware(from_fn("audit", move |envelope, next| {
            let seen = seen.clone();
            async move {
                let out = next.run(envelope.with_header("audited", "in")).await?;
                let handled = out.all::<HandledStamp>().count();
                seen.lock().unwrap().push(format!("handled {handled}"));
                Ok(out.with_header("audit-out", "done"))
            }
        }))
        .build()
        .unwrap();
    let out = messenger
        .bus()
        .dispatch(Envelope::new(Charge { cents: 5 }))
        .await
        .unwrap();
    assert_eq!(out.header("audited"), Some("in"), "stamped on the way in");
    assert_eq!(out.header("audit-out"), Some("done"), "and on the way out");
    assert_eq!(entries(&log), ["handled 1"], "read the handler's stamp");
}

/// Would not compile before.
#[tokio::test]
async fn a_closure_middleware_that_drops_next_short_circuits_the_pipeline() {
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let messenger = Messenger::builder()
        .command_handler(move |c: Charge| {
            counter.fetch_add(1, Ordering::SeqCst);
            charge(c)
        })
        .middleware(from_fn("maintenance", |envelope, next| async move {
            drop(next);
            Ok(envelope.with_header("maintenance", "on"))
        }))
        .build()
        .unwrap();
    let out = messenger
        .bus()
        .dispatch(Envelope::new(Charge { cents: 5 }))
        .await
        .unwrap();
    assert_eq!(handled.load(Ordering::SeqCst), 0, "the handler never ran");
    assert!(!out.has::<HandledStamp>());
    assert_eq!(out.header("maintenance"), Some("on"));
}

/// Would not compile before.
#[tokio::test]
async fn a_closure_middleware_error_fails_the_dispatch_before_the_handler() {
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let messenger = Messenger::builder()
        .command_handler(move |c: Charge| {
            counter.fetch_add(1, Ordering::SeqCst);
            charge(c)
        })
        .middleware(from_fn("quota", |envelope, next| async move {
            if envelope.message::<Charge>().is_some_and(|c| c.cents > 100) {
                return Err(BusError::Middleware {
                    middleware: "quota".into(),
                    source: Box::new(OverQuota),
                });
            }
            next.run(envelope).await
        }))
        .build()
        .unwrap();
    let error = messenger
        .bus()
        .dispatch(Envelope::new(Charge { cents: 500 }))
        .await
        .unwrap_err();
    assert!(error.middleware_error::<OverQuota>().is_some(), "{error}");
    assert_eq!(handled.load(Ordering::SeqCst), 0);
    messenger
        .bus()
        .dispatch(Envelope::new(Charge { cents: 50 }))
        .await
        .unwrap();
    assert_eq!(handled.load(Ordering::SeqCst), 1, "under quota it runs");
}

/// Would not compile before.
#[tokio::test]
async fn a_closure_middleware_gets_the_handler_error_on_the_way_out() {
    let log = Log::default();
    let seen = log.clone();
    let messenger = Messenger::builder()
        .command_handler(charge)
        .middleware(from_fn("watch", move |envelope, next| {
            let seen = seen.clone();
            async move {
                let out = next.run(envelope).await;
                if let Err(e) = &out {
                    seen.lock().unwrap().push(e.kind().to_string());
                }
                out
            }
        }))
        .build()
        .unwrap();
    let error = messenger
        .dispatcher()
        .dispatch(Charge { cents: 0 })
        .await
        .unwrap_err();
    assert!(
        error.domain().is_some(),
        "the domain error is kept: {error}"
    );
    assert_eq!(entries(&log), ["handler"]);
}

/// Would not compile before.
#[tokio::test]
async fn a_closure_middleware_knows_whether_the_rest_sends_the_message() {
    let log = Log::default();
    let seen = log.clone();
    let senders = RecordingSenders::default();
    let messenger = Messenger::builder()
        .command_handler(charge)
        .route::<Charge>("async")
        .sender_dispatcher(Arc::new(senders.clone()))
        .middleware(from_fn("side", move |envelope, next| {
            seen.lock().unwrap().push(next.sends().to_string());
            next.run(envelope)
        }))
        .build()
        .unwrap();
    let bus = messenger.bus();
    bus.dispatch(Envelope::new(Charge { cents: 5 }))
        .await
        .unwrap();
    let received =
        Envelope::new(Charge { cents: 5 }).with(envoi_core::stamp::ReceivedStamp::new("async"));
    bus.dispatch(received).await.unwrap();
    assert_eq!(entries(&log), ["true", "false"]);
    assert_eq!(senders.sent_to(), ["async"]);
}

/// Would not compile before.
#[tokio::test]
async fn a_stage_closure_middleware_sees_its_stage_and_the_handler_failure() {
    let log = Log::default();
    let (before, after) = (log.clone(), log.clone());
    let stages = StagePipeline::new()
        .use_(
            PipelineStage::BeforeConsuming,
            [as_middleware(move |envelope, next| {
                let before = before.clone();
                async move {
                    before.lock().unwrap().push(format!("{} in", next.stage()));
                    let out = next.run(envelope.with_header("stage", "seen")).await;
                    before
                        .lock()
                        .unwrap()
                        .push(format!("out ok={}", out.is_ok()));
                    out
                }
            })],
        )
        .use_(
            PipelineStage::AfterConsuming,
            [as_middleware(move |envelope, next| {
                let failure = next.failure().map(|f| format!("{}: {f}", f.kind()));
                after.lock().unwrap().push(failure.unwrap_or("none".into()));
                next.run(envelope)
            })],
        );
    let messenger = Messenger::builder()
        .command_handler(charge)
        .stages(stages)
        .build()
        .unwrap();
    let bus = messenger.bus();
    let out = bus
        .dispatch(Envelope::new(Charge { cents: 5 }))
        .await
        .unwrap();
    assert_eq!(out.header("stage"), Some("seen"));
    bus.dispatch(Envelope::new(Charge { cents: 0 }))
        .await
        .unwrap_err();
    assert_eq!(
        entries(&log),
        [
            "before_consuming in",
            "out ok=true",
            "none",
            "before_consuming in",
            "out ok=false",
            "handler: handling `Charge` failed: handler `charge` failed: card declined",
        ]
    );
}

/// Would not compile before: the filter's argument is not annotated.
#[tokio::test]
async fn an_unannotated_filter_stops_a_message_as_a_filter_stop_does() {
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let messenger = Messenger::builder()
        .command_handler(move |c: Charge| {
            counter.fetch_add(1, Ordering::SeqCst);
            charge(c)
        })
        .stages(
            StagePipeline::new()
                .use_(
                    PipelineStage::BeforeConsuming,
                    [as_filter(|envelope| match envelope.header("tenant") {
                        Some(_) => FilterAction::Continue,
                        None => FilterAction::Stop,
                    })],
                )
                .use_(
                    PipelineStage::Outgoing,
                    [as_filter(|envelope| {
                        if envelope.message::<Charge>().is_some_and(|c| c.cents > 1000) {
                            FilterAction::Stop
                        } else {
                            FilterAction::Continue
                        }
                    })],
                ),
        )
        .build()
        .unwrap();
    let bus = messenger.bus();
    let out = bus
        .dispatch(Envelope::new(Charge { cents: 5 }))
        .await
        .expect("a before_consuming stop is no error");
    assert_eq!(
        out.last::<StoppedByFilterStamp>().map(|s| s.stage.as_ref()),
        Some("before_consuming")
    );
    assert_eq!(handled.load(Ordering::SeqCst), 0);
    let error = bus
        .dispatch(Envelope::new(Charge { cents: 5000 }).with_header("tenant", "acme"))
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        BusError::OutgoingFiltersBlocked { message: "Charge" }
    ));
    bus.dispatch(Envelope::new(Charge { cents: 5 }).with_header("tenant", "acme"))
        .await
        .unwrap();
    assert_eq!(handled.load(Ordering::SeqCst), 1);
}

type BusSlot = Arc<Mutex<Option<MessageBus>>>;

#[derive(Debug, Clone)]
struct Note;
impl Message for Note {
    const NAME: &'static str = "Note";
}
impl Command for Note {
    type Output = ();
    type Error = Infallible;
}

/// The rest of the pipeline runs in the middleware's own future, so a
/// handler reached through a handle that the closure moved into another
/// task still runs inside its dispatch: what it defers waits for the
/// dispatch to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_run_in_a_task_the_closure_awaits_runs_the_rest_inside_the_dispatch() {
    let log = Log::default();
    let slot = BusSlot::default();
    let (outer, noted) = (log.clone(), log.clone());
    let bus_of_handler = slot.clone();
    let messenger = Messenger::builder()
        .command_handler(move |c: Charge| {
            let (log, slot) = (outer.clone(), bus_of_handler.clone());
            async move {
                log.lock().unwrap().push("charge starts".into());
                tokio::task::yield_now().await;
                let bus = slot.lock().unwrap().clone().expect("bus set");
                bus.dispatch_after_current(Envelope::new(Note))
                    .await
                    .unwrap();
                log.lock().unwrap().push("charge ends".into());
                Ok::<_, Declined>(c.cents)
            }
        })
        .command_handler(move |_: Note| {
            noted.lock().unwrap().push("note".into());
            async { Ok::<_, Infallible>(()) }
        })
        .middleware(from_fn("elsewhere", |envelope, next| async move {
            tokio::spawn(next.run(envelope))
                .await
                .expect("the task ran")
        }))
        .build()
        .unwrap();
    *slot.lock().unwrap() = Some(messenger.bus().clone());
    let out = messenger
        .bus()
        .dispatch(Envelope::new(Charge { cents: 5 }))
        .await
        .unwrap();
    assert!(out.has::<HandledStamp>());
    assert_eq!(entries(&log), ["charge starts", "charge ends", "note"]);
}

/// A handle run once its middleware has finished fails with an error that
/// hands the envelope back, and the dispatch is short-circuited meanwhile.
#[tokio::test]
async fn a_handle_run_after_its_middleware_finished_fails_and_hands_the_envelope_back() {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = Mutex::new(Some(tx));
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let messenger = Messenger::builder()
        .command_handler(move |c: Charge| {
            counter.fetch_add(1, Ordering::SeqCst);
            charge(c)
        })
        .middleware(from_fn("too-late", move |envelope, next| {
            let tx = tx.lock().unwrap().take().expect("one dispatch");
            let late = envelope.clone().with_header("late", "yes");
            tokio::spawn(async move {
                let _ = tx.send(next.run(late).await);
            });
            async move { Ok(envelope) }
        }))
        .build()
        .unwrap();
    messenger
        .bus()
        .dispatch(Envelope::new(Charge { cents: 5 }))
        .await
        .unwrap();
    let error = rx.await.unwrap().unwrap_err();
    match &error {
        BusError::Middleware { middleware, .. } => assert_eq!(middleware, "too-late"),
        other => panic!("unexpected {other:?}"),
    }
    match error.middleware_error::<OwnedNextError>() {
        Some(OwnedNextError::Gone {
            envelope: Some(envelope),
        }) => assert_eq!(envelope.header("late"), Some("yes")),
        other => panic!("expected the envelope back, got {other:?}"),
    }
    assert_eq!(handled.load(Ordering::SeqCst), 0);
}

/// Sets its flag when dropped.
struct DropFlag(Arc<AtomicBool>);
impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A closure that drops the future of `next.run` while the rest is still
/// running drops the rest, as dropping the future of `Next::run` would,
/// even though the closure itself goes on.
#[tokio::test]
async fn dropping_the_future_of_run_drops_the_rest_while_the_closure_goes_on() {
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = dropped.clone();
    let messenger = Messenger::builder()
        .command_handler(move |_: Charge| {
            let guard = DropFlag(flag.clone());
            async move {
                let _guard = guard;
                std::future::pending::<()>().await;
                Ok::<u32, Declined>(0)
            }
        })
        .middleware(from_fn("give-up", {
            let dropped = dropped.clone();
            move |envelope, next| {
                let dropped = dropped.clone();
                async move {
                    let kept = envelope.clone();
                    tokio::select! {
                        biased;
                        out = next.run(envelope) => return out,
                        () = tokio::task::yield_now() => {}
                    }
                    // The rest is dropped when the adapter next looks, not
                    // when the closure ends.
                    tokio::task::yield_now().await;
                    let rest_dropped = dropped.load(Ordering::SeqCst).to_string();
                    Ok(kept.with_header("rest-dropped", rest_dropped))
                }
            }
        }))
        .build()
        .unwrap();
    let out = messenger
        .bus()
        .dispatch(Envelope::new(Charge { cents: 5 }))
        .await
        .unwrap();
    assert_eq!(out.header("rest-dropped"), Some("true"));
    assert!(!out.has::<HandledStamp>());
}

/// Polling the future of `run` again once it returned is a clear error,
/// not a panic.
#[tokio::test]
async fn polling_the_future_of_run_after_it_completed_is_an_error_not_a_panic() {
    let stack = MiddlewareStack::new([Arc::new(from_fn("again", |envelope, next| async move {
        let mut run = std::pin::pin!(next.run(envelope));
        let out = run.as_mut().await?;
        let again = std::future::poll_fn(|cx| Poll::Ready(run.as_mut().poll(cx))).await;
        match again {
            Poll::Ready(Err(e)) => match e.middleware_error::<OwnedNextError>() {
                Some(OwnedNextError::PolledAfterCompletion) => {
                    Ok(out.with_header("again", "refused"))
                }
                other => panic!("unexpected {other:?}"),
            },
            other => panic!("unexpected {other:?}"),
        }
    })) as Arc<dyn Middleware>]);
    let out = stack.run(Envelope::new(Note)).await.unwrap();
    assert_eq!(out.header("again"), Some("refused"));
}

/// Handles run on other threads while their dispatches are polled on
/// others: every result finds its way back (no wake-up is lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_dispatches_through_handles_on_other_tasks_all_come_back() {
    let messenger = Messenger::builder()
        .command_handler(|c: Charge| async move {
            tokio::task::yield_now().await;
            charge(c).await
        })
        .middleware(from_fn("elsewhere", |envelope, next| async move {
            tokio::task::yield_now().await;
            let out = tokio::spawn(next.run(envelope))
                .await
                .expect("the task ran");
            tokio::task::yield_now().await;
            out
        }))
        .build()
        .unwrap();
    let dispatches = (1..=500).map(|cents| {
        let bus = messenger.bus().clone();
        tokio::spawn(async move { bus.dispatch(Envelope::new(Charge { cents })).await })
    });
    let mut handled = 0;
    for dispatch in dispatches.collect::<Vec<_>>() {
        let out = dispatch.await.unwrap().unwrap();
        handled += out.all::<HandledStamp>().count();
    }
    assert_eq!(handled, 500);
}

/// A handle handed on before the middleware's future was ever polled
/// fails, rather than waits forever, when that future is dropped unpolled.
#[tokio::test]
async fn a_handle_whose_middleware_future_is_dropped_unpolled_fails_instead_of_waiting() {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = Mutex::new(Some(tx));
    let middleware = from_fn("unpolled", move |envelope, next| {
        let tx = tx.lock().unwrap().take().expect("one call");
        tokio::spawn(async move {
            let _ = tx.send(next.run(envelope).await);
        });
        async { Err(BusError::Disposed("never polled".into())) }
    });
    drop(middleware.handle(Envelope::new(Note), Next::passthrough()));
    let error = rx.await.unwrap().unwrap_err();
    assert!(
        matches!(
            error.middleware_error::<OwnedNextError>(),
            Some(OwnedNextError::Gone { envelope: Some(_) })
        ),
        "{error:?}"
    );
}
