//! The JSON serializer: round trips, stamp headers, registries and limits.

use envoi_core::serializer::{OpaqueStamp, Serializer, STAMP_HEADER_PREFIX};
use envoi_core::stamp::{
    BusNameStamp, DelayStamp, ErrorDetailsStamp, HandledStamp, HandlerResult, ReceivedStamp,
    RedeliveryStamp, SentStamp, TransportMessageIdStamp,
};
use envoi_core::transport::RawMessage;
use envoi_core::{Envelope, Message, MessageKind, Messenger, SerializationError, Stamp};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PlaceOrder {
    id: u64,
    lines: Vec<String>,
}
impl Message for PlaceOrder {
    const NAME: &'static str = "shop.PlaceOrder";
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Tenant {
    tenant: String,
}
impl Stamp for Tenant {
    const NAME: &'static str = "Tenant";
}

fn serializer() -> Serializer {
    Serializer::builder()
        .message::<PlaceOrder>()
        .stamp::<Tenant>()
        .build()
        .unwrap()
}

fn order() -> PlaceOrder {
    PlaceOrder {
        id: 42,
        lines: vec!["a".into(), "b".into()],
    }
}

#[test]
fn a_round_trip_keeps_body_kind_headers_and_stamps_in_order() {
    let s = serializer();
    let envelope = Envelope::event(order())
        .with(BusNameStamp::new("event.bus"))
        .with(RedeliveryStamp {
            retry_count: 1,
            at: 10,
        })
        .with(Tenant { tenant: "a".into() })
        .with(RedeliveryStamp {
            retry_count: 2,
            at: 20,
        })
        .with(Tenant { tenant: "b".into() })
        .with_header("trace", "t-1");
    let raw = s.encode(&envelope).unwrap();
    assert_eq!(raw.header("type"), Some("shop.PlaceOrder"));
    assert_eq!(raw.header("kind"), Some("event"));
    assert_eq!(raw.header("trace"), Some("t-1"));
    assert_eq!(
        raw.header("X-Message-Stamp-Tenant"),
        Some(r#"[{"tenant":"a"},{"tenant":"b"}]"#)
    );
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&raw.body).unwrap(),
        serde_json::json!({"id": 42, "lines": ["a", "b"]})
    );

    let back = s.decode(&raw).unwrap();
    assert_eq!(back.message::<PlaceOrder>(), Some(&order()));
    assert_eq!(back.kind(), MessageKind::Event);
    assert_eq!(back.header("trace"), Some("t-1"));
    assert_eq!(&*back.last::<BusNameStamp>().unwrap().bus, "event.bus");
    let retries: Vec<u32> = back
        .all::<RedeliveryStamp>()
        .map(|r| r.retry_count)
        .collect();
    assert_eq!(retries, [1, 2]);
    let tenants: Vec<&str> = back.all::<Tenant>().map(|t| t.tenant.as_str()).collect();
    assert_eq!(tenants, ["a", "b"]);
}

#[test]
fn non_sendable_stamps_do_not_cross_the_wire() {
    let s = serializer();
    let envelope = Envelope::new(order())
        .with(ReceivedStamp::new("async"))
        .with(SentStamp::new("async"))
        .with(TransportMessageIdStamp::new("7"))
        .with(HandledStamp::new("h", HandlerResult::new(5u32)))
        .with(DelayStamp { ms: 5 });
    let raw = s.encode(&envelope).unwrap();
    let stamp_headers: Vec<&str> = raw
        .headers
        .keys()
        .filter_map(|k| k.strip_prefix(STAMP_HEADER_PREFIX))
        .collect();
    assert_eq!(stamp_headers, ["Delay", "Handled"]);
    let back = s.decode(&raw).unwrap();
    assert!(!back.has::<ReceivedStamp>());
    assert!(!back.has::<SentStamp>());
    assert!(!back.has::<TransportMessageIdStamp>());
    let handled = back.last::<HandledStamp>().unwrap();
    assert_eq!(handled.handler, "h");
    assert!(handled.result.downcast_ref::<u32>().is_none());
}

#[test]
fn an_unregistered_type_name_does_not_decode() {
    let raw = RawMessage {
        body: b"{}".to_vec(),
        headers: [("type".to_string(), "shop.Refund".to_string())].into(),
    };
    match serializer().decode(&raw) {
        Err(SerializationError::UnknownType(name)) => assert_eq!(name, "shop.Refund"),
        other => panic!("expected UnknownType, got {other:?}"),
    }
}

#[test]
fn a_malformed_body_is_an_error_naming_the_type() {
    let mut raw = serializer().encode(&Envelope::new(order())).unwrap();
    raw.body = b"{\"id\": \"not a number\"".to_vec();
    let e = serializer().decode(&raw).unwrap_err();
    assert_eq!(e.kind(), "malformed");
    assert!(e.to_string().contains("shop.PlaceOrder"), "{e}");
}

#[test]
fn a_malformed_known_stamp_header_is_an_error() {
    let mut raw = serializer().encode(&Envelope::new(order())).unwrap();
    raw.headers
        .insert("X-Message-Stamp-Delay", "[{\"ms\":\"soon\"}]");
    match serializer().decode(&raw) {
        Err(SerializationError::MalformedStamp { header, .. }) => {
            assert_eq!(header, "X-Message-Stamp-Delay")
        }
        other => panic!("expected MalformedStamp, got {other:?}"),
    }
}

#[test]
fn a_body_over_the_limit_fails_both_ways() {
    let small = Serializer::builder()
        .message::<PlaceOrder>()
        .max_body_size(16)
        .build()
        .unwrap();
    match small.encode(&Envelope::new(order())) {
        Err(SerializationError::TooLarge { size, limit }) => {
            assert!(size > 16);
            assert_eq!(limit, 16);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let raw = serializer().encode(&Envelope::new(order())).unwrap();
    assert_eq!(small.decode(&raw).unwrap_err().kind(), "too_large");
}

#[test]
fn headers_over_the_limit_fail_both_ways_stamp_headers_included() {
    let envelope = Envelope::new(order())
        .with_header("note", "n".repeat(100))
        .with(Tenant {
            tenant: "t".repeat(100),
        });
    let raw = serializer().encode(&envelope).unwrap();
    let size = raw.headers.encoded_size();
    let names_and_values: usize = raw.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    assert_eq!(size, names_and_values);
    assert!(size > 200, "the envelope header and the stamp header count");

    let with_limit = |limit| {
        Serializer::builder()
            .message::<PlaceOrder>()
            .stamp::<Tenant>()
            .max_headers_size(limit)
            .build()
            .unwrap()
    };
    let exact = with_limit(size);
    assert_eq!(exact.max_headers_size(), size);
    assert_eq!(exact.encode(&envelope).unwrap().headers, raw.headers);
    assert_eq!(
        exact.decode(&raw).unwrap().header("note").unwrap().len(),
        100
    );

    let small = with_limit(size - 1);
    match small.encode(&envelope) {
        Err(SerializationError::HeadersTooLarge { size: s, limit }) => {
            assert_eq!((s, limit), (size, size - 1));
        }
        other => panic!("expected HeadersTooLarge, got {other:?}"),
    }
    let err = small.decode(&raw).unwrap_err();
    assert_eq!(err.kind(), "headers_too_large");
    assert_eq!(
        err.to_string(),
        format!(
            "headers of {size} bytes exceed the limit of {} bytes",
            size - 1
        )
    );
    // A huge stamp header alone is refused before it is parsed.
    let mut huge = serializer().encode(&Envelope::new(order())).unwrap();
    huge.headers.insert(
        "X-Message-Stamp-Tenant",
        format!("[{{\"tenant\":\"{}\"}}]", "t".repeat(2 * 1024 * 1024)),
    );
    assert_eq!(
        serializer().decode(&huge).unwrap_err().kind(),
        "headers_too_large",
        "the default limit is 1 MiB"
    );
}

#[test]
fn unknown_stamp_headers_are_kept_verbatim_and_sent_again() {
    let mut raw = serializer().encode(&Envelope::new(order())).unwrap();
    let odd = r#"[{"who":"other service"}]"#;
    raw.headers.insert("X-Message-Stamp-Audit", odd.to_string());
    let back = serializer().decode(&raw).unwrap();
    assert_eq!(
        back.last::<OpaqueStamp>(),
        Some(&OpaqueStamp {
            name: "Audit".into(),
            value: odd.into()
        })
    );
    let again = serializer().encode(&back).unwrap();
    assert_eq!(again.header("X-Message-Stamp-Audit"), Some(odd));
    assert!(again.header("X-Message-Stamp-Opaque").is_none());
}

#[test]
fn a_registered_user_stamp_decodes_to_its_type_and_an_unregistered_one_does_not() {
    let raw = serializer()
        .encode(&Envelope::new(order()).with(Tenant { tenant: "a".into() }))
        .unwrap();
    let without = Serializer::builder()
        .message::<PlaceOrder>()
        .build()
        .unwrap();
    let opaque = without.decode(&raw).unwrap();
    assert!(!opaque.has::<Tenant>());
    assert_eq!(opaque.last::<OpaqueStamp>().unwrap().name, "Tenant");
    assert_eq!(
        serializer()
            .decode(&raw)
            .unwrap()
            .last::<Tenant>()
            .unwrap()
            .tenant,
        "a"
    );
}

#[test]
fn error_details_survive_a_round_trip() {
    let s = serializer();
    let details = ErrorDetailsStamp {
        kind: "handler:pay".into(),
        message: "card declined".into(),
        chain: vec!["gateway said no".into()],
    };
    let raw = s
        .encode(&Envelope::new(order()).with(details.clone()))
        .unwrap();
    assert_eq!(
        s.decode(&raw).unwrap().last::<ErrorDetailsStamp>(),
        Some(&details)
    );
}

#[test]
fn routing_a_type_registers_it_and_message_registers_a_received_only_type() {
    #[derive(Debug, Clone, Serialize, Deserialize)]
    struct Refund;
    impl Message for Refund {
        const NAME: &'static str = "shop.Refund";
    }
    let messenger = Messenger::builder()
        .transport(
            "async",
            std::sync::Arc::new(envoi_core::transport::in_memory::InMemoryTransport::new()),
        )
        .route::<PlaceOrder>("async")
        .message::<Refund>()
        .build()
        .unwrap();
    let s = messenger.serializer();
    assert_eq!(s.message_names(), ["shop.PlaceOrder", "shop.Refund"]);
    assert!(s.can_encode::<PlaceOrder>());
}

#[test]
fn garbage_never_panics_the_decoder() {
    let s = serializer();
    let bodies: [&[u8]; 5] = [b"", b"\xff\xfe", b"null", b"[1,2", b"{\"id\":1e999}"];
    let kinds = [None, Some("command"), Some("???")];
    let stamps = [None, Some("not json"), Some("{}"), Some("[null]")];
    for body in bodies {
        for kind in kinds {
            for stamp in stamps {
                let mut raw = RawMessage {
                    body: body.to_vec(),
                    headers: [("type".to_string(), "shop.PlaceOrder".to_string())].into(),
                };
                if let Some(k) = kind {
                    raw.headers.insert("kind", k);
                }
                if let Some(v) = stamp {
                    raw.headers.insert("X-Message-Stamp-Redelivery", v);
                }
                assert!(s.decode(&raw).is_err(), "{raw:?} decoded");
            }
        }
    }
}
