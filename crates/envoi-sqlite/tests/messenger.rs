//! The SQLite transport behind a messenger and a worker: commands routed to
//! it by DSN are stored, consumed, retried through delays and parked in a
//! failure transport in the same database.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoi_core::failure::MultiplierRetryStrategy;
use envoi_core::middleware::dedup::{DedupClaim, DedupStore, Deduplicate, InMemoryDedupStore};
use envoi_core::stamp::{SentStamp, TransportMessageIdStamp};
use envoi_core::testing::Abilities;
use envoi_core::worker::{StopReason, Worker};
use envoi_core::{Command, Envelope, Message, Messenger};
use envoi_sqlite::SqliteTransportFactory;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Charge {
    order: u32,
}
impl Message for Charge {
    const NAME: &'static str = "Charge";
}

#[derive(Debug, thiserror::Error)]
#[error("payment gateway unavailable")]
struct GatewayDown;

impl Command for Charge {
    type Output = ();
    type Error = GatewayDown;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_sent_to_sqlite_are_handled_retried_and_parked_by_a_worker() {
    const ORDERS: u32 = 300;
    let path = std::env::temp_dir()
        .join("envoi-sqlite-tests")
        .join(format!("messenger-{}.db", uuid::Uuid::new_v4().simple()));
    let dsn = format!("sqlite://{}?lease=5s", path.display());

    // Orders divisible by 50 fail once then succeed; order 7 always fails.
    let attempts: Arc<Mutex<BTreeMap<u32, u32>>> = Arc::default();
    let handled = Arc::new(AtomicU32::new(0));
    let (seen, done) = (attempts.clone(), handled.clone());
    let messenger = Messenger::builder()
        .command_handler(move |c: Charge| {
            let (seen, done) = (seen.clone(), done.clone());
            async move {
                let n = {
                    let mut seen = seen.lock().unwrap();
                    let n = seen.entry(c.order).or_default();
                    *n += 1;
                    *n
                };
                if c.order == 7 || (c.order.is_multiple_of(50) && n == 1) {
                    return Err(GatewayDown);
                }
                done.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        })
        .transport_factory(SqliteTransportFactory)
        .transport_dsn("orders", dsn.as_str())
        .transport_dsn("failed", dsn.as_str())
        .route::<Charge>("orders")
        .default_retry_strategy(MultiplierRetryStrategy {
            max_retries: 2,
            delay: Duration::from_millis(50),
            jitter: 0.0,
            ..Default::default()
        })
        .failure_transport("failed")
        .build_async()
        .await
        .expect("messenger");

    for order in 0..ORDERS {
        let sent = messenger
            .bus()
            .dispatch(Envelope::new(Charge { order }))
            .await
            .expect("dispatch");
        assert_eq!(sent.last::<SentStamp>().expect("sent").transport, "orders");
        assert!(sent.has::<TransportMessageIdStamp>());
    }
    let orders = messenger.transport("orders").expect("orders transport");
    assert_eq!(
        orders.counter().message_count().await.expect("count"),
        u64::from(ORDERS)
    );

    let worker = Worker::builder(&messenger)
        .receiver("orders")
        .concurrency(4)
        .stop_when_empty()
        .idle_sleep(Duration::from_millis(20))
        .build()
        .expect("worker");
    let report = tokio::time::timeout(Duration::from_secs(60), worker.run())
        .await
        .expect("timed out after 60 s waiting for the worker to empty the queue");
    assert_eq!(report.reason, StopReason::Empty);
    // Every order but 7 handled once; 0, 50, …, 250 retried once; 7 retried
    // twice, then parked.
    assert_eq!(handled.load(Ordering::SeqCst), ORDERS - 1);
    assert_eq!(report.stats.handled, u64::from(ORDERS - 1));
    assert_eq!(report.stats.retried, 6 + 2);
    assert_eq!(report.stats.failed, 1);
    assert_eq!(attempts.lock().unwrap()[&7], 3);
    assert_eq!(orders.counter().message_count().await.expect("count"), 0);

    let failed = messenger.transport("failed").expect("failure transport");
    let parked = failed.browser().list(10).await.expect("list");
    assert_eq!(parked.len(), 1, "one message parked");
    assert!(
        String::from_utf8_lossy(&parked[0].raw.body).contains("\"order\":7"),
        "the parked message is order 7"
    );
    assert_eq!(parked[0].raw.header("type"), Some("Charge"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deduplicated_message_whose_worker_died_is_handled_when_its_lease_runs_out() {
    let path = std::env::temp_dir()
        .join("envoi-sqlite-tests")
        .join(format!("dead-dedup-{}.db", uuid::Uuid::new_v4().simple()));
    // A lease far shorter than the processing timeout (20 s): without the
    // redelivery mark, the dead worker's claim would make the message a
    // duplicate.
    let dsn = format!("sqlite://{}?lease=1s&poll=20ms", path.display());
    let store = Arc::new(InMemoryDedupStore::new());
    let handled = Arc::new(AtomicU32::new(0));
    let done = handled.clone();
    let messenger = Messenger::builder()
        .command_handler(move |_: Charge| {
            let done = done.clone();
            async move {
                done.fetch_add(1, Ordering::SeqCst);
                Ok::<_, GatewayDown>(())
            }
        })
        .transport_factory(SqliteTransportFactory)
        .transport_dsn("orders", dsn.as_str())
        .route::<Charge>("orders")
        .middleware(
            Deduplicate::new(Duration::from_secs(3600))
                .key(|c: &Charge| c.order.to_string())
                .store_arc(store.clone()),
        )
        .build_async()
        .await
        .expect("messenger");
    messenger
        .bus()
        .dispatch(Envelope::new(Charge { order: 1 }))
        .await
        .expect("dispatch");
    // A worker took the message, claimed its key and died.
    let orders = messenger.transport("orders").expect("orders transport");
    let taken = orders.receiver().get(1).await.expect("get");
    assert_eq!(taken.len(), 1);
    assert!(store
        .insert(
            "Charge:1",
            Duration::from_secs(20),
            DedupClaim::new(uuid::Uuid::new_v4())
        )
        .await
        .expect("claim"));

    let report = Worker::builder(&messenger)
        .receiver("orders")
        .message_limit(1)
        .time_limit(Duration::from_secs(20))
        .idle_sleep(Duration::from_millis(20))
        .build()
        .expect("worker")
        .run()
        .await;
    assert_eq!(report.reason, StopReason::MessageLimit, "{report:?}");
    assert_eq!(
        handled.load(Ordering::SeqCst),
        1,
        "the redelivery is handled, not taken for a duplicate"
    );
    assert_eq!(orders.counter().message_count().await.expect("count"), 0);
}
