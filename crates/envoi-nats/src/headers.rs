//! How envoi headers travel as NATS headers.
//!
//! NATS headers cannot carry every envoi header:
//! names must be printable ASCII without `:`, values cannot hold line breaks
//! and lose leading and trailing whitespace, and `Nats-*` names steer the
//! server. Headers that would not survive (or would steer the server) travel
//! JSON-encoded in one [`EXTRA_HEADERS`] header instead (a JSON object of
//! strings, read and written by core's shared JSON header support), so every
//! header comes back exactly as it was sent.

use std::str::FromStr;

use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use envoi_core::serializer::INVALID_HEADERS_HEADER;
use envoi_core::transport::support::{decode_json_headers, encode_json_headers};
use envoi_core::transport::RawMessage;
use envoi_core::{Headers, TransportError};

/// The time (milliseconds since the Unix epoch) before which a delayed
/// message must not be handed out.
pub(crate) const NOT_BEFORE: &str = "Envoi-Not-Before";
/// JSON object of the headers that cannot travel as NATS headers.
pub(crate) const EXTRA_HEADERS: &str = "Envoi-Headers";
/// JetStream's de-duplication id; set on every send when de-duplication is
/// on (`dedup`), so a retried publish is stored once.
pub(crate) const MSG_ID: &str = "Nats-Msg-Id";

fn is_reserved(name: &str) -> bool {
    name.len() >= 5 && name[..5].eq_ignore_ascii_case("nats-")
        || name.eq_ignore_ascii_case(NOT_BEFORE)
        || name.eq_ignore_ascii_case(EXTRA_HEADERS)
}

fn travels_natively(name: &str, value: &str) -> bool {
    !name.is_empty()
        && name.chars().all(|c| c.is_ascii_graphic() && c != ':')
        && !is_reserved(name)
        && !value.contains(['\r', '\n'])
        && value.trim() == value
}

/// Header names envoi's serializer writes on (nearly) every message, as
/// static names: building them costs no allocation.
const COMMON_NAMES: &[&str] = &[
    "type",
    "kind",
    "X-Message-Stamp-BusName",
    "X-Message-Stamp-MessageId",
    "X-Message-Stamp-CorrelationId",
    "X-Message-Stamp-CausationId",
    "X-Message-Stamp-Redelivery",
    "X-Message-Stamp-Delay",
    "X-Message-Stamp-Handled",
];

fn header_name(name: &str) -> Result<HeaderName, async_nats::header::ParseHeaderNameError> {
    match COMMON_NAMES.iter().find(|common| **common == name) {
        Some(common) => Ok(HeaderName::from_static(common)),
        None => HeaderName::from_str(name),
    }
}

/// Builds the NATS headers for `headers`, plus the de-duplication id (if
/// any) and the due time of a delayed message.
pub(crate) fn encode(
    headers: &Headers,
    msg_id: Option<uuid::Uuid>,
    not_before_ms: Option<u128>,
) -> Result<HeaderMap, TransportError> {
    let mut map = HeaderMap::new();
    let mut extra = Headers::new();
    for (name, value) in headers {
        match (
            travels_natively(name, value),
            header_name(name),
            HeaderValue::from_str(value),
        ) {
            (true, Ok(name), Ok(value)) => map.insert(name, value),
            _ => {
                extra.insert_copy(name, value);
            }
        }
    }
    if !extra.is_empty() {
        map.insert(EXTRA_HEADERS, encode_json_headers(&extra)?);
    }
    if let Some(msg_id) = msg_id {
        let mut id = uuid::Uuid::encode_buffer();
        map.insert(MSG_ID, &*msg_id.simple().encode_lower(&mut id));
    }
    if let Some(ms) = not_before_ms {
        map.insert(NOT_BEFORE, ms.to_string());
    }
    Ok(map)
}

/// How many bytes `headers` take on the wire (`NATS/1.0\r\n`, a
/// `name: value\r\n` line per value, a blank line), which the server counts
/// against its payload limit with the body.
pub(crate) fn encoded_len(headers: &HeaderMap) -> usize {
    let lines: usize = headers
        .iter()
        .map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(|v| name.len() + 2 + v.as_str().len() + 2)
                .sum::<usize>()
        })
        .sum();
    "NATS/1.0\r\n".len() + lines + 2
}

/// Rebuilds the envoi message from a NATS message's headers and payload.
/// Headers JetStream adds (`Nats-*`) and the transport's own are left out.
///
/// A header with several values, or given both natively and in
/// [`EXTRA_HEADERS`], is kept with its last value and
/// [`INVALID_HEADERS_HEADER`] naming it, so that the message does not
/// decode and the worker parks it rather than guess which value counts.
///
/// A message whose [`EXTRA_HEADERS`] header is not a JSON object of strings
/// (written by something else than envoi) is still returned, as core's
/// [`decode_json_headers`] keeps such headers: the string values it holds,
/// [`INVALID_HEADERS_HEADER`] saying what is wrong and the header as it was
/// stored, so that it does not decode and the worker parks it with the
/// reason instead of handling it without the headers it carried.
pub(crate) fn decode(headers: Option<&HeaderMap>, payload: &[u8]) -> RawMessage {
    decode_delivered(headers, payload).0
}

/// [`decode`], and the due time of a delayed message (its [`NOT_BEFORE`]
/// header), found in the same pass over the headers.
pub(crate) fn decode_delivered(
    headers: Option<&HeaderMap>,
    payload: &[u8],
) -> (RawMessage, Option<u128>) {
    let mut out = Headers::new();
    let mut due = None;
    if let Some(headers) = headers {
        let mut extra = None;
        // Headers with several values (set by another producer): which one
        // counts is anyone's guess, so the message must not be handled.
        let mut twice = Vec::new();
        for (name, values) in headers.iter() {
            let name: &str = name.as_ref();
            if is_reserved(name) {
                // The first value, of a name in any case (as reserved):
                // another producer's `envoi-headers` is read, not dropped.
                if name.eq_ignore_ascii_case(EXTRA_HEADERS) {
                    extra = extra.or(values.first());
                } else if name.eq_ignore_ascii_case(NOT_BEFORE) {
                    due = values.first().and_then(|v| v.as_str().parse().ok());
                }
                continue;
            }
            if values.len() > 1 {
                twice.push(format!("`{name}`"));
            }
            if let Some(value) = values.last() {
                out.insert_copy(name, value.as_str());
            }
        }
        if let Some(extra) = extra {
            for (name, value) in decode_json_headers(extra.as_str().as_bytes()) {
                if out.contains_key(&name) {
                    twice.push(format!("`{name}`"));
                }
                out.insert(name, value);
            }
        }
        if !twice.is_empty() {
            let problem = format!("headers given more than once: {}", twice.join(", "));
            let reason = match out.get(INVALID_HEADERS_HEADER) {
                Some(earlier) => format!("{earlier}; {problem}"),
                None => problem,
            };
            out.insert(INVALID_HEADERS_HEADER, reason);
        }
    }
    let raw = RawMessage {
        body: payload.to_vec(),
        headers: out,
    };
    (raw, due)
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoi_core::transport::support::STORED_HEADERS_HEADER;

    fn roundtrip(headers: &[(&str, &str)]) -> Headers {
        let headers: Headers = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let map = encode(&headers, Some(uuid::Uuid::nil()), None).unwrap();
        decode(Some(&map), b"body").headers
    }

    #[test]
    fn ordinary_headers_travel_as_nats_headers() {
        let headers = Headers::from([("type", "App\\Order")]);
        let id = uuid::Uuid::from_u128(0xabc);
        let map = encode(&headers, Some(id), Some(42)).unwrap();
        assert_eq!(map.get("type").map(|v| v.as_str()), Some("App\\Order"));
        assert_eq!(
            map.get(MSG_ID).map(|v| v.as_str()),
            Some(id.simple().to_string().as_str())
        );
        assert_eq!(decode_delivered(Some(&map), b"").1, Some(42));
        assert!(map.get(EXTRA_HEADERS).is_none());
        let map = encode(&headers, None, None).unwrap();
        assert!(map.get(MSG_ID).is_none());
        assert_eq!(map.len(), 1);
    }

    #[test]
    fn headers_nats_cannot_carry_come_back_unchanged() {
        let headers = [
            ("type", "Order"),
            ("X-Message-Stamp-Delay", "{\"ms\":5}"),
            ("multi", "line one\r\nline two"),
            ("padded", "  spaced  "),
            ("with space", "v"),
            ("colon:name", "v"),
            ("Nats-Rollup", "all"),
            ("Envoi-Not-Before", "1"),
            ("unicode", "żółw 🐢"),
            ("empty", ""),
        ];
        let back = roundtrip(&headers);
        let expected: Headers = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(back, expected);
    }

    #[test]
    fn server_headers_are_not_reported_as_message_headers() {
        let mut map = HeaderMap::new();
        map.insert("Nats-Sequence", "7");
        map.insert(MSG_ID, "abc");
        map.insert("kind", "command");
        let raw = decode(Some(&map), b"x");
        assert_eq!(raw.headers.len(), 1);
        assert_eq!(raw.header("kind"), Some("command"));
        assert_eq!(raw.body, b"x");
    }

    #[test]
    fn the_due_time_is_found_with_the_headers() {
        let headers = Headers::from([("type", "Order"), ("multi", "a\r\nb")]);
        let map = encode(&headers, Some(uuid::Uuid::nil()), Some(1234)).unwrap();
        let (raw, due) = decode_delivered(Some(&map), b"b");
        assert_eq!(raw.headers, headers);
        assert_eq!(due, Some(1234));
        let map = encode(&headers, None, None).unwrap();
        assert_eq!(decode_delivered(Some(&map), b"b").1, None);
        assert_eq!(decode_delivered(None, b"b").1, None);
    }

    #[test]
    fn a_corrupt_extra_header_is_kept_and_marks_the_message_invalid() {
        let mut map = HeaderMap::new();
        map.insert(EXTRA_HEADERS, "not json");
        map.insert("type", "Order");
        let raw = decode(Some(&map), b"payload");
        assert_eq!(raw.header(STORED_HEADERS_HEADER), Some("not json"));
        assert_eq!(raw.header("type"), Some("Order"));
        assert_eq!(raw.body, b"payload");
        let reason = raw.header(INVALID_HEADERS_HEADER).unwrap();
        assert!(reason.contains("not a JSON object of strings"), "{reason}");

        // An object with a value that is not a string: the strings are kept.
        let mut map = HeaderMap::new();
        map.insert(EXTRA_HEADERS, r#"{"trace":"t1","n":1}"#);
        let raw = decode(Some(&map), b"payload");
        assert_eq!(raw.header("trace"), Some("t1"));
        let reason = raw.header(INVALID_HEADERS_HEADER).unwrap();
        assert!(reason.contains("`n` holds a number"), "{reason}");
    }

    #[test]
    fn a_header_with_several_values_marks_the_message_invalid() {
        let mut map = HeaderMap::new();
        map.append("type", "Order");
        map.append("type", "Refund");
        map.insert("kind", "command");
        let raw = decode(Some(&map), b"{}");
        let reason = raw.header(INVALID_HEADERS_HEADER).unwrap_or_default();
        assert!(
            reason.contains("headers given more than once: `type`"),
            "{reason:?}"
        );
        // A name given twice inside the JSON of `Envoi-Headers`.
        let mut map = HeaderMap::new();
        map.insert("Envoi-Headers", r#"{"trace":"t1","trace":"t2"}"#);
        let reason = decode(Some(&map), b"{}")
            .header(INVALID_HEADERS_HEADER)
            .unwrap_or_default()
            .to_string();
        assert!(
            reason.contains("header `trace` is given more than once"),
            "{reason:?}"
        );
        // One value each: nothing to say.
        let mut map = HeaderMap::new();
        map.insert("type", "Order");
        assert_eq!(
            decode(Some(&map), b"{}").header(INVALID_HEADERS_HEADER),
            None
        );
    }

    #[test]
    fn the_transport_s_own_headers_are_read_in_any_case() {
        let mut map = HeaderMap::new();
        map.insert("envoi-headers", r#"{"type":"Order","trace":"t1"}"#);
        map.insert("envoi-not-before", "1234");
        let (raw, due) = decode_delivered(Some(&map), b"payload");
        assert_eq!(raw.header("type"), Some("Order"));
        assert_eq!(raw.header("trace"), Some("t1"));
        assert_eq!(due, Some(1234));
        assert_eq!(raw.header(INVALID_HEADERS_HEADER), None);
    }
}
