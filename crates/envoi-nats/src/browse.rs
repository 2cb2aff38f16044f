//! Looking at the stream without taking anything from it: counting, listing
//! and finding messages.

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use envoi_core::transport::{Browse, Delivery, DeliveryId, MessageCount};
use envoi_core::{BoxFuture, TransportError};

use crate::headers;
use crate::settle::parse_id;
use crate::transport::backend;
use crate::NatsTransport;

fn stream_message_to_delivery(message: StreamMessage) -> Delivery {
    Delivery::new(
        message.sequence.to_string(),
        headers::decode(Some(&message.headers), &message.payload),
    )
}

impl MessageCount for NatsTransport {
    /// The consumer's `num_pending + num_ack_pending`: waiting, leased and
    /// delayed messages. Acks are confirmed before they return, so it never
    /// counts a message this handle acknowledged.
    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            self.check_open()?;
            self.ensure_setup().await?;
            let stream = self.open_stream().await?;
            let info = stream
                .consumer_info(self.consumer())
                .await
                .map_err(|e| backend(format!("reading consumer `{}`", self.consumer()), e))?;
            Ok(info.num_pending + info.num_ack_pending as u64)
        })
    }
}

impl Browse for NatsTransport {
    /// `STREAM.MSG.GET` by subject from sequence 1, oldest first.
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            self.check_open()?;
            self.ensure_setup().await?;
            let stream = self.open_stream().await?;
            let mut out = Vec::new();
            let mut sequence = 1;
            while out.len() < limit {
                match stream
                    .get_first_raw_message_by_subject(self.subject(), sequence)
                    .await
                {
                    Ok(message) => {
                        sequence = message.sequence + 1;
                        out.push(stream_message_to_delivery(message));
                    }
                    Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => break,
                    Err(e) => {
                        return Err(backend(format!("listing stream `{}`", self.stream()), e))
                    }
                }
            }
            Ok(out)
        })
    }

    /// `STREAM.MSG.GET` by sequence; `None` for an id that is not a stream
    /// sequence, or names a message gone or on another subject.
    fn find<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        Box::pin(async move {
            self.check_open()?;
            let Some(sequence) = parse_id(id.as_str()) else {
                return Ok(None);
            };
            self.ensure_setup().await?;
            let stream = self.open_stream().await?;
            match stream.get_raw_message(sequence).await {
                Ok(message) if message.subject.as_str() == self.subject() => {
                    Ok(Some(stream_message_to_delivery(message)))
                }
                Ok(_) => Ok(None),
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
                Err(e) => Err(backend(format!("reading message {sequence}"), e)),
            }
        })
    }
}
