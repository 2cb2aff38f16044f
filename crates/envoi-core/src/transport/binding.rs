//! How a transport learns about the messenger it is registered with.

use std::fmt;
use std::sync::{Arc, Weak};

use super::serializer::Serializer;
use crate::envelope::Envelope;
use crate::error::Result;
use crate::BoxFuture;

/// What a messenger tells a transport registered with it; see
/// [`Transport::bind`](super::Transport::bind).
#[derive(Clone)]
pub struct TransportBinding {
    name: Arc<str>,
    serializer: Serializer,
    inbox: Weak<dyn Inbox>,
}

impl TransportBinding {
    /// The binding of the transport registered as `name`.
    pub fn new(name: Arc<str>, serializer: Serializer, inbox: Weak<dyn Inbox>) -> Self {
        Self {
            name,
            serializer,
            inbox,
        }
    }

    /// The name the transport is registered under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The messenger's serializer.
    pub fn serializer(&self) -> &Serializer {
        &self.serializer
    }

    /// The messenger, to hand it messages received now; `None` once it is
    /// gone (the binding does not keep it alive).
    pub fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        self.inbox.upgrade()
    }
}

impl fmt::Debug for TransportBinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransportBinding")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The messenger as a transport registered with it sees it: it takes a
/// message the transport received and dispatches it now, on the bus its
/// `BusNameStamp` names (the default bus when it names none the messenger
/// has). The sync transport, which handles what is sent to it, uses it.
pub trait Inbox: Send + Sync + 'static {
    /// Dispatches `envelope`, stamped as received, and returns what came
    /// back.
    fn dispatch_received(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope>>;
}
