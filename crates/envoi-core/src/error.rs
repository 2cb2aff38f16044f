//! Errors of the untyped bus, of handlers and of transports.
//!
//! [`BusError`] is what `MessageBus` returns. The typed
//! `Dispatcher` splits it: the message's own domain error
//! goes to `DispatchError::Domain`, everything
//! else (no handler, cancellation, deadline, transport) to
//! `DispatchError::Infrastructure`.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::envelope::message::MessageKind;
use crate::envelope::Envelope;

/// A boxed, thread-safe error.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Result with [`BusError`] as the default error.
pub type Result<T, E = BusError> = std::result::Result<T, E>;

/// What the bus's built-in steps hand each other: the error boxed, so the
/// value moved out of every nested future on the way back is three words
/// instead of a whole [`BusError`]. Converted back at the bus's edge.
pub(crate) type StepResult = std::result::Result<crate::envelope::Envelope, Box<BusError>>;

/// The stage of a hook middleware operation, after the message kind:
/// `Publish` for events, `Callback` for queries, `Execute` for commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Stage {
    /// Fire-and-forget broadcasting (events).
    Publish,
    /// Request/response (queries).
    Callback,
    /// Executing a command.
    Execute,
}

impl From<MessageKind> for Stage {
    fn from(kind: MessageKind) -> Self {
        match kind {
            MessageKind::Event => Stage::Publish,
            MessageKind::Query => Stage::Callback,
            MessageKind::Command => Stage::Execute,
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Publish => "Publish",
            Stage::Callback => "Callback",
            Stage::Execute => "Execute",
        })
    }
}

/// How a retry policy should treat a handler failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryHint {
    /// Let the retry strategy decide.
    Default,
    /// Never retry: move the message to the failure transport at once.
    Unrecoverable,
    /// Always retry (within the strategy's budget), optionally after a delay
    /// the error chose.
    Recoverable(Option<Duration>),
}

/// Wrap (or put in the `source()` chain of) a handler error to say that
/// retrying cannot help: the message goes straight to the failure transport.
#[derive(Debug, thiserror::Error)]
#[error("unrecoverable: {0}")]
pub struct Unrecoverable(#[source] pub BoxError);

impl Unrecoverable {
    /// Marks `error` unrecoverable.
    pub fn new(error: impl Into<BoxError>) -> Self {
        Self(error.into())
    }
}

/// Wrap (or put in the `source()` chain of) a handler error to say that it
/// is worth retrying, optionally after a delay of its own.
#[derive(Debug, thiserror::Error)]
#[error("recoverable: {source}")]
pub struct Recoverable {
    /// The underlying error.
    #[source]
    pub source: BoxError,
    /// A delay to use instead of the strategy's.
    pub delay: Option<Duration>,
}

impl Recoverable {
    /// Marks `error` recoverable, retried after the strategy's delay.
    pub fn new(error: impl Into<BoxError>) -> Self {
        Self {
            source: error.into(),
            delay: None,
        }
    }

    /// Marks `error` recoverable, retried after `delay`.
    pub fn after(error: impl Into<BoxError>, delay: Duration) -> Self {
        Self {
            source: error.into(),
            delay: Some(delay),
        }
    }
}

/// One handler's failure.
#[derive(Debug)]
pub struct HandlerError {
    /// The handler's name.
    pub handler: &'static str,
    /// What it returned.
    pub error: BoxError,
}

impl HandlerError {
    /// Looks through the error and its `source()` chain for an
    /// [`Unrecoverable`] or [`Recoverable`] marker.
    pub fn retry_hint(&self) -> RetryHint {
        let mut current: Option<&(dyn StdError + 'static)> = Some(&*self.error);
        while let Some(e) = current {
            if e.is::<Unrecoverable>() {
                return RetryHint::Unrecoverable;
            }
            if let Some(r) = e.downcast_ref::<Recoverable>() {
                return RetryHint::Recoverable(r.delay);
            }
            current = e.source();
        }
        RetryHint::Default
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "handler `{}` failed: {}", self.handler, self.error)
    }
}

impl StdError for HandlerError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.error)
    }
}

/// Everything that can go wrong dispatching on the untyped bus.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BusError {
    /// One or more handlers returned an error. Carries the envelope (with the
    /// stamps of the handlers that succeeded) so nothing is lost.
    #[error("handling `{}` failed: {}", envelope.message_name(), join(errors))]
    HandlerFailed {
        /// The envelope as it was when the handlers ran.
        envelope: Box<Envelope>,
        /// Every failing handler's error.
        errors: Vec<HandlerError>,
    },
    /// A command or query has no handler.
    #[error("no handler for {kind} `{message}`")]
    NoHandler {
        /// The message name.
        message: &'static str,
        /// How it was dispatched.
        kind: MessageKind,
    },
    /// A hook middleware interrupted the operation.
    #[error("{stage} of message {message_id} cancelled by middleware `{middleware}`{}", reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default())]
    Cancelled {
        /// The stage that was running.
        stage: Stage,
        /// The id of the cancelled message.
        message_id: String,
        /// The name of the middleware that interrupted.
        middleware: String,
        /// Why, if it said.
        reason: Option<String>,
    },
    /// An `outgoing` filter returned `Stop`.
    #[error("outgoing filters blocked `{message}`")]
    OutgoingFiltersBlocked {
        /// The message name.
        message: &'static str,
    },
    /// A deadline expired and the handler was abandoned.
    #[error("{side}.{tag} exceeded its deadline of {after:?}")]
    DeadlineExceeded {
        /// The message name.
        tag: &'static str,
        /// `command`, `query` or `event`.
        side: &'static str,
        /// The limit that passed.
        after: Duration,
    },
    /// A transport failed; the envelope is handed back.
    #[error("transport `{transport}` failed: {source}")]
    Transport {
        /// The transport's name.
        transport: String,
        /// The envelope that could not be sent, if any.
        envelope: Option<Box<Envelope>>,
        /// The underlying error.
        #[source]
        source: TransportError,
    },
    /// A message could not be encoded or decoded.
    #[error(transparent)]
    Serialization(#[from] SerializationError),
    /// Messages deferred until after the current dispatch failed.
    #[error("{} deferred message(s) failed: {}", errors.len(), join(errors))]
    DelayedHandlingFailed {
        /// The outer envelope, which was handled.
        envelope: Box<Envelope>,
        /// Each deferred dispatch's error.
        errors: Vec<BusError>,
    },
    /// A typed dispatch that waits for a handler's result was refused,
    /// and nothing was sent: the message is routed to transports, where no
    /// result comes back. Send it with `Dispatcher::send` instead (or give
    /// the command a unit output).
    #[error("`{message}` is routed to {}, where no result comes back; nothing was sent (use `send` for messages routed to a transport)", transports.join(", "))]
    ExpectsResult {
        /// The message name.
        message: &'static str,
        /// The transports it is routed to.
        transports: Vec<String>,
    },
    /// `Dispatcher::send` was given a message routed to no transport;
    /// nothing was handled. Dispatch it instead.
    #[error(
        "`{message}` is routed to no transport; nothing was sent or handled (dispatch it instead)"
    )]
    NotRouted {
        /// The message name.
        message: &'static str,
    },
    /// A `before_consuming` filter stopped the message: its handler did not
    /// run, so a typed dispatch has no result. Not a failure of the
    /// handler.
    #[error("`{message}` was stopped by a `{stage}` filter; its handler did not run")]
    StoppedByFilter {
        /// The message name.
        message: &'static str,
        /// The stage whose filter stopped it.
        stage: String,
    },
    /// A typed dispatch expected a result but the message was not handled
    /// synchronously (it was sent to a transport, for instance).
    #[error("`{message}` was not handled synchronously, so it has no result")]
    NoResult {
        /// The message name.
        message: &'static str,
    },
    /// A middleware failed with an error of its own: the opt-in
    /// middleware's error types (a validation's `Invalid`, a circuit
    /// breaker's `CircuitOpen`) live with them and come wrapped here; see
    /// [`BusError::middleware_error`].
    #[error("middleware `{middleware}` failed: {source}")]
    Middleware {
        /// The middleware's name.
        middleware: String,
        /// The error.
        #[source]
        source: BoxError,
    },
    /// The bus was disposed.
    #[error("bus `{0}` is disposed")]
    Disposed(String),
}

impl BusError {
    /// The envelope the error carries, if any.
    pub fn envelope(&self) -> Option<&Envelope> {
        match self {
            BusError::HandlerFailed { envelope, .. }
            | BusError::DelayedHandlingFailed { envelope, .. } => Some(envelope),
            BusError::Transport { envelope, .. } => envelope.as_deref(),
            _ => None,
        }
    }

    /// The error of type `E` a middleware failed with
    /// ([`BusError::Middleware`]), if it is one.
    ///
    /// ```
    /// use envoi_core::BusError;
    ///
    /// #[derive(Debug, thiserror::Error)]
    /// #[error("quota exceeded")]
    /// struct OverQuota;
    ///
    /// let error = BusError::Middleware { middleware: "Quota".into(), source: Box::new(OverQuota) };
    /// assert!(error.middleware_error::<OverQuota>().is_some());
    /// assert!(error.middleware_error::<std::fmt::Error>().is_none());
    /// ```
    pub fn middleware_error<E: StdError + 'static>(&self) -> Option<&E> {
        match self {
            BusError::Middleware { source, .. } => source.downcast_ref::<E>(),
            _ => None,
        }
    }

    /// A short, stable classification (`handler`, `no_handler`, `cancelled`,
    /// …) for metrics labels and error-details stamps.
    pub fn kind(&self) -> &'static str {
        match self {
            BusError::HandlerFailed { .. } => "handler",
            BusError::NoHandler { .. } => "no_handler",
            BusError::Cancelled { .. } => "cancelled",
            BusError::OutgoingFiltersBlocked { .. } => "outgoing_blocked",
            BusError::DeadlineExceeded { .. } => "deadline",
            BusError::Transport { .. } => "transport",
            BusError::Serialization(_) => "serialization",
            BusError::DelayedHandlingFailed { .. } => "delayed",
            BusError::NoResult { .. } => "no_result",
            BusError::ExpectsResult { .. } => "expects_result",
            BusError::NotRouted { .. } => "not_routed",
            BusError::StoppedByFilter { .. } => "stopped_by_filter",
            BusError::Middleware { .. } => "middleware",
            BusError::Disposed(_) => "disposed",
        }
    }
}

fn join<T: fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a transport can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The DSN could not be understood.
    #[error("invalid DSN `{dsn}`: {reason}")]
    InvalidDsn {
        /// The DSN, with any password masked.
        dsn: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No transport has that name.
    #[error("unknown transport `{0}`")]
    UnknownTransport(String),
    /// No message has that id.
    #[error("no message with id `{0}`")]
    NotFound(String),
    /// The payload is larger than the configured limit.
    #[error("payload of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The payload's size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The operation is not supported by this transport.
    #[error("`{0}` is not supported by this transport")]
    Unsupported(&'static str),
    /// The transport was closed.
    #[error("transport closed")]
    Closed,
    /// The message could not be encoded for, or decoded from, the transport.
    #[error(transparent)]
    Serialization(#[from] SerializationError),
    /// The backend (database, broker) could not be reached: it refused
    /// the connection, or gave no answer within the connect timeout.
    #[error("cannot connect to `{dsn}`: {source}")]
    Unreachable {
        /// The DSN, with any password masked.
        dsn: String,
        /// Why: the driver's error, or the timeout that ran out.
        #[source]
        source: BoxError,
    },
    /// The backend (database, broker) failed.
    #[error("{context}: {source}")]
    Backend {
        /// What was being done.
        context: String,
        /// The driver's error.
        #[source]
        source: BoxError,
    },
}

impl TransportError {
    /// A backend error with context.
    pub fn backend(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        TransportError::Backend {
            context: context.into(),
            source: source.into(),
        }
    }
}

/// What encoding or decoding a message can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SerializationError {
    /// The `type` header names no registered message.
    #[error("unknown message type `{0}`")]
    UnknownType(String),
    /// A required header is absent.
    #[error("missing header `{0}`")]
    MissingHeader(&'static str),
    /// The body did not decode as the named type.
    #[error("malformed body for `{message}`: {source}")]
    Malformed {
        /// The message name.
        message: String,
        /// The decoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// A stamp header did not decode.
    #[error("malformed stamp header `{header}`: {reason}")]
    MalformedStamp {
        /// The header name.
        header: String,
        /// What is wrong.
        reason: String,
    },
    /// The body is larger than the configured limit.
    #[error("body of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The body's size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The headers (names and values, stamp headers included) add up to
    /// more bytes than the configured limit.
    #[error("headers of {size} bytes exceed the limit of {limit} bytes")]
    HeadersTooLarge {
        /// The headers' size: the bytes of every name and value.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A header has a value the serializer cannot use, or an envelope header
    /// uses a name the serializer reserves.
    #[error("invalid header `{header}`: {reason}")]
    InvalidHeader {
        /// The header name.
        header: String,
        /// What is wrong.
        reason: String,
    },
    /// The message type was never registered for encoding.
    #[error("message `{0}` is not registered with the serializer")]
    NotRegistered(&'static str),
    /// The message failed to encode.
    #[error("encoding `{message}` failed: {source}")]
    Encode {
        /// The message name.
        message: &'static str,
        /// The encoder's error.
        #[source]
        source: serde_json::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_hint_is_found_in_the_source_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("payment declined")]
        struct Declined(#[source] Unrecoverable);
        let e = HandlerError {
            handler: "h",
            error: Box::new(Declined(Unrecoverable::new("card stolen"))),
        };
        assert_eq!(e.retry_hint(), RetryHint::Unrecoverable);

        let e = HandlerError {
            handler: "h",
            error: Box::new(Recoverable::after("busy", Duration::from_secs(2))),
        };
        assert_eq!(
            e.retry_hint(),
            RetryHint::Recoverable(Some(Duration::from_secs(2)))
        );

        let e = HandlerError {
            handler: "h",
            error: "plain".into(),
        };
        assert_eq!(e.retry_hint(), RetryHint::Default);
    }

    #[test]
    fn cancelled_error_names_stage_message_middleware_and_reason() {
        let e = BusError::Cancelled {
            stage: Stage::Execute,
            message_id: "m-1".into(),
            middleware: "Auth".into(),
            reason: Some("no token".into()),
        };
        assert_eq!(
            e.to_string(),
            "Execute of message m-1 cancelled by middleware `Auth`: no token"
        );
    }
}
