//! `nats_e2e`: the NATS JetStream transport against raw async-nats.
//!
//! The baseline does what envoi's transport does: a file-backed
//! work-queue stream (envoi's default storage) and a durable pull consumer
//! with explicit acks and unlimited `max_ack_pending`; [`PRODUCERS`]
//! concurrent publishers, each awaiting its publish ack; then pull
//! requests of 500 messages, the next one running while a batch is
//! handled ([`pipeline`]). Each batch is acknowledged as envoi acknowledges
//! one: every ack published, the last one as a request the server answers
//! once it has applied them (`double_ack`), so an acknowledgement is known
//! to have landed; this runs while the next batch is pulled. Every job
//! must come once, every batch's acks be confirmed, and the stream be
//! empty at the end (a work queue drops what is acknowledged).
//!
//! [`PRODUCERS`]: crate::e2e::PRODUCERS

use std::sync::Arc;
use std::time::Instant;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, consumer, stream, Message};
use envoi_core::transport::Setup;
use futures_util::StreamExt;

use super::probe::envoi_side;
use super::{
    and_then_clean, body, delete_then_close, log_baseline, run_scenario, send_all, unique,
    with_options, Broker, BATCH, KIND, TYPE,
};
use crate::pipeline;
use crate::tally::{settled, Tally};

/// `nats_e2e`.
pub(crate) fn scenario() -> Result<(), String> {
    run_scenario(Broker {
        scenario: "nats_e2e",
        url_var: "ENVOI_NATS_URL",
        envoi: |url, n| Box::pin(nats_envoi(url, n)),
        baseline: |url, n| Box::pin(nats_baseline(url, n)),
    })
}

async fn nats_envoi(url: &str, n: u64) -> Result<f64, String> {
    let name = format!("envoi-bench-{}", unique());
    let dsn = with_options(
        url,
        &format!(
            "stream={name}&subject={subject}&consumer={name}&batch={BATCH}",
            subject = name.replace('-', ".")
        ),
    );
    let transport = envoi_nats::NatsTransport::connect("jobs", &dsn)
        .await
        .map_err(|e| e.to_string())?;
    let transport = Arc::new(transport);
    and_then_clean(
        async {
            transport.setup().await.map_err(|e| e.to_string())?;
            envoi_side(transport.clone(), n).await
        },
        delete_then_close(&*transport, transport.close()),
    )
    .await
}

/// One pull request for up to [`BATCH`] messages.
async fn pull(consumer: Arc<PullConsumer>) -> Result<Vec<Message>, String> {
    let mut messages = consumer
        .fetch()
        .max_messages(BATCH)
        .messages()
        .await
        .map_err(|e| format!("fetch failed: {e}"))?;
    let mut batch = Vec::with_capacity(BATCH);
    while let Some(message) = messages.next().await {
        batch.push(message.map_err(|e| format!("fetch failed: {e}"))?);
    }
    Ok(batch)
}

/// Acknowledges `batch`: every ack published, the last one confirmed by
/// the server; answers how many.
async fn ack_confirmed(batch: Vec<Message>) -> Result<u64, String> {
    let Some((last, rest)) = batch.split_last() else {
        return Ok(0);
    };
    for message in rest {
        message
            .ack()
            .await
            .map_err(|e| format!("ack failed: {e}"))?;
    }
    last.double_ack()
        .await
        .map_err(|e| format!("confirmed ack failed: {e}"))?;
    Ok(batch.len() as u64)
}

/// Pulls and acknowledges until all `n` are consumed, pipelined.
async fn consume(consumer: PullConsumer, n: u64) -> Result<(), String> {
    let consumer = Arc::new(consumer);
    let mut tally = Tally::new(n);
    let done = pipeline::consume(
        n,
        move || pull(consumer.clone()),
        |message: Message| tally.body(&message.payload).map(|()| message),
        ack_confirmed,
    )
    .await?;
    tally.finish()?;
    settled("confirmed acks", done.settled, done.messages)
}

/// The baseline on a stream of its own, deleted at the end.
async fn nats_baseline(url: &str, n: u64) -> Result<f64, String> {
    let name: &str = &format!("envoi-bench-{}-raw", unique());
    let client = async_nats::connect(url)
        .await
        .map_err(|e| format!("connecting to nats: {e}"))?;
    let js = jetstream::new(client.clone());
    let subject = name.replace('-', ".");
    let run = async {
        let mut stream = js
            .create_stream(stream::Config {
                name: name.to_string(),
                subjects: vec![subject.clone()],
                retention: stream::RetentionPolicy::WorkQueue,
                storage: stream::StorageType::File,
                num_replicas: 1,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating stream {name}: {e}"))?;
        let consumer = stream
            .create_consumer(consumer::pull::Config {
                durable_name: Some(name.to_string()),
                ack_policy: consumer::AckPolicy::Explicit,
                max_ack_pending: -1,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating consumer {name}: {e}"))?;
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("type", TYPE);
        headers.insert("kind", KIND);

        let start = Instant::now();
        let (js2, subject2) = (js.clone(), subject.clone());
        send_all(n, move |id| {
            let (js, subject, headers) = (js2.clone(), subject2.clone(), headers.clone());
            async move {
                js.publish_with_headers(subject, headers, body(id)?.into())
                    .await
                    .map_err(|e| format!("publish failed: {e}"))?
                    .await
                    .map(drop)
                    .map_err(|e| format!("publish ack failed: {e}"))
            }
        })
        .await?;
        let sent = start.elapsed();
        consume(consumer, n).await?;
        log_baseline(n, start, sent);
        let rate = n as f64 / start.elapsed().as_secs_f64();
        let info = stream
            .info()
            .await
            .map_err(|e| format!("stream info: {e}"))?;
        match info.state.messages {
            0 => Ok(rate),
            left => Err(format!(
                "{left} messages left in the stream after acking all {n}"
            )),
        }
    };
    let delete = async {
        js.delete_stream(name)
            .await
            .map(drop)
            .map_err(|e| format!("deleting stream {name}: {e}"))
    };
    let result = and_then_clean(run, delete).await;
    let _ = client.flush().await;
    result
}
