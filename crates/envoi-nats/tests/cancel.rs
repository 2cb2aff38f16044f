//! A `get` kept pending while other messages are settled, or dropped while
//! its pull request waits on the server.

mod common;

use std::time::{Duration, Instant};

use common::{get_exactly, transport, unique_name};
use envoi_core::transport::{DeliveryId, Keepalive, RawMessage, Receiver, Teardown, Transport};

fn message(body: &str) -> RawMessage {
    RawMessage {
        body: body.as_bytes().to_vec(),
        ..RawMessage::default()
    }
}

async fn settling_runs_promptly_while_a_long_fetch_waits(url: String) {
    let t = transport(
        &url,
        &unique_name("cancel-settle"),
        "lease=30s&wait=10s&double_ack=true",
    )
    .await;
    for i in 0..3 {
        t.send(message(&format!("m{i}")), None).await.unwrap();
    }
    let held = get_exactly(&t, 3, Duration::from_secs(5)).await;
    let reader = {
        let t = t.clone();
        tokio::spawn(async move { t.get(1).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Settling while the fetch waits (nothing can end it but the release
    // below, or its 10 s wait): had settling waited for the fetch, the
    // fetch would have ended first.
    t.keepalive(&held[0].id).await.unwrap();
    t.ack(&held[0].id).await.unwrap();
    t.ack_batch(&[held[2].id.clone()]).await.unwrap();
    assert!(
        !reader.is_finished(),
        "the fetch ended before settling did: settling waited for it"
    );
    t.release(&held[1].id).await.unwrap();
    // The release ends the fetch, long before its own 10 s wait would.
    let got = tokio::time::timeout(Duration::from_secs(8), reader)
        .await
        .expect("the pending fetch did not get the released message within 8 s")
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 1, "the fetch ended without the released message");
    assert_eq!(got[0].id, held[1].id);
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}

async fn a_message_sent_after_a_dropped_fetch_goes_to_the_next_get(url: String) {
    let t = transport(&url, &unique_name("cancel-drop"), "lease=30s&wait=5s").await;
    let get = {
        let t = t.clone();
        tokio::spawn(async move { t.get(1).await })
    };
    // The pull request is on the server, waiting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    get.abort();
    let _ = get.await;
    let sent_at = Instant::now();
    let id = t.send(message("after the drop"), None).await.unwrap();
    let mut got = Vec::new();
    while got.is_empty() {
        assert!(
            sent_at.elapsed() < Duration::from_secs(20),
            "the message sent after the drop was not delivered within 20 s \
             (lost to the drop, it would come back after the 30 s lease)"
        );
        got = t.get(1).await.unwrap();
    }
    eprintln!("delivered after {:?}", sent_at.elapsed());
    assert_eq!(got[0].id.as_str(), id);
    // Handed to the dropped pull request, JetStream would have counted a
    // delivery, and handed it out again only after the 30 s lease.
    assert!(
        !got[0].redelivered,
        "went to the dropped pull request (delivered {:?} after it was sent)",
        sent_at.elapsed()
    );
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}

async fn a_get_dropped_while_it_waits_for_the_read_ahead_loses_nothing_to_the_lease(url: String) {
    let t = transport(
        &url,
        &unique_name("cancel-ahead"),
        "lease=30s&wait=3s&batch=100",
    )
    .await;
    let batch: Vec<_> = (0..100)
        .map(|i| (message(&format!("m{i}")), None))
        .collect();
    t.send_batch(batch).await.unwrap();
    // A full batch of 100: the pull request for the next `get` goes out
    // and waits on the server, the stream being empty.
    let first = get_exactly(&t, 100, Duration::from_secs(5)).await;
    let ids: Vec<DeliveryId> = first.iter().map(|d| d.id.clone()).collect();
    t.ack_batch(&ids).await.unwrap();
    // This `get` waits for that pull request, and is dropped meanwhile.
    let dropped = tokio::time::timeout(Duration::from_millis(200), t.get(100)).await;
    assert!(dropped.is_err(), "the get did not wait for the read-ahead");
    let sent_at = Instant::now();
    let id = t.send(message("after the drop"), None).await.unwrap();
    let mut got = Vec::new();
    while got.is_empty() {
        assert!(
            sent_at.elapsed() < Duration::from_secs(20),
            "the message sent after the drop was not delivered within 20 s \
             (lost to the drop, it would come back after the 30 s lease)"
        );
        got = t.get(100).await.unwrap();
    }
    eprintln!("delivered after {:?}", sent_at.elapsed());
    assert_eq!(got[0].id.as_str(), id);
    // Lost to the dropped `get`, JetStream would have counted a delivery,
    // and handed it out again only after the 30 s lease.
    assert!(
        !got[0].redelivered,
        "lost to the dropped get and redelivered ({:?} after it was sent)",
        sent_at.elapsed()
    );
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_NATS_URL", tests = [
        settling_runs_promptly_while_a_long_fetch_waits,
        a_message_sent_after_a_dropped_fetch_goes_to_the_next_get,
        a_get_dropped_while_it_waits_for_the_read_ahead_loses_nothing_to_the_lease,
    ];
}
