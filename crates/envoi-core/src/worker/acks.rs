//! Acknowledging, rejecting and releasing messages with their transports,
//! in batches.

use std::future::Future;
use std::sync::Arc;

use super::events::{bump, WorkerEvent};
use super::fetch::{receiving, MessageId};
use super::handle::Ctx;
use super::in_flight::Finished;
use super::run::Run;
use super::settle::Done;
use crate::error::TransportError;
use crate::transport::{DeliveryId, Transport};
use tokio::time::Instant;

/// The acknowledgements of one receiver waiting to be sent.
#[derive(Default)]
pub(super) struct Acks {
    /// Keys of messages from an in-process transport.
    local: Vec<u64>,
    /// Ids of messages from any other transport.
    remote: Vec<DeliveryId>,
}

impl Acks {
    pub(super) fn len(&self) -> usize {
        self.local.len() + self.remote.len()
    }

    pub(super) fn push(&mut self, id: MessageId) {
        match id {
            MessageId::Local(id) => self.local.push(id.key()),
            MessageId::Remote(id) => self.remote.push(id),
        }
    }
}

/// Acknowledges messages of an in-process transport by key, or by their text
/// ids when it cannot take keys.
async fn ack_local(transport: &Arc<dyn Transport>, keys: &[u64]) -> Result<(), TransportError> {
    if let Some(local) = transport.as_local_receiver() {
        return local.ack_local(keys);
    }
    let ids: Vec<DeliveryId> = keys
        .iter()
        .map(|k| DeliveryId::from(k.to_string()))
        .collect();
    receiving(transport)?.ack_batch(&ids).await
}

/// The acknowledgement lists, emptied, and what failed (by receiver).
pub(super) type SentAcks = (Vec<Acks>, Vec<(usize, TransportError)>);

/// Sends every receiver's acknowledgements.
pub(super) async fn send_acks(ctx: &Ctx, mut acks: Vec<Acks>) -> SentAcks {
    let mut failed = Vec::new();
    for (receiver, acks) in acks.iter_mut().enumerate() {
        let transport = &ctx.receivers[receiver].transport;
        if !acks.local.is_empty() {
            if let Err(e) = ack_local(transport, &acks.local).await {
                failed.push((receiver, e));
            }
            acks.local.clear();
        }
        if !acks.remote.is_empty() {
            let result = match receiving(transport) {
                Ok(r) if acks.remote.len() == 1 => r.ack(&acks.remote[0]).await,
                Ok(r) => r.ack_batch(&acks.remote).await,
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                failed.push((receiver, e));
            }
            acks.remote.clear();
        }
    }
    (acks, failed)
}

impl<'a, F: Future<Output = Done> + 'a> Run<'a, F> {
    pub(super) fn pending_acks(&self) -> usize {
        self.acks.iter().map(Acks::len).sum()
    }

    /// Whether handled messages wait to be acknowledged, rejected,
    /// released or parked.
    pub(super) fn has_outcomes(&self) -> bool {
        self.pending_acks() > 0
            || !self.rejects.is_empty()
            || !self.releases.is_empty()
            || !self.panicked.is_empty()
    }

    pub(super) fn transport_failed(
        &self,
        receiver: usize,
        operation: &'static str,
        error: &TransportError,
    ) {
        self.ctx.events.emit(|| WorkerEvent::TransportFailed {
            transport: self.ctx.receivers[receiver].name.clone(),
            operation,
            error: error.to_string(),
        });
    }

    /// Parks panicked messages, then sends acknowledgements, rejections and
    /// releases.
    pub(super) async fn flush(&mut self) {
        for (receiver, id, envelope, message) in std::mem::take(&mut self.panicked) {
            let done = self
                .ctx
                .park_panicked(receiver, &id.text(), envelope, message)
                .await;
            self.record(Finished::Done(done, id));
        }
        if self.pending_acks() > 0 {
            let acks = self.take_acks();
            let sent = send_acks(self.ctx, acks).await;
            self.acks_sent(sent);
        }
        for (receiver, id) in std::mem::take(&mut self.rejects) {
            let result = match self.ctx.receivers[receiver].receiver() {
                Ok(r) => r.reject(&id.delivery_id()).await,
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                self.transport_failed(receiver, "reject", &e);
            }
        }
        for (receiver, id) in std::mem::take(&mut self.releases) {
            let result = match self.ctx.receivers[receiver].receiver() {
                Ok(r) => r.release(&id.delivery_id()).await,
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                self.transport_failed(receiver, "release", &e);
            }
        }
        if self.ctx.take_park_failed() {
            let now = Instant::now();
            for (receiver, after) in self.fetch_after.iter_mut().enumerate() {
                if let Some(pause) = self.ctx.park_backoff(receiver) {
                    *after = Some(now + pause);
                }
            }
        }
    }

    /// The pending acknowledgements, to be sent; new ones go to the spare
    /// lists meanwhile.
    pub(super) fn take_acks(&mut self) -> Vec<Acks> {
        self.settle = false;
        let spare = std::mem::take(&mut self.spare_acks);
        std::mem::replace(&mut self.acks, spare)
    }

    /// Keeps the lists of sent acknowledgements (emptied) as the spare ones
    /// and reports what failed.
    pub(super) fn acks_sent(&mut self, (acks, failed): SentAcks) {
        self.spare_acks = acks;
        for (receiver, e) in failed {
            self.transport_failed(receiver, "ack", &e);
        }
    }

    /// Gives back a message that will not be handled now.
    pub(super) fn give_back(&mut self, receiver: usize, id: MessageId) {
        bump(&self.ctx.counters.released);
        self.ctx.events.emit(|| WorkerEvent::Released {
            transport: self.ctx.receivers[receiver].name.clone(),
            id: id.text().into_owned(),
        });
        self.releases.push((receiver, id));
    }
}
