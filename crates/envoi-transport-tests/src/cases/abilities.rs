//! The abilities beside receiving (counting, browsing, setting up) and
//! batches.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use envoi_core::transport::{Browse, Delivery, DeliveryId, RawMessage};

use super::bodies;
use crate::support::{
    ability, ack, assert_exactly_once, body, expect_count, expect_nothing, message, open, receive,
    receive_and_ack, receiver, send, send_texts, settle_wait, setup, text, unique_name,
};
use crate::{MakeTransport, Options};

/// `list(limit)`, panicking with what failed.
async fn list(browse: &dyn Browse, limit: usize) -> Vec<Delivery> {
    browse
        .list(limit)
        .await
        .unwrap_or_else(|e| panic!("list({limit}) failed: {e}"))
}

/// `find(id)`, panicking with what failed.
async fn find(browse: &dyn Browse, id: &str) -> Option<Delivery> {
    browse
        .find(&DeliveryId::from(id))
        .await
        .unwrap_or_else(|e| panic!("find of `{id}` failed: {e}"))
}

/// `message_count` counts waiting messages, leased ones included, and drops
/// as they are acked. Needs the
/// [`MessageCount`](envoi_core::transport::MessageCount) ability.
pub async fn message_count_counts_waiting_messages(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("count");
    let Some(t) = open(make, &name).await else {
        return;
    };
    if ability(
        "message_count_counts_waiting_messages",
        t.as_message_count(),
        "count messages",
    )
    .is_none()
    {
        return;
    }
    expect_count(&*t, 0, "on a new transport").await;
    send_texts(&*t, &bodies("count", 5)).await;
    expect_count(&*t, 5, "after 5 sends").await;
    let leased = receive(&*t, 2, 2, options.timeout).await;
    expect_count(&*t, 5, "with 2 of 5 messages leased").await;
    for d in &leased {
        ack(&*t, &d.id).await;
    }
    expect_count(&*t, 3, "after acking 2 of 5").await;
    receive_and_ack(&*t, 3, 10, options.timeout).await;
    expect_count(&*t, 0, "after acking all").await;
}

/// `list` shows stored messages oldest first with the ids `send` returned,
/// honours its limit and leases nothing; `find` returns a stored message by
/// id and nothing for an acked or unknown one. Needs the
/// [`Browse`] ability.
pub async fn list_and_find_do_not_lease(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("list");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let Some(browse) = ability("list_and_find_do_not_lease", t.as_browse(), "browse") else {
        return;
    };
    let sent: Vec<RawMessage> = (0..3)
        .map(|i| {
            message(
                format!("{{\"listed\":{i}}}"),
                &[("type", "Listed"), ("index", &i.to_string())],
            )
        })
        .collect();
    let mut ids = Vec::new();
    for m in &sent {
        ids.push(send(&*t, m.clone()).await);
    }
    let listed = list(browse, 10).await;
    let listed_ids: Vec<&str> = listed.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        listed_ids, ids,
        "list is not oldest first with the ids send returned"
    );
    for (d, m) in listed.iter().zip(&sent) {
        assert_eq!(&d.raw, m, "list shows a different message");
    }
    assert_eq!(list(browse, 2).await.len(), 2, "list(2) ignored its limit");
    let found = find(browse, &ids[1])
        .await
        .unwrap_or_else(|| panic!("find did not find `{}`", ids[1]));
    assert_eq!(found.raw, sent[1], "find returned a different message");
    let unknown = DeliveryId::from("no-such-message-id");
    if let Ok(Some(d)) = browse.find(&unknown).await {
        panic!("find of an unknown id returned `{}`", d.id);
    }

    // Listing and finding leased nothing: every message can still be taken.
    let got = receive(&*t, 3, 10, options.timeout).await;
    // Leased messages are still stored, so still listed.
    let still = list(browse, 10).await;
    assert_eq!(still.len(), 3, "leased messages disappeared from list");
    for d in &got {
        ack(&*t, &d.id).await;
    }
    let gone = find(browse, &ids[0]).await;
    assert!(gone.is_none(), "find still returns an acked message");
    let empty = list(browse, 10).await;
    assert!(
        empty.is_empty(),
        "list still shows {} acked messages",
        empty.len()
    );
}

/// `setup` can run again, from several handles at once, without losing or
/// duplicating what is stored. A transport without the
/// [`Setup`](envoi_core::transport::Setup) ability has nothing to set up:
/// the case then checks that a second handle sees what the first stored.
pub async fn setup_is_idempotent(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("setup");
    let Some(a) = open(make, &name).await else {
        return;
    };
    send(&*a, text("kept across setups")).await;
    let Some(b) = open(make, &name).await else {
        return;
    };
    let (ra, rb, rc) = tokio::join!(setup(&*a), setup(&*b), setup(&*a));
    for r in [ra, rb, rc] {
        r.unwrap_or_else(|e| panic!("repeated setup failed: {e}"));
    }
    let got = receive_and_ack(&*b, 1, 10, options.timeout).await;
    assert_eq!(body(&got[0]), "kept across setups");
    expect_nothing(
        &*a,
        Duration::from_millis(300),
        "the only message was acked",
    )
    .await;
}

/// `send_batch` stores every message (ids distinct, in order) and
/// `ack_batch` settles them all; empty batches are fine. Where the transport
/// delays ([`Options::delay`]), a delayed message in a batch waits.
pub async fn send_batch_and_ack_batch(make: &impl MakeTransport, options: &Options) {
    const N: usize = 50;
    let name = unique_name("batch");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let none = t
        .send_batch(Vec::new())
        .await
        .unwrap_or_else(|e| panic!("empty send_batch failed: {e}"));
    assert!(none.is_empty(), "an empty batch returned ids");
    receiver(&*t)
        .ack_batch(&[])
        .await
        .unwrap_or_else(|e| panic!("empty ack_batch failed: {e}"));

    let expected = bodies("batch", N);
    let ids = t
        .send_batch(expected.iter().map(|b| (text(b), None)).collect())
        .await
        .unwrap_or_else(|e| panic!("send_batch failed: {e}"));
    assert_eq!(
        ids.len(),
        N,
        "send_batch returned {} ids for {N} messages",
        ids.len()
    );
    let distinct: BTreeSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), N, "send_batch returned duplicate ids");
    expect_count(&*t, N as u64, "after a batch of 50").await;

    let got = receive(&*t, N, 20, options.timeout).await;
    let got_bodies: Vec<String> = got.iter().map(body).collect();
    assert_exactly_once(&got_bodies, &expected, "sent as one batch");
    let got_ids: Vec<DeliveryId> = got.iter().map(|d| d.id.clone()).collect();
    receiver(&*t)
        .ack_batch(&got_ids)
        .await
        .unwrap_or_else(|e| panic!("ack_batch failed: {e}"));
    expect_nothing(&*t, settle_wait(options), "the whole batch was acked").await;
    expect_count(&*t, 0, "after ack_batch").await;

    if options.delay {
        let start = Instant::now();
        t.send_batch(vec![
            (text("batch-now"), None),
            (text("batch-later"), Some(Duration::from_secs(2))),
        ])
        .await
        .unwrap_or_else(|e| panic!("send_batch with a delay failed: {e}"));
        let first = receive_and_ack(&*t, 1, 10, options.timeout).await;
        assert_eq!(body(&first[0]), "batch-now");
        let later = receive_and_ack(&*t, 1, 10, options.timeout).await;
        assert_eq!(body(&later[0]), "batch-later");
        let waited = start.elapsed();
        assert!(
            waited + Duration::from_millis(50) >= Duration::from_secs(2),
            "a message delayed 2 s in a batch arrived after {waited:?}"
        );
    }
}
