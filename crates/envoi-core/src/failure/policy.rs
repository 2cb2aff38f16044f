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

/// What happens to a message whose handlers fail: the retry strategy that
/// decides whether and when it is tried again, and the failure transport
/// where it is parked once out of retries. One rule for every transport,
/// and overrides per transport, each set the same way — on a policy, or on
/// the messenger's builder, whose methods of the same names edit its
/// policy.
///
/// ```
/// use envoi_core::failure::{FailurePolicy, MultiplierRetryStrategy};
///
/// let policy = FailurePolicy::new()
///     .default_retry_strategy(MultiplierRetryStrategy { max_retries: 5, ..Default::default() })
///     .failure_transport("failed")
///     .failure_transport_for("payments", "payments_failed");
/// assert_eq!(policy.failure_for("orders"), Some("failed"));
/// assert_eq!(policy.failure_for("payments"), Some("payments_failed"));
/// assert_eq!(policy.failure_transports(), ["failed", "payments_failed"]);
/// ```
#[derive(Clone)]
pub struct FailurePolicy {
    /// The strategy of transports without their own.
    default_strategy: Arc<dyn RetryStrategy>,
    /// The failure transport of transports without their own.
    default_failure: Option<String>,
    transports: BTreeMap<String, Rule>,
    without_retry: BTreeSet<String>,
}

/// The rule of one transport: what it sets of its own.
#[derive(Clone, Default)]
struct Rule {
    strategy: Option<Arc<dyn RetryStrategy>>,
    failure_transport: Option<String>,
}

impl Default for FailurePolicy {
    fn default() -> Self {
        Self {
            default_strategy: Arc::new(MultiplierRetryStrategy::default()),
            default_failure: None,
            transports: BTreeMap::new(),
            without_retry: BTreeSet::new(),
        }
    }
}

impl fmt::Debug for FailurePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FailurePolicy")
            .field("failure_transport", &self.default_failure)
            .field(
                "transports",
                &self
                    .transports
                    .iter()
                    .map(|(t, r)| (t, &r.failure_transport))
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl FailurePolicy {
    /// Every transport uses the default [`MultiplierRetryStrategy`] and no
    /// failure transport: a message out of retries is rejected.
    pub fn new() -> Self {
        Self::default()
    }

    /// Uses `strategy` for messages received from `transport`.
    pub fn retry_strategy(
        mut self,
        transport: impl Into<String>,
        strategy: impl RetryStrategy,
    ) -> Self {
        self.transports
            .entry(transport.into())
            .or_default()
            .strategy = Some(Arc::new(strategy));
        self
    }

    /// Uses `strategy` for transports without their own.
    pub fn default_retry_strategy(mut self, strategy: impl RetryStrategy) -> Self {
        self.default_strategy = Arc::new(strategy);
        self
    }

    /// Parks messages from `transport` that are out of retries in `failure`.
    pub fn failure_transport_for(
        mut self,
        transport: impl Into<String>,
        failure: impl Into<String>,
    ) -> Self {
        self.transports
            .entry(transport.into())
            .or_default()
            .failure_transport = Some(failure.into());
        self
    }

    /// Parks messages from transports without their own failure transport
    /// in `failure`.
    pub fn failure_transport(mut self, failure: impl Into<String>) -> Self {
        self.default_failure = Some(failure.into());
        self
    }

    /// Never retries nor parks messages received from `transport`: their
    /// failure goes straight back to the caller. The messenger sets it for
    /// the sync transport, which handles messages while they are sent. A
    /// message parked after failing on `transport` (when it was another
    /// kind of transport) and retried from its failure transport is not
    /// retried either, but parked again when it fails.
    pub(crate) fn without_retry(mut self, transport: impl Into<String>) -> Self {
        self.without_retry.insert(transport.into());
        self
    }

    /// The failure transports configured, without duplicates, sorted.
    pub fn failure_transports(&self) -> Vec<&str> {
        let mut all: Vec<&str> = self
            .transports
            .values()
            .filter_map(|r| r.failure_transport.as_deref())
            .chain(self.default_failure.as_deref())
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    fn strategy_for(&self, transport: &str) -> &dyn RetryStrategy {
        self.transports
            .get(transport)
            .and_then(|r| r.strategy.as_deref())
            .unwrap_or(&*self.default_strategy)
    }

    /// The failure transport for messages received from `transport`.
    pub fn failure_for(&self, transport: &str) -> Option<&str> {
        self.transports
            .get(transport)
            .and_then(|r| r.failure_transport.as_deref())
            .or(self.default_failure.as_deref())
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
}

/// What [`FailurePolicy::decide`] says to do with a failed message.
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
