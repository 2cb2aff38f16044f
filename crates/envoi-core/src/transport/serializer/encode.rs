//! Encoding: an envelope as a [`RawMessage`], its stamps grouped into one
//! JSON array header per stamp name.

use serde::Serialize;

use super::{
    is_history, Inner, OpaqueStamp, Serializer, INVALID_BODY_HEADER, INVALID_HEADERS_HEADER,
    KIND_HEADER, STAMP_HEADER_PREFIX, STAMP_HISTORY, TYPE_HEADER,
};
use crate::envelope::headers::{Headers, BUS_NAME_HEADER};
use crate::envelope::stamp::{
    BusNameStamp, DelayStamp, ErasedStamp, HandledStamp, MessageIdStamp,
    SentToFailureTransportStamp,
};
use crate::envelope::Envelope;
use crate::error::SerializationError;
use crate::middleware::correlation::{CausationIdStamp, CorrelationIdStamp};
use crate::transport::RawMessage;

impl Serializer {
    /// Encodes `envelope`: the message as the body, its kind, type, sendable
    /// stamps and headers as headers.
    pub fn encode(&self, envelope: &Envelope) -> Result<RawMessage, SerializationError> {
        let name = envelope.message_name();
        let Some((_, codec)) = self.inner.by_type.get(&envelope.message_type_id()) else {
            return Err(SerializationError::NotRegistered(name));
        };
        let body = match (codec.encode)(envelope) {
            Some(Ok(body)) => body,
            Some(Err(source)) => {
                return Err(SerializationError::Encode {
                    message: name,
                    source,
                })
            }
            None => return Err(SerializationError::NotRegistered(name)),
        };
        if body.len() > self.inner.max_body_size {
            return Err(SerializationError::TooLarge {
                size: body.len(),
                limit: self.inner.max_body_size,
            });
        }
        // Room for every header at once: the two fixed ones, the envelope's,
        // and at most one per stamp.
        let mut headers =
            Headers::with_capacity(2 + envelope.headers().count() + envelope.stamp_count());
        for (key, value) in envelope.headers() {
            if is_reserved(key) {
                return Err(SerializationError::InvalidHeader {
                    header: key.to_string(),
                    reason: "the name is reserved by the serializer".into(),
                });
            }
            headers.insert(key.to_string(), value.to_string());
        }
        // Stamp headers (`X-…`) sort before `kind`, which sorts before
        // `type`: added in that order, each header goes at the end.
        encode_stamps(&self.inner, envelope, &mut headers)?;
        headers.insert(KIND_HEADER, envelope.kind().as_str());
        headers.insert(TYPE_HEADER, name);
        self.check_headers_size(&headers)?;
        Ok(RawMessage { body, headers })
    }
}

fn is_reserved(header: &str) -> bool {
    header == TYPE_HEADER
        || header == KIND_HEADER
        || header.starts_with(STAMP_HEADER_PREFIX)
        || header == INVALID_HEADERS_HEADER
        || header == INVALID_BODY_HEADER
}

/// Groups the sendable stamps by name, keeping each type's order, and writes
/// one JSON array header per name, in order of first appearance.
///
/// Each group is written straight into the buffer that becomes the header's
/// value: no intermediate `serde_json::Value`s or strings for the stamps the
/// serializer knows to write directly (see [`write_stamp`]).
fn encode_stamps(
    inner: &Inner,
    envelope: &Envelope,
    headers: &mut Headers,
) -> Result<(), SerializationError> {
    let mut opaque = false;
    for (index, stamp) in envelope.stamps().enumerate() {
        if !stamp.sendable() {
            continue;
        }
        if stamp.as_any().is::<OpaqueStamp>() {
            opaque = true;
            continue;
        }
        let name = stamp.name();
        // Written with the first stamp of its name, together with the rest.
        if envelope
            .stamps()
            .take(index)
            .any(|s| s.sendable() && s.name() == name && !s.as_any().is::<OpaqueStamp>())
        {
            continue;
        }
        // The bus-name stamp every dispatched message carries, alone under
        // its name: its header is written once per bus and then shared.
        if let Some(bus) = stamp.as_any().downcast_ref::<BusNameStamp>() {
            let alone = !envelope
                .stamps()
                .skip(index + 1)
                .any(|s| s.sendable() && s.name() == name);
            if let Some((_, value)) = alone.then(|| inner.known_bus(&bus.bus)).flatten() {
                headers.insert(BUS_NAME_HEADER, value);
                continue;
            }
        }
        let same = |s: &&dyn ErasedStamp| {
            s.sendable() && s.name() == name && !s.as_any().is::<OpaqueStamp>()
        };
        let group = || std::iter::once(stamp).chain(envelope.stamps().skip(index + 1).filter(same));
        // Retry history: only the newest stamps.
        let skip = if is_history(name) {
            group().count().saturating_sub(STAMP_HISTORY)
        } else {
            0
        };
        let mut json = Vec::with_capacity(32);
        json.push(b'[');
        for (i, stamp) in group().skip(skip).enumerate() {
            if i > 0 {
                json.push(b',');
            }
            write_stamp(stamp, &mut json)?;
        }
        json.push(b']');
        let json = String::from_utf8(json).map_err(|_| SerializationError::InvalidHeader {
            header: stamp_header(name),
            reason: "the stamp did not serialize to UTF-8 JSON".into(),
        })?;
        headers.insert(stamp_header(name), json);
    }
    if !opaque {
        return Ok(());
    }
    for o in envelope
        .stamps()
        .filter_map(|s| s.as_any().downcast_ref::<OpaqueStamp>())
    {
        let key = stamp_header(&o.name);
        // The same name twice: merge the arrays when both are arrays,
        // otherwise keep what is there and append the opaque value.
        let value = match headers.get(&key) {
            None => o.value.clone(),
            Some(existing) => merge_arrays(existing, &o.value),
        };
        headers.insert(key, value);
    }
    Ok(())
}

/// `X-Message-Stamp-<name>`.
pub(super) fn stamp_header(name: &str) -> String {
    let mut key = String::with_capacity(STAMP_HEADER_PREFIX.len() + name.len());
    key.push_str(STAMP_HEADER_PREFIX);
    key.push_str(name);
    key
}

/// Writes `stamp` as JSON to `out`.
///
/// The wire format is the stamp as a `serde_json::Value` writes it, whose
/// objects have their keys sorted. The built-in stamps with at most one
/// field serialize to exactly that directly, so they are written without
/// the intermediate value; every other stamp goes through
/// [`ErasedStamp::to_json`].
fn write_stamp(stamp: &dyn ErasedStamp, out: &mut Vec<u8>) -> Result<(), SerializationError> {
    fn direct<S: Serialize + 'static>(
        stamp: &dyn ErasedStamp,
        out: &mut Vec<u8>,
    ) -> Option<Result<(), serde_json::Error>> {
        let s = stamp.as_any().downcast_ref::<S>()?;
        Some(serde_json::to_writer(out, s))
    }
    let written = direct::<BusNameStamp>(stamp, out)
        .or_else(|| direct::<HandledStamp>(stamp, out))
        .or_else(|| direct::<MessageIdStamp>(stamp, out))
        .or_else(|| direct::<CorrelationIdStamp>(stamp, out))
        .or_else(|| direct::<CausationIdStamp>(stamp, out))
        .or_else(|| direct::<DelayStamp>(stamp, out))
        .or_else(|| direct::<SentToFailureTransportStamp>(stamp, out));
    let written = match written {
        Some(written) => written,
        None => serde_json::to_writer(out, &stamp_json(stamp)?),
    };
    written.map_err(|e| SerializationError::Encode {
        message: "stamp",
        source: e,
    })
}

fn stamp_json(stamp: &dyn ErasedStamp) -> Result<serde_json::Value, SerializationError> {
    stamp
        .to_json()
        .ok_or_else(|| SerializationError::InvalidHeader {
            header: stamp_header(stamp.name()),
            reason: "the stamp did not serialize to JSON".into(),
        })
}

fn merge_arrays(first: &str, second: &str) -> String {
    let a: Result<Vec<serde_json::Value>, _> = serde_json::from_str(first);
    let b: Result<Vec<serde_json::Value>, _> = serde_json::from_str(second);
    match (a, b) {
        (Ok(mut a), Ok(b)) => {
            a.extend(b);
            serde_json::to_string(&a).unwrap_or_else(|_| first.to_string())
        }
        _ => format!("[{first},{second}]"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::stamp::{
        ErrorDetailsStamp, ReceivedStamp, RedeliveredStamp, RedeliveryStamp, SentStamp,
    };
    use crate::middleware::dedup::DedupClaimStamp;
    use crate::transport::serializer::fixtures::{order, serializer};

    #[test]
    fn unregistered_messages_do_not_encode() {
        let e = Serializer::default()
            .encode(&Envelope::new(order()))
            .unwrap_err();
        assert!(matches!(e, SerializationError::NotRegistered("Order")));
    }

    #[test]
    fn non_sendable_stamps_are_dropped() {
        let raw = serializer()
            .encode(
                &Envelope::new(order())
                    .with(ReceivedStamp::new("async"))
                    .with(SentStamp::new("async")),
            )
            .unwrap();
        assert!(raw
            .headers
            .keys()
            .all(|k| !k.starts_with(STAMP_HEADER_PREFIX)));
    }

    #[test]
    fn reserved_envelope_headers_are_refused() {
        let e = serializer()
            .encode(&Envelope::new(order()).with_header("type", "x"))
            .unwrap_err();
        assert_eq!(e.kind(), "invalid_header");
        // The markers of a message that must not decode: a header of that
        // name would make this one undecodable.
        for marker in [INVALID_HEADERS_HEADER, INVALID_BODY_HEADER] {
            let e = serializer()
                .encode(&Envelope::new(order()).with_header(marker, "x"))
                .unwrap_err();
            assert_eq!(e.kind(), "invalid_header", "{marker}");
        }
    }

    #[test]
    fn a_redelivered_stamp_is_never_sent_and_no_stored_header_makes_one() {
        let plain = serializer().encode(&Envelope::new(order())).unwrap();
        let marked = serializer()
            .encode(&Envelope::new(order()).with(RedeliveredStamp::new()))
            .unwrap();
        assert_eq!(marked, plain, "the mark is the transport's: it is not sent");
        let mut forged = plain.clone();
        forged.headers.insert("X-Envoi-Redelivered", "true");
        let back = serializer().decode(&forged).unwrap();
        assert!(!back.has::<RedeliveredStamp>(), "only a transport marks it");
    }

    /// The stamps `write_stamp` writes directly must come out exactly as
    /// through `serde_json::Value` (sorted keys), the wire format.
    #[test]
    fn stamps_written_directly_match_their_json_value() {
        let id = uuid::Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
        let stamps: Vec<Box<dyn ErasedStamp>> = vec![
            Box::new(BusNameStamp::new("command.bus")),
            Box::new(HandledStamp::new("h \"q\"", Default::default())),
            Box::new(MessageIdStamp { id }),
            Box::new(CorrelationIdStamp { id }),
            Box::new(CausationIdStamp { id }),
            Box::new(DelayStamp { ms: 1500 }),
            Box::new(SentToFailureTransportStamp {
                original_transport: "async".into(),
            }),
            Box::new(RedeliveryStamp {
                retry_count: 2,
                at: 7,
            }),
            Box::new(ErrorDetailsStamp {
                kind: "k".into(),
                message: "m".into(),
                chain: vec!["c".into()],
            }),
        ];
        for stamp in stamps {
            let mut out = Vec::new();
            write_stamp(&*stamp, &mut out).unwrap();
            let expected = serde_json::to_string(&stamp.to_json().unwrap()).unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), expected, "{stamp:?}");
        }
    }

    #[test]
    fn stamps_of_one_name_are_grouped_in_order_of_first_appearance() {
        let raw = serializer()
            .encode(
                &Envelope::new(order())
                    .with(DelayStamp { ms: 1 })
                    .with(BusNameStamp::new("b"))
                    .with(ReceivedStamp::new("async"))
                    .with(DelayStamp { ms: 2 })
                    .with(RedeliveryStamp {
                        retry_count: 1,
                        at: 3,
                    }),
            )
            .unwrap();
        assert_eq!(
            raw.header("X-Message-Stamp-Delay"),
            Some(r#"[{"ms":1},{"ms":2}]"#)
        );
        assert_eq!(
            raw.header("X-Message-Stamp-BusName"),
            Some(r#"[{"bus":"b"}]"#)
        );
        assert_eq!(
            raw.header("X-Message-Stamp-Redelivery"),
            Some(r#"[{"at":3,"retry_count":1}]"#)
        );
        let back = serializer().decode(&raw).unwrap();
        let delays: Vec<u64> = back.all::<DelayStamp>().map(|d| d.ms).collect();
        assert_eq!(delays, [1, 2]);
    }

    #[test]
    fn only_the_newest_retry_history_stamps_are_written() {
        let mut e = Envelope::new(order());
        for n in 0..40u64 {
            e = e
                .with(DelayStamp { ms: n })
                .with(HandledStamp::new(format!("h{n}"), Default::default()));
        }
        let back = serializer()
            .decode(&serializer().encode(&e).unwrap())
            .unwrap();
        let delays: Vec<u64> = back.all::<DelayStamp>().map(|d| d.ms).collect();
        assert_eq!(delays, (40 - STAMP_HISTORY as u64..40).collect::<Vec<_>>());
        // Other stamps are all kept.
        assert_eq!(back.all::<HandledStamp>().count(), 40);
    }

    #[test]
    fn only_the_newest_dedup_claims_are_written() {
        let claims: Vec<DedupClaimStamp> = (0..40)
            .map(|_| DedupClaimStamp {
                claim: uuid::Uuid::new_v4(),
            })
            .collect();
        let e = claims
            .iter()
            .fold(Envelope::new(order()), |e, c| e.with(*c));
        let back = serializer()
            .decode(&serializer().encode(&e).unwrap())
            .unwrap();
        let kept: Vec<DedupClaimStamp> = back.all::<DedupClaimStamp>().copied().collect();
        assert_eq!(kept, claims[40 - STAMP_HISTORY..]);
        assert_eq!(back.last::<DedupClaimStamp>(), claims.last());
    }

    #[test]
    fn opaque_stamps_merge_with_a_known_header_of_the_same_name() {
        assert_eq!(merge_arrays("[1]", "[2,3]"), "[1,2,3]");
        assert_eq!(merge_arrays("[1]", "x"), "[[1],x]");
    }
}
