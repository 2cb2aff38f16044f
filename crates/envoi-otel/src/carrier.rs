//! Envelope headers as an OpenTelemetry carrier: [`HeaderInjector`] writes
//! a context into them, [`EnvelopeExtractor`] reads one back, so any
//! [`TextMapPropagator`](opentelemetry::propagation::TextMapPropagator)
//! (W3C `traceparent`/`tracestate`, baggage, …) works on them without
//! envoi parsing a header itself.

use envoi_core::Envelope;
use opentelemetry::propagation::{Extractor, Injector};

/// Collects the headers a propagator writes, to be set on an envelope with
/// [`apply`](Self::apply) (an [`Envelope`] is immutable: headers are added
/// to a new one).
///
/// ```
/// use envoi_core::{Envelope, Message};
/// use envoi_otel::HeaderInjector;
/// use opentelemetry::propagation::Injector;
///
/// #[derive(Debug)]
/// struct Ping;
/// impl Message for Ping { const NAME: &'static str = "Ping"; }
///
/// let mut injector = HeaderInjector::default();
/// injector.set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
/// let envelope = injector.apply(Envelope::new(Ping));
/// assert_eq!(
///     envelope.header("traceparent"),
///     Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
/// );
/// ```
#[derive(Debug, Default)]
pub struct HeaderInjector {
    headers: Vec<(String, String)>,
}

impl HeaderInjector {
    /// `envelope` with every header written so far set (replacing a header
    /// of the same name it had).
    pub fn apply(self, envelope: Envelope) -> Envelope {
        self.headers
            .into_iter()
            .fold(envelope, |envelope, (key, value)| {
                envelope.with_header(key, value)
            })
    }
}

impl Injector for HeaderInjector {
    fn set(&mut self, key: &str, value: String) {
        self.headers.push((key.to_owned(), value));
    }
}

/// Reads a propagated context from an envelope's headers.
///
/// ```
/// use envoi_core::{Envelope, Message};
/// use envoi_otel::EnvelopeExtractor;
/// use opentelemetry::propagation::Extractor;
///
/// #[derive(Debug)]
/// struct Ping;
/// impl Message for Ping { const NAME: &'static str = "Ping"; }
///
/// let envelope = Envelope::new(Ping).with_header("tracestate", "vendor=1");
/// let extractor = EnvelopeExtractor(&envelope);
/// assert_eq!(extractor.get("tracestate"), Some("vendor=1"));
/// assert_eq!(extractor.keys(), ["tracestate"]);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct EnvelopeExtractor<'a>(pub &'a Envelope);

impl Extractor for EnvelopeExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.header(key)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.headers().map(|(key, _)| key).collect()
    }
}
