//! The failure policy: per transport, the retry strategy and the failure
//! transport where messages out of retries are parked.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::strategy::{combined_hint, MultiplierRetryStrategy, RetryStrategy};
use crate::envelope::stamp::RedeliveryStamp;
use crate::envelope::Envelope;
use crate::error::{HandlerError, RetryHint};
use crate::transport::SenderDispatcher;

/// Retry strategies and failure transports per transport.
#[derive(Clone)]
pub struct RetryConfig {
    strategies: BTreeMap<String, Arc<dyn RetryStrategy>>,
    default_strategy: Arc<dyn RetryStrategy>,
    failure_transports: BTreeMap<String, String>,
    default_failure_transport: Option<String>,
    without_retry: BTreeSet<String>,
    dispatcher: Arc<dyn SenderDispatcher>,
}

impl fmt::Debug for RetryConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryConfig")
            .field("strategies", &self.strategies.keys().collect::<Vec<_>>())
            .field("failure_transports", &self.failure_transports)
            .field("default_failure_transport", &self.default_failure_transport)
            .finish()
    }
}

impl RetryConfig {
    /// Sends retries and failures through `dispatcher`; every transport uses
    /// the default [`MultiplierRetryStrategy`] and no failure transport.
    pub fn new(dispatcher: Arc<dyn SenderDispatcher>) -> Self {
        Self {
            strategies: BTreeMap::new(),
            default_strategy: Arc::new(MultiplierRetryStrategy::default()),
            failure_transports: BTreeMap::new(),
            default_failure_transport: None,
            without_retry: BTreeSet::new(),
            dispatcher,
        }
    }

    /// Never retries nor parks messages received from `transport`: their
    /// failure goes straight back to the caller. Used for the sync
    /// transport, which handles messages while they are sent. A message
    /// parked after failing on `transport` (when it was another kind of
    /// transport) and retried from its failure transport is not retried
    /// either, but parked again when it fails.
    pub fn without_retry(mut self, transport: impl Into<String>) -> Self {
        self.without_retry.insert(transport.into());
        self
    }

    /// The failure transports configured, without duplicates, sorted.
    pub fn failure_transports(&self) -> Vec<&str> {
        let mut all: Vec<&str> = self
            .failure_transports
            .values()
            .chain(self.default_failure_transport.iter())
            .map(String::as_str)
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// Uses `strategy` for messages received from `transport`.
    pub fn strategy(
        mut self,
        transport: impl Into<String>,
        strategy: Arc<dyn RetryStrategy>,
    ) -> Self {
        self.strategies.insert(transport.into(), strategy);
        self
    }

    /// Uses `strategy` for transports without their own.
    pub fn default_strategy(mut self, strategy: Arc<dyn RetryStrategy>) -> Self {
        self.default_strategy = strategy;
        self
    }

    /// Parks messages from `transport` that are out of retries in `failure`.
    pub fn failure_transport_for(
        mut self,
        transport: impl Into<String>,
        failure: impl Into<String>,
    ) -> Self {
        self.failure_transports
            .insert(transport.into(), failure.into());
        self
    }

    /// Parks messages from any other transport in `failure`.
    pub fn failure_transport(mut self, failure: impl Into<String>) -> Self {
        self.default_failure_transport = Some(failure.into());
        self
    }

    fn strategy_for(&self, transport: &str) -> &dyn RetryStrategy {
        self.strategies
            .get(transport)
            .map(|s| &**s)
            .unwrap_or(&*self.default_strategy)
    }

    /// The failure transport for messages received from `transport`.
    pub fn failure_for(&self, transport: &str) -> Option<&str> {
        self.failure_transports
            .get(transport)
            .or(self.default_failure_transport.as_ref())
            .map(String::as_str)
    }

    /// What to do with `envelope`, received from `transport`, whose
    /// handlers failed with `errors`: retry it (which attempt, after how
    /// long), park it (in which failure transport), or let the failure go
    /// back to the caller.
    pub(crate) fn decide(
        &self,
        transport: &str,
        envelope: &Envelope,
        errors: &[HandlerError],
    ) -> Decision<'_> {
        let attempt = envelope
            .last::<RedeliveryStamp>()
            .map_or(0, |r| r.retry_count)
            // A count read from a header may be anything: never wrap.
            .saturating_add(1);
        let hint = combined_hint(errors);
        let strategy = self.strategy_for(transport);
        // A retry cannot be sent to a transport that handles on send.
        let retry = hint != RetryHint::Unrecoverable
            && !self.without_retry.contains(transport)
            && strategy.is_retryable(envelope, errors, attempt);
        if retry {
            let delay = match hint {
                RetryHint::Recoverable(Some(d)) => d,
                _ => strategy.delay(envelope, attempt),
            };
            return Decision::Retry { attempt, delay };
        }
        match self.failure_for(transport) {
            Some(failure) => Decision::Park { failure },
            None => Decision::Fail,
        }
    }

    /// Whether messages received from `transport` skip the retry step
    /// (see [`without_retry`](Self::without_retry)).
    pub(crate) fn skips(&self, transport: &str) -> bool {
        !self.without_retry.is_empty() && self.without_retry.contains(transport)
    }

    /// Where retries and parked messages are sent.
    pub(crate) fn dispatcher(&self) -> &dyn SenderDispatcher {
        &*self.dispatcher
    }
}

/// What [`RetryConfig::decide`] says to do with a failed message.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Decision<'a> {
    /// Send it back to its transport as retry number `attempt`, due after
    /// `delay`.
    Retry {
        /// Which retry (1 for the first).
        attempt: u32,
        /// How long it waits.
        delay: Duration,
    },
    /// Park it in `failure`.
    Park {
        /// The failure transport.
        failure: &'a str,
    },
    /// Neither: the failure goes back to the caller.
    Fail,
}
