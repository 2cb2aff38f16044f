//! A `get` kept pending while other messages are settled, or dropped while
//! its pull request waits on the server.

mod common;

use std::time::{Duration, Instant};

use common::{nats_url, transport, unique_name};
use envoi_core::transport::{DeliveryId, Keepalive, RawMessage, Receiver, Teardown, Transport};

fn message(body: &str) -> RawMessage {
    RawMessage {
        body: body.as_bytes().to_vec(),
        ..RawMessage::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_runs_promptly_while_a_long_fetch_waits() {
    let Some(url) = nats_url("settling_runs_promptly_while_a_long_fetch_waits") else {
        return;
    };
    let t = transport(
        &url,
        &unique_name("cancel-settle"),
        "lease=30s&wait=10s&double_ack=true",
    )
    .await;
    for i in 0..3 {
        t.send(message(&format!("m{i}")), None).await.unwrap();
    }
    let held = common::get_n(&t, 3, Duration::from_secs(5)).await;
    assert_eq!(held.len(), 3);
    let reader = {
        let t = t.clone();
        tokio::spawn(async move { t.get(1).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    t.keepalive(&held[0].id).await.unwrap();
    t.ack(&held[0].id).await.unwrap();
    t.ack_batch(&[held[2].id.clone()]).await.unwrap();
    t.release(&held[1].id).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "settling waited for the fetch: {:?}",
        started.elapsed()
    );
    let got = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("the pending fetch did not get the released message")
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id, held[1].id);
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_sent_after_a_dropped_fetch_goes_to_the_next_get() {
    let Some(url) = nats_url("a_message_sent_after_a_dropped_fetch_goes_to_the_next_get") else {
        return;
    };
    let t = transport(&url, &unique_name("cancel-drop"), "lease=3s&wait=5s").await;
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
            sent_at.elapsed() < Duration::from_secs(15),
            "never delivered"
        );
        got = t.get(1).await.unwrap();
    }
    eprintln!("delivered after {:?}", sent_at.elapsed());
    assert_eq!(got[0].id.as_str(), id);
    assert!(
        sent_at.elapsed() < Duration::from_secs(2),
        "went to the dropped pull request: {:?}",
        sent_at.elapsed()
    );
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_dropped_while_it_waits_for_the_read_ahead_loses_nothing_to_the_lease() {
    let Some(url) =
        nats_url("a_get_dropped_while_it_waits_for_the_read_ahead_loses_nothing_to_the_lease")
    else {
        return;
    };
    let t = transport(
        &url,
        &unique_name("cancel-ahead"),
        "lease=10s&wait=3s&batch=100",
    )
    .await;
    let batch: Vec<_> = (0..100)
        .map(|i| (message(&format!("m{i}")), None))
        .collect();
    t.send_batch(batch).await.unwrap();
    // A full batch of 100: the pull request for the next `get` goes out
    // and waits on the server, the stream being empty.
    let first = common::get_n(&t, 100, Duration::from_secs(5)).await;
    assert_eq!(first.len(), 100);
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
            "never delivered"
        );
        got = t.get(100).await.unwrap();
    }
    eprintln!("delivered after {:?}", sent_at.elapsed());
    assert_eq!(got[0].id.as_str(), id);
    assert!(
        sent_at.elapsed() < Duration::from_secs(5),
        "waited for the lease: {:?}",
        sent_at.elapsed()
    );
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}
