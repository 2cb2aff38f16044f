//! # envoi-redis
//!
//! The Redis Streams transport for envoi: a DSN such as
//! `redis://127.0.0.1:6379?lease=30s` becomes a [`RedisTransport`] that
//! stores messages in one stream and hands them out through a consumer
//! group, at least once.
//!
//! ```no_run
//! use std::sync::Arc;
//! use envoi_core::transport::{Transport, TransportFactory};
//! use envoi_redis::RedisTransportFactory;
//!
//! # async fn demo() -> Result<(), envoi_core::TransportError> {
//! let transport: Arc<dyn Transport> = RedisTransportFactory
//!     .create("async", "redis://127.0.0.1:6379?group=workers&lease=30s")
//!     .await?;
//! if let Some(setup) = transport.as_setup() {
//!     setup.setup().await?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Or directly, with [`RedisTransport::connect`] (a DSN) or
//! [`RedisTransport::with_config`] (a [`RedisConfig`]).
//!
//! ## How it maps onto Redis
//!
//! | operation | Redis |
//! |---|---|
//! | `setup` | `XGROUP CREATE <stream> <group> 0 MKSTREAM` (an existing group is fine) |
//! | `send` | `XADD <stream> [MAXLEN ~ n] * body <bytes> headers <netstrings>` |
//! | `send` with a delay | script: `HSET <stream>:delayed:<id>` + `ZADD <stream>:delayed <due ms> <id>` |
//! | `get` | `XAUTOCLAIM` (expired leases; those entries come marked `redelivered`), script moving due delayed messages, script claiming released entries, `XREADGROUP ... BLOCK` on a dedicated connection |
//! | `ack` | `XACK`; a `get` at most once a second trims what every group acknowledged (`XTRIM MINID`) |
//! | `reject` | script: `XACK`, then `XDEL` unless another group still needs the entry |
//! | `release` | script: `XCLAIM ... JUSTID` to the group's release consumer (the entry stays pending; the stream, and every other group, is untouched); the next `get` claims it, marked `redelivered` |
//! | `keepalive` ([`Keepalive`](envoi_core::transport::Keepalive)) | script: `XCLAIM <id> JUSTID` to the same consumer (resets the idle time) |
//! | `message_count` ([`MessageCount`](envoi_core::transport::MessageCount)) | script: pending + `lag` of the group, + `ZCARD` of the delay set |
//! | `list` / `find` ([`Browse`](envoi_core::transport::Browse)) | script: pending entries, then those not yet delivered; then the delay set |
//! | `purge` ([`Teardown`](envoi_core::transport::Teardown)) | script: delete the delay set and payloads, `XACK` the group's pending entries, `XGROUP SETID <group> $`; then trim |
//! | `delete` ([`Teardown`](envoi_core::transport::Teardown)) | `DEL` of the stream (every group with it), the delay set and the payloads |
//! | `wait_for_messages` ([`WakeUp`](envoi_core::transport::WakeUp)) | returns at once (`get` blocked on the server already); after a failed `get`, sleeps |
//! | [`close`](RedisTransport::close) | script giving back what was read ahead, then the connections close |
//!
//! The crate's README describes the DSN options, the guarantees and how to
//! run the tests.
//!
//! ## Performance notes
//!
//! * `send_batch` writes up to 500 messages per pipeline (one round trip).
//! * `ack_batch` is a single `XACK`; acknowledged entries leave the stream in
//!   bulk through the periodic trim, not one `XDEL` each.
//! * `get(max)` fetches up to `max` entries with one `XREADGROUP`, and a
//!   full `get` of at least 100 reads the next batch in the background
//!   (handed out while less than half a lease old); lease
//!   recovery (`XAUTOCLAIM`) runs every quarter lease (kept between 50 ms and
//!   5 s), the delay mover at most every 250 ms and the trim every second,
//!   not on every call.
//! * Sends, acks and scripts share one multiplexed connection per handle;
//!   only the blocking read has a connection of its own. While the server
//!   is out of reach, attempts to reconnect are spaced (50 ms doubling up
//!   to 1 s).

#![forbid(unsafe_code)]

mod codec;
mod config;
mod factory;
mod keys;
mod link;
mod scripts;
mod transport;

pub use config::RedisConfig;
pub use factory::RedisTransportFactory;
pub use transport::RedisTransport;
