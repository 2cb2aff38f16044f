//! [`Headers`]: the string headers of an envelope, and of a message as a
//! transport stores it.

use std::borrow::Cow;
use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A header name or value: borrowed for the fixed ones (`type`, `kind`, a
/// message's name), owned for the rest.
pub type HeaderText = Cow<'static, str>;

/// `text` as a [`HeaderText`]: borrowed when it is one of the texts the
/// headers of every message hold (the names `type`, `kind` and
/// `X-Message-Stamp-BusName`, and the message kinds), copied otherwise.
/// Transports decoding headers from the wire use it (through
/// [`Headers::insert_copy`]) to allocate less.
///
/// ```
/// use std::borrow::Cow;
/// use envoi_core::headers::header_text;
///
/// assert!(matches!(header_text("kind"), Cow::Borrowed("kind")));
/// assert!(matches!(
///     header_text("X-Message-Stamp-BusName"),
///     Cow::Borrowed(_)
/// ));
/// assert!(matches!(header_text("X-Trace"), Cow::Owned(_)));
/// ```
pub fn header_text(text: &str) -> HeaderText {
    match text {
        "type" => Cow::Borrowed("type"),
        "kind" => Cow::Borrowed("kind"),
        "command" => Cow::Borrowed("command"),
        "event" => Cow::Borrowed("event"),
        "query" => Cow::Borrowed("query"),
        // Every dispatched message carries a bus-name stamp.
        BUS_NAME_HEADER => Cow::Borrowed(BUS_NAME_HEADER),
        _ => Cow::Owned(text.to_owned()),
    }
}

/// The headers of an encoded message: one value per name, in name order.
///
/// Names and values are [`HeaderText`]s, so the headers every message
/// carries (`type`, `kind` and the message's name) are stored without
/// allocating. A message has a handful of headers; they are kept in one
/// sorted vector, which is cheaper to build, search and drop than a tree.
///
/// [`insert`](Self::insert) takes `&'static str`s and `String`s; text
/// borrowed for less than `'static` goes in with
/// [`insert_copy`](Self::insert_copy).
///
/// ```
/// use envoi_core::Headers;
///
/// let mut headers = Headers::new();
/// headers.insert("type", "SendInvoice");
/// headers.insert("X-Trace", String::from("abc"));
/// assert_eq!(headers.get("type"), Some("SendInvoice"));
/// // Iteration is in name order.
/// let names: Vec<&str> = headers.keys().collect();
/// assert_eq!(names, ["X-Trace", "type"]);
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Headers {
    entries: Vec<(HeaderText, HeaderText)>,
}

impl Headers {
    /// No headers.
    pub const fn new() -> Self {
        Self {
            entries: Vec::new(),
        }
    }

    /// No headers, with room for `n` without reallocating.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            entries: Vec::with_capacity(n),
        }
    }

    fn position(&self, name: &str) -> Result<usize, usize> {
        self.entries.binary_search_by(|(k, _)| (**k).cmp(name))
    }

    /// The value of header `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.position(name).ok().map(|i| &*self.entries[i].1)
    }

    /// Whether header `name` is set.
    pub fn contains_key(&self, name: &str) -> bool {
        self.position(name).is_ok()
    }

    /// Sets header `name` to `value`, returning the value it replaced.
    pub fn insert(
        &mut self,
        name: impl Into<HeaderText>,
        value: impl Into<HeaderText>,
    ) -> Option<HeaderText> {
        let name = name.into();
        let value = value.into();
        // Headers mostly arrive in name order: check the end first.
        if self.entries.last().is_none_or(|(last, _)| **last < *name) {
            self.entries.push((name, value));
            return None;
        }
        match self.position(&name) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            Err(i) => {
                self.entries.insert(i, (name, value));
                None
            }
        }
    }

    /// Adds header `name` with `value` unless `name` is set already, in
    /// which case it changes nothing and gives `name` back.
    fn insert_new(&mut self, name: HeaderText, value: HeaderText) -> Result<(), HeaderText> {
        if self.entries.last().is_none_or(|(last, _)| **last < *name) {
            self.entries.push((name, value));
            return Ok(());
        }
        match self.position(&name) {
            Ok(_) => Err(name),
            Err(i) => {
                self.entries.insert(i, (name, value));
                Ok(())
            }
        }
    }

    /// Sets header `name` to `value`, both copied (see [`header_text`]),
    /// returning the value it replaced.
    pub fn insert_copy(&mut self, name: &str, value: &str) -> Option<HeaderText> {
        self.insert(header_text(name), header_text(value))
    }

    /// Removes header `name`, returning its value.
    pub fn remove(&mut self, name: &str) -> Option<HeaderText> {
        self.position(name).ok().map(|i| self.entries.remove(i).1)
    }

    /// Keeps only the headers for which `keep(name, value)` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&str, &str) -> bool) {
        self.entries.retain(|(k, v)| keep(k, v));
    }

    /// How many headers there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The size of the headers as encoded: the bytes of every name and
    /// value, added up. What the serializer's `max_headers_size` limits.
    pub fn encoded_size(&self) -> usize {
        self.entries
            .iter()
            .fold(0usize, |n, (k, v)| n.saturating_add(k.len() + v.len()))
    }

    /// The headers as `(name, value)`, in name order.
    pub fn iter(&self) -> Iter<'_> {
        Iter(self.entries.iter())
    }

    /// The names, in order.
    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &str> + ExactSizeIterator + '_ {
        self.entries.iter().map(|(k, _)| &**k)
    }

    /// The values, in the order of their names.
    pub fn values(&self) -> impl DoubleEndedIterator<Item = &str> + ExactSizeIterator + '_ {
        self.entries.iter().map(|(_, v)| &**v)
    }
}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl std::ops::Index<&str> for Headers {
    type Output = str;

    /// The value of header `name`.
    ///
    /// # Panics
    ///
    /// When there is no such header; [`Headers::get`] does not panic.
    fn index(&self, name: &str) -> &str {
        match self.get(name) {
            Some(value) => value,
            None => panic!("no header `{name}`"),
        }
    }
}

/// An iterator over `(name, value)` pairs of [`Headers`], in name order.
#[derive(Debug, Clone)]
pub struct Iter<'a>(std::slice::Iter<'a, (HeaderText, HeaderText)>);

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a str, &'a str);

    fn next(&mut self) -> Option<Self::Item> {
        self.0.next().map(|(k, v)| (&**k, &**v))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl DoubleEndedIterator for Iter<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        self.0.next_back().map(|(k, v)| (&**k, &**v))
    }
}

impl ExactSizeIterator for Iter<'_> {}

impl<'a> IntoIterator for &'a Headers {
    type Item = (&'a str, &'a str);
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl IntoIterator for Headers {
    type Item = (HeaderText, HeaderText);
    type IntoIter = std::vec::IntoIter<(HeaderText, HeaderText)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.into_iter()
    }
}

impl<K: Into<HeaderText>, V: Into<HeaderText>> Extend<(K, V)> for Headers {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, iter: I) {
        for (k, v) in iter {
            self.insert(k, v);
        }
    }
}

impl<K: Into<HeaderText>, V: Into<HeaderText>> FromIterator<(K, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let iter = iter.into_iter();
        let mut headers = Headers::with_capacity(iter.size_hint().0);
        headers.extend(iter);
        headers
    }
}

impl<K: Into<HeaderText>, V: Into<HeaderText>, const N: usize> From<[(K, V); N]> for Headers {
    fn from(pairs: [(K, V); N]) -> Self {
        pairs.into_iter().collect()
    }
}

impl Serialize for Headers {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.len()))?;
        for (k, v) in self {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Headers {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HeadersVisitor;

        impl<'de> Visitor<'de> for HeadersVisitor {
            type Value = Headers;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of header names to string values")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Headers, A::Error> {
                let mut headers = Headers::with_capacity(map.size_hint().unwrap_or(0).min(64));
                while let Some((Text(k), Text(v))) = map.next_entry()? {
                    // Which of two values was meant is anyone's guess: a
                    // message is not handled with either.
                    if let Err(k) = headers.insert_new(k, v) {
                        return Err(serde::de::Error::custom(format_args!(
                            "header `{}` is given more than once",
                            &*k
                        )));
                    }
                }
                Ok(headers)
            }
        }

        deserializer.deserialize_map(HeadersVisitor)
    }
}

/// A header name or value read with [`header_text`]: the well-known ones
/// borrowed, a string the deserializer already owns kept as it is.
struct Text(HeaderText);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor;

        impl Visitor<'_> for TextVisitor {
            type Value = Text;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(header_text(v)))
            }

            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Text, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }

        deserializer.deserialize_str(TextVisitor)
    }
}

/// The header of [`BusNameStamp`](crate::envelope::stamp::BusNameStamp)s:
/// `X-Message-Stamp-BusName`.
pub(crate) const BUS_NAME_HEADER: &str = "X-Message-Stamp-BusName";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_iterate_in_name_order_whatever_the_insertion_order() {
        let mut h = Headers::new();
        for name in ["type", "X-B", "kind", "X-A", "content-type"] {
            h.insert(name, format!("v-{name}"));
        }
        let names: Vec<&str> = h.keys().collect();
        assert_eq!(names, ["X-A", "X-B", "content-type", "kind", "type"]);
        assert_eq!(h.get("kind"), Some("v-kind"));
        assert_eq!(h.get("missing"), None);
    }

    #[test]
    fn inserting_a_name_again_replaces_its_value() {
        let mut h = Headers::from([("type", "A"), ("kind", "command")]);
        assert_eq!(h.insert("type", "B").as_deref(), Some("A"));
        assert_eq!(h.len(), 2);
        assert_eq!(h.get("type"), Some("B"));
        assert_eq!(h.remove("type").as_deref(), Some("B"));
        assert!(!h.contains_key("type"));
        assert_eq!(h.remove("type"), None);
    }

    #[test]
    fn headers_round_trip_through_json_as_a_map() {
        let h = Headers::from([("type", "Job"), ("kind", "event")]);
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(json, r#"{"kind":"event","type":"Job"}"#);
        let back: Headers = serde_json::from_str(&json).unwrap();
        assert_eq!(back, h);
        assert!(serde_json::from_str::<Headers>(r#"{"type":1}"#).is_err());
        // Escaped text is unescaped, and not mistaken for a well-known name.
        let escaped: Headers =
            serde_json::from_str(r#"{"ty\u0070e":"a\"b","k\nind":"x"}"#).unwrap();
        assert_eq!(escaped.get("type"), Some("a\"b"));
        assert_eq!(escaped.get("k\nind"), Some("x"));
    }

    #[test]
    fn a_name_given_twice_in_json_is_an_error_not_its_last_value() {
        let error = serde_json::from_str::<Headers>(r#"{"type":"A","kind":"event","type":"B"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("header `type` is given more than once"),
            "{error}"
        );
    }

    #[test]
    fn well_known_texts_are_borrowed_and_others_copied() {
        let mut h = Headers::new();
        let name = String::from("kind");
        let value = String::from("X-Custom-Value");
        h.insert_copy(&name, &value);
        assert!(matches!(h.entries[0].0, Cow::Borrowed("kind")));
        assert!(matches!(h.entries[0].1, Cow::Owned(_)));
        assert_eq!(h.get("kind"), Some("X-Custom-Value"));
        for text in [
            "type",
            "kind",
            "command",
            "event",
            "query",
            "X-Message-Stamp-BusName",
        ] {
            assert!(matches!(header_text(&String::from(text)), Cow::Borrowed(t) if t == text));
        }
    }

    #[test]
    fn equal_headers_compare_equal_however_they_were_built() {
        let a = Headers::from([("b", String::from("2")), ("a", String::from("1"))]);
        let mut b = Headers::new();
        b.insert("a", "1");
        b.insert("b", "2");
        assert_eq!(a, b);
        assert_eq!(format!("{a:?}"), r#"{"a": "1", "b": "2"}"#);
    }
}
