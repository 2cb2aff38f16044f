//! The broker connection is lost in the middle of a run (closed from the
//! server side with `rabbitmqctl`, or cut by a TCP proxy between client and
//! server) and the run still handles every message.

mod common;

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoi_amqp::AmqpTransport;
use envoi_core::transport::{MessageCount, RawMessage, Receiver, Teardown, Transport};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use common::{unique, Within};

/// `common::dsn` with a 20 s reconnect timeout.
fn with_options(url: &str, options: &str) -> String {
    common::dsn(url, &format!("reconnect_timeout=20s&{options}"))
}

const MESSAGES: usize = 2000;
const BATCH: usize = 50;

#[derive(Default)]
struct Progress {
    sent: AtomicUsize,
    handled: Mutex<BTreeSet<usize>>,
    deliveries: AtomicUsize,
    settle_errors: AtomicUsize,
}

/// Sends `MESSAGES` numbered messages through `producer` (in batches, every
/// fifth batch message by message; slowly until the outage is over, so that
/// it hits the producer too) while `consumer` takes and acks them; calls
/// `outage` once a tenth has been handled. Returns when every message was
/// handled, and asserts that the outage hit a run in progress.
async fn run_through_outage<F, Fut>(producer: AmqpTransport, consumer: AmqpTransport, outage: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    let progress = Arc::new(Progress::default());
    let done = Arc::new(AtomicBool::new(false));
    let outage_over = Arc::new(AtomicBool::new(false));

    let sending: JoinHandle<AmqpTransport> = {
        let progress = Arc::clone(&progress);
        let outage_over = Arc::clone(&outage_over);
        tokio::spawn(async move {
            for (n, start) in (0..MESSAGES).step_by(BATCH).enumerate() {
                let batch: Vec<(RawMessage, Option<Duration>)> = (start..start + BATCH)
                    .map(|i| {
                        let raw = RawMessage {
                            body: i.to_string().into_bytes(),
                            headers: [("n".to_string(), i.to_string())].into_iter().collect(),
                        };
                        (raw, None)
                    })
                    .collect();
                if n % 5 == 4 {
                    for (raw, delay) in batch {
                        producer
                            .send(raw, delay)
                            .expect_within("a send through the outage")
                            .await;
                    }
                } else {
                    let ids = producer
                        .send_batch(batch)
                        .expect_within("a send_batch through the outage")
                        .await;
                    assert_eq!(ids.len(), BATCH);
                }
                progress.sent.fetch_add(BATCH, Ordering::SeqCst);
                let pause = if outage_over.load(Ordering::SeqCst) {
                    10
                } else {
                    250
                };
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            producer
        })
    };

    let consuming: JoinHandle<AmqpTransport> = {
        let progress = Arc::clone(&progress);
        let done = Arc::clone(&done);
        tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                let got = consumer
                    .get(100)
                    .expect_within("a get through the outage")
                    .await;
                let mut ids = Vec::with_capacity(got.len());
                for d in got {
                    let n: usize = std::str::from_utf8(&d.raw.body)
                        .ok()
                        .and_then(|b| b.parse().ok())
                        .unwrap_or_else(|| panic!("unexpected body {:?}", d.raw.body));
                    assert_eq!(d.raw.header("n"), Some(n.to_string().as_str()));
                    progress.handled.lock().unwrap().insert(n);
                    progress.deliveries.fetch_add(1, Ordering::SeqCst);
                    ids.push(d.id);
                }
                // Acks of deliveries from a connection that was lost fail:
                // the broker hands those messages out again.
                if consumer
                    .ack_batch(&ids)
                    .within("an ack_batch through the outage")
                    .await
                    .is_err()
                {
                    progress.settle_errors.fetch_add(1, Ordering::SeqCst);
                }
            }
            consumer
        })
    };

    let deadline = Instant::now() + Duration::from_secs(25);
    while progress.handled.lock().unwrap().len() < MESSAGES / 10 {
        assert!(Instant::now() < deadline, "the run did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    outage().within("the outage").await;
    outage_over.store(true, Ordering::SeqCst);
    let sent_after_outage = progress.sent.load(Ordering::SeqCst);
    assert!(
        sent_after_outage < MESSAGES,
        "the producer had finished before the outage was over; it did not hit the run"
    );
    loop {
        let handled = progress.handled.lock().unwrap().len();
        if handled == MESSAGES {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {handled} of {MESSAGES} messages were handled ({} sent)",
            progress.sent.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    done.store(true, Ordering::SeqCst);
    let producer = sending.expect_within("the producer").await;
    let consumer = consuming.expect_within("the consumer").await;
    assert!(
        producer.reconnections() >= 1,
        "the producer never reconnected"
    );
    assert!(
        consumer.reconnections() >= 1,
        "the consumer never reconnected"
    );
    let handled = progress.handled.lock().unwrap().clone();
    assert_eq!(handled, (0..MESSAGES).collect::<BTreeSet<_>>());
    eprintln!(
        "{} deliveries for {MESSAGES} messages, {} failed ack batches",
        progress.deliveries.load(Ordering::SeqCst),
        progress.settle_errors.load(Ordering::SeqCst)
    );
    // Nothing is left over: everything sent was acked exactly once in the end.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = consumer
            .message_count()
            .expect_within("message_count")
            .await;
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{left} messages left in the queue"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(producer);
    consumer.delete().expect_within("delete").await;
}

async fn rabbitmqctl(args: &[&str]) -> Option<String> {
    let output = tokio::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .within(format!("rabbitmqctl {args:?}"))
        .await
        .ok()?;
    assert!(
        output.status.success(),
        "rabbitmqctl {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The server's ids of the connections whose name contains `marker`.
async fn connections_named(marker: &str) -> Vec<String> {
    let list = rabbitmqctl(&["-q", "list_connections", "pid", "client_properties"])
        .await
        .expect("rabbitmqctl runs");
    list.lines()
        .filter(|line| line.contains(marker))
        .filter_map(|line| line.split_whitespace().next().map(str::to_string))
        .collect()
}

/// Closes the connections `pids` from the server, all at once.
async fn close_connections(pids: &[String]) {
    let closing = pids.iter().map(|pid| async move {
        rabbitmqctl(&["-q", "close_connection", pid, "envoi reconnect test"])
            .await
            .expect("rabbitmqctl runs")
    });
    futures_util::future::join_all(closing).await;
}

async fn connections_closed_by_the_server_mid_run_lose_no_message(url: String) {
    let test = "connections_closed_by_the_server_mid_run_lose_no_message";
    if rabbitmqctl(&["-q", "status"]).await.is_none() {
        eprintln!("skipped {test}: rabbitmqctl is not available");
        return;
    }
    let name = unique("amqp_server_close");
    let producer = AmqpTransport::connect(
        &name,
        &with_options(&url, &format!("connection_name={name}-producer")),
    )
    .expect_within("connect producer")
    .await;
    let consumer = AmqpTransport::connect(
        &name,
        &with_options(&url, &format!("connection_name={name}-consumer")),
    )
    .expect_within("connect consumer")
    .await;
    // Listed beforehand: `rabbitmqctl` takes seconds to start.
    let pids = connections_named(&name).await;
    assert_eq!(
        pids.len(),
        2,
        "the producer's and the consumer's connections: {pids:?}"
    );
    run_through_outage(producer, consumer, || close_connections(&pids)).await;
}

/// A TCP proxy on 127.0.0.1 in front of the broker that can cut every
/// connection and refuse new ones for a while.
struct Proxy {
    port: u16,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    refusing: Arc<AtomicBool>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .expect_within("bind proxy")
            .await;
        let port = listener.local_addr().expect("proxy address").port();
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let refusing = Arc::new(AtomicBool::new(false));
        let accept = {
            let connections = Arc::clone(&connections);
            let refusing = Arc::clone(&refusing);
            tokio::spawn(async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    if refusing.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let upstream = upstream.clone();
                    let task = tokio::spawn(async move {
                        if let Ok(mut server) = TcpStream::connect(&upstream).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    connections.lock().unwrap().push(task);
                }
            })
        };
        Proxy {
            port,
            connections,
            refusing,
            accept,
        }
    }

    /// Drops every proxied connection and refuses new ones for `down`.
    async fn cut(&self, down: Duration) -> usize {
        self.refusing.store(true, Ordering::SeqCst);
        let cut: Vec<_> = self.connections.lock().unwrap().drain(..).collect();
        let live = cut.iter().filter(|t| !t.is_finished()).count();
        for task in cut {
            task.abort();
        }
        tokio::time::sleep(down).await;
        self.refusing.store(false, Ordering::SeqCst);
        live
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        for task in self.connections.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

/// `amqp://user:pass@host:port/vhost?query` → (`host:port`, the same URL
/// pointing at 127.0.0.1:`port`).
fn redirect(url: &str, port: u16) -> (String, String) {
    let (scheme, rest) = url.split_once("://").expect("URL has a scheme");
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:5672")
    };
    (
        hostport,
        format!("{scheme}://{userinfo}127.0.0.1:{port}{tail}"),
    )
}

async fn connections_cut_by_a_proxy_mid_run_lose_no_message(url: String) {
    let (upstream, _) = redirect(&url, 0);
    let proxy = Proxy::start(upstream).await;
    let (_, proxied) = redirect(&url, proxy.port);
    let name = unique("amqp_proxy_cut");
    let producer = AmqpTransport::connect(&name, &with_options(&proxied, ""))
        .expect_within("connect producer")
        .await;
    let consumer = AmqpTransport::connect(&name, &with_options(&proxied, ""))
        .expect_within("connect consumer")
        .await;
    run_through_outage(producer, consumer, || async {
        let cut = proxy.cut(Duration::from_millis(1500)).await;
        assert!(cut >= 2, "the proxy cut {cut} live connections");
    })
    .await;
}

fn redirect_points_the_url_at_the_proxy() {
    let (upstream, proxied) = redirect("amqp://guest:guest@10.0.0.1:5673/%2f?heartbeat=5", 4000);
    assert_eq!(upstream, "10.0.0.1:5673");
    assert_eq!(proxied, "amqp://guest:guest@127.0.0.1:4000/%2f?heartbeat=5");
    let (upstream, proxied) = redirect("amqp://broker/vh", 4001);
    assert_eq!(upstream, "broker:5672");
    assert_eq!(proxied, "amqp://127.0.0.1:4001/vh");
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_AMQP_URL", tests = [
        connections_closed_by_the_server_mid_run_lose_no_message,
        connections_cut_by_a_proxy_mid_run_lose_no_message,
    ];
    tests = [
        redirect_points_the_url_at_the_proxy: sync,
    ];
}
