//! Reading a stored message's headers without decoding its body, so that a
//! message whose type is unknown or whose body is malformed can be shown too.

use envoi_core::serializer::{KIND_HEADER, STAMP_HEADER_PREFIX, TYPE_HEADER};
use envoi_core::stamp::{ErrorDetailsStamp, RedeliveryStamp, SentToFailureTransportStamp, Stamp};
use envoi_core::transport::Delivery;
use serde_json::{json, Value};

use crate::table::utc;

/// What the failure commands show about a stored message.
#[derive(Debug)]
pub(crate) struct Inspected {
    pub(crate) id: String,
    pub(crate) message: String,
    pub(crate) kind: Option<String>,
    pub(crate) error: Option<ErrorDetailsStamp>,
    /// Retries it went through (redeliveries with a count above zero).
    pub(crate) retries: usize,
    /// When it was parked (the `at` of its last redelivery stamp).
    pub(crate) failed_at: Option<u64>,
    pub(crate) original_transport: Option<String>,
    /// Each stamp header: the stamp name and its JSON array (or the raw
    /// text when it is not JSON).
    pub(crate) stamps: Vec<(String, Value)>,
    /// The other headers.
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Value,
}

fn stamps_of<S: Stamp>(delivery: &Delivery) -> Vec<S> {
    delivery
        .raw
        .header(&format!("{STAMP_HEADER_PREFIX}{}", S::NAME))
        .and_then(|json| serde_json::from_str::<Vec<S>>(json).ok())
        .unwrap_or_default()
}

pub(crate) fn inspect(delivery: &Delivery) -> Inspected {
    let redeliveries = stamps_of::<RedeliveryStamp>(delivery);
    let mut stamps = Vec::new();
    let mut headers = Vec::new();
    for (key, value) in &delivery.raw.headers {
        if let Some(name) = key.strip_prefix(STAMP_HEADER_PREFIX) {
            let parsed = serde_json::from_str::<Value>(value)
                .unwrap_or_else(|_| Value::String(value.to_string()));
            stamps.push((name.to_string(), parsed));
        } else if key != TYPE_HEADER && key != KIND_HEADER {
            headers.push((key.to_string(), value.to_string()));
        }
    }
    let body = match serde_json::from_slice::<Value>(&delivery.raw.body) {
        Ok(v) => v,
        Err(_) => Value::String(String::from_utf8_lossy(&delivery.raw.body).into_owned()),
    };
    Inspected {
        id: delivery.id.to_string(),
        message: delivery
            .raw
            .header(TYPE_HEADER)
            .unwrap_or("(no type header)")
            .to_string(),
        kind: delivery.raw.header(KIND_HEADER).map(str::to_string),
        error: stamps_of::<ErrorDetailsStamp>(delivery).pop(),
        retries: redeliveries.iter().filter(|r| r.retry_count > 0).count(),
        failed_at: redeliveries.last().map(|r| r.at),
        original_transport: stamps_of::<SentToFailureTransportStamp>(delivery)
            .pop()
            .map(|s| s.original_transport),
        stamps,
        headers,
        body,
    }
}

impl Inspected {
    /// The error's one-line summary: for one failed handler, its own error
    /// (the details name the handler); otherwise the whole message.
    pub(crate) fn error_line(&self) -> String {
        match &self.error {
            Some(e) if e.kind.starts_with("handler:") && !e.chain.is_empty() => e.chain[0].clone(),
            Some(e) => e.message.clone(),
            None => "(no error details)".to_string(),
        }
    }

    pub(crate) fn failed_at_text(&self) -> String {
        self.failed_at.map_or_else(|| "-".to_string(), utc)
    }

    /// The summary as JSON (the rows of `failed show`).
    pub(crate) fn summary_json(&self) -> Value {
        json!({
            "id": self.id,
            "message": self.message,
            "kind": self.kind,
            "error": self.error.as_ref().map(|e| &e.message),
            "error_kind": self.error.as_ref().map(|e| &e.kind),
            "retries": self.retries,
            "failed_at": self.failed_at.map(utc),
            "original_transport": self.original_transport,
        })
    }

    /// Everything, as JSON (`failed show <id>`).
    pub(crate) fn detail_json(&self, transport: &str) -> Value {
        let mut v = self.summary_json();
        if let Value::Object(map) = &mut v {
            map.insert("transport".into(), json!(transport));
            map.insert(
                "error_chain".into(),
                json!(self.error.as_ref().map(|e| &e.chain)),
            );
            map.insert(
                "stamps".into(),
                Value::Object(self.stamps.iter().cloned().collect()),
            );
            map.insert(
                "headers".into(),
                Value::Object(
                    self.headers
                        .iter()
                        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                        .collect(),
                ),
            );
            map.insert("body".into(), self.body.clone());
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoi_core::transport::RawMessage;

    fn delivery(headers: &[(&str, &str)], body: &[u8]) -> Delivery {
        Delivery::new(
            "7",
            RawMessage {
                body: body.to_vec(),
                headers: headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            },
        )
    }

    #[test]
    fn a_parked_message_shows_its_error_retries_and_origin() {
        let d = delivery(
            &[
                ("type", "PlaceOrder"),
                ("kind", "command"),
                (
                    "X-Message-Stamp-ErrorDetails",
                    r#"[{"kind":"handler:h","message":"card declined","chain":["unrecoverable: card declined"]}]"#,
                ),
                (
                    "X-Message-Stamp-Redelivery",
                    r#"[{"retry_count":1,"at":1000},{"retry_count":2,"at":2000},{"retry_count":0,"at":1714566896789}]"#,
                ),
                (
                    "X-Message-Stamp-SentToFailureTransport",
                    r#"[{"original_transport":"orders"}]"#,
                ),
                ("tenant", "acme"),
            ],
            br#"{"id":1}"#,
        );
        let i = inspect(&d);
        assert_eq!(i.message, "PlaceOrder");
        assert_eq!(i.kind.as_deref(), Some("command"));
        assert_eq!(i.error_line(), "unrecoverable: card declined");
        assert_eq!(i.retries, 2);
        assert_eq!(i.failed_at_text(), "2024-05-01T12:34:56.789Z");
        assert_eq!(i.original_transport.as_deref(), Some("orders"));
        assert_eq!(i.headers, vec![("tenant".to_string(), "acme".to_string())]);
        assert_eq!(i.stamps.len(), 3);
        assert_eq!(i.body, json!({"id": 1}));
    }

    #[test]
    fn a_message_that_is_not_json_is_still_shown() {
        let d = delivery(
            &[("X-Message-Stamp-Redelivery", "not json")],
            b"\xff\xfebinary",
        );
        let i = inspect(&d);
        assert_eq!(i.message, "(no type header)");
        assert_eq!(i.error_line(), "(no error details)");
        assert_eq!(i.retries, 0);
        assert_eq!(i.failed_at_text(), "-");
        assert_eq!(i.stamps, vec![("Redelivery".into(), json!("not json"))]);
        assert!(matches!(i.body, Value::String(_)));
    }
}
