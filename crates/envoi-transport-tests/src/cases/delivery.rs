//! When and where messages are handed out: in order, by transport name,
//! after their delay, at most `max` at a time, never blocking for long, and
//! still there after a restart.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::bodies;
use crate::support::{
    ack, assert_exactly_once, body, expect_count, expect_nothing, get, open, receive,
    receive_and_ack, requires, send, send_texts, text, unique_name,
};
use crate::{MakeTransport, Options};

/// With a single consumer, messages come out in the order they were sent,
/// whether sent one by one or as a batch and fetched one or several at a
/// time. Needs [`Options::ordered`].
pub async fn single_consumer_receives_in_order(make: &impl MakeTransport, options: &Options) {
    let name = unique_name("order");
    if !requires(
        "single_consumer_receives_in_order",
        options.ordered,
        "ordered",
    ) {
        return;
    }
    let Some(t) = open(make, &name).await else {
        return;
    };
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
/// once. Delayed messages count as waiting. Needs [`Options::delay`].
pub async fn delay_is_honoured(make: &impl MakeTransport, options: &Options) {
    if !requires("delay_is_honoured", options.delay, "delay") {
        return;
    }
    let name = unique_name("delay");
    let Some(t) = open(make, &name).await else {
        return;
    };
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

/// Messages sent through one handle are received through a handle opened
/// after the first was closed (a restart). Needs [`Options::persistent`].
pub async fn messages_survive_reopening(make: &impl MakeTransport, options: &Options) {
    if !requires(
        "messages_survive_reopening",
        options.persistent,
        "persistent",
    ) {
        return;
    }
    let name = unique_name("survive");
    let Some(a) = open(make, &name).await else {
        return;
    };
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
