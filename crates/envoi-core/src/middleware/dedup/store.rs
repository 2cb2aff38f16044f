//! Where the keys are kept: the [`DedupStore`] trait and the
//! [`InMemoryDedupStore`] of one process.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;
use uuid::Uuid;

use super::DedupClaim;
use crate::error::BoxError;
use crate::far;
use crate::BoxFuture;

/// Where the keys seen recently are kept, each with the token of the
/// attempt that claimed it and until when.
///
/// [`Deduplicate`](super::Deduplicate) claims a key with
/// [`insert`](Self::insert) for the processing timeout only, renews that
/// claim with [`hold`](Self::hold) while the handler runs, and once the
/// message was handled claims it with `insert` for the window under
/// [`DedupClaim::HANDLED`]. A claim left by a process that died is
/// therefore gone after the processing timeout, and the redelivered
/// message is handled; a message its transport marks as redelivered takes
/// such a claim over at once (see [`DedupClaim::redelivered`]).
pub trait DedupStore: Send + Sync + 'static {
    /// Claims `key` for `hold` with `claim.token`, unless it is claimed
    /// already, and not expired, under a token other than `claim.previous`
    /// (and, for a `claim.redelivered`, other than any token but
    /// [`DedupClaim::HANDLED`]). Returns `true` when the key was new,
    /// expired, claimed by `claim.previous` and not by
    /// [`DedupClaim::HANDLED`], or `claim.redelivered` and not claimed by
    /// [`DedupClaim::HANDLED`] (the message is to be handled, or, for a
    /// `claim.token` of [`DedupClaim::HANDLED`], its key remembered; the
    /// key is now claimed by `claim.token` until `hold` from now), `false`
    /// when it is a duplicate (the key and its claim are left as they
    /// were).
    ///
    /// A store that ignores `claim.redelivered` takes a redelivery for a
    /// duplicate while the key is claimed, so the message of a consumer that
    /// died is lost when its transport redelivers it within the processing
    /// timeout (RabbitMQ does).
    fn insert<'a>(
        &'a self,
        key: &'a str,
        hold: Duration,
        claim: DedupClaim,
    ) -> BoxFuture<'a, Result<bool, BoxError>>;

    /// Keeps `key` claimed by `token` until `hold` from now, if it is
    /// claimed by `token`, expired or not remembered; a key another token
    /// claimed (and that has not expired) is left as it is. Called with the
    /// processing timeout to renew the claim of a message still being
    /// handled, and with the window once it was handled.
    ///
    /// The default implementation is
    /// `insert(key, hold, DedupClaim { token, previous: Some(token),
    /// redelivered: false })`, which does just that.
    ///
    /// [`Deduplicate`](super::Deduplicate) calls it with the processing
    /// timeout, to renew the claim of a message still being handled.
    fn hold<'a>(
        &'a self,
        key: &'a str,
        token: Uuid,
        hold: Duration,
    ) -> BoxFuture<'a, Result<(), BoxError>> {
        let claim = DedupClaim {
            token,
            previous: Some(token),
            redelivered: false,
        };
        Box::pin(self.insert(key, hold, claim).map(|r| r.map(|_| ())))
    }

    /// Forgets `key` if it is claimed by `token` (expired or not), so a
    /// message with it is handled again; a key claimed by another token is
    /// left as it is. [`Deduplicate`](super::Deduplicate) calls it with the
    /// token of an attempt that failed, was scheduled for a retry or was
    /// abandoned.
    ///
    /// A store that forgets the key whoever claims it lets a copy through
    /// while another attempt handles the message: the retry of a failed
    /// attempt, sent before that attempt forgets the key, may already have
    /// claimed it anew, and so may a redelivery that took the claim over
    /// while the attempt still ran.
    fn remove<'a>(&'a self, key: &'a str, token: Uuid) -> BoxFuture<'a, Result<(), BoxError>>;
}

/// A [`DedupStore`] in this process's memory; expired keys are pruned as
/// new ones arrive.
#[derive(Debug, Default)]
pub struct InMemoryDedupStore {
    /// Each key with when it expires and the token that claimed it.
    keys: Mutex<HashMap<String, (Instant, Uuid)>>,
}

impl InMemoryDedupStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many keys are remembered (expired ones included until pruned).
    pub fn len(&self) -> usize {
        self.keys.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DedupStore for InMemoryDedupStore {
    fn insert<'a>(
        &'a self,
        key: &'a str,
        hold: Duration,
        claim: DedupClaim,
    ) -> BoxFuture<'a, Result<bool, BoxError>> {
        let now = Instant::now();
        let until = now + far::clamp(hold);
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if keys.len() >= 1024 && keys.len().is_power_of_two() {
            keys.retain(|_, (until, _)| *until > now);
        }
        let fresh = match keys.get_mut(key) {
            Some((expires, token)) if *expires > now => {
                let mine = *token != DedupClaim::HANDLED
                    && (claim.redelivered || claim.previous == Some(*token));
                if mine {
                    *expires = until;
                    *token = claim.token;
                }
                mine
            }
            Some(expired) => {
                *expired = (until, claim.token);
                true
            }
            None => {
                keys.insert(key.to_owned(), (until, claim.token));
                true
            }
        };
        Box::pin(std::future::ready(Ok(fresh)))
    }

    fn remove<'a>(&'a self, key: &'a str, token: Uuid) -> BoxFuture<'a, Result<(), BoxError>> {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if keys.get(key).is_some_and(|(_, claim)| *claim == token) {
            keys.remove(key);
        }
        Box::pin(std::future::ready(Ok(())))
    }
}
