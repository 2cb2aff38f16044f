//! What building a worker, or handling one message as a worker would, can
//! fail with.

/// A configuration mistake found by [`WorkerBuilder::build`](crate::worker::WorkerBuilder::build).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// No receiver was given.
    #[error("a worker needs at least one transport to consume")]
    NoReceivers,
    /// A receiver names no transport registered with the messenger.
    #[error("unknown transport `{0}`")]
    UnknownTransport(String),
    /// The transport handles messages when they are sent (`sync://`), so
    /// there is nothing to consume.
    #[error("transport `{0}` handles messages when they are sent; there is nothing to consume")]
    NotConsumable(String),
    /// An option is out of range.
    #[error("invalid worker option: {0}")]
    InvalidOption(String),
    /// A transport operation failed.
    #[error("transport `{transport}` failed: {error}")]
    Transport {
        /// The transport.
        transport: String,
        /// The error.
        error: String,
    },
}
