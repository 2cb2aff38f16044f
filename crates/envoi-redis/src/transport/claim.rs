//! Taking over entries whose lease ran out: `XAUTOCLAIM` of what other
//! consumers (or this one) left pending longer than the lease.

use std::time::Instant;

use envoi_core::transport::Delivery;
use envoi_core::TransportError;
use redis::Value;

use super::RedisTransport;
use crate::codec::{self, Entries};
use crate::keys::millis;

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
