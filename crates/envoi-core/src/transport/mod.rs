//! How messages leave a process and come back.
//!
//! A [`Transport`] stores [`RawMessage`]s (a body and string headers); the
//! [`Serializer`](serializer::Serializer) turns envelopes into raw messages
//! and back. Keeping transports byte-level means a message that cannot be
//! decoded (unknown type, malformed body) is still a [`Delivery`] the
//! worker can move to the failure transport with the reason, instead of an
//! error that loses it.
//!
//! A transport is its sending side ([`Transport::send`]) and the abilities
//! it has beside it, each a small trait handed out by an `as_*` method of
//! [`Transport`]: a [`Receiver`] (get, ack, ack batch, reject, release) for
//! a transport a worker can consume, and [`Keepalive`], [`Setup`],
//! [`MessageCount`], [`Browse`], [`Teardown`] and [`WakeUp`] for what it
//! can do beyond
//! that. Transports that live in the process (in-memory, sync) also move
//! envelopes without encoding them ([`LocalSender`], [`LocalReceiver`]).
//!
//! A [`Sender`] is the envelope-level view the send step uses; a
//! [`SenderDispatcher`] decides how a send happens (now, or after a
//! database transaction commits).
//!
//! Register transports with the messenger's builder
//! (`MessengerBuilder::transport`, or by DSN with `transport_dsn` and a
//! [`TransportFactory`]); the messenger then sends to them through
//! [`TransportSender`](registry::TransportSender)s, hands them out by name
//! and calls [`Transport::bind`] on each. A worker consumes them.
//!
//! What several transport crates need is written once in [`support`].

mod abilities;
mod binding;
mod factory;
mod local;
mod raw;
mod sender;
mod sides;

pub mod in_memory;
pub mod registry;
pub mod serializer;
pub mod support;
pub mod sync;

pub use crate::envelope::local_id::LocalId;
pub use abilities::{Browse, Keepalive, MessageCount, Setup, Teardown, WakeUp};
pub use binding::{Inbox, TransportBinding};
pub use factory::TransportFactory;
pub(crate) use local::handles_on_send;
pub use local::{LocalDelivery, LocalFuture, LocalReceiver, LocalSender, Payload};
pub use raw::{Delivery, DeliveryId, RawMessage};
pub use sender::{SendError, Sender, SenderDispatcher};
pub use sides::{Receiver, Transport, TransportDescription};
pub(crate) use support::dsn::strip_scheme;
pub use support::dsn::{dsn_has_scheme, mask_dsn, parse_duration};
