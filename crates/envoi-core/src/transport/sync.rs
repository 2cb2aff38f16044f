//! The sync transport (`sync://`): "sending" a message to it handles it at
//! once, in the sender's task, on the bus named by its
//! [`BusNameStamp`](crate::envelope::stamp::BusNameStamp) (the default bus
//! otherwise), with a [`ReceivedStamp`] naming the transport.
//!
//! It lets a route be switched between asynchronous and synchronous handling
//! by configuration alone. Because the message is handled during the send:
//!
//! * the caller gets the handlers' results (a query routed to `sync://` still
//!   returns its answer) and their errors;
//! * delays are ignored and nothing is retried (a failure goes straight
//!   back to the caller); there is nothing to consume, so a worker refuses
//!   it, and it cannot be a failure transport (the build refuses it).
//!
//! The transport must be registered with the messenger that handles its
//! messages (`MessengerBuilder::transport`
//! or `transport_dsn`).
//!
//! ```
//! use envoi_core::transport::sync::SyncTransport;
//! use envoi_core::{Message, Messenger, Query};
//! use serde::{Deserialize, Serialize};
//! use std::convert::Infallible;
//! use std::sync::Arc;
//!
//! #[derive(Debug, Clone, Serialize, Deserialize)]
//! struct Add(u32, u32);
//! impl Message for Add { const NAME: &'static str = "Add"; }
//! impl Query for Add { type Output = u32; type Error = Infallible; }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let messenger = Messenger::builder()
//!     .query_handler(|q: Add| async move { Ok::<_, Infallible>(q.0 + q.1) })
//!     .transport("sync", Arc::new(SyncTransport::new()))
//!     .route::<Add>("sync")
//!     .build()
//!     .unwrap();
//! assert_eq!(messenger.dispatcher().ask(Add(2, 3)).await.unwrap(), 5);
//! # });
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::envelope::stamp::{ReceivedStamp, TransportMessageIdStamp};
use crate::envelope::Envelope;
use crate::error::{BusError, Result, TransportError};
use crate::transport::{
    mask_dsn, strip_scheme, Inbox, LocalFuture, LocalSender, RawMessage, Receiver, Transport,
    TransportBinding, TransportDescription,
};
use crate::BoxFuture;

/// Handles messages when they are sent; see the [module documentation](self).
#[derive(Default)]
pub struct SyncTransport {
    binding: RwLock<Option<TransportBinding>>,
    next_id: AtomicU64,
}

impl fmt::Debug for SyncTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncTransport")
            .field("name", &self.binding().map(|b| b.name().to_string()))
            .finish()
    }
}

impl SyncTransport {
    /// A sync transport, to be registered with a messenger.
    pub fn new() -> Self {
        Self::default()
    }

    /// A sync transport from a `sync://` DSN (which takes no options).
    pub fn from_dsn(dsn: &str) -> Result<Self, TransportError> {
        match strip_scheme(dsn, "sync://") {
            Some("") => Ok(Self::new()),
            Some(rest) => Err(TransportError::InvalidDsn {
                dsn: mask_dsn(dsn),
                reason: format!("`sync://` takes no host, path or options, found `{rest}`"),
            }),
            None => Err(TransportError::InvalidDsn {
                dsn: mask_dsn(dsn),
                reason: "the scheme must be `sync://`".into(),
            }),
        }
    }

    fn binding(&self) -> Option<TransportBinding> {
        self.binding
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn target(&self) -> Result<(Arc<dyn Inbox>, TransportBinding), TransportError> {
        let binding = self.binding().ok_or_else(|| {
            TransportError::backend(
                "handling on the sync transport",
                "the transport is not registered with a messenger",
            )
        })?;
        let inbox = binding.inbox().ok_or(TransportError::Closed)?;
        Ok((inbox, binding))
    }

    async fn handle(&self, envelope: Envelope) -> Result<Envelope> {
        let (inbox, binding) = match self.target() {
            Ok(t) => t,
            Err(source) => {
                return Err(BusError::Transport {
                    transport: "sync".into(),
                    envelope: Some(Box::new(envelope)),
                    source,
                })
            }
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let envelope = envelope.with(ReceivedStamp::new(binding.name()));
        let handled = inbox.dispatch_received(envelope).await?;
        Ok(handled.with(TransportMessageIdStamp::new(id.to_string())))
    }
}

impl Transport for SyncTransport {
    /// In process, like the in-memory transport: `in_memory`.
    fn describe(&self) -> TransportDescription {
        TransportDescription::new("in_memory")
    }

    /// Decodes `message` and handles it now; a failure to decode or to
    /// handle is returned as an error. The delay is ignored.
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        let _ = delay;
        Box::pin(async move {
            let (_, binding) = self.target()?;
            let envelope = binding.serializer().decode(&message)?;
            match self.handle(envelope).await {
                Ok(out) => Ok(out
                    .last::<TransportMessageIdStamp>()
                    .map(|s| s.id.clone())
                    .unwrap_or_default()),
                Err(BusError::Transport { source, .. }) => Err(source),
                Err(e) => Err(TransportError::backend("handling on the sync transport", e)),
            }
        })
    }

    fn as_receiver(&self) -> Option<&dyn Receiver> {
        // Nothing waits here: what is sent is handled at once.
        None
    }

    fn as_local_sender(&self) -> Option<&dyn LocalSender> {
        Some(self)
    }

    fn bind(&self, binding: &TransportBinding) {
        *self.binding.write().unwrap_or_else(|p| p.into_inner()) = Some(binding.clone());
    }
}

impl LocalSender for SyncTransport {
    fn send_envelope(&self, envelope: Envelope) -> LocalFuture<'_, Result<Envelope>> {
        LocalFuture::pending(self.handle(envelope))
    }

    fn handles_on_send(&self) -> bool {
        true
    }
}
