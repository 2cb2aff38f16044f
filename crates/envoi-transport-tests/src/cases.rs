//! The conformance cases, one `pub async fn` each. The
//! [`conformance!`](crate::conformance) macro emits a test per case; each can
//! also be called by hand with any [`MakeTransport`].
//!
//! Every case opens transports with names of its own, calls `setup` on each
//! handle, bounds its loops and time, and panics with a message that says
//! what went wrong.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoi_core::transport::{Delivery, RawMessage, REDELIVERED_HEADER};

use crate::support::{
    ack, assert_exactly_once, body, count, expect_count, expect_nothing, get, message, open,
    receive, receive_and_ack, release, requires, send, send_texts, settle_wait, text, unique_name,
    Handle,
};
use crate::{MakeTransport, Options};

/// The message a redelivery carries, without the mark a transport may set
/// on it ([`Delivery::redelivered`]).
fn unmarked(delivery: &Delivery) -> RawMessage {
    let mut raw = delivery.raw.clone();
    raw.headers.remove(REDELIVERED_HEADER);
    raw
}

fn bodies(tag: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{tag}-{i}")).collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Bodies and headers come back exactly as sent: JSON with escapes and
/// emoji, a 256 KiB body, header values with quotes, backslashes, newlines,
/// tabs, empty and 8 KiB values, and 64 headers on one message. Ids are
/// non-empty and distinct.
pub async fn publish_consume_integrity(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("integrity");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let long_value = "x".repeat(8 * 1024);
    let big_body = format!("{{\"data\":\"{}\"}}", "abcdefghij".repeat(26 * 1024));
    let many: Vec<(String, String)> = (0..64)
        .map(|i| (format!("X-Header-{i}"), format!("value {i}")))
        .collect();
    let mut sent = vec![
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
    ];
    // Bodies are distinct so deliveries can be matched to what was sent.
    let mut ids = BTreeSet::new();
    for m in &sent {
        ids.insert(send(&*t, m.clone()).await);
    }
    assert_eq!(ids.len(), sent.len(), "send returned duplicate ids");

    let got = receive_and_ack(&*t, sent.len(), 10, options.timeout).await;
    let delivery_ids: BTreeSet<_> = got.iter().map(|d| d.id.clone()).collect();
    assert_eq!(delivery_ids.len(), got.len(), "deliveries share an id");
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

/// An acknowledged message is never handed out again, not even after the
/// lease would have expired; the count drops to zero.
pub async fn acked_message_never_comes_back(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("acked");
    let Some(t) = open(make, &name).await else {
        return;
    };
    send_texts(&*t, &bodies("acked", 3)).await;
    receive_and_ack(&*t, 3, 10, options.timeout).await;
    expect_nothing(&*t, settle_wait(options), "all messages were acked").await;
    expect_count(&*t, 0, "after acking every message").await;
}

/// A rejected message is never handed out again.
pub async fn rejected_message_never_comes_back(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("rejected");
    let Some(t) = open(make, &name).await else {
        return;
    };
    send_texts(&*t, &bodies("rejected", 3)).await;
    for d in receive(&*t, 3, 10, options.timeout).await {
        t.reject(&d.id)
            .await
            .unwrap_or_else(|e| panic!("reject of `{}` failed: {e}", d.id));
    }
    expect_nothing(&*t, settle_wait(options), "all messages were rejected").await;
    expect_count(&*t, 0, "after rejecting every message").await;
}

/// A released message (the handler failed, or the worker stopped) is handed
/// out again, intact, well before a lease would have expired.
pub async fn released_message_is_redelivered(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("released");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let sent = message("{\"retry\":\"me\"}", &[("type", "Retry"), ("attempt", "1")]);
    send(&*t, sent.clone()).await;
    let first = receive(&*t, 1, 1, options.timeout).await.remove(0);
    assert_eq!(first.raw, sent, "first delivery differs from what was sent");
    release(&*t, &first.id).await;
    let released_at = Instant::now();
    let second = receive(&*t, 1, 1, options.timeout).await.remove(0);
    let waited = released_at.elapsed();
    assert_eq!(
        unmarked(&second),
        sent,
        "redelivery differs from what was sent"
    );
    if options.lease_expiry {
        assert!(
            waited < options.lease,
            "a released message came back only after {waited:?}, as if its lease had to expire"
        );
    }
    ack(&*t, &second.id).await;
    expect_nothing(&*t, Duration::from_millis(500), "the redelivery was acked").await;
}

/// A consumer whose handler fails three times for every message (it
/// releases them) keeps consuming; each message is finally acked once.
pub async fn continues_after_repeated_errors(make: &impl MakeTransport, options: &Options) {
    const FAILURES: usize = 3;
    let name = unique_name("errors");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let expected = bodies("flaky", 10);
    send_texts(&*t, &expected).await;
    let deadline = Instant::now() + options.timeout;
    let mut attempts: BTreeMap<String, usize> = BTreeMap::new();
    let mut acked: Vec<String> = Vec::new();
    while acked.len() < expected.len() {
        assert!(
            Instant::now() < deadline,
            "only {} of {} messages were acked within {:?}; attempts so far: {attempts:?}",
            acked.len(),
            expected.len(),
            options.timeout
        );
        let got = get(&*t, 5).await;
        if got.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for d in got {
            let b = body(&d);
            let n = attempts.entry(b.clone()).or_default();
            *n += 1;
            if *n <= FAILURES {
                release(&*t, &d.id).await;
            } else {
                ack(&*t, &d.id).await;
                acked.push(b);
            }
        }
    }
    assert_exactly_once(&acked, &expected, "acked after repeated errors");
    for (b, n) in &attempts {
        assert_eq!(*n, FAILURES + 1, "`{b}` was handed out {n} times");
    }
    expect_nothing(&*t, Duration::from_millis(500), "every message was acked").await;
}

/// A message handed out and never settled is not handed out again while the
/// lease runs, then comes back intact once it expires, to another handle,
/// marked as redelivered (unless [`Options::marks_redeliveries`] is off;
/// the first delivery is never marked). Settling the stale delivery
/// afterwards does not panic.
pub async fn unacked_message_is_redelivered_after_lease(
    make: &impl MakeTransport,
    options: &Options,
) {
    if !options.lease_expiry {
        eprintln!(
            "skipped unacked_message_is_redelivered_after_lease: transport has no lease expiry"
        );
        return;
    }
    let name = unique_name("lease");
    let Some(a) = open(make, &name).await else {
        return;
    };
    let Some(b) = open(make, &name).await else {
        return;
    };
    let sent = message("{\"lease\":1}", &[("type", "Lease")]);
    send(&*a, sent.clone()).await;
    let first = receive(&*a, 1, 1, options.timeout).await.remove(0);
    let claimed_at = Instant::now();
    assert!(
        !first.is_redelivered(),
        "the first delivery is marked as redelivered"
    );
    expect_nothing(
        &*b,
        options.lease / 2,
        "the message is leased to another consumer",
    )
    .await;
    let again = receive(&*b, 1, 1, options.lease + options.timeout)
        .await
        .remove(0);
    let after = claimed_at.elapsed();
    assert_eq!(
        unmarked(&again),
        sent,
        "redelivery differs from what was sent"
    );
    assert!(
        again.is_redelivered() || !options.marks_redeliveries,
        "the message that came back after its lease is not marked as redelivered"
    );
    assert!(
        after >= options.lease * 3 / 4,
        "the message came back after {after:?}, before its lease of {:?} expired",
        options.lease
    );
    ack(&*b, &again.id).await;
    // The first consumer wakes up late and settles its stale delivery.
    let _ = a.ack(&first.id).await;
    expect_nothing(&*b, settle_wait(options), "the redelivery was acked").await;
}

/// A consumer that keeps calling `keepalive` holds its message well past the
/// lease; nobody else gets it, and after the ack it never comes back.
pub async fn keepalive_prevents_redelivery(make: &impl MakeTransport, options: &Options) {
    if !options.lease_expiry {
        eprintln!("skipped keepalive_prevents_redelivery: transport has no lease expiry");
        return;
    }
    let name = unique_name("keepalive");
    let Some(a) = open(make, &name).await else {
        return;
    };
    let Some(b) = open(make, &name).await else {
        return;
    };
    send(&*a, text("slow handler")).await;
    let held = receive(&*a, 1, 1, options.timeout).await.remove(0);
    let keeper = {
        let a = Arc::clone(&a);
        let id = held.id.clone();
        let every = options.lease / 4;
        let until = Instant::now() + options.lease * 3;
        tokio::spawn(async move {
            while Instant::now() < until {
                tokio::time::sleep(every).await;
                a.keepalive(&id)
                    .await
                    .unwrap_or_else(|e| panic!("keepalive of `{id}` failed: {e}"));
            }
        })
    };
    expect_nothing(
        &*b,
        options.lease * 3,
        "the message's lease is kept alive by its consumer",
    )
    .await;
    keeper.await.expect("the keepalive task panicked");
    ack(&*a, &held.id).await;
    expect_nothing(
        &*b,
        settle_wait(options),
        "the kept-alive message was acked",
    )
    .await;
}

/// Four consumers (two sharing a handle, two with handles of their own)
/// consuming 200 messages together see each exactly once.
pub async fn concurrent_consumers_see_every_message_once(
    make: &impl MakeTransport,
    options: &Options,
) {
    const N: usize = 200;
    let name = unique_name("concurrent");
    let Some(shared) = open(make, &name).await else {
        return;
    };
    let mut handles: Vec<Handle> = vec![Arc::clone(&shared), shared];
    for _ in 0..2 {
        let Some(h) = open(make, &name).await else {
            return;
        };
        handles.push(h);
    }
    let expected = bodies("concurrent", N);
    send_texts(&*handles[0], &expected).await;

    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let deadline = Instant::now() + options.timeout;
    let tasks: Vec<_> = handles
        .into_iter()
        .map(|t| {
            let seen = Arc::clone(&seen);
            tokio::spawn(async move {
                while lock(&seen).len() < N && Instant::now() < deadline {
                    let got = get(&*t, 10).await;
                    if got.is_empty() {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    for d in got {
                        lock(&seen).push(body(&d));
                        ack(&*t, &d.id).await;
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a consumer panicked");
    }
    let seen = lock(&seen).clone();
    assert_exactly_once(&seen, &expected, "four concurrent consumers");
}

/// Consumers that are closed and reopened mid-stream, each leaving part of
/// what it took unsettled (or released, without lease expiry), lose nothing:
/// every message is finally acked, exactly once.
pub async fn consumers_reopened_mid_stream_lose_nothing(
    make: &impl MakeTransport,
    options: &Options,
) {
    const N: usize = 60;
    let name = unique_name("reopen");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let expected = bodies("reopen", N);
    send_texts(&*t, &expected).await;
    drop(t);

    let deadline = Instant::now() + options.timeout + options.lease;
    let mut acked: Vec<String> = Vec::new();
    let mut rounds = 0;
    while acked.len() < N {
        assert!(
            Instant::now() < deadline,
            "only {} of {N} messages were acked after {rounds} reopenings",
            acked.len()
        );
        rounds += 1;
        let Some(h) = open(make, &name).await else {
            return;
        };
        let round_end = Instant::now() + Duration::from_millis(200);
        let mut got: Vec<Delivery> = Vec::new();
        while got.len() < 6 && Instant::now() < round_end {
            let more = get(&*h, 6 - got.len()).await;
            if more.is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            got.extend(more);
        }
        // Ack half of what this consumer took; close with the rest in hand.
        let keep = got.len().div_ceil(2);
        for d in &got[..keep] {
            ack(&*h, &d.id).await;
            acked.push(body(d));
        }
        if !options.lease_expiry {
            for d in &got[keep..] {
                release(&*h, &d.id).await;
            }
        }
        drop(h);
    }
    assert_exactly_once(&acked, &expected, "acked by reopened consumers");
}

/// Ten consumers with messages in hand all close at the same moment; a
/// fresh consumer then gets everything they did not ack, and nothing is
/// acked twice.
pub async fn many_consumers_closing_at_once_lose_nothing(
    make: &impl MakeTransport,
    options: &Options,
) {
    const N: usize = 100;
    const CONSUMERS: usize = 10;
    let name = unique_name("closing");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let expected = bodies("closing", N);
    send_texts(&*t, &expected).await;

    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let release_on_close = !options.lease_expiry;
    let mut tasks = Vec::new();
    for _ in 0..CONSUMERS {
        let Some(h) = open(make, &name).await else {
            return;
        };
        let acked = Arc::clone(&acked);
        let stop = Arc::clone(&stop);
        tasks.push(tokio::spawn(async move {
            let mut held: Vec<Delivery> = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let got = get(&*h, 3).await;
                if got.is_empty() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let mut got = got.into_iter();
                if let Some(first) = got.next() {
                    ack(&*h, &first.id).await;
                    lock(&acked).push(body(&first));
                }
                held.extend(got);
            }
            if release_on_close {
                for d in &held {
                    release(&*h, &d.id).await;
                }
            }
            (h, held.len())
        }));
    }
    // Let them work a little, then close them all at once.
    let busy_until = Instant::now() + options.timeout;
    while lock(&acked).len() < CONSUMERS && Instant::now() < busy_until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let mut closed = Vec::new();
    let mut in_hand = 0;
    for task in tasks {
        let (h, held) = task.await.expect("a consumer panicked");
        in_hand += held;
        closed.push(h);
    }
    drop(closed);

    let done = lock(&acked).clone();
    let remaining = N - done.len();
    assert!(
        remaining >= in_hand,
        "{} messages acked and {in_hand} in hand out of {N}",
        done.len()
    );
    let fresh = receive_and_ack(&*t, remaining, 10, options.timeout + options.lease).await;
    let mut all = done;
    all.extend(fresh.iter().map(body));
    assert_exactly_once(&all, &expected, "acked before and after closing");
    expect_nothing(&*t, Duration::from_millis(300), "every message was acked").await;
}

/// With a single consumer, messages come out in the order they were sent,
/// whether sent one by one or as a batch and fetched one or several at a
/// time. Needs `ordered`.
pub async fn single_consumer_receives_in_order(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("order");
    let Some(t) = open(make, &name).await else {
        return;
    };
    if !requires(
        "single_consumer_receives_in_order",
        t.capabilities().ordered,
        "ordered",
    ) {
        return;
    }
    let expected = bodies("order", 50);
    send_texts(&*t, &expected).await;
    let mut got = receive_and_ack(&*t, 10, 1, options.timeout).await;
    got.extend(receive_and_ack(&*t, 40, 7, options.timeout).await);
    let got: Vec<String> = got.iter().map(body).collect();
    assert_eq!(got, expected, "messages sent one by one came out of order");

    let batch = bodies("batch", 20);
    t.send_batch(batch.iter().map(|b| (text(b), None)).collect())
        .await
        .unwrap_or_else(|e| panic!("send_batch failed: {e}"));
    let got: Vec<String> = receive_and_ack(&*t, 20, 20, options.timeout)
        .await
        .iter()
        .map(body)
        .collect();
    assert_eq!(got, batch, "a batch came out of order");
}

/// Ten publishers with handles of their own send concurrently and close;
/// every message arrives exactly once.
pub async fn concurrent_publishers_lose_nothing(make: &impl MakeTransport, options: &Options) {
    const PUBLISHERS: usize = 10;
    const EACH: usize = 30;
    let name = unique_name("publishers");
    let Some(consumer) = open(make, &name).await else {
        return;
    };
    let mut tasks = Vec::new();
    for p in 0..PUBLISHERS {
        let Some(h) = open(make, &name).await else {
            return;
        };
        tasks.push(tokio::spawn(async move {
            for i in 0..EACH {
                send(&*h, text(&format!("publisher{p}-{i}"))).await;
            }
            drop(h);
        }));
    }
    for task in tasks {
        task.await.expect("a publisher panicked");
    }
    let expected: Vec<String> = (0..PUBLISHERS)
        .flat_map(|p| (0..EACH).map(move |i| format!("publisher{p}-{i}")))
        .collect();
    let got: Vec<String> = receive_and_ack(&*consumer, expected.len(), 25, options.timeout)
        .await
        .iter()
        .map(body)
        .collect();
    assert_exactly_once(&got, &expected, "sent by concurrent publishers");
    expect_nothing(
        &*consumer,
        Duration::from_millis(300),
        "every message was acked",
    )
    .await;
}

/// Messages sent to one transport name are never handed out by another.
pub async fn transport_names_isolate_messages(make: &impl MakeTransport, options: &Options) {
    let (name_a, name_b) = (unique_name("isolate_a"), unique_name("isolate_b"));
    let Some(a) = open(make, &name_a).await else {
        return;
    };
    let Some(b) = open(make, &name_b).await else {
        return;
    };
    let (for_a, for_b) = (bodies("a", 5), bodies("b", 5));
    send_texts(&*a, &for_a).await;
    send_texts(&*b, &for_b).await;
    let got_a: Vec<String> = receive_and_ack(&*a, 5, 10, options.timeout)
        .await
        .iter()
        .map(body)
        .collect();
    expect_nothing(&*a, Duration::from_millis(300), "`a` was drained").await;
    expect_count(&*a, 0, "on `a` once drained").await;
    expect_count(&*b, 5, "on `b` while only `a` was drained").await;
    let got_b: Vec<String> = receive_and_ack(&*b, 5, 10, options.timeout)
        .await
        .iter()
        .map(body)
        .collect();
    expect_nothing(&*b, Duration::from_millis(300), "`b` was drained").await;
    assert_exactly_once(&got_a, &for_a, "transport `a`");
    assert_exactly_once(&got_b, &for_b, "transport `b`");
}

/// Delayed messages are not handed out before their delay and not much
/// after it (a few seconds of tolerance); an undelayed one is available at
/// once. Delayed messages count as waiting. Needs `delay`.
pub async fn delay_is_honoured(make: &impl MakeTransport, _options: &Options) {
    let name = unique_name("delay");
    let Some(t) = open(make, &name).await else {
        return;
    };
    if !requires("delay_is_honoured", t.capabilities().delay, "delay") {
        return;
    }
    let late_tolerance = Duration::from_secs(5);
    let plan = [
        ("now", Duration::ZERO),
        ("one-second", Duration::from_secs(1)),
        ("two-seconds", Duration::from_secs(2)),
    ];
    let start = Instant::now();
    for (b, d) in &plan {
        let delay = (!d.is_zero()).then_some(*d);
        t.send(text(b), delay)
            .await
            .unwrap_or_else(|e| panic!("send with delay {delay:?} failed: {e}"));
    }
    expect_count(&*t, 3, "with two delayed messages waiting").await;
    let mut arrived: BTreeMap<String, Duration> = BTreeMap::new();
    let deadline = start + Duration::from_secs(2) + late_tolerance;
    while arrived.len() < plan.len() && Instant::now() < deadline {
        let got = get(&*t, 10).await;
        let at = start.elapsed();
        if got.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for d in got {
            arrived.insert(body(&d), at);
            ack(&*t, &d.id).await;
        }
    }
    for (b, d) in &plan {
        let at = arrived
            .get(*b)
            .unwrap_or_else(|| panic!("`{b}` (delay {d:?}) did not arrive within {late_tolerance:?} of its delay; arrived: {arrived:?}"));
        // 50 ms of slack for clocks with coarse resolution.
        assert!(
            *at + Duration::from_millis(50) >= *d,
            "`{b}` arrived after {at:?}, before its delay of {d:?}"
        );
        assert!(
            *at <= *d + late_tolerance,
            "`{b}` arrived after {at:?}, much later than its delay of {d:?}"
        );
    }
    assert!(
        arrived["now"] < Duration::from_secs(1),
        "the undelayed message waited {:?}",
        arrived["now"]
    );
}

/// `message_count` counts waiting messages, leased ones included, and drops
/// as they are acked. Skipped when the transport does not count.
pub async fn message_count_counts_waiting_messages(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("count");
    let Some(t) = open(make, &name).await else {
        return;
    };
    if count(&*t).await.is_none() {
        eprintln!(
            "skipped message_count_counts_waiting_messages: transport does not count messages"
        );
        return;
    }
    expect_count(&*t, 0, "on a new transport").await;
    send_texts(&*t, &bodies("count", 5)).await;
    expect_count(&*t, 5, "after 5 sends").await;
    let leased = receive(&*t, 2, 2, options.timeout).await;
    expect_count(&*t, 5, "with 2 of 5 messages leased").await;
    for d in &leased {
        ack(&*t, &d.id).await;
    }
    expect_count(&*t, 3, "after acking 2 of 5").await;
    receive_and_ack(&*t, 3, 10, options.timeout).await;
    expect_count(&*t, 0, "after acking all").await;
}

/// `list` shows stored messages oldest first with the ids `send` returned,
/// honours its limit and leases nothing; `find` returns a stored message by
/// id and nothing for an acked or unknown one. Needs `listable`.
pub async fn list_and_find_do_not_lease(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("list");
    let Some(t) = open(make, &name).await else {
        return;
    };
    if !requires(
        "list_and_find_do_not_lease",
        t.capabilities().listable,
        "listable",
    ) {
        return;
    }
    let sent: Vec<RawMessage> = (0..3)
        .map(|i| {
            message(
                format!("{{\"listed\":{i}}}"),
                &[("type", "Listed"), ("index", &i.to_string())],
            )
        })
        .collect();
    let mut ids = Vec::new();
    for m in &sent {
        ids.push(send(&*t, m.clone()).await);
    }
    let listed = t
        .list(10)
        .await
        .unwrap_or_else(|e| panic!("list failed: {e}"));
    let listed_ids: Vec<&str> = listed.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        listed_ids, ids,
        "list is not oldest first with the ids send returned"
    );
    for (d, m) in listed.iter().zip(&sent) {
        assert_eq!(&d.raw, m, "list shows a different message");
    }
    let two = t
        .list(2)
        .await
        .unwrap_or_else(|e| panic!("list(2) failed: {e}"));
    assert_eq!(two.len(), 2, "list(2) ignored its limit");
    let found = t
        .find(&ids[1])
        .await
        .unwrap_or_else(|e| panic!("find failed: {e}"))
        .unwrap_or_else(|| panic!("find did not find `{}`", ids[1]));
    assert_eq!(found.raw, sent[1], "find returned a different message");
    if let Ok(Some(d)) = t.find("no-such-message-id").await {
        panic!("find of an unknown id returned `{}`", d.id);
    }

    // Listing and finding leased nothing: every message can still be taken.
    let got = receive(&*t, 3, 10, options.timeout).await;
    // Leased messages are still stored, so still listed.
    let still = t
        .list(10)
        .await
        .unwrap_or_else(|e| panic!("list failed: {e}"));
    assert_eq!(still.len(), 3, "leased messages disappeared from list");
    for d in &got {
        ack(&*t, &d.id).await;
    }
    let gone = t
        .find(&ids[0])
        .await
        .unwrap_or_else(|e| panic!("find failed: {e}"));
    assert!(gone.is_none(), "find still returns an acked message");
    let empty = t
        .list(10)
        .await
        .unwrap_or_else(|e| panic!("list failed: {e}"));
    assert!(
        empty.is_empty(),
        "list still shows {} acked messages",
        empty.len()
    );
}

/// `setup` can run again, from several handles at once, without losing or
/// duplicating what is stored.
pub async fn setup_is_idempotent(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("setup");
    let Some(a) = open(make, &name).await else {
        return;
    };
    send(&*a, text("kept across setups")).await;
    let Some(b) = open(make, &name).await else {
        return;
    };
    let (ra, rb, rc) = tokio::join!(a.setup(), b.setup(), a.setup());
    for r in [ra, rb, rc] {
        r.unwrap_or_else(|e| panic!("repeated setup failed: {e}"));
    }
    let got = receive_and_ack(&*b, 1, 10, options.timeout).await;
    assert_eq!(body(&got[0]), "kept across setups");
    expect_nothing(
        &*a,
        Duration::from_millis(300),
        "the only message was acked",
    )
    .await;
}

/// `send_batch` stores every message (ids distinct, in order) and
/// `ack_batch` settles them all; empty batches are fine. Where the transport
/// delays, a delayed message in a batch waits.
pub async fn send_batch_and_ack_batch(make: &impl MakeTransport, options: &Options) {
    const N: usize = 50;
    let name = unique_name("batch");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let none = t
        .send_batch(Vec::new())
        .await
        .unwrap_or_else(|e| panic!("empty send_batch failed: {e}"));
    assert!(none.is_empty(), "an empty batch returned ids");
    t.ack_batch(&[])
        .await
        .unwrap_or_else(|e| panic!("empty ack_batch failed: {e}"));

    let expected = bodies("batch", N);
    let ids = t
        .send_batch(expected.iter().map(|b| (text(b), None)).collect())
        .await
        .unwrap_or_else(|e| panic!("send_batch failed: {e}"));
    assert_eq!(
        ids.len(),
        N,
        "send_batch returned {} ids for {N} messages",
        ids.len()
    );
    let distinct: BTreeSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), N, "send_batch returned duplicate ids");
    expect_count(&*t, N as u64, "after a batch of 50").await;

    let got = receive(&*t, N, 20, options.timeout).await;
    let got_bodies: Vec<String> = got.iter().map(body).collect();
    assert_exactly_once(&got_bodies, &expected, "sent as one batch");
    let got_ids: Vec<String> = got.iter().map(|d| d.id.clone()).collect();
    t.ack_batch(&got_ids)
        .await
        .unwrap_or_else(|e| panic!("ack_batch failed: {e}"));
    expect_nothing(&*t, settle_wait(options), "the whole batch was acked").await;
    expect_count(&*t, 0, "after ack_batch").await;

    if t.capabilities().delay {
        let start = Instant::now();
        t.send_batch(vec![
            (text("batch-now"), None),
            (text("batch-later"), Some(Duration::from_secs(2))),
        ])
        .await
        .unwrap_or_else(|e| panic!("send_batch with a delay failed: {e}"));
        let first = receive_and_ack(&*t, 1, 10, options.timeout).await;
        assert_eq!(body(&first[0]), "batch-now");
        let later = receive_and_ack(&*t, 1, 10, options.timeout).await;
        assert_eq!(body(&later[0]), "batch-later");
        let waited = start.elapsed();
        assert!(
            waited + Duration::from_millis(50) >= Duration::from_secs(2),
            "a message delayed 2 s in a batch arrived after {waited:?}"
        );
    }
}

/// `get(max)` never hands out more than `max`, and repeated small gets
/// drain the queue.
pub async fn get_never_exceeds_max(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("max");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let expected = bodies("max", 10);
    send_texts(&*t, &expected).await;
    // `receive` asserts every get against its max.
    let mut got = receive_and_ack(&*t, 1, 1, options.timeout).await;
    got.extend(receive_and_ack(&*t, 9, 3, options.timeout).await);
    let got: Vec<String> = got.iter().map(body).collect();
    assert_exactly_once(&got, &expected, "drained with small gets");
    expect_nothing(&*t, Duration::from_millis(300), "every message was acked").await;
}

/// Acking, rejecting, releasing or keeping alive ids the transport never
/// handed out does not panic and leaves stored messages alone; acking twice
/// does not bring a message back.
pub async fn unknown_ids_do_not_disturb_other_messages(
    make: &impl MakeTransport,
    options: &Options,
) {
    let name = unique_name("unknown");
    let Some(t) = open(make, &name).await else {
        return;
    };
    let sent = message("{\"bystander\":true}", &[("type", "Bystander")]);
    send(&*t, sent.clone()).await;
    for id in ["", "0", "999999999", "not-an-id", "1-0", "💥"] {
        // Errors are fine; panics and side effects are not.
        let _ = t.ack(id).await;
        let _ = t.reject(id).await;
        let _ = t.release(id).await;
        let _ = t.keepalive(id).await;
        let _ = t.ack_batch(&[id.to_string()]).await;
    }
    let got = receive(&*t, 1, 10, options.timeout).await.remove(0);
    assert_eq!(got.raw, sent, "the stored message was disturbed");
    ack(&*t, &got.id).await;
    let _ = t.ack(&got.id).await;
    let _ = t.release(&got.id).await;
    expect_nothing(&*t, settle_wait(options), "the message was acked").await;
}

/// Messages sent through one handle are received through a handle opened
/// after the first was closed (a restart). Needs `persistent`.
pub async fn messages_survive_reopening(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("survive");
    let Some(a) = open(make, &name).await else {
        return;
    };
    if !requires(
        "messages_survive_reopening",
        a.capabilities().persistent,
        "persistent",
    ) {
        return;
    }
    let expected = bodies("survive", 5);
    send_texts(&*a, &expected).await;
    drop(a);
    let Some(b) = open(make, &name).await else {
        return;
    };
    let got: Vec<String> = receive_and_ack(&*b, 5, 10, options.timeout)
        .await
        .iter()
        .map(body)
        .collect();
    assert_exactly_once(&got, &expected, "received after reopening");
}

/// A consumer that takes a message and disappears (its handle is dropped
/// without settling) does not lose it: another handle gets it once the lease
/// expires, marked as redelivered (unless
/// [`Options::marks_redeliveries`] is off).
pub async fn claimed_message_survives_consumer_crash(make: &impl MakeTransport, options: &Options) {
    if !options.lease_expiry {
        eprintln!("skipped claimed_message_survives_consumer_crash: transport has no lease expiry");
        return;
    }
    let name = unique_name("crash");
    let Some(a) = open(make, &name).await else {
        return;
    };
    let sent = message("{\"crash\":true}", &[("type", "Crash")]);
    send(&*a, sent.clone()).await;
    let taken = receive(&*a, 1, 1, options.timeout).await;
    assert_eq!(taken[0].raw, sent);
    drop(a);
    let Some(b) = open(make, &name).await else {
        return;
    };
    let again = receive(&*b, 1, 1, options.lease + options.timeout)
        .await
        .remove(0);
    assert_eq!(unmarked(&again), sent, "the redelivered message differs");
    assert!(
        again.is_redelivered() || !options.marks_redeliveries,
        "the message of the consumer that disappeared is not marked as redelivered"
    );
    ack(&*b, &again.id).await;
    expect_nothing(&*b, settle_wait(options), "the redelivery was acked").await;
}

/// `get` on an empty transport comes back empty within a few seconds (it
/// may wait briefly for a message, never indefinitely), and so does a `get`
/// while the only message is leased to someone else.
pub async fn get_on_an_empty_transport_returns(make: &impl MakeTransport, options: &Options) {
    const BOUND: Duration = Duration::from_secs(5);
    let name = unique_name("empty");
    let Some(t) = open(make, &name).await else {
        return;
    };
    for _ in 0..3 {
        let started = Instant::now();
        let got = get(&*t, 10).await;
        assert!(got.is_empty(), "an empty transport handed out a message");
        assert!(
            started.elapsed() < BOUND,
            "get on an empty transport took {:?}",
            started.elapsed()
        );
    }
    send(&*t, text("only one")).await;
    let held = receive(&*t, 1, 1, options.timeout).await.remove(0);
    let started = Instant::now();
    let got = get(&*t, 10).await;
    assert!(
        got.is_empty(),
        "a leased message was handed out again at once"
    );
    assert!(
        started.elapsed() < BOUND,
        "get with every message leased took {:?}",
        started.elapsed()
    );
    ack(&*t, &held.id).await;
}
