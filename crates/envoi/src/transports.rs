//! Transports configured by DSN, with a factory for every transport whose
//! cargo feature is enabled.
//!
//! | scheme | feature | module |
//! |---|---|---|
//! | `in-memory://`, `sync://` | always | [`in_memory`](crate::transport::in_memory), [`sync`](crate::transport::sync) |
//! | `sqlite://<path>` | `sqlite` (default) | `envoi::sqlite` |
//! | `postgres://`, `postgresql://` | `postgres` | `envoi::postgres` |
//! | `redis://` | `redis` | `envoi::redis` |
//! | `amqp://`, `amqps://` | `amqp` | `envoi::amqp` |
//! | `nats://` | `nats` | `envoi::nats` |
//!
//! [`MessengerBuilderExt::with_transport_factories`] registers them on a
//! [`MessengerBuilder`], so an application configures its transports by DSN
//! (from its configuration file or environment):
//!
//! ```
//! use envoi::{Messenger, MessengerBuilderExt};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let messenger = Messenger::builder()
//!     .with_transport_factories()
//!     .transport_dsn("async", "in-memory://?serialize=true")
//!     .build_async()
//!     .await
//!     .unwrap();
//! assert!(messenger.transport("async").is_some());
//!
//! // A scheme nobody provides is a clear error, never a panic.
//! let error = envoi::transports::from_dsn("db", "mysql://root:secret@db/app")
//!     .await
//!     .unwrap_err();
//! assert!(error.to_string().contains("mysql://"));
//! assert!(!error.to_string().contains("secret"));
//! # });
//! ```
//!
//! A DSN whose transport exists but whose feature is off says which feature
//! to enable. Everything else of core's
//! [`transport::registry`](envoi_core::transport::registry) module is
//! re-exported here.

use std::sync::Arc;

use envoi_core::middleware::BoxFuture;
use envoi_core::transport::{dsn_has_scheme, mask_dsn, Transport, TransportFactory};
use envoi_core::{MessengerBuilder, TransportError};

pub use envoi_core::transport::registry::*;

/// Each transport feature, the DSN prefixes it provides, and whether it is
/// enabled in this build.
const FEATURES: &[(&str, &[&str], bool)] = &[
    ("sqlite", &["sqlite:"], cfg!(feature = "sqlite")),
    (
        "postgres",
        &["postgres://", "postgresql://"],
        cfg!(feature = "postgres"),
    ),
    ("redis", &["redis://"], cfg!(feature = "redis")),
    ("amqp", &["amqp://", "amqps://"], cfg!(feature = "amqp")),
    ("nats", &["nats://"], cfg!(feature = "nats")),
];

/// The transport features enabled in this build, such as `["sqlite"]`.
///
/// ```
/// assert_eq!(
///     envoi::transports::enabled_features().contains(&"sqlite"),
///     cfg!(feature = "sqlite")
/// );
/// ```
pub fn enabled_features() -> Vec<&'static str> {
    FEATURES
        .iter()
        .filter(|(_, _, on)| *on)
        .map(|(name, _, _)| *name)
        .collect()
}

/// The DSN schemes this build can create transports for, such as
/// `["in-memory://", "sync://", "sqlite://"]`.
pub fn supported_schemes() -> Vec<&'static str> {
    let mut schemes = vec!["in-memory://", "sync://"];
    for (_, prefixes, on) in FEATURES {
        if *on {
            schemes.extend(prefixes.iter().map(|p| match *p {
                "sqlite:" => "sqlite://",
                other => other,
            }));
        }
    }
    schemes
}

/// Answers for the schemes of transports whose feature is off, with an
/// error naming the feature.
#[derive(Debug, Clone, Copy, Default)]
struct DisabledFeatures;

impl DisabledFeatures {
    fn feature_for(dsn: &str) -> Option<&'static str> {
        FEATURES
            .iter()
            .find(|(_, prefixes, on)| !*on && prefixes.iter().any(|p| dsn_has_scheme(dsn, p)))
            .map(|(name, _, _)| *name)
    }
}

impl TransportFactory for DisabledFeatures {
    fn supports(&self, dsn: &str) -> bool {
        Self::feature_for(dsn).is_some()
    }

    fn create<'a>(
        &'a self,
        _name: &'a str,
        dsn: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Transport>, TransportError>> {
        let feature = Self::feature_for(dsn).unwrap_or("?");
        let enabled = enabled_features();
        let error = TransportError::InvalidDsn {
            dsn: mask_dsn(dsn),
            reason: format!(
                "this transport needs the `{feature}` feature of the `envoi` crate (enabled: {})",
                if enabled.is_empty() {
                    "none".to_string()
                } else {
                    enabled.join(", ")
                }
            ),
        };
        Box::pin(async move { Err(error) })
    }
}

/// Every factory of this build: core's `in-memory://` and `sync://`, and one
/// per enabled transport feature.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let factories = envoi::transports::factories();
/// let queue = factories.create("async", "in-memory://").await.unwrap();
/// // What it can do beyond sending, each ability handed out by an `as_*`.
/// assert!(queue.as_receiver().is_some());
/// assert!(queue.as_setup().is_none(), "nothing to create in memory");
/// # });
/// ```
pub fn factories() -> TransportFactories {
    let mut factories = TransportFactories::new();
    factories.register(Arc::new(DisabledFeatures));
    #[cfg(feature = "sqlite")]
    factories.register(Arc::new(envoi_sqlite::SqliteTransportFactory));
    #[cfg(feature = "postgres")]
    factories.register(Arc::new(envoi_postgres::PostgresTransportFactory));
    #[cfg(feature = "redis")]
    factories.register(Arc::new(envoi_redis::RedisTransportFactory));
    #[cfg(feature = "amqp")]
    factories.register(Arc::new(envoi_amqp::AmqpTransportFactory));
    #[cfg(feature = "nats")]
    factories.register(Arc::new(envoi_nats::NatsTransportFactory));
    factories
}

/// Creates the transport called `name` from `dsn` with [`factories`].
///
/// # Errors
///
/// [`TransportError::InvalidDsn`] (password masked) for a scheme no enabled
/// transport provides — naming the feature to enable when there is one — or
/// a DSN the transport refuses; whatever the transport fails with when it
/// connects.
pub async fn from_dsn(name: &str, dsn: &str) -> Result<Arc<dyn Transport>, TransportError> {
    factories().create(name, dsn).await
}

/// Adds DSN support for every enabled transport feature to a
/// [`MessengerBuilder`].
pub trait MessengerBuilderExt {
    /// Registers the factory of every enabled transport feature, so
    /// [`transport_dsn`](MessengerBuilder::transport_dsn) accepts their
    /// schemes, and a scheme whose feature is off fails
    /// [`build_async`](MessengerBuilder::build_async) with an error naming
    /// the feature.
    fn with_transport_factories(self) -> Self;
}

impl MessengerBuilderExt for MessengerBuilder {
    fn with_transport_factories(mut self) -> Self {
        self = self.transport_factory(DisabledFeatures);
        #[cfg(feature = "sqlite")]
        {
            self = self.transport_factory(envoi_sqlite::SqliteTransportFactory);
        }
        #[cfg(feature = "postgres")]
        {
            self = self.transport_factory(envoi_postgres::PostgresTransportFactory);
        }
        #[cfg(feature = "redis")]
        {
            self = self.transport_factory(envoi_redis::RedisTransportFactory);
        }
        #[cfg(feature = "amqp")]
        {
            self = self.transport_factory(envoi_amqp::AmqpTransportFactory);
        }
        #[cfg(feature = "nats")]
        {
            self = self.transport_factory(envoi_nats::NatsTransportFactory);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disabled_feature_is_recognised_by_its_scheme_case_insensitively() {
        for (feature, prefixes, on) in FEATURES {
            for prefix in *prefixes {
                let dsn = format!("{}rest", prefix.to_ascii_uppercase());
                let expected = if *on { None } else { Some(*feature) };
                assert_eq!(DisabledFeatures::feature_for(&dsn), expected, "{dsn}");
            }
        }
        assert_eq!(DisabledFeatures::feature_for("mysql://x"), None);
    }

    #[test]
    fn supported_schemes_follow_the_enabled_features() {
        let schemes = supported_schemes();
        assert!(schemes.contains(&"in-memory://"));
        assert_eq!(schemes.contains(&"sqlite://"), cfg!(feature = "sqlite"));
        assert_eq!(schemes.contains(&"redis://"), cfg!(feature = "redis"));
        assert_eq!(schemes.contains(&"amqps://"), cfg!(feature = "amqp"));
    }
}
