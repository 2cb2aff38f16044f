//! [`RedisTransport`]: the [`Transport`] on Redis Streams.
//!
//! What a handle does is split by concept: sending ([`send`]), handing
//! out entries ([`receive`]), taking over entries whose lease ran out
//! ([`claim`]), the periodic chores of `get` ([`chores`]), settling
//! ([`settle`]), counting and browsing ([`browse`]) and emptying or
//! removing what it stores ([`teardown`]).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use envoi_core::transport::support::ReadAhead;
use envoi_core::transport::{
    mask_dsn, Delivery, RawMessage, Setup, Transport, TransportDescription, WakeUp,
};
use envoi_core::{BoxFuture, TransportError};
use redis::Client;
use uuid::Uuid;

use crate::config::RedisConfig;
use crate::keys::{client_name, Keys};
use crate::link::{redis_code, Link, Target};

mod browse;
mod chores;
mod claim;
mod receive;
mod send;
mod settle;
mod teardown;

use chores::Chores;

/// How long a command on the shared connection may take.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

/// A [`Transport`] on one Redis stream, consumed through a consumer group.
///
/// * `send` is `XADD`; a delayed send stores the message in a sorted set
///   scored with its due time, and an atomic script moves due messages into
///   the stream (several workers never move one twice).
/// * [`Receiver::get`](envoi_core::transport::Receiver::get) reclaims entries other consumers left pending longer
///   than the lease (`XAUTOCLAIM`; they come marked
///   [`redelivered`](Delivery::redelivered)), moves due delayed messages,
///   then reads new entries with `XREADGROUP ... BLOCK` on a connection of
///   its own, so blocking never holds up sends and acks on the shared one.
///   A `get` of at least 100 entries that comes back full reads the next
///   batch at once, so it arrives while the caller handles this one; the
///   next `get` hands it out while it is less than half a lease old, and
///   leaves older entries to be claimed again.
/// * `ack` is `XACK`; every second, `get` trims the entries every group has
///   acknowledged from the head of the stream (`XTRIM MINID`), so they do
///   not pile up. `reject` acknowledges the entry and deletes it at once
///   (`XDEL`) unless another group still needs it. `release` gives the
///   entry back to the group: it stays pending, moved to the group's
///   release consumer, and the next `get` of a handle in the group claims
///   it (marked redelivered); the stream, and so every other group on it,
///   is untouched. [`Keepalive::keepalive`](envoi_core::transport::Keepalive::keepalive) resets the entry's idle time with
///   `XCLAIM ... JUSTID` to its own consumer.
/// * [`Setup`], [`MessageCount`](envoi_core::transport::MessageCount), [`Browse`](envoi_core::transport::Browse), [`Teardown`](envoi_core::transport::Teardown) and [`WakeUp`]
///   are there too (see the crate docs for how each maps onto Redis).
///
/// Every handle is a consumer of its own (the configured prefix plus a
/// random suffix), so two handles on one stream share the work.
/// [`close`](Self::close) gives back what was read ahead and closes the
/// connections; dropping the handle gives back what was read ahead in the
/// background.
///
/// ```no_run
/// use envoi_core::transport::{RawMessage, Transport};
/// use envoi_redis::RedisTransport;
///
/// # async fn demo() -> Result<(), envoi_core::TransportError> {
/// let transport = RedisTransport::connect("orders", "redis://127.0.0.1:6379?lease=30s").await?;
/// transport.as_setup().expect("redis streams are set up").setup().await?;
/// let id = transport.send(RawMessage { body: b"{}".to_vec(), ..Default::default() }, None).await?;
/// let receiver = transport.as_receiver().expect("redis streams are consumed");
/// for delivery in receiver.get(10).await? {
///     receiver.ack(&delivery.id).await?;
/// }
/// transport.close().await?;
/// # let _ = id;
/// # Ok(())
/// # }
/// ```
pub struct RedisTransport {
    config: RedisConfig,
    keys: Arc<Keys>,
    /// How often `get` looks for entries whose lease ran out.
    claim_interval: Duration,
    /// Sends, acks and scripts.
    shared: Arc<Link>,
    /// Blocking reads (and reads ahead), so they hold up nothing else.
    blocking: Arc<Link>,
    /// One blocking read at a time per handle.
    read_lock: tokio::sync::Mutex<()>,
    chores: Mutex<Chores>,
    /// Entries read ahead of the next `get`.
    ahead: ReadAhead<Delivery>,
    /// Whether the stream and group are known to exist.
    ready: AtomicBool,
    /// Whether the last `get` failed (then `wait_for_messages` really waits).
    get_failed: AtomicBool,
}

impl RedisTransport {
    /// The transport called `name` on `dsn` (see [`RedisConfig::from_dsn`]).
    ///
    /// Connects lazily: the first command opens the connections (and opens
    /// them again whenever they are lost), so this fails only for a DSN
    /// that is not valid. Opening a connection takes at most
    /// `connect_timeout` (5 s by default); a command that cannot get one
    /// fails with [`TransportError::Unreachable`] naming the server's URL,
    /// its password masked.
    pub async fn connect(name: &str, dsn: &str) -> Result<Self, TransportError> {
        Self::with_config(name, RedisConfig::from_dsn(dsn)?).await
    }

    /// The transport called `name` with `config`; its stream is
    /// [`RedisConfig::stream`], or `envoi:<name>`. Connects lazily, as
    /// [`connect`](Self::connect) does.
    ///
    /// Fails with [`TransportError::InvalidDsn`] when the `redis` crate
    /// rejects [`RedisConfig::url`], or a setting is one
    /// [`RedisConfig::from_dsn`] would refuse (the fields are public, so the
    /// configuration may have been changed in code).
    pub async fn with_config(name: &str, config: RedisConfig) -> Result<Self, TransportError> {
        Self::build(name, config)
    }

    fn build(name: &str, config: RedisConfig) -> Result<Self, TransportError> {
        let invalid = |reason: String| TransportError::InvalidDsn {
            dsn: mask_dsn(&config.url),
            reason,
        };
        config.validate().map_err(invalid)?;
        let client = Client::open(config.url.as_str()).map_err(|e| invalid(e.to_string()))?;
        let suffix = Uuid::new_v4().simple().to_string();
        let keys = Keys::new(
            config.stream_for(name),
            config.group.clone(),
            format!("{}-{}", config.consumer, &suffix[..16]),
            config.trim,
        );
        let client_name = client_name(&keys.stream, &keys.consumer);
        Ok(Self {
            claim_interval: (config.lease / 4)
                .clamp(Duration::from_millis(50), Duration::from_secs(5)),
            shared: Arc::new(Link::new(
                client.clone(),
                client_name.clone(),
                Target {
                    url: config.url.clone(),
                    connect_timeout: config.connect_timeout,
                    response_timeout: RESPONSE_TIMEOUT,
                },
            )),
            blocking: Arc::new(Link::new(
                client,
                format!("{client_name}:block"),
                Target {
                    url: config.url.clone(),
                    connect_timeout: config.connect_timeout,
                    response_timeout: config.block + RESPONSE_TIMEOUT,
                },
            )),
            keys: Arc::new(keys),
            read_lock: tokio::sync::Mutex::new(()),
            chores: Mutex::new(Chores::new()),
            ahead: ReadAhead::new(config.lease),
            ready: AtomicBool::new(false),
            get_failed: AtomicBool::new(false),
            config,
        })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The key of its stream: [`RedisConfig::stream`], or
    /// `envoi:<transport name>`.
    pub fn stream(&self) -> &str {
        &self.keys.stream
    }

    /// This handle's consumer name in the group, unique per handle.
    pub fn consumer_name(&self) -> &str {
        &self.keys.consumer
    }

    /// The `CLIENT SETNAME` of this handle's two connections: the shared one
    /// (sends, acks, scripts) and the one dedicated to blocking reads. They
    /// identify the handle in `CLIENT LIST`, for instance to `CLIENT KILL` it.
    pub fn client_names(&self) -> [&str; 2] {
        [self.shared.name(), self.blocking.name()]
    }

    /// Gives back the entries read ahead and not handed out (they are
    /// handed out again at once, to any consumer), then closes the
    /// connections. Every later call on this handle fails with
    /// [`TransportError::Closed`]; closing again does nothing.
    pub async fn close(&self) -> Result<(), TransportError> {
        // No new read starts; one in flight finishes into `ahead`.
        self.blocking.close();
        let spare = self.ahead.drain().await;
        let given_back = settle::release_entries(&self.shared, &self.keys, &spare).await;
        self.shared.close();
        given_back.map(|_| ())
    }

    fn chores(&self) -> MutexGuard<'_, Chores> {
        self.chores.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Creates the stream and the group unless they exist.
    async fn setup_group(&self) -> Result<(), TransportError> {
        let created = self
            .shared
            .run("creating the consumer group", |mut c| async move {
                redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(&self.keys.stream)
                    .arg(&self.keys.group)
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
}

impl Transport for RedisTransport {
    /// `redis`, at the server's host and port from the DSN.
    fn describe(&self) -> TransportDescription {
        let described = TransportDescription::new("redis");
        match self.config.server() {
            Some((host, port)) => described.with_server(host, port),
            None => described,
        }
    }

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

impl Setup for RedisTransport {
    /// `XGROUP CREATE <stream> <group> 0 MKSTREAM`; an existing group is
    /// fine.
    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(self.setup_group())
    }
}

impl WakeUp for RedisTransport {
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

impl Drop for RedisTransport {
    /// Gives back what was read ahead and not handed out, in the background.
    /// Without a runtime to do it in, those entries stay pending for this
    /// consumer, and another one claims them once their lease has passed.
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(spare) = self.ahead.drain_later() else {
            return;
        };
        let (shared, keys) = (Arc::clone(&self.shared), Arc::clone(&self.keys));
        runtime.spawn(async move {
            let spare = spare.await;
            if let Err(e) = settle::release_entries(&shared, &keys, &spare).await {
                tracing::warn!(stream = %keys.stream, error = %e, "giving back entries read ahead failed");
            }
        });
    }
}

impl fmt::Debug for RedisTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTransport")
            .field("config", &self.config)
            .field("stream", &self.keys.stream)
            .field("consumer", &self.keys.consumer)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoi_core::transport::Receiver;

    #[tokio::test]
    async fn with_config_refuses_settings_changed_in_code_as_from_dsn_would() {
        let base = RedisConfig::from_dsn("redis://127.0.0.1:1").unwrap();
        type Change = (&'static str, fn(&mut RedisConfig));
        let changes: [Change; 6] = [
            ("lease", |o| o.lease = Duration::ZERO),
            ("connect_timeout", |o| o.connect_timeout = Duration::ZERO),
            ("lease", |o| o.lease = Duration::from_secs(400 * 86_400)),
            ("block", |o| o.block = Duration::from_secs(3600)),
            ("trim", |o| o.trim = Some(0)),
            ("stream", |o| o.stream = Some(String::new())),
        ];
        for (option, change) in changes {
            let mut config = base.clone();
            change(&mut config);
            match RedisTransport::with_config("q", config).await {
                Err(TransportError::InvalidDsn { reason, .. }) => {
                    assert!(reason.contains(option), "{option}: {reason}")
                }
                other => panic!("{option}: expected InvalidDsn, got {:?}", other.err()),
            }
        }
    }

    #[tokio::test]
    async fn every_handle_gets_its_own_consumer_name() {
        let dsn = "redis://127.0.0.1:6379?consumer=worker";
        let a = RedisTransport::connect("t", dsn).await.unwrap();
        let b = RedisTransport::connect("t", dsn).await.unwrap();
        assert!(a.consumer_name().starts_with("worker-"));
        assert_ne!(a.consumer_name(), b.consumer_name());
        assert_ne!(a.client_names(), b.client_names());
        assert!(a.client_names()[1].ends_with(":block"));
        assert_eq!(a.stream(), "envoi:t");
    }

    #[tokio::test]
    async fn it_has_every_ability_redis_streams_give() {
        let t = RedisTransport::connect("t", "redis://127.0.0.1:1")
            .await
            .unwrap();
        assert!(t.as_receiver().is_some());
        assert!(t.as_keepalive().is_some());
        assert!(t.as_setup().is_some());
        assert!(t.as_message_count().is_some());
        assert!(t.as_browse().is_some());
        assert!(t.as_teardown().is_some());
        assert!(t.as_wake_up().is_some());
        assert!(t.as_local_sender().is_none() && t.as_local_receiver().is_none());
    }

    #[tokio::test]
    async fn close_is_idempotent_and_later_calls_fail_as_closed() {
        let t = RedisTransport::connect("t", "redis://127.0.0.1:1")
            .await
            .unwrap();
        t.close().await.unwrap();
        t.close().await.unwrap();
        let sent = t.send(RawMessage::default(), None).await;
        assert!(matches!(sent, Err(TransportError::Closed)), "{sent:?}");
        let got = t.get(1).await;
        assert!(matches!(got, Err(TransportError::Closed)), "{got:?}");
    }
}
