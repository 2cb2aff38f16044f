//! The shared conformance suite on classic queues, run against the RabbitMQ at
//! `ENVOI_AMQP_URL`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use envoi_amqp::AmqpTransport;
use envoi_core::transport::Transport;

use common::Within;

const LEASE: Duration = Duration::from_secs(2);

async fn make(name: String) -> Option<Arc<dyn Transport>> {
    let url = envoi_core::testing::broker_url("ENVOI_AMQP_URL", "conformance")?;
    let separator = if url.contains('?') { '&' } else { '?' };
    // Short lease for the redelivery cases; the queues of a run delete
    // themselves a minute after its last use.
    let dsn = format!("{url}{separator}queue_type=classic&lease=2s&expires=60s");
    let transport = AmqpTransport::connect(&name, &dsn)
        .expect_within(format!("connecting `{name}`"))
        .await;
    Some(Arc::new(transport))
}

envoi_transport_tests::conformance!(
    make,
    // Durable queues, one consumer served in order, delays through TTL
    // queues, leases kept by the transport, redeliveries flagged by the
    // broker; listing and finding run too (the transport browses the
    // queue and puts every message back in its place).
    envoi_transport_tests::Options {
        lease: LEASE,
        persistent: true,
        ordered: true,
        delay: true,
        lease_expiry: true,
        marks_redeliveries: true,
        ..envoi_transport_tests::Options::default()
    },
    env = "ENVOI_AMQP_URL"
);
