//! The shared conformance suite, against the PostgreSQL server in
//! `ENVOI_POSTGRES_URL`. PostgreSQL promises everything the suite asks
//! about (persistent, ordered, delays, lease expiry, marked redeliveries,
//! binary bodies): the default options.

use std::sync::Arc;

use envoi_core::transport::Transport;
use envoi_postgres::PostgresTransport;

async fn make(name: String) -> Option<Arc<dyn Transport>> {
    let url = envoi_core::testing::broker_url("ENVOI_POSTGRES_URL", "conformance")?;
    let separator = if url.contains('?') { '&' } else { '?' };
    // The suite's default lease is 2 s; a short poll keeps its waits brief.
    let dsn = format!(
        "{url}{separator}table=envoi_conformance&lease=2s&wait=200ms&poll=200ms&max_connections=4\
         &application_name=envoi_conformance"
    );
    let transport = PostgresTransport::connect(&name, &dsn)
        .await
        .unwrap_or_else(|e| panic!("opening the postgres transport failed: {e}"));
    Some(Arc::new(transport))
}

envoi_transport_tests::conformance!(make, env = "ENVOI_POSTGRES_URL");
