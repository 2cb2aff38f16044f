//! Step 1 of the canonical pipeline: stamp the envelope with the bus name.

use std::borrow::Cow;

use crate::envelope::stamp::{intern_bus_name, BusNameStamp};
use crate::envelope::Envelope;
use crate::error::Result;
use crate::middleware::{Middleware, Next};
use crate::BoxFuture;

/// Adds a [`BusNameStamp`] naming this bus unless the envelope already has
/// one (a message received from a transport keeps the bus it was sent from).
#[derive(Debug, Clone)]
pub struct AddBusNameStamp {
    bus: &'static str,
}

impl AddBusNameStamp {
    /// The step for bus `bus`.
    pub fn new(bus: impl AsRef<str>) -> Self {
        Self {
            bus: intern_bus_name(bus.as_ref()),
        }
    }

    /// The stamping itself, shared by the bus's inline pipeline.
    #[inline]
    pub(crate) fn apply(&self, envelope: Envelope) -> Envelope {
        if envelope.has::<BusNameStamp>() {
            envelope
        } else {
            envelope.with(BusNameStamp {
                bus: Cow::Borrowed(self.bus),
            })
        }
    }
}

impl Middleware for AddBusNameStamp {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(next.run(self.apply(envelope)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Ping, RecordingEndpoint};

    #[tokio::test]
    async fn stamps_the_bus_name_before_next() {
        let end = RecordingEndpoint::new();
        let mw = AddBusNameStamp::new("command.bus");
        mw.handle(Envelope::new(Ping), end.next()).await.unwrap();
        let seen = end.single();
        assert_eq!(
            seen.last::<BusNameStamp>().unwrap().bus.as_ref(),
            "command.bus"
        );
    }

    #[tokio::test]
    async fn keeps_an_existing_bus_name() {
        let end = RecordingEndpoint::new();
        let mw = AddBusNameStamp::new("event.bus");
        let e = Envelope::new(Ping).with(BusNameStamp::new("command.bus"));
        mw.handle(e, end.next()).await.unwrap();
        let seen = end.single();
        assert_eq!(seen.all::<BusNameStamp>().count(), 1);
        assert_eq!(
            seen.last::<BusNameStamp>().unwrap().bus.as_ref(),
            "command.bus"
        );
    }
}
