//! The whole suite against the core's `in-memory://` transport, as stored
//! (`raw`) and with `serialize=true`: one transport per name, shared by every
//! handle opened with that name, with a one-second lease. Its messages
//! live as long as the transport, so it is not `persistent`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use envoi_core::transport::in_memory::InMemoryTransport;
use envoi_core::transport::Transport;

/// Transports by DSN and name.
type Queues = HashMap<(String, String), Arc<dyn Transport>>;

fn shared(dsn: &str, name: String) -> Arc<dyn Transport> {
    static QUEUES: OnceLock<Mutex<Queues>> = OnceLock::new();
    let mut queues = QUEUES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let transport = queues.entry((dsn.to_string(), name)).or_insert_with(|| {
        Arc::new(InMemoryTransport::from_dsn(dsn).expect("a valid in-memory DSN"))
    });
    Arc::clone(transport)
}

fn options() -> envoi_transport_tests::Options {
    envoi_transport_tests::Options {
        lease: Duration::from_secs(1),
        persistent: false,
        ..envoi_transport_tests::Options::default()
    }
}

mod raw {
    use super::*;

    pub(super) async fn make(name: String) -> Option<Arc<dyn Transport>> {
        Some(shared("in-memory://?lease_timeout_ms=1000", name))
    }
}

mod serialized {
    use super::*;

    pub(super) async fn make(name: String) -> Option<Arc<dyn Transport>> {
        Some(shared(
            "in-memory://?serialize=true&lease_timeout_ms=1000",
            name,
        ))
    }
}

fn main() -> std::process::ExitCode {
    let mut trials = envoi_transport_tests::harness::Trials::default();
    envoi_transport_tests::conformance_trials!(&mut trials, "raw::", raw::make, options());
    envoi_transport_tests::conformance_trials!(
        &mut trials,
        "serialized::",
        serialized::make,
        options()
    );
    trials.run()
}
