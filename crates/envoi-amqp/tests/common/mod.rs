//! Helpers shared by the tests that talk to a real RabbitMQ broker.
//!
//! Every wait on the broker is bounded: [`Within::within`] and
//! [`Within::expect_within`] fail the test, naming what it waited for, when
//! the broker gives no answer within [`BROKER_WAIT`].

#![allow(dead_code, unreachable_pub)]

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

use envoi_core::transport::{Delivery, Receiver};

/// The longest a test waits for one answer of the broker. Generous: the
/// machine running the tests may be slow and shared.
pub const BROKER_WAIT: Duration = Duration::from_secs(30);

/// Bounds a wait on the broker to [`BROKER_WAIT`] (with core's
/// [`within`](envoi_core::testing::within)).
pub trait Within: Future + Sized {
    /// The output of the future, or a test failure saying it waited for
    /// `what` in vain.
    fn within(self, what: impl Display) -> impl Future<Output = Self::Output> {
        let what = what.to_string();
        async move { envoi_core::testing::within(BROKER_WAIT, &what, self).await }
    }

    /// Like [`within`](Self::within), for a fallible future: the success,
    /// or a test failure naming `what` and the error.
    fn expect_within<T, E>(self, what: impl Display) -> impl Future<Output = T>
    where
        Self: Future<Output = Result<T, E>>,
        E: Display,
    {
        let what = what.to_string();
        async move {
            match self.within(&what).await {
                Ok(value) => value,
                Err(e) => panic!("{what} failed: {e}"),
            }
        }
    }
}

impl<F: Future> Within for F {}

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
        out.extend(t.get(n - out.len()).expect_within("a get").await);
    }
    out
}
