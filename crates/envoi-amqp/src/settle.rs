//! Settling deliveries by their ids (`<epoch>:<delivery tag>`): `ack`
//! (several at once with `multiple` where that touches nobody else's),
//! `reject`, `release`, and `keepalive`, which restarts a lease. `ack` and
//! `reject` of an id a listing showed go to the `browse` module.

use std::time::Instant;

use envoi_core::transport::DeliveryId;
use envoi_core::TransportError;
use futures_util::future::join_all;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::Channel;

use crate::error::AmqpError;
use crate::link::Link;
use crate::shared::{backend, lock, Shared};

/// How a delivery is settled.
#[derive(Clone, Copy)]
pub(crate) enum Settle {
    /// `basic.ack`: handled, removed.
    Ack,
    /// `basic.reject` without requeue: removed for good (dead-lettered to
    /// `<queue>.dead` on a quorum queue).
    Reject,
    /// `basic.nack` with requeue: handed out again.
    Release,
}

impl Settle {
    /// Settles delivery `tag` on `channel` this way.
    pub(crate) async fn send(self, channel: &Channel, tag: u64) -> Result<(), lapin::Error> {
        match self {
            Settle::Ack => channel.basic_ack(tag, BasicAckOptions::default()).await,
            Settle::Reject => {
                channel
                    .basic_reject(tag, BasicRejectOptions { requeue: false })
                    .await
            }
            Settle::Release => {
                channel
                    .basic_nack(
                        tag,
                        BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        },
                    )
                    .await
            }
        }
    }

    /// Whether settling this way removes the message from the queue (an
    /// id a listing showed can be settled so).
    fn removes(self) -> bool {
        matches!(self, Settle::Ack | Settle::Reject)
    }

    /// What settling this way is called, for error messages.
    pub(crate) fn verb(self) -> &'static str {
        match self {
            Settle::Ack => "acknowledging",
            Settle::Reject => "rejecting",
            Settle::Release => "releasing",
        }
    }
}

/// The id of the delivery `tag` of connection `epoch`: `<epoch>:<tag>`,
/// written without the formatting machinery (this runs per message).
pub(crate) fn delivery_id(epoch: u64, tag: u64) -> String {
    let (mut e, mut t) = (itoa::Buffer::new(), itoa::Buffer::new());
    let (e, t) = (e.format(epoch), t.format(tag));
    let mut id = String::with_capacity(e.len() + 1 + t.len());
    id.push_str(e);
    id.push(':');
    id.push_str(t);
    id
}

/// The epoch and delivery tag of a delivery id.
pub(crate) fn parse_id(id: &str) -> Option<(u64, u64)> {
    let (epoch, tag) = id.split_once(':')?;
    Some((epoch.parse().ok()?, tag.parse().ok()?))
}

/// The error for `id`, of a connection that has since closed, while
/// `context`.
fn stale(id: &DeliveryId, context: String) -> TransportError {
    backend(context, AmqpError::StaleDelivery(id.to_string()))
}

/// The ack frames for `tags` (sorted here): one with `multiple` for every
/// tag below `floor`, one by one for the others.
fn ack_frames(mut tags: Vec<u64>, floor: u64) -> Vec<(u64, bool)> {
    tags.sort_unstable();
    let below = tags.partition_point(|&tag| tag < floor);
    let mut frames = Vec::with_capacity(tags.len() - below + 1);
    if below > 0 {
        frames.push((tags[below - 1], below > 1));
    }
    frames.extend(tags[below..].iter().map(|&tag| (tag, false)));
    frames
}

impl Shared {
    /// Removes `ids` from the leases and marks them as being settled;
    /// returns the tags to settle on `link`, the [floor](crate::consume::ConsumeState::floor)
    /// below which they can be settled with one `multiple` frame, and the
    /// first id that could not be settled, with why.
    fn take_leases(
        &self,
        link: &Link,
        ids: &[DeliveryId],
    ) -> (Vec<u64>, u64, Option<TransportError>) {
        let mut state = lock(&self.consume);
        let mut tags = Vec::with_capacity(ids.len());
        let mut error = None;
        for id in ids {
            let refused = match parse_id(id.as_str()) {
                Some((epoch, tag)) if epoch == link.epoch && state.epoch == link.epoch => {
                    if state.leased.remove(&tag).is_some() {
                        tags.push(tag);
                        continue;
                    }
                    TransportError::NotFound(id.to_string())
                }
                Some((epoch, _)) if epoch > 0 && epoch < link.epoch => {
                    stale(id, format!("settling `{id}`"))
                }
                _ => TransportError::NotFound(id.to_string()),
            };
            error.get_or_insert(refused);
        }
        let floor = state.floor();
        state.settling.extend(tags.iter().copied());
        (tags, floor, error)
    }

    /// Settles `ids` as `how` says. Every id that can be is settled; the
    /// first error is returned.
    pub(crate) async fn settle(
        &self,
        ids: &[DeliveryId],
        how: Settle,
    ) -> Result<(), TransportError> {
        if ids.is_empty() {
            return Ok(());
        }
        if how.removes() && ids.iter().any(|id| parse_id(id.as_str()).is_none()) {
            return Box::pin(self.settle_with_listed(ids, how)).await;
        }
        let Some(link) = self.current().filter(|l| l.healthy()) else {
            return Err(self.settle_without_link(ids));
        };
        let (tags, floor, refused) = self.take_leases(&link, ids);
        let sent = if matches!(how, Settle::Ack) {
            join_all(
                ack_frames(tags.clone(), floor)
                    .into_iter()
                    .map(|(tag, multiple)| {
                        link.consumer.basic_ack(tag, BasicAckOptions { multiple })
                    }),
            )
            .await
        } else {
            join_all(tags.iter().map(|&tag| how.send(&link.consumer, tag))).await
        };
        lock(&self.consume).settled(link.epoch, &tags);
        *lock(&self.last_settle) = Some(Instant::now());
        if let Some(e) = sent.into_iter().find_map(Result::err) {
            if !link.healthy() {
                self.invalidate(&link);
            }
            return Err(backend(
                format!("{} {} message(s)", how.verb(), tags.len()),
                e,
            ));
        }
        refused.map_or(Ok(()), Err)
    }

    /// Settles `ids`, some of which are ids a listing showed (message ids)
    /// rather than delivery ids: the delivery ids as usual, the others by
    /// finding the messages (see [`Shared::settle_listed`]). Every id that
    /// can be is settled; the first error is returned.
    async fn settle_with_listed(
        &self,
        ids: &[DeliveryId],
        how: Settle,
    ) -> Result<(), TransportError> {
        let (delivered, listed): (Vec<&DeliveryId>, Vec<&DeliveryId>) =
            ids.iter().partition(|id| parse_id(id.as_str()).is_some());
        let delivered: Vec<DeliveryId> = delivered.into_iter().cloned().collect();
        let first = if delivered.is_empty() {
            Ok(())
        } else {
            Box::pin(self.settle(&delivered, how)).await
        };
        let second = self.settle_listed(&listed, how).await;
        first.and(second)
    }

    /// Why `ids` cannot be settled while no connection is open: the
    /// connection that delivered them is gone, and so are the deliveries
    /// (the broker put them back). Unknown ids stay unknown.
    fn settle_without_link(&self, ids: &[DeliveryId]) -> TransportError {
        let delivered = ids
            .iter()
            .find(|id| parse_id(id.as_str()).is_some_and(|(e, _)| e > 0));
        match delivered {
            Some(_) if self.closed.load(std::sync::atomic::Ordering::SeqCst) => {
                TransportError::Closed
            }
            Some(id) => stale(id, format!("settling `{id}`")),
            None => TransportError::NotFound(ids[0].to_string()),
        }
    }

    /// Restarts the lease of `id`.
    pub(crate) fn keepalive(&self, id: &DeliveryId) -> Result<(), TransportError> {
        let Some((epoch, tag)) = parse_id(id.as_str()) else {
            return Err(TransportError::NotFound(id.to_string()));
        };
        let mut state = lock(&self.consume);
        if state.epoch != epoch {
            return Err(if epoch > 0 && epoch < state.epoch {
                stale(id, format!("keeping `{id}` alive"))
            } else {
                TransportError::NotFound(id.to_string())
            });
        }
        match state.leased.get_mut(&tag) {
            Some(held) => {
                if let Some(lease) = self.config.lease {
                    held.deadline = Instant::now() + lease;
                }
                Ok(())
            }
            None => Err(TransportError::NotFound(id.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_ids_parse_back_to_their_epoch_and_tag() {
        for (epoch, tag) in [(1, 1), (0, 0), (7, 1_234_567), (u64::MAX, u64::MAX)] {
            let id = delivery_id(epoch, tag);
            assert_eq!(id, format!("{epoch}:{tag}"));
            assert_eq!(parse_id(&id), Some((epoch, tag)));
        }
        assert_eq!(parse_id("7"), None);
        assert_eq!(parse_id("a:1"), None);
    }

    #[test]
    fn acks_below_the_floor_go_in_one_frame() {
        assert_eq!(
            ack_frames(vec![5, 1, 2, 7], 4),
            [(2, true), (5, false), (7, false)]
        );
        assert_eq!(ack_frames(vec![3], 4), [(3, false)]);
        assert_eq!(ack_frames(vec![6, 5], 4), [(5, false), (6, false)]);
    }
}
