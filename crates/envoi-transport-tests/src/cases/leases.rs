//! Leases: what is handed out and never settled comes back once its lease
//! runs out, marked as redelivered, unless its consumer keeps it alive.

use std::sync::Arc;
use std::time::Instant;

use crate::support::{
    ability, ack, expect_nothing, message, open, receive, receiver, send, settle_wait, text,
    unique_name,
};
use crate::{MakeTransport, Options};

/// A message handed out and never settled is not handed out again while the
/// lease runs, then comes back intact once it expires, to another handle,
/// marked as redelivered (unless [`Options::marks_redeliveries`] is off;
/// the first delivery is never marked). Settling the stale delivery
/// afterwards does not panic.
pub async fn unacked_message_is_redelivered_after_lease(
    make: &impl MakeTransport,
    options: &Options,
) {
    if !options.lease_expiry {
        eprintln!(
            "skipped unacked_message_is_redelivered_after_lease: transport has no lease expiry"
        );
        return;
    }
    let name = unique_name("lease");
    let Some(a) = open(make, &name).await else {
        return;
    };
    let Some(b) = open(make, &name).await else {
        return;
    };
    let sent = message("{\"lease\":1}", &[("type", "Lease")]);
    send(&*a, sent.clone()).await;
    let first = receive(&*a, 1, 1, options.timeout).await.remove(0);
    let claimed_at = Instant::now();
    assert!(
        !first.redelivered,
        "the first delivery is marked as redelivered"
    );
    expect_nothing(
        &*b,
        options.lease / 2,
        "the message is leased to another consumer",
    )
    .await;
    let again = receive(&*b, 1, 1, options.lease + options.timeout)
        .await
        .remove(0);
    let after = claimed_at.elapsed();
    assert_eq!(again.raw, sent, "redelivery differs from what was sent");
    assert!(
        again.redelivered || !options.marks_redeliveries,
        "the message that came back after its lease is not marked as redelivered"
    );
    assert!(
        after >= options.lease * 3 / 4,
        "the message came back after {after:?}, before its lease of {:?} expired",
        options.lease
    );
    ack(&*b, &again.id).await;
    // The first consumer wakes up late and settles its stale delivery.
    let _ = receiver(&*a).ack(&first.id).await;
    expect_nothing(&*b, settle_wait(options), "the redelivery was acked").await;
}

/// A consumer that keeps calling `keepalive` holds its message well past the
/// lease; nobody else gets it, and after the ack it never comes back. Needs
/// the [`Keepalive`](envoi_core::transport::Keepalive) ability.
pub async fn keepalive_prevents_redelivery(make: &impl MakeTransport, options: &Options) {
    if !options.lease_expiry {
        eprintln!("skipped keepalive_prevents_redelivery: transport has no lease expiry");
        return;
    }
    let name = unique_name("keepalive");
    let Some(a) = open(make, &name).await else {
        return;
    };
    if ability(
        "keepalive_prevents_redelivery",
        a.as_keepalive(),
        "keep leases alive",
    )
    .is_none()
    {
        return;
    }
    let Some(b) = open(make, &name).await else {
        return;
    };
    send(&*a, text("slow handler")).await;
    let held = receive(&*a, 1, 1, options.timeout).await.remove(0);
    let keeper = {
        let a = Arc::clone(&a);
        let id = held.id.clone();
        let every = options.lease / 4;
        let until = Instant::now() + options.lease * 3;
        tokio::spawn(async move {
            while Instant::now() < until {
                tokio::time::sleep(every).await;
                let keepalive = a.as_keepalive().expect("checked before the case began");
                keepalive
                    .keepalive(&id)
                    .await
                    .unwrap_or_else(|e| panic!("keepalive of `{id}` failed: {e}"));
            }
        })
    };
    expect_nothing(
        &*b,
        options.lease * 3,
        "the message's lease is kept alive by its consumer",
    )
    .await;
    keeper.await.expect("the keepalive task panicked");
    ack(&*a, &held.id).await;
    expect_nothing(
        &*b,
        settle_wait(options),
        "the kept-alive message was acked",
    )
    .await;
}

/// A consumer that takes a message and disappears (its handle is dropped
/// without settling) does not lose it: another handle gets it once the lease
/// expires, marked as redelivered (unless
/// [`Options::marks_redeliveries`] is off).
pub async fn claimed_message_survives_consumer_crash(make: &impl MakeTransport, options: &Options) {
    if !options.lease_expiry {
        eprintln!("skipped claimed_message_survives_consumer_crash: transport has no lease expiry");
        return;
    }
    let name = unique_name("crash");
    let Some(a) = open(make, &name).await else {
        return;
    };
    let sent = message("{\"crash\":true}", &[("type", "Crash")]);
    send(&*a, sent.clone()).await;
    let taken = receive(&*a, 1, 1, options.timeout).await;
    assert_eq!(taken[0].raw, sent);
    drop(a);
    let Some(b) = open(make, &name).await else {
        return;
    };
    let again = receive(&*b, 1, 1, options.lease + options.timeout)
        .await
        .remove(0);
    assert_eq!(again.raw, sent, "the redelivered message differs");
    assert!(
        again.redelivered || !options.marks_redeliveries,
        "the message of the consumer that disappeared is not marked as redelivered"
    );
    ack(&*b, &again.id).await;
    expect_nothing(&*b, settle_wait(options), "the redelivery was acked").await;
}
