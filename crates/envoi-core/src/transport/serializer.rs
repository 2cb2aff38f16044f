//! The [`Serializer`]: turns envelopes into [`RawMessage`]s for a transport
//! and back.
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
//! * every [envelope header](Envelope::header) is written as a header of its
//!   own. `type`, `kind`, the `X-Message-Stamp-` prefix, the two
//!   markers of a message that must not decode
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

use std::any::TypeId;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::marker::PhantomData;
use std::sync::{Arc, PoisonError, RwLock};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::envelope::headers::{Headers, BUS_NAME_HEADER};
use crate::envelope::message::{Message, MessageKind};
use crate::envelope::stamp::{
    BusNameStamp, DelayStamp, ErasedStamp, ErrorDetailsStamp, HandledStamp, MessageIdStamp,
    RedeliveryStamp, SentToFailureTransportStamp, Stamp, UnsentStamp,
};
use crate::envelope::type_map::TypeMap;
use crate::envelope::Envelope;
use crate::error::SerializationError;
use crate::middleware::correlation::{CausationIdStamp, CorrelationIdStamp};
use crate::middleware::dedup::DedupClaimStamp;
use crate::transport::RawMessage;

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

/// FNV-1a, for the registries keyed by wire names: they are short, and only
/// names the program registered are ever stored, so a key that came off
/// the wire can only miss.
#[derive(Default)]
struct NameHasher(u64);

impl Hasher for NameHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut hash = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for b in bytes {
            hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = hash;
    }
}

type NameMap<V> = HashMap<&'static str, V, BuildHasherDefault<NameHasher>>;

/// Most distinct bus names a serializer keeps to share between the
/// [`BusNameStamp`]s it decodes.
const BUS_NAMES: usize = 32;

type EncodeFn = fn(&Envelope) -> Option<Result<Vec<u8>, serde_json::Error>>;
type DecodeFn = fn(&[u8], MessageKind) -> Result<Envelope, serde_json::Error>;
type StampDecodeFn = fn(Envelope, &str) -> Result<Envelope, serde_json::Error>;

#[derive(Clone, Copy)]
struct MessageCodec {
    type_id: TypeId,
    encode: EncodeFn,
    decode: DecodeFn,
}

fn encode_message<M: Message + Serialize>(
    envelope: &Envelope,
) -> Option<Result<Vec<u8>, serde_json::Error>> {
    envelope.message::<M>().map(serde_json::to_vec)
}

fn decode_message<M: Message + DeserializeOwned>(
    body: &[u8],
    kind: MessageKind,
) -> Result<Envelope, serde_json::Error> {
    let message: M = serde_json::from_slice(body)?;
    Ok(Envelope::with_kind(message, kind))
}

/// Decodes a stamp header (a JSON array of `S`) onto `envelope`, each
/// element added as it is parsed: no intermediate vector.
fn decode_stamps<S: Stamp>(envelope: Envelope, json: &str) -> Result<Envelope, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(json);
    let envelope = serde::de::DeserializeSeed::deserialize(
        StampSeq::<S> {
            envelope,
            stamp: PhantomData,
        },
        &mut de,
    )?;
    de.end()?;
    Ok(envelope)
}

/// Deserializes a JSON array of stamps `S` straight onto an envelope.
struct StampSeq<S> {
    envelope: Envelope,
    stamp: PhantomData<fn() -> S>,
}

impl<'de, S: Stamp> serde::de::DeserializeSeed<'de> for StampSeq<S> {
    type Value = Envelope;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Envelope, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, S: Stamp> serde::de::Visitor<'de> for StampSeq<S> {
    type Value = Envelope;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a JSON array of `{}` stamps", S::NAME)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Envelope, A::Error> {
        let mut envelope = self.envelope;
        while let Some(stamp) = seq.next_element::<S>()? {
            envelope = envelope.with(stamp);
        }
        Ok(envelope)
    }
}

/// Two types registered under one wire name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Two message types share a [`Message::NAME`].
    #[error("two message types are registered under the name `{0}`")]
    DuplicateMessageName(&'static str),
    /// Two stamp types share a [`Stamp::NAME`].
    #[error("two stamp types are registered under the name `{0}`")]
    DuplicateStampName(&'static str),
}

/// Configures a [`Serializer`]; see [`Serializer::builder`].
#[must_use = "a builder does nothing until `build` is called"]
#[derive(Clone)]
pub struct SerializerBuilder {
    messages: NameMap<MessageCodec>,
    stamps: NameMap<(TypeId, StampDecodeFn)>,
    errors: Vec<RegistryError>,
    max_body_size: usize,
    max_headers_size: usize,
}

impl Default for SerializerBuilder {
    fn default() -> Self {
        let builder = Self {
            messages: NameMap::default(),
            stamps: NameMap::default(),
            errors: Vec::new(),
            max_body_size: DEFAULT_MAX_BODY_SIZE,
            max_headers_size: DEFAULT_MAX_HEADERS_SIZE,
        };
        builder
            .stamp::<BusNameStamp>()
            .stamp::<HandledStamp>()
            .stamp::<RedeliveryStamp>()
            .stamp::<DelayStamp>()
            .stamp::<ErrorDetailsStamp>()
            .stamp::<SentToFailureTransportStamp>()
            .stamp::<UnsentStamp>()
            .stamp::<MessageIdStamp>()
            .stamp::<CorrelationIdStamp>()
            .stamp::<CausationIdStamp>()
            .stamp::<DedupClaimStamp>()
    }
}

impl fmt::Debug for SerializerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut messages: Vec<_> = self.messages.keys().collect();
        messages.sort();
        f.debug_struct("SerializerBuilder")
            .field("messages", &messages)
            .field("max_body_size", &self.max_body_size)
            .field("max_headers_size", &self.max_headers_size)
            .finish_non_exhaustive()
    }
}

impl SerializerBuilder {
    /// Registers message type `M` under [`Message::NAME`], for encoding and
    /// decoding. Registering a type twice is harmless; two types with one
    /// name make [`build`](Self::build) fail.
    pub fn message<M>(mut self) -> Self
    where
        M: Message + Serialize + DeserializeOwned,
    {
        self.add_message::<M>();
        self
    }

    pub(crate) fn add_message<M>(&mut self)
    where
        M: Message + Serialize + DeserializeOwned,
    {
        let codec = MessageCodec {
            type_id: TypeId::of::<M>(),
            encode: encode_message::<M>,
            decode: decode_message::<M>,
        };
        match self.messages.get(M::NAME) {
            Some(existing) if existing.type_id != codec.type_id => self
                .errors
                .push(RegistryError::DuplicateMessageName(M::NAME)),
            Some(_) => {}
            None => {
                self.messages.insert(M::NAME, codec);
            }
        }
    }

    /// Registers stamp type `S` so its header decodes to `S` rather than to
    /// an [`OpaqueStamp`]. The built-in sendable stamps are registered
    /// already.
    pub fn stamp<S: Stamp>(mut self) -> Self {
        self.add_stamp::<S>();
        self
    }

    pub(crate) fn add_stamp<S: Stamp>(&mut self) {
        let id = TypeId::of::<S>();
        match self.stamps.get(S::NAME) {
            Some((existing, _)) if *existing != id => {
                self.errors.push(RegistryError::DuplicateStampName(S::NAME))
            }
            Some(_) => {}
            None => {
                self.stamps.insert(S::NAME, (id, decode_stamps::<S>));
            }
        }
    }

    /// Limits the size of a body, in bytes (16 MiB by default).
    pub fn max_body_size(mut self, bytes: usize) -> Self {
        self.max_body_size = bytes;
        self
    }

    pub(crate) fn set_max_body_size(&mut self, bytes: usize) {
        self.max_body_size = bytes;
    }

    /// Limits the size of a message's headers, in bytes: every header name
    /// and value added up, stamp headers included (1 MiB by default).
    pub fn max_headers_size(mut self, bytes: usize) -> Self {
        self.max_headers_size = bytes;
        self
    }

    pub(crate) fn set_max_headers_size(&mut self, bytes: usize) {
        self.max_headers_size = bytes;
    }

    /// Builds the serializer; fails when two types share a wire name.
    pub fn build(self) -> Result<Serializer, RegistryError> {
        if let Some(e) = self.errors.into_iter().next() {
            return Err(e);
        }
        let by_type = self
            .messages
            .iter()
            .map(|(name, codec)| (codec.type_id, (*name, *codec)))
            .collect();
        Ok(Serializer {
            inner: Arc::new(Inner {
                by_name: self.messages,
                by_type,
                stamps: self
                    .stamps
                    .into_iter()
                    .map(|(name, (_, decode))| (name, decode))
                    .collect(),
                max_body_size: self.max_body_size,
                max_headers_size: self.max_headers_size,
                buses: RwLock::new(Vec::new()),
            }),
        })
    }
}

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

impl Inner {
    /// Bus `name` as a shared `'static` string, with the `BusName` stamp
    /// header of a message whose one bus-name stamp names it,
    /// `[{"bus":"<name>"}]`: kept on first use, for decoding and encoding
    /// alike. `None` for a name JSON would escape, and past the first
    /// [`BUS_NAMES`] names.
    fn known_bus(&self, name: &str) -> Option<(&'static str, &'static str)> {
        let known = |buses: &[(&'static str, &'static str)]| {
            buses.iter().find(|(n, _)| *n == name).copied()
        };
        if let Some(bus) = known(&self.buses.read().unwrap_or_else(PoisonError::into_inner)) {
            return Some(bus);
        }
        if !is_plain(name) {
            return None;
        }
        let mut buses = self.buses.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(bus) = known(&buses) {
            return Some(bus);
        }
        if buses.len() >= BUS_NAMES {
            return None;
        }
        let shared = crate::envelope::stamp::intern_bus_name(name);
        let header: &'static str = Box::leak(format!(r#"[{{"bus":"{name}"}}]"#).into_boxed_str());
        buses.push((shared, header));
        Some((shared, header))
    }

    /// The bus of a `BusName` stamp header holding one plain stamp,
    /// `[{"bus":"<name>"}]` (what the serializer writes); `None` for
    /// anything else, which then goes through the stamp's `Deserialize`.
    fn plain_bus_name(json: &str) -> Option<&str> {
        let name = json.strip_prefix(r#"[{"bus":""#)?.strip_suffix(r#""}]"#)?;
        is_plain(name).then_some(name)
    }
}

/// Whether JSON writes `text` as it is, with no escapes.
fn is_plain(text: &str) -> bool {
    !text.contains(['"', '\\']) && !text.chars().any(char::is_control)
}

/// Encodes envelopes as JSON [`RawMessage`]s and decodes them back; see the
/// [module documentation](self). Cheap to clone.
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

    /// Encodes `envelope`: the message as the body, its kind, type, sendable
    /// stamps and headers as headers.
    pub fn encode(&self, envelope: &Envelope) -> Result<RawMessage, SerializationError> {
        let name = envelope.message_name();
        let Some((_, codec)) = self.inner.by_type.get(&envelope.message_type_id()) else {
            return Err(SerializationError::NotRegistered(name));
        };
        let body = match (codec.encode)(envelope) {
            Some(Ok(body)) => body,
            Some(Err(source)) => {
                return Err(SerializationError::Encode {
                    message: name,
                    source,
                })
            }
            None => return Err(SerializationError::NotRegistered(name)),
        };
        if body.len() > self.inner.max_body_size {
            return Err(SerializationError::TooLarge {
                size: body.len(),
                limit: self.inner.max_body_size,
            });
        }
        // Room for every header at once: the two fixed ones, the envelope's,
        // and at most one per stamp.
        let mut headers =
            Headers::with_capacity(2 + envelope.headers().count() + envelope.stamp_count());
        for (key, value) in envelope.headers() {
            if is_reserved(key) {
                return Err(SerializationError::InvalidHeader {
                    header: key.to_string(),
                    reason: "the name is reserved by the serializer".into(),
                });
            }
            headers.insert(key.to_string(), value.to_string());
        }
        // Stamp headers (`X-…`) sort before `kind`, which sorts before
        // `type`: added in that order, each header goes at the end.
        encode_stamps(&self.inner, envelope, &mut headers)?;
        headers.insert(KIND_HEADER, envelope.kind().as_str());
        headers.insert(TYPE_HEADER, name);
        self.check_headers_size(&headers)?;
        Ok(RawMessage { body, headers })
    }

    /// Decodes `raw` back into an envelope. Fails, without panicking, when
    /// the body or the headers are too large, the type is missing or
    /// unknown, the body does not decode as that type, or a header is
    /// malformed.
    pub fn decode(&self, raw: &RawMessage) -> Result<Envelope, SerializationError> {
        if raw.body.len() > self.inner.max_body_size {
            return Err(SerializationError::TooLarge {
                size: raw.body.len(),
                limit: self.inner.max_body_size,
            });
        }
        self.check_headers_size(&raw.headers)?;
        for marker in [INVALID_HEADERS_HEADER, INVALID_BODY_HEADER] {
            if let Some(reason) = raw.header(marker) {
                return Err(SerializationError::InvalidHeader {
                    header: marker.into(),
                    reason: reason.to_string(),
                });
            }
        }
        let Some(name) = raw.header(TYPE_HEADER) else {
            return Err(SerializationError::MissingHeader(TYPE_HEADER));
        };
        let Some(codec) = self.inner.by_name.get(name) else {
            return Err(SerializationError::UnknownType(name.to_string()));
        };
        let kind = match raw.header(KIND_HEADER) {
            None => MessageKind::Command,
            Some(k) => MessageKind::parse(k).ok_or_else(|| SerializationError::InvalidHeader {
                header: KIND_HEADER.into(),
                reason: format!("`{k}` is not one of command, query, event"),
            })?,
        };
        let mut envelope =
            (codec.decode)(&raw.body, kind).map_err(|source| SerializationError::Malformed {
                message: name.to_string(),
                source,
            })?;
        for (key, value) in &raw.headers {
            if key == TYPE_HEADER || key == KIND_HEADER {
                continue;
            }
            let Some(stamp) = key.strip_prefix(STAMP_HEADER_PREFIX) else {
                envelope = envelope.with_header(key, value);
                continue;
            };
            if stamp == BusNameStamp::NAME {
                if let Some(bus) = Inner::plain_bus_name(value) {
                    let bus = match self.inner.known_bus(bus) {
                        Some((shared, _)) => Cow::Borrowed(shared),
                        None => Cow::Owned(bus.to_owned()),
                    };
                    envelope = envelope.with(BusNameStamp::new(bus));
                    continue;
                }
            }
            envelope = match self.inner.stamps.get(stamp) {
                Some(decode) => {
                    decode(envelope, value).map_err(|e| SerializationError::MalformedStamp {
                        header: key.to_string(),
                        reason: e.to_string(),
                    })?
                }
                None => envelope.with(OpaqueStamp {
                    name: stamp.to_string(),
                    value: value.to_string(),
                }),
            };
        }
        Ok(envelope)
    }
}

fn is_reserved(header: &str) -> bool {
    header == TYPE_HEADER
        || header == KIND_HEADER
        || header.starts_with(STAMP_HEADER_PREFIX)
        || header == INVALID_HEADERS_HEADER
        || header == INVALID_BODY_HEADER
}

/// Groups the sendable stamps by name, keeping each type's order, and writes
/// one JSON array header per name, in order of first appearance.
///
/// Each group is written straight into the buffer that becomes the header's
/// value: no intermediate `serde_json::Value`s or strings for the stamps the
/// serializer knows to write directly (see [`write_stamp`]).
fn encode_stamps(
    inner: &Inner,
    envelope: &Envelope,
    headers: &mut Headers,
) -> Result<(), SerializationError> {
    let mut opaque = false;
    for (index, stamp) in envelope.stamps().enumerate() {
        if !stamp.sendable() {
            continue;
        }
        if stamp.as_any().is::<OpaqueStamp>() {
            opaque = true;
            continue;
        }
        let name = stamp.name();
        // Written with the first stamp of its name, together with the rest.
        if envelope
            .stamps()
            .take(index)
            .any(|s| s.sendable() && s.name() == name && !s.as_any().is::<OpaqueStamp>())
        {
            continue;
        }
        // The bus-name stamp every dispatched message carries, alone under
        // its name: its header is written once per bus and then shared.
        if let Some(bus) = stamp.as_any().downcast_ref::<BusNameStamp>() {
            let alone = !envelope
                .stamps()
                .skip(index + 1)
                .any(|s| s.sendable() && s.name() == name);
            if let Some((_, value)) = alone.then(|| inner.known_bus(&bus.bus)).flatten() {
                headers.insert(BUS_NAME_HEADER, value);
                continue;
            }
        }
        let same = |s: &&dyn ErasedStamp| {
            s.sendable() && s.name() == name && !s.as_any().is::<OpaqueStamp>()
        };
        let group = || std::iter::once(stamp).chain(envelope.stamps().skip(index + 1).filter(same));
        // Retry history: only the newest stamps.
        let skip = if is_history(name) {
            group().count().saturating_sub(STAMP_HISTORY)
        } else {
            0
        };
        let mut json = Vec::with_capacity(32);
        json.push(b'[');
        for (i, stamp) in group().skip(skip).enumerate() {
            if i > 0 {
                json.push(b',');
            }
            write_stamp(stamp, &mut json)?;
        }
        json.push(b']');
        let json = String::from_utf8(json).map_err(|_| SerializationError::InvalidHeader {
            header: stamp_header(name),
            reason: "the stamp did not serialize to UTF-8 JSON".into(),
        })?;
        headers.insert(stamp_header(name), json);
    }
    if !opaque {
        return Ok(());
    }
    for o in envelope
        .stamps()
        .filter_map(|s| s.as_any().downcast_ref::<OpaqueStamp>())
    {
        let key = stamp_header(&o.name);
        // The same name twice: merge the arrays when both are arrays,
        // otherwise keep what is there and append the opaque value.
        let value = match headers.get(&key) {
            None => o.value.clone(),
            Some(existing) => merge_arrays(existing, &o.value),
        };
        headers.insert(key, value);
    }
    Ok(())
}

/// `X-Message-Stamp-<name>`.
fn stamp_header(name: &str) -> String {
    let mut key = String::with_capacity(STAMP_HEADER_PREFIX.len() + name.len());
    key.push_str(STAMP_HEADER_PREFIX);
    key.push_str(name);
    key
}

/// Writes `stamp` as JSON to `out`.
///
/// The wire format is the stamp as a `serde_json::Value` writes it, whose
/// objects have their keys sorted. The built-in stamps with at most one
/// field serialize to exactly that directly, so they are written without
/// the intermediate value; every other stamp goes through
/// [`ErasedStamp::to_json`].
fn write_stamp(stamp: &dyn ErasedStamp, out: &mut Vec<u8>) -> Result<(), SerializationError> {
    fn direct<S: Serialize + 'static>(
        stamp: &dyn ErasedStamp,
        out: &mut Vec<u8>,
    ) -> Option<Result<(), serde_json::Error>> {
        let s = stamp.as_any().downcast_ref::<S>()?;
        Some(serde_json::to_writer(out, s))
    }
    let written = direct::<BusNameStamp>(stamp, out)
        .or_else(|| direct::<HandledStamp>(stamp, out))
        .or_else(|| direct::<MessageIdStamp>(stamp, out))
        .or_else(|| direct::<CorrelationIdStamp>(stamp, out))
        .or_else(|| direct::<CausationIdStamp>(stamp, out))
        .or_else(|| direct::<DelayStamp>(stamp, out))
        .or_else(|| direct::<SentToFailureTransportStamp>(stamp, out));
    let written = match written {
        Some(written) => written,
        None => serde_json::to_writer(out, &stamp_json(stamp)?),
    };
    written.map_err(|e| SerializationError::Encode {
        message: "stamp",
        source: e,
    })
}

fn stamp_json(stamp: &dyn ErasedStamp) -> Result<serde_json::Value, SerializationError> {
    stamp
        .to_json()
        .ok_or_else(|| SerializationError::InvalidHeader {
            header: stamp_header(stamp.name()),
            reason: "the stamp did not serialize to JSON".into(),
        })
}

fn merge_arrays(first: &str, second: &str) -> String {
    let a: Result<Vec<serde_json::Value>, _> = serde_json::from_str(first);
    let b: Result<Vec<serde_json::Value>, _> = serde_json::from_str(second);
    match (a, b) {
        (Ok(mut a), Ok(b)) => {
            a.extend(b);
            serde_json::to_string(&a).unwrap_or_else(|_| first.to_string())
        }
        _ => format!("[{first},{second}]"),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::stamp::RedeliveredStamp;
    use crate::envelope::stamp::{ReceivedStamp, SentStamp};

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Order {
        id: u32,
        sku: String,
    }
    impl Message for Order {
        const NAME: &'static str = "Order";
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct OtherOrder;
    impl Message for OtherOrder {
        const NAME: &'static str = "Order";
    }

    fn serializer() -> Serializer {
        Serializer::builder().message::<Order>().build().unwrap()
    }

    fn order() -> Order {
        Order {
            id: 1,
            sku: "A-1".into(),
        }
    }

    #[test]
    fn two_types_with_one_name_do_not_build() {
        let e = Serializer::builder()
            .message::<Order>()
            .message::<OtherOrder>()
            .build()
            .unwrap_err();
        assert_eq!(e, RegistryError::DuplicateMessageName("Order"));
    }

    #[test]
    fn the_kind_travels_and_defaults_to_command() {
        let s = serializer();
        let raw = s.encode(&Envelope::event(order())).unwrap();
        assert_eq!(raw.header(KIND_HEADER), Some("event"));
        assert_eq!(s.decode(&raw).unwrap().kind(), MessageKind::Event);
        let mut raw = raw;
        raw.headers.remove(KIND_HEADER);
        assert_eq!(s.decode(&raw).unwrap().kind(), MessageKind::Command);
        raw.headers.insert(KIND_HEADER, "rumour");
        assert!(matches!(
            s.decode(&raw),
            Err(SerializationError::InvalidHeader { .. })
        ));
    }

    #[test]
    fn a_message_a_transport_marked_as_misread_does_not_decode_however_good_the_rest() {
        let s = serializer();
        for marker in [INVALID_HEADERS_HEADER, INVALID_BODY_HEADER] {
            let mut raw = s.encode(&Envelope::new(order())).unwrap();
            assert!(s.decode(&raw).is_ok());
            raw.headers
                .insert(marker, "headers stored as BLOB, not TEXT");
            match s.decode(&raw) {
                Err(SerializationError::InvalidHeader { header, reason }) => {
                    assert_eq!(header, marker);
                    assert_eq!(reason, "headers stored as BLOB, not TEXT");
                }
                other => panic!("{marker}: expected InvalidHeader, got {other:?}"),
            }
        }
    }

    #[test]
    fn unregistered_messages_do_not_encode() {
        let e = Serializer::default()
            .encode(&Envelope::new(order()))
            .unwrap_err();
        assert!(matches!(e, SerializationError::NotRegistered("Order")));
    }

    #[test]
    fn non_sendable_stamps_are_dropped() {
        let raw = serializer()
            .encode(
                &Envelope::new(order())
                    .with(ReceivedStamp::new("async"))
                    .with(SentStamp::new("async")),
            )
            .unwrap();
        assert!(raw
            .headers
            .keys()
            .all(|k| !k.starts_with(STAMP_HEADER_PREFIX)));
    }

    #[test]
    fn reserved_envelope_headers_are_refused() {
        let e = serializer()
            .encode(&Envelope::new(order()).with_header("type", "x"))
            .unwrap_err();
        assert_eq!(e.kind(), "invalid_header");
        // The markers of a message that must not decode: a header of that
        // name would make this one undecodable.
        for marker in [INVALID_HEADERS_HEADER, INVALID_BODY_HEADER] {
            let e = serializer()
                .encode(&Envelope::new(order()).with_header(marker, "x"))
                .unwrap_err();
            assert_eq!(e.kind(), "invalid_header", "{marker}");
        }
    }

    #[test]
    fn a_redelivered_stamp_is_never_sent_and_no_stored_header_makes_one() {
        let plain = serializer().encode(&Envelope::new(order())).unwrap();
        let marked = serializer()
            .encode(&Envelope::new(order()).with(RedeliveredStamp::new()))
            .unwrap();
        assert_eq!(marked, plain, "the mark is the transport's: it is not sent");
        let mut forged = plain.clone();
        forged.headers.insert("X-Envoi-Redelivered", "true");
        let back = serializer().decode(&forged).unwrap();
        assert!(!back.has::<RedeliveredStamp>(), "only a transport marks it");
    }

    #[test]
    fn a_missing_type_header_is_reported() {
        let raw = RawMessage {
            body: b"{}".to_vec(),
            headers: Headers::new(),
        };
        assert!(matches!(
            serializer().decode(&raw),
            Err(SerializationError::MissingHeader("type"))
        ));
    }

    /// The stamps `write_stamp` writes directly must come out exactly as
    /// through `serde_json::Value` (sorted keys), the wire format.
    #[test]
    fn stamps_written_directly_match_their_json_value() {
        let id = uuid::Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
        let stamps: Vec<Box<dyn ErasedStamp>> = vec![
            Box::new(BusNameStamp::new("command.bus")),
            Box::new(HandledStamp::new("h \"q\"", Default::default())),
            Box::new(MessageIdStamp { id }),
            Box::new(CorrelationIdStamp { id }),
            Box::new(CausationIdStamp { id }),
            Box::new(DelayStamp { ms: 1500 }),
            Box::new(SentToFailureTransportStamp {
                original_transport: "async".into(),
            }),
            Box::new(RedeliveryStamp {
                retry_count: 2,
                at: 7,
            }),
            Box::new(ErrorDetailsStamp {
                kind: "k".into(),
                message: "m".into(),
                chain: vec!["c".into()],
            }),
        ];
        for stamp in stamps {
            let mut out = Vec::new();
            write_stamp(&*stamp, &mut out).unwrap();
            let expected = serde_json::to_string(&stamp.to_json().unwrap()).unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), expected, "{stamp:?}");
        }
    }

    #[test]
    fn stamps_of_one_name_are_grouped_in_order_of_first_appearance() {
        let raw = serializer()
            .encode(
                &Envelope::new(order())
                    .with(DelayStamp { ms: 1 })
                    .with(BusNameStamp::new("b"))
                    .with(ReceivedStamp::new("async"))
                    .with(DelayStamp { ms: 2 })
                    .with(RedeliveryStamp {
                        retry_count: 1,
                        at: 3,
                    }),
            )
            .unwrap();
        assert_eq!(
            raw.header("X-Message-Stamp-Delay"),
            Some(r#"[{"ms":1},{"ms":2}]"#)
        );
        assert_eq!(
            raw.header("X-Message-Stamp-BusName"),
            Some(r#"[{"bus":"b"}]"#)
        );
        assert_eq!(
            raw.header("X-Message-Stamp-Redelivery"),
            Some(r#"[{"at":3,"retry_count":1}]"#)
        );
        let back = serializer().decode(&raw).unwrap();
        let delays: Vec<u64> = back.all::<DelayStamp>().map(|d| d.ms).collect();
        assert_eq!(delays, [1, 2]);
    }

    #[test]
    fn only_the_newest_retry_history_stamps_are_written() {
        let mut e = Envelope::new(order());
        for n in 0..40u64 {
            e = e
                .with(DelayStamp { ms: n })
                .with(HandledStamp::new(format!("h{n}"), Default::default()));
        }
        let back = serializer()
            .decode(&serializer().encode(&e).unwrap())
            .unwrap();
        let delays: Vec<u64> = back.all::<DelayStamp>().map(|d| d.ms).collect();
        assert_eq!(delays, (40 - STAMP_HISTORY as u64..40).collect::<Vec<_>>());
        // Other stamps are all kept.
        assert_eq!(back.all::<HandledStamp>().count(), 40);
    }

    #[test]
    fn only_the_newest_dedup_claims_are_written() {
        let claims: Vec<DedupClaimStamp> = (0..40)
            .map(|_| DedupClaimStamp {
                claim: uuid::Uuid::new_v4(),
            })
            .collect();
        let e = claims
            .iter()
            .fold(Envelope::new(order()), |e, c| e.with(*c));
        let back = serializer()
            .decode(&serializer().encode(&e).unwrap())
            .unwrap();
        let kept: Vec<DedupClaimStamp> = back.all::<DedupClaimStamp>().copied().collect();
        assert_eq!(kept, claims[40 - STAMP_HISTORY..]);
        assert_eq!(back.last::<DedupClaimStamp>(), claims.last());
    }

    #[test]
    fn a_bus_name_header_is_written_once_per_bus_and_shared() {
        assert_eq!(BUS_NAME_HEADER, stamp_header(BusNameStamp::NAME));
        // Transports decoding it from the wire keep the name borrowed.
        assert!(matches!(
            crate::envelope::headers::header_text(&stamp_header(BusNameStamp::NAME)),
            Cow::Borrowed(BUS_NAME_HEADER)
        ));
        let s = serializer();
        let header = |envelope: Envelope| {
            let raw = s.encode(&envelope).unwrap();
            let value = raw.header(BUS_NAME_HEADER).unwrap().to_string();
            (raw, value)
        };
        for name in [
            "command.bus",
            "ünï",
            "",
            "b\u{e9}\"q\"\\",
            "x\ty",
            "del\u{7f}",
        ] {
            let stamp = BusNameStamp::new(name);
            let (raw, value) = header(Envelope::new(order()).with(stamp.clone()));
            assert_eq!(value, serde_json::to_string(&[&stamp]).unwrap(), "{name:?}");
            assert_eq!(s.decode(&raw).unwrap().last::<BusNameStamp>(), Some(&stamp));
        }
        // Two messages of one bus share the header's text.
        let (a, _) = header(Envelope::new(order()).with(BusNameStamp::new("shared")));
        let (b, _) = header(Envelope::new(order()).with(BusNameStamp::new("shared")));
        let (a, b) = (
            a.header(BUS_NAME_HEADER).unwrap(),
            b.header(BUS_NAME_HEADER).unwrap(),
        );
        assert!(std::ptr::eq(a.as_ptr(), b.as_ptr()));
        // Two bus-name stamps are both written, in order.
        let (_, both) = header(
            Envelope::new(order())
                .with(BusNameStamp::new("first"))
                .with(BusNameStamp::new("second")),
        );
        assert_eq!(both, r#"[{"bus":"first"},{"bus":"second"}]"#);
    }

    #[test]
    fn bus_names_decode_as_written_and_are_shared() {
        let s = serializer();
        let names = ["command.bus", "b\u{e9}\"q\"\\", "ünï", "", "x\ty"];
        for name in names {
            let raw = s
                .encode(&Envelope::new(order()).with(BusNameStamp::new(name)))
                .unwrap();
            let a = s.decode(&raw).unwrap();
            let b = s.decode(&raw).unwrap();
            let (a, b) = (
                a.last::<BusNameStamp>().unwrap(),
                b.last::<BusNameStamp>().unwrap(),
            );
            assert_eq!(&*a.bus, name);
            assert_eq!(a, b);
        }
        let raw = s
            .encode(&Envelope::new(order()).with(BusNameStamp::new("shared")))
            .unwrap();
        let (a, b) = (s.decode(&raw).unwrap(), s.decode(&raw).unwrap());
        let (a, b) = (
            &a.last::<BusNameStamp>().unwrap().bus,
            &b.last::<BusNameStamp>().unwrap().bus,
        );
        assert!(matches!(a, Cow::Borrowed(_)) && std::ptr::eq(a.as_ptr(), b.as_ptr()));
        // Whatever is not the plain form still decodes, or fails, as JSON.
        let mut raw = raw;
        for (value, bus) in [
            (r#"[ {"bus":"spaced"} ]"#, Some("spaced")),
            (r#"[{"bus":"a"},{"bus":"b"}]"#, Some("b")),
            ("[{\"bus\":\"raw tab\tinside\"}]", None),
            (r#"[{"bus":"x"}"#, None),
        ] {
            raw.headers.insert("X-Message-Stamp-BusName", value);
            match (s.decode(&raw), bus) {
                (Ok(e), Some(bus)) => assert_eq!(&*e.last::<BusNameStamp>().unwrap().bus, bus),
                (Err(e), None) => assert_eq!(e.kind(), "malformed_stamp"),
                (other, _) => panic!("{value}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_stamp_header_with_trailing_garbage_is_malformed() {
        let mut raw = serializer().encode(&Envelope::new(order())).unwrap();
        raw.headers
            .insert("X-Message-Stamp-Delay", r#"[{"ms":1}] x"#);
        assert_eq!(
            serializer().decode(&raw).unwrap_err().kind(),
            "malformed_stamp"
        );
    }

    #[test]
    fn opaque_stamps_merge_with_a_known_header_of_the_same_name() {
        assert_eq!(merge_arrays("[1]", "[2,3]"), "[1,2,3]");
        assert_eq!(merge_arrays("[1]", "x"), "[[1],x]");
    }
}
