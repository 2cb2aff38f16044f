//! How an [`InMemoryTransport`](super::InMemoryTransport) behaves, and
//! the `in-memory://` DSN that says so.

use std::time::Duration;

use crate::error::{Result, TransportError};
use crate::transport::strip_scheme;
use crate::transport::support::DsnQuery;

/// How an [`InMemoryTransport`](super::InMemoryTransport) behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InMemoryConfig {
    /// Encode every message with the serializer (default `false`).
    pub serialize: bool,
    /// How long a handed-out message stays leased without a keepalive
    /// (default 30 s).
    pub lease_timeout: Duration,
}

impl Default for InMemoryConfig {
    fn default() -> Self {
        Self {
            serialize: false,
            lease_timeout: Duration::from_secs(30),
        }
    }
}

impl InMemoryConfig {
    /// Reads `in-memory://[?serialize=true|false][&lease_timeout_ms=N]`.
    /// Anything else (an option given twice included) is an
    /// [`InvalidDsn`](TransportError::InvalidDsn).
    pub fn from_dsn(dsn: &str) -> Result<Self, TransportError> {
        let mut query = DsnQuery::parse(dsn)?;
        let Some(rest) = strip_scheme(dsn, "in-memory://") else {
            return Err(query.invalid("the scheme must be `in-memory://`".into()));
        };
        let host = rest.split(['?', '#']).next().unwrap_or_default();
        if !host.is_empty() {
            return Err(query.invalid(format!(
                "`in-memory://` takes no host or path, found `{host}`"
            )));
        }
        let mut config = Self::default();
        if let Some(serialize) = query.bool("serialize")? {
            config.serialize = serialize;
        }
        if let Some(ms) = query.number::<u64>("lease_timeout_ms")? {
            if ms == 0 {
                return Err(query.invalid("`lease_timeout_ms` must be above 0".into()));
            }
            config.lease_timeout = Duration::from_millis(ms);
        }
        query.finish()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dsn_options_are_read_and_bad_ones_refused() {
        let c =
            InMemoryConfig::from_dsn("in-memory://?serialize=true&lease_timeout_ms=250").unwrap();
        assert!(c.serialize);
        assert_eq!(c.lease_timeout, Duration::from_millis(250));
        assert_eq!(
            InMemoryConfig::from_dsn("in-memory://").unwrap(),
            InMemoryConfig::default()
        );
        // The scheme in any case, as every other transport takes it.
        assert!(
            InMemoryConfig::from_dsn("IN-MEMORY://?serialize=true")
                .unwrap()
                .serialize
        );
        assert!(crate::transport::TransportFactory::supports(
            &crate::transport::registry::InMemoryFactory,
            "In-Memory://"
        ));
        for bad in [
            "in-memory://?serialize=maybe",
            "in-memory://host",
            "in-memory://?colour=red",
            "in-memory://?lease_timeout_ms=0",
            "memory://",
            // Given twice, an option is ambiguous: neither value is taken.
            "in-memory://?serialize=true&serialize=false",
            "in-memory://?lease_timeout_ms=100&serialize=true&lease_timeout_ms=200",
        ] {
            assert!(
                matches!(
                    InMemoryConfig::from_dsn(bad),
                    Err(TransportError::InvalidDsn { .. })
                ),
                "{bad}"
            );
        }
    }
}
