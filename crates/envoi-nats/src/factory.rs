//! [`NatsTransportFactory`]: builds [`NatsTransport`]s from `nats://` DSNs.

use std::sync::Arc;

use envoi_core::transport::{dsn_has_scheme, Transport, TransportFactory};
use envoi_core::{BoxFuture, TransportError};

use crate::NatsTransport;

/// Creates a [`NatsTransport`] for every `nats://` DSN.
///
/// ```
/// use envoi_core::transport::TransportFactory;
/// use envoi_nats::NatsTransportFactory;
///
/// let factory = NatsTransportFactory;
/// assert!(factory.supports("nats://127.0.0.1:4222?stream=orders"));
/// assert!(!factory.supports("redis://127.0.0.1:6379"));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct NatsTransportFactory;

impl TransportFactory for NatsTransportFactory {
    fn supports(&self, dsn: &str) -> bool {
        dsn_has_scheme(dsn, "nats://")
    }

    fn create<'a>(
        &'a self,
        name: &'a str,
        dsn: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Transport>, TransportError>> {
        Box::pin(async move {
            let transport = NatsTransport::connect(name, dsn).await?;
            Ok(Arc::new(transport) as Arc<dyn Transport>)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dsns_of_other_schemes_are_not_supported_whatever_their_characters() {
        for dsn in ["", "nats:/", "€€€://x", "nats:/é", "naté://x", "redis://h"] {
            assert!(!NatsTransportFactory.supports(dsn), "{dsn}");
        }
        assert!(NatsTransportFactory.supports("NATS://127.0.0.1:4222"));
    }

    #[tokio::test]
    async fn a_bad_dsn_fails_before_connecting_and_masks_the_password() {
        let error = NatsTransportFactory
            .create("q", "nats://admin:s3cret@127.0.0.1:1?batch=none")
            .await
            .unwrap_err();
        match error {
            TransportError::InvalidDsn { dsn, reason } => {
                assert_eq!(dsn, "nats://admin:***@127.0.0.1:1?batch=none");
                assert!(reason.contains("batch"), "{reason}");
            }
            other => panic!("expected InvalidDsn, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_unreachable_server_is_unreachable_named_without_the_password() {
        let error = NatsTransportFactory
            .create("q", "nats://admin:s3cret@127.0.0.1:1")
            .await
            .unwrap_err();
        match &error {
            TransportError::Unreachable { dsn, .. } => {
                assert_eq!(dsn, "nats://admin:***@127.0.0.1:1")
            }
            other => panic!("expected Unreachable, got {other:?}"),
        }
        assert!(!format!("{error} {error:?}").contains("s3cret"), "{error}");
    }
}
