//! Listing, finding and removing stored messages by the id a listing
//! shows (what `failed show`, `failed retry <id>` and `failed remove <id>`
//! do), on quorum and classic queues: nothing is lost, and every message
//! keeps its place in the queue.

mod common;

use std::time::{Duration, Instant};

use envoi_amqp::AmqpTransport;
use envoi_core::transport::{
    Browse, Delivery, DeliveryId, MessageCount, RawMessage, Receiver, Teardown, Transport,
};
use envoi_core::TransportError;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

use common::{dsn, receive, unique, Within};

fn message(i: usize) -> RawMessage {
    RawMessage {
        body: format!("{{\"n\":{i}}}").into_bytes(),
        headers: [("type", "Numbered".to_string()), ("n", i.to_string())]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
    }
}

fn browse(t: &AmqpTransport) -> &dyn Browse {
    t.as_browse()
        .expect("a RabbitMQ transport lists and finds its messages")
}

/// Opens the transport `name` with `options`, and sends `n` numbered
/// messages one by one; returns it and the ids `send` returned.
async fn filled(url: &str, name: &str, options: &str, n: usize) -> (AmqpTransport, Vec<String>) {
    let t = AmqpTransport::connect(name, &dsn(url, options))
        .expect_within("connect")
        .await;
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(t.send(message(i), None).expect_within("send").await);
    }
    (t, ids)
}

/// `list(limit)`, checked to be the first `limit` of `expected` (ids and
/// messages), oldest first.
async fn expect_listed(t: &AmqpTransport, limit: usize, expected: &[(String, RawMessage)]) {
    let listed = browse(t)
        .list(limit)
        .expect_within(format!("list({limit})"))
        .await;
    let ids: Vec<&str> = listed.iter().map(|d| d.id.as_str()).collect();
    let want: Vec<&str> = expected
        .iter()
        .take(limit)
        .map(|(id, _)| id.as_str())
        .collect();
    assert_eq!(ids, want, "list({limit}) is not the queue, oldest first");
    for (d, (_, raw)) in listed.iter().zip(expected) {
        assert_eq!(&d.raw, raw, "list({limit}) shows another message");
        assert!(!d.redelivered, "a listed message is not handed out");
    }
}

/// Takes every message with one consumer, acknowledging each batch, and
/// checks they come in the order `expected` gives.
async fn expect_consumed_in_order(t: &AmqpTransport, expected: &[RawMessage]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got: Vec<Delivery> = Vec::new();
    while got.len() < expected.len() {
        assert!(
            Instant::now() < deadline,
            "consumed {} of {} messages",
            got.len(),
            expected.len()
        );
        let batch = t.get(expected.len() - got.len()).expect_within("get").await;
        let ids: Vec<DeliveryId> = batch.iter().map(|d| d.id.clone()).collect();
        t.ack_batch(&ids).expect_within("ack_batch").await;
        got.extend(batch);
    }
    let bodies: Vec<String> = got
        .iter()
        .map(|d| String::from_utf8_lossy(&d.raw.body).into_owned())
        .collect();
    let want: Vec<String> = expected
        .iter()
        .map(|m| String::from_utf8_lossy(&m.body).into_owned())
        .collect();
    assert_eq!(bodies, want, "consumed out of order after browsing");
    assert!(
        t.get(10).expect_within("get").await.is_empty(),
        "a message came back after all were acknowledged"
    );
    assert_eq!(t.message_count().expect_within("message_count").await, 0);
}

/// How many messages are ready in `queue`, by a passive declare.
async fn ready(url: &str, queue: &str) -> u32 {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .expect_within("a raw connection")
        .await;
    let channel = connection.create_channel().expect_within("a channel").await;
    let n = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .expect_within(format!("a passive declare of `{queue}`"))
        .await
        .message_count();
    let _ = connection.close(200, "done".into()).within("closing").await;
    n
}

async fn listing_and_finding_keep_every_message_in_its_place(url: &str, queue_type: &str) {
    // More than nine: RabbitMQ 3.x puts back what `basic.get` took in the
    // text order of its tags (1, 10, 11, 2, …); the transport must not
    // depend on that.
    const N: usize = 14;
    let name = unique("amqp_browse_order");
    let (t, ids) = filled(url, &name, &format!("queue_type={queue_type}"), N).await;
    let sent: Vec<(String, RawMessage)> = ids.iter().cloned().zip((0..N).map(message)).collect();

    // Listings of every length, one after the other and in any order,
    // each see the queue as it was sent.
    for limit in [5, N, 3, 1, N + 10, 11, 2] {
        expect_listed(&t, limit, &sent).await;
    }
    for i in [9, 0, N - 1] {
        let found = browse(&t)
            .find(&DeliveryId::from(ids[i].as_str()))
            .expect_within(format!("find of message {i}"))
            .await
            .unwrap_or_else(|| panic!("message {i} was not found"));
        assert_eq!(found.id.as_str(), ids[i]);
        assert_eq!(found.raw, message(i));
    }
    for unknown in ["no-such-message", "", "7:1"] {
        let found = browse(&t)
            .find(&DeliveryId::from(unknown))
            .expect_within(format!("find of `{unknown}`"))
            .await;
        assert!(found.is_none(), "`{unknown}` was found");
    }
    expect_listed(&t, N, &sent).await;
    assert_eq!(
        t.message_count().expect_within("message_count").await,
        N as u64,
        "browsing changed the count"
    );
    expect_consumed_in_order(&t, &(0..N).map(message).collect::<Vec<_>>()).await;
    t.delete().expect_within("delete").await;
}

async fn listing_and_finding_keep_every_message_in_its_place_on_a_quorum_queue(url: String) {
    listing_and_finding_keep_every_message_in_its_place(&url, "quorum").await;
}

async fn listing_and_finding_keep_every_message_in_its_place_on_a_classic_queue(url: String) {
    listing_and_finding_keep_every_message_in_its_place(&url, "classic").await;
}

async fn removing_messages_by_their_listed_ids_keeps_the_others_in_order(
    url: &str,
    queue_type: &str,
) {
    const N: usize = 12;
    let name = unique("amqp_browse_remove");
    let (t, ids) = filled(url, &name, &format!("queue_type={queue_type}"), N).await;

    // What `failed remove <id>` and `failed retry <id>` do: find the
    // message, then acknowledge it by the id the listing showed.
    let found = browse(&t)
        .find(&DeliveryId::from(ids[4].as_str()))
        .expect_within("find")
        .await
        .expect("message 4 is stored");
    t.ack(&found.id).expect_within("ack by listed id").await;
    // Several at once, as `failed remove a b` does.
    let two = [ids[10].as_str(), ids[0].as_str()].map(DeliveryId::from);
    t.ack_batch(&two)
        .expect_within("ack_batch by listed ids")
        .await;
    // Rejected by its listed id: gone from the queue (dead-lettered to
    // `<queue>.dead` on a quorum queue, dropped on a classic one).
    t.reject(&DeliveryId::from(ids[7].as_str()))
        .expect_within("reject by listed id")
        .await;
    // Gone: acknowledging again finds nothing, and so does `find`.
    assert!(matches!(
        t.ack(&found.id).within("a second ack").await,
        Err(TransportError::NotFound(_))
    ));
    assert!(browse(&t)
        .find(&found.id)
        .expect_within("find of a removed message")
        .await
        .is_none());
    // Unknown ids are refused without touching anything else.
    for unknown in ["no-such-message", ""] {
        assert!(matches!(
            t.ack(&DeliveryId::from(unknown))
                .within(format!("ack of `{unknown}`"))
                .await,
            Err(TransportError::NotFound(_))
        ));
    }

    if queue_type == "quorum" {
        // Dead-lettering is asynchronous: wait for it, within bounds.
        let deadline = Instant::now() + Duration::from_secs(10);
        while ready(url, &format!("{name}.dead")).await == 0 {
            assert!(
                Instant::now() < deadline,
                "the rejected message never reached the dead-letter queue"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let kept: Vec<usize> = (0..N).filter(|i| ![0, 4, 7, 10].contains(i)).collect();
    let expected: Vec<(String, RawMessage)> =
        kept.iter().map(|&i| (ids[i].clone(), message(i))).collect();
    expect_listed(&t, N, &expected).await;
    assert_eq!(
        t.message_count().expect_within("message_count").await,
        kept.len() as u64
    );
    expect_consumed_in_order(&t, &kept.iter().map(|&i| message(i)).collect::<Vec<_>>()).await;
    t.delete().expect_within("delete").await;
}

async fn removing_messages_by_their_listed_ids_keeps_the_others_in_order_on_a_quorum_queue(
    url: String,
) {
    removing_messages_by_their_listed_ids_keeps_the_others_in_order(&url, "quorum").await;
}

async fn removing_messages_by_their_listed_ids_keeps_the_others_in_order_on_a_classic_queue(
    url: String,
) {
    removing_messages_by_their_listed_ids_keeps_the_others_in_order(&url, "classic").await;
}

async fn listing_a_quorum_queue_again_and_again_never_dead_letters_a_message(url: String) {
    // Before RabbitMQ 4.3 a quorum queue counts every message a listing
    // puts back as a delivery; past `delivery_limit` it would dead-letter
    // it. The listing must not let that happen.
    const N: usize = 4;
    let name = unique("amqp_browse_limit");
    let (t, ids) = filled(&url, &name, "queue_type=quorum&delivery_limit=2", N).await;
    let sent: Vec<(String, RawMessage)> = ids.iter().cloned().zip((0..N).map(message)).collect();
    for _ in 0..8 {
        expect_listed(&t, N, &sent).await;
    }
    assert_eq!(
        ready(&url, &format!("{name}.dead")).await,
        0,
        "listing dead-lettered messages"
    );
    assert_eq!(
        t.message_count().expect_within("message_count").await,
        N as u64
    );
    expect_consumed_in_order(&t, &(0..N).map(message).collect::<Vec<_>>()).await;
    t.delete().expect_within("delete").await;
}

async fn a_listing_shows_what_the_handle_holds_first_and_takes_nothing_from_it(url: String) {
    const N: usize = 6;
    let name = unique("amqp_browse_held");
    let (t, ids) = filled(&url, &name, "lease=5m&prefetch=2", N).await;
    // Two handed out, then (prefetch 2) nothing more is on its way to the
    // consumer until they are settled.
    let held = receive(&t, 2, Duration::from_secs(30)).await;
    let sent: Vec<(String, RawMessage)> = ids.iter().cloned().zip((0..N).map(message)).collect();
    expect_listed(&t, N, &sent).await;
    expect_listed(&t, 1, &sent).await;
    // The held messages are still the handle's to settle.
    let held_ids: Vec<DeliveryId> = held.iter().map(|d| d.id.clone()).collect();
    t.ack_batch(&held_ids)
        .expect_within("ack_batch of the held messages")
        .await;
    expect_consumed_in_order(&t, &(2..N).map(message).collect::<Vec<_>>()).await;
    t.delete().expect_within("delete").await;
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_AMQP_URL", tests = [
        listing_a_quorum_queue_again_and_again_never_dead_letters_a_message,
        a_listing_shows_what_the_handle_holds_first_and_takes_nothing_from_it,
        listing_and_finding_keep_every_message_in_its_place_on_a_quorum_queue,
        listing_and_finding_keep_every_message_in_its_place_on_a_classic_queue,
        removing_messages_by_their_listed_ids_keeps_the_others_in_order_on_a_quorum_queue,
        removing_messages_by_their_listed_ids_keeps_the_others_in_order_on_a_classic_queue,
    ];
}
