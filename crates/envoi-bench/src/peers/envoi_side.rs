//! envoi's side of a peer scenario, run in its own process (`envoi-bench
//! --side envoi <scenario> <n>`).
//!
//! The worker starts first; then the clock starts, [`PRODUCERS`] concurrent
//! dispatchers send N [`Order`]s and the clock stops when the handler has
//! counted the N-th. Tuning is the bench's for each transport, as in the
//! `*_e2e` scenarios: 64 handlers in flight, fetches of 500 messages
//! (256 in memory), a PostgreSQL pool of 16, a RabbitMQ prefetch of 1000;
//! everything else is the transport's default (a quorum queue on RabbitMQ,
//! one Redis stream). Each round uses its own table / stream / queue and
//! deletes it at the end.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use envoi_core::transport::in_memory::InMemoryTransport;
use envoi_core::transport::{Setup, Teardown, Transport};
use envoi_core::worker::Worker;
use envoi_core::{Command, Message, Messenger};
use serde::{Deserialize, Serialize};

use super::{unique, Backend};
use crate::e2e::{runtime, PRODUCERS};

/// Handlers in flight.
const CONCURRENCY: usize = 64;
/// Messages per fetch on the brokers.
const BROKER_BATCH: usize = 500;
/// Messages per fetch in memory (as in `memory_e2e`).
const MEMORY_BATCH: usize = 256;
/// Pool size of the PostgreSQL transport.
const PG_CONNECTIONS: u32 = 16;
/// RabbitMQ prefetch.
const AMQP_PREFETCH: u16 = 1000;

/// The message of every peer scenario: about 100 bytes of JSON, the same
/// shape every peer's producer builds
/// (`{"id":…,"order":"order-…","customer":"customer-…","amount_cents":…,"currency":"EUR"}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Order {
    pub(crate) id: u64,
    pub(crate) order: String,
    pub(crate) customer: String,
    pub(crate) amount_cents: u64,
    pub(crate) currency: String,
}

impl Message for Order {
    const NAME: &'static str = "Order";
}

impl Command for Order {
    type Output = ();
    type Error = Infallible;
}

/// The `id`-th message.
pub(crate) fn payload(id: u64) -> Order {
    Order {
        id,
        order: format!("order-{id:08}"),
        customer: format!("customer-{:05}", id % 1000),
        amount_cents: 1000 + id % 9000,
        currency: "EUR".to_owned(),
    }
}

/// What one run did: messages handled and the seconds from the first send
/// to the last one handled.
#[derive(Debug, Clone, Copy)]
pub(super) struct Outcome {
    pub(super) handled: u64,
    pub(super) seconds: f64,
}

/// Runs envoi's side once on `backend` (at `url`) with `n` messages.
pub(super) fn run(backend: Backend, url: &str, n: u64) -> Result<Outcome, String> {
    runtime()?.block_on(async {
        match backend {
            Backend::Memory => drive(Arc::new(InMemoryTransport::new()), n, MEMORY_BATCH).await,
            Backend::Postgres => {
                let options = format!(
                    "table=envoi_bench_peer_{}&batch={BROKER_BATCH}&max_connections={PG_CONNECTIONS}",
                    unique()
                );
                let t = envoi_postgres::PostgresTransport::connect("jobs", &with(url, &options))
                    .await
                    .map_err(|e| e.to_string())?;
                let t = Arc::new(t);
                on_broker(t.clone(), n, t.close()).await
            }
            Backend::Redis => {
                let options = format!("stream=envoi-bench-peer:{}&group=bench", unique());
                let t = envoi_redis::RedisTransport::connect("jobs", &with(url, &options))
                    .await
                    .map_err(|e| e.to_string())?;
                let t = Arc::new(t);
                on_broker(t.clone(), n, t.close()).await
            }
            Backend::Amqp => {
                // `expires` only removes the queue should the run die first.
                let q = format!("envoi-bench-peer-{}", unique());
                let options = format!("queue={q}&exchange={q}&prefetch={AMQP_PREFETCH}&expires=10m");
                let t = envoi_amqp::AmqpTransport::connect("jobs", &with(url, &options))
                    .await
                    .map_err(|e| e.to_string())?;
                let t = Arc::new(t);
                on_broker(t.clone(), n, t.close()).await
            }
        }
    })
}

/// `url` with `options` appended to its query string.
fn with(url: &str, options: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{options}")
}

/// Sets `transport` up, drives it, then deletes what it created and closes
/// it (`close`), whatever happened; the first error wins.
async fn on_broker<T>(
    transport: Arc<T>,
    n: u64,
    close: impl Future<Output = Result<(), envoi_core::TransportError>>,
) -> Result<Outcome, String>
where
    T: Transport + Setup + Teardown + 'static,
{
    let result = async {
        transport.setup().await.map_err(|e| e.to_string())?;
        drive(transport.clone(), n, BROKER_BATCH).await
    }
    .await;
    let deleted = transport.delete().await.map_err(|e| e.to_string());
    let _ = close.await;
    let outcome = result?;
    deleted?;
    Ok(outcome)
}

/// The count of handled messages and the moment the `n`-th was handled.
#[derive(Debug, Default)]
struct Handled {
    count: AtomicU64,
    last: OnceLock<Instant>,
}

/// A messenger routing [`Order`] to `transport`, whose handler counts into
/// `handled` and notes when it reached `n`.
fn messenger(
    transport: Arc<dyn Transport>,
    handled: &Arc<Handled>,
    n: u64,
) -> Result<Messenger, String> {
    let h = handled.clone();
    Messenger::builder()
        .command_handler(move |order: Order| {
            let h = h.clone();
            async move {
                std::hint::black_box(order.id);
                if h.count.fetch_add(1, Ordering::Relaxed) + 1 == n {
                    let _ = h.last.set(Instant::now());
                }
                Ok::<_, Infallible>(())
            }
        })
        .transport("jobs", transport)
        .route::<Order>("jobs")
        .build()
        .map_err(|e| e.to_string())
}

/// Starts a worker on `transport`, then times [`PRODUCERS`] dispatchers
/// sending `n` orders until the worker has handled the `n`-th.
async fn drive(transport: Arc<dyn Transport>, n: u64, batch: usize) -> Result<Outcome, String> {
    let handled = Arc::new(Handled::default());
    let messenger = messenger(transport, &handled, n)?;
    let worker = Worker::builder(&messenger)
        .receiver("jobs")
        .concurrency(CONCURRENCY)
        .batch_size(batch)
        .message_limit(n)
        .time_limit(Duration::from_secs(600))
        .build()
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let (report, sent) = tokio::join!(worker.run(), produce(&messenger, n));
    sent?;
    let count = handled.count.load(Ordering::Relaxed);
    let last = handled.last.get().copied();
    match last {
        Some(last) if count == n && report.stats.handled == n => Ok(Outcome {
            handled: count,
            seconds: (last - start).as_secs_f64(),
        }),
        _ => Err(format!(
            "envoi handled {count} of {n} messages (worker: {:?}, stopped: {:?})",
            report.stats, report.reason
        )),
    }
}

/// Sends orders `0..n` from [`PRODUCERS`] concurrent dispatchers.
async fn produce(messenger: &Messenger, n: u64) -> Result<(), String> {
    let started = Instant::now();
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let dispatcher = messenger.dispatcher();
        producers.push(tokio::spawn(async move {
            let mut id = p;
            while id < n {
                dispatcher
                    .dispatch(payload(id))
                    .await
                    .map_err(|e| format!("dispatch failed: {e}"))?;
                id += PRODUCERS;
            }
            Ok::<_, String>(())
        }));
    }
    for p in producers {
        p.await.map_err(|e| e.to_string())??;
    }
    eprintln!(
        "  envoi: sent {n} in {:.3}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payload_is_about_a_hundred_bytes_of_json_in_the_shape_the_peers_send() {
        let json = serde_json::to_string(&payload(12_345)).unwrap();
        assert_eq!(
            json,
            r#"{"id":12345,"order":"order-00012345","customer":"customer-00345","amount_cents":4345,"currency":"EUR"}"#
        );
        assert!((90..=110).contains(&json.len()), "{} bytes", json.len());
    }

    #[test]
    fn options_are_appended_to_the_query_string() {
        assert_eq!(with("redis://h", "a=1"), "redis://h?a=1");
        assert_eq!(with("redis://h?x=2", "a=1"), "redis://h?x=2&a=1");
    }
}
