//! Correlation and causation ids: which conversation a message belongs to,
//! and which message caused it.
//!
//! [`Correlation`] gives every message a [`MessageIdStamp`] (when it has
//! none) and a [`CorrelationIdStamp`]:
//!
//! * a message dispatched from inside a handler inherits the correlation id
//!   of the message that handler is handling, and gets a
//!   [`CausationIdStamp`] naming that message's id;
//! * any other message starts a conversation: its correlation id is its own
//!   message id, and it has no causation id;
//! * a message that already carries a correlation id (one received from a
//!   transport, or stamped by the caller) keeps it.
//!
//! The handler's context is kept in a task-local value set around the rest
//! of the pipeline, so it reaches every dispatch the handler makes on the
//! same task through a bus with this middleware. Work spawned onto another
//! task does not inherit it: read it with [`current`] and stamp the message
//! with [`stamp`] there. The same applies to dispatches deferred until after
//! the current one ([`DispatchAfterCurrentBusStamp`](crate::envelope::stamp::DispatchAfterCurrentBusStamp)),
//! which run after the handler has returned: stamp them with [`stamp`].
//!
//! Both stamps cross transports: the serializer knows them by default, so
//! a worker in another process decodes them and carries the conversation
//! on.
//!
//! ```
//! use envoi_core::middleware::correlation::{Correlation, CorrelationIdStamp};
//! use envoi_core::{Command, Message, Messenger};
//! use envoi_core::stamp::MessageIdStamp;
//! use std::convert::Infallible;
//!
//! #[derive(Debug, Clone)]
//! struct Ship;
//! impl Message for Ship { const NAME: &'static str = "Ship"; }
//! impl Command for Ship { type Output = (); type Error = Infallible; }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let messenger = Messenger::builder()
//!     .command_handler(|_: Ship| async { Ok::<_, Infallible>(()) })
//!     .middleware(Correlation)
//!     .build()
//!     .unwrap();
//! let out = messenger.bus().dispatch_message(Ship).await.unwrap();
//! let id = out.last::<MessageIdStamp>().unwrap().id;
//! assert_eq!(out.last::<CorrelationIdStamp>().unwrap().id, id);
//! # });
//! ```

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{BoxFuture, Middleware, Next};
use crate::envelope::stamp::{MessageIdStamp, Stamp};
use crate::envelope::Envelope;
use crate::error::Result;

/// The id of the conversation a message belongs to: the message id of the
/// message that started it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CorrelationIdStamp {
    /// The id.
    pub id: Uuid,
}

impl Stamp for CorrelationIdStamp {
    const NAME: &'static str = "CorrelationId";
}

/// The message id of the message whose handler dispatched this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CausationIdStamp {
    /// The id.
    pub id: Uuid,
}

impl Stamp for CausationIdStamp {
    const NAME: &'static str = "CausationId";
}

/// The message being handled on this task: what a message dispatched now
/// inherits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CorrelationContext {
    /// The conversation.
    pub correlation_id: Uuid,
    /// The message being handled, the cause of what is dispatched now.
    pub message_id: Uuid,
}

tokio::task_local! {
    static CURRENT: CorrelationContext;
}

/// The context of the message being handled on this task, if a
/// [`Correlation`] middleware is running it.
pub fn current() -> Option<CorrelationContext> {
    CURRENT.try_with(|c| *c).ok()
}

/// Stamps `envelope` as [`Correlation`] would on this task: a message id if
/// it has none, and — unless it has a correlation id already — the
/// correlation id and causation of the message being handled, or its own id
/// as a new correlation id.
pub fn stamp(envelope: Envelope) -> Envelope {
    stamp_with(envelope, current())
}

/// Stamps `envelope` as caused by the message `parent` describes (or as the
/// start of a conversation when `parent` is `None`).
pub fn stamp_with(envelope: Envelope, parent: Option<CorrelationContext>) -> Envelope {
    let envelope = if envelope.has::<MessageIdStamp>() {
        envelope
    } else {
        envelope.with(MessageIdStamp::generate())
    };
    if envelope.has::<CorrelationIdStamp>() {
        return envelope;
    }
    match parent {
        Some(p) => envelope
            .with(CorrelationIdStamp {
                id: p.correlation_id,
            })
            .with(CausationIdStamp { id: p.message_id }),
        None => {
            let id = envelope
                .last::<MessageIdStamp>()
                .map(|s| s.id)
                .unwrap_or_else(Uuid::now_v7);
            envelope.with(CorrelationIdStamp { id })
        }
    }
}

/// The correlation middleware; see the [module docs](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct Correlation;

impl Middleware for Correlation {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        let envelope = stamp(envelope);
        let context = match (
            envelope.last::<CorrelationIdStamp>(),
            envelope.last::<MessageIdStamp>(),
        ) {
            (Some(c), Some(m)) => CorrelationContext {
                correlation_id: c.id,
                message_id: m.id,
            },
            _ => return next.run(envelope).boxed(),
        };
        // Build the rest inside the scope: a middleware's synchronous part
        // runs when `next.run` is called.
        Box::pin(CURRENT.scope(context, async move { next.run(envelope).await }))
    }

    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed("Correlation")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FnEndpoint, Ping, RecordingEndpoint};
    use std::sync::{Arc, Mutex};

    #[tokio::test]
    async fn a_root_message_correlates_to_itself() {
        let end = RecordingEndpoint::new();
        Correlation
            .handle(Envelope::new(Ping), end.next())
            .await
            .unwrap();
        let e = end.single();
        let id = e.last::<MessageIdStamp>().unwrap().id;
        assert_eq!(e.last::<CorrelationIdStamp>().unwrap().id, id);
        assert!(!e.has::<CausationIdStamp>());
    }

    #[tokio::test]
    async fn a_message_dispatched_while_handling_inherits_correlation_and_names_its_cause() {
        let nested: Arc<Mutex<Option<Envelope>>> = Arc::default();
        let nested2 = nested.clone();
        let handler = FnEndpoint::new(move |e: Envelope| {
            let nested = nested2.clone();
            Box::pin(async move {
                let inner = RecordingEndpoint::new();
                Correlation
                    .handle(Envelope::new(Ping), inner.next())
                    .await?;
                *nested.lock().unwrap() = Some(inner.single());
                Ok(e)
            })
        });
        let outer = Correlation
            .handle(Envelope::new(Ping), Next::to_endpoint(&handler))
            .await
            .unwrap();
        let nested = nested.lock().unwrap().clone().unwrap();
        let outer_id = outer.last::<MessageIdStamp>().unwrap().id;
        let outer_corr = outer.last::<CorrelationIdStamp>().unwrap().id;
        assert_eq!(nested.last::<CorrelationIdStamp>().unwrap().id, outer_corr);
        assert_eq!(nested.last::<CausationIdStamp>().unwrap().id, outer_id);
        assert_ne!(nested.last::<MessageIdStamp>().unwrap().id, outer_id);
        assert!(current().is_none(), "the context ends with the dispatch");
    }

    #[tokio::test]
    async fn an_existing_correlation_id_is_kept_and_becomes_the_context() {
        let corr = Uuid::now_v7();
        let seen: Arc<Mutex<Option<CorrelationContext>>> = Arc::default();
        let seen2 = seen.clone();
        let handler = FnEndpoint::new(move |e: Envelope| {
            *seen2.lock().unwrap() = current();
            Box::pin(async move { Ok(e) })
        });
        let out = Correlation
            .handle(
                Envelope::new(Ping).with(CorrelationIdStamp { id: corr }),
                Next::to_endpoint(&handler),
            )
            .await
            .unwrap();
        assert_eq!(out.all::<CorrelationIdStamp>().count(), 1);
        let ctx = seen.lock().unwrap().unwrap();
        assert_eq!(ctx.correlation_id, corr);
        assert_eq!(ctx.message_id, out.last::<MessageIdStamp>().unwrap().id);
    }

    #[test]
    fn stamp_with_a_parent_sets_both_ids() {
        let parent = CorrelationContext {
            correlation_id: Uuid::now_v7(),
            message_id: Uuid::now_v7(),
        };
        let e = stamp_with(Envelope::new(Ping), Some(parent));
        assert_eq!(
            e.last::<CorrelationIdStamp>().unwrap().id,
            parent.correlation_id
        );
        assert_eq!(e.last::<CausationIdStamp>().unwrap().id, parent.message_id);
    }
}
