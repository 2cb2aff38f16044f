//! [`MessageTracing`]: the middleware that opens the send and process spans
//! and carries the trace context across transports in the headers.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use envoi_core::middleware::{was_retried, BoxFuture, Middleware, Next};
use envoi_core::stamp::{ReceivedStamp, SentStamp};
use envoi_core::{Envelope, Messenger, Result};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::carrier::{EnvelopeExtractor, HeaderInjector};
use crate::span;
use crate::transports::Transports;

/// Traces messages across transports: a `send {destination}` producer span
/// around each send, a `process {destination}` consumer span around each
/// handling of a received message, and the trace context in the message's
/// headers between the two; see the [crate documentation](crate).
///
/// Cheap to clone: clones share the transports learnt by
/// [`attach`](Self::attach).
///
/// ```
/// use envoi_core::transport::in_memory::InMemoryTransport;
/// use envoi_core::Messenger;
/// use std::sync::Arc;
/// use envoi_otel::MessageTracing;
///
/// let messenger = Messenger::builder()
///     .transport("orders", Arc::new(InMemoryTransport::new()))
///     .build()
///     .unwrap();
/// // On every bus, knowing every transport.
/// let tracing = MessageTracing::install(&messenger);
/// # let _ = tracing;
/// ```
#[derive(Clone)]
pub struct MessageTracing {
    propagator: Arc<dyn TextMapPropagator + Send + Sync>,
    transports: Transports,
}

impl Default for MessageTracing {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MessageTracing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageTracing")
            .field("transports", &self.transports)
            .finish_non_exhaustive()
    }
}

impl MessageTracing {
    /// The middleware with the W3C Trace Context propagator
    /// (`traceparent`, `tracestate`), knowing no transport yet: register it
    /// on the buses you want traced, then [`attach`](Self::attach) it to
    /// the messenger once built. [`install`](Self::install) does both.
    pub fn new() -> Self {
        Self {
            propagator: Arc::new(TraceContextPropagator::new()),
            transports: Transports::default(),
        }
    }

    /// The same, writing and reading the headers with `propagator`
    /// instead (a `TextMapCompositePropagator` adding baggage, say).
    #[must_use]
    pub fn with_propagator(
        mut self,
        propagator: impl TextMapPropagator + Send + Sync + 'static,
    ) -> Self {
        self.propagator = Arc::new(propagator);
        self
    }

    /// Learns the transports of `messenger`, so the spans name each one's
    /// messaging system and server ([`Transport::describe`](envoi_core::transport::Transport::describe)).
    /// Until then, a transport's system is `unknown`.
    pub fn attach(&self, messenger: &Messenger) {
        self.transports.learn(messenger);
    }

    /// A middleware that knows the transports of `messenger`, appended to
    /// the user middleware of each of its buses.
    pub fn install(messenger: &Messenger) -> Self {
        let tracing = Self::new();
        tracing.install_on(messenger);
        tracing
    }

    /// Attaches this middleware to `messenger` and appends it to the user
    /// middleware of each of its buses.
    pub fn install_on(&self, messenger: &Messenger) {
        self.attach(messenger);
        for bus in messenger.buses() {
            bus.add_middleware(Arc::new(self.clone()));
        }
    }

    /// `envelope` carrying the context of `span` in its headers.
    fn inject(&self, span: &Span, envelope: Envelope) -> Envelope {
        let mut injector = HeaderInjector::default();
        self.propagator
            .inject_context(&span.context(), &mut injector);
        injector.apply(envelope)
    }

    /// Sends `envelope` inside a `send` span whose context it carries.
    fn send<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        let span = span::send();
        if span.is_disabled() {
            return next.run(envelope).boxed();
        }
        let envelope = self.inject(&span, envelope);
        let before = envelope.all::<SentStamp>().count();
        Box::pin(async move {
            let out = next.run(envelope).instrument(span.clone()).await;
            match &out {
                Ok(sent) => {
                    span::record_message(&span, sent);
                    self.record_destinations(&span, sent, before);
                }
                Err(error) => span::record_error(&span, error.kind()),
            }
            out
        })
    }

    /// Names the span after the transports `sent` went to (its
    /// [`SentStamp`]s after the first `before`): `send {destination}` for
    /// one, plain `send` for several (with their system when they share
    /// one).
    fn record_destinations(&self, span: &Span, sent: &Envelope, before: usize) {
        let destinations: Vec<&str> = sent
            .all::<SentStamp>()
            .skip(before)
            .map(|s| s.transport.as_str())
            .collect();
        match destinations.as_slice() {
            [] => {}
            [one] => {
                let name = format!("send {one}");
                // Started already (its context went into the headers): the
                // layer no longer renames it from `otel.name`.
                span.context().span().update_name(name.clone());
                span.record("otel.name", name);
                span.record("messaging.destination.name", *one);
                span::record_transport(span, &self.transports.describe(one));
            }
            [first, rest @ ..] => {
                let system = self.transports.describe(first).system;
                if rest
                    .iter()
                    .all(|t| self.transports.describe(t).system == system)
                {
                    span.record("messaging.system", system);
                }
            }
        }
    }

    /// Handles `envelope`, received from `transport`, inside a `process`
    /// span continuing the trace its headers carry (a new trace when they
    /// carry none). The headers are rewritten with the process span's
    /// context, so a retry or a parked copy continues the trace as a child
    /// of this attempt.
    fn process<'a>(
        &'a self,
        transport: &str,
        envelope: Envelope,
        next: Next<'a>,
    ) -> BoxFuture<'a, Result<Envelope>> {
        let span = span::process(transport);
        if span.is_disabled() {
            return next.run(envelope).boxed();
        }
        let parent = self.propagator.extract(&EnvelopeExtractor(&envelope));
        // The OpenTelemetry parent is the context the message carries, or
        // none (a new trace), never the ambient context of the worker.
        let parent = if parent.span().span_context().is_valid() {
            parent
        } else {
            Context::new()
        };
        // Fails only without a `tracing-opentelemetry` layer, when there
        // is nothing to parent.
        let _ = span.set_parent(parent);
        span::record_message(&span, &envelope);
        span::record_transport(&span, &self.transports.describe(transport));
        let envelope = self.inject(&span, envelope);
        let received = envelope.clone();
        Box::pin(async move {
            let out = next.run(envelope).instrument(span.clone()).await;
            match &out {
                // Retried: its handlers failed.
                Ok(after) if was_retried(&received, after) => span::record_error(&span, "handler"),
                Ok(_) => {}
                Err(error) => span::record_error(&span, error.kind()),
            }
            out
        })
    }
}

impl Middleware for MessageTracing {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        if let Some(received) = envelope.last::<ReceivedStamp>() {
            let transport = received.transport.clone();
            return self.process(&transport, envelope, next);
        }
        if next.sends(&envelope) {
            return self.send(envelope, next);
        }
        next.run(envelope).boxed()
    }

    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed("MessageTracing")
    }

    /// Only while a subscriber records the spans of
    /// [`TARGET`](crate::TARGET): otherwise the bus skips it altogether.
    fn takes_part(&self, envelope: &Envelope) -> bool {
        let _ = envelope;
        tracing::span_enabled!(target: span::TARGET, tracing::Level::INFO)
    }
}
