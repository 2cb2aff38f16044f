//! The records of one message type, as typed values: what the test kit's
//! accessors (`handled::<M>()`, `retried::<M>()`, …) return.

use std::time::Duration;

use super::journal::{Activity, Record};
use super::TestKit;
use crate::envelope::message::Message;
use crate::envelope::stamp::HandlerResult;

/// A handler that handled an `M`; see [`TestKit::handled_by`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Handled<M> {
    /// The message.
    pub message: M,
    /// The handler's name.
    pub handler: String,
    /// What it returned (empty when it returned `()`).
    pub result: HandlerResult,
}

/// A retry of an `M`; see [`TestKit::retried`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Retried<M> {
    /// The message.
    pub message: M,
    /// The transport it came from, and was sent back to.
    pub transport: String,
    /// Which retry it is (1 for the first).
    pub attempt: u32,
    /// How long it waited before it was handed out again.
    pub delay: Duration,
}

/// An `M` parked in a failure transport; see [`TestKit::parked`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Parked<M> {
    /// The message.
    pub message: M,
    /// The transport it came from.
    pub transport: String,
    /// The failure transport it went to.
    pub failure_transport: String,
    /// Why it failed.
    pub error: String,
}

impl TestKit {
    /// What `view` makes of each record of an `M`, in order.
    fn view<M, T>(&self, view: impl Fn(&Activity, M) -> Option<T>) -> Vec<T>
    where
        M: Message + Clone,
    {
        self.records()
            .iter()
            .filter_map(|r| view(&r.activity, r.message::<M>()?.clone()))
            .collect()
    }

    /// How many records of an `M` `matches` takes.
    pub(super) fn count<M: Message>(&self, matches: impl Fn(&Activity) -> bool) -> usize {
        self.records()
            .iter()
            .filter(|r| r.message::<M>().is_some() && matches(&r.activity))
            .count()
    }

    /// Each `M` the application dispatched, in order (a deferred dispatch
    /// when it ran).
    pub fn dispatched<M: Message + Clone>(&self) -> Vec<M> {
        self.view(|a, m: M| matches!(a, Activity::Dispatched { .. }).then_some(m))
    }

    /// Each `M` sent to a transport it is routed to, with the transport's
    /// name, in order.
    pub fn sent<M: Message + Clone>(&self) -> Vec<(String, M)> {
        self.view(|a, m: M| match a {
            Activity::Sent { transport } => Some((transport.clone(), m)),
            _ => None,
        })
    }

    /// Each `M` sent to `transport`, in order.
    pub fn sent_to<M: Message + Clone>(&self, transport: &str) -> Vec<M> {
        self.view(|a, m: M| match a {
            Activity::Sent { transport: t } if t == transport => Some(m),
            _ => None,
        })
    }

    /// Each `M` a handler handled successfully, in order: once per handler
    /// (an event two handlers handled is there twice), whether in process
    /// or received from a transport.
    pub fn handled<M: Message + Clone>(&self) -> Vec<M> {
        self.view(|a, m: M| matches!(a, Activity::Handled { .. }).then_some(m))
    }

    /// Each `M` a handler handled successfully, with the handler's name and
    /// what it returned, in order.
    pub fn handled_by<M: Message + Clone>(&self) -> Vec<Handled<M>> {
        self.view(|a, message: M| match a {
            Activity::Handled { handler, result } => Some(Handled {
                message,
                handler: handler.clone(),
                result: result.clone(),
            }),
            _ => None,
        })
    }

    /// Each retry of an `M` (attempt number and delay), in order.
    pub fn retried<M: Message + Clone>(&self) -> Vec<Retried<M>> {
        self.view(|a, message: M| match a {
            Activity::Retried {
                transport,
                attempt,
                delay,
            } => Some(Retried {
                message,
                transport: transport.clone(),
                attempt: *attempt,
                delay: *delay,
            }),
            _ => None,
        })
    }

    /// Each `M` parked in a failure transport (which, and why), in order.
    pub fn parked<M: Message + Clone>(&self) -> Vec<Parked<M>> {
        self.view(|a, message: M| match a {
            Activity::Parked {
                transport,
                failure_transport,
                error,
            } => Some(Parked {
                message,
                transport: transport.clone(),
                failure_transport: failure_transport.clone(),
                error: error.clone(),
            }),
            _ => None,
        })
    }

    /// Every record of a message that is an `M`, in order.
    pub fn records_of<M: Message>(&self) -> Vec<Record> {
        self.records()
            .into_iter()
            .filter(|r| r.message::<M>().is_some())
            .collect()
    }
}
