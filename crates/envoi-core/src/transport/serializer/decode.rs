//! Decoding: a [`RawMessage`] back into an envelope, refused when it is
//! too large, marked as misread, of an unknown type or malformed.

use std::borrow::Cow;

use super::{
    Inner, OpaqueStamp, Serializer, INVALID_BODY_HEADER, INVALID_HEADERS_HEADER, KIND_HEADER,
    STAMP_HEADER_PREFIX, TYPE_HEADER,
};
use crate::envelope::message::MessageKind;
use crate::envelope::stamp::{BusNameStamp, Stamp};
use crate::envelope::Envelope;
use crate::error::SerializationError;
use crate::transport::RawMessage;

impl Serializer {
    /// Decodes `raw` back into an envelope. Fails, without panicking, when
    /// the body or the headers are too large, the type is missing or
    /// unknown, the body does not decode as that type, or a header is
    /// malformed.
    pub fn decode(&self, raw: &RawMessage) -> Result<Envelope, SerializationError> {
        if raw.body.len() > self.inner.max_body_size {
            return Err(SerializationError::TooLarge {
                size: raw.body.len(),
                limit: self.inner.max_body_size,
            });
        }
        self.check_headers_size(&raw.headers)?;
        for marker in [INVALID_HEADERS_HEADER, INVALID_BODY_HEADER] {
            if let Some(reason) = raw.header(marker) {
                return Err(SerializationError::InvalidHeader {
                    header: marker.into(),
                    reason: reason.to_string(),
                });
            }
        }
        let Some(name) = raw.header(TYPE_HEADER) else {
            return Err(SerializationError::MissingHeader(TYPE_HEADER));
        };
        let Some(codec) = self.inner.by_name.get(name) else {
            return Err(SerializationError::UnknownType(name.to_string()));
        };
        let kind = match raw.header(KIND_HEADER) {
            None => MessageKind::Command,
            Some(k) => MessageKind::parse(k).ok_or_else(|| SerializationError::InvalidHeader {
                header: KIND_HEADER.into(),
                reason: format!("`{k}` is not one of command, query, event"),
            })?,
        };
        let mut envelope =
            (codec.decode)(&raw.body, kind).map_err(|source| SerializationError::Malformed {
                message: name.to_string(),
                source,
            })?;
        for (key, value) in &raw.headers {
            if key == TYPE_HEADER || key == KIND_HEADER {
                continue;
            }
            let Some(stamp) = key.strip_prefix(STAMP_HEADER_PREFIX) else {
                envelope = envelope.with_header(key, value);
                continue;
            };
            if stamp == BusNameStamp::NAME {
                if let Some(bus) = Inner::plain_bus_name(value) {
                    let bus = match self.inner.known_bus(bus) {
                        Some((shared, _)) => Cow::Borrowed(shared),
                        None => Cow::Owned(bus.to_owned()),
                    };
                    envelope = envelope.with(BusNameStamp::new(bus));
                    continue;
                }
            }
            envelope = match self.inner.stamps.get(stamp) {
                Some(decode) => {
                    decode(envelope, value).map_err(|e| SerializationError::MalformedStamp {
                        header: key.to_string(),
                        reason: e.to_string(),
                    })?
                }
                None => envelope.with(OpaqueStamp {
                    name: stamp.to_string(),
                    value: value.to_string(),
                }),
            };
        }
        Ok(envelope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::headers::Headers;
    use crate::transport::serializer::fixtures::{order, serializer};

    #[test]
    fn the_kind_travels_and_defaults_to_command() {
        let s = serializer();
        let raw = s.encode(&Envelope::event(order())).unwrap();
        assert_eq!(raw.header(KIND_HEADER), Some("event"));
        assert_eq!(s.decode(&raw).unwrap().kind(), MessageKind::Event);
        let mut raw = raw;
        raw.headers.remove(KIND_HEADER);
        assert_eq!(s.decode(&raw).unwrap().kind(), MessageKind::Command);
        raw.headers.insert(KIND_HEADER, "rumour");
        assert!(matches!(
            s.decode(&raw),
            Err(SerializationError::InvalidHeader { .. })
        ));
    }

    #[test]
    fn a_message_a_transport_marked_as_misread_does_not_decode_however_good_the_rest() {
        let s = serializer();
        for marker in [INVALID_HEADERS_HEADER, INVALID_BODY_HEADER] {
            let mut raw = s.encode(&Envelope::new(order())).unwrap();
            assert!(s.decode(&raw).is_ok());
            raw.headers
                .insert(marker, "headers stored as BLOB, not TEXT");
            match s.decode(&raw) {
                Err(SerializationError::InvalidHeader { header, reason }) => {
                    assert_eq!(header, marker);
                    assert_eq!(reason, "headers stored as BLOB, not TEXT");
                }
                other => panic!("{marker}: expected InvalidHeader, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_missing_type_header_is_reported() {
        let raw = RawMessage {
            body: b"{}".to_vec(),
            headers: Headers::new(),
        };
        assert!(matches!(
            serializer().decode(&raw),
            Err(SerializationError::MissingHeader("type"))
        ));
    }

    #[test]
    fn a_stamp_header_with_trailing_garbage_is_malformed() {
        let mut raw = serializer().encode(&Envelope::new(order())).unwrap();
        raw.headers
            .insert("X-Message-Stamp-Delay", r#"[{"ms":1}] x"#);
        assert_eq!(
            serializer().decode(&raw).unwrap_err().kind(),
            "malformed_stamp"
        );
    }
}
