//! The compact id of a message held by an in-process transport.

use std::fmt;
use std::sync::Arc;

use crate::envelope::stamp::{ErasedStamp, TransportMessageIdStamp};

/// The id of a message in an in-process transport: a number, whose decimal
/// form is the id a transport's methods take. Nothing is stored for it but
/// the number: its text and its
/// [`TransportMessageIdStamp`] are made when needed.
///
/// ```
/// use envoi_core::transport::LocalId;
///
/// let id = LocalId::new(42);
/// assert_eq!((id.key(), id.to_string()), (42, "42".to_string()));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocalId {
    key: u64,
}

impl LocalId {
    /// The id `key`.
    pub fn new(key: u64) -> Self {
        Self { key }
    }

    /// The number.
    pub fn key(self) -> u64 {
        self.key
    }

    /// A [`TransportMessageIdStamp`] carrying the text form, to add with
    /// [`Envelope::with_erased`](super::Envelope::with_erased).
    pub fn stamp(self) -> Arc<dyn ErasedStamp> {
        Arc::new(TransportMessageIdStamp::new(decimal(self.key)))
    }
}

impl fmt::Display for LocalId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.key, f)
    }
}

/// `n` in decimal, without the formatting machinery (this runs per message).
pub(crate) fn decimal(n: u64) -> String {
    itoa::Buffer::new().format(n).to_owned()
}
