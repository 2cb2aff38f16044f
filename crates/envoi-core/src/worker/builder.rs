//! Configuring a worker: the [`WorkerBuilder`].

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;

use super::error::WorkerError;
use super::events::{Counters, WorkerListener};
use super::fetch::Source;
use super::rate::RateLimit;
use super::stop::StopHandle;
use super::Worker;
use crate::far;
use crate::messenger::Messenger;

#[derive(Debug, Clone)]
pub(super) struct Options {
    pub(super) concurrency: usize,
    pub(super) batch_size: usize,
    pub(super) message_limit: Option<u64>,
    pub(super) time_limit: Option<Duration>,
    pub(super) memory_limit: Option<u64>,
    pub(super) failure_limit: Option<u64>,
    pub(super) grace_period: Duration,
    pub(super) keepalive_interval: Option<Duration>,
    pub(super) idle_sleep: Duration,
    pub(super) stop_when_empty: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            concurrency: 1,
            batch_size: 32,
            message_limit: None,
            time_limit: None,
            memory_limit: None,
            failure_limit: None,
            grace_period: Duration::from_secs(10),
            keepalive_interval: Some(Duration::from_secs(5)),
            idle_sleep: Duration::from_millis(250),
            stop_when_empty: false,
        }
    }
}

/// Configures a [`Worker`]; see [`Worker::builder`].
#[must_use = "a builder does nothing until `build` is called"]
pub struct WorkerBuilder {
    pub(super) messenger: Messenger,
    pub(super) receivers: Vec<String>,
    pub(super) rate_limits: Vec<(String, RateLimit)>,
    pub(super) options: Options,
    pub(super) listeners: Vec<Arc<dyn WorkerListener>>,
    pub(super) stop: Option<StopHandle>,
    pub(super) event_capacity: usize,
}

impl fmt::Debug for WorkerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("receivers", &self.receivers)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl WorkerBuilder {
    /// Consumes `transport`, after the receivers added before it (priority
    /// order: first added, first read).
    pub fn receiver(mut self, transport: impl Into<String>) -> Self {
        self.receivers.push(transport.into());
        self
    }

    /// Consumes each of `transports`, in priority order.
    pub fn receivers<I, S>(mut self, transports: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.receivers
            .extend(transports.into_iter().map(Into::into));
        self
    }

    /// Handles up to `n` messages at once (default 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.options.concurrency = n;
        self
    }

    /// Asks a transport for up to `n` messages at a time (default 32).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.options.batch_size = n;
        self
    }

    /// Stops after `n` messages, whatever became of them: handled, retried
    /// or failed all count.
    pub fn message_limit(mut self, n: u64) -> Self {
        self.options.message_limit = Some(n);
        self
    }

    /// Stops after running for `limit` (thirty years or more: no limit).
    pub fn time_limit(mut self, limit: Duration) -> Self {
        self.options.time_limit = Some(far::clamp(limit));
        self
    }

    /// Stops when the process's resident memory exceeds `bytes` (Linux
    /// only). It is checked at start, then at most once a second, between
    /// the worker's steps: while every slot holds a slow handler, it is
    /// next checked when one finishes or a keepalive tick comes.
    pub fn memory_limit(mut self, bytes: u64) -> Self {
        self.options.memory_limit = Some(bytes);
        self
    }

    /// Stops after `n` failed messages. Messages already in flight then
    /// still finish within the grace period, and may fail too: with a
    /// concurrency above 1 the report can count more than `n` failures.
    pub fn failure_limit(mut self, n: u64) -> Self {
        self.options.failure_limit = Some(n);
        self
    }

    /// How long handlers in flight may take to finish once the worker stops
    /// (default 10 s); what has not finished then is released.
    pub fn grace_period(mut self, grace: Duration) -> Self {
        self.options.grace_period = far::clamp(grace);
        self
    }

    /// Extends the lease of held messages this often (default 5 s); `None`
    /// never does. A message's first extension comes within one and a half
    /// intervals of its fetch: a transport's lease must be longer.
    pub fn keepalive_interval(mut self, interval: Option<Duration>) -> Self {
        self.options.keepalive_interval = interval.map(far::clamp);
        self
    }

    /// The longest wait before asking empty receivers again (default
    /// 250 ms). Transports that can tell when a message arrives wake the
    /// worker earlier.
    pub fn idle_sleep(mut self, sleep: Duration) -> Self {
        self.options.idle_sleep = far::clamp(sleep);
        self
    }

    /// Stops once every receiver is empty (no message waiting, delayed or
    /// leased) and nothing is in flight. Emptiness is read from
    /// [`MessageCount`](crate::transport::MessageCount); a transport without that ability
    /// counts as empty as soon as it hands out nothing, whatever it still
    /// holds delayed or leased. A receiver paused because one of its
    /// messages could not be parked is asked again, once its pause is
    /// over, before the worker stops.
    ///
    /// Messages this worker parked back into a receiver they came from — a
    /// failure transport it consumes, where a message failing for good again
    /// returns for later — do not count: consuming a failure transport with
    /// this option tries each message there once, then stops.
    pub fn stop_when_empty(mut self) -> Self {
        self.options.stop_when_empty = true;
        self
    }

    /// Paces how fast messages are taken from `transport`: `limit` per
    /// period on average, after a first burst of up to `limit.messages`
    /// (see [`RateLimit`]).
    pub fn rate_limit(mut self, transport: impl Into<String>, limit: RateLimit) -> Self {
        let limit = RateLimit::new(limit.messages, far::clamp(limit.per));
        self.rate_limits.push((transport.into(), limit));
        self
    }

    /// Adds a listener for the worker's events.
    pub fn listener(mut self, listener: impl WorkerListener) -> Self {
        self.listeners.push(Arc::new(listener));
        self
    }

    /// Stops the worker with `handle` (a handle of its own is made
    /// otherwise; see [`Worker::stop_handle`]).
    pub fn stop_handle(mut self, handle: StopHandle) -> Self {
        self.stop = Some(handle);
        self
    }

    /// How many events a [`Worker::subscribe`]r may fall behind before it
    /// misses some (default 1024).
    pub fn event_capacity(mut self, n: usize) -> Self {
        self.event_capacity = n.max(1);
        self
    }

    /// Checks the configuration.
    pub fn build(self) -> Result<Worker, WorkerError> {
        if self.receivers.is_empty() {
            return Err(WorkerError::NoReceivers);
        }
        if self.options.concurrency == 0 {
            return Err(WorkerError::InvalidOption(
                "concurrency must be at least 1".into(),
            ));
        }
        if self.options.batch_size == 0 {
            return Err(WorkerError::InvalidOption(
                "batch size must be at least 1".into(),
            ));
        }
        let mut limits: BTreeMap<String, RateLimit> = BTreeMap::new();
        for (name, limit) in self.rate_limits {
            if limit.messages == 0 {
                return Err(WorkerError::InvalidOption(format!(
                    "the rate limit of `{name}` must allow at least one message"
                )));
            }
            limits.insert(name, limit);
        }
        let mut receivers = Vec::new();
        for name in self.receivers {
            if receivers.iter().any(|r: &Source| *r.name == *name) {
                continue;
            }
            let transport = self
                .messenger
                .transport(&name)
                .ok_or_else(|| WorkerError::UnknownTransport(name.clone()))?
                .clone();
            if transport.as_receiver().is_none() {
                return Err(WorkerError::NotConsumable(name));
            }
            receivers.push(Source {
                rate: limits.remove(&name),
                name: Arc::from(name.as_str()),
                transport,
            });
        }
        if let Some(name) = limits.into_keys().next() {
            return Err(WorkerError::InvalidOption(format!(
                "rate limit for `{name}`, which the worker does not consume"
            )));
        }
        Ok(Worker {
            messenger: self.messenger,
            receivers,
            options: self.options,
            listeners: self.listeners,
            events: broadcast::channel(self.event_capacity).0,
            stop: self.stop.unwrap_or_default(),
            counters: Arc::new(Counters::default()),
        })
    }
}
