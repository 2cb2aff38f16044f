//! The [`Serializer`]: turns envelopes into
//! [`RawMessage`](crate::transport::RawMessage)s for a transport and back.
//!
//! The format is JSON:
//!
//! * the **body** is the message, as `serde_json` writes it;
//! * the `type` header holds the message's stable name ([`Message::NAME`]);
//! * the `kind` header holds `command`, `query` or `event`;
//! * one `X-Message-Stamp-<name>` header per stamp type holds a JSON array of
//!   that type's stamps, oldest first. Stamps that are not
//!   [sendable](crate::Stamp::SENDABLE) are dropped. Of the stamps the
//!   retry step and the worker add on every retry and park (`Redelivery`,
//!   `Delay`, `ErrorDetails`, `SentToFailureTransport`) and of the
//!   `DedupClaim` stamps deduplication adds on every attempt, only the newest
//!   [`STAMP_HISTORY`] of each type are written, so a message that keeps
//!   failing and coming back does not grow without bound;
//! * every [envelope header](crate::envelope::Envelope::header) is
//!   written as a header of its own. `type`, `kind`, the `X-Message-Stamp-`
//!   prefix, the two markers of a message that must not decode
//!   ([`INVALID_HEADERS_HEADER`], [`INVALID_BODY_HEADER`]) are reserved.
//!   Whether a message is a redelivery is not in its headers: its transport
//!   says so ([`Delivery::redelivered`](crate::transport::Delivery::redelivered)).
//!
//! # Registries
//!
//! Only **registered** message names decode: a `type` the serializer does
//! not know is an error ([`SerializationError::UnknownType`]), never a guess.
//! `MessengerBuilder::route` registers the
//! routed type; register types a process only receives with
//! `MessengerBuilder::message` or
//! [`SerializerBuilder::message`].
//!
//! Stamps decode through a registry as well. Every built-in sendable stamp is
//! registered; register your own with
//! `MessengerBuilder::stamp`. A stamp
//! header that names no registered stamp type is **kept verbatim** as an
//! [`OpaqueStamp`] and written back unchanged when the envelope is sent
//! again, so a process that does not know a stamp does not strip it from a
//! message another process relies on.
//!
//! # Limits and errors
//!
//! A body larger than [`max_body_size`](SerializerBuilder::max_body_size)
//! (16 MiB by default) fails with [`SerializationError::TooLarge`], both when
//! encoding and when decoding. Headers larger than
//! [`max_headers_size`](SerializerBuilder::max_headers_size) (1 MiB by
//! default; the bytes of every header name and value added up, stamp
//! headers included) fail with [`SerializationError::HeadersTooLarge`],
//! both when encoding and when decoding. A body that does not decode as the named type
//! fails with [`SerializationError::Malformed`], a bad stamp header with
//! [`SerializationError::MalformedStamp`]. Decoding never panics; the worker
//! moves what does not decode to the failure transport with the error.
//!
//! ```
//! use envoi_core::serializer::Serializer;
//! use envoi_core::stamp::DelayStamp;
//! use envoi_core::{Envelope, Message};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
//! struct SendInvoice { id: u32 }
//! impl Message for SendInvoice { const NAME: &'static str = "SendInvoice"; }
//!
//! let serializer = Serializer::builder().message::<SendInvoice>().build().unwrap();
//! let raw = serializer
//!     .encode(&Envelope::new(SendInvoice { id: 7 }).with(DelayStamp { ms: 500 }))
//!     .unwrap();
//! assert_eq!(raw.header("type"), Some("SendInvoice"));
//! assert_eq!(raw.header("X-Message-Stamp-Delay"), Some(r#"[{"ms":500}]"#));
//! assert_eq!(raw.body, br#"{"id":7}"#);
//!
//! let back = serializer.decode(&raw).unwrap();
//! assert_eq!(back.message::<SendInvoice>(), Some(&SendInvoice { id: 7 }));
//! assert_eq!(back.last::<DelayStamp>().unwrap().ms, 500);
//! ```

mod bus_names;
mod codec;
mod decode;
mod encode;
mod registry;

use std::any::TypeId;
use std::fmt;
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};

use crate::envelope::headers::Headers;
use crate::envelope::message::Message;
use crate::envelope::stamp::{
    DelayStamp, ErrorDetailsStamp, RedeliveryStamp, SentToFailureTransportStamp, Stamp,
};
use crate::envelope::type_map::TypeMap;
use crate::error::SerializationError;
use crate::middleware::dedup::DedupClaimStamp;

use codec::{MessageCodec, StampDecodeFn};
use registry::NameMap;
pub use registry::{RegistryError, SerializerBuilder};

/// The header holding the message's stable name.
pub const TYPE_HEADER: &str = "type";
/// The header holding the message's kind (`command`, `query`, `event`).
pub const KIND_HEADER: &str = "kind";
/// The prefix of the headers holding stamps: `X-Message-Stamp-<name>`.
pub const STAMP_HEADER_PREFIX: &str = "X-Message-Stamp-";
/// How many stamps of each retry-history type (`Redelivery`, `Delay`,
/// `ErrorDetails`, `SentToFailureTransport`, `DedupClaim`) a message keeps
/// on the wire: the newest ones. Enough for the longest delay of a message
/// parked again and again (an hour, reached after 13 parks).
pub const STAMP_HISTORY: usize = 16;

/// Whether stamps named `name` are retry history, of which only the newest
/// [`STAMP_HISTORY`] cross the wire.
pub(crate) fn is_history(name: &str) -> bool {
    name == RedeliveryStamp::NAME
        || name == DelayStamp::NAME
        || name == ErrorDetailsStamp::NAME
        || name == SentToFailureTransportStamp::NAME
        || name == DedupClaimStamp::NAME
}

/// The default limit of a body's size: 16 MiB.
pub const DEFAULT_MAX_BODY_SIZE: usize = 16 * 1024 * 1024;
/// The default limit of a message's headers, names and values added up
/// (stamp headers included): 1 MiB.
pub const DEFAULT_MAX_HEADERS_SIZE: usize = 1024 * 1024;
/// The header a transport sets on a message whose stored headers it could
/// not read as they should be, saying what was wrong: the message does not
/// decode (the error names this header and its text), so the worker parks
/// it with the reason instead of handling what was recovered of it.
pub const INVALID_HEADERS_HEADER: &str = "X-Envoi-Invalid-Headers";
/// The header a transport sets on a message whose stored body it could not
/// read as it should be, saying what was wrong; the message does not
/// decode, like one with [`INVALID_HEADERS_HEADER`].
pub const INVALID_BODY_HEADER: &str = "X-Envoi-Invalid-Body";

/// A stamp header that named no registered stamp type, kept verbatim.
///
/// The serializer writes it back as the header it came from, so a message
/// passing through a process that does not know one of its stamps keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpaqueStamp {
    /// The stamp's wire name (the header without `X-Message-Stamp-`).
    pub name: String,
    /// The header's value, unparsed.
    pub value: String,
}

impl Stamp for OpaqueStamp {
    const NAME: &'static str = "Opaque";
}

/// Encodes envelopes as JSON [`RawMessage`](crate::transport::RawMessage)s
/// and decodes them back; see the [module documentation](self). Cheap to
/// clone.
#[derive(Clone)]
pub struct Serializer {
    inner: Arc<Inner>,
}

impl Default for Serializer {
    /// A serializer with the built-in stamps and no message types.
    fn default() -> Self {
        SerializerBuilder::default()
            .build()
            .unwrap_or_else(|_| unreachable!("the built-in stamps have distinct names"))
    }
}

impl fmt::Debug for Serializer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Serializer")
            .field("messages", &self.message_names())
            .field("max_body_size", &self.inner.max_body_size)
            .field("max_headers_size", &self.inner.max_headers_size)
            .finish_non_exhaustive()
    }
}

impl Serializer {
    /// Starts a configuration with the built-in stamps registered.
    pub fn builder() -> SerializerBuilder {
        SerializerBuilder::default()
    }

    /// The registered message names, sorted.
    pub fn message_names(&self) -> Vec<&'static str> {
        let mut names: Vec<_> = self.inner.by_name.keys().copied().collect();
        names.sort_unstable();
        names
    }

    /// Whether a message named `name` decodes.
    pub fn is_registered(&self, name: &str) -> bool {
        self.inner.by_name.contains_key(name)
    }

    /// Whether messages of type `M` can be encoded.
    pub fn can_encode<M: Message>(&self) -> bool {
        self.inner.by_type.contains_key(&TypeId::of::<M>())
    }

    /// The body size limit in bytes.
    pub fn max_body_size(&self) -> usize {
        self.inner.max_body_size
    }

    /// The headers size limit in bytes (names and values added up).
    pub fn max_headers_size(&self) -> usize {
        self.inner.max_headers_size
    }

    /// Fails when `headers` are over the headers size limit.
    fn check_headers_size(&self, headers: &Headers) -> Result<(), SerializationError> {
        let size = headers.encoded_size();
        if size > self.inner.max_headers_size {
            return Err(SerializationError::HeadersTooLarge {
                size,
                limit: self.inner.max_headers_size,
            });
        }
        Ok(())
    }
}

/// What a [`Serializer`] was built with: its registries by name and by
/// type, its limits, and the bus names it shares.
struct Inner {
    by_name: NameMap<MessageCodec>,
    by_type: TypeMap<(&'static str, MessageCodec)>,
    stamps: NameMap<StampDecodeFn>,
    max_body_size: usize,
    max_headers_size: usize,
    /// The bus names read or written so far, each with its `BusName` stamp
    /// header: shared by the stamps and messages naming that bus.
    buses: RwLock<Vec<(&'static str, &'static str)>>,
}

impl SerializationError {
    /// A short, stable classification for error-details stamps and metrics:
    /// `unknown_type`, `missing_header`, `malformed`, `malformed_stamp`,
    /// `invalid_header`, `too_large`, `headers_too_large`, `not_registered`
    /// or `encode`.
    pub fn kind(&self) -> &'static str {
        match self {
            SerializationError::UnknownType(_) => "unknown_type",
            SerializationError::MissingHeader(_) => "missing_header",
            SerializationError::Malformed { .. } => "malformed",
            SerializationError::MalformedStamp { .. } => "malformed_stamp",
            SerializationError::InvalidHeader { .. } => "invalid_header",
            SerializationError::TooLarge { .. } => "too_large",
            SerializationError::HeadersTooLarge { .. } => "headers_too_large",
            SerializationError::NotRegistered(_) => "not_registered",
            SerializationError::Encode { .. } => "encode",
        }
    }
}

/// The messages the tests of the serializer encode and decode.
#[cfg(test)]
mod fixtures {
    use serde::{Deserialize, Serialize};

    use super::Serializer;
    use crate::envelope::message::Message;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub(super) struct Order {
        pub(super) id: u32,
        pub(super) sku: String,
    }
    impl Message for Order {
        const NAME: &'static str = "Order";
    }

    pub(super) fn serializer() -> Serializer {
        Serializer::builder().message::<Order>().build().unwrap()
    }

    pub(super) fn order() -> Order {
        Order {
            id: 1,
            sku: "A-1".into(),
        }
    }
}
