//! Taking over entries: `XAUTOCLAIM` of what other consumers (or this
//! one) left pending longer than the lease, and the entries given back to
//! the group (released, or read ahead and not handed out).

use std::collections::HashSet;
use std::time::Instant;

use envoi_core::transport::Delivery;
use envoi_core::TransportError;
use redis::Value;

use super::RedisTransport;
use crate::codec::{self, Entries};
use crate::keys::{millis, RELEASE_CONSUMER};
use crate::scripts;

/// The most entries given back that one `get` claims (a script's `unpack`
/// takes a few thousand values at most).
const CLAIM_RELEASED_MAX: usize = 1000;

impl RedisTransport {
    /// When a scan of the pending list is due (every quarter lease, kept
    /// between 50 ms and 5 s, and at once while a scan has more to go),
    /// claims up to `max` entries idle longer than the lease. Returns them,
    /// or `None` when there were none (then idle consumers are pruned, when
    /// that is due).
    pub(super) async fn reclaim_if_due(
        &self,
        now: Instant,
        max: usize,
    ) -> Result<Option<Vec<Delivery>>, TransportError> {
        let claim_from = {
            let mut chores = self.chores();
            (now >= chores.next_reclaim).then(|| {
                chores.next_reclaim = now + self.claim_interval;
                chores.claim_cursor.clone()
            })
        };
        let Some(cursor) = claim_from else {
            return Ok(None);
        };
        let (next, claimed) = match self.reclaim(&cursor, max).await {
            Ok(claimed) => claimed,
            Err(e) => {
                self.chores().next_reclaim = now;
                return Err(e);
            }
        };
        {
            let mut chores = self.chores();
            if next != "0-0" {
                // More of the pending list to scan: go on next time.
                chores.next_reclaim = now;
            }
            chores.claim_cursor = next;
        }
        if !claimed.is_empty() {
            return Ok(Some(claimed));
        }
        self.maybe_prune(now).await;
        Ok(None)
    }

    /// Claims up to `max` entries idle longer than the lease, scanning from
    /// `cursor`. Returns the next cursor and what was claimed, every entry
    /// marked as redelivered.
    async fn reclaim(
        &self,
        cursor: &str,
        max: usize,
    ) -> Result<(String, Vec<Delivery>), TransportError> {
        let mut cmd = redis::cmd("XAUTOCLAIM");
        cmd.arg(&self.keys.stream)
            .arg(&self.keys.group)
            .arg(&self.keys.consumer)
            .arg(millis(self.config.lease))
            .arg(cursor)
            .arg("COUNT")
            .arg(max);
        let reply: Value = self
            .shared
            .run("XAUTOCLAIM", |mut c| {
                let cmd = &cmd;
                async move { cmd.query_async(&mut c).await }
            })
            .await?;
        let (next, entries) =
            codec::decode_autoclaim(reply).map_err(|e| TransportError::backend("XAUTOCLAIM", e))?;
        self.drop_deleted(&entries).await?;
        if !entries.deliveries.is_empty() {
            tracing::debug!(
                stream = %self.keys.stream,
                consumer = %self.keys.consumer,
                count = entries.deliveries.len(),
                "reclaimed entries whose lease expired"
            );
        }
        // Handed out before and not acknowledged in time: marked, so a
        // deduplicating handler takes over the key a dead consumer claimed.
        let deliveries = entries
            .deliveries
            .into_iter()
            .map(Delivery::mark_redelivered)
            .collect();
        Ok((next, deliveries))
    }

    /// When it is time to look for them (every
    /// [`RELEASE_POLL`](super::chores::RELEASE_POLL), and at once after this
    /// handle gave one back), claims up to `max` entries given back to the
    /// group, oldest first. Returns them, or `None` when there were none;
    /// those handed out before are marked as redelivered.
    pub(super) async fn claim_released_if_due(
        &self,
        now: Instant,
        max: usize,
    ) -> Result<Option<Vec<Delivery>>, TransportError> {
        if !self.chores().release_check_due(now) {
            return Ok(None);
        }
        let claimed = match self.claim_released(max).await {
            Ok(claimed) => claimed,
            Err(e) => {
                self.chores().released_at(now);
                return Err(e);
            }
        };
        if claimed.len() >= max.min(CLAIM_RELEASED_MAX) {
            // There may be more: look again on the next `get`.
            self.chores().released_at(now);
        }
        Ok((!claimed.is_empty()).then_some(claimed))
    }

    /// Claims up to `max` entries given back to the group.
    async fn claim_released(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        let mut invocation = scripts::CLAIM_RELEASED.prepare_invoke();
        invocation
            .key(&self.keys.stream)
            .arg(&self.keys.group)
            .arg(RELEASE_CONSUMER)
            .arg(&self.keys.consumer)
            .arg(max.min(CLAIM_RELEASED_MAX));
        let reply: Value = self
            .shared
            .run("claiming released messages", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        let (entries, again) = codec::decode_released(reply)
            .map_err(|e| TransportError::backend("claiming released messages", e))?;
        self.drop_deleted(&entries).await?;
        let again: HashSet<String> = again.into_iter().collect();
        Ok(entries
            .deliveries
            .into_iter()
            .map(|d| {
                if again.contains(d.id.as_str()) {
                    d.mark_redelivered()
                } else {
                    d
                }
            })
            .collect())
    }

    /// Entries deleted while pending carry nothing to deliver; settle them so
    /// they leave the pending list (Redis 7 already drops them itself).
    pub(super) async fn drop_deleted(&self, entries: &Entries) -> Result<(), TransportError> {
        if entries.deleted.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = entries.deleted.iter().map(String::as_str).collect();
        self.settle(&ids).await
    }
}
