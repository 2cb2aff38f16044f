//! The queue behind an [`InMemoryTransport`](super::InMemoryTransport):
//! the messages available now, the delayed ones and the leased ones.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use crate::envelope::Envelope;
use crate::far;
use crate::transport::{LocalId, Payload, RawMessage};

/// A stored message: a [`Payload`] in half the space (a queue may hold
/// many), and whether it is to be handed out marked as redelivered.
pub(super) enum Stored {
    Envelope(Envelope),
    /// An envelope whose lease ran out.
    Redelivered(Envelope),
    Raw(Box<RawMessage>),
    /// A raw message whose lease ran out.
    RedeliveredRaw(Box<RawMessage>),
}

impl Stored {
    /// The message of a lease that ran out, marked as redelivered to be
    /// handed out again.
    fn redelivered(self) -> Self {
        match self {
            Stored::Envelope(e) => Stored::Redelivered(e),
            Stored::Raw(raw) => Stored::RedeliveredRaw(raw),
            marked => marked,
        }
    }

    /// Whether it is marked by [`redelivered`](Self::redelivered).
    pub(super) fn is_redelivered(&self) -> bool {
        matches!(self, Stored::Redelivered(_) | Stored::RedeliveredRaw(_))
    }

    /// A copy to hand out, once [`make_sendable`](Self::make_sendable)
    /// ran.
    pub(super) fn handout(&self) -> Payload {
        match self {
            Stored::Envelope(e) | Stored::Redelivered(e) => Payload::Envelope(e.clone()),
            Stored::Raw(raw) | Stored::RedeliveredRaw(raw) => Payload::Raw((**raw).clone()),
        }
    }

    /// A copy to list: an envelope without its non-sendable stamps.
    fn payload(&self) -> Payload {
        match self {
            Stored::Envelope(e) | Stored::Redelivered(e) => {
                Payload::Envelope(e.clone().into_sendable())
            }
            Stored::Raw(raw) | Stored::RedeliveredRaw(raw) => Payload::Raw((**raw).clone()),
        }
    }

    /// Drops the non-sendable stamps of a stored envelope (kept until it is
    /// first handed out, so that storing it needs no copy of its stamps).
    fn make_sendable(&mut self) {
        if let Stored::Envelope(e) | Stored::Redelivered(e) = self {
            e.make_sendable();
        }
    }
}

/// A stored message under its id.
pub(super) struct Entry {
    pub(super) id: LocalId,
    pub(super) stored: Stored,
}

impl Entry {
    pub(super) fn key(&self) -> u64 {
        self.id.key()
    }
}

/// A message waiting for its time.
pub(super) struct Delayed {
    at: Instant,
    entry: Entry,
}

impl PartialEq for Delayed {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at && self.entry.key() == other.entry.key()
    }
}
impl Eq for Delayed {}
impl PartialOrd for Delayed {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Delayed {
    // Reversed, so the max-heap pops the earliest first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.entry.key()).cmp(&(self.at, self.entry.key()))
    }
}

/// A handed-out message, and when it is handed out again unless settled.
pub(super) struct Lease {
    pub(super) entry: Entry,
    pub(super) expires: Instant,
}

/// The leased messages, in key order. Messages are leased, and mostly
/// acknowledged, in key order: a sorted deque finds them by binary search,
/// adds them at its back and frees them from its front. A lease removed
/// from the middle leaves a hole, until the holes before it are gone too or
/// the holes outnumber the leases.
#[derive(Default)]
pub(super) struct Leases {
    slots: VecDeque<(u64, Option<Lease>)>,
    live: usize,
}

impl Leases {
    fn len(&self) -> usize {
        self.live
    }

    fn position(&self, key: u64) -> Result<usize, usize> {
        self.slots.binary_search_by_key(&key, |(k, _)| *k)
    }

    fn reserve(&mut self, n: usize) {
        self.slots.reserve(n);
    }

    fn insert(&mut self, lease: Lease) {
        let key = lease.entry.key();
        match self.slots.back() {
            Some((last, _)) if *last >= key => match self.position(key) {
                // The hole the same message left when it was last leased.
                Ok(at) => {
                    if self.slots[at].1.replace(lease).is_none() {
                        self.live += 1;
                    }
                }
                Err(at) => {
                    self.slots.insert(at, (key, Some(lease)));
                    self.live += 1;
                }
            },
            _ => {
                self.slots.push_back((key, Some(lease)));
                self.live += 1;
            }
        }
    }

    pub(super) fn get_mut(&mut self, key: u64) -> Option<&mut Lease> {
        let at = self.position(key).ok()?;
        self.slots[at].1.as_mut()
    }

    pub(super) fn remove(&mut self, key: u64) -> Option<Lease> {
        // Most often the oldest lease: messages finish in about the order
        // they were handed out.
        let at = match self.slots.front() {
            Some((first, _)) if *first == key => 0,
            _ => self.position(key).ok()?,
        };
        let lease = self.slots[at].1.take()?;
        self.live -= 1;
        self.tidy();
        Some(lease)
    }

    /// Drops the holes at both ends, and all of them once they outnumber
    /// the leases (so a lease held for long does not keep every later hole).
    fn tidy(&mut self) {
        while matches!(self.slots.front(), Some((_, None))) {
            self.slots.pop_front();
        }
        while matches!(self.slots.back(), Some((_, None))) {
            self.slots.pop_back();
        }
        if self.slots.len() > 2 * self.live + 64 {
            self.slots.retain(|(_, l)| l.is_some());
        }
    }

    fn iter(&self) -> impl Iterator<Item = &Lease> + '_ {
        self.slots.iter().filter_map(|(_, l)| l.as_ref())
    }

    /// Removes and returns the leases expired at `now`.
    fn take_expired(&mut self, now: Instant) -> Vec<Lease> {
        let mut out = Vec::new();
        for (_, slot) in self.slots.iter_mut() {
            if slot.as_ref().is_some_and(|l| l.expires <= now) {
                out.extend(slot.take());
            }
        }
        self.live -= out.len();
        self.tidy();
        out
    }
}

/// Every message of a transport, available, delayed or leased, and the
/// counts of those acknowledged and rejected.
#[derive(Default)]
pub(super) struct State {
    /// Available now, sorted by id.
    pub(super) ready: VecDeque<Entry>,
    pub(super) delayed: BinaryHeap<Delayed>,
    pub(super) leased: Leases,
    /// No lease expires before this (a lower bound; `None` when none is held).
    pub(super) earliest_expiry: Option<Instant>,
    pub(super) acknowledged: u64,
    pub(super) rejected: u64,
}

impl State {
    /// Adds an available message in its place by id (a new message goes
    /// last; a released or expired one takes its old place).
    pub(super) fn insert_ready(&mut self, entry: Entry) {
        match self.ready.back() {
            Some(last) if last.key() > entry.key() => {
                let key = entry.key();
                let at = self.ready.partition_point(|e| e.key() < key);
                self.ready.insert(at, entry);
            }
            _ => self.ready.push_back(entry),
        }
    }

    /// Stores a message under `id` (see
    /// [`InMemoryTransport::next_id`](super::InMemoryTransport::next_id)).
    pub(super) fn store(&mut self, id: LocalId, stored: Stored, delay: Option<Duration>) {
        let entry = Entry { id, stored };
        match delay.filter(|d| !d.is_zero()) {
            Some(d) => self.delayed.push(Delayed {
                at: Instant::now() + far::clamp(d),
                entry,
            }),
            None => self.insert_ready(entry),
        }
    }

    /// Moves due delayed messages and expired leases to `ready`.
    fn promote(&mut self, now: Instant) {
        while self.delayed.peek().is_some_and(|d| d.at <= now) {
            if let Some(d) = self.delayed.pop() {
                self.insert_ready(d.entry);
            }
        }
        if self.earliest_expiry.is_some_and(|t| t <= now) {
            for lease in self.leased.take_expired(now) {
                // Handed out and not settled in time: marked, so a
                // deduplicating handler takes over the key its consumer
                // claimed.
                let Entry { id, stored } = lease.entry;
                self.insert_ready(Entry {
                    id,
                    stored: stored.redelivered(),
                });
            }
            self.earliest_expiry = self.leased.iter().map(|l| l.expires).min();
        }
    }

    /// Leases up to `max` ready messages, calling `out` with each.
    pub(super) fn take(&mut self, max: usize, lease: Duration, mut out: impl FnMut(&Entry)) {
        if self.ready.is_empty() && self.delayed.is_empty() && self.earliest_expiry.is_none() {
            return;
        }
        let now = Instant::now();
        self.promote(now);
        let expires = now + lease;
        let n = max.min(self.ready.len());
        if n == 0 {
            return;
        }
        self.leased.reserve(n);
        for mut entry in self.ready.drain(..n) {
            entry.stored.make_sendable();
            out(&entry);
            self.leased.insert(Lease { entry, expires });
        }
        if self.earliest_expiry.is_none_or(|t| t > expires) {
            self.earliest_expiry = Some(expires);
        }
    }

    /// Removes a message for good, leased or not (a consumer whose lease
    /// expired may still acknowledge the work it did).
    pub(super) fn remove(&mut self, id: u64) -> bool {
        self.take_out(id).is_some()
    }

    /// Removes a message for good and returns it, to be dropped once the
    /// lock is released.
    pub(super) fn take_out(&mut self, id: u64) -> Option<Entry> {
        if let Some(lease) = self.leased.remove(id) {
            return Some(lease.entry);
        }
        if let Some(pos) = self.ready.iter().position(|e| e.key() == id) {
            return self.ready.remove(pos);
        }
        let pos = self.delayed.iter().position(|d| d.entry.key() == id)?;
        let mut delayed = std::mem::take(&mut self.delayed).into_vec();
        let entry = delayed.swap_remove(pos).entry;
        self.delayed = BinaryHeap::from(delayed);
        Some(entry)
    }

    /// Every stored message, in id order.
    pub(super) fn snapshot(&self) -> Vec<(LocalId, Payload)> {
        let mut all: Vec<(LocalId, Payload)> = self
            .ready
            .iter()
            .chain(self.delayed.iter().map(|d| &d.entry))
            .chain(self.leased.iter().map(|l| &l.entry))
            .map(|e| (e.id, e.stored.payload()))
            .collect();
        all.sort_unstable_by_key(|(id, _)| id.key());
        all
    }

    pub(super) fn count(&self) -> usize {
        self.ready.len() + self.delayed.len() + self.leased.len()
    }

    /// How long until a delayed message is due or a lease expires.
    pub(super) fn next_change(&self, now: Instant) -> Option<Duration> {
        let delayed = self.delayed.peek().map(|d| d.at);
        let soonest = match (delayed, self.earliest_expiry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        soonest.map(|t| t.saturating_duration_since(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(n: u8) -> RawMessage {
        RawMessage {
            body: vec![n],
            headers: Default::default(),
        }
    }

    #[tokio::test]
    async fn messages_given_ids_concurrently_are_queued_in_id_order() {
        // Ids are taken before the lock: a send may queue its message after
        // one that took a later id.
        let mut state = State::default();
        for k in [2, 3, 1, 5, 4] {
            state.store(LocalId::new(k), Stored::Raw(Box::new(raw(k as u8))), None);
        }
        let mut got = Vec::new();
        state.take(10, Duration::from_secs(1), |e| got.push(e.key()));
        assert_eq!(got, [1, 2, 3, 4, 5]);
    }

    #[test]
    fn leases_are_found_in_any_order_and_holes_do_not_pile_up() {
        let now = Instant::now();
        let lease = |k: u64| Lease {
            entry: Entry {
                id: LocalId::new(k),
                stored: Stored::Raw(Box::new(raw(k as u8))),
            },
            expires: now + Duration::from_secs(k),
        };
        let mut leases = Leases::default();
        for k in 1..=1000 {
            leases.insert(lease(k));
        }
        // The first stays leased; the others go, newest first.
        for k in (2..=1000).rev() {
            assert_eq!(leases.remove(k).map(|l| l.entry.key()), Some(k));
            assert!(leases.slots.len() <= 2 * leases.len() + 64 + 1);
        }
        assert!(leases.remove(500).is_none());
        assert_eq!((leases.len(), leases.slots.len()), (1, 1));
        // Out of order: an older key comes back while newer ones are held.
        for k in [10, 20, 30] {
            leases.insert(lease(k));
        }
        assert!(leases.remove(20).is_some());
        leases.insert(lease(20));
        leases.insert(lease(5));
        let keys: Vec<u64> = leases.iter().map(|l| l.entry.key()).collect();
        assert_eq!(keys, [1, 5, 10, 20, 30]);
        leases.get_mut(30).unwrap().expires = now;
        let expired: Vec<u64> = leases
            .take_expired(now + Duration::from_secs(5))
            .iter()
            .map(|l| l.entry.key())
            .collect();
        assert_eq!(expired, [1, 5, 30]);
        assert_eq!(leases.len(), 2);
        assert!(leases.get_mut(1).is_none());
    }
}
