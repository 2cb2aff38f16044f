//! The broker restarts (SIGTERM, then started again on the same port and
//! store) while a worker runs: every message is still handled exactly
//! once. The acks the worker makes while the broker is away, or that die
//! with the connection, are sent again after the reconnect, within the
//! lease; lost, their messages would come back to be handled again.
//!
//! The test starts its own `nats-server` (it is reported as ignored
//! without one) and needs no `ENVOI_NATS_URL`.

mod common;

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::server::Server;
use common::{send_jobs, unique_name, with_options, Job};
use envoi_core::transport::{MessageCount, Setup, Teardown};
use envoi_core::worker::{StopReason, Worker, WorkerEvent};
use envoi_core::Messenger;
use envoi_nats::NatsTransport;

/// Messages produced.
const N: usize = 2000;
/// The broker restarts once the worker has handled this many.
const RESTART_AFTER: u64 = 600;
/// Long enough a lease for the broker to come back within it.
const OPTIONS: &str = "lease=15s&wait=100ms";

async fn a_broker_restart_mid_run_leaves_no_duplicate_and_loses_nothing(binary: PathBuf) {
    let server = Arc::new(Mutex::new(Server::start(&binary, &[])));
    let url = server.lock().unwrap().url();
    let name = unique_name("restart");
    let dsn = with_options(&url, OPTIONS);

    let producer = NatsTransport::connect(&name, &dsn).await.expect("connect");
    producer.setup().await.expect("setup");
    send_jobs(&producer, N).await;
    producer.close().await.expect("close the producer");

    let counts = Arc::new(Mutex::new(vec![0u32; N]));
    let handled = Arc::new(AtomicU64::new(0));
    let restart_due = Arc::new(tokio::sync::Notify::new());
    // Set once the broker is down: the handler that asked for the restart
    // waits for it, so that the acks of what is in flight are made while
    // the broker is away.
    let (down_tx, down_rx) = tokio::sync::watch::channel(false);
    let transport = NatsTransport::connect(&name, &dsn).await.expect("connect");
    let messenger = Messenger::builder()
        .command_handler({
            let (counts, handled, restart_due) =
                (counts.clone(), handled.clone(), restart_due.clone());
            move |job: Job| {
                let (counts, handled, restart_due) =
                    (counts.clone(), handled.clone(), restart_due.clone());
                let mut down = down_rx.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    counts.lock().unwrap()[job.id] += 1;
                    if handled.fetch_add(1, Ordering::SeqCst) + 1 == RESTART_AFTER {
                        restart_due.notify_one();
                        let _ = tokio::time::timeout(
                            Duration::from_secs(30),
                            down.wait_for(|down| *down),
                        )
                        .await;
                    }
                    Ok::<_, Infallible>(())
                }
            }
        })
        .transport("jobs", Arc::new(transport))
        .route::<Job>("jobs")
        .build()
        .expect("messenger");

    let restarting = tokio::spawn({
        let (server, handled) = (server.clone(), handled.clone());
        async move {
            restart_due.notified().await;
            let stopping = server.clone();
            tokio::task::spawn_blocking(move || stopping.lock().unwrap().stop())
                .await
                .expect("stopping the broker");
            down_tx.send_replace(true);
            // Down for a moment: the worker's fetches and acks fail.
            tokio::time::sleep(Duration::from_millis(500)).await;
            tokio::task::spawn_blocking(move || server.lock().unwrap().start_again())
                .await
                .expect("starting the broker again");
            handled.load(Ordering::SeqCst)
        }
    });
    // What failed with the transport, to tell why should a message come
    // back.
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let run = Worker::builder(&messenger)
        .listener({
            let failures = failures.clone();
            move |event: &WorkerEvent| {
                if let WorkerEvent::TransportFailed {
                    operation, error, ..
                } = event
                {
                    failures
                        .lock()
                        .unwrap()
                        .push(format!("{operation}: {error}"));
                }
            }
        })
        .receiver("jobs")
        .concurrency(8)
        .keepalive_interval(Some(Duration::from_secs(2)))
        .stop_when_empty()
        .build()
        .expect("worker")
        .run();
    let report = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .unwrap_or_else(|_| {
            let counts = counts.lock().unwrap();
            let done = counts.iter().filter(|c| **c > 0).count();
            panic!("the worker never found the stream empty ({done} of {N} ids handled)")
        });
    assert_eq!(report.reason, StopReason::Empty);
    let handled_when_back = tokio::time::timeout(Duration::from_secs(30), restarting)
        .await
        .expect("the broker restart never finished")
        .expect("the broker restart");
    assert!(
        handled_when_back < N as u64,
        "the broker came back after the run ({handled_when_back} handled by then)"
    );

    let counts = counts.lock().unwrap().clone();
    let total: u64 = counts.iter().map(|c| u64::from(*c)).sum();
    let duplicated: Vec<usize> = (0..N).filter(|id| counts[*id] > 1).collect();
    let lost: Vec<usize> = (0..N).filter(|id| counts[*id] == 0).collect();
    eprintln!(
        "broker restart: produced {N}, handled {total} ({handled_when_back} before the \
         broker was back), duplicated {}, lost {}",
        duplicated.len(),
        lost.len()
    );
    assert!(
        duplicated.is_empty(),
        "handled twice: {duplicated:?}; transport failures: {:#?}",
        failures.lock().unwrap()
    );
    assert!(lost.is_empty(), "never handled: {lost:?}");

    let check = NatsTransport::connect(&name, &dsn).await.expect("connect");
    assert_eq!(check.message_count().await.expect("count"), 0);
    check.delete().await.expect("delete the stream");
}

envoi_transport_tests::broker_tests! {
    needs = common::server::binary, tests = [
        a_broker_restart_mid_run_leaves_no_duplicate_and_loses_nothing,
    ];
}
