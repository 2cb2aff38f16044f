//! A `get` kept pending for a long time, or dropped while its blocking read
//! is on the server: what runs alongside it and what becomes of the entries
//! it was about to read.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::transport::{
    DeliveryId, Keepalive, RawMessage, Receiver, Setup, Teardown, Transport,
};
use envoi_core::Headers;
use envoi_redis::RedisTransport;
use redis::aio::MultiplexedConnection;

fn text(body: &str) -> RawMessage {
    RawMessage {
        body: body.as_bytes().to_vec(),
        headers: Headers::new(),
    }
}

/// Waits until the handle's blocking connection runs `XREADGROUP`.
async fn wait_blocked(c: &mut MultiplexedConnection, t: &RedisTransport) {
    let blocking_name = t.client_names()[1].to_string();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(c)
            .await
            .unwrap();
        if list
            .lines()
            .any(|l| l.contains(&format!("name={blocking_name} ")) && l.contains("cmd=xreadgroup"))
        {
            return;
        }
        assert!(Instant::now() < deadline, "the read never blocked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_runs_promptly_while_a_long_read_is_pending() {
    let Some(url) = common::url("settling_runs_promptly_while_a_long_read_is_pending") else {
        return;
    };
    let t = Arc::new(
        common::transport(
            &url,
            &common::unique("cancel-settle"),
            "block=10s&lease=30s",
        )
        .await,
    );
    t.setup().await.unwrap();
    for i in 0..3 {
        t.send(text(&format!("m{i}")), None).await.unwrap();
    }
    let held = t.get(3).await.unwrap();
    assert_eq!(held.len(), 3);
    let reader = {
        let t = Arc::clone(&t);
        tokio::spawn(async move { t.get(1).await })
    };
    let mut c = common::raw(&url).await;
    wait_blocked(&mut c, &t).await;
    let started = Instant::now();
    t.keepalive(&held[0].id).await.unwrap();
    t.ack(&held[0].id).await.unwrap();
    t.release(&held[1].id).await.unwrap();
    t.ack_batch(&[held[2].id.clone()]).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "settling waited for the read: {:?}",
        started.elapsed()
    );
    // The released message wakes the pending read.
    let got = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("the read did not wake up")
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 1);
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_read_by_a_dropped_get_comes_back_after_the_lease() {
    let Some(url) = common::url("an_entry_read_by_a_dropped_get_comes_back_after_the_lease") else {
        return;
    };
    let t = Arc::new(
        common::transport(&url, &common::unique("cancel-drop"), "block=3s&lease=2s").await,
    );
    t.setup().await.unwrap();
    let get = {
        let t = Arc::clone(&t);
        tokio::spawn(async move { t.get(1).await })
    };
    let mut c = common::raw(&url).await;
    wait_blocked(&mut c, &t).await;
    get.abort();
    let _ = get.await;
    let sent_at = Instant::now();
    let id = t.send(text("after the drop"), None).await.unwrap();
    // Sends and acks on the shared connection are not held up.
    assert!(sent_at.elapsed() < Duration::from_secs(1));
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
    t.ack(&got[0].id).await.unwrap();
    // The blocking connection still works: a new entry is read at once.
    let again = t.send(text("next"), None).await.unwrap();
    let started = Instant::now();
    let got = t.get(1).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id.as_str(), again);
    assert!(started.elapsed() < Duration::from_secs(1));
    t.ack(&DeliveryId::from(again)).await.unwrap();
    t.delete().await.unwrap();
}
