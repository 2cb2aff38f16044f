//! Pull requests: one batch of messages from the durable consumer, read off
//! a plain subscription, and giving back what is not handed out.

use std::time::Duration;

use async_nats::jetstream::consumer::pull::BatchConfig;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::AckKind;
use async_nats::{StatusCode, Subject};
use envoi_core::TransportError;
use futures_util::StreamExt;

use crate::transport::backend;

/// Extra time a fetch gets beyond its expiry before it is considered
/// stalled and abandoned.
const FETCH_GRACE: Duration = Duration::from_secs(1);

/// How a pull request ended.
#[derive(Debug)]
pub(crate) enum FetchEnd {
    /// The server ended it (batch complete, expired, no messages).
    Done,
    /// No end came within the expiry plus [`FETCH_GRACE`].
    Stalled,
    /// The request or a message failed.
    Failed(TransportError),
}

/// What the ack subject of a delivery tells of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeliveryInfo {
    /// The stream sequence: the message's id.
    pub(crate) sequence: u64,
    /// How many times JetStream delivered it, this time included.
    pub(crate) delivered: u64,
    /// When the message was stored (nanoseconds since the epoch): with the
    /// sequence, it tells one stored message from any other, even in a
    /// stream deleted and made again, whose sequences start over.
    pub(crate) stored: u64,
}

/// The stream sequence, delivery count and storage time in a JetStream ack
/// subject: `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.
/// <consumer seq>.<timestamp>.<pending>`, or the same with `<domain>.
/// <account hash>` before the stream and possibly more tokens after
/// `<pending>` (ADR-15). One pass over the bytes; only the three numbers
/// `get` needs are parsed.
pub(crate) fn delivery_info(reply: &str) -> Option<DeliveryInfo> {
    let tokens = reply.strip_prefix("$JS.ACK.")?;
    // Where each of the first nine tokens starts, and how many there are.
    let mut starts = [0; 9];
    let mut count = 1;
    for (at, byte) in tokens.bytes().enumerate() {
        if byte == b'.' {
            if let Some(start) = starts.get_mut(count) {
                *start = at + 1;
            }
            count += 1;
        }
    }
    let delivered = match count {
        7 => 2,
        n if n >= 9 => 4,
        _ => return None,
    };
    let token = |i: usize| tokens.get(starts[i]..starts[i + 1] - 1)?.parse().ok();
    Some(DeliveryInfo {
        sequence: token(delivered + 1)?,
        delivered: token(delivered)?,
        stored: token(delivered + 3)?,
    })
}

/// Gives `messages` back to JetStream (`-NAK`), so they are delivered
/// again at once rather than after the lease.
pub(crate) async fn give_back(client: &async_nats::Client, messages: Vec<async_nats::Message>) {
    for message in messages {
        if let Some(reply) = message.reply {
            if let Err(error) = client.publish(reply, AckKind::Nak(None).into()).await {
                tracing::debug!(%error, "could not give back a message fetched but not handed out");
            }
        }
    }
}

/// One pull request for up to `want` messages, waiting up to `expires`.
/// Returns what arrived and how the request ended.
///
/// This is what the consumer's `fetch()` does, reading the replies off a
/// plain subscription: `fetch()` hands out every message with its own copy
/// of the JetStream context, which the transport never uses and which costs
/// an allocation and a dozen reference counts per message to make and drop.
pub(crate) async fn fetch_once(
    client: &async_nats::Client,
    consumer: &PullConsumer,
    want: usize,
    expires: Duration,
) -> (Vec<async_nats::Message>, FetchEnd) {
    let hard_deadline = tokio::time::Instant::now() + expires + FETCH_GRACE;
    let mut messages = Vec::new();
    // One deadline for the request and every message: a timer per message
    // would be armed and disarmed hundreds of times per batch.
    let collect = async {
        let inbox = Subject::from(client.new_inbox());
        let mut replies = match client.subscribe(inbox.clone()).await {
            Ok(replies) => replies,
            Err(e) => return FetchEnd::Failed(backend("requesting a batch", e)),
        };
        let request = BatchConfig {
            batch: want,
            expires: Some(expires),
            no_wait: true,
            ..BatchConfig::default()
        };
        if let Err(e) = consumer.request_batch(request, inbox).await {
            return FetchEnd::Failed(backend("requesting a batch", e));
        }
        messages.reserve_exact(want);
        while messages.len() < want {
            // The subscription ends only when the client is closed.
            let Some(message) = replies.next().await else {
                break;
            };
            match message.status {
                None | Some(StatusCode::OK) => messages.push(message),
                Some(StatusCode::IDLE_HEARTBEAT) => {}
                // Expired, or (no_wait) nothing more to deliver.
                Some(StatusCode::TIMEOUT | StatusCode::NOT_FOUND) => break,
                Some(status) => {
                    return FetchEnd::Failed(backend(
                        "fetching messages",
                        format!(
                            "the server ended the pull request: {status} {}",
                            message.description.as_deref().unwrap_or_default()
                        ),
                    ))
                }
            }
        }
        FetchEnd::Done
    };
    match tokio::time::timeout_at(hard_deadline, collect).await {
        Ok(end) => (messages, end),
        // The server's end-of-batch never came: a stalled pull (a lost
        // connection or subscription, a consumer gone missing).
        Err(_) => (messages, FetchEnd::Stalled),
    }
}

/// [`fetch_once`] for the next `get`, run in the background: what arrived
/// when the request ended normally, or the error after giving back what
/// arrived (the consumer is then re-bound by the `get` that finds it).
pub(crate) async fn fetch_ahead(
    client: async_nats::Client,
    consumer: std::sync::Arc<PullConsumer>,
    want: usize,
    expires: Duration,
) -> Result<Vec<async_nats::Message>, TransportError> {
    let (messages, end) = fetch_once(&client, &consumer, want, expires).await;
    let error = match end {
        FetchEnd::Done => return Ok(messages),
        FetchEnd::Stalled => backend("fetching messages ahead", "the pull request got no answer"),
        FetchEnd::Failed(error) => error,
    };
    give_back(&client, messages).await;
    Err(error)
}

#[cfg(test)]
mod tests {
    use super::{delivery_info, DeliveryInfo};

    fn info(sequence: u64, delivered: u64, stored: u64) -> Option<DeliveryInfo> {
        Some(DeliveryInfo {
            sequence,
            delivered,
            stored,
        })
    }

    #[test]
    fn ack_subjects_of_both_formats_give_sequence_delivery_count_and_storage_time() {
        assert_eq!(
            delivery_info("$JS.ACK.orders.workers.3.1042.1040.1700000000000000001.7"),
            info(1042, 3, 1_700_000_000_000_000_001)
        );
        assert_eq!(
            delivery_info("$JS.ACK._.ACCHASH.orders.workers.1.5.5.1700000000000000002.0"),
            info(5, 1, 1_700_000_000_000_000_002)
        );
        assert_eq!(
            delivery_info(
                "$JS.ACK.hub.ACCHASH.orders.workers.2.77.70.1700000000000000003.0.r4nd0m"
            ),
            info(77, 2, 1_700_000_000_000_000_003)
        );
        for bad in [
            "",
            "_INBOX.abc",
            "$JS.ACK.orders.workers.3.1042",
            "$JS.ACK.orders.workers.3.x.1040.1700000000000000000.7",
            "$JS.ACK.a.b.c.d.e.f.g.h",
            "$JS.ACK.orders.workers.-1.5.5.1700000000000000000.0",
            "$JS.ACK.orders.workers.1.5.5.later.0",
        ] {
            assert_eq!(delivery_info(bad), None, "{bad}");
        }
    }
}
