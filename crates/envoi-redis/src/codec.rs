//! How a [`RawMessage`] is laid out in a stream entry, and back.
//!
//! An entry has a `body` field holding the body bytes as they are and a
//! `headers` field holding every header: two fields, whatever the number of
//! headers, so that Redis and the client parse four values per entry instead
//! of two more per header. The headers are written as netstrings, name then
//! value, each `<length in bytes>:<text>` (`4:type3:Job4:kind7:command`):
//! nothing to escape, nothing to unescape.
//!
//! Reading also accepts one `h:<name>` field per header (the layout of
//! earlier versions). Other fields, written by other producers, come back as
//! headers of their own name, as does a `headers` field that is not a
//! well-formed list of netstrings, so a foreign entry still reaches the
//! worker, which can then park it with a reason. A field whose name or
//! value is not UTF-8 is kept as well as it can be read, and
//! `X-Envoi-Invalid-Headers` names it, so that the worker parks the message
//! rather than handling it with an altered header. So does a body or header
//! given more than once (two `type` fields, say): the message is not
//! handled with whichever came last.

use std::io::Write;

use envoi_core::serializer::INVALID_HEADERS_HEADER;
use envoi_core::transport::{Delivery, RawMessage};
use envoi_core::Headers;
use redis::{Cmd, RedisWrite, ToRedisArgs, Value};

/// The field holding the body.
pub(crate) const BODY: &str = "body";
/// The field holding the headers, as netstrings.
pub(crate) const HEADERS: &str = "headers";
/// The prefix of the one-field-per-header layout, still read.
pub(crate) const HEADER_PREFIX: &str = "h:";

/// Appends the message's fields (`body`, and `headers` unless there are
/// none) to `cmd`.
pub(crate) fn push_fields(cmd: &mut Cmd, raw: &RawMessage) {
    cmd.arg(BODY).arg(raw.body.as_slice());
    if !raw.headers.is_empty() {
        cmd.arg(HEADERS).arg(PackedHeaders(&raw.headers));
    }
}

/// How many arguments and about how many bytes [`push_fields`] adds, to
/// size a command.
pub(crate) fn fields_size(raw: &RawMessage) -> (usize, usize) {
    if raw.headers.is_empty() {
        return (2, BODY.len() + raw.body.len());
    }
    let headers: usize = raw
        .headers
        .iter()
        .map(|(key, value)| netstring_len(key) + netstring_len(value))
        .sum();
    (4, BODY.len() + raw.body.len() + HEADERS.len() + headers)
}

/// The length of `text` written as a netstring.
fn netstring_len(text: &str) -> usize {
    itoa::Buffer::new().format(text.len()).len() + 1 + text.len()
}

/// The headers as netstrings, written into the command without building
/// the string first.
struct PackedHeaders<'a>(&'a Headers);

impl ToRedisArgs for PackedHeaders<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut arg = out.writer_for_next_arg();
        let mut digits = itoa::Buffer::new();
        for (key, value) in self.0 {
            for text in [key, value] {
                // Writing into the command's buffer cannot fail.
                let _ = arg.write_all(digits.format(text.len()).as_bytes());
                let _ = arg.write_all(b":");
                let _ = arg.write_all(text.as_bytes());
            }
        }
    }
}

/// Reads the headers [`PackedHeaders`] wrote; `None` unless `bytes` is a
/// whole number of well-formed name and value netstrings. The names of
/// headers given more than once go to `twice`.
fn unpack_headers(mut bytes: &[u8], twice: &mut Vec<String>) -> Option<Headers> {
    let mut headers = Headers::with_capacity(4);
    while !bytes.is_empty() {
        let key = netstring(&mut bytes)?;
        let value = netstring(&mut bytes)?;
        if headers.insert_copy(key, value).is_some() {
            twice.push(format!("`{key}`"));
        }
    }
    Some(headers)
}

/// Takes one `<length>:<text>` off the front of `bytes`.
fn netstring<'a>(bytes: &mut &'a [u8]) -> Option<&'a str> {
    // At most ten digits: no length of a Redis value has more.
    let mut len = 0usize;
    let mut digits = 0;
    loop {
        match bytes.get(digits)? {
            b':' if digits > 0 => break,
            d @ b'0'..=b'9' if digits < 10 => len = len * 10 + usize::from(d - b'0'),
            _ => return None,
        }
        digits += 1;
    }
    let rest = &bytes[digits + 1..];
    let text = rest.get(..len)?;
    let text = std::str::from_utf8(text).ok()?;
    *bytes = &rest[len..];
    Some(text)
}

/// Whether `id` is a stream entry id (`<ms>` or `<ms>-<seq>`).
pub(crate) fn is_stream_id(id: &str) -> bool {
    let mut parts = id.splitn(2, '-');
    let digits = |s: &str| {
        !s.is_empty()
            && s.len() <= 20
            && s.bytes().all(|b| b.is_ascii_digit())
            && s.parse::<u64>().is_ok()
    };
    match (parts.next(), parts.next()) {
        (Some(ms), None) => digits(ms),
        (Some(ms), Some(seq)) => digits(ms) && digits(seq),
        _ => false,
    }
}

/// A reply that does not have the shape the command promises.
pub(crate) fn unexpected(what: &str, value: &Value) -> String {
    let mut shown = format!("{value:?}");
    shown.truncate(200);
    format!("unexpected reply to {what}: {shown}")
}

fn bytes(value: Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        Value::Int(i) => Some(i.to_string().into_bytes()),
        Value::VerbatimString { text, .. } => Some(text.into_bytes()),
        _ => None,
    }
}

/// The string in `value` (a bulk or simple string), lossily when it is not
/// UTF-8 (stream ids and counts, which always are).
pub(crate) fn string(value: Value) -> Option<String> {
    bytes(value).map(|b| text(b).0)
}

/// `bytes` as a string, without copying them when they are UTF-8, and
/// whether they were (when not, the text is a lossy rendering).
fn text(bytes: Vec<u8>) -> (String, bool) {
    match String::from_utf8(bytes) {
        Ok(text) => (text, true),
        Err(e) => (String::from_utf8_lossy(e.as_bytes()).into_owned(), false),
    }
}

/// Builds the message from a flat `field, value, ...` list.
pub(crate) fn decode_fields(fields: Vec<Value>) -> Result<RawMessage, String> {
    if !fields.len().is_multiple_of(2) {
        return Err(format!(
            "an entry has an odd number ({}) of field items",
            fields.len()
        ));
    }
    let mut decoder = Decoder::default();
    let mut items = fields.into_iter();
    while let (Some(field), Some(value)) = (items.next(), items.next()) {
        let field = bytes(field).ok_or("an entry has a field name that is not a string")?;
        let value = bytes(value).ok_or("an entry has a field value that is not a string")?;
        decoder.field(field, value);
    }
    Ok(decoder.finish())
}

/// A message being read field by field, with what is wrong with it.
#[derive(Default)]
struct Decoder {
    raw: RawMessage,
    /// Fields whose name or value is not UTF-8, kept as well as they can be
    /// read: the message must not be handled with an altered header.
    altered: Vec<String>,
    /// The body or headers given more than once (by a foreign producer):
    /// which one counts is anyone's guess, so the message must not be
    /// handled with either.
    twice: Vec<String>,
    has_body: bool,
}

impl Decoder {
    fn field(&mut self, mut field: Vec<u8>, value: Vec<u8>) {
        if field == BODY.as_bytes() {
            if self.has_body {
                self.twice.push(format!("`{BODY}`"));
            }
            self.has_body = true;
            self.raw.body = value;
        } else if field == HEADERS.as_bytes() {
            self.headers_field(field, value);
        } else {
            if field.starts_with(HEADER_PREFIX.as_bytes()) {
                field.drain(..HEADER_PREFIX.len());
            }
            let (field, value) = (self.read(field), self.read(value));
            if self.raw.headers.contains_key(&field) {
                self.twice.push(format!("`{field}`"));
            }
            self.raw.headers.insert(field, value);
        }
    }

    /// The `headers` field: the packed headers, or someone else's field of
    /// that name, kept as it is.
    fn headers_field(&mut self, field: Vec<u8>, value: Vec<u8>) {
        let mut repeated = Vec::new();
        match unpack_headers(&value, &mut repeated) {
            Some(headers) if self.raw.headers.is_empty() => {
                self.twice.append(&mut repeated);
                self.raw.headers = headers;
            }
            Some(headers) => {
                self.twice.append(&mut repeated);
                for (name, value) in headers {
                    if self.raw.headers.contains_key(&name) {
                        self.twice.push(format!("`{name}`"));
                    }
                    self.raw.headers.insert(name, value);
                }
            }
            None => {
                let (field, value) = (self.read(field), self.read(value));
                if self.raw.headers.insert(field, value).is_some() {
                    self.twice.push(format!("`{HEADERS}`"));
                }
            }
        }
    }

    /// `bytes` as text, noting it when they are not UTF-8.
    fn read(&mut self, bytes: Vec<u8>) -> String {
        let (text, exact) = text(bytes);
        if !exact {
            self.altered.push(format!("`{text}`"));
        }
        text
    }

    /// The message, with `X-Envoi-Invalid-Headers` saying what is wrong with
    /// it, if anything.
    fn finish(mut self) -> RawMessage {
        let mut problems = Vec::new();
        if !self.altered.is_empty() {
            problems.push(format!(
                "fields that are not UTF-8: {}",
                self.altered.join(", ")
            ));
        }
        if !self.twice.is_empty() {
            problems.push(format!(
                "fields or headers given more than once: {}",
                self.twice.join(", ")
            ));
        }
        if !problems.is_empty() {
            self.raw
                .headers
                .insert(INVALID_HEADERS_HEADER, problems.join("; "));
        }
        self.raw
    }
}

fn flatten(value: Value) -> Option<Vec<Value>> {
    match value {
        Value::Array(items) => Some(items),
        Value::Map(pairs) => Some(pairs.into_iter().flat_map(|(k, v)| [k, v]).collect()),
        _ => None,
    }
}

/// Entries decoded from a list of `[id, [field, value, ...]]`. Entries whose
/// fields are nil (deleted while pending) are returned apart by id.
#[derive(Debug, Default)]
pub(crate) struct Entries {
    pub(crate) deliveries: Vec<Delivery>,
    pub(crate) deleted: Vec<String>,
}

/// Decodes a list of entries as `XRANGE`, `XREADGROUP` and `XAUTOCLAIM` give.
pub(crate) fn decode_entries(value: Value, what: &str) -> Result<Entries, String> {
    let mut out = Entries::default();
    let list = match value {
        Value::Nil => return Ok(out),
        Value::Array(list) => list,
        other => return Err(unexpected(what, &other)),
    };
    for entry in list {
        let Value::Array(mut parts) = entry else {
            return Err(unexpected(what, &entry));
        };
        if parts.len() < 2 {
            return Err(unexpected(what, &Value::Array(parts)));
        }
        let fields = parts.swap_remove(1);
        let id = string(parts.swap_remove(0))
            .ok_or_else(|| format!("{what} gave an entry without an id"))?;
        match fields {
            Value::Nil => out.deleted.push(id),
            fields => {
                let fields = flatten(fields)
                    .ok_or_else(|| format!("{what} gave entry `{id}` without fields"))?;
                let raw =
                    decode_fields(fields).map_err(|e| format!("{what}: entry `{id}`: {e}"))?;
                out.deliveries.push(Delivery::new(id, raw));
            }
        }
    }
    Ok(out)
}

/// Decodes an `XREADGROUP` reply: nil, or `[[stream, [entries]]]` (a map in
/// RESP3).
pub(crate) fn decode_read(value: Value) -> Result<Entries, String> {
    let streams = match value {
        Value::Nil => return Ok(Entries::default()),
        Value::Array(streams) => streams
            .into_iter()
            .map(|s| match s {
                Value::Array(mut kv) if kv.len() == 2 => Ok(kv.swap_remove(1)),
                other => Err(unexpected("XREADGROUP", &other)),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Value::Map(pairs) => pairs.into_iter().map(|(_, v)| v).collect(),
        other => return Err(unexpected("XREADGROUP", &other)),
    };
    let mut out = Entries::default();
    for entries in streams {
        let more = decode_entries(entries, "XREADGROUP")?;
        out.deliveries.extend(more.deliveries);
        out.deleted.extend(more.deleted);
    }
    Ok(out)
}

/// Decodes an `XAUTOCLAIM` reply: `[cursor, [entries], [deleted ids]]`.
pub(crate) fn decode_autoclaim(value: Value) -> Result<(String, Entries), String> {
    let Value::Array(mut parts) = value else {
        return Err(unexpected("XAUTOCLAIM", &value));
    };
    if parts.len() < 2 {
        return Err(unexpected("XAUTOCLAIM", &Value::Array(parts)));
    }
    let deleted = if parts.len() > 2 {
        parts.swap_remove(2)
    } else {
        Value::Nil
    };
    let entries = parts.swap_remove(1);
    let cursor = string(parts.swap_remove(0)).ok_or("XAUTOCLAIM gave no cursor")?;
    let mut out = decode_entries(entries, "XAUTOCLAIM")?;
    if let Value::Array(ids) = deleted {
        out.deleted.extend(ids.into_iter().filter_map(string));
    }
    Ok((cursor, out))
}

/// Decodes the reply of the script claiming entries given back:
/// `[[entries as XCLAIM gives them], [ids handed out before]]`.
pub(crate) fn decode_released(value: Value) -> Result<(Entries, Vec<String>), String> {
    let Value::Array(mut parts) = value else {
        return Err(unexpected("claiming released messages", &value));
    };
    if parts.len() != 2 {
        return Err(unexpected(
            "claiming released messages",
            &Value::Array(parts),
        ));
    }
    let again = match parts.swap_remove(1) {
        Value::Array(ids) => ids.into_iter().filter_map(string).collect(),
        Value::Nil => Vec::new(),
        other => return Err(unexpected("claiming released messages", &other)),
    };
    let entries = decode_entries(parts.swap_remove(0), "XCLAIM")?;
    Ok((entries, again))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &[u8]) -> Value {
        Value::BulkString(s.to_vec())
    }

    #[test]
    fn stream_ids_are_recognised() {
        for id in ["0", "1-0", "1700000000000-12", "999999999"] {
            assert!(is_stream_id(id), "{id}");
        }
        for id in [
            "",
            "-",
            "1-",
            "-1",
            "a-1",
            "1-2-3",
            "💥",
            "not-an-id",
            "1-0 ",
            "+1-0",
        ] {
            assert!(!is_stream_id(id), "{id}");
        }
    }

    #[test]
    fn fields_round_trip_body_bytes_and_headers() {
        let raw = RawMessage {
            body: vec![0, 255, 10, 0xc3],
            headers: [
                ("type".to_string(), "A".to_string()),
                ("body".to_string(), "a header called body".to_string()),
                ("empty".to_string(), String::new()),
            ]
            .into_iter()
            .collect(),
        };
        let mut cmd = redis::cmd("XADD");
        push_fields(&mut cmd, &raw);
        let fields: Vec<Value> = cmd
            .args_iter()
            .skip(1)
            .map(|a| match a {
                redis::Arg::Simple(b) => bulk(b),
                _ => panic!("only plain arguments expected"),
            })
            .collect();
        assert_eq!(decode_fields(fields).unwrap(), raw);
    }

    #[test]
    fn an_entry_has_a_body_field_and_one_headers_field_whatever_the_headers() {
        let raw = RawMessage {
            body: b"{}".to_vec(),
            headers: [("type", "A"), ("kind", "command"), ("x", "\"quoted\"\n")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let mut cmd = redis::cmd("XADD");
        push_fields(&mut cmd, &raw);
        let args: Vec<Vec<u8>> = cmd
            .args_iter()
            .skip(1)
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => panic!("only plain arguments expected"),
            })
            .collect();
        assert_eq!(args.len(), 4);
        assert_eq!(
            (&args[0][..], &args[2][..]),
            (&b"body"[..], &b"headers"[..])
        );
        assert_eq!(
            String::from_utf8(args[3].clone()).unwrap(),
            "4:kind7:command4:type1:A1:x9:\"quoted\"\n"
        );
        assert_eq!(
            unpack_headers(&args[3], &mut Vec::new()).unwrap(),
            raw.headers
        );
        assert_eq!(fields_size(&raw), (4, args.iter().map(Vec::len).sum()));

        let mut bare = redis::cmd("XADD");
        let no_headers = RawMessage {
            body: b"x".to_vec(),
            headers: Headers::new(),
        };
        push_fields(&mut bare, &no_headers);
        assert_eq!(bare.args_iter().count(), 3, "no headers field");
        assert_eq!(fields_size(&no_headers).0, 2);
    }

    #[test]
    fn entries_in_the_one_field_per_header_layout_are_still_read() {
        let raw = decode_fields(vec![
            bulk(b"body"),
            bulk(b"{}"),
            bulk(b"h:type"),
            bulk(b"A"),
            bulk(b"h:kind"),
            bulk(b"event"),
        ])
        .unwrap();
        assert_eq!(raw.body, b"{}");
        assert_eq!(raw.header("type"), Some("A"));
        assert_eq!(raw.header("kind"), Some("event"));
    }

    #[test]
    fn headers_of_any_text_round_trip() {
        let headers = Headers::from([
            ("", ""),
            ("a:b", "12:not a length"),
            ("ünïcode", "💥"),
            ("empty", ""),
        ]);
        let mut cmd = redis::cmd("XADD");
        cmd.arg(PackedHeaders(&headers));
        let packed: Vec<u8> = match cmd.args_iter().nth(1) {
            Some(redis::Arg::Simple(b)) => b.to_vec(),
            _ => panic!("one plain argument expected"),
        };
        assert_eq!(unpack_headers(&packed, &mut Vec::new()).unwrap(), headers);
    }

    #[test]
    fn a_headers_field_that_is_not_well_formed_is_kept_as_a_header() {
        for bad in [
            &b"not netstrings"[..],
            b"4:type",
            b"4:type3:Jo",
            b"4:type3:Job4:kind",
            b"x:type3:Job",
            b"99999999999999999999:a",
            b"2:\xff\xfe1:a",
        ] {
            let raw = decode_fields(vec![bulk(b"headers"), bulk(bad)]).unwrap();
            let kept = raw.header("headers").expect("kept as a header");
            assert_eq!(kept, String::from_utf8_lossy(bad), "{bad:?}");
            // Text that had to be altered says so.
            let utf8 = std::str::from_utf8(bad).is_ok();
            assert_eq!(raw.headers.len(), if utf8 { 1 } else { 2 }, "{bad:?}");
            assert_eq!(
                raw.header(INVALID_HEADERS_HEADER).is_some(),
                !utf8,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_field_that_is_not_utf8_marks_the_message_invalid() {
        let raw = decode_fields(vec![
            bulk(b"type"),
            bulk(b"Job"),
            bulk(b"trace"),
            bulk(b"\xff\xfe"),
        ])
        .unwrap();
        assert_eq!(raw.header("type"), Some("Job"));
        let reason = raw.header(INVALID_HEADERS_HEADER).unwrap();
        assert!(reason.starts_with("fields that are not UTF-8:"), "{reason}");
        let raw = decode_fields(vec![bulk(b"type"), bulk(b"Job")]).unwrap();
        assert_eq!(raw.header(INVALID_HEADERS_HEADER), None);
    }

    #[test]
    fn a_field_or_header_given_twice_marks_the_message_invalid() {
        for (fields, twice) in [
            // A foreign producer's `type` field, twice.
            (
                vec![
                    bulk(b"type"),
                    bulk(b"Job"),
                    bulk(b"type"),
                    bulk(b"Evil"),
                    bulk(b"body"),
                    bulk(b"{}"),
                ],
                "`type`",
            ),
            // Two bodies.
            (
                vec![bulk(b"body"), bulk(b"{}"), bulk(b"body"), bulk(b"[]")],
                "`body`",
            ),
            // A header both in the `headers` field and as a field of its own.
            (
                vec![
                    bulk(b"headers"),
                    bulk(b"4:type3:Job"),
                    bulk(b"h:type"),
                    bulk(b"Evil"),
                ],
                "`type`",
            ),
            // Twice in the `headers` field itself.
            (
                vec![
                    bulk(b"headers"),
                    bulk(b"4:type3:Job4:type4:Evil"),
                    bulk(b"body"),
                    bulk(b"{}"),
                ],
                "`type`",
            ),
        ] {
            let raw = decode_fields(fields).unwrap();
            let reason = raw.header(INVALID_HEADERS_HEADER).unwrap_or_default();
            assert!(
                reason.contains("given more than once") && reason.contains(twice),
                "{reason:?} does not name {twice}"
            );
        }
        // Each once: nothing to say.
        let raw = decode_fields(vec![
            bulk(b"body"),
            bulk(b"{}"),
            bulk(b"headers"),
            bulk(b"4:type3:Job4:kind7:command"),
        ])
        .unwrap();
        assert_eq!(raw.header(INVALID_HEADERS_HEADER), None);
    }

    #[test]
    fn foreign_fields_become_headers_and_a_missing_body_is_empty() {
        let raw = decode_fields(vec![bulk(b"event"), bulk(b"signup")]).unwrap();
        assert!(raw.body.is_empty());
        assert_eq!(raw.header("event"), Some("signup"));
    }

    #[test]
    fn malformed_entries_are_errors_not_panics() {
        assert!(decode_fields(vec![bulk(b"body")]).is_err());
        assert!(decode_fields(vec![Value::Nil, bulk(b"x")]).is_err());
        assert!(decode_entries(Value::Int(3), "XRANGE").is_err());
        assert!(decode_entries(Value::Array(vec![Value::Int(1)]), "XRANGE").is_err());
        assert!(decode_entries(
            Value::Array(vec![Value::Array(vec![bulk(b"1-0")])]),
            "XRANGE"
        )
        .is_err());
        assert!(decode_read(Value::Okay).is_err());
        assert!(decode_autoclaim(Value::Array(vec![bulk(b"0-0")])).is_err());
    }

    #[test]
    fn deleted_entries_are_reported_apart() {
        let reply = Value::Array(vec![
            Value::Array(vec![bulk(b"1-0"), Value::Nil]),
            Value::Array(vec![
                bulk(b"2-0"),
                Value::Array(vec![bulk(b"body"), bulk(b"x")]),
            ]),
        ]);
        let entries = decode_entries(reply, "XAUTOCLAIM").unwrap();
        assert_eq!(entries.deleted, vec!["1-0".to_string()]);
        assert_eq!(entries.deliveries.len(), 1);
        assert_eq!(entries.deliveries[0].id.as_str(), "2-0");
        assert_eq!(entries.deliveries[0].raw.body, b"x");
    }

    #[test]
    fn autoclaim_reply_gives_cursor_entries_and_deleted_ids() {
        let reply = Value::Array(vec![
            bulk(b"5-0"),
            Value::Array(vec![Value::Array(vec![
                bulk(b"3-0"),
                Value::Array(vec![bulk(b"body"), bulk(b"y")]),
            ])]),
            Value::Array(vec![bulk(b"4-0")]),
        ]);
        let (cursor, entries) = decode_autoclaim(reply).unwrap();
        assert_eq!(cursor, "5-0");
        assert_eq!(entries.deliveries[0].id.as_str(), "3-0");
        assert_eq!(entries.deleted, vec!["4-0".to_string()]);
    }
}
