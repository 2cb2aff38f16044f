//! The two spans and their attributes, after the OpenTelemetry messaging
//! semantic conventions ([`SEMCONV_VERSION`](crate::SEMCONV_VERSION)).
//!
//! `tracing` needs field names when a span is created, so every attribute
//! a span may get is declared there, empty until recorded; the
//! `tracing-opentelemetry` layer turns `otel.name`, `otel.kind` and
//! `otel.status_code` into the span's name, kind and status, and every
//! other field into an attribute.

use envoi_core::middleware::correlation::CorrelationIdStamp;
use envoi_core::stamp::{MessageIdStamp, TransportMessageIdStamp};
use envoi_core::transport::TransportDescription;
use envoi_core::Envelope;
use tracing::field::Empty;
use tracing::Span;

/// The target of the send and process spans: a subscriber filters them by
/// it (`envoi::messaging=info`).
pub const TARGET: &str = "envoi::messaging";

/// A `send` producer span, child of the current span; its name becomes
/// `send {destination}` once the destination is known.
pub(crate) fn send() -> Span {
    tracing::info_span!(
        target: TARGET,
        "send",
        otel.name = "send",
        otel.kind = "producer",
        otel.status_code = Empty,
        otel.status_description = Empty,
        "messaging.system" = Empty,
        "messaging.operation.name" = "send",
        "messaging.operation.type" = "send",
        "messaging.destination.name" = Empty,
        "messaging.message.id" = Empty,
        "messaging.message.conversation_id" = Empty,
        "server.address" = Empty,
        "server.port" = Empty,
        "error.type" = Empty,
    )
}

/// A `process {transport}` consumer span with no `tracing` parent: its
/// OpenTelemetry parent is the context the message carries, if any.
pub(crate) fn process(transport: &str) -> Span {
    tracing::info_span!(
        target: TARGET,
        parent: None,
        "process",
        otel.name = format!("process {transport}"),
        otel.kind = "consumer",
        otel.status_code = Empty,
        otel.status_description = Empty,
        "messaging.system" = Empty,
        "messaging.operation.name" = "process",
        "messaging.operation.type" = "process",
        "messaging.destination.name" = transport,
        "messaging.message.id" = Empty,
        "messaging.message.conversation_id" = Empty,
        "server.address" = Empty,
        "server.port" = Empty,
        "error.type" = Empty,
    )
}

/// Records the message's id (envoi's own, kept across transports and
/// retries, else the transport's) and its conversation (the correlation
/// id), when the envelope has them.
pub(crate) fn record_message(span: &Span, envelope: &Envelope) {
    if let Some(id) = envelope.last::<MessageIdStamp>() {
        span.record("messaging.message.id", id.id.to_string());
    } else if let Some(id) = envelope.last::<TransportMessageIdStamp>() {
        span.record("messaging.message.id", id.id.as_str());
    }
    if let Some(correlation) = envelope.last::<CorrelationIdStamp>() {
        span.record(
            "messaging.message.conversation_id",
            correlation.id.to_string(),
        );
    }
}

/// Records what `described` says of the transport: its system and server.
pub(crate) fn record_transport(span: &Span, described: &TransportDescription) {
    span.record("messaging.system", described.system);
    if let Some((host, port)) = &described.server {
        span.record("server.address", host.as_str());
        span.record("server.port", i64::from(*port));
    }
}

/// Records a failure of kind `kind` (`handler`, `transport`, …): the
/// span's status is an error and `error.type` names the kind.
pub(crate) fn record_error(span: &Span, kind: &'static str) {
    span.record("otel.status_code", "error");
    span.record("otel.status_description", kind);
    span.record("error.type", kind);
}
