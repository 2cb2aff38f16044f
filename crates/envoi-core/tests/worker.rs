//! The worker: undecodable messages, limits, graceful stop, events,
//! priorities, concurrency, rate limits, leases and panics.

use envoi_core::testing::Within;

/// The longest a test waits for a worker to stop before it fails (real
/// time, whatever the tokio clock does).
const WAIT: std::time::Duration = std::time::Duration::from_secs(120);

use envoi_core::testing::Abilities;
use envoi_core::transport::DeliveryId;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoi_core::stamp::{ErrorDetailsStamp, SentToFailureTransportStamp};
use envoi_core::transport::in_memory::{InMemoryConfig, InMemoryTransport};
use envoi_core::transport::{Payload, RawMessage, Transport};
use envoi_core::worker::{
    RateLimit, StopHandle, StopReason, Worker, WorkerError, WorkerEvent, WorkerReport,
};
use envoi_core::{Command, Envelope, Message, Messenger};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Job {
    n: u32,
}
impl Message for Job {
    const NAME: &'static str = "Job";
}

#[derive(Debug, thiserror::Error)]
#[error("job failed")]
struct JobFailed;

impl Command for Job {
    type Output = ();
    type Error = JobFailed;
}

fn memory() -> Arc<InMemoryTransport> {
    Arc::new(InMemoryTransport::new())
}

/// Runs `worker`; `probe` later, another consumer of `queue` must get
/// nothing (what the worker took is still leased, or acknowledged); stops
/// it `then` later and returns its report.
async fn run_while_leases_hold(
    worker: Worker,
    queue: &InMemoryTransport,
    probe: Duration,
    then: Duration,
) -> WorkerReport {
    let stop = worker.stop_handle();
    let run = tokio::spawn(worker.run());
    tokio::time::sleep(probe).await;
    let taken = queue.receiver().get(10).await.unwrap();
    assert!(
        taken.is_empty(),
        "{} handed out again at {probe:?}",
        taken.len()
    );
    tokio::time::sleep(then).await;
    stop.stop();
    run.within(WAIT, "the worker to stop").await.unwrap()
}

/// An in-memory queue whose messages stay leased for `lease`.
fn leased_queue(lease: Duration) -> Arc<InMemoryTransport> {
    let mut config = InMemoryConfig::default();
    config.lease_timeout = lease;
    Arc::new(InMemoryTransport::with_config(config))
}

/// Records the jobs handled, in order.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<u32>>>);

impl Seen {
    fn handler(&self, delay: Duration) -> impl Fn(Job) -> BoxedUnit + Send + Sync + 'static {
        let seen = self.0.clone();
        move |job: Job| {
            let seen = seen.clone();
            Box::pin(async move {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                seen.lock().unwrap().push(job.n);
                Ok(())
            })
        }
    }

    fn get(&self) -> Vec<u32> {
        self.0.lock().unwrap().clone()
    }
}

type BoxedUnit =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), JobFailed>> + Send + 'static>>;

async fn send_jobs(messenger: &Messenger, range: std::ops::Range<u32>) {
    for n in range {
        messenger.dispatcher().dispatch(Job { n }).await.unwrap();
    }
}

fn messenger_with(
    seen: &Seen,
    delay: Duration,
    transports: &[(&str, Arc<InMemoryTransport>)],
    failure: Option<&str>,
) -> Messenger {
    let mut b = Messenger::builder().command_handler(seen.handler(delay));
    for (name, t) in transports {
        b = b.transport(*name, t.clone());
    }
    b = b.route::<Job>(transports[0].0);
    if let Some(f) = failure {
        b = b.failure_transport(f);
    }
    b.build().unwrap()
}

fn raw(type_name: &str, body: &[u8]) -> RawMessage {
    RawMessage {
        body: body.to_vec(),
        headers: [
            ("type".to_string(), type_name.to_string()),
            ("X-Message-Stamp-Trace".to_string(), "[1]".to_string()),
        ]
        .into(),
    }
}

async fn drain(worker: envoi_core::worker::WorkerBuilder) -> WorkerReport {
    worker
        .stop_when_empty()
        .idle_sleep(Duration::from_millis(5))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await
}

#[tokio::test]
async fn undecodable_messages_are_parked_with_the_reason_and_the_worker_goes_on() {
    let seen = Seen::default();
    let queue = memory();
    let failed = memory();
    let messenger = Messenger::builder()
        .command_handler(seen.handler(Duration::ZERO))
        .transport("async", queue.clone())
        .transport("failed", failed.clone())
        .route::<Job>("async")
        .failure_transport("failed")
        .max_body_size(64)
        .max_headers_size(256)
        .build()
        .unwrap();
    send_jobs(&messenger, 0..1).await;
    queue.send(raw("Unknown", b"{}"), None).await.unwrap();
    queue.send(raw("Job", b"{\"n\": oops"), None).await.unwrap();
    queue.send(raw("Job", &[b' '; 100]), None).await.unwrap();
    let mut big_headers = raw("Job", b"{\"n\": 7}");
    big_headers.headers.insert("X-Big", "b".repeat(300));
    queue.send(big_headers, None).await.unwrap();
    send_jobs(&messenger, 1..2).await;

    let report = drain(Worker::builder(&messenger).receiver("async")).await;
    assert_eq!(
        seen.get(),
        [0, 1],
        "the good messages around them were handled"
    );
    assert_eq!((report.stats.handled, report.stats.failed), (2, 4));
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);

    let parked = failed.browser().list(10).await.unwrap();
    assert_eq!(parked.len(), 4, "nothing lost");
    let kinds: Vec<String> = parked
        .iter()
        .map(|d| {
            let details: Vec<ErrorDetailsStamp> =
                serde_json::from_str(d.raw.header("X-Message-Stamp-ErrorDetails").unwrap())
                    .unwrap();
            details[0].kind.clone()
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "decode:unknown_type",
            "decode:malformed",
            "decode:too_large",
            "decode:headers_too_large"
        ]
    );
    let details: Vec<ErrorDetailsStamp> = serde_json::from_str(
        parked[3]
            .raw
            .header("X-Message-Stamp-ErrorDetails")
            .unwrap(),
    )
    .unwrap();
    assert!(
        details[0].message.contains("exceed the limit of 256 bytes"),
        "{}",
        details[0].message
    );
    assert_eq!(parked[3].raw.header("X-Big").unwrap().len(), 300);
    // Kept as they were, plus the stamps saying where they came from.
    assert_eq!(parked[0].raw.body, b"{}");
    assert_eq!(parked[0].raw.header("X-Message-Stamp-Trace"), Some("[1]"));
    let origin: Vec<SentToFailureTransportStamp> = serde_json::from_str(
        parked[0]
            .raw
            .header("X-Message-Stamp-SentToFailureTransport")
            .unwrap(),
    )
    .unwrap();
    assert_eq!(origin[0].original_transport, "async");
}

#[tokio::test]
async fn without_a_failure_transport_an_undecodable_message_is_rejected_with_an_event() {
    let seen = Seen::default();
    let queue = memory();
    let messenger = messenger_with(&seen, Duration::ZERO, &[("async", queue.clone())], None);
    queue.send(raw("Unknown", b"{}"), None).await.unwrap();
    let events = Arc::new(Mutex::new(Vec::new()));
    let log = events.clone();
    let report = drain(Worker::builder(&messenger).receiver("async").listener(
        move |e: &WorkerEvent| {
            if let WorkerEvent::Failed {
                kind,
                parked_in,
                message,
                ..
            } = e
            {
                log.lock().unwrap().push((
                    message.to_string(),
                    kind.to_string(),
                    parked_in.clone(),
                ));
            }
        },
    ))
    .await;
    assert_eq!(report.stats.failed, 1);
    assert_eq!(queue.rejected(), 1);
    assert_eq!(
        *events.lock().unwrap(),
        [(
            "Unknown".to_string(),
            "decode:unknown_type".to_string(),
            None
        )]
    );
}

#[tokio::test]
async fn the_message_limit_stops_the_worker_and_leaves_the_rest() {
    let seen = Seen::default();
    let queue = memory();
    let messenger = messenger_with(&seen, Duration::ZERO, &[("async", queue.clone())], None);
    send_jobs(&messenger, 0..10).await;
    let report = Worker::builder(&messenger)
        .receiver("async")
        .message_limit(3)
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::MessageLimit);
    assert_eq!(seen.get(), [0, 1, 2]);
    assert_eq!(queue.counter().message_count().await.unwrap(), 7);
    assert_eq!(
        queue.receiver().get(10).await.unwrap().len(),
        7,
        "none left leased"
    );
}

#[tokio::test]
async fn the_message_limit_counts_failed_messages_too() {
    let seen = Seen::default();
    let queue = memory();
    let messenger = messenger_with(&seen, Duration::ZERO, &[("async", queue.clone())], None);
    for _ in 0..2 {
        queue.send(raw("Unknown", b"{}"), None).await.unwrap();
    }
    send_jobs(&messenger, 0..5).await;
    let report = Worker::builder(&messenger)
        .receiver("async")
        .message_limit(3)
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::MessageLimit);
    assert_eq!((report.stats.failed, report.stats.handled), (2, 1));
    assert_eq!(seen.get(), [0]);
    assert_eq!(queue.counter().message_count().await.unwrap(), 4);
}

#[tokio::test]
async fn durations_too_long_for_a_clock_mean_no_limit_rather_than_a_panic() {
    let seen = Seen::default();
    let queue = memory();
    let messenger = messenger_with(&seen, Duration::ZERO, &[("async", queue.clone())], None);
    send_jobs(&messenger, 0..3).await;
    let report = Worker::builder(&messenger)
        .receiver("async")
        .message_limit(1)
        .time_limit(Duration::MAX)
        .keepalive_interval(Some(Duration::MAX))
        .grace_period(Duration::MAX)
        .idle_sleep(Duration::MAX)
        .rate_limit("async", RateLimit::new(1, Duration::MAX))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::MessageLimit);
    assert_eq!(seen.get(), [0]);

    // One message per "forever": a second worker takes one, then waits
    // (within a time limit too long to reach) until asked to stop.
    let stop = StopHandle::new();
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .time_limit(Duration::from_secs(u64::MAX / 2))
        .rate_limit("async", RateLimit::new(1, Duration::MAX))
        .stop_handle(stop.clone())
        .build()
        .unwrap();
    let run = tokio::spawn(worker.run());
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop.stop();
    let report = run.within(WAIT, "the worker to stop").await.unwrap();
    assert_eq!(report.reason, StopReason::Stopped);
    assert_eq!(seen.get(), [0, 1]);
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        1,
        "nothing lost"
    );
}

#[tokio::test(start_paused = true)]
async fn the_time_limit_stops_an_idle_worker() {
    let seen = Seen::default();
    let messenger = messenger_with(&seen, Duration::ZERO, &[("async", memory())], None);
    let start = Instant::now();
    let report = Worker::builder(&messenger)
        .receiver("async")
        .time_limit(Duration::from_secs(3))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::TimeLimit);
    let took = start.elapsed();
    assert!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(4),
        "{took:?}"
    );
}

#[tokio::test]
async fn the_failure_limit_stops_the_worker() {
    let queue = memory();
    let messenger = Messenger::builder()
        .command_handler(|_: Job| async { Err::<(), _>(JobFailed) })
        .transport("async", queue.clone())
        .route::<Job>("async")
        .default_retry_strategy(envoi_core::failure::MultiplierRetryStrategy {
            max_retries: 0,
            ..Default::default()
        })
        .build()
        .unwrap();
    send_jobs(&messenger, 0..5).await;
    let report = Worker::builder(&messenger)
        .receiver("async")
        .failure_limit(2)
        .batch_size(1)
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::FailureLimit);
    assert_eq!(report.stats.failed, 2);
    assert_eq!(queue.counter().message_count().await.unwrap(), 3);
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_memory_limit_stops_the_worker() {
    let seen = Seen::default();
    let messenger = messenger_with(&seen, Duration::ZERO, &[("async", memory())], None);
    let report = Worker::builder(&messenger)
        .receiver("async")
        .memory_limit(1024)
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::MemoryLimit);
}

#[tokio::test]
async fn a_graceful_stop_lets_handlers_finish_and_releases_the_rest() {
    let seen = Seen::default();
    let queue = memory();
    let messenger = messenger_with(
        &seen,
        Duration::from_millis(30),
        &[("async", queue.clone())],
        None,
    );
    send_jobs(&messenger, 0..40).await;
    let stop = StopHandle::new();
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .concurrency(4)
        .batch_size(8)
        .stop_handle(stop.clone())
        .grace_period(Duration::from_secs(30))
        .build()
        .unwrap();
    let progress = worker.progress();
    let running = tokio::spawn(worker.run());
    while progress.snapshot().handled < 6 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.stop();
    let report = running.within(WAIT, "the worker to stop").await.unwrap();
    assert_eq!(report.reason, StopReason::Stopped);
    let first = seen.get();
    assert_eq!(first.len() as u64, report.stats.handled);
    assert!(report.stats.released > 0, "{report:?}");
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        40 - report.stats.handled,
        "handled ones acknowledged, the rest waiting"
    );
    // Nothing is leased any more: a second worker gets every remaining one.
    drain(Worker::builder(&messenger).receiver("async").concurrency(8)).await;
    let mut all = seen.get();
    all.sort_unstable();
    assert_eq!(all, (0..40).collect::<Vec<_>>(), "each exactly once");
}

/// Three jobs whose handlers take an hour, and a worker handling two at a
/// time with `grace`, once both handlers have started: its queue, its stop
/// handle and its run.
async fn two_hour_long_handlers_running(
    grace: Duration,
) -> (
    Arc<InMemoryTransport>,
    StopHandle,
    tokio::task::JoinHandle<WorkerReport>,
) {
    let seen = Seen::default();
    let queue = memory();
    let messenger = messenger_with(
        &seen,
        Duration::from_secs(3600),
        &[("async", queue.clone())],
        None,
    );
    send_jobs(&messenger, 0..3).await;
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .concurrency(2)
        .grace_period(grace)
        .build()
        .unwrap();
    let stop = worker.stop_handle();
    let mut events = worker.subscribe();
    let running = tokio::spawn(worker.run());
    // Wait until both handlers started.
    let mut started = 0;
    while started < 2 {
        if let WorkerEvent::Received { .. } = events.recv().await.unwrap() {
            started += 1;
        }
    }
    (queue, stop, running)
}

#[tokio::test]
async fn handlers_still_running_after_the_grace_period_are_released_not_lost() {
    let (queue, stop, running) = two_hour_long_handlers_running(Duration::from_millis(20)).await;
    stop.stop();
    let report = running.within(WAIT, "the worker to stop").await.unwrap();
    assert_eq!(report.stats.handled, 0);
    assert_eq!(report.stats.released, 3);
    assert_eq!(
        queue.receiver().get(10).await.unwrap().len(),
        3,
        "all available again"
    );
}

#[tokio::test]
async fn stop_now_cuts_the_grace_period_short_and_releases_what_is_in_flight() {
    let (queue, stop, running) = two_hour_long_handlers_running(Duration::from_secs(3600)).await;
    // A graceful stop waits for the handlers, for up to an hour…
    stop.stop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!running.is_finished(), "a graceful stop waits");
    // …unless asked again to stop, at once (a second Ctrl-C).
    stop.stop_now();
    let report = tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .expect("stopped at once")
        .unwrap();
    assert_eq!(report.reason, StopReason::Stopped);
    assert_eq!(report.stats.handled, 0);
    assert_eq!(report.stats.released, 3);
    assert_eq!(
        queue.receiver().get(10).await.unwrap().len(),
        3,
        "all available again"
    );
}

#[tokio::test]
async fn events_tell_the_whole_story() {
    let queue = memory();
    let failed = memory();
    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let messenger = Messenger::builder()
        .command_handler(move |job: Job| {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                match job.n {
                    // Fails once, then succeeds.
                    1 if n < 2 => Err(JobFailed),
                    // Always fails.
                    2 => Err(JobFailed),
                    _ => Ok(()),
                }
            }
        })
        .transport("async", queue.clone())
        .transport("failed", failed.clone())
        .route::<Job>("async")
        .failure_transport("failed")
        .default_retry_strategy(envoi_core::failure::MultiplierRetryStrategy {
            max_retries: 1,
            delay: Duration::from_millis(1),
            jitter: 0.0,
            ..Default::default()
        })
        .build()
        .unwrap();
    send_jobs(&messenger, 0..3).await;
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .stop_when_empty()
        .idle_sleep(Duration::from_millis(5))
        .build()
        .unwrap();
    let mut rx = worker.subscribe();
    let report = worker.run().within(WAIT, "the worker to stop").await;
    let mut names = Vec::new();
    let mut per_job: BTreeMap<u32, Vec<&'static str>> = BTreeMap::new();
    while let Ok(e) = rx.try_recv() {
        let (name, envelope) = match &e {
            WorkerEvent::Started { transports } => {
                assert_eq!(transports, &["async"]);
                ("started", None)
            }
            WorkerEvent::Received { .. } => ("received", None),
            WorkerEvent::Handled { envelope, .. } => ("handled", Some(envelope.clone())),
            WorkerEvent::Retried {
                envelope,
                retry_count,
                ..
            } => {
                assert_eq!(*retry_count, 1);
                ("retried", Some(envelope.clone()))
            }
            WorkerEvent::Failed {
                envelope,
                parked_in,
                ..
            } => {
                assert_eq!(parked_in.as_deref(), Some("failed"));
                ("failed", envelope.clone())
            }
            WorkerEvent::Stopped { report: r } => {
                assert_eq!(r, &report);
                ("stopped", None)
            }
            other => panic!("unexpected event {other:?}"),
        };
        names.push(name);
        if let Some(e) = envelope {
            per_job
                .entry(e.message::<Job>().unwrap().n)
                .or_default()
                .push(name);
        }
    }
    assert_eq!(names.first(), Some(&"started"));
    assert_eq!(names.last(), Some(&"stopped"));
    assert_eq!(names.iter().filter(|n| **n == "received").count(), 5);
    assert_eq!(per_job[&0], ["handled"]);
    assert_eq!(per_job[&1], ["retried", "handled"]);
    assert_eq!(per_job[&2], ["retried", "failed"]);
    assert_eq!(
        (
            report.stats.handled,
            report.stats.retried,
            report.stats.failed
        ),
        (2, 2, 1)
    );
}

/// A messenger with two in-memory transports, `high` and `low`, whose
/// handler records into `seen`.
fn high_and_low(seen: &Seen) -> (Messenger, Arc<InMemoryTransport>, Arc<InMemoryTransport>) {
    let (high, low) = (memory(), memory());
    let messenger = Messenger::builder()
        .command_handler(seen.handler(Duration::ZERO))
        .transport("high", high.clone())
        .transport("low", low.clone())
        .build()
        .unwrap();
    (messenger, high, low)
}

#[tokio::test]
async fn receivers_are_read_in_priority_order() {
    let seen = Seen::default();
    let (messenger, high, low) = high_and_low(&seen);
    let sender = |t: &Arc<InMemoryTransport>, n: u32| {
        let t = t.clone();
        let e = Envelope::new(Job { n });
        async move {
            envoi_core::transport::LocalSender::send_envelope(&*t, e)
                .await
                .unwrap();
        }
    };
    for n in 0..5 {
        sender(&low, 100 + n).await;
        sender(&high, n).await;
    }
    drain(
        Worker::builder(&messenger)
            .receivers(["high", "low"])
            .batch_size(2),
    )
    .await;
    assert_eq!(seen.get(), [0, 1, 2, 3, 4, 100, 101, 102, 103, 104]);
}

#[tokio::test]
async fn a_lower_receiver_is_read_while_a_higher_one_is_held_back_by_its_rate_limit() {
    let seen = Seen::default();
    let (messenger, high, low) = high_and_low(&seen);
    for n in 0..3 {
        envoi_core::transport::LocalSender::send_envelope(&*high, Envelope::new(Job { n }))
            .await
            .unwrap();
        envoi_core::transport::LocalSender::send_envelope(&*low, Envelope::new(Job { n: 100 + n }))
            .await
            .unwrap();
    }
    let report = Worker::builder(&messenger)
        .receivers(["high", "low"])
        .rate_limit("high", RateLimit::new(1, Duration::from_secs(3600)))
        .message_limit(4)
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::MessageLimit);
    assert_eq!(seen.get(), [0, 100, 101, 102]);
    assert_eq!(high.counter().message_count().await.unwrap(), 2);
}

#[tokio::test]
async fn no_more_handlers_run_at_once_than_the_concurrency() {
    let current = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (c, p) = (current.clone(), peak.clone());
    let messenger = Messenger::builder()
        .command_handler(move |_: Job| {
            let (c, p) = (c.clone(), p.clone());
            async move {
                let now = c.fetch_add(1, Ordering::SeqCst) + 1;
                p.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                c.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, JobFailed>(())
            }
        })
        .transport("async", memory())
        .route::<Job>("async")
        .build()
        .unwrap();
    send_jobs(&messenger, 0..24).await;
    let report = drain(Worker::builder(&messenger).receiver("async").concurrency(3)).await;
    assert_eq!(report.stats.handled, 24);
    assert_eq!(peak.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn a_rate_limit_spreads_the_messages_over_time() {
    let seen = Seen::default();
    let messenger = messenger_with(&seen, Duration::ZERO, &[("async", memory())], None);
    send_jobs(&messenger, 0..15).await;
    let start = Instant::now();
    let report = drain(
        Worker::builder(&messenger)
            .receiver("async")
            .rate_limit("async", RateLimit::per_second(5)),
    )
    .await;
    let took = start.elapsed();
    assert_eq!(report.stats.handled, 15);
    // Five at once, then one every 200 ms.
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_millis(2600),
        "{took:?}"
    );
}

#[tokio::test]
async fn a_message_held_by_a_worker_that_died_is_redelivered_after_its_lease() {
    let queue = leased_queue(Duration::from_millis(1000));
    let stuck = Arc::new(AtomicBool::new(true));
    let seen = Seen::default();
    let (s, record) = (stuck.clone(), seen.0.clone());
    let messenger = Messenger::builder()
        .command_handler(move |job: Job| {
            let (s, record) = (s.clone(), record.clone());
            async move {
                if s.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                record.lock().unwrap().push(job.n);
                Ok::<_, JobFailed>(())
            }
        })
        .transport("async", queue.clone())
        .route::<Job>("async")
        .build()
        .unwrap();
    send_jobs(&messenger, 0..3).await;
    // A worker that takes everything and then dies without a word.
    let dying = Worker::builder(&messenger)
        .receiver("async")
        .concurrency(3)
        .keepalive_interval(None)
        .build()
        .unwrap();
    let progress = dying.progress();
    tokio::select! {
        _ = dying.run() => panic!("the stuck worker cannot finish"),
        _ = async {
            while progress.snapshot().received < 3 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        } => {}
    }
    assert!(
        queue.receiver().get(10).await.unwrap().is_empty(),
        "still leased"
    );
    stuck.store(false, Ordering::SeqCst);
    drain(Worker::builder(&messenger).receiver("async")).await;
    let mut got = seen.get();
    got.sort_unstable();
    assert_eq!(got, [0, 1, 2]);
}

#[tokio::test]
async fn keepalive_stops_a_slow_handler_s_message_from_being_redelivered() {
    let queue = leased_queue(Duration::from_millis(500));
    let seen = Seen::default();
    let messenger = messenger_with(
        &seen,
        Duration::from_millis(1500),
        &[("async", queue.clone())],
        None,
    );
    send_jobs(&messenger, 0..1).await;
    let worker = |name: &str| {
        let _ = name;
        Worker::builder(&messenger)
            .receiver("async")
            .keepalive_interval(Some(Duration::from_millis(25)))
            .time_limit(Duration::from_millis(2200))
            .idle_sleep(Duration::from_millis(10))
            .build()
            .unwrap()
            .run()
    };
    let (a, b) = tokio::join!(worker("a"), worker("b"));
    assert_eq!(a.stats.received + b.stats.received, 1);
    assert_eq!(seen.get(), [0]);
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_message_held_half_an_interval_is_extended_at_the_next_keepalive_tick() {
    // Ticks every second from the start; the message is fetched at 0.4 s
    // with a lease of 1.2 s, so it must be extended at the first tick
    // (held 0.6 s), not only at the second (by then 0.4 s too late).
    let queue = leased_queue(Duration::from_millis(1200));
    let seen = Seen::default();
    let messenger = messenger_with(
        &seen,
        Duration::from_secs(3),
        &[("async", queue.clone())],
        None,
    );
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .keepalive_interval(Some(Duration::from_secs(1)))
        .idle_sleep(Duration::from_millis(10))
        .build()
        .unwrap();
    let stop = worker.stop_handle();
    let run = tokio::spawn(worker.run());
    tokio::time::sleep(Duration::from_millis(400)).await;
    send_jobs(&messenger, 0..1).await;
    tokio::time::sleep(Duration::from_millis(1400)).await;
    let taken = queue.receiver().get(10).await.unwrap();
    assert!(taken.is_empty(), "the lease ran out at 1.6 s");
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.stop();
    let report = run.within(WAIT, "the worker to stop").await.unwrap();
    assert_eq!(seen.get(), [0]);
    assert_eq!(report.stats.handled, 1);
}

#[tokio::test]
async fn a_panicking_handler_is_parked_and_the_worker_goes_on() {
    let failed = memory();
    let messenger = Messenger::builder()
        .command_handler(|job: Job| async move {
            if job.n == 1 {
                panic!("handler bug on job 1");
            }
            Ok::<_, JobFailed>(())
        })
        .transport("async", memory())
        .transport("failed", failed.clone())
        .route::<Job>("async")
        .failure_transport("failed")
        .build()
        .unwrap();
    send_jobs(&messenger, 0..3).await;
    let report = drain(Worker::builder(&messenger).receiver("async")).await;
    assert_eq!((report.stats.handled, report.stats.failed), (2, 1));
    let parked = failed.stored();
    let Payload::Envelope(e) = &parked[0].payload else {
        panic!("expected an envelope")
    };
    assert_eq!(e.message::<Job>(), Some(&Job { n: 1 }));
    let details = e.last::<ErrorDetailsStamp>().unwrap();
    assert_eq!(details.kind, "panic");
    assert_eq!(details.message, "handler bug on job 1");
}

#[tokio::test]
async fn building_a_worker_checks_its_configuration() {
    let seen = Seen::default();
    let messenger = messenger_with(&seen, Duration::ZERO, &[("async", memory())], None);
    let err = |b: envoi_core::worker::WorkerBuilder| b.build().unwrap_err();
    assert_eq!(err(Worker::builder(&messenger)), WorkerError::NoReceivers);
    assert_eq!(
        err(Worker::builder(&messenger).receiver("nope")),
        WorkerError::UnknownTransport("nope".into())
    );
    assert!(matches!(
        err(Worker::builder(&messenger).receiver("async").concurrency(0)),
        WorkerError::InvalidOption(_)
    ));
    assert!(matches!(
        err(Worker::builder(&messenger)
            .receiver("async")
            .rate_limit("other", RateLimit::per_second(1))),
        WorkerError::InvalidOption(_)
    ));
}

#[tokio::test]
async fn one_stop_handle_stops_several_workers() {
    let seen = Seen::default();
    let messenger = messenger_with(&seen, Duration::ZERO, &[("async", memory())], None);
    let stop = StopHandle::new();
    let worker = || {
        Worker::builder(&messenger)
            .receiver("async")
            .stop_handle(stop.clone())
            .build()
            .unwrap()
            .run()
    };
    let stopper = stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        stopper.stop();
    });
    let (a, b) = tokio::join!(worker(), worker());
    assert_eq!(
        (a.reason, b.reason),
        (StopReason::Stopped, StopReason::Stopped)
    );
}

#[tokio::test]
async fn consume_one_retries_a_parked_message_as_a_worker_would() {
    let broken = Arc::new(AtomicBool::new(true));
    let b = broken.clone();
    let queue = memory();
    let failed = memory();
    let messenger = Messenger::builder()
        .command_handler(move |_: Job| {
            let fail = b.load(Ordering::SeqCst);
            async move {
                if fail {
                    Err(JobFailed)
                } else {
                    Ok(())
                }
            }
        })
        .transport("async", queue.clone())
        .transport("failed", failed.clone())
        .route::<Job>("async")
        .failure_transport("failed")
        .default_retry_strategy(envoi_core::failure::MultiplierRetryStrategy {
            max_retries: 0,
            ..Default::default()
        })
        .build()
        .unwrap();
    send_jobs(&messenger, 0..2).await;
    drain(Worker::builder(&messenger).receiver("async")).await;
    let parked = failed.browser().list(10).await.unwrap();
    assert_eq!(parked.len(), 2);

    // Still broken: it goes back to its origin for a fresh round of retries.
    let outcome = envoi_core::worker::consume_one(&messenger, "failed", parked[0].clone())
        .await
        .unwrap();
    assert!(
        matches!(outcome, envoi_core::worker::Outcome::Failed { parked_in: Some(ref f), .. } if f == "failed"),
        "{outcome:?}"
    );
    // Fixed: handled and removed from the failure transport.
    broken.store(false, Ordering::SeqCst);
    let outcome = envoi_core::worker::consume_one(&messenger, "failed", parked[1].clone())
        .await
        .unwrap();
    assert!(matches!(outcome, envoi_core::worker::Outcome::Handled));
    assert_eq!(failed.counter().message_count().await.unwrap(), 1);
    assert!(matches!(
        envoi_core::worker::consume_one(&messenger, "nope", parked[1].clone()).await,
        Err(WorkerError::UnknownTransport(_))
    ));
}

#[tokio::test]
async fn an_undecodable_redelivery_is_parked_without_its_transports_redelivered_mark() {
    let queue = memory();
    let failed = memory();
    let messenger = Messenger::builder()
        .command_handler(|_: Job| async { Ok::<(), JobFailed>(()) })
        .transport("async", queue.clone())
        .transport("failed", failed.clone())
        .route::<Job>("async")
        .failure_transport("failed")
        .build()
        .unwrap();
    queue.send(raw("Unknown", b"{}"), None).await.unwrap();
    let got = queue
        .receiver()
        .get(1)
        .await
        .unwrap()
        .remove(0)
        .mark_redelivered();
    envoi_core::worker::consume_one(&messenger, "async", got)
        .await
        .unwrap();
    let parked = failed.browser().list(10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert!(!parked[0].redelivered, "the mark stays with its transport");
}

#[tokio::test]
async fn an_undecodable_message_retried_from_the_failure_transport_keeps_its_origin_and_waits() {
    let seen = Seen::default();
    let failed = memory();
    let messenger = messenger_with(
        &seen,
        Duration::ZERO,
        &[("async", memory()), ("failed", failed.clone())],
        Some("failed"),
    );
    let mut message = raw("Unknown", b"{}");
    message.headers.insert(
        "X-Message-Stamp-SentToFailureTransport",
        r#"[{"original_transport":"async"}]"#,
    );
    failed.send(message, None).await.unwrap();
    let report = drain(
        Worker::builder(&messenger)
            .receiver("failed")
            .message_limit(1),
    )
    .await;
    assert_eq!(report.stats.failed, 1);
    let parked = failed.browser().list(10).await.unwrap();
    assert_eq!(parked.len(), 1, "moved to the back, not lost");
    let origins: Vec<SentToFailureTransportStamp> = serde_json::from_str(
        parked[0]
            .raw
            .header("X-Message-Stamp-SentToFailureTransport")
            .unwrap(),
    )
    .unwrap();
    assert_eq!(origins.len(), 2);
    assert!(origins.iter().all(|o| o.original_transport == "async"));
    // Back in the transport it came from, for later: a worker consuming it
    // does not get it again at once.
    assert!(
        failed.receiver().get(1).await.unwrap().is_empty(),
        "not due yet"
    );
    assert_eq!(failed.counter().message_count().await.unwrap(), 1);
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Audit {
    n: u32,
}
impl Message for Audit {
    const NAME: &'static str = "Audit";
}
impl Command for Audit {
    type Output = ();
    type Error = JobFailed;
}

/// A messenger routing [`Job`] to `queue`, whose handler defers an
/// [`Audit`] (handled in process) until it has finished; with a middleware
/// that records both, when `with_middleware`.
fn deferring_messenger(queue: Arc<InMemoryTransport>, with_middleware: bool) -> (Messenger, Log) {
    let log: Log = Arc::default();
    let bus = BusSlot::default();
    let (l1, l2, slot) = (log.clone(), log.clone(), bus.0.clone());
    let mut builder = Messenger::builder()
        .command_handler(move |job: Job| {
            let (log, slot) = (l1.clone(), slot.clone());
            async move {
                let bus = slot.lock().unwrap().clone().expect("bus set");
                bus.dispatch_after_current(Envelope::new(Audit { n: job.n }))
                    .await
                    .expect("a deferred dispatch is accepted");
                log.lock().unwrap().push(format!("job {} done", job.n));
                Ok::<_, JobFailed>(())
            }
        })
        .command_handler(move |audit: Audit| {
            let log = l2.clone();
            async move {
                log.lock().unwrap().push(format!("audit {}", audit.n));
                Ok::<_, JobFailed>(())
            }
        })
        .transport("queue", queue)
        .route::<Job>("queue");
    if with_middleware {
        builder = builder.middleware(Recorder(log.clone()));
    }
    let messenger = builder.build().unwrap();
    bus.fill(&messenger);
    (messenger, log)
}

type Log = Arc<Mutex<Vec<String>>>;

/// Records the name of every message it sees.
struct Recorder(Log);

impl envoi_core::middleware::Middleware for Recorder {
    fn handle<'a>(
        &'a self,
        envelope: Envelope,
        next: envoi_core::middleware::Next<'a>,
    ) -> envoi_core::middleware::BoxFuture<'a, envoi_core::Result<Envelope>> {
        self.0
            .lock()
            .unwrap()
            .push(format!("middleware {}", envelope.message_name()));
        Box::pin(next.run(envelope))
    }
}

#[tokio::test]
async fn a_received_message_s_handler_can_defer_a_dispatch_until_it_has_finished() {
    for with_middleware in [false, true] {
        let queue = memory();
        let (messenger, log) = deferring_messenger(queue.clone(), with_middleware);
        messenger.dispatcher().dispatch(Job { n: 7 }).await.unwrap();
        log.lock().unwrap().clear();
        let report = drain(Worker::builder(&messenger).receiver("queue")).await;
        assert_eq!(report.stats.handled, 1);
        let expected: &[&str] = if with_middleware {
            &[
                "middleware Job",
                "job 7 done",
                "middleware Audit",
                "audit 7",
            ]
        } else {
            &["job 7 done", "audit 7"]
        };
        assert_eq!(
            *log.lock().unwrap(),
            expected,
            "middleware: {with_middleware}"
        );
        assert_eq!(queue.counter().message_count().await.unwrap(), 0);
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Paid;
impl Message for Paid {
    const NAME: &'static str = "Paid";
}
impl envoi_core::Event for Paid {
    type Error = JobFailed;
}

/// A messenger routing the event [`Paid`] to `async` (failure transport
/// `failed`, `retries` retries at once) with two handlers: the first
/// succeeds and defers an [`Audit`] (handled in process, counted), the
/// second fails while `failing` is set. With a pass-through middleware when
/// `with_middleware`.
fn deferring_beside_a_failure(
    retries: u32,
    failing: Arc<AtomicBool>,
    with_middleware: bool,
) -> (Messenger, Arc<AtomicUsize>, Arc<InMemoryTransport>) {
    let audits = Arc::new(AtomicUsize::new(0));
    let failed = memory();
    let (bus, counted) = (BusSlot::default(), audits.clone());
    let mut builder = Messenger::builder()
        .event_handler(bus.paid_deferring_an_audit(Arc::default()))
        .event_handler(paid_failing_while(failing))
        .command_handler(move |_: Audit| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, JobFailed>(()) }
        })
        .transport("async", memory())
        .transport("failed", failed.clone())
        .route::<Paid>("async")
        .failure_transport("failed")
        .default_retry_strategy(retrying_at_once(retries));
    if with_middleware {
        builder = builder.middleware(Recorder(Log::default()));
    }
    let messenger = builder.build().unwrap();
    bus.fill(&messenger);
    (messenger, audits, failed)
}

#[tokio::test]
async fn what_a_successful_handler_deferred_is_dispatched_once_whether_the_message_is_retried_or_parked(
) {
    // No retries: parked at once. Two retries: retried (the first handler
    // then skipped, having handled it), then parked.
    for retries in [0, 2] {
        for with_middleware in [false, true] {
            let case = format!("retries: {retries}, middleware: {with_middleware}");
            let failing = Arc::new(AtomicBool::new(true));
            let (messenger, audits, failed) =
                deferring_beside_a_failure(retries, failing.clone(), with_middleware);
            dispatch_paid(&messenger).await;
            let report = drain(Worker::builder(&messenger).receiver("async")).await;
            assert_eq!(report.stats.failed, 1, "{case}");
            assert_eq!(report.stats.retried, u64::from(retries), "{case}");
            assert_eq!(
                failed.counter().message_count().await.unwrap(),
                1,
                "parked: {case}"
            );
            assert_eq!(
                audits.load(Ordering::SeqCst),
                1,
                "the deferred audit is dispatched once the message is parked: {case}"
            );
            // Retried from the failure transport, the first handler is
            // skipped (it handled the message), so it defers nothing again.
            failing.store(false, Ordering::SeqCst);
            let report = drain(Worker::builder(&messenger).receiver("failed")).await;
            assert_eq!(report.stats.handled, 1, "{case}");
            assert_eq!(
                audits.load(Ordering::SeqCst),
                1,
                "dispatched once in all: {case}"
            );
        }
    }
}

/// A messenger routing the event [`Paid`] to `async` (failure transport
/// `failed`, `retries` retries at once; `Paid` handled in process when not
/// `routed`) with two handlers: the first succeeds, counting its runs, and
/// defers an [`Audit`]; the second fails while `failing` is set. The
/// audit's dispatch fails: when `unsent`, it is routed to `down`, a
/// transport that refuses every message until [`FailingAudit::up`] is set;
/// otherwise its in-process handler fails while `audit_failing` is set.
/// Its handler, registered unless `audit_failing` is `None`, counts the
/// audits it handles.
struct FailingAudit {
    messenger: Messenger,
    paid_runs: Arc<AtomicUsize>,
    audits: Arc<AtomicUsize>,
    queue: Arc<InMemoryTransport>,
    failed: Arc<InMemoryTransport>,
    /// What `down` holds once it takes messages.
    down: Arc<InMemoryTransport>,
    /// Whether `down` takes messages.
    up: Arc<AtomicBool>,
}

/// Why a message is refused, or `None` to send it.
type Refusal = Box<dyn Fn(&RawMessage) -> Option<&'static str> + Send + Sync>;

/// An in-memory transport whose sends `refuse` may fail first (with its
/// reason); it tells how many messages it holds only when `counted`, as a
/// broker may not.
struct Gated {
    inner: Arc<InMemoryTransport>,
    refuse: Refusal,
    counted: bool,
}

impl Gated {
    /// Refuses every message sent while `up` is not set.
    fn switchable(inner: Arc<InMemoryTransport>, up: Arc<AtomicBool>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            refuse: Box::new(move |_| (!up.load(Ordering::SeqCst)).then_some("down")),
            counted: false,
        })
    }

    /// Refuses the messages of the type `name` (a failure transport that
    /// cannot take them).
    fn refusing_type(inner: Arc<InMemoryTransport>, name: &'static str) -> Arc<Self> {
        Arc::new(Self {
            inner,
            refuse: Box::new(move |message| {
                (message.header(envoi_core::serializer::TYPE_HEADER) == Some(name))
                    .then_some("refused")
            }),
            counted: true,
        })
    }

    /// Cannot count its messages, and refuses the first `refuse` sends.
    fn uncounted(inner: Arc<InMemoryTransport>, refuse: usize) -> Arc<Self> {
        let left = AtomicUsize::new(refuse);
        Arc::new(Self {
            inner,
            refuse: Box::new(move |_| {
                left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
                    .then_some("refused")
            }),
            counted: false,
        })
    }
}

impl Transport for Gated {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> envoi_core::middleware::BoxFuture<'_, Result<String, envoi_core::TransportError>> {
        match (self.refuse)(&message) {
            Some(reason) => {
                Box::pin(async move { Err(envoi_core::TransportError::backend("sending", reason)) })
            }
            None => self.inner.send(message, delay),
        }
    }

    fn as_receiver(&self) -> Option<&dyn envoi_core::transport::Receiver> {
        self.inner.as_receiver()
    }

    fn as_message_count(&self) -> Option<&dyn envoi_core::transport::MessageCount> {
        if self.counted {
            self.inner.as_message_count()
        } else {
            None
        }
    }

    fn bind(&self, binding: &envoi_core::transport::TransportBinding) {
        self.inner.bind(binding);
    }
}

/// The messenger's bus, for the handlers registered before it is built:
/// [`BusSlot::fill`] it once the messenger is.
#[derive(Clone, Default)]
struct BusSlot(Arc<Mutex<Option<envoi_core::MessageBus>>>);

impl BusSlot {
    fn fill(&self, messenger: &Messenger) {
        *self.0.lock().unwrap() = Some(messenger.bus().clone());
    }

    /// A [`Paid`] handler that counts its runs in `runs` and defers an
    /// [`Audit`] (`n: 1`) through the bus.
    fn paid_deferring_an_audit(
        &self,
        runs: Arc<AtomicUsize>,
    ) -> impl Fn(Paid) -> envoi_core::middleware::BoxFuture<'static, Result<(), JobFailed>>
           + Send
           + Sync
           + 'static {
        let slot = self.0.clone();
        move |_: Paid| {
            let slot = slot.clone();
            runs.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let bus = slot.lock().unwrap().clone().expect("bus set");
                bus.dispatch_after_current(Envelope::new(Audit { n: 1 }))
                    .await
                    .expect("a deferred dispatch is accepted");
                Ok::<_, JobFailed>(())
            })
        }
    }
}

/// A [`Paid`] handler that fails while `failing` is set.
fn paid_failing_while(
    failing: Arc<AtomicBool>,
) -> impl Fn(Paid) -> std::future::Ready<Result<(), JobFailed>> + Send + Sync + 'static {
    move |_: Paid| {
        std::future::ready(if failing.load(Ordering::SeqCst) {
            Err(JobFailed)
        } else {
            Ok(())
        })
    }
}

/// Retries `max_retries` times, at once.
fn retrying_at_once(max_retries: u32) -> envoi_core::failure::MultiplierRetryStrategy {
    envoi_core::failure::MultiplierRetryStrategy {
        max_retries,
        delay: Duration::ZERO,
        jitter: 0.0,
        ..Default::default()
    }
}

/// Dispatches a [`Paid`] event through `messenger`'s bus.
async fn dispatch_paid(messenger: &Messenger) {
    messenger
        .bus()
        .dispatch(Envelope::event(Paid))
        .await
        .unwrap();
}

fn deferring_a_failing_audit(
    retries: u32,
    failing: Arc<AtomicBool>,
    unsent: bool,
    audit_failing: Option<Arc<AtomicBool>>,
    with_middleware: bool,
    routed: bool,
) -> FailingAudit {
    let (paid_runs, audits) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (queue, failed, down) = (memory(), memory(), memory());
    let up = Arc::new(AtomicBool::new(false));
    let (bus, counted) = (BusSlot::default(), audits.clone());
    let mut builder = Messenger::builder()
        .event_handler(bus.paid_deferring_an_audit(paid_runs.clone()))
        .event_handler(paid_failing_while(failing))
        .transport("async", queue.clone())
        .transport("down", Gated::switchable(down.clone(), up.clone()))
        .transport("failed", failed.clone())
        .failure_transport("failed")
        .default_retry_strategy(retrying_at_once(retries));
    if let Some(audit_failing) = audit_failing {
        builder = builder.command_handler(move |_: Audit| {
            let result = if audit_failing.load(Ordering::SeqCst) {
                Err(JobFailed)
            } else {
                counted.fetch_add(1, Ordering::SeqCst);
                Ok(())
            };
            async move { result }
        });
    }
    if routed {
        builder = builder.route::<Paid>("async");
    }
    if unsent {
        builder = builder.route::<Audit>("down");
    }
    if with_middleware {
        builder = builder.middleware(Recorder(Log::default()));
    }
    let messenger = builder.build().unwrap();
    bus.fill(&messenger);
    FailingAudit {
        messenger,
        paid_runs,
        audits,
        queue,
        failed,
        down,
        up,
    }
}

impl FailingAudit {
    /// Dispatches a [`Paid`] event and drains `async` with a worker;
    /// returns its report.
    async fn pay_and_drain(&self) -> WorkerReport {
        dispatch_paid(&self.messenger).await;
        drain(Worker::builder(&self.messenger).receiver("async")).await
    }

    /// Drains `down`, where an unsent audit goes once retried, with a
    /// worker that handles it; returns its report.
    async fn drain_down(&self) -> WorkerReport {
        drain(Worker::builder(&self.messenger).receiver("down")).await
    }
}

/// Drains `transport` with a worker; returns its report and the names of
/// the messages it received, sorted.
async fn drain_names(messenger: &Messenger, transport: &str) -> (WorkerReport, Vec<String>) {
    let names: Log = Log::default();
    let seen = names.clone();
    let report = drain(Worker::builder(messenger).receiver(transport).listener(
        move |e: &WorkerEvent| {
            if let WorkerEvent::Received { message, .. } = e {
                seen.lock().unwrap().push(message.to_string());
            }
        },
    ))
    .await;
    let mut names = names.lock().unwrap().clone();
    names.sort();
    (report, names)
}

#[tokio::test]
async fn a_handled_message_whose_deferred_dispatch_fails_is_acknowledged_and_only_the_failed_dispatch_is_parked(
) {
    for unsent in [true, false] {
        for with_middleware in [false, true] {
            let case = format!("unsent: {unsent}, middleware: {with_middleware}");
            let audit_failing = Arc::new(AtomicBool::new(!unsent));
            let t = deferring_a_failing_audit(
                0,
                Arc::new(AtomicBool::new(false)),
                unsent,
                Some(audit_failing.clone()),
                with_middleware,
                true,
            );
            let report = t.pay_and_drain().await;
            assert_eq!(report.stats.handled, 1, "{case}");
            assert_eq!(report.stats.failed, 1, "the audit failed: {case}");
            assert_eq!(
                t.queue.counter().message_count().await.unwrap(),
                0,
                "{case}"
            );
            // The failure transport holds the audit, not the handled event:
            // retried from there, the audit is handled; the event's handler
            // does not run again.
            audit_failing.store(false, Ordering::SeqCst);
            t.up.store(true, Ordering::SeqCst);
            let (report, names) = drain_names(&t.messenger, "failed").await;
            assert_eq!(names, ["Audit"], "only the failed audit was parked: {case}");
            assert_eq!(report.stats.handled, 1, "{case}");
            if unsent {
                // Sent to `down` from there, and handled when read from it.
                assert_eq!(t.audits.load(Ordering::SeqCst), 0, "{case}");
                t.drain_down().await;
            }
            assert_eq!(
                t.audits.load(Ordering::SeqCst),
                1,
                "the audit is not lost: {case}"
            );
            assert_eq!(t.paid_runs.load(Ordering::SeqCst), 1, "{case}");
        }
    }
}

#[tokio::test]
async fn a_retried_message_whose_deferred_dispatch_fails_is_not_parked_beside_its_retry() {
    for unsent in [true, false] {
        for with_middleware in [false, true] {
            let case = format!("unsent: {unsent}, middleware: {with_middleware}");
            let failing = Arc::new(AtomicBool::new(true));
            let audit_failing = Arc::new(AtomicBool::new(!unsent));
            let t = deferring_a_failing_audit(
                1,
                failing.clone(),
                unsent,
                Some(audit_failing.clone()),
                with_middleware,
                true,
            );
            dispatch_paid(&t.messenger).await;
            // The first delivery only: its retry is sent back to `async`.
            let report = drain(
                Worker::builder(&t.messenger)
                    .receiver("async")
                    .message_limit(1),
            )
            .await;
            assert_eq!(report.stats.retried, 1, "{case}");
            assert_eq!(
                t.queue.counter().message_count().await.unwrap(),
                1,
                "the retry: {case}"
            );
            audit_failing.store(false, Ordering::SeqCst);
            t.up.store(true, Ordering::SeqCst);
            let (_, names) = drain_names(&t.messenger, "failed").await;
            assert_eq!(
                names,
                ["Audit"],
                "the event lives once, as its retry; only the audit is parked: {case}"
            );
            if unsent {
                t.drain_down().await;
            }
            assert_eq!(t.audits.load(Ordering::SeqCst), 1, "{case}");
            // The retry succeeds without running the first handler again,
            // so the audit is not deferred twice.
            failing.store(false, Ordering::SeqCst);
            let report = drain(Worker::builder(&t.messenger).receiver("async")).await;
            assert_eq!(report.stats.handled, 1, "{case}");
            assert_eq!(t.paid_runs.load(Ordering::SeqCst), 1, "{case}");
            assert_eq!(t.audits.load(Ordering::SeqCst), 1, "{case}");
        }
    }
}

#[tokio::test]
async fn a_parked_message_whose_successful_handler_s_deferred_dispatch_fails_has_it_parked_too() {
    for unsent in [true, false] {
        let case = format!("unsent: {unsent}");
        let failing = Arc::new(AtomicBool::new(true));
        let audit_failing = Arc::new(AtomicBool::new(!unsent));
        let t = deferring_a_failing_audit(
            0,
            failing.clone(),
            unsent,
            Some(audit_failing.clone()),
            false,
            true,
        );
        let report = t.pay_and_drain().await;
        assert_eq!(report.stats.failed, 2, "the event and its audit: {case}");
        failing.store(false, Ordering::SeqCst);
        audit_failing.store(false, Ordering::SeqCst);
        t.up.store(true, Ordering::SeqCst);
        let (report, names) = drain_names(&t.messenger, "failed").await;
        assert_eq!(names, ["Audit", "Paid"], "{case}");
        assert_eq!(report.stats.handled, 2, "{case}");
        if unsent {
            t.drain_down().await;
        }
        assert_eq!(
            t.audits.load(Ordering::SeqCst),
            1,
            "the audit is not lost: {case}"
        );
        assert_eq!(t.paid_runs.load(Ordering::SeqCst), 1, "{case}");
    }
}

#[tokio::test]
async fn a_deferred_dispatch_that_could_not_be_sent_is_sent_again_not_handled_when_retried_from_the_failure_transport(
) {
    for local_handler in [false, true] {
        let case = format!("local handler: {local_handler}");
        let t = deferring_a_failing_audit(
            0,
            Arc::new(AtomicBool::new(false)),
            true,
            local_handler.then(|| Arc::new(AtomicBool::new(false))),
            false,
            true,
        );
        let report = t.pay_and_drain().await;
        assert_eq!(report.stats.failed, 1, "the audit was not sent: {case}");
        assert_eq!(
            t.failed.counter().message_count().await.unwrap(),
            1,
            "{case}"
        );
        // Retried while `down` still refuses it: kept where it is.
        let report = drain(
            Worker::builder(&t.messenger)
                .receiver("failed")
                .message_limit(1),
        )
        .await;
        assert_eq!(report.stats.failed, 1, "{case}");
        assert_eq!(
            t.failed.counter().message_count().await.unwrap(),
            1,
            "{case}"
        );
        assert_eq!(t.down.counter().message_count().await.unwrap(), 0, "{case}");
        // Once `down` is back, retrying it sends it there.
        t.up.store(true, Ordering::SeqCst);
        let (report, names) = drain_names(&t.messenger, "failed").await;
        assert_eq!(names, ["Audit"], "{case}");
        assert_eq!(report.stats.handled, 1, "{case}");
        assert_eq!(report.stats.failed, 0, "{case}");
        assert_eq!(
            t.failed.counter().message_count().await.unwrap(),
            0,
            "{case}"
        );
        assert_eq!(
            t.audits.load(Ordering::SeqCst),
            0,
            "not handled in this process: {case}"
        );
        let sent = t.down.receiver().get(10).await.unwrap();
        assert_eq!(sent.len(), 1, "delivered to `down`: {case}");
        let envelope = t.messenger.serializer().decode(&sent[0].raw).unwrap();
        assert_eq!(envelope.message_name(), "Audit", "{case}");
        assert!(
            !envelope.has::<envoi_core::stamp::UnsentStamp>(),
            "no longer unsent: {case}"
        );
        assert_eq!(
            envelope
                .last::<SentToFailureTransportStamp>()
                .unwrap()
                .original_transport,
            "down",
            "read from `down`, it is handled as a message of `down`: {case}"
        );
        t.down.receiver().release(&sent[0].id).await.unwrap();
        if local_handler {
            let report = t.drain_down().await;
            assert_eq!(report.stats.handled, 1, "{case}");
            assert_eq!(t.audits.load(Ordering::SeqCst), 1, "{case}");
        }
        assert_eq!(t.paid_runs.load(Ordering::SeqCst), 1, "{case}");
    }
}

#[tokio::test]
async fn a_deferred_dispatch_routed_to_several_transports_reaches_those_after_the_one_it_could_not_be_sent_to(
) {
    let (queue, failed, down, audit) = (memory(), memory(), memory(), memory());
    let up = Arc::new(AtomicBool::new(false));
    let bus = BusSlot::default();
    let messenger = Messenger::builder()
        .event_handler(bus.paid_deferring_an_audit(Arc::default()))
        .transport("async", queue.clone())
        .transport("down", Gated::switchable(down.clone(), up.clone()))
        .transport("audit", audit.clone())
        .transport("failed", failed.clone())
        .failure_transport("failed")
        .route::<Paid>("async")
        // `down` first: its send fails before `audit` is sent to.
        .route::<Audit>("down")
        .route::<Audit>("audit")
        .build()
        .unwrap();
    bus.fill(&messenger);
    dispatch_paid(&messenger).await;
    let report = drain(Worker::builder(&messenger).receiver("async")).await;
    assert_eq!(report.stats.failed, 1, "the audit was not sent");
    assert_eq!(failed.counter().message_count().await.unwrap(), 1);
    assert_eq!(
        audit.counter().message_count().await.unwrap(),
        0,
        "not sent there yet"
    );
    // Retried once `down` is back: sent to `down`, and to `audit`, which
    // the failed send kept it from.
    up.store(true, Ordering::SeqCst);
    let report = drain(Worker::builder(&messenger).receiver("failed")).await;
    assert_eq!(report.stats.handled, 1);
    assert_eq!(failed.counter().message_count().await.unwrap(), 0);
    assert_eq!(
        down.counter().message_count().await.unwrap(),
        1,
        "sent to `down`"
    );
    assert_eq!(
        audit.counter().message_count().await.unwrap(),
        1,
        "and to the route after it"
    );
}

#[tokio::test]
async fn an_application_dispatch_whose_deferred_dispatch_fails_returns_the_deferred_errors() {
    for unsent in [true, false] {
        let t = deferring_a_failing_audit(
            0,
            Arc::new(AtomicBool::new(false)),
            unsent,
            Some(Arc::new(AtomicBool::new(!unsent))),
            false,
            false,
        );
        let error = t
            .messenger
            .bus()
            .dispatch(Envelope::event(Paid))
            .await
            .unwrap_err();
        match error {
            envoi_core::BusError::DelayedHandlingFailed { envelope, errors } => {
                assert_eq!(envelope.message_name(), "Paid");
                assert_eq!(errors.len(), 1, "unsent: {unsent}");
                assert_eq!(
                    errors[0].kind(),
                    if unsent { "transport" } else { "handler" }
                );
            }
            other => panic!("unexpected error: {other}"),
        }
        assert_eq!(
            t.failed.counter().message_count().await.unwrap(),
            0,
            "nothing parked"
        );
        assert_eq!(t.paid_runs.load(Ordering::SeqCst), 1);
    }
}

/// Runs a worker on `async` until `limit`; returns its report and the kind
/// and error of each `Failed` event that released its message, parked
/// nowhere.
async fn run_counting_releases(
    messenger: &Messenger,
    limit: Duration,
) -> (WorkerReport, Vec<(String, String)>) {
    let released = Arc::new(Mutex::new(Vec::new()));
    let seen = released.clone();
    let report = Worker::builder(messenger)
        .receiver("async")
        .idle_sleep(Duration::from_millis(5))
        .time_limit(limit)
        .listener(move |e: &WorkerEvent| {
            if let WorkerEvent::Failed {
                kind,
                error,
                released: true,
                parked_in: None,
                ..
            } = e
            {
                seen.lock().unwrap().push((kind.to_string(), error.clone()));
            }
        })
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    let released = released.lock().unwrap().clone();
    (report, released)
}

/// A failure transport that refuses every message, or panics in `send`;
/// it counts the tries.
#[derive(Default)]
struct Refusing {
    panics: bool,
    sends: AtomicUsize,
}

impl Refusing {
    fn panicking() -> Self {
        Self {
            panics: true,
            ..Self::default()
        }
    }
}

impl Transport for Refusing {
    fn send(
        &self,
        _message: RawMessage,
        _delay: Option<Duration>,
    ) -> envoi_core::middleware::BoxFuture<'_, Result<String, envoi_core::TransportError>> {
        self.sends.fetch_add(1, Ordering::SeqCst);
        assert!(!self.panics, "the failure transport's send panicked");
        Box::pin(async { Err(envoi_core::TransportError::backend("sending", "refused")) })
    }

    fn as_receiver(&self) -> Option<&dyn envoi_core::transport::Receiver> {
        Some(self)
    }
}

impl envoi_core::transport::Receiver for Refusing {
    fn get(
        &self,
        _max: usize,
    ) -> envoi_core::middleware::BoxFuture<
        '_,
        Result<Vec<envoi_core::transport::Delivery>, envoi_core::TransportError>,
    > {
        Box::pin(async { Ok(Vec::new()) })
    }

    fn ack<'a>(
        &'a self,
        _id: &'a DeliveryId,
    ) -> envoi_core::middleware::BoxFuture<'a, Result<(), envoi_core::TransportError>> {
        Box::pin(async { Ok(()) })
    }

    fn reject<'a>(
        &'a self,
        _id: &'a DeliveryId,
    ) -> envoi_core::middleware::BoxFuture<'a, Result<(), envoi_core::TransportError>> {
        Box::pin(async { Ok(()) })
    }

    fn release<'a>(
        &'a self,
        _id: &'a DeliveryId,
    ) -> envoi_core::middleware::BoxFuture<'a, Result<(), envoi_core::TransportError>> {
        Box::pin(async { Ok(()) })
    }
}

/// The gaps between the times (since the start) in `times`.
fn gaps(times: &[Duration]) -> Vec<Duration> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

#[tokio::test(start_paused = true)]
async fn a_message_that_cannot_be_parked_is_kept_and_retried_with_a_growing_pause() {
    let seen = Seen::default();
    let queue = memory();
    let messenger = Messenger::builder()
        .command_handler(seen.handler(Duration::ZERO))
        .transport("async", queue.clone())
        .transport("failed", Arc::new(Refusing::default()))
        .route::<Job>("async")
        .failure_transport("failed")
        .build()
        .unwrap();
    queue.send(raw("Unknown", b"{}"), None).await.unwrap();
    let start = Instant::now();
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let seen_at = attempts.clone();
    let report = Worker::builder(&messenger)
        .receiver("async")
        .idle_sleep(Duration::from_millis(5))
        .time_limit(Duration::from_secs(1))
        .listener(move |e: &WorkerEvent| {
            if let WorkerEvent::Failed {
                released: true,
                parked_in: None,
                ..
            } = e
            {
                seen_at.lock().unwrap().push(start.elapsed());
            }
        })
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::TimeLimit);
    // Tried again after pauses of 100, 200 and 400 ms (the next, of 800
    // ms, would end after the time limit), not once per round trip of the
    // transports.
    let attempts = attempts.lock().unwrap().clone();
    assert_eq!(attempts[0], Duration::ZERO, "{attempts:?}");
    assert_eq!(
        gaps(&attempts),
        [100, 200, 400].map(Duration::from_millis),
        "{attempts:?}"
    );
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        1,
        "the message is kept, not lost"
    );
}

#[tokio::test]
async fn keepalive_goes_on_while_quick_messages_keep_the_worker_busy() {
    // One slow handler holds a slot while quick ones, finishing as soon as
    // they start, keep the other slot and the fetching busy: the slow
    // message's lease must still be extended, or it is handed out again.
    let queue = leased_queue(Duration::from_millis(200));
    let slow_runs = Arc::new(AtomicU32::new(0));
    let runs = slow_runs.clone();
    let messenger = Messenger::builder()
        .command_handler(move |job: Job| {
            let runs = runs.clone();
            async move {
                if job.n == 0 {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(600)).await;
                } else {
                    // Busy, without yielding.
                    std::thread::sleep(Duration::from_micros(200));
                }
                Ok::<_, JobFailed>(())
            }
        })
        .transport("async", queue.clone())
        .route::<Job>("async")
        .build()
        .unwrap();
    send_jobs(&messenger, 0..4000).await;
    let report = Worker::builder(&messenger)
        .receiver("async")
        .concurrency(2)
        .keepalive_interval(Some(Duration::from_millis(20)))
        .stop_when_empty()
        .idle_sleep(Duration::from_millis(5))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(slow_runs.load(Ordering::SeqCst), 1, "{:?}", report.stats);
    assert_eq!(report.stats.handled, 4000);
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);
}

#[tokio::test]
async fn a_panicking_listener_neither_fails_messages_nor_stops_the_worker() {
    let seen = Seen::default();
    let (queue, failed) = (memory(), memory());
    let messenger = messenger_with(
        &seen,
        Duration::ZERO,
        &[("async", queue.clone()), ("failed", failed.clone())],
        Some("failed"),
    );
    send_jobs(&messenger, 0..3).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let count = calls.clone();
    let report = drain(Worker::builder(&messenger).receiver("async").listener(
        move |_: &WorkerEvent| {
            count.fetch_add(1, Ordering::SeqCst);
            panic!("listener bug");
        },
    ))
    .await;
    assert_eq!(seen.get(), [0, 1, 2]);
    assert_eq!((report.stats.handled, report.stats.failed), (3, 0));
    assert_eq!(
        failed.counter().message_count().await.unwrap(),
        0,
        "nothing parked"
    );
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);
    // Started, three Received, three Handled, Stopped.
    assert_eq!(calls.load(Ordering::SeqCst), 8);
}

#[tokio::test(start_paused = true)]
async fn a_message_the_retry_step_cannot_park_is_handled_again_only_after_a_pause() {
    let queue = memory();
    let start = Instant::now();
    let runs = Arc::new(Mutex::new(Vec::new()));
    let seen_at = runs.clone();
    let messenger = Messenger::builder()
        .command_handler(move |_: Job| {
            seen_at.lock().unwrap().push(start.elapsed());
            async { Err::<(), _>(JobFailed) }
        })
        .transport("async", queue.clone())
        .transport("failed", Arc::new(Refusing::default()))
        .route::<Job>("async")
        .failure_transport("failed")
        .default_retry_strategy(envoi_core::failure::MultiplierRetryStrategy {
            max_retries: 0,
            ..Default::default()
        })
        .build()
        .unwrap();
    send_jobs(&messenger, 0..1).await;
    let report = Worker::builder(&messenger)
        .receiver("async")
        .idle_sleep(Duration::from_millis(5))
        .time_limit(Duration::from_secs(1))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::TimeLimit);
    // The retry step's park fails and the message is released: handled
    // again after pauses of 100, 200 and 400 ms (the next, of 800 ms,
    // would end after the time limit), not at once in a loop as fast as
    // the transports go.
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs[0], Duration::ZERO, "{runs:?}");
    assert_eq!(
        gaps(&runs),
        [100, 200, 400].map(Duration::from_millis),
        "{runs:?}"
    );
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        1,
        "kept, not lost"
    );
}

/// A queue whose `get` waits long for a message when there is none, as a
/// broker's long poll does (Redis `block`, NATS `wait`).
struct LongPoll(Arc<InMemoryTransport>, Duration);

impl Transport for LongPoll {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> envoi_core::middleware::BoxFuture<'_, Result<String, envoi_core::TransportError>> {
        self.0.send(message, delay)
    }

    fn as_receiver(&self) -> Option<&dyn envoi_core::transport::Receiver> {
        Some(self)
    }

    fn as_keepalive(&self) -> Option<&dyn envoi_core::transport::Keepalive> {
        self.0.as_keepalive()
    }
}

impl envoi_core::transport::Receiver for LongPoll {
    fn get(
        &self,
        max: usize,
    ) -> envoi_core::middleware::BoxFuture<
        '_,
        Result<Vec<envoi_core::transport::Delivery>, envoi_core::TransportError>,
    > {
        Box::pin(async move {
            let got = self.0.receiver().get(max).await?;
            if got.is_empty() {
                tokio::time::sleep(self.1).await;
                return self.0.receiver().get(max).await;
            }
            Ok(got)
        })
    }

    fn ack<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> envoi_core::middleware::BoxFuture<'a, Result<(), envoi_core::TransportError>> {
        self.0.receiver().ack(id)
    }

    fn reject<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> envoi_core::middleware::BoxFuture<'a, Result<(), envoi_core::TransportError>> {
        self.0.receiver().reject(id)
    }

    fn release<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> envoi_core::middleware::BoxFuture<'a, Result<(), envoi_core::TransportError>> {
        self.0.receiver().release(id)
    }
}

/// A messenger with one queue of two-second leases behind a 30 s long poll,
/// handling each job for `handling`.
fn long_poll_messenger(seen: &Seen, handling: Duration) -> (Messenger, Arc<InMemoryTransport>) {
    let queue = leased_queue(Duration::from_secs(2));
    let messenger = Messenger::builder()
        .command_handler(seen.handler(handling))
        .transport(
            "async",
            Arc::new(LongPoll(queue.clone(), Duration::from_secs(30))),
        )
        .route::<Job>("async")
        .build()
        .unwrap();
    (messenger, queue)
}

#[tokio::test(start_paused = true)]
async fn leases_are_extended_while_a_long_poll_waits() {
    // One message handled for 5 s while the worker's next `get` waits 30 s
    // for more: the message's 2 s lease must be extended meanwhile, or
    // another consumer takes it.
    let seen = Seen::default();
    let (messenger, queue) = long_poll_messenger(&seen, Duration::from_secs(5));
    send_jobs(&messenger, 0..1).await;
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .concurrency(2)
        .keepalive_interval(Some(Duration::from_millis(500)))
        .build()
        .unwrap();
    let report = run_while_leases_hold(
        worker,
        &queue,
        Duration::from_millis(3500),
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(seen.get(), [0]);
    assert_eq!(report.stats.handled, 1);
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_message_handled_during_a_long_poll_is_acknowledged_before_the_poll_ends() {
    // Handled in 1 s while the next `get` waits 30 s: kept unacknowledged
    // until the poll ends, its 2 s lease would run out and it would be
    // handed out again.
    let seen = Seen::default();
    let (messenger, queue) = long_poll_messenger(&seen, Duration::from_secs(1));
    send_jobs(&messenger, 0..1).await;
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .concurrency(2)
        .keepalive_interval(None)
        .build()
        .unwrap();
    let stop = worker.stop_handle();
    let run = tokio::spawn(worker.run());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        0,
        "not acknowledged"
    );
    stop.stop();
    let report = run.within(WAIT, "the worker to stop").await.unwrap();
    assert_eq!(seen.get(), [0]);
    assert_eq!(report.stats.handled, 1);
}

#[tokio::test(start_paused = true)]
async fn a_stop_during_a_long_poll_lets_the_handlers_in_flight_finish() {
    // Stopped 1 s into a 3 s handler (thirty steps of 100 ms, each needing
    // a poll), while the next `get` waits 30 s: the handler goes on and its
    // message is acknowledged, not released when the grace period ends.
    let queue = Arc::new(InMemoryTransport::new());
    let steps = Arc::new(AtomicU32::new(0));
    let done = steps.clone();
    let messenger = Messenger::builder()
        .command_handler(move |_: Job| {
            let done = done.clone();
            async move {
                for _ in 0..30 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    done.fetch_add(1, Ordering::SeqCst);
                }
                Ok::<_, JobFailed>(())
            }
        })
        .transport(
            "async",
            Arc::new(LongPoll(queue.clone(), Duration::from_secs(30))),
        )
        .route::<Job>("async")
        .build()
        .unwrap();
    send_jobs(&messenger, 0..1).await;
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .concurrency(2)
        .grace_period(Duration::from_secs(10))
        .build()
        .unwrap();
    let stop = worker.stop_handle();
    let run = tokio::spawn(worker.run());
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.stop();
    let report = run.within(WAIT, "the worker to stop").await.unwrap();
    assert_eq!(report.reason, StopReason::Stopped);
    assert_eq!(steps.load(Ordering::SeqCst), 30);
    assert_eq!((report.stats.handled, report.stats.released), (1, 0));
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_time_limit_and_a_stop_do_not_wait_for_a_long_poll() {
    let queue = Arc::new(InMemoryTransport::new());
    let messenger = Messenger::builder()
        .transport("async", Arc::new(LongPoll(queue, Duration::from_secs(30))))
        .build()
        .unwrap();
    // A `get` still out is waited for within the grace period only, so
    // that what it brings is given back.
    let report = Worker::builder(&messenger)
        .receiver("async")
        .time_limit(Duration::from_secs(1))
        .grace_period(Duration::from_millis(500))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::TimeLimit);
    assert!(
        report.elapsed < Duration::from_secs(2),
        "{:?}",
        report.elapsed
    );

    let worker = Worker::builder(&messenger)
        .receiver("async")
        .grace_period(Duration::from_millis(500))
        .build()
        .unwrap();
    let stop = worker.stop_handle();
    let start = Instant::now();
    let run = tokio::spawn(worker.run());
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.stop();
    let report = run.within(WAIT, "the worker to stop").await.unwrap();
    assert_eq!(report.reason, StopReason::Stopped);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_long_poll_settled_early_and_found_empty_still_lets_the_lower_receivers_be_read() {
    // "high" long-polls empty while a "low" message is handled: what
    // finishes is settled during the poll, and when the poll ends empty the
    // round goes on to "low" rather than ending there (which, with
    // receivers that cannot count, looked like every receiver was empty).
    let (high, low) = (memory(), memory());
    let seen = Seen::default();
    let messenger = Messenger::builder()
        .command_handler(seen.handler(Duration::from_secs(1)))
        .transport(
            "high",
            Arc::new(LongPoll(high.clone(), Duration::from_secs(30))),
        )
        .transport(
            "low",
            Arc::new(LongPoll(low.clone(), Duration::from_secs(30))),
        )
        .route::<Job>("low")
        .build()
        .unwrap();
    send_jobs(&messenger, 0..2).await;
    let report = drain(
        Worker::builder(&messenger)
            .receivers(["high", "low"])
            .concurrency(2)
            .batch_size(1),
    )
    .await;
    assert_eq!(report.reason, StopReason::Empty);
    assert_eq!(seen.get(), [0, 1]);
    assert_eq!(low.counter().message_count().await.unwrap(), 0);
}

#[tokio::test(start_paused = true)]
async fn during_the_grace_period_what_is_given_back_or_finished_is_settled_at_once() {
    // Leases of 1.5 s; job n is handled for 3n + 1 seconds, two at once,
    // four fetched. Stopped at 0.5 s: jobs 2 and 3 are given back and must
    // be free for others at once, and job 0, done at 1 s, must be
    // acknowledged then, not when job 1 ends at 4 s and its lease has run
    // out (to be handled again by another worker).
    let queue = leased_queue(Duration::from_millis(1500));
    let seen = Seen::default();
    let record = seen.0.clone();
    let messenger = Messenger::builder()
        .command_handler(move |job: Job| {
            let record = record.clone();
            async move {
                tokio::time::sleep(Duration::from_secs(u64::from(job.n) * 3 + 1)).await;
                record.lock().unwrap().push(job.n);
                Ok::<_, JobFailed>(())
            }
        })
        .transport("async", queue.clone())
        .route::<Job>("async")
        .build()
        .unwrap();
    send_jobs(&messenger, 0..4).await;
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .concurrency(2)
        .batch_size(4)
        .keepalive_interval(Some(Duration::from_millis(200)))
        .grace_period(Duration::from_secs(10))
        .build()
        .unwrap();
    let stop = worker.stop_handle();
    let run = tokio::spawn(worker.run());
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.stop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let free: Vec<DeliveryId> = queue
        .receiver()
        .get(10)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(free.len(), 2, "given back, yet still leased");
    for id in &free {
        queue.receiver().release(id).await.unwrap();
    }
    // Job 0 ended at 1 s; job 1 runs until 4 s.
    tokio::time::sleep(Duration::from_millis(2900)).await;
    assert_eq!(seen.get(), [0]);
    let taken = queue.receiver().get(10).await.unwrap();
    assert_eq!(taken.len(), 2, "job 0 was handled but not acknowledged");
    for d in &taken {
        queue.receiver().release(&d.id).await.unwrap();
    }
    let report = run.within(WAIT, "the worker to stop").await.unwrap();
    assert_eq!((report.stats.handled, report.stats.released), (2, 2));
    assert_eq!(queue.counter().message_count().await.unwrap(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_handled_message_waiting_for_its_batched_acknowledgement_keeps_its_lease() {
    // Four fetched, handled one at a time for a second each, leases of
    // 1.5 s: job 0, done at 1 s, must not wait to be acknowledged with the
    // others until its lease has run out and another worker takes it.
    let queue = leased_queue(Duration::from_millis(1500));
    let seen = Seen::default();
    let messenger = messenger_with(
        &seen,
        Duration::from_secs(1),
        &[("async", queue.clone())],
        None,
    );
    send_jobs(&messenger, 0..4).await;
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .batch_size(4)
        .keepalive_interval(Some(Duration::from_millis(200)))
        .build()
        .unwrap();
    let report = run_while_leases_hold(
        worker,
        &queue,
        Duration::from_millis(2700),
        Duration::from_secs(2),
    )
    .await;
    assert_eq!(seen.get(), [0, 1, 2, 3]);
    assert_eq!(report.stats.handled, 4);
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);
}

#[tokio::test(start_paused = true)]
async fn leases_are_extended_while_fetching_pauses_after_a_failed_park() {
    // A message that cannot be parked makes the worker pause fetching, for
    // up to 5 s; a slow handler's message must keep its 1.5 s lease
    // meanwhile.
    let queue = leased_queue(Duration::from_millis(1500));
    let seen = Seen::default();
    let messenger = Messenger::builder()
        .command_handler(seen.handler(Duration::from_secs(20)))
        .transport("async", queue.clone())
        .transport("failed", Arc::new(Refusing::default()))
        .route::<Job>("async")
        .failure_transport("failed")
        .build()
        .unwrap();
    queue.send(raw("Unknown", b"{}"), None).await.unwrap();
    send_jobs(&messenger, 0..1).await;
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .concurrency(2)
        .keepalive_interval(Some(Duration::from_millis(200)))
        .grace_period(Duration::from_secs(30))
        .build()
        .unwrap();
    let stop = worker.stop_handle();
    let run = tokio::spawn(worker.run());
    for second in 1..=18 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let taken = queue.receiver().get(10).await.unwrap();
        let jobs = taken
            .iter()
            .filter(|d| d.raw.header("type") == Some("Job"))
            .count();
        for d in &taken {
            queue.receiver().release(&d.id).await.unwrap();
        }
        assert_eq!(jobs, 0, "the handler's lease ran out by {second} s");
    }
    stop.stop();
    let report = run.within(WAIT, "the worker to stop").await.unwrap();
    assert_eq!(seen.get(), [0]);
    assert_eq!(report.stats.handled, 1);
}

#[tokio::test(start_paused = true)]
async fn a_rate_limit_counts_a_long_poll_s_messages_when_they_arrive() {
    // Two a second; the first `get` waits 30 s and brings two. The bucket,
    // full when it was asked, must be empty after them, not refilled for
    // the whole wait: the next two come a second later, not at once.
    let queue = memory();
    let seen = Seen::default();
    let messenger = Messenger::builder()
        .command_handler(seen.handler(Duration::ZERO))
        .transport(
            "async",
            Arc::new(LongPoll(queue.clone(), Duration::from_secs(30))),
        )
        .route::<Job>("async")
        .build()
        .unwrap();
    let times = Arc::new(Mutex::new(Vec::new()));
    let record = times.clone();
    let start = Instant::now();
    let worker = Worker::builder(&messenger)
        .receiver("async")
        .rate_limit("async", RateLimit::per_second(2))
        .listener(move |e: &WorkerEvent| {
            if let WorkerEvent::Handled { .. } = e {
                record.lock().unwrap().push(start.elapsed());
            }
        })
        .build()
        .unwrap();
    let stop = worker.stop_handle();
    let run = tokio::spawn(worker.run());
    tokio::time::sleep(Duration::from_secs(10)).await;
    send_jobs(&messenger, 0..4).await;
    tokio::time::sleep(Duration::from_secs(25)).await;
    stop.stop();
    run.within(WAIT, "the worker to stop").await.unwrap();
    let times = times.lock().unwrap().clone();
    assert_eq!(times.len(), 4, "{times:?}");
    assert!(
        times[3] - times[0] >= Duration::from_millis(900),
        "four at once at a rate of two a second: {times:?}"
    );
}

#[tokio::test]
async fn an_undecodable_message_whose_failure_transport_cannot_take_raw_messages_is_kept() {
    // The failure transport is a plain sender: it parks envelopes, but a
    // message that does not decode has none. Rejecting it would lose it.
    let seen = Seen::default();
    let queue = memory();
    let store = memory();
    let sender = envoi_core::transport::registry::TransportSender::new(
        "failed",
        store.clone(),
        envoi_core::serializer::Serializer::builder()
            .build()
            .unwrap(),
    );
    let messenger = Messenger::builder()
        .command_handler(seen.handler(Duration::ZERO))
        .transport("async", queue.clone())
        .sender("failed", Arc::new(sender))
        .route::<Job>("async")
        .failure_transport("failed")
        .build()
        .unwrap();
    queue.send(raw("Unknown", b"{}"), None).await.unwrap();
    let (report, released) = run_counting_releases(&messenger, Duration::from_millis(300)).await;
    assert_eq!(report.reason, StopReason::TimeLimit);
    assert_eq!(queue.rejected(), 0, "not rejected");
    assert!(!released.is_empty());
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        1,
        "the message is kept, not lost"
    );
}

#[tokio::test]
async fn a_panic_while_parking_an_undecodable_message_is_reported_and_paces_the_worker() {
    let queue = memory();
    let failed = Arc::new(Refusing::panicking());
    let messenger = Messenger::builder()
        .transport("async", queue.clone())
        .transport("failed", failed.clone())
        .failure_transport("failed")
        .build()
        .unwrap();
    queue.send(raw("Unknown", b"{}"), None).await.unwrap();
    let (report, events) = run_counting_releases(&messenger, Duration::from_millis(500)).await;
    assert_eq!(report.reason, StopReason::TimeLimit);
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        1,
        "kept, not lost"
    );
    let (kind, error) = events.first().expect("a Failed event that released it");
    assert_eq!(kind, "panic");
    assert!(error.contains("send panicked"), "{error}");
    assert_eq!(report.stats.failed, events.len() as u64);
    // Released and fetched again at once, it would panic again at once:
    // fetching pauses as when parking fails (100 ms, then 200 ms, ...).
    let sends = failed.sends.load(Ordering::SeqCst);
    assert!(sends <= 10, "parked {sends} times in half a second");
}

#[tokio::test]
async fn a_panic_while_parking_a_panicked_handler_s_message_keeps_it_and_the_worker() {
    let queue = memory();
    let failed = Arc::new(Refusing::panicking());
    let messenger = Messenger::builder()
        .command_handler(|_: Job| async {
            if true {
                panic!("handler bug");
            }
            Ok::<(), JobFailed>(())
        })
        .transport("async", queue.clone())
        .transport("failed", failed.clone())
        .route::<Job>("async")
        .failure_transport("failed")
        .build()
        .unwrap();
    messenger.dispatcher().dispatch(Job { n: 1 }).await.unwrap();
    let (report, released) = run_counting_releases(&messenger, Duration::from_millis(500)).await;
    assert_eq!(report.reason, StopReason::TimeLimit);
    assert_eq!(
        queue.counter().message_count().await.unwrap(),
        1,
        "kept, not lost"
    );
    let (kind, error) = released.first().expect("a Failed event that released it");
    assert_eq!(kind, "panic");
    assert!(error.contains("send panicked"), "{error}");
    // Fetching pauses as when parking fails.
    let sends = failed.sends.load(Ordering::SeqCst);
    assert!(sends <= 10, "parked {sends} times in half a second");
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Upload {
    data: String,
}
impl Message for Upload {
    const NAME: &'static str = "Upload";
}
impl Command for Upload {
    type Output = ();
    type Error = JobFailed;
}

#[tokio::test(start_paused = true)]
async fn a_message_its_failure_transport_cannot_take_pauses_only_its_own_receiver() {
    // `bulk` stores envelopes as they are; the failure transport encodes
    // them, with a body limit the upload is over: it can never be parked.
    let seen = Seen::default();
    let (bulk, queue) = (memory(), memory());
    let mut encoding = InMemoryConfig::default();
    encoding.serialize = true;
    let failed = Arc::new(InMemoryTransport::with_config(encoding));
    let uploads = Arc::new(AtomicUsize::new(0));
    let tried = uploads.clone();
    let messenger = Messenger::builder()
        .command_handler(seen.handler(Duration::ZERO))
        .command_handler(move |_: Upload| {
            tried.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>(JobFailed) }
        })
        .transport("bulk", bulk.clone())
        .transport("async", queue.clone())
        .transport("failed", failed.clone())
        .route::<Upload>("bulk")
        .route::<Job>("async")
        .failure_transport("failed")
        .max_body_size(1024)
        .default_retry_strategy(envoi_core::failure::MultiplierRetryStrategy {
            max_retries: 0,
            ..Default::default()
        })
        .build()
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(Upload {
            data: "x".repeat(4096),
        })
        .await
        .unwrap();
    send_jobs(&messenger, 0..10).await;
    let released = Arc::new(Mutex::new(Vec::new()));
    let record = released.clone();
    // The upload once, then the ten jobs: `bulk` comes first, but while
    // it is paused `async` is read.
    let report = Worker::builder(&messenger)
        .receivers(["bulk", "async"])
        .message_limit(11)
        .listener(move |e: &WorkerEvent| {
            if let WorkerEvent::Failed {
                transport,
                error,
                released: true,
                parked_in: None,
                ..
            } = e
            {
                record
                    .lock()
                    .unwrap()
                    .push((transport.to_string(), error.clone()));
            }
        })
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::MessageLimit);
    assert_eq!(uploads.load(Ordering::SeqCst), 1, "tried once, then paused");
    assert_eq!(seen.get(), (0..10).collect::<Vec<_>>(), "every job handled");
    assert_eq!((report.stats.handled, report.stats.failed), (10, 1));
    assert_eq!(
        bulk.counter().message_count().await.unwrap(),
        1,
        "kept, not lost"
    );
    assert_eq!(failed.counter().message_count().await.unwrap(), 0);
    let released = released.lock().unwrap().clone();
    assert_eq!(released.len(), 1, "{released:?}");
    let (transport, error) = &released[0];
    assert_eq!(transport, "bulk");
    assert!(
        error.contains("could not be parked in `failed`") && error.contains("exceeds the limit"),
        "{error}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_retried_or_parked_message_whose_deferred_dispatch_cannot_be_parked_is_not_duplicated() {
    for retries in [0, 1] {
        let case = format!("retries: {retries}");
        let (queue, failed) = (memory(), memory());
        let bus = BusSlot::default();
        let runs = Arc::new(AtomicUsize::new(0));
        let messenger = Messenger::builder()
            .event_handler(bus.paid_deferring_an_audit(runs.clone()))
            .event_handler(|_: Paid| async { Err::<(), _>(JobFailed) })
            .command_handler(|_: Audit| async { Ok::<_, JobFailed>(()) })
            .transport("async", queue.clone())
            // The audit's dispatch fails, and the failure transport does not
            // take it either.
            .transport("down", Arc::new(Refusing::default()))
            .transport("failed", Gated::refusing_type(failed.clone(), "Audit"))
            .route::<Paid>("async")
            .route::<Audit>("down")
            .failure_transport("failed")
            .default_retry_strategy(retrying_at_once(retries))
            .build()
            .unwrap();
        bus.fill(&messenger);
        dispatch_paid(&messenger).await;
        let events = Arc::new(Mutex::new(Vec::new()));
        let seen = events.clone();
        let report = drain(
            Worker::builder(&messenger)
                .receiver("async")
                .message_limit(1)
                .listener(move |e: &WorkerEvent| {
                    if let WorkerEvent::Failed {
                        message,
                        parked_in,
                        released,
                        ..
                    } = e
                    {
                        seen.lock().unwrap().push((
                            message.to_string(),
                            parked_in.clone(),
                            *released,
                        ));
                    }
                }),
        )
        .await;
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{case}");
        // The event lives on once: as its retry, or parked. Released as
        // well, it would be handled again and retried or parked again.
        let (in_queue, parked) = if retries == 0 { (0, 1) } else { (1, 0) };
        assert_eq!(
            queue.counter().message_count().await.unwrap(),
            in_queue,
            "the event is not given back beside its retry or parked copy: {case}"
        );
        assert_eq!(
            failed.counter().message_count().await.unwrap(),
            parked,
            "{case}"
        );
        assert_eq!(report.stats.retried, u64::from(retries), "{case}");
        let events = events.lock().unwrap().clone();
        assert!(
            events.contains(&("Audit".to_string(), None, false)),
            "the audit that could not be parked is reported, not released: {case}: {events:?}"
        );
        assert!(
            events.iter().all(|(_, _, released)| !released),
            "{case}: {events:?}"
        );
    }
}

#[tokio::test]
async fn a_handled_message_rejected_for_want_of_a_failure_transport_for_its_deferred_dispatch_still_counts_as_handled(
) {
    let queue = memory();
    let bus = BusSlot::default();
    let messenger = Messenger::builder()
        .event_handler(bus.paid_deferring_an_audit(Arc::default()))
        .command_handler(|_: Audit| async { Err::<(), _>(JobFailed) })
        .transport("async", queue.clone())
        .route::<Paid>("async")
        .build()
        .unwrap();
    bus.fill(&messenger);
    dispatch_paid(&messenger).await;
    let handled = Arc::new(AtomicUsize::new(0));
    let seen = handled.clone();
    let report = drain(Worker::builder(&messenger).receiver("async").listener(
        move |e: &WorkerEvent| {
            if let WorkerEvent::Handled { .. } = e {
                seen.fetch_add(1, Ordering::SeqCst);
            }
        },
    ))
    .await;
    // The event was handled; only its audit failed (and, with nowhere to
    // park it, the event is rejected).
    assert_eq!(report.stats.handled, 1, "{:?}", report.stats);
    assert_eq!(report.stats.failed, 1, "the audit: {:?}", report.stats);
    assert_eq!(handled.load(Ordering::SeqCst), 1, "a Handled event");
    assert_eq!(queue.counter().message_count().await.unwrap(), 0);
}

#[tokio::test(start_paused = true)]
async fn stop_when_empty_does_not_stop_before_asking_again_a_receiver_paused_after_a_failed_park() {
    let seen = Seen::default();
    let (paused, other, failed) = (memory(), memory(), memory());
    let messenger = Messenger::builder()
        .command_handler(seen.handler(Duration::ZERO))
        .transport("paused", Gated::uncounted(paused.clone(), 0))
        .transport("other", other.clone())
        // Down at first: the message `paused` holds cannot be parked, so it
        // is given back and `paused` is not read for a while.
        .transport("failed", Gated::uncounted(failed.clone(), 1))
        .route::<Job>("other")
        .failure_transport("failed")
        .build()
        .unwrap();
    paused.send(raw("Unknown", b"{}"), None).await.unwrap();
    let report = drain(Worker::builder(&messenger).receivers(["paused", "other"])).await;
    assert_eq!(report.reason, StopReason::Empty);
    // `paused` cannot say it still holds the message: only asking it again
    // (after its pause) tells, and by then the message can be parked.
    assert_eq!(
        failed.counter().message_count().await.unwrap(),
        1,
        "parked at the second try: {:?}",
        report.stats
    );
    assert_eq!(paused.counter().message_count().await.unwrap(), 0);
    assert_eq!(report.stats.failed, 2, "the failed park, then the park");
}

/// Puts `envelope` in `failed`, as if a worker had parked it there.
async fn put_parked(messenger: &Messenger, failed: &InMemoryTransport, envelope: Envelope) {
    let raw = messenger.serializer().encode(&envelope).unwrap();
    failed.send(raw, None).await.unwrap();
}

/// The one message in `failed`, decoded.
async fn the_one_parked(messenger: &Messenger, failed: &InMemoryTransport) -> Envelope {
    let left = failed.browser().list(10).await.unwrap();
    assert_eq!(left.len(), 1, "parked again, once");
    messenger.serializer().decode(&left[0].raw).unwrap()
}

#[tokio::test]
async fn a_message_parked_unsent_to_a_transport_that_is_gone_is_parked_again_with_why() {
    let (failed, audit) = (memory(), memory());
    let messenger = Messenger::builder()
        .transport("audit", audit.clone())
        .transport("failed", failed.clone())
        .failure_transport("failed")
        .route::<Audit>("audit")
        .build()
        .unwrap();
    // Parked while going to `gone`, a transport removed since, ahead of one
    // parked while going to `audit`.
    for (n, to) in [(1, "gone"), (2, "audit")] {
        let parked = Envelope::new(Audit { n })
            .with(envoi_core::stamp::UnsentStamp::new(to))
            .with(SentToFailureTransportStamp::new(to));
        put_parked(&messenger, &failed, parked).await;
    }
    let report = Worker::builder(&messenger)
        .receiver("failed")
        .message_limit(2)
        .time_limit(Duration::from_secs(5))
        .idle_sleep(Duration::from_millis(5))
        .build()
        .unwrap()
        .run()
        .within(WAIT, "the worker to stop")
        .await;
    assert_eq!(report.reason, StopReason::MessageLimit, "{report:?}");
    assert_eq!(
        (
            report.stats.handled,
            report.stats.failed,
            report.stats.released
        ),
        (1, 1, 0),
        "{report:?}"
    );
    let sent = audit.receiver().get(10).await.unwrap();
    assert_eq!(sent.len(), 1, "the one behind it reached `audit`");
    let parked = the_one_parked(&messenger, &failed).await;
    assert_eq!(parked.message::<Audit>().unwrap().n, 1);
    assert_eq!(
        parked
            .last::<envoi_core::stamp::UnsentStamp>()
            .unwrap()
            .transport,
        "gone",
        "still to be sent to `gone`"
    );
    let why = parked.last::<ErrorDetailsStamp>().unwrap();
    assert!(why.message.contains("unknown transport `gone`"), "{why:?}");
    assert_eq!(
        parked.all::<SentToFailureTransportStamp>().count(),
        2,
        "parked twice, so handed out again after a growing delay"
    );
}

#[tokio::test]
async fn a_message_whose_retry_goes_to_a_transport_that_is_gone_is_parked_again_with_why() {
    let failed = memory();
    let messenger = Messenger::builder()
        .command_handler(|_: Audit| async { Err::<(), _>(JobFailed) })
        .transport("failed", failed.clone())
        .failure_transport("failed")
        .route::<Audit>("failed")
        .default_retry_strategy(envoi_core::failure::MultiplierRetryStrategy {
            max_retries: 3,
            ..Default::default()
        })
        .build()
        .unwrap();
    // Parked from `gone`, a transport removed since: retried from the
    // failure transport, it fails, and its retry would go back to `gone`.
    let parked = Envelope::new(Audit { n: 1 }).with(SentToFailureTransportStamp::new("gone"));
    put_parked(&messenger, &failed, parked).await;
    let report = drain(
        Worker::builder(&messenger)
            .receiver("failed")
            .message_limit(1),
    )
    .await;
    assert_eq!(
        (report.stats.failed, report.stats.released),
        (1, 0),
        "{report:?}"
    );
    let again = the_one_parked(&messenger, &failed).await;
    let why = again.last::<ErrorDetailsStamp>().unwrap();
    assert!(why.message.contains("unknown transport `gone`"), "{why:?}");
    assert_eq!(
        again
            .last::<SentToFailureTransportStamp>()
            .unwrap()
            .original_transport,
        "gone",
        "still a message of `gone`"
    );
    assert_eq!(again.all::<SentToFailureTransportStamp>().count(), 2);
}
