//! Taking messages from the receivers: in priority order, in batches,
//! one batch asked for ahead.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::time::Instant;

use super::events::WorkerEvent;
use super::handle::Ctx;
use super::rate::{Bucket, RateLimit};
use crate::envelope::stamp::TransportMessageIdStamp;
use crate::envelope::Envelope;
use crate::error::TransportError;
use crate::transport::{DeliveryId, LocalId, Payload, Transport};
use crate::BoxFuture;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::time::Duration;

use super::acks::{send_acks, SentAcks};
use super::run::Run;
use super::settle::Done;

pub(super) struct Source {
    pub(super) name: Arc<str>,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) rate: Option<RateLimit>,
}

impl Source {
    /// Up to `max` messages.
    pub(super) async fn get(&self, max: usize) -> Result<Batch, TransportError> {
        Ok(match self.transport.as_local_receiver() {
            Some(local) => Batch::Local(local.get_local(max).await?),
            None => Batch::Remote(self.receiver()?.get(max).await?),
        })
    }

    /// The transport's receiving side (a worker only consumes transports
    /// that have one).
    pub(super) fn receiver(&self) -> Result<&dyn crate::transport::Receiver, TransportError> {
        receiving(&self.transport)
    }
}

/// The receiving side of `transport`, or why there is none.
pub(super) fn receiving(
    transport: &Arc<dyn Transport>,
) -> Result<&dyn crate::transport::Receiver, TransportError> {
    transport
        .as_receiver()
        .ok_or(TransportError::Unsupported("receiving messages"))
}

/// Messages as a receiver's transport handed them out.
pub(super) enum Batch {
    Local(Vec<crate::transport::LocalDelivery>),
    Remote(Vec<crate::transport::Delivery>),
}

impl Batch {
    pub(super) fn len(&self) -> usize {
        match self {
            Batch::Local(got) => got.len(),
            Batch::Remote(got) => got.len(),
        }
    }

    /// Adds the messages to `buffer`, held by receiver number `receiver`
    /// from now.
    pub(super) fn hold(self, receiver: usize, buffer: &mut VecDeque<Held>) {
        let since = Instant::now();
        match self {
            Batch::Local(got) => buffer.extend(got.into_iter().map(|d| Held {
                receiver,
                id: MessageId::Local(d.id),
                payload: d.payload,
                redelivered: d.redelivered,
                since,
            })),
            Batch::Remote(got) => buffer.extend(got.into_iter().map(|d| Held {
                receiver,
                id: MessageId::Remote(d.id),
                payload: Payload::Raw(d.raw),
                redelivered: d.redelivered,
                since,
            })),
        }
    }
}

/// The id of a held message.
#[derive(Clone)]
pub(super) enum MessageId {
    /// From an in-process transport: a number.
    Local(LocalId),
    /// From any other transport.
    Remote(DeliveryId),
}

impl MessageId {
    pub(super) fn text(&self) -> Cow<'_, str> {
        match self {
            MessageId::Local(id) => Cow::Owned(id.to_string()),
            MessageId::Remote(id) => Cow::Borrowed(id.as_str()),
        }
    }

    /// The id the transport's [`Receiver`](crate::transport::Receiver)
    /// takes.
    pub(super) fn delivery_id(&self) -> Cow<'_, DeliveryId> {
        match self {
            MessageId::Local(id) => Cow::Owned(DeliveryId::from(id.to_string())),
            MessageId::Remote(id) => Cow::Borrowed(id),
        }
    }

    /// `envelope` with the [`TransportMessageIdStamp`] of this id.
    pub(super) fn stamp(&self, envelope: Envelope) -> Envelope {
        match self {
            MessageId::Local(id) => envelope.with_local_id(*id),
            MessageId::Remote(id) => {
                envelope.with(TransportMessageIdStamp::new(id.as_str().to_owned()))
            }
        }
    }
}

/// A message fetched and not started yet.
pub(super) struct Held {
    pub(super) receiver: usize,
    pub(super) id: MessageId,
    pub(super) payload: Payload,
    /// The transport handed it out before (see
    /// [`Delivery::redelivered`](crate::transport::Delivery::redelivered)).
    pub(super) redelivered: bool,
    pub(super) since: Instant,
}

/// A batch asked for ahead of time, or a `get` still out when the worker
/// had to stop (always of a transport that is not an in-process one).
pub(super) struct Ahead<'a> {
    /// The receiver asked.
    pub(super) receiver: usize,
    /// How many messages were asked for.
    pub(super) want: usize,
    pub(super) get: BoxFuture<'a, Result<Vec<crate::transport::Delivery>, TransportError>>,
}

/// Polls the batch asked for ahead of time, if any; once it arrives, its
/// messages join the buffer (where keepalives and a stop see them) and
/// take their receiver's rate-limit tokens.
pub(super) fn poll_ahead(
    ahead: &mut Option<Ahead<'_>>,
    buffer: &mut VecDeque<Held>,
    buckets: &mut [Option<Bucket>],
    ctx: &Ctx,
    cx: &mut Context<'_>,
) -> Poll<()> {
    let Some(a) = ahead else {
        return Poll::Pending;
    };
    let Poll::Ready(got) = a.get.as_mut().poll(cx) else {
        return Poll::Pending;
    };
    let receiver = a.receiver;
    *ahead = None;
    match got {
        Ok(got) => {
            if let Some(bucket) = &mut buckets[receiver] {
                bucket.take(got.len(), Instant::now());
            }
            Batch::Remote(got).hold(receiver, buffer);
        }
        Err(e) => ctx.events.emit(|| WorkerEvent::TransportFailed {
            transport: ctx.receivers[receiver].name.clone(),
            operation: "get",
            error: e.to_string(),
        }),
    }
    Poll::Ready(())
}

impl<'a, F: Future<Output = Done> + 'a> Run<'a, F> {
    /// Asks the receivers, in priority order, for a batch while the
    /// pending acknowledgements are sent (a broker round trip each, and a
    /// transport that groups writes commits them together); keeps the
    /// messages in flight going meanwhile. Returns how many arrived, and the
    /// shortest wait for a rate-limited receiver's next token. The
    /// acknowledgements have been sent when it returns.
    pub(super) async fn fetch(&mut self, budget: u64) -> (usize, Option<Duration>) {
        let ctx = self.ctx;
        let pending = self.pending_acks() > 0;
        let acks = if pending {
            self.take_acks()
        } else {
            Vec::new()
        };
        let acking = send_acks(ctx, acks);
        tokio::pin!(acking);
        // `Some` once the acknowledgements are sent.
        let mut sent: Option<SentAcks> = None;
        let fetched = if let Some(asked) = self.ahead.as_ref().map(|a| a.receiver) {
            // Asked for already: wait for it, unless the worker must stop
            // first (then a stop gives it back when it arrives).
            let must_stop = self.must_stop();
            tokio::pin!(must_stop);
            let arrived = loop {
                tokio::select! {
                    biased;
                    _ = poll_fn(|cx| poll_ahead(&mut self.ahead, &mut self.buffer, &mut self.buckets, ctx, cx)) => {
                        break true;
                    }
                    () = &mut must_stop => break false,
                    done = acking.as_mut(), if pending && sent.is_none() => sent = Some(done),
                    finished = self.in_flight.next(), if !self.in_flight.is_empty() => {
                        self.record(finished);
                    }
                    _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
                }
                // What finished meanwhile is settled now, not when the
                // batch arrives (a long poll may outlast its leases).
                if (!pending || sent.is_some()) && self.has_outcomes() {
                    break false;
                }
            };
            if arrived && self.buffer.is_empty() {
                // It brought nothing: the round goes on with the receivers
                // after the one asked, as if its `get` had been awaited in
                // line (a `get` settled early is often a receiver's).
                let budget = self.budget();
                self.fetch_batch(budget, asked + 1, &mut acking, &mut sent, pending)
                    .await
            } else {
                (self.buffer.len(), None)
            }
        } else {
            self.fetch_batch(budget, 0, &mut acking, &mut sent, pending)
                .await
        };
        if fetched.0 > 0 {
            self.ask_ahead();
        }
        if pending {
            let sent = match sent {
                Some(sent) => sent,
                None => loop {
                    tokio::select! {
                        biased;
                        sent = &mut acking => break sent,
                        finished = self.in_flight.next(), if !self.in_flight.is_empty() => {
                            self.record(finished);
                        }
                    }
                },
            };
            self.acks_sent(sent);
        }
        fetched
    }

    /// Asks the receivers from number `from` on, in priority order, for a
    /// batch; see [`fetch`](Self::fetch).
    pub(super) async fn fetch_batch<A>(
        &mut self,
        budget: u64,
        from: usize,
        acking: &mut Pin<&mut A>,
        sent: &mut Option<SentAcks>,
        pending: bool,
    ) -> (usize, Option<Duration>)
    where
        A: Future<Output = SentAcks>,
    {
        let mut wait: Option<Duration> = None;
        for receiver in from..self.ctx.receivers.len() {
            let Some(want) = self.wanted(receiver, budget, &mut wait) else {
                continue;
            };
            if want == 0 {
                break;
            }
            let got = if self.ctx.receivers[receiver]
                .transport
                .as_local_receiver()
                .is_none()
            {
                match self.get_remote(receiver, want, acking, sent, pending).await {
                    Some(got) => got.map(Batch::Remote),
                    // The `get` goes on as the batch asked for ahead.
                    None => return (0, wait),
                }
            } else {
                self.get_local(receiver, want, acking, sent, pending).await
            };
            match got {
                Ok(batch) if batch.len() > 0 => {
                    if let Some(bucket) = &mut self.buckets[receiver] {
                        bucket.take(batch.len(), Instant::now());
                    }
                    let n = batch.len();
                    batch.hold(receiver, &mut self.buffer);
                    return (n, wait);
                }
                Ok(_) => {}
                Err(e) => self.transport_failed(receiver, "get", &e),
            }
        }
        (0, wait)
    }

    /// How many messages to ask `receiver` for within `budget` and its rate
    /// limit; `None` to skip it for now (paused after a failed park, or out
    /// of tokens: `wait` then holds the soonest next token).
    fn wanted(
        &mut self,
        receiver: usize,
        budget: u64,
        wait: &mut Option<Duration>,
    ) -> Option<usize> {
        // Paused after one of its messages could not be parked: the
        // receivers after it are read meanwhile.
        if self.fetch_after[receiver].is_some() {
            if self.paused(receiver, Instant::now()).is_some() {
                return None;
            }
            self.fetch_after[receiver] = None;
        }
        let mut want = self
            .options
            .batch_size
            .min(budget.min(usize::MAX as u64) as usize);
        if let Some(bucket) = &mut self.buckets[receiver] {
            let tokens = bucket.available(Instant::now());
            if tokens == 0 {
                let w = bucket.wait();
                *wait = Some(wait.map_or(w, |x: Duration| x.min(w)));
                return None;
            }
            want = want.min(tokens);
        }
        Some(want)
    }

    /// Asks a broker's `receiver` for `want` messages, going on with the
    /// acknowledgements, the messages in flight and their leases meanwhile.
    /// A `get` may wait long for a message (a long poll): it must not hold
    /// up a stop, the time limit, or what finished meanwhile; then it goes
    /// on as the batch asked for ahead (a stop gives back what it brings)
    /// and this returns `None`.
    async fn get_remote<A>(
        &mut self,
        receiver: usize,
        want: usize,
        acking: &mut Pin<&mut A>,
        sent: &mut Option<SentAcks>,
        pending: bool,
    ) -> Option<Result<Vec<crate::transport::Delivery>, TransportError>>
    where
        A: Future<Output = SentAcks>,
    {
        let ctx = self.ctx;
        let mut get = match ctx.receivers[receiver].receiver() {
            Ok(r) => r.get(want),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        };
        let must_stop = self.must_stop();
        tokio::pin!(must_stop);
        let got = loop {
            tokio::select! {
                biased;
                got = get.as_mut() => break Some(got),
                done = acking.as_mut(), if pending && sent.is_none() => *sent = Some(done),
                finished = self.in_flight.next(), if !self.in_flight.is_empty() => {
                    self.record(finished);
                }
                // A long poll must not let the leases of what is in flight
                // run out.
                _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
                () = &mut must_stop => break None,
            }
            // What finished meanwhile is settled now, not when the poll
            // ends (it may outlast their leases).
            if (!pending || sent.is_some()) && self.has_outcomes() {
                break None;
            }
        };
        if got.is_none() {
            self.ahead = Some(Ahead {
                receiver,
                want,
                get,
            });
        }
        got
    }

    /// Asks an in-process `receiver` for `want` messages, going on with the
    /// acknowledgements and the messages in flight meanwhile.
    async fn get_local<A>(
        &mut self,
        receiver: usize,
        want: usize,
        acking: &mut Pin<&mut A>,
        sent: &mut Option<SentAcks>,
        pending: bool,
    ) -> Result<Batch, TransportError>
    where
        A: Future<Output = SentAcks>,
    {
        let ctx = self.ctx;
        let get = ctx.receivers[receiver].get(want);
        tokio::pin!(get);
        loop {
            tokio::select! {
                biased;
                got = &mut get => break got,
                done = acking.as_mut(), if pending && sent.is_none() => *sent = Some(done),
                finished = self.in_flight.next(), if !self.in_flight.is_empty() => {
                    self.record(finished);
                }
            }
        }
    }

    /// How many more messages may be asked for within the message limit:
    /// those handled, in flight, fetched and asked for ahead count.
    pub(super) fn budget(&self) -> u64 {
        let asked = self.ahead.as_ref().map_or(0, |a| a.want) as u64;
        self.options.message_limit.map_or(u64::MAX, |n| {
            n.saturating_sub(
                self.processed + self.in_flight.len() as u64 + self.buffer.len() as u64 + asked,
            )
        })
    }

    /// Resolves once the worker must stop: asked to, or out of time.
    pub(super) fn must_stop(&self) -> impl Future<Output = ()> + 'static {
        let stop = self.stop.clone();
        let deadline = self.options.time_limit.map(|t| self.started + t);
        async move {
            let out_of_time = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stop.stopped() => {}
                () = out_of_time => {}
            }
        }
    }

    /// Asks for the next batch now, so it arrives while the current one is
    /// handled: with one receiver only (several must be read in priority
    /// order after each batch), a transport with round trips (not an
    /// in-process one) and no rate limit, within the message limit.
    pub(super) fn ask_ahead(&mut self) {
        let ctx = self.ctx;
        let budget = self.options.message_limit.map_or(u64::MAX, |n| {
            n.saturating_sub(
                self.processed + self.in_flight.len() as u64 + self.buffer.len() as u64,
            )
        });
        let want = self
            .options
            .batch_size
            .min(budget.min(usize::MAX as u64) as usize);
        if want == 0
            || self.ahead.is_some()
            || ctx.receivers.len() != 1
            || self.buckets[0].is_some()
            || ctx.receivers[0].transport.as_local_receiver().is_some()
            || self.stop.is_stopped()
        {
            return;
        }
        let Ok(receiver) = ctx.receivers[0].receiver() else {
            return;
        };
        self.ahead = Some(Ahead {
            receiver: 0,
            want,
            get: receiver.get(want),
        });
    }

    /// Whether every receiver is empty (a receiver that cannot count is
    /// taken as empty once `get` returned nothing).
    pub(super) async fn all_empty(&mut self) -> bool {
        for (i, r) in self.ctx.receivers.iter().enumerate() {
            // A receiver that cannot count is taken as empty once `get`
            // returned nothing.
            let Some(counter) = r.transport.as_message_count() else {
                continue;
            };
            match counter.message_count().await {
                // What this run parked back into the transport waits there
                // for later; it is not work left to do now.
                Ok(n) if n <= self.again[i].len() as u64 => {}
                Ok(_) => return false,
                Err(e) => {
                    self.transport_failed(i, "count", &e);
                    return false;
                }
            }
        }
        true
    }
}
