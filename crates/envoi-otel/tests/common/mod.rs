//! What the tests share: an OpenTelemetry pipeline exporting to memory, a
//! messenger whose `Job` handler fails a given number of times, a worker,
//! and reading the exported spans back as a trace.

#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoi_core::failure::MultiplierRetryStrategy;
use envoi_core::middleware::correlation::Correlation;
use envoi_core::testing::within;
use envoi_core::worker::Worker;
use envoi_core::{Command, Envelope, Message, Messenger, MessengerBuilder};
use envoi_otel::MessageTracing;
use opentelemetry::trace::{SpanId, SpanKind, TraceId, TracerProvider as _};
use opentelemetry::Value;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde::{Deserialize, Serialize};
use tracing::subscriber::DefaultGuard;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

/// The transport every test sends `Job` to.
pub const JOBS: &str = "jobs";

/// The longest a worker may take to handle what a test sent.
const LIMIT: Duration = Duration::from_secs(60);

/// An OpenTelemetry pipeline exporting every span to memory, bridged to
/// `tracing` for the current thread while it lives.
pub struct Telemetry {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    _guard: DefaultGuard,
}

impl Telemetry {
    /// Starts recording.
    pub fn install() -> Self {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("envoi-otel-tests")));
        let guard = tracing::subscriber::set_default(subscriber);
        Self {
            exporter,
            provider,
            _guard: guard,
        }
    }

    /// Every span ended so far.
    pub fn trace(&self) -> Trace {
        self.provider.force_flush().expect("the spans are flushed");
        Trace(
            self.exporter
                .get_finished_spans()
                .expect("the spans are read"),
        )
    }
}

/// A job to run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    pub n: u32,
}

impl Message for Job {
    const NAME: &'static str = "Job";
}

impl Command for Job {
    type Output = ();
    type Error = JobFailed;
}

/// What the `Job` handler fails with while it is told to.
#[derive(Debug, thiserror::Error)]
#[error("job {0} failed on purpose")]
pub struct JobFailed(u32);

/// How many times the `Job` handler ran, and how many of them fail.
#[derive(Clone, Default)]
pub struct Attempts {
    ran: Arc<AtomicU32>,
    failing: Arc<AtomicU32>,
}

impl Attempts {
    /// The first `n` runs fail.
    pub fn failing_first(n: u32) -> Self {
        let attempts = Self::default();
        attempts.failing.store(n, Ordering::SeqCst);
        attempts
    }

    /// How many times the handler ran.
    pub fn ran(&self) -> u32 {
        self.ran.load(Ordering::SeqCst)
    }
}

/// A messenger routing `Job` to [`JOBS`], whose handler runs inside a
/// `charge` span and fails while `attempts` says so; each message is
/// retried once, at once; messages get message and correlation ids.
pub fn messenger(attempts: &Attempts) -> MessengerBuilder {
    let attempts = attempts.clone();
    Messenger::builder()
        .command_handler(move |job: Job| {
            let attempts = attempts.clone();
            async move {
                let run = attempts.ran.fetch_add(1, Ordering::SeqCst);
                tracing::info_span!("charge").in_scope(|| {
                    if run < attempts.failing.load(Ordering::SeqCst) {
                        Err(JobFailed(job.n))
                    } else {
                        Ok(())
                    }
                })
            }
        })
        .route::<Job>(JOBS)
        .middleware(Correlation)
        .default_retry_strategy(MultiplierRetryStrategy {
            max_retries: 1,
            delay: Duration::ZERO,
            jitter: 0.0,
            ..MultiplierRetryStrategy::default()
        })
}

/// Builds `builder`, sets its transports up and installs the tracing.
pub async fn start(builder: MessengerBuilder) -> Messenger {
    let messenger = builder.build_async().await.expect("the messenger builds");
    for (name, result) in messenger.setup_transports().await {
        result.unwrap_or_else(|e| panic!("setting up `{name}` failed: {e}"));
    }
    MessageTracing::install(&messenger);
    messenger
}

/// Dispatches a `Job` inside a `request` span, as an application serving
/// a request would.
pub async fn dispatch_in_request(messenger: &Messenger) {
    messenger
        .bus()
        .dispatch(Envelope::new(Job { n: 7 }))
        .instrument(tracing::info_span!("request"))
        .await
        .expect("the job is sent");
}

/// Runs a worker on [`JOBS`] until it has taken `messages` messages.
pub async fn work(messenger: &Messenger, messages: u64) {
    let worker = Worker::builder(messenger)
        .receiver(JOBS)
        .message_limit(messages)
        .idle_sleep(Duration::from_millis(20))
        .build()
        .expect("the worker builds");
    let report = within(LIMIT, "the worker to take the jobs", worker.run()).await;
    let _ = report;
}

/// Exported spans.
pub struct Trace(pub Vec<SpanData>);

impl Trace {
    /// The spans called `name`, in the order they started.
    pub fn named(&self, name: &str) -> Vec<&SpanData> {
        let mut spans: Vec<&SpanData> = self.0.iter().filter(|s| s.name == name).collect();
        spans.sort_by_key(|s| s.start_time);
        spans
    }

    /// The one span called `name`.
    pub fn one(&self, name: &str) -> &SpanData {
        match self.named(name).as_slice() {
            [one] => one,
            other => panic!(
                "expected one `{name}` span, found {}; spans: {}",
                other.len(),
                self.describe()
            ),
        }
    }

    /// Each span as `name (kind) span id ← parent id`, one a line, and its
    /// attributes, sorted by key, below it.
    pub fn describe(&self) -> String {
        let mut spans: Vec<&SpanData> = self.0.iter().collect();
        spans.sort_by_key(|s| s.start_time);
        let mut out = String::new();
        for span in spans {
            out.push_str(&format!(
                "\n{} ({:?}) trace {} span {} ← parent {}{}",
                span.name,
                span.span_kind,
                span.span_context.trace_id(),
                span.span_context.span_id(),
                span.parent_span_id,
                if span.parent_span_is_remote {
                    " (remote)"
                } else {
                    ""
                },
            ));
            let mut attributes: Vec<String> = span
                .attributes
                .iter()
                .map(|kv| format!("{}={}", kv.key, kv.value))
                .collect();
            attributes.sort();
            for attribute in attributes {
                out.push_str(&format!("\n    {attribute}"));
            }
            out.push_str(&format!("\n    status={:?}", span.status));
        }
        out
    }
}

/// The value of attribute `key` of `span`, as text.
pub fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| match &kv.value {
            Value::String(s) => s.to_string(),
            other => other.to_string(),
        })
}

/// Asserts `child` is a child of `parent` in the same trace.
pub fn assert_child(child: &SpanData, parent: &SpanData) {
    assert_eq!(
        child.span_context.trace_id(),
        parent.span_context.trace_id(),
        "`{}` is in the trace of `{}`",
        child.name,
        parent.name
    );
    assert_eq!(
        child.parent_span_id,
        parent.span_context.span_id(),
        "`{}` is a child of `{}`",
        child.name,
        parent.name
    );
}

/// What a transport's spans say about it.
pub struct Expected<'a> {
    pub system: &'a str,
    pub server: Option<(&'a str, u16)>,
}

/// Asserts the messaging attributes of a send or process span (`kind`
/// `send` or `process`) on [`JOBS`].
pub fn assert_messaging(span: &SpanData, operation: &str, expected: &Expected<'_>) {
    let name = format!("{operation} {JOBS}");
    assert_eq!(span.name, name);
    let kind = if operation == "send" {
        SpanKind::Producer
    } else {
        SpanKind::Consumer
    };
    assert_eq!(span.span_kind, kind, "the kind of `{name}`");
    let expect = |key: &str, value: Option<&str>| {
        assert_eq!(
            attribute(span, key).as_deref(),
            value,
            "`{key}` of `{name}`"
        );
    };
    expect("messaging.system", Some(expected.system));
    expect("messaging.operation.name", Some(operation));
    expect("messaging.operation.type", Some(operation));
    expect("messaging.destination.name", Some(JOBS));
    let port = expected.server.map(|(_, port)| port.to_string());
    expect("server.address", expected.server.map(|(host, _)| host));
    expect("server.port", port.as_deref());
    for key in ["messaging.message.id", "messaging.message.conversation_id"] {
        let id = attribute(span, key).unwrap_or_else(|| panic!("`{name}` has no `{key}`"));
        assert!(uuid::Uuid::parse_str(&id).is_ok(), "`{key}` {id} is a uuid");
    }
}

/// Asserts `span` failed with `error.type` `kind`.
pub fn assert_failed(span: &SpanData, kind: &str) {
    assert_eq!(attribute(span, "error.type").as_deref(), Some(kind));
    assert!(
        matches!(span.status, opentelemetry::trace::Status::Error { .. }),
        "`{}` has an error status: {:?}",
        span.name,
        span.status
    );
}

/// Asserts `span` did not fail.
pub fn assert_succeeded(span: &SpanData) {
    assert_eq!(attribute(span, "error.type"), None, "`{}`", span.name);
    assert!(
        !matches!(span.status, opentelemetry::trace::Status::Error { .. }),
        "`{}` succeeded: {:?}",
        span.name,
        span.status
    );
}

/// Asserts the trace of a job dispatched in a request whose handler failed
/// `failures` times before it succeeded (each failure retried): request →
/// send → process (→ process …), each attempt's `charge` inside its
/// process span, the retries children of the attempt before them, all one
/// trace.
pub fn assert_one_trace(trace: &Trace, failures: usize, expected: &Expected<'_>) {
    let request = trace.one("request");
    assert_eq!(
        request.parent_span_id,
        SpanId::INVALID,
        "the request is a root"
    );
    let send = trace.one(&format!("send {JOBS}"));
    assert_child(send, request);
    assert_messaging(send, "send", expected);
    assert_succeeded(send);
    let attempts = trace.named(&format!("process {JOBS}"));
    assert_eq!(
        attempts.len(),
        failures + 1,
        "one process span per attempt: {}",
        trace.describe()
    );
    let charges = trace.named("charge");
    assert_eq!(
        charges.len(),
        attempts.len(),
        "the handler ran once per attempt"
    );
    let mut parent = send;
    for (i, attempt) in attempts.iter().enumerate() {
        assert_child(attempt, parent);
        assert!(
            attempt.parent_span_is_remote,
            "the parent came in the headers"
        );
        assert_messaging(attempt, "process", expected);
        assert_eq!(
            attribute(attempt, "messaging.message.id"),
            attribute(send, "messaging.message.id"),
            "every attempt is the message sent"
        );
        assert_child(charges[i], attempt);
        if i < failures {
            assert_failed(attempt, "handler");
        } else {
            assert_succeeded(attempt);
        }
        parent = attempt;
    }
    let trace_id: TraceId = request.span_context.trace_id();
    assert!(
        trace
            .0
            .iter()
            .all(|s| s.span_context.trace_id() == trace_id),
        "every span is in one trace: {}",
        trace.describe()
    );
}
