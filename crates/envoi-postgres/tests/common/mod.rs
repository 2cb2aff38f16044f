//! Helpers shared by the integration tests.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::time::{Duration, Instant};

use envoi_core::transport::{Delivery, DeliveryId, RawMessage, Receiver, Setup};
use envoi_postgres::sqlx::postgres::PgPool;
use envoi_postgres::PostgresTransport;

/// `url` with envoi options appended to its query string.
pub fn dsn(url: &str, options: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{options}")
}

/// A name unique to this run, usable as a table, queue or application name.
pub fn unique(tag: &str) -> String {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{tag}_{}", &suffix[..12])
}

/// A transport on `url` with `options`, set up.
pub async fn open(name: &str, url: &str, options: &str) -> PostgresTransport {
    let transport = PostgresTransport::connect(name, &dsn(url, options))
        .await
        .unwrap_or_else(|e| panic!("opening `{name}` failed: {e}"));
    transport
        .setup()
        .await
        .unwrap_or_else(|e| panic!("setup of `{name}` failed: {e}"));
    transport
}

/// A plain pool for looking at the server from outside the transport.
pub async fn admin(url: &str) -> PgPool {
    envoi_postgres::sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("connecting to {url} failed: {e}"))
}

/// A message with a text body and no headers.
pub fn text(body: &str) -> RawMessage {
    RawMessage {
        body: body.as_bytes().to_vec(),
        headers: Default::default(),
    }
}

/// The delivery's body as text.
pub fn body(delivery: &Delivery) -> String {
    String::from_utf8_lossy(&delivery.raw.body).into_owned()
}

/// The ids of `deliveries`, to settle them in one call.
pub fn ids(deliveries: &[Delivery]) -> Vec<DeliveryId> {
    deliveries.iter().map(|d| d.id.clone()).collect()
}

/// Gets until `n` deliveries arrived; panics after `timeout`.
pub async fn receive(transport: &dyn Receiver, n: usize, timeout: Duration) -> Vec<Delivery> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "received {} of {n} messages within {timeout:?}",
            out.len()
        );
        let left = deadline.saturating_duration_since(Instant::now());
        let got = within(left, &format!("{n} messages"), transport.get(n - out.len())).await;
        out.extend(got.unwrap_or_else(|e| panic!("get failed: {e}")));
    }
    out
}

/// Connections of the server whose `application_name` is `app`, and how
/// many of them are listening (their last statement was `LISTEN`).
pub async fn connections(admin: &PgPool, app: &str) -> (i64, i64) {
    envoi_postgres::sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE query ILIKE 'LISTEN%') \
         FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(app)
    .fetch_one(admin)
    .await
    .unwrap_or_else(|e| panic!("reading pg_stat_activity failed: {e}"))
}

/// Waits up to `timeout` for `app` to have exactly one listening connection.
pub async fn wait_for_listener(admin: &PgPool, app: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if connections(admin, app).await.1 == 1 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Waits for `future` at most `limit` (real time); past it, fails naming
/// `what` it waited for, rather than hang the test run.
pub use envoi_core::testing::within;
