//! Deduplication: a second message with the same key inside a time window
//! is acknowledged without running the handler.
//!
//! Delivery through a transport is at least once, and producers retry
//! sends; [`Deduplicate`] makes handling idempotent for the message types
//! it is given a key for. The key comes from the message (an order number,
//! a payment reference) through a function registered per type with
//! [`Deduplicate::key`]. The first message with a key runs as usual; another
//! one with the same key while the key is remembered returns successfully
//! without calling the rest of the pipeline, stamped with
//! [`DeduplicatedStamp`], so a worker acknowledges it.
//!
//! A key is forgotten when its message fails, is scheduled for a retry or
//! is abandoned before it finished (its dispatch dropped by a deadline or a
//! stopping worker), so the redelivery is handled; otherwise it is
//! remembered for the window. A message abandoned while the store is
//! still remembering its key forgets it too: whether the key was new is not
//! known then, and handling a message twice beats never handling it.
//! When the store cannot forget the key of a message whose handler failed,
//! the handler failure is still what the dispatch returns (so a worker
//! parks or rejects the message as usual) and the store error is logged;
//! after other outcomes the store error is returned.
//!
//! The retry of a failed message is never taken for a duplicate of itself,
//! even when its key could not be forgotten: each attempt claims the key
//! with a fresh token, carried by the message as a [`DedupClaimStamp`] (it
//! crosses transports, so retries and messages parked in a failure
//! transport keep it), and the store lets through a message presenting the
//! token its key is claimed by, claiming it anew. Another message with the
//! same key has no such token and is still a duplicate, and so is a second
//! delivery of an attempt that was handled (its token is no longer the
//! claim).
//! Where the bus sends a message to a transport, the middleware lets it
//! through: duplicates are caught where messages are handled.
//!
//! Keys live in a [`DedupStore`]; the default [`InMemoryDedupStore`] is
//! per process. Workers in several processes need a shared store (a table
//! or a key-value server) implementing the trait.
//!
//! A typed `dispatch` of a command that is dropped as a duplicate has no
//! result and reports [`BusError::NoResult`].
//!
//! ```
//! use envoi_core::middleware::dedup::Deduplicate;
//! use envoi_core::Message;
//! use std::time::Duration;
//!
//! #[derive(Debug, Clone)]
//! struct CapturePayment { reference: String }
//! impl Message for CapturePayment { const NAME: &'static str = "CapturePayment"; }
//!
//! let dedup = Deduplicate::new(Duration::from_secs(3600))
//!     .key(|p: &CapturePayment| p.reference.clone());
//! # let _ = dedup;
//! ```

use std::any::TypeId;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use uuid::Uuid;

use super::retry::was_retried;
use super::{BoxFuture, Middleware, Next};
use crate::envelope::Envelope;
use crate::error::{BoxError, BusError, Result};
use crate::far;
use crate::message::Message;
use crate::stamp::Stamp;

/// Marks an envelope that was recognised as a duplicate and not handled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeduplicatedStamp {
    /// The key it shared with an earlier message.
    pub key: String,
}

impl Stamp for DeduplicatedStamp {
    const NAME: &'static str = "Deduplicated";
    const SENDABLE: bool = false;
}

/// The token of the handling attempt that claimed a message's key, added
/// by [`Deduplicate`] before the message is handled. It is sent with the
/// message, so a retry presents it and is not taken for a duplicate of
/// itself when the failed attempt's key could not be forgotten.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DedupClaimStamp {
    /// The token the key was claimed with.
    pub claim: Uuid,
}

impl Stamp for DedupClaimStamp {
    const NAME: &'static str = "DedupClaim";
}

/// How a handling attempt claims a key in [`DedupStore::insert`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DedupClaim {
    /// The token this attempt claims the key with: fresh for every attempt.
    pub token: Uuid,
    /// The token of the same message's previous attempt (the newest
    /// [`DedupClaimStamp`] it carries), if it had one.
    pub previous: Option<Uuid>,
}

/// Where the keys seen recently are kept, each with the token of the
/// attempt that claimed it.
pub trait DedupStore: Send + Sync + 'static {
    /// Remembers `key` for `window`, claimed by `claim.token`, unless it is
    /// remembered already under a token other than `claim.previous`.
    /// Returns `true` when the key was new or claimed by `claim.previous`
    /// (the message is to be handled; the key is now claimed by
    /// `claim.token` for `window`), `false` when it is a duplicate (the
    /// key and its claim are left as they were).
    fn insert<'a>(
        &'a self,
        key: &'a str,
        window: Duration,
        claim: DedupClaim,
    ) -> BoxFuture<'a, Result<bool, BoxError>>;

    /// Forgets `key`, so a message with it is handled again.
    fn remove<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<(), BoxError>>;
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
        window: Duration,
        claim: DedupClaim,
    ) -> BoxFuture<'a, Result<bool, BoxError>> {
        let now = Instant::now();
        let until = now + far::clamp(window);
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if keys.len() >= 1024 && keys.len().is_power_of_two() {
            keys.retain(|_, (until, _)| *until > now);
        }
        let fresh = match keys.get_mut(key) {
            Some((expires, token)) if *expires > now => {
                let mine = claim.previous == Some(*token);
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

    fn remove<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<(), BoxError>> {
        self.keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
        Box::pin(std::future::ready(Ok(())))
    }
}

type KeyFn = dyn Fn(&Envelope) -> Option<String> + Send + Sync;

/// A key remembered for a message still running: forgotten if the message
/// is abandoned (its future dropped) before it settled — while the store
/// remembers the key, while the handler runs, or while the store forgets it.
struct Reservation<'a> {
    store: &'a Arc<dyn DedupStore>,
    key: String,
    /// Cleared once the message settled.
    armed: bool,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let key = std::mem::take(&mut self.key);
        let store = self.store.clone();
        let mut forget = Box::pin(async move {
            let _ = store.remove(&key).await;
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

/// The deduplication middleware; see the [module docs](self).
#[derive(Clone)]
pub struct Deduplicate {
    window: Duration,
    store: Arc<dyn DedupStore>,
    keys: HashMap<TypeId, Arc<KeyFn>>,
}

impl fmt::Debug for Deduplicate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deduplicate")
            .field("window", &self.window)
            .field("types", &self.keys.len())
            .finish()
    }
}

impl Deduplicate {
    /// Remembers keys for `window`, in an [`InMemoryDedupStore`].
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            store: Arc::new(InMemoryDedupStore::new()),
            keys: HashMap::new(),
        }
    }

    /// Deduplicates messages of type `M` by the key `key` returns.
    #[must_use = "`key` returns the middleware with the type added"]
    pub fn key<M: Message>(mut self, key: impl Fn(&M) -> String + Send + Sync + 'static) -> Self {
        let f = move |e: &Envelope| e.message::<M>().map(|m| format!("{}:{}", M::NAME, key(m)));
        self.keys.insert(TypeId::of::<M>(), Arc::new(f));
        self
    }

    /// Keeps keys in `store` instead of in memory.
    #[must_use = "`store` returns the configured middleware"]
    pub fn store(mut self, store: impl DedupStore) -> Self {
        self.store = Arc::new(store);
        self
    }

    /// Keeps keys in a shared `store`.
    #[must_use = "`store_arc` returns the configured middleware"]
    pub fn store_arc(mut self, store: Arc<dyn DedupStore>) -> Self {
        self.store = store;
        self
    }

    fn store_error(source: BoxError) -> BusError {
        BusError::Middleware {
            middleware: "Deduplicate".into(),
            source,
        }
    }
}

impl Middleware for Deduplicate {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        let key = match self.keys.get(&envelope.message_type_id()) {
            Some(f) if !next.sends(&envelope) => f(&envelope),
            _ => None,
        };
        let Some(key) = key else {
            return next.run(envelope).boxed();
        };
        Box::pin(async move {
            // Forgets the key if this future is dropped before the message
            // settled (a deadline, a stopping worker), so the message is
            // handled when it comes again. Armed before the store is asked:
            // a store that is not in memory may remember the key before its
            // `insert` returns.
            let mut reserved = Reservation {
                store: &self.store,
                key,
                armed: true,
            };
            let claim = DedupClaim {
                token: Uuid::new_v4(),
                previous: envelope.last::<DedupClaimStamp>().map(|s| s.claim),
            };
            let fresh = self.store.insert(&reserved.key, self.window, claim).await;
            let fresh = fresh.map_err(|e| {
                reserved.armed = false;
                Self::store_error(e)
            })?;
            if !fresh {
                reserved.armed = false;
                let key = std::mem::take(&mut reserved.key);
                return Ok(envelope.with(DeduplicatedStamp { key }));
            }
            // Carried by a retry of this attempt, which the store then
            // lets through even if it could not forget the key.
            let envelope = envelope.with(DedupClaimStamp { claim: claim.token });
            let before = envelope.clone();
            let out = next.run(envelope).await;
            let handled = matches!(&out, Ok(after) if !was_retried(&before, after));
            let removed = if handled {
                Ok(())
            } else {
                // Let the redelivery (or a new attempt) through.
                self.store.remove(&reserved.key).await
            };
            reserved.armed = false;
            match removed {
                Ok(()) => out,
                // The handler failure is what the caller acts on (a worker
                // parks or rejects the message by it): keep it.
                Err(e) if matches!(out, Err(BusError::HandlerFailed { .. })) => {
                    tracing::warn!(
                        key = %reserved.key,
                        error = %e,
                        "Deduplicate: could not forget the key of a failed message; \
                         its retry is still handled, but another message with the key \
                         is acknowledged as a duplicate within the window"
                    );
                    out
                }
                Err(e) => Err(Self::store_error(e)),
            }
        })
    }

    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed("Deduplicate")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stamp::RedeliveryStamp;
    use crate::testing::{FailingEndpoint, FnEndpoint, Ping, RecordingEndpoint};

    #[derive(Debug)]
    struct Pay(&'static str);
    impl Message for Pay {
        const NAME: &'static str = "Pay";
    }

    fn dedup() -> Deduplicate {
        Deduplicate::new(Duration::from_secs(60)).key(|p: &Pay| p.0.to_string())
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_message_with_the_same_key_is_acked_without_the_handler() {
        let d = dedup();
        let end = RecordingEndpoint::new();
        d.handle(Envelope::new(Pay("r-1")), end.next())
            .await
            .unwrap();
        let dup = d
            .handle(Envelope::new(Pay("r-1")), end.next())
            .await
            .unwrap();
        assert_eq!(end.calls().len(), 1);
        assert_eq!(dup.last::<DeduplicatedStamp>().unwrap().key, "Pay:r-1");
        d.handle(Envelope::new(Pay("r-2")), end.next())
            .await
            .unwrap();
        d.handle(Envelope::new(Ping), end.next()).await.unwrap();
        d.handle(Envelope::new(Ping), end.next()).await.unwrap();
        assert_eq!(end.calls().len(), 4, "other keys and unkeyed types pass");
    }

    #[tokio::test(start_paused = true)]
    async fn the_key_is_forgotten_after_the_window() {
        let d = dedup();
        let end = RecordingEndpoint::new();
        d.handle(Envelope::new(Pay("r-1")), end.next())
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(61)).await;
        d.handle(Envelope::new(Pay("r-1")), end.next())
            .await
            .unwrap();
        assert_eq!(end.calls().len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_or_retried_message_is_handled_when_it_comes_again() {
        let d = dedup();
        let bad = FailingEndpoint::plain();
        d.handle(Envelope::new(Pay("r-1")), bad.next())
            .await
            .unwrap_err();
        let retried =
            FnEndpoint::new(|e| Box::pin(async move { Ok(e.with(RedeliveryStamp::new(1))) }));
        d.handle(Envelope::new(Pay("r-1")), Next::to_endpoint(&retried))
            .await
            .unwrap();
        let end = RecordingEndpoint::new();
        d.handle(Envelope::new(Pay("r-1")), end.next())
            .await
            .unwrap();
        assert_eq!(end.calls().len(), 1);
    }

    /// `r-1` comes again after its first dispatch was abandoned: it is
    /// handled (by `end`, for the first time), not taken for a duplicate.
    async fn assert_handled_again(d: &Deduplicate, end: &RecordingEndpoint) {
        let out = d
            .handle(Envelope::new(Pay("r-1")), end.next())
            .await
            .unwrap();
        assert!(!out.has::<DeduplicatedStamp>());
        assert_eq!(end.calls().len(), 1, "the redelivery is handled");
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_message_is_handled_when_it_comes_again() {
        let d = dedup();
        let stuck = FnEndpoint::new(|_| Box::pin(std::future::pending()));
        let abandoned = tokio::time::timeout(
            Duration::from_secs(1),
            d.handle(Envelope::new(Pay("r-1")), Next::to_endpoint(&stuck)),
        )
        .await;
        assert!(abandoned.is_err(), "the handler never finishes");
        let end = RecordingEndpoint::new();
        assert_handled_again(&d, &end).await;
        d.handle(Envelope::new(Pay("r-1")), end.next())
            .await
            .unwrap();
        assert_eq!(end.calls().len(), 1, "once handled, the key is kept");
    }

    struct BrokenStore;
    impl DedupStore for BrokenStore {
        fn insert<'a>(
            &'a self,
            _: &'a str,
            _: Duration,
            _: DedupClaim,
        ) -> BoxFuture<'a, Result<bool, BoxError>> {
            Box::pin(async { Err("store down".into()) })
        }
        fn remove<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<(), BoxError>> {
            Box::pin(async { Ok(()) })
        }
    }

    #[tokio::test]
    async fn a_store_failure_is_an_error_not_a_silent_drop() {
        let d = dedup().store(BrokenStore);
        let end = RecordingEndpoint::new();
        let err = d
            .handle(Envelope::new(Pay("r-1")), end.next())
            .await
            .unwrap_err();
        assert!(end.calls().is_empty());
        assert_eq!(
            err.to_string(),
            "middleware `Deduplicate` failed: store down"
        );
    }

    /// An in-memory store whose `insert` (after remembering) and `remove`
    /// (before forgetting) yield once, as a store over a network would.
    #[derive(Default)]
    struct YieldingStore {
        keys: Arc<InMemoryDedupStore>,
    }
    impl DedupStore for YieldingStore {
        fn insert<'a>(
            &'a self,
            key: &'a str,
            w: Duration,
            claim: DedupClaim,
        ) -> BoxFuture<'a, Result<bool, BoxError>> {
            Box::pin(async move {
                let fresh = self.keys.insert(key, w, claim).await;
                tokio::task::yield_now().await;
                fresh
            })
        }
        fn remove<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<(), BoxError>> {
            Box::pin(async move {
                tokio::task::yield_now().await;
                self.keys.remove(key).await
            })
        }
    }

    /// Lets spawned tasks run.
    async fn settle() {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_message_abandoned_while_the_store_remembers_its_key_is_handled_when_it_comes_again()
    {
        let store = YieldingStore::default();
        let keys = store.keys.clone();
        let d = dedup().store(store);
        let end = RecordingEndpoint::new();
        let mut abandoned = d.handle(Envelope::new(Pay("r-1")), end.next());
        assert!((&mut abandoned).now_or_never().is_none());
        assert_eq!(keys.len(), 1, "the store has the key");
        drop(abandoned);
        settle().await;
        assert_handled_again(&d, &end).await;
    }

    #[tokio::test]
    async fn a_failed_message_abandoned_while_the_store_forgets_its_key_is_handled_when_it_comes_again(
    ) {
        let store = YieldingStore::default();
        let keys = store.keys.clone();
        let d = dedup().store(store);
        let bad = FailingEndpoint::plain();
        let mut abandoned = d.handle(Envelope::new(Pay("r-1")), bad.next());
        // Remembers (yields), then fails and starts forgetting (yields).
        assert!((&mut abandoned).now_or_never().is_none());
        assert!((&mut abandoned).now_or_never().is_none());
        assert_eq!(keys.len(), 1, "the store still has the key");
        drop(abandoned);
        settle().await;
        let end = RecordingEndpoint::new();
        assert_handled_again(&d, &end).await;
    }

    struct ForgetfulStore(InMemoryDedupStore);
    impl DedupStore for ForgetfulStore {
        fn insert<'a>(
            &'a self,
            key: &'a str,
            w: Duration,
            claim: DedupClaim,
        ) -> BoxFuture<'a, Result<bool, BoxError>> {
            self.0.insert(key, w, claim)
        }
        fn remove<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<(), BoxError>> {
            Box::pin(async { Err("store down".into()) })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_retry_of_a_failed_message_whose_key_could_not_be_forgotten_is_handled() {
        let d = dedup().store(ForgetfulStore(InMemoryDedupStore::new()));
        let bad = FailingEndpoint::plain();
        let failed = match d.handle(Envelope::new(Pay("r-1")), bad.next()).await {
            Err(BusError::HandlerFailed { envelope, .. }) => *envelope,
            other => panic!("expected the handler failure, got {other:?}"),
        };
        // What the retry step sends again: the failed attempt's envelope.
        let retry = failed.with(RedeliveryStamp::new(1));
        let end = RecordingEndpoint::new();
        let out = d.handle(retry.clone(), end.next()).await.unwrap();
        assert!(!out.has::<DeduplicatedStamp>());
        assert_eq!(end.calls().len(), 1, "the retry is handled");

        // Another message with the key, and the handled retry delivered
        // twice, are duplicates.
        let other = d
            .handle(Envelope::new(Pay("r-1")), end.next())
            .await
            .unwrap();
        assert!(other.has::<DeduplicatedStamp>());
        let again = d.handle(retry, end.next()).await.unwrap();
        assert!(again.has::<DeduplicatedStamp>());
        assert_eq!(end.calls().len(), 1);
    }

    #[tokio::test]
    async fn a_store_failure_forgetting_a_failed_message_keeps_the_handler_failure() {
        let d = dedup().store(ForgetfulStore(InMemoryDedupStore::new()));
        let bad = FailingEndpoint::plain();
        let err = d
            .handle(Envelope::new(Pay("r-1")), bad.next())
            .await
            .unwrap_err();
        match err {
            BusError::HandlerFailed { envelope, errors } => {
                assert!(envelope.message::<Pay>().is_some());
                assert_eq!(errors.len(), 1);
            }
            other => panic!("expected the handler failure, got {other:?}"),
        }
    }
}
