//! Several consumers and publishers on one transport: concurrent, closing
//! and reopening, none loses or duplicates a message.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoi_core::transport::Delivery;

use super::{bodies, lock};
use crate::support::{
    ack, assert_exactly_once, body, expect_nothing, get, open, receive_and_ack, release, send,
    send_texts, text, unique_name, Handle,
};
use crate::{MakeTransport, Options};

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
