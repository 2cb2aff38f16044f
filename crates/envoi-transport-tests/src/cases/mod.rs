//! The conformance cases, one `pub async fn` each. The
//! [`conformance!`](crate::conformance) macro emits a test per case; each can
//! also be called by hand with any [`MakeTransport`](crate::MakeTransport).
//!
//! Every case opens transports with names of its own, runs the
//! [`Setup`](envoi_core::transport::Setup) of each handle that has one,
//! bounds its loops and time, and panics with a message that says what went
//! wrong. A case that needs an ability the transport lacks, or a promise
//! its [`Options`](crate::Options) deny, prints why it is skipped and
//! passes.
//!
//! The cases are grouped by what they look at:
//!
//! * what comes out is what went in: [`publish_consume_integrity`],
//!   [`binary_bodies_round_trip`];
//! * settling: [`acked_message_never_comes_back`],
//!   [`rejected_message_never_comes_back`],
//!   [`released_message_is_redelivered`],
//!   [`continues_after_repeated_errors`],
//!   [`unknown_ids_do_not_disturb_other_messages`];
//! * leases: [`unacked_message_is_redelivered_after_lease`],
//!   [`keepalive_prevents_redelivery`],
//!   [`claimed_message_survives_consumer_crash`];
//! * several consumers and publishers:
//!   [`concurrent_consumers_see_every_message_once`],
//!   [`consumers_reopened_mid_stream_lose_nothing`],
//!   [`many_consumers_closing_at_once_lose_nothing`],
//!   [`concurrent_publishers_lose_nothing`];
//! * when and where messages are handed out:
//!   [`single_consumer_receives_in_order`],
//!   [`transport_names_isolate_messages`], [`delay_is_honoured`],
//!   [`get_never_exceeds_max`], [`get_on_an_empty_transport_returns`],
//!   [`messages_survive_reopening`];
//! * the abilities beside receiving and batches:
//!   [`message_count_counts_waiting_messages`],
//!   [`list_and_find_do_not_lease`], [`setup_is_idempotent`],
//!   [`send_batch_and_ack_batch`].

mod abilities;
mod consumers;
mod delivery;
mod integrity;
mod leases;
mod settling;

use std::sync::{Mutex, MutexGuard, PoisonError};

pub use abilities::{
    list_and_find_do_not_lease, message_count_counts_waiting_messages, send_batch_and_ack_batch,
    setup_is_idempotent,
};
pub use consumers::{
    concurrent_consumers_see_every_message_once, concurrent_publishers_lose_nothing,
    consumers_reopened_mid_stream_lose_nothing, many_consumers_closing_at_once_lose_nothing,
};
pub use delivery::{
    delay_is_honoured, get_never_exceeds_max, get_on_an_empty_transport_returns,
    messages_survive_reopening, single_consumer_receives_in_order,
    transport_names_isolate_messages,
};
pub use integrity::{binary_bodies_round_trip, publish_consume_integrity};
pub use leases::{
    claimed_message_survives_consumer_crash, keepalive_prevents_redelivery,
    unacked_message_is_redelivered_after_lease,
};
pub use settling::{
    acked_message_never_comes_back, continues_after_repeated_errors,
    rejected_message_never_comes_back, released_message_is_redelivered,
    unknown_ids_do_not_disturb_other_messages,
};

/// `n` distinct text bodies: `tag-0`, `tag-1`, …
fn bodies(tag: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{tag}-{i}")).collect()
}

/// Locks `m`, also when a task panicked while holding it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
