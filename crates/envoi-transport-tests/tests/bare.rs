//! The whole suite against a transport that can only send and receive:
//! the cases needing keepalive, counting or browsing skip, the others pass
//! without them (and without a setup to run).

mod support;

use std::sync::Arc;
use std::time::Duration;

use envoi_core::transport::Transport;
use support::Bare;

async fn make(name: String) -> Option<Arc<dyn Transport>> {
    Some(Bare::open(&name, Duration::from_secs(1)))
}

envoi_transport_tests::conformance!(
    make,
    envoi_transport_tests::Options {
        lease: Duration::from_secs(1),
        ..envoi_transport_tests::Options::default()
    }
);
