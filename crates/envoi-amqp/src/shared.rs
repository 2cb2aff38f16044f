//! [`Shared`]: the state every part of one handle works on (its connection,
//! its consumer's bookkeeping, the delay queues it declared), and the small
//! helpers they all use.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::task::Waker;
use std::time::Instant;

use envoi_core::TransportError;
use lapin::types::ShortString;
use tokio::sync::Notify;

use crate::config::AmqpConfig;
use crate::consume::{ArrivalWaker, ConsumeState};
use crate::link::Link;
use crate::topology::Names;

/// What one [`AmqpTransport`](crate::AmqpTransport) handle holds, shared with
/// its background tasks.
pub(crate) struct Shared {
    /// The transport's name.
    pub(crate) name: String,
    pub(crate) config: AmqpConfig,
    pub(crate) names: Names,
    /// A short random id of this handle, part of its consumer tags.
    pub(crate) handle_id: String,
    /// The current connection, if one is open.
    pub(crate) link: RwLock<Option<Arc<Link>>>,
    /// Held while reconnecting: one task reconnects, the others wait.
    pub(crate) reconnect: tokio::sync::Mutex<()>,
    /// The epoch of the latest connection (1 for the first).
    pub(crate) epochs: AtomicU64,
    pub(crate) consume: Mutex<ConsumeState>,
    /// Held while a consumer is started or cancelled.
    pub(crate) consume_switch: tokio::sync::Mutex<()>,
    /// Notified when a delivery arrives (or the consumer ends).
    pub(crate) arrived: Arc<Notify>,
    /// Wakes every task waiting on `arrived`: the waker the consumer holds.
    pub(crate) on_arrival: Waker,
    /// Delay (ms) → when this handle last declared its queue (`None`: must
    /// be declared again before use, after a reconnection).
    pub(crate) delay_queues: Mutex<HashMap<u64, Option<Instant>>>,
    /// Whether `setup` ran: the topology is declared again on reconnect
    /// even without `auto_setup`.
    pub(crate) setup_done: AtomicBool,
    pub(crate) closed: AtomicBool,
    /// When this handle last acknowledged, rejected or released a message.
    pub(crate) last_settle: Mutex<Option<Instant>>,
    /// Held while the queue is browsed: one browse at a time.
    pub(crate) browsing: tokio::sync::Mutex<()>,
}

impl Shared {
    /// The state of a handle not connected yet.
    pub(crate) fn new(name: &str, config: AmqpConfig, names: Names) -> Self {
        let arrived = Arc::new(Notify::new());
        Self {
            name: name.to_string(),
            config,
            names,
            handle_id: uuid::Uuid::new_v4().simple().to_string()[..8].to_string(),
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
            browsing: tokio::sync::Mutex::new(()),
        }
    }
}

/// Locks `m`, whether or not a panic poisoned it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A [`TransportError::Backend`] saying what was being done.
pub(crate) fn backend(
    context: impl Into<String>,
    source: impl Into<envoi_core::BoxError>,
) -> TransportError {
    TransportError::backend(context, source)
}

/// `s` as an AMQP short string (at most 255 bytes).
pub(crate) fn short(s: &str) -> Result<ShortString, TransportError> {
    ShortString::try_new(s).map_err(|e| backend(format!("name `{s}`"), e))
}
