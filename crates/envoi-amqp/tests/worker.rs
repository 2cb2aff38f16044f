//! The envoi worker consuming a RabbitMQ transport created from a DSN, end
//! to end: dispatch, send, receive, handle, acknowledge.

mod common;

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoi_amqp::{AmqpTransport, AmqpTransportFactory};
use envoi_core::transport::{RawMessage, Receiver, Teardown, Transport, WakeUp};
use envoi_core::worker::{StopReason, Worker};
use envoi_core::{Command, Message, Messenger};
use serde::{Deserialize, Serialize};

use common::{dsn, unique, Within};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct ShipOrder {
    id: u32,
}

impl Message for ShipOrder {
    const NAME: &'static str = "ShipOrder";
}

impl Command for ShipOrder {
    type Output = ();
    type Error = Infallible;
}

async fn the_worker_handles_every_message_sent_through_an_amqp_dsn(url: String) {
    const N: u32 = 200;
    let queue = unique("amqp_worker");
    let seen = Arc::new(Mutex::new(Vec::<u32>::new()));
    let handler_seen = Arc::clone(&seen);
    let messenger = Messenger::builder()
        .command_handler(move |order: ShipOrder| {
            let seen = Arc::clone(&handler_seen);
            async move {
                seen.lock().unwrap().push(order.id);
                Ok::<_, Infallible>(())
            }
        })
        .transport_factory(AmqpTransportFactory)
        .transport_dsn("orders", dsn(&url, &format!("queue={queue}&lease=5s")))
        .route::<ShipOrder>("orders")
        .build_async()
        .expect_within("the messenger builds from an amqp DSN")
        .await;
    let transport = Arc::clone(messenger.transport("orders").expect("registered"));
    transport
        .as_setup()
        .expect("a RabbitMQ transport declares its queues")
        .setup()
        .expect_within("setup")
        .await;
    let count = transport
        .as_message_count()
        .expect("a RabbitMQ transport counts its messages");

    for id in 0..N {
        messenger
            .dispatcher()
            .dispatch(ShipOrder { id })
            .expect_within("dispatch sends to RabbitMQ")
            .await;
    }
    assert_eq!(
        count.message_count().expect_within("message_count").await,
        u64::from(N)
    );

    let report = Worker::builder(&messenger)
        .receiver("orders")
        .stop_when_empty()
        .build()
        .expect("worker")
        .run()
        .within("the worker to empty the queue")
        .await;
    assert_eq!(report.reason, StopReason::Empty);
    assert_eq!(report.stats.handled, u64::from(N));
    let seen = seen.lock().unwrap().clone();
    let distinct: BTreeSet<u32> = seen.iter().copied().collect();
    assert_eq!(seen.len(), N as usize, "some orders were handled twice");
    assert_eq!(distinct, (0..N).collect(), "some orders were never handled");
    assert_eq!(
        count.message_count().expect_within("message_count").await,
        0
    );
    drop(messenger);
    AmqpTransport::connect(&queue, &dsn(&url, ""))
        .expect_within("connect")
        .await
        .delete()
        .expect_within("delete")
        .await;
}

async fn wait_for_messages_wakes_when_a_message_arrives_and_times_out_otherwise(url: String) {
    let name = unique("amqp_wait");
    let waiter = Arc::new(
        AmqpTransport::connect(&name, &dsn(&url, ""))
            .expect_within("connect waiter")
            .await,
    );
    let sender = AmqpTransport::connect(&name, &dsn(&url, ""))
        .expect_within("connect sender")
        .await;

    let started = Instant::now();
    waiter
        .wait_for_messages(Duration::from_millis(300))
        .within("a wait of 300 ms")
        .await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(5),
        "an empty queue was waited on for {waited:?}"
    );

    let waiting = {
        let waiter = Arc::clone(&waiter);
        tokio::spawn(async move {
            let started = Instant::now();
            waiter.wait_for_messages(Duration::from_secs(20)).await;
            started.elapsed()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let raw = RawMessage {
        body: b"wake up".to_vec(),
        ..RawMessage::default()
    };
    sender.send(raw, None).expect_within("send").await;
    let waited = waiting.expect_within("the waiter").await;
    assert!(
        waited < Duration::from_secs(10),
        "the waiter slept {waited:?} with a message available"
    );
    let got = waiter.get(1).expect_within("get").await;
    assert_eq!(got.len(), 1, "the message was not there after the wake-up");
    waiter.ack(&got[0].id).expect_within("ack").await;
    sender.delete().expect_within("delete").await;
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_AMQP_URL", tests = [
        the_worker_handles_every_message_sent_through_an_amqp_dsn,
        wait_for_messages_wakes_when_a_message_arrives_and_times_out_otherwise,
    ];
}
