//! Handling one message as a worker would, outside a running worker: what
//! `failed retry` does.

use std::sync::Arc;

use tokio::time::Instant;

use super::error::WorkerError;
use super::events::{Counters, Events, WorkerEvent};
use super::fetch::{receiving, Held, MessageId, Source};
use super::handle::Ctx;
use super::in_flight::{Finished, InFlight};
use super::settle::Action;
use crate::messenger::Messenger;
use crate::transport::{Payload, Transport};

/// What became of a message handled by [`consume_one`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Outcome {
    /// It was handled and acknowledged.
    Handled,
    /// It failed and the retry step scheduled a retry; it was acknowledged.
    Retried {
        /// Which retry it is.
        retry_count: u32,
    },
    /// It failed: parked (and acknowledged), rejected, or released to be
    /// delivered again.
    Failed {
        /// Why.
        error: String,
        /// The failure transport it went to, if any.
        parked_in: Option<String>,
        /// Whether it was released rather than removed.
        released: bool,
    },
}

/// What the transport of a message handled by [`handle_one`] is to do
/// with it, as a worker would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settlement {
    /// Remove it: it was handled, its retry sent, or it was parked.
    Ack,
    /// Reject it: it failed, or a dispatch its handlers deferred failed,
    /// and there is no failure transport.
    Reject,
    /// Give it back, to be delivered again: it could not be parked (or a
    /// dispatch its handlers deferred could not be), or sent.
    Release,
}

/// A message handled by [`handle_one`], not yet settled with its transport.
#[derive(Debug, Clone)]
#[non_exhaustive]
#[must_use = "the message is not settled with its transport: apply `settlement`"]
pub struct HandledOne {
    /// What became of it.
    pub outcome: Outcome,
    /// What its transport is to do with it.
    pub settlement: Settlement,
    /// The [`Handled`](crate::worker::WorkerEvent::Handled),
    /// [`Retried`](crate::worker::WorkerEvent::Retried) and [`Failed`](crate::worker::WorkerEvent::Failed)
    /// events, in order: a dispatch its handlers deferred that failed, and
    /// was parked on its own (or could not be), has a `Failed` event of its
    /// own, before the message's. A message given back because such a
    /// dispatch could not be parked has no event of its own: the last one
    /// is that dispatch's, which [`outcome`](Self::outcome) reports.
    pub events: Vec<WorkerEvent>,
}

/// Handles one message of `transport` exactly as a worker would — decode,
/// dispatch with a [`ReceivedStamp`](crate::envelope::stamp::ReceivedStamp) (or send one parked because it could
/// not be sent), park it or what its handlers deferred that failed — but
/// leaves settling it with the transport to the caller: what a worker
/// would do is [`HandledOne::settlement`]. [`consume_one`] does it too.
///
/// Fails with [`WorkerError::UnknownTransport`] for a transport the
/// messenger does not have.
///
/// ```
/// # use std::sync::Arc;
/// # use envoi_core::transport::in_memory::InMemoryTransport;
/// # use envoi_core::transport::{MessageCount, Receiver};
/// # use envoi_core::worker::{handle_one, Outcome, Settlement};
/// # use envoi_core::{Command, Envelope, Message, Messenger};
/// # #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
/// # struct Ping;
/// # impl Message for Ping { const NAME: &'static str = "Ping"; }
/// # impl Command for Ping { type Output = (); type Error = std::convert::Infallible; }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let queue = Arc::new(InMemoryTransport::new());
/// let messenger = Messenger::builder()
///     .command_handler(|_: Ping| async { Ok::<_, std::convert::Infallible>(()) })
///     .transport("async", queue.clone())
///     .route::<Ping>("async")
///     .build()
///     .unwrap();
/// messenger.bus().dispatch(Envelope::new(Ping)).await.unwrap();
/// let delivery = queue.get(1).await.unwrap().remove(0);
/// let id = delivery.id.clone();
/// let handled = handle_one(&messenger, "async", delivery).await.unwrap();
/// assert!(matches!(handled.outcome, Outcome::Handled));
/// // Settled as a worker would.
/// match handled.settlement {
///     Settlement::Ack => queue.ack(&id).await.unwrap(),
///     Settlement::Reject => queue.reject(&id).await.unwrap(),
///     Settlement::Release => queue.release(&id).await.unwrap(),
///     _ => unreachable!(),
/// }
/// assert_eq!(queue.message_count().await.unwrap(), 0);
/// # }
/// ```
pub async fn handle_one(
    messenger: &Messenger,
    transport: &str,
    delivery: crate::transport::Delivery,
) -> Result<HandledOne, WorkerError> {
    let t = messenger
        .transport(transport)
        .ok_or_else(|| WorkerError::UnknownTransport(transport.to_string()))?
        .clone();
    let (ctx, events) = recording(messenger, transport, t);
    let mut in_flight = InFlight::new();
    let (task, work) = ctx.begin(Held {
        receiver: 0,
        id: MessageId::Remote(delivery.id),
        payload: Payload::Raw(delivery.raw),
        redelivered: delivery.redelivered,
        since: Instant::now(),
    });
    let future = ctx.process(0, task.id.clone(), work);
    let finished = match in_flight.start(task, future) {
        Some(finished) => finished,
        None => in_flight.next().await,
    };
    let done = match finished {
        Finished::Done(done, _) => done,
        Finished::Panicked {
            receiver,
            id,
            envelope,
            message,
        } => {
            ctx.park_panicked(receiver, &id.text(), envelope, message)
                .await
        }
    };
    let events = std::mem::take(&mut *events.lock().unwrap_or_else(|p| p.into_inner()));
    let settlement = match done.action {
        Action::Ack => Settlement::Ack,
        Action::Reject => Settlement::Reject,
        Action::Release => Settlement::Release,
    };
    Ok(HandledOne {
        outcome: outcome_of(&events),
        settlement,
        events,
    })
}

/// What is recorded of one message handled outside a worker.
type Recorded = Arc<std::sync::Mutex<Vec<WorkerEvent>>>;

/// A worker's context for the one transport `name`, recording the
/// `Handled`, `Retried` and `Failed` events.
fn recording(messenger: &Messenger, name: &str, transport: Arc<dyn Transport>) -> (Ctx, Recorded) {
    let events = Recorded::default();
    let record = events.clone();
    let ctx = Ctx::new(
        messenger.clone(),
        Events {
            listeners: vec![Arc::new(move |e: &WorkerEvent| {
                if matches!(
                    e,
                    WorkerEvent::Handled { .. }
                        | WorkerEvent::Retried { .. }
                        | WorkerEvent::Failed { .. }
                ) {
                    record
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(e.clone());
                }
            })],
            tx: None,
        },
        Arc::new(Counters::default()),
        vec![Source {
            name: Arc::from(name),
            transport,
            rate: None,
        }],
    );
    (ctx, events)
}

/// What became of the message, by its last event: a dispatch its handlers
/// deferred that failed has a `Failed` event of its own before it.
fn outcome_of(events: &[WorkerEvent]) -> Outcome {
    match events.last() {
        Some(WorkerEvent::Retried { retry_count, .. }) => Outcome::Retried {
            retry_count: *retry_count,
        },
        Some(WorkerEvent::Failed {
            error,
            parked_in,
            released,
            ..
        }) => Outcome::Failed {
            error: error.clone(),
            parked_in: parked_in.clone(),
            released: *released,
        },
        _ => Outcome::Handled,
    }
}

/// Handles one message of `transport` exactly as a worker would — decode,
/// dispatch with a [`ReceivedStamp`](crate::envelope::stamp::ReceivedStamp), then acknowledge, reject, release or
/// park it — and says what became of it. This is how a command line retries
/// one message from a failure transport: [`find`](crate::transport::Browse::find) it, then
/// hand it here (or to [`handle_one`], to settle it itself).
///
/// Fails with [`WorkerError::UnknownTransport`] for a transport the
/// messenger does not have, and with [`WorkerError::Transport`] when
/// acknowledging, rejecting or releasing it fails.
pub async fn consume_one(
    messenger: &Messenger,
    transport: &str,
    delivery: crate::transport::Delivery,
) -> Result<Outcome, WorkerError> {
    let id = delivery.id.clone();
    let handled = handle_one(messenger, transport, delivery).await?;
    let t = messenger
        .transport(transport)
        .ok_or_else(|| WorkerError::UnknownTransport(transport.to_string()))?;
    let result = match receiving(t) {
        Ok(r) => match handled.settlement {
            Settlement::Ack => r.ack(&id).await,
            Settlement::Reject => r.reject(&id).await,
            Settlement::Release => r.release(&id).await,
        },
        Err(e) => Err(e),
    };
    result.map_err(|e| WorkerError::Transport {
        transport: transport.to_string(),
        error: e.to_string(),
    })?;
    Ok(handled.outcome)
}
