//! Connecting ends within `connect_timeout`: a closed port, or a server
//! that never answers, is `TransportError::Unreachable` naming the DSN with
//! its password masked. No broker is needed.

use std::time::{Duration, Instant};

use envoi_core::TransportError;
use envoi_nats::NatsTransport;

/// The error of connecting with `dsn`, which must fail within 30 s, and
/// how long it took.
async fn connect_error(dsn: &str) -> (TransportError, Duration) {
    let started = Instant::now();
    let connecting = NatsTransport::connect("q", dsn);
    let result = tokio::time::timeout(Duration::from_secs(30), connecting)
        .await
        .unwrap_or_else(|_| panic!("connecting with {dsn} did not end within 30 s"));
    match result {
        Ok(_) => panic!("connected with {dsn}"),
        Err(error) => (error, started.elapsed()),
    }
}

/// `error` is `Unreachable`, names `masked` and never shows `secret`.
fn assert_unreachable(error: &TransportError, masked: &str, secret: &str) {
    match error {
        TransportError::Unreachable { dsn, .. } => assert_eq!(dsn, masked),
        other => panic!("expected Unreachable, got {other:?}"),
    }
    let shown = format!("{error} / {error:?}");
    assert!(shown.contains(masked), "{shown}");
    assert!(!shown.contains(secret), "the password shows: {shown}");
}

#[tokio::test]
async fn a_closed_port_is_unreachable_naming_the_masked_dsn() {
    let (error, _) = connect_error("nats://u:hunter2@127.0.0.1:1?connect_timeout=1s").await;
    assert_unreachable(
        &error,
        "nats://u:***@127.0.0.1:1?connect_timeout=1s",
        "hunter2",
    );
    let (error, _) = connect_error("nats://hunter2@127.0.0.1:1?connect_timeout=1s").await;
    assert_unreachable(
        &error,
        "nats://***@127.0.0.1:1?connect_timeout=1s",
        "hunter2",
    );
}

#[tokio::test]
async fn a_server_that_never_answers_is_unreachable_after_the_connect_timeout() {
    // Accepts connections (the kernel does, into the backlog) and never
    // says anything: the client waits for the server's INFO.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = silent.local_addr().expect("address").port();
    let dsn = format!("nats://u:hunter2@127.0.0.1:{port}?connect_timeout=1s");
    let (error, took) = connect_error(&dsn).await;
    assert_unreachable(
        &error,
        &format!("nats://u:***@127.0.0.1:{port}?connect_timeout=1s"),
        "hunter2",
    );
    // Not before the timeout; after it by far less than the 5 s default
    // (a wide margin: the machine may be busy).
    assert!(
        took >= Duration::from_millis(900),
        "gave up early: {took:?}"
    );
    assert!(
        took < Duration::from_secs(4),
        "ignored connect_timeout=1s: {took:?}"
    );
    drop(silent);
}
