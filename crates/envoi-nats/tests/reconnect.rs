//! The connection to the server is cut mid-run and restored: every message
//! is still handled, and acknowledgements lost with the connection are
//! sent again.
//!
//! The server keeps running (other tests use it); instead the clients talk to
//! it through a TCP proxy on 127.0.0.1 that these tests run, cut (closing
//! every proxied connection and refusing new ones), black-hole (keeping the
//! connections but dropping what the clients send) and restore.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{unique_name, with_options};
use envoi_core::transport::{
    DeliveryId, MessageCount, RawMessage, Receiver, Setup, Teardown, Transport,
};
use envoi_nats::NatsTransport;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A TCP proxy that can be cut, black-holed and restored.
struct Proxy {
    addr: SocketAddr,
    up: Arc<AtomicBool>,
    /// Whether what the clients send is passed on (or dropped).
    forwarding: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    acceptor: JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let up = Arc::new(AtomicBool::new(true));
        let forwarding = Arc::new(AtomicBool::new(true));
        let accepted = Arc::new(AtomicUsize::new(0));
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let acceptor = tokio::spawn({
            let (up, accepted, links) = (up.clone(), accepted.clone(), links.clone());
            let forwarding = forwarding.clone();
            async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    if !up.load(Ordering::SeqCst) {
                        // Down: the connection is closed at once.
                        drop(inbound);
                        continue;
                    }
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let link = tokio::spawn(link(inbound, upstream, forwarding.clone()));
                    links.lock().unwrap().push(link);
                }
            }
        });
        Proxy {
            addr,
            up,
            forwarding,
            accepted,
            links,
            acceptor,
        }
    }

    /// A proxy to the server at `url`, and the DSN through it with
    /// `options`.
    async fn to(url: &str, options: &str) -> (Proxy, String) {
        let mut through_proxy = url::Url::parse(url).expect("ENVOI_NATS_URL is a URL");
        let upstream = tokio::net::lookup_host((
            through_proxy.host_str().expect("host").to_string(),
            through_proxy.port().unwrap_or(4222),
        ))
        .await
        .expect("resolve the server")
        .next()
        .expect("an address");
        let proxy = Proxy::start(upstream).await;
        through_proxy.set_host(Some("127.0.0.1")).expect("host");
        through_proxy
            .set_port(Some(proxy.addr.port()))
            .expect("port");
        let proxied = with_options(through_proxy.as_str(), options);
        (proxy, proxied)
    }

    /// Closes every proxied connection and refuses new ones.
    fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    /// Keeps every connection open but drops what the clients send.
    fn black_hole(&self) {
        self.forwarding.store(false, Ordering::SeqCst);
    }

    fn restore(&self) {
        self.forwarding.store(true, Ordering::SeqCst);
        self.up.store(true, Ordering::SeqCst);
    }

    fn connections(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }
}

/// One proxied connection: the server's bytes go to the client; the
/// client's go to the server while `forwarding`, and are dropped
/// otherwise. Aborting the task closes both sockets.
async fn link(inbound: TcpStream, upstream: SocketAddr, forwarding: Arc<AtomicBool>) {
    let Ok(outbound) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_reads, mut client_writes) = inbound.into_split();
    let (mut server_reads, mut server_writes) = outbound.into_split();
    let up = async {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            match client_reads.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) if forwarding.load(Ordering::SeqCst) => {
                    if server_writes.write_all(&buffer[..n]).await.is_err() {
                        break;
                    }
                }
                Ok(_) => {}
            }
        }
    };
    let down = tokio::io::copy(&mut server_reads, &mut client_writes);
    tokio::select! {
        () = up => {}
        _ = down => {}
    }
}

const MESSAGES: usize = 400;

fn message(i: usize) -> RawMessage {
    RawMessage {
        body: format!("message-{i}").into_bytes(),
        headers: [("type".to_string(), "Tick".to_string())].into(),
    }
}

fn index(raw: &RawMessage) -> usize {
    std::str::from_utf8(&raw.body)
        .ok()
        .and_then(|s| s.strip_prefix("message-"))
        .and_then(|i| i.parse().ok())
        .expect("a message sent by this test")
}

async fn every_message_is_handled_when_the_connection_is_cut_mid_run(url: String) {
    let name = unique_name("reconnect");
    let options = "lease=1s&wait=100ms";

    // A direct handle for setup, checks and clean-up.
    let direct = NatsTransport::connect(&name, &with_options(&url, options))
        .await
        .expect("connect directly");
    direct.setup().await.expect("setup");

    let (proxy, proxied) = Proxy::to(&url, options).await;

    let producer = NatsTransport::connect(&name, &proxied)
        .await
        .expect("producer");
    let consumers = [
        NatsTransport::connect(&name, &proxied)
            .await
            .expect("consumer 1"),
        NatsTransport::connect(&name, &proxied)
            .await
            .expect("consumer 2"),
    ];
    let initial_connections = proxy.connections();

    let deadline = Instant::now() + Duration::from_secs(25);
    let handled: Arc<Mutex<BTreeSet<usize>>> = Arc::default();
    let send_failures = Arc::new(AtomicUsize::new(0));

    let producing = tokio::spawn({
        let send_failures = send_failures.clone();
        async move {
            for chunk in (0..MESSAGES).collect::<Vec<_>>().chunks(10) {
                let batch: Vec<_> = chunk.iter().map(|i| (message(*i), None)).collect();
                // A send that fails is sent again: at least once.
                while let Err(error) = producer.send_batch(batch.clone()).await {
                    send_failures.fetch_add(1, Ordering::SeqCst);
                    assert!(
                        Instant::now() < deadline,
                        "sending never recovered: {error}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
        }
    });

    let consuming: Vec<_> = consumers
        .into_iter()
        .map(|consumer| {
            let handled = handled.clone();
            tokio::spawn(async move {
                let mut errors = 0usize;
                while handled.lock().unwrap().len() < MESSAGES && Instant::now() < deadline {
                    match consumer.get(10).await {
                        Ok(deliveries) => {
                            let ids: Vec<DeliveryId> =
                                deliveries.iter().map(|d| d.id.clone()).collect();
                            {
                                let mut handled = handled.lock().unwrap();
                                for delivery in &deliveries {
                                    handled.insert(index(&delivery.raw));
                                }
                            }
                            // A lost ack only means the message comes back.
                            if consumer.ack_batch(&ids).await.is_err() {
                                errors += 1;
                            }
                        }
                        Err(_) => {
                            errors += 1;
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
                errors
            })
        })
        .collect();

    // Cut mid-run, stay down for a while, come back.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let before_cut = handled.lock().unwrap().len();
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proxy.restore();

    producing.await.expect("producer");
    let mut consumer_errors = 0;
    for task in consuming {
        consumer_errors += task.await.expect("consumer");
    }

    let handled = handled.lock().unwrap().clone();
    let missing: Vec<usize> = (0..MESSAGES).filter(|i| !handled.contains(i)).collect();
    assert!(missing.is_empty(), "never handled: {missing:?}");
    assert!(
        before_cut < MESSAGES,
        "the cut came after the run ({before_cut} handled before it)"
    );
    assert!(
        proxy.connections() > initial_connections,
        "the clients never reconnected ({} connections)",
        proxy.connections()
    );
    eprintln!(
        "reconnect: {before_cut} handled before the cut, {} send retries, {consumer_errors} consumer errors, {} connections",
        send_failures.load(Ordering::SeqCst),
        proxy.connections()
    );

    // Duplicates from lost acks come back after the lease; drain them.
    // Nothing else may be left.
    let drain_deadline = Instant::now() + Duration::from_secs(10);
    while direct.message_count().await.expect("count") > 0 && Instant::now() < drain_deadline {
        let deliveries = direct.get(50).await.expect("drain");
        for delivery in &deliveries {
            assert!(handled.contains(&index(&delivery.raw)));
        }
        let ids: Vec<DeliveryId> = deliveries.into_iter().map(|d| d.id).collect();
        direct.ack_batch(&ids).await.expect("ack");
    }
    assert_eq!(direct.message_count().await.expect("count"), 0);
    direct.delete().await.expect("delete stream");
}

/// Acknowledgements written to a connection that turns out dead (the
/// server never got them) are sent again once the client has reconnected:
/// `ack_batch` returns when the server has them, and the messages are gone
/// long before their lease could bring them back.
async fn acks_lost_with_the_connection_are_sent_again_after_reconnecting(url: String) {
    for options in [
        "lease=30s&wait=100ms",
        "lease=30s&wait=100ms&double_ack=true",
    ] {
        let name = unique_name("lost-acks");
        let direct = NatsTransport::connect(&name, &with_options(&url, options))
            .await
            .expect("connect directly");
        direct.setup().await.expect("setup");
        let batch = (0..5).map(|i| (message(i), None)).collect();
        direct.send_batch(batch).await.expect("send");

        let (proxy, proxied) = Proxy::to(&url, options).await;
        let consumer = NatsTransport::connect(&name, &proxied)
            .await
            .expect("connect through the proxy");
        let got = common::get_n(&consumer, 5, Duration::from_secs(10)).await;
        assert_eq!(got.len(), 5, "{options}: fetched {} of 5", got.len());
        let ids: Vec<DeliveryId> = got.into_iter().map(|d| d.id).collect();

        // The acks go into the black hole; then the connection dies and
        // the client reconnects.
        proxy.black_hole();
        let acking = tokio::spawn({
            let consumer = consumer.clone();
            async move { consumer.ack_batch(&ids).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        proxy.cut();
        tokio::time::sleep(Duration::from_millis(300)).await;
        proxy.restore();
        tokio::time::timeout(Duration::from_secs(20), acking)
            .await
            .unwrap_or_else(|_| panic!("{options}: ack_batch never returned after reconnecting"))
            .expect("the acking task")
            .unwrap_or_else(|e| panic!("{options}: ack_batch failed: {e}"));

        // Well within the 30 s lease, the server has applied every ack.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut left = direct.message_count().await.expect("count");
        while left > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            left = direct.message_count().await.expect("count");
        }
        assert_eq!(
            left, 0,
            "{options}: {left} acks were lost with the connection (their messages wait for the lease)"
        );
        assert!(
            proxy.connections() > 1,
            "{options}: the consumer never reconnected"
        );
        direct.delete().await.expect("delete the stream");
    }
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_NATS_URL", tests = [
        every_message_is_handled_when_the_connection_is_cut_mid_run: multi_thread(4),
        acks_lost_with_the_connection_are_sent_again_after_reconnecting,
    ];
}
