//! Listing and finding stored messages without taking them ([`Browse`]),
//! and removing one by the id a listing shows it with.
//!
//! AMQP cannot read a queue without taking messages out of it. A *browse*
//! takes them with a consumer of its own, on a channel of its own, never
//! acknowledges them, and closes the channel: the broker puts back
//! everything the channel held. What makes that safe:
//!
//! * **Nothing is lost.** A message a browse took is acknowledged only
//!   when it is the one being removed, or once a copy of it is confirmed
//!   (see the delivery limit below). Anything else, an error or a dropped
//!   call included, closes the channel and the broker puts it back.
//! * **Nothing moves.** A classic queue puts a message back where it was.
//!   A quorum queue puts back what one consumer held in the order it was
//!   delivered, ahead of the messages never delivered but behind those put
//!   back earlier and not taken since; and RabbitMQ 3.x puts back what
//!   `basic.get` took in the text order of its internal tags (1, 10, 11,
//!   2, …). So a browse consumes (it never uses `basic.get`) and, on a
//!   quorum queue, takes every ready message, whatever it looks for: what
//!   it puts back is then the whole queue, in its order. It also waits,
//!   after closing its channel, until the broker counts the messages as
//!   ready again, so that the next browse does not start on a queue whose
//!   head is still on its way back. Browses of one handle run one at a
//!   time.
//! * **The delivery limit.** Before RabbitMQ 4.3 a quorum queue counts
//!   every message put back as a delivery, and dead-letters one put back
//!   more than `delivery_limit` times. When a browse holds a message whose
//!   count has reached the limit, it publishes a copy of every message it
//!   holds, in order and confirmed, and only then acknowledges them: they
//!   stay in the queue (with fresh counts), behind whatever was published
//!   meanwhile.

use std::collections::HashSet;
use std::hash::Hasher;
use std::time::{Duration, Instant};

use envoi_core::transport::{Browse, Delivery, DeliveryId, RawMessage};
use envoi_core::{BoxFuture, TransportError};
use futures_util::future::join_all;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};

use crate::config::QueueType;
use crate::headers;
use crate::link::{Link, SETTLE_GRACE};
use crate::settle::{parse_id, Settle};
use crate::shared::{backend, lock, short, Shared};
use crate::transport::AmqpTransport;

/// The most messages one browse takes: the largest prefetch count AMQP
/// can set.
pub(crate) const MOST: usize = u16::MAX as usize;
/// How long a browse waits for the next delivery before it asks the broker
/// whether any message is still ready.
const IDLE: Duration = Duration::from_millis(100);
/// The longest a browse takes messages for.
const TAKING: Duration = Duration::from_secs(30);
/// How long a browse waits, once its channel is closed, for the broker to
/// count what it put back as ready again.
const PUT_BACK: Duration = Duration::from_secs(2);
/// The headers in which a quorum queue tells how often it delivered a
/// message.
const COUNT_HEADERS: [&str; 2] = ["x-delivery-count", "x-acquired-count"];

/// The id a listing shows a message with: its AMQP `message-id` (what
/// `send` returned), or, for a message without one (or with one that reads
/// as a delivery id), `digest-` and a hash of its `message-id`, headers and
/// body.
pub(crate) fn listing_id(properties: &BasicProperties, body: &[u8]) -> String {
    let message_id = properties.message_id().as_ref().map(ShortString::as_str);
    match message_id {
        Some(id) if !id.is_empty() && parse_id(id).is_none() => id.to_string(),
        _ => {
            let mut hash = Fnv1a::default();
            hash.write(message_id.unwrap_or_default().as_bytes());
            for (name, value) in &headers::decode(properties.headers().as_ref()) {
                hash.write(&[0]);
                hash.write(name.as_bytes());
                hash.write(&[0]);
                hash.write(value.as_bytes());
            }
            hash.write(&[0]);
            hash.write(body);
            format!("digest-{:016x}", hash.finish())
        }
    }
}

/// The message with `properties` and `body` as a listing shows it.
pub(crate) fn listed(properties: &BasicProperties, body: Vec<u8>) -> Delivery {
    Delivery::new(
        listing_id(properties, &body),
        RawMessage {
            headers: headers::decode(properties.headers().as_ref()),
            body,
        },
    )
}

/// The 64-bit FNV-1a hash: stable across processes and builds, so that a
/// `digest-` id shown by one command finds the message in the next.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// What a browse is for.
enum Purpose<'a> {
    /// Showing up to this many messages.
    List(usize),
    /// Finding the message with this listed id.
    Find(&'a str),
    /// Settling the messages with these listed ids this way.
    Remove(&'a HashSet<&'a str>, Settle),
}

/// A message a browse took.
struct Taken {
    tag: u64,
    id: String,
    properties: BasicProperties,
    body: Vec<u8>,
}

impl Taken {
    fn new(delivery: lapin::message::Delivery) -> Self {
        Self {
            tag: delivery.delivery_tag,
            id: listing_id(&delivery.properties, &delivery.data),
            properties: delivery.properties,
            body: delivery.data,
        }
    }

    /// How often the queue says it delivered the message (0 when it does
    /// not say).
    fn deliveries(&self) -> u64 {
        let Some(table) = self.properties.headers() else {
            return 0;
        };
        COUNT_HEADERS
            .iter()
            .filter_map(|name| table.inner().get(*name))
            .filter_map(|value| match value {
                AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
                AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
                AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
                AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
                AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
                AMQPValue::LongUInt(n) => Some(u64::from(*n)),
                AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// The properties of a copy: the same, without the queue's delivery
    /// counts.
    fn copy_properties(&self) -> BasicProperties {
        let Some(table) = self.properties.headers() else {
            return self.properties.clone();
        };
        let mut headers = FieldTable::default();
        for (name, value) in table {
            if !COUNT_HEADERS.contains(&name.as_str()) {
                headers.insert(name.clone(), value.clone());
            }
        }
        self.properties.clone().with_headers(headers)
    }

    fn into_delivery(self) -> Delivery {
        listed(&self.properties, self.body)
    }
}

/// What a browse found, and what it must wait for once its channel is
/// closed.
#[derive(Default)]
struct Session {
    /// The messages it looked for: the first ones (a listing), the one
    /// with the id (a search), or those it settled (a removal).
    found: Vec<Taken>,
    /// How many it leaves for the broker to put back.
    put_back: u32,
    /// How many messages were ready just before the channel was closed.
    ready_before: u32,
}

impl Shared {
    /// Up to `limit` stored messages, oldest first: those this handle
    /// holds (prefetched or handed out), then the queue's.
    pub(crate) async fn list(&self, limit: usize) -> Result<Vec<Delivery>, TransportError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let link = self.link().await?;
        let mut out = self.held(&link);
        if out.len() < limit {
            let session = self
                .browse(&link, &Purpose::List(limit - out.len()))
                .await?;
            out.extend(session.into_iter().map(Taken::into_delivery));
        }
        out.truncate(limit);
        Ok(out)
    }

    /// The stored message a listing shows as `id`.
    pub(crate) async fn find(&self, id: &DeliveryId) -> Result<Option<Delivery>, TransportError> {
        let id = id.as_str();
        if id.is_empty() {
            return Ok(None);
        }
        let link = self.link().await?;
        if let Some(held) = self.held(&link).into_iter().find(|d| d.id.as_str() == id) {
            return Ok(Some(held));
        }
        let found = self.browse(&link, &Purpose::Find(id)).await?;
        Ok(found.into_iter().next().map(Taken::into_delivery))
    }

    /// Settles, as `how` says, the stored messages a listing shows as
    /// `ids`: through the delivery that handed it out when this handle
    /// holds one, by a browse otherwise. Fails with
    /// [`TransportError::NotFound`] for the first id no message has.
    pub(crate) async fn settle_listed(
        &self,
        ids: &[&DeliveryId],
        how: Settle,
    ) -> Result<(), TransportError> {
        let mut wanted: HashSet<&str> = ids
            .iter()
            .map(|id| id.as_str())
            .filter(|id| !id.is_empty())
            .collect();
        if !wanted.is_empty() {
            let link = self.link().await?;
            let held = self.held_deliveries(&link, &wanted);
            if !held.is_empty() {
                for (listed_id, _) in &held {
                    wanted.remove(listed_id.as_str());
                }
                let delivery_ids: Vec<DeliveryId> = held.into_iter().map(|(_, id)| id).collect();
                Box::pin(self.settle(&delivery_ids, how)).await?;
            }
            if !wanted.is_empty() {
                let settled = self.browse(&link, &Purpose::Remove(&wanted, how)).await?;
                for taken in &settled {
                    wanted.remove(taken.id.as_str());
                }
            }
        }
        match ids
            .iter()
            .find(|id| id.as_str().is_empty() || wanted.contains(id.as_str()))
        {
            Some(missing) => Err(TransportError::NotFound(missing.to_string())),
            None => Ok(()),
        }
    }

    /// What this handle holds (prefetched, or handed out and not settled),
    /// as a listing shows it, in the order the broker delivered it.
    fn held(&self, link: &Link) -> Vec<Delivery> {
        let mut state = lock(&self.consume);
        if state.epoch != link.epoch {
            return Vec::new();
        }
        state.drain(&self.on_arrival, &self.name);
        let mut held: Vec<(u64, Delivery)> = state
            .buffer
            .iter()
            .map(|d| (d.delivery_tag, listed(&d.properties, d.data.clone())))
            .chain(
                state
                    .leased
                    .iter()
                    .map(|(&tag, lease)| (tag, listed(&lease.properties, lease.body.clone()))),
            )
            .collect();
        held.sort_unstable_by_key(|(tag, _)| *tag);
        held.into_iter().map(|(_, d)| d).collect()
    }

    /// The messages among `wanted` this handle handed out and holds: their
    /// listed ids and the ids of the deliveries that handed them out.
    /// Those prefetched and not handed out yet are handed out for the
    /// purpose (leased), so that they are settled like the others.
    fn held_deliveries(&self, link: &Link, wanted: &HashSet<&str>) -> Vec<(String, DeliveryId)> {
        let mut state = lock(&self.consume);
        if state.epoch != link.epoch {
            return Vec::new();
        }
        state.drain(&self.on_arrival, &self.name);
        let buffered: Vec<u64> = state
            .buffer
            .iter()
            .filter(|d| wanted.contains(listing_id(&d.properties, &d.data).as_str()))
            .map(|d| d.delivery_tag)
            .collect();
        if !buffered.is_empty() {
            let lease_end = Instant::now() + self.config.lease.unwrap_or(Duration::MAX / 4);
            state.lease_buffered(&buffered, lease_end);
        }
        state
            .leased
            .iter()
            .filter_map(|(&tag, lease)| {
                let id = listing_id(&lease.properties, &lease.body);
                wanted.contains(id.as_str()).then(|| {
                    let delivery = crate::settle::delivery_id(link.epoch, tag);
                    (id, DeliveryId::from(delivery))
                })
            })
            .collect()
    }

    /// Runs one browse of the queue for `purpose`: takes messages on a
    /// channel of its own, settles what it must, closes the channel and
    /// waits for the broker to have put back the rest.
    async fn browse(
        &self,
        link: &Link,
        purpose: &Purpose<'_>,
    ) -> Result<Vec<Taken>, TransportError> {
        let _one_at_a_time = self.browsing.lock().await;
        let channel = link.side_channel().await?;
        let session = self.take_and_settle(link, &channel, purpose).await;
        let _ = channel.close(200, "browsed".into()).await;
        let session = session?;
        if session.put_back > 0 {
            self.await_put_back(link, session.ready_before + session.put_back)
                .await;
        }
        Ok(session.found)
    }

    /// The part of [`browse`](Self::browse) on its channel.
    async fn take_and_settle(
        &self,
        link: &Link,
        channel: &Channel,
        purpose: &Purpose<'_>,
    ) -> Result<Session, TransportError> {
        let queue = &self.names.queue;
        let failed = |e: lapin::Error| backend(format!("browsing queue `{queue}`"), e);
        let ready = ready_count(channel, queue).await?;
        let quorum = self.config.queue_type == QueueType::Quorum;
        // A quorum queue puts back in order only what is taken as a whole.
        let plan = match purpose {
            Purpose::List(n) if !quorum => (*n).min(ready as usize),
            _ => ready as usize,
        }
        .min(MOST);
        if plan == 0 {
            return Ok(Session::default());
        }
        channel
            .basic_qos(
                u16::try_from(plan).unwrap_or(u16::MAX),
                BasicQosOptions::default(),
            )
            .await
            .map_err(failed)?;
        let tag = short(&format!("envoi-browse-{}", self.handle_id))?;
        let mut consumer = channel
            .basic_consume(
                short(queue)?,
                tag.clone(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(failed)?;
        let mut taken: Vec<Taken> = Vec::new();
        let until = Instant::now() + TAKING;
        while taken.len() < plan && (quorum || !purpose.satisfied(&taken)) && Instant::now() < until
        {
            match tokio::time::timeout(IDLE, consumer.next()).await {
                Ok(Some(Ok(delivery))) => taken.push(Taken::new(delivery)),
                Ok(Some(Err(e))) => return Err(failed(e)),
                Ok(None) => break,
                Err(_) => {
                    if ready_count(channel, queue).await? == 0 {
                        break;
                    }
                }
            }
        }
        channel
            .basic_cancel(tag, BasicCancelOptions::default())
            .await
            .map_err(failed)?;
        if quorum {
            // What was on its way when the consumer was cancelled is held
            // too, and is looked at for its delivery count.
            while let Ok(Some(Ok(delivery))) = tokio::time::timeout(IDLE, consumer.next()).await {
                taken.push(Taken::new(delivery));
            }
        }
        self.settle_taken(link, channel, purpose, taken).await
    }

    /// Settles what a browse took as `purpose` says (and, on a quorum
    /// queue, whatever a put-back would dead-letter); returns what it
    /// found and what the broker will put back.
    async fn settle_taken(
        &self,
        link: &Link,
        channel: &Channel,
        purpose: &Purpose<'_>,
        taken: Vec<Taken>,
    ) -> Result<Session, TransportError> {
        let queue = &self.names.queue;
        let held = taken.len();
        let (found, rest): (Vec<Taken>, Vec<Taken>) = match purpose {
            Purpose::List(n) => {
                let mut taken = taken;
                let rest = taken.split_off((*n).min(taken.len()));
                (taken, rest)
            }
            Purpose::Find(id) => {
                let mut taken = taken;
                match taken.iter().position(|t| t.id == *id) {
                    Some(at) => {
                        let one = taken.remove(at);
                        (vec![one], taken)
                    }
                    None => (Vec::new(), taken),
                }
            }
            Purpose::Remove(ids, _) => {
                let mut seen = HashSet::new();
                taken
                    .into_iter()
                    .partition(|t| ids.contains(t.id.as_str()) && seen.insert(t.id.clone()))
            }
        };
        let mut settled = 0;
        if let Purpose::Remove(_, how) = purpose {
            let sent = join_all(found.iter().map(|t| how.send(channel, t.tag))).await;
            if let Some(e) = sent.into_iter().find_map(Result::err) {
                return Err(backend(format!("{} in queue `{queue}`", how.verb()), e));
            }
            settled += found.len();
        }
        let limit = u64::from(self.config.delivery_limit);
        let quorum = self.config.queue_type == QueueType::Quorum;
        if quorum && taken_spent(&found, &rest, purpose, limit) {
            settled += self.renew(link, channel, &found, &rest, purpose).await;
        }
        if settled > 0 && quorum {
            // Quorum queues apply settlements asynchronously: give them
            // time before the channel closes (see `SETTLE_GRACE`).
            tokio::time::sleep(SETTLE_GRACE).await;
        }
        let put_back = u32::try_from(held - settled).unwrap_or(u32::MAX);
        let ready_before = if put_back > 0 {
            ready_count(channel, queue).await?
        } else {
            0
        };
        Ok(Session {
            found,
            put_back,
            ready_before,
        })
    }

    /// Publishes a confirmed copy of every message a browse holds (all but
    /// those it removed), in order, then acknowledges the originals: they
    /// stay in the queue with fresh delivery counts. Returns how many were
    /// acknowledged; a message whose copy was not confirmed is left to be
    /// put back.
    async fn renew(
        &self,
        link: &Link,
        channel: &Channel,
        found: &[Taken],
        rest: &[Taken],
        purpose: &Purpose<'_>,
    ) -> usize {
        let removed = matches!(purpose, Purpose::Remove(..));
        let mut kept: Vec<&Taken> = rest.iter().collect();
        if !removed {
            kept.extend(found);
        }
        kept.sort_unstable_by_key(|t| t.tag);
        tracing::warn!(
            transport = %self.name,
            messages = kept.len(),
            "a browse would have pushed messages past the quorum queue's delivery limit; \
             publishing them again"
        );
        let Ok(queue) = short(&self.names.queue) else {
            return 0;
        };
        let mut confirms = Vec::with_capacity(kept.len());
        for t in &kept {
            let published = link
                .publisher
                .basic_publish(
                    ShortString::default(),
                    queue.clone(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &t.body,
                    t.copy_properties(),
                )
                .await;
            match published {
                Ok(confirm) => confirms.push((t.tag, confirm)),
                Err(_) => break,
            }
        }
        let mut renewed = Vec::with_capacity(confirms.len());
        for (tag, confirm) in confirms {
            if let Ok(Confirmation::Ack(None)) = confirm.await {
                renewed.push(tag);
            }
        }
        let acked = join_all(
            renewed
                .iter()
                .map(|&tag| channel.basic_ack(tag, BasicAckOptions::default())),
        )
        .await;
        acked.into_iter().filter(Result::is_ok).count()
    }

    /// Waits (up to [`PUT_BACK`]) until `ready` messages are ready in the
    /// queue: the broker has put back what a browse left.
    async fn await_put_back(&self, link: &Link, ready: u32) {
        let Ok(channel) = link.side_channel().await else {
            return;
        };
        let until = Instant::now() + PUT_BACK;
        while Instant::now() < until {
            match ready_count(&channel, &self.names.queue).await {
                Ok(n) if n < ready => tokio::time::sleep(Duration::from_millis(5)).await,
                _ => break,
            }
        }
        let _ = channel.close(200, "counted".into()).await;
    }
}

impl Purpose<'_> {
    /// Whether what was taken is all this purpose needs (on a queue that
    /// puts back each message where it was).
    fn satisfied(&self, taken: &[Taken]) -> bool {
        match self {
            Purpose::List(n) => taken.len() >= *n,
            Purpose::Find(id) => taken.iter().any(|t| t.id == *id),
            Purpose::Remove(ids, _) => {
                ids.len() <= taken.len()
                    && ids
                        .iter()
                        .all(|id| taken.iter().any(|t| t.id.as_str() == *id))
            }
        }
    }
}

/// Whether putting back what a browse holds would dead-letter a message:
/// one of them (other than those it removes) has been delivered `limit`
/// times.
fn taken_spent(found: &[Taken], rest: &[Taken], purpose: &Purpose<'_>, limit: u64) -> bool {
    let kept_found = if matches!(purpose, Purpose::Remove(..)) {
        &[][..]
    } else {
        found
    };
    rest.iter()
        .chain(kept_found)
        .any(|t| t.deliveries() >= limit)
}

/// How many messages are ready in `queue`, by a passive declare on
/// `channel`.
async fn ready_count(channel: &Channel, queue: &str) -> Result<u32, TransportError> {
    channel
        .queue_declare(
            short(queue)?,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map(|q| q.message_count())
        .map_err(|e| backend(format!("counting queue `{queue}`"), e))
}

/// Lists and finds stored messages without taking them; see the
/// [crate docs](crate#browsing) for how and what it costs.
impl Browse for AmqpTransport {
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(self.shared().list(limit))
    }

    fn find<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        Box::pin(self.shared().find(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn properties(message_id: Option<&str>, headers: &[(&str, &str)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert((*k).into(), AMQPValue::LongString((*v).into()));
        }
        let p = BasicProperties::default().with_headers(table);
        match message_id {
            Some(id) => p.with_message_id(id.into()),
            None => p,
        }
    }

    #[test]
    fn a_message_is_listed_by_its_message_id_or_else_by_a_stable_digest() {
        let sent = properties(Some("0190-abc"), &[("type", "Job")]);
        assert_eq!(listing_id(&sent, b"{}"), "0190-abc");
        for foreign in [None, Some(""), Some("3:7")] {
            let p = properties(foreign, &[("type", "Job")]);
            let id = listing_id(&p, b"{}");
            assert!(id.starts_with("digest-") && id.len() == 23, "{id}");
            assert_eq!(id, listing_id(&p, b"{}"), "the digest is stable");
            assert_ne!(id, listing_id(&p, b"{ }"), "the body counts");
            let other = properties(foreign, &[("type", "Other")]);
            assert_ne!(id, listing_id(&other, b"{}"), "the headers count");
            assert!(
                parse_id(&id).is_none(),
                "a digest never reads as a delivery id"
            );
        }
        // Known value: the hash does not change from one build to the next.
        let mut h = Fnv1a::default();
        h.write(b"a");
        assert_eq!(h.finish(), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn delivery_counts_are_read_from_either_header_and_dropped_from_copies() {
        let mut table = FieldTable::default();
        table.insert("x-delivery-count".into(), AMQPValue::LongLongInt(3));
        table.insert("x-acquired-count".into(), AMQPValue::LongInt(5));
        table.insert("type".into(), AMQPValue::LongString("Job".into()));
        let taken = Taken {
            tag: 1,
            id: "m".into(),
            properties: BasicProperties::default().with_headers(table),
            body: Vec::new(),
        };
        assert_eq!(taken.deliveries(), 5);
        let copy = taken.copy_properties();
        let headers = copy.headers().as_ref().unwrap();
        assert!(headers.inner().contains_key("type"));
        assert!(!headers.inner().contains_key("x-delivery-count"));
        assert!(!headers.inner().contains_key("x-acquired-count"));
        let bare = Taken {
            properties: BasicProperties::default(),
            ..taken
        };
        assert_eq!(bare.deliveries(), 0);
    }
}
