//! `amqp_e2e`: the RabbitMQ transport against raw lapin.
//!
//! The baseline does what envoi's transport does: a durable quorum queue
//! (envoi's default), persistent messages published by [`PRODUCERS`]
//! concurrent senders on one confirm-mode channel, each awaiting its own
//! confirm (as each envoi `send` does); then one `basic.consume` with
//! envoi's prefetch of 1,000, handing out what has arrived up to 500 at a
//! time (envoi's `get`). Each batch is acknowledged with one `basic.ack`
//! with `multiple` (as envoi acknowledges a batch whose tags are all below
//! what anyone else holds), sent while the next batch is taken, one
//! acknowledgement in flight at a time, as the worker does. The delivery
//! tags must run 1, 2, 3, … without a redelivery, the last acknowledged tag
//! must be N, and once the consumer's channel is closed the queue must
//! hold nothing (a message left unacknowledged would be back in it).
//!
//! [`PRODUCERS`]: crate::e2e::PRODUCERS

use std::sync::Arc;
use std::time::Instant;

use envoi_core::transport::Setup;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::task::JoinHandle;

use super::probe::envoi_side;
use super::{
    and_then_clean, body, delete_then_close, log_baseline, run_scenario, send_all, unique,
    with_options, Broker, BATCH, KIND, TYPE,
};
use crate::tally::Tally;

/// RabbitMQ prefetch of both consumers.
const PREFETCH: u16 = 1000;

/// `amqp_e2e`.
pub(crate) fn scenario() -> Result<(), String> {
    run_scenario(Broker {
        scenario: "amqp_e2e",
        url_var: "ENVOI_AMQP_URL",
        envoi: |url, n| Box::pin(amqp_envoi(url, n)),
        baseline: |url, n| Box::pin(amqp_baseline(url, n)),
    })
}

async fn amqp_envoi(url: &str, n: u64) -> Result<f64, String> {
    let queue = format!("envoi-bench-{}", unique());
    // `expires` only removes the queues should the run die before deleting
    // them.
    let dsn = with_options(
        url,
        &format!("queue={queue}&exchange={queue}&prefetch={PREFETCH}&expires=10m"),
    );
    let transport = envoi_amqp::AmqpTransport::connect("jobs", &dsn)
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

fn short(s: &str) -> Result<ShortString, String> {
    ShortString::try_new(s).map_err(|e| e.to_string())
}

/// Declares `queue` (durable, quorum, expiring should the run die first);
/// with `passive`, only looks it up. Answers how many messages it holds
/// ready.
async fn declare(channel: &Channel, queue: &str, passive: bool) -> Result<u32, String> {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert("x-expires".into(), AMQPValue::LongLongInt(600_000));
    let options = QueueDeclareOptions {
        durable: true,
        passive,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(short(queue)?, options, args)
        .await
        .map(|q| q.message_count())
        .map_err(|e| format!("declaring queue {queue}: {e}"))
}

/// Publishes jobs `0..n` from [`PRODUCERS`](crate::e2e::PRODUCERS)
/// concurrent senders on one confirm-mode channel, each awaiting its
/// confirm.
async fn publish(connection: &Connection, queue: &str, n: u64) -> Result<(), String> {
    let publisher = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let mut headers = FieldTable::default();
    headers.insert("type".into(), AMQPValue::LongString(LongString::from(TYPE)));
    headers.insert("kind".into(), AMQPValue::LongString(LongString::from(KIND)));
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    let routing_key = short(queue)?;
    send_all(n, move |id| {
        let (publisher, properties, key) =
            (publisher.clone(), properties.clone(), routing_key.clone());
        async move {
            let confirm = publisher
                .basic_publish(
                    ShortString::from(""),
                    key,
                    BasicPublishOptions::default(),
                    &body(id)?,
                    properties,
                )
                .await
                .map_err(|e| format!("publish failed: {e}"))?
                .await
                .map_err(|e| format!("confirm failed: {e}"))?;
            match confirm {
                Confirmation::Ack(_) => Ok(()),
                other => Err(format!("publish not confirmed: {other:?}")),
            }
        }
    })
    .await
}

/// `basic.ack` of every delivery up to `tag`, on its own task.
fn ack_upto(channel: &Channel, tag: u64) -> JoinHandle<Result<(), String>> {
    let channel = channel.clone();
    tokio::spawn(async move {
        channel
            .basic_ack(tag, BasicAckOptions { multiple: true })
            .await
            .map_err(|e| format!("ack failed: {e}"))
    })
}

/// Consumes `n` messages on a channel of its own, acknowledging each batch
/// with `multiple`, overlapped; closes the channel; answers the last tag
/// acknowledged.
async fn consume(connection: &Connection, queue: &str, n: u64) -> Result<u64, String> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let consumer = channel
        .basic_consume(
            short(queue)?,
            short("bench-raw")?,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    let mut batches = consumer.ready_chunks(BATCH);
    let mut tally = Tally::new(n);
    let (mut consumed, mut acked_upto) = (0u64, 0u64);
    let mut acking: Option<JoinHandle<Result<(), String>>> = None;
    while consumed < n {
        let Some(batch) = batches.next().await else {
            return Err(format!("consumer ended after {consumed} of {n}"));
        };
        if let Some(acked) = acking.take() {
            acked.await.map_err(|e| e.to_string())??;
        }
        for delivery in batch {
            let delivery = delivery.map_err(|e| format!("consume failed: {e}"))?;
            consumed += 1;
            if delivery.delivery_tag != consumed || delivery.redelivered {
                return Err(format!(
                    "delivery {consumed} came with tag {} (redelivered: {})",
                    delivery.delivery_tag, delivery.redelivered
                ));
            }
            tally.body(&delivery.data)?;
        }
        acking = Some(ack_upto(&channel, consumed));
        acked_upto = consumed;
    }
    if let Some(acked) = acking {
        acked.await.map_err(|e| e.to_string())??;
    }
    tally.finish()?;
    // Closing sends the acknowledgements ahead of it; whatever they missed
    // goes back to the queue.
    channel
        .close(200, "done".into())
        .await
        .map_err(|e| format!("closing the consumer's channel: {e}"))?;
    Ok(acked_upto)
}

/// The baseline on a queue of its own, deleted at the end.
async fn amqp_baseline(url: &str, n: u64) -> Result<f64, String> {
    let queue: &str = &format!("envoi-bench-{}-raw", unique());
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("connecting to rabbitmq: {e}"))?;
    let admin = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    let run = async {
        declare(&admin, queue, false).await?;
        let start = Instant::now();
        publish(&connection, queue, n).await?;
        let sent = start.elapsed();
        let acked_upto = consume(&connection, queue, n).await?;
        log_baseline(n, start, sent);
        let rate = n as f64 / start.elapsed().as_secs_f64();
        if acked_upto != n {
            return Err(format!("acknowledged up to tag {acked_upto} of {n}"));
        }
        match declare(&admin, queue, true).await? {
            0 => Ok(rate),
            left => Err(format!(
                "{left} messages left in the queue after acking all {n}"
            )),
        }
    };
    let delete = async {
        admin
            .queue_delete(short(queue)?, QueueDeleteOptions::default())
            .await
            .map(drop)
            .map_err(|e| format!("deleting queue {queue}: {e}"))
    };
    let result = and_then_clean(run, delete).await;
    let _ = connection.close(200, "done".into()).await;
    result
}
