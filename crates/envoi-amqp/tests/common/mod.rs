//! Helpers shared by the tests that talk to a real RabbitMQ broker.

#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use envoi_core::transport::{Delivery, Receiver};

/// The broker URL, or `None` after printing why `test` is skipped.
pub fn url(test: &str) -> Option<String> {
    match std::env::var("ENVOI_AMQP_URL") {
        Ok(url) => Some(url),
        Err(_) => {
            eprintln!("skipped {test}: ENVOI_AMQP_URL is not set");
            None
        }
    }
}

/// A name no other test (or earlier run) uses.
pub fn unique(tag: &str) -> String {
    format!("{tag}_{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// `url` with `options`, its queues expiring a minute after their last
/// use so that tests leave none behind.
pub fn dsn(url: &str, options: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}expires=60s&{options}")
}

/// Gets until `n` messages arrived; fails after `within`.
pub async fn receive(t: &dyn Receiver, n: usize, within: Duration) -> Vec<Delivery> {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "received {} of {n} messages within {within:?}",
            out.len()
        );
        out.extend(t.get(n - out.len()).await.expect("get failed"));
    }
    out
}
