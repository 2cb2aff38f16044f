//! Step 7 of the canonical pipeline, the terminal: run the handlers.

use std::sync::{Arc, Weak};

use super::bus::BusInner;
use super::dispatch_after_current_bus::{run_now, scope, take_deferred, Deferred};
use super::frame;
use crate::envelope::message::MessageKind;
use crate::envelope::stamp::HandledStamp;
use crate::envelope::Envelope;
use crate::error::{BusError, HandlerError, Result, StepResult};
use crate::middleware::{Middleware, Next};
use crate::pipeline::handler::{ErasedHandler, HandlerRegistry, Handlers};
use crate::BoxFuture;

/// Looks up the handlers of the message's type and runs them one after the
/// other, adding one [`HandledStamp`] per handler that succeeded.
///
/// * A command or query without a handler fails with
///   [`BusError::NoHandler`]; an event without one is fine.
/// * A handler that already has a `HandledStamp` on the envelope (a retried
///   event whose other handler failed) is not run again.
/// * If any handler fails, the result is [`BusError::HandlerFailed`] with the
///   envelope (carrying the stamps of those that succeeded) and every error.
/// * What a handler that succeeded deferred goes to the dispatch's frame,
///   for step 2 to run once the dispatch is over; in a stack without step
///   2 (no frame), it runs once the handlers succeeded.
///
/// It never calls `next`: it is the end of the pipeline.
#[derive(Clone)]
pub struct HandleMessage {
    registry: Arc<HandlerRegistry>,
    /// The bus the step is part of, for the contexts of its handlers
    /// (none for a step assembled by hand). Weak: the bus holds the step.
    bus: Weak<BusInner>,
}

impl std::fmt::Debug for HandleMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandleMessage")
            .field("registry", &self.registry)
            .finish()
    }
}

impl HandleMessage {
    /// The step running `handlers`.
    pub fn new(handlers: Handlers) -> Self {
        Self::with_registry(Arc::new(handlers.0))
    }

    pub(crate) fn with_registry(registry: Arc<HandlerRegistry>) -> Self {
        Self {
            registry,
            bus: Weak::new(),
        }
    }

    /// The step as part of the bus `bus`, which its handlers' contexts
    /// dispatch on.
    pub(crate) fn on_bus(&self, bus: Weak<BusInner>) -> Self {
        Self {
            registry: self.registry.clone(),
            bus,
        }
    }

    /// The bus the step is part of, which handlers are called with.
    #[inline]
    pub(crate) fn bus(&self) -> &Weak<BusInner> {
        &self.bus
    }

    pub(crate) fn registry(&self) -> &HandlerRegistry {
        &self.registry
    }

    /// The message's handler when it has exactly one that has not handled
    /// it yet: the case the bus runs inline (see [`single_failed`]).
    #[inline]
    pub(crate) fn single(&self, envelope: &Envelope) -> Option<&dyn ErasedHandler> {
        match self
            .registry
            .get(envelope.message_type_id())?
            .handlers
            .as_slice()
        {
            [handler] if !already_handled(envelope, &**handler) => Some(&**handler),
            _ => None,
        }
    }

    /// Runs the handlers.
    pub(crate) async fn process(&self, envelope: Envelope) -> StepResult {
        let Some(reg) = self.registry.get(envelope.message_type_id()) else {
            return match envelope.kind() {
                MessageKind::Event => Ok(envelope),
                kind => Err(Box::new(BusError::NoHandler {
                    message: envelope.message_name(),
                    kind,
                })),
            };
        };
        let mut unframed = Vec::new();
        let mut envelope = envelope;
        let mut errors = Vec::new();
        for handler in &reg.handlers {
            if already_handled(&envelope, &**handler) {
                continue;
            }
            match scope(handler.call(&envelope, &self.bus)).await {
                Ok((result, scope_id)) => {
                    envelope = envelope.with(HandledStamp::new(handler.name(), result));
                    unframed.extend(hand_on(take_deferred(scope_id)));
                }
                Err(error) => errors.push(HandlerError {
                    handler: handler.name(),
                    error,
                }),
            }
        }
        if !errors.is_empty() {
            return Err(Box::new(BusError::HandlerFailed {
                envelope: Box::new(envelope),
                errors,
            }));
        }
        if unframed.is_empty() {
            Ok(envelope)
        } else {
            Box::pin(run_now(envelope, unframed)).await
        }
    }
}

/// The error of a message whose only handler failed.
pub(crate) fn single_failed(
    envelope: Envelope,
    handler: &dyn ErasedHandler,
    error: crate::error::BoxError,
) -> Box<BusError> {
    Box::new(BusError::HandlerFailed {
        envelope: Box::new(envelope),
        errors: vec![HandlerError {
            handler: handler.name(),
            error,
        }],
    })
}

/// Hands what a handler that succeeded deferred to the dispatch's frame,
/// for step 2; returns what has no frame to go to.
#[inline]
pub(crate) fn hand_on(deferred: Vec<Deferred>) -> Vec<Deferred> {
    frame::defer(deferred).err().unwrap_or_default()
}

#[inline]
fn already_handled(envelope: &Envelope, handler: &dyn ErasedHandler) -> bool {
    envelope
        .all::<HandledStamp>()
        .any(|s| s.handler == handler.name())
}

impl Middleware for HandleMessage {
    fn handle<'a>(
        &'a self,
        envelope: Envelope,
        _next: Next<'a>,
    ) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(async move { self.process(envelope).await.map_err(|e| *e) })
    }
}
