//! A named, self-healing connection to Redis.

use std::future::Future;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use envoi_core::TransportError;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisError, RedisResult};

/// One multiplexed connection that is opened on first use, named with
/// `CLIENT SETNAME` every time it is (re)opened, and replaced after a
/// connection-level failure. [`Link::run`] retries an operation once on a
/// fresh connection when the first attempt failed that way, so a connection
/// killed between two calls costs nothing but a reconnect.
pub(crate) struct Link {
    client: Client,
    config: AsyncConnectionConfig,
    name: String,
    /// The current connection: every command takes a clone of it, under a
    /// lock held only for that.
    slot: Mutex<Slot>,
    /// Held while a connection is opened, so only one is.
    connecting: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Slot {
    generation: u64,
    connection: Option<MultiplexedConnection>,
}

impl Link {
    pub(crate) fn new(client: Client, name: String, response_timeout: Duration) -> Self {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(response_timeout));
        Self {
            client,
            config,
            name,
            slot: Mutex::new(Slot::default()),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    /// The `CLIENT SETNAME` this link's connections carry.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        let slot = self.slot();
        slot.connection
            .as_ref()
            .map(|connection| (slot.generation, connection.clone()))
    }

    async fn connection(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let mut connection = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        redis::cmd("CLIENT")
            .arg("SETNAME")
            .arg(&self.name)
            .exec_async(&mut connection)
            .await?;
        let mut slot = self.slot();
        slot.generation += 1;
        slot.connection = Some(connection.clone());
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

    /// Runs `op` on the connection; on a connection-level failure, drops the
    /// connection and tries once more on a new one. Errors become
    /// [`TransportError::Backend`] with `context`.
    pub(crate) async fn run<T, F, Fut>(&self, context: &str, op: F) -> Result<T, TransportError>
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let mut retried = false;
        loop {
            let (generation, connection) = match self.connection().await {
                Ok(c) => c,
                Err(e) if !retried && is_connection_failure(&e) => {
                    retried = true;
                    continue;
                }
                Err(e) => return Err(backend(context, e)),
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
