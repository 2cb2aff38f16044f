//! A `get` kept pending for a long time, or dropped while its blocking read
//! is on the server: what runs alongside it and what becomes of the entries
//! it was about to read.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::transport::{
    DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown, Transport,
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

/// Whether the handle's blocking connection is blocked in `XREADGROUP`
/// now (`CLIENT LIST` flags it `b`).
async fn is_blocked(c: &mut MultiplexedConnection, t: &RedisTransport) -> bool {
    let blocking_name = t.client_names()[1].to_string();
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(c)
        .await
        .unwrap();
    list.lines().any(|l| {
        let fields: Vec<&str> = l.split(' ').collect();
        let has = |field: &str| fields.contains(&field);
        let blocked = fields.iter().any(|f| {
            f.strip_prefix("flags=")
                .is_some_and(|flags| flags.contains('b'))
        });
        has(&format!("name={blocking_name}")) && has("cmd=xreadgroup") && blocked
    })
}

/// Waits until the handle's blocking connection runs `XREADGROUP`.
async fn wait_blocked(c: &mut MultiplexedConnection, t: &RedisTransport) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !is_blocked(c, t).await {
        assert!(Instant::now() < deadline, "the read never blocked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn settling_runs_promptly_while_a_long_read_is_pending(url: String) {
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
    t.keepalive(&held[0].id).await.unwrap();
    t.ack(&held[0].id).await.unwrap();
    t.ack_batch(&[held[2].id.clone()]).await.unwrap();
    // Settled while the read still blocks (for up to 10 s): nothing waited
    // for it.
    assert!(
        is_blocked(&mut c, &t).await,
        "settling waited for the read to end"
    );
    t.release(&held[1].id).await.unwrap();
    // The released message wakes the pending read.
    let got = common::within(
        Duration::from_secs(5),
        "the blocked read to wake up for the released message",
        reader,
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(got.len(), 1);
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}

async fn an_entry_read_by_a_dropped_get_comes_back_after_the_lease(url: String) {
    const LEASE: Duration = Duration::from_secs(2);
    let name = common::unique("cancel-drop");
    let t = Arc::new(common::transport(&url, &name, "block=3s&lease=2s").await);
    t.setup().await.unwrap();
    let get = {
        let t = Arc::clone(&t);
        tokio::spawn(async move { t.get(1).await })
    };
    let mut c = common::raw(&url).await;
    wait_blocked(&mut c, &t).await;
    get.abort();
    let _ = get.await;
    // Commands on the shared connection are not held up by the read, which
    // still blocks on the server.
    assert_eq!(t.message_count().await.unwrap(), 0);
    assert!(
        is_blocked(&mut c, &t).await,
        "a command on the shared connection waited for the blocked read"
    );
    // The server hands the entry to the dropped read, whose reply nobody
    // takes: it is pending for this handle from now on. Another handle,
    // whose gets come back every 100 ms, would see it as soon as it is
    // claimable.
    let other = common::transport(&url, &name, "block=100ms&lease=2s").await;
    let sent_at = Instant::now();
    let id = t.send(text("after the drop"), None).await.unwrap();
    let mut got = Vec::new();
    while got.is_empty() {
        assert!(
            sent_at.elapsed() < Duration::from_secs(20),
            "never delivered"
        );
        got = common::within(Duration::from_secs(15), "a get", other.get(1))
            .await
            .unwrap();
    }
    let back_after = sent_at.elapsed();
    eprintln!("delivered after {back_after:?}");
    assert_eq!(got[0].id.as_str(), id);
    assert!(got[0].redelivered, "a claimed entry is marked");
    // It was handed to the dropped read at the earliest when it was sent,
    // and is claimed only once idle for the lease (the margin covers the
    // server's clock counting whole milliseconds).
    assert!(
        back_after + Duration::from_millis(50) >= LEASE,
        "the entry came back after {back_after:?}, before its {LEASE:?} lease had passed"
    );
    other.ack(&got[0].id).await.unwrap();
    // The blocking connection still works: a new entry is read by the next
    // get (a broken connection would fail it, a lost read return nothing
    // after blocking).
    let again = t.send(text("next"), None).await.unwrap();
    let got = common::within(
        Duration::from_secs(10),
        "a get of a waiting entry",
        t.get(1),
    )
    .await
    .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id.as_str(), again);
    t.ack(&DeliveryId::from(again)).await.unwrap();
    t.delete().await.unwrap();
}

envoi_transport_tests::broker_tests! {
    needs = common::url, tests = [
        settling_runs_promptly_while_a_long_read_is_pending,
        an_entry_read_by_a_dropped_get_comes_back_after_the_lease,
    ];
}
