//! A `get` dropped while it waits for a claim.

mod common;

use std::time::{Duration, Instant};

use envoi_core::transport::Transport;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_claimed_ahead_for_a_dropped_get_are_given_back_by_close() {
    let Some(url) = common::url("rows_claimed_ahead_for_a_dropped_get_are_given_back_by_close")
    else {
        return;
    };
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
            t.close().await;
            let _ = sqlx_drop(&admin, &table).await;
            continue;
        }
        // Closing gives back what was claimed ahead and not handed out.
        t.close().await;
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
            let ids: Vec<String> = batch.into_iter().map(|d| d.id).collect();
            other.ack_batch(&ids).await.unwrap();
        }
        assert_eq!(got, 100);
        let _ = sqlx_drop(&admin, &table).await;
        return;
    }
    panic!("never caught a claim ahead in flight");
}
