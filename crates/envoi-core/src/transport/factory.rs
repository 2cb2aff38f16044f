//! Creating transports from DSNs.

use std::sync::Arc;

use super::Transport;
use crate::error::TransportError;
use crate::BoxFuture;

/// Creates transports from DSNs such as `sqlite://envoi.db` or
/// `redis://127.0.0.1:6379`. Each transport crate provides one.
pub trait TransportFactory: Send + Sync + 'static {
    /// Whether this factory understands `dsn` (usually by its scheme).
    fn supports(&self, dsn: &str) -> bool;

    /// Creates the transport called `name` from `dsn`. Fails with
    /// [`TransportError::InvalidDsn`] for a DSN it cannot use.
    fn create<'a>(
        &'a self,
        name: &'a str,
        dsn: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Transport>, TransportError>>;
}
