//! One trace from producer to consumer through each broker transport on a
//! real server (skipped, saying why, when its URL is not set): a request
//! dispatches a job, a worker takes it from the broker, the handler fails
//! once and the retry succeeds — all one trace. And a message sent with no
//! trace context is handled in a new one.

mod common;

use common::{
    assert_child, assert_one_trace, assert_succeeded, dispatch_in_request, messenger, start, work,
    Attempts, Expected, Job, Telemetry, JOBS,
};
use envoi_core::transport::TransportFactory;
use envoi_core::{Envelope, Messenger};
use opentelemetry::trace::SpanId;

/// A broker: the options that give a test queues of its
/// own, its factory and what its spans say about it.
struct Broker {
    system: &'static str,
    options: fn(&str) -> String,
}

const RABBITMQ: Broker = Broker {
    system: "rabbitmq",
    options: |name| format!("queue={name}&exchange={name}&expires=60s"),
};

const REDIS: Broker = Broker {
    system: "redis",
    options: |name| format!("stream=envoi-otel:{name}"),
};

const NATS: Broker = Broker {
    system: "nats",
    options: |name| format!("stream={name}&subject={name}"),
};

const POSTGRES: Broker = Broker {
    system: "postgresql",
    options: |name| format!("table={name}"),
};

/// A name of this run's own.
fn unique() -> String {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("otel_{}", &suffix[..12])
}

/// The host and port of `url`.
fn server(url: &str) -> (String, u16) {
    let authority = url
        .split("://")
        .nth(1)
        .unwrap()
        .split(['/', '?'])
        .next()
        .unwrap();
    let host_port = authority.rsplit('@').next().unwrap();
    let (host, port) = host_port.rsplit_once(':').expect("the URL names a port");
    (host.to_string(), port.parse().unwrap())
}

/// A messenger on `broker`'s queue of this test (the server at `url`),
/// traced.
async fn on(
    broker: &Broker,
    factory: impl TransportFactory,
    attempts: &Attempts,
    url: &str,
) -> (Messenger, (String, u16)) {
    let separator = if url.contains('?') { '&' } else { '?' };
    let dsn = format!("{url}{separator}{}", (broker.options)(&unique()));
    let messenger = start(
        messenger(attempts)
            .transport_factory(factory)
            .transport_dsn(JOBS, dsn),
    )
    .await;
    (messenger, server(url))
}

/// Removes what the test's transport stored on the server.
async fn tear_down(messenger: &Messenger) {
    let jobs = messenger.transport(JOBS).unwrap();
    if let Some(teardown) = jobs.as_teardown() {
        teardown
            .delete()
            .await
            .expect("the test's queue is removed");
    }
}

/// Dispatches a job in a request; the worker's first attempt fails, the
/// retry succeeds; asserts one trace and returns it described.
async fn retried_in_one_trace(
    broker: &Broker,
    factory: impl TransportFactory,
    url: &str,
) -> String {
    let telemetry = Telemetry::install();
    let attempts = Attempts::failing_first(1);
    let (messenger, (host, port)) = on(broker, factory, &attempts, url).await;
    dispatch_in_request(&messenger).await;
    work(&messenger, 2).await;
    tear_down(&messenger).await;
    assert_eq!(attempts.ran(), 2, "tried, failed, retried");
    let trace = telemetry.trace();
    let expected = Expected {
        system: broker.system,
        server: Some((&host, port)),
    };
    assert_one_trace(&trace, 1, &expected);
    trace.describe()
}

/// Sends a job encoded with no trace context straight to the broker;
/// asserts the worker handles it in a new trace.
async fn untraced_in_a_new_trace(broker: &Broker, factory: impl TransportFactory, url: &str) {
    let telemetry = Telemetry::install();
    let attempts = Attempts::default();
    let (messenger, _) = on(broker, factory, &attempts, url).await;
    let raw = messenger
        .serializer()
        .encode(&Envelope::new(Job { n: 1 }))
        .unwrap();
    messenger
        .transport(JOBS)
        .unwrap()
        .send(raw, None)
        .await
        .unwrap();
    work(&messenger, 1).await;
    tear_down(&messenger).await;
    assert_eq!(attempts.ran(), 1, "handled");
    let trace = telemetry.trace();
    let process = trace.one(&format!("process {JOBS}"));
    assert_eq!(process.parent_span_id, SpanId::INVALID, "a new trace");
    assert_succeeded(process);
    assert_child(trace.one("charge"), process);
}

async fn rabbitmq_carries_one_trace_from_the_request_to_the_retried_handler(url: String) {
    let trace = retried_in_one_trace(&RABBITMQ, envoi_amqp::AmqpTransportFactory, &url).await;
    println!("one trace through RabbitMQ (request → send → failed attempt → retry):{trace}");
}

async fn rabbitmq_handles_a_message_without_trace_context_in_a_new_trace(url: String) {
    untraced_in_a_new_trace(&RABBITMQ, envoi_amqp::AmqpTransportFactory, &url).await;
}

async fn redis_carries_one_trace_from_the_request_to_the_retried_handler(url: String) {
    retried_in_one_trace(&REDIS, envoi_redis::RedisTransportFactory, &url).await;
}

async fn redis_handles_a_message_without_trace_context_in_a_new_trace(url: String) {
    untraced_in_a_new_trace(&REDIS, envoi_redis::RedisTransportFactory, &url).await;
}

async fn nats_carries_one_trace_from_the_request_to_the_retried_handler(url: String) {
    retried_in_one_trace(&NATS, envoi_nats::NatsTransportFactory, &url).await;
}

async fn nats_handles_a_message_without_trace_context_in_a_new_trace(url: String) {
    untraced_in_a_new_trace(&NATS, envoi_nats::NatsTransportFactory, &url).await;
}

async fn postgres_carries_one_trace_from_the_request_to_the_retried_handler(url: String) {
    retried_in_one_trace(&POSTGRES, envoi_postgres::PostgresTransportFactory, &url).await;
}

async fn postgres_handles_a_message_without_trace_context_in_a_new_trace(url: String) {
    untraced_in_a_new_trace(&POSTGRES, envoi_postgres::PostgresTransportFactory, &url).await;
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_AMQP_URL", tests = [
        rabbitmq_carries_one_trace_from_the_request_to_the_retried_handler: current_thread,
        rabbitmq_handles_a_message_without_trace_context_in_a_new_trace: current_thread,
    ];
    env = "ENVOI_REDIS_URL", tests = [
        redis_carries_one_trace_from_the_request_to_the_retried_handler: current_thread,
        redis_handles_a_message_without_trace_context_in_a_new_trace: current_thread,
    ];
    env = "ENVOI_NATS_URL", tests = [
        nats_carries_one_trace_from_the_request_to_the_retried_handler: current_thread,
        nats_handles_a_message_without_trace_context_in_a_new_trace: current_thread,
    ];
    env = "ENVOI_POSTGRES_URL", tests = [
        postgres_carries_one_trace_from_the_request_to_the_retried_handler: current_thread,
        postgres_handles_a_message_without_trace_context_in_a_new_trace: current_thread,
    ];
}
