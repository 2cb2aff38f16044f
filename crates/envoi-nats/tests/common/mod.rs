//! Shared helpers for the tests that talk to a real NATS server.

#![allow(dead_code, unreachable_pub)]

pub mod server;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use envoi_core::transport::{RawMessage, Receiver, Setup, Transport};
use envoi_core::{Command, Headers, Message};
use envoi_nats::NatsTransport;
use serde::{Deserialize, Serialize};

/// The command the worker tests produce; its id is what they count.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    pub id: usize,
}

impl Message for Job {
    const NAME: &'static str = "Job";
}

impl Command for Job {
    type Output = ();
    type Error = std::convert::Infallible;
}

/// Sends jobs `0..n` to `producer` as raw messages, in batches of 500.
pub async fn send_jobs(producer: &NatsTransport, n: usize) {
    let jobs: Vec<(RawMessage, Option<std::time::Duration>)> = (0..n)
        .map(|id| {
            let raw = RawMessage {
                body: format!("{{\"id\":{id}}}").into_bytes(),
                headers: Headers::from([("type".to_string(), Job::NAME.to_string())]),
            };
            (raw, None)
        })
        .collect();
    for chunk in jobs.chunks(500) {
        producer.send_batch(chunk.to_vec()).await.expect("send");
    }
}

/// A transport name no other test (or earlier run) uses.
pub fn unique_name(test: &str) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{test}-{}-{}-{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// `url` with extra query options appended.
pub fn with_options(url: &str, options: &str) -> String {
    if options.is_empty() {
        url.to_string()
    } else if url.contains('?') {
        format!("{url}&{options}")
    } else {
        format!("{url}?{options}")
    }
}

/// A set-up transport on a fresh stream.
pub async fn transport(url: &str, name: &str, options: &str) -> NatsTransport {
    let transport = NatsTransport::connect(name, &with_options(url, options))
        .await
        .expect("connect");
    transport.setup().await.expect("setup");
    transport
}

/// Gets until `n` deliveries arrived; panics, saying what it waited for,
/// when fewer came within `timeout`.
pub async fn get_exactly(
    transport: &NatsTransport,
    n: usize,
    timeout: std::time::Duration,
) -> Vec<envoi_core::transport::Delivery> {
    let got = get_n(transport, n, timeout).await;
    assert_eq!(
        got.len(),
        n,
        "waited {timeout:?} for {n} message(s) from stream `{}`; {} came",
        transport.stream(),
        got.len()
    );
    got
}

/// Gets until `n` deliveries arrived or `timeout` passed.
pub async fn get_n(
    transport: &NatsTransport,
    n: usize,
    timeout: std::time::Duration,
) -> Vec<envoi_core::transport::Delivery> {
    let deadline = std::time::Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < n && std::time::Instant::now() < deadline {
        out.extend(transport.get(n - out.len()).await.expect("get"));
    }
    out
}
