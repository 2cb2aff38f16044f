//! The whole suite against the fault-free reference transport.

mod support;

use std::sync::Arc;
use std::time::Duration;

use envoi_core::transport::Transport;
use support::{Fault, Reference};

async fn make(name: String) -> Option<Arc<dyn Transport>> {
    Some(Reference::open(&name, Duration::from_secs(1), Fault::None))
}

envoi_transport_tests::conformance!(
    make,
    envoi_transport_tests::Options {
        lease: Duration::from_secs(1),
        ..envoi_transport_tests::Options::default()
    }
);
