//! [`AmqpTransportFactory`]: creates [`AmqpTransport`]s from `amqp://` DSNs.

use std::sync::Arc;

use envoi_core::transport::{dsn_has_scheme, Transport, TransportFactory};
use envoi_core::BoxFuture;
use envoi_core::TransportError;

use crate::AmqpTransport;

/// Creates [`AmqpTransport`]s for `amqp://` and `amqps://` DSNs.
///
/// ```
/// use envoi_amqp::AmqpTransportFactory;
/// use envoi_core::transport::TransportFactory;
///
/// let factory = AmqpTransportFactory;
/// assert!(factory.supports("amqp://guest:guest@127.0.0.1:5672/%2f"));
/// assert!(factory.supports("amqps://broker.example/%2f"));
/// assert!(factory.supports("AMQP://guest:guest@127.0.0.1:5672/%2f"));
/// assert!(!factory.supports("redis://127.0.0.1:6379"));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct AmqpTransportFactory;

impl TransportFactory for AmqpTransportFactory {
    fn supports(&self, dsn: &str) -> bool {
        dsn_has_scheme(dsn, "amqp://") || dsn_has_scheme(dsn, "amqps://")
    }

    fn create<'a>(
        &'a self,
        name: &'a str,
        dsn: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Transport>, TransportError>> {
        Box::pin(async move {
            let transport = AmqpTransport::connect(name, dsn).await?;
            Ok(Arc::new(transport) as Arc<dyn Transport>)
        })
    }
}
