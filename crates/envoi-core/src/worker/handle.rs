//! Handling one message: decode it, dispatch it on its bus, and settle it
//! by its verdict.

use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::events::{bump, Counters, Events, WorkerEvent};
use super::fetch::{Held, MessageId, Source};
use super::in_flight::TaskInfo;
use super::settle::{Action, Done};
use crate::envelope::stamp::{
    BusNameStamp, ReceivedStamp, RedeliveredStamp, StoppedByFilterStamp, UnsentStamp,
};
use crate::envelope::Envelope;
use crate::messenger::Messenger;
use crate::pipeline::bus::MessageBus;
use crate::transport::{Payload, RawMessage};

/// What every message a worker handles shares: the messenger, where
/// events go, the counters, the receivers and their park failures.
pub(super) struct Ctx {
    pub(super) messenger: Messenger,
    pub(super) events: Events,
    pub(super) counters: Arc<Counters>,
    pub(super) receivers: Vec<Source>,
    /// The messenger has only the default bus: every message goes there.
    single_bus: bool,
    /// Per receiver, the attempts to park its messages that failed in a
    /// row (reset by one that works).
    pub(super) park_failures: Vec<AtomicU32>,
    /// Per receiver, whether parking one of its messages failed since
    /// [`Ctx::park_backoff`] last looked.
    pub(super) park_failed: Vec<AtomicBool>,
    /// Whether parking failed for any receiver since
    /// [`Ctx::take_park_failed`] last looked.
    pub(super) any_park_failed: AtomicBool,
}

/// What to do with a message once started.
pub(super) enum Work {
    /// Dispatch the envelope (as the transport handed it out).
    Dispatch(Envelope),
    /// It did not decode: park it as it is.
    /// (Boxed: it is rare, and every started message's future holds a
    /// `Work`.)
    Park(Box<(RawMessage, crate::error::SerializationError)>),
}

impl Ctx {
    pub(super) fn new(
        messenger: Messenger,
        events: Events,
        counters: Arc<Counters>,
        receivers: Vec<Source>,
    ) -> Self {
        let single_bus = messenger.buses().nth(1).is_none();
        Self {
            single_bus,
            messenger,
            events,
            counters,
            park_failures: receivers.iter().map(|_| AtomicU32::new(0)).collect(),
            park_failed: receivers.iter().map(|_| AtomicBool::new(false)).collect(),
            any_park_failed: AtomicBool::new(false),
            receivers,
        }
    }

    pub(super) fn bus_for(&self, envelope: &Envelope) -> &MessageBus {
        if self.single_bus {
            return self.messenger.bus();
        }
        envelope
            .last::<BusNameStamp>()
            .and_then(|b| self.messenger.bus_named(&b.bus))
            .unwrap_or_else(|| self.messenger.bus())
    }

    /// Counts a held message as received and decodes it: returns what to
    /// record about it while it is handled, and what to do with it.
    pub(super) fn begin(&self, held: Held) -> (TaskInfo, Work) {
        let Held {
            receiver,
            id,
            payload,
            redelivered,
            since,
        } = held;
        bump(&self.counters.received);
        // The transport's mark of a redelivery becomes a stamp, which lets
        // deduplication take over the claim of a consumer that died.
        let marked = |e: Envelope| {
            if redelivered {
                e.with(RedeliveredStamp::new())
            } else {
                e
            }
        };
        let (work, envelope) = match payload {
            Payload::Envelope(e) => {
                let e = marked(e);
                (Work::Dispatch(e.clone()), Some(e))
            }
            Payload::Raw(raw) => match self.messenger.serializer().decode(&raw) {
                Ok(e) => {
                    let e = marked(e);
                    (Work::Dispatch(e.clone()), Some(e))
                }
                Err(error) => (Work::Park(Box::new((raw, error))), None),
            },
        };
        let task = TaskInfo {
            receiver,
            id,
            since,
            envelope,
        };
        (task, work)
    }

    /// Handles one started message.
    ///
    /// Parking (rare) is awaited through a box: a future holds the state of
    /// everything it awaits inline, and this one is moved into its slot for
    /// every message.
    pub(super) async fn process(&self, receiver: usize, id: MessageId, work: Work) -> Done {
        match work {
            Work::Dispatch(envelope) => self.handle(receiver, id, envelope).await,
            Work::Park(parked) => {
                let (raw, error) = *parked;
                Box::pin(self.park_raw(receiver, &id.text(), raw, error)).await
            }
        }
    }

    /// Dispatches a decoded message on its bus and settles it by the
    /// verdict; one parked because it could not be sent is sent instead.
    async fn handle(&self, receiver: usize, id: MessageId, envelope: Envelope) -> Done {
        let transport = &self.receivers[receiver].name;
        self.events.emit(|| WorkerEvent::Received {
            transport: transport.clone(),
            id: id.text().into_owned(),
            message: envelope.message_name(),
        });
        // Parked because it could not be sent: it is sent, not handled.
        if envelope.has::<UnsentStamp>() {
            return Box::pin(self.send_unsent(receiver, id, envelope)).await;
        }
        // `envelope` is shared (with the transport's lease, with the copy
        // kept in case the handler panics) and is kept as received; the
        // dispatched copy takes the stamps of the receipt (one copy of the
        // stamps, which the pipeline then adds to in place).
        let stamped = id.stamp(envelope.clone().with(ReceivedStamp {
            transport: transport.clone(),
        }));
        let started = self.events.enabled().then(Instant::now);
        let verdict = self.bus_for(&stamped).receive(stamped).await;
        let duration = started.map(|s| s.elapsed()).unwrap_or_default();
        self.settle(receiver, id, &envelope, verdict, duration)
            .await
    }

    /// Counts and reports a message handled (or stopped by a filter, counted
    /// apart), and says to acknowledge it.
    pub(super) fn handled(
        &self,
        receiver: usize,
        id: &MessageId,
        envelope: Envelope,
        duration: Duration,
    ) -> Action {
        if envelope.has::<StoppedByFilterStamp>() {
            bump(&self.counters.stopped_by_filter);
        } else {
            bump(&self.counters.handled);
        }
        self.events.emit(|| WorkerEvent::Handled {
            transport: self.receivers[receiver].name.clone(),
            id: id.text().into_owned(),
            envelope,
            duration,
        });
        Action::Ack
    }

    /// Counts and reports a message the retry step sent back for another
    /// try, and says to acknowledge it (the retry is a message of its own).
    pub(super) fn retried(
        &self,
        receiver: usize,
        id: &MessageId,
        envelope: Envelope,
        attempt: u32,
        duration: Duration,
    ) -> Action {
        bump(&self.counters.retried);
        self.parked(receiver, true);
        self.events.emit(|| WorkerEvent::Retried {
            transport: self.receivers[receiver].name.clone(),
            id: id.text().into_owned(),
            retry_count: attempt,
            envelope,
            duration,
        });
        Action::Ack
    }
}
