//! `metrics()` (Effect): counts and times every dispatch through the
//! [`metrics` crate](::metrics)'s facade, tagged by message and outcome.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | [`DISPATCH_TOTAL`] (`cqrs_dispatch_total`) | counter | [`LABEL_TAG`], [`LABEL_SIDE`], [`LABEL_OUTCOME`] |
//! | [`DISPATCH_DURATION`] (`cqrs_dispatch_duration`) | histogram, seconds | [`LABEL_TAG`], [`LABEL_SIDE`] |
//!
//! A metric's name and labels are a public contract the moment they reach a
//! dashboard, so they are constants here. Both successes and failures are
//! counted, and the duration is measured across either: timing only the
//! successes would flatter exactly the messages whose latency matters most,
//! since a slow failure is still a slow request. A dispatch abandoned before
//! it finished (its future dropped by a caller's timeout, or by a
//! [`deadline`](super::deadline) outside this layer) is counted with the
//! outcome [`OUTCOME_CANCELLED`].
//!
//! It is opt-in: add it to a typed dispatcher with
//! [`Dispatcher::with`](crate::Dispatcher::with) (then `tag` and `side` come
//! from the typed call), or to a bus as an ordinary [`Middleware`] (then
//! from the envelope, which also covers messages a worker consumes).
//!
//! ```
//! use envoi_core::typed::metrics::metrics;
//! use envoi_core::{Command, Message, Messenger};
//! use std::convert::Infallible;
//!
//! #[derive(Debug, Clone)]
//! struct PlaceOrder;
//! impl Message for PlaceOrder { const NAME: &'static str = "PlaceOrder"; }
//! impl Command for PlaceOrder { type Output = (); type Error = Infallible; }
//!
//! let messenger = Messenger::builder()
//!     .command_handler(|_: PlaceOrder| async { Ok::<_, Infallible>(()) })
//!     .build()
//!     .unwrap();
//! let orders = messenger.dispatcher().with(metrics());
//! # let _ = orders;
//! ```
//!
//! # Cost when nothing records
//!
//! With no recorder installed, the `metrics` crate falls back to its no-op
//! recorder, which is zero-sized. This layer checks for a zero-sized
//! recorder first and then does nothing at all: it reads no clock and looks
//! up no key. (A recorder that records holds state, so it is not
//! zero-sized; one that forwards everything to statics would be mistaken
//! for the no-op recorder.)

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock};

use metrics::{Key, KeyName, Label, SharedString, Unit};
use tokio::time::Instant;

use crate::envelope::message::MessageKind;
use crate::envelope::Envelope;
use crate::error::{BusError, Result};
use crate::middleware::{Middleware, Next};
use crate::typed::{DispatchContext, DispatchMiddleware, DispatchNext};
use crate::BoxFuture;

/// Counter of dispatches: `cqrs_dispatch_total`.
pub const DISPATCH_TOTAL: &str = "cqrs_dispatch_total";
/// Histogram of dispatch durations in seconds: `cqrs_dispatch_duration`.
pub const DISPATCH_DURATION: &str = "cqrs_dispatch_duration";
/// Label holding the message name.
pub const LABEL_TAG: &str = "cqrs.tag";
/// Label holding `command`, `query` or `event`.
pub const LABEL_SIDE: &str = "cqrs.side";
/// Label holding [`OUTCOME_SUCCESS`], [`OUTCOME_FAILURE`] or
/// [`OUTCOME_CANCELLED`].
pub const LABEL_OUTCOME: &str = "cqrs.outcome";
/// The dispatch returned its output.
pub const OUTCOME_SUCCESS: &str = "success";
/// The dispatch failed (a domain or an infrastructure error).
pub const OUTCOME_FAILURE: &str = "failure";
/// The dispatch was abandoned before it finished.
pub const OUTCOME_CANCELLED: &str = "cancelled";

static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// The keys of one tag and side, built once.
struct TagKeys {
    success: Key,
    failure: Key,
    cancelled: Key,
    duration: Key,
}

impl TagKeys {
    fn new(tag: &'static str, side: MessageKind) -> Self {
        let total = |outcome: &'static str| {
            Key::from_parts(
                DISPATCH_TOTAL,
                vec![
                    Label::from_static_parts(LABEL_TAG, tag),
                    Label::from_static_parts(LABEL_SIDE, side.as_str()),
                    Label::from_static_parts(LABEL_OUTCOME, outcome),
                ],
            )
        };
        Self {
            success: total(OUTCOME_SUCCESS),
            failure: total(OUTCOME_FAILURE),
            cancelled: total(OUTCOME_CANCELLED),
            duration: Key::from_parts(
                DISPATCH_DURATION,
                vec![
                    Label::from_static_parts(LABEL_TAG, tag),
                    Label::from_static_parts(LABEL_SIDE, side.as_str()),
                ],
            ),
        }
    }
}

type KeyCache = HashMap<(MessageKind, &'static str), Arc<TagKeys>>;

/// Whether a recorder that records is installed for this thread (see the
/// [module docs](self)).
#[inline]
pub(crate) fn recording() -> bool {
    metrics::with_recorder(|r| std::mem::size_of_val(r) != 0)
}

/// The `metrics()` layer; see the [module docs](self). Clones share their
/// key cache.
#[derive(Clone, Default)]
pub struct Metrics {
    keys: Arc<RwLock<KeyCache>>,
}

/// The `metrics()` layer, as Effect has it.
pub fn metrics() -> Metrics {
    Metrics::default()
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    fn keys(&self, tag: &'static str, side: MessageKind) -> Arc<TagKeys> {
        if let Some(k) = self
            .keys
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(side, tag))
        {
            return k.clone();
        }
        metrics::with_recorder(|r| {
            r.describe_counter(
                KeyName::from_const_str(DISPATCH_TOTAL),
                None,
                SharedString::const_str("Dispatches, by message, side and outcome"),
            );
            r.describe_histogram(
                KeyName::from_const_str(DISPATCH_DURATION),
                Some(Unit::Seconds),
                SharedString::const_str("Dispatch duration, successes and failures alike"),
            );
        });
        self.keys
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry((side, tag))
            .or_insert_with(|| Arc::new(TagKeys::new(tag, side)))
            .clone()
    }

    /// Starts measuring a dispatch, or returns `None` when nothing records.
    #[inline]
    pub(crate) fn start(&self, tag: &'static str, side: MessageKind) -> Option<MetricsGuard> {
        if !recording() {
            return None;
        }
        Some(MetricsGuard {
            keys: Some(self.keys(tag, side)),
            start: Instant::now(),
        })
    }
}

/// Measures one dispatch; records it as cancelled if dropped unfinished.
pub(crate) struct MetricsGuard {
    keys: Option<Arc<TagKeys>>,
    start: Instant,
}

impl MetricsGuard {
    fn record(&mut self, outcome: &'static str) {
        let Some(keys) = self.keys.take() else {
            return;
        };
        let seconds = self.start.elapsed().as_secs_f64();
        let counter = match outcome {
            OUTCOME_SUCCESS => &keys.success,
            OUTCOME_FAILURE => &keys.failure,
            _ => &keys.cancelled,
        };
        metrics::with_recorder(|r| {
            r.register_counter(counter, &METADATA).increment(1);
            r.register_histogram(&keys.duration, &METADATA)
                .record(seconds);
        });
    }

    /// Records the outcome of `out`.
    pub(crate) fn finish<T>(&mut self, out: &Result<T, BusError>) {
        self.record(if out.is_ok() {
            OUTCOME_SUCCESS
        } else {
            OUTCOME_FAILURE
        });
    }

    /// Records the dispatch as abandoned.
    pub(crate) fn cancel(&mut self) {
        self.record(OUTCOME_CANCELLED);
    }
}

impl Drop for MetricsGuard {
    fn drop(&mut self) {
        self.record(OUTCOME_CANCELLED);
    }
}

impl DispatchMiddleware for Metrics {
    fn wrap<'a>(
        &'a self,
        ctx: DispatchContext,
        next: DispatchNext<'a>,
    ) -> BoxFuture<'a, Result<Envelope>> {
        let guard = self.start(ctx.tag, ctx.side);
        let run = next.run();
        match guard {
            None => run,
            Some(mut guard) => Box::pin(async move {
                let out = run.await;
                guard.finish(&out);
                out
            }),
        }
    }
}

impl Middleware for Metrics {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        match self.start(envelope.message_name(), envelope.kind()) {
            None => next.run(envelope).boxed(),
            Some(mut guard) => Box::pin(async move {
                let out = next.run(envelope).await;
                guard.finish(&out);
                out
            }),
        }
    }

    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed("Metrics")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::testing::{FailingEndpoint, Ping, RecordingEndpoint};
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use metrics_util::CompositeKey;

    /// `(name, labels, value)` of every metric in `snapshotter`, sorted.
    pub(crate) fn read(snapshotter: &Snapshotter) -> Vec<(String, Vec<String>, DebugValue)> {
        let mut out: Vec<_> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(ck, _, _, v): (CompositeKey, _, _, DebugValue)| {
                let (_, key) = ck.into_parts();
                let labels = key
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                (key.name().to_string(), labels, v)
            })
            .collect();
        out.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        out
    }

    fn counter(snap: &[(String, Vec<String>, DebugValue)], labels: &[&str]) -> Option<u64> {
        snap.iter().find_map(|(n, l, v)| match v {
            DebugValue::Counter(c) if n == DISPATCH_TOTAL && l == labels => Some(*c),
            _ => None,
        })
    }

    fn durations(snap: &[(String, Vec<String>, DebugValue)]) -> Vec<f64> {
        snap.iter()
            .filter_map(|(n, _, v)| match v {
                DebugValue::Histogram(h) if n == DISPATCH_DURATION => {
                    Some(h.iter().map(|x| x.into_inner()).collect::<Vec<_>>())
                }
                _ => None,
            })
            .flatten()
            .collect()
    }

    fn run_with_recorder<T>(f: impl std::future::Future<Output = T>) -> (T, Snapshotter) {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let out = metrics::with_local_recorder(&recorder, || rt.block_on(f));
        (out, snapshotter)
    }

    #[test]
    fn success_and_failure_are_counted_with_tag_side_and_outcome() {
        let m = metrics();
        let (_, snap) = run_with_recorder(async {
            let ok = RecordingEndpoint::new();
            m.handle(Envelope::new(Ping), ok.next()).await.unwrap();
            m.handle(Envelope::new(Ping), ok.next()).await.unwrap();
            let bad = FailingEndpoint::plain();
            m.handle(Envelope::query(Ping), bad.next())
                .await
                .unwrap_err();
        });
        let snap = read(&snap);
        assert_eq!(
            counter(
                &snap,
                &["cqrs.tag=Ping", "cqrs.side=command", "cqrs.outcome=success"]
            ),
            Some(2)
        );
        assert_eq!(
            counter(
                &snap,
                &["cqrs.tag=Ping", "cqrs.side=query", "cqrs.outcome=failure"]
            ),
            Some(1)
        );
        assert_eq!(durations(&snap).len(), 3, "every dispatch is timed");
        assert!(snap
            .iter()
            .filter(|(n, _, _)| n == DISPATCH_DURATION)
            .all(|(_, l, _)| l.len() == 2 && !l.iter().any(|l| l.starts_with("cqrs.outcome"))));
    }

    #[test]
    fn a_dropped_dispatch_is_counted_as_cancelled() {
        let m = metrics();
        let (_, snap) = run_with_recorder(async {
            let pending = crate::testing::FnEndpoint::new(|_| Box::pin(std::future::pending()));
            let fut = m.handle(Envelope::event(Ping), Next::to_endpoint(&pending));
            let timed_out = tokio::time::timeout(std::time::Duration::from_millis(1), fut).await;
            assert!(timed_out.is_err());
        });
        let snap = read(&snap);
        assert_eq!(
            counter(
                &snap,
                &["cqrs.tag=Ping", "cqrs.side=event", "cqrs.outcome=cancelled"]
            ),
            Some(1)
        );
    }

    #[test]
    fn nothing_is_recorded_without_a_recorder() {
        let noop = metrics::NoopRecorder;
        metrics::with_local_recorder(&noop, || {
            assert!(!recording());
            assert!(metrics().start("Ping", MessageKind::Command).is_none());
        });
        let recorder = DebuggingRecorder::new();
        metrics::with_local_recorder(&recorder, || assert!(recording()));
    }
}
