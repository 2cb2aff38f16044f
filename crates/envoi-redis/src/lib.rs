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
//! transport.setup().await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## How it maps onto Redis
//!
//! | operation | Redis |
//! |---|---|
//! | `setup` | `XGROUP CREATE <stream> <group> 0 MKSTREAM` (an existing group is fine) |
//! | `send` | `XADD <stream> [MAXLEN ~ n] * body <bytes> headers <netstrings>` |
//! | `send` with a delay | script: `HSET <stream>:delayed:<id>` + `ZADD <stream>:delayed <due ms> <id>` |
//! | `get` | `XAUTOCLAIM` (expired leases), script moving due delayed messages, `XREADGROUP ... BLOCK` on a dedicated connection |
//! | `ack` / `reject` | `XACK`; a `get` at most once a second trims what every group acknowledged (`XTRIM MINID`) |
//! | `release` | script: `XADD` a copy at the end, `XACK` the old entry |
//! | `keepalive` | script: `XCLAIM <id> JUSTID` to the same consumer (resets the idle time) |
//! | `message_count` | script: pending + `lag` of the group, + `ZCARD` of the delay set |
//! | `list` / `find` | script: pending entries, then those not yet delivered; then the delay set |
//!
//! The crate's README describes the DSN options, the guarantees and how to
//! run the tests.
//!
//! ## Performance notes
//!
//! * `send_batch` writes up to 500 messages per pipeline (one round trip).
//! * `ack_batch` is a single `XACK`; acknowledged entries leave the stream in
//!   bulk through the periodic trim, not one `XDEL` each.
//! * `get(max)` fetches up to `max` entries with one `XREADGROUP`; lease
//!   recovery (`XAUTOCLAIM`) runs every quarter lease (kept between 50 ms and
//!   5 s), the delay mover at most every 250 ms and the trim every second,
//!   not on every call.
//! * Sends, acks and scripts share one multiplexed connection per handle;
//!   only the blocking read has a connection of its own.

#![forbid(unsafe_code)]

mod codec;
mod factory;
mod link;
mod options;
mod scripts;
mod transport;

pub use factory::RedisTransportFactory;
pub use options::RedisOptions;
pub use transport::RedisTransport;
