#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub use envoi_core::*;

pub mod transports;

pub use transports::MessengerBuilderExt;

/// The embedded SQLite transport, `sqlite://<path>` (feature `sqlite`, on by
/// default).
#[cfg(feature = "sqlite")]
pub use envoi_sqlite as sqlite;

/// The PostgreSQL transport, `postgres://…` (feature `postgres`).
#[cfg(feature = "postgres")]
pub use envoi_postgres as postgres;

/// The Redis Streams transport, `redis://…` (feature `redis`).
#[cfg(feature = "redis")]
pub use envoi_redis as redis;

/// The RabbitMQ transport, `amqp://…` and `amqps://…` (feature `amqp`).
#[cfg(feature = "amqp")]
pub use envoi_amqp as amqp;

/// The NATS JetStream transport, `nats://…` (feature `nats`).
#[cfg(feature = "nats")]
pub use envoi_nats as nats;

/// OpenTelemetry: one trace from the dispatch to the handler, through
/// every transport (feature `otel`).
#[cfg(feature = "otel")]
pub use envoi_otel as otel;
