//! Consuming: one `basic.consume` per connection, started by the first
//! fetch, whose deliveries wait in a buffer ([`ConsumeState`]) until `get`
//! hands them out; and `wait_for_messages`, which waits for one.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use envoi_core::transport::{Delivery, DeliveryId, RawMessage};
use envoi_core::TransportError;
use futures_util::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Consumer};
use tokio::task::JoinHandle;

use crate::headers;
use crate::link::Link;
use crate::settle::delivery_id;
use crate::shared::{backend, lock, short, Shared};

/// How long `get` waits for a first message when none is buffered.
const GET_WAIT: Duration = Duration::from_millis(200);

/// What the consumer side holds, all for the link of generation `epoch`.
#[derive(Default)]
pub(crate) struct ConsumeState {
    pub(crate) epoch: u64,
    /// Generation of the running `basic.consume`, if one runs.
    pub(crate) active: Option<u64>,
    /// Its consumer tag.
    pub(crate) tag: Option<ShortString>,
    next_generation: u64,
    /// The running `basic.consume` (of generation `active`). Fetches poll
    /// it themselves, so a delivery goes from the connection's I/O thread
    /// to the fetching task without a hop through another task.
    pub(crate) consumer: Option<Consumer>,
    /// Delivered by the broker, not yet handed out (unsettled on the channel).
    pub(crate) buffer: VecDeque<lapin::message::Delivery>,
    /// Handed out, unsettled: delivery tag → its lease.
    pub(crate) leased: BTreeMap<u64, Lease>,
    /// Taken out of `buffer` or `leased`, their settlement being sent.
    pub(crate) settling: BTreeSet<u64>,
    /// Every delivery tag up to this one has been taken from a consumer.
    /// (The broker numbers the deliveries of a channel 1, 2, 3, …)
    seen_upto: u64,
    /// Tags beyond `seen_upto + 1` taken from a consumer first.
    seen_ahead: BTreeSet<u64>,
    /// When a fetch last asked for messages.
    pub(crate) last_get: Option<Instant>,
    /// Tasks giving back what a cancelled consumer still delivers.
    pub(crate) give_backs: Vec<JoinHandle<()>>,
}

impl ConsumeState {
    /// Records that delivery `tag` was taken from a consumer.
    pub(crate) fn seen(&mut self, tag: u64) {
        if tag == self.seen_upto + 1 {
            self.seen_upto = tag;
            while self.seen_ahead.remove(&(self.seen_upto + 1)) {
                self.seen_upto += 1;
            }
        } else if tag > self.seen_upto {
            self.seen_ahead.insert(tag);
        }
    }

    /// The lowest delivery tag that may be unsettled on the channel: every
    /// tag below it is settled, or being settled by the caller. One
    /// `basic.ack` with `multiple` can therefore settle the caller's tags
    /// below it without touching anyone else's.
    pub(crate) fn floor(&self) -> u64 {
        let mut floor = self.seen_upto + 1;
        if let Some(&tag) = self.seen_ahead.first() {
            floor = floor.min(tag);
        }
        if let Some(tag) = self.buffer.iter().map(|d| d.delivery_tag).min() {
            floor = floor.min(tag);
        }
        if let Some((&tag, _)) = self.leased.first_key_value() {
            floor = floor.min(tag);
        }
        if let Some(&tag) = self.settling.first() {
            floor = floor.min(tag);
        }
        floor
    }

    /// Whether a consumer runs on link `epoch`.
    pub(crate) fn consuming(&self, epoch: u64) -> bool {
        self.epoch == epoch && self.active.is_some()
    }

    /// Moves what the running consumer has delivered into `buffer`. When
    /// nothing is left, `waker` is registered to be woken by the next
    /// delivery. A consumer that ended (cancelled by the broker, connection
    /// lost) is forgotten, so the next fetch starts another.
    pub(crate) fn drain(&mut self, waker: &Waker, name: &str) {
        let Some(mut consumer) = self.consumer.take() else {
            return;
        };
        let mut cx = Context::from_waker(waker);
        loop {
            match consumer.poll_next_unpin(&mut cx) {
                Poll::Ready(Some(Ok(delivery))) => {
                    self.seen(delivery.delivery_tag);
                    self.buffer.push_back(delivery);
                }
                Poll::Ready(Some(Err(error))) => {
                    tracing::debug!(transport = %name, %error, "AMQP consumer stopped");
                    break;
                }
                Poll::Ready(None) => break,
                Poll::Pending => {
                    self.consumer = Some(consumer);
                    return;
                }
            }
        }
        self.active = None;
        self.tag = None;
    }

    /// Forgets `tags` as being settled, if they are of link `epoch`.
    pub(crate) fn settled(&mut self, epoch: u64, tags: &[u64]) {
        if self.epoch == epoch {
            for tag in tags {
                self.settling.remove(tag);
            }
        }
    }

    /// Takes every message held, buffered or leased, marking them as being
    /// settled; returns their tags.
    pub(crate) fn take_held(&mut self) -> Vec<u64> {
        let mut tags: Vec<u64> = self.buffer.drain(..).map(|d| d.delivery_tag).collect();
        tags.extend(std::mem::take(&mut self.leased).into_keys());
        self.settling.extend(tags.iter().copied());
        tags
    }

    /// Hands out the buffered deliveries `tags` to the caller (which
    /// settles them at once), leased until `lease_end` like any other.
    pub(crate) fn lease_buffered(&mut self, tags: &[u64], lease_end: Instant) {
        let mut kept = VecDeque::with_capacity(self.buffer.len());
        for d in self.buffer.drain(..) {
            if tags.contains(&d.delivery_tag) {
                let lease = Lease {
                    deadline: lease_end,
                    properties: d.properties,
                    body: d.data,
                };
                self.leased.insert(d.delivery_tag, lease);
            } else {
                kept.push_back(d);
            }
        }
        self.buffer = kept;
    }

    /// Starts over for the new link `epoch`: everything of the previous
    /// one is void (the broker put its unsettled deliveries back).
    pub(crate) fn reset(&mut self, epoch: u64) {
        for task in self.give_backs.drain(..) {
            task.abort();
        }
        self.epoch = epoch;
        self.active = None;
        self.tag = None;
        self.consumer = None;
        self.buffer.clear();
        self.leased.clear();
        self.settling.clear();
        self.seen_upto = 0;
        self.seen_ahead.clear();
    }

    /// Stops consuming, for a handle being closed: returns the consumer's
    /// tag, the give-back tasks and the consumer itself.
    pub(crate) fn stop(&mut self) -> (Option<ShortString>, Vec<JoinHandle<()>>, Option<Consumer>) {
        self.active = None;
        self.buffer.clear();
        (
            self.tag.take(),
            std::mem::take(&mut self.give_backs),
            self.consumer.take(),
        )
    }

    /// Hands out up to `max` buffered deliveries of link `epoch`, each
    /// leased until `lease_end`.
    fn hand_out(&mut self, epoch: u64, max: usize, lease_end: Instant) -> Vec<Delivery> {
        let mut out = Vec::new();
        while out.len() < max {
            let Some(d) = self.buffer.pop_front() else {
                break;
            };
            let headers = headers::decode(d.properties.headers().as_ref());
            let lease = Lease {
                deadline: lease_end,
                properties: d.properties,
                body: d.data.clone(),
            };
            self.leased.insert(d.delivery_tag, lease);
            out.push(Delivery {
                id: DeliveryId::from(delivery_id(epoch, d.delivery_tag)),
                raw: RawMessage {
                    headers,
                    body: d.data,
                },
                // Handed out before and not acknowledged (a consumer's
                // connection closed, or it gave it back): the broker says so.
                redelivered: d.redelivered,
            });
        }
        out
    }
}

/// A message handed out and not settled yet.
pub(crate) struct Lease {
    /// When it is given back unless settled or kept alive.
    pub(crate) deadline: Instant,
    /// Its properties (message id, headers) and a copy of its body: a
    /// listing shows the messages the handle holds, which the broker no
    /// longer hands to anyone.
    pub(crate) properties: BasicProperties,
    pub(crate) body: Vec<u8>,
}

impl Lease {
    /// A lease until `deadline` of a message with no properties and no
    /// body (for tests of the bookkeeping).
    #[cfg(test)]
    pub(crate) fn until(deadline: Instant) -> Self {
        Self {
            deadline,
            properties: BasicProperties::default(),
            body: Vec::new(),
        }
    }
}

/// Wakes every task waiting for a delivery.
pub(crate) struct ArrivalWaker(pub(crate) Arc<tokio::sync::Notify>);

impl Wake for ArrivalWaker {
    fn wake(self: Arc<Self>) {
        self.0.notify_waiters();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.notify_waiters();
    }
}

impl Shared {
    /// Starts `basic.consume` on `link` unless a consumer already runs.
    async fn ensure_consuming(self: &Arc<Self>, link: &Arc<Link>) -> Result<(), TransportError> {
        if lock(&self.consume).consuming(link.epoch) {
            return Ok(());
        }
        // In a task of its own: a caller dropped while `basic.consume` is on
        // its way (a `get` or `wait_for_messages` given up) must not leave a
        // consumer the broker starts and nobody polls, holding up to
        // `prefetch` messages until the connection closes. The task finishes
        // starting it, and the next fetch uses it.
        let (shared, link) = (Arc::clone(self), Arc::clone(link));
        let starting = tokio::spawn(async move { shared.start_consuming(&link).await });
        match starting.await {
            Ok(started) => started,
            Err(e) => Err(backend(
                format!("consuming queue `{}`", self.names.queue),
                e,
            )),
        }
    }

    /// The slow path of [`Shared::ensure_consuming`].
    async fn start_consuming(self: &Arc<Self>, link: &Arc<Link>) -> Result<(), TransportError> {
        let _switch = self.consume_switch.lock().await;
        let generation = {
            let mut state = lock(&self.consume);
            if state.consuming(link.epoch) || state.epoch != link.epoch {
                // Running already, or the link was replaced meanwhile (the
                // caller retries).
                return Ok(());
            }
            state.next_generation += 1;
            state.next_generation
        };
        let tag = format!("envoi-{}-{}-{generation}", self.handle_id, link.epoch);
        let consumer = link
            .consumer
            .basic_consume(
                short(&self.names.queue)?,
                short(&tag)?,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await;
        let consumer = match consumer {
            Ok(consumer) => consumer,
            Err(e) => {
                if !link.healthy() {
                    self.invalidate(link);
                }
                return Err(backend(
                    format!("consuming queue `{}`", self.names.queue),
                    e,
                ));
            }
        };
        let mut state = lock(&self.consume);
        if state.epoch != link.epoch {
            return Ok(()); // dropped with the old link
        }
        state.active = Some(generation);
        state.tag = Some(short(&tag)?);
        state.consumer = Some(consumer);
        state.last_get = Some(Instant::now());
        Ok(())
    }

    /// Hands out up to `max` messages, waiting up to [`GET_WAIT`] for a
    /// first one.
    pub(crate) async fn get(self: &Arc<Self>, max: usize) -> Result<Vec<Delivery>, TransportError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let deadline = Instant::now() + GET_WAIT;
        loop {
            let link = self.link().await?;
            self.ensure_consuming(&link).await?;
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let (out, running) = {
                let mut state = lock(&self.consume);
                let now = Instant::now();
                state.last_get = Some(now);
                let mut out = Vec::new();
                if state.epoch == link.epoch {
                    state.drain(&self.on_arrival, &self.name);
                    let lease_end = now + self.config.lease.unwrap_or(Duration::MAX / 4);
                    out = state.hand_out(link.epoch, max, lease_end);
                }
                (out, state.consuming(link.epoch))
            };
            let now = Instant::now();
            if !out.is_empty() || now >= deadline {
                return Ok(out);
            }
            if !running {
                // The consumer stopped (connection lost, queue deleted, idle
                // cancel racing us): start again after a short pause.
                tokio::time::sleep(Duration::from_millis(20).min(deadline - now)).await;
                continue;
            }
            if tokio::time::timeout(deadline - now, arrived).await.is_err() {
                return Ok(Vec::new());
            }
        }
    }

    /// Resolves when a delivery is buffered (or the consumer stopped), or
    /// after `timeout`. Waiting counts as activity: it keeps the consumer.
    pub(crate) async fn wait_for_messages(self: &Arc<Self>, timeout: Duration) {
        let wait = async {
            let ready = match self.link().await {
                Ok(link) => self.ensure_consuming(&link).await.map(|()| link),
                Err(e) => Err(e),
            };
            let Ok(link) = ready else {
                // Do not spin while the broker is away.
                std::future::pending::<()>().await;
                return;
            };
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            {
                let mut state = lock(&self.consume);
                state.last_get = Some(Instant::now());
                if state.epoch == link.epoch {
                    state.drain(&self.on_arrival, &self.name);
                }
                if state.epoch != link.epoch || !state.buffer.is_empty() || state.active.is_none() {
                    return;
                }
            }
            arrived.await;
        };
        let _ = tokio::time::timeout(timeout, wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_is_the_lowest_tag_that_may_be_unsettled() {
        let mut state = ConsumeState::default();
        assert_eq!(state.floor(), 1);
        for tag in [1, 2, 4, 5] {
            state.seen(tag);
        }
        // Tag 3 has not been taken from a consumer: it may be unsettled.
        assert_eq!(state.seen_upto, 2);
        assert_eq!(state.floor(), 3);
        state.seen(3);
        assert_eq!(state.seen_upto, 5);
        assert!(state.seen_ahead.is_empty());
        assert_eq!(state.floor(), 6);
        state.leased.insert(4, Lease::until(Instant::now()));
        assert_eq!(state.floor(), 4);
        state.settling.insert(2);
        assert_eq!(state.floor(), 2);
        state.settled(state.epoch, &[2]);
        assert_eq!(state.floor(), 4);
        // Settlements of another link's tags change nothing.
        state.settling.insert(2);
        state.settled(state.epoch + 1, &[2]);
        assert_eq!(state.floor(), 2);
    }

    #[test]
    fn taking_what_is_held_marks_it_as_being_settled() {
        let mut state = ConsumeState::default();
        for tag in [1, 2, 3] {
            state.seen(tag);
        }
        state.leased.insert(2, Lease::until(Instant::now()));
        state.leased.insert(3, Lease::until(Instant::now()));
        let mut tags = state.take_held();
        tags.sort_unstable();
        assert_eq!(tags, [2, 3]);
        assert!(state.leased.is_empty());
        assert_eq!(state.floor(), 2);
        state.settled(state.epoch, &tags);
        assert_eq!(state.floor(), 4);
    }
}
