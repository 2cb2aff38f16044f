//! Reading a row as a delivery, as well as it can be read: a row written by
//! something other than envoi (a body or headers of the wrong storage
//! class, headers that are not a JSON object of strings) is handed out all
//! the same, with what is wrong, so the worker parks it instead of the row
//! coming back on every claim.

use envoi_core::serializer::{INVALID_BODY_HEADER, INVALID_HEADERS_HEADER};
use envoi_core::transport::support::{decode_json_headers, salvage_json_headers};
use envoi_core::transport::{Delivery, RawMessage};
use envoi_core::Headers;
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, TypeInfo, ValueRef};

/// Reads a claimed, listed or found row (`id, body, headers`) as a
/// delivery. Only an unreadable id fails: a body or headers of the wrong
/// storage class, not UTF-8 or not a JSON object of strings are handed out
/// as well as they can be read, with [`INVALID_BODY_HEADER`] or
/// [`INVALID_HEADERS_HEADER`] saying what is wrong.
pub(crate) fn decode_row(row: &SqliteRow) -> Result<Delivery, sqlx::Error> {
    let id: i64 = row.try_get(0)?;
    // The storage classes first: reading a value as bytes may convert it.
    let body_class = storage_class(row, 1)?;
    let headers_class = storage_class(row, 2)?;
    // Unchecked: any storage class reads as bytes (a number as its text,
    // NULL as nothing); the classes above say whether that was expected.
    let body: Vec<u8> = row.try_get_unchecked(1)?;
    let stored: &[u8] = row.try_get_unchecked(2)?;
    let mut headers = read_headers(headers_class, stored);
    if !matches!(body_class, "BLOB" | "TEXT") {
        let handed_out = if body_class == "NULL" {
            "handed out empty"
        } else {
            "handed out as its text"
        };
        headers.insert(
            INVALID_BODY_HEADER,
            format!("body stored as {body_class}, not BLOB: {handed_out}"),
        );
    }
    Ok(Delivery::new(id.to_string(), RawMessage { body, headers }))
}

/// What [`INVALID_HEADERS_HEADER`] or [`INVALID_BODY_HEADER`] says is wrong
/// with the row `delivery` was read from; `None` when it was stored as
/// envoi stores rows.
pub(crate) fn invalid_reason(delivery: &Delivery) -> Option<&str> {
    let raw = &delivery.raw;
    raw.header(INVALID_HEADERS_HEADER)
        .or(raw.header(INVALID_BODY_HEADER))
}

/// The SQLite storage class of column `index`: `NULL`, `INTEGER`, `REAL`,
/// `TEXT` or `BLOB`.
fn storage_class(row: &SqliteRow, index: usize) -> Result<&'static str, sqlx::Error> {
    let value = row.try_get_raw(index)?;
    if value.is_null() {
        return Ok("NULL");
    }
    Ok(match value.type_info().name() {
        "INTEGER" => "INTEGER",
        "REAL" => "REAL",
        "TEXT" => "TEXT",
        "BLOB" => "BLOB",
        _ => "an unknown storage class",
    })
}

/// The headers of a row, stored as `class` holding `stored`: TEXT is read
/// by [`decode_json_headers`]; any other class is salvaged with the class
/// as the first problem, and NULL, which holds nothing to keep, is only
/// the problem.
fn read_headers(class: &str, stored: &[u8]) -> Headers {
    match class {
        "TEXT" => decode_json_headers(stored),
        "NULL" => Headers::from([(INVALID_HEADERS_HEADER, "headers stored as NULL, not TEXT")]),
        _ => salvage_json_headers(
            stored,
            vec![format!("headers stored as {class}, not TEXT")],
            None,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoi_core::transport::support::STORED_HEADERS_HEADER;
    use sqlx::{AssertSqlSafe, Connection, SqliteConnection};

    /// The delivery `decode_row` makes of `SELECT 1, <body>, <headers>`.
    async fn decoded(body: &str, headers: &str) -> Delivery {
        let mut conn = SqliteConnection::connect("sqlite::memory:")
            .await
            .expect("memory db");
        let row = sqlx::query(AssertSqlSafe(format!("SELECT 1, {body}, {headers}")))
            .fetch_one(&mut conn)
            .await
            .expect("select");
        decode_row(&row).expect("a row with an id decodes")
    }

    #[tokio::test]
    async fn rows_stored_as_envoi_stores_them_decode_without_a_reason() {
        let d = decoded("x'7b7d'", r#"'{"type":"Job","kind":"command"}'"#).await;
        assert_eq!(d.id.as_str(), "1");
        assert!(!d.redelivered);
        assert_eq!(d.raw.body, b"{}");
        assert_eq!(
            d.raw.headers,
            Headers::from([("kind", "command"), ("type", "Job")])
        );
        // A TEXT body is read as its bytes, as before.
        let d = decoded("'{}'", "'{}'").await;
        assert_eq!(
            (d.raw.body.as_slice(), d.raw.headers.len()),
            (&b"{}"[..], 0)
        );
    }

    #[tokio::test]
    async fn a_stored_header_named_like_the_former_redelivery_mark_is_an_ordinary_header() {
        let d = decoded("x'7b7d'", r#"'{"X-Envoi-Redelivered":"true"}'"#).await;
        assert!(!d.redelivered, "only the delivery count marks a delivery");
        assert_eq!(d.raw.header("X-Envoi-Redelivered"), Some("true"));
        assert_eq!(invalid_reason(&d), None);
    }

    #[tokio::test]
    async fn a_body_of_the_wrong_storage_class_is_read_as_its_text_with_the_reason() {
        for (body, bytes, reason) in [
            (
                "5",
                &b"5"[..],
                "body stored as INTEGER, not BLOB: handed out as its text",
            ),
            (
                "2.5",
                b"2.5",
                "body stored as REAL, not BLOB: handed out as its text",
            ),
            (
                "NULL",
                b"",
                "body stored as NULL, not BLOB: handed out empty",
            ),
        ] {
            let d = decoded(body, r#"'{"type":"Job"}'"#).await;
            assert_eq!(d.raw.body, bytes, "{body}");
            assert_eq!(d.raw.header(INVALID_BODY_HEADER), Some(reason), "{body}");
            assert_eq!(d.raw.header("type"), Some("Job"), "{body}");
            assert_eq!(d.raw.header(INVALID_HEADERS_HEADER), None, "{body}");
            assert_eq!(invalid_reason(&d), Some(reason), "{body}");
        }
    }

    /// Stored headers, the headers read, the stored text kept, the reason.
    type Case = (
        &'static str,
        &'static [(&'static str, &'static str)],
        Option<&'static str>,
        &'static str,
    );

    const INVALID_HEADER_CASES: [Case; 8] = [
        (
            r#"'{"type":"Job","type":"Other"}'"#,
            &[("type", "Other")],
            Some(r#"{"type":"Job","type":"Other"}"#),
            "stored headers are not a JSON object of strings: \
             header `type` is given more than once at line 1 column 29",
        ),
        (
            r#"CAST('{"type":"Job"}' AS BLOB)"#,
            &[("type", "Job")],
            Some(r#"{"type":"Job"}"#),
            "headers stored as BLOB, not TEXT",
        ),
        (
            "CAST(x'7b22ff223a2231227d' AS TEXT)",
            &[("\u{fffd}", "1")],
            Some("x'7b22ff223a2231227d'"),
            "stored headers are not UTF-8 (invalid utf-8 sequence of 1 bytes from index 2); \
             `X-Envoi-Stored-Headers` holds them as a hex literal",
        ),
        (
            r#"'{"type":"Job","n":1,"tags":["a"]}'"#,
            &[("type", "Job")],
            Some(r#"{"type":"Job","n":1,"tags":["a"]}"#),
            "stored headers are not a JSON object of strings: `n` holds a number, \
             `tags` holds an array",
        ),
        (
            "'not json'",
            &[],
            Some("not json"),
            "stored headers are not a JSON object of strings: expected ident at line 1 column 2",
        ),
        (
            "'[1,2]'",
            &[],
            Some("[1,2]"),
            "stored headers are not a JSON object of strings: they are an array",
        ),
        (
            "7",
            &[],
            Some("7"),
            "headers stored as INTEGER, not TEXT; \
             stored headers are not a JSON object of strings: they are a number",
        ),
        ("NULL", &[], None, "headers stored as NULL, not TEXT"),
    ];

    #[tokio::test]
    async fn invalid_headers_keep_their_strings_and_the_stored_text_with_the_reason() {
        for (stored, read, kept, reason) in INVALID_HEADER_CASES {
            let d = decoded("x'7b7d'", stored).await;
            let mut expected: Headers = read.iter().copied().collect();
            expected.insert(INVALID_HEADERS_HEADER, reason);
            if let Some(kept) = kept {
                expected.insert(STORED_HEADERS_HEADER, kept);
            }
            assert_eq!(d.raw.headers, expected, "{stored}");
            assert_eq!(d.raw.body, b"{}", "{stored}");
        }
    }
}
