//! The configuration mistakes
//! [`MessengerBuilder::build`](super::MessengerBuilder::build) refuses: a
//! [`BuildError`].

use crate::envelope::message::MessageKind;
use crate::transport::serializer::RegistryError;

/// A configuration mistake found by
/// [`MessengerBuilder::build`](super::MessengerBuilder::build).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// A command or query got a second handler.
    #[error("{kind} `{message}` already has a handler; a {kind} has exactly one")]
    DuplicateHandler {
        /// The message name.
        message: &'static str,
        /// Its kind.
        kind: MessageKind,
    },
    /// One message type was registered as two kinds.
    #[error("`{message}` is registered both as {first} and as {second}")]
    KindConflict {
        /// The message name.
        message: &'static str,
        /// The first kind.
        first: MessageKind,
        /// The second kind.
        second: MessageKind,
    },
    /// A handler takes shared state of a type that was not registered with
    /// [`MessengerBuilder::state`](super::MessengerBuilder::state): a
    /// [`State<T>`](crate::State) argument of a handler function, or a type
    /// a [`ContextHandler`](crate::ContextHandler) lists in its
    /// [`required_state`](crate::ContextHandler::required_state).
    #[error(
        "handler `{handler}` of `{message}` takes shared state of type `{state}`, \
         which is not registered; register it with `Messenger::builder().state(…)`"
    )]
    MissingState {
        /// The handler's name.
        handler: &'static str,
        /// The message name.
        message: &'static str,
        /// The state's type.
        state: &'static str,
    },
    /// Two values of one type were registered as shared state.
    #[error("shared state of type `{0}` is registered twice; a type has one value")]
    DuplicateState(&'static str),
    /// Two buses have one name.
    #[error("bus `{0}` is defined twice")]
    DuplicateBus(String),
    /// A route names a transport with no sender.
    #[error("`{message}` is routed to `{transport}`, which is not a configured transport")]
    UnknownTransport {
        /// The message name.
        message: &'static str,
        /// The transport name.
        transport: String,
    },
    /// A query is routed to a transport that does not hand results back
    /// (any but `sync://`): its answer would never reach the caller.
    #[error("query `{message}` is routed to `{transport}`, which gives no answer back; a query is handled in process (or through `sync://`)")]
    QueryRoutedToTransport {
        /// The message name.
        message: &'static str,
        /// The transport.
        transport: String,
    },
    /// A failure transport is not a configured transport.
    #[error("failure transport `{0}` is not a configured transport")]
    UnknownFailureTransport(String),
    /// A failure transport handles messages when they are sent
    /// (`sync://`): parking a message there would handle it again at once,
    /// fail again and park it again, without end.
    #[error(
        "failure transport `{0}` handles messages when they are sent (`sync://`); \
         a failure transport must store them"
    )]
    FailureTransportHandlesOnSend(String),
    /// Two transports (or a transport and a sender) have one name.
    #[error("transport `{0}` is defined twice")]
    DuplicateTransport(String),
    /// Two message or stamp types share a wire name.
    #[error(transparent)]
    Serializer(#[from] RegistryError),
    /// A transport could not be created from its DSN.
    #[error("transport `{name}`: {reason}")]
    Transport {
        /// The transport's name.
        name: String,
        /// Why (the DSN in it has its password masked).
        reason: String,
    },
    /// A transport is configured by DSN, which needs
    /// [`MessengerBuilder::build_async`](super::MessengerBuilder::build_async).
    #[error("transport `{0}` is configured by DSN; build with `build_async().await`")]
    NeedsAsyncBuild(String),
}
