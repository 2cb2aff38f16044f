//! Errors of the AMQP transport that do not come from the client library.
//!
//! They reach callers as the `source` of a
//! [`TransportError::Backend`](envoi_core::TransportError::Backend), next to
//! the [`lapin::Error`]s of the client itself.

/// What can go wrong in the transport besides the client library's errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmqpError {
    /// A header name is one RabbitMQ sets by itself (`x-death`,
    /// `x-delivery-count`, `x-first-death-*`, `x-last-death-*`); the transport
    /// could not hand it back unchanged.
    #[error("header `{0}` is reserved by RabbitMQ")]
    ReservedHeader(String),
    /// AMQP header names are at most 255 bytes.
    #[error("a header name of {0} bytes is longer than the 255 bytes AMQP allows")]
    HeaderNameTooLong(usize),
    /// The broker returned a message it could not route to any queue, even
    /// after the topology was declared again.
    #[error("exchange `{exchange}` has no queue bound for routing key `{routing_key}` ({reply})")]
    Unroutable {
        /// The exchange published to.
        exchange: String,
        /// The routing key used.
        routing_key: String,
        /// The broker's reply text.
        reply: String,
    },
    /// The broker refused to take responsibility for a message (a negative
    /// publisher confirm), repeatedly.
    #[error("the broker refused the message (negative publisher confirm)")]
    Nacked,
    /// The delivery came from a connection that has since been closed: the
    /// broker has already put the message back and will hand it out again.
    #[error("delivery `{0}` belongs to a closed connection; the broker redelivers it")]
    StaleDelivery(String),
    /// The connection could not be (re)established in time.
    #[error("could not connect within {0:?}")]
    ConnectTimeout(std::time::Duration),
}
