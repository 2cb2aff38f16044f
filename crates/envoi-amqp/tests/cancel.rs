//! A `get` kept pending while other messages are settled, or dropped while
//! it waits for the broker.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_amqp::AmqpTransport;
use envoi_core::transport::{
    DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown, Transport,
};

use common::{dsn, receive, unique, url};

fn message(body: &str) -> RawMessage {
    RawMessage {
        body: body.as_bytes().to_vec(),
        ..RawMessage::default()
    }
}

/// How many consumers `queue` has, by a passive declare.
async fn consumers(url: &str, queue: &str) -> u32 {
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .expect("raw connection");
    let channel = connection.create_channel().await.expect("channel");
    let n = channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("passive declare")
        .consumer_count();
    let _ = connection.close(200, "done".into()).await;
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_dropped_while_the_consumer_starts_leaves_no_consumer_behind() {
    let Some(url) = url("a_get_dropped_while_the_consumer_starts_leaves_no_consumer_behind") else {
        return;
    };
    // A few rounds: how the broker's `basic.consume-ok` meets the dropped
    // request varies from run to run.
    for _ in 0..3 {
        let name = unique("amqp_cancel_start");
        let t = AmqpTransport::connect(&name, &dsn(&url, "lease=off"))
            .await
            .expect("connect");
        t.setup().await.expect("setup");
        // Polled once, then dropped: its `basic.consume` is on its way.
        let dropped = tokio::time::timeout(Duration::ZERO, t.get(10)).await;
        assert!(dropped.is_err(), "the get finished at its first poll");
        // The broker has taken the `basic.consume` by now.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let batch: Vec<_> = (0..3).map(|i| (message(&format!("m{i}")), None)).collect();
        t.send_batch(batch).await.expect("send_batch");
        // Every message reaches a later `get`, through the one consumer.
        let got = receive(&t, 3, Duration::from_secs(5)).await;
        assert_eq!(consumers(&url, &name).await, 1, "a consumer nobody polls");
        let ids: Vec<DeliveryId> = got.iter().map(|d| d.id.clone()).collect();
        t.ack_batch(&ids).await.expect("ack_batch");
        t.delete().await.expect("delete");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_runs_while_a_get_waits() {
    let Some(url) = url("settling_runs_while_a_get_waits") else {
        return;
    };
    let name = unique("amqp_cancel_settle");
    let t = Arc::new(
        AmqpTransport::connect(&name, &dsn(&url, "lease=30s"))
            .await
            .expect("connect"),
    );
    t.setup().await.expect("setup");
    let batch: Vec<_> = (0..4).map(|i| (message(&format!("m{i}")), None)).collect();
    t.send_batch(batch).await.expect("send_batch");
    let held = receive(&*t, 4, Duration::from_secs(5)).await;
    for round in 0..20 {
        let waiting = {
            let t = Arc::clone(&t);
            tokio::spawn(async move { t.get(1).await })
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        let started = Instant::now();
        match round {
            0 => t.ack(&held[0].id).await.expect("ack"),
            1 => t.keepalive(&held[1].id).await.expect("keepalive"),
            2 => t.release(&held[1].id).await.expect("release"),
            3 => t.ack_batch(&[held[2].id.clone()]).await.expect("ack_batch"),
            _ => {}
        }
        assert!(
            started.elapsed() < Duration::from_millis(150),
            "{:?}",
            started.elapsed()
        );
        for d in waiting.await.unwrap().expect("get") {
            t.ack(&d.id).await.expect("ack of the released message");
        }
    }
    t.ack(&held[3].id).await.expect("ack");
    assert_eq!(t.message_count().await.expect("count"), 0);
    t.delete().await.expect("delete");
}
