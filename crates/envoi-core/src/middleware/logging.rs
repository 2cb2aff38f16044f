//! Logging: one `tracing` event when a message is dispatched and one when
//! it is handled, sent or failed.
//!
//! Events have the target `envoi::bus` and carry the message name, its kind
//! (`command`, `query`, `event`), its id when it has a
//! [`MessageIdStamp`], the transport it was received from, and on
//! completion the elapsed time and the outcome: `handled` (the number of
//! handlers that ran), `sent` (to a transport) or `failed` (the error and
//! its [kind](crate::BusError::kind)). The payload is never logged: it may carry
//! secrets, and the name and id identify the message.
//!
//! Levels are configurable ([`Logging::levels`]); by default the start is
//! `DEBUG`, a success `INFO` and a failure `WARN`. When no subscriber is
//! interested in any of them, the middleware costs a level check.
//!
//! ```
//! use envoi_core::middleware::logging::Logging;
//! use tracing::Level;
//!
//! let quiet = Logging::new().levels(Level::TRACE, Level::DEBUG, Level::ERROR);
//! # let _ = quiet;
//! ```

use std::borrow::Cow;

use tokio::time::Instant;
use tracing::Level;

use super::{BoxFuture, Middleware, Next};
use crate::envelope::stamp::{HandledStamp, MessageIdStamp, ReceivedStamp, SentStamp};
use crate::envelope::Envelope;
use crate::error::Result;

/// The logging middleware; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct Logging {
    start: Level,
    success: Level,
    failure: Level,
}

impl Default for Logging {
    fn default() -> Self {
        Self {
            start: Level::DEBUG,
            success: Level::INFO,
            failure: Level::WARN,
        }
    }
}

/// Emits a `tracing` event at a level chosen at run time.
macro_rules! event_at {
    ($level:expr, $($rest:tt)+) => {
        match $level {
            Level::ERROR => tracing::event!(target: "envoi::bus", Level::ERROR, $($rest)+),
            Level::WARN => tracing::event!(target: "envoi::bus", Level::WARN, $($rest)+),
            Level::INFO => tracing::event!(target: "envoi::bus", Level::INFO, $($rest)+),
            Level::DEBUG => tracing::event!(target: "envoi::bus", Level::DEBUG, $($rest)+),
            _ => tracing::event!(target: "envoi::bus", Level::TRACE, $($rest)+),
        }
    };
}

fn enabled(level: Level) -> bool {
    match level {
        Level::ERROR => tracing::enabled!(target: "envoi::bus", Level::ERROR),
        Level::WARN => tracing::enabled!(target: "envoi::bus", Level::WARN),
        Level::INFO => tracing::enabled!(target: "envoi::bus", Level::INFO),
        Level::DEBUG => tracing::enabled!(target: "envoi::bus", Level::DEBUG),
        _ => tracing::enabled!(target: "envoi::bus", Level::TRACE),
    }
}

impl Logging {
    /// Logs with the default levels.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the levels of the start, success and failure events.
    #[must_use = "`levels` returns the configured middleware"]
    pub fn levels(mut self, start: Level, success: Level, failure: Level) -> Self {
        self.start = start;
        self.success = success;
        self.failure = failure;
        self
    }

    async fn run(&self, envelope: Envelope, next: Next<'_>) -> Result<Envelope> {
        let message = envelope.message_name();
        let kind = envelope.kind().as_str();
        let id = envelope.last::<MessageIdStamp>().map(|s| s.id.to_string());
        let id = id.as_deref().unwrap_or("");
        let received = envelope
            .last::<ReceivedStamp>()
            .map(|s| s.transport.clone());
        let received = received.as_deref().unwrap_or("");
        event_at!(self.start, message, kind, id, received, "dispatching");
        let started = Instant::now();
        let out = next.run(envelope).await;
        let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
        match &out {
            Ok(e) if e.has::<SentStamp>() => {
                let transports = e
                    .all::<SentStamp>()
                    .map(|s| s.transport.as_str())
                    .collect::<Vec<_>>()
                    .join(",");
                event_at!(self.success, message, kind, id, elapsed_ms, sent = %transports, "sent");
            }
            Ok(e) => {
                let handlers = e.all::<HandledStamp>().count();
                event_at!(
                    self.success,
                    message,
                    kind,
                    id,
                    received,
                    elapsed_ms,
                    handlers,
                    "handled"
                );
            }
            Err(error) => {
                let error_kind = error.kind();
                event_at!(self.failure, message, kind, id, received, elapsed_ms, error_kind, error = %error, "failed");
            }
        }
        out
    }
}

impl Middleware for Logging {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        if !enabled(self.start) && !enabled(self.success) && !enabled(self.failure) {
            return next.run(envelope).boxed();
        }
        Box::pin(self.run(envelope, next))
    }

    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed("Logging")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FailingEndpoint, Ping, RecordingEndpoint};
    use std::fmt;
    use std::sync::{Arc, Mutex};
    use tracing::field::{Field, Visit};
    use tracing::{Event, Subscriber};
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

    #[derive(Clone, Default)]
    struct Events(Arc<Mutex<Vec<(Level, String)>>>);

    struct Text<'a>(&'a mut String);
    impl Visit for Text<'_> {
        fn record_debug(&mut self, f: &Field, v: &dyn fmt::Debug) {
            self.0.push_str(&format!("{}={:?} ", f.name(), v));
        }
    }

    impl<S: Subscriber> Layer<S> for Events {
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            let mut s = String::new();
            event.record(&mut Text(&mut s));
            self.0.lock().unwrap().push((*event.metadata().level(), s));
        }
    }

    #[tokio::test]
    async fn logs_start_and_outcome_without_the_payload() {
        let events = Events::default();
        let _g =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(events.clone()));
        let end = RecordingEndpoint::new();
        Logging::new()
            .handle(Envelope::new(Ping), end.next())
            .await
            .unwrap();
        let bad = FailingEndpoint::plain();
        Logging::new()
            .handle(Envelope::query(Ping), bad.next())
            .await
            .unwrap_err();
        let events = events.0.lock().unwrap().clone();
        assert_eq!(events.len(), 4, "{events:?}");
        assert_eq!(events[0].0, Level::DEBUG);
        assert!(events[0].1.contains("message=\"Ping\""), "{}", events[0].1);
        assert!(events[0].1.contains("dispatching"));
        assert_eq!(events[1].0, Level::INFO);
        assert!(events[1].1.contains("handled"));
        assert_eq!(events[3].0, Level::WARN);
        assert!(
            events[3].1.contains("error_kind=\"handler\""),
            "{}",
            events[3].1
        );
        assert!(events[3].1.contains("boom"));
        assert!(
            events.iter().all(|(_, t)| !t.contains("Ping)")),
            "no payload"
        );
    }

    #[tokio::test]
    async fn levels_are_configurable() {
        let events = Events::default();
        let _g =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(events.clone()));
        let end = RecordingEndpoint::new();
        Logging::new()
            .levels(Level::TRACE, Level::ERROR, Level::ERROR)
            .handle(Envelope::new(Ping), end.next())
            .await
            .unwrap();
        let levels: Vec<_> = events.0.lock().unwrap().iter().map(|(l, _)| *l).collect();
        assert_eq!(levels, [Level::TRACE, Level::ERROR]);
    }
}
