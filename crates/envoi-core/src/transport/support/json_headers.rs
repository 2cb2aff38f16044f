//! Headers stored as one JSON object of strings, as the SQL transports
//! store them.

use std::borrow::Cow;

use crate::envelope::headers::Headers;
use crate::error::TransportError;
use crate::transport::serializer::INVALID_HEADERS_HEADER;

/// The header that keeps what was stored, exactly, when stored headers are
/// not a JSON object of strings (see [`decode_json_headers`]).
pub const STORED_HEADERS_HEADER: &str = "X-Envoi-Stored-Headers";

/// `headers` as a JSON object of strings.
pub fn encode_json_headers(headers: &Headers) -> Result<String, TransportError> {
    serde_json::to_string(headers).map_err(|e| TransportError::backend("encoding headers", e))
}

/// The headers stored as `stored`, which should be a JSON object of
/// strings. Anything else is no error here, and nothing of it is lost: the
/// headers are every string value of the object (if it is one), plus
/// [`INVALID_HEADERS_HEADER`] saying what is wrong and
/// [`STORED_HEADERS_HEADER`] holding what was stored. Such a message does
/// not decode, so a worker parks it with the reason. Bytes that are not
/// UTF-8 are kept as a hex literal (`x'7b22ff'`).
///
/// ```
/// use envoi_core::transport::support::{decode_json_headers, STORED_HEADERS_HEADER};
/// use envoi_core::serializer::INVALID_HEADERS_HEADER;
///
/// let ok = decode_json_headers(br#"{"type":"Ping"}"#);
/// assert_eq!(ok.get("type"), Some("Ping"));
/// assert_eq!(ok.get(INVALID_HEADERS_HEADER), None);
///
/// let bad = decode_json_headers(br#"{"type":"Ping","n":1}"#);
/// assert_eq!(bad.get("type"), Some("Ping"));
/// assert!(bad.get(INVALID_HEADERS_HEADER).unwrap().contains("`n` holds a number"));
/// assert_eq!(bad.get(STORED_HEADERS_HEADER), Some(r#"{"type":"Ping","n":1}"#));
/// ```
pub fn decode_json_headers(stored: &[u8]) -> Headers {
    if let Ok(text) = std::str::from_utf8(stored) {
        if text == "{}" {
            return Headers::new();
        }
        match serde_json::from_str::<Headers>(text) {
            Ok(headers) => return headers,
            Err(e) => return salvage(stored, Vec::new(), Some(e)),
        }
    }
    salvage(stored, Vec::new(), None)
}

/// What [`decode_json_headers`] makes of stored headers that are not a JSON
/// object of strings, with `problems` found by the caller beforehand (a
/// column of the wrong type, say) added first. `parsed` is why reading them
/// as headers failed, if that was tried: a name given twice, which reading
/// them as a JSON object hides.
#[cold]
pub fn salvage(
    stored: &[u8],
    mut problems: Vec<String>,
    parsed: Option<serde_json::Error>,
) -> Headers {
    let mut headers = Headers::new();
    let text = match std::str::from_utf8(stored) {
        Ok(text) => Cow::Borrowed(text),
        Err(e) => {
            problems.push(format!(
                "stored headers are not UTF-8 ({e}); `{STORED_HEADERS_HEADER}` holds them as a hex literal"
            ));
            String::from_utf8_lossy(stored)
        }
    };
    const NOT_AN_OBJECT: &str = "stored headers are not a JSON object of strings";
    let before = problems.len();
    match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(serde_json::Value::Object(map)) => {
            let mut not_strings = Vec::new();
            for (name, value) in map {
                match value {
                    serde_json::Value::String(value) => {
                        headers.insert(name, value);
                    }
                    other => not_strings.push(format!("`{name}` holds {}", json_kind(&other))),
                }
            }
            if !not_strings.is_empty() {
                problems.push(format!("{NOT_AN_OBJECT}: {}", not_strings.join(", ")));
            }
        }
        Ok(other) => problems.push(format!("{NOT_AN_OBJECT}: they are {}", json_kind(&other))),
        Err(e) => problems.push(format!("{NOT_AN_OBJECT}: {e}")),
    }
    if let (true, Some(e)) = (problems.len() == before, parsed) {
        problems.push(format!("{NOT_AN_OBJECT}: {e}"));
    }
    if !problems.is_empty() {
        let kept = match text {
            Cow::Borrowed(text) => text.to_owned(),
            // Not UTF-8: read lossily above, kept exactly here.
            Cow::Owned(_) => hex_literal(stored),
        };
        headers.insert(STORED_HEADERS_HEADER, kept);
        headers.insert(INVALID_HEADERS_HEADER, problems.join("; "));
    }
    headers
}

/// What a JSON value is, for an error message.
fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// `bytes` as a hex literal: `x'7b22ff'`.
pub fn hex_literal(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2 + 3);
    s.push_str("x'");
    for b in bytes {
        s.push(HEX[usize::from(b >> 4)] as char);
        s.push(HEX[usize::from(b & 0xf)] as char);
    }
    s.push('\'');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_through_json() {
        let headers = Headers::from([("type", "Ping"), ("note", "a \"quoted\"\nline")]);
        let text = encode_json_headers(&headers).unwrap();
        assert_eq!(decode_json_headers(text.as_bytes()), headers);
    }

    #[test]
    fn headers_that_are_not_an_object_or_not_text_keep_what_was_stored_and_say_why() {
        let h = decode_json_headers(b"[1,2]");
        assert!(h
            .get(INVALID_HEADERS_HEADER)
            .unwrap()
            .contains("they are an array"));
        assert_eq!(h.get(STORED_HEADERS_HEADER), Some("[1,2]"));

        let h = decode_json_headers(b"{\"a\":\xff}");
        assert!(h.get(INVALID_HEADERS_HEADER).unwrap().contains("not UTF-8"));
        assert_eq!(h.get(STORED_HEADERS_HEADER), Some("x'7b2261223aff7d'"));

        let h = decode_json_headers(br#"{"a":"1","a":"2"}"#);
        assert!(
            h.get(INVALID_HEADERS_HEADER).is_some(),
            "a name given twice: {h:?}"
        );

        let h = salvage(b"{}", vec!["stored as BLOB, not TEXT".into()], None);
        assert_eq!(
            h.get(INVALID_HEADERS_HEADER),
            Some("stored as BLOB, not TEXT")
        );
    }
}
