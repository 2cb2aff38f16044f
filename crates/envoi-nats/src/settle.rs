//! Settling what was handed out: the leases a handle holds, and the acks,
//! naks and in-progress acks sent on their JetStream ack subjects (acks and
//! naks confirmed by the server, see `confirm.rs`).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use async_nats::Subject;
use envoi_core::transport::{DeliveryId, Keepalive};
use envoi_core::{BoxFuture, TransportError};

use crate::confirm::Settlement;
use crate::fetch::DeliveryInfo;
use crate::transport::{backend, lock};
use crate::NatsTransport;

/// Leases not touched for this long (and at least three lease periods) are
/// forgotten; JetStream has handed those messages out again anyway.
const LEASE_MEMORY: Duration = Duration::from_secs(300);

/// Messages acknowledged this long ago (and at least two lease periods) are
/// forgotten: a server that lost the acknowledgement (a restart) has
/// delivered them again by then.
const ACKED_MEMORY: Duration = Duration::from_secs(60);

/// The most acknowledged messages remembered; the oldest go first.
const ACKED_MAX: usize = 100_000;

/// The stream sequence an id names; `None` for anything but a positive
/// number.
pub(crate) fn parse_id(id: &str) -> Option<u64> {
    id.parse().ok().filter(|seq| *seq > 0)
}

/// The stream sequence of `id`, or [`TransportError::NotFound`].
fn sequence_of(id: &DeliveryId) -> Result<u64, TransportError> {
    parse_id(id.as_str()).ok_or_else(|| TransportError::NotFound(id.to_string()))
}

/// A message handed out and not yet acknowledged, rejected or released.
#[derive(Debug)]
pub(crate) struct Lease {
    /// The JetStream ack subject of the latest delivery.
    pub(crate) reply: Subject,
    /// When it was handed out or last kept alive.
    pub(crate) touched: Instant,
    /// When the message was stored (see [`DeliveryInfo`]).
    pub(crate) stored: u64,
}

/// Whether a message fetched again is one this handle already has.
pub(crate) enum Seen {
    /// Never handed out by this handle, or handed out and given back, or
    /// its lease ran out: hand it out.
    New,
    /// Handed out and held, its lease running for at least half of it
    /// more: delivered again only because the server lost track of the
    /// delivery (a restart). Not handed out again; the lease takes the new
    /// ack subject.
    Held,
    /// Acknowledged by this handle and confirmed, yet delivered again: the
    /// server lost the acknowledgement (a restart). Acknowledged again, not
    /// handed out.
    Acked,
}

/// Hashes stream sequences (numbers the server counts up) by a
/// multiplication that spreads them over all bits: much cheaper than
/// SipHash for a map every delivery and acknowledgement goes through.
#[derive(Default)]
struct SequenceHasher(u64);

impl Hasher for SequenceHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// The messages a handle has handed out and not settled, by stream
/// sequence; and those it acknowledged lately, by stream sequence with
/// their storage time.
#[derive(Debug)]
pub(crate) struct Leases {
    by_sequence: HashMap<u64, Lease, BuildHasherDefault<SequenceHasher>>,
    last_pruned: Instant,
    acked: HashMap<u64, u64, BuildHasherDefault<SequenceHasher>>,
    /// When each entry of `acked` was made, oldest first.
    acked_at: VecDeque<(Instant, u64)>,
}

impl Leases {
    pub(crate) fn new() -> Self {
        Self {
            by_sequence: HashMap::default(),
            last_pruned: Instant::now(),
            acked: HashMap::default(),
            acked_at: VecDeque::new(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.by_sequence.len()
    }

    /// Forgets every lease and every acknowledged message (the messages
    /// are gone: purged, or the stream deleted).
    pub(crate) fn clear(&mut self) {
        self.by_sequence.clear();
        self.acked.clear();
        self.acked_at.clear();
    }

    /// Whether the message `info` describes, fetched again, is one this
    /// handle holds (leased for `lease`, less than half of it ago) or
    /// acknowledged; a held one takes `reply`, the new delivery's ack
    /// subject, when the answer is [`Seen::Held`].
    pub(crate) fn seen(&mut self, info: &DeliveryInfo, reply: &Subject, lease: Duration) -> Seen {
        if let Some(held) = self.by_sequence.get_mut(&info.sequence) {
            if held.stored == info.stored && held.touched.elapsed() < lease / 2 {
                held.reply = reply.clone();
                return Seen::Held;
            }
            return Seen::New;
        }
        if self.acked.get(&info.sequence) == Some(&info.stored) {
            Seen::Acked
        } else {
            Seen::New
        }
    }

    /// Remembers messages (sequence and storage time) whose acknowledgement
    /// the server confirmed, for `keep`; forgets older ones.
    fn remember_acked(&mut self, acked: impl IntoIterator<Item = (u64, u64)>, keep: Duration) {
        let now = Instant::now();
        for (sequence, stored) in acked {
            self.acked.insert(sequence, stored);
            self.acked_at.push_back((now, sequence));
        }
        while let Some(&(at, sequence)) = self.acked_at.front() {
            if self.acked_at.len() <= ACKED_MAX && now.duration_since(at) < keep {
                break;
            }
            self.acked_at.pop_front();
            self.acked.remove(&sequence);
        }
    }

    pub(crate) fn extend(&mut self, leased: impl IntoIterator<Item = (u64, Lease)>) {
        self.by_sequence.extend(leased);
    }

    fn remove(&mut self, sequence: u64) -> Option<Lease> {
        self.by_sequence.remove(&sequence)
    }
}

impl NatsTransport {
    /// Forgets leases untouched for long (at most once a lease period).
    pub(crate) fn prune_leases(&self) {
        let lease = self.inner.config.lease;
        let mut leases = lock(&self.inner.leases);
        if leases.last_pruned.elapsed() < lease {
            return;
        }
        leases.last_pruned = Instant::now();
        let keep = LEASE_MEMORY.max(lease * 3);
        leases.by_sequence.retain(|_, l| l.touched.elapsed() < keep);
    }

    fn take_lease(&self, sequence: u64) -> Option<Lease> {
        lock(&self.inner.leases).remove(sequence)
    }

    /// Remembers messages whose acknowledgement the server confirmed (by
    /// sequence and storage time), so that a delivery of one of them again
    /// is acknowledged again instead of handed out.
    fn remember_acked(&self, acked: impl IntoIterator<Item = (u64, u64)>) {
        let keep = ACKED_MEMORY.max(self.inner.config.lease.saturating_mul(2));
        lock(&self.inner.leases).remember_acked(acked, keep);
    }

    /// The settlement of `lease`, to be confirmed while it lasts.
    fn settlement(&self, lease: Lease) -> Settlement {
        Settlement {
            reply: lease.reply,
            lease_ends: tokio::time::Instant::from_std(lease.touched + self.inner.config.lease),
        }
    }

    /// Removes the message with stream sequence `sequence` from the stream
    /// directly (used for ids this handle did not hand out, such as ids
    /// from `list`). A message that is already gone counts as removed.
    async fn delete_by_sequence(&self, sequence: u64) -> Result<(), TransportError> {
        let stream = self.open_stream().await?;
        match stream.delete_message(sequence).await {
            Ok(_) => Ok(()),
            Err(e) => match e.kind() {
                jetstream::stream::DeleteMessageErrorKind::JetStream(js)
                    if js.error_code() == jetstream::ErrorCode::STREAM_MESSAGE_DELETE_FAILED
                        || js.error_code() == jetstream::ErrorCode::NO_MESSAGE_FOUND
                        || js.error_code() == jetstream::ErrorCode::SEQUENCE_NOT_FOUND =>
                {
                    Ok(())
                }
                _ => Err(backend(format!("deleting message {sequence}"), e)),
            },
        }
    }

    /// `ack` and `reject`: `+ACK` on a work-queue stream removes the
    /// message for good, and returns once the server confirmed it; a
    /// message this handle did not hand out is deleted from the stream.
    pub(crate) async fn remove(&self, id: &DeliveryId) -> Result<(), TransportError> {
        self.check_open()?;
        let sequence = sequence_of(id)?;
        match self.take_lease(sequence) {
            Some(lease) => {
                let stored = lease.stored;
                let settlement = self.settlement(lease);
                self.confirm("acknowledging", AckKind::Ack, vec![settlement])
                    .await?;
                self.remember_acked([(sequence, stored)]);
                Ok(())
            }
            None => self.delete_by_sequence(sequence).await,
        }
    }

    /// Acknowledges every id: the acks are written together and confirmed
    /// by the server with one round trip (each confirmed, concurrently,
    /// with `double_ack`); ids not handed out by this handle are deleted
    /// from the stream. Every id that can be is settled; the first error
    /// is returned.
    pub(crate) async fn remove_all(&self, ids: &[DeliveryId]) -> Result<(), TransportError> {
        self.check_open()?;
        let mut first_error = None;
        let mut settlements = Vec::with_capacity(ids.len());
        let mut others = Vec::new();
        {
            let mut leases = lock(&self.inner.leases);
            for id in ids {
                match sequence_of(id) {
                    Ok(sequence) => match leases.remove(sequence) {
                        Some(lease) => settlements.push((sequence, lease)),
                        None => others.push(sequence),
                    },
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        let keys: Vec<(u64, u64)> = settlements
            .iter()
            .map(|(sequence, lease)| (*sequence, lease.stored))
            .collect();
        let settlements = settlements
            .into_iter()
            .map(|(_, lease)| self.settlement(lease))
            .collect::<Vec<_>>();
        let acked = if settlements.is_empty() {
            Ok(())
        } else {
            let confirmed = self
                .confirm("acknowledging", AckKind::Ack, settlements)
                .await;
            if confirmed.is_ok() {
                self.remember_acked(keys);
            }
            confirmed
        };
        for sequence in others {
            if let Err(e) = self.delete_by_sequence(sequence).await {
                first_error.get_or_insert(e);
            }
        }
        match (acked, first_error) {
            (Err(e), _) | (Ok(()), Some(e)) => Err(e),
            (Ok(()), None) => Ok(()),
        }
    }

    /// `-NAK` without delay: handed out again at once, once the server
    /// confirmed it. Only for a message this handle holds.
    pub(crate) async fn give_back_one(&self, id: &DeliveryId) -> Result<(), TransportError> {
        self.check_open()?;
        let lease = self
            .take_lease(sequence_of(id)?)
            .ok_or_else(|| TransportError::NotFound(id.to_string()))?;
        let settlement = self.settlement(lease);
        self.confirm("releasing", AckKind::Nak(None), vec![settlement])
            .await
    }
}

impl Keepalive for NatsTransport {
    /// `+WPI` (in progress): JetStream starts the lease over. Only for a
    /// message this handle holds.
    fn keepalive<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.check_open()?;
            let sequence = sequence_of(id)?;
            let reply = {
                let mut leases = lock(&self.inner.leases);
                let lease = leases
                    .by_sequence
                    .get_mut(&sequence)
                    .ok_or_else(|| TransportError::NotFound(id.to_string()))?;
                lease.touched = Instant::now();
                lease.reply.clone()
            };
            if self.inner.config.double_ack {
                let answer = self
                    .inner
                    .client
                    .request(reply, AckKind::Progress.into())
                    .await
                    .map_err(|e| {
                        backend("keeping a message alive (waiting for confirmation)", e)
                    })?;
                match answer.status {
                    Some(status) if !status.is_success() => Err(backend(
                        "keeping a message alive",
                        format!("the server answered {status}"),
                    )),
                    _ => Ok(()),
                }
            } else {
                self.inner
                    .client
                    .publish(reply, AckKind::Progress.into())
                    .await
                    .map_err(|e| backend("keeping a message alive", e))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(sequence: u64, stored: u64) -> DeliveryInfo {
        DeliveryInfo {
            sequence,
            delivered: 2,
            stored,
        }
    }

    fn lease(reply: &str, touched: Instant, stored: u64) -> Lease {
        Lease {
            reply: Subject::from(reply),
            touched,
            stored,
        }
    }

    #[test]
    fn a_message_delivered_again_while_held_is_not_new_and_takes_the_new_ack_subject() {
        let lease_period = Duration::from_secs(30);
        let mut leases = Leases::new();
        leases.extend([(7, lease("$JS.ACK.old", Instant::now(), 100))]);
        let again = Subject::from("$JS.ACK.new");
        assert!(matches!(
            leases.seen(&info(7, 100), &again, lease_period),
            Seen::Held
        ));
        assert_eq!(leases.remove(7).unwrap().reply, again);

        // Another message with that sequence (the stream made again), or
        // one whose lease is half gone: new.
        leases.extend([(7, lease("$JS.ACK.old", Instant::now(), 100))]);
        assert!(matches!(
            leases.seen(&info(7, 200), &again, lease_period),
            Seen::New
        ));
        let Some(long_ago) = Instant::now().checked_sub(Duration::from_secs(20)) else {
            return;
        };
        leases.extend([(8, lease("$JS.ACK.old", long_ago, 100))]);
        assert!(matches!(
            leases.seen(&info(8, 100), &again, lease_period),
            Seen::New
        ));
    }

    #[test]
    fn acknowledged_messages_are_remembered_for_a_while_and_a_bounded_number() {
        let reply = Subject::from("$JS.ACK.x");
        let lease_period = Duration::from_secs(30);
        let mut leases = Leases::new();
        leases.remember_acked([(1, 10), (2, 20)], Duration::from_secs(60));
        assert!(matches!(
            leases.seen(&info(1, 10), &reply, lease_period),
            Seen::Acked
        ));
        assert!(matches!(
            leases.seen(&info(2, 99), &reply, lease_period),
            Seen::New
        ));
        assert!(matches!(
            leases.seen(&info(3, 30), &reply, lease_period),
            Seen::New
        ));
        // Kept for no time: forgotten at the next acknowledgement.
        leases.remember_acked([(4, 40)], Duration::ZERO);
        assert!(leases.acked.is_empty() && leases.acked_at.is_empty());

        leases.remember_acked(
            (0..ACKED_MAX as u64 + 5).map(|s| (s, s)),
            Duration::from_secs(60),
        );
        assert_eq!(leases.acked.len(), ACKED_MAX);
        assert!(matches!(
            leases.seen(&info(4, 4), &reply, lease_period),
            Seen::New
        ));
        leases.clear();
        assert!(leases.acked.is_empty() && leases.acked_at.is_empty());
    }

    #[test]
    fn ids_are_positive_stream_sequences() {
        assert_eq!(parse_id("42"), Some(42));
        assert_eq!(parse_id("0"), None);
        assert_eq!(parse_id("-1"), None);
        assert_eq!(parse_id("42.1"), None);
        assert_eq!(parse_id("abc"), None);
    }
}
