//! Connection loss mid-run: the server kills every connection of the
//! transport (found by their `application_name`) several times while
//! messages are sent and consumed; every message is still handled.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{admin, body, connections, open, text, unique, wait_for_listener};
use envoi_core::transport::{Browse, RawMessage, Receiver, Teardown, Transport};
use envoi_postgres::sqlx;

const MESSAGES: usize = 2000;
const KILLS: usize = 5;
/// Kill rounds the last message waits for, so that they surely happen
/// while messages are being sent.
const KILLS_WHILE_SENDING: usize = 2;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Terminates every backend named `app`; returns (killed, of which listening).
async fn kill_all(admin: &sqlx::PgPool, app: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)), \
                count(*) FILTER (WHERE query ILIKE 'LISTEN%') \
         FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(app)
    .fetch_one(admin)
    .await
    .unwrap_or_else(|e| panic!("pg_terminate_backend failed: {e}"))
}

async fn every_message_is_handled_when_the_server_kills_the_connections_mid_run(url: String) {
    let name = unique("reconnect");
    let app = unique("envoi_reconnect");
    let options = format!(
        "table=envoi_test_messages&lease=2s&wait=200ms&poll=200ms&max_connections=4&application_name={app}"
    );
    let producer = open(&name, &url, &options).await;
    let consumer = open(&name, &url, &options).await;
    let admin = admin(&url).await;

    // Sent bodies (sequence numbers) and their ids, as `send` reported them.
    let sent: Arc<Mutex<BTreeMap<usize, String>>> = Arc::default();
    // Handled messages: body -> ids it was handed out under, acked.
    let handled: Arc<Mutex<BTreeMap<usize, BTreeSet<String>>>> = Arc::default();
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let kill_rounds = Arc::new(AtomicUsize::new(0));

    let producing = {
        let (sent, errors) = (Arc::clone(&sent), Arc::clone(&errors));
        let kill_rounds = Arc::clone(&kill_rounds);
        tokio::spawn(async move {
            let mut next = 0;
            while next < MESSAGES {
                if next + 1 == MESSAGES {
                    // The last one waits for the kills that must find
                    // sending under way (the assertion below says so if
                    // they never come).
                    let waiting = Instant::now();
                    while kill_rounds.load(Ordering::SeqCst) < KILLS_WHILE_SENDING
                        && waiting.elapsed() < Duration::from_secs(30)
                    {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                // Alternate single sends and batches of 25; the last
                // message alone.
                let size = if next.is_multiple_of(50) {
                    1
                } else {
                    25.min(MESSAGES - 1 - next).max(1)
                };
                let batch: Vec<(RawMessage, Option<std::time::Duration>)> = (next..next + size)
                    .map(|i| (text(&i.to_string()), None))
                    .collect();
                let result = if size == 1 {
                    producer
                        .send(batch[0].0.clone(), None)
                        .await
                        .map(|id| vec![id])
                } else {
                    producer.send_batch(batch).await
                };
                match result {
                    Ok(ids) => {
                        let mut sent = lock(&sent);
                        for (i, id) in ids.into_iter().enumerate() {
                            sent.insert(next + i, id);
                        }
                        next += size;
                    }
                    // Not acknowledged: send it again.
                    Err(e) => {
                        lock(&errors).push(format!("send: {e}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };

    let consumers: Vec<_> = (0..3)
        .map(|_| {
            let consumer = consumer.clone();
            let (handled, errors) = (Arc::clone(&handled), Arc::clone(&errors));
            let sent_count = Arc::clone(&sent);
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(25);
                while Instant::now() < deadline {
                    let done = {
                        let h = lock(&handled);
                        h.len() == MESSAGES && lock(&sent_count).len() == MESSAGES
                    };
                    if done {
                        break;
                    }
                    let got = match consumer.get(20).await {
                        Ok(got) => got,
                        Err(e) => {
                            lock(&errors).push(format!("get: {e}"));
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    if got.is_empty() {
                        continue;
                    }
                    // Handled = acked; an unacked batch comes back after the lease.
                    match consumer.ack_batch(&common::ids(&got)).await {
                        Ok(()) => {
                            let mut h = lock(&handled);
                            for d in &got {
                                let seq: usize = body(d).parse().expect("a foreign body");
                                h.entry(seq).or_default().insert(d.id.to_string());
                            }
                        }
                        Err(e) => lock(&errors).push(format!("ack: {e}")),
                    }
                }
            })
        })
        .collect();

    // Kill everything the transport holds, several times, while it works.
    assert!(
        wait_for_listener(&admin, &app, Duration::from_secs(10)).await,
        "the listener never connected"
    );
    let (mut killed, mut listeners_killed, mut mid_run) = (0, 0, 0);
    for _ in 0..KILLS {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let (k, l) = kill_all(&admin, &app).await;
        killed += k;
        listeners_killed += l;
        if lock(&sent).len() < MESSAGES {
            mid_run += 1;
        }
        kill_rounds.fetch_add(1, Ordering::SeqCst);
    }
    common::within(Duration::from_secs(60), "the producer", producing)
        .await
        .expect("the producer panicked");
    for c in consumers {
        common::within(Duration::from_secs(60), "a consumer", c)
            .await
            .expect("a consumer panicked");
    }

    let sent = lock(&sent).clone();
    let handled = lock(&handled).clone();
    let errors = lock(&errors).clone();
    eprintln!(
        "killed {killed} connections ({listeners_killed} listening) in {KILLS} rounds, \
         {mid_run} while sending; \
         {} errors surfaced: {:?}",
        errors.len(),
        errors.iter().take(5).collect::<Vec<_>>()
    );
    assert!(
        killed >= KILLS as i64,
        "only {killed} connections were killed"
    );
    assert!(
        listeners_killed >= 1,
        "the listener connection was never killed"
    );
    assert!(
        mid_run >= 2,
        "only {mid_run} kills happened while messages were being sent"
    );
    assert_eq!(sent.len(), MESSAGES, "not every message was sent");
    let missing: Vec<usize> = (0..MESSAGES).filter(|i| !handled.contains_key(i)).collect();
    assert!(
        missing.is_empty(),
        "{} of {MESSAGES} messages never handled, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    // Counted by id: every id `send` returned was handed out and acked.
    let handled_ids: BTreeSet<&String> = handled.values().flatten().collect();
    for (seq, id) in &sent {
        assert!(
            handled_ids.contains(id),
            "message {seq} (id {id}) was never acked"
        );
    }
    // What is left can only be a second copy of a handled message (a send
    // whose connection died after its commit is retried: at least once).
    let left = consumer.list(MESSAGES).await.unwrap();
    for d in &left {
        let seq: usize = body(d).parse().expect("a foreign body");
        assert!(
            handled.contains_key(&seq),
            "message {seq} is left unhandled"
        );
        assert!(
            !sent.values().any(|id| id.as_str() == d.id.as_str()),
            "acked id {} is still stored",
            d.id
        );
    }
    consumer.purge().await.unwrap();
    // The listener came back after the last kill.
    assert!(
        wait_for_listener(&admin, &app, Duration::from_secs(10)).await,
        "the listener did not reconnect: {:?}",
        connections(&admin, &app).await
    );
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_POSTGRES_URL", tests = [
        every_message_is_handled_when_the_server_kills_the_connections_mid_run,
    ];
}
