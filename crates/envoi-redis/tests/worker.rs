//! The envoi worker consuming a Redis transport created from a DSN, end to
//! end: dispatch, send, receive, handle, acknowledge.

mod common;

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoi_core::transport::{Browse, Teardown, Transport};
use envoi_core::worker::{StopReason, Worker};
use envoi_core::{Command, Message, Messenger};
use envoi_redis::RedisTransportFactory;
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

/// A messenger sending [`ShipOrder`]s to the Redis stream of `name` (made
/// from a DSN, with a 5 s lease, set up) and recording the ids it handles;
/// with `failed` as its failure transport when given.
async fn shipping(
    url: &str,
    name: &str,
    failed: Option<Arc<dyn Transport>>,
) -> (Messenger, Arc<dyn Transport>, Arc<Mutex<Vec<u32>>>) {
    let separator = if url.contains('?') { '&' } else { '?' };
    let dsn = format!("{url}{separator}stream={}{name}&lease=5s", common::PREFIX);
    let seen = Arc::new(Mutex::new(Vec::<u32>::new()));
    let handler_seen = Arc::clone(&seen);
    let mut builder = Messenger::builder()
        .command_handler(move |order: ShipOrder| {
            let seen = Arc::clone(&handler_seen);
            async move {
                seen.lock().unwrap().push(order.id);
                Ok::<_, Infallible>(())
            }
        })
        .transport_factory(RedisTransportFactory)
        .transport_dsn("orders", dsn)
        .route::<ShipOrder>("orders");
    if let Some(failed) = failed {
        builder = builder
            .transport("failed", failed)
            .failure_transport("failed");
    }
    let messenger = builder
        .build_async()
        .await
        .expect("the messenger builds from a redis DSN");
    let transport = Arc::clone(messenger.transport("orders").expect("registered"));
    transport
        .as_setup()
        .expect("a redis transport is set up")
        .setup()
        .await
        .expect("setup");
    (messenger, transport, seen)
}

/// How many messages `transport` holds.
async fn count(transport: &dyn Transport) -> u64 {
    transport
        .as_message_count()
        .expect("a redis transport counts")
        .message_count()
        .await
        .unwrap()
}

async fn the_worker_handles_every_message_sent_through_a_redis_dsn(url: String) {
    const N: u32 = 200;
    let name = common::unique("worker");
    let (messenger, transport, seen) = shipping(&url, &name, None).await;

    for id in 0..N {
        messenger
            .dispatcher()
            .dispatch(ShipOrder { id })
            .await
            .expect("dispatch sends to redis");
    }
    assert_eq!(count(&*transport).await, u64::from(N));

    let worker = Worker::builder(&messenger)
        .receiver("orders")
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
    assert_eq!(count(&*transport).await, 0);
    assert!(transport
        .as_browse()
        .expect("browsable")
        .list(10)
        .await
        .unwrap()
        .is_empty());
    common::transport(&url, &name, "")
        .await
        .delete()
        .await
        .unwrap();
}

async fn an_entry_with_its_type_field_given_twice_is_parked_with_the_reason(url: String) {
    let name = common::unique("twice");
    let failed = Arc::new(envoi_core::transport::in_memory::InMemoryTransport::new());
    let (messenger, transport, seen) = shipping(&url, &name, Some(failed.clone())).await;

    // A foreign producer writes `type` twice: which one it meant is
    // anyone's guess.
    let mut c = common::raw(&url).await;
    let _: String = redis::cmd("XADD")
        .arg(format!("{}{name}", common::PREFIX))
        .arg("*")
        .arg("type")
        .arg("ShipOrder")
        .arg("type")
        .arg("ShipOrder")
        .arg("body")
        .arg(r#"{"id":7}"#)
        .query_async(&mut c)
        .await
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(ShipOrder { id: 1 })
        .await
        .expect("dispatch sends to redis");

    let worker = Worker::builder(&messenger)
        .receiver("orders")
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
    assert_eq!((report.stats.handled, report.stats.failed), (1, 1));
    assert_eq!(
        *seen.lock().unwrap(),
        [1],
        "only the good message is handled"
    );
    assert_eq!(count(&*transport).await, 0);

    let parked = failed.list(10).await.unwrap();
    assert_eq!(parked.len(), 1, "the entry is parked, not lost");
    assert_eq!(parked[0].raw.body, br#"{"id":7}"#);
    // The error-details stamp, as the JSON array the wire holds.
    let details = parked[0]
        .raw
        .header("X-Message-Stamp-ErrorDetails")
        .expect("an error-details stamp");
    assert!(
        details.contains(r#""kind":"decode:invalid_header""#),
        "{details}"
    );
    assert!(
        details.contains("fields or headers given more than once: `type`"),
        "{details}"
    );
    common::transport(&url, &name, "")
        .await
        .delete()
        .await
        .unwrap();
}

envoi_transport_tests::broker_tests! {
    needs = common::url, tests = [
        the_worker_handles_every_message_sent_through_a_redis_dsn,
        an_entry_with_its_type_field_given_twice_is_parked_with_the_reason,
    ];
}
