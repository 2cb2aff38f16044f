//! Putting transports to work: the envelope-level [`TransportSender`], the
//! dispatcher a messenger sends through, and
//! [`TransportFactories`], which create transports from DSNs.
//!
//! Core knows two DSN schemes:
//!
//! * `in-memory://` — an [`InMemoryTransport`]; options `serialize=true`
//!   (encode every message, default `false`) and `lease_timeout_ms=N`;
//! * `sync://` — a [`SyncTransport`], which handles messages when they are
//!   sent.
//!
//! Transport crates add theirs by providing a [`TransportFactory`]; register
//! it with
//! `MessengerBuilder::transport_factory`
//! or [`TransportFactories::with`].
//!
//! ```
//! use envoi_core::transport::registry::TransportFactories;
//! use envoi_core::TransportError;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let factories = TransportFactories::default();
//! let queue = factories.create("async", "in-memory://?serialize=true").await.unwrap();
//! assert!(queue.as_local_receiver().is_none(), "every message is encoded");
//! match factories.create("db", "mysql://root:secret@db/app").await {
//!     Err(TransportError::InvalidDsn { dsn, .. }) => assert_eq!(dsn, "mysql://root:***@db/app"),
//!     other => panic!("{other:?}"),
//! }
//! # });
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::envelope::stamp::{DelayStamp, TransportMessageIdStamp};
use crate::envelope::Envelope;
use crate::error::{BusError, Result, TransportError};
use crate::transport::in_memory::InMemoryTransport;
use crate::transport::serializer::Serializer;
use crate::transport::sync::SyncTransport;
use crate::transport::{
    dsn_has_scheme, mask_dsn, SendError, Sender, SenderDispatcher, Transport, TransportFactory,
};
use crate::BoxFuture;

/// Sends envelopes to one [`Transport`]: through its in-process side when it
/// has one, otherwise encoded by the [`Serializer`] and sent with the delay
/// of the envelope's last [`DelayStamp`].
#[derive(Clone)]
pub struct TransportSender {
    name: Arc<str>,
    transport: Arc<dyn Transport>,
    serializer: Serializer,
}

impl fmt::Debug for TransportSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransportSender")
            .field("name", &self.name)
            .finish()
    }
}

impl TransportSender {
    /// A sender to `transport`, called `name` in errors.
    pub fn new(
        name: impl Into<Arc<str>>,
        transport: Arc<dyn Transport>,
        serializer: Serializer,
    ) -> Self {
        Self {
            name: name.into(),
            transport,
            serializer,
        }
    }

    /// The transport.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// Sends `envelope`; returns it with a [`TransportMessageIdStamp`]. A
    /// transport that handles on send (`sync://`) returns what handling
    /// returned, errors included; any other failure is a
    /// [`BusError::Transport`] carrying the envelope.
    pub async fn send_envelope(&self, envelope: Envelope) -> Result<Envelope> {
        if let Some(local) = self.transport.as_local_sender() {
            return local.send_envelope(envelope).await;
        }
        let raw = match self.serializer.encode(&envelope) {
            Ok(raw) => raw,
            Err(e) => return Err(self.failed(envelope, e.into())),
        };
        let delay = envelope
            .last::<DelayStamp>()
            .map(DelayStamp::duration)
            .filter(|d| !d.is_zero());
        match self.transport.send(raw, delay).await {
            Ok(id) => Ok(envelope.with(TransportMessageIdStamp::new(id))),
            Err(e) => Err(self.failed(envelope, e)),
        }
    }

    fn failed(&self, envelope: Envelope, source: TransportError) -> BusError {
        BusError::Transport {
            transport: self.name.to_string(),
            envelope: Some(Box::new(envelope)),
            source,
        }
    }
}

impl Sender for TransportSender {
    fn send(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope, SendError>> {
        Box::pin(async move {
            let fallback = envelope.clone();
            self.send_envelope(envelope).await.map_err(|e| match e {
                BusError::Transport {
                    envelope, source, ..
                } => SendError {
                    envelope: envelope.unwrap_or_else(|| Box::new(fallback)),
                    source,
                },
                other => SendError {
                    envelope: Box::new(other.envelope().cloned().unwrap_or(fallback)),
                    source: TransportError::backend("handling on send", other),
                },
            })
        })
    }
}

#[derive(Clone)]
enum Target {
    Transport(TransportSender),
    Sender(Arc<dyn Sender>),
}

/// The [`SenderDispatcher`] a `Messenger` builds: sends
/// at once to registered transports (through [`TransportSender`]s) and to
/// registered plain [`Sender`]s.
#[derive(Clone, Default)]
pub(crate) struct Senders {
    targets: BTreeMap<String, Target>,
}

impl fmt::Debug for Senders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.targets.keys()).finish()
    }
}

impl Senders {
    /// No targets.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Sends to `name` through `sender` (replacing any target of that name).
    pub(crate) fn insert_transport(&mut self, name: impl Into<String>, sender: TransportSender) {
        self.targets.insert(name.into(), Target::Transport(sender));
    }

    /// Sends to `name` through a plain [`Sender`].
    pub(crate) fn insert_sender(&mut self, name: impl Into<String>, sender: Arc<dyn Sender>) {
        self.targets.insert(name.into(), Target::Sender(sender));
    }

    /// Whether `name` is a target.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.targets.contains_key(name)
    }
}

impl SenderDispatcher for Senders {
    fn send<'a>(
        &'a self,
        transport: &'a str,
        envelope: Envelope,
    ) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(async move {
            match self.targets.get(transport) {
                Some(Target::Transport(t)) => t.send_envelope(envelope).await,
                Some(Target::Sender(s)) => {
                    s.send(envelope).await.map_err(|e| BusError::Transport {
                        transport: transport.to_string(),
                        envelope: Some(e.envelope),
                        source: e.source,
                    })
                }
                None => Err(BusError::Transport {
                    transport: transport.to_string(),
                    envelope: Some(Box::new(envelope)),
                    source: TransportError::UnknownTransport(transport.to_string()),
                }),
            }
        })
    }

    fn transports(&self) -> Vec<String> {
        self.targets.keys().cloned().collect()
    }

    fn direct(&self, transport: &str) -> Option<Arc<dyn Transport>> {
        match self.targets.get(transport) {
            Some(Target::Transport(t)) => Some(t.transport().clone()),
            _ => None,
        }
    }
}

/// Creates the `in-memory://` transport.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct InMemoryFactory;

impl TransportFactory for InMemoryFactory {
    fn supports(&self, dsn: &str) -> bool {
        dsn_has_scheme(dsn, "in-memory://")
    }

    fn create<'a>(
        &'a self,
        _name: &'a str,
        dsn: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Transport>, TransportError>> {
        let out = InMemoryTransport::from_dsn(dsn).map(|t| Arc::new(t) as Arc<dyn Transport>);
        Box::pin(async move { out })
    }
}

/// Creates the `sync://` transport.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SyncFactory;

impl TransportFactory for SyncFactory {
    fn supports(&self, dsn: &str) -> bool {
        dsn_has_scheme(dsn, "sync://")
    }

    fn create<'a>(
        &'a self,
        _name: &'a str,
        dsn: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Transport>, TransportError>> {
        let out = SyncTransport::from_dsn(dsn).map(|t| Arc::new(t) as Arc<dyn Transport>);
        Box::pin(async move { out })
    }
}

/// The registered [`TransportFactory`] values. The default set knows
/// `in-memory://` and `sync://`; factories registered later are asked first,
/// so an application can override a scheme.
#[derive(Clone)]
pub struct TransportFactories {
    factories: Vec<Arc<dyn TransportFactory>>,
}

impl Default for TransportFactories {
    fn default() -> Self {
        Self {
            factories: vec![Arc::new(InMemoryFactory), Arc::new(SyncFactory)],
        }
    }
}

impl fmt::Debug for TransportFactories {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransportFactories")
            .field("count", &self.factories.len())
            .finish()
    }
}

impl TransportFactories {
    /// The built-in factories (`in-memory://`, `sync://`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `factory`, asked before those registered earlier.
    #[must_use]
    pub fn with(mut self, factory: impl TransportFactory) -> Self {
        self.register(Arc::new(factory));
        self
    }

    /// Adds a shared `factory`, asked before those registered earlier.
    pub fn register(&mut self, factory: Arc<dyn TransportFactory>) {
        self.factories.push(factory);
    }

    /// Creates the transport called `name` from `dsn` with the first
    /// factory (latest registered first) that supports it. A DSN no factory
    /// supports, or one the factory refuses, is a
    /// [`TransportError::InvalidDsn`] with any password masked.
    pub async fn create(
        &self,
        name: &str,
        dsn: &str,
    ) -> Result<Arc<dyn Transport>, TransportError> {
        match self.factories.iter().rev().find(|f| f.supports(dsn)) {
            Some(factory) => factory.create(name, dsn).await,
            None => Err(TransportError::InvalidDsn {
                dsn: mask_dsn(dsn),
                reason: match dsn.split_once("://") {
                    Some((scheme, _)) => format!(
                        "no transport factory for the scheme `{scheme}://` (is the transport's crate or feature enabled?)"
                    ),
                    None => "a DSN looks like `scheme://…`".into(),
                },
            }),
        }
    }
}
