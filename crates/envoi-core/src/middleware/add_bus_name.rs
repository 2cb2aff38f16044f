//! Step 1 of the canonical pipeline: stamp the envelope with the bus name.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Mutex;

use super::{BoxFuture, Middleware, Next};
use crate::envelope::Envelope;
use crate::error::Result;
use crate::stamp::BusNameStamp;

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
            bus: intern(bus.as_ref()),
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

/// Bus names as `'static` strings, each kept once for the life of the
/// program: buses are named when they are built, so the set stays as small
/// as the number of distinct bus names.
pub(crate) fn intern(name: &str) -> &'static str {
    static NAMES: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(|p| p.into_inner());
    let names = names.get_or_insert_with(HashSet::new);
    match names.get(name) {
        Some(interned) => interned,
        None => {
            let interned: &'static str = Box::leak(name.into());
            names.insert(interned);
            interned
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
