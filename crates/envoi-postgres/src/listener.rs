//! Waking consumers: one `LISTEN` connection per transport, shared by every
//! consumer, with polling as the fallback.
//!
//! Consumers never hold a connection while they wait. Each waits on a
//! [`Wake`] signal (a generation counter in a `watch` channel) for at most
//! the poll interval. The listener task owns the only `LISTEN` connection;
//! it bumps the generation when a notification for its queue arrives, and
//! also whenever it (re)connects, because notifications sent while it was
//! away are lost. While it is down, consumers simply poll.

use std::sync::Arc;
use std::time::Duration;

use envoi_core::transport::support::Backoff;
use sqlx::postgres::{PgListener, PgPool};
use sqlx::AssertSqlSafe;
use tokio::sync::{watch, Notify};

/// The generation counter consumers wait on.
#[derive(Debug)]
pub(crate) struct Wake {
    tx: watch::Sender<u64>,
}

impl Wake {
    pub(crate) fn new() -> Self {
        Self {
            tx: watch::Sender::new(0),
        }
    }

    /// Wakes every consumer waiting now, and makes the next wait of one
    /// that subscribed before this call return at once.
    pub(crate) fn wake(&self) {
        self.tx
            .send_modify(|generation| *generation = generation.wrapping_add(1));
    }

    /// A receiver that sees every wake from now on.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.tx.subscribe()
    }
}

/// What the listener task needs; it holds no reference to the transport, so
/// dropping the transport (which aborts the task) frees everything.
pub(crate) struct ListenerTask {
    /// A pool of one connection, used only for `LISTEN`.
    pub(crate) pool: PgPool,
    /// The channel (the table name).
    pub(crate) channel: String,
    /// Notifications whose payload is this queue name wake consumers.
    pub(crate) queue: String,
    pub(crate) wake: Arc<Wake>,
}

impl ListenerTask {
    /// Listens until aborted, reconnecting after waits of 100 ms doubling
    /// up to 5 s (back to 100 ms once listening again).
    pub(crate) async fn run(self) {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            match self.listen(&mut backoff).await {
                Ok(never) => match never {},
                Err(error) => {
                    tracing::warn!(
                        %error,
                        channel = %self.channel,
                        queue = %self.queue,
                        retry_in = ?backoff.peek(),
                        "postgres listener lost; consumers poll until it is back"
                    );
                }
            }
            // Whatever was notified while the listener was away is lost.
            self.wake.wake();
            backoff.wait().await;
        }
    }

    /// Connects, listens and forwards notifications until the connection fails.
    /// Resets `backoff` once listening.
    async fn listen(&self, backoff: &mut Backoff) -> Result<std::convert::Infallible, sqlx::Error> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        // Reconnects are handled here, with a wake after each.
        listener.eager_reconnect(false);
        listener.listen(&self.channel).await?;
        tracing::debug!(channel = %self.channel, queue = %self.queue, "postgres listener connected");
        backoff.reset();
        // Messages may have been sent between the last poll and LISTEN.
        self.wake.wake();
        loop {
            match listener.try_recv().await? {
                Some(notification) => {
                    if notification.payload() == self.queue {
                        self.wake.wake();
                    }
                }
                None => {
                    return Err(sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "listener connection closed",
                    )))
                }
            }
        }
    }
}

/// Attempts at one notification whose connection was lost.
const NOTIFY_ATTEMPTS: u32 = 3;

/// Sends the `NOTIFY`s of one transport, coalesced: however many sends
/// complete while a notification is on its way, one more follows it. Each
/// notification leaves after the commits it announces, so a consumer it
/// wakes finds their rows.
pub(crate) struct NotifierTask {
    /// The transport's query pool.
    pub(crate) pool: PgPool,
    /// `SELECT pg_notify(channel, $1)`.
    pub(crate) sql: Arc<str>,
    /// The payload: the queue name.
    pub(crate) queue: String,
    /// Signalled after each commit that made messages available.
    pub(crate) signal: Arc<Notify>,
}

impl NotifierTask {
    /// Notifies once per signal (signals that arrive meanwhile collapse
    /// into one) until aborted.
    pub(crate) async fn run(self) {
        loop {
            self.signal.notified().await;
            self.notify().await;
        }
    }

    /// Sends one notification, again (after a short wait) when its
    /// connection was lost, [`NOTIFY_ATTEMPTS`] times at most.
    async fn notify(&self) {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(100));
        for attempt in 1..=NOTIFY_ATTEMPTS {
            let result = sqlx::query(AssertSqlSafe(self.sql.clone()))
                .bind(self.queue.as_str())
                .execute(&self.pool)
                .await;
            let Err(error) = result else {
                return;
            };
            // Consumers elsewhere poll: a lost notification only delays
            // them.
            tracing::debug!(%error, queue = %self.queue, "postgres: NOTIFY failed");
            if attempt == NOTIFY_ATTEMPTS || !crate::retry::is_connection_error(&error) {
                return;
            }
            backoff.wait().await;
        }
    }
}
