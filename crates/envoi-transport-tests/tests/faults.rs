//! The suite catches broken transports: each planted fault of the reference
//! transport makes the case that looks for it fail.

mod support;

use std::sync::Arc;
use std::time::Duration;

use envoi_core::transport::Transport;
use envoi_transport_tests::{cases, Options};
use support::{Bare, Fault, Reference};

fn options() -> Options {
    Options {
        lease: Duration::from_secs(1),
        timeout: Duration::from_secs(4),
        ..Options::default()
    }
}

macro_rules! faulty {
    ($fault:ident) => {
        |name: String| async move {
            Some(Reference::open(
                &name,
                Duration::from_secs(1),
                Fault::$fault,
            )) as Option<Arc<dyn Transport>>
        }
    };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "all messages were acked, but")]
async fn ack_that_keeps_the_message_fails_acked_message_never_comes_back() {
    cases::acked_message_never_comes_back(&faulty!(AckKeepsMessage), &options()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "as if its lease had to expire")]
async fn ignored_release_fails_released_message_is_redelivered() {
    cases::released_message_is_redelivered(&faulty!(ReleaseIgnored), &options()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "received 270 of 300 messages")]
async fn dropped_sends_fail_concurrent_publishers_lose_nothing() {
    cases::concurrent_publishers_lose_nothing(&faulty!(DropsEveryTenthSend), &options()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "kept alive by its consumer, but")]
async fn ignored_keepalive_fails_keepalive_prevents_redelivery() {
    cases::keepalive_prevents_redelivery(&faulty!(KeepaliveIgnored), &options()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "before its delay")]
async fn ignored_delay_fails_delay_is_honoured() {
    cases::delay_is_honoured(&faulty!(DelayIgnored), &options()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "came out of order")]
async fn newest_first_fails_single_consumer_receives_in_order() {
    cases::single_consumer_receives_in_order(&faulty!(NewestFirst), &options()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "headers changed in transit")]
async fn trimmed_headers_fail_publish_consume_integrity() {
    cases::publish_consume_integrity(&faulty!(TrimsHeaders), &options()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "is not marked as redelivered")]
async fn unmarked_redeliveries_fail_unacked_message_is_redelivered_after_lease() {
    cases::unacked_message_is_redelivered_after_lease(&faulty!(RedeliveriesUnmarked), &options())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "received 0 of 1 messages")]
async fn leases_that_never_expire_fail_unacked_message_is_redelivered_after_lease() {
    cases::unacked_message_is_redelivered_after_lease(&faulty!(LeasesNeverExpire), &options())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "received 0 of 1 messages")]
async fn leases_that_never_expire_fail_claimed_message_survives_consumer_crash() {
    cases::claimed_message_survives_consumer_crash(&faulty!(LeasesNeverExpire), &options()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "is marked as redelivered")]
async fn a_stored_header_marking_a_redelivery_fails_publish_consume_integrity() {
    cases::publish_consume_integrity(&faulty!(MarksFromStoredHeader), &options()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "the transport under test has no receiving side")]
async fn a_transport_without_a_receiving_side_fails_with_a_clear_message() {
    let make = |name: String| async move { Some(Bare::send_only(&name, Duration::from_secs(1))) };
    cases::acked_message_never_comes_back(&make, &options()).await;
}
