//! The canonical order, declared once: every bus runs its steps in this
//! order, lists them in it ([`MessageBus::pipeline`]) and assembles a
//! [`MiddlewareStack`] of its public steps in it
//! ([`MessageBus::stack`]).
//!
//! The bus runs the steps inline, in one future, rather than through the
//! stack: the built-in steps are known types, so a step with nothing to do
//! costs a branch instead of a boxed layer. A test runs the same messages
//! through both and holds them to the same results
//! (`crates/envoi-core/tests/canonical.rs`).
//!
//! [`MessageBus::pipeline`]: super::bus::MessageBus::pipeline
//! [`MessageBus::stack`]: super::bus::MessageBus::stack
//! [`MiddlewareStack`]: crate::middleware::MiddlewareStack

/// One step of the canonical pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Step {
    /// Tags the envelope with the bus's name
    /// ([`AddBusNameStamp`](super::add_bus_name::AddBusNameStamp)).
    AddBusName,
    /// Holds a dispatch stamped to wait for the current one, and settles
    /// what the handlers deferred
    /// ([`DispatchAfterCurrentBus`](super::dispatch_after_current_bus::DispatchAfterCurrentBus)).
    DispatchAfterCurrentBus,
    /// Makes a message retried from a failure transport behave like its
    /// original delivery
    /// ([`FailedMessageProcessing`](super::failed_message_processing::FailedMessageProcessing)).
    FailedMessageProcessing,
    /// The user middleware, in registration order (hook and stage adapters
    /// included), then the bus's stage pipeline.
    User,
    /// Sends a routed message to its transports and stops
    /// ([`SendMessage`](super::send_message::SendMessage)).
    SendMessage,
    /// Retries or parks a received message whose handlers failed
    /// ([`Retry`](super::retry::Retry)).
    Retry,
    /// Runs the handlers ([`HandleMessage`](super::handle_message::HandleMessage)).
    HandleMessage,
}

/// The canonical order, as Symfony Messenger has it.
pub const CANONICAL: [Step; 7] = [
    Step::AddBusName,
    Step::DispatchAfterCurrentBus,
    Step::FailedMessageProcessing,
    Step::User,
    Step::SendMessage,
    Step::Retry,
    Step::HandleMessage,
];

impl Step {
    /// The step's name in pipeline listings.
    pub const fn name(self) -> &'static str {
        match self {
            Step::AddBusName => "AddBusNameStamp",
            Step::DispatchAfterCurrentBus => "DispatchAfterCurrentBus",
            Step::FailedMessageProcessing => "FailedMessageProcessing",
            Step::User => "user middleware",
            Step::SendMessage => "SendMessage",
            Step::Retry => "Retry",
            Step::HandleMessage => "HandleMessage",
        }
    }
}
