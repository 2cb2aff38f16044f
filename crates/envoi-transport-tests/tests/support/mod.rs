//! A small in-memory reference transport, so the suite itself is tested:
//! the correct version must pass every case, and versions with a planted
//! fault must fail the case that looks for it.

#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use envoi_core::transport::{
    Browse, Delivery, DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Transport,
};
use envoi_core::{BoxFuture, TransportError};

/// The header that marked a redelivery before transports marked it on the
/// delivery itself; [`Fault::MarksFromStoredHeader`] still reads it.
const FORMER_REDELIVERY_HEADER: &str = "X-Envoi-Redelivered";

/// A fault planted in the reference transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Behaves correctly.
    None,
    /// `ack` leaves the message stored (it comes back after the lease).
    AckKeepsMessage,
    /// `release` does nothing (the message only comes back after the lease).
    ReleaseIgnored,
    /// Every tenth `send` is dropped.
    DropsEveryTenthSend,
    /// `keepalive` does not extend the lease.
    KeepaliveIgnored,
    /// Delays are ignored.
    DelayIgnored,
    /// `get` hands out the newest message first.
    NewestFirst,
    /// Header values lose trailing whitespace.
    TrimsHeaders,
    /// Expired leases are never redelivered.
    LeasesNeverExpire,
    /// A message whose lease expired comes back without the redelivery
    /// mark.
    RedeliveriesUnmarked,
    /// A message stored with an `X-Envoi-Redelivered: true` header is
    /// handed out marked as redelivered, even the first time.
    MarksFromStoredHeader,
}

struct Stored {
    raw: RawMessage,
    available_at: Instant,
    leased_until: Option<Instant>,
}

#[derive(Default)]
struct Queue {
    next_id: u64,
    sends: u64,
    messages: BTreeMap<u64, Stored>,
}

fn registry() -> &'static Mutex<HashMap<String, Arc<Mutex<Queue>>>> {
    static QUEUES: OnceLock<Mutex<HashMap<String, Arc<Mutex<Queue>>>>> = OnceLock::new();
    QUEUES.get_or_init(Default::default)
}

/// A handle on the in-memory queue called `name` (same name, same queue).
pub struct Reference {
    queue: Arc<Mutex<Queue>>,
    lease: Duration,
    fault: Fault,
}

impl Reference {
    /// Opens `name` with `lease` and `fault`.
    pub fn open(name: &str, lease: Duration, fault: Fault) -> Arc<dyn Transport> {
        let queue = Arc::clone(
            registry()
                .lock()
                .unwrap()
                .entry(name.to_string())
                .or_default(),
        );
        Arc::new(Reference {
            queue,
            lease,
            fault,
        })
    }

    fn parse(id: &DeliveryId) -> Option<u64> {
        id.as_str().parse().ok()
    }

    /// Removes the message `id`, if stored.
    fn remove(&self, id: &DeliveryId) -> Result<(), TransportError> {
        let Some(n) = Self::parse(id) else {
            return Err(TransportError::NotFound(id.to_string()));
        };
        self.queue.lock().unwrap().messages.remove(&n);
        Ok(())
    }

    /// Whether the stored message `raw`, handed out for the first time, is
    /// marked as redelivered.
    fn marked_at_first(&self, raw: &RawMessage) -> bool {
        self.fault == Fault::MarksFromStoredHeader
            && raw.header(FORMER_REDELIVERY_HEADER) == Some("true")
    }
}

impl Transport for Reference {
    fn send(
        &self,
        mut message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(async move {
            let mut q = self.queue.lock().unwrap();
            q.next_id += 1;
            q.sends += 1;
            let id = q.next_id;
            if self.fault == Fault::DropsEveryTenthSend && q.sends.is_multiple_of(10) {
                return Ok(id.to_string());
            }
            if self.fault == Fault::TrimsHeaders {
                message.headers = message
                    .headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.trim_end().to_string()))
                    .collect();
            }
            let delay = if self.fault == Fault::DelayIgnored {
                Duration::ZERO
            } else {
                delay.unwrap_or_default()
            };
            q.messages.insert(
                id,
                Stored {
                    raw: message,
                    available_at: Instant::now() + delay,
                    leased_until: None,
                },
            );
            Ok(id.to_string())
        })
    }

    fn as_receiver(&self) -> Option<&dyn Receiver> {
        Some(self)
    }

    fn as_keepalive(&self) -> Option<&dyn Keepalive> {
        Some(self)
    }

    fn as_setup(&self) -> Option<&dyn Setup> {
        Some(self)
    }

    fn as_message_count(&self) -> Option<&dyn MessageCount> {
        Some(self)
    }

    fn as_browse(&self) -> Option<&dyn Browse> {
        Some(self)
    }
}

impl Receiver for Reference {
    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut q = self.queue.lock().unwrap();
            let never_expire = self.fault == Fault::LeasesNeverExpire;
            let available = |s: &Stored| {
                s.available_at <= now
                    && match s.leased_until {
                        None => true,
                        Some(until) => !never_expire && until <= now,
                    }
            };
            let ids: Vec<u64> = if self.fault == Fault::NewestFirst {
                q.messages
                    .iter()
                    .rev()
                    .filter(|(_, s)| available(s))
                    .map(|(id, _)| *id)
                    .take(max)
                    .collect()
            } else {
                q.messages
                    .iter()
                    .filter(|(_, s)| available(s))
                    .map(|(id, _)| *id)
                    .take(max)
                    .collect()
            };
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                let s = q.messages.get_mut(&id).expect("listed above");
                // Still leased by a consumer that never settled it.
                let expired = s.leased_until.is_some();
                s.leased_until = Some(now + self.lease);
                let marked = (expired && self.fault != Fault::RedeliveriesUnmarked)
                    || self.marked_at_first(&s.raw);
                let delivery = Delivery::new(id.to_string(), s.raw.clone());
                out.push(if marked {
                    delivery.mark_redelivered()
                } else {
                    delivery
                });
            }
            Ok(out)
        })
    }

    fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            if self.fault == Fault::AckKeepsMessage {
                return Ok(());
            }
            self.remove(id)
        })
    }

    fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.remove(id) })
    }

    fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            if self.fault == Fault::ReleaseIgnored {
                return Ok(());
            }
            if let Some(s) = Self::parse(id).and_then(|id| {
                self.queue
                    .lock()
                    .unwrap()
                    .messages
                    .get_mut(&id)
                    .map(|s| s.leased_until.take())
            }) {
                let _ = s;
            }
            Ok(())
        })
    }
}

impl Keepalive for Reference {
    fn keepalive<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            if self.fault == Fault::KeepaliveIgnored {
                return Ok(());
            }
            let mut q = self.queue.lock().unwrap();
            if let Some(s) = Self::parse(id).and_then(|id| q.messages.get_mut(&id)) {
                if s.leased_until.is_some() {
                    s.leased_until = Some(Instant::now() + self.lease);
                }
            }
            Ok(())
        })
    }
}

/// Nothing to create: the queue exists once opened.
impl Setup for Reference {
    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async { Ok(()) })
    }
}

impl MessageCount for Reference {
    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move { Ok(self.queue.lock().unwrap().messages.len() as u64) })
    }
}

impl Browse for Reference {
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            Ok(self
                .queue
                .lock()
                .unwrap()
                .messages
                .iter()
                .take(limit)
                .map(|(id, s)| Delivery::new(id.to_string(), s.raw.clone()))
                .collect())
        })
    }

    fn find<'a>(
        &'a self,
        id: &'a DeliveryId,
    ) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        Box::pin(async move {
            let q = self.queue.lock().unwrap();
            Ok(Self::parse(id).and_then(|n| {
                q.messages
                    .get(&n)
                    .map(|s| Delivery::new(id.clone(), s.raw.clone()))
            }))
        })
    }
}

/// The reference transport stripped of every ability beside sending and,
/// unless told otherwise, receiving: what the suite must cope with by
/// skipping what needs the missing abilities.
pub struct Bare {
    inner: Arc<dyn Transport>,
    receives: bool,
}

impl Bare {
    /// A handle on the reference queue `name` with only a receiving side.
    pub fn open(name: &str, lease: Duration) -> Arc<dyn Transport> {
        Arc::new(Bare {
            inner: Reference::open(name, lease, Fault::None),
            receives: true,
        })
    }

    /// A handle on the reference queue `name` that can only send.
    pub fn send_only(name: &str, lease: Duration) -> Arc<dyn Transport> {
        Arc::new(Bare {
            inner: Reference::open(name, lease, Fault::None),
            receives: false,
        })
    }
}

impl Transport for Bare {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        self.inner.send(message, delay)
    }

    fn as_receiver(&self) -> Option<&dyn Receiver> {
        if self.receives {
            self.inner.as_receiver()
        } else {
            None
        }
    }
}
