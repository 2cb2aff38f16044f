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
//! A key is remembered in two steps. While its message is being handled,
//! the key is only claimed for the *processing timeout*
//! ([`DEFAULT_PROCESSING_TIMEOUT`], 20 s, or
//! [`Deduplicate::processing_timeout`], at least [`MIN_PROCESSING_TIMEOUT`];
//! never longer than the window), and
//! the claim is renewed every half processing timeout as long as the
//! handler runs. Once the message was handled, its key is remembered for
//! the window. A copy that comes in either step is a duplicate.
//!
//! The claim expires on its own so that a message whose process died while
//! handling it (killed, crashed, out of memory) is not lost: nothing renews
//! or forgets the claim then, it lapses within the processing timeout, and
//! the message the transport redelivers after its lease is handled. So keep
//! the processing timeout shorter than the time the transport takes to
//! redeliver the message of a consumer that died: its lease (30 s by
//! default for the in-memory, Redis and NATS transports, 60 s for SQLite,
//! 300 s for PostgreSQL) less the worker's keepalive interval (5 s). A
//! redelivery that comes while the dead process's claim holds is
//! acknowledged as a duplicate, and the message is lost, unless its
//! transport marks it as redelivered. (A *copy* that comes then is no loss:
//! the original is redelivered and handled later.)
//!
//! A transport that knows a message was handed out before and not
//! acknowledged marks it (`Delivery::redelivered`; the RabbitMQ transport
//! does, from AMQP's `redelivered` flag, since RabbitMQ hands a dead
//! consumer's messages out again as soon as its connection closes; so do
//! the Redis transport for the entries it takes over with `XAUTOCLAIM`, the
//! SQLite and PostgreSQL transports for a row handed out before (its lease
//! ran out, or it was released), the in-memory transport for a message
//! whose lease ran out, whatever the lease, and the NATS transport for a
//! message JetStream delivered before, unless it is delayed), and the
//! received envelope carries a
//! [`RedeliveredStamp`]. Such a redelivery is handled when its key is only
//! claimed by an attempt in processing (it takes the claim over), and is a
//! duplicate when its key is remembered after its message was handled, as
//! a copy is. A copy without the mark is a duplicate in either step. So a
//! message whose consumer died is handled at once; if that consumer had
//! only lost its connection and still runs the handler, the message is
//! handled twice, which beats never. A [`DedupStore`] tells the two steps
//! apart by the token: a handled message's key is claimed by
//! [`DedupClaim::HANDLED`].
//!
//!
//! The trade-offs: a handler slower than the processing timeout keeps its
//! key only through the renewals, one store call every half processing
//! timeout (none for a quicker handler); if the store cannot renew the
//! claim (the error is logged), a copy that comes after the processing
//! timeout is handled while the first still runs. Without renewals, a
//! processing timeout short enough for the leases would let a copy of every
//! slow message through. The renewal is the middleware's own, not the
//! worker's lease keepalive, but stops with the process in the same way.
//! When the store cannot remember a handled message's key for the window,
//! the dispatch still succeeds (a worker acknowledges the message) and the
//! error is logged; a copy that comes after the processing timeout is then
//! handled again.
//!
//! A key is forgotten when its message fails, is scheduled for a retry or
//! is abandoned before it finished (its dispatch dropped by a deadline or a
//! stopping worker), so the redelivery is handled. A message abandoned
//! while the store is still remembering its key forgets it too: whether
//! the key was new is not known then, and handling a message twice beats
//! never handling it. Only the attempt's own claim is forgotten
//! ([`DedupStore::remove`] takes its token): the retry of a failed attempt,
//! sent before that attempt forgets the key, or a redelivery that took the
//! claim over while the attempt still ran, may hold the key by then, and a
//! copy that comes while it is handled is still a duplicate. When the store cannot forget the key of a message
//! whose handler failed, the handler failure is still what the dispatch
//! returns (so a worker parks or rejects the message as usual) and the
//! store error is logged (the claim lapses after the processing timeout);
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
//!
//! A known gap: the key is remembered as handled when the handler
//! succeeded, before the dispatches it
//! deferred run. When one
//! of those fails and cannot be parked, a worker releases
//! the handled message so its handlers defer it again; with this middleware
//! the redelivery is acknowledged as a duplicate instead, and the deferred
//! dispatch is lost (the worker reports its failure, with `released`).
//!
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
//! // Handled payments are remembered for an hour; one being handled is
//! // claimed 20 s at a time (the default), renewed while its handler runs.
//! let dedup = Deduplicate::new(Duration::from_secs(3600))
//!     .processing_timeout(Duration::from_secs(20))
//!     .key(|p: &CapturePayment| p.reference.clone());
//! # let _ = dedup;
//! ```

mod claim;
mod store;

use std::any::TypeId;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use uuid::Uuid;

use super::was_retried;
use super::{BoxFuture, Middleware, Next};
use crate::envelope::message::Message;
use crate::envelope::stamp::{RedeliveredStamp, Stamp};
use crate::envelope::Envelope;
use crate::error::{BoxError, BusError, Result};
use crate::far;

use claim::Reservation;
pub use claim::{DedupClaim, DedupClaimStamp};
pub use store::{DedupStore, InMemoryDedupStore};

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

type KeyFn = dyn Fn(&Envelope) -> Option<String> + Send + Sync;

/// How long [`Deduplicate`] holds the key of a message being handled
/// unless told otherwise ([`Deduplicate::processing_timeout`]): 20 seconds,
/// shorter than the leases of the transports (30 seconds by default for the
/// in-memory, Redis and NATS transports, less the worker's 5-second
/// keepalive interval), so the message of a process that died is not yet
/// redelivered when its claim expires.
pub const DEFAULT_PROCESSING_TIMEOUT: Duration = Duration::from_secs(20);

/// The shortest processing timeout [`Deduplicate::processing_timeout`]
/// sets: 10 milliseconds. A shorter one (zero included) is taken as this:
/// a claim that lapses at once would let every copy through while its
/// message is handled, and one renewed more often than every 5 ms would
/// outpace the timer's 1 ms resolution and the store's round trip.
pub const MIN_PROCESSING_TIMEOUT: Duration = Duration::from_millis(10);

/// The deduplication middleware; see the [module docs](self).
#[derive(Clone)]
pub struct Deduplicate {
    window: Duration,
    processing: Duration,
    store: Arc<dyn DedupStore>,
    keys: HashMap<TypeId, Arc<KeyFn>>,
}

impl fmt::Debug for Deduplicate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deduplicate")
            .field("window", &self.window)
            .field("processing_timeout", &self.processing)
            .field("types", &self.keys.len())
            .finish()
    }
}

impl Deduplicate {
    /// Remembers the keys of handled messages for `window`, in an
    /// [`InMemoryDedupStore`]; holds the key of a message being handled for
    /// [`DEFAULT_PROCESSING_TIMEOUT`] at a time (at most `window`: a window
    /// of zero remembers no key, not even while its message is handled).
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            processing: DEFAULT_PROCESSING_TIMEOUT,
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

    /// Holds the key of a message being handled for `timeout` at a time
    /// (renewed every half `timeout` while its handler runs, at most the
    /// window) instead of [`DEFAULT_PROCESSING_TIMEOUT`]. Keep it shorter
    /// than the time the transport takes to redeliver the message of a
    /// consumer that died (its lease, less the worker's keepalive
    /// interval): a redelivery that comes while the claim holds is
    /// acknowledged as a duplicate, and the message is lost, unless its
    /// transport marks it as redelivered. See the [module docs](self).
    ///
    /// A `timeout` shorter than [`MIN_PROCESSING_TIMEOUT`] (10 ms), zero
    /// included, is taken as that minimum: duplicates are always caught
    /// while a message is handled.
    #[must_use = "`processing_timeout` returns the configured middleware"]
    pub fn processing_timeout(mut self, timeout: Duration) -> Self {
        self.processing = timeout.max(MIN_PROCESSING_TIMEOUT);
        self
    }

    /// How long the key of a message being handled is held at a time: the
    /// processing timeout, at most the window.
    fn processing(&self) -> Duration {
        far::clamp(self.processing.min(self.window))
    }

    /// Runs the handler, renewing the claim `token` has on `key` every half
    /// processing timeout while it runs, so a message handled for longer
    /// than the processing timeout keeps its key while its process lives.
    async fn run_holding(
        &self,
        key: &str,
        token: Uuid,
        run: impl std::future::Future<Output = Result<Envelope>>,
    ) -> Result<Envelope> {
        let hold = self.processing();
        let every = hold / 2;
        if every.is_zero() {
            return run.await;
        }
        let renew = async {
            let mut next = Instant::now();
            loop {
                next += every;
                tokio::time::sleep_until(next).await;
                if let Err(e) = self.store.hold(key, token, hold).await {
                    tracing::warn!(
                        key,
                        error = %e,
                        "Deduplicate: could not renew the claim of a message being handled; \
                         a copy that comes after the processing timeout is handled too"
                    );
                }
            }
        };
        // The handler first: one that finishes on its first poll sets no
        // renewal timer.
        tokio::select! {
            biased;
            out = run => out,
            never = renew => never,
        }
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

    /// Handles `envelope`, whose key is `key`, unless the key is claimed
    /// already: then the envelope comes back stamped with
    /// [`DeduplicatedStamp`], unhandled.
    async fn deduplicate(
        &self,
        key: String,
        envelope: Envelope,
        next: Next<'_>,
    ) -> Result<Envelope> {
        // Forgets the key if this future is dropped before the message
        // settled (a deadline, a stopping worker), so the message is
        // handled when it comes again. Armed before the store is asked:
        // a store that is not in memory may remember the key before its
        // `insert` returns.
        let claim = DedupClaim {
            token: Uuid::new_v4(),
            previous: envelope.last::<DedupClaimStamp>().map(|s| s.claim),
            redelivered: envelope.has::<RedeliveredStamp>(),
        };
        let mut reserved = Reservation {
            store: &self.store,
            key,
            token: claim.token,
            armed: true,
        };
        if !self.claim_key(&mut reserved, claim).await? {
            reserved.armed = false;
            let key = std::mem::take(&mut reserved.key);
            return Ok(envelope.with(DeduplicatedStamp { key }));
        }
        // Carried by a retry of this attempt, which the store then
        // lets through even if it could not forget the key.
        let envelope = envelope.with(DedupClaimStamp { claim: claim.token });
        let before = envelope.clone();
        let out = self
            .run_holding(&reserved.key, claim.token, next.run(envelope))
            .await;
        if matches!(&out, Ok(after) if !was_retried(&before, after)) {
            self.remember_handled(&mut reserved).await;
            return out;
        }
        self.forget_key(&mut reserved, out).await
    }

    /// Claims the key of `reserved` with `claim` for the processing
    /// timeout: whether the message is to be handled (`false`: it is a
    /// duplicate). A store failure is the dispatch's error, and leaves no
    /// key to forget.
    async fn claim_key(&self, reserved: &mut Reservation<'_>, claim: DedupClaim) -> Result<bool> {
        let fresh = self
            .store
            .insert(&reserved.key, self.processing(), claim)
            .await;
        fresh.map_err(|e| {
            reserved.armed = false;
            Self::store_error(e)
        })
    }

    /// Remembers the key of `reserved`, whose message was handled, for the
    /// window. A store failure is logged: the message was handled all the
    /// same.
    async fn remember_handled(&self, reserved: &mut Reservation<'_>) {
        // Remembered for the window only now that it was handled, as
        // handled: a redelivery does not take it over. (Not remembered if
        // a redelivery took the claim over meanwhile: that attempt
        // remembers it when it is handled.)
        let handled = DedupClaim {
            token: DedupClaim::HANDLED,
            previous: Some(reserved.token),
            redelivered: false,
        };
        let kept = self.store.insert(&reserved.key, self.window, handled).await;
        reserved.armed = false;
        if let Err(e) = kept {
            // Handled all the same: a worker must acknowledge it.
            tracing::warn!(
                key = %reserved.key,
                error = %e,
                "Deduplicate: could not remember the key of a handled message \
                 for the window; a copy that comes after the processing timeout \
                 is handled again"
            );
        }
    }

    /// Forgets the key of `reserved`, whose message was not handled (it
    /// failed or was scheduled for a retry), and returns `out`. When the
    /// store cannot forget it, a handler failure is still returned (the
    /// store error is logged); after other outcomes the store error is.
    async fn forget_key(
        &self,
        reserved: &mut Reservation<'_>,
        out: Result<Envelope>,
    ) -> Result<Envelope> {
        // Let the redelivery (or a new attempt) through, unless the
        // key is claimed by another attempt already (this one's retry,
        // or a redelivery that took it over).
        let removed = self.store.remove(&reserved.key, reserved.token).await;
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
                     is acknowledged as a duplicate within the processing timeout"
                );
                out
            }
            Err(e) => Err(Self::store_error(e)),
        }
    }
}

impl Middleware for Deduplicate {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        let key = match self.keys.get(&envelope.message_type_id()) {
            Some(f) if !next.sends(&envelope) => f(&envelope),
            _ => None,
        };
        match key {
            Some(key) => Box::pin(self.deduplicate(key, envelope, next)),
            None => next.run(envelope).boxed(),
        }
    }

    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed("Deduplicate")
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use futures_util::FutureExt;

    use super::*;
    use crate::envelope::stamp::RedeliveryStamp;
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
        fn remove<'a>(&'a self, _: &'a str, _: Uuid) -> BoxFuture<'a, Result<(), BoxError>> {
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
        fn remove<'a>(&'a self, key: &'a str, token: Uuid) -> BoxFuture<'a, Result<(), BoxError>> {
            Box::pin(async move {
                tokio::task::yield_now().await;
                self.keys.remove(key, token).await
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
        fn remove<'a>(&'a self, _: &'a str, _: Uuid) -> BoxFuture<'a, Result<(), BoxError>> {
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

    /// A window far longer than the processing timeout, as in production.
    const HOUR: Duration = Duration::from_secs(3600);

    fn hourly(store: Arc<dyn DedupStore>) -> Deduplicate {
        Deduplicate::new(HOUR)
            .key(|p: &Pay| p.0.to_string())
            .store_arc(store)
    }

    /// Starts handling `Pay("r-1")` with a handler that never finishes, in
    /// a task, and lets it claim the key.
    async fn handling_forever(d: &Deduplicate) -> tokio::task::JoinHandle<()> {
        handling_forever_from(d, Envelope::new(Pay("r-1"))).await
    }

    /// Starts handling `envelope` with a handler that never finishes, in a
    /// task, and lets it claim its key.
    async fn handling_forever_from(
        d: &Deduplicate,
        envelope: Envelope,
    ) -> tokio::task::JoinHandle<()> {
        let d = d.clone();
        let task = tokio::spawn(async move {
            let stuck = FnEndpoint::new(|_| Box::pin(std::future::pending()));
            let _ = d.handle(envelope, Next::to_endpoint(&stuck)).await;
        });
        settle().await;
        task
    }

    /// Starts handling `Pay("r-1")` with a handler that never finishes, as
    /// a process that claimed the key and then died: polled once, then
    /// never again (no cleanup, no renewal).
    fn dies_mid_handling(d: &Deduplicate) {
        let stuck = FnEndpoint::new(|_| Box::pin(std::future::pending()));
        let mut handling = Box::pin(d.handle(Envelope::new(Pay("r-1")), Next::to_endpoint(&stuck)));
        assert!((&mut handling).now_or_never().is_none());
        std::mem::forget(handling);
    }

    /// The [`hourly`] deduplication of a live worker, sharing its store
    /// with a process that [`dies_mid_handling`].
    fn beside_a_process_that_died_mid_handling() -> Deduplicate {
        let store: Arc<dyn DedupStore> = Arc::new(InMemoryDedupStore::new());
        dies_mid_handling(&hourly(store.clone()));
        hourly(store)
    }

    /// `Pay("r-1")` as its transport hands it out again, marked as
    /// redelivered.
    fn redelivered() -> Envelope {
        Envelope::new(Pay("r-1")).with(RedeliveredStamp::new())
    }

    /// Whether `copy` is acknowledged as a duplicate (and the handler not
    /// run).
    async fn is_acknowledged_as_duplicate(d: &Deduplicate, copy: Envelope) -> bool {
        let end = RecordingEndpoint::new();
        let out = d.handle(copy, end.next()).await.unwrap();
        assert_eq!(end.calls().is_empty(), out.has::<DeduplicatedStamp>());
        out.has::<DeduplicatedStamp>()
    }

    /// Whether a copy of `Pay("r-1")` is acknowledged as a duplicate (and
    /// the handler not run).
    async fn is_duplicate(d: &Deduplicate) -> bool {
        is_acknowledged_as_duplicate(d, Envelope::new(Pay("r-1"))).await
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_whose_process_died_mid_handling_is_handled_when_redelivered_after_the_processing_timeout(
    ) {
        // Another worker gets the message the transport redelivers after
        // the lease (30 s by default).
        let alive = beside_a_process_that_died_mid_handling();
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(is_duplicate(&alive).await, "within the processing timeout");
        tokio::time::advance(DEFAULT_PROCESSING_TIMEOUT + Duration::from_secs(20)).await;
        assert!(
            !is_duplicate(&alive).await,
            "the redelivery is handled, not acknowledged as a duplicate"
        );
        assert!(
            is_duplicate(&alive).await,
            "and its key is kept once handled"
        );
    }

    /// Whether a copy of `Pay("r-1")` its transport marked as redelivered
    /// is acknowledged as a duplicate (and the handler not run).
    async fn redelivery_is_duplicate(d: &Deduplicate) -> bool {
        is_acknowledged_as_duplicate(d, redelivered()).await
    }

    #[tokio::test(start_paused = true)]
    async fn a_redelivery_is_handled_while_the_key_is_only_claimed_but_not_once_the_message_was_handled(
    ) {
        // A consumer claimed the key and died mid-handling; RabbitMQ hands
        // its message out again at once, marked as redelivered.
        let alive = beside_a_process_that_died_mid_handling();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            is_duplicate(&alive).await,
            "a copy that is no redelivery is still a duplicate"
        );
        assert!(
            !redelivery_is_duplicate(&alive).await,
            "the redelivery is handled while the dead consumer's claim holds"
        );
        assert!(
            redelivery_is_duplicate(&alive).await,
            "once handled, a redelivery is a duplicate"
        );
        assert!(is_duplicate(&alive).await, "and so is a copy");
        tokio::time::advance(DEFAULT_PROCESSING_TIMEOUT * 3).await;
        assert!(
            redelivery_is_duplicate(&alive).await,
            "for the window, past the processing timeout"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_redelivery_of_a_handled_message_is_a_duplicate() {
        let d = hourly(Arc::new(InMemoryDedupStore::new()));
        assert!(!is_duplicate(&d).await);
        assert!(redelivery_is_duplicate(&d).await);
    }

    #[tokio::test(start_paused = true)]
    async fn the_processing_timeout_is_configurable_and_at_most_the_window() {
        let store: Arc<dyn DedupStore> = Arc::new(InMemoryDedupStore::new());
        let dead = hourly(store.clone()).processing_timeout(Duration::from_secs(5));
        dies_mid_handling(&dead);
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(is_duplicate(&hourly(store.clone())).await);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!is_duplicate(&hourly(store)).await, "claimed for 5 s only");

        // A window shorter than the processing timeout bounds the claim.
        let short = Deduplicate::new(Duration::from_secs(3))
            .key(|p: &Pay| p.0.to_string())
            .processing_timeout(Duration::from_secs(60));
        dies_mid_handling(&short);
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(!is_duplicate(&short).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_copy_that_comes_while_the_first_is_being_handled_is_a_duplicate() {
        let d = hourly(Arc::new(InMemoryDedupStore::new()));
        let first = handling_forever(&d).await;
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(is_duplicate(&d).await);
        first.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_handled_for_longer_than_the_processing_timeout_keeps_its_key_while_its_handler_runs(
    ) {
        let d = hourly(Arc::new(InMemoryDedupStore::new()));
        let first = handling_forever(&d).await;
        for _ in 0..10 {
            tokio::time::advance(DEFAULT_PROCESSING_TIMEOUT / 2).await;
            settle().await;
        }
        assert!(
            is_duplicate(&d).await,
            "the claim is renewed while the handler runs (100 s)"
        );
        first.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_copy_that_comes_after_the_first_was_handled_is_a_duplicate_for_the_window() {
        let d = hourly(Arc::new(InMemoryDedupStore::new()));
        assert!(!is_duplicate(&d).await);
        tokio::time::advance(DEFAULT_PROCESSING_TIMEOUT * 3).await;
        assert!(is_duplicate(&d).await, "past the processing timeout");
        tokio::time::advance(HOUR - DEFAULT_PROCESSING_TIMEOUT * 4).await;
        assert!(is_duplicate(&d).await, "just before the window ends");
        tokio::time::advance(DEFAULT_PROCESSING_TIMEOUT * 2).await;
        assert!(!is_duplicate(&d).await, "after the window");
    }

    /// Claims keys in memory but cannot keep them once handled.
    struct NoHoldStore(InMemoryDedupStore);
    impl DedupStore for NoHoldStore {
        fn insert<'a>(
            &'a self,
            key: &'a str,
            hold: Duration,
            claim: DedupClaim,
        ) -> BoxFuture<'a, Result<bool, BoxError>> {
            if claim.token == DedupClaim::HANDLED {
                return Box::pin(async { Err("store down".into()) });
            }
            self.0.insert(key, hold, claim)
        }
        fn hold<'a>(
            &'a self,
            _: &'a str,
            _: Uuid,
            _: Duration,
        ) -> BoxFuture<'a, Result<(), BoxError>> {
            Box::pin(async { Err("store down".into()) })
        }
        fn remove<'a>(&'a self, key: &'a str, token: Uuid) -> BoxFuture<'a, Result<(), BoxError>> {
            self.0.remove(key, token)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_failure_remembering_a_handled_message_keeps_the_success() {
        let d = dedup().store(NoHoldStore(InMemoryDedupStore::new()));
        let end = RecordingEndpoint::new();
        let out = d
            .handle(Envelope::new(Pay("r-1")), end.next())
            .await
            .unwrap();
        assert!(!out.has::<DeduplicatedStamp>());
        assert_eq!(end.calls().len(), 1);
        assert!(is_duplicate(&d).await, "the processing claim still holds");
    }

    #[tokio::test(start_paused = true)]
    async fn a_retried_attempt_does_not_forget_the_key_its_retry_claimed_already() {
        let d = hourly(Arc::new(InMemoryDedupStore::new()));
        let worker = d.clone();
        let retry = Arc::new(Mutex::new(None));
        let running = retry.clone();
        // Schedules a retry, which another worker picks up (presenting this
        // attempt's token, it claims the key anew) before this attempt
        // forgets the key.
        let retrying = FnEndpoint::new(move |e| {
            let (worker, running) = (worker.clone(), running.clone());
            Box::pin(async move {
                let sent = e.with(RedeliveryStamp::new(1));
                let task = handling_forever_from(&worker, sent.clone()).await;
                *running.lock().unwrap() = Some(task);
                Ok(sent)
            })
        });
        d.handle(Envelope::new(Pay("r-1")), Next::to_endpoint(&retrying))
            .await
            .unwrap();
        assert!(
            is_duplicate(&d).await,
            "a copy that comes while the retry is handled is a duplicate"
        );
        let task = retry.lock().unwrap().take().unwrap();
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_that_fails_after_a_redelivery_took_its_claim_over_leaves_that_claim() {
        let d = hourly(Arc::new(InMemoryDedupStore::new()));
        // A consumer that only lost its connection: its handler still runs,
        // and fails once the redelivery took the claim over.
        let fail = Arc::new(tokio::sync::Notify::new());
        let failing = fail.clone();
        let slow_failure = FnEndpoint::new(move |_| {
            let failing = failing.clone();
            Box::pin(async move {
                failing.notified().await;
                Err(BusError::Middleware {
                    middleware: "Handler".into(),
                    source: "boom".into(),
                })
            })
        });
        let mut old =
            Box::pin(d.handle(Envelope::new(Pay("r-1")), Next::to_endpoint(&slow_failure)));
        assert!((&mut old).now_or_never().is_none());
        let redelivery = handling_forever_from(&d, redelivered()).await;
        fail.notify_one();
        old.await.unwrap_err();
        assert!(
            is_duplicate(&d).await,
            "a copy that comes while the redelivery is handled is a duplicate"
        );
        redelivery.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_abandoned_after_a_redelivery_took_its_claim_over_leaves_that_claim() {
        let d = hourly(Arc::new(InMemoryDedupStore::new()));
        let stuck = FnEndpoint::new(|_| Box::pin(std::future::pending()));
        let mut old = Box::pin(d.handle(Envelope::new(Pay("r-1")), Next::to_endpoint(&stuck)));
        assert!((&mut old).now_or_never().is_none());
        let redelivery = handling_forever_from(&d, redelivered()).await;
        // Its dispatch is dropped (a deadline, a stopping worker).
        drop(old);
        settle().await;
        assert!(
            is_duplicate(&d).await,
            "a copy that comes while the redelivery is handled is a duplicate"
        );
        redelivery.abort();
    }

    #[test]
    fn a_handler_that_finishes_at_once_sets_no_renewal_timer() {
        // No time driver: setting a timer panics here.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let end = RecordingEndpoint::new();
            for _ in 0..64 {
                let out = dedup()
                    .handle(Envelope::new(Pay("r-1")), end.next())
                    .await
                    .unwrap();
                assert!(!out.has::<DeduplicatedStamp>());
            }
            assert_eq!(end.calls().len(), 64);
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_processing_timeout_still_claims_the_key_while_the_message_is_handled() {
        let d = hourly(Arc::new(InMemoryDedupStore::new())).processing_timeout(Duration::ZERO);
        let first = handling_forever(&d).await;
        assert!(is_duplicate(&d).await, "while the handler runs");
        for _ in 0..10 {
            tokio::time::advance(MIN_PROCESSING_TIMEOUT / 2).await;
            settle().await;
        }
        assert!(
            is_duplicate(&d).await,
            "renewed every half minimum processing timeout"
        );
        first.abort();
    }
}
