//! The connection of a handle and its two channels ([`Link`]): opening it
//! (for up to `connect_timeout`), replacing it when it breaks (with
//! back-off, for up to `reconnect_timeout`), and closing it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use envoi_core::transport::support::{unreachable, Backoff};
use envoi_core::TransportError;
use lapin::options::{BasicCancelOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::LongString;
use lapin::{Channel, Connection, ConnectionProperties};

use crate::error::AmqpError;
use crate::shared::{backend, lock, Shared};
use crate::topology::forget_declarations;

/// The first wait between two attempts to reconnect or to publish again.
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// Longest single wait between reconnection attempts.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How long a closing handle waits after its last settlement before it
/// closes the connection; see [`Shared::shutdown`].
pub(crate) const SETTLE_GRACE: Duration = Duration::from_millis(200);

/// One connection and its channels.
pub(crate) struct Link {
    /// Which connection of the handle this is (1 for the first): part of
    /// the delivery ids it hands out.
    pub(crate) epoch: u64,
    pub(crate) connection: Connection,
    /// In confirm mode.
    pub(crate) publisher: Channel,
    /// With the prefetch count; consumes and settles.
    pub(crate) consumer: Channel,
}

impl Link {
    /// Whether the connection and both channels are open.
    pub(crate) fn healthy(&self) -> bool {
        self.connection.status().connected()
            && self.publisher.status().connected()
            && self.consumer.status().connected()
    }

    /// The largest frame the connection takes.
    pub(crate) fn frame_max(&self) -> usize {
        match self.connection.configuration().frame_max() {
            0 => usize::MAX,
            n => n as usize,
        }
    }

    /// Opens a channel of its own, for a declaration or a query whose
    /// refusal must not close the link's channels.
    pub(crate) async fn side_channel(&self) -> Result<Channel, TransportError> {
        self.connection
            .create_channel()
            .await
            .map_err(|e| backend("opening a channel", e))
    }
}

/// Which connection of a handle is being opened.
#[derive(Clone, Copy)]
enum Opening {
    /// The first: bounded by `connect_timeout`; a broker out of reach is
    /// [`TransportError::Unreachable`].
    First,
    /// One replacing a lost connection: bounded by `reconnect_timeout`.
    Again,
}

/// Whether an error is worth a reconnection (the connection or a channel
/// broke) rather than a permanent failure (refused credentials, a queue
/// declared with other arguments).
pub(crate) fn retryable(error: &lapin::Error) -> bool {
    use lapin::ErrorKind as K;
    match error.kind() {
        K::InvalidChannel(_)
        | K::InvalidChannelState(..)
        | K::InvalidConnectionState(_)
        | K::IOError(_)
        | K::MissingHeartbeatError => true,
        // 320 connection-forced (closed by an operator), 541 internal error.
        K::ProtocolError(e) => matches!(e.get_id(), 320 | 541),
        _ => false,
    }
}

/// Whether `error` is a broker error worth a reconnection.
fn retryable_transport(error: &TransportError) -> bool {
    matches!(error, TransportError::Backend { source, .. }
        if source.downcast_ref::<lapin::Error>().is_some_and(retryable))
}

/// Closes `link` without waiting for it.
fn close_in_background(link: Arc<Link>) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let _ = link.connection.close(200, "closed".into()).await;
        });
    }
    // Without a runtime, dropping the last handle closes the connection.
}

impl Shared {
    /// The current link, healthy or not.
    pub(crate) fn current(&self) -> Option<Arc<Link>> {
        self.link
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Takes the current link away: the next operation opens another.
    pub(crate) fn take_link(&self) -> Option<Arc<Link>> {
        self.link
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// The current healthy link, reconnecting (with topology recovery) when
    /// the connection or one of its channels broke.
    pub(crate) async fn link(&self) -> Result<Arc<Link>, TransportError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(TransportError::Closed);
        }
        if let Some(link) = self.current().filter(|l| l.healthy()) {
            return Ok(link);
        }
        // Boxed: every send and fetch awaits `link`, and reconnecting
        // needs far more state than the healthy path.
        Box::pin(self.relink()).await
    }

    /// Opens the first connection of the handle, trying again after a
    /// refusal for up to `connect_timeout`. A broker that cannot be reached
    /// in that time gives [`TransportError::Unreachable`] naming the masked
    /// DSN; a broker that refuses the topology gives
    /// [`TransportError::Backend`].
    pub(crate) async fn connect_first(&self) -> Result<Arc<Link>, TransportError> {
        let _guard = self.reconnect.lock().await;
        self.open_until(self.config.connect_timeout, Opening::First)
            .await
    }

    /// The slow path of [`Shared::link`]: replaces a lost connection.
    async fn relink(&self) -> Result<Arc<Link>, TransportError> {
        let _guard = self.reconnect.lock().await;
        if self.closed.load(Ordering::SeqCst) {
            return Err(TransportError::Closed);
        }
        if let Some(link) = self.current().filter(|l| l.healthy()) {
            return Ok(link);
        }
        if let Some(old) = self.take_link() {
            tracing::warn!(transport = %self.name, "AMQP connection lost; reconnecting");
            close_in_background(old);
        }
        self.open_until(self.config.reconnect_timeout, Opening::Again)
            .await
    }

    /// Opens a link and makes it current, trying again with back-off for
    /// up to `within`. The caller holds the `reconnect` lock.
    async fn open_until(
        &self,
        within: Duration,
        opening: Opening,
    ) -> Result<Arc<Link>, TransportError> {
        let deadline = Instant::now()
            .checked_add(within)
            .unwrap_or_else(|| Instant::now() + MAX_BACKOFF);
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        loop {
            match self.open_link(deadline, opening).await {
                Ok(link) => {
                    let link = Arc::new(link);
                    self.install(Arc::clone(&link));
                    return Ok(link);
                }
                Err((error, retry)) => {
                    if !retry || Instant::now() + backoff.peek() >= deadline {
                        return Err(error);
                    }
                    tracing::debug!(transport = %self.name, %error, "AMQP connection attempt failed");
                    backoff.wait().await;
                }
            }
        }
    }

    /// Opens a connection and its channels, and declares the topology
    /// when it should be. The error says whether another attempt may work.
    async fn open_link(
        &self,
        deadline: Instant,
        opening: Opening,
    ) -> Result<Link, (TransportError, bool)> {
        let fail = |context: &str, e: lapin::Error| {
            let retry = retryable(&e);
            (backend(context, e), retry)
        };
        let connection = self.connect(deadline, opening).await?;
        let publisher = connection
            .create_channel()
            .await
            .map_err(|e| fail("opening the publishing channel", e))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| fail("enabling publisher confirms", e))?;
        let consumer = connection
            .create_channel()
            .await
            .map_err(|e| fail("opening the consuming channel", e))?;
        consumer
            .basic_qos(self.config.prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| fail("setting the prefetch count", e))?;
        let link = Link {
            epoch: self.epochs.fetch_add(1, Ordering::SeqCst) + 1,
            connection,
            publisher,
            consumer,
        };
        if self.config.auto_setup || self.setup_done.load(Ordering::SeqCst) {
            self.declare(&link).await.map_err(|e| {
                let retry = retryable_transport(&e);
                (e, retry)
            })?;
        }
        Ok(link)
    }

    /// Opens the connection, giving up at `deadline` (or 100 ms from now,
    /// whichever is later). The first connection of a handle fails with
    /// [`TransportError::Unreachable`], a later one with
    /// [`TransportError::Backend`].
    async fn connect(
        &self,
        deadline: Instant,
        opening: Opening,
    ) -> Result<Connection, (TransportError, bool)> {
        let connection_name = self
            .config
            .connection_name
            .clone()
            .unwrap_or_else(|| format!("envoi-{}", self.name));
        let properties = ConnectionProperties::default()
            .with_connection_name(LongString::from(connection_name.into_bytes()));
        let budget = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100));
        let failed = |source: envoi_core::BoxError| match opening {
            Opening::First => unreachable(self.config.masked_dsn(), source),
            Opening::Again => backend(
                format!("connecting to {}", self.config.masked_dsn()),
                source,
            ),
        };
        match tokio::time::timeout(
            budget,
            Connection::connect_uri(self.config.uri().clone(), properties),
        )
        .await
        {
            Ok(Ok(connection)) => Ok(connection),
            Ok(Err(e)) => {
                let retry = retryable(&e);
                Err((failed(e.into()), retry))
            }
            Err(_) => Err((failed(AmqpError::ConnectTimeout(budget).into()), true)),
        }
    }

    /// Makes `link` current and forgets everything of the previous one: its
    /// unsettled deliveries are back in the queue since it closed.
    fn install(&self, link: Arc<Link>) {
        lock(&self.consume).reset(link.epoch);
        *self.link.write().unwrap_or_else(PoisonError::into_inner) = Some(link);
        forget_declarations(&self.delay_queues);
    }

    /// Forgets `link` if it is still current, so the next call reconnects.
    pub(crate) fn invalidate(&self, link: &Link) {
        let mut current = self.link.write().unwrap_or_else(PoisonError::into_inner);
        if current.as_ref().is_some_and(|l| l.epoch == link.epoch) {
            if let Some(old) = current.take() {
                drop(current);
                close_in_background(old);
            }
        }
    }

    /// Closes `link` gracefully: stops the consumer, lets the broker apply
    /// the acknowledgements just sent, then closes the connection (which
    /// gives back everything unsettled).
    ///
    /// Quorum queues apply acknowledgements asynchronously; a connection
    /// closed right after a burst of them can lose the last ones, and the
    /// broker would hand those messages out again. Waiting
    /// [`SETTLE_GRACE`] after the last settlement avoids that.
    pub(crate) async fn shutdown(&self, link: Arc<Link>) -> Result<(), TransportError> {
        // The consumer lives until the connection closes: dropping it
        // earlier would let it cancel itself while acknowledgements settle.
        let (tag, give_backs, _consumer) = lock(&self.consume).stop();
        if let Some(tag) = tag {
            let _ = link
                .consumer
                .basic_cancel(tag, BasicCancelOptions::default())
                .await;
        }
        let last = *lock(&self.last_settle);
        if let Some(wait) =
            last.and_then(|at| (at + SETTLE_GRACE).checked_duration_since(Instant::now()))
        {
            tokio::time::sleep(wait).await;
        }
        for task in give_backs {
            task.abort();
        }
        link.connection
            .close(200, "closed".into())
            .await
            .map_err(|e| backend("closing the connection", e))
    }
}
