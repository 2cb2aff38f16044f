//! A worker stopped by SIGTERM finishes what it started and loses nothing.
//! (A test binary of its own: it signals its own process.)

#![cfg(unix)]

use envoi_core::testing::Abilities;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoi_core::transport::in_memory::InMemoryTransport;
use envoi_core::worker::{StopHandle, StopReason, Worker};
use envoi_core::{Command, Message, Messenger};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Job(u32);
impl Message for Job {
    const NAME: &'static str = "Job";
}
impl Command for Job {
    type Output = ();
    type Error = Infallible;
}

#[tokio::test]
async fn sigterm_stops_the_worker_gracefully_and_loses_nothing() {
    let done = Arc::new(Mutex::new(Vec::new()));
    let record = done.clone();
    let queue = Arc::new(InMemoryTransport::new());
    let messenger = Messenger::builder()
        .command_handler(move |job: Job| {
            let record = record.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                record.lock().unwrap().push(job.0);
                Ok::<_, Infallible>(())
            }
        })
        .transport("async", queue.clone())
        .route::<Job>("async")
        .build()
        .unwrap();
    for n in 0..100 {
        messenger.dispatcher().dispatch(Job(n)).await.unwrap();
    }
    let stop = StopHandle::new();
    stop.stop_on_signals().unwrap();
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .concurrency(4)
        .stop_handle(stop.clone())
        .build()
        .unwrap();
    let progress = worker.progress();
    let running = tokio::spawn(worker.run());
    while progress.snapshot().handled < 4 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let status = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let report = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the worker stops")
        .unwrap();
    assert_eq!(report.reason, StopReason::Stopped);
    assert!(stop.is_stopped());
    let handled = done.lock().unwrap().len() as u64;
    assert_eq!(handled, report.stats.handled);
    assert!(handled < 100, "stopped before the end");
    // Every message is either handled (and acknowledged) or waiting again.
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        100 - handled
    );
    assert_eq!(
        queue.receiver().get(100).await.unwrap().len() as u64,
        100 - handled
    );
}
