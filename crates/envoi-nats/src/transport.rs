//! [`NatsTransport`]: a JetStream stream and a durable pull consumer.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::connection::State;
use async_nats::jetstream::consumer::pull::{self, BatchConfig};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::stream::{
    Config as StreamConfig, LastRawMessageErrorKind, RetentionPolicy, StorageType,
};
use async_nats::jetstream::{self, AckKind};
use async_nats::{ConnectOptions, RequestErrorKind, StatusCode, Subject};
use bytes::Bytes;
use envoi_core::middleware::BoxFuture;
use envoi_core::transport::{mask_dsn, Capabilities, Delivery, RawMessage, Transport};
use envoi_core::{BoxError, Headers, TransportError};
use futures_util::StreamExt;
use serde::Deserialize;
use tokio::sync::OnceCell;

use crate::config::{subject_matches, NatsConfig, Storage};
use crate::headers;

/// How long a publish may take, from queueing it on the connection to
/// JetStream's acknowledgement, before it is tried again (the JetStream
/// context's default wait for an acknowledgement).
const PUBLISH_ACK_WAIT: Duration = Duration::from_secs(5);
/// How many publishes of one `send_batch` wait for their acknowledgements at
/// once (the JetStream context's default limit).
const PUBLISHES_IN_FLIGHT: usize = 5_000;
/// How many times a publish whose acknowledgement timed out (or whose
/// connection broke) is tried (with `dedup`, always with the same
/// de-duplication id).
const SEND_ATTEMPTS: usize = 3;
/// Extra time a fetch gets beyond its expiry before it is considered
/// stalled and abandoned.
const FETCH_GRACE: Duration = Duration::from_secs(1);
/// The longest a delayed message is deferred at a time.
const MAX_DEFER: Duration = Duration::from_secs(24 * 3600);
/// After this long without a single message, `get` checks the consumer.
const IDLE_CHECK: Duration = Duration::from_secs(5);
/// A `get` this large that comes back full starts the pull request for the
/// next one at once (see [`ReadAhead`]); smaller ones never do.
const READ_AHEAD_MIN: usize = 100;
/// Leases not touched for this long (and at least three lease periods) are
/// forgotten; JetStream has handed those messages out again anyway.
const LEASE_MEMORY: Duration = Duration::from_secs(300);

fn backend(context: impl Into<String>, source: impl Into<BoxError>) -> TransportError {
    TransportError::Backend {
        context: context.into(),
        source: source.into(),
    }
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// The pause before connection attempt number `attempts` (the first
/// connection is attempt 1): none for the first two, then 100 ms doubling up
/// to 2 s, so a server that comes back is used again within two seconds.
fn reconnect_delay(attempts: usize) -> Duration {
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let exp = u32::try_from((attempts - 2).min(5)).unwrap_or(5);
    Duration::from_millis(100 * 2u64.pow(exp)).min(Duration::from_secs(2))
}

/// The message id of stream sequence `sequence`: its decimal digits
/// (what `to_string` gives, without the formatting machinery).
fn sequence_id(sequence: u64) -> String {
    itoa::Buffer::new().format(sequence).to_owned()
}

/// The stream sequence and delivery count in a JetStream ack subject:
/// `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.
/// <timestamp>.<pending>`, or the same with `<domain>.<account hash>` before
/// the stream and possibly more tokens after `<pending>` (ADR-15). One pass
/// over the bytes; only the two numbers `get` needs are parsed.
fn ack_subject_sequences(reply: &str) -> Option<(u64, u64)> {
    let tokens = reply.strip_prefix("$JS.ACK.")?;
    // Where each of the first seven tokens starts, and how many there are.
    let mut starts = [0; 7];
    let mut count = 1;
    for (at, byte) in tokens.bytes().enumerate() {
        if byte == b'.' {
            if let Some(start) = starts.get_mut(count) {
                *start = at + 1;
            }
            count += 1;
        }
    }
    let delivered = match count {
        7 => 2,
        n if n >= 9 => 4,
        _ => return None,
    };
    let token = |i: usize| tokens.get(starts[i]..starts[i + 1] - 1)?.parse().ok();
    Some((token(delivered + 1)?, token(delivered)?))
}

fn parse_id(id: &str) -> Option<u64> {
    id.parse().ok().filter(|seq| *seq > 0)
}

/// The pull request for the next `get`, started when a large `get` came back
/// full: its messages arrive while the caller handles the previous batch.
/// They are handed out by the next `get` (a smaller one gives the surplus
/// back at once), given back if that `get` comes later than half a lease,
/// and given back when the transport is dropped.
#[derive(Debug)]
struct ReadAhead {
    fetch: tokio::task::JoinHandle<(Vec<async_nats::Message>, FetchEnd)>,
    started: Instant,
}

/// A [`ReadAhead`] a `get` is waiting for: put back when that `get` is
/// dropped before it finished (given back to JetStream when another one was
/// started meanwhile).
struct PendingReadAhead<'a> {
    inner: &'a Inner,
    ahead: Option<ReadAhead>,
}

impl Drop for PendingReadAhead<'_> {
    fn drop(&mut self) {
        let Some(ahead) = self.ahead.take() else {
            return;
        };
        let mut slot = lock(&self.inner.read_ahead);
        if slot.is_none() {
            *slot = Some(ahead);
        } else if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(give_back_read_ahead(self.inner.client.clone(), ahead));
        }
    }
}

/// What a `get` found of the pull request started by the previous one.
#[derive(Debug)]
enum ReadAheadUse {
    /// There was none (or it was too old and was given back).
    None,
    /// Its messages were taken; `refilled` when it came back full and the
    /// pull request for the next `get` has been started.
    Taken { refilled: bool },
    /// It ended with an error; the consumer will be re-bound.
    Broken,
}

/// A message handed out and not yet acknowledged, rejected or released.
#[derive(Debug)]
struct Lease {
    /// The JetStream ack subject of the latest delivery.
    reply: Subject,
    /// When it was handed out or last kept alive.
    touched: Instant,
}

/// Hashes stream sequences (numbers the server counts up) by a
/// multiplication that spreads them over all bits: much cheaper than
/// SipHash for a map every delivery and acknowledgement goes through.
#[derive(Default)]
struct SequenceHasher(u64);

impl Hasher for SequenceHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

#[derive(Debug)]
struct Leases {
    by_sequence: HashMap<u64, Lease, BuildHasherDefault<SequenceHasher>>,
    last_pruned: Instant,
}

#[derive(Debug)]
struct Inner {
    config: NatsConfig,
    /// `config.subject`, built once.
    subject: Subject,
    /// The server's payload limit as last read (0: none known); re-read
    /// before refusing a message over it.
    max_payload: AtomicUsize,
    client: async_nats::Client,
    js: jetstream::Context,
    consumer: Mutex<Option<Arc<PullConsumer>>>,
    set_up: OnceCell<()>,
    leases: Mutex<Leases>,
    /// Since when fetches have returned nothing (stall detection).
    idle_since: Mutex<Option<Instant>>,
    /// The ack subject of the latest unconfirmed (plain publish) ack, for
    /// `ack_barrier`.
    unconfirmed_ack: Mutex<Option<Subject>>,
    /// Whether the latest `get` failed (then `wait_for_messages` waits).
    get_failed: AtomicBool,
    read_ahead: Mutex<Option<ReadAhead>>,
}

impl Drop for Inner {
    /// Acks are plain publishes queued on the connection, and a client
    /// dropped with writes still queued loses them. The last handle going
    /// away therefore keeps the connection open (on the current runtime)
    /// until the server has confirmed its latest ack, or at least until
    /// everything queued is written.
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let client = self.client.clone();
        let reply = lock(&self.unconfirmed_ack).take();
        let read_ahead = lock(&self.read_ahead).take();
        runtime.spawn(async move {
            if let Some(read_ahead) = read_ahead {
                give_back_read_ahead(client.clone(), read_ahead).await;
            }
            let settle = async {
                match reply {
                    Some(reply) => client
                        .request(reply, AckKind::Ack.into())
                        .await
                        .map(drop)
                        .is_ok(),
                    None => client.flush().await.is_ok(),
                }
            };
            if !matches!(
                tokio::time::timeout(Duration::from_secs(5), settle).await,
                Ok(true)
            ) {
                tracing::debug!("queued acks may not have reached the server before closing");
            }
        });
    }
}

/// A transport on a NATS JetStream stream.
///
/// [`setup`](Transport::setup) creates a work-queue stream capturing the
/// configured subject and a durable pull consumer on it (both idempotently).
/// [`send`](Transport::send) publishes and waits for JetStream's
/// acknowledgement; [`get`](Transport::get) fetches a batch from the
/// consumer, waiting up to the configured `wait` when none is available.
/// Every handle created for the same name shares the durable consumer, so
/// handles (and processes) compete for messages.
///
/// A `get` of at least 100 messages that comes back full starts the pull
/// request for the next batch at once, so the batch arrives while the
/// caller handles this one. What it fetched goes to the next `get`; a
/// smaller next `get`, one that comes later than half a lease, and dropping
/// the last handle give the messages back to JetStream at once.
///
/// Message ids are stream sequence numbers: the id `send` returns is the id
/// of every later delivery of that message and the id `list` and `find` use.
///
/// ```no_run
/// use envoi_core::transport::{RawMessage, Transport};
/// use envoi_nats::NatsTransport;
///
/// # async fn run() -> Result<(), envoi_core::TransportError> {
/// let transport = NatsTransport::from_dsn("orders", "nats://127.0.0.1:4222?lease=30s").await?;
/// transport.setup().await?;
/// let id = transport.send(RawMessage { body: b"hello".to_vec(), ..Default::default() }, None).await?;
/// for delivery in transport.get(10).await? {
///     assert_eq!(delivery.id, id);
///     transport.ack(&delivery.id).await?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct NatsTransport {
    inner: Arc<Inner>,
}

/// JetStream's answer to a publish: the stream sequence it stored the
/// message under, or an error (which can come with `"stream"` and
/// `"seq": 0`). Only what `send` needs is read; the client's own response
/// type is parsed through a buffered, untagged representation, several times
/// the work for every message.
#[derive(Deserialize)]
struct PublishAnswer {
    #[serde(default)]
    seq: u64,
    error: Option<jetstream::Error>,
}

/// The stream sequence in JetStream's answer to a publish, or the error it
/// reports.
fn publish_ack(payload: &[u8]) -> Result<u64, BoxError> {
    match serde_json::from_slice::<PublishAnswer>(payload)? {
        PublishAnswer {
            error: Some(error), ..
        } => Err(error.into()),
        PublishAnswer { seq: 0, .. } => {
            Err("JetStream acknowledged the publish without a sequence".into())
        }
        PublishAnswer { seq, .. } => Ok(seq),
    }
}

/// Whether a failed request lost its answer (the client dropped it with the
/// connection) rather than failing for good.
fn answer_lost(error: &async_nats::RequestError) -> bool {
    match error.kind() {
        RequestErrorKind::TimedOut => true,
        RequestErrorKind::Other => std::error::Error::source(error)
            .is_some_and(|source| source.is::<tokio::sync::oneshot::error::RecvError>()),
        _ => false,
    }
}

/// Gives the messages of `read_ahead` back to JetStream (`-NAK`), so they
/// are delivered again at once rather than after the lease.
async fn give_back_read_ahead(client: async_nats::Client, read_ahead: ReadAhead) {
    if let Ok((messages, _)) = read_ahead.fetch.await {
        give_back(&client, messages).await;
    }
}

async fn give_back(client: &async_nats::Client, messages: Vec<async_nats::Message>) {
    for message in messages {
        if let Some(reply) = message.reply {
            if let Err(error) = client.publish(reply, AckKind::Nak(None).into()).await {
                tracing::debug!(%error, "could not give back a message fetched ahead");
            }
        }
    }
}

/// One pull request for up to `want` messages, waiting up to `expires`.
/// Returns what arrived and how the request ended.
///
/// This is what the consumer's `fetch()` does, reading the replies off a
/// plain subscription: `fetch()` hands out every message with its own copy
/// of the JetStream context, which the transport never uses and which costs
/// an allocation and a dozen reference counts per message to make and drop.
async fn fetch_once(
    client: &async_nats::Client,
    consumer: &PullConsumer,
    want: usize,
    expires: Duration,
) -> (Vec<async_nats::Message>, FetchEnd) {
    let hard_deadline = tokio::time::Instant::now() + expires + FETCH_GRACE;
    let mut messages = Vec::new();
    // One deadline for the request and every message: a timer per message
    // would be armed and disarmed hundreds of times per batch.
    let collect = async {
        let inbox = Subject::from(client.new_inbox());
        let mut replies = match client.subscribe(inbox.clone()).await {
            Ok(replies) => replies,
            Err(e) => return FetchEnd::Failed(backend("requesting a batch", e)),
        };
        let request = BatchConfig {
            batch: want,
            expires: Some(expires),
            no_wait: true,
            ..BatchConfig::default()
        };
        if let Err(e) = consumer.request_batch(request, inbox).await {
            return FetchEnd::Failed(backend("requesting a batch", e));
        }
        messages.reserve_exact(want);
        while messages.len() < want {
            // The subscription ends only when the client is closed.
            let Some(message) = replies.next().await else {
                break;
            };
            match message.status {
                None | Some(StatusCode::OK) => messages.push(message),
                Some(StatusCode::IDLE_HEARTBEAT) => {}
                // Expired, or (no_wait) nothing more to deliver.
                Some(StatusCode::TIMEOUT | StatusCode::NOT_FOUND) => break,
                Some(status) => {
                    return FetchEnd::Failed(backend(
                        "fetching messages",
                        format!(
                            "the server ended the pull request: {status} {}",
                            message.description.as_deref().unwrap_or_default()
                        ),
                    ))
                }
            }
        }
        FetchEnd::Done
    };
    match tokio::time::timeout_at(hard_deadline, collect).await {
        Ok(end) => (messages, end),
        // The server's end-of-batch never came: a stalled pull (a lost
        // connection or subscription, a consumer gone missing).
        Err(_) => (messages, FetchEnd::Stalled),
    }
}

/// How a pull request ended.
#[derive(Debug)]
enum FetchEnd {
    /// The server ended it (batch complete, expired, no messages).
    Done,
    /// No end came within the expiry plus [`FETCH_GRACE`].
    Stalled,
    /// The request or a message failed.
    Failed(TransportError),
}

/// A message ready to publish; kept so that a failed publish can be retried
/// (with `dedup`, under the same de-duplication id).
struct Prepared {
    /// The headers of the first attempt; a retry encodes them again from
    /// `source` (cheaper than copying them for every publish).
    headers: Option<async_nats::HeaderMap>,
    source: Headers,
    /// The de-duplication id every attempt carries (with `dedup`).
    msg_id: Option<uuid::Uuid>,
    not_before: Option<u128>,
    payload: Bytes,
    /// The size of the headers as sent: the server's payload limit counts
    /// them with the body.
    headers_len: usize,
}

impl Prepared {
    /// The headers for the next attempt.
    fn take_headers(&mut self) -> Result<async_nats::HeaderMap, TransportError> {
        match self.headers.take() {
            Some(headers) => Ok(headers),
            None => headers::encode(&self.source, self.msg_id, self.not_before)
                .map_err(|e| backend("encoding headers", e)),
        }
    }
}

impl NatsTransport {
    /// Connects to the server named in `config`. Nothing is created on the
    /// server until [`setup`](Transport::setup) (or the first use, when
    /// `auto_setup` is on).
    ///
    /// # Errors
    ///
    /// [`TransportError::InvalidDsn`] for a name, lease, wait, batch or
    /// `max_ack_pending` that [`NatsConfig::from_dsn`] would refuse (the
    /// fields are public, so a configuration may have been changed in
    /// code); [`TransportError::Backend`] when the server cannot be reached.
    pub async fn connect(config: NatsConfig) -> Result<Self, TransportError> {
        config
            .validate()
            .map_err(|reason| TransportError::InvalidDsn {
                dsn: mask_dsn(&config.server),
                reason,
            })?;
        let options = ConnectOptions::new()
            .name("envoi")
            .require_tls(config.tls)
            .reconnect_delay_callback(reconnect_delay)
            .event_callback(|event| async move {
                tracing::debug!(%event, "nats connection event");
            });
        let client = options
            .connect(config.server.as_str())
            .await
            .map_err(|e| backend(format!("connecting to {}", mask_dsn(&config.server)), e))?;
        let js = jetstream::new(client.clone());
        let max_payload = AtomicUsize::new(client.server_info().max_payload);
        Ok(Self {
            inner: Arc::new(Inner {
                subject: Subject::from(config.subject.as_str()),
                max_payload,
                config,
                client,
                js,
                consumer: Mutex::new(None),
                set_up: OnceCell::new(),
                leases: Mutex::new(Leases {
                    by_sequence: HashMap::default(),
                    last_pruned: Instant::now(),
                }),
                idle_since: Mutex::new(None),
                unconfirmed_ack: Mutex::new(None),
                get_failed: AtomicBool::new(false),
                read_ahead: Mutex::new(None),
            }),
        })
    }

    /// Parses `dsn` (see [`NatsConfig`]) and connects.
    pub async fn from_dsn(name: &str, dsn: &str) -> Result<Self, TransportError> {
        Self::connect(NatsConfig::from_dsn(name, dsn)?).await
    }

    /// The configuration in use.
    pub fn config(&self) -> &NatsConfig {
        &self.inner.config
    }

    /// Deletes the stream, its consumer and every message in it. Returns
    /// whether there was a stream to delete.
    pub async fn delete_stream(&self) -> Result<bool, TransportError> {
        *lock(&self.inner.consumer) = None;
        if let Some(ahead) = lock(&self.inner.read_ahead).take() {
            ahead.fetch.abort();
        }
        lock(&self.inner.leases).by_sequence.clear();
        let stream = &self.inner.config.stream;
        match self.inner.js.delete_stream(stream).await {
            Ok(status) => Ok(status.success),
            Err(e) => match e.kind() {
                jetstream::context::DeleteStreamErrorKind::JetStream(js)
                    if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                {
                    Ok(false)
                }
                _ => Err(backend(format!("deleting stream `{stream}`"), e)),
            },
        }
    }

    /// How many messages this handle has handed out and not yet settled.
    pub fn leased(&self) -> usize {
        lock(&self.inner.leases).by_sequence.len()
    }

    fn consumer_config(&self) -> pull::Config {
        let config = &self.inner.config;
        pull::Config {
            durable_name: Some(config.consumer.clone()),
            description: Some("envoi transport consumer".to_string()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: config.lease,
            // Delays are naks: they must not use up a delivery budget.
            max_deliver: -1,
            max_ack_pending: config.max_ack_pending,
            filter_subject: config.subject.clone(),
            ..Default::default()
        }
    }

    async fn setup_now(&self) -> Result<(), TransportError> {
        let config = &self.inner.config;
        let stream = self
            .inner
            .js
            .get_or_create_stream(StreamConfig {
                name: config.stream.clone(),
                subjects: vec![config.subject.clone()],
                retention: RetentionPolicy::WorkQueue,
                storage: match config.storage {
                    Storage::File => StorageType::File,
                    Storage::Memory => StorageType::Memory,
                },
                num_replicas: 1,
                ..Default::default()
            })
            .await
            .map_err(|e| backend(format!("creating stream `{}`", config.stream), e))?;
        let info = stream.cached_info();
        let captured = if info.config.subjects.is_empty() {
            info.config.name == config.subject
        } else {
            info.config
                .subjects
                .iter()
                .any(|filter| subject_matches(filter, &config.subject))
        };
        if !captured {
            return Err(backend(
                format!("setting up stream `{}`", config.stream),
                format!(
                    "the existing stream does not capture subject `{}` (its subjects: {:?})",
                    config.subject, info.config.subjects
                ),
            ));
        }
        if info.config.retention != RetentionPolicy::WorkQueue {
            tracing::warn!(
                stream = %config.stream,
                "existing stream is not a work queue: acknowledged messages stay in it and `list` shows them"
            );
        }
        let consumer = self.bind_consumer(&stream).await?;
        *lock(&self.inner.consumer) = Some(Arc::new(consumer));
        Ok(())
    }

    /// Binds to the durable consumer, creating it, or updating it when its
    /// settings differ from the configuration. A consumer that already has
    /// the right settings is left untouched (no write on the server).
    async fn bind_consumer<I>(
        &self,
        stream: &jetstream::stream::Stream<I>,
    ) -> Result<PullConsumer, TransportError> {
        let wanted = self.consumer_config();
        let name = &self.inner.config.consumer;
        if let Ok(existing) = stream.get_consumer::<pull::Config>(name).await {
            let current = &existing.cached_info().config;
            let same = current.ack_wait == wanted.ack_wait
                && current.max_deliver == wanted.max_deliver
                && current.max_ack_pending == wanted.max_ack_pending
                && current.filter_subject == wanted.filter_subject
                && current.ack_policy == wanted.ack_policy
                && current.deliver_policy == wanted.deliver_policy;
            if same {
                return Ok(existing);
            }
        }
        stream
            .create_consumer(wanted)
            .await
            .map_err(|e| backend(format!("creating consumer `{name}`"), e))
    }

    async fn ensure_setup(&self) -> Result<(), TransportError> {
        if !self.inner.config.auto_setup || self.inner.set_up.initialized() {
            return Ok(());
        }
        // Boxed: the set-up future is several kilobytes, and every `send`
        // future would otherwise be that large (and copied that much).
        Box::pin(self.inner.set_up.get_or_try_init(|| self.setup_now()))
            .await
            .map(|_| ())
    }

    /// The pull consumer, bound (or re-created, if it went missing) when
    /// needed.
    async fn consumer(&self) -> Result<Arc<PullConsumer>, TransportError> {
        if let Some(consumer) = lock(&self.inner.consumer).clone() {
            return Ok(consumer);
        }
        let config = &self.inner.config;
        let stream = self
            .inner
            .js
            .get_stream_no_info(&config.stream)
            .await
            .map_err(|e| backend(format!("opening stream `{}`", config.stream), e))?;
        // Brings the consumer back if it was deleted behind our back.
        let consumer = Arc::new(self.bind_consumer(&stream).await?);
        *lock(&self.inner.consumer) = Some(consumer.clone());
        Ok(consumer)
    }

    fn forget_consumer(&self) {
        *lock(&self.inner.consumer) = None;
    }

    fn prepare(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> Result<Prepared, TransportError> {
        let not_before = delay
            .filter(|d| !d.is_zero())
            .map(|d| now_ms() + d.as_millis());
        let msg_id = self.inner.config.dedup.then(uuid::Uuid::new_v4);
        let headers = headers::encode(&message.headers, msg_id, not_before)
            .map_err(|e| backend("encoding headers", e))?;
        let headers_len = headers::encoded_len(&headers);
        let size = message.body.len() + headers_len;
        let known = self.inner.max_payload.load(Ordering::Relaxed);
        if known > 0 && size > known {
            // The limit may have changed with a reconnection: read it again.
            let max_payload = self.inner.client.server_info().max_payload;
            self.inner.max_payload.store(max_payload, Ordering::Relaxed);
            if max_payload > 0 && size > max_payload {
                return Err(TransportError::TooLarge {
                    size,
                    limit: max_payload,
                });
            }
        }
        Ok(Prepared {
            headers_len,
            headers: Some(headers),
            source: message.headers,
            msg_id,
            not_before,
            payload: Bytes::from(message.body),
        })
    }

    /// Publishes `prepared` and waits for JetStream's acknowledgement,
    /// trying again when it does not come (timed out, connection broken). With
    /// `dedup` the de-duplication id makes a retry store the message at most
    /// once; without, the first attempt may have been stored too (at least
    /// once). The request goes through the client's shared reply
    /// subscription, like the JetStream context's publish.
    async fn publish(&self, prepared: &mut Prepared) -> Result<String, TransportError> {
        for tries in 1..=SEND_ATTEMPTS {
            // One deadline for queueing the request (the connection may be
            // reconnecting) and for the acknowledgement.
            let request = async_nats::Request::new()
                .headers(prepared.take_headers()?)
                .payload(prepared.payload.clone())
                .timeout(None);
            let failed = |hint: &str, error: BoxError| {
                backend(
                    format!(
                        "publishing to `{}` after {tries} attempt(s){hint}",
                        self.inner.config.subject
                    ),
                    error,
                )
            };
            let answer = tokio::time::timeout(
                PUBLISH_ACK_WAIT,
                self.inner
                    .client
                    .send_request(self.inner.subject.clone(), request),
            )
            .await
            .unwrap_or_else(|_| Err(async_nats::RequestError::new(RequestErrorKind::TimedOut)));
            let error = match answer {
                Ok(answer) => {
                    return publish_ack(&answer.payload)
                        .map(sequence_id)
                        .map_err(|e| failed("", e))
                }
                Err(e) if e.kind() == RequestErrorKind::MaxPayloadExceeded => {
                    return Err(TransportError::TooLarge {
                        size: prepared.payload.len() + prepared.headers_len,
                        limit: self.inner.client.server_info().max_payload,
                    })
                }
                Err(e) if e.kind() == RequestErrorKind::NoResponders => {
                    return Err(failed(
                        " (no stream captures the subject: run setup)",
                        e.into(),
                    ))
                }
                Err(e) if !answer_lost(&e) || tries == SEND_ATTEMPTS => {
                    return Err(failed("", e.into()))
                }
                Err(e) => e,
            };
            tracing::debug!(%error, tries, dedup = prepared.msg_id.is_some(), "publish not acknowledged; retrying");
        }
        unreachable!("the loop returns on its last attempt")
    }

    /// Sorts fetched messages: due ones are leased and returned, delayed
    /// ones are given back to JetStream until they are due.
    async fn accept(&self, messages: Vec<async_nats::Message>, out: &mut Vec<Delivery>) {
        let now = now_ms();
        let touched = Instant::now();
        let mut leased = Vec::with_capacity(messages.len());
        out.reserve(messages.len());
        for mut message in messages {
            let Some(reply) = message.reply.take() else {
                tracing::warn!("message without a JetStream ack subject skipped");
                continue;
            };
            let Some((sequence, delivered)) = ack_subject_sequences(&reply) else {
                tracing::warn!(%reply, "message without JetStream metadata skipped");
                continue;
            };
            let (raw, due) = headers::decode_delivered(message.headers.as_ref(), &message.payload);
            if let Some(due) = due {
                if due > now {
                    // Capped so the nanosecond delay fits the server's int64;
                    // a message due later is simply deferred again.
                    let wait = Duration::from_millis(u64::try_from(due - now).unwrap_or(u64::MAX))
                        .min(MAX_DEFER);
                    if let Err(error) = self
                        .inner
                        .client
                        .publish(reply, AckKind::Nak(Some(wait)).into())
                        .await
                    {
                        // The lease expires and JetStream hands it out again.
                        tracing::warn!(%error, sequence, "could not defer a delayed message");
                    }
                    continue;
                }
            }
            tracing::trace!(sequence, delivered, "message handed out");
            leased.push((sequence, Lease { reply, touched }));
            let delivery = Delivery {
                id: sequence_id(sequence),
                raw,
            };
            // Delivered before and not acknowledged (its lease ran out, its
            // consumer gave it back): marked, so a deduplicating handler
            // takes over the key a dead consumer claimed. Not a delayed
            // message: deferring it until it is due counts as a delivery
            // too, so its count cannot tell.
            out.push(if due.is_none() && delivered > 1 {
                delivery.redelivered()
            } else {
                delivery
            });
        }
        if !leased.is_empty() {
            lock(&self.inner.leases).by_sequence.extend(leased);
        }
    }

    /// Stall guard: after a long run of empty fetches, checks that the
    /// consumer still exists and is not sitting on messages it does not
    /// hand out; re-creates the binding if something is off.
    async fn check_idle(&self, got_messages: bool) {
        let due = {
            let mut idle = lock(&self.inner.idle_since);
            if got_messages {
                *idle = None;
                return;
            }
            let since = *idle.get_or_insert_with(Instant::now);
            let period = IDLE_CHECK.max(self.inner.config.wait * 4);
            if since.elapsed() >= period {
                *idle = Some(Instant::now());
                true
            } else {
                false
            }
        };
        if !due {
            return;
        }
        let config = &self.inner.config;
        let info = match self.inner.js.get_stream_no_info(&config.stream).await {
            Ok(stream) => stream.consumer_info(&config.consumer).await,
            Err(e) => {
                tracing::warn!(error = %e, "stall check could not open the stream");
                return;
            }
        };
        match info {
            Ok(info) if info.num_pending > 0 => {
                tracing::warn!(
                    consumer = %config.consumer,
                    pending = info.num_pending,
                    "consumer has pending messages but fetches return none; re-binding"
                );
                self.forget_consumer();
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, consumer = %config.consumer, "consumer check failed; re-binding");
                self.forget_consumer();
            }
        }
    }

    fn prune_leases(&self) {
        let lease = self.inner.config.lease;
        let mut leases = lock(&self.inner.leases);
        if leases.last_pruned.elapsed() < lease {
            return;
        }
        leases.last_pruned = Instant::now();
        let keep = LEASE_MEMORY.max(lease * 3);
        leases.by_sequence.retain(|_, l| l.touched.elapsed() < keep);
    }

    fn take_lease(&self, sequence: u64) -> Option<Lease> {
        lock(&self.inner.leases).by_sequence.remove(&sequence)
    }

    async fn send_ack(&self, reply: Subject, kind: AckKind) -> Result<(), TransportError> {
        if self.inner.config.double_ack {
            let response = self
                .inner
                .client
                .request(reply, kind.into())
                .await
                .map_err(|e| backend("acknowledging (waiting for confirmation)", e))?;
            if let Some(status) = response.status {
                if !status.is_success() {
                    return Err(backend(
                        "acknowledging",
                        format!("server answered {status}"),
                    ));
                }
            }
            Ok(())
        } else {
            if matches!(kind, AckKind::Ack) {
                *lock(&self.inner.unconfirmed_ack) = Some(reply.clone());
            }
            self.inner
                .client
                .publish(reply, kind.into())
                .await
                .map_err(|e| backend("acknowledging", e))
        }
    }

    /// Read-your-acks for `list`, `find` and `message_count`: plain acks are
    /// processed by the server after they are sent, so the latest one is
    /// sent again as a confirmed ack. The consumer handles acks from one
    /// connection in order, so once that one is confirmed, every earlier ack
    /// from this handle has been applied. Acking twice is harmless.
    async fn ack_barrier(&self) {
        let Some(reply) = lock(&self.inner.unconfirmed_ack).take() else {
            return;
        };
        let confirmation = self.inner.client.request(reply, AckKind::Ack.into());
        match tokio::time::timeout(Duration::from_secs(5), confirmation).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::debug!(%error, "ack barrier not confirmed"),
            Err(_) => tracing::debug!("ack barrier timed out"),
        }
    }

    /// Removes the message with stream sequence `sequence` from the stream
    /// directly (used for ids this handle did not hand out, such as ids
    /// from `list`). A message that is already gone counts as removed.
    async fn delete_by_sequence(&self, sequence: u64) -> Result<(), TransportError> {
        let config = &self.inner.config;
        let stream = self
            .inner
            .js
            .get_stream_no_info(&config.stream)
            .await
            .map_err(|e| backend(format!("opening stream `{}`", config.stream), e))?;
        match stream.delete_message(sequence).await {
            Ok(_) => Ok(()),
            Err(e) => match e.kind() {
                jetstream::stream::DeleteMessageErrorKind::JetStream(js)
                    if js.error_code() == jetstream::ErrorCode::STREAM_MESSAGE_DELETE_FAILED
                        || js.error_code() == jetstream::ErrorCode::NO_MESSAGE_FOUND
                        || js.error_code() == jetstream::ErrorCode::SEQUENCE_NOT_FOUND =>
                {
                    Ok(())
                }
                _ => Err(backend(format!("deleting message {sequence}"), e)),
            },
        }
    }

    async fn remove(&self, id: &str) -> Result<(), TransportError> {
        let sequence = parse_id(id).ok_or_else(|| TransportError::NotFound(id.to_string()))?;
        match self.take_lease(sequence) {
            Some(lease) => self.send_ack(lease.reply, AckKind::Ack).await,
            None => self.delete_by_sequence(sequence).await,
        }
    }

    async fn get_now(&self, max: usize) -> Result<Vec<Delivery>, TransportError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        self.ensure_setup().await?;
        self.prune_leases();
        let consumer = self.consumer().await?;
        let wait = self.inner.config.wait;
        let want = max.min(self.inner.config.batch);
        let mut out = Vec::new();
        match self.use_read_ahead(&consumer, want, &mut out).await {
            // The next batch is on its way: hand out what came, even if
            // every message in it was a deferred delayed one.
            ReadAheadUse::Taken { refilled: true } => {
                self.check_idle(!out.is_empty()).await;
                return Ok(out);
            }
            _ if !out.is_empty() => {
                self.check_idle(true).await;
                return Ok(out);
            }
            ReadAheadUse::None | ReadAheadUse::Taken { .. } | ReadAheadUse::Broken => {}
        }
        let deadline = Instant::now() + wait;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let expires = remaining.max(Duration::from_millis(10));
            let started = Instant::now();
            // `out` is empty here: the loop ends once it holds anything.
            let (messages, end) = fetch_once(&self.inner.client, &consumer, want, expires).await;
            let fetched = messages.len();
            // A full batch: the server is asked for the next one before this
            // one is decoded, so it never waits on the decoding.
            let refilled =
                matches!(end, FetchEnd::Done) && self.read_ahead(&consumer, want, fetched);
            self.accept(messages, &mut out).await;
            match end {
                FetchEnd::Done => {}
                FetchEnd::Stalled => {
                    self.forget_consumer();
                    if self.inner.client.connection_state() != State::Connected {
                        if out.is_empty() {
                            return Err(backend(
                                "fetching messages",
                                "the connection to the server is down (reconnecting)",
                            ));
                        }
                    } else {
                        tracing::warn!(
                            consumer = %self.inner.config.consumer,
                            "pull request got no answer; the consumer will be re-bound"
                        );
                    }
                    break;
                }
                FetchEnd::Failed(error) => {
                    tracing::warn!(%error, "pull request failed; the consumer will be re-bound");
                    self.forget_consumer();
                    if out.is_empty() {
                        return Err(error);
                    }
                    break;
                }
            }
            if refilled || !out.is_empty() || Instant::now() >= deadline {
                break;
            }
            if fetched == 0 && started.elapsed() < expires / 2 {
                // The server answered at once (e.g. other requests are
                // waiting for the few pending messages): do not spin.
                let pause = Duration::from_millis(20)
                    .min(deadline.saturating_duration_since(Instant::now()));
                tokio::time::sleep(pause).await;
            }
        }
        self.check_idle(!out.is_empty()).await;
        Ok(out)
    }

    /// Takes the pending [`ReadAhead`], if any, into `out`: up to `want` of
    /// its messages, the rest given back (all of them when it is older than
    /// half a lease). When it came back full, the pull request for the next
    /// `get` goes out before its messages are decoded.
    async fn use_read_ahead(
        &self,
        consumer: &Arc<PullConsumer>,
        want: usize,
        out: &mut Vec<Delivery>,
    ) -> ReadAheadUse {
        let Some(ahead) = lock(&self.inner.read_ahead).take() else {
            return ReadAheadUse::None;
        };
        if ahead.started.elapsed() > self.inner.config.lease / 2 {
            give_back_read_ahead(self.inner.client.clone(), ahead).await;
            return ReadAheadUse::None;
        }
        // The pull request may wait on the server up to `wait`: should this
        // `get` be dropped meanwhile, the guard puts it back for the next
        // `get` (or gives it back), rather than let what it brings sit out
        // the lease.
        let mut waiting = PendingReadAhead {
            inner: &self.inner,
            ahead: Some(ahead),
        };
        let fetched = match waiting.ahead.as_mut() {
            Some(ahead) => (&mut ahead.fetch).await,
            None => return ReadAheadUse::None,
        };
        waiting.ahead = None;
        let Ok((mut messages, end)) = fetched else {
            return ReadAheadUse::None;
        };
        let refilled =
            matches!(end, FetchEnd::Done) && self.read_ahead(consumer, want, messages.len());
        if messages.len() > want {
            let surplus = messages.split_off(want);
            give_back(&self.inner.client, surplus).await;
        }
        self.accept(messages, out).await;
        match end {
            FetchEnd::Done => ReadAheadUse::Taken { refilled },
            FetchEnd::Stalled | FetchEnd::Failed(_) => {
                tracing::debug!(consumer = %self.inner.config.consumer, ?end, "pull request fetching ahead failed; the consumer will be re-bound");
                self.forget_consumer();
                ReadAheadUse::Broken
            }
        }
    }

    /// After a pull request for `want` messages (at least
    /// [`READ_AHEAD_MIN`]) that brought `got >= want`, starts the pull
    /// request for the next `get`. Returns whether it did.
    fn read_ahead(&self, consumer: &Arc<PullConsumer>, want: usize, got: usize) -> bool {
        if want < READ_AHEAD_MIN || got < want || lock(&self.inner.consumer).is_none() {
            return false;
        }
        let consumer = Arc::clone(consumer);
        let client = self.inner.client.clone();
        let expires = self.inner.config.wait;
        let fetch =
            tokio::spawn(async move { fetch_once(&client, &consumer, want, expires).await });
        let ahead = ReadAhead {
            fetch,
            started: Instant::now(),
        };
        // Another `get` of this handle may have started one meanwhile.
        if let Some(other) = lock(&self.inner.read_ahead).replace(ahead) {
            tokio::spawn(give_back_read_ahead(self.inner.client.clone(), other));
        }
        true
    }

    fn stream_message_to_delivery(message: jetstream::message::StreamMessage) -> Delivery {
        Delivery {
            id: message.sequence.to_string(),
            raw: headers::decode(Some(&message.headers), &message.payload),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Transport for NatsTransport {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(async move {
            self.ensure_setup().await?;
            let mut prepared = self.prepare(message, delay)?;
            self.publish(&mut prepared).await
        })
    }

    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        Box::pin(async move {
            self.ensure_setup().await?;
            let mut prepared = messages
                .into_iter()
                .map(|(message, delay)| self.prepare(message, delay))
                .collect::<Result<Vec<_>, _>>()?;
            // Every publish goes out before any acknowledgement is awaited
            // (up to PUBLISHES_IN_FLIGHT at a time): one round trip for the
            // whole batch instead of one per message. Publishes are first
            // polled, and so queued on the connection, in the batch's order.
            let mut in_flight = futures_util::stream::FuturesOrdered::new();
            let mut ids = Vec::with_capacity(prepared.len());
            for message in &mut prepared {
                if in_flight.len() >= PUBLISHES_IN_FLIGHT {
                    if let Some(id) = in_flight.next().await {
                        ids.push(id?);
                    }
                }
                in_flight.push_back(self.publish(message));
            }
            while let Some(id) = in_flight.next().await {
                ids.push(id?);
            }
            Ok(ids)
        })
    }

    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            let result = self.get_now(max).await;
            self.inner
                .get_failed
                .store(result.is_err(), Ordering::Relaxed);
            result
        })
    }

    fn ack<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.remove(id))
    }

    fn ack_batch<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let mut replies = Vec::with_capacity(ids.len());
            let mut others = Vec::new();
            {
                let mut leases = lock(&self.inner.leases);
                for id in ids {
                    let sequence =
                        parse_id(id).ok_or_else(|| TransportError::NotFound(id.to_string()))?;
                    match leases.by_sequence.remove(&sequence) {
                        Some(lease) => replies.push(lease.reply),
                        None => others.push(sequence),
                    }
                }
            }
            if self.inner.config.double_ack {
                let confirmations = replies
                    .into_iter()
                    .map(|reply| self.send_ack(reply, AckKind::Ack));
                for result in futures_util::future::join_all(confirmations).await {
                    result?;
                }
            } else if let Some(last) = replies.last() {
                // Acks are plain publishes: they are queued on the connection
                // and written together. The last one is the barrier for
                // `ack_barrier`.
                *lock(&self.inner.unconfirmed_ack) = Some(last.clone());
                for reply in replies {
                    self.inner
                        .client
                        .publish(reply, AckKind::Ack.into())
                        .await
                        .map_err(|e| backend("acknowledging", e))?;
                }
            }
            for sequence in others {
                self.delete_by_sequence(sequence).await?;
            }
            Ok(())
        })
    }

    fn reject<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        // On a work-queue stream an acknowledgement removes the message.
        Box::pin(self.remove(id))
    }

    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let sequence = parse_id(id).ok_or_else(|| TransportError::NotFound(id.to_string()))?;
            let lease = self
                .take_lease(sequence)
                .ok_or_else(|| TransportError::NotFound(id.to_string()))?;
            self.send_ack(lease.reply, AckKind::Nak(None)).await
        })
    }

    fn keepalive<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let sequence = parse_id(id).ok_or_else(|| TransportError::NotFound(id.to_string()))?;
            let reply = {
                let mut leases = lock(&self.inner.leases);
                let lease = leases
                    .by_sequence
                    .get_mut(&sequence)
                    .ok_or_else(|| TransportError::NotFound(id.to_string()))?;
                lease.touched = Instant::now();
                lease.reply.clone()
            };
            self.send_ack(reply, AckKind::Progress).await
        })
    }

    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            self.setup_now().await?;
            let _ = self.inner.set_up.set(());
            Ok(())
        })
    }

    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            self.ensure_setup().await?;
            self.ack_barrier().await;
            let config = &self.inner.config;
            let stream = self
                .inner
                .js
                .get_stream_no_info(&config.stream)
                .await
                .map_err(|e| backend(format!("opening stream `{}`", config.stream), e))?;
            let info = stream
                .consumer_info(&config.consumer)
                .await
                .map_err(|e| backend(format!("reading consumer `{}`", config.consumer), e))?;
            Ok(info.num_pending + info.num_ack_pending as u64)
        })
    }

    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async move {
            self.ensure_setup().await?;
            self.ack_barrier().await;
            let config = &self.inner.config;
            let stream = self
                .inner
                .js
                .get_stream_no_info(&config.stream)
                .await
                .map_err(|e| backend(format!("opening stream `{}`", config.stream), e))?;
            let mut out = Vec::new();
            let mut sequence = 1;
            while out.len() < limit {
                match stream
                    .get_first_raw_message_by_subject(&config.subject, sequence)
                    .await
                {
                    Ok(message) => {
                        sequence = message.sequence + 1;
                        out.push(Self::stream_message_to_delivery(message));
                    }
                    Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => break,
                    Err(e) => {
                        return Err(backend(format!("listing stream `{}`", config.stream), e))
                    }
                }
            }
            Ok(out)
        })
    }

    fn find<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Delivery>, TransportError>> {
        Box::pin(async move {
            let Some(sequence) = parse_id(id) else {
                return Ok(None);
            };
            self.ensure_setup().await?;
            self.ack_barrier().await;
            let config = &self.inner.config;
            let stream = self
                .inner
                .js
                .get_stream_no_info(&config.stream)
                .await
                .map_err(|e| backend(format!("opening stream `{}`", config.stream), e))?;
            match stream.get_raw_message(sequence).await {
                Ok(message) if message.subject.as_str() == config.subject => {
                    Ok(Some(Self::stream_message_to_delivery(message)))
                }
                Ok(_) => Ok(None),
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
                Err(e) => Err(backend(format!("reading message {sequence}"), e)),
            }
        })
    }

    /// Returns at once: an empty `get` has already waited on the server (up
    /// to `wait`) and returns as soon as a message comes, so sleeping here
    /// would only delay the next message. After a failed `get` (the server
    /// unreachable, say) it sleeps the whole `timeout`, so callers do not
    /// retry in a tight loop.
    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        let failed = self.inner.get_failed.load(Ordering::Relaxed);
        Box::pin(async move {
            if failed {
                tokio::time::sleep(timeout).await;
            }
        })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(self.inner.config.storage == Storage::File, true, true, true)
    }
}

#[cfg(test)]
mod tests {
    use super::{ack_subject_sequences, parse_id, publish_ack, reconnect_delay, sequence_id};
    use std::time::Duration;

    #[tokio::test]
    async fn connect_refuses_a_configuration_changed_in_code_as_from_dsn_would() {
        // A port nothing listens on: the check comes before any connection.
        let base = crate::NatsConfig::from_dsn("q", "nats://127.0.0.1:1").unwrap();
        type Change = (&'static str, fn(&mut crate::NatsConfig));
        let changes: [Change; 4] = [
            ("lease", |c| c.lease = Duration::ZERO),
            ("batch", |c| c.batch = 0),
            ("wait", |c| c.wait = Duration::from_secs(3600)),
            ("stream", |c| c.stream = "a.b".into()),
        ];
        for (option, change) in changes {
            let mut config = base.clone();
            change(&mut config);
            match super::NatsTransport::connect(config).await {
                Err(envoi_core::TransportError::InvalidDsn { reason, .. }) => {
                    assert!(reason.contains(option), "{option}: {reason}")
                }
                other => panic!("{option}: expected InvalidDsn, got {:?}", other.err()),
            }
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

    #[test]
    fn publish_answers_give_the_sequence_or_the_error() {
        assert_eq!(
            publish_ack(br#"{"stream":"orders","seq":42}"#).ok(),
            Some(42)
        );
        assert_eq!(
            publish_ack(br#"{"stream":"o","seq":7,"duplicate":true,"domain":"hub"}"#).ok(),
            Some(7)
        );
        let error = publish_ack(
            br#"{"stream":"orders","seq":0,"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}"#,
        )
        .unwrap_err();
        assert!(
            error.to_string().contains("maximum messages exceeded"),
            "{error}"
        );
        let error = publish_ack(br#"{"error":{"code":400,"description":"bad"}}"#).unwrap_err();
        assert!(error.to_string().contains("bad"), "{error}");
        assert!(publish_ack(br#"{"stream":"orders"}"#).is_err());
        assert!(publish_ack(b"").is_err());
        assert!(publish_ack(b"+OK").is_err());
        assert!(publish_ack(br#"{"seq":"x"}"#).is_err());
    }

    #[test]
    fn sequence_ids_are_decimal_digits() {
        for n in [0, 1, 9, 10, 42, 1_000_000, u64::MAX] {
            assert_eq!(sequence_id(n), n.to_string());
            assert_eq!(parse_id(&sequence_id(n)), Some(n).filter(|n| *n > 0));
        }
    }

    #[test]
    fn ack_subjects_of_both_formats_give_sequence_and_delivery_count() {
        assert_eq!(
            ack_subject_sequences("$JS.ACK.orders.workers.3.1042.1040.1700000000000000000.7"),
            Some((1042, 3))
        );
        assert_eq!(
            ack_subject_sequences("$JS.ACK._.ACCHASH.orders.workers.1.5.5.1700000000000000000.0"),
            Some((5, 1))
        );
        assert_eq!(
            ack_subject_sequences(
                "$JS.ACK.hub.ACCHASH.orders.workers.2.77.70.1700000000000000000.0.r4nd0m"
            ),
            Some((77, 2))
        );
        for bad in [
            "",
            "_INBOX.abc",
            "$JS.ACK.orders.workers.3.1042",
            "$JS.ACK.orders.workers.3.x.1040.1700000000000000000.7",
            "$JS.ACK.a.b.c.d.e.f.g.h",
            "$JS.ACK.orders.workers.-1.5.5.1700000000000000000.0",
        ] {
            assert_eq!(ack_subject_sequences(bad), None, "{bad}");
        }
    }

    #[test]
    fn ids_are_positive_stream_sequences() {
        assert_eq!(parse_id("42"), Some(42));
        assert_eq!(parse_id("0"), None);
        assert_eq!(parse_id("-1"), None);
        assert_eq!(parse_id("42.1"), None);
        assert_eq!(parse_id("abc"), None);
    }
}
