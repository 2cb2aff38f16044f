//! The functions that encode and decode one registered message or stamp
//! type, stored by name in a serializer's registries.

use std::any::TypeId;
use std::fmt;
use std::marker::PhantomData;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::envelope::message::{Message, MessageKind};
use crate::envelope::stamp::Stamp;
use crate::envelope::Envelope;

pub(super) type EncodeFn = fn(&Envelope) -> Option<Result<Vec<u8>, serde_json::Error>>;
pub(super) type DecodeFn = fn(&[u8], MessageKind) -> Result<Envelope, serde_json::Error>;
pub(super) type StampDecodeFn = fn(Envelope, &str) -> Result<Envelope, serde_json::Error>;

/// How one registered message type is encoded and decoded.
#[derive(Clone, Copy)]
pub(super) struct MessageCodec {
    pub(super) type_id: TypeId,
    pub(super) encode: EncodeFn,
    pub(super) decode: DecodeFn,
}

pub(super) fn encode_message<M: Message + Serialize>(
    envelope: &Envelope,
) -> Option<Result<Vec<u8>, serde_json::Error>> {
    envelope.message::<M>().map(serde_json::to_vec)
}

pub(super) fn decode_message<M: Message + DeserializeOwned>(
    body: &[u8],
    kind: MessageKind,
) -> Result<Envelope, serde_json::Error> {
    let message: M = serde_json::from_slice(body)?;
    Ok(Envelope::with_kind(message, kind))
}

/// Decodes a stamp header (a JSON array of `S`) onto `envelope`, each
/// element added as it is parsed: no intermediate vector.
pub(super) fn decode_stamps<S: Stamp>(
    envelope: Envelope,
    json: &str,
) -> Result<Envelope, serde_json::Error> {
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
