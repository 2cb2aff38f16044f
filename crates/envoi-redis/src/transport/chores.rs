//! The periodic chores of `get`: moving due delayed messages into the
//! stream, looking for entries given back to the group, trimming
//! acknowledged entries and pruning idle consumers, and when each is next
//! due.

use std::time::{Duration, Instant};

use envoi_core::TransportError;

use super::RedisTransport;
use crate::keys::millis;
use crate::scripts;

/// Due delayed messages are looked for at least this often while consuming.
const DELAY_POLL: Duration = Duration::from_millis(250);
/// Entries given back to the group by other handles are looked for at
/// least this often while consuming (at once after this handle gave one
/// back).
pub(super) const RELEASE_POLL: Duration = Duration::from_millis(250);
/// At most this many delayed messages move per script run.
const MOVE_LIMIT: usize = 1000;
/// How often acknowledged entries are trimmed from the head of the stream.
const TRIM_EVERY: Duration = Duration::from_secs(1);
/// How often a handle prunes idle consumers of its group.
const PRUNE_EVERY: Duration = Duration::from_secs(600);
/// Consumers idle at least this long with nothing pending are pruned (or ten
/// leases, when that is longer).
const PRUNE_IDLE: Duration = Duration::from_secs(3600);

/// When the periodic chores of `get` are next due.
#[derive(Debug)]
pub(super) struct Chores {
    pub(super) next_reclaim: Instant,
    /// Where the next `XAUTOCLAIM` scan of the pending list starts.
    pub(super) claim_cursor: String,
    /// When to look next for entries given back to the group.
    pub(super) next_release_check: Instant,
    next_delay_check: Instant,
    next_trim: Instant,
    /// The earliest due time of a delayed message this handle knows of.
    known_due: Option<Instant>,
    next_prune: Instant,
}

impl Chores {
    pub(super) fn new() -> Self {
        let now = Instant::now();
        Self {
            next_reclaim: now,
            claim_cursor: "0-0".to_string(),
            next_release_check: now,
            next_delay_check: now,
            next_trim: now,
            known_due: None,
            next_prune: now,
        }
    }

    /// A delayed message is due at `due`: look for it then at the latest.
    pub(super) fn expect_due(&mut self, due: Instant) {
        self.next_delay_check = self.next_delay_check.min(due);
        self.known_due = Some(self.known_due.map_or(due, |known| known.min(due)));
    }

    /// This handle gave an entry back at `at`: its next `get` looks for it.
    pub(super) fn released_at(&mut self, at: Instant) {
        self.next_release_check = self.next_release_check.min(at);
    }

    /// Whether it is time to look for entries given back to the group; if
    /// so, the next look is [`RELEASE_POLL`] later.
    pub(super) fn release_check_due(&mut self, now: Instant) -> bool {
        Self::take_due(&mut self.next_release_check, now, RELEASE_POLL)
    }

    /// How long a read may block: `block`, but not past the moment a known
    /// delayed message is due.
    pub(super) fn block_for(&self, block: Duration) -> Duration {
        match self.known_due {
            Some(due) => block.min(due.saturating_duration_since(Instant::now())),
            None => block,
        }
    }

    /// Whether a chore whose next run is `next` is due at `now`; if so, the
    /// run after is `every` later.
    fn take_due(next: &mut Instant, now: Instant, every: Duration) -> bool {
        let due = now >= *next;
        if due {
            *next = now + every;
        }
        due
    }
}

impl RedisTransport {
    /// Deletes the group's consumers that have nothing pending and have been
    /// idle at least `min_idle`, except this handle's own; returns how many.
    ///
    /// Handles are consumers of their own, so consumers of stopped processes
    /// stay listed in `XINFO CONSUMERS`; `get` runs this every ten minutes
    /// with a threshold of one hour (or ten leases). A consumer with pending
    /// entries is never deleted: that would orphan its entries.
    pub async fn prune_idle_consumers(&self, min_idle: Duration) -> Result<u64, TransportError> {
        let mut invocation = scripts::PRUNE_CONSUMERS.prepare_invoke();
        invocation
            .key(&self.keys.stream)
            .arg(&self.keys.group)
            .arg(millis(min_idle))
            .arg(&self.keys.consumer);
        let removed: i64 = self
            .shared
            .run("pruning idle consumers", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        Ok(u64::try_from(removed).unwrap_or(0))
    }

    /// Deletes the entries every consumer group of the stream has
    /// acknowledged from the head of the stream (`XTRIM MINID` up to the
    /// oldest entry some group still needs); returns how many. `get` runs
    /// this every second.
    pub async fn trim_acknowledged(&self) -> Result<u64, TransportError> {
        let mut invocation = scripts::TRIM_ACKED.prepare_invoke();
        invocation.key(&self.keys.stream);
        let trimmed: i64 = self
            .shared
            .run("trimming acknowledged entries", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        Ok(u64::try_from(trimmed).unwrap_or(0))
    }

    /// Trims acknowledged entries, at most every [`TRIM_EVERY`]. A failure
    /// is logged: the next run trims what this one left.
    pub(super) async fn maybe_trim(&self, now: Instant) {
        if !Chores::take_due(&mut self.chores().next_trim, now, TRIM_EVERY) {
            return;
        }
        if let Err(e) = self.trim_acknowledged().await {
            tracing::warn!(stream = %self.keys.stream, error = %e, "trimming acknowledged entries failed");
        }
    }

    /// Prunes idle consumers, at most every [`PRUNE_EVERY`].
    pub(super) async fn maybe_prune(&self, now: Instant) {
        if !Chores::take_due(&mut self.chores().next_prune, now, PRUNE_EVERY) {
            return;
        }
        let min_idle = PRUNE_IDLE.max(self.config.lease * 10);
        if let Err(e) = self.prune_idle_consumers(min_idle).await {
            tracing::warn!(stream = %self.keys.stream, error = %e, "pruning idle consumers failed");
        }
    }

    /// Moves due delayed messages into the stream, when it is time to look
    /// for them (every [`DELAY_POLL`], or when one this handle knows of is
    /// due).
    pub(super) async fn maybe_move_due(&self, now: Instant) -> Result<(), TransportError> {
        if !Chores::take_due(&mut self.chores().next_delay_check, now, DELAY_POLL) {
            return Ok(());
        }
        match self.move_due().await {
            Ok((moved, wait)) => {
                let mut chores = self.chores();
                chores.known_due = wait.map(|wait| Instant::now() + wait);
                if moved >= MOVE_LIMIT {
                    chores.next_delay_check = now;
                } else if let Some(due) = chores.known_due {
                    chores.next_delay_check = chores.next_delay_check.min(due);
                }
                Ok(())
            }
            Err(e) => {
                self.chores().next_delay_check = now;
                Err(e)
            }
        }
    }

    /// Runs the script moving due messages; returns how many moved and how
    /// long until the next one is due, if any waits.
    async fn move_due(&self) -> Result<(usize, Option<Duration>), TransportError> {
        let mut invocation = scripts::MOVE_DUE.prepare_invoke();
        invocation
            .key(&self.keys.delayed)
            .key(&self.keys.stream)
            .arg(MOVE_LIMIT)
            .arg(&self.keys.payload_prefix)
            .arg(&self.keys.trim);
        let (moved, wait): (i64, i64) = self
            .shared
            .run("moving due delayed messages", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        let wait = u64::try_from(wait).ok().map(Duration::from_millis);
        Ok((usize::try_from(moved).unwrap_or(0), wait))
    }
}
