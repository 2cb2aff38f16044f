//! The shared conformance suite against the real Redis server in
//! `ENVOI_REDIS_URL`, with a 2 s lease.

mod common;

use std::sync::Arc;

use envoi_core::transport::Transport;

async fn make(name: String) -> Option<Arc<dyn Transport>> {
    let url = common::url().ok()?;
    Some(Arc::new(common::transport(&url, &name, "lease=2s").await))
}

envoi_transport_tests::conformance!(make, env = "ENVOI_REDIS_URL");
