//! The dispatch span (Effect): one `tracing` span per typed dispatch,
//! named `<side>.<tag>` (`command.PlaceOrder`, `query.OrderTotal`).
//!
//! The typed [`Dispatcher`](crate::Dispatcher) opens it outermost for every
//! command and query (events opt in with
//! [`span_events`](crate::Dispatcher::span_events)), as a child of whatever
//! span the caller is in, so the caller's own
//! [`DispatchMiddleware`](crate::typed::DispatchMiddleware), the bus's
//! middleware and the handler all run inside it.
//!
//! # Attributes
//!
//! Nothing from the payload reaches the span unless a per-tag extractor,
//! registered with [`SpanAttributes::tag`], names it: a payload can carry a
//! bearer token or an opaque subject id, and a span is the last place either
//! should end up. An extractor returns `(key, value)` pairs whose value is a
//! [`SpanAttributeValue`]: a string, an integer, a float or a boolean. An
//! attribute an exporter could not represent is rejected where it is
//! written, because it does not compile:
//!
//! ```compile_fail
//! use envoi_core::typed::span::SpanAttributes;
//! use envoi_core::Message;
//!
//! #[derive(Debug)]
//! struct PlaceOrder { lines: Vec<String> }
//! impl Message for PlaceOrder { const NAME: &'static str = "PlaceOrder"; }
//!
//! // error[E0277]: the trait `From<Vec<String>>` is not implemented for `SpanAttributeValue`
//! let _ = SpanAttributes::new().tag(|p: &PlaceOrder| [("order.lines", p.lines.clone().into())]);
//! ```
//!
//! ```
//! use envoi_core::typed::span::SpanAttributes;
//! use envoi_core::Message;
//!
//! #[derive(Debug)]
//! struct PlaceOrder { quantity: u32, coupon: Option<String>, token: String }
//! impl Message for PlaceOrder { const NAME: &'static str = "PlaceOrder"; }
//!
//! // `token` is never named, so it never reaches a span.
//! let attributes = SpanAttributes::new().tag(|p: &PlaceOrder| {
//!     [
//!         ("order.quantity", p.quantity.into()),
//!         ("order.has_coupon", p.coupon.is_some().into()),
//!     ]
//! });
//! # let _ = attributes;
//! ```
//!
//! # How the span looks to a subscriber
//!
//! `tracing` needs a span's name and field names to be `'static` and known
//! when its callsite is registered. The dispatch span therefore gets a
//! callsite of its own per side, tag and set of attribute keys, created the
//! first time a subscriber is interested in it and kept for the life of the
//! process (a handful per message type). Its name is `<side>.<tag>`, its
//! target `envoi::dispatch`, its level `INFO`, and its fields are the
//! attribute keys plus `otel.status_code` and `otel.status_description`. So
//! every subscriber sees the real span name and each attribute as a field
//! of its own type (`record_str`, `record_i64`, `record_f64`,
//! `record_bool`), and an OpenTelemetry bridge such as
//! `tracing-opentelemetry` turns those fields into span attributes and the
//! two `otel.` fields into the span status.
//!
//! # Failure
//!
//! When the dispatch fails, `otel.status_code` is recorded as `error` and
//! `otel.status_description` as the error's [kind](crate::BusError::kind)
//! (`handler`, `deadline`, `cancelled`, …). The error's text is not
//! recorded: it may quote the payload. On success the status stays unset,
//! as OpenTelemetry recommends.
//!
//! # Cost
//!
//! With no subscriber, or none that enables `INFO` for `envoi::dispatch`,
//! opening the span costs one atomic load (the global maximum level) or a
//! cached interest check: no extractor runs and nothing is allocated.

use std::any::TypeId;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, LazyLock, OnceLock, RwLock};

use smallvec::SmallVec;
use tracing::callsite::Callsite;
use tracing::field::FieldSet;
use tracing::metadata::Kind;
use tracing::subscriber::Interest;
use tracing::{Level, Metadata};

use crate::envelope::message::{Message, MessageKind};
use crate::envelope::Envelope;
use crate::error::BusError;

/// The target of dispatch spans.
pub const SPAN_TARGET: &str = "envoi::dispatch";
/// The field holding the span status (`error` on failure).
pub const STATUS_CODE_FIELD: &str = "otel.status_code";
/// The field holding the status description (the error's kind).
pub const STATUS_DESCRIPTION_FIELD: &str = "otel.status_description";

/// A span attribute value: a string, an integer, a float or a boolean —
/// deliberately nothing else, because an attribute most exporters cannot
/// represent is silently dropped, which is worse than not compiling.
///
/// Conversions exist from `&str`, `String`, every integer type, `f32`,
/// `f64` and `bool`. An integer is recorded as an `Int` when it fits an
/// `i64` (the widest integer tracing and OpenTelemetry carry) and as its
/// decimal `String` otherwise (a `u64` above `i64::MAX`, say), so no value
/// is dropped or wrapped.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum SpanAttributeValue {
    /// A string.
    String(Cow<'static, str>),
    /// A signed integer.
    Int(i64),
    /// A floating-point number.
    Float(f64),
    /// A boolean.
    Bool(bool),
}

impl SpanAttributeValue {
    fn as_value(&self) -> &dyn tracing::Value {
        match self {
            SpanAttributeValue::String(Cow::Borrowed(s)) => s,
            SpanAttributeValue::String(Cow::Owned(s)) => s,
            SpanAttributeValue::Int(i) => i,
            SpanAttributeValue::Float(f) => f,
            SpanAttributeValue::Bool(b) => b,
        }
    }
}

impl From<&str> for SpanAttributeValue {
    fn from(v: &str) -> Self {
        SpanAttributeValue::String(Cow::Owned(v.to_owned()))
    }
}

impl From<String> for SpanAttributeValue {
    fn from(v: String) -> Self {
        SpanAttributeValue::String(Cow::Owned(v))
    }
}

impl From<Cow<'static, str>> for SpanAttributeValue {
    fn from(v: Cow<'static, str>) -> Self {
        SpanAttributeValue::String(v)
    }
}

macro_rules! int_attribute {
    ($($t:ty),*) => {$(
        impl From<$t> for SpanAttributeValue {
            fn from(v: $t) -> Self {
                SpanAttributeValue::Int(i64::from(v))
            }
        }
    )*};
}
int_attribute!(i8, i16, i32, i64, u8, u16, u32);

macro_rules! wide_int_attribute {
    ($($t:ty),*) => {$(
        impl From<$t> for SpanAttributeValue {
            /// An `Int` when the value fits an `i64`, else its decimal text.
            fn from(v: $t) -> Self {
                match i64::try_from(v) {
                    Ok(i) => SpanAttributeValue::Int(i),
                    Err(_) => SpanAttributeValue::String(Cow::Owned(v.to_string())),
                }
            }
        }
    )*};
}
wide_int_attribute!(u64, usize, isize, u128, i128);

impl From<f64> for SpanAttributeValue {
    fn from(v: f64) -> Self {
        SpanAttributeValue::Float(v)
    }
}

impl From<f32> for SpanAttributeValue {
    fn from(v: f32) -> Self {
        SpanAttributeValue::Float(f64::from(v))
    }
}

impl From<bool> for SpanAttributeValue {
    fn from(v: bool) -> Self {
        SpanAttributeValue::Bool(v)
    }
}

type Attributes = SmallVec<[(&'static str, SpanAttributeValue); 4]>;
type Extractor = dyn Fn(&Envelope, &mut Attributes) + Send + Sync;

/// Per-tag attribute extractors (Effect's `AttributeExtractors`): which
/// audited payload fields reach the dispatch span of each message type.
#[derive(Clone, Default)]
pub struct SpanAttributes {
    by_type: HashMap<TypeId, Arc<Extractor>>,
}

impl fmt::Debug for SpanAttributes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpanAttributes")
            .field("tags", &self.by_type.len())
            .finish()
    }
}

impl SpanAttributes {
    /// No extractors: spans carry no payload attributes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the extractor for message type `M`, replacing any earlier one.
    /// It returns `(key, value)` pairs; a key returned twice keeps its last
    /// value.
    #[must_use = "`tag` returns the extractors with the new one added"]
    pub fn tag<M, I>(mut self, extract: impl Fn(&M) -> I + Send + Sync + 'static) -> Self
    where
        M: Message,
        I: IntoIterator<Item = (&'static str, SpanAttributeValue)>,
    {
        let extractor = move |envelope: &Envelope, out: &mut Attributes| {
            if let Some(message) = envelope.message::<M>() {
                out.extend(extract(message));
            }
        };
        self.by_type.insert(TypeId::of::<M>(), Arc::new(extractor));
        self
    }

    /// Whether any extractor is registered.
    pub fn is_empty(&self) -> bool {
        self.by_type.is_empty()
    }

    fn extract(&self, envelope: &Envelope) -> Attributes {
        let mut out = Attributes::new();
        if let Some(f) = self.by_type.get(&envelope.message_type_id()) {
            f(envelope, &mut out);
        }
        // A key given twice keeps its last value.
        let mut i = 0;
        while i < out.len() {
            if out[i + 1..].iter().any(|(k, _)| *k == out[i].0)
                || out[i].0 == STATUS_CODE_FIELD
                || out[i].0 == STATUS_DESCRIPTION_FIELD
            {
                out.remove(i);
            } else {
                i += 1;
            }
        }
        out
    }
}

/// A callsite created at run time for one side, tag and set of keys.
struct DispatchCallsite {
    meta: OnceLock<Metadata<'static>>,
    interest: AtomicU8,
}

const INTEREST_NEVER: u8 = 0;
const INTEREST_SOMETIMES: u8 = 1;
const INTEREST_ALWAYS: u8 = 2;

impl Callsite for DispatchCallsite {
    fn set_interest(&self, interest: Interest) {
        let v = if interest.is_never() {
            INTEREST_NEVER
        } else if interest.is_always() {
            INTEREST_ALWAYS
        } else {
            INTEREST_SOMETIMES
        };
        self.interest.store(v, Ordering::Relaxed);
    }

    fn metadata(&self) -> &Metadata<'_> {
        // Set before the callsite is registered, so before anyone asks.
        self.meta.get().expect("dispatch callsite metadata is set")
    }
}

impl DispatchCallsite {
    fn enabled(&'static self) -> bool {
        match self.interest.load(Ordering::Relaxed) {
            INTEREST_NEVER => false,
            INTEREST_ALWAYS => true,
            _ => {
                let meta = self.metadata();
                tracing::dispatcher::get_default(|d| d.enabled(meta))
            }
        }
    }
}

type CallsiteKey = (MessageKind, &'static str);
type CallsiteMap = HashMap<CallsiteKey, Vec<(&'static [&'static str], &'static DispatchCallsite)>>;

static CALLSITES: LazyLock<RwLock<CallsiteMap>> = LazyLock::new(Default::default);

/// The callsite for `side`, `tag` and exactly these attribute `keys`.
fn callsite(
    side: MessageKind,
    tag: &'static str,
    keys: &[&'static str],
) -> &'static DispatchCallsite {
    let found = |map: &CallsiteMap| {
        map.get(&(side, tag)).and_then(|list| {
            list.iter()
                .find(|(k, _)| k.len() == keys.len() + 2 && k[..keys.len()] == *keys)
                .map(|(_, cs)| *cs)
        })
    };
    if let Some(cs) = found(&CALLSITES.read().unwrap_or_else(|e| e.into_inner())) {
        return cs;
    }
    let mut map = CALLSITES.write().unwrap_or_else(|e| e.into_inner());
    if let Some(cs) = found(&map) {
        return cs;
    }
    let name: &'static str = Box::leak(format!("{side}.{tag}").into_boxed_str());
    let mut names = keys.to_vec();
    names.extend([STATUS_CODE_FIELD, STATUS_DESCRIPTION_FIELD]);
    let names: &'static [&'static str] = Box::leak(names.into_boxed_slice());
    let cs: &'static DispatchCallsite = Box::leak(Box::new(DispatchCallsite {
        meta: OnceLock::new(),
        interest: AtomicU8::new(INTEREST_SOMETIMES),
    }));
    let _ = cs.meta.set(Metadata::new(
        name,
        SPAN_TARGET,
        Level::INFO,
        Some(file!()),
        Some(line!()),
        Some(module_path!()),
        FieldSet::new(names, tracing_core::identify_callsite!(cs)),
        Kind::SPAN,
    ));
    tracing::callsite::register(cs);
    map.entry((side, tag)).or_default().push((names, cs));
    cs
}

/// Opens the dispatch span of `envelope`, or returns `None` when no
/// subscriber is interested (without running any extractor).
pub(crate) fn open(
    side: MessageKind,
    tag: &'static str,
    envelope: &Envelope,
    attributes: &SpanAttributes,
) -> Option<tracing::Span> {
    if !tracing::level_enabled!(Level::INFO) {
        return None;
    }
    let attrs = attributes.extract(envelope);
    let keys: SmallVec<[&'static str; 4]> = attrs.iter().map(|(k, _)| *k).collect();
    let cs = callsite(side, tag, &keys);
    if !cs.enabled() {
        return None;
    }
    let meta = cs.metadata();
    let mut values: SmallVec<[Option<&dyn tracing::Value>; 6]> =
        attrs.iter().map(|(_, v)| Some(v.as_value())).collect();
    values.extend([None, None]);
    Some(tracing::Span::new(
        meta,
        &meta.fields().value_set_all(&values),
    ))
}

/// Records the outcome of the dispatch on its span.
pub(crate) fn close<T>(span: &tracing::Span, out: &Result<T, BusError>) {
    if let Err(e) = out {
        span.record(STATUS_CODE_FIELD, "error");
        span.record(STATUS_DESCRIPTION_FIELD, e.kind());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Ping;

    #[derive(Debug)]
    struct Order {
        quantity: u32,
        token: String,
    }
    impl Message for Order {
        const NAME: &'static str = "Order";
    }

    #[test]
    fn only_the_named_fields_are_extracted_and_a_repeated_key_keeps_its_last_value() {
        let attrs = SpanAttributes::new().tag(|o: &Order| {
            [
                ("order.quantity", SpanAttributeValue::from(1u8)),
                ("order.quantity", o.quantity.into()),
                (STATUS_CODE_FIELD, "ok".into()),
            ]
        });
        let e = Envelope::new(Order {
            quantity: 3,
            token: "secret".into(),
        });
        let got = attrs.extract(&e);
        assert_eq!(
            got.as_slice(),
            [("order.quantity", SpanAttributeValue::Int(3))]
        );
        assert!(e.message::<Order>().is_some_and(|o| o.token == "secret"));
        assert!(attrs.extract(&Envelope::new(Ping)).is_empty());
    }

    #[test]
    fn values_convert_from_strings_numbers_and_booleans() {
        assert_eq!(
            SpanAttributeValue::from("a"),
            SpanAttributeValue::String("a".into())
        );
        assert_eq!(SpanAttributeValue::from(7u32), SpanAttributeValue::Int(7));
        assert_eq!(SpanAttributeValue::from(-2i64), SpanAttributeValue::Int(-2));
        assert_eq!(
            SpanAttributeValue::from(0.5f32),
            SpanAttributeValue::Float(0.5)
        );
        assert_eq!(
            SpanAttributeValue::from(true),
            SpanAttributeValue::Bool(true)
        );
    }

    #[test]
    fn every_integer_width_converts_and_what_exceeds_i64_is_recorded_as_text() {
        assert_eq!(SpanAttributeValue::from(7u64), SpanAttributeValue::Int(7));
        assert_eq!(SpanAttributeValue::from(7usize), SpanAttributeValue::Int(7));
        assert_eq!(
            SpanAttributeValue::from(-7isize),
            SpanAttributeValue::Int(-7)
        );
        assert_eq!(
            SpanAttributeValue::from(-7i128),
            SpanAttributeValue::Int(-7)
        );
        assert_eq!(
            SpanAttributeValue::from(i64::MAX as u64),
            SpanAttributeValue::Int(i64::MAX)
        );
        assert_eq!(
            SpanAttributeValue::from(u64::MAX),
            SpanAttributeValue::String("18446744073709551615".into())
        );
        assert_eq!(
            SpanAttributeValue::from(u128::MAX),
            SpanAttributeValue::String(u128::MAX.to_string().into())
        );
        assert_eq!(
            SpanAttributeValue::from(i128::MIN),
            SpanAttributeValue::String(i128::MIN.to_string().into())
        );
    }

    #[test]
    fn one_callsite_per_side_tag_and_key_set() {
        let a = callsite(MessageKind::Command, "SpanTestA", &["x"]);
        let b = callsite(MessageKind::Command, "SpanTestA", &["x"]);
        let c = callsite(MessageKind::Command, "SpanTestA", &[]);
        let d = callsite(MessageKind::Query, "SpanTestA", &["x"]);
        assert!(std::ptr::eq(a, b));
        assert!(!std::ptr::eq(a, c));
        assert!(!std::ptr::eq(a, d));
        let meta = a.metadata();
        assert_eq!(meta.name(), "command.SpanTestA");
        assert_eq!(meta.target(), SPAN_TARGET);
        let fields: Vec<_> = meta.fields().iter().map(|f| f.name()).collect();
        assert_eq!(fields, ["x", STATUS_CODE_FIELD, STATUS_DESCRIPTION_FIELD]);
        assert_eq!(d.metadata().name(), "query.SpanTestA");
    }

    #[test]
    fn without_a_subscriber_no_span_is_opened_and_no_extractor_runs() {
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ran2 = ran.clone();
        let attrs = SpanAttributes::new().tag(move |_: &Ping| {
            ran2.store(true, Ordering::SeqCst);
            [("k", SpanAttributeValue::from(1u8))]
        });
        let span = tracing::dispatcher::with_default(&tracing::Dispatch::none(), || {
            open(MessageKind::Command, "Ping", &Envelope::new(Ping), &attrs)
        });
        assert!(span.is_none());
        // The global maximum level may be raised by another test's
        // subscriber; only assert the extractor when it is not.
        if !tracing::level_enabled!(Level::INFO) {
            assert!(!ran.load(Ordering::SeqCst));
        }
    }
}
