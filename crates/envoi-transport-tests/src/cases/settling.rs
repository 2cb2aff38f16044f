//! Settling: what is acknowledged or rejected never comes back, what is
//! released does, ids nobody handed out disturb nothing.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use envoi_core::transport::DeliveryId;

use super::bodies;
use crate::support::{
    ack, assert_exactly_once, body, expect_count, expect_nothing, get, message, open, receive,
    receive_and_ack, receiver, release, send, send_texts, settle_wait, unique_name,
};
use crate::{MakeTransport, Options};

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
        receiver(&*t)
            .reject(&d.id)
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
    assert_eq!(second.raw, sent, "redelivery differs from what was sent");
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

/// Acking, rejecting, releasing or (where the transport can) keeping alive
/// ids the transport never handed out does not panic and leaves stored messages alone; acking twice
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
    let r = receiver(&*t);
    for id in ["", "0", "999999999", "not-an-id", "1-0", "💥"] {
        let id = DeliveryId::from(id);
        // Errors are fine; panics and side effects are not.
        let _ = r.ack(&id).await;
        let _ = r.reject(&id).await;
        let _ = r.release(&id).await;
        if let Some(k) = t.as_keepalive() {
            let _ = k.keepalive(&id).await;
        }
        let _ = r.ack_batch(std::slice::from_ref(&id)).await;
    }
    let got = receive(&*t, 1, 10, options.timeout).await.remove(0);
    assert_eq!(got.raw, sent, "the stored message was disturbed");
    ack(&*t, &got.id).await;
    let _ = r.ack(&got.id).await;
    let _ = r.release(&got.id).await;
    expect_nothing(&*t, settle_wait(options), "the message was acked").await;
}
