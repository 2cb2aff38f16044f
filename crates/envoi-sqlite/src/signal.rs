//! Waking consumers in this process when messages may have become
//! available.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use tokio::sync::Notify;

/// Raised when messages may have become available: a [`Notify`] for
/// waiters and a generation counter, so a wait that starts after the raise
/// (but after an empty claim) still sees it.
#[derive(Default)]
pub(crate) struct Signal {
    pub(crate) notify: Notify,
    generation: AtomicU64,
}

impl Signal {
    /// Raises the signal: every waiter wakes, the generation moves on.
    pub(crate) fn wake(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// How many times it was raised.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// One signal per queue per process (`key` names the database file, the
    /// table and the queue), so a send through one handle wakes consumers
    /// waiting on another.
    pub(crate) fn shared(key: String) -> Arc<Signal> {
        static SIGNALS: OnceLock<Mutex<HashMap<String, Weak<Signal>>>> = OnceLock::new();
        let mut map = SIGNALS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = map.get(&key).and_then(Weak::upgrade) {
            return s;
        }
        map.retain(|_, w| w.strong_count() > 0);
        let s = Arc::new(Signal::default());
        map.insert(key, Arc::downgrade(&s));
        s
    }
}
