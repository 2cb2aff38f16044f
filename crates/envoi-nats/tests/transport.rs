//! The NATS transport against a real JetStream server (`ENVOI_NATS_URL`).

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{get_exactly, get_n, transport, unique_name};
use envoi_core::transport::{
    Browse, DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown, Transport,
    WakeUp,
};
use envoi_core::{Headers, TransportError};

fn message(body: &str) -> RawMessage {
    RawMessage {
        body: body.as_bytes().to_vec(),
        headers: Headers::from([
            ("type".to_string(), "App\\Order".to_string()),
            ("kind".to_string(), "command".to_string()),
        ]),
    }
}

async fn a_sent_message_arrives_intact_and_an_acked_one_never_returns(url: String) {
    let t = transport(&url, &unique_name("intact"), "lease=1s&wait=200ms").await;
    let mut raw = message("{\"id\":1}");
    raw.headers
        .insert("X-Message-Stamp-Bus", "[{\"name\":\"default\"}]");
    raw.headers.insert("multi", "line\r\nbreak");
    raw.headers.insert("padded", " x ");
    raw.body.extend_from_slice(&[0, 159, 255]);

    let id = t.send(raw.clone(), None).await.unwrap();
    let got = get_exactly(&t, 1, Duration::from_secs(5)).await;
    assert_eq!(got[0].id.as_str(), id);
    assert_eq!(got[0].raw, raw);
    assert_eq!(t.leased(), 1);

    t.ack(&got[0].id).await.unwrap();
    assert_eq!(t.leased(), 0);
    // Well past the 1 s lease: an acknowledged message is gone for good.
    let again = get_n(&t, 1, Duration::from_millis(2500)).await;
    assert!(again.is_empty(), "acked message came back: {again:?}");
    assert_eq!(t.message_count().await.unwrap(), 0);
    t.delete().await.unwrap();
}

async fn an_unacknowledged_message_comes_back_after_the_lease(url: String) {
    let t = transport(&url, &unique_name("lease"), "lease=1s&wait=200ms").await;
    let id = t.send(message("m"), None).await.unwrap();
    // The server hands the message out, and starts its lease, after this.
    let asked_at = Instant::now();
    let first = get_exactly(&t, 1, Duration::from_secs(5)).await;
    assert_eq!(first[0].id.as_str(), id);

    // Leased: not handed out again before the lease ends.
    let during = t.get(10).await.unwrap();
    assert!(
        during.is_empty() || asked_at.elapsed() >= Duration::from_secs(1),
        "handed out again {:?} after it was asked for, within its 1 s lease",
        asked_at.elapsed()
    );

    let second = get_n(&t, 1, Duration::from_secs(6)).await;
    assert_eq!(second.len(), 1, "message not redelivered after the lease");
    assert_eq!(second[0].id.as_str(), id);
    assert!(
        asked_at.elapsed() >= Duration::from_secs(1),
        "redelivered {:?} after it was first asked for, within its 1 s lease",
        asked_at.elapsed()
    );
    t.ack(&second[0].id).await.unwrap();
    t.delete().await.unwrap();
}

async fn a_message_not_acknowledged_within_its_lease_comes_back_marked_as_redelivered(url: String) {
    let t = transport(&url, &unique_name("redelivered"), "lease=1s&wait=200ms").await;
    t.send(message("m"), None).await.unwrap();
    let first = get_exactly(&t, 1, Duration::from_secs(5)).await;
    assert!(!first[0].redelivered, "handed out the first time");
    assert_eq!(first[0].raw, message("m"));

    let again = get_n(&t, 1, Duration::from_secs(6)).await;
    assert_eq!(again.len(), 1, "message not redelivered after the lease");
    assert_eq!(again[0].id, first[0].id);
    assert!(again[0].redelivered, "handed out again, marked");
    assert_eq!(
        again[0].raw,
        message("m"),
        "the message itself is unchanged"
    );
    t.ack(&again[0].id).await.unwrap();
    t.delete().await.unwrap();
}

async fn a_released_message_is_handed_out_again_before_its_lease_ends(url: String) {
    let t = transport(&url, &unique_name("release"), "lease=20s&wait=200ms").await;
    t.send(message("m"), None).await.unwrap();
    let first = get_exactly(&t, 1, Duration::from_secs(5)).await;
    let released_at = Instant::now();
    t.release(&first[0].id).await.unwrap();
    let again = get_exactly(&t, 1, Duration::from_secs(5)).await;
    assert_eq!(again[0].id, first[0].id);
    // JetStream counts the delivery the consumer gave back: marked.
    assert!(!first[0].redelivered);
    assert!(again[0].redelivered, "a released message comes back marked");
    assert_eq!(again[0].raw, first[0].raw);
    assert!(
        released_at.elapsed() < Duration::from_secs(10),
        "waited for the lease"
    );
    t.ack(&again[0].id).await.unwrap();
    t.delete().await.unwrap();
}

async fn keepalive_keeps_a_message_from_being_handed_out_again(url: String) {
    let name = unique_name("keepalive");
    // A lease of 2 s kept alive every 300 ms or so (a keepalive, an empty
    // fetch of 100 ms, a pause of 200 ms): the machine may be busy.
    let worker = transport(&url, &name, "lease=2s&wait=100ms").await;
    let other = transport(&url, &name, "lease=2s&wait=100ms").await;
    worker.send(message("m"), None).await.unwrap();
    let got = get_exactly(&worker, 1, Duration::from_secs(5)).await;

    // Three lease periods, kept alive: nobody else gets it.
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        worker.keepalive(&got[0].id).await.unwrap();
        let stolen = other.get(1).await.unwrap();
        assert!(stolen.is_empty(), "kept-alive message handed out again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    worker.ack(&got[0].id).await.unwrap();
    worker.delete().await.unwrap();
}

async fn a_delayed_message_is_not_handed_out_before_it_is_due(url: String) {
    let t = transport(&url, &unique_name("delay"), "lease=5s&wait=100ms").await;
    let sent_at = Instant::now();
    let delayed = t
        .send(message("later"), Some(Duration::from_millis(1200)))
        .await
        .unwrap();
    let now = t.send(message("now"), None).await.unwrap();

    let first = get_exactly(&t, 1, Duration::from_secs(3)).await;
    assert_eq!(
        first[0].id.as_str(),
        now,
        "the undelayed message comes first"
    );
    t.ack(&first[0].id).await.unwrap();

    let later = get_n(&t, 1, Duration::from_secs(8)).await;
    let elapsed = sent_at.elapsed();
    assert_eq!(later.len(), 1, "delayed message never arrived");
    assert_eq!(later[0].id.as_str(), delayed);
    // Deferred until due, it was delivered before: not marked, as that
    // does not tell a deferral from a redelivery.
    assert!(!later[0].redelivered, "unmarked");
    assert_eq!(later[0].raw, message("later"));
    assert!(elapsed >= Duration::from_millis(1150), "early: {elapsed:?}");
    assert!(
        elapsed < Duration::from_secs(6),
        "much too late: {elapsed:?}"
    );
    t.ack(&later[0].id).await.unwrap();
    t.delete().await.unwrap();
}

async fn message_count_includes_waiting_leased_and_delayed_messages(url: String) {
    let t = transport(&url, &unique_name("count"), "lease=10s&wait=100ms").await;
    assert_eq!(t.message_count().await.unwrap(), 0);
    t.send(message("a"), None).await.unwrap();
    t.send(message("b"), None).await.unwrap();
    t.send(message("c"), Some(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(t.message_count().await.unwrap(), 3);

    // One leased, one waiting, one delayed (seen and deferred).
    let got = t.get(1).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(t.message_count().await.unwrap(), 3);
    t.ack(&got[0].id).await.unwrap();

    let deadline = Instant::now() + Duration::from_secs(5);
    let mut count = t.message_count().await.unwrap();
    while count != 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        count = t.message_count().await.unwrap();
    }
    assert_eq!(count, 2);
    t.delete().await.unwrap();
}

async fn list_and_find_show_stored_messages_oldest_first_without_leasing(url: String) {
    let t = transport(&url, &unique_name("list"), "lease=10s&wait=100ms").await;
    let ids = t
        .send_batch(vec![
            (message("one"), None),
            (message("two"), None),
            (message("three"), None),
        ])
        .await
        .unwrap();

    let listed = t.list(10).await.unwrap();
    assert_eq!(
        listed
            .iter()
            .map(|d| d.id.as_str().to_string())
            .collect::<Vec<_>>(),
        ids,
        "listed oldest first"
    );
    assert_eq!(listed[1].raw, message("two"));
    assert_eq!(t.list(2).await.unwrap().len(), 2);
    assert_eq!(t.leased(), 0, "listing leases nothing");

    let ids: Vec<DeliveryId> = ids.into_iter().map(DeliveryId::from).collect();
    let found = t.find(&ids[2]).await.unwrap().expect("found");
    assert_eq!(found.raw, message("three"));
    assert!(t.find(&"999999".into()).await.unwrap().is_none());
    assert!(t.find(&"not-an-id".into()).await.unwrap().is_none());

    // Removing a listed (never handed out) message deletes it.
    t.reject(&ids[0]).await.unwrap();
    assert!(t.find(&ids[0]).await.unwrap().is_none());
    let left = t.list(10).await.unwrap();
    assert_eq!(left.len(), 2);

    // Acked through a delivery: gone from the listing too.
    let got = get_exactly(&t, 2, Duration::from_secs(5)).await;
    t.ack_batch(&[got[0].id.clone(), got[1].id.clone()])
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !t.list(10).await.unwrap().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(t.list(10).await.unwrap().is_empty());
    t.delete().await.unwrap();
}

async fn setup_is_idempotent_and_handles_with_one_name_share_the_queue(url: String) {
    let name = unique_name("shared");
    let a = transport(&url, &name, "lease=10s&wait=100ms").await;
    a.setup().await.unwrap();
    a.setup().await.unwrap();
    let b = transport(&url, &name, "lease=10s&wait=100ms").await;

    let batch = (0..20)
        .map(|i| (message(&format!("m{i}")), None))
        .collect::<Vec<_>>();
    let ids: BTreeSet<DeliveryId> = a
        .send_batch(batch)
        .await
        .unwrap()
        .into_iter()
        .map(DeliveryId::from)
        .collect();
    assert_eq!(ids.len(), 20);

    let mut seen = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.len() < 20 && Instant::now() < deadline {
        for handle in [&a, &b] {
            for d in handle.get(3).await.unwrap() {
                assert!(seen.insert(d.id.clone()), "{} handed out twice", d.id);
                handle.ack(&d.id).await.unwrap();
            }
        }
    }
    assert_eq!(seen, ids);
    a.delete().await.unwrap();
}

async fn transport_names_isolate_messages(url: String) {
    let a = transport(&url, &unique_name("iso-a"), "wait=100ms").await;
    let b = transport(&url, &unique_name("iso-b"), "wait=100ms").await;
    a.send(message("for a"), None).await.unwrap();
    assert!(b.get(10).await.unwrap().is_empty());
    assert_eq!(b.message_count().await.unwrap(), 0);
    let got = get_exactly(&a, 1, Duration::from_secs(5)).await;
    a.ack(&got[0].id).await.unwrap();
    a.delete().await.unwrap();
    b.delete().await.unwrap();
}

async fn get_hands_out_at_most_max_and_waits_briefly_when_empty(url: String) {
    let t = transport(&url, &unique_name("max"), "lease=10s&wait=300ms&batch=4").await;
    let started = Instant::now();
    assert!(t.get(10).await.unwrap().is_empty());
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250),
        "returned at once: {waited:?}"
    );
    assert!(waited < Duration::from_secs(5), "blocked: {waited:?}");

    let batch = (0..10).map(|i| (message(&format!("{i}")), None)).collect();
    t.send_batch(batch).await.unwrap();
    assert_eq!(t.get(3).await.unwrap().len(), 3);
    assert_eq!(t.get(10).await.unwrap().len(), 4, "capped by batch=4");
    t.delete().await.unwrap();
}

async fn a_consumer_deleted_behind_its_back_is_recreated(url: String) {
    let t = transport(&url, &unique_name("stall"), "lease=10s&wait=100ms").await;
    let id = t.send(message("m"), None).await.unwrap();

    let client = async_nats::connect(t.config().server.as_str())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(&t.stream()).await.unwrap();
    stream.delete_consumer(t.consumer()).await.unwrap();

    // The next gets fail or come back empty until the consumer is re-bound.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut got = Vec::new();
    while got.is_empty() && Instant::now() < deadline {
        got = t.get(1).await.unwrap_or_default();
    }
    assert_eq!(got.len(), 1, "consumer never resumed");
    assert_eq!(got[0].id.as_str(), id);
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}

async fn only_dedup_gives_publishes_an_id_that_jetstream_deduplicates(url: String) {
    let plain = transport(&url, &unique_name("nodedup"), "wait=100ms").await;
    let dedup = transport(&url, &unique_name("dedup"), "dedup=true&wait=100ms").await;
    let client = async_nats::connect(plain.config().server.as_str())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);

    let mut stored_ids = Vec::new();
    for t in [&plain, &dedup] {
        let id = t.send(message("m"), None).await.unwrap();
        let stream = js.get_stream(&t.stream()).await.unwrap();
        let stored = stream.get_raw_message(id.parse().unwrap()).await.unwrap();
        stored_ids.push(stored.headers.get("Nats-Msg-Id").cloned());
        // Whatever JetStream keeps, the delivery shows the sent headers only.
        let got = get_exactly(t, 1, Duration::from_secs(5)).await;
        assert_eq!(got[0].raw.headers, message("m").headers);
        t.ack(&got[0].id).await.unwrap();
    }
    assert_eq!(stored_ids[0], None, "no id without dedup");
    let msg_id = stored_ids[1].clone().expect("an id with dedup");

    // A publish repeating the id (what a retry sends) is not stored again.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", msg_id);
    let ack = js
        .publish_with_headers(dedup.subject().to_string(), headers, "again".into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(ack.duplicate);
    assert_eq!(dedup.message_count().await.unwrap(), 0);
    plain.delete().await.unwrap();
    dedup.delete().await.unwrap();
}

async fn ids_that_were_not_handed_out_cannot_be_released_or_kept_alive(url: String) {
    let t = transport(&url, &unique_name("unknown"), "wait=100ms").await;
    let id = DeliveryId::from(t.send(message("m"), None).await.unwrap());
    assert!(matches!(
        t.release(&id).await,
        Err(TransportError::NotFound(_))
    ));
    assert!(matches!(
        t.keepalive(&"nope".into()).await,
        Err(TransportError::NotFound(_))
    ));
    assert!(matches!(
        t.ack(&"nope".into()).await,
        Err(TransportError::NotFound(_))
    ));
    t.delete().await.unwrap();
}

async fn an_oversized_payload_is_refused_with_its_size(url: String) {
    let t = transport(&url, &unique_name("large"), "").await;
    let body = vec![b'x'; 8 * 1024 * 1024];
    match t
        .send(
            RawMessage {
                body,
                headers: Headers::new(),
            },
            None,
        )
        .await
    {
        Err(TransportError::TooLarge { size, limit }) => {
            // The body and the headers the transport adds.
            assert!(
                size > 8 * 1024 * 1024 && size < 8 * 1024 * 1024 + 200,
                "{size}"
            );
            assert!(limit < size);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(t.message_count().await.unwrap(), 0);
    t.delete().await.unwrap();
}

async fn a_body_within_the_limit_whose_headers_are_not_is_refused_with_both_counted(url: String) {
    let t = transport(&url, &unique_name("large-headers"), "").await;
    // The server's limit counts the headers too: find it from a refusal.
    let limit = match t
        .send(
            RawMessage {
                body: vec![b'x'; 64 * 1024 * 1024],
                headers: Headers::new(),
            },
            None,
        )
        .await
    {
        Err(TransportError::TooLarge { limit, .. }) => limit,
        other => panic!("expected TooLarge, got {other:?}"),
    };
    let mut headers = Headers::new();
    headers.insert("type", "Job");
    headers.insert("trace", "t".repeat(100));
    match t
        .send(
            RawMessage {
                body: vec![b'x'; limit - 50],
                headers,
            },
            None,
        )
        .await
    {
        Err(TransportError::TooLarge { size, limit: l }) => {
            assert_eq!(l, limit);
            assert!(size > limit, "{size} is reported as over {limit}");
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(t.message_count().await.unwrap(), 0);
    t.delete().await.unwrap();
}

async fn double_ack_waits_for_the_server_and_removes_the_message(url: String) {
    let t = transport(&url, &unique_name("dack"), "double_ack=true&wait=100ms").await;
    t.send_batch(vec![(message("a"), None), (message("b"), None)])
        .await
        .unwrap();
    let got = get_exactly(&t, 2, Duration::from_secs(5)).await;
    t.ack(&got[0].id).await.unwrap();
    t.ack_batch(&[got[1].id.clone()]).await.unwrap();
    // Confirmed acks: the count is already zero, no waiting needed.
    assert_eq!(t.message_count().await.unwrap(), 0);
    t.delete().await.unwrap();
}

async fn wait_for_messages_returns_at_once_after_an_empty_get_that_waited(url: String) {
    let t = transport(&url, &unique_name("idle"), "wait=100ms").await;
    assert!(t.get(1).await.unwrap().is_empty());
    let started = Instant::now();
    t.wait_for_messages(Duration::from_secs(10)).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "slept although get already waited"
    );
    t.delete().await.unwrap();
}

/// A large `get` that comes back full fetches the next batch ahead; what it
/// fetched must not be stuck until the lease ends when nobody takes it.
async fn messages_fetched_ahead_are_given_back_when_the_handle_is_dropped(url: String) {
    let name = unique_name("ahead_drop");
    let options = "lease=60s&wait=200ms";
    let t = transport(&url, &name, options).await;
    let bodies: Vec<String> = (0..300).map(|i| format!("m{i}")).collect();
    t.send_batch(bodies.iter().map(|b| (message(b), None)).collect())
        .await
        .unwrap();
    let first = t.get(100).await.unwrap();
    assert_eq!(first.len(), 100);
    let ids: Vec<DeliveryId> = first.iter().map(|d| d.id.clone()).collect();
    t.ack_batch(&ids).await.unwrap();
    drop(t);

    // Well within the 60 s lease, a new handle gets all the others.
    let other = transport(&url, &name, options).await;
    let rest = get_n(&other, 200, Duration::from_secs(20)).await;
    let mut seen: BTreeSet<Vec<u8>> = first.iter().map(|d| d.raw.body.clone()).collect();
    seen.extend(rest.iter().map(|d| d.raw.body.clone()));
    assert_eq!(seen.len(), 300, "{} of 300 distinct messages", seen.len());
    other.delete().await.unwrap();
}

async fn a_smaller_get_after_a_full_large_one_gives_the_surplus_back(url: String) {
    let name = unique_name("ahead_surplus");
    let options = "lease=60s&wait=200ms";
    let t = transport(&url, &name, options).await;
    let bodies: Vec<String> = (0..300).map(|i| format!("m{i}")).collect();
    t.send_batch(bodies.iter().map(|b| (message(b), None)).collect())
        .await
        .unwrap();
    let first = t.get(100).await.unwrap();
    assert_eq!(first.len(), 100);
    let second = t.get(10).await.unwrap();
    assert!(second.len() <= 10);
    let mut seen: BTreeSet<Vec<u8>> = first
        .iter()
        .chain(&second)
        .map(|d| d.raw.body.clone())
        .collect();
    assert_eq!(seen.len(), 100 + second.len());

    let other = transport(&url, &name, options).await;
    let rest = get_n(&other, 300 - seen.len(), Duration::from_secs(20)).await;
    seen.extend(rest.iter().map(|d| d.raw.body.clone()));
    assert_eq!(seen.len(), 300, "{} of 300 distinct messages", seen.len());
    other.delete().await.unwrap();
}

async fn the_transport_has_every_ability_jetstream_gives_it(url: String) {
    let t = transport(&url, &unique_name("abilities"), "wait=100ms").await;
    assert!(t.as_receiver().is_some());
    assert!(t.as_keepalive().is_some());
    assert!(t.as_setup().is_some());
    assert!(t.as_message_count().is_some());
    assert!(t.as_browse().is_some());
    assert!(t.as_teardown().is_some());
    assert!(t.as_wake_up().is_some());
    assert!(t.as_local_sender().is_none());
    assert!(t.as_local_receiver().is_none());
    t.delete().await.unwrap();
}

async fn a_rejected_message_never_comes_back(url: String) {
    let t = transport(&url, &unique_name("reject"), "lease=1s&wait=200ms").await;
    t.send(message("poison"), None).await.unwrap();
    let got = get_exactly(&t, 1, Duration::from_secs(5)).await;
    t.reject(&got[0].id).await.unwrap();
    assert_eq!(t.leased(), 0);
    // Well past the 1 s lease.
    let again = get_n(&t, 1, Duration::from_millis(2500)).await;
    assert!(again.is_empty(), "rejected message came back: {again:?}");
    assert_eq!(t.message_count().await.unwrap(), 0);
    t.delete().await.unwrap();
}

async fn purge_deletes_waiting_leased_and_delayed_messages_and_counts_them(url: String) {
    let t = transport(&url, &unique_name("purge"), "lease=10s&wait=100ms").await;
    t.send_batch(vec![
        (message("a"), None),
        (message("b"), None),
        (message("c"), Some(Duration::from_secs(60))),
    ])
    .await
    .unwrap();
    let leased = t.get(1).await.unwrap();
    assert_eq!(leased.len(), 1);
    assert_eq!(t.purge().await.unwrap(), 3);
    assert_eq!(t.leased(), 0, "purged messages are no longer leased");
    assert_eq!(t.message_count().await.unwrap(), 0);
    assert!(t.get(10).await.unwrap().is_empty());
    // The purged message is gone: acknowledging it is not an error.
    t.ack(&leased[0].id).await.unwrap();
    assert_eq!(t.purge().await.unwrap(), 0);
    t.delete().await.unwrap();
}

async fn delete_is_idempotent_and_the_next_use_sets_up_again(url: String) {
    let t = transport(&url, &unique_name("delete"), "wait=100ms").await;
    t.send(message("gone"), None).await.unwrap();
    t.delete().await.unwrap();
    t.delete().await.unwrap();
    let client = async_nats::connect(t.config().server.as_str())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    assert!(js.get_stream(t.stream()).await.is_err(), "stream deleted");

    // With auto_setup, the next send makes the stream and consumer again.
    let id = t.send(message("new"), None).await.unwrap();
    let got = get_exactly(&t, 1, Duration::from_secs(5)).await;
    assert_eq!(got[0].id.as_str(), id);
    assert_eq!(got[0].raw, message("new"));
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}

/// A large `get` that comes back full fetches the next batch ahead; closing
/// the transport gives it back at once.
async fn close_gives_back_what_was_fetched_ahead_and_later_calls_fail(url: String) {
    let name = unique_name("close");
    let options = "lease=60s&wait=200ms";
    let t = transport(&url, &name, options).await;
    let bodies: Vec<String> = (0..300).map(|i| format!("m{i}")).collect();
    t.send_batch(bodies.iter().map(|b| (message(b), None)).collect())
        .await
        .unwrap();
    let first = t.get(100).await.unwrap();
    assert_eq!(first.len(), 100);
    let ids: Vec<DeliveryId> = first.iter().map(|d| d.id.clone()).collect();
    t.ack_batch(&ids).await.unwrap();
    let other = t.clone();
    t.close().await.unwrap();
    t.close().await.unwrap();
    assert!(matches!(other.get(10).await, Err(TransportError::Closed)));
    assert!(matches!(
        other.send(message("late"), None).await,
        Err(TransportError::Closed)
    ));
    assert!(matches!(
        other.ack(&ids[0]).await,
        Err(TransportError::Closed)
    ));

    // Well within the 60 s lease, a new handle gets all the others.
    let after = transport(&url, &name, options).await;
    let rest = get_n(&after, 200, Duration::from_secs(20)).await;
    let mut seen: BTreeSet<Vec<u8>> = first.iter().map(|d| d.raw.body.clone()).collect();
    seen.extend(rest.iter().map(|d| d.raw.body.clone()));
    assert_eq!(seen.len(), 300, "{} of 300 distinct messages", seen.len());
    after.delete().await.unwrap();
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_NATS_URL", tests = [
        a_sent_message_arrives_intact_and_an_acked_one_never_returns: current_thread,
        an_unacknowledged_message_comes_back_after_the_lease: current_thread,
        a_message_not_acknowledged_within_its_lease_comes_back_marked_as_redelivered: current_thread,
        a_released_message_is_handed_out_again_before_its_lease_ends: current_thread,
        keepalive_keeps_a_message_from_being_handed_out_again: current_thread,
        a_delayed_message_is_not_handed_out_before_it_is_due: current_thread,
        message_count_includes_waiting_leased_and_delayed_messages: current_thread,
        list_and_find_show_stored_messages_oldest_first_without_leasing: current_thread,
        setup_is_idempotent_and_handles_with_one_name_share_the_queue: current_thread,
        transport_names_isolate_messages: current_thread,
        get_hands_out_at_most_max_and_waits_briefly_when_empty: current_thread,
        a_consumer_deleted_behind_its_back_is_recreated: current_thread,
        only_dedup_gives_publishes_an_id_that_jetstream_deduplicates: current_thread,
        ids_that_were_not_handed_out_cannot_be_released_or_kept_alive: current_thread,
        an_oversized_payload_is_refused_with_its_size: current_thread,
        a_body_within_the_limit_whose_headers_are_not_is_refused_with_both_counted: current_thread,
        double_ack_waits_for_the_server_and_removes_the_message: current_thread,
        wait_for_messages_returns_at_once_after_an_empty_get_that_waited: current_thread,
        messages_fetched_ahead_are_given_back_when_the_handle_is_dropped,
        a_smaller_get_after_a_full_large_one_gives_the_surplus_back,
        the_transport_has_every_ability_jetstream_gives_it: current_thread,
        a_rejected_message_never_comes_back: current_thread,
        purge_deletes_waiting_leased_and_delayed_messages_and_counts_them: current_thread,
        delete_is_idempotent_and_the_next_use_sets_up_again: current_thread,
        close_gives_back_what_was_fetched_ahead_and_later_calls_fail,
    ];
}
