//! Claiming: leasing available rows to a `get`, claiming the next batch
//! ahead, giving back rows claimed and never handed out, and waiting for
//! messages to arrive.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use envoi_core::transport::Delivery;
use envoi_core::TransportError;
use sqlx::postgres::PgPool;
use sqlx::{AssertSqlSafe, Row};
use tokio::time::Instant;

use crate::rows::{parse_id, row_to_delivery};
use crate::transport::Inner;

/// A `get` this large that comes back full claims the next batch at once
/// (see "Claiming ahead" on [`PostgresTransport`](crate::PostgresTransport));
/// smaller ones never do.
const CLAIM_AHEAD_MIN: usize = 100;

impl Inner {
    /// Hands out up to `max` (at most `batch`) messages: claimed ahead, or
    /// claimed now, waiting up to `wait` for a notification when none is
    /// available.
    pub(crate) async fn get(self: &Arc<Self>, max: usize) -> Result<Vec<Delivery>, TransportError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let want = max.min(self.config.batch);
        let limit = i64::try_from(want).unwrap_or(i64::MAX);
        self.ensure_listener();
        let ahead = self.take_ahead(want).await?;
        if !ahead.is_empty() {
            self.claim_ahead(want, ahead.len());
            return Ok(ahead);
        }
        let deadline = Instant::now() + self.config.wait;
        loop {
            // Subscribe before claiming: a wake that arrives while the claim
            // runs makes the wait below return at once.
            let mut wakes = self.wake.subscribe();
            self.claimed_generation
                .store(*wakes.borrow_and_update(), Ordering::Relaxed);
            let got = self.claim(limit).await?;
            if !got.is_empty() {
                self.claim_ahead(want, got.len());
                return Ok(got);
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Ok(got);
            }
            match tokio::time::timeout(remaining, wakes.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) | Err(_) => return Ok(got),
            }
        }
    }

    /// One claim statement: leases up to `limit` available messages, in
    /// queue order, marking those handed out before as redelivered.
    pub(crate) async fn claim(&self, limit: i64) -> Result<Vec<Delivery>, TransportError> {
        let rows = self
            .retrying("claiming messages", || {
                sqlx::query(AssertSqlSafe(self.sql.claim.clone()))
                    .bind(self.name.as_str())
                    .bind(limit)
                    .bind(self.lease_secs)
                    .fetch_all(&self.pool)
            })
            .await?;
        let unreadable = |e| self.error("reading claimed messages", e);
        // RETURNING does not keep the sub-select's order: sort by
        // (available_at, id) again.
        let mut keyed = Vec::with_capacity(rows.len());
        for row in &rows {
            let at: i64 = row.try_get(3).map_err(unreadable)?;
            let id: i64 = row.try_get(0).map_err(unreadable)?;
            let mut delivery = row_to_delivery(row).map_err(unreadable)?;
            // Claimed before and not acknowledged: its lease ran out, or it
            // was released.
            if row.try_get::<i32, _>(4).is_ok_and(|count| count > 1) {
                delivery = delivery.mark_redelivered();
            }
            keyed.push(((at, id), delivery));
        }
        keyed.sort_by_key(|(key, _)| *key);
        Ok(keyed.into_iter().map(|(_, d)| d).collect())
    }

    /// Up to `want` rows claimed ahead, waiting for a claim in flight. Rows
    /// that waited longer than half a lease are given back instead (those
    /// past their whole lease are left alone: they may be another
    /// consumer's by now).
    async fn take_ahead(&self, want: usize) -> Result<Vec<Delivery>, TransportError> {
        let taken = self.ahead.take(want).await?;
        self.unclaim(taken.stale).await;
        Ok(taken.fresh)
    }

    /// After a `get` of `want` (at least [`CLAIM_AHEAD_MIN`]) that handed out
    /// `got == want` rows, claims the next `want` in the background.
    fn claim_ahead(self: &Arc<Self>, want: usize, got: usize) {
        if want < CLAIM_AHEAD_MIN || got < want {
            return;
        }
        let inner = Arc::clone(self);
        let limit = i64::try_from(want).unwrap_or(i64::MAX);
        self.ahead
            .fetch_ahead(async move { inner.claim(limit).await });
    }

    /// Ends the leases of `rows`, claimed but never handed out: their
    /// delivery does not count.
    pub(crate) async fn unclaim(&self, rows: Vec<Delivery>) {
        let ids: Vec<i64> = rows.iter().filter_map(|d| parse_id(&d.id)).collect();
        if ids.is_empty() {
            return;
        }
        let given_back = self
            .retrying("giving back rows claimed ahead", || {
                sqlx::query(AssertSqlSafe(self.sql.unclaim.clone()))
                    .bind(&ids)
                    .bind(self.name.as_str())
                    .execute(&self.pool)
            })
            .await;
        match given_back {
            Ok(_) => self.notify_consumers(),
            Err(error) => {
                tracing::debug!(%error, "postgres: rows claimed ahead wait for their lease to end")
            }
        }
    }

    /// Returns when a notification for this queue arrived since the latest
    /// claim started, or after `timeout` capped at the poll interval.
    pub(crate) async fn wait_for_messages(&self, timeout: Duration) {
        self.ensure_listener();
        let mut wakes = self.wake.subscribe();
        if *wakes.borrow_and_update() != self.claimed_generation.load(Ordering::Relaxed) {
            // Woken since the latest claim started: there may be messages.
            return;
        }
        // Delays coming due and leases expiring send no notification: poll.
        let timeout = timeout.min(self.config.poll_interval);
        let _ = tokio::time::timeout(timeout, wakes.changed()).await;
    }
}

/// Gives back the rows `rows` yields (claimed ahead for a transport being
/// dropped, still within their lease), on `pool` with the `unclaim`
/// statement, without retrying: what is not given back waits for its lease
/// to end.
pub(crate) async fn give_back_later(
    rows: impl Future<Output = Vec<Delivery>>,
    pool: PgPool,
    unclaim: Arc<str>,
    name: String,
) {
    let rows = rows.await;
    let ids: Vec<i64> = rows.iter().filter_map(|d| parse_id(&d.id)).collect();
    if ids.is_empty() {
        return;
    }
    let given_back = sqlx::query(AssertSqlSafe(unclaim))
        .bind(&ids)
        .bind(name.as_str())
        .execute(&pool)
        .await;
    if let Err(error) = given_back {
        tracing::debug!(%error, "postgres: could not give back rows claimed ahead; they wait for their lease to end");
    }
}
