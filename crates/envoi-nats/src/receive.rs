//! Receiving: `get` as pull requests on the durable consumer, the pull
//! request started ahead for the next `get`, delayed messages deferred
//! until due, and the stall guard.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::connection::State;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::AckKind;
use envoi_core::transport::{Delivery, DeliveryId, Receiver, WakeUp};
use envoi_core::{BoxFuture, TransportError};

use crate::fetch::{delivery_info, fetch_ahead, fetch_once, give_back, FetchEnd};
use crate::headers;
use crate::publish::{now_ms, sequence_id};
use crate::settle::{Lease, Seen};
use crate::transport::{backend, lock};
use crate::NatsTransport;

/// The longest a delayed message is deferred at a time.
const MAX_DEFER: Duration = Duration::from_secs(24 * 3600);
/// After this long without a single message, `get` checks the consumer.
const IDLE_CHECK: Duration = Duration::from_secs(5);
/// A `get` this large that comes back full starts the pull request for the
/// next one at once; smaller ones never do.
const READ_AHEAD_MIN: usize = 100;

impl NatsTransport {
    async fn get_now(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        self.check_open()?;
        if max == 0 {
            return Ok(Vec::new());
        }
        self.ensure_setup().await?;
        self.prune_leases();
        let consumer = self.bound_consumer().await?;
        let want = max.min(self.inner.config.batch);
        let mut out = Vec::new();
        // The next batch on its way: hand out what came, even if every
        // message in it was a deferred delayed one.
        let refilled = self.take_ahead(&consumer, want, &mut out).await;
        if !refilled && out.is_empty() {
            self.fetch_until_any(&consumer, want, &mut out).await?;
        }
        self.check_idle(!out.is_empty()).await;
        Ok(out)
    }

    /// Pull requests for up to `want` messages until one brings a message
    /// to hand out, or `wait` has passed.
    async fn fetch_until_any(
        &self,
        consumer: &Arc<PullConsumer>,
        want: usize,
        out: &mut Vec<Delivery>,
    ) -> Result<(), TransportError> {
        let deadline = Instant::now() + self.inner.config.wait;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let expires = remaining.max(Duration::from_millis(10));
            let started = Instant::now();
            // `out` is empty here: the loop ends once it holds anything.
            let (messages, end) = fetch_once(&self.inner.client, consumer, want, expires).await;
            let fetched = messages.len();
            // A full batch: the server is asked for the next one before this
            // one is decoded, so it never waits on the decoding.
            let refilled =
                matches!(end, FetchEnd::Done) && self.start_fetch_ahead(consumer, want, fetched);
            self.accept(messages, out).await;
            if !self.fetch_went_well(end, out.is_empty())? {
                return Ok(());
            }
            if refilled || !out.is_empty() || Instant::now() >= deadline {
                return Ok(());
            }
            if fetched == 0 && started.elapsed() < expires / 2 {
                // The server answered at once (e.g. other requests are
                // waiting for the few pending messages): do not spin.
                let pause = Duration::from_millis(20)
                    .min(deadline.saturating_duration_since(Instant::now()));
                tokio::time::sleep(pause).await;
            }
        }
    }

    /// What a pull request's `end` means for the `get` that made it:
    /// whether it may go on fetching, or the error to return when it has
    /// nothing to hand out (`empty`). A request that stalled or failed
    /// drops the consumer's binding.
    fn fetch_went_well(&self, end: FetchEnd, empty: bool) -> Result<bool, TransportError> {
        match end {
            FetchEnd::Done => Ok(true),
            FetchEnd::Stalled => {
                self.forget_consumer();
                if self.inner.client.connection_state() != State::Connected {
                    if empty {
                        return Err(backend(
                            "fetching messages",
                            "the connection to the server is down (reconnecting)",
                        ));
                    }
                } else {
                    tracing::warn!(
                        consumer = %self.consumer(),
                        "pull request got no answer; the consumer will be re-bound"
                    );
                }
                Ok(false)
            }
            FetchEnd::Failed(error) => {
                tracing::warn!(%error, "pull request failed; the consumer will be re-bound");
                self.forget_consumer();
                if empty {
                    return Err(error);
                }
                Ok(false)
            }
        }
    }

    /// Takes what the pull request started ahead brought into `out`: up to
    /// `want` of its messages, the rest given back, as are those fetched
    /// more than half a lease ago. When it came back full, the pull request
    /// for the next `get` goes out before its messages are decoded; returns
    /// whether it did.
    async fn take_ahead(
        &self,
        consumer: &Arc<PullConsumer>,
        want: usize,
        out: &mut Vec<Delivery>,
    ) -> bool {
        // Waits for a pull request in flight; a `get` dropped meanwhile
        // leaves it for the next one.
        let taken = match self.inner.read_ahead.take(usize::MAX).await {
            Ok(taken) => taken,
            Err(error) => {
                tracing::debug!(consumer = %self.consumer(), %error, "pull request fetching ahead failed; the consumer will be re-bound");
                self.forget_consumer();
                return false;
            }
        };
        give_back(&self.inner.client, taken.stale).await;
        let mut messages = taken.fresh;
        if messages.is_empty() {
            return false;
        }
        let refilled = self.start_fetch_ahead(consumer, want, messages.len());
        if messages.len() > want {
            let surplus = messages.split_off(want);
            give_back(&self.inner.client, surplus).await;
        }
        self.accept(messages, out).await;
        refilled
    }

    /// After a pull request for `want` messages (at least
    /// [`READ_AHEAD_MIN`]) that brought `got >= want`, starts the pull
    /// request for the next `get`. Returns whether it did (or one is on
    /// its way already).
    fn start_fetch_ahead(&self, consumer: &Arc<PullConsumer>, want: usize, got: usize) -> bool {
        if want < READ_AHEAD_MIN
            || got < want
            || lock(&self.inner.consumer).is_none()
            || self.inner.closed.load(Ordering::Relaxed)
        {
            return false;
        }
        self.inner.read_ahead.fetch_ahead(fetch_ahead(
            self.inner.client.clone(),
            Arc::clone(consumer),
            want,
            self.inner.config.wait,
        ));
        true
    }

    /// Sorts fetched messages: due ones are leased and returned, delayed
    /// ones are given back to JetStream until they are due. A message this
    /// handle holds or acknowledged, delivered again because the server
    /// lost track of it (a restart), is not handed out a second time (see
    /// [`Seen`]).
    async fn accept(&self, messages: Vec<async_nats::Message>, out: &mut Vec<Delivery>) {
        let mut fetched = Vec::with_capacity(messages.len());
        let mut acked_again = Vec::new();
        {
            let lease = self.inner.config.lease;
            let mut leases = lock(&self.inner.leases);
            for mut message in messages {
                let Some(reply) = message.reply.take() else {
                    tracing::warn!("message without a JetStream ack subject skipped");
                    continue;
                };
                let Some(info) = delivery_info(&reply) else {
                    tracing::warn!(%reply, "message without JetStream metadata skipped");
                    continue;
                };
                match leases.seen(&info, &reply, lease) {
                    Seen::New => fetched.push((message, reply, info)),
                    Seen::Held => tracing::debug!(
                        sequence = info.sequence,
                        "delivered again while this handle holds it; not handed out twice"
                    ),
                    Seen::Acked => {
                        tracing::debug!(
                            sequence = info.sequence,
                            "delivered again after this handle acknowledged it; acknowledged again"
                        );
                        acked_again.push(reply);
                    }
                }
            }
        }
        for reply in acked_again {
            if let Err(error) = self.inner.client.publish(reply, AckKind::Ack.into()).await {
                // It comes back, and is acknowledged again then.
                tracing::debug!(%error, "could not acknowledge a message delivered again");
            }
        }
        let now = now_ms();
        let touched = Instant::now();
        let mut leased = Vec::with_capacity(fetched.len());
        out.reserve(fetched.len());
        for (message, reply, info) in fetched {
            let (raw, due) = headers::decode_delivered(message.headers.as_ref(), &message.payload);
            if let Some(due) = due.filter(|due| *due > now) {
                self.defer(reply, info.sequence, due - now).await;
                continue;
            }
            tracing::trace!(
                sequence = info.sequence,
                delivered = info.delivered,
                "message handed out"
            );
            leased.push((
                info.sequence,
                Lease {
                    reply,
                    touched,
                    stored: info.stored,
                },
            ));
            let delivery = Delivery::new(sequence_id(info.sequence), raw);
            // Delivered before and not acknowledged (its lease ran out, its
            // consumer gave it back): marked, so a deduplicating handler
            // takes over the key a dead consumer claimed. Not a delayed
            // message: deferring it until it is due counts as a delivery
            // too, so its count cannot tell.
            out.push(if due.is_none() && info.delivered > 1 {
                delivery.mark_redelivered()
            } else {
                delivery
            });
        }
        if !leased.is_empty() {
            lock(&self.inner.leases).extend(leased);
        }
    }

    /// `-NAK {"delay": remaining_ms}` for a delayed message not due yet:
    /// JetStream delivers it again when it is.
    async fn defer(&self, reply: async_nats::Subject, sequence: u64, remaining_ms: u128) {
        // Capped so the nanosecond delay fits the server's int64; a message
        // due later is simply deferred again.
        let wait =
            Duration::from_millis(u64::try_from(remaining_ms).unwrap_or(u64::MAX)).min(MAX_DEFER);
        if let Err(error) = self
            .inner
            .client
            .publish(reply, AckKind::Nak(Some(wait)).into())
            .await
        {
            // The lease expires and JetStream hands it out again.
            tracing::warn!(%error, sequence, "could not defer a delayed message");
        }
    }

    /// Stall guard: after a long run of empty fetches, checks that the
    /// consumer still exists and is not sitting on messages it does not
    /// hand out; re-creates the binding if something is off.
    async fn check_idle(&self, got_messages: bool) {
        let due = {
            let mut idle = lock(&self.inner.idle_since);
            if got_messages {
                *idle = None;
                return;
            }
            let since = *idle.get_or_insert_with(Instant::now);
            let period = IDLE_CHECK.max(self.inner.config.wait * 4);
            if since.elapsed() >= period {
                *idle = Some(Instant::now());
                true
            } else {
                false
            }
        };
        if !due {
            return;
        }
        let info = match self.open_stream().await {
            Ok(stream) => stream.consumer_info(self.consumer()).await,
            Err(e) => {
                tracing::warn!(error = %e, "stall check could not open the stream");
                return;
            }
        };
        match info {
            Ok(info) if info.num_pending > 0 => {
                tracing::warn!(
                    consumer = %self.consumer(),
                    pending = info.num_pending,
                    "consumer has pending messages but fetches return none; re-binding"
                );
                self.forget_consumer();
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, consumer = %self.consumer(), "consumer check failed; re-binding");
                self.forget_consumer();
            }
        }
    }
}

impl Receiver for NatsTransport {
    /// One pull request for `min(max, batch)` messages, expiring after
    /// `wait` (or what the pull request started ahead brought).
    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            let result = self.get_now(max).await;
            self.inner
                .get_failed
                .store(result.is_err(), Ordering::Relaxed);
            result
        })
    }

    /// `+ACK`, returning once the server confirmed it; an id this handle
    /// did not hand out is deleted from the stream.
    fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.remove(id))
    }

    /// Every ack written out together, confirmed by one answer from the
    /// server (each confirmed with `double_ack`).
    fn ack_batch<'a>(&'a self, ids: &'a [DeliveryId]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.remove_all(ids))
    }

    /// `+ACK`, confirmed, as `ack`: on a work-queue stream the message is
    /// then gone for good and never handed out again.
    fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.remove(id))
    }

    /// `-NAK` without delay, confirmed: handed out again at once.
    fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.give_back_one(id))
    }
}

impl WakeUp for NatsTransport {
    /// Returns at once: an empty `get` has already waited on the server (up
    /// to `wait`) and returns as soon as a message comes, so sleeping here
    /// would only delay the next message. After a failed `get` (the server
    /// unreachable, say) it sleeps the whole `timeout`, so callers do not
    /// retry in a tight loop.
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        let failed = self.inner.get_failed.load(Ordering::Relaxed);
        Box::pin(async move {
            if failed {
                tokio::time::sleep(timeout).await;
            }
        })
    }
}
