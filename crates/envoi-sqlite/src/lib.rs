//! # envoi-sqlite
//!
//! The SQLite transport, envoi's embedded default: messages wait in a table
//! of a local database file, so a worker in the same or another process
//! consumes them with no broker to run.
//!
//! ```no_run
//! use envoi_core::transport::{RawMessage, Receiver, Setup, Transport};
//! use envoi_sqlite::SqliteTransport;
//!
//! # async fn run() -> Result<(), envoi_core::TransportError> {
//! let orders = SqliteTransport::connect("orders", "sqlite://var/envoi.db?lease=30s").await?;
//! orders.setup().await?;
//! orders.send(RawMessage { body: br#"{"id":1}"#.to_vec(), ..Default::default() }, None).await?;
//! for delivery in orders.get(10).await? {
//!     // handle it, then
//!     orders.ack(&delivery.id).await?;
//! }
//! orders.close().await?;
//! # Ok(()) }
//! ```
//!
//! Besides sending ([`Transport`]) it has
//! every ability a worker and the commands use, each handed out by its
//! `as_*` method: [`Receiver`](envoi_core::transport::Receiver),
//! [`Keepalive`](envoi_core::transport::Keepalive),
//! [`Setup`](envoi_core::transport::Setup),
//! [`MessageCount`](envoi_core::transport::MessageCount),
//! [`Browse`](envoi_core::transport::Browse),
//! [`Teardown`](envoi_core::transport::Teardown) and
//! [`WakeUp`](envoi_core::transport::WakeUp).
//!
//! ## DSN
//!
//! `sqlite://<path>[?table=..&lease=..&poll=..&batch=..&busy_timeout=..&auto_setup=..]`;
//! see [`SqliteConfig`] for each option and its default (build one in code
//! and open it with [`SqliteTransport::with_config`]).
//! `sqlite:///abs/path.db` is absolute, `sqlite://var/envoi.db` relative to
//! the working directory; the file and its directory are created if
//! missing. In-memory databases (`sqlite::memory:`) are rejected with
//! [`envoi_core::TransportError::InvalidDsn`]:
//! every pooled connection would see a database of its own; use the
//! `in-memory://` transport instead.
//!
//! ## Schema
//!
//! One table per transport, `envoi_<name>` unless `table=` says otherwise
//! (several transports may share a table: every statement filters on
//! `queue_name`). [`setup`](envoi_core::transport::Setup::setup), or the
//! first use with `auto_setup`, creates it:
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS "envoi_<name>" (
//!     id INTEGER PRIMARY KEY AUTOINCREMENT,  -- the delivery id; never reused
//!     queue_name TEXT NOT NULL,              -- the transport's name
//!     body BLOB NOT NULL,                    -- the encoded message, any bytes
//!     headers TEXT NOT NULL,                 -- JSON object of string values
//!     created_at INTEGER NOT NULL,           -- Unix ms
//!     available_at INTEGER NOT NULL          -- Unix ms; not handed out before
//!         CHECK (typeof(available_at) = 'integer'),  -- else never due, never claimed
//!     delivered_at INTEGER,                  -- Unix ms of the claim; NULL when not leased
//!     lease_until INTEGER,                   -- Unix ms; NULL when not leased
//!     delivery_count INTEGER NOT NULL DEFAULT 0  -- times claimed, less those given back unused
//! );
//! CREATE INDEX IF NOT EXISTS "envoi_<name>:claim" ON "envoi_<name>" (queue_name, available_at, id);
//! ```
//!
//! A row written by something else, whose body is not a BLOB or TEXT or
//! whose headers are not TEXT holding a JSON object of strings, is handed
//! out all the same, as well as it can be read: the body a number renders
//! as, the headers that are strings, the stored headers in
//! [`STORED_HEADERS_HEADER`], and what is wrong in [`INVALID_BODY_HEADER`]
//! or [`INVALID_HEADERS_HEADER`] (headers are read by
//! [`decode_json_headers`], as on every transport storing them as JSON;
//! headers of another storage class are salvaged with that class as the
//! first problem). The serializer refuses such a message naming the
//! reason, so the worker moves it to the failure transport instead of the
//! row coming back on every claim.
//!
//! [`STORED_HEADERS_HEADER`]: envoi_core::transport::support::STORED_HEADERS_HEADER
//! [`decode_json_headers`]: envoi_core::transport::support::decode_json_headers
//! [`INVALID_BODY_HEADER`]: envoi_core::serializer::INVALID_BODY_HEADER
//! [`INVALID_HEADERS_HEADER`]: envoi_core::serializer::INVALID_HEADERS_HEADER
//!
//! The statements, with `?now` the current Unix time in milliseconds:
//!
//! * **send**: `INSERT … (queue_name, body, headers, created_at,
//!   available_at) VALUES (?, ?, ?, ?now, ?now + delay)`;
//!   `send_batch` inserts 64 rows per statement in one transaction: a
//!   batch that fails stores none of its messages.
//! * **claim** (`get`): one statement, atomic on its own (a writing
//!   statement takes SQLite's write lock before it reads):
//!   `UPDATE … SET delivered_at = ?now, lease_until = ?now + lease,
//!   available_at = ?now + lease, delivery_count = delivery_count + 1
//!   WHERE id IN (SELECT id … WHERE queue_name = ?
//!   AND available_at <= ?now ORDER BY available_at, id LIMIT ?max)
//!   RETURNING id, body, headers, delivery_count`. Moving `available_at`
//!   to the end of the lease is what makes a claimed row invisible to other
//!   consumers and visible again when the lease expires, with one index
//!   range scan.
//! * **ack** / **reject**: `DELETE … WHERE id = ?` (a rejected message is
//!   gone, as an acknowledged one: the worker keeps what it gives up on in
//!   its failure transport); `ack_batch`:
//!   `DELETE … WHERE id IN (SELECT value FROM json_each(?))`.
//! * **release**: `lease_until = NULL, available_at = ?now` (handed out
//!   again at once). **keepalive**: `lease_until = available_at = ?now +
//!   lease`.
//! * **purge** ([`Teardown`](envoi_core::transport::Teardown)): `DELETE …
//!   WHERE queue_name = ?`; **delete**: the same, then `DROP TABLE` when no
//!   other transport's rows are left in it (nothing to do without a table).
//!
//! ## Guarantees
//!
//! * At least once: a message handed out is leased for `lease` (60 s by
//!   default); a consumer that dies without acknowledging it loses the lease
//!   and the message is handed out again, to any process using the file. A
//!   live consumer calls `keepalive` to keep a long handler's message.
//! * Redeliveries are marked: a row claimed before and not acknowledged
//!   (its lease ran out, or it was released; `delivery_count` above 1) is
//!   handed out marked as redelivered ([`Delivery::redelivered`]), so
//!   [`Deduplicate`] handles it even while the claim of a consumer that
//!   died still holds its key. Rows a handle kept and gave back unused do
//!   not count, and nothing stored in a row marks it. Setup adds the
//!   column to a table made before it existed.
//!
//!   [`Delivery::redelivered`]: envoi_core::transport::Delivery::redelivered
//!   [`Deduplicate`]: envoi_core::middleware::dedup::Deduplicate
//! * Ordered: one consumer gets messages batch by batch in the order they
//!   became available, each batch in send order (for undelayed messages,
//!   send order throughout).
//! * Delays to the millisecond, observed within `poll` (50 ms by default);
//!   sends in the same process wake waiting consumers at once.
//! * Persistent: WAL journal, `synchronous=NORMAL`; a committed send
//!   survives a crash of the process (the last transactions may be lost on
//!   power failure, as `NORMAL` trades that for speed).
//! * `list`, `find` and `message_count` cover waiting, delayed and leased
//!   messages.
//! * Ids come from an `AUTOINCREMENT` key and are never reused, so a late
//!   ack from a consumer whose lease ran out can only remove the message it
//!   handled (then handled by two consumers, as at-least-once allows), never
//!   a newer one.
//!
//! `tests/crash.rs` proves the first and last points with real worker
//! processes: one is killed with `SIGKILL` five times at different points of
//! a 2,000-message run and restarted, and every message id is handled at
//! least once with none left behind; another is stopped with `SIGTERM` and
//! finishes what it started, hands back what it had fetched but not started
//! (claimable again at once), and handles nothing twice.
//!
//! `get(max)` claims `max` rows in one statement. Consumers that ask for one
//! message at a time can set `batch=N` to claim `N` and keep the others,
//! leased to this handle, for the next calls; rows kept for half the lease
//! are given back, as are those held by a handle when it is dropped or
//! [closed](SqliteTransport::close) (only while still leased under the claim
//! that kept them: one whose lease ran out may be another consumer's by
//! then, and stays so). The worker fetches in batches itself,
//! so it needs no prefetching (and a graceful stop then leaves nothing
//! leased).
//!
//! ## Connections and group commit
//!
//! SQLite has a single writer, so each transport writes through one
//! connection owned by a writer task (on the Tokio runtime it was opened
//! in). Sends, claims, acks, releases and keepalives queue for it; what
//! queued while it was busy is committed in one `BEGIN IMMEDIATE`
//! transaction, so concurrent producers and consumers share commits instead
//! of taking turns on the write lock (if any part fails, each operation is
//! retried on its own, so one failure never fails the others). A lone
//! operation runs on its own: one statement, or a transaction of its own
//! for a batch of several messages (or a `delete`). Reads (`list`, `find`,
//! `message_count`) use up to two more connections.
//! [`close`](SqliteTransport::close) lets the writer finish what queued
//! before it and closes every connection: every clone of the handle fails
//! with [`Closed`](envoi_core::TransportError::Closed) afterwards. Dropping
//! the last handle stops the writer once its queue is empty.

#![forbid(unsafe_code)]

mod apply;
mod browse;
mod config;
mod op;
mod open;
mod prefetch;
mod receive;
mod row;
mod send;
mod setup;
mod signal;
mod sql;
mod transport;
mod writer;

use std::sync::Arc;

use envoi_core::transport::{dsn_has_scheme, Transport, TransportFactory};
use envoi_core::{BoxFuture, TransportError};

pub use config::SqliteConfig;
pub use transport::SqliteTransport;

/// Creates [`SqliteTransport`]s from `sqlite://` DSNs.
///
/// ```
/// use envoi_core::transport::TransportFactory;
/// use envoi_sqlite::SqliteTransportFactory;
///
/// assert!(SqliteTransportFactory.supports("sqlite://var/envoi.db"));
/// assert!(!SqliteTransportFactory.supports("redis://127.0.0.1:6379"));
/// ```
#[derive(Debug, Default, Clone, Copy)]
pub struct SqliteTransportFactory;

impl TransportFactory for SqliteTransportFactory {
    fn supports(&self, dsn: &str) -> bool {
        dsn_has_scheme(dsn, "sqlite:")
    }

    fn create<'a>(
        &'a self,
        name: &'a str,
        dsn: &'a str,
    ) -> BoxFuture<'a, Result<Arc<dyn Transport>, TransportError>> {
        Box::pin(async move {
            let transport = SqliteTransport::connect(name, dsn).await?;
            Ok(Arc::new(transport) as Arc<dyn Transport>)
        })
    }
}
