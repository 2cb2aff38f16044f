//! OpenTelemetry for envoi: one trace from the code that dispatches a
//! message to the handler that processes it, in another process, through
//! any transport.
//!
//! [`MessageTracing`] is a middleware. On the sending side it opens a
//! `send {destination}` producer span around the send step and writes the
//! span's context into the message's headers (W3C Trace Context:
//! `traceparent`, `tracestate`); every envoi transport carries headers, so
//! the context crosses the in-memory, SQLite, PostgreSQL, Redis, RabbitMQ
//! and NATS transports alike. On the receiving side it reads the context
//! back and runs the handlers inside a `process {destination}` consumer
//! span whose parent is the send span. The headers are written and read by
//! the `opentelemetry` crate's propagators; envoi parses none itself.
//!
//! ```no_run
//! use envoi_core::transport::in_memory::InMemoryTransport;
//! use envoi_core::Messenger;
//! use std::sync::Arc;
//! use envoi_otel::MessageTracing;
//! use opentelemetry::trace::TracerProvider as _;
//! use opentelemetry_sdk::trace::SdkTracerProvider;
//! use tracing_subscriber::layer::SubscriberExt;
//!
//! // Your OpenTelemetry pipeline (an OTLP exporter, say), bridged to `tracing`.
//! let provider = SdkTracerProvider::builder().build();
//! let subscriber = tracing_subscriber::registry()
//!     .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("orders")));
//! tracing::subscriber::set_global_default(subscriber).unwrap();
//!
//! let messenger = Messenger::builder()
//!     .transport("orders", Arc::new(InMemoryTransport::new()))
//!     .build()
//!     .unwrap();
//! MessageTracing::install(&messenger);
//! ```
//!
//! # Spans and attributes
//!
//! The spans follow the messaging spans of the OpenTelemetry semantic
//! conventions, version [`SEMCONV_VERSION`]:
//!
//! | attribute | send | process |
//! |---|---|---|
//! | span name | `send {transport}` (`send` when sent to several) | `process {transport}` |
//! | span kind | producer | consumer |
//! | `messaging.system` | the transport's ([`Transport::describe`](envoi_core::transport::Transport::describe)): `rabbitmq`, `redis`, `nats`, `postgresql`, `sqlite`, `in_memory` | the same |
//! | `messaging.operation.name` / `.type` | `send` / `send` | `process` / `process` |
//! | `messaging.destination.name` | the transport's name | the transport's name |
//! | `messaging.message.id` | the [`MessageIdStamp`](envoi_core::stamp::MessageIdStamp), else the transport's id | the same |
//! | `messaging.message.conversation_id` | the [`CorrelationIdStamp`](envoi_core::middleware::correlation::CorrelationIdStamp) | the same |
//! | `server.address` / `server.port` | the broker's, from the DSN | the same |
//! | `error.type`, error status | the [error's kind](envoi_core::BusError::kind) | the same; `handler` when the handlers failed and a retry was scheduled |
//!
//! `messaging.message.body.size` is not recorded: the middleware sees the
//! message before it is encoded and after it is decoded, never its bytes.
//!
//! # Retries and the failure transport
//!
//! Before the handlers run, the received message's trace headers are
//! rewritten with the context of its `process` span. A retry, which the
//! retry step sends with the message's headers, is therefore processed in
//! the same trace as a child of the attempt that failed; a message parked
//! in the failure transport carries its last attempt too, so `failed retry`
//! continues the original trace. Each attempt is one `process` span, and
//! they chain: send → attempt 1 → attempt 2 → ….
//!
//! A message whose headers carry no context (sent by a producer that is
//! not envoi, or before tracing was on) is handled as usual in a new trace.
//!
//! # Limits
//!
//! * A dispatch a handler defers until its own dispatch has succeeded
//!   ([`DispatchAfterCurrentBusStamp`](envoi_core::stamp::DispatchAfterCurrentBusStamp))
//!   runs after the `process` span has closed, so its `send` span is not
//!   in the trace of the message being handled.
//! * Each received message gets its own `process` span, a child of its
//!   send span; there is no span-link mode for batches yet, and no
//!   `receive` or `settle` spans.
//!
//! # Cost
//!
//! With no subscriber recording `INFO` spans of [`TARGET`], the middleware
//! tells the bus it takes no part, and the bus skips it: no span, no header.

#![forbid(unsafe_code)]

mod carrier;
mod middleware;
mod span;
mod transports;

pub use carrier::{EnvelopeExtractor, HeaderInjector};
pub use middleware::MessageTracing;
pub use span::TARGET;

/// The version of the OpenTelemetry semantic conventions the spans follow.
pub const SEMCONV_VERSION: &str = "1.27.0";
