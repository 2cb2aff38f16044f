//! Typed dispatch from a handler's [`Context`]: on the bus the handler
//! runs on, now or once the current dispatch has succeeded.

use crate::envelope::message::{Command, Event, Query};
use crate::envelope::Envelope;
use crate::error::BusError;
use crate::middleware::correlation::{self, CorrelationContext};
use crate::pipeline::context::Context;
use crate::typed::{DispatchError, Dispatcher, EventErrors};

impl Context {
    /// A typed dispatcher on the bus the handler runs on, with the default
    /// dispatch span and no middleware of its own.
    pub fn dispatcher(&self) -> Dispatcher {
        Dispatcher::new(self.bus().clone())
    }

    /// Dispatches `command` now and returns its handler's output, as
    /// [`Dispatcher::dispatch`] does.
    pub async fn dispatch<C: Command>(
        &self,
        command: C,
    ) -> Result<C::Output, DispatchError<C::Error>> {
        self.dispatcher().dispatch(command).await
    }

    /// Asks `query` now and returns its handler's answer, as
    /// [`Dispatcher::ask`] does.
    pub async fn ask<Q: Query>(&self, query: Q) -> Result<Q::Output, DispatchError<Q::Error>> {
        self.dispatcher().ask(query).await
    }

    /// Publishes `event` to its handlers (or transports) now, as
    /// [`Dispatcher::publish`] does.
    pub async fn publish<E: Event>(
        &self,
        event: E,
    ) -> Result<(), DispatchError<EventErrors<E::Error>>> {
        self.dispatcher().publish(event).await
    }

    /// Dispatches `command` once the dispatch running this handler has
    /// succeeded, middleware included (see
    /// [`dispatch_after_current_bus`](crate::pipeline::dispatch_after_current_bus)):
    /// if it fails, the command is dropped. Returns at once, without its
    /// output. Called from work spawned onto another task, it is dispatched
    /// at once, and its failure returned.
    ///
    /// When the message being handled has a correlation id, the command
    /// carries the conversation on, as caused by that message: the
    /// [`Correlation`](crate::middleware::correlation::Correlation)
    /// middleware cannot, as the handler has returned when it runs.
    pub async fn dispatch_after_current<C: Command>(&self, command: C) -> Result<(), BusError> {
        self.after_current(Envelope::new(command)).await
    }

    /// Publishes `event` once the dispatch running this handler has
    /// succeeded; see [`dispatch_after_current`](Self::dispatch_after_current).
    pub async fn publish_after_current<E: Event>(&self, event: E) -> Result<(), BusError> {
        self.after_current(Envelope::event(event)).await
    }

    async fn after_current(&self, envelope: Envelope) -> Result<(), BusError> {
        let envelope = match (self.correlation_id(), self.message_id()) {
            (Some(correlation_id), Some(message_id)) => correlation::stamp_with(
                envelope,
                Some(CorrelationContext {
                    correlation_id,
                    message_id,
                }),
            ),
            _ => envelope,
        };
        self.bus()
            .dispatch_after_current(envelope)
            .await
            .map(|_| ())
    }
}
