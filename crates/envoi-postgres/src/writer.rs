//! The writer of one transport value: a background task that stores the
//! sends waiting for it with one multi-row `INSERT`, and answers each.

use std::sync::{Arc, Weak};

use envoi_core::TransportError;
use sqlx::AssertSqlSafe;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use crate::retry::is_connection_error;
use crate::transport::{AbortOnDrop, Inner};

/// Most rows one grouped `INSERT` stores.
const GROUP_ROWS: usize = 1000;
/// Sends that must be waiting before a second grouped `INSERT` starts
/// while one runs.
const JOIN_ROWS: usize = 16;
/// Most body bytes one grouped `INSERT` carries (a bigger group is split).
const GROUP_BYTES: usize = 8 * 1024 * 1024;

/// A send waiting for the writer.
pub(crate) struct PendingSend {
    pub(crate) body: Vec<u8>,
    /// The headers as JSON text.
    pub(crate) headers: String,
    /// The delay in seconds.
    pub(crate) delay: f64,
    pub(crate) reply: oneshot::Sender<Result<i64, TransportError>>,
}

/// What the writer answers a send.
type Reply = Result<i64, TransportError>;

/// The writer of one transport value: a task storing the sends queued on
/// `queue`, grouped.
pub(crate) struct Writer {
    pub(crate) queue: mpsc::UnboundedSender<PendingSend>,
    pub(crate) task: AbortOnDrop,
}

impl Writer {
    /// Grouped statements in flight at once.
    fn parallelism(inner: &Inner) -> usize {
        let connections = inner.pool.options().get_max_connections() as usize;
        (connections / 4).clamp(1, 2)
    }

    /// Starts the writer of `inner`.
    pub(crate) fn start(inner: &Arc<Inner>) -> Self {
        let (queue, pending) = mpsc::unbounded_channel();
        let parallel = Self::parallelism(inner);
        let task = tokio::spawn(Self::run(Arc::downgrade(inner), pending, parallel));
        Self {
            queue,
            task: AbortOnDrop(task),
        }
    }

    /// Collects the queued sends and stores them, grouped, until the
    /// transport is gone. A statement starts at once when none runs; another
    /// one joins it (up to `parallel`) only once [`JOIN_ROWS`] sends wait, so
    /// that groups stay large rather than splitting the waiting sends into
    /// many small statements. Holds the transport only while a statement
    /// runs, so dropping the last handle ends the task.
    async fn run(
        inner: Weak<Inner>,
        mut pending: mpsc::UnboundedReceiver<PendingSend>,
        parallel: usize,
    ) {
        let mut running = JoinSet::new();
        let mut group = Vec::new();
        let mut open = true;
        while open || !group.is_empty() || !running.is_empty() {
            let start = !group.is_empty()
                && (running.is_empty() || (running.len() < parallel && group.len() >= JOIN_ROWS));
            if start {
                // Let the senders that are ready now queue too: one
                // statement for them rather than one for the first alone.
                tokio::task::yield_now().await;
                while group.len() < GROUP_ROWS {
                    match pending.try_recv() {
                        Ok(send) => group.push(send),
                        Err(_) => break,
                    }
                }
                let Some(inner) = inner.upgrade() else {
                    // Gone: dropping the group tells its senders.
                    break;
                };
                let group = std::mem::take(&mut group);
                running.spawn(async move { inner.write_group(group).await });
                continue;
            }
            let room = GROUP_ROWS - group.len();
            tokio::select! {
                biased;
                Some(_) = running.join_next(), if !running.is_empty() => {}
                taken = pending.recv_many(&mut group, room), if open && room > 0 => {
                    if taken == 0 {
                        open = false;
                    }
                }
            }
        }
    }
}

/// How many of `rest` (at least one) the next statement stores: no more
/// than [`GROUP_BYTES`] of bodies, unless the first alone is larger.
fn chunk_len(rest: &[PendingSend]) -> usize {
    let mut bytes = 0;
    rest.iter()
        .position(|p| {
            bytes += p.body.len();
            bytes > GROUP_BYTES
        })
        .map_or(rest.len(), |n| n.max(1))
}

impl Inner {
    /// Stores `group` (sends taken by the writer) and answers each: with one
    /// multi-row `INSERT` per [`GROUP_BYTES`] of bodies, or row by row when
    /// a grouped statement fails for another reason than a lost connection.
    async fn write_group(&self, group: Vec<PendingSend>) {
        let mut rest = group.as_slice();
        let mut replies: Vec<Reply> = Vec::with_capacity(group.len());
        while !rest.is_empty() {
            let (chunk, after) = rest.split_at(chunk_len(rest));
            rest = after;
            replies.extend(self.write_chunk(chunk).await);
        }
        if group
            .iter()
            .zip(&replies)
            .any(|(p, r)| r.is_ok() && p.delay <= 0.0)
        {
            self.notify_consumers();
        }
        for (pending, reply) in group.into_iter().zip(replies) {
            // A sender that went away meanwhile no longer waits for the answer.
            let _ = pending.reply.send(reply);
        }
    }

    /// Stores `chunk` with one statement (one row: a single-row `INSERT`);
    /// one reply per send, in order.
    async fn write_chunk(&self, chunk: &[PendingSend]) -> Vec<Reply> {
        if let [p] = chunk {
            return vec![self.insert_one(&p.body, &p.headers, p.delay).await];
        }
        let bodies: Vec<&[u8]> = chunk.iter().map(|p| p.body.as_slice()).collect();
        let headers: Vec<&str> = chunk.iter().map(|p| p.headers.as_str()).collect();
        let delays: Vec<f64> = chunk.iter().map(|p| p.delay).collect();
        let stored = self
            .retrying_raw(|| {
                sqlx::query_scalar::<_, i64>(AssertSqlSafe(self.sql.insert_batch.clone()))
                    .bind(self.name.as_str())
                    .bind(&bodies)
                    .bind(&headers)
                    .bind(&delays)
                    .fetch_all(&self.pool)
            })
            .await;
        let each =
            |error: &dyn Fn() -> TransportError| chunk.iter().map(|_| Err(error())).collect();
        match stored {
            Ok(ids) if ids.len() == chunk.len() => ids.into_iter().map(Ok).collect(),
            // Cannot happen (one row per element); never guess which
            // message got which id.
            Ok(ids) => each(&|| {
                TransportError::backend(
                    "postgres: sending a message",
                    format!(
                        "a grouped insert stored {} rows for {}",
                        ids.len(),
                        chunk.len()
                    ),
                )
            }),
            Err(sqlx::Error::PoolClosed) => each(&|| TransportError::Closed),
            Err(error) if is_connection_error(&error) => {
                let error = error.to_string();
                each(&|| {
                    TransportError::backend(
                        format!(
                            "postgres: sending a message (transport `{}`, table `{}`)",
                            self.name, self.config.table
                        ),
                        error.clone(),
                    )
                })
            }
            Err(error) => {
                tracing::debug!(%error, rows = chunk.len(), transport = %self.name, "postgres: grouped insert failed; storing its rows one by one");
                let mut replies = Vec::with_capacity(chunk.len());
                for p in chunk {
                    replies.push(self.insert_one(&p.body, &p.headers, p.delay).await);
                }
                replies
            }
        }
    }
}
