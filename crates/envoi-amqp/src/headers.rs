//! Mapping between envoi's string headers and AMQP header tables.
//!
//! Each header becomes one entry of the message's `headers` table, a long
//! string holding the UTF-8 value. Headers the broker adds on its own
//! (dead-lettering and quorum queue bookkeeping) are dropped on the way in,
//! so a message comes back with exactly the headers it was sent with.

use envoi_core::headers::header_text;
use envoi_core::serializer::INVALID_HEADERS_HEADER;
use envoi_core::Headers;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::error::AmqpError;

/// Header names RabbitMQ sets by itself; they are not part of the message.
const BROKER_HEADERS: &[&str] = &["x-death", "x-delivery-count"];
/// Header name prefixes RabbitMQ sets by itself.
const BROKER_PREFIXES: &[&str] = &["x-first-death-", "x-last-death-"];

/// Bytes one header takes in the encoded table, besides its name and value:
/// name length (1), type tag (1), value length (4).
const PER_HEADER: usize = 6;

pub(crate) fn is_broker_header(name: &str) -> bool {
    BROKER_HEADERS.contains(&name) || BROKER_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Encodes `headers`; returns the table and its encoded size in bytes.
pub(crate) fn encode(headers: &Headers) -> Result<(FieldTable, usize), AmqpError> {
    let mut table = FieldTable::default();
    let mut size = 4;
    for (name, value) in headers {
        if is_broker_header(name) {
            return Err(AmqpError::ReservedHeader(name.to_string()));
        }
        let key =
            ShortString::try_new(name).map_err(|_| AmqpError::HeaderNameTooLong(name.len()))?;
        size += PER_HEADER + name.len() + value.len();
        table.insert(
            key,
            AMQPValue::LongString(LongString::from(value.as_bytes())),
        );
    }
    Ok((table, size))
}

/// Decodes a received header table. String values (long or short) are kept;
/// numbers, booleans, timestamps and UTF-8 byte arrays (set by other
/// producers) are rendered as text; broker bookkeeping headers are dropped.
///
/// A value that has no faithful text — bytes that are not UTF-8, a nested
/// table or array, a decimal — is kept as well as it can be rendered, and
/// [`INVALID_HEADERS_HEADER`] says which header it is, so that the message
/// does not decode and the worker parks it with the reason instead of
/// handling it with an altered header.
pub(crate) fn decode(table: Option<&FieldTable>) -> Headers {
    let Some(table) = table else {
        return Headers::new();
    };
    let mut headers = Headers::with_capacity(table.inner().len());
    let mut unreadable = Vec::new();
    for (k, v) in table {
        if is_broker_header(k.as_str()) {
            continue;
        }
        // String values as they are; anything else rendered as text.
        let plain = match v {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
            AMQPValue::ShortString(s) => Some(s.as_str()),
            _ => None,
        };
        match plain {
            Some(value) => headers.insert_copy(k.as_str(), value),
            None => {
                let (value, faithful) = text(v);
                if !faithful {
                    unreadable.push(format!("`{}` ({})", k.as_str(), kind(v)));
                }
                headers.insert(header_text(k.as_str()), value)
            }
        };
    }
    if !unreadable.is_empty() {
        headers.insert(
            INVALID_HEADERS_HEADER,
            format!("headers with no text value: {}", unreadable.join(", ")),
        );
    }
    headers
}

/// What `value` is, in words.
fn kind(value: &AMQPValue) -> &'static str {
    match value {
        AMQPValue::LongString(_) | AMQPValue::ByteArray(_) => "bytes that are not UTF-8",
        AMQPValue::FieldTable(_) => "a table",
        AMQPValue::FieldArray(_) => "an array",
        AMQPValue::DecimalValue(_) => "a decimal",
        _ => "a value of another type",
    }
}

/// `value` as text, and whether that text is faithful.
fn text(value: &AMQPValue) -> (String, bool) {
    let lossy = |bytes: &[u8]| match std::str::from_utf8(bytes) {
        Ok(s) => (s.to_string(), true),
        Err(_) => (String::from_utf8_lossy(bytes).into_owned(), false),
    };
    let exact = match value {
        AMQPValue::LongString(s) => return lossy(s.as_bytes()),
        AMQPValue::ByteArray(b) => return lossy(b.as_slice()),
        AMQPValue::FieldTable(_) | AMQPValue::FieldArray(_) | AMQPValue::DecimalValue(_) => {
            return (format!("{value:?}"), false)
        }
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Float(n) => n.to_string(),
        AMQPValue::Double(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        AMQPValue::Void => String::new(),
    };
    (exact, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_broker_headers_are_dropped() {
        let headers = Headers::from([
            ("type", "App.Order"),
            ("Type", "other case"),
            ("empty", ""),
            ("multi", "a\nb\r\nc\td \"q\" \\ 🎉"),
        ]);
        let (mut table, size) = encode(&headers).unwrap();
        assert!(size > headers.values().map(str::len).sum::<usize>());
        table.insert("x-delivery-count".into(), AMQPValue::LongLongInt(2));
        table.insert(
            "x-first-death-reason".into(),
            AMQPValue::LongString("expired".into()),
        );
        table.insert("x-death".into(), AMQPValue::Void);
        assert_eq!(decode(Some(&table)), headers);
        assert!(decode(None).is_empty());
    }

    #[test]
    fn reserved_and_overlong_header_names_are_refused() {
        let reserved = Headers::from([("x-death", "")]);
        assert!(matches!(
            encode(&reserved),
            Err(AmqpError::ReservedHeader(_))
        ));
        let long = Headers::from([("k".repeat(256), String::new())]);
        assert!(matches!(
            encode(&long),
            Err(AmqpError::HeaderNameTooLong(256))
        ));
    }

    #[test]
    fn foreign_header_types_are_rendered_as_text() {
        let mut table = FieldTable::default();
        table.insert("n".into(), AMQPValue::LongInt(-4));
        table.insert("b".into(), AMQPValue::Boolean(true));
        table.insert("s".into(), AMQPValue::ShortString("short".into()));
        table.insert("a".into(), AMQPValue::ByteArray(b"Job".to_vec().into()));
        let decoded = decode(Some(&table));
        assert_eq!(&decoded["n"], "-4");
        assert_eq!(&decoded["b"], "true");
        assert_eq!(&decoded["s"], "short");
        assert_eq!(&decoded["a"], "Job");
        assert_eq!(decoded.get(INVALID_HEADERS_HEADER), None);
    }

    #[test]
    fn a_header_with_no_faithful_text_marks_the_message_invalid() {
        let mut nested = FieldTable::default();
        nested.insert("a".into(), AMQPValue::LongInt(1));
        let mut table = FieldTable::default();
        table.insert("type".into(), AMQPValue::LongString("Job".into()));
        table.insert("trace".into(), AMQPValue::FieldTable(nested));
        table.insert(
            "raw".into(),
            AMQPValue::LongString(LongString::from(&b"\xff\xfe"[..])),
        );
        let decoded = decode(Some(&table));
        assert_eq!(&decoded["type"], "Job");
        let reason = decoded.get(INVALID_HEADERS_HEADER).unwrap();
        assert!(reason.contains("`trace` (a table)"), "{reason}");
        assert!(
            reason.contains("`raw` (bytes that are not UTF-8)"),
            "{reason}"
        );
    }
}
