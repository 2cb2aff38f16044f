//! A `get` kept pending while other messages are settled, or dropped while
//! it waits for the broker.

mod common;

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_amqp::AmqpTransport;
use envoi_core::transport::{
    Delivery, DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown, Transport,
};
use envoi_core::TransportError;

use common::{dsn, receive, unique, Within};

/// How often a settlement is tried again when the `get` it ran beside had
/// ended before it started, or it finished after that `get`.
const ATTEMPTS: usize = 10;

fn message(body: &str) -> RawMessage {
    RawMessage {
        body: body.as_bytes().to_vec(),
        ..RawMessage::default()
    }
}

/// How many consumers `queue` has, by a passive declare.
async fn consumers(url: &str, queue: &str) -> u32 {
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .expect_within("a raw connection")
        .await;
    let channel = connection.create_channel().expect_within("a channel").await;
    let n = channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .expect_within(format!("a passive declare of `{queue}`"))
        .await
        .consumer_count();
    let _ = connection.close(200, "done".into()).within("closing").await;
    n
}

async fn a_get_dropped_while_the_consumer_starts_leaves_no_consumer_behind(url: String) {
    // A few rounds: how the broker's `basic.consume-ok` meets the dropped
    // request varies from run to run.
    for _ in 0..3 {
        let name = unique("amqp_cancel_start");
        let t = AmqpTransport::connect(&name, &dsn(&url, "lease=off"))
            .expect_within("connect")
            .await;
        t.setup().expect_within("setup").await;
        // Polled once, then dropped: its `basic.consume` is on its way.
        let dropped = tokio::time::timeout(Duration::ZERO, t.get(10)).await;
        assert!(dropped.is_err(), "the get finished at its first poll");
        let batch: Vec<_> = (0..3).map(|i| (message(&format!("m{i}")), None)).collect();
        t.send_batch(batch).expect_within("send_batch").await;
        // Every message reaches a later `get`, through the one consumer
        // (whether the dropped request's consumer was running by then or
        // the later `get` waited for it to start).
        let got = receive(&t, 3, Duration::from_secs(30)).await;
        assert_eq!(consumers(&url, &name).await, 1, "a consumer nobody polls");
        let ids: Vec<DeliveryId> = got.iter().map(|d| d.id.clone()).collect();
        t.ack_batch(&ids).expect_within("ack_batch").await;
        t.delete().expect_within("delete").await;
    }
}

/// What a `get(1)` running beside a settlement returned, and when.
struct Beside {
    /// Whether the settlement finished before the `get` did; `None` when
    /// the `get` had already ended when the settlement started (nothing
    /// to conclude).
    settled_first: Option<bool>,
    got: Vec<Delivery>,
}

/// Starts a `get(1)`, gives it time to reach its wait for the broker, then
/// runs `settle` (described by `what`) while it waits.
async fn settle_beside_a_get(
    t: &Arc<AmqpTransport>,
    what: &str,
    settle: impl Future<Output = Result<(), TransportError>>,
) -> Beside {
    let getting = {
        let t = Arc::clone(t);
        tokio::spawn(async move {
            let got = t.get(1).await;
            (got, Instant::now())
        })
    };
    // The `get` waits up to 200 ms for a message; settle while it does.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let waiting = !getting.is_finished();
    settle.expect_within(what).await;
    let settled_at = Instant::now();
    let (got, got_at) = getting
        .within("the get beside the settlement")
        .await
        .unwrap();
    Beside {
        settled_first: waiting.then_some(settled_at < got_at),
        got: got.expect("get"),
    }
}

async fn settling_runs_while_a_get_waits(url: String) {
    let name = unique("amqp_cancel_settle");
    let t = Arc::new(
        AmqpTransport::connect(&name, &dsn(&url, "lease=5m"))
            .expect_within("connect")
            .await,
    );
    t.setup().expect_within("setup").await;
    // One held message per attempt that uses one up.
    let n = 4 * ATTEMPTS + 1;
    let batch: Vec<_> = (0..n).map(|i| (message(&format!("m{i}")), None)).collect();
    t.send_batch(batch).expect_within("send_batch").await;
    let mut held: VecDeque<Delivery> = receive(&*t, n, Duration::from_secs(30)).await.into();

    // A settlement that waited for the `get` beside it would finish after
    // that `get` every time: each kind must, at least once, finish while
    // the `get` still waits. The order of the two is what is checked, not
    // how long either took.
    for kind in ["ack", "keepalive", "ack_batch", "release"] {
        let mut orders = Vec::new();
        let mut concluded = false;
        for _ in 0..ATTEMPTS {
            let beside = match kind {
                "ack" => {
                    let d = held.pop_front().expect("a held message");
                    settle_beside_a_get(&t, kind, t.ack(&d.id)).await
                }
                "keepalive" => {
                    let id = held.front().expect("a held message").id.clone();
                    settle_beside_a_get(&t, kind, async { t.keepalive(&id).await }).await
                }
                "ack_batch" => {
                    let ids =
                        [held.pop_front(), held.pop_front()].map(|d| d.expect("a held message").id);
                    settle_beside_a_get(&t, kind, async { t.ack_batch(&ids).await }).await
                }
                _ => {
                    let d = held.pop_front().expect("a held message");
                    let beside = settle_beside_a_get(&t, kind, t.release(&d.id)).await;
                    // The `get` that waited while the message was given
                    // back hands it out: it was still waiting then.
                    if beside.settled_first == Some(true) {
                        assert!(
                            beside.got.iter().any(|g| g.raw == d.raw),
                            "the waiting get did not hand out the released message"
                        );
                    }
                    beside
                }
            };
            held.extend(beside.got);
            orders.push(beside.settled_first);
            if beside.settled_first == Some(true) {
                concluded = true;
                break;
            }
        }
        assert!(
            concluded,
            "`{kind}` never finished while a get waited (finished first: {orders:?}); \
             it waits for the get"
        );
    }

    // What was released comes back; everything held is acknowledged.
    let ids: Vec<DeliveryId> = held.iter().map(|d| d.id.clone()).collect();
    t.ack_batch(&ids)
        .expect_within("ack_batch of the rest")
        .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = t.message_count().expect_within("message_count").await;
        if left == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{left} messages left");
        for d in t.get(10).expect_within("get").await {
            t.ack(&d.id).expect_within("ack").await;
        }
    }
    t.delete().expect_within("delete").await;
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_AMQP_URL", tests = [
        a_get_dropped_while_the_consumer_starts_leaves_no_consumer_behind,
        settling_runs_while_a_get_waits,
    ];
}
