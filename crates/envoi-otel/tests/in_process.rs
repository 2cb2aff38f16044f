//! One trace from producer to consumer through the in-process transports
//! (in-memory) and SQLite: propagation, retries, `failed retry`, and
//! messages that carry no trace.

mod common;

use common::{
    assert_child, assert_failed, assert_one_trace, assert_succeeded, dispatch_in_request,
    messenger, start, work, Attempts, Expected, Job, Telemetry, JOBS,
};
use envoi_core::{Envelope, Messenger};
use opentelemetry::trace::SpanId;

const IN_MEMORY: Expected<'static> = Expected {
    system: "in_memory",
    server: None,
};

const SQLITE: Expected<'static> = Expected {
    system: "sqlite",
    server: None,
};

async fn in_memory(attempts: &Attempts) -> Messenger {
    start(messenger(attempts).transport_dsn(JOBS, "in-memory://")).await
}

async fn sqlite(attempts: &Attempts, dir: &tempfile::TempDir) -> Messenger {
    let dsn = format!("sqlite://{}/jobs.db", dir.path().display());
    start(
        messenger(attempts)
            .transport_factory(envoi_sqlite::SqliteTransportFactory)
            .transport_dsn(JOBS, dsn),
    )
    .await
}

#[tokio::test]
async fn a_job_sent_through_the_in_memory_transport_is_processed_in_the_trace_of_its_request() {
    let telemetry = Telemetry::install();
    let attempts = Attempts::default();
    let messenger = in_memory(&attempts).await;
    dispatch_in_request(&messenger).await;
    work(&messenger, 1).await;
    assert_eq!(attempts.ran(), 1);
    assert_one_trace(&telemetry.trace(), 0, &IN_MEMORY);
}

#[tokio::test]
async fn a_job_sent_through_sqlite_is_processed_in_the_trace_of_its_request() {
    let telemetry = Telemetry::install();
    let dir = tempfile::tempdir().unwrap();
    let attempts = Attempts::default();
    let messenger = sqlite(&attempts, &dir).await;
    dispatch_in_request(&messenger).await;
    work(&messenger, 1).await;
    assert_eq!(attempts.ran(), 1);
    assert_one_trace(&telemetry.trace(), 0, &SQLITE);
}

#[tokio::test]
async fn a_retried_job_is_processed_again_as_a_child_of_the_attempt_that_failed() {
    let telemetry = Telemetry::install();
    let attempts = Attempts::failing_first(1);
    let messenger = in_memory(&attempts).await;
    dispatch_in_request(&messenger).await;
    work(&messenger, 2).await;
    assert_eq!(attempts.ran(), 2);
    assert_one_trace(&telemetry.trace(), 1, &IN_MEMORY);
}

#[tokio::test]
async fn a_job_retried_through_sqlite_keeps_its_trace() {
    let telemetry = Telemetry::install();
    let dir = tempfile::tempdir().unwrap();
    let attempts = Attempts::failing_first(1);
    let messenger = sqlite(&attempts, &dir).await;
    dispatch_in_request(&messenger).await;
    work(&messenger, 2).await;
    assert_eq!(attempts.ran(), 2);
    assert_one_trace(&telemetry.trace(), 1, &SQLITE);
}

#[tokio::test]
async fn failed_retry_continues_the_trace_of_a_job_parked_in_the_failure_transport() {
    let telemetry = Telemetry::install();
    let dir = tempfile::tempdir().unwrap();
    // Fails its first try and its one retry, so it is parked; the third
    // run, from `failed retry`, succeeds.
    let attempts = Attempts::failing_first(2);
    let dsn = format!("sqlite://{}/failed.db", dir.path().display());
    let messenger = start(
        messenger(&attempts)
            .transport_factory(envoi_sqlite::SqliteTransportFactory)
            .transport_dsn(JOBS, "in-memory://")
            .transport_dsn("failed", dsn)
            .failure_transport("failed"),
    )
    .await;
    dispatch_in_request(&messenger).await;
    work(&messenger, 2).await;
    assert_eq!(attempts.ran(), 2, "tried and retried, then parked");

    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = envoi_cli::run_with(
        &messenger,
        ["app", "failed", "retry", "--all"],
        &mut out,
        &mut err,
    )
    .await;
    assert_eq!(code, 0, "{}", String::from_utf8_lossy(&err));
    assert_eq!(attempts.ran(), 3, "handled by `failed retry`");

    let trace = telemetry.trace();
    let attempts = trace.named(&format!("process {JOBS}"));
    assert_eq!(attempts.len(), 3, "{}", trace.describe());
    assert_child(attempts[0], trace.one(&format!("send {JOBS}")));
    assert_child(attempts[1], attempts[0]);
    assert_child(attempts[2], attempts[1]);
    assert_failed(attempts[0], "handler");
    assert_failed(attempts[1], "handler");
    assert_succeeded(attempts[2]);
    let request = trace.one("request");
    assert!(
        attempts
            .iter()
            .all(|a| a.span_context.trace_id() == request.span_context.trace_id()),
        "the retry from the failure transport is in the request's trace"
    );
}

#[tokio::test]
async fn a_message_without_trace_headers_is_handled_in_a_new_trace() {
    let telemetry = Telemetry::install();
    let dir = tempfile::tempdir().unwrap();
    let attempts = Attempts::default();
    let messenger = sqlite(&attempts, &dir).await;
    // Sent as a producer that is not envoi would: encoded, no trace.
    let raw = messenger
        .serializer()
        .encode(&Envelope::new(Job { n: 1 }))
        .unwrap();
    assert!(!raw.headers.contains_key("traceparent"));
    let jobs = messenger.transport(JOBS).unwrap();
    jobs.send(raw, None).await.unwrap();
    work(&messenger, 1).await;
    assert_eq!(attempts.ran(), 1, "handled");
    let trace = telemetry.trace();
    let process = trace.one(&format!("process {JOBS}"));
    assert_eq!(process.parent_span_id, SpanId::INVALID, "a new trace");
    assert_succeeded(process);
    assert_child(trace.one("charge"), process);
}

#[tokio::test]
async fn without_a_subscriber_nothing_is_added_to_the_message() {
    let attempts = Attempts::default();
    let messenger = in_memory(&attempts).await;
    let sent = messenger
        .bus()
        .dispatch(Envelope::new(Job { n: 1 }))
        .await
        .unwrap();
    assert_eq!(sent.header("traceparent"), None);
    work(&messenger, 1).await;
    assert_eq!(attempts.ran(), 1);
}

#[tokio::test]
async fn a_sent_message_carries_its_send_span_in_w3c_trace_context_headers() {
    let telemetry = Telemetry::install();
    let attempts = Attempts::default();
    let messenger = in_memory(&attempts).await;
    let sent = messenger
        .bus()
        .dispatch(Envelope::new(Job { n: 1 }))
        .await
        .unwrap();
    let traceparent = sent.header("traceparent").expect("a traceparent header");
    let trace = telemetry.trace();
    let send = trace.one(&format!("send {JOBS}"));
    assert_eq!(
        traceparent,
        format!(
            "00-{}-{}-01",
            send.span_context.trace_id(),
            send.span_context.span_id()
        )
    );
}
