//! [`RedisTransport`]: the [`Transport`] on Redis Streams.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use envoi_core::middleware::BoxFuture;
use envoi_core::transport::{Capabilities, Delivery, RawMessage, Transport};
use envoi_core::TransportError;
use redis::{Client, Cmd, RedisError, Value};
use uuid::Uuid;

use crate::codec::{self, Entries};
use crate::link::Link;
use crate::options::RedisOptions;
use crate::scripts;

/// Due delayed messages are looked for at least this often while consuming.
const DELAY_POLL: Duration = Duration::from_millis(250);
/// At most this many delayed messages move per script run.
const MOVE_LIMIT: usize = 1000;
/// Commands per pipeline in `send_batch`.
const SEND_CHUNK: usize = 500;
/// The longest delay accepted (about 100 years), in ms.
const MAX_DELAY_MS: u64 = 100 * 365 * 24 * 3600 * 1000;
/// How long a command on the shared connection may take.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often acknowledged entries are trimmed from the head of the stream.
const TRIM_EVERY: Duration = Duration::from_secs(1);
/// A `get` this large that comes back full reads the next batch ahead (see
/// [`Ahead`]); smaller ones never do.
const READ_AHEAD_MIN: usize = 100;
/// How often a handle prunes idle consumers of its group.
const PRUNE_EVERY: Duration = Duration::from_secs(600);
/// Consumers idle at least this long with nothing pending are pruned (or ten
/// leases, when that is longer).
const PRUNE_IDLE: Duration = Duration::from_secs(3600);

/// A [`Transport`] on one Redis stream, consumed through a consumer group.
///
/// * `send` is `XADD`; a delayed send stores the message in a sorted set
///   scored with its due time, and an atomic script moves due messages into
///   the stream (several workers never move one twice).
/// * `get` reclaims entries other consumers left pending longer than the
///   lease (`XAUTOCLAIM`), moves due delayed messages, then reads new entries
///   with `XREADGROUP ... BLOCK` on a connection of its own, so blocking
///   never holds up sends and acks on the shared one. A `get` of at least
///   100 entries that comes back full reads the next batch at once, so it
///   arrives while the caller handles this one (see `Ahead` in the source
///   for what becomes of entries read ahead and not handed out).
/// * `ack` / `reject` are `XACK`; every second, `get` trims the entries every
///   group has acknowledged from the head of the stream (`XTRIM MINID`), so
///   they do not pile up. `release` re-adds the entry at the end of the
///   stream and acknowledges the old one atomically; `keepalive` resets the
///   entry's idle time with `XCLAIM ... JUSTID` to its own consumer.
///
/// Every handle is a consumer of its own (the configured prefix plus a
/// random suffix), so two handles on one stream share the work.
///
/// ```no_run
/// use envoi_core::transport::{RawMessage, Transport};
/// use envoi_redis::RedisTransport;
///
/// # async fn demo() -> Result<(), envoi_core::TransportError> {
/// let transport = RedisTransport::from_dsn("orders", "redis://127.0.0.1:6379?lease=30s")?;
/// transport.setup().await?;
/// let id = transport.send(RawMessage { body: b"{}".to_vec(), ..Default::default() }, None).await?;
/// for delivery in transport.get(10).await? {
///     transport.ack(&delivery.id).await?;
/// }
/// # let _ = id;
/// # Ok(())
/// # }
/// ```
pub struct RedisTransport {
    options: RedisOptions,
    consumer: String,
    delayed_key: String,
    payload_prefix: String,
    trim: String,
    claim_interval: Duration,
    shared: Link,
    blocking: Arc<Link>,
    read_lock: tokio::sync::Mutex<()>,
    state: Mutex<State>,
    ahead: Mutex<Ahead>,
    ready: AtomicBool,
    /// Whether the last `get` failed (then `wait_for_messages` really waits).
    get_failed: AtomicBool,
}

/// Entries read ahead of the next `get`.
///
/// When a `get` of at least [`READ_AHEAD_MIN`] comes back full, the next
/// batch is read at once (without blocking) while the caller handles this
/// one, and the next `get` hands it out. Entries read ahead are this
/// consumer's pending entries like the ones handed out: should the handle go
/// away before handing them out, another consumer claims them once their
/// lease has passed. A `get` asking for fewer keeps the rest for the next
/// one; entries kept longer than half a lease are left to be claimed again
/// rather than handed out with little of their lease left.
#[derive(Default)]
struct Ahead {
    /// The read in flight, and when it started.
    reading: Option<(
        tokio::task::JoinHandle<Result<Entries, TransportError>>,
        Instant,
    )>,
    spare: VecDeque<Delivery>,
    /// When the read that gave `spare` started.
    read_at: Option<Instant>,
}

/// When the periodic chores of `get` are next due.
#[derive(Debug)]
struct State {
    next_reclaim: Instant,
    claim_cursor: String,
    next_delay_check: Instant,
    next_trim: Instant,
    /// The earliest due time of a delayed message this handle knows of.
    known_due: Option<Instant>,
    next_prune: Instant,
}

impl RedisTransport {
    /// A transport with `options`. Connects lazily, on first use.
    ///
    /// Fails with [`TransportError::InvalidDsn`] when the `redis` crate
    /// rejects [`RedisOptions::url`], or an option is one
    /// [`RedisOptions::from_dsn`] would refuse (the fields are public, so
    /// options may have been changed in code).
    pub fn new(options: RedisOptions) -> Result<Self, TransportError> {
        options
            .validate()
            .map_err(|reason| TransportError::InvalidDsn {
                dsn: envoi_core::transport::mask_dsn(&options.url),
                reason,
            })?;
        let client =
            Client::open(options.url.as_str()).map_err(|e| TransportError::InvalidDsn {
                dsn: envoi_core::transport::mask_dsn(&options.url),
                reason: e.to_string(),
            })?;
        let suffix = Uuid::new_v4().simple().to_string();
        let consumer = format!("{}-{}", options.consumer, &suffix[..16]);
        let client_name = client_name(&options.stream, &consumer);
        let now = Instant::now();
        Ok(Self {
            delayed_key: format!("{}:delayed", options.stream),
            payload_prefix: format!("{}:delayed:", options.stream),
            trim: options.trim.map(|n| n.to_string()).unwrap_or_default(),
            claim_interval: (options.lease / 4)
                .clamp(Duration::from_millis(50), Duration::from_secs(5)),
            shared: Link::new(client.clone(), client_name.clone(), RESPONSE_TIMEOUT),
            blocking: Arc::new(Link::new(
                client,
                format!("{client_name}:block"),
                options.block + RESPONSE_TIMEOUT,
            )),
            consumer,
            read_lock: tokio::sync::Mutex::new(()),
            state: Mutex::new(State {
                next_reclaim: now,
                claim_cursor: "0-0".to_string(),
                next_delay_check: now,
                next_trim: now,
                known_due: None,
                next_prune: now,
            }),
            ready: AtomicBool::new(false),
            get_failed: AtomicBool::new(false),
            ahead: Mutex::new(Ahead::default()),
            options,
        })
    }

    /// The transport called `name` on `dsn` (see [`RedisOptions::from_dsn`]).
    pub fn from_dsn(name: &str, dsn: &str) -> Result<Self, TransportError> {
        Self::new(RedisOptions::from_dsn(name, dsn)?)
    }

    /// The options it runs with.
    pub fn options(&self) -> &RedisOptions {
        &self.options
    }

    /// This handle's consumer name in the group, unique per handle.
    pub fn consumer_name(&self) -> &str {
        &self.consumer
    }

    /// The `CLIENT SETNAME` of this handle's two connections: the shared one
    /// (sends, acks, scripts) and the one dedicated to blocking reads. They
    /// identify the handle in `CLIENT LIST`, for instance to `CLIENT KILL` it.
    pub fn client_names(&self) -> [&str; 2] {
        [self.shared.name(), self.blocking.name()]
    }

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
            .key(&self.options.stream)
            .arg(&self.options.group)
            .arg(millis(min_idle))
            .arg(&self.consumer);
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
        invocation.key(&self.options.stream);
        let trimmed: i64 = self
            .shared
            .run("trimming acknowledged entries", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        Ok(u64::try_from(trimmed).unwrap_or(0))
    }

    /// Deletes everything this transport stores: the stream with its consumer
    /// group, the delay set and the delayed payloads. The next use creates
    /// them again.
    pub async fn destroy(&self) -> Result<(), TransportError> {
        let delayed: Vec<String> = self
            .shared
            .run("listing delayed messages", |mut c| {
                let key = &self.delayed_key;
                async move {
                    redis::cmd("ZRANGE")
                        .arg(key)
                        .arg(0)
                        .arg(-1)
                        .query_async(&mut c)
                        .await
                }
            })
            .await?;
        let mut keys: Vec<String> = delayed
            .iter()
            .map(|id| format!("{}{id}", self.payload_prefix))
            .collect();
        keys.push(self.options.stream.clone());
        keys.push(self.delayed_key.clone());
        for chunk in keys.chunks(500) {
            self.shared
                .run("deleting the transport's keys", |mut c| async move {
                    redis::cmd("DEL").arg(chunk).exec_async(&mut c).await
                })
                .await?;
        }
        self.ready.store(false, Ordering::SeqCst);
        let mut ahead = self.ahead();
        if let Some((reading, _)) = ahead.reading.take() {
            reading.abort();
        }
        ahead.spare.clear();
        Ok(())
    }

    fn ahead(&self) -> MutexGuard<'_, Ahead> {
        self.ahead.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn setup_group(&self) -> Result<(), TransportError> {
        let created = self
            .shared
            .run("creating the consumer group", |mut c| async move {
                redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(&self.options.stream)
                    .arg(&self.options.group)
                    .arg("0")
                    .arg("MKSTREAM")
                    .exec_async(&mut c)
                    .await
            })
            .await;
        match created {
            Ok(()) => {}
            Err(e) if redis_code(&e) == Some("BUSYGROUP") => {}
            Err(e) => return Err(e),
        }
        self.ready.store(true, Ordering::SeqCst);
        Ok(())
    }

    async fn ensure_ready(&self) -> Result<(), TransportError> {
        if self.ready.load(Ordering::SeqCst) {
            Ok(())
        } else {
            self.setup_group().await
        }
    }

    fn xadd(&self, raw: &RawMessage) -> Cmd {
        let (args, bytes) = codec::fields_size(raw);
        let mut cmd = Cmd::with_capacity(
            args + 6,
            bytes + 8 + self.options.stream.len() + self.trim.len(),
        );
        cmd.arg("XADD").arg(&self.options.stream);
        if !self.trim.is_empty() {
            cmd.arg("MAXLEN").arg("~").arg(&self.trim);
        }
        cmd.arg("*");
        codec::push_fields(&mut cmd, raw);
        cmd
    }

    fn send_delayed(&self, raw: &RawMessage, delay_ms: u64, id: &str) -> Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(scripts::SEND_DELAYED)
            .arg(2)
            .arg(&self.delayed_key)
            .arg(format!("{}{id}", self.payload_prefix))
            .arg(delay_ms)
            .arg(id);
        codec::push_fields(&mut cmd, raw);
        cmd
    }

    /// Makes this handle look for due messages no later than `delay` from now.
    fn expect_due(&self, delay_ms: u64) {
        // Thirty years at most: a longer delay would overflow an `Instant`.
        let delay = Duration::from_millis(delay_ms).min(Duration::from_secs(86_400 * 365 * 30));
        let due = Instant::now() + delay;
        let mut state = self.state();
        state.next_delay_check = state.next_delay_check.min(due);
        state.known_due = Some(state.known_due.map_or(due, |known| known.min(due)));
    }

    async fn send_one(
        &self,
        raw: RawMessage,
        delay: Option<Duration>,
    ) -> Result<String, TransportError> {
        match delay_ms(delay) {
            None => {
                let cmd = self.xadd(&raw);
                self.shared
                    .run("XADD", |mut c| {
                        let cmd = &cmd;
                        async move { cmd.query_async(&mut c).await }
                    })
                    .await
            }
            Some(ms) => {
                let id = Uuid::now_v7().to_string();
                let cmd = self.send_delayed(&raw, ms, &id);
                self.shared
                    .run("storing a delayed message", |mut c| {
                        let cmd = &cmd;
                        async move { cmd.exec_async(&mut c).await }
                    })
                    .await?;
                self.expect_due(ms);
                Ok(id)
            }
        }
    }

    async fn send_many(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> Result<Vec<String>, TransportError> {
        let mut ids = Vec::with_capacity(messages.len());
        for chunk in messages.chunks(SEND_CHUNK) {
            let mut pipe = redis::pipe();
            let mut planned: Vec<Option<String>> = Vec::with_capacity(chunk.len());
            let mut soonest: Option<u64> = None;
            for (raw, delay) in chunk {
                match delay_ms(*delay) {
                    None => {
                        pipe.add_command(self.xadd(raw));
                        planned.push(None);
                    }
                    Some(ms) => {
                        let id = Uuid::now_v7().to_string();
                        pipe.add_command(self.send_delayed(raw, ms, &id));
                        planned.push(Some(id));
                        soonest = Some(soonest.map_or(ms, |s| s.min(ms)));
                    }
                }
            }
            let replies: Vec<Value> = self
                .shared
                .run("XADD (batch)", |mut c| {
                    let pipe = &pipe;
                    async move { pipe.query_async(&mut c).await }
                })
                .await?;
            if let Some(ms) = soonest {
                self.expect_due(ms);
            }
            if replies.len() != planned.len() {
                return Err(TransportError::backend(
                    "XADD (batch)",
                    format!("{} replies for {} commands", replies.len(), planned.len()),
                ));
            }
            for (reply, planned) in replies.into_iter().zip(planned) {
                match planned {
                    Some(id) => ids.push(id),
                    None => ids.push(codec::string(reply.clone()).ok_or_else(|| {
                        TransportError::backend("XADD (batch)", codec::unexpected("XADD", &reply))
                    })?),
                }
            }
        }
        Ok(ids)
    }

    /// Claims up to `max` entries idle longer than the lease, scanning from
    /// `cursor`. Returns the next cursor and what was claimed.
    async fn reclaim(
        &self,
        cursor: &str,
        max: usize,
    ) -> Result<(String, Vec<Delivery>), TransportError> {
        let mut cmd = redis::cmd("XAUTOCLAIM");
        cmd.arg(&self.options.stream)
            .arg(&self.options.group)
            .arg(&self.consumer)
            .arg(millis(self.options.lease))
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
                stream = %self.options.stream,
                consumer = %self.consumer,
                count = entries.deliveries.len(),
                "reclaimed entries whose lease expired"
            );
        }
        // Handed out before and not acknowledged in time: marked, so a
        // deduplicating handler takes over the key a dead consumer claimed.
        let deliveries = entries
            .deliveries
            .into_iter()
            .map(Delivery::redelivered)
            .collect();
        Ok((next, deliveries))
    }

    /// Entries deleted while pending carry nothing to deliver; settle them so
    /// they leave the pending list (Redis 7 already drops them itself).
    async fn drop_deleted(&self, entries: &Entries) -> Result<(), TransportError> {
        if entries.deleted.is_empty() {
            return Ok(());
        }
        self.settle(&entries.deleted).await
    }

    async fn move_due(&self) -> Result<(usize, Option<Duration>), TransportError> {
        let mut invocation = scripts::MOVE_DUE.prepare_invoke();
        invocation
            .key(&self.delayed_key)
            .key(&self.options.stream)
            .arg(MOVE_LIMIT)
            .arg(&self.payload_prefix)
            .arg(&self.trim);
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

    /// `XREADGROUP` for up to `max` new entries of this consumer, waiting
    /// up to `block` for one when given.
    fn read_new_cmd(&self, max: usize, block: Option<Duration>) -> redis::Cmd {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.options.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(max);
        if let Some(block) = block {
            cmd.arg("BLOCK").arg(millis(block).max(1));
        }
        cmd.arg("STREAMS").arg(&self.options.stream).arg(">");
        cmd
    }

    async fn read_new(&self, max: usize, block: Duration) -> Result<Vec<Delivery>, TransportError> {
        let _reading = self.read_lock.lock().await;
        let cmd = self.read_new_cmd(max, Some(block));
        let reply: Value = self
            .blocking
            .run("XREADGROUP", |mut c| {
                let cmd = &cmd;
                async move { cmd.query_async(&mut c).await }
            })
            .await?;
        let entries =
            codec::decode_read(reply).map_err(|e| TransportError::backend("XREADGROUP", e))?;
        self.drop_deleted(&entries).await?;
        Ok(entries.deliveries)
    }

    async fn get_once(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        self.ensure_ready().await?;
        let now = Instant::now();

        let claim_from = {
            let mut state = self.state();
            (now >= state.next_reclaim).then(|| {
                state.next_reclaim = now + self.claim_interval;
                state.claim_cursor.clone()
            })
        };
        if let Some(cursor) = claim_from {
            match self.reclaim(&cursor, max).await {
                Ok((next, claimed)) => {
                    let mut state = self.state();
                    if next != "0-0" {
                        // More of the pending list to scan: go on next time.
                        state.next_reclaim = now;
                    }
                    state.claim_cursor = next;
                    drop(state);
                    if !claimed.is_empty() {
                        return Ok(claimed);
                    }
                }
                Err(e) => {
                    self.state().next_reclaim = now;
                    return Err(e);
                }
            }
            self.maybe_prune(now).await;
        }

        self.maybe_trim(now).await;

        let move_due = {
            let mut state = self.state();
            (now >= state.next_delay_check).then(|| state.next_delay_check = now + DELAY_POLL)
        };
        if move_due.is_some() {
            match self.move_due().await {
                Ok((moved, wait)) => {
                    let mut state = self.state();
                    state.known_due = wait.map(|wait| Instant::now() + wait);
                    if moved >= MOVE_LIMIT {
                        state.next_delay_check = now;
                    } else if let Some(due) = state.known_due {
                        state.next_delay_check = state.next_delay_check.min(due);
                    }
                }
                Err(e) => {
                    self.state().next_delay_check = now;
                    return Err(e);
                }
            }
        }

        let ahead = self.take_ahead(max).await?;
        if !ahead.is_empty() {
            self.read_ahead(max, ahead.len());
            return Ok(ahead);
        }

        // Do not sleep through the moment a known delayed message is due.
        let block = match self.state().known_due {
            Some(due) => self
                .options
                .block
                .min(due.saturating_duration_since(Instant::now())),
            None => self.options.block,
        };
        let got = self.read_new(max, block).await?;
        self.read_ahead(max, got.len());
        Ok(got)
    }

    /// Up to `max` entries read ahead (see [`Ahead`]), waiting for a read in
    /// flight.
    async fn take_ahead(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        let reading = self.ahead().reading.take();
        if let Some((reading, read_at)) = reading {
            // A failed or aborted read leaves nothing to hand out; what it
            // may have read is claimed again after its lease.
            if let Ok(read) = reading.await {
                let entries = read?;
                self.drop_deleted(&entries).await?;
                let mut ahead = self.ahead();
                ahead.spare.extend(entries.deliveries);
                ahead.read_at = Some(read_at);
            }
        }
        let mut ahead = self.ahead();
        if ahead
            .read_at
            .is_some_and(|at| at.elapsed() > self.options.lease / 2)
        {
            ahead.spare.clear();
        }
        let n = max.min(ahead.spare.len());
        Ok(ahead.spare.drain(..n).collect())
    }

    /// After a `get` of `max` (at least [`READ_AHEAD_MIN`]) that handed out
    /// `got == max` entries, reads the next `max` new entries in the
    /// background, unless some are still kept from the last read.
    fn read_ahead(&self, max: usize, got: usize) {
        if max < READ_AHEAD_MIN || got < max {
            return;
        }
        let mut ahead = self.ahead();
        if ahead.reading.is_some() || !ahead.spare.is_empty() {
            return;
        }
        let cmd = self.read_new_cmd(max, None);
        // On the reading connection: a large reply there does not hold up
        // the acknowledgements on the shared one.
        let link = Arc::clone(&self.blocking);
        let started = Instant::now();
        let reading = tokio::spawn(async move {
            let reply: Value = link
                .run("XREADGROUP", |mut c| {
                    let cmd = &cmd;
                    async move { cmd.query_async(&mut c).await }
                })
                .await?;
            codec::decode_read(reply).map_err(|e| TransportError::backend("XREADGROUP", e))
        });
        ahead.reading = Some((reading, started));
    }

    async fn maybe_trim(&self, now: Instant) {
        let due = {
            let mut state = self.state();
            (now >= state.next_trim).then(|| state.next_trim = now + TRIM_EVERY)
        };
        if due.is_some() {
            if let Err(e) = self.trim_acknowledged().await {
                tracing::warn!(stream = %self.options.stream, error = %e, "trimming acknowledged entries failed");
            }
        }
    }

    async fn maybe_prune(&self, now: Instant) {
        let due = {
            let mut state = self.state();
            (now >= state.next_prune).then(|| state.next_prune = now + PRUNE_EVERY)
        };
        if due.is_some() {
            let min_idle = PRUNE_IDLE.max(self.options.lease * 10);
            if let Err(e) = self.prune_idle_consumers(min_idle).await {
                tracing::warn!(stream = %self.options.stream, error = %e, "pruning idle consumers failed");
            }
        }
    }

    /// Acknowledges the entries among `ids` (ids that are not pending are
    /// ignored by Redis; ids that are not stream ids are skipped).
    async fn settle(&self, ids: &[String]) -> Result<(), TransportError> {
        let valid: Vec<&str> = ids
            .iter()
            .map(String::as_str)
            .filter(|id| codec::is_stream_id(id))
            .collect();
        if valid.is_empty() {
            return Ok(());
        }
        let mut cmd = redis::cmd("XACK");
        cmd.arg(&self.options.stream)
            .arg(&self.options.group)
            .arg(&valid);
        let _acked: i64 = self
            .shared
            .run("XACK", |mut c| {
                let cmd = &cmd;
                async move { cmd.query_async(&mut c).await }
            })
            .await?;
        Ok(())
    }

    async fn release_one(&self, id: &str) -> Result<(), TransportError> {
        if !codec::is_stream_id(id) {
            return Err(TransportError::NotFound(id.to_string()));
        }
        let mut invocation = scripts::RELEASE.prepare_invoke();
        invocation
            .key(&self.options.stream)
            .arg(&self.options.group)
            .arg(id)
            .arg(&self.trim);
        let readded: Option<String> = self
            .shared
            .run("releasing a message", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        match readded {
            Some(_) => Ok(()),
            None => Err(TransportError::NotFound(id.to_string())),
        }
    }

    async fn keepalive_one(&self, id: &str) -> Result<(), TransportError> {
        if !codec::is_stream_id(id) {
            return Err(TransportError::NotFound(id.to_string()));
        }
        let mut invocation = scripts::KEEPALIVE.prepare_invoke();
        invocation
            .key(&self.options.stream)
            .arg(&self.options.group)
            .arg(id)
            .arg(&self.consumer);
        let renewed: i64 = self
            .shared
            .run("XCLAIM (keepalive)", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        match renewed {
            1 => Ok(()),
            -1 => {
                tracing::debug!(id, consumer = %self.consumer, "keepalive: another consumer claimed the message");
                Err(TransportError::NotFound(id.to_string()))
            }
            _ => Err(TransportError::NotFound(id.to_string())),
        }
    }

    async fn count(&self) -> Result<u64, TransportError> {
        let mut invocation = scripts::COUNT.prepare_invoke();
        invocation
            .key(&self.options.stream)
            .key(&self.delayed_key)
            .arg(&self.options.group);
        let n: i64 = self
            .shared
            .run("counting messages", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn delayed_payloads(&self, ids: Vec<String>) -> Result<Vec<Delivery>, TransportError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.cmd("HGETALL")
                .arg(format!("{}{id}", self.payload_prefix));
        }
        let replies: Vec<Value> = self
            .shared
            .run("reading delayed messages", |mut c| {
                let pipe = &pipe;
                async move { pipe.query_async(&mut c).await }
            })
            .await?;
        let mut out = Vec::with_capacity(ids.len());
        for (id, reply) in ids.into_iter().zip(replies) {
            let fields = match reply {
                Value::Array(fields) => fields,
                Value::Map(pairs) => pairs.into_iter().flat_map(|(k, v)| [k, v]).collect(),
                other => {
                    return Err(TransportError::backend(
                        "reading delayed messages",
                        codec::unexpected("HGETALL", &other),
                    ))
                }
            };
            // Moved into the stream between the two reads.
            if fields.is_empty() {
                continue;
            }
            let raw = codec::decode_fields(fields)
                .map_err(|e| TransportError::backend("reading delayed messages", e))?;
            out.push(Delivery { id, raw });
        }
        Ok(out)
    }

    async fn list_some(&self, limit: usize) -> Result<Vec<Delivery>, TransportError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut invocation = scripts::LIST.prepare_invoke();
        invocation
            .key(&self.options.stream)
            .arg(&self.options.group)
            .arg(limit);
        let reply: Value = self
            .shared
            .run("listing messages", |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut c).await }
            })
            .await?;
        let mut out = codec::decode_entries(reply, "listing messages")
            .map_err(|e| TransportError::backend("listing messages", e))?
            .deliveries;
        if out.len() < limit {
            let room = limit - out.len();
            let ids: Vec<String> = self
                .shared
                .run("listing delayed messages", |mut c| async move {
                    redis::cmd("ZRANGE")
                        .arg(&self.delayed_key)
                        .arg(0)
                        .arg(room.saturating_sub(1))
                        .query_async(&mut c)
                        .await
                })
                .await?;
            out.extend(self.delayed_payloads(ids).await?);
        }
        Ok(out)
    }

    async fn find_one(&self, id: &str) -> Result<Option<Delivery>, TransportError> {
        if codec::is_stream_id(id) {
            let mut invocation = scripts::FIND.prepare_invoke();
            invocation
                .key(&self.options.stream)
                .arg(&self.options.group)
                .arg(id);
            let reply: Value = self
                .shared
                .run("finding a message", |mut c| {
                    let invocation = &invocation;
                    async move { invocation.invoke_async(&mut c).await }
                })
                .await?;
            let entries = codec::decode_entries(reply, "finding a message")
                .map_err(|e| TransportError::backend("finding a message", e))?;
            Ok(entries.deliveries.into_iter().find(|d| d.id == id))
        } else if Uuid::parse_str(id).is_ok() {
            Ok(self.delayed_payloads(vec![id.to_string()]).await?.pop())
        } else {
            Ok(None)
        }
    }
}

impl Transport for RedisTransport {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(self.send_one(message, delay))
    }

    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        Box::pin(self.send_many(messages))
    }

    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            if max == 0 {
                return Ok(Vec::new());
            }
            let got = match self.get_once(max).await {
                Err(e) if redis_code(&e) == Some("NOGROUP") => {
                    // The stream or group was deleted under us: recreate it.
                    self.ready.store(false, Ordering::SeqCst);
                    self.get_once(max).await
                }
                other => other,
            };
            self.get_failed.store(got.is_err(), Ordering::SeqCst);
            got
        })
    }

    fn ack<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.settle(&[id.to_string()]).await })
    }

    fn ack_batch<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.settle(ids))
    }

    fn reject<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.settle(&[id.to_string()]).await })
    }

    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.release_one(id))
    }

    fn keepalive<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.keepalive_one(id))
    }

    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(self.setup_group())
    }

    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(self.count())
    }

    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(self.list_some(limit))
    }

    fn find<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        Box::pin(self.find_one(id))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }

    /// Returns at once: `get` itself already waited on the server (up to
    /// `block`) and wakes as soon as an entry is added, so sleeping here
    /// would only delay the next message. After a failed `get` (server
    /// unreachable, for instance) it sleeps the whole `timeout`, so callers
    /// do not retry in a tight loop.
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        let failed = self.get_failed.load(Ordering::SeqCst);
        Box::pin(async move {
            if failed {
                tokio::time::sleep(timeout).await;
            }
        })
    }
}

impl fmt::Debug for RedisTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTransport")
            .field("options", &self.options)
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

/// The server's error code (`BUSYGROUP`, `NOGROUP`, ...) behind `e`, if any.
fn redis_code(e: &TransportError) -> Option<&str> {
    match e {
        TransportError::Backend { source, .. } => source.downcast_ref::<RedisError>()?.code(),
        _ => None,
    }
}

/// `CLIENT SETNAME` takes no spaces nor special characters.
fn client_name(stream: &str, consumer: &str) -> String {
    format!("envoi:{stream}:{consumer}")
        .chars()
        .map(|c| if c.is_ascii_graphic() { c } else { '_' })
        .collect()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A delay worth storing (at least 1 ms), capped at about a century.
fn delay_ms(delay: Option<Duration>) -> Option<u64> {
    delay
        .filter(|d| !d.is_zero())
        .map(|d| millis(d).clamp(1, MAX_DELAY_MS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_refuses_options_changed_in_code_as_from_dsn_would() {
        let base = RedisOptions::from_dsn("q", "redis://127.0.0.1:1").unwrap();
        type Change = (&'static str, fn(&mut RedisOptions));
        let changes: [Change; 4] = [
            ("lease", |o| o.lease = Duration::ZERO),
            ("lease", |o| o.lease = Duration::from_secs(400 * 86_400)),
            ("block", |o| o.block = Duration::from_secs(3600)),
            ("trim", |o| o.trim = Some(0)),
        ];
        for (option, change) in changes {
            let mut options = base.clone();
            change(&mut options);
            match RedisTransport::new(options) {
                Err(TransportError::InvalidDsn { reason, .. }) => {
                    assert!(reason.contains(option), "{option}: {reason}")
                }
                other => panic!("{option}: expected InvalidDsn, got {:?}", other.err()),
            }
        }
    }

    #[test]
    fn client_names_hold_no_spaces_or_control_characters() {
        assert_eq!(client_name("my stream", "c\n1"), "envoi:my_stream:c_1");
        assert_eq!(
            client_name("envoi:a", "consumer-1"),
            "envoi:envoi:a:consumer-1"
        );
    }

    #[test]
    fn delays_round_up_to_a_millisecond_and_zero_means_none() {
        assert_eq!(delay_ms(None), None);
        assert_eq!(delay_ms(Some(Duration::ZERO)), None);
        assert_eq!(delay_ms(Some(Duration::from_micros(10))), Some(1));
        assert_eq!(delay_ms(Some(Duration::from_secs(2))), Some(2000));
        assert_eq!(delay_ms(Some(Duration::MAX)), Some(MAX_DELAY_MS));
    }

    #[test]
    fn every_handle_gets_its_own_consumer_name() {
        let options =
            RedisOptions::from_dsn("t", "redis://127.0.0.1:6379?consumer=worker").unwrap();
        let a = RedisTransport::new(options.clone()).unwrap();
        let b = RedisTransport::new(options).unwrap();
        assert!(a.consumer_name().starts_with("worker-"));
        assert_ne!(a.consumer_name(), b.consumer_name());
        assert_ne!(a.client_names(), b.client_names());
        assert!(a.client_names()[1].ends_with(":block"));
    }
}
