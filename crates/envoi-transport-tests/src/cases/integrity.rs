//! What comes out is what went in: bodies and headers of every shape,
//! binary bodies.

use std::collections::BTreeSet;
use std::time::Duration;

use envoi_core::transport::RawMessage;

use crate::support::{expect_nothing, message, open, receive_and_ack, send, unique_name};
use crate::{MakeTransport, Options};

/// The header that marked a redelivery before transports marked it on the
/// delivery itself: now an ordinary header like any other.
const FORMER_REDELIVERY_HEADER: &str = "X-Envoi-Redelivered";

/// The messages [`publish_consume_integrity`] sends, each with a body of
/// its own.
fn awkward_messages() -> Vec<RawMessage> {
    let long_value = "x".repeat(8 * 1024);
    let big_body = format!("{{\"data\":\"{}\"}}", "abcdefghij".repeat(26 * 1024));
    let many: Vec<(String, String)> = (0..64)
        .map(|i| (format!("X-Header-{i}"), format!("value {i}")))
        .collect();
    vec![
        message(
            r#"{"order":1,"note":"h\u00e9llo \"world\" ✓ 🚀","nested":{"a":[1,2,3]}}"#,
            &[
                ("type", "App.OrderPlaced"),
                ("kind", "event"),
                (
                    "X-Message-Stamp-Bus",
                    r#"[{"name":"default","at":"2024-01-01T00:00:00Z"}]"#,
                ),
            ],
        ),
        message(
            "line one\nline two\ttabbed \\ backslash \"quoted\" — ünïcödé 中文",
            &[
                ("empty", ""),
                ("multi-line", "first\nsecond\r\nthird\ttab"),
                ("quotes", r#"she said "hi" and \left"#),
                ("emoji", "🎉 中文 ✓"),
                ("long", &long_value),
                ("a.b_c-D9", "mixed key characters"),
                ("Type", "case differs from `type`"),
                ("trailing", "ends with a space and a newline \n"),
                ("leading", "  starts with spaces"),
            ],
        ),
        message(big_body, &[("size", "256KiB")]),
        RawMessage {
            body: b"{\"many\":true}".to_vec(),
            headers: many.into_iter().collect(),
        },
        message("{}", &[]),
        message(
            "{\"stored mark\":true}",
            &[(FORMER_REDELIVERY_HEADER, "true"), ("type", "Marked")],
        ),
    ]
}

/// Bodies and headers come back exactly as sent: JSON with escapes and
/// emoji, a 256 KiB body, header values with quotes, backslashes, newlines,
/// tabs, empty and 8 KiB values, and 64 headers on one message. Ids are
/// non-empty and distinct. No first delivery is marked as redelivered, not
/// even one whose stored headers say `X-Envoi-Redelivered: true`: only the
/// transport marks a redelivery, and that header round-trips like any
/// other.
pub async fn publish_consume_integrity(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("integrity");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let mut sent = awkward_messages();
    // Bodies are distinct so deliveries can be matched to what was sent.
    let mut ids = BTreeSet::new();
    for m in &sent {
        ids.insert(send(&*t, m.clone()).await);
    }
    assert_eq!(ids.len(), sent.len(), "send returned duplicate ids");

    let got = receive_and_ack(&*t, sent.len(), 10, options.timeout).await;
    let delivery_ids: BTreeSet<_> = got.iter().map(|d| d.id.clone()).collect();
    assert_eq!(delivery_ids.len(), got.len(), "deliveries share an id");
    for d in &got {
        assert!(
            !d.redelivered,
            "the first delivery of body `{}` is marked as redelivered",
            String::from_utf8_lossy(&d.raw.body[..d.raw.body.len().min(60)])
        );
    }
    let mut received: Vec<RawMessage> = got.into_iter().map(|d| d.raw).collect();
    received.sort_by(|a, b| a.body.cmp(&b.body));
    sent.sort_by(|a, b| a.body.cmp(&b.body));
    for (s, r) in sent.iter().zip(&received) {
        assert_eq!(
            s.headers,
            r.headers,
            "headers changed in transit for body `{}`",
            String::from_utf8_lossy(&s.body[..s.body.len().min(60)])
        );
        assert!(s.body == r.body, "a body changed in transit");
    }
    expect_nothing(&*t, Duration::from_millis(300), "every message was acked").await;
}

/// Bodies that are not UTF-8 (empty, every byte value, NUL bytes, invalid
/// sequences) come back byte for byte. Skipped when
/// [`Options::binary_bodies`] is false.
pub async fn binary_bodies_round_trip(make: &impl MakeTransport, options: &Options) {
    if !options.binary_bodies {
        eprintln!("skipped binary_bodies_round_trip: transport takes text bodies only");
        return;
    }
    let name = unique_name("binary");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let samples: Vec<Vec<u8>> = vec![
        Vec::new(),
        (0..=255u8).collect(),
        vec![0xff, 0xfe, 0x00, 0x00, 0x80, 0xc3, 0x28],
        b"text with a \0 NUL in the middle".to_vec(),
        (0..=255u8).cycle().take(64 * 1024).collect(),
    ];
    for (i, s) in samples.iter().enumerate() {
        let index = i.to_string();
        let m = RawMessage {
            body: s.clone(),
            headers: [("sample".to_string(), index)].into_iter().collect(),
        };
        send(&*t, m).await;
    }
    let got = receive_and_ack(&*t, samples.len(), 10, options.timeout).await;
    for d in got {
        let index: usize = d
            .raw
            .header("sample")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("delivery `{}` lost its `sample` header", d.id));
        assert!(
            d.raw.body == samples[index],
            "binary sample {index} changed in transit ({} bytes sent, {} received)",
            samples[index].len(),
            d.raw.body.len()
        );
    }
}
