//! The in-memory transport: a queue inside the process, for tests and for
//! work that may be lost when the process stops.
//!
//! * **Not persistent**: messages live as long as the transport does.
//! * **Ordered**: available messages are handed out in the order they were
//!   sent (a released or redelivered message takes its old place). Sends
//!   made at the same time from several tasks have no order of their own:
//!   they come out in the order they reached the queue, which need not be
//!   the order of their ids. The sends of one task keep their order.
//! * **Delays** are honoured (with tokio's clock, so paused-time tests work).
//! * **Leases**: a message handed out by `get` is leased; if it is neither
//!   acknowledged, rejected nor released within the lease timeout (30 s by
//!   default, extended by `keepalive`), it is handed out again.
//! * **Redeliveries are marked**: a message whose lease ran out is handed
//!   out again marked as redelivered ([`Delivery::redelivered`],
//!   [`LocalDelivery::redelivered`]), from then on; a worker stamps it with a
//!   [`RedeliveredStamp`](crate::envelope::stamp::RedeliveredStamp). So
//!   [`Deduplicate`](crate::middleware::dedup::Deduplicate) handles it even
//!   when the lease is shorter than its processing timeout and the key is
//!   still claimed by the consumer that let the lease run out. A message
//!   given back with `release` is not marked: the consumer that gave it
//!   back is alive, and a worker releases a message only once its dispatch
//!   ended or was dropped, which forgets the key it claimed.
//! * **No encoding by default**: messages sent through a messenger are
//!   stored as envelopes and handed back (and listed) as envelopes without
//!   their non-sendable stamps, as a real transport would drop them, which
//!   is what makes it fast. A stored message costs its envelope (the one the
//!   send returned, shared: its non-sendable stamps are dropped in place when
//!   it is first handed out) and a number: its id's text is made when
//!   needed. With `serialize` set (`in-memory://?serialize=true`) every
//!   message is encoded by the serializer on the way in and decoded on the
//!   way out, to prove the messages survive a real transport.
//!
//! Raw messages sent through [`Transport::send`] are stored as they are.
//! Raw reads ([`Receiver::get`], [`Browse::list`], [`Browse::find`]) of a
//! message stored as an envelope encode it with the serializer of the
//! messenger the transport is registered with.
//!
//! ```
//! use envoi_core::transport::in_memory::InMemoryTransport;
//! use envoi_core::transport::{MessageCount, RawMessage, Receiver, Transport};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let queue = InMemoryTransport::new();
//! let id = queue.send(RawMessage::default(), None).await.unwrap().into();
//! let got = queue.get(10).await.unwrap();
//! assert_eq!(got[0].id, id);
//! queue.ack(&id).await.unwrap();
//! assert_eq!(queue.message_count().await.unwrap(), 0);
//! assert_eq!(queue.acknowledged(), 1);
//! # });
//! ```

mod config;
mod state;

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use crossbeam_queue::SegQueue;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::envelope::headers::Headers;
use crate::envelope::stamp::DelayStamp;
use crate::envelope::Envelope;
use crate::error::{Result, TransportError};
use crate::far;
use crate::transport::serializer::{Serializer, INVALID_BODY_HEADER, KIND_HEADER, TYPE_HEADER};
use crate::transport::{
    Browse, Delivery, DeliveryId, Keepalive, LocalDelivery, LocalFuture, LocalId, LocalReceiver,
    LocalSender, MessageCount, Payload, RawMessage, Receiver, Teardown, Transport,
    TransportBinding, TransportDescription, WakeUp,
};
use crate::BoxFuture;

pub use config::InMemoryConfig;
use state::{Entry, Leases, State, Stored};

/// A queue in the process's memory; see the [module documentation](self).
pub struct InMemoryTransport {
    state: Mutex<State>,
    /// Messages sent for now, not yet in `state`: a send queues its message
    /// here without the lock, which takes them in (in id order) the next
    /// time it is held.
    inbox: SegQueue<Entry>,
    /// The last id given out. A send takes its id without the lock and
    /// queues its message in the inbox, so it never waits for the lock.
    last_key: AtomicU64,
    notify: Notify,
    /// How many [`WakeUp::wait_for_messages`] calls are checking or
    /// waiting: a send wakes them only when there is one.
    waiting: AtomicUsize,
    config: InMemoryConfig,
    serializer: OnceLock<Serializer>,
}

impl Default for InMemoryTransport {
    fn default() -> Self {
        Self::with_config(InMemoryConfig::default())
    }
}

impl fmt::Debug for InMemoryTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InMemoryTransport")
            .field("config", &self.config)
            .field("stored", &self.lock().count())
            .finish()
    }
}

fn parse_id(id: &str) -> Result<u64, TransportError> {
    id.parse()
        .map_err(|_| TransportError::NotFound(id.to_string()))
}

impl InMemoryTransport {
    /// An empty transport storing envelopes without encoding them.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty transport configured by `config`. A lease timeout of thirty
    /// years or more is taken as thirty years, which no clock overflows.
    pub fn with_config(config: InMemoryConfig) -> Self {
        let config = InMemoryConfig {
            lease_timeout: far::clamp(config.lease_timeout),
            ..config
        };
        Self {
            state: Mutex::new(State::default()),
            inbox: SegQueue::new(),
            last_key: AtomicU64::new(0),
            notify: Notify::new(),
            waiting: AtomicUsize::new(0),
            config,
            serializer: OnceLock::new(),
        }
    }

    /// A transport configured by an `in-memory://` DSN; see
    /// [`InMemoryConfig::from_dsn`].
    pub fn from_dsn(dsn: &str) -> Result<Self, TransportError> {
        Ok(Self::with_config(InMemoryConfig::from_dsn(dsn)?))
    }

    /// Uses `serializer` for raw reads of messages stored as envelopes (and
    /// for encoding with `serialize` set), instead of the one of the
    /// messenger it is registered with.
    #[must_use]
    pub fn with_serializer(self, serializer: Serializer) -> Self {
        let _ = self.serializer.set(serializer);
        self
    }

    /// The configuration.
    pub fn config(&self) -> &InMemoryConfig {
        &self.config
    }

    /// How many messages were acknowledged so far.
    pub fn acknowledged(&self) -> u64 {
        self.lock().acknowledged
    }

    /// How many messages were rejected so far.
    pub fn rejected(&self) -> u64 {
        self.lock().rejected
    }

    /// Every stored message (waiting, delayed or leased), oldest first,
    /// without leasing them.
    pub fn stored(&self) -> Vec<LocalDelivery> {
        let all = self.lock().snapshot();
        all.into_iter()
            .map(|(id, payload)| LocalDelivery {
                id,
                payload,
                redelivered: false,
            })
            .collect()
    }

    /// The state, with every message sent so far in it.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.lock_to_take(usize::MAX)
    }

    /// The state, with at least `max` messages available if that many
    /// were sent: taking a batch moves no more than it needs out of the
    /// inbox.
    fn lock_to_take(&self, max: usize) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-updated
        // in a way that matters more than losing the queue; keep going.
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while state.ready.len() < max {
            let Some(entry) = self.inbox.pop() else { break };
            state.insert_ready(entry);
        }
        state
    }

    /// Stores a message under `id`: one available now goes through the
    /// inbox, without waiting for the lock.
    fn put(&self, id: LocalId, stored: Stored, delay: Option<Duration>) {
        match delay.filter(|d| !d.is_zero()) {
            None => self.inbox.push(Entry { id, stored }),
            delay => self.lock().store(id, stored, delay),
        }
    }

    /// A stored message as a raw one. An envelope that cannot be encoded
    /// (its type is not registered, its body is too large, a header uses a
    /// reserved name, or there is no serializer) becomes a raw message that
    /// says so and does not decode, rather than an error that would hide
    /// every other message read with it.
    fn raw(&self, id: &LocalId, payload: Payload) -> Delivery {
        let raw = match payload {
            Payload::Raw(raw) => raw,
            Payload::Envelope(envelope) => match self.serializer.get() {
                Some(s) => s
                    .encode(&envelope)
                    .unwrap_or_else(|e| unencodable(&envelope, &e.to_string())),
                None => unencodable(
                    &envelope,
                    "the transport is not registered with a messenger and has no serializer",
                ),
            },
        };
        Delivery::new(id.to_string(), raw)
    }

    /// Wakes a [`WakeUp::wait_for_messages`] call, if one is waiting.
    fn wake(&self) {
        // Orders the message just queued before the check, as the waiter
        // orders its count before looking at the queue: one of the two
        // sees the other.
        std::sync::atomic::fence(AtomicOrdering::SeqCst);
        if self.waiting.load(AtomicOrdering::SeqCst) > 0 {
            self.notify.notify_one();
        }
    }

    /// The id for the next message stored.
    fn next_id(&self) -> LocalId {
        LocalId::new(self.last_key.fetch_add(1, AtomicOrdering::Relaxed) + 1)
    }

    fn store(&self, stored: Stored, delay: Option<Duration>) -> LocalId {
        let id = self.next_id();
        self.put(id, stored, delay);
        self.wake();
        id
    }

    /// Stores `envelope` and returns it stamped with its new id.
    ///
    /// The stored copy shares the returned envelope's body, stamps
    /// included: its non-sendable stamps (the id, the sender's
    /// [`SentStamp`](crate::envelope::stamp::SentStamp)) are dropped when it is first
    /// handed out, by then usually in place. Stamping the envelope before it
    /// is shared costs no copy.
    fn store_envelope(&self, envelope: Envelope) -> Envelope {
        let delay = envelope
            .last::<DelayStamp>()
            .map(DelayStamp::duration)
            .filter(|d| !d.is_zero());
        let id = self.next_id();
        let stamped = envelope.with_local_id(id);
        let stored = Stored::Envelope(stamped.clone());
        self.put(id, stored, delay);
        self.wake();
        stamped
    }
}

/// What a raw read shows of an envelope that cannot be encoded: its debug
/// text as the body, its type and kind, and [`INVALID_BODY_HEADER`] saying
/// why, which makes it fail to decode with that reason.
fn unencodable(envelope: &Envelope, reason: &str) -> RawMessage {
    let mut headers = Headers::new();
    headers.insert(
        INVALID_BODY_HEADER,
        format!("the envelope cannot be encoded: {reason}"),
    );
    headers.insert(KIND_HEADER, envelope.kind().as_str());
    headers.insert(TYPE_HEADER, envelope.message_name());
    RawMessage {
        body: format!("{envelope:?}").into_bytes(),
        headers,
    }
}

/// Counts a [`WakeUp::wait_for_messages`] call while it runs.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, AtomicOrdering::SeqCst);
        Self(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, AtomicOrdering::SeqCst);
    }
}

impl Transport for InMemoryTransport {
    fn describe(&self) -> TransportDescription {
        TransportDescription::new("in_memory")
    }

    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        let id = self.store(Stored::Raw(Box::new(message)), delay);
        Box::pin(async move { Ok(id.to_string()) })
    }

    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        let stored: Vec<(Stored, Option<Duration>)> = messages
            .into_iter()
            .map(|(m, d)| (Stored::Raw(Box::new(m)), d))
            .collect();
        let ids: Vec<LocalId> = {
            let mut state = self.lock();
            stored
                .into_iter()
                .map(|(s, d)| {
                    let id = self.next_id();
                    state.store(id, s, d);
                    id
                })
                .collect()
        };
        self.wake();
        let ids = ids.iter().map(LocalId::to_string).collect();
        Box::pin(async move { Ok(ids) })
    }

    crate::abilities!(
        receiver,
        keepalive,
        message_count,
        browse,
        wake_up,
        teardown
    );

    fn as_local_sender(&self) -> Option<&dyn LocalSender> {
        (!self.config.serialize).then_some(self as &dyn LocalSender)
    }

    fn as_local_receiver(&self) -> Option<&dyn LocalReceiver> {
        (!self.config.serialize).then_some(self as &dyn LocalReceiver)
    }

    fn bind(&self, binding: &TransportBinding) {
        let _ = self.serializer.set(binding.serializer().clone());
    }
}

impl Receiver for InMemoryTransport {
    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        let mut taken = Vec::new();
        self.lock_to_take(max)
            .take(max, self.config.lease_timeout, |e| {
                taken.push((e.id, e.stored.handout(), e.stored.is_redelivered()))
            });
        let out = taken
            .into_iter()
            .map(|(id, p, redelivered)| Delivery {
                redelivered,
                ..self.raw(&id, p)
            })
            .collect();
        Box::pin(async move { Ok(out) })
    }

    fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        let out = parse_id(id.as_str()).and_then(|n| {
            let mut state = self.lock();
            if state.remove(n) {
                state.acknowledged += 1;
                Ok(())
            } else {
                Err(TransportError::NotFound(id.to_string()))
            }
        });
        Box::pin(async move { out })
    }

    fn ack_batch<'a>(&'a self, ids: &'a [DeliveryId]) -> BoxFuture<'a, Result<(), TransportError>> {
        let mut missing = None;
        {
            let mut state = self.lock();
            for id in ids {
                match parse_id(id.as_str()) {
                    Ok(n) if state.remove(n) => state.acknowledged += 1,
                    // The first error is the one returned.
                    _ => {
                        missing.get_or_insert_with(|| id.to_string());
                    }
                }
            }
        }
        Box::pin(async move {
            match missing {
                Some(id) => Err(TransportError::NotFound(id)),
                None => Ok(()),
            }
        })
    }

    fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        let out = parse_id(id.as_str()).and_then(|n| {
            let mut state = self.lock();
            if state.remove(n) {
                state.rejected += 1;
                Ok(())
            } else {
                Err(TransportError::NotFound(id.to_string()))
            }
        });
        Box::pin(async move { out })
    }

    fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        let out = parse_id(id.as_str()).and_then(|n| {
            let mut state = self.lock();
            match state.leased.remove(n) {
                Some(lease) => {
                    state.insert_ready(lease.entry);
                    Ok(())
                }
                // Its lease expired and it is waiting again: nothing to do.
                None if state.ready.iter().any(|e| e.key() == n) => Ok(()),
                None => Err(TransportError::NotFound(id.to_string())),
            }
        });
        if out.is_ok() {
            self.wake();
        }
        Box::pin(async move { out })
    }
}

impl Keepalive for InMemoryTransport {
    fn keepalive<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        let out = parse_id(id.as_str()).and_then(|n| {
            let mut state = self.lock();
            let expires = Instant::now() + self.config.lease_timeout;
            match state.leased.get_mut(n) {
                Some(lease) => {
                    lease.expires = expires;
                    Ok(())
                }
                None => Err(TransportError::NotFound(id.to_string())),
            }
        });
        Box::pin(async move { out })
    }
}

impl MessageCount for InMemoryTransport {
    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        let n = self.lock().count() as u64;
        Box::pin(async move { Ok(n) })
    }
}

impl Browse for InMemoryTransport {
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        let out = self
            .lock()
            .snapshot()
            .into_iter()
            .take(limit)
            .map(|(id, p)| self.raw(&id, p))
            .collect();
        Box::pin(async move { Ok(out) })
    }

    fn find<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        let out = match id.as_str().parse::<u64>() {
            Err(_) => Ok(None),
            Ok(n) => {
                let found = self
                    .lock()
                    .snapshot()
                    .into_iter()
                    .find(|(i, _)| i.key() == n);
                Ok(found.map(|(i, p)| self.raw(&i, p)))
            }
        };
        Box::pin(async move { out })
    }
}

impl Teardown for InMemoryTransport {
    fn purge(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        let removed = {
            let mut state = self.lock();
            let n = state.count() as u64;
            state.leased = Leases::default();
            state.ready.clear();
            state.delayed.clear();
            state.earliest_expiry = None;
            n
        };
        Box::pin(async move { Ok(removed) })
    }

    fn delete(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        let purged = self.purge();
        Box::pin(async move { purged.await.map(drop) })
    }
}

impl WakeUp for InMemoryTransport {
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _waiting = Waiting::new(&self.waiting);
            let notified = self.notify.notified();
            let wait = {
                let state = self.lock();
                if !state.ready.is_empty() {
                    return;
                }
                state
                    .next_change(Instant::now())
                    .map_or(timeout, |d| d.min(timeout))
            };
            let _ = tokio::time::timeout(wait, notified).await;
        })
    }
}

impl LocalSender for InMemoryTransport {
    fn send_envelope(&self, envelope: Envelope) -> LocalFuture<'_, Result<Envelope>> {
        LocalFuture::ready(Ok(self.store_envelope(envelope)))
    }

    fn handles_on_send(&self) -> bool {
        false
    }
}

impl LocalReceiver for InMemoryTransport {
    fn get_local(&self, max: usize) -> LocalFuture<'_, Result<Vec<LocalDelivery>, TransportError>> {
        let mut out = Vec::new();
        self.lock_to_take(max)
            .take(max, self.config.lease_timeout, |e| {
                if out.capacity() == 0 {
                    out.reserve_exact(max);
                }
                out.push(LocalDelivery {
                    id: e.id,
                    payload: e.stored.handout(),
                    redelivered: e.stored.is_redelivered(),
                })
            });
        LocalFuture::ready(Ok(out))
    }
    fn ack_local(&self, keys: &[u64]) -> Result<(), TransportError> {
        let mut missing = None;
        // Freeing the messages waits until the lock is released.
        let mut removed = Vec::with_capacity(keys.len());
        {
            let mut state = self.lock();
            for &key in keys {
                match state.take_out(key) {
                    Some(entry) => {
                        removed.push(entry);
                        state.acknowledged += 1;
                    }
                    None => {
                        missing.get_or_insert(key);
                    }
                }
            }
        }
        drop(removed);
        match missing {
            Some(key) => Err(TransportError::NotFound(key.to_string())),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Ping;

    fn raw(n: u8) -> RawMessage {
        RawMessage {
            body: vec![n],
            headers: Default::default(),
        }
    }

    fn bodies(ds: &[Delivery]) -> Vec<u8> {
        ds.iter().map(|d| d.raw.body[0]).collect()
    }

    fn short_lease() -> InMemoryTransport {
        InMemoryTransport::with_config(InMemoryConfig {
            lease_timeout: Duration::from_secs(10),
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn messages_come_out_in_the_order_they_went_in() {
        let t = InMemoryTransport::new();
        for n in 1..=5 {
            t.send(raw(n), None).await.unwrap();
        }
        assert_eq!(bodies(&t.get(3).await.unwrap()), [1, 2, 3]);
        assert_eq!(bodies(&t.get(10).await.unwrap()), [4, 5]);
        assert!(t.get(10).await.unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_delayed_message_waits_for_its_time() {
        let t = InMemoryTransport::new();
        t.send(raw(1), Some(Duration::from_secs(5))).await.unwrap();
        t.send(raw(2), None).await.unwrap();
        assert_eq!(bodies(&t.get(10).await.unwrap()), [2]);
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(t.get(10).await.unwrap().is_empty());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(bodies(&t.get(10).await.unwrap()), [1]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unacknowledged_message_is_redelivered_after_its_lease() {
        let t = short_lease();
        t.send(raw(1), None).await.unwrap();
        t.send(raw(2), None).await.unwrap();
        let first = t.get(1).await.unwrap();
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(bodies(&t.get(10).await.unwrap()), [2]);
        tokio::time::advance(Duration::from_secs(1)).await;
        let again = t.get(10).await.unwrap();
        assert_eq!(
            again,
            [first[0].clone().mark_redelivered()],
            "same id and body, marked"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_raw_message_whose_lease_ran_out_is_handed_out_again_marked_as_redelivered() {
        let t = short_lease();
        t.send(raw(1), None).await.unwrap();
        let first = t.get(1).await.unwrap().remove(0);
        assert!(!first.redelivered, "handed out the first time");
        tokio::time::advance(Duration::from_secs(10)).await;
        let again = t.get(1).await.unwrap().remove(0);
        assert_eq!((&again.id, &again.raw.body), (&first.id, &first.raw.body));
        assert!(again.redelivered, "its lease ran out");
        // Given back by the consumer that holds it now, it stays marked.
        t.release(&again.id).await.unwrap();
        assert!(t.get(1).await.unwrap()[0].redelivered);
    }

    #[tokio::test]
    async fn a_released_message_is_not_marked_as_redelivered() {
        let t = InMemoryTransport::new();
        t.send(raw(1), None).await.unwrap();
        let first = t.get(1).await.unwrap().remove(0);
        t.release(&first.id).await.unwrap();
        let again = t.get(1).await.unwrap().remove(0);
        assert_eq!(again, first, "same id and body, unmarked");
    }

    #[tokio::test]
    async fn a_header_a_producer_set_never_marks_a_redelivery() {
        let t = InMemoryTransport::new();
        let mut forged = raw(1);
        forged.headers.insert("X-Envoi-Redelivered", "true");
        t.send(forged.clone(), None).await.unwrap();
        t.send_batch(vec![(forged.clone(), None)]).await.unwrap();
        let got = t.get(10).await.unwrap();
        assert_eq!(got.len(), 2);
        assert!(
            got.iter().all(|d| d.raw == forged && !d.redelivered),
            "{got:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_encoded_message_whose_lease_ran_out_is_handed_out_marked() {
        let serializer = Serializer::builder().message::<Ping>().build().unwrap();
        let t = InMemoryTransport::from_dsn("in-memory://?serialize=true&lease_timeout_ms=5000")
            .unwrap()
            .with_serializer(serializer.clone());
        assert!(t.as_local_receiver().is_none(), "every message is encoded");
        t.send(serializer.encode(&Envelope::new(Ping)).unwrap(), None)
            .await
            .unwrap();
        let first = t.get(1).await.unwrap().remove(0);
        assert!(!first.redelivered);
        tokio::time::advance(Duration::from_secs(5)).await;
        let again = t.get(1).await.unwrap().remove(0);
        assert_eq!(again.id, first.id);
        assert!(again.redelivered);
        assert_eq!(again.raw, first.raw, "the mark is not in the message");
    }

    #[tokio::test(start_paused = true)]
    async fn an_envelope_whose_lease_ran_out_is_handed_out_again_marked() {
        let t =
            short_lease().with_serializer(Serializer::builder().message::<Ping>().build().unwrap());
        t.send_envelope(Envelope::new(Ping)).await.unwrap();
        t.send_envelope(Envelope::new(Ping)).await.unwrap();
        let first = t.get_local(1).await.unwrap();
        assert!(!first[0].redelivered);
        // The other one is first handed out raw.
        assert!(!t.get(1).await.unwrap()[0].redelivered);
        tokio::time::advance(Duration::from_secs(10)).await;
        let again = t.get_local(1).await.unwrap();
        assert_eq!(again[0].id, first[0].id);
        assert!(again[0].redelivered);
        // Raw, it is marked too.
        assert!(t.get(1).await.unwrap()[0].redelivered);
        // Expired again, both are still marked.
        tokio::time::advance(Duration::from_secs(10)).await;
        let third = t.get_local(10).await.unwrap();
        assert_eq!(third.len(), 2);
        assert!(third.iter().all(|d| d.redelivered));
        // Listing shows the message as it was sent, unmarked.
        let listed = &t.stored()[0];
        assert!(!listed.redelivered);
        let Payload::Envelope(listed) = &listed.payload else {
            panic!("expected an envelope")
        };
        assert!(!listed.has::<crate::envelope::stamp::RedeliveredStamp>());
    }

    #[tokio::test(start_paused = true)]
    async fn a_deduplicating_handler_takes_over_the_key_of_a_consumer_whose_lease_ran_out() {
        use crate::middleware::dedup::Deduplicate;
        use crate::middleware::{Middleware, Next};
        use crate::testing::{FnEndpoint, RecordingEndpoint};
        use futures_util::FutureExt;

        // A lease shorter than the processing timeout (20 s by default).
        let t = short_lease();
        let dedup = Deduplicate::new(Duration::from_secs(3600)).key(|_: &Ping| "ping".to_string());
        t.send_envelope(Envelope::new(Ping)).await.unwrap();
        let Payload::Envelope(first) = t.get_local(1).await.unwrap().remove(0).payload else {
            panic!("expected an envelope")
        };
        // The consumer claims the key, starts the handler and dies: nothing
        // of it runs again, neither a keepalive nor the dedup cleanup.
        let stuck = FnEndpoint::new(|_| Box::pin(std::future::pending()));
        let mut dead = Box::pin(dedup.handle(first, Next::to_endpoint(&stuck)));
        assert!((&mut dead).now_or_never().is_none());
        std::mem::forget(dead);

        tokio::time::advance(Duration::from_secs(10)).await;
        let again = t.get_local(1).await.unwrap().remove(0);
        assert!(again.redelivered, "its lease ran out");
        let Payload::Envelope(again) = again.payload else {
            panic!("expected an envelope")
        };
        // As a worker stamps a delivery its transport marked.
        let again = again.with(crate::envelope::stamp::RedeliveredStamp::new());
        let end = RecordingEndpoint::new();
        let out = dedup.handle(again, end.next()).await.unwrap();
        assert!(
            !out.has::<crate::middleware::dedup::DeduplicatedStamp>(),
            "the redelivery is no duplicate"
        );
        assert_eq!(end.calls().len(), 1, "the redelivery is handled");
    }

    #[tokio::test(start_paused = true)]
    async fn keepalive_extends_the_lease() {
        let t = short_lease();
        let id = DeliveryId::from(t.send(raw(1), None).await.unwrap());
        t.get(1).await.unwrap();
        tokio::time::advance(Duration::from_secs(8)).await;
        t.keepalive(&id).await.unwrap();
        tokio::time::advance(Duration::from_secs(8)).await;
        assert!(t.get(10).await.unwrap().is_empty());
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(bodies(&t.get(10).await.unwrap()), [1]);
    }

    #[tokio::test]
    async fn a_released_message_is_handed_out_again_in_its_old_place() {
        let t = InMemoryTransport::new();
        for n in 1..=3 {
            t.send(raw(n), None).await.unwrap();
        }
        let got = t.get(1).await.unwrap();
        t.release(&got[0].id).await.unwrap();
        assert_eq!(bodies(&t.get(10).await.unwrap()), [1, 2, 3]);
    }

    #[tokio::test]
    async fn ack_and_reject_remove_for_good_and_are_counted() {
        let t = InMemoryTransport::new();
        let a = DeliveryId::from(t.send(raw(1), None).await.unwrap());
        let b = DeliveryId::from(t.send(raw(2), None).await.unwrap());
        let c = DeliveryId::from(t.send(raw(3), None).await.unwrap());
        t.get(10).await.unwrap();
        t.ack_batch(&[a.clone(), b]).await.unwrap();
        t.reject(&c).await.unwrap();
        assert_eq!(t.message_count().await.unwrap(), 0);
        assert_eq!((t.acknowledged(), t.rejected()), (2, 1));
        assert!(matches!(t.ack(&a).await, Err(TransportError::NotFound(_))));
        assert!(matches!(
            t.ack(&"nope".into()).await,
            Err(TransportError::NotFound(_))
        ));
    }

    #[tokio::test]
    async fn a_batch_acknowledgement_acknowledges_what_it_can_and_names_the_first_unknown_id() {
        let t = InMemoryTransport::new();
        let a = DeliveryId::from(t.send(raw(1), None).await.unwrap());
        let b = DeliveryId::from(t.send(raw(2), None).await.unwrap());
        t.get(10).await.unwrap();
        let ids = [DeliveryId::from("7"), a, DeliveryId::from("8"), b];
        assert!(matches!(
            t.ack_batch(&ids).await,
            Err(TransportError::NotFound(id)) if id == "7"
        ));
        assert_eq!((t.message_count().await.unwrap(), t.acknowledged()), (0, 2));

        for _ in 0..2 {
            t.send_envelope(Envelope::new(Ping)).await.unwrap();
        }
        let keys: Vec<u64> = t
            .get_local(10)
            .await
            .unwrap()
            .iter()
            .map(|d| d.id.key())
            .collect();
        assert!(matches!(
            t.ack_local(&[70, keys[0], 80, keys[1]]),
            Err(TransportError::NotFound(id)) if id == "70"
        ));
        assert_eq!((t.message_count().await.unwrap(), t.acknowledged()), (0, 4));
    }

    #[tokio::test(start_paused = true)]
    async fn list_find_and_count_see_waiting_delayed_and_leased_messages() {
        let t = InMemoryTransport::new();
        let a = DeliveryId::from(t.send(raw(1), None).await.unwrap());
        t.send(raw(2), Some(Duration::from_secs(60))).await.unwrap();
        t.send(raw(3), None).await.unwrap();
        t.get(1).await.unwrap();
        assert_eq!(t.message_count().await.unwrap(), 3);
        assert_eq!(bodies(&t.list(10).await.unwrap()), [1, 2, 3]);
        assert_eq!(bodies(&t.list(2).await.unwrap()), [1, 2]);
        assert_eq!(t.find(&a).await.unwrap().unwrap().raw.body, [1]);
        assert!(t.find(&"999".into()).await.unwrap().is_none());
        // Listing does not lease: message 3 is still available.
        assert_eq!(bodies(&t.get(10).await.unwrap()), [3]);
    }

    #[tokio::test]
    async fn envelopes_are_stored_without_their_non_sendable_stamps() {
        let t = InMemoryTransport::new();
        let sent = t
            .send_envelope(
                Envelope::new(Ping)
                    .with(crate::envelope::stamp::ReceivedStamp::new("x"))
                    .with(DelayStamp { ms: 0 }),
            )
            .await
            .unwrap();
        assert!(sent.has::<crate::envelope::stamp::TransportMessageIdStamp>());
        let got = t.get_local(10).await.unwrap();
        let Payload::Envelope(e) = &got[0].payload else {
            panic!("expected an envelope")
        };
        assert!(!e.has::<crate::envelope::stamp::ReceivedStamp>());
        assert!(e.has::<DelayStamp>());
        assert_eq!(
            got[0].id.to_string(),
            sent.last::<crate::envelope::stamp::TransportMessageIdStamp>()
                .unwrap()
                .id
        );
        assert!(!e.has::<crate::envelope::stamp::TransportMessageIdStamp>());
    }

    /// The reason a raw message read from an envelope that could not be
    /// encoded gives for not decoding.
    fn unencodable_reason(d: &Delivery) -> &str {
        d.raw.header(INVALID_BODY_HEADER).unwrap_or_default()
    }

    #[tokio::test]
    async fn raw_reads_of_envelopes_need_a_serializer() {
        let t = InMemoryTransport::new();
        t.send_envelope(Envelope::new(Ping)).await.unwrap();
        let listed = t.list(10).await.unwrap();
        assert_eq!(listed.len(), 1);
        assert!(unencodable_reason(&listed[0]).contains("no serializer"));
        assert_eq!(listed[0].raw.header("type"), Some("Ping"));
        let t = InMemoryTransport::new()
            .with_serializer(Serializer::builder().message::<Ping>().build().unwrap());
        t.send_envelope(Envelope::new(Ping)).await.unwrap();
        let listed = t.list(10).await.unwrap();
        assert_eq!(listed[0].raw.header("type"), Some("Ping"));
    }

    #[tokio::test]
    async fn an_envelope_that_cannot_be_encoded_does_not_hide_the_others_from_raw_reads() {
        let t = InMemoryTransport::new()
            .with_serializer(Serializer::builder().message::<Ping>().build().unwrap());
        t.send(raw(1), None).await.unwrap();
        // `kind` is the serializer's own header: this envelope cannot be
        // written as a raw message.
        t.send_envelope(Envelope::new(Ping).with_header("kind", "event"))
            .await
            .unwrap();
        t.send_envelope(Envelope::new(Ping)).await.unwrap();

        let listed = t.list(10).await.unwrap();
        assert_eq!(listed.len(), 3);
        assert!(unencodable_reason(&listed[1]).contains("reserved"));
        let found = t.find(&listed[1].id).await.unwrap().unwrap();
        assert!(unencodable_reason(&found).contains("reserved"));

        // A raw fetch hands out all three, so each can be acknowledged.
        let got = t.get(10).await.unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(bodies(&got[..1]), [1]);
        assert!(unencodable_reason(&got[1]).contains("reserved"));
        assert_eq!(unencodable_reason(&got[2]), "");
        let serializer = Serializer::builder().message::<Ping>().build().unwrap();
        assert!(serializer.decode(&got[1].raw).is_err());
        assert!(serializer.decode(&got[2].raw).is_ok());
        for d in &got {
            t.ack(&d.id).await.unwrap();
        }
        assert_eq!(t.message_count().await.unwrap(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_returns_when_a_message_arrives() {
        let t = std::sync::Arc::new(InMemoryTransport::new());
        let sender = t.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            sender.send(raw(1), None).await.unwrap();
        });
        let start = Instant::now();
        t.wait_for_messages(Duration::from_secs(60)).await;
        assert!(start.elapsed() < Duration::from_secs(1));
        assert_eq!(t.get(1).await.unwrap().len(), 1);
    }

    #[test]
    fn ids_are_formatted_in_decimal() {
        for n in [0, 7, 10, 12345, u64::MAX] {
            assert_eq!(LocalId::new(n).to_string(), n.to_string());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_and_delayed_messages_can_be_acknowledged_too() {
        let t = InMemoryTransport::new();
        let waiting = DeliveryId::from(t.send(raw(1), None).await.unwrap());
        let delayed = DeliveryId::from(t.send(raw(2), Some(Duration::from_secs(5))).await.unwrap());
        let later = DeliveryId::from(t.send(raw(3), Some(Duration::from_secs(9))).await.unwrap());
        t.ack(&delayed).await.unwrap();
        t.ack(&waiting).await.unwrap();
        assert_eq!((t.message_count().await.unwrap(), t.acknowledged()), (1, 2));
        tokio::time::advance(Duration::from_secs(10)).await;
        let got = t.get(10).await.unwrap();
        assert_eq!((bodies(&got), got[0].id.clone()), (vec![3], later));
    }

    #[tokio::test]
    async fn local_acks_remove_by_key_and_report_unknown_keys() {
        let t = InMemoryTransport::new();
        for _ in 0..3 {
            t.send_envelope(Envelope::new(Ping)).await.unwrap();
        }
        let got = t.get_local(10).await.unwrap();
        let keys: Vec<u64> = got.iter().map(|d| d.id.key()).collect();
        t.ack_local(&keys[..2]).unwrap();
        assert_eq!((t.message_count().await.unwrap(), t.acknowledged()), (1, 2));
        assert!(matches!(
            t.ack_local(&[keys[0]]),
            Err(TransportError::NotFound(id)) if id == keys[0].to_string()
        ));
        t.ack(&got[2].id.to_string().into()).await.unwrap();
        assert_eq!(t.message_count().await.unwrap(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_send_without_a_waiting_consumer_leaves_no_stale_wake_up() {
        let t = std::sync::Arc::new(InMemoryTransport::new());
        t.send(raw(1), None).await.unwrap();
        t.get(1).await.unwrap();
        // Nobody waited during the send, so nothing wakes this wait early.
        let waited = tokio::time::timeout(
            Duration::from_millis(50),
            t.wait_for_messages(Duration::from_secs(60)),
        )
        .await;
        assert!(waited.is_err());
    }

    /// Sends `envelope`, which the in-memory transport stores at once.
    fn send_now(t: &InMemoryTransport, envelope: Envelope) {
        let LocalFuture::Ready(Some(Ok(_))) = t.send_envelope(envelope) else {
            panic!("the in-memory transport stores a message at once");
        };
    }

    #[test]
    fn sends_from_many_threads_are_all_counted_and_handed_out_once_each_batch_in_id_order() {
        let t = std::sync::Arc::new(InMemoryTransport::new());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        send_now(&t, Envelope::new(Ping));
                    }
                })
            })
            .collect();
        // Batches taken while the senders run come out in id order too.
        let mut keys = Vec::new();
        while keys.len() < 2000 {
            let LocalFuture::Ready(Some(Ok(got))) = t.get_local(64) else {
                panic!("the in-memory transport answers at once");
            };
            let batch: Vec<u64> = got.iter().map(|d| d.id.key()).collect();
            assert!(batch.windows(2).all(|w| w[0] < w[1]), "{batch:?}");
            keys.extend(batch);
            if threads.iter().all(|h| h.is_finished()) && got.is_empty() {
                break;
            }
        }
        for h in threads {
            h.join().unwrap();
        }
        let LocalFuture::Ready(Some(Ok(rest))) = t.get_local(10_000) else {
            panic!("the in-memory transport answers at once");
        };
        keys.extend(rest.iter().map(|d| d.id.key()));
        assert_eq!(keys.len(), 2000, "every message, once");
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 2000, "no message twice");
        assert_eq!(t.lock().count(), 2000, "all leased until acknowledged");
        t.ack_local(&keys).unwrap();
        assert_eq!(t.lock().count(), 0);
    }

    #[test]
    fn a_message_sent_but_not_yet_taken_in_is_counted_listed_and_acknowledgeable() {
        let t = InMemoryTransport::new();
        send_now(&t, Envelope::new(Ping));
        send_now(&t, Envelope::new(Ping));
        assert_eq!(t.inbox.len(), 2, "both wait in the inbox");
        assert_eq!(t.stored().len(), 2);
        t.ack_local(&[1]).unwrap();
        assert_eq!(t.lock().count(), 1);
        assert_eq!(t.acknowledged(), 1);
    }
}
