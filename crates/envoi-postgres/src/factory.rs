//! [`PostgresTransportFactory`]: creates transports from `postgres://` DSNs.

use std::sync::Arc;

use envoi_core::transport::{Transport, TransportFactory};
use envoi_core::{BoxFuture, TransportError};

use crate::config::is_postgres_scheme;
use crate::PostgresTransport;

/// Creates [`PostgresTransport`]s from `postgres://` and `postgresql://` DSNs.
///
/// ```
/// use envoi_core::transport::TransportFactory;
/// use envoi_postgres::PostgresTransportFactory;
///
/// let factory = PostgresTransportFactory;
/// assert!(factory.supports("postgres://app@db/shop?table=jobs"));
/// assert!(factory.supports("postgresql://app@db/shop"));
/// assert!(!factory.supports("redis://127.0.0.1:6379"));
/// ```
#[derive(Debug, Default, Clone, Copy)]
pub struct PostgresTransportFactory;

impl TransportFactory for PostgresTransportFactory {
    fn supports(&self, dsn: &str) -> bool {
        dsn.split_once("://")
            .is_some_and(|(scheme, _)| is_postgres_scheme(scheme))
    }

    fn create<'a>(
        &'a self,
        name: &'a str,
        dsn: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Transport>, TransportError>> {
        Box::pin(async move {
            let transport = PostgresTransport::connect(name, dsn).await?;
            Ok(Arc::new(transport) as Arc<dyn Transport>)
        })
    }
}
