//! [`NatsTransport`]: a JetStream stream and a durable pull consumer.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::{ConnectOptions, Subject};
use envoi_core::transport::support::{connect_within, Backoff, ReadAhead};
use envoi_core::transport::{RawMessage, Transport, TransportDescription};
use envoi_core::{BoxError, BoxFuture, TransportError};

use crate::auth::{mask, masked_server, with_credentials};
use crate::config::{Names, NatsConfig};
use crate::fetch::give_back;
use crate::settle::Leases;

pub(crate) fn backend(context: impl Into<String>, source: impl Into<BoxError>) -> TransportError {
    TransportError::backend(context, source)
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The pause before connection attempt number `attempts` (the first
/// connection is attempt 1): none for the first two, then a [`Backoff`]
/// of 100 ms doubling up to 2 s, so a server that comes back is used again
/// within two seconds.
fn reconnect_delay(attempts: usize) -> Duration {
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    // The waits stop growing long before the sixteenth attempt.
    for _ in 2..attempts.min(16) {
        backoff.next_wait();
    }
    backoff.next_wait()
}

/// What every handle (clone) of one transport shares.
#[derive(Debug)]
pub(crate) struct Inner {
    /// The configuration, with the names in use filled in.
    pub(crate) config: NatsConfig,
    /// The stream, subject and consumer in use.
    pub(crate) names: Names,
    /// The subject, built once.
    pub(crate) subject: Subject,
    /// The server's payload limit as last read (0: none known); re-read
    /// before refusing a message over it.
    pub(crate) max_payload: AtomicUsize,
    pub(crate) client: async_nats::Client,
    pub(crate) js: jetstream::Context,
    pub(crate) consumer: Mutex<Option<Arc<PullConsumer>>>,
    /// Whether the stream and consumer were set up (by `setup` or on first
    /// use); cleared when the stream is deleted.
    pub(crate) set_up: AtomicBool,
    /// Held while setting up on first use, so it happens once.
    pub(crate) setting_up: tokio::sync::Mutex<()>,
    pub(crate) leases: Mutex<Leases>,
    /// Since when fetches have returned nothing (stall detection).
    pub(crate) idle_since: Mutex<Option<Instant>>,
    /// Whether the latest `get` failed (then `wait_for_messages` waits).
    pub(crate) get_failed: AtomicBool,
    /// The pull request for the next `get`, started when a large `get` came
    /// back full.
    pub(crate) read_ahead: ReadAhead<async_nats::Message>,
    /// Set by [`NatsTransport::close`].
    pub(crate) closed: AtomicBool,
}

impl Drop for Inner {
    /// Acks and naks are confirmed by the server before they return, but
    /// what was fetched ahead is given back with plain publishes, which a
    /// client dropped with writes still queued loses. The last handle
    /// going away therefore keeps the connection open (on the current
    /// runtime) until it has given back what it fetched ahead and flushed
    /// what is queued.
    fn drop(&mut self) {
        if self.closed.load(Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let client = self.client.clone();
        let ahead = self.read_ahead.drain_later();
        runtime.spawn(async move {
            if let Some(ahead) = ahead {
                give_back(&client, ahead.await).await;
            }
            if !flushed(&client).await {
                tracing::debug!("queued writes may not have reached the server before closing");
            }
        });
    }
}

/// Flushes the connection: what was queued on it (plain publishes) is
/// written out. Whether that happened within five seconds.
async fn flushed(client: &async_nats::Client) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(5), client.flush()).await,
        Ok(Ok(()))
    )
}

/// A transport on a NATS JetStream stream.
///
/// Its [`Setup`](envoi_core::transport::Setup) creates a work-queue stream capturing the configured
/// subject and a durable pull consumer on it (both idempotently).
/// [`send`](Transport::send) publishes and waits for JetStream's
/// acknowledgement; its [`Receiver::get`](envoi_core::transport::Receiver::get) fetches a batch from the
/// consumer, waiting up to the configured `wait` when none is available.
/// Every handle created for the same name shares the durable consumer, so
/// handles (and processes) compete for messages.
///
/// Abilities: [`Receiver`](envoi_core::transport::Receiver), [`Keepalive`](envoi_core::transport::Keepalive) (`+WPI`), [`Setup`](envoi_core::transport::Setup),
/// [`MessageCount`](envoi_core::transport::MessageCount), [`Browse`](envoi_core::transport::Browse), [`Teardown`](envoi_core::transport::Teardown) and [`WakeUp`](envoi_core::transport::WakeUp).
///
/// A `get` of at least 100 messages that comes back full starts the pull
/// request for the next batch at once, so the batch arrives while the
/// caller handles this one. What it fetched goes to the next `get`; what
/// that `get` does not hand out (it asked for fewer, or came later than
/// half a lease) is given back to JetStream at once, and so is what is
/// fetched ahead when the transport is closed or its last handle dropped.
///
/// Message ids are stream sequence numbers: the id `send` returns is the id
/// of every later delivery of that message and the id `list` and `find` use.
///
/// ```no_run
/// use envoi_core::transport::{RawMessage, Transport, TransportDescription};
/// use envoi_nats::NatsTransport;
///
/// # async fn run() -> Result<(), envoi_core::TransportError> {
/// let transport = NatsTransport::connect("orders", "nats://127.0.0.1:4222?lease=30s").await?;
/// transport.as_setup().expect("JetStream streams are set up").setup().await?;
/// let id = transport.send(RawMessage { body: b"hello".to_vec(), ..Default::default() }, None).await?;
/// let receiver = transport.as_receiver().expect("a stream can be consumed");
/// for delivery in receiver.get(10).await? {
///     assert_eq!(delivery.id.as_str(), id);
///     receiver.ack(&delivery.id).await?;
/// }
/// transport.close().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct NatsTransport {
    pub(crate) inner: Arc<Inner>,
}

impl NatsTransport {
    /// Connects the transport called `name` as `dsn` describes (see
    /// [`NatsConfig`] for the options). Nothing is created on the server
    /// until [`Setup::setup`](envoi_core::transport::Setup::setup) (or the first use, when `auto_setup` is on).
    ///
    /// # Errors
    ///
    /// [`TransportError::InvalidDsn`] for a DSN [`NatsConfig::from_dsn`]
    /// refuses, or naming a credentials or TLS file that cannot be read or
    /// used; [`TransportError::Unreachable`], naming the DSN with its
    /// password and token masked, when the server does not answer within
    /// `connect_timeout`, refuses the connection or the credentials.
    pub async fn connect(name: &str, dsn: &str) -> Result<Self, TransportError> {
        let config = NatsConfig::from_dsn(dsn)?;
        Self::open(name, config, &mask(dsn)).await
    }

    /// Like [`connect`](Self::connect) with an already parsed
    /// configuration. The stream, subject and consumer it does not name
    /// are derived from `name`.
    ///
    /// # Errors
    ///
    /// [`TransportError::InvalidDsn`] as well for a name, lease, wait, batch
    /// or `max_ack_pending` that [`NatsConfig::from_dsn`] would refuse (the
    /// fields are public, so a configuration may have been changed in
    /// code), and for a transport name that derives a stream, subject or
    /// consumer name JetStream does not accept. Errors name the server with
    /// its credentials masked.
    pub async fn with_config(name: &str, config: NatsConfig) -> Result<Self, TransportError> {
        let shown = masked_server(&config);
        Self::open(name, config, &shown).await
    }

    /// Connects the transport called `name` as `config` says; errors name
    /// the server as `shown` (masked).
    async fn open(name: &str, mut config: NatsConfig, shown: &str) -> Result<Self, TransportError> {
        let invalid = |reason: String| TransportError::InvalidDsn {
            dsn: shown.to_string(),
            reason,
        };
        config.validate().map_err(invalid)?;
        let names = config.names(name).map_err(invalid)?;
        config.stream = Some(names.stream.clone());
        config.subject = Some(names.subject.clone());
        config.consumer = Some(names.consumer.clone());
        let options = ConnectOptions::new()
            .name("envoi")
            .connection_timeout(config.connect_timeout)
            .reconnect_delay_callback(reconnect_delay)
            .event_callback(|event| async move {
                tracing::debug!(%event, "nats connection event");
            });
        let options = with_credentials(&config, options).await.map_err(invalid)?;
        let client = connect_within(
            shown,
            config.connect_timeout,
            options.connect(config.server.as_str()),
        )
        .await?;
        let js = jetstream::new(client.clone());
        let max_payload = AtomicUsize::new(client.server_info().max_payload);
        Ok(Self {
            inner: Arc::new(Inner {
                subject: Subject::from(names.subject.as_str()),
                read_ahead: ReadAhead::new(config.lease),
                names,
                max_payload,
                config,
                client,
                js,
                consumer: Mutex::new(None),
                set_up: AtomicBool::new(false),
                setting_up: tokio::sync::Mutex::new(()),
                leases: Mutex::new(Leases::new()),
                idle_since: Mutex::new(None),
                get_failed: AtomicBool::new(false),
                closed: AtomicBool::new(false),
            }),
        })
    }

    /// The configuration in use, with the stream, subject and consumer
    /// names filled in.
    pub fn config(&self) -> &NatsConfig {
        &self.inner.config
    }

    /// The JetStream stream holding the messages.
    pub fn stream(&self) -> &str {
        &self.inner.names.stream
    }

    /// The subject messages are published to.
    pub fn subject(&self) -> &str {
        &self.inner.names.subject
    }

    /// The durable pull consumer every handle on this transport shares.
    pub fn consumer(&self) -> &str {
        &self.inner.names.consumer
    }

    /// How many messages this handle has handed out and not yet settled.
    pub fn leased(&self) -> usize {
        lock(&self.inner.leases).len()
    }

    /// Closes the transport: gives back to JetStream what was fetched
    /// ahead of the next `get` (waiting for a pull request in flight),
    /// flushes what is queued, then drains and closes the connection (acks
    /// need nothing more: each was confirmed before it returned). Every handle on this transport fails with
    /// [`TransportError::Closed`] afterwards; a second call does nothing.
    /// Dropping the last handle does the same in the background.
    ///
    /// # Errors
    ///
    /// [`TransportError::Backend`] when the connection cannot be drained.
    pub async fn close(&self) -> Result<(), TransportError> {
        if self.inner.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        *lock(&self.inner.consumer) = None;
        let ahead = self.inner.read_ahead.drain().await;
        give_back(&self.inner.client, ahead).await;
        if !flushed(&self.inner.client).await {
            tracing::debug!("queued writes may not have reached the server before closing");
        }
        self.inner
            .client
            .drain()
            .await
            .map_err(|e| backend("closing the connection", e))
    }

    /// Fails with [`TransportError::Closed`] once the transport is closed.
    pub(crate) fn check_open(&self) -> Result<(), TransportError> {
        if self.inner.closed.load(Ordering::Relaxed) {
            Err(TransportError::Closed)
        } else {
            Ok(())
        }
    }
}

impl Transport for NatsTransport {
    /// `nats`, at the server's host and port from the DSN.
    fn describe(&self) -> TransportDescription {
        let described = TransportDescription::new("nats");
        match self.inner.config.server_address() {
            Some((host, port)) => described.with_server(host, port),
            None => described,
        }
    }

    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(async move {
            self.check_open()?;
            self.ensure_setup().await?;
            let mut prepared = self.prepare(message, delay)?;
            self.publish(&mut prepared).await
        })
    }

    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        Box::pin(self.publish_batch(messages))
    }

    envoi_core::abilities!(
        receiver,
        keepalive,
        setup,
        message_count,
        browse,
        teardown,
        wake_up
    );
}

#[cfg(test)]
mod tests {
    use super::reconnect_delay;
    use std::time::Duration;

    #[tokio::test]
    async fn with_config_refuses_a_configuration_changed_in_code_as_from_dsn_would() {
        // A port nothing listens on: the check comes before any connection.
        let base = crate::NatsConfig::from_dsn("nats://127.0.0.1:1").unwrap();
        type Change = (&'static str, fn(&mut crate::NatsConfig));
        let changes: [Change; 5] = [
            ("lease", |c| c.lease = Duration::ZERO),
            ("batch", |c| c.batch = 0),
            ("wait", |c| c.wait = Duration::from_secs(3600)),
            ("stream", |c| c.stream = Some("a.b".into())),
            ("subject", |c| c.subject = Some("a.>".into())),
        ];
        for (option, change) in changes {
            let mut config = base.clone();
            change(&mut config);
            match super::NatsTransport::with_config("q", config).await {
                Err(envoi_core::TransportError::InvalidDsn { reason, .. }) => {
                    assert!(reason.contains(option), "{option}: {reason}")
                }
                other => panic!("{option}: expected InvalidDsn, got {:?}", other.err()),
            }
        }
        // A transport name no JetStream name can be derived from.
        match super::NatsTransport::with_config("é", base).await {
            Err(envoi_core::TransportError::InvalidDsn { reason, .. }) => {
                assert!(reason.contains("stream"), "{reason}")
            }
            other => panic!("expected InvalidDsn, got {:?}", other.err()),
        }
    }

    #[test]
    fn reconnects_start_at_once_then_back_off_to_two_seconds() {
        assert_eq!(reconnect_delay(0), Duration::ZERO);
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), Duration::from_millis(100));
        assert_eq!(reconnect_delay(3), Duration::from_millis(200));
        assert_eq!(reconnect_delay(6), Duration::from_millis(1600));
        assert_eq!(reconnect_delay(7), Duration::from_secs(2));
        assert_eq!(reconnect_delay(1000), Duration::from_secs(2));
    }
}
