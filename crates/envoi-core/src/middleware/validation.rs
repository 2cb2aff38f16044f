//! Validation: a message that breaks its own rules is refused before any
//! handler runs.
//!
//! A message type implements [`Validate`]; [`Validation`] lists the types it
//! checks and, placed in a bus's middleware, fails an invalid message with
//! an [`Invalid`] error naming the message and the reason (wrapped in
//! [`BusError::Middleware`]). The typed
//! dispatcher reports it as an infrastructure error: validation is a
//! property of the bus, not part of the message's own error type (a
//! middleware may not widen that type, as in Effect).
//!
//! Where the bus sends a message to a transport, validation runs before the
//! send, so an invalid message never leaves the producer; on the receiving
//! side it runs again before the handler.
//!
//! ```
//! use envoi_core::middleware::validation::{Invalid, Validate, Validation};
//! use envoi_core::{BusError, Command, DispatchError, Message, Messenger};
//! use std::convert::Infallible;
//!
//! #[derive(Debug, Clone)]
//! struct Transfer { amount: i64 }
//! impl Message for Transfer { const NAME: &'static str = "Transfer"; }
//! impl Command for Transfer { type Output = (); type Error = Infallible; }
//!
//! impl Validate for Transfer {
//!     fn validate(&self) -> Result<(), String> {
//!         if self.amount > 0 { Ok(()) } else { Err(format!("amount must be positive, got {}", self.amount)) }
//!     }
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let messenger = Messenger::builder()
//!     .command_handler(|_: Transfer| async { Ok::<_, Infallible>(()) })
//!     .middleware(Validation::new().message::<Transfer>())
//!     .build()
//!     .unwrap();
//! match messenger.dispatcher().dispatch(Transfer { amount: -5 }).await {
//!     Err(DispatchError::Infrastructure(error)) => {
//!         let invalid = error.middleware_error::<Invalid>().expect("invalid");
//!         assert_eq!(invalid.message, "Transfer");
//!         assert_eq!(invalid.reason, "amount must be positive, got -5");
//!     }
//!     other => panic!("unexpected {other:?}"),
//! }
//! # });
//! ```

use std::any::TypeId;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use super::{BoxFuture, Middleware, Next};
use crate::envelope::message::Message;
use crate::envelope::Envelope;
use crate::error::{BusError, Result};

/// A message that can check its own invariants.
pub trait Validate {
    /// `Ok(())` when the message is valid, otherwise why it is not.
    fn validate(&self) -> std::result::Result<(), String>;
}

type Check = fn(&Envelope) -> std::result::Result<(), String>;

fn check<M: Message + Validate>(envelope: &Envelope) -> std::result::Result<(), String> {
    match envelope.message::<M>() {
        Some(m) => m.validate(),
        None => Ok(()),
    }
}

/// Validates the registered message types before the rest of the pipeline;
/// see the [module docs](self). Other messages pass untouched.
#[derive(Clone, Default)]
pub struct Validation {
    checks: HashMap<TypeId, Check>,
}

impl fmt::Debug for Validation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Validation")
            .field("types", &self.checks.len())
            .finish()
    }
}

impl Validation {
    /// Validates nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also validates messages of type `M`.
    #[must_use = "`message` returns the middleware with the type added"]
    pub fn message<M: Message + Validate>(mut self) -> Self {
        self.checks.insert(TypeId::of::<M>(), check::<M>);
        self
    }

    /// Checks `envelope`: the error the middleware would fail with, if any.
    pub fn check(&self, envelope: &Envelope) -> Result<()> {
        match self.checks.get(&envelope.message_type_id()) {
            Some(check) => check(envelope).map_err(|reason| BusError::Middleware {
                middleware: "Validation".into(),
                source: Box::new(Invalid {
                    message: envelope.message_name(),
                    reason,
                }),
            }),
            None => Ok(()),
        }
    }
}

/// A message that failed validation before any handler ran.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{message}` is invalid: {reason}")]
#[non_exhaustive]
pub struct Invalid {
    /// The message name.
    pub message: &'static str,
    /// What is wrong.
    pub reason: String,
}

impl Middleware for Validation {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        match self.check(&envelope) {
            Ok(()) => next.run(envelope).boxed(),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }

    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed("Validation")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Ping, RecordingEndpoint};

    #[derive(Debug)]
    struct Email(&'static str);
    impl Message for Email {
        const NAME: &'static str = "Email";
    }
    impl Validate for Email {
        fn validate(&self) -> std::result::Result<(), String> {
            if self.0.contains('@') {
                Ok(())
            } else {
                Err(format!("`{}` is not an address", self.0))
            }
        }
    }

    #[tokio::test]
    async fn an_invalid_message_fails_before_next_with_the_reason() {
        let v = Validation::new().message::<Email>();
        let end = RecordingEndpoint::new();
        let err = v
            .handle(Envelope::new(Email("nobody")), end.next())
            .await
            .unwrap_err();
        assert!(end.calls().is_empty(), "the handler must not run");
        assert_eq!(
            err.to_string(),
            "middleware `Validation` failed: `Email` is invalid: `nobody` is not an address"
        );
        assert_eq!(
            err.middleware_error::<Invalid>(),
            Some(&Invalid {
                message: "Email",
                reason: "`nobody` is not an address".into()
            })
        );
    }

    #[tokio::test]
    async fn valid_and_unregistered_messages_pass() {
        let v = Validation::new().message::<Email>();
        let end = RecordingEndpoint::new();
        v.handle(Envelope::new(Email("a@b")), end.next())
            .await
            .unwrap();
        v.handle(Envelope::new(Ping), end.next()).await.unwrap();
        assert_eq!(end.calls().len(), 2);
    }
}
