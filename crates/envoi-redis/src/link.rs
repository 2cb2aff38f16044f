//! A named, self-healing connection to Redis.

use std::future::Future;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use envoi_core::transport::support::{connect_within, unreachable, Backoff};
use envoi_core::TransportError;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, ErrorKind, RedisError, RedisResult};

/// The wait after a failed attempt to connect before the next one, doubling
/// up to [`RECONNECT_MAX`] while the server stays out of reach.
const RECONNECT_FIRST: Duration = Duration::from_millis(50);
/// The longest wait between two attempts to connect.
const RECONNECT_MAX: Duration = Duration::from_secs(1);

/// One multiplexed connection that is opened on first use, named with
/// `CLIENT SETNAME` every time it is (re)opened, and replaced after a
/// connection-level failure. [`Link::run`] retries an operation once on a
/// fresh connection when the first attempt failed that way, so a connection
/// killed between two calls costs nothing but a reconnect.
///
/// Opening a connection (and naming it) takes at most the connect timeout;
/// an attempt that fails or runs out of it makes the command fail with
/// [`TransportError::Unreachable`] naming the server's masked URL. While the
/// server is out of reach, attempts to connect are spaced by a
/// [`Backoff`] (50 ms, doubling up to 1 s): a command that comes before the
/// next attempt is due fails at once with the last attempt's error, so
/// callers retrying in a loop do not each open a connection.
pub(crate) struct Link {
    client: Client,
    config: AsyncConnectionConfig,
    name: String,
    /// The server's URL, for errors (masked when shown).
    url: String,
    /// The longest an attempt to connect may take.
    connect_timeout: Duration,
    /// The current connection: every command takes a clone of it, under a
    /// lock held only for that.
    slot: Mutex<Slot>,
    /// Held while a connection is opened, so only one is.
    connecting: tokio::sync::Mutex<()>,
    /// When the next attempt to connect may be made after failed ones.
    reconnect: Mutex<Reconnect>,
}

#[derive(Default)]
struct Slot {
    generation: u64,
    connection: Option<MultiplexedConnection>,
    /// The server's `CLIENT ID` of `connection`, when it told it.
    client_id: Option<i64>,
    /// Set by [`Link::close`]: every command fails with
    /// [`TransportError::Closed`] from then on.
    closed: bool,
}

/// The pace of attempts to connect while they fail.
struct Reconnect {
    backoff: Backoff,
    /// No attempt before this, with why the last one failed.
    not_before: Option<(Instant, String)>,
}

/// Why [`Link::connection`] gave no connection.
enum NoConnection {
    Closed,
    /// [`TransportError::Unreachable`].
    Failed(TransportError),
}

/// How a [`Link`] reaches its server.
pub(crate) struct Target {
    /// The server's URL, as the `redis` crate opens it.
    pub(crate) url: String,
    /// The longest an attempt to connect may take.
    pub(crate) connect_timeout: Duration,
    /// The longest a command may wait for its reply.
    pub(crate) response_timeout: Duration,
}

impl Link {
    pub(crate) fn new(client: Client, name: String, target: Target) -> Self {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(target.connect_timeout))
            .set_response_timeout(Some(target.response_timeout));
        Self {
            client,
            config,
            name,
            url: target.url,
            connect_timeout: target.connect_timeout,
            slot: Mutex::new(Slot::default()),
            connecting: tokio::sync::Mutex::new(()),
            reconnect: Mutex::new(Reconnect {
                backoff: Backoff::new(RECONNECT_FIRST, RECONNECT_MAX),
                not_before: None,
            }),
        }
    }

    /// The `CLIENT SETNAME` this link's connections carry.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    fn slot(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn reconnect(&self) -> MutexGuard<'_, Reconnect> {
        self.reconnect
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Drops the connection; every later command fails with
    /// [`TransportError::Closed`]. Commands in flight finish.
    pub(crate) fn close(&self) {
        let mut slot = self.slot();
        slot.closed = true;
        slot.connection = None;
    }

    /// The server's `CLIENT ID` of the current connection, if there is one
    /// and the server told it.
    pub(crate) fn client_id(&self) -> Option<i64> {
        let slot = self.slot();
        slot.connection.as_ref().and(slot.client_id)
    }

    fn current(&self) -> Result<Option<(u64, MultiplexedConnection)>, NoConnection> {
        let slot = self.slot();
        if slot.closed {
            return Err(NoConnection::Closed);
        }
        Ok(slot
            .connection
            .as_ref()
            .map(|connection| (slot.generation, connection.clone())))
    }

    async fn connection(&self) -> Result<(u64, MultiplexedConnection), NoConnection> {
        if let Some(current) = self.current()? {
            return Ok(current);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(current) = self.current()? {
            return Ok(current);
        }
        self.too_soon()
            .map_err(|e| NoConnection::Failed(unreachable(&self.url, e.into())))?;
        match connect_within(&self.url, self.connect_timeout, self.open()).await {
            Ok((connection, client_id)) => {
                let mut reconnect = self.reconnect();
                reconnect.backoff.reset();
                reconnect.not_before = None;
                drop(reconnect);
                self.install(connection, client_id)
            }
            Err(e) => {
                let why = match &e {
                    TransportError::Unreachable { source, .. } => source.to_string(),
                    other => other.to_string(),
                };
                let mut reconnect = self.reconnect();
                let wait = reconnect.backoff.next_wait();
                reconnect.not_before = Some((Instant::now() + wait, why));
                Err(NoConnection::Failed(e))
            }
        }
    }

    /// An error when the last attempt to connect failed and the next one is
    /// not due yet.
    fn too_soon(&self) -> RedisResult<()> {
        match &self.reconnect().not_before {
            Some((at, why)) if Instant::now() < *at => Err(RedisError::from((
                ErrorKind::Io,
                "not reconnecting yet after a failed attempt",
                format!(
                    "next attempt in {:?}; the last one failed: {why}",
                    at.saturating_duration_since(Instant::now())
                ),
            ))),
            _ => Ok(()),
        }
    }

    /// A new connection, named, with its `CLIENT ID` (`None` when the
    /// server refuses to tell it, as an ACL may).
    async fn open(&self) -> RedisResult<(MultiplexedConnection, Option<i64>)> {
        let mut connection = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        redis::cmd("CLIENT")
            .arg("SETNAME")
            .arg(&self.name)
            .exec_async(&mut connection)
            .await?;
        let client_id = match redis::cmd("CLIENT")
            .arg("ID")
            .query_async::<i64>(&mut connection)
            .await
        {
            Ok(id) => Some(id),
            Err(e) if is_connection_failure(&e) => return Err(e),
            Err(_) => None,
        };
        Ok((connection, client_id))
    }

    /// Makes `connection` the current one, unless the link was closed
    /// meanwhile.
    fn install(
        &self,
        connection: MultiplexedConnection,
        client_id: Option<i64>,
    ) -> Result<(u64, MultiplexedConnection), NoConnection> {
        let mut slot = self.slot();
        if slot.closed {
            return Err(NoConnection::Closed);
        }
        slot.generation += 1;
        slot.connection = Some(connection.clone());
        slot.client_id = client_id;
        if slot.generation > 1 {
            tracing::debug!(client = %self.name, "reconnected to redis");
        }
        Ok((slot.generation, connection))
    }

    fn discard(&self, generation: u64) {
        let mut slot = self.slot();
        if slot.generation == generation {
            slot.connection = None;
        }
    }

    /// Runs `op` on the connection; when `op` fails at the connection level,
    /// drops the connection and tries once more on a new one. Errors become
    /// [`TransportError::Backend`] with `context`,
    /// [`TransportError::Unreachable`] when no connection could be opened,
    /// or [`TransportError::Closed`] once the link is closed.
    pub(crate) async fn run<T, F, Fut>(&self, context: &str, op: F) -> Result<T, TransportError>
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let mut retried = false;
        loop {
            let (generation, connection) = match self.connection().await {
                Ok(c) => c,
                Err(NoConnection::Closed) => return Err(TransportError::Closed),
                // Trying again at once would only be refused: the next
                // attempt waits for the back-off.
                Err(NoConnection::Failed(e)) => return Err(e),
            };
            match op(connection).await {
                Ok(value) => return Ok(value),
                Err(e) if is_connection_failure(&e) => {
                    self.discard(generation);
                    if retried {
                        return Err(backend(context, e));
                    }
                    tracing::debug!(client = %self.name, error = %e, "redis connection lost; retrying once");
                    retried = true;
                }
                Err(e) => return Err(backend(context, e)),
            }
        }
    }
}

/// Whether `e` means the connection is unusable (as opposed to a command
/// the server refused).
pub(crate) fn is_connection_failure(e: &RedisError) -> bool {
    e.is_unrecoverable_error() || e.is_io_error() || e.is_connection_dropped() || e.is_timeout()
}

fn backend(context: &str, e: RedisError) -> TransportError {
    TransportError::backend(context.to_string(), e)
}

/// The server's error code (`BUSYGROUP`, `NOGROUP`, ...) behind `e`, if any.
pub(crate) fn redis_code(e: &TransportError) -> Option<&str> {
    match e {
        TransportError::Backend { source, .. } => source.downcast_ref::<RedisError>()?.code(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link_to(url: &str, connect_timeout: Duration) -> Link {
        let client = Client::open(url).unwrap();
        let target = Target {
            url: url.to_string(),
            connect_timeout,
            response_timeout: Duration::from_secs(1),
        };
        Link::new(client, "test".to_string(), target)
    }

    fn unreachable() -> Link {
        // Nothing listens on port 1: every attempt to connect fails at once.
        link_to("redis://127.0.0.1:1", Duration::from_secs(1))
    }

    async fn ping(link: &Link) -> Result<(), TransportError> {
        link.run("PING", |mut c| async move {
            redis::cmd("PING").exec_async(&mut c).await
        })
        .await
    }

    #[tokio::test]
    async fn attempts_to_connect_are_spaced_while_they_fail() {
        let link = unreachable();
        let err = ping(&link).await.unwrap_err().to_string();
        assert!(!err.contains("not reconnecting yet"), "{err}");
        // Within the wait: refused without an attempt, saying why.
        let err = ping(&link).await.unwrap_err().to_string();
        assert!(err.contains("not reconnecting yet"), "{err}");
        let first = link.reconnect().backoff.peek();
        tokio::time::sleep(RECONNECT_FIRST * 4).await;
        // Due again: a real attempt, which fails and doubles the wait.
        let err = ping(&link).await.unwrap_err().to_string();
        assert!(!err.contains("not reconnecting yet"), "{err}");
        assert!(link.reconnect().backoff.peek() > first);
    }

    #[tokio::test]
    async fn a_server_that_never_answers_fails_within_the_connect_timeout() {
        // Accepted by the kernel, never answered: the handshake hangs.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = silent.local_addr().unwrap().port();
        let link = link_to(
            &format!("redis://u:hunter2@127.0.0.1:{port}"),
            Duration::from_millis(300),
        );
        let started = Instant::now();
        let error = tokio::time::timeout(Duration::from_secs(10), ping(&link))
            .await
            .expect("connecting hung past its timeout")
            .unwrap_err();
        let waited = started.elapsed();
        assert!(
            matches!(error, TransportError::Unreachable { .. }),
            "{error:?}"
        );
        let text = error.to_string();
        assert!(
            text.contains(&format!("redis://u:***@127.0.0.1:{port}")),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
        // The lower bound shows the attempt waited for the timeout rather
        // than failing for another reason; the upper one is wide.
        assert!(waited >= Duration::from_millis(250), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        drop(silent);
    }

    #[tokio::test]
    async fn a_closed_link_refuses_every_command() {
        let link = unreachable();
        link.close();
        assert!(matches!(ping(&link).await, Err(TransportError::Closed)));
    }
}
