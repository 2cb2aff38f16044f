//! How a handling attempt claims a message's key: the [`DedupClaim`] a
//! store is asked with, the [`DedupClaimStamp`] a message carries to its
//! retries, and the reservation that forgets the key of an attempt
//! abandoned before it settled.

use std::sync::Arc;

use futures_util::FutureExt;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::DedupStore;
use crate::envelope::stamp::Stamp;

/// The token of the handling attempt that claimed a message's key, added
/// by [`Deduplicate`](super::Deduplicate) before the message is handled.
/// It is sent with the message, so a retry presents it and is not taken
/// for a duplicate of itself when the failed attempt's key could not be
/// forgotten.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DedupClaimStamp {
    /// The token the key was claimed with.
    pub claim: Uuid,
}

impl Stamp for DedupClaimStamp {
    const NAME: &'static str = "DedupClaim";
}

/// How a handling attempt claims a key in [`DedupStore::insert`].
///
/// Stores read its fields; [`Deduplicate`](super::Deduplicate) builds it.
/// It may gain fields, so outside this crate it is built with
/// [`DedupClaim::new`] (a store's tests claiming a key as an attempt
/// would), not as a struct literal:
///
/// ```compile_fail
/// use envoi_core::middleware::dedup::DedupClaim;
///
/// let claim = DedupClaim {
///     token: DedupClaim::HANDLED,
///     previous: None,
///     redelivered: false,
/// };
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DedupClaim {
    /// The token this attempt claims the key with: fresh for every attempt,
    /// or [`DedupClaim::HANDLED`] to remember the key of a handled message.
    pub token: Uuid,
    /// The token of the same message's previous attempt (the newest
    /// [`DedupClaimStamp`] it carries), if it had one.
    pub previous: Option<Uuid>,
    /// The message's transport handed it out before without it being
    /// acknowledged (it carries a
    /// [`RedeliveredStamp`](crate::envelope::stamp::RedeliveredStamp)): a
    /// key claimed by an attempt in processing, whose consumer may have
    /// died, is taken over; a key claimed by [`DedupClaim::HANDLED`] is
    /// not.
    pub redelivered: bool,
}

impl DedupClaim {
    /// The token a key is claimed by once its message was handled, for the
    /// window: [`Deduplicate`](super::Deduplicate) claims it so with
    /// `previous` set to the handling attempt's token. A redelivery does not
    /// take it over, so stores tell a key remembered after success from one
    /// merely claimed by this token. (The nil UUID: never the token of an
    /// attempt.)
    pub const HANDLED: Uuid = Uuid::nil();

    /// A claim with `token` by a first attempt (no `previous` token) that
    /// is no redelivery.
    ///
    /// ```
    /// use envoi_core::middleware::dedup::DedupClaim;
    ///
    /// # let (token, previous) = (DedupClaim::HANDLED, DedupClaim::HANDLED);
    /// let claim = DedupClaim::new(token)
    ///     .with_previous(Some(previous))
    ///     .with_redelivered(true);
    /// assert_eq!((claim.token, claim.previous, claim.redelivered), (token, Some(previous), true));
    /// ```
    pub fn new(token: Uuid) -> Self {
        Self {
            token,
            previous: None,
            redelivered: false,
        }
    }

    /// The claim with `previous` as the token of the message's previous
    /// attempt (see [`DedupClaim::previous`]).
    #[must_use = "`with_previous` returns the changed claim"]
    pub fn with_previous(mut self, previous: Option<Uuid>) -> Self {
        self.previous = previous;
        self
    }

    /// The claim of a message its transport marked as redelivered, or not
    /// (see [`DedupClaim::redelivered`]).
    #[must_use = "`with_redelivered` returns the changed claim"]
    pub fn with_redelivered(mut self, redelivered: bool) -> Self {
        self.redelivered = redelivered;
        self
    }
}

/// A key remembered for a message still running: forgotten if the message
/// is abandoned (its future dropped) before it settled — while the store
/// remembers the key, while the handler runs, or while the store forgets it
/// — unless another attempt claimed it meanwhile.
pub(super) struct Reservation<'a> {
    pub(super) store: &'a Arc<dyn DedupStore>,
    pub(super) key: String,
    /// The token this attempt claims the key with.
    pub(super) token: Uuid,
    /// Cleared once the message settled.
    pub(super) armed: bool,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let key = std::mem::take(&mut self.key);
        let (store, token) = (self.store.clone(), self.token);
        let mut forget = Box::pin(async move {
            let _ = store.remove(&key, token).await;
        });
        // An in-memory store forgets at once; another one gets a task, when
        // there is a runtime to run it.
        if forget.as_mut().now_or_never().is_none() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(forget);
            }
        }
    }
}
