//! Redis-specific behaviour of the transport, checked against the real
//! server in `ENVOI_REDIS_URL` by looking at what it stores.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::transport::{
    Browse, Delivery, DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown,
    Transport, WakeUp,
};
use envoi_core::{Headers, TransportError};
use envoi_redis::RedisTransport;
use redis::aio::MultiplexedConnection;
use redis::Value;

fn text(body: &str) -> RawMessage {
    RawMessage {
        body: body.as_bytes().to_vec(),
        headers: Headers::new(),
    }
}

fn body(d: &Delivery) -> String {
    String::from_utf8_lossy(&d.raw.body).into_owned()
}

/// Gets until `n` deliveries arrived (or panics after `within`).
async fn receive(t: &dyn Receiver, n: usize, within: Duration) -> Vec<Delivery> {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "received {} of {n} within {within:?}",
            out.len()
        );
        let left = deadline.saturating_duration_since(Instant::now());
        let got = common::within(left, &format!("{n} deliveries"), t.get(n - out.len())).await;
        out.extend(got.expect("get failed"));
    }
    out
}

async fn xlen(c: &mut MultiplexedConnection, stream: &str) -> i64 {
    redis::cmd("XLEN")
        .arg(stream)
        .query_async(c)
        .await
        .expect("XLEN")
}

/// `XPENDING <stream> <group>`'s count.
async fn pending(c: &mut MultiplexedConnection, t: &RedisTransport) -> i64 {
    let summary: Vec<Value> = redis::cmd("XPENDING")
        .arg(t.stream())
        .arg(&t.config().group)
        .query_async(c)
        .await
        .expect("XPENDING");
    match summary.first() {
        Some(Value::Int(n)) => *n,
        other => panic!("unexpected XPENDING summary {other:?}"),
    }
}

/// `(consumer, idle ms)` of a pending entry.
async fn pending_entry(
    c: &mut MultiplexedConnection,
    t: &RedisTransport,
    id: &str,
) -> Option<(String, i64)> {
    let rows: Vec<(String, String, i64, i64)> = redis::cmd("XPENDING")
        .arg(t.stream())
        .arg(&t.config().group)
        .arg(id)
        .arg(id)
        .arg(1)
        .query_async(c)
        .await
        .expect("XPENDING range");
    rows.into_iter()
        .next()
        .map(|(_, consumer, idle, _)| (consumer, idle))
}

async fn consumers(c: &mut MultiplexedConnection, t: &RedisTransport) -> Vec<String> {
    let rows: Vec<Vec<Value>> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(t.stream())
        .arg(&t.config().group)
        .query_async(c)
        .await
        .expect("XINFO CONSUMERS");
    rows.into_iter()
        .filter_map(|row| match row.get(1) {
            Some(Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        })
        .collect()
}

async fn acked_entries_leave_the_pending_list_and_are_trimmed_from_the_stream(url: String) {
    let t = common::transport(&url, &common::unique("acked"), "").await;
    t.setup().await.unwrap();
    let mut c = common::raw(&url).await;
    for i in 0..5 {
        t.send(text(&format!("m{i}")), None).await.unwrap();
    }
    assert_eq!(xlen(&mut c, t.stream()).await, 5);
    let got = receive(&t, 5, Duration::from_secs(10)).await;
    assert_eq!(
        pending(&mut c, &t).await,
        5,
        "handed out entries are pending"
    );
    let ids: Vec<DeliveryId> = got.iter().map(|d| d.id.clone()).collect();
    t.ack_batch(&ids[..3]).await.unwrap();
    t.reject(&ids[3]).await.unwrap();
    assert_eq!(
        xlen(&mut c, t.stream()).await,
        4,
        "a rejected entry stays in the stream"
    );
    t.ack(&ids[4]).await.unwrap();
    assert_eq!(pending(&mut c, &t).await, 0, "settled entries stay pending");
    assert_eq!(t.message_count().await.unwrap(), 0);
    assert!(
        t.list(10).await.unwrap().is_empty(),
        "settled entries are listed"
    );
    assert_eq!(t.trim_acknowledged().await.unwrap(), 4);
    assert_eq!(
        xlen(&mut c, t.stream()).await,
        0,
        "settled entries stay in the stream"
    );
    t.delete().await.unwrap();
}

async fn acking_an_entry_that_was_never_handed_out_leaves_it_alone(url: String) {
    let t = common::transport(&url, &common::unique("stray_ack"), "").await;
    t.setup().await.unwrap();
    let id = DeliveryId::from(t.send(text("waiting"), None).await.unwrap());
    t.ack(&id).await.unwrap();
    let got = receive(&t, 1, Duration::from_secs(10)).await;
    assert_eq!(got[0].id, id, "an ack of an undelivered entry deleted it");
    t.ack(&id).await.unwrap();
    t.delete().await.unwrap();
}

async fn delayed_messages_are_moved_exactly_once_by_competing_workers(url: String) {
    const N: usize = 300;
    const WORKERS: usize = 6;
    let name = common::unique("delay_race");
    let sender = common::transport(&url, &name, "lease=30s").await;
    sender.setup().await.unwrap();
    let start = Instant::now();
    let delay = Duration::from_millis(700);
    sender
        .send_batch(
            (0..N)
                .map(|i| (text(&format!("d{i}")), Some(delay)))
                .collect(),
        )
        .await
        .unwrap();
    assert_eq!(
        sender.message_count().await.unwrap(),
        N as u64,
        "delayed messages are counted"
    );
    let mut c = common::raw(&url).await;
    assert_eq!(
        xlen(&mut c, sender.stream()).await,
        0,
        "delayed messages reached the stream early"
    );

    let seen = Arc::new(std::sync::Mutex::new(Vec::<(String, Duration)>::new()));
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let t = common::transport(&url, &name, "lease=30s&block=50ms").await;
        let seen = Arc::clone(&seen);
        tasks.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(15);
            while seen.lock().unwrap().len() < N && Instant::now() < deadline {
                let got = t.get(25).await.expect("get failed");
                let ids: Vec<DeliveryId> = got.iter().map(|d| d.id.clone()).collect();
                let at = start.elapsed();
                seen.lock()
                    .unwrap()
                    .extend(got.iter().map(|d| (body(d), at)));
                t.ack_batch(&ids).await.expect("ack failed");
            }
        }));
    }
    for task in tasks {
        common::within(
            Duration::from_secs(30),
            "a consumer of delayed messages",
            task,
        )
        .await
        .expect("a worker panicked");
    }
    let seen = seen.lock().unwrap().clone();
    let mut bodies: Vec<String> = seen.iter().map(|(b, _)| b.clone()).collect();
    bodies.sort();
    let before = bodies.len();
    bodies.dedup();
    assert_eq!(
        before,
        bodies.len(),
        "a delayed message was moved (and handed out) twice"
    );
    assert_eq!(bodies.len(), N, "delayed messages were lost");
    for (b, at) in &seen {
        assert!(
            *at + Duration::from_millis(50) >= delay,
            "`{b}` arrived after {at:?}, before its delay"
        );
    }
    assert_eq!(sender.message_count().await.unwrap(), 0);
    sender.delete().await.unwrap();
}

async fn list_and_find_show_delayed_messages_by_the_id_send_returned(url: String) {
    let t = common::transport(&url, &common::unique("delayed_list"), "").await;
    t.setup().await.unwrap();
    let now_id = t.send(text("now"), None).await.unwrap();
    let later = RawMessage {
        body: vec![0, 1, 2, 255],
        headers: [("type".to_string(), "Later".to_string())]
            .into_iter()
            .collect(),
    };
    let later_id = DeliveryId::from(
        t.send(later.clone(), Some(Duration::from_secs(60)))
            .await
            .unwrap(),
    );
    assert_ne!(now_id, later_id.as_str());
    let listed = t.list(10).await.unwrap();
    let ids: Vec<&str> = listed.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        ids,
        [now_id.as_str(), later_id.as_str()],
        "stream entries first, then delayed ones"
    );
    assert_eq!(listed[1].raw, later);
    assert_eq!(t.list(1).await.unwrap().len(), 1);
    let found = t
        .find(&later_id)
        .await
        .unwrap()
        .expect("the delayed message is findable");
    assert_eq!(found.raw, later);
    assert_eq!(t.message_count().await.unwrap(), 2);
    t.delete().await.unwrap();
    assert_eq!(
        t.message_count().await.unwrap(),
        0,
        "delete left messages behind"
    );
    assert!(
        t.find(&later_id).await.unwrap().is_none(),
        "delete left the delayed payload"
    );
}

async fn release_keeps_the_entry_pending_and_hands_it_out_again_marked(url: String) {
    let t = common::transport(&url, &common::unique("release"), "lease=30s").await;
    t.setup().await.unwrap();
    let mut c = common::raw(&url).await;
    let sent = RawMessage {
        body: b"again".to_vec(),
        headers: [("attempt".to_string(), "1".to_string())]
            .into_iter()
            .collect(),
    };
    t.send(sent.clone(), None).await.unwrap();
    let first = receive(&t, 1, Duration::from_secs(10)).await.remove(0);
    assert!(!first.redelivered);
    t.release(&first.id).await.unwrap();
    assert!(
        matches!(t.release(&first.id).await, Err(TransportError::NotFound(_))),
        "releasing twice must fail as the first release gave it back"
    );
    assert_eq!(
        t.message_count().await.unwrap(),
        1,
        "release must give back, not add"
    );
    assert_eq!(
        pending(&mut c, &t).await,
        1,
        "the released entry left the group's pending list"
    );
    assert_eq!(xlen(&mut c, t.stream()).await, 1, "release added an entry");
    assert!(
        t.find(&first.id).await.unwrap().is_some(),
        "the released entry is not findable"
    );
    t.trim_acknowledged().await.unwrap();
    assert_eq!(
        xlen(&mut c, t.stream()).await,
        1,
        "the released entry was trimmed"
    );
    let second = receive(&t, 1, Duration::from_secs(5)).await.remove(0);
    assert_eq!(second.id, first.id, "the same entry comes back");
    assert_eq!(second.raw, sent);
    assert!(second.redelivered, "a released message comes back marked");
    let (owner, _) = pending_entry(&mut c, &t, second.id.as_str())
        .await
        .expect("pending again");
    assert_eq!(owner, t.consumer_name());
    t.ack(&second.id).await.unwrap();
    assert!(
        matches!(
            t.release(&second.id).await,
            Err(TransportError::NotFound(_))
        ),
        "releasing a settled message must not bring it back"
    );
    assert_eq!(t.message_count().await.unwrap(), 0);
    t.trim_acknowledged().await.unwrap();
    assert_eq!(xlen(&mut c, t.stream()).await, 0);
    t.delete().await.unwrap();
}

/// Another consumer group on the same stream (an audit log, say) sees each
/// entry sent once: envoi's releases are its own group's business.
async fn a_release_gives_the_message_back_to_envois_group_only(url: String) {
    let name = common::unique("release_groups");
    let envoi = common::transport(&url, &name, "lease=30s").await;
    envoi.setup().await.unwrap();
    let mut c = common::raw(&url).await;
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(envoi.stream())
        .arg("audit")
        .arg("0")
        .query_async(&mut c)
        .await
        .expect("XGROUP CREATE audit");
    let mut sent = Vec::new();
    for i in 0..3 {
        sent.push(envoi.send(text(&format!("m{i}")), None).await.unwrap());
    }
    let held = receive(&envoi, 2, Duration::from_secs(10)).await;
    envoi.release(&held[0].id).await.unwrap();
    envoi.release(&held[1].id).await.unwrap();
    let mut again = receive(&envoi, 3, Duration::from_secs(10)).await;
    again.sort_by_key(body);
    let bodies: Vec<String> = again.iter().map(body).collect();
    assert_eq!(bodies, ["m0", "m1", "m2"], "envoi's group lost a message");
    for d in &again {
        let released = held.iter().any(|h| h.id == d.id);
        assert_eq!(d.redelivered, released, "`{}`", body(d));
    }
    for d in &again {
        envoi.ack(&d.id).await.unwrap();
    }

    // What the other group reads: exactly the entries sent, once each.
    let read: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("audit")
        .arg("auditor")
        .arg("COUNT")
        .arg(100)
        .arg("STREAMS")
        .arg(envoi.stream())
        .arg(">")
        .query_async(&mut c)
        .await
        .expect("XREADGROUP audit");
    let ids = entry_ids(read);
    assert_eq!(ids, sent, "the other group saw released copies");
    envoi.delete().await.unwrap();
}

/// The ids of the entries of an `XREADGROUP` reply on one stream.
fn entry_ids(reply: Value) -> Vec<String> {
    let Value::Array(streams) = reply else {
        return Vec::new();
    };
    let mut ids = Vec::new();
    for stream in streams {
        let Value::Array(mut kv) = stream else {
            panic!("unexpected XREADGROUP reply {stream:?}");
        };
        let Some(Value::Array(entries)) = kv.pop() else {
            panic!("unexpected XREADGROUP reply");
        };
        for entry in entries {
            match entry {
                Value::Array(parts) => match parts.first() {
                    Some(Value::BulkString(id)) => {
                        ids.push(String::from_utf8_lossy(id).into_owned())
                    }
                    other => panic!("entry without an id: {other:?}"),
                },
                other => panic!("unexpected entry {other:?}"),
            }
        }
    }
    ids
}

async fn keepalive_resets_the_idle_time_of_the_pending_entry(url: String) {
    let t = common::transport(&url, &common::unique("keepalive"), "lease=30s").await;
    t.setup().await.unwrap();
    let mut c = common::raw(&url).await;
    t.send(text("slow"), None).await.unwrap();
    let held = receive(&t, 1, Duration::from_secs(10)).await.remove(0);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (owner, idle_before) = pending_entry(&mut c, &t, held.id.as_str())
        .await
        .expect("pending");
    assert_eq!(owner, t.consumer_name());
    assert!(
        idle_before >= 700,
        "idle time {idle_before} ms before keepalive"
    );
    t.keepalive(&held.id).await.unwrap();
    let (owner, idle_after) = pending_entry(&mut c, &t, held.id.as_str())
        .await
        .expect("still pending");
    assert_eq!(
        owner,
        t.consumer_name(),
        "keepalive moved the entry to another consumer"
    );
    assert!(
        idle_after < idle_before,
        "keepalive did not reset the idle time ({idle_after} ms)"
    );
    t.ack(&held.id).await.unwrap();
    assert!(
        matches!(
            t.keepalive(&held.id).await,
            Err(TransportError::NotFound(_))
        ),
        "keepalive of a settled message must fail"
    );
    t.delete().await.unwrap();
}

async fn a_consumer_whose_lease_expired_loses_the_message_to_the_claimer(url: String) {
    let name = common::unique("claimed");
    let a = common::transport(&url, &name, "lease=1s").await;
    let b = common::transport(&url, &name, "lease=1s").await;
    a.setup().await.unwrap();
    a.send(text("contested"), None).await.unwrap();
    let held = receive(&a, 1, Duration::from_secs(10)).await.remove(0);
    assert!(!held.redelivered, "handed out the first time");
    let again = receive(&b, 1, Duration::from_secs(10)).await.remove(0);
    assert_eq!(again.id, held.id, "XAUTOCLAIM hands over the same entry");
    assert!(again.redelivered, "the claimed entry is marked");
    assert!(
        matches!(
            a.keepalive(&held.id).await,
            Err(TransportError::NotFound(_))
        ),
        "the old holder's keepalive must not take the message back"
    );
    let mut c = common::raw(&url).await;
    let (owner, _) = pending_entry(&mut c, &b, held.id.as_str())
        .await
        .expect("pending");
    assert_eq!(owner, b.consumer_name());
    b.ack(&again.id).await.unwrap();
    a.delete().await.unwrap();
}

async fn trim_caps_the_stream_approximately(url: String) {
    let t = common::transport(&url, &common::unique("trim"), "trim=10").await;
    t.setup().await.unwrap();
    t.send_batch((0..1000).map(|i| (text(&format!("t{i}")), None)).collect())
        .await
        .unwrap();
    let mut c = common::raw(&url).await;
    let len = xlen(&mut c, t.stream()).await;
    assert!(
        (10..1000).contains(&len),
        "stream holds {len} entries with trim=10"
    );
    t.delete().await.unwrap();
}

async fn setup_creates_one_group_and_get_recreates_a_deleted_stream(url: String) {
    let t = common::transport(&url, &common::unique("setup"), "group=billing").await;
    t.setup().await.unwrap();
    t.setup().await.unwrap();
    let mut c = common::raw(&url).await;
    let groups: Vec<Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(t.stream())
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(groups.len(), 1, "setup created {} groups", groups.len());

    // Someone deletes the stream (and so the group) under a running consumer.
    let _: i64 = redis::cmd("DEL")
        .arg(t.stream())
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(t.get(1).await.unwrap().is_empty());
    t.send(text("after the purge"), None).await.unwrap();
    let got = receive(&t, 1, Duration::from_secs(10)).await;
    assert_eq!(body(&got[0]), "after the purge");
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
}

async fn entries_written_by_other_producers_arrive_with_their_fields_as_headers(url: String) {
    let t = common::transport(&url, &common::unique("foreign"), "").await;
    t.setup().await.unwrap();
    let mut c = common::raw(&url).await;
    let _: String = redis::cmd("XADD")
        .arg(t.stream())
        .arg("*")
        .arg("event")
        .arg("signup")
        .query_async(&mut c)
        .await
        .unwrap();
    let got = receive(&t, 1, Duration::from_secs(10)).await.remove(0);
    assert!(got.raw.body.is_empty());
    assert_eq!(got.raw.header("event"), Some("signup"));
    t.ack(&got.id).await.unwrap();
    t.delete().await.unwrap();
}

async fn a_delayed_payload_that_is_not_a_hash_is_handed_out_marked_and_holds_up_nothing(
    url: String,
) {
    let t = common::transport(&url, &common::unique("bad-delayed"), "").await;
    t.setup().await.unwrap();
    // Another program writes a due delayed id whose payload is a string.
    let mut c = common::raw(&url).await;
    let stream = t.stream();
    let _: i64 = redis::cmd("ZADD")
        .arg(format!("{stream}:delayed"))
        .arg(0)
        .arg("bogus")
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(format!("{stream}:delayed:bogus"))
        .arg("junk")
        .query_async(&mut c)
        .await
        .unwrap();
    t.send(text("later"), Some(Duration::from_millis(100)))
        .await
        .unwrap();

    let mut got = receive(&t, 2, Duration::from_secs(10)).await;
    got.sort_by_key(|d| d.raw.body.clone());
    assert_eq!(body(&got[0]), "junk");
    let reason = got[0]
        .raw
        .header(envoi_core::serializer::INVALID_HEADERS_HEADER)
        .unwrap_or_default();
    assert!(reason.contains("is a string, not a hash"), "{reason}");
    assert_eq!(
        body(&got[1]),
        "later",
        "the delayed message behind it moved"
    );
    for d in &got {
        t.ack(&d.id).await.unwrap();
    }
    assert_eq!(t.message_count().await.unwrap(), 0);
    t.delete().await.unwrap();
}

async fn a_blocking_read_does_not_hold_up_sends_on_the_same_handle(url: String) {
    let t = Arc::new(common::transport(&url, &common::unique("block"), "block=5s").await);
    t.setup().await.unwrap();
    // Make the first get skip straight to the read (no reclaim, no delays due).
    let reader = {
        let t = Arc::clone(&t);
        tokio::spawn(async move { t.get(1).await })
    };
    let mut c = common::raw(&url).await;
    // Wait until the read is blocked on the server, on its own connection.
    let blocking_name = t.client_names()[1].to_string();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut c)
            .await
            .unwrap();
        if list
            .lines()
            .any(|l| l.contains(&format!("name={blocking_name} ")) && l.contains("cmd=xreadgroup"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the read never blocked on `{blocking_name}`"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sent = tokio::time::timeout(Duration::from_secs(3), t.send(text("while blocked"), None))
        .await
        .expect("send waited for the blocking read")
        .map(DeliveryId::from)
        .unwrap();
    let got = reader.await.unwrap().unwrap();
    assert_eq!(
        got.len(),
        1,
        "the blocked read did not wake up for the new entry"
    );
    assert_eq!(got[0].id, sent);
    t.ack(&sent).await.unwrap();
    t.delete().await.unwrap();
}

async fn a_killed_connection_is_replaced_without_an_error(url: String) {
    let t = common::transport(&url, &common::unique("kill_once"), "").await;
    t.setup().await.unwrap();
    t.send(text("before"), None).await.unwrap();
    let mut c = common::raw(&url).await;
    let killed = kill_clients(&mut c, t.client_names()[0]).await;
    assert_eq!(killed, 1, "the shared connection was not found by its name");
    t.send(text("after"), None)
        .await
        .expect("a send after CLIENT KILL failed");
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(
        list.contains(&format!("name={} ", t.client_names()[0])),
        "the new connection is not named"
    );
    let got = receive(&t, 2, Duration::from_secs(10)).await;
    let ids: Vec<DeliveryId> = got.iter().map(|d| d.id.clone()).collect();
    t.ack_batch(&ids).await.unwrap();
    t.delete().await.unwrap();
}

/// Kills every client whose name is `name`; returns how many.
async fn kill_clients(c: &mut MultiplexedConnection, name: &str) -> usize {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(c)
        .await
        .unwrap();
    let mut killed = 0;
    for line in list
        .lines()
        .filter(|l| l.contains(&format!(" name={name} ")))
    {
        let Some(id) = line.split(' ').find_map(|f| f.strip_prefix("id=")) else {
            continue;
        };
        let n: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query_async(c)
            .await
            .unwrap();
        killed += n as usize;
    }
    killed
}

async fn pruning_deletes_idle_consumers_but_never_one_with_pending_entries(url: String) {
    let name = common::unique("prune");
    let holder = common::transport(&url, &name, "lease=30s").await;
    let idle = common::transport(&url, &name, "lease=30s&block=10ms").await;
    let pruner = common::transport(&url, &name, "lease=30s").await;
    holder.setup().await.unwrap();
    holder.send(text("held"), None).await.unwrap();
    holder.send(text("handled"), None).await.unwrap();
    let held = receive(&holder, 1, Duration::from_secs(10)).await.remove(0);
    // A consumer exists once it has been handed something; this one settles it.
    let handled = receive(&idle, 1, Duration::from_secs(10)).await.remove(0);
    idle.ack(&handled.id).await.unwrap();
    let mut c = common::raw(&url).await;
    let before = consumers(&mut c, &holder).await;
    assert!(
        before.contains(&idle.consumer_name().to_string()),
        "{before:?}"
    );

    assert_eq!(
        pruner
            .prune_idle_consumers(Duration::from_secs(3600))
            .await
            .unwrap(),
        0
    );
    let removed = pruner.prune_idle_consumers(Duration::ZERO).await.unwrap();
    let after = consumers(&mut c, &holder).await;
    assert_eq!(removed, 1, "consumers before {before:?}, after {after:?}");
    assert!(!after.contains(&idle.consumer_name().to_string()));
    assert!(
        after.contains(&holder.consumer_name().to_string()),
        "a consumer with a pending entry was deleted"
    );
    holder.ack(&held.id).await.unwrap();
    holder.delete().await.unwrap();
}

async fn count_list_and_find_skip_acked_entries_behind_a_pending_one(url: String) {
    let t = common::transport(&url, &common::unique("holes"), "lease=30s").await;
    t.setup().await.unwrap();
    let mut c = common::raw(&url).await;
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(DeliveryId::from(
            t.send(text(&format!("h{i}")), None).await.unwrap(),
        ));
    }
    let got = receive(&t, 4, Duration::from_secs(10)).await;
    assert_eq!(
        got.iter().map(|d| d.id.clone()).collect::<Vec<_>>(),
        ids[..4]
    );
    // Acked: 0, 2, 3. Pending: 1. Never handed out: 4, 5.
    t.ack_batch(&[ids[0].clone(), ids[2].clone(), ids[3].clone()])
        .await
        .unwrap();
    assert_eq!(t.message_count().await.unwrap(), 3);
    let listed: Vec<DeliveryId> = t
        .list(10)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(listed, [ids[1].clone(), ids[4].clone(), ids[5].clone()]);
    assert!(
        t.find(&ids[2]).await.unwrap().is_none(),
        "an acked entry is findable"
    );
    assert!(
        t.find(&ids[1]).await.unwrap().is_some(),
        "a pending entry is not findable"
    );
    assert!(
        t.find(&ids[5]).await.unwrap().is_some(),
        "a waiting entry is not findable"
    );
    // Only what precedes the oldest pending entry can go.
    assert_eq!(t.trim_acknowledged().await.unwrap(), 1);
    assert_eq!(xlen(&mut c, t.stream()).await, 5);
    t.ack(&ids[1]).await.unwrap();
    assert_eq!(t.trim_acknowledged().await.unwrap(), 3);
    assert_eq!(t.message_count().await.unwrap(), 2);
    t.delete().await.unwrap();
}

async fn trimming_keeps_what_another_group_has_not_read(url: String) {
    let name = common::unique("fanout");
    let billing = common::transport(&url, &name, "group=billing").await;
    let audit = common::transport(&url, &name, "group=audit").await;
    billing.setup().await.unwrap();
    audit.setup().await.unwrap();
    for i in 0..3 {
        billing.send(text(&format!("f{i}")), None).await.unwrap();
    }
    let got = receive(&billing, 3, Duration::from_secs(10)).await;
    let ids: Vec<DeliveryId> = got.iter().map(|d| d.id.clone()).collect();
    billing.ack_batch(&ids).await.unwrap();
    assert_eq!(
        billing.trim_acknowledged().await.unwrap(),
        0,
        "trimmed entries `audit` still needs"
    );
    assert_eq!(billing.message_count().await.unwrap(), 0);
    assert_eq!(audit.message_count().await.unwrap(), 3);
    let seen = receive(&audit, 3, Duration::from_secs(10)).await;
    assert_eq!(seen.iter().map(|d| d.id.clone()).collect::<Vec<_>>(), ids);
    audit.ack_batch(&ids).await.unwrap();
    assert_eq!(audit.trim_acknowledged().await.unwrap(), 3);
    billing.delete().await.unwrap();
}

async fn wait_for_messages_returns_at_once_after_a_blocking_get(url: String) {
    let t = common::transport(&url, &common::unique("wait"), "block=50ms").await;
    t.setup().await.unwrap();
    assert!(t.get(1).await.unwrap().is_empty());
    let started = Instant::now();
    t.wait_for_messages(Duration::from_secs(20)).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited {:?} although get already blocked",
        started.elapsed()
    );
    t.delete().await.unwrap();
}

/// Sends to `dsn` and expects [`TransportError::Unreachable`] within a few
/// seconds, naming the server with its password masked.
async fn expect_unreachable(dsn: &str, server: &str) {
    let t = RedisTransport::connect("unreachable", dsn)
        .await
        .expect("creating connects nothing");
    let started = Instant::now();
    let sent = tokio::time::timeout(Duration::from_secs(20), t.send(text("lost"), None))
        .await
        .expect("the send hung instead of failing within the connect timeout");
    let waited = started.elapsed();
    let error = sent.expect_err("a send to a server that cannot be reached succeeded");
    let text = error.to_string();
    match &error {
        TransportError::Unreachable { dsn, .. } => assert_eq!(dsn, server, "{text}"),
        other => panic!("expected Unreachable, got {other:?}"),
    }
    assert!(!text.contains("s3cret"), "the password leaked: {text}");
    assert!(text.contains(server), "{text}");
    assert!(
        waited < Duration::from_secs(6),
        "failed only after {waited:?}"
    );
}

async fn a_closed_port_is_unreachable_within_the_connect_timeout() {
    // Nothing listens on port 1: no server is needed.
    expect_unreachable(
        "redis://u:s3cret@127.0.0.1:1?connect_timeout=1s",
        "redis://u:***@127.0.0.1:1",
    )
    .await;
}

async fn a_server_that_never_answers_is_unreachable_within_the_connect_timeout() {
    // The kernel accepts the connection; nothing ever answers on it.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    expect_unreachable(
        &format!("redis://u:s3cret@127.0.0.1:{port}?connect_timeout=1s"),
        &format!("redis://u:***@127.0.0.1:{port}"),
    )
    .await;
    drop(silent);
}

async fn wait_for_messages_sleeps_after_a_failed_get() {
    // Nothing listens on port 1: every get fails at once.
    let t = RedisTransport::connect("unreachable", "redis://127.0.0.1:1")
        .await
        .unwrap();
    assert!(t.get(1).await.is_err(), "get from a closed port succeeded");
    let started = Instant::now();
    t.wait_for_messages(Duration::from_millis(300)).await;
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "returned after {:?}: callers would retry in a tight loop",
        started.elapsed()
    );
}

/// A large `get` that comes back full reads the next batch ahead; a smaller
/// `get` then hands out part of it and keeps the rest for the next one.
async fn entries_read_ahead_are_each_handed_out_once(url: String) {
    let t = common::transport(&url, &common::unique("ahead"), "block=100ms").await;
    t.setup().await.unwrap();
    let sent: Vec<String> = (0..350).map(|i| format!("m{i}")).collect();
    t.send_batch(sent.iter().map(|b| (text(b), None)).collect())
        .await
        .unwrap();
    let mut seen = Vec::new();
    for max in [100, 10, 100, 100, 100] {
        let got = t.get(max).await.unwrap();
        assert!(got.len() <= max);
        let ids: Vec<DeliveryId> = got.iter().map(|d| d.id.clone()).collect();
        t.ack_batch(&ids).await.unwrap();
        seen.extend(got.iter().map(body));
    }
    seen.extend(
        receive(&t, 350 - seen.len(), Duration::from_secs(10))
            .await
            .iter()
            .map(body),
    );
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), seen.len(), "an entry was handed out twice");
    assert_eq!(seen.len(), 350);
    t.delete().await.unwrap();
}

/// Entries a handle read ahead and never handed out are not lost with it:
/// another consumer claims them once their lease has passed.
async fn entries_read_ahead_by_a_dropped_handle_are_claimed_after_the_lease(url: String) {
    let name = common::unique("ahead_drop");
    let a = common::transport(&url, &name, "lease=1s&block=100ms").await;
    a.setup().await.unwrap();
    let sent: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    a.send_batch(sent.iter().map(|b| (text(b), None)).collect())
        .await
        .unwrap();
    let first = a.get(100).await.unwrap();
    assert_eq!(first.len(), 100);
    let ids: Vec<DeliveryId> = first.iter().map(|d| d.id.clone()).collect();
    a.ack_batch(&ids).await.unwrap();
    drop(a);

    let b = common::transport(&url, &name, "lease=1s&block=100ms").await;
    let rest = receive(&b, 100, Duration::from_secs(15)).await;
    let mut all: Vec<String> = first.iter().chain(&rest).map(body).collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 200);
    b.delete().await.unwrap();
}

/// Reads 200 entries into `a` (100 handed out and acked, 100 read ahead),
/// lets `give_back` close or drop it, and checks another handle gets the
/// 100 read ahead at once, long before their 30 s lease ran out.
async fn read_ahead_is_given_back(
    url: &str,
    tag: &str,
    give_back: impl AsyncFnOnce(RedisTransport),
) {
    let name = common::unique(tag);
    let a = common::transport(url, &name, "lease=30s&block=100ms").await;
    a.setup().await.unwrap();
    let sent: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    a.send_batch(sent.iter().map(|b| (text(b), None)).collect())
        .await
        .unwrap();
    let first = a.get(100).await.unwrap();
    assert_eq!(first.len(), 100, "a full get, which reads ahead");
    let ids: Vec<DeliveryId> = first.iter().map(|d| d.id.clone()).collect();
    a.ack_batch(&ids).await.unwrap();
    give_back(a).await;

    let b = common::transport(url, &name, "lease=30s&block=100ms").await;
    let rest = receive(&b, 100, Duration::from_secs(5)).await;
    assert!(
        rest.iter().all(|d| !d.redelivered),
        "entries never handed out are marked as redelivered"
    );
    let mut all: Vec<String> = first.iter().chain(&rest).map(body).collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 200);
    b.delete().await.unwrap();
}

async fn close_gives_back_the_entries_read_ahead_and_later_calls_fail(url: String) {
    read_ahead_is_given_back(&url, "close_ahead", async |a| {
        a.close().await.unwrap();
        a.close().await.expect("closing twice is fine");
        assert!(matches!(a.get(1).await, Err(TransportError::Closed)));
        assert!(matches!(
            a.send(text("late"), None).await,
            Err(TransportError::Closed)
        ));
    })
    .await;
}

async fn dropping_a_handle_gives_back_the_entries_read_ahead(url: String) {
    read_ahead_is_given_back(&url, "drop_ahead", async |a| drop(a)).await;
}

async fn a_rejected_entry_is_deleted_unless_another_group_still_needs_it(url: String) {
    let name = common::unique("reject");
    let billing = common::transport(&url, &name, "group=billing").await;
    let audit = common::transport(&url, &name, "group=audit").await;
    billing.setup().await.unwrap();
    audit.setup().await.unwrap();
    let mut c = common::raw(&url).await;
    for i in 0..2 {
        billing.send(text(&format!("r{i}")), None).await.unwrap();
    }
    let got = receive(&billing, 2, Duration::from_secs(10)).await;
    billing.reject(&got[0].id).await.unwrap();
    assert_eq!(
        xlen(&mut c, billing.stream()).await,
        2,
        "an entry `audit` has not read was deleted"
    );
    assert!(billing.find(&got[0].id).await.unwrap().is_none());
    assert_eq!(billing.message_count().await.unwrap(), 1);
    assert_eq!(audit.message_count().await.unwrap(), 2);

    let seen = receive(&audit, 2, Duration::from_secs(10)).await;
    assert_eq!(seen[0].id, got[0].id);
    audit.reject(&seen[0].id).await.unwrap();
    assert_eq!(
        xlen(&mut c, billing.stream()).await,
        1,
        "an entry every group rejected or acknowledged is still there"
    );
    // Rejecting what is not pending any more changes nothing.
    audit.reject(&seen[0].id).await.unwrap();
    billing.reject(&got[1].id).await.unwrap();
    assert_eq!(
        xlen(&mut c, billing.stream()).await,
        1,
        "an entry `audit` holds was deleted"
    );
    audit.ack(&seen[1].id).await.unwrap();
    assert_eq!(billing.message_count().await.unwrap(), 0);
    assert_eq!(audit.message_count().await.unwrap(), 0);
    billing.delete().await.unwrap();
}

async fn purge_deletes_waiting_leased_and_delayed_messages_and_says_how_many(url: String) {
    let name = common::unique("purge");
    let t = common::transport(&url, &name, "lease=30s").await;
    let audit = common::transport(&url, &name, "group=audit").await;
    t.setup().await.unwrap();
    audit.setup().await.unwrap();
    let mut c = common::raw(&url).await;
    for i in 0..3 {
        t.send(text(&format!("p{i}")), None).await.unwrap();
    }
    for i in 0..2 {
        t.send(text(&format!("d{i}")), Some(Duration::from_secs(60)))
            .await
            .unwrap();
    }
    let leased = receive(&t, 1, Duration::from_secs(10)).await;
    assert_eq!(t.message_count().await.unwrap(), 5);

    assert_eq!(t.purge().await.unwrap(), 5);
    assert_eq!(t.message_count().await.unwrap(), 0);
    assert!(t.list(10).await.unwrap().is_empty());
    assert_eq!(
        pending(&mut c, &t).await,
        0,
        "a leased entry is still pending"
    );
    assert!(matches!(
        t.release(&leased[0].id).await,
        Err(TransportError::NotFound(_))
    ));
    assert!(t.get(10).await.unwrap().is_empty());
    // Another group keeps the entries it has not read (the delayed messages,
    // not in the stream yet, are gone for every group).
    assert_eq!(audit.message_count().await.unwrap(), 3);
    assert_eq!(xlen(&mut c, t.stream()).await, 3);
    assert_eq!(t.purge().await.unwrap(), 0, "purging again");

    // The transport works on.
    let id = t.send(text("after"), None).await.unwrap();
    let got = receive(&t, 1, Duration::from_secs(10)).await;
    assert_eq!(got[0].id.as_str(), id);
    t.ack(&got[0].id).await.unwrap();
    t.delete().await.unwrap();
    t.delete().await.expect("deleting again is fine");
}

envoi_transport_tests::broker_tests! {
    needs = common::url, tests = [
        acked_entries_leave_the_pending_list_and_are_trimmed_from_the_stream,
        acking_an_entry_that_was_never_handed_out_leaves_it_alone,
        delayed_messages_are_moved_exactly_once_by_competing_workers,
        list_and_find_show_delayed_messages_by_the_id_send_returned,
        release_keeps_the_entry_pending_and_hands_it_out_again_marked,
        a_release_gives_the_message_back_to_envois_group_only,
        keepalive_resets_the_idle_time_of_the_pending_entry,
        a_consumer_whose_lease_expired_loses_the_message_to_the_claimer,
        trim_caps_the_stream_approximately,
        setup_creates_one_group_and_get_recreates_a_deleted_stream,
        entries_written_by_other_producers_arrive_with_their_fields_as_headers,
        a_delayed_payload_that_is_not_a_hash_is_handed_out_marked_and_holds_up_nothing,
        a_blocking_read_does_not_hold_up_sends_on_the_same_handle,
        a_killed_connection_is_replaced_without_an_error,
        pruning_deletes_idle_consumers_but_never_one_with_pending_entries,
        count_list_and_find_skip_acked_entries_behind_a_pending_one,
        trimming_keeps_what_another_group_has_not_read,
        wait_for_messages_returns_at_once_after_a_blocking_get,
        entries_read_ahead_are_each_handed_out_once,
        entries_read_ahead_by_a_dropped_handle_are_claimed_after_the_lease,
        a_rejected_entry_is_deleted_unless_another_group_still_needs_it,
        purge_deletes_waiting_leased_and_delayed_messages_and_says_how_many,
        close_gives_back_the_entries_read_ahead_and_later_calls_fail,
        dropping_a_handle_gives_back_the_entries_read_ahead,
    ];
    tests = [
        a_closed_port_is_unreachable_within_the_connect_timeout,
        a_server_that_never_answers_is_unreachable_within_the_connect_timeout,
        wait_for_messages_sleeps_after_a_failed_get,
    ];
}
