//! Rows a claim took beyond what `get` asked for (`batch=N`), kept leased
//! to the handle for its next calls while their lease is fresh.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use envoi_core::transport::Delivery;
use envoi_core::TransportError;

use crate::op::Op;
use crate::transport::{now_ms, parse_id, Inner};

/// The rows a handle keeps.
pub(crate) struct Prefetched {
    rows: Mutex<VecDeque<Kept>>,
    /// How long a kept row may be handed out after its claim: half the
    /// lease, so its handler still has the other half.
    fresh_for: Duration,
}

struct Kept {
    delivery: Delivery,
    claimed_at: Instant,
    /// The claim's time, its `delivered_at`: the row is still leased to
    /// this handle while `delivered_at` holds it (a later claim by anyone
    /// sets a later time).
    claim: i64,
}

impl Prefetched {
    /// Nothing kept, for rows leased for `lease`.
    pub(crate) fn new(lease: Duration) -> Self {
        Self {
            rows: Mutex::new(VecDeque::new()),
            fresh_for: lease / 2,
        }
    }

    fn rows(&self) -> MutexGuard<'_, VecDeque<Kept>> {
        self.rows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether no row is kept.
    pub(crate) fn is_empty(&self) -> bool {
        self.rows().is_empty()
    }

    /// Keeps `deliveries`, leased by the claim made at `claim`.
    pub(crate) fn keep(&self, deliveries: Vec<Delivery>, claim: i64) {
        let claimed_at = Instant::now();
        self.rows()
            .extend(deliveries.into_iter().map(|delivery| Kept {
                delivery,
                claimed_at,
                claim,
            }));
    }

    /// Up to `max` fresh rows to hand out, and the stale ones met on the
    /// way, `(id, claim)`, to give back.
    pub(crate) fn take(&self, max: usize) -> (Vec<Delivery>, Vec<(i64, i64)>) {
        let mut rows = self.rows();
        let mut fresh = Vec::new();
        let mut stale = Vec::new();
        while fresh.len() < max {
            let Some(kept) = rows.pop_front() else { break };
            if kept.claimed_at.elapsed() < self.fresh_for {
                fresh.push(kept.delivery);
            } else if let Some(id) = parse_id(kept.delivery.id.as_str()) {
                stale.push((id, kept.claim));
            }
        }
        (fresh, stale)
    }

    /// Takes every kept row out: `(id, claim)`.
    pub(crate) fn drain(&self) -> Vec<(i64, i64)> {
        self.rows()
            .drain(..)
            .filter_map(|k| Some((parse_id(k.delivery.id.as_str())?, k.claim)))
            .collect()
    }

    /// Forgets every kept row (they were deleted).
    pub(crate) fn clear(&self) {
        self.rows().clear();
    }
}

/// Kept rows, `(id, claim)`, by the claim that leased them: `(claim, ids)`.
pub(crate) fn by_claim(held: Vec<(i64, i64)>) -> Vec<(i64, Vec<i64>)> {
    let mut claims: Vec<(i64, Vec<i64>)> = Vec::new();
    for (id, claim) in held {
        match claims.iter_mut().find(|(c, _)| *c == claim) {
            Some((_, ids)) => ids.push(id),
            None => claims.push((claim, vec![id])),
        }
    }
    claims
}

impl Inner {
    /// Hands out up to `max` kept rows, giving back those kept so long that
    /// their lease may be running out.
    pub(crate) async fn take_prefetched(
        &self,
        max: usize,
    ) -> Result<Vec<Delivery>, TransportError> {
        if self.prefetched.is_empty() {
            return Ok(Vec::new());
        }
        let (fresh, stale) = self.prefetched.take(max);
        self.give_back(stale).await?;
        Ok(fresh)
    }

    /// Gives back rows kept by this handle, `(id, claim)`, those still
    /// leased under the claim that kept them: a row whose lease ran out
    /// may have been claimed by another consumer since, and stays its.
    pub(crate) async fn give_back(&self, held: Vec<(i64, i64)>) -> Result<(), TransportError> {
        for (claim, ids) in by_claim(held) {
            let now = now_ms();
            self.write("releasing messages", |reply| Op::Release {
                ids,
                now,
                claim: Some(claim),
                reply: Some(reply),
            })
            .await?;
        }
        Ok(())
    }
}
