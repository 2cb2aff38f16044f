//! The envoi worker consuming a PostgreSQL transport created from a DSN, end
//! to end: dispatch, send, receive, handle, acknowledge.

mod common;

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoi_core::worker::{StopReason, Worker};
use envoi_core::{Command, Message, Messenger};
use envoi_postgres::PostgresTransportFactory;
use serde::{Deserialize, Serialize};

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

async fn the_worker_handles_every_message_sent_through_a_postgres_dsn(url: String) {
    const N: u32 = 200;
    let name = common::unique("worker");
    let dsn = common::dsn(&url, "table=envoi_test_messages&lease=5s&max_connections=4");
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
        .transport_factory(PostgresTransportFactory)
        .transport_dsn(name.clone(), dsn)
        .route::<ShipOrder>(name.clone())
        .build_async()
        .await
        .expect("the messenger builds from a postgres DSN");
    let transport = Arc::clone(messenger.transport(&name).expect("registered"));
    let setup = transport.as_setup().expect("a postgres transport sets up");
    setup.setup().await.expect("setup");
    let count = transport
        .as_message_count()
        .expect("a postgres transport counts");

    for id in 0..N {
        messenger
            .dispatcher()
            .dispatch(ShipOrder { id })
            .await
            .expect("dispatch sends to postgres");
    }
    assert_eq!(count.message_count().await.unwrap(), u64::from(N));

    let worker = Worker::builder(&messenger)
        .receiver(name.clone())
        .stop_when_empty()
        .build()
        .expect("worker");
    let report = common::within(
        Duration::from_secs(60),
        "the worker to empty the queue",
        worker.run(),
    )
    .await;
    assert_eq!(report.reason, StopReason::Empty);
    assert_eq!(report.stats.handled, u64::from(N));
    let seen = seen.lock().unwrap().clone();
    let distinct: BTreeSet<u32> = seen.iter().copied().collect();
    assert_eq!(seen.len(), N as usize, "some orders were handled twice");
    assert_eq!(distinct, (0..N).collect(), "some orders were never handled");
    assert_eq!(count.message_count().await.unwrap(), 0);
    let browse = transport.as_browse().expect("a postgres transport lists");
    assert!(browse.list(10).await.unwrap().is_empty());
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_POSTGRES_URL", tests = [
        the_worker_handles_every_message_sent_through_a_postgres_dsn,
    ];
}
