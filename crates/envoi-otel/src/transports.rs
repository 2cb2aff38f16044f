//! What the spans say about each transport of a messenger: its
//! [`TransportDescription`], learnt once when the middleware is attached.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use envoi_core::transport::TransportDescription;
use envoi_core::Messenger;

/// The description of every transport of the messengers the middleware
/// was attached to, by transport name.
#[derive(Debug, Default, Clone)]
pub(crate) struct Transports {
    by_name: Arc<RwLock<HashMap<String, TransportDescription>>>,
}

impl Transports {
    /// Learns the transports of `messenger` (a transport of the same name
    /// learnt before is replaced).
    pub(crate) fn learn(&self, messenger: &Messenger) {
        let mut by_name = self.by_name.write().unwrap_or_else(|p| p.into_inner());
        for (name, transport) in messenger.transports() {
            by_name.insert(name.to_owned(), transport.describe());
        }
    }

    /// The description of the transport called `name`; `unknown`, with no
    /// server, for one not learnt.
    pub(crate) fn describe(&self, name: &str) -> TransportDescription {
        self.by_name
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
            .unwrap_or_else(|| TransportDescription::new("unknown"))
    }
}
