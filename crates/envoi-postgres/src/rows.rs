//! Rows as deliveries: ids, and the body and headers a row holds.

use envoi_core::serializer::{INVALID_BODY_HEADER, INVALID_HEADERS_HEADER};
use envoi_core::transport::support::decode_json_headers;
use envoi_core::transport::{Delivery, DeliveryId, RawMessage};
use envoi_core::Headers;
use sqlx::postgres::PgRow;
use sqlx::Row;

/// The row id a delivery id names: a positive integer.
pub(crate) fn parse_id(id: &DeliveryId) -> Option<i64> {
    id.as_str().parse::<i64>().ok().filter(|id| *id > 0)
}

/// The headers stored as `stored` (`headers::text`), or NULL. Headers
/// that are not a JSON object of strings are kept as
/// [`decode_json_headers`] keeps them, saying why, so that the message
/// does not decode and the worker parks it with the reason.
fn stored_headers(stored: Option<&str>) -> Headers {
    match stored {
        Some(text) => decode_json_headers(text.as_bytes()),
        None => Headers::from([(INVALID_HEADERS_HEADER, "the stored headers are NULL")]),
    }
}

/// A row (`id, body, headers::text, …`) as a delivery. A row whose body or
/// headers are NULL (a table whose constraints were changed, written by
/// hand) is still handed out, marked so that it does not decode, rather
/// than failing the whole claim and holding up every row claimed with it.
pub(crate) fn row_to_delivery(row: &PgRow) -> Result<Delivery, sqlx::Error> {
    let id: i64 = row.try_get(0)?;
    let body: Option<Vec<u8>> = row.try_get(1)?;
    let headers: Option<String> = row.try_get(2)?;
    let mut headers = stored_headers(headers.as_deref());
    if body.is_none() {
        headers.insert(INVALID_BODY_HEADER, "the stored body is NULL");
    }
    Ok(Delivery::new(
        id.to_string(),
        RawMessage {
            body: body.unwrap_or_default(),
            headers,
        },
    ))
}

#[cfg(test)]
mod tests {
    use envoi_core::transport::support::STORED_HEADERS_HEADER;

    use super::*;

    #[test]
    fn ids_are_positive_integers_only() {
        assert_eq!(parse_id(&DeliveryId::from("42")), Some(42));
        for bad in ["", "0", "-3", "1-0", "abc", "💥", "99999999999999999999"] {
            assert_eq!(parse_id(&DeliveryId::from(bad)), None, "{bad:?}");
        }
    }

    #[test]
    fn stored_headers_that_are_not_strings_are_kept_with_the_reason_and_never_vanish() {
        assert_eq!(
            stored_headers(Some(r#"{"type":"A","n":"1"}"#)),
            Headers::from([("type", "A"), ("n", "1")])
        );
        // Not stringified: the string headers stay, the rest is kept as
        // stored, and the message is marked so that it is parked.
        let odd = stored_headers(Some(r#"{"type":"A","n":1,"ok":true}"#));
        assert_eq!(odd.get("type"), Some("A"));
        assert_eq!(odd.get("n"), None);
        assert_eq!(odd.get("ok"), None);
        let reason = odd.get(INVALID_HEADERS_HEADER).unwrap();
        assert!(reason.contains("`n` holds a number"), "{reason}");
        assert!(reason.contains("`ok` holds a boolean"), "{reason}");
        assert_eq!(
            odd.get(STORED_HEADERS_HEADER),
            Some(r#"{"type":"A","n":1,"ok":true}"#)
        );

        let array = stored_headers(Some("[1,2]"));
        assert_eq!(array.get(STORED_HEADERS_HEADER), Some("[1,2]"));
        assert!(array
            .get(INVALID_HEADERS_HEADER)
            .unwrap()
            .contains("they are an array"));

        assert_eq!(
            stored_headers(None).get(INVALID_HEADERS_HEADER),
            Some("the stored headers are NULL")
        );
    }
}
