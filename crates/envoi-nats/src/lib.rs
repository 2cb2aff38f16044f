//! # envoi-nats
//!
//! A NATS JetStream transport for envoi.
//!
//! ```text
//! nats://[user:password@|token@]host:port?stream=..&subject=..&consumer=..&lease=..&batch=..&wait=..
//! ```
//!
//! Each transport is a work-queue stream capturing one subject and a durable
//! pull consumer on it; [`NatsConfig`] lists every DSN option. Handles created
//! for the same name share the consumer and compete for messages.
//!
//! ## Connecting
//!
//! Credentials come from the DSN: a user and password as its user
//! information (`nats://user:password@host`, percent-encoded), a token as
//! user information without a password (`nats://TOKEN@host`, as NATS URLs
//! give one) or as the `token` option, an NKey seed file
//! (`nkey_seed_file=`) or a `.creds` file (`creds_file=`); at most one of
//! them. `tls=true` requires TLS; `tls_ca_file`, `tls_cert_file` and
//! `tls_key_file` name the authorities' certificates and the client's
//! certificate and key (PEM). Passwords and tokens are masked wherever the
//! DSN or configuration is shown. See [`NatsConfig`].
//!
//! Connecting takes at most `connect_timeout` (5 s by default): a server
//! that refuses the connection or the credentials, or does not answer in
//! time, is [`TransportError::Unreachable`](envoi_core::TransportError::Unreachable)
//! naming the masked DSN.
//!
//! ## How each operation maps to JetStream
//!
//! [`NatsTransport`] is a [`Transport`](envoi_core::transport::Transport)
//! with these abilities, each handed out by its `as_*` method:
//!
//! | Ability / call                 | JetStream                                                    |
//! |--------------------------------|--------------------------------------------------------------|
//! | `Setup::setup`                 | get-or-create stream, create-or-update durable pull consumer |
//! | `send` / `send_batch`          | publish (`Nats-Msg-Id` with `dedup`), wait for the ack        |
//! | `Receiver::get`                | one pull request (fetch) with an expiry of `wait`            |
//! | `Receiver::ack`, `ack_batch`   | `+ACK`, confirmed by the server (one round trip a batch)     |
//! | `Receiver::reject`             | `+ACK`, confirmed (a work queue drops the message for good)  |
//! | `Receiver::release`            | `-NAK` with no delay, confirmed: handed out again at once    |
//! | `Keepalive::keepalive`         | `+WPI` (in progress): the lease starts over                  |
//! | lease                          | the consumer's `ack_wait`                                    |
//! | `MessageCount::message_count`  | consumer info: `num_pending + num_ack_pending`               |
//! | `Browse::list` / `find`        | `STREAM.MSG.GET` by subject / by sequence                    |
//! | `Teardown::purge`              | stream purge of the transport's subject (returns the count)  |
//! | `Teardown::delete`             | stream delete (its consumer and messages with it)            |
//! | `WakeUp::wait_for_messages`    | returns at once: an empty `get` already waited on the server |
//! | [`NatsTransport::close`]       | gives back what was fetched ahead, flushes, drains           |
//!
//! A message JetStream delivered before (its delivery count is above one)
//! is handed out with [`Delivery::redelivered`](envoi_core::transport::Delivery::redelivered)
//! set, unless it is a delayed message (deferring counts as a delivery).
//!
//! Ids are stream sequence numbers, the same for every delivery of a message.
//! `ack` and `reject` of an id this handle did not hand out (one from `list`,
//! say) delete that message from the stream.
//!
//! ## Acknowledgements
//!
//! `ack`, `ack_batch`, `reject` and `release` return once the server has
//! applied them: a worker whose graceful stop (SIGTERM) ends with its last
//! acks, and whose process exits right after, leaves nothing to be handled
//! again. The acks of a batch are written together, the last one as a
//! request that the server answers once applied; as the consumer applies
//! the acks of one connection in order, that answer confirms the batch, so
//! a batch costs one round trip. Should the connection be lost meanwhile (a
//! broker restart), or no answer come, the batch is sent again after the
//! client reconnects, for as long as the lease of its messages lasts (past
//! it, the message may be another consumer's); after that the call fails,
//! and the messages come back. With `double_ack=true` every ack is a request
//! of its own, confirmed concurrently within a batch. `list`, `find` and
//! `message_count` therefore never show a message the same handle
//! acknowledged.
//!
//! A server that restarts can lose track of deliveries and even of
//! acknowledgements it confirmed just before it stopped, and deliver those
//! messages again. A handle does not hand such a message out twice: one it
//! holds (leased less than half a lease ago) takes the new delivery's ack
//! subject, and one it acknowledged (in the last two leases or minute, the
//! latest 100,000) is acknowledged again. Messages are told apart by
//! stream sequence and storage time, so a stream deleted and made again
//! (whose sequences start over) is not mistaken for the old one.
//!
//! See the crate's `README.md` for options, guarantees and how to run the
//! tests.
//!
//! ## Delays
//!
//! The JetStream servers this transport targets have no per-message delay.
//! A delayed message is published at once with an `Envoi-Not-Before` header
//! (milliseconds since the Unix epoch, by the sender's clock). When `get`
//! receives it before that time it sends `-NAK {"delay": remaining}` and does
//! not hand it out; JetStream delivers it again when it is due. A message is
//! therefore never handed out early (given synchronised clocks) and is
//! usually late by no more than a fetch round trip (a few milliseconds on a
//! local server), provided some consumer is fetching. Waiting delayed messages
//! count as "ack pending" on the consumer, which is why `max_ack_pending`
//! defaults to unlimited.
//!
//! ## Stalls and reconnects
//!
//! The client reconnects on its own (at once, then 100 ms doubling up to
//! 2 s). Every `get` is a fresh pull request with its own inbox, bounded by
//! `wait` plus one second: a request lost with a connection ends at that
//! bound instead of hanging, and the consumer is then re-bound (created again
//! if it went missing). After five seconds (or four `wait`s) without a
//! message, `get` asks the server about the consumer; if it reports pending
//! messages that fetches do not return, or cannot be read, the binding is
//! re-created. Acks and naks lost with a connection are sent again after
//! the reconnect (see above). [`NatsTransport::close`] (or dropping the
//! last handle) gives back what was fetched ahead and flushes what is
//! queued before the connection closes.
//!
//! ## What an acknowledged send survives
//!
//! `send` returns once JetStream has stored the message (publish ack). With
//! the default `storage=file` it survives the client and the connection going
//! away and a server restart; `storage=memory` survives only the connection.
//! On a single server (replicas 1) it does not survive losing the server's
//! disk, and the server flushes to disk on its own schedule (`sync_interval`),
//! so an operating-system crash right after the ack can lose it. A publish
//! whose ack is lost is retried, which can store the message twice (at least
//! once); with `dedup=true` every publish carries a `Nats-Msg-Id` and the
//! retry reuses it, so JetStream's duplicate window (two minutes by default)
//! stores it once, at the price of the server checking and keeping every id.
//!
//! ## Performance notes
//!
//! * `send_batch` publishes every message (up to 5,000 at a time) before
//!   waiting for any ack, so a batch costs about one round trip.
//! * A publish is a plain request on the connection; only the stream sequence
//!   is read from JetStream's answer.
//! * `get` fetches up to `min(max, batch)` messages with one pull request,
//!   read off a plain subscription; a `get` of at least 100 that comes back
//!   full asks for the next batch before decoding this one.
//!   `wait_for_messages` returns at once after an empty `get`, which has
//!   already waited on the server.
//! * `dedup=true` costs publish throughput: the server looks up and keeps
//!   every `Nats-Msg-Id`, and every message carries one.
//! * Acks and naks are publishes on the shared connection, written out
//!   together; `ack_batch` waits for one answer from the server, on the
//!   last of them. With `double_ack=true` each ack is a request, answered
//!   concurrently within a batch. Keepalives are plain publishes (requests
//!   with `double_ack`).
//!
//! ```
//! use std::time::Duration;
//! use envoi_nats::NatsConfig;
//!
//! let config = NatsConfig::from_dsn("nats://127.0.0.1:4222?lease=1m&consumer=mailer").unwrap();
//! assert_eq!(config.consumer.as_deref(), Some("mailer"));
//! assert_eq!(config.lease, Duration::from_secs(60));
//! ```
//!
//! ```no_run
//! use envoi_core::transport::Transport;
//! use envoi_nats::NatsTransport;
//!
//! # async fn run() -> Result<(), envoi_core::TransportError> {
//! let emails = NatsTransport::connect("emails", "nats://127.0.0.1:4222?lease=1m").await?;
//! assert_eq!(emails.consumer(), "envoi-emails");
//! if let Some(teardown) = emails.as_teardown() {
//!     let purged = teardown.purge().await?;
//!     println!("{purged} messages purged");
//! }
//! emails.close().await?;
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]

mod auth;
mod browse;
pub mod config;
mod confirm;
pub mod factory;
mod fetch;
mod headers;
mod publish;
mod receive;
mod settle;
mod setup;
pub mod transport;

pub use config::{NatsConfig, Storage};
pub use factory::NatsTransportFactory;
pub use transport::NatsTransport;
