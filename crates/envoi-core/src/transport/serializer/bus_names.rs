//! The bus names a serializer keeps (the first [`BUS_NAMES`] it meets),
//! each with its `BusName` stamp header: the
//! [`BusNameStamp`](crate::envelope::stamp::BusNameStamp)s it decodes and
//! the headers it writes for such a bus share one copy of each.

use std::sync::PoisonError;

use super::Inner;

/// Most distinct bus names a serializer keeps to share between the
/// [`BusNameStamp`](crate::envelope::stamp::BusNameStamp)s it decodes.
const BUS_NAMES: usize = 32;

impl Inner {
    /// Bus `name` as a shared `'static` string, with the `BusName` stamp
    /// header of a message whose one bus-name stamp names it,
    /// `[{"bus":"<name>"}]`: kept on first use, for decoding and encoding
    /// alike. `None` for a name JSON would escape, and past the first
    /// [`BUS_NAMES`] names.
    pub(super) fn known_bus(&self, name: &str) -> Option<(&'static str, &'static str)> {
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
    pub(super) fn plain_bus_name(json: &str) -> Option<&str> {
        let name = json.strip_prefix(r#"[{"bus":""#)?.strip_suffix(r#""}]"#)?;
        is_plain(name).then_some(name)
    }
}

/// Whether JSON writes `text` as it is, with no escapes.
fn is_plain(text: &str) -> bool {
    !text.contains(['"', '\\']) && !text.chars().any(char::is_control)
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use crate::envelope::headers::BUS_NAME_HEADER;
    use crate::envelope::stamp::{BusNameStamp, Stamp};
    use crate::envelope::Envelope;
    use crate::transport::serializer::encode::stamp_header;
    use crate::transport::serializer::fixtures::{order, serializer};

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
}
