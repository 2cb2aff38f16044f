//! [`AmqpTransport`]: the [`Transport`] implementation on RabbitMQ.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use envoi_core::middleware::BoxFuture;
use envoi_core::transport::{Capabilities, Delivery, RawMessage, Transport};
use envoi_core::{Headers, TransportError};
use futures_util::future::join_all;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Consumer,
    ExchangeKind,
};
use smallvec::SmallVec;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::config::{AmqpConfig, QueueType, MAX_QUEUE_NAME};
use crate::error::AmqpError;
use crate::headers;

/// How long `get` waits for a first message when none is buffered.
const GET_WAIT: Duration = Duration::from_millis(200);
/// A delay queue lives this much longer than its delay once unused.
const DELAY_QUEUE_GRACE: Duration = Duration::from_secs(60);
/// A delay queue is declared again (renewing its expiry) when its last
/// declaration is older than this; must stay below [`DELAY_QUEUE_GRACE`].
const DELAY_REDECLARE: Duration = Duration::from_secs(30);
/// Longest single wait between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How often a batch is retried when the broker keeps returning it as
/// unroutable although the topology was declared again.
const UNROUTABLE_ATTEMPTS: usize = 3;
/// Bytes of the content header besides the header table (properties,
/// message id); used to refuse headers that cannot fit in one frame.
const PROPERTIES_OVERHEAD: usize = 512;
/// How long a closing handle waits after its last settlement before it
/// closes the connection; see [`Shared::shutdown`].
const SETTLE_GRACE: Duration = Duration::from_millis(200);
/// AMQP persistent delivery mode.
const PERSISTENT: u8 = 2;

/// A RabbitMQ transport: publishes with confirms to a durable exchange and
/// consumes its durable queue with a prefetching consumer.
///
/// Open one with [`AmqpTransport::connect`] (or through
/// [`AmqpTransportFactory`](crate::AmqpTransportFactory)). Each handle owns
/// one connection with two channels: one in confirm mode for publishing, one
/// for consuming and settling. Dropping the handle closes the connection, and
/// the broker puts back every message the handle had not settled.
///
/// # Delivery ids
///
/// [`Delivery::id`] is `<connection generation>:<delivery tag>`. Delivery
/// tags are scoped to the channel that delivered the message, so an id is
/// only meaningful on the handle that handed it out and only until that
/// handle reconnects; settling it afterwards fails with
/// [`AmqpError::StaleDelivery`] (the broker has already put the message back).
/// The id [`send`](Transport::send) returns is the AMQP `message-id`
/// property (a UUIDv7), not a delivery id.
///
/// # Leases
///
/// RabbitMQ has no lease: an unsettled message is given back when the
/// channel closes. The transport adds one on the consumer side: a handed-out
/// message not settled within the `lease` is given back with
/// `basic.nack(requeue)`; [`keepalive`](Transport::keepalive) restarts it.
pub struct AmqpTransport {
    shared: Arc<Shared>,
}

impl fmt::Debug for AmqpTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpTransport")
            .field("name", &self.shared.name)
            .field("queue", &self.shared.names.queue)
            .field("exchange", &self.shared.names.exchange)
            .field("config", &self.shared.config)
            .finish()
    }
}

struct Names {
    queue: String,
    exchange: String,
    dead: String,
    /// `exchange` and `queue` as AMQP short strings, built once (`None`
    /// when a name is too long for one, which publishing then reports).
    exchange_short: Option<ShortString>,
    queue_short: Option<ShortString>,
}

impl Names {
    fn new(queue: String, exchange: String) -> Self {
        Self {
            dead: format!("{queue}.dead"),
            exchange_short: ShortString::try_new(exchange.as_str()).ok(),
            queue_short: ShortString::try_new(queue.as_str()).ok(),
            queue,
            exchange,
        }
    }

    fn delay_queue(&self, ms: u64) -> String {
        format!("{}.delay.{ms}", self.queue)
    }

    /// The exchange and routing key a message with `delay_ms` is published
    /// with.
    fn route(&self, delay_ms: Option<u64>) -> Result<(ShortString, ShortString), TransportError> {
        match delay_ms {
            Some(ms) => Ok((ShortString::default(), short(&self.delay_queue(ms))?)),
            None => Ok((
                match &self.exchange_short {
                    Some(exchange) => exchange.clone(),
                    None => short(&self.exchange)?,
                },
                match &self.queue_short {
                    Some(queue) => queue.clone(),
                    None => short(&self.queue)?,
                },
            )),
        }
    }
}

/// A message being published: kept until its publish is confirmed, so it can
/// be published again.
struct Outgoing {
    body: Vec<u8>,
    /// The message's headers, encoded again for a second attempt.
    headers: Headers,
    /// The encoded headers of the first attempt.
    table: Option<FieldTable>,
    header_size: usize,
    delay_ms: Option<u64>,
    id: String,
}

impl Outgoing {
    fn new(message: RawMessage, delay: Option<Duration>) -> Result<Self, TransportError> {
        let (table, header_size) =
            headers::encode(&message.headers).map_err(|e| backend("encoding headers", e))?;
        let delay_ms = delay.filter(|d| !d.is_zero()).map(|d| {
            // Never early: round up to the next millisecond.
            let ms = d.as_nanos().div_ceil(1_000_000);
            u64::try_from(ms).unwrap_or(u64::MAX)
        });
        Ok(Self {
            body: message.body,
            headers: message.headers,
            table: Some(table),
            header_size,
            delay_ms,
            // Encoded directly: `to_string` would go through the formatting
            // machinery, once per message.
            id: uuid::Uuid::now_v7()
                .hyphenated()
                .encode_lower(&mut uuid::Uuid::encode_buffer())
                .to_owned(),
        })
    }

    /// The header table for the next attempt.
    fn take_table(&mut self) -> Result<FieldTable, TransportError> {
        match self.table.take() {
            Some(table) => Ok(table),
            None => headers::encode(&self.headers)
                .map(|(table, _)| table)
                .map_err(|e| backend("encoding headers", e)),
        }
    }
}

/// One connection and its channels.
struct Link {
    epoch: u64,
    connection: Connection,
    publisher: Channel,
    consumer: Channel,
}

impl Link {
    fn healthy(&self) -> bool {
        self.connection.status().connected()
            && self.publisher.status().connected()
            && self.consumer.status().connected()
    }

    fn frame_max(&self) -> usize {
        match self.connection.configuration().frame_max() {
            0 => usize::MAX,
            n => n as usize,
        }
    }
}

/// What the consumer side holds, all for the link of generation `epoch`.
#[derive(Default)]
struct ConsumeState {
    epoch: u64,
    /// Generation of the running `basic.consume`, if one runs.
    active: Option<u64>,
    /// Its consumer tag.
    tag: Option<ShortString>,
    next_generation: u64,
    /// The running `basic.consume` (of generation `active`). Fetches poll
    /// it themselves, so a delivery goes from the connection's I/O thread
    /// to the fetching task without a hop through another task.
    consumer: Option<Consumer>,
    /// Delivered by the broker, not yet handed out (unsettled on the channel).
    buffer: VecDeque<lapin::message::Delivery>,
    /// Handed out, unsettled: delivery tag → lease deadline.
    leased: BTreeMap<u64, Instant>,
    /// Taken out of `buffer` or `leased`, their settlement being sent.
    settling: BTreeSet<u64>,
    /// Every delivery tag up to this one has been taken from a consumer.
    /// (The broker numbers the deliveries of a channel 1, 2, 3, …)
    seen_upto: u64,
    /// Tags beyond `seen_upto + 1` taken from a consumer first.
    seen_ahead: BTreeSet<u64>,
    last_get: Option<Instant>,
    /// Tasks giving back what a cancelled consumer still delivers.
    give_backs: Vec<JoinHandle<()>>,
}

impl ConsumeState {
    /// Records that delivery `tag` was taken from a consumer.
    fn seen(&mut self, tag: u64) {
        if tag == self.seen_upto + 1 {
            self.seen_upto = tag;
            while self.seen_ahead.remove(&(self.seen_upto + 1)) {
                self.seen_upto += 1;
            }
        } else if tag > self.seen_upto {
            self.seen_ahead.insert(tag);
        }
    }

    /// The lowest delivery tag that may be unsettled on the channel: every
    /// tag below it is settled, or being settled by the caller. One
    /// `basic.ack` with `multiple` can therefore settle the caller's tags
    /// below it without touching anyone else's.
    fn floor(&self) -> u64 {
        let mut floor = self.seen_upto + 1;
        if let Some(&tag) = self.seen_ahead.first() {
            floor = floor.min(tag);
        }
        if let Some(tag) = self.buffer.iter().map(|d| d.delivery_tag).min() {
            floor = floor.min(tag);
        }
        if let Some((&tag, _)) = self.leased.first_key_value() {
            floor = floor.min(tag);
        }
        if let Some(&tag) = self.settling.first() {
            floor = floor.min(tag);
        }
        floor
    }

    /// Whether a consumer runs on link `epoch`.
    fn consuming(&self, epoch: u64) -> bool {
        self.epoch == epoch && self.active.is_some()
    }

    /// Moves what the running consumer has delivered into `buffer`. When
    /// nothing is left, `waker` is registered to be woken by the next
    /// delivery. A consumer that ended (cancelled by the broker, connection
    /// lost) is forgotten, so the next fetch starts another.
    fn drain(&mut self, waker: &Waker, name: &str) {
        let Some(mut consumer) = self.consumer.take() else {
            return;
        };
        let mut cx = Context::from_waker(waker);
        loop {
            match consumer.poll_next_unpin(&mut cx) {
                Poll::Ready(Some(Ok(delivery))) => {
                    self.seen(delivery.delivery_tag);
                    self.buffer.push_back(delivery);
                }
                Poll::Ready(Some(Err(error))) => {
                    tracing::debug!(transport = %name, %error, "AMQP consumer stopped");
                    break;
                }
                Poll::Ready(None) => break,
                Poll::Pending => {
                    self.consumer = Some(consumer);
                    return;
                }
            }
        }
        self.active = None;
        self.tag = None;
    }

    /// Forgets `tags` as being settled, if they are of link `epoch`.
    fn settled(&mut self, epoch: u64, tags: &[u64]) {
        if self.epoch == epoch {
            for tag in tags {
                self.settling.remove(tag);
            }
        }
    }
}

struct Shared {
    name: String,
    config: AmqpConfig,
    names: Names,
    handle_id: String,
    link: RwLock<Option<Arc<Link>>>,
    reconnect: tokio::sync::Mutex<()>,
    epochs: AtomicU64,
    consume: Mutex<ConsumeState>,
    consume_switch: tokio::sync::Mutex<()>,
    /// Notified when a delivery arrives (or the consumer ends).
    arrived: Arc<Notify>,
    /// Wakes every task waiting on `arrived`: the waker the consumer holds.
    on_arrival: Waker,
    /// Delay (ms) → when this handle last declared its queue (`None`: must
    /// be declared again before use, after a reconnection).
    delay_queues: Mutex<HashMap<u64, Option<Instant>>>,
    setup_done: AtomicBool,
    closed: AtomicBool,
    /// When this handle last acknowledged, rejected or released a message.
    last_settle: Mutex<Option<Instant>>,
}

/// Wakes every task waiting for a delivery.
struct ArrivalWaker(Arc<Notify>);

impl Wake for ArrivalWaker {
    fn wake(self: Arc<Self>) {
        self.0.notify_waiters();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.notify_waiters();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn backend(context: impl Into<String>, source: impl Into<envoi_core::BoxError>) -> TransportError {
    TransportError::backend(context, source)
}

/// Whether an error is worth a reconnection (the connection or a channel
/// broke) rather than a permanent failure (refused credentials, a queue
/// declared with other arguments).
fn retryable(error: &lapin::Error) -> bool {
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

/// Positions in a batch of outgoing messages.
type Indices = SmallVec<[usize; 1]>;

fn short(s: &str) -> Result<ShortString, TransportError> {
    ShortString::try_new(s).map_err(|e| backend(format!("name `{s}`"), e))
}

fn forget_declarations(known: &Mutex<HashMap<u64, Option<Instant>>>) {
    for at in lock(known).values_mut() {
        *at = None;
    }
}

/// The id of the delivery `tag` of connection `epoch`: `<epoch>:<tag>`,
/// written without the formatting machinery (this runs per message).
fn delivery_id(epoch: u64, tag: u64) -> String {
    let (mut e, mut t) = (itoa::Buffer::new(), itoa::Buffer::new());
    let (e, t) = (e.format(epoch), t.format(tag));
    let mut id = String::with_capacity(e.len() + 1 + t.len());
    id.push_str(e);
    id.push(':');
    id.push_str(t);
    id
}

fn parse_id(id: &str) -> Option<(u64, u64)> {
    let (epoch, tag) = id.split_once(':')?;
    Some((epoch.parse().ok()?, tag.parse().ok()?))
}

impl AmqpTransport {
    /// Connects the transport called `name` as `dsn` describes (see
    /// [`AmqpConfig`] for the options). The queue and exchange default to
    /// `name`. With `auto_setup` (the default) the topology is declared at
    /// once.
    ///
    /// Fails with [`TransportError::InvalidDsn`] for a bad DSN and
    /// [`TransportError::Backend`] when the broker cannot be reached (after
    /// retrying for `reconnect_timeout`) or refuses the topology.
    pub async fn connect(name: &str, dsn: &str) -> Result<Self, TransportError> {
        Self::with_config(name, AmqpConfig::from_dsn(dsn)?).await
    }

    /// Like [`connect`](Self::connect) with an already parsed configuration.
    ///
    /// Fails with [`TransportError::InvalidDsn`] as well for a value
    /// [`AmqpConfig::from_dsn`] would refuse (the fields are public, so a
    /// configuration may have been changed in code).
    pub async fn with_config(name: &str, config: AmqpConfig) -> Result<Self, TransportError> {
        config
            .validate()
            .map_err(|reason| TransportError::InvalidDsn {
                dsn: config.masked_dsn().to_string(),
                reason,
            })?;
        let queue = config.queue.clone().unwrap_or_else(|| name.to_string());
        if queue.is_empty() || queue.len() > MAX_QUEUE_NAME || queue.starts_with("amq.") {
            return Err(TransportError::InvalidDsn {
                dsn: config.masked_dsn().to_string(),
                reason: format!(
                    "`{queue}` cannot name a queue: give 1 to {MAX_QUEUE_NAME} bytes not starting with `amq.` (option `queue`)"
                ),
            });
        }
        let exchange = config.exchange.clone().unwrap_or_else(|| queue.clone());
        let names = Names::new(queue, exchange);
        let handle_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
        let arrived = Arc::new(Notify::new());
        let shared = Arc::new(Shared {
            name: name.to_string(),
            config,
            names,
            handle_id,
            link: RwLock::new(None),
            reconnect: tokio::sync::Mutex::new(()),
            epochs: AtomicU64::new(0),
            consume: Mutex::new(ConsumeState::default()),
            consume_switch: tokio::sync::Mutex::new(()),
            arrived: Arc::clone(&arrived),
            on_arrival: Waker::from(Arc::new(ArrivalWaker(arrived))),
            delay_queues: Mutex::new(HashMap::new()),
            setup_done: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            last_settle: Mutex::new(None),
        });
        shared.link().await?;
        tokio::spawn(housekeeping(Arc::downgrade(&shared)));
        Ok(Self { shared })
    }

    /// The queue consumed from.
    pub fn queue(&self) -> &str {
        &self.shared.names.queue
    }

    /// The exchange published to (empty: the default exchange).
    pub fn exchange(&self) -> &str {
        &self.shared.names.exchange
    }

    /// How many times the connection was re-established after it broke
    /// (the first connection does not count).
    pub fn reconnections(&self) -> u64 {
        self.shared.epochs.load(Ordering::SeqCst).saturating_sub(1)
    }

    /// The configuration in use.
    pub fn config(&self) -> &AmqpConfig {
        &self.shared.config
    }

    /// Closes the connection: every message handed out or prefetched and not
    /// settled goes back to the queue. Later calls fail with
    /// [`TransportError::Closed`]. Dropping the transport does the same in
    /// the background.
    pub async fn close(&self) -> Result<(), TransportError> {
        self.shared.closed.store(true, Ordering::SeqCst);
        match self.shared.take_link() {
            Some(link) => self.shared.shutdown(link).await,
            None => Ok(()),
        }
    }

    /// Deletes the queue, its dead-letter queue and (unless it is the
    /// default one) the exchange, with every message in them. Delay queues
    /// vanish by themselves once unused. Meant for tests and tooling.
    pub async fn delete(&self) -> Result<(), TransportError> {
        let link = self.shared.link().await?;
        let channel = link
            .connection
            .create_channel()
            .await
            .map_err(|e| backend("opening a channel", e))?;
        let names = &self.shared.names;
        for queue in [&names.queue, &names.dead] {
            channel
                .queue_delete(short(queue)?, Default::default())
                .await
                .map_err(|e| backend(format!("deleting queue `{queue}`"), e))?;
        }
        if !names.exchange.is_empty() {
            channel
                .exchange_delete(short(&names.exchange)?, Default::default())
                .await
                .map_err(|e| backend(format!("deleting exchange `{}`", names.exchange), e))?;
        }
        self.shared.setup_done.store(false, Ordering::SeqCst);
        Ok(())
    }
}

impl Drop for AmqpTransport {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        let Some(link) = self.shared.take_link() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let shared = Arc::clone(&self.shared);
                runtime.spawn(async move {
                    let _ = shared.shutdown(link).await;
                });
            }
            // Without a runtime, dropping the last handle on the connection
            // closes it.
            Err(_) => {
                for task in std::mem::take(&mut lock(&self.shared.consume).give_backs) {
                    task.abort();
                }
            }
        }
    }
}

fn close_in_background(link: Arc<Link>) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let _ = link.connection.close(200, "closed".into()).await;
        });
    }
    // Without a runtime, dropping the last handle closes the connection.
}

impl Shared {
    fn current(&self) -> Option<Arc<Link>> {
        self.link
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn take_link(&self) -> Option<Arc<Link>> {
        self.link
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Closes `link` gracefully: stops the consumer, lets the broker apply
    /// the acknowledgements just sent, then closes the connection (which
    /// gives back everything unsettled).
    ///
    /// Quorum queues apply acknowledgements asynchronously; a connection
    /// closed right after a burst of them can lose the last ones, and the
    /// broker would hand those messages out again. Waiting
    /// [`SETTLE_GRACE`] after the last settlement avoids that.
    async fn shutdown(&self, link: Arc<Link>) -> Result<(), TransportError> {
        // The consumer lives until the connection closes: dropping it
        // earlier would let it cancel itself while acknowledgements settle.
        let (tag, give_backs, _consumer) = {
            let mut state = lock(&self.consume);
            state.active = None;
            state.buffer.clear();
            (
                state.tag.take(),
                std::mem::take(&mut state.give_backs),
                state.consumer.take(),
            )
        };
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

    fn lease(&self) -> Option<Duration> {
        self.config.lease
    }

    /// The current healthy link, reconnecting (with topology recovery) when
    /// the connection or one of its channels broke.
    async fn link(&self) -> Result<Arc<Link>, TransportError> {
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
        let deadline = Instant::now() + self.config.reconnect_timeout;
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.open_link(deadline).await {
                Ok(link) => {
                    let link = Arc::new(link);
                    self.install(Arc::clone(&link));
                    return Ok(link);
                }
                Err((error, retry)) => {
                    if !retry || Instant::now() + backoff >= deadline {
                        return Err(error);
                    }
                    tracing::debug!(transport = %self.name, %error, "AMQP connection attempt failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    async fn open_link(&self, deadline: Instant) -> Result<Link, (TransportError, bool)> {
        let fail = |context: &str, e: lapin::Error| {
            let retry = retryable(&e);
            (backend(context, e), retry)
        };
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
        let connection = tokio::time::timeout(
            budget,
            Connection::connect_uri(self.config.uri().clone(), properties),
        )
        .await
        .map_err(|_| {
            (
                backend(
                    format!("connecting to {}", self.config.masked_dsn()),
                    AmqpError::ConnectTimeout(budget),
                ),
                true,
            )
        })?
        .map_err(|e| fail(&format!("connecting to {}", self.config.masked_dsn()), e))?;
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
                let retry = matches!(&e, TransportError::Backend { source, .. }
                    if source.downcast_ref::<lapin::Error>().is_some_and(retryable));
                (e, retry)
            })?;
        }
        Ok(link)
    }

    /// Makes `link` current and forgets everything of the previous one: its
    /// unsettled deliveries are back in the queue since it closed.
    fn install(&self, link: Arc<Link>) {
        let mut state = lock(&self.consume);
        for task in state.give_backs.drain(..) {
            task.abort();
        }
        state.epoch = link.epoch;
        state.active = None;
        state.tag = None;
        state.consumer = None;
        state.buffer.clear();
        state.leased.clear();
        state.settling.clear();
        state.seen_upto = 0;
        state.seen_ahead.clear();
        *self.link.write().unwrap_or_else(PoisonError::into_inner) = Some(link);
        forget_declarations(&self.delay_queues);
    }

    /// Forgets `link` if it is still current, so the next call reconnects.
    fn invalidate(&self, link: &Link) {
        let mut current = self.link.write().unwrap_or_else(PoisonError::into_inner);
        if current.as_ref().is_some_and(|l| l.epoch == link.epoch) {
            if let Some(old) = current.take() {
                drop(current);
                close_in_background(old);
            }
        }
    }

    fn main_queue_arguments(&self) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(self.config.queue_type.as_str().into()),
        );
        if self.config.queue_type == QueueType::Quorum {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(self.config.delivery_limit)),
            );
            args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(self.names.dead.as_str().into()),
            );
            args.insert(
                "x-dead-letter-strategy".into(),
                AMQPValue::LongString("at-least-once".into()),
            );
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString("reject-publish".into()),
            );
        }
        self.expires(&mut args);
        args
    }

    fn expires(&self, args: &mut FieldTable) {
        if let Some(expires) = self.config.expires {
            args.insert(
                "x-expires".into(),
                AMQPValue::LongLongInt(i64::try_from(expires.as_millis()).unwrap_or(i64::MAX)),
            );
        }
    }

    fn delay_queue_arguments(&self, ms: u64) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("classic".into()),
        );
        args.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(i64::try_from(ms).unwrap_or(i64::MAX)),
        );
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(self.names.exchange.as_str().into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(self.names.queue.as_str().into()),
        );
        let expires = u64::try_from(DELAY_QUEUE_GRACE.as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(ms);
        args.insert(
            "x-expires".into(),
            AMQPValue::LongLongInt(i64::try_from(expires).unwrap_or(i64::MAX)),
        );
        args
    }

    /// Declares the exchange, the dead-letter queue (quorum), the queue and
    /// its binding, on a channel of its own so a refusal does not break the
    /// link.
    async fn declare(&self, link: &Link) -> Result<(), TransportError> {
        let channel = link
            .connection
            .create_channel()
            .await
            .map_err(|e| backend("opening a channel for setup", e))?;
        let names = &self.names;
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        if !names.exchange.is_empty() {
            channel
                .exchange_declare(
                    short(&names.exchange)?,
                    ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| backend(format!("declaring exchange `{}`", names.exchange), e))?;
        }
        if self.config.queue_type == QueueType::Quorum {
            let mut args = FieldTable::default();
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
            self.expires(&mut args);
            channel
                .queue_declare(short(&names.dead)?, durable, args)
                .await
                .map_err(|e| backend(format!("declaring queue `{}`", names.dead), e))?;
        }
        channel
            .queue_declare(short(&names.queue)?, durable, self.main_queue_arguments())
            .await
            .map_err(|e| backend(format!("declaring queue `{}`", names.queue), e))?;
        if !names.exchange.is_empty() {
            channel
                .queue_bind(
                    short(&names.queue)?,
                    short(&names.exchange)?,
                    short(&names.queue)?,
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    backend(
                        format!("binding queue `{}` to `{}`", names.queue, names.exchange),
                        e,
                    )
                })?;
        }
        let _ = channel.close(200, "setup done".into()).await;
        Ok(())
    }

    /// Declares the delay queue for `ms` unless it was declared recently.
    async fn ensure_delay_queue(&self, link: &Link, ms: u64) -> Result<(), TransportError> {
        let fresh = {
            let mut known = lock(&self.delay_queues);
            // Forget queues that have expired by now (unless another handle
            // kept them alive, in which case they are counted there).
            known.retain(|ms, at| {
                at.is_none_or(|at| at.elapsed() < DELAY_QUEUE_GRACE + Duration::from_millis(*ms))
            });
            known
                .get(&ms)
                .copied()
                .flatten()
                .is_some_and(|at| at.elapsed() < DELAY_REDECLARE)
        };
        if !fresh {
            self.declare_delay_queue(link, ms).await?;
            lock(&self.delay_queues).insert(ms, Some(Instant::now()));
        }
        Ok(())
    }

    /// Declares the delay queue for `ms` (renewing its expiry); returns how
    /// many messages wait in it.
    async fn declare_delay_queue(&self, link: &Link, ms: u64) -> Result<u64, TransportError> {
        let name = self.names.delay_queue(ms);
        let channel = link
            .connection
            .create_channel()
            .await
            .map_err(|e| backend("opening a channel", e))?;
        let queue = channel
            .queue_declare(
                short(&name)?,
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                self.delay_queue_arguments(ms),
            )
            .await
            .map_err(|e| backend(format!("declaring delay queue `{name}`"), e))?;
        let _ = channel.close(200, "declared".into()).await;
        Ok(u64::from(queue.message_count()))
    }

    // ----- publishing -------------------------------------------------------

    /// Publishes `outgoing` with confirms, again (with the same message
    /// ids) what the broker did not confirm, until `reconnect_timeout`.
    async fn publish(&self, outgoing: &mut [Outgoing]) -> Result<(), TransportError> {
        if outgoing.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + self.config.reconnect_timeout;
        // Most sends publish one message: the bookkeeping below then stays
        // on the stack.
        let mut pending: Indices = (0..outgoing.len()).collect();
        let mut unroutable_rounds = 0;
        let mut backoff = Duration::from_millis(50);
        loop {
            let link = self.link().await?;
            let limit = link.frame_max().saturating_sub(PROPERTIES_OVERHEAD);
            if let Some(o) = pending
                .iter()
                .map(|&i| &outgoing[i])
                .find(|o| o.header_size > limit)
            {
                return Err(TransportError::TooLarge {
                    size: o.header_size,
                    limit,
                });
            }
            let mut failed = Indices::new();
            let mut returned = Indices::new();
            let mut last_error: Option<TransportError> = None;
            let mut nacked = false;
            let mut reply = None;

            // Delay queues first, so every publish below is routable.
            let mut delays: Vec<u64> = pending
                .iter()
                .filter_map(|&i| outgoing[i].delay_ms)
                .collect();
            delays.sort_unstable();
            delays.dedup();
            let mut delay_error = None;
            for ms in delays {
                // Boxed, like every rare path here, to keep the future of
                // a send small.
                if let Err(e) = Box::pin(self.ensure_delay_queue(&link, ms)).await {
                    delay_error = Some(e);
                    break;
                }
            }
            if let Some(e) = delay_error {
                if link.healthy() || Instant::now() >= deadline {
                    return Err(e);
                }
                self.invalidate(&link);
                continue;
            }

            // Pipeline every publish, then collect the confirms.
            let mut confirms: SmallVec<[_; 1]> = SmallVec::with_capacity(pending.len());
            for (n, &i) in pending.iter().enumerate() {
                let o = &mut outgoing[i];
                let (exchange, routing_key) = self.names.route(o.delay_ms)?;
                let properties = BasicProperties::default()
                    .with_delivery_mode(PERSISTENT)
                    .with_message_id(short(&o.id)?)
                    .with_headers(o.take_table()?);
                let published = link
                    .publisher
                    .basic_publish(
                        exchange,
                        routing_key,
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &o.body,
                        properties,
                    )
                    .await;
                match published {
                    Ok(confirm) => confirms.push((i, confirm)),
                    Err(e) => {
                        failed.extend(pending[n..].iter().copied());
                        last_error = Some(backend("publishing", e));
                        break;
                    }
                }
            }
            for (i, confirm) in confirms {
                match confirm.await {
                    Ok(Confirmation::Ack(None)) | Ok(Confirmation::NotRequested) => {}
                    Ok(Confirmation::Ack(Some(message))) => {
                        reply = Some(message.reply_text.to_string());
                        returned.push(i);
                    }
                    Ok(Confirmation::Nack(_)) => {
                        nacked = true;
                        failed.push(i);
                    }
                    Err(e) => {
                        failed.push(i);
                        last_error = Some(backend("waiting for the publisher confirm", e));
                    }
                }
            }
            if failed.is_empty() && returned.is_empty() {
                return Ok(());
            }
            if !returned.is_empty() {
                // The queue, binding or a delay queue is gone: declare again.
                unroutable_rounds += 1;
                let first = &outgoing[returned[0]];
                if unroutable_rounds >= UNROUTABLE_ATTEMPTS {
                    let (exchange, routing_key) = match first.delay_ms {
                        Some(ms) => (String::new(), self.names.delay_queue(ms)),
                        None => (self.names.exchange.clone(), self.names.queue.clone()),
                    };
                    return Err(backend(
                        format!("publishing {} message(s)", returned.len()),
                        AmqpError::Unroutable {
                            exchange,
                            routing_key,
                            reply: reply.unwrap_or_default(),
                        },
                    ));
                }
                forget_declarations(&self.delay_queues);
                if let Err(e) = Box::pin(self.declare(&link)).await {
                    if link.healthy() {
                        return Err(e);
                    }
                }
            }
            if !link.healthy() {
                self.invalidate(&link);
            }
            if Instant::now() >= deadline {
                return Err(last_error.unwrap_or_else(|| {
                    backend(
                        format!("publishing {} message(s)", failed.len()),
                        AmqpError::Nacked,
                    )
                }));
            }
            if nacked || !failed.is_empty() {
                tracing::debug!(transport = %self.name, retrying = failed.len() + returned.len(), "retrying unconfirmed publishes");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
            failed.extend(returned);
            failed.sort_unstable();
            pending = failed;
        }
    }

    // ----- consuming --------------------------------------------------------

    /// Starts `basic.consume` on `link` unless a consumer already runs.
    async fn ensure_consuming(self: &Arc<Self>, link: &Arc<Link>) -> Result<(), TransportError> {
        if lock(&self.consume).consuming(link.epoch) {
            return Ok(());
        }
        // In a task of its own: a caller dropped while `basic.consume` is on
        // its way (a `get` or `wait_for_messages` given up) must not leave a
        // consumer the broker starts and nobody polls, holding up to
        // `prefetch` messages until the connection closes. The task finishes
        // starting it, and the next fetch uses it.
        let (shared, link) = (Arc::clone(self), Arc::clone(link));
        let starting = tokio::spawn(async move { shared.start_consuming(&link).await });
        match starting.await {
            Ok(started) => started,
            Err(e) => Err(backend(
                format!("consuming queue `{}`", self.names.queue),
                e,
            )),
        }
    }

    /// The slow path of [`Shared::ensure_consuming`].
    async fn start_consuming(self: &Arc<Self>, link: &Arc<Link>) -> Result<(), TransportError> {
        let _switch = self.consume_switch.lock().await;
        let generation = {
            let mut state = lock(&self.consume);
            if state.consuming(link.epoch) {
                return Ok(());
            }
            if state.epoch != link.epoch {
                // The link was replaced meanwhile; the caller retries.
                return Ok(());
            }
            state.next_generation += 1;
            state.next_generation
        };
        let tag = format!("envoi-{}-{}-{generation}", self.handle_id, link.epoch);
        let consumer = link
            .consumer
            .basic_consume(
                short(&self.names.queue)?,
                short(&tag)?,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await;
        let consumer = match consumer {
            Ok(consumer) => consumer,
            Err(e) => {
                if !link.healthy() {
                    self.invalidate(link);
                }
                return Err(backend(
                    format!("consuming queue `{}`", self.names.queue),
                    e,
                ));
            }
        };
        let mut state = lock(&self.consume);
        if state.epoch != link.epoch {
            return Ok(()); // dropped with the old link
        }
        state.active = Some(generation);
        state.tag = Some(short(&tag)?);
        state.consumer = Some(consumer);
        state.last_get = Some(Instant::now());
        Ok(())
    }

    async fn get(self: &Arc<Self>, max: usize) -> Result<Vec<Delivery>, TransportError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let deadline = Instant::now() + GET_WAIT;
        loop {
            let link = self.link().await?;
            self.ensure_consuming(&link).await?;
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let mut out = Vec::new();
            let running = {
                let mut state = lock(&self.consume);
                let now = Instant::now();
                state.last_get = Some(now);
                if state.epoch == link.epoch {
                    state.drain(&self.on_arrival, &self.name);
                    let lease_end = now + self.lease().unwrap_or(Duration::MAX / 4);
                    while out.len() < max {
                        let Some(d) = state.buffer.pop_front() else {
                            break;
                        };
                        state.leased.insert(d.delivery_tag, lease_end);
                        let delivery = Delivery {
                            id: delivery_id(link.epoch, d.delivery_tag),
                            raw: RawMessage {
                                headers: headers::decode(d.properties.headers().as_ref()),
                                body: d.data,
                            },
                        };
                        // Handed out before and not acknowledged (a
                        // consumer's connection closed, or it gave it back).
                        out.push(if d.redelivered {
                            delivery.redelivered()
                        } else {
                            delivery
                        });
                    }
                }
                state.consuming(link.epoch)
            };
            if !out.is_empty() {
                return Ok(out);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(out);
            }
            if !running {
                // The consumer stopped (connection lost, queue deleted, idle
                // cancel racing us): start again after a short pause.
                tokio::time::sleep(Duration::from_millis(20).min(deadline - now)).await;
                continue;
            }
            if tokio::time::timeout(deadline - now, arrived).await.is_err() {
                return Ok(Vec::new());
            }
        }
    }

    /// Resolves when a delivery is buffered (or the consumer stopped), or
    /// after `timeout`. Waiting counts as activity: it keeps the consumer.
    async fn wait_for_messages(self: &Arc<Self>, timeout: Duration) {
        let wait = async {
            let ready = match self.link().await {
                Ok(link) => self.ensure_consuming(&link).await.map(|()| link),
                Err(e) => Err(e),
            };
            let Ok(link) = ready else {
                // Do not spin while the broker is away.
                std::future::pending::<()>().await;
                return;
            };
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            {
                let mut state = lock(&self.consume);
                state.last_get = Some(Instant::now());
                if state.epoch == link.epoch {
                    state.drain(&self.on_arrival, &self.name);
                }
                if state.epoch != link.epoch || !state.buffer.is_empty() || state.active.is_none() {
                    return;
                }
            }
            arrived.await;
        };
        let _ = tokio::time::timeout(timeout, wait).await;
    }

    /// Removes `ids` from the leases and marks them as being settled;
    /// returns the tags to settle on `link`, the [floor](ConsumeState::floor)
    /// below which they can be settled with one `multiple` frame, and the
    /// first id that could not be settled, with why.
    fn take_leases(&self, link: &Link, ids: &[String]) -> (Vec<u64>, u64, Option<TransportError>) {
        let mut state = lock(&self.consume);
        let mut tags = Vec::with_capacity(ids.len());
        let mut error = None;
        for id in ids {
            match parse_id(id) {
                Some((epoch, tag)) if epoch == link.epoch && state.epoch == link.epoch => {
                    if state.leased.remove(&tag).is_some() {
                        tags.push(tag);
                    } else if error.is_none() {
                        error = Some(TransportError::NotFound(id.clone()));
                    }
                }
                Some((epoch, _)) if epoch > 0 && epoch < link.epoch => {
                    if error.is_none() {
                        error = Some(backend(
                            format!("settling `{id}`"),
                            AmqpError::StaleDelivery(id.clone()),
                        ));
                    }
                }
                _ => {
                    if error.is_none() {
                        error = Some(TransportError::NotFound(id.clone()));
                    }
                }
            }
        }
        let floor = state.floor();
        state.settling.extend(tags.iter().copied());
        (tags, floor, error)
    }

    async fn settle(&self, ids: &[String], how: Settle) -> Result<(), TransportError> {
        if ids.is_empty() {
            return Ok(());
        }
        let Some(link) = self.current().filter(|l| l.healthy()) else {
            // The connection that delivered these is gone; so are the
            // deliveries (the broker put them back). Unknown ids stay unknown.
            let stale = ids
                .iter()
                .find(|id| parse_id(id).is_some_and(|(e, _)| e > 0));
            return Err(match stale {
                Some(id) if !self.closed.load(Ordering::SeqCst) => backend(
                    format!("settling `{id}`"),
                    AmqpError::StaleDelivery(id.clone()),
                ),
                Some(_) => TransportError::Closed,
                None => TransportError::NotFound(ids[0].clone()),
            });
        };
        let (tags, floor, refused) = self.take_leases(&link, ids);
        let sent =
            if matches!(how, Settle::Ack) {
                // Every tag below the floor in one frame, the others one by one.
                let mut sorted = tags.clone();
                sorted.sort_unstable();
                let below = sorted.partition_point(|&tag| tag < floor);
                let mut frames = Vec::with_capacity(sorted.len() - below + 1);
                if below > 0 {
                    frames.push((sorted[below - 1], below > 1));
                }
                frames.extend(sorted[below..].iter().map(|&tag| (tag, false)));
                join_all(frames.into_iter().map(|(tag, multiple)| {
                    link.consumer.basic_ack(tag, BasicAckOptions { multiple })
                }))
                .await
            } else {
                join_all(tags.iter().map(|&tag| how.send(&link.consumer, tag))).await
            };
        lock(&self.consume).settled(link.epoch, &tags);
        *lock(&self.last_settle) = Some(Instant::now());
        if let Some(e) = sent.into_iter().find_map(Result::err) {
            if !link.healthy() {
                self.invalidate(&link);
            }
            return Err(backend(
                format!("{} {} message(s)", how.verb(), tags.len()),
                e,
            ));
        }
        match refused {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn keepalive(&self, id: &str) -> Result<(), TransportError> {
        let Some((epoch, tag)) = parse_id(id) else {
            return Err(TransportError::NotFound(id.to_string()));
        };
        let mut state = lock(&self.consume);
        if state.epoch != epoch {
            return Err(if epoch > 0 && epoch < state.epoch {
                backend(
                    format!("keeping `{id}` alive"),
                    AmqpError::StaleDelivery(id.to_string()),
                )
            } else {
                TransportError::NotFound(id.to_string())
            });
        }
        let lease = self.lease();
        match state.leased.get_mut(&tag) {
            Some(deadline) => {
                if let Some(lease) = lease {
                    *deadline = Instant::now() + lease;
                }
                Ok(())
            }
            None => Err(TransportError::NotFound(id.to_string())),
        }
    }

    async fn message_count(&self) -> Result<u64, TransportError> {
        let link = self.link().await?;
        let channel = link
            .connection
            .create_channel()
            .await
            .map_err(|e| backend("opening a channel", e))?;
        let queue = channel
            .queue_declare(
                short(&self.names.queue)?,
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| backend(format!("counting queue `{}`", self.names.queue), e))?;
        let _ = channel.close(200, "counted".into()).await;
        let mut total = u64::from(queue.message_count());
        let delays: Vec<u64> = lock(&self.delay_queues).keys().copied().collect();
        for ms in delays {
            total += self.declare_delay_queue(&link, ms).await?;
        }
        let mut state = lock(&self.consume);
        if state.epoch == link.epoch {
            // What the consumer received but no fetch took yet counts too.
            state.drain(&self.on_arrival, &self.name);
            total += (state.buffer.len() + state.leased.len()) as u64;
        }
        Ok(total)
    }

    // ----- housekeeping -----------------------------------------------------

    /// Gives back expired leases and stops an idle consumer.
    async fn housekeep(self: &Arc<Self>) {
        let Some(link) = self.current().filter(|l| l.healthy()) else {
            return;
        };
        let now = Instant::now();
        let expired: Vec<u64> = {
            let mut state = lock(&self.consume);
            if state.epoch != link.epoch {
                return;
            }
            let expired: Vec<u64> = state
                .leased
                .iter()
                .filter(|(_, deadline)| **deadline <= now)
                .map(|(tag, _)| *tag)
                .collect();
            for tag in &expired {
                state.leased.remove(tag);
            }
            state.settling.extend(expired.iter().copied());
            expired
        };
        if !expired.is_empty() {
            tracing::debug!(transport = %self.name, count = expired.len(), "leases expired; giving the messages back");
            let _ = join_all(
                expired
                    .iter()
                    .map(|&t| Settle::Release.send(&link.consumer, t)),
            )
            .await;
            lock(&self.consume).settled(link.epoch, &expired);
        }
        self.cancel_if_idle(&link).await;
    }

    async fn cancel_if_idle(self: &Arc<Self>, link: &Arc<Link>) {
        let idle = |s: &ConsumeState| {
            s.consuming(link.epoch)
                && s.last_get
                    .is_none_or(|at| at.elapsed() >= self.config.consumer_idle)
        };
        if !idle(&lock(&self.consume)) {
            return;
        }
        let _switch = self.consume_switch.lock().await;
        let (tag, consumer, buffered) = {
            let mut state = lock(&self.consume);
            if !idle(&state) {
                return;
            }
            state.drain(&self.on_arrival, &self.name);
            state.active = None;
            let buffered: Vec<u64> = state.buffer.drain(..).map(|d| d.delivery_tag).collect();
            state.settling.extend(buffered.iter().copied());
            (state.tag.take(), state.consumer.take(), buffered)
        };
        if let Some(tag) = tag {
            let _ = link
                .consumer
                .basic_cancel(tag, BasicCancelOptions::default())
                .await;
        }
        if let Some(consumer) = consumer {
            // What it delivered between the drain above and the broker
            // taking the cancellation.
            let rest = tokio::spawn(give_back_rest(
                Arc::downgrade(self),
                Arc::clone(link),
                consumer,
            ));
            let mut state = lock(&self.consume);
            state.give_backs.retain(|p| !p.is_finished());
            state.give_backs.push(rest);
        }
        let _ = join_all(
            buffered
                .iter()
                .map(|&t| Settle::Release.send(&link.consumer, t)),
        )
        .await;
        lock(&self.consume).settled(link.epoch, &buffered);
    }
}

/// Gives back everything a cancelled consumer still delivers, until the
/// broker confirms the cancellation and the stream ends.
async fn give_back_rest(shared: Weak<Shared>, link: Arc<Link>, mut consumer: Consumer) {
    while let Some(Ok(delivery)) = consumer.next().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let tag = delivery.delivery_tag;
        {
            let mut state = lock(&shared.consume);
            if state.epoch != link.epoch {
                // The connection that delivered it is gone, and with it the
                // delivery: the broker has put it back.
                continue;
            }
            state.seen(tag);
            state.settling.insert(tag);
        }
        let _ = Settle::Release.send(&link.consumer, tag).await;
        lock(&shared.consume).settled(link.epoch, &[tag]);
    }
}

/// Periodically expires leases and cancels an idle consumer, for as long as
/// the transport lives.
async fn housekeeping(shared: Weak<Shared>) {
    let tick = {
        let Some(s) = shared.upgrade() else {
            return;
        };
        let by_lease = s.lease().map_or(Duration::from_secs(1), |l| l / 8);
        by_lease
            .min(s.config.consumer_idle / 4)
            .clamp(Duration::from_millis(25), Duration::from_secs(1))
    };
    loop {
        tokio::time::sleep(tick).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.closed.load(Ordering::SeqCst) {
            return;
        }
        shared.housekeep().await;
    }
}

#[derive(Clone, Copy)]
enum Settle {
    Ack,
    Reject,
    Release,
}

impl Settle {
    async fn send(self, channel: &Channel, tag: u64) -> Result<(), lapin::Error> {
        match self {
            Settle::Ack => channel.basic_ack(tag, BasicAckOptions::default()).await,
            Settle::Reject => {
                channel
                    .basic_reject(tag, BasicRejectOptions { requeue: false })
                    .await
            }
            Settle::Release => {
                channel
                    .basic_nack(
                        tag,
                        BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        },
                    )
                    .await
            }
        }
    }

    fn verb(self) -> &'static str {
        match self {
            Settle::Ack => "acknowledging",
            Settle::Reject => "rejecting",
            Settle::Release => "releasing",
        }
    }
}

impl Transport for AmqpTransport {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(async move {
            let mut outgoing = [Outgoing::new(message, delay)?];
            self.shared.publish(&mut outgoing).await?;
            let [sent] = outgoing;
            Ok(sent.id)
        })
    }

    fn send_batch(
        &self,
        messages: Vec<(RawMessage, Option<Duration>)>,
    ) -> BoxFuture<'_, Result<Vec<String>, TransportError>> {
        Box::pin(async move {
            let mut outgoing = messages
                .into_iter()
                .map(|(message, delay)| Outgoing::new(message, delay))
                .collect::<Result<Vec<_>, _>>()?;
            self.shared.publish(&mut outgoing).await?;
            Ok(outgoing.into_iter().map(|o| o.id).collect())
        })
    }

    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(self.shared.get(max))
    }

    fn wait_for_messages(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(self.shared.wait_for_messages(timeout))
    }

    fn ack<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.shared.settle(&[id.to_string()], Settle::Ack).await })
    }

    fn ack_batch<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.shared.settle(ids, Settle::Ack))
    }

    fn reject<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.shared.settle(&[id.to_string()], Settle::Reject).await })
    }

    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.shared.settle(&[id.to_string()], Settle::Release).await })
    }

    fn keepalive<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.shared.keepalive(id))
    }

    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            let link = self.shared.link().await?;
            self.shared.declare(&link).await?;
            self.shared.setup_done.store(true, Ordering::SeqCst);
            Ok(())
        })
    }

    fn message_count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(self.shared.message_count())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(true, true, true, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn with_config_refuses_a_configuration_changed_in_code_as_from_dsn_would() {
        // The check comes before connecting: nothing listens on port 1.
        let base = AmqpConfig::from_dsn("amqp://127.0.0.1:1/%2f?auto_setup=false").unwrap();
        type Change = (&'static str, fn(&mut AmqpConfig));
        let changes: [Change; 5] = [
            ("prefetch", |c| c.prefetch = 0),
            ("lease", |c| c.lease = Some(Duration::MAX)),
            ("consumer_idle", |c| c.consumer_idle = Duration::ZERO),
            ("expires", |c| c.expires = Some(Duration::ZERO)),
            ("queue", |c| c.queue = Some("amq.mine".into())),
        ];
        for (option, change) in changes {
            let mut config = base.clone();
            change(&mut config);
            match AmqpTransport::with_config("q", config).await {
                Err(TransportError::InvalidDsn { reason, .. }) => {
                    assert!(reason.contains(option), "{option}: {reason}")
                }
                other => panic!("{option}: expected InvalidDsn, got {:?}", other.err()),
            }
        }
    }

    #[test]
    fn delivery_ids_parse_back_to_their_epoch_and_tag() {
        for (epoch, tag) in [(1, 1), (0, 0), (7, 1_234_567), (u64::MAX, u64::MAX)] {
            let id = delivery_id(epoch, tag);
            assert_eq!(id, format!("{epoch}:{tag}"));
            assert_eq!(parse_id(&id), Some((epoch, tag)));
        }
        assert_eq!(parse_id("7"), None);
        assert_eq!(parse_id("a:1"), None);
    }

    #[test]
    fn the_floor_is_the_lowest_tag_that_may_be_unsettled() {
        let mut state = ConsumeState::default();
        assert_eq!(state.floor(), 1);
        for tag in [1, 2, 4, 5] {
            state.seen(tag);
        }
        // Tag 3 has not been taken from a consumer: it may be unsettled.
        assert_eq!(state.seen_upto, 2);
        assert_eq!(state.floor(), 3);
        state.seen(3);
        assert_eq!(state.seen_upto, 5);
        assert!(state.seen_ahead.is_empty());
        assert_eq!(state.floor(), 6);
        state.leased.insert(4, Instant::now());
        assert_eq!(state.floor(), 4);
        state.settling.insert(2);
        assert_eq!(state.floor(), 2);
        state.settled(state.epoch, &[2]);
        assert_eq!(state.floor(), 4);
        // Settlements of another link's tags change nothing.
        state.settling.insert(2);
        state.settled(state.epoch + 1, &[2]);
        assert_eq!(state.floor(), 2);
    }
}
