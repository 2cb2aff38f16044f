//! What dispatching a received message did: the [`Verdict`] a worker
//! settles the message by.

use std::time::Duration;

use super::dispatch_after_current_bus::FailedDispatch;
use super::frame::RetryRecord;
use crate::envelope::Envelope;
use crate::error::{BusError, StepResult};

/// What became of a message received from a transport once it was
/// dispatched ([`MessageBus::receive`](super::bus::MessageBus::receive)),
/// with the dispatches its handlers deferred that failed afterwards.
#[derive(Debug)]
#[non_exhaustive]
pub struct Verdict {
    /// What became of the message.
    pub fate: Fate,
    /// Dispatches the message's handlers deferred that failed once they
    /// ran (after it was handled, retried or parked): a worker parks each
    /// on its own.
    pub failed_deferred: Vec<FailedDispatch>,
}

/// What became of a received message.
#[derive(Debug)]
#[non_exhaustive]
pub enum Fate {
    /// Its handlers ran and succeeded (or nothing had to: a filter stopped
    /// it, and its envelope then carries a
    /// [`StoppedByFilterStamp`](crate::stamp::StoppedByFilterStamp)). The
    /// envelope as the pipeline returned it.
    Handled(Envelope),
    /// A handler failed and the retry step sent it back to its transport.
    Retried {
        /// The retry as sent, when the pipeline handed it back (a
        /// middleware may turn it into an error that carries none).
        envelope: Option<Envelope>,
        /// Which retry it is (1 for the first).
        attempt: u32,
        /// How long it waits before it is handed out again.
        delay: Duration,
    },
    /// A handler failed for good and the retry step parked it.
    Parked {
        /// The message as the pipeline returned it (the parked copy as
        /// sent, with the stamps of its handlers that succeeded), when it
        /// did.
        envelope: Option<Envelope>,
        /// The failure transport it went to.
        failure_transport: String,
        /// Why: the handlers' failure.
        reason: String,
    },
    /// It failed and went nowhere: neither retried nor parked. The error
    /// says why: no handler, a middleware's error, handlers failing with
    /// no failure transport configured, a retry or park its transport did
    /// not take, a disposed bus.
    Failed(BusError),
}

impl Verdict {
    /// The verdict of a dispatch that returned `result`, whose retry step
    /// did what `retry` records. What the retry step did decides, whatever
    /// the middleware around it made of its result afterwards: a message
    /// retried or parked is somewhere else already.
    pub(crate) fn of(
        result: StepResult,
        retry: Option<RetryRecord>,
        failed_deferred: Vec<FailedDispatch>,
    ) -> Self {
        let fate = match (retry, result) {
            (Some(RetryRecord::Retried { attempt, delay }), result) => Fate::Retried {
                envelope: match result {
                    Ok(envelope) => Some(envelope),
                    Err(error) => error.envelope().cloned(),
                },
                attempt,
                delay,
            },
            (Some(RetryRecord::Parked { failure }), result) => {
                let (envelope, reason) = match result {
                    Err(error) => (error.envelope().cloned(), error.to_string()),
                    // A middleware took the failure for a success: the
                    // message is parked all the same.
                    Ok(envelope) => (Some(envelope), "its handlers failed for good".to_string()),
                };
                Fate::Parked {
                    envelope,
                    failure_transport: failure,
                    reason,
                }
            }
            (None, Ok(envelope)) => Fate::Handled(envelope),
            (None, Err(error)) => Fate::Failed(*error),
        };
        Self {
            fate,
            failed_deferred,
        }
    }
}
