//! The canonical pipeline: the bus that runs it, the handlers at its end,
//! and its built-in steps.
//!
//! The order is declared once, in [`canonical`]:
//!
//! 1. [`add_bus_name`] — `AddBusNameStamp`
//! 2. [`dispatch_after_current_bus`] — `DispatchAfterCurrentBus`
//! 3. [`failed_message_processing`] — `FailedMessageProcessing`
//! 4. user middleware, in registration order
//! 5. [`send_message`] — `SendMessage`
//! 6. [`retry`] — `Retry`
//! 7. [`handle_message`] — `HandleMessage`
//!
//! A handler may take the [`context::Context`] of its call, or values taken
//! from it (shared state, [`context::State`]), beside its message.

pub mod add_bus_name;
pub mod bus;
pub mod canonical;
pub mod context;
pub mod dispatch_after_current_bus;
mod extract;
pub mod failed_message_processing;
pub(crate) mod frame;
pub mod handle_message;
pub mod handler;
pub mod retry;
pub mod send_message;
pub mod verdict;
