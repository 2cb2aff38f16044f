//! [`RedisTransportFactory`]: `redis://` DSNs to transports.

use std::sync::Arc;

use envoi_core::transport::{dsn_has_scheme, Transport, TransportFactory};
use envoi_core::{BoxFuture, TransportError};

use crate::RedisTransport;

/// Creates [`RedisTransport`]s from `redis://` DSNs with
/// [`RedisTransport::connect`] (see
/// [`RedisConfig::from_dsn`](crate::RedisConfig::from_dsn) for the
/// options). Creating connects nothing; the first use does.
///
/// ```
/// use envoi_core::transport::TransportFactory;
/// use envoi_redis::RedisTransportFactory;
///
/// let factory = RedisTransportFactory;
/// assert!(factory.supports("redis://127.0.0.1:6379?lease=2s"));
/// assert!(!factory.supports("postgres://postgres@127.0.0.1/test"));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct RedisTransportFactory;

impl TransportFactory for RedisTransportFactory {
    fn supports(&self, dsn: &str) -> bool {
        dsn_has_scheme(dsn, "redis://")
    }

    fn create<'a>(
        &'a self,
        name: &'a str,
        dsn: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Transport>, TransportError>> {
        Box::pin(async move {
            let transport: Arc<dyn Transport> = Arc::new(RedisTransport::connect(name, dsn).await?);
            Ok(transport)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_bad_dsn_is_invalid_with_the_password_masked() {
        let err = RedisTransportFactory
            .create("t", "redis://app:s3cret@127.0.0.1:6379?lease=never")
            .await
            .expect_err("a bad lease must be refused");
        match err {
            TransportError::InvalidDsn { dsn, reason } => {
                assert!(!dsn.contains("s3cret"), "{dsn}");
                assert!(reason.contains("lease"), "{reason}");
            }
            other => panic!("expected InvalidDsn, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_good_dsn_creates_a_transport_without_connecting() {
        // Nothing listens on port 1: creating must still succeed.
        let t = RedisTransportFactory
            .create("t", "redis://127.0.0.1:1")
            .await
            .expect("creating connects nothing");
        assert!(t.as_receiver().is_some());
    }

    #[test]
    fn supports_only_the_redis_scheme() {
        assert!(RedisTransportFactory.supports("REDIS://h"));
        assert!(!RedisTransportFactory.supports("rediss://h"));
        assert!(!RedisTransportFactory.supports("redis:"));
        assert!(!RedisTransportFactory.supports("amqp://h"));
    }
}
