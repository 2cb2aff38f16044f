//! A message larger than the receiving side's limit, written straight into
//! the queue (as another producer could), is parked with the reason, not
//! handled, on every transport; the message beside it is handled.
//!
//! Broker cases read `ENVOI_POSTGRES_URL`, `ENVOI_REDIS_URL`,
//! `ENVOI_AMQP_URL` and `ENVOI_NATS_URL`; without one, that case is
//! reported as ignored, with the reason (or fails, with
//! `ENVOI_REQUIRE_BROKERS=1`). The SQLite case always runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoi::stamp::ErrorDetailsStamp;
use envoi::transport::RawMessage;
use envoi::worker::Worker;
use envoi::{Message, Messenger, MessengerBuilderExt};
use envoi_drill::{unique_name, Job};

/// The receiving side's limit in these tests.
const LIMIT: usize = 64 * 1024;

fn unique(tag: &str) -> String {
    unique_name(&format!("big_{tag}"))
}

fn raw_job(id: u64, padding: usize) -> RawMessage {
    let mut raw = RawMessage::default();
    raw.headers.insert("type", Job::NAME);
    raw.body = format!(r#"{{"id":{id},"note":"{}"}}"#, "x".repeat(padding)).into_bytes();
    raw
}

/// Writes a 512 KiB job and a small one straight into `queue` (at
/// `queue_dsn`), runs a worker with a 64 KiB receive limit until the queue
/// is empty, and checks that the small one was handled and the big one
/// parked in `failed` (at `failed_dsn`) with the limit as its reason.
async fn oversized_is_parked(queue_dsn: &str, failed_dsn: &str, tag: &str) {
    let queue = unique(tag);
    let failed = format!("{queue}_failed");
    let handled = Arc::new(AtomicU64::new(0));
    let seen = handled.clone();
    let messenger = Messenger::builder()
        .with_transport_factories()
        .max_body_size(LIMIT)
        .event_handler(move |job: Job| {
            let seen = seen.clone();
            async move {
                seen.fetch_add(job.id, Ordering::Relaxed);
                Ok::<_, std::io::Error>(())
            }
        })
        .transport_dsn(queue.clone(), queue_dsn)
        .transport_dsn(failed.clone(), failed_dsn)
        .route::<Job>(queue.clone())
        .failure_transport(failed.clone())
        .build_async()
        .await
        .unwrap();
    for (name, result) in messenger.setup_transports().await {
        result.unwrap_or_else(|e| panic!("setting up `{name}` failed: {e}"));
    }
    let sender = messenger.transport(&queue).unwrap();
    sender.send(raw_job(1, 512 * 1024), None).await.unwrap();
    sender.send(raw_job(2, 10), None).await.unwrap();
    let run = Worker::builder(&messenger)
        .receiver(queue.clone())
        .stop_when_empty()
        .build()
        .unwrap()
        .run();
    let report = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the worker emptied the queue within 60 s");
    assert_eq!(
        handled.load(Ordering::Relaxed),
        2,
        "only the small job is handled"
    );
    assert_eq!(report.stats.handled, 1, "{:?}", report.stats);

    let parked = messenger.transport(&failed).unwrap();
    let receiver = parked.as_receiver().unwrap();
    let mut got = Vec::new();
    for _ in 0..50 {
        got.extend(receiver.get(10).await.unwrap());
        if !got.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(got.len(), 1, "the big job is parked");
    let details = got[0]
        .raw
        .header("X-Message-Stamp-ErrorDetails")
        .expect("the parked message says why");
    let details: Vec<ErrorDetailsStamp> = serde_json::from_str(details).unwrap();
    let reason = &details[0].message;
    assert!(
        reason.contains(&format!("exceeds the limit of {LIMIT} bytes")),
        "{reason}"
    );
    assert_eq!(got[0].raw.body.len(), raw_job(1, 512 * 1024).body.len());
    receiver.ack(&got[0].id).await.unwrap();
    for name in [&queue, &failed] {
        if let Some(teardown) = messenger.transport(name).and_then(|t| t.as_teardown()) {
            let _ = teardown.delete().await;
        }
    }
}

fn with(url: &str, options: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{options}")
}

async fn sqlite_parks_a_message_over_the_receive_limit() {
    let dir = tempfile::tempdir().unwrap();
    let dsn = format!("sqlite://{}/q.db", dir.path().display());
    oversized_is_parked(&dsn, &dsn, "sqlite").await;
}

async fn postgres_parks_a_message_over_the_receive_limit(url: String) {
    let queue = unique("pgq");
    let failed = unique("pgf");
    oversized_is_parked(
        &with(&url, &format!("table={queue}")),
        &with(&url, &format!("table={failed}")),
        "postgres",
    )
    .await;
}

async fn redis_parks_a_message_over_the_receive_limit(url: String) {
    oversized_is_parked(&url, &url, "redis").await;
}

async fn rabbitmq_parks_a_message_over_the_receive_limit(url: String) {
    let dsn = with(&url, "expires=10m");
    oversized_is_parked(&dsn, &dsn, "rabbitmq").await;
}

async fn nats_parks_a_message_over_the_receive_limit(url: String) {
    oversized_is_parked(&url, &url, "nats").await;
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_POSTGRES_URL", tests = [
        postgres_parks_a_message_over_the_receive_limit: current_thread,
    ];
    env = "ENVOI_REDIS_URL", tests = [
        redis_parks_a_message_over_the_receive_limit: current_thread,
    ];
    env = "ENVOI_AMQP_URL", tests = [
        rabbitmq_parks_a_message_over_the_receive_limit: current_thread,
    ];
    env = "ENVOI_NATS_URL", tests = [
        nats_parks_a_message_over_the_receive_limit: current_thread,
    ];
    tests = [
        sqlite_parks_a_message_over_the_receive_limit: current_thread,
    ];
}
