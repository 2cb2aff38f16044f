//! Sending: messages published on the stream's subject, each waiting for
//! JetStream's acknowledgement.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use async_nats::RequestErrorKind;
use bytes::Bytes;
use envoi_core::transport::RawMessage;
use envoi_core::{BoxError, Headers, TransportError};
use futures_util::StreamExt;
use serde::Deserialize;

use crate::headers;
use crate::transport::backend;
use crate::NatsTransport;

/// How long a publish may take, from queueing it on the connection to
/// JetStream's acknowledgement, before it is tried again (the JetStream
/// context's default wait for an acknowledgement).
const PUBLISH_ACK_WAIT: Duration = Duration::from_secs(5);
/// How many publishes of one `send_batch` wait for their acknowledgements at
/// once (the JetStream context's default limit).
const PUBLISHES_IN_FLIGHT: usize = 5_000;
/// How many times a publish whose acknowledgement timed out (or whose
/// connection broke) is tried (with `dedup`, always with the same
/// de-duplication id).
const SEND_ATTEMPTS: usize = 3;

/// Milliseconds since the Unix epoch, by this machine's clock.
pub(crate) fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// The message id of stream sequence `sequence`: its decimal digits
/// (what `to_string` gives, without the formatting machinery).
pub(crate) fn sequence_id(sequence: u64) -> String {
    itoa::Buffer::new().format(sequence).to_owned()
}

/// JetStream's answer to a publish: the stream sequence it stored the
/// message under, or an error (which can come with `"stream"` and
/// `"seq": 0`). Only what `send` needs is read; the client's own response
/// type is parsed through a buffered, untagged representation, several times
/// the work for every message.
#[derive(Deserialize)]
struct PublishAnswer {
    #[serde(default)]
    seq: u64,
    error: Option<jetstream::Error>,
}

/// The stream sequence in JetStream's answer to a publish, or the error it
/// reports.
fn publish_ack(payload: &[u8]) -> Result<u64, BoxError> {
    match serde_json::from_slice::<PublishAnswer>(payload)? {
        PublishAnswer {
            error: Some(error), ..
        } => Err(error.into()),
        PublishAnswer { seq: 0, .. } => {
            Err("JetStream acknowledged the publish without a sequence".into())
        }
        PublishAnswer { seq, .. } => Ok(seq),
    }
}

/// Whether a failed request lost its answer (the client dropped it with the
/// connection) rather than failing for good.
fn answer_lost(error: &async_nats::RequestError) -> bool {
    match error.kind() {
        RequestErrorKind::TimedOut => true,
        RequestErrorKind::Other => std::error::Error::source(error)
            .is_some_and(|source| source.is::<tokio::sync::oneshot::error::RecvError>()),
        _ => false,
    }
}

/// A message ready to publish; kept so that a failed publish can be retried
/// (with `dedup`, under the same de-duplication id).
pub(crate) struct Prepared {
    /// The headers of the first attempt; a retry encodes them again from
    /// `source` (cheaper than copying them for every publish).
    headers: Option<async_nats::HeaderMap>,
    source: Headers,
    /// The de-duplication id every attempt carries (with `dedup`).
    msg_id: Option<uuid::Uuid>,
    not_before: Option<u128>,
    payload: Bytes,
    /// The size of the headers as sent: the server's payload limit counts
    /// them with the body.
    headers_len: usize,
}

impl Prepared {
    /// The headers for the next attempt.
    fn take_headers(&mut self) -> Result<async_nats::HeaderMap, TransportError> {
        match self.headers.take() {
            Some(headers) => Ok(headers),
            None => headers::encode(&self.source, self.msg_id, self.not_before),
        }
    }
}

impl NatsTransport {
    /// Encodes `message` for publishing, refusing it when it is larger
    /// than the server takes.
    pub(crate) fn prepare(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> Result<Prepared, TransportError> {
        let not_before = delay
            .filter(|d| !d.is_zero())
            .map(|d| now_ms() + d.as_millis());
        let msg_id = self.inner.config.dedup.then(uuid::Uuid::new_v4);
        let headers = headers::encode(&message.headers, msg_id, not_before)?;
        let headers_len = headers::encoded_len(&headers);
        let size = message.body.len() + headers_len;
        let known = self.inner.max_payload.load(Ordering::Relaxed);
        if known > 0 && size > known {
            // The limit may have changed with a reconnection: read it again.
            let max_payload = self.inner.client.server_info().max_payload;
            self.inner.max_payload.store(max_payload, Ordering::Relaxed);
            if max_payload > 0 && size > max_payload {
                return Err(TransportError::TooLarge {
                    size,
                    limit: max_payload,
                });
            }
        }
        Ok(Prepared {
            headers_len,
            headers: Some(headers),
            source: message.headers,
            msg_id,
            not_before,
            payload: Bytes::from(message.body),
        })
    }

    /// Publishes every message before any acknowledgement is awaited (up
    /// to [`PUBLISHES_IN_FLIGHT`] at a time): one round trip for the whole
    /// batch instead of one per message. Publishes are first polled, and so
    /// queued on the connection, in the batch's order.
    pub(crate) async fn publish_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> Result<Vec<String>, TransportError> {
        self.check_open()?;
        self.ensure_setup().await?;
        let mut prepared = messages
            .into_iter()
            .map(|(message, delay)| self.prepare(message, delay))
            .collect::<Result<Vec<_>, _>>()?;
        let mut in_flight = futures_util::stream::FuturesOrdered::new();
        let mut ids = Vec::with_capacity(prepared.len());
        for message in &mut prepared {
            if in_flight.len() >= PUBLISHES_IN_FLIGHT {
                if let Some(id) = in_flight.next().await {
                    ids.push(id?);
                }
            }
            in_flight.push_back(self.publish(message));
        }
        while let Some(id) = in_flight.next().await {
            ids.push(id?);
        }
        Ok(ids)
    }

    /// Publishes `prepared` and waits for JetStream's acknowledgement,
    /// trying again when it does not come (timed out, connection broken). With
    /// `dedup` the de-duplication id makes a retry store the message at most
    /// once; without, the first attempt may have been stored too (at least
    /// once). The request goes through the client's shared reply
    /// subscription, like the JetStream context's publish.
    pub(crate) async fn publish(&self, prepared: &mut Prepared) -> Result<String, TransportError> {
        for tries in 1..=SEND_ATTEMPTS {
            // One deadline for queueing the request (the connection may be
            // reconnecting) and for the acknowledgement.
            let request = async_nats::Request::new()
                .headers(prepared.take_headers()?)
                .payload(prepared.payload.clone())
                .timeout(None);
            let failed = |hint: &str, error: BoxError| {
                backend(
                    format!(
                        "publishing to `{}` after {tries} attempt(s){hint}",
                        self.inner.names.subject
                    ),
                    error,
                )
            };
            let answer = tokio::time::timeout(
                PUBLISH_ACK_WAIT,
                self.inner
                    .client
                    .send_request(self.inner.subject.clone(), request),
            )
            .await
            .unwrap_or_else(|_| Err(async_nats::RequestError::new(RequestErrorKind::TimedOut)));
            let error = match answer {
                Ok(answer) => {
                    return publish_ack(&answer.payload)
                        .map(sequence_id)
                        .map_err(|e| failed("", e))
                }
                Err(e) if e.kind() == RequestErrorKind::MaxPayloadExceeded => {
                    return Err(TransportError::TooLarge {
                        size: prepared.payload.len() + prepared.headers_len,
                        limit: self.inner.client.server_info().max_payload,
                    })
                }
                Err(e) if e.kind() == RequestErrorKind::NoResponders => {
                    return Err(failed(
                        " (no stream captures the subject: run setup)",
                        e.into(),
                    ))
                }
                Err(e) if !answer_lost(&e) || tries == SEND_ATTEMPTS => {
                    return Err(failed("", e.into()))
                }
                Err(e) => e,
            };
            tracing::debug!(%error, tries, dedup = prepared.msg_id.is_some(), "publish not acknowledged; retrying");
        }
        unreachable!("the loop returns on its last attempt")
    }
}

#[cfg(test)]
mod tests {
    use super::{publish_ack, sequence_id};
    use crate::settle::parse_id;

    #[test]
    fn publish_answers_give_the_sequence_or_the_error() {
        assert_eq!(
            publish_ack(br#"{"stream":"orders","seq":42}"#).ok(),
            Some(42)
        );
        assert_eq!(
            publish_ack(br#"{"stream":"o","seq":7,"duplicate":true,"domain":"hub"}"#).ok(),
            Some(7)
        );
        let error = publish_ack(
            br#"{"stream":"orders","seq":0,"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}"#,
        )
        .unwrap_err();
        assert!(
            error.to_string().contains("maximum messages exceeded"),
            "{error}"
        );
        let error = publish_ack(br#"{"error":{"code":400,"description":"bad"}}"#).unwrap_err();
        assert!(error.to_string().contains("bad"), "{error}");
        assert!(publish_ack(br#"{"stream":"orders"}"#).is_err());
        assert!(publish_ack(b"").is_err());
        assert!(publish_ack(b"+OK").is_err());
        assert!(publish_ack(br#"{"seq":"x"}"#).is_err());
    }

    #[test]
    fn sequence_ids_are_decimal_digits() {
        for n in [0, 1, 9, 10, 42, 1_000_000, u64::MAX] {
            assert_eq!(sequence_id(n), n.to_string());
            assert_eq!(parse_id(&sequence_id(n)), Some(n).filter(|n| *n > 0));
        }
    }
}
