//! A circuit breaker: after a run of handler failures, fail fast for a
//! while instead of hammering what is failing.
//!
//! [`CircuitBreaker`] keeps one circuit per message type:
//!
//! * **closed** — messages go through; each handler failure counts, each
//!   success resets the count. At `failure_threshold` consecutive failures
//!   the circuit opens.
//! * **open** — for `cool_down`, messages fail at once with
//!   [`CircuitOpen`] (naming the time left, wrapped in
//!   [`BusError::Middleware`]) without reaching the handler.
//! * **half-open** — after the cool-down, one trial message goes through
//!   (others still fail fast). Its success closes the circuit; its failure
//!   opens it for another cool-down.
//!
//! A message let in while the circuit was closed that finishes after it
//! opened does not move it: only the trial settles an open or half-open
//! circuit.
//!
//! Only handler failures count ([`BusError::HandlerFailed`], or a failure
//! the retry step scheduled for a retry); cancellations, validation errors
//! and the like say nothing about the handler's health. Where the bus sends
//! a message to a transport, the breaker lets it through: it protects
//! handlers.
//!
//! ```
//! use envoi_core::middleware::circuit_breaker::CircuitBreaker;
//! use std::time::Duration;
//!
//! let breaker = CircuitBreaker::new(5, Duration::from_secs(30));
//! # let _ = breaker;
//! ```

use std::any::TypeId;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::was_retried;
use super::{BoxFuture, Middleware, Next};
use crate::envelope::Envelope;
use crate::error::{BusError, Result};
use crate::far;

/// The state of one circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CircuitState {
    /// Messages go through; `failures` consecutive handler failures so far.
    Closed {
        /// Consecutive failures.
        failures: u32,
    },
    /// Failing fast until `until`.
    Open {
        /// End of the cool-down.
        until: Instant,
    },
    /// A trial message is running.
    HalfOpen,
}

#[derive(Debug)]
struct Inner {
    threshold: u32,
    cool_down: Duration,
    circuits: Mutex<HashMap<TypeId, CircuitState>>,
}

/// The circuit breaker middleware; see the [module docs](self). Clones
/// share their circuits.
#[derive(Debug, Clone)]
pub struct CircuitBreaker {
    inner: Arc<Inner>,
}

/// What happened to one message, for the circuit.
enum Outcome {
    Success,
    HandlerFailure,
    /// Says nothing about the handler.
    Neutral,
}

/// Held while a message runs; settles the circuit when told the outcome or,
/// if dropped unfinished, lets the next message be a trial.
struct Admission<'a> {
    breaker: &'a Inner,
    key: TypeId,
    trial: bool,
    settled: bool,
}

impl Admission<'_> {
    fn settle(mut self, outcome: Outcome) {
        self.settled = true;
        let mut circuits = self.breaker.lock();
        let state = circuits
            .entry(self.key)
            .or_insert(CircuitState::Closed { failures: 0 });
        let open = CircuitState::Open {
            until: Instant::now() + self.breaker.cool_down,
        };
        // Only the trial settles an open or half-open circuit: a message
        // let in while it was closed may finish after it opened.
        *state = match (outcome, *state) {
            (Outcome::Success, _) if self.trial => CircuitState::Closed { failures: 0 },
            (Outcome::Success, CircuitState::Closed { .. }) => CircuitState::Closed { failures: 0 },
            (Outcome::Success, other) => other,
            (Outcome::HandlerFailure, _) if self.trial => open,
            (Outcome::HandlerFailure, CircuitState::Closed { failures }) => {
                let failures = failures.saturating_add(1);
                if failures >= self.breaker.threshold {
                    open
                } else {
                    CircuitState::Closed { failures }
                }
            }
            (Outcome::HandlerFailure, other) => other,
            (Outcome::Neutral, _) if self.trial => CircuitState::Open {
                until: Instant::now(),
            },
            (Outcome::Neutral, other) => other,
        };
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if !self.settled && self.trial {
            // The trial was abandoned: the next message may try again. Only
            // the half-open state it made is undone, not one that followed.
            let mut circuits = self.breaker.lock();
            if let Some(state @ CircuitState::HalfOpen) = circuits.get_mut(&self.key) {
                *state = CircuitState::Open {
                    until: Instant::now(),
                };
            }
        }
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TypeId, CircuitState>> {
        self.circuits.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn admit(&self, envelope: &Envelope) -> Result<Admission<'_>> {
        let key = envelope.message_type_id();
        let mut circuits = self.lock();
        let state = circuits
            .entry(key)
            .or_insert(CircuitState::Closed { failures: 0 });
        let trial = match *state {
            CircuitState::Closed { .. } => false,
            CircuitState::Open { until } => {
                let now = Instant::now();
                if now < until {
                    return Err(open(envelope.message_name(), until - now));
                }
                *state = CircuitState::HalfOpen;
                true
            }
            CircuitState::HalfOpen => return Err(open(envelope.message_name(), Duration::ZERO)),
        };
        Ok(Admission {
            breaker: self,
            key,
            trial,
            settled: false,
        })
    }
}

impl CircuitBreaker {
    /// Opens a circuit after `failure_threshold` consecutive handler
    /// failures (at least 1) and keeps it open for `cool_down`.
    pub fn new(failure_threshold: u32, cool_down: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                threshold: failure_threshold.max(1),
                cool_down: far::clamp(cool_down),
                circuits: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The state of the circuit of message type `M`.
    pub fn state<M: 'static>(&self) -> CircuitState {
        self.inner
            .lock()
            .get(&TypeId::of::<M>())
            .copied()
            .unwrap_or(CircuitState::Closed { failures: 0 })
    }
}

impl Middleware for CircuitBreaker {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        if next.sends(&envelope) {
            return next.run(envelope).boxed();
        }
        let admission = match self.inner.admit(&envelope) {
            Ok(a) => a,
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        };
        Box::pin(async move {
            let before = envelope.clone();
            let out = next.run(envelope).await;
            admission.settle(match &out {
                Ok(after) if was_retried(&before, after) => Outcome::HandlerFailure,
                Ok(_) => Outcome::Success,
                Err(BusError::HandlerFailed { .. }) => Outcome::HandlerFailure,
                Err(_) => Outcome::Neutral,
            });
            out
        })
    }

    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed("CircuitBreaker")
    }
}

/// The circuit is open: the message failed fast, without its handler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("circuit open for `{message}`; retry in {retry_in:?}")]
#[non_exhaustive]
pub struct CircuitOpen {
    /// The message name.
    pub message: &'static str,
    /// Time left in the cool-down.
    pub retry_in: Duration,
}

/// The error of a message refused while the circuit is open.
fn open(message: &'static str, retry_in: Duration) -> BusError {
    BusError::Middleware {
        middleware: "CircuitBreaker".into(),
        source: Box::new(CircuitOpen { message, retry_in }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FailingEndpoint, FnEndpoint, Ping, RecordingEndpoint};
    use futures_util::FutureExt;
    use tokio::sync::Notify;

    /// An endpoint that succeeds once `gate` is notified.
    fn gated(gate: &Arc<Notify>) -> FnEndpoint {
        let gate = gate.clone();
        FnEndpoint::new(move |e| {
            let gate = gate.clone();
            Box::pin(async move {
                gate.notified().await;
                Ok(e)
            })
        })
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_n_consecutive_failures_fails_fast_then_lets_one_trial_through() {
        let cb = CircuitBreaker::new(3, Duration::from_secs(10));
        let bad = FailingEndpoint::plain();
        for _ in 0..3 {
            let err = cb
                .handle(Envelope::new(Ping), bad.next())
                .await
                .unwrap_err();
            assert_eq!(err.kind(), "handler");
        }
        assert!(matches!(cb.state::<Ping>(), CircuitState::Open { .. }));

        let end = RecordingEndpoint::new();
        tokio::time::advance(Duration::from_secs(4)).await;
        match cb
            .handle(Envelope::new(Ping), end.next())
            .await
            .unwrap_err()
        {
            error if error.middleware_error::<CircuitOpen>().is_some() => {
                let open = error.middleware_error::<CircuitOpen>().unwrap();
                assert_eq!(open.message, "Ping");
                assert_eq!(open.retry_in, Duration::from_secs(6));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(end.calls().is_empty(), "fails fast without the handler");

        tokio::time::advance(Duration::from_secs(6)).await;
        cb.handle(Envelope::new(Ping), end.next()).await.unwrap();
        assert_eq!(end.calls().len(), 1, "the trial goes through");
        assert_eq!(cb.state::<Ping>(), CircuitState::Closed { failures: 0 });
    }

    /// A breaker that opens on one failure, opened by one, its `cool_down`
    /// passed: the next message is a trial.
    async fn ready_for_a_trial(cool_down: Duration) -> CircuitBreaker {
        let cb = CircuitBreaker::new(1, cool_down);
        cb.handle(Envelope::new(Ping), FailingEndpoint::plain().next())
            .await
            .unwrap_err();
        tokio::time::advance(cool_down).await;
        cb
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_trial_opens_the_circuit_again() {
        let cb = ready_for_a_trial(Duration::from_secs(5)).await;
        let bad = FailingEndpoint::plain();
        cb.handle(Envelope::new(Ping), bad.next())
            .await
            .unwrap_err();
        let end = RecordingEndpoint::new();
        let err = cb
            .handle(Envelope::new(Ping), end.next())
            .await
            .unwrap_err();
        assert!(err.middleware_error::<CircuitOpen>().is_some(), "{err}");
        assert!(end.calls().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_resets_the_count() {
        let cb = CircuitBreaker::new(2, Duration::from_secs(5));
        let (bad, good) = (FailingEndpoint::plain(), RecordingEndpoint::new());
        cb.handle(Envelope::new(Ping), bad.next())
            .await
            .unwrap_err();
        cb.handle(Envelope::new(Ping), good.next()).await.unwrap();
        cb.handle(Envelope::new(Ping), bad.next())
            .await
            .unwrap_err();
        assert_eq!(cb.state::<Ping>(), CircuitState::Closed { failures: 1 });
    }

    #[tokio::test(start_paused = true)]
    async fn only_one_trial_runs_at_a_time() {
        let cb = ready_for_a_trial(Duration::from_secs(1)).await;
        let admission = cb.inner.admit(&Envelope::new(Ping)).unwrap();
        assert!(admission.trial);
        let end = RecordingEndpoint::new();
        let err = cb
            .handle(Envelope::new(Ping), end.next())
            .await
            .unwrap_err();
        assert!(err.middleware_error::<CircuitOpen>().is_some(), "{err}");
        drop(admission);
        cb.handle(Envelope::new(Ping), end.next()).await.unwrap();
        assert_eq!(
            end.calls().len(),
            1,
            "an abandoned trial lets the next one try"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_trial_settles_an_open_or_half_open_circuit() {
        let cb = CircuitBreaker::new(1, Duration::from_secs(5));
        let (early, late) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let (early_end, late_end) = (gated(&early), gated(&late));
        // Two messages let in while the circuit is closed, still running.
        let mut first = cb.handle(Envelope::new(Ping), Next::to_endpoint(&early_end));
        let mut second = cb.handle(Envelope::new(Ping), Next::to_endpoint(&late_end));
        assert!((&mut first).now_or_never().is_none());
        assert!((&mut second).now_or_never().is_none());
        let bad = FailingEndpoint::plain();
        cb.handle(Envelope::new(Ping), bad.next())
            .await
            .unwrap_err();
        let open = cb.state::<Ping>();
        assert!(matches!(open, CircuitState::Open { .. }));

        early.notify_one();
        first.await.unwrap();
        assert_eq!(cb.state::<Ping>(), open, "the cool-down is not cut short");

        tokio::time::advance(Duration::from_secs(5)).await;
        let stuck = FnEndpoint::new(|_| Box::pin(std::future::pending()));
        let mut trial = cb.handle(Envelope::new(Ping), Next::to_endpoint(&stuck));
        assert!((&mut trial).now_or_never().is_none());
        assert_eq!(cb.state::<Ping>(), CircuitState::HalfOpen);
        late.notify_one();
        second.await.unwrap();
        assert_eq!(
            cb.state::<Ping>(),
            CircuitState::HalfOpen,
            "a message that is not the trial does not close the circuit"
        );
        let end = RecordingEndpoint::new();
        let err = cb
            .handle(Envelope::new(Ping), end.next())
            .await
            .unwrap_err();
        assert!(
            err.middleware_error::<CircuitOpen>().is_some(),
            "the trial is still running: {err}"
        );
        assert!(end.calls().is_empty());
        drop(trial);
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_trial_resets_only_the_half_open_state_it_made() {
        let cb = ready_for_a_trial(Duration::from_secs(5)).await;
        let trial = cb.inner.admit(&Envelope::new(Ping)).unwrap();
        assert!(trial.trial);
        // The circuit moved on while the trial ran (say a message let in
        // before it opened closed it, and a failure opened it afresh).
        let reopened = CircuitState::Open {
            until: Instant::now() + Duration::from_secs(5),
        };
        cb.inner.lock().insert(TypeId::of::<Ping>(), reopened);
        drop(trial);
        assert_eq!(cb.state::<Ping>(), reopened, "the cool-down is kept");

        // An abandoned trial of a half-open circuit lets the next one try.
        tokio::time::advance(Duration::from_secs(5)).await;
        drop(cb.inner.admit(&Envelope::new(Ping)).unwrap());
        assert!(
            matches!(cb.state::<Ping>(), CircuitState::Open { until } if until <= Instant::now())
        );
    }
}
