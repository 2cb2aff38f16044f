//! Message definitions: what can be dispatched, and what the typed
//! dispatchers promise about its result.
//!
//! Every message implements [`Message`], which gives it a stable name (used on
//! the wire, in spans and in metrics). A message is also one of three kinds:
//!
//! * a [`Command`] asks for something to be done and has exactly one handler;
//! * a [`Query`] asks a question and has exactly one handler that answers;
//! * an [`Event`] tells that something happened and has zero or more handlers.
//!
//! The kind's associated `Output` and `Error` types are what the typed
//! `Dispatcher` returns; no middleware can change them.
//!
//! ```
//! use envoi_core::{Command, Message};
//!
//! #[derive(Debug, Clone)]
//! struct PlaceOrder { quantity: u32 }
//!
//! #[derive(Debug, thiserror::Error)]
//! enum OrderError { #[error("out of stock")] OutOfStock }
//!
//! impl Message for PlaceOrder { const NAME: &'static str = "PlaceOrder"; }
//! impl Command for PlaceOrder { type Output = u64; type Error = OrderError; }
//! ```

use std::error::Error as StdError;

/// Anything that can be put in an [`Envelope`](crate::Envelope).
pub trait Message: std::fmt::Debug + Send + Sync + 'static {
    /// Stable name of the message type. It identifies the type on the wire
    /// (the `type` header), names dispatch spans (`command.<NAME>`) and
    /// labels metrics, so keep it stable once messages exist.
    const NAME: &'static str;
}

/// A request to change something; exactly one handler.
pub trait Command: Message {
    /// What the handler returns on success.
    type Output: Send + Sync + Clone + 'static;
    /// The domain error the handler may return.
    type Error: StdError + Send + Sync + 'static;
}

/// A question; exactly one handler, which returns the answer.
pub trait Query: Message {
    /// The answer.
    type Output: Send + Sync + Clone + 'static;
    /// The domain error the handler may return.
    type Error: StdError + Send + Sync + 'static;
}

/// A fact; zero or more handlers.
pub trait Event: Message {
    /// The domain error a handler may return.
    type Error: StdError + Send + Sync + 'static;
}

/// Which of the three kinds a dispatched message is. The call site decides
/// (`dispatch`, `ask`, `publish`); it travels with the envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum MessageKind {
    /// A command: exactly one handler.
    Command,
    /// A query: exactly one handler returning a value.
    Query,
    /// An event: zero or more handlers.
    Event,
}

impl MessageKind {
    /// `command`, `query` or `event`: the side used in span names and metric
    /// labels.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageKind::Command => "command",
            MessageKind::Query => "query",
            MessageKind::Event => "event",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s output.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "command" => Some(MessageKind::Command),
            "query" => Some(MessageKind::Query),
            "event" => Some(MessageKind::Event),
            _ => None,
        }
    }
}

impl std::fmt::Display for MessageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
