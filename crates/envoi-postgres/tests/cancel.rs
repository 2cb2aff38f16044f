//! A `get` kept pending while other messages are settled, or dropped while
//! its claim runs.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::transport::{DeliveryId, Keepalive, MessageCount, Receiver, Transport};

async fn settling_runs_promptly_while_a_get_waits_on_a_one_connection_pool(url: String) {
    let table = common::unique("cancel_settle");
    let t = Arc::new(
        common::open(
            "q",
            &url,
            &format!("table={table}&wait=10s&lease=30s&max_connections=1"),
        )
        .await,
    );
    for i in 0..3 {
        t.send(common::text(&format!("m{i}")), None).await.unwrap();
    }
    let held = t.get(3).await.unwrap();
    assert_eq!(held.len(), 3);
    let reader = {
        let t = Arc::clone(&t);
        tokio::spawn(async move { t.get(1).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    t.keepalive(&held[0].id).await.unwrap();
    t.ack(&held[0].id).await.unwrap();
    t.ack_batch(&[held[2].id.clone()]).await.unwrap();
    // Settled while the get still waits (for up to 10 s): nothing waited
    // for it.
    assert!(!reader.is_finished(), "settling waited for the get to end");
    t.release(&held[1].id).await.unwrap();
    let got = common::within(
        Duration::from_secs(5),
        "the waiting get to wake up for the released message",
        reader,
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id, held[1].id);
    t.ack(&got[0].id).await.unwrap();
    let admin = common::admin(&url).await;
    let _ = sqlx_drop(&admin, &table).await;
}

async fn gets_dropped_mid_claim_break_nothing_and_lose_nothing(url: String) {
    let table = common::unique("cancel_drop");
    let t = common::open(
        "q",
        &url,
        &format!("table={table}&wait=1s&lease=2s&poll=100ms&max_connections=1"),
    )
    .await;
    let mut sent = BTreeSet::new();
    for i in 0..5 {
        let id = t.send(common::text(&format!("m{i}")), None).await.unwrap();
        sent.insert(DeliveryId::from(id));
    }
    for round in 0..40 {
        // Dropped after one poll, or a little later: mid-claim, or waiting.
        let after = Duration::from_micros(round * 50);
        let _ = tokio::time::timeout(after, t.get(1)).await;
    }
    // The one pooled connection still works, and every message is handed
    // out once, some of them after their lease.
    let started = Instant::now();
    let mut got = BTreeSet::new();
    while got.len() < sent.len() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "got {got:?} of {sent:?}"
        );
        for d in t.get(5).await.unwrap() {
            t.ack(&d.id).await.unwrap();
            assert!(got.insert(d.id), "handed out twice");
        }
    }
    eprintln!("all back after {:?}", started.elapsed());
    assert_eq!(got, sent);
    assert_eq!(t.message_count().await.unwrap(), 0);
    let admin = common::admin(&url).await;
    let _ = sqlx_drop(&admin, &table).await;
}

async fn sqlx_drop(
    admin: &envoi_postgres::sqlx::postgres::PgPool,
    table: &str,
) -> Result<(), envoi_postgres::sqlx::Error> {
    envoi_postgres::sqlx::query(envoi_postgres::sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {table}"
    )))
    .execute(admin)
    .await
    .map(drop)
}

async fn rows_claimed_ahead_for_a_dropped_get_are_given_back_by_close(url: String) {
    let admin = common::admin(&url).await;
    // A few attempts: the claim ahead may finish before the second `get`
    // is first polled.
    for _ in 0..20 {
        let table = common::unique("cancel_ahead");
        let options = format!("table={table}&lease=60s&batch=100");
        let t = common::open("q", &url, &options).await;
        let batch: Vec<_> = (0..200)
            .map(|i| (common::text(&format!("m{i}")), None))
            .collect();
        t.send_batch(batch).await.unwrap();
        // A full batch of 100: the next 100 are claimed ahead, in the
        // background.
        let first = t.get(100).await.unwrap();
        assert_eq!(first.len(), 100);
        // This `get` waits for that claim, and is dropped meanwhile.
        let dropped = tokio::time::timeout(Duration::ZERO, t.get(100)).await;
        if dropped.is_ok() {
            // The claim ahead had already finished: try again.
            t.close().await.unwrap();
            let _ = sqlx_drop(&admin, &table).await;
            continue;
        }
        // Closing gives back what was claimed ahead and not handed out.
        t.close().await.unwrap();
        let other = common::open("q", &url, &options).await;
        let started = Instant::now();
        let mut got = 0;
        while got < 100 {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{got} of the 100 claimed ahead came back"
            );
            let batch = other.get(100).await.unwrap();
            got += batch.len();
            other.ack_batch(&common::ids(&batch)).await.unwrap();
        }
        assert_eq!(got, 100);
        let _ = sqlx_drop(&admin, &table).await;
        return;
    }
    panic!("never caught a claim ahead in flight");
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_POSTGRES_URL", tests = [
        settling_runs_promptly_while_a_get_waits_on_a_one_connection_pool,
        gets_dropped_mid_claim_break_nothing_and_lose_nothing,
        rows_claimed_ahead_for_a_dropped_get_are_given_back_by_close,
    ];
}
