//! The broker taken away in the middle of a run: connections killed on the
//! server (`CLIENT KILL`), and the network cut for a while (a TCP proxy
//! between client and server that drops everything, then comes back). The
//! transport reconnects by itself and every message is still handled.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoi_core::transport::{
    DeliveryId, MessageCount, RawMessage, Receiver, Setup, Teardown, Transport,
};
use envoi_redis::RedisTransport;
use redis::aio::MultiplexedConnection;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

const N: usize = 600;
const BATCH: usize = 20;

fn message(seq: usize) -> RawMessage {
    RawMessage {
        body: format!("m{seq}").into_bytes(),
        headers: [("seq".to_string(), seq.to_string())].into_iter().collect(),
    }
}

/// Kills every client whose name starts with `prefix`; returns how many.
async fn kill_matching(c: &mut MultiplexedConnection, prefix: &str) -> usize {
    let Ok(list) = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async::<String>(c)
        .await
    else {
        return 0;
    };
    let mut killed = 0;
    for line in list.lines() {
        let named = line
            .split(' ')
            .find_map(|f| f.strip_prefix("name="))
            .is_some_and(|n| n.starts_with(prefix));
        let id = line.split(' ').find_map(|f| f.strip_prefix("id="));
        if let (true, Some(id)) = (named, id) {
            let n: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(id)
                .query_async(c)
                .await
                .unwrap_or(0);
            killed += usize::try_from(n).unwrap_or(0);
        }
    }
    killed
}

/// What one run saw.
struct Outcome {
    errors: usize,
    redeliveries: usize,
}

/// Sends `N` messages (every fifth batch delayed) through one handle while
/// two others consume and ack, all on the transport `name` reached through
/// `url`; `disrupt` runs meanwhile (it is told when sending is over).
/// Asserts every message was handled, every undelayed send id was handed
/// out, and the stream drains to empty.
async fn run_under_fire(
    url: &str,
    name: &str,
    disrupt: impl FnOnce(Arc<AtomicBool>) -> JoinHandle<()>,
) -> Outcome {
    let producer = Arc::new(common::transport(url, name, "lease=1s").await);
    let mut consumers: Vec<Arc<RedisTransport>> = Vec::new();
    for _ in 0..2 {
        consumers.push(Arc::new(
            common::transport(url, name, "lease=1s&block=100ms").await,
        ));
    }
    let setup_deadline = Instant::now() + Duration::from_secs(5);
    while let Err(e) = producer.setup().await {
        assert!(Instant::now() < setup_deadline, "setup failed: {e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let sent_ids = Arc::new(Mutex::new(BTreeSet::<String>::new()));
    let handled: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let handled_ids = Arc::new(Mutex::new(BTreeSet::<String>::new()));
    let errors = Arc::new(AtomicUsize::new(0));
    let sending = Arc::new(AtomicBool::new(true));
    let deadline = Instant::now() + Duration::from_secs(25);

    let disruptor = disrupt(Arc::clone(&sending));
    let produce = {
        let (producer, sent_ids, errors, sending) = (
            Arc::clone(&producer),
            Arc::clone(&sent_ids),
            Arc::clone(&errors),
            Arc::clone(&sending),
        );
        tokio::spawn(async move {
            for (round, start) in (0..N).step_by(BATCH).enumerate() {
                // Every fifth batch is delayed, to run the mover under fire too.
                let delay = (round % 5 == 4).then_some(Duration::from_millis(300));
                let batch: Vec<_> = (start..start + BATCH)
                    .map(|i| (message(i), delay))
                    .collect();
                loop {
                    assert!(Instant::now() < deadline, "sending did not finish");
                    match producer.send_batch(batch.clone()).await {
                        Ok(ids) => {
                            sent_ids.lock().unwrap().extend(ids);
                            break;
                        }
                        // An unacknowledged send is sent again: at least once.
                        Err(_) => {
                            errors.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(60)).await;
            }
            sending.store(false, Ordering::SeqCst);
        })
    };

    let consume: Vec<_> = consumers
        .iter()
        .map(|t| {
            let (t, handled, handled_ids, errors) = (
                Arc::clone(t),
                Arc::clone(&handled),
                Arc::clone(&handled_ids),
                Arc::clone(&errors),
            );
            tokio::spawn(async move {
                while handled.lock().unwrap().len() < N && Instant::now() < deadline {
                    let got = match t.get(BATCH).await {
                        Ok(got) => got,
                        Err(_) => {
                            errors.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                    };
                    let ids: Vec<DeliveryId> = got.iter().map(|d| d.id.clone()).collect();
                    {
                        let mut handled = handled.lock().unwrap();
                        for d in &got {
                            let seq = d.raw.header("seq").unwrap_or("?").to_string();
                            *handled.entry(seq).or_default() += 1;
                        }
                        handled_ids
                            .lock()
                            .unwrap()
                            .extend(ids.iter().map(|id| id.to_string()));
                    }
                    // A failed ack leaves the entries pending: they come back
                    // after the lease and are handled again.
                    if t.ack_batch(&ids).await.is_err() {
                        errors.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();

    common::within(Duration::from_secs(40), "the producer", produce)
        .await
        .expect("the producer panicked");
    common::within(Duration::from_secs(40), "the disruptor", disruptor)
        .await
        .expect("the disruptor panicked");
    for task in consume {
        common::within(Duration::from_secs(40), "a consumer", task)
            .await
            .expect("a consumer panicked");
    }

    let handled = handled.lock().unwrap().clone();
    let missing: Vec<usize> = (0..N)
        .filter(|i| !handled.contains_key(&i.to_string()))
        .collect();
    assert!(missing.is_empty(), "messages never handled: {missing:?}");
    assert_eq!(handled.len(), N, "unexpected messages: {handled:?}");
    let sent_ids = sent_ids.lock().unwrap().clone();
    let handled_ids = handled_ids.lock().unwrap().clone();
    // Delayed messages get their stream id when they are moved, so only
    // undelayed sends (stream ids, `<ms>-<seq>`) are matched by id.
    let unhandled: Vec<&String> = sent_ids
        .iter()
        .filter(|id| id.split('-').count() == 2)
        .filter(|id| !handled_ids.contains(*id))
        .collect();
    assert!(
        unhandled.is_empty(),
        "sent ids never handed out: {unhandled:?}"
    );

    // Whatever was handled but not acked (the ack was cut off), or stored
    // twice by a resent batch, comes back and is acked: the stream drains.
    let drain = &consumers[0];
    let drain_deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(got) = drain.get(BATCH).await {
            let ids: Vec<DeliveryId> = got.iter().map(|d| d.id.clone()).collect();
            let _ = drain.ack_batch(&ids).await;
        }
        if drain.message_count().await.ok() == Some(0) {
            break;
        }
        assert!(
            Instant::now() < drain_deadline,
            "messages left after the run"
        );
    }
    producer.delete().await.expect("delete");
    Outcome {
        errors: errors.load(Ordering::SeqCst),
        redeliveries: handled.values().map(|n| n - 1).sum(),
    }
}

async fn every_message_is_handled_when_connections_are_killed_mid_run(url: String) {
    let name = common::unique("reconnect_kill");
    let stream = common::transport(&url, &name, "")
        .await
        .stream()
        .to_string();
    // Every connection of every handle on this stream carries this prefix.
    let prefix = format!("envoi:{stream}:");
    let kills = Arc::new(AtomicUsize::new(0));
    let mut admin = common::raw(&url).await;
    let outcome = {
        let kills = Arc::clone(&kills);
        let prefix = prefix.clone();
        run_under_fire(&url, &name, move |sending| {
            tokio::spawn(async move {
                // Kill every connection of every handle, over and over, while
                // sends, blocking reads and acks are in flight.
                let mut rounds = 0;
                while sending.load(Ordering::SeqCst) && rounds < 12 {
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    kills.fetch_add(kill_matching(&mut admin, &prefix).await, Ordering::SeqCst);
                    rounds += 1;
                }
            })
        })
        .await
    };
    let kills = kills.load(Ordering::SeqCst);
    eprintln!(
        "CLIENT KILL run: {N} messages handled, {kills} connections killed, {} errors seen, {} redeliveries",
        outcome.errors, outcome.redeliveries
    );
    assert!(
        kills >= 6,
        "only {kills} connections were killed; the run proves nothing"
    );
}

/// A TCP proxy on 127.0.0.1 that can drop every connection and refuse
/// service for a while.
struct Proxy {
    port: u16,
    up: Arc<AtomicBool>,
    cut: broadcast::Sender<()>,
}

impl Proxy {
    async fn start(target: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let up = Arc::new(AtomicBool::new(true));
        let (cut, _) = broadcast::channel(4);
        let (accept_up, accept_cut) = (Arc::clone(&up), cut.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !accept_up.load(Ordering::SeqCst) {
                    continue; // dropped: the client sees the connection close
                }
                let mut cut = accept_cut.subscribe();
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.recv() => {}
                    }
                });
            }
        });
        Proxy { port, up, cut }
    }

    fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        let _ = self.cut.send(());
    }

    fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

async fn every_message_is_handled_across_a_network_outage(url: String) {
    let mut through = url::Url::parse(&url).expect("ENVOI_REDIS_URL is a URL");
    let target = format!(
        "{}:{}",
        through.host_str().unwrap_or("127.0.0.1"),
        through.port().unwrap_or(6379)
    );
    let proxy = Arc::new(Proxy::start(target).await);
    through.set_host(Some("127.0.0.1")).expect("set host");
    through.set_port(Some(proxy.port)).expect("set port");
    let name = common::unique("reconnect_outage");
    let outages = Arc::new(AtomicUsize::new(0));
    let outcome = {
        let (proxy, outages) = (Arc::clone(&proxy), Arc::clone(&outages));
        run_under_fire(through.as_str(), &name, move |_sending| {
            tokio::spawn(async move {
                // Two outages of 600 ms, a second apart, mid-run.
                for _ in 0..2 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    proxy.cut();
                    tokio::time::sleep(Duration::from_millis(600)).await;
                    proxy.restore();
                    outages.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .await
    };
    eprintln!(
        "network outage run: {N} messages handled, {} errors seen, {} redeliveries",
        outcome.errors, outcome.redeliveries
    );
    assert_eq!(outages.load(Ordering::SeqCst), 2);
    assert!(
        outcome.errors > 0,
        "the outages were never felt; the run proves nothing"
    );
}

envoi_transport_tests::broker_tests! {
    needs = common::url, tests = [
        every_message_is_handled_when_connections_are_killed_mid_run,
        every_message_is_handled_across_a_network_outage,
    ];
}
