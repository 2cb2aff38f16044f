//! What the test kit saw, in order: a [`Record`] per thing that happened to
//! a message, written by a middleware on every bus ([`Recorder`]: what was
//! dispatched, sent and handled) and by the worker's events (what was
//! retried, parked or failed).

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::envelope::stamp::{DelayStamp, HandledStamp, HandlerResult, ReceivedStamp, SentStamp};
use crate::envelope::Envelope;
use crate::error::Result;
use crate::middleware::{Middleware, Next};
use crate::worker::WorkerEvent;
use crate::BoxFuture;

/// What happened to a message; see [`Record`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Activity {
    /// The application dispatched it on a bus (a handler's deferred
    /// dispatch counts when it runs, after the dispatch that deferred it
    /// succeeded). A message a worker received from a transport is not
    /// dispatched again.
    Dispatched {
        /// The bus.
        bus: String,
    },
    /// Its dispatch sent it to a transport it is routed to.
    Sent {
        /// The transport.
        transport: String,
    },
    /// A handler ran and succeeded: once per handler (an event with two
    /// handlers is handled twice).
    Handled {
        /// The handler's name.
        handler: String,
        /// What it returned (empty when it returned `()`).
        result: HandlerResult,
    },
    /// Its handlers failed and the retry step sent it back to its
    /// transport, to be tried again after `delay`.
    Retried {
        /// The transport it came from, and goes back to.
        transport: String,
        /// Which retry it is (1 for the first).
        attempt: u32,
        /// How long it waits before it is handed out again.
        delay: Duration,
    },
    /// It failed for good and went to a failure transport.
    Parked {
        /// The transport it came from.
        transport: String,
        /// The failure transport it went to.
        failure_transport: String,
        /// Why it failed.
        error: String,
    },
    /// A worker could not handle it and it went to no failure transport:
    /// rejected (none is configured) or released, to be delivered again.
    Failed {
        /// The transport it came from.
        transport: String,
        /// Why it failed.
        error: String,
    },
}

impl Activity {
    /// The verb a listing shows (`dispatched`, `sent`, …).
    pub fn verb(&self) -> &'static str {
        match self {
            Activity::Dispatched { .. } => "dispatched",
            Activity::Sent { .. } => "sent",
            Activity::Handled { .. } => "handled",
            Activity::Retried { .. } => "retried",
            Activity::Parked { .. } => "parked",
            Activity::Failed { .. } => "failed",
        }
    }
}

/// One thing the test kit saw happen to a message.
#[derive(Clone)]
#[non_exhaustive]
pub struct Record {
    /// What happened.
    pub activity: Activity,
    /// The message's name ([`Message::NAME`](crate::Message::NAME), or the
    /// `type` header of a message that did not decode).
    pub message: Cow<'static, str>,
    /// The envelope, when there is one (a message that did not decode has
    /// none).
    pub envelope: Option<Envelope>,
}

impl Record {
    /// The message, when it is an `M`.
    pub fn message<M: crate::Message>(&self) -> Option<&M> {
        self.envelope.as_ref()?.message::<M>()
    }
}

impl fmt::Debug for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Record")
            .field("activity", &self.activity)
            .field("message", &self.message)
            .finish_non_exhaustive()
    }
}

/// A record as one line of a listing: `handled PlaceOrder { id: 1 } by
/// place_order`.
impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:<10} ", self.activity.verb())?;
        match &self.envelope {
            Some(envelope) => write!(f, "{:?}", envelope.message_debug())?,
            None => write!(f, "{} (not decoded)", self.message)?,
        }
        match &self.activity {
            Activity::Dispatched { bus } => write!(f, " on `{bus}`"),
            Activity::Sent { transport } => write!(f, " to `{transport}`"),
            Activity::Handled { handler, .. } => write!(f, " by {handler}"),
            Activity::Retried {
                transport,
                attempt,
                delay,
            } => write!(f, " on `{transport}`: retry {attempt} after {delay:?}"),
            Activity::Parked {
                transport,
                failure_transport,
                error,
            } => write!(f, " from `{transport}` in `{failure_transport}`: {error}"),
            Activity::Failed { transport, error } => write!(f, " from `{transport}`: {error}"),
        }
    }
}

/// The records, shared by the recorder, the worker's listener and the kit.
#[derive(Debug, Clone, Default)]
pub(super) struct Journal(Arc<Mutex<Vec<Record>>>);

impl Journal {
    fn lock(&self) -> MutexGuard<'_, Vec<Record>> {
        // A panicking test thread leaves whole records behind: keep them.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, activity: Activity, envelope: &Envelope) {
        self.lock().push(Record {
            activity,
            message: Cow::Borrowed(envelope.message_name()),
            envelope: Some(envelope.clone()),
        });
    }

    /// Every record so far, oldest first.
    pub(super) fn records(&self) -> Vec<Record> {
        self.lock().clone()
    }

    /// Forgets every record.
    pub(super) fn clear(&self) {
        self.lock().clear();
    }

    /// Records what a worker tells: retries, parked and failed messages
    /// (what was handled comes from the [`Recorder`], in the order the
    /// pipeline ran).
    pub(super) fn on_worker_event(&self, event: &WorkerEvent) {
        match event {
            WorkerEvent::Retried {
                transport,
                envelope,
                retry_count,
                ..
            } => {
                let delay = envelope
                    .last::<DelayStamp>()
                    .map_or(Duration::ZERO, DelayStamp::duration);
                let activity = Activity::Retried {
                    transport: transport.to_string(),
                    attempt: *retry_count,
                    delay,
                };
                self.push(activity, envelope);
            }
            WorkerEvent::Failed {
                transport,
                message,
                error,
                parked_in,
                envelope,
                ..
            } => {
                let activity = match parked_in {
                    Some(failure) => Activity::Parked {
                        transport: transport.to_string(),
                        failure_transport: failure.clone(),
                        error: error.clone(),
                    },
                    None => Activity::Failed {
                        transport: transport.to_string(),
                        error: error.clone(),
                    },
                };
                self.lock().push(Record {
                    activity,
                    message: message.clone(),
                    envelope: envelope.clone(),
                });
            }
            _ => {}
        }
    }
}

/// The middleware the kit appends to each bus: records each dispatch the
/// application makes, the transports it was sent to, and each handler that
/// succeeded, as the pipeline returns.
///
/// It reads stamps to describe what the steps after it did (the
/// [`SentStamp`]s and [`HandledStamp`]s they added, a [`ReceivedStamp`]
/// telling a received message from a dispatch); it adds none and changes
/// nothing.
pub(super) struct Recorder {
    pub(super) journal: Journal,
    /// The bus it records on.
    pub(super) bus: String,
}

impl Recorder {
    /// Records what the steps after the recorder did to a message that
    /// came in with `before` stamps and came back as `out`.
    fn record_outcome(&self, out: &Envelope, received: bool, before: (usize, usize)) {
        let (sent_before, handled_before) = before;
        // A received message's new `SentStamp` is its retry, which the
        // worker's event records.
        let mut sent = 0;
        if !received {
            for stamp in out.all::<SentStamp>().skip(sent_before) {
                let transport = stamp.transport.clone();
                self.journal.push(Activity::Sent { transport }, out);
                sent += 1;
            }
        }
        // A dispatch that sent the message ran no handler: the handled
        // stamps it came back with are a sync transport's, which recorded
        // them as it handled the message.
        if sent > 0 {
            return;
        }
        for stamp in out.all::<HandledStamp>().skip(handled_before) {
            let activity = Activity::Handled {
                handler: stamp.handler.to_string(),
                result: stamp.result.clone(),
            };
            self.journal.push(activity, out);
        }
    }
}

impl Middleware for Recorder {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(async move {
            let received = envelope.has::<ReceivedStamp>();
            if !received {
                let bus = self.bus.clone();
                self.journal.push(Activity::Dispatched { bus }, &envelope);
            }
            let before = (
                envelope.all::<SentStamp>().count(),
                envelope.all::<HandledStamp>().count(),
            );
            let result = next.run(envelope).await;
            let out = match &result {
                Ok(out) => Some(out),
                // With the stamps of the handlers that succeeded beside one
                // that failed, and of the sends made before one failed.
                Err(error) => error.envelope(),
            };
            if let Some(out) = out {
                self.record_outcome(out, received, before);
            }
            result
        })
    }

    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed("TestKit recorder")
    }
}
