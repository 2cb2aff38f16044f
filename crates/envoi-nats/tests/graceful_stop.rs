//! A worker stopped gracefully mid-run (its stop handle: what SIGTERM
//! does), its process then ending, and a second worker run to the end:
//! every message is handled exactly once. The acknowledgements the first
//! worker made before it returned must have reached the server, or their
//! messages come back to the second worker after the lease.

mod common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{send_jobs, unique_name, with_options, Job};
use envoi_core::transport::{MessageCount, Setup, Teardown};
use envoi_core::worker::{StopHandle, StopReason, Worker, WorkerReport};
use envoi_core::Messenger;
use envoi_nats::NatsTransport;

/// Messages produced.
const N: usize = 3000;
/// The first worker is stopped once it has handled this many.
const STOP_AFTER: u64 = 1000;
/// The lease: a message whose acknowledgement was lost comes back to the
/// second worker after it.
const OPTIONS: &str = "lease=5s&wait=100ms";

/// How many times each id was handled, by either worker.
type Counts = Arc<Mutex<Vec<u32>>>;

/// A messenger on the NATS transport `name`, handling [`Job`]s into
/// `counts`; `stop` is used once `handled` reaches [`STOP_AFTER`].
async fn messenger(
    url: &str,
    name: &str,
    counts: Counts,
    handled: Arc<AtomicU64>,
    stop: Option<StopHandle>,
) -> Messenger {
    let transport = NatsTransport::connect(name, &with_options(url, OPTIONS))
        .await
        .expect("connect");
    transport.setup().await.expect("setup");
    Messenger::builder()
        .command_handler(move |job: Job| {
            let (counts, handled, stop) = (counts.clone(), handled.clone(), stop.clone());
            async move {
                // A little work, so that several messages are in flight
                // when the stop comes.
                tokio::time::sleep(Duration::from_millis(1)).await;
                counts.lock().unwrap()[job.id] += 1;
                if handled.fetch_add(1, Ordering::SeqCst) + 1 == STOP_AFTER {
                    if let Some(stop) = &stop {
                        stop.stop();
                    }
                }
                Ok::<_, Infallible>(())
            }
        })
        .transport("jobs", Arc::new(transport))
        .route::<Job>("jobs")
        .build()
        .expect("messenger")
}

/// The first worker, as a process of its own that exits once its worker
/// returns: its runtime ends then, taking every task (the NATS
/// connection's) with it. The runtime has one thread, so the connection's
/// task runs only while the worker waits: what the worker merely queued
/// on the connection after its last wait never leaves, as in a process
/// that exits before its background tasks get to run.
fn first_worker(url: String, name: String, counts: Counts) -> WorkerReport {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let report = runtime.block_on(async move {
        let stop = StopHandle::new();
        let handled = Arc::new(AtomicU64::new(0));
        let messenger = messenger(&url, &name, counts, handled, Some(stop.clone())).await;
        Worker::builder(&messenger)
            .receiver("jobs")
            .concurrency(8)
            .keepalive_interval(Some(Duration::from_secs(1)))
            .stop_handle(stop)
            .build()
            .expect("worker")
            .run()
            .await
    });
    drop(runtime);
    report
}

async fn a_worker_stopped_mid_run_leaves_no_duplicate_for_the_next_one(url: String) {
    let name = unique_name("graceful");
    let producer = NatsTransport::connect(&name, &with_options(&url, OPTIONS))
        .await
        .expect("connect");
    producer.setup().await.expect("setup");
    send_jobs(&producer, N).await;
    assert_eq!(producer.message_count().await.expect("count"), N as u64);

    let counts: Counts = Arc::new(Mutex::new(vec![0; N]));
    let first = tokio::task::spawn_blocking({
        let (url, name, counts) = (url.clone(), name.clone(), counts.clone());
        move || first_worker(url, name, counts)
    });
    let first = tokio::time::timeout(Duration::from_secs(120), first)
        .await
        .expect("the first worker never stopped (waiting for its graceful stop)")
        .expect("the first worker panicked");
    assert_eq!(first.reason, StopReason::Stopped);
    assert!(
        first.stats.handled >= STOP_AFTER && first.stats.handled < N as u64,
        "the stop came mid-run: {:?}",
        first.stats
    );

    let handled = Arc::new(AtomicU64::new(0));
    let second = messenger(&url, &name, counts.clone(), handled, None).await;
    let run = Worker::builder(&second)
        .receiver("jobs")
        .concurrency(8)
        .keepalive_interval(Some(Duration::from_secs(1)))
        .stop_when_empty()
        .build()
        .expect("worker")
        .run();
    let report = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .unwrap_or_else(|_| {
            let counts = counts.lock().unwrap();
            let done = counts.iter().filter(|c| **c > 0).count();
            panic!("the second worker never found the stream empty ({done} of {N} ids handled)")
        });
    assert_eq!(report.reason, StopReason::Empty);

    let counts = counts.lock().unwrap().clone();
    let handled: u64 = counts.iter().map(|c| u64::from(*c)).sum();
    let duplicated: Vec<usize> = (0..N).filter(|id| counts[*id] > 1).collect();
    let lost: Vec<usize> = (0..N).filter(|id| counts[*id] == 0).collect();
    eprintln!(
        "graceful stop: produced {N}, handled {handled} (first worker {}, second {}), \
         duplicated {}, lost {}",
        first.stats.handled,
        report.stats.handled,
        duplicated.len(),
        lost.len()
    );
    assert!(duplicated.is_empty(), "handled twice: {duplicated:?}");
    assert!(lost.is_empty(), "never handled: {lost:?}");
    assert_eq!(handled, N as u64);
    assert_eq!(producer.message_count().await.expect("count"), 0);
    producer.delete().await.expect("delete the stream");
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_NATS_URL", tests = [
        a_worker_stopped_mid_run_leaves_no_duplicate_for_the_next_one,
    ];
}
