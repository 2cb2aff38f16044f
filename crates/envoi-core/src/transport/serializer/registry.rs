//! The registries of message and stamp types a [`Serializer`] is built
//! with: the [`SerializerBuilder`] that fills them, and the
//! [`RegistryError`] of two types under one wire name.

use std::any::TypeId;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, RwLock};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::codec::{decode_message, decode_stamps, encode_message, MessageCodec, StampDecodeFn};
use super::{Inner, Serializer, DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_HEADERS_SIZE};
use crate::envelope::message::Message;
use crate::envelope::stamp::{
    BusNameStamp, DelayStamp, ErrorDetailsStamp, HandledStamp, MessageIdStamp, RedeliveryStamp,
    SentToFailureTransportStamp, Stamp, UnsentStamp,
};
use crate::middleware::correlation::{CausationIdStamp, CorrelationIdStamp};
use crate::middleware::dedup::DedupClaimStamp;

/// FNV-1a, for the registries keyed by wire names: they are short, and only
/// names the program registered are ever stored, so a key that came off
/// the wire can only miss.
#[derive(Default)]
pub(super) struct NameHasher(u64);

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

pub(super) type NameMap<V> = HashMap<&'static str, V, BuildHasherDefault<NameHasher>>;

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
    /// an [`OpaqueStamp`](super::OpaqueStamp). The built-in sendable stamps
    /// are registered already.
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

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::*;
    use crate::transport::serializer::fixtures::Order;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct OtherOrder;
    impl Message for OtherOrder {
        const NAME: &'static str = "Order";
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
}
