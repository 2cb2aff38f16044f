//! Behaviour specific to the RabbitMQ transport: DSN errors, topology,
//! delay queues, dead-lettering, idle consumers, header limits.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_amqp::{AmqpError, AmqpTransport, AmqpTransportFactory};
use envoi_core::transport::{
    DeliveryId, MessageCount, RawMessage, Receiver, Setup, Teardown, Transport, TransportFactory,
};
use envoi_core::{Headers, TransportError};
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

use common::{dsn, receive, unique, Within};

fn message(body: &str, headers: &[(&str, &str)]) -> RawMessage {
    RawMessage {
        body: body.as_bytes().to_vec(),
        headers: headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

async fn raw_connection(url: &str) -> Connection {
    Connection::connect(url, ConnectionProperties::default())
        .expect_within("a raw connection")
        .await
}

/// How many messages are ready in `queue`, by a passive declare.
async fn ready_count(connection: &Connection, queue: &str) -> u32 {
    let channel = connection.create_channel().expect_within("channel").await;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .expect_within(format!("a passive declare of `{queue}`"))
        .await
        .message_count()
}

/// Takes one message from `queue` with `basic.get` (auto-ack), if any.
async fn take_one(connection: &Connection, queue: &str) -> Option<Vec<u8>> {
    let channel = connection.create_channel().expect_within("channel").await;
    let got = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .expect_within(format!("basic.get on `{queue}`"))
        .await;
    got.map(|m| m.delivery.data)
}

async fn bad_dsn_gives_invalid_dsn_with_the_password_masked() {
    let factory = AmqpTransportFactory;
    for dsn in [
        "amqp://user:s3cret@127.0.0.1:5672/%2f?prefetch=none",
        "amqp://user:s3cret@127.0.0.1:5672/%2f?unknown=1",
        "amqp://user:s3cret@127.0.0.1:notaport/%2f",
    ] {
        match factory
            .create("bad", dsn)
            .within("refusing a bad DSN")
            .await
        {
            Err(TransportError::InvalidDsn { dsn: shown, reason }) => {
                assert!(shown.contains("user:***@"), "DSN not masked: {shown}");
                assert!(!shown.contains("s3cret") && !reason.contains("s3cret"));
            }
            other => panic!("`{dsn}` gave {other:?}, expected InvalidDsn"),
        }
    }
    let long = "n".repeat(300);
    assert!(matches!(
        AmqpTransport::connect(&long, "amqp://127.0.0.1/%2f")
            .within("refusing a long name")
            .await,
        Err(TransportError::InvalidDsn { .. })
    ));
}

/// Connects to `dsn`, which names a broker that cannot answer, and checks
/// that the connect gives up within a few seconds of its 1 s
/// `connect_timeout` (not the 30 s `reconnect_timeout`) with
/// `Unreachable`, naming the DSN without its password.
async fn assert_unreachable_within_the_connect_timeout(dsn: &str) -> String {
    let started = Instant::now();
    let result = AmqpTransport::connect("nowhere", dsn)
        .within(format!("a connect to `{dsn}`"))
        .await;
    let waited = started.elapsed();
    let error = match result {
        Err(error @ TransportError::Unreachable { .. }) => error,
        other => panic!("expected Unreachable, got {other:?}"),
    };
    let text = error.to_string();
    let TransportError::Unreachable { dsn: shown, .. } = &error else {
        unreachable!()
    };
    assert!(
        shown.contains("u:***@127.0.0.1:"),
        "DSN not masked: {shown}"
    );
    assert!(!text.contains("s3cret"), "password shown: {text}");
    assert!(
        !format!("{error:?}").contains("s3cret"),
        "password in {error:?}"
    );
    assert!(
        waited < Duration::from_secs(10),
        "gave up after {waited:?} with a 1 s connect_timeout"
    );
    text
}

async fn a_closed_port_is_unreachable_within_the_connect_timeout() {
    let text = assert_unreachable_within_the_connect_timeout(
        "amqp://u:s3cret@127.0.0.1:1/%2f?connect_timeout=1s",
    )
    .await;
    assert!(text.contains("127.0.0.1:1"), "{text}");
}

async fn a_port_that_never_answers_is_unreachable_within_the_connect_timeout() {
    // The kernel accepts the TCP connection; nothing ever speaks AMQP.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a silent port");
    let port = silent.local_addr().expect("its address").port();
    let text = assert_unreachable_within_the_connect_timeout(&format!(
        "amqp://u:s3cret@127.0.0.1:{port}/%2f?connect_timeout=1s"
    ))
    .await;
    assert!(text.contains("within"), "{text}");
    drop(silent);
}

async fn delayed_message_waits_in_a_ttl_queue_and_comes_back_with_its_own_headers(url: String) {
    let name = unique("amqp_delay");
    let t = AmqpTransport::connect(&name, &dsn(&url, "lease=2s"))
        .expect_within("connect")
        .await;
    t.setup().expect_within("setup").await;
    let sent = message("{\"later\":true}", &[("type", "Later"), ("n", "1")]);
    let start = Instant::now();
    t.send(sent.clone(), Some(Duration::from_millis(700)))
        .expect_within("delayed send")
        .await;

    // The message waits in `<queue>.delay.700`, not in the queue.
    let raw = raw_connection(&url).await;
    assert_eq!(ready_count(&raw, &format!("{name}.delay.700")).await, 1);
    assert_eq!(t.message_count().expect_within("count").await, 1);

    let got = receive(&t, 1, Duration::from_secs(10)).await;
    assert!(
        start.elapsed() >= Duration::from_millis(650),
        "arrived after {:?}",
        start.elapsed()
    );
    // Dead-lettering adds x-death headers; they are not the message's.
    assert_eq!(got[0].raw, sent);
    t.ack(&got[0].id).expect_within("ack").await;
    t.delete().expect_within("delete").await;
}

async fn quorum_queue_dead_letters_past_the_delivery_limit_instead_of_dropping(url: String) {
    let name = unique("amqp_limit");
    let t = AmqpTransport::connect(&name, &dsn(&url, "delivery_limit=2&queue_type=quorum"))
        .expect_within("connect")
        .await;
    t.setup().expect_within("setup").await;
    t.send(message("poison", &[]), None)
        .expect_within("send")
        .await;
    t.send(message("refused", &[]), None)
        .expect_within("send")
        .await;

    // `refused` is rejected: it is moved to the dead-letter queue.
    // `poison` is released until the broker's delivery limit is passed.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut releases = 0;
    let mut rejected = false;
    loop {
        assert!(
            Instant::now() < deadline,
            "the poison message kept coming back"
        );
        let got = t.get(10).expect_within("get").await;
        for d in &got {
            match d.raw.body.as_slice() {
                b"refused" => {
                    t.reject(&d.id).expect_within("reject").await;
                    rejected = true;
                }
                _ => {
                    t.release(&d.id).expect_within("release").await;
                    releases += 1;
                }
            }
        }
        if got.is_empty() && rejected && releases > 2 {
            break;
        }
    }
    assert_eq!(
        releases, 3,
        "handed out {releases} times with a delivery limit of 2"
    );

    let raw = raw_connection(&url).await;
    let dead_letter_queue = format!("{name}.dead");
    let mut dead = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while dead.len() < 2 && Instant::now() < deadline {
        match take_one(&raw, &dead_letter_queue).await {
            Some(body) => dead.push(String::from_utf8(body).expect("utf-8")),
            None => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    dead.sort();
    assert_eq!(dead, ["poison", "refused"], "dead-lettered messages");
    t.delete().expect_within("delete").await;
}

async fn idle_consumer_gives_its_prefetched_messages_to_other_handles(url: String) {
    let name = unique("amqp_idle");
    let dsn = dsn(&url, "consumer_idle=300ms&lease=off&prefetch=50");
    let a = AmqpTransport::connect(&name, &dsn)
        .expect_within("connect a")
        .await;
    let b = AmqpTransport::connect(&name, &dsn)
        .expect_within("connect b")
        .await;
    a.setup().expect_within("setup").await;
    let batch: Vec<_> = (0..10)
        .map(|i| (message(&format!("m{i}"), &[]), None))
        .collect();
    a.send_batch(batch).expect_within("send_batch").await;
    // `a` takes one; the prefetch puts the nine others in its buffer.
    let held = receive(&a, 1, Duration::from_secs(10)).await;
    // `a` stops calling `get`: its consumer is cancelled and the nine go
    // back, so `b` gets them although `a` never settles what it holds.
    let others = receive(&b, 9, Duration::from_secs(10)).await;
    let mut bodies: Vec<_> = others
        .iter()
        .chain(&held)
        .map(|d| String::from_utf8_lossy(&d.raw.body).into_owned())
        .collect();
    bodies.sort();
    let expected: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
    assert_eq!(bodies, expected);
    let ids: Vec<DeliveryId> = others.iter().map(|d| d.id.clone()).collect();
    b.ack_batch(&ids).expect_within("ack_batch").await;
    // What `a` handed out is still its own to settle.
    a.ack(&held[0].id)
        .expect_within("ack of the held message")
        .await;
    assert_eq!(a.message_count().expect_within("count").await, 0);
    a.delete().expect_within("delete").await;
}

async fn headers_that_cannot_travel_are_refused_and_the_transport_keeps_working(url: String) {
    let name = unique("amqp_headers");
    let t = AmqpTransport::connect(&name, &dsn(&url, "queue_type=classic"))
        .expect_within("connect")
        .await;
    t.setup().expect_within("setup").await;

    let huge: Headers = (0..4)
        .map(|i| (format!("h{i}"), "v".repeat(64 * 1024)))
        .collect();
    let too_large = RawMessage {
        body: b"{}".to_vec(),
        headers: huge,
    };
    assert!(matches!(
        t.send(too_large, None)
            .within("refusing large headers")
            .await,
        Err(TransportError::TooLarge { .. })
    ));
    match t
        .send(message("{}", &[("x-death", "mine")]), None)
        .within("refusing a reserved header")
        .await
    {
        Err(TransportError::Backend { source, .. }) => assert!(matches!(
            source.downcast_ref::<AmqpError>(),
            Some(AmqpError::ReservedHeader(h)) if h == "x-death"
        )),
        other => panic!("a reserved header gave {other:?}"),
    }
    let long_name = "k".repeat(300);
    assert!(t
        .send(message("{}", &[(long_name.as_str(), "v")]), None)
        .within("refusing a long header name")
        .await
        .is_err());

    let fine = message("{\"ok\":1}", &[("type", "Fine")]);
    t.send(fine.clone(), None)
        .expect_within("send after refusals")
        .await;
    let got = receive(&t, 1, Duration::from_secs(10)).await;
    assert_eq!(got[0].raw, fine);
    t.ack(&got[0].id).expect_within("ack").await;
    assert_eq!(t.message_count().expect_within("count").await, 0);
    t.delete().expect_within("delete").await;
}

async fn setup_refuses_a_queue_declared_with_another_type(url: String) {
    let name = unique("amqp_mismatch");
    let classic = AmqpTransport::connect(&name, &dsn(&url, "queue_type=classic"))
        .expect_within("connect classic")
        .await;
    classic.setup().expect_within("setup classic").await;
    let quorum = AmqpTransport::connect(
        &name,
        &dsn(
            &url,
            "queue_type=quorum&auto_setup=false&reconnect_timeout=2s",
        ),
    )
    .expect_within("connect without setup")
    .await;
    match quorum.setup().within("setup over a classic queue").await {
        Err(TransportError::Backend { context, .. }) => {
            assert!(context.contains(&name), "context: {context}")
        }
        other => panic!("setup over a classic queue gave {other:?}"),
    }
    // The refusal broke nothing: the classic handle still sends and consumes.
    classic
        .send(message("still fine", &[]), None)
        .expect_within("send")
        .await;
    let got = receive(&classic, 1, Duration::from_secs(10)).await;
    classic.ack(&got[0].id).expect_within("ack").await;
    classic.delete().expect_within("delete").await;
}

async fn close_gives_back_unsettled_messages_and_later_calls_fail_closed(url: String) {
    let name = unique("amqp_close");
    let dsn = dsn(&url, "lease=off");
    let a = AmqpTransport::connect(&name, &dsn)
        .expect_within("connect a")
        .await;
    a.send(message("held", &[]), None)
        .expect_within("send")
        .await;
    let held = receive(&a, 1, Duration::from_secs(10)).await;
    a.close().expect_within("close").await;
    assert!(matches!(
        a.get(1).within("get after close").await,
        Err(TransportError::Closed)
    ));
    assert!(a.ack(&held[0].id).within("ack after close").await.is_err());

    let b: Arc<dyn Transport> = Arc::new(
        AmqpTransport::connect(&name, &dsn)
            .expect_within("connect b")
            .await,
    );
    let b = b.as_receiver().expect("a RabbitMQ queue can be consumed");
    let again = receive(b, 1, Duration::from_secs(10)).await;
    assert_eq!(again[0].raw.body, b"held");
    b.ack(&again[0].id).expect_within("ack").await;
    AmqpTransport::connect(&name, &dsn)
        .expect_within("connect c")
        .await
        .delete()
        .expect_within("delete")
        .await;
}

async fn a_message_a_consumer_did_not_acknowledge_before_its_connection_closed_comes_back_marked_as_redelivered(
    url: String,
) {
    let name = unique("amqp_redelivered");
    let dsn = dsn(&url, "lease=off");
    let a = AmqpTransport::connect(&name, &dsn)
        .expect_within("connect a")
        .await;
    a.send(message("held", &[("type", "Held")]), None)
        .expect_within("send")
        .await;
    let held = receive(&a, 1, Duration::from_secs(10)).await;
    assert!(!held[0].redelivered, "handed out the first time");
    assert_eq!(held[0].raw, message("held", &[("type", "Held")]));
    // The consumer dies: its connection closes with the message unsettled.
    a.close().expect_within("close").await;

    let b = AmqpTransport::connect(&name, &dsn)
        .expect_within("connect b")
        .await;
    let again = receive(&b, 1, Duration::from_secs(10)).await;
    assert_eq!(again[0].raw.body, b"held");
    assert!(again[0].redelivered, "handed out again, marked");
    assert_eq!(again[0].raw, message("held", &[("type", "Held")]));
    b.ack(&again[0].id).expect_within("ack").await;
    b.delete().expect_within("delete").await;
}

async fn acking_a_batch_leaves_an_unacknowledged_earlier_delivery_alone(url: String) {
    let name = unique("amqp_multiple");
    let dsn = dsn(&url, "lease=off");
    let t = AmqpTransport::connect(&name, &dsn)
        .expect_within("connect")
        .await;
    for i in 0..6 {
        t.send(message(&format!("m{i}"), &[]), None)
            .expect_within("send")
            .await;
    }
    let got = receive(&t, 6, Duration::from_secs(10)).await;
    let bodies: Vec<&[u8]> = got.iter().map(|d| d.raw.body.as_slice()).collect();
    assert_eq!(bodies, [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"]);
    // The third stays unsettled while the ones around it are acknowledged,
    // the later ones first.
    let ids: Vec<DeliveryId> = [5, 4, 0, 1, 3].iter().map(|&i| got[i].id.clone()).collect();
    t.ack_batch(&ids).expect_within("ack_batch").await;
    t.release(&got[2].id)
        .expect_within("the third delivery is still unsettled")
        .await;
    let again = receive(&t, 1, Duration::from_secs(10)).await;
    assert_eq!(again[0].raw.body, b"m2");
    t.ack_batch(std::slice::from_ref(&again[0].id))
        .expect_within("ack")
        .await;
    assert_eq!(t.message_count().expect_within("count").await, 0);
    t.delete().expect_within("delete").await;
}

async fn message_count_includes_what_the_consumer_received_but_no_fetch_took(url: String) {
    let name = unique("amqp_count_held");
    let dsn = dsn(&url, "lease=off&prefetch=50");
    let t = AmqpTransport::connect(&name, &dsn)
        .expect_within("connect")
        .await;
    t.send(message("first", &[]), None)
        .expect_within("send")
        .await;
    // Starts the consumer and takes the only message.
    let first = receive(&t, 1, Duration::from_secs(10)).await;
    for i in 0..5 {
        t.send(message(&format!("m{i}"), &[]), None)
            .expect_within("send")
            .await;
    }
    // Delivered to this handle's consumer (the queue has no ready message
    // left) while nothing fetches.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let connection = raw_connection(&url).await;
        let ready = ready_count(&connection, &name).await;
        let _ = connection.close(200, "done".into()).within("closing").await;
        if ready == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the consumer never took the messages"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(t.message_count().expect_within("count").await, 6);
    t.ack(&first[0].id).expect_within("ack").await;
    let rest = receive(&t, 5, Duration::from_secs(10)).await;
    t.ack_batch(&rest.iter().map(|d| d.id.clone()).collect::<Vec<_>>())
        .expect_within("ack_batch")
        .await;
    assert_eq!(t.message_count().expect_within("count").await, 0);
    t.delete().expect_within("delete").await;
}

async fn the_abilities_are_those_rabbitmq_has(url: String) {
    let name = unique("amqp_abilities");
    let leased = AmqpTransport::connect(&name, &dsn(&url, "lease=30s"))
        .expect_within("connect")
        .await;
    assert!(leased.as_receiver().is_some());
    assert!(leased.as_setup().is_some());
    assert!(leased.as_message_count().is_some());
    assert!(leased.as_teardown().is_some());
    assert!(leased.as_wake_up().is_some());
    assert!(leased.as_keepalive().is_some(), "a lease to extend");
    assert!(
        leased.as_browse().is_some(),
        "the failure commands list and find the messages of a RabbitMQ queue"
    );
    assert!(leased.as_local_sender().is_none() && leased.as_local_receiver().is_none());
    let unleased = AmqpTransport::connect(&name, &dsn(&url, "lease=off"))
        .expect_within("connect")
        .await;
    assert!(unleased.as_keepalive().is_none(), "no lease to extend");
    leased.delete().expect_within("delete").await;
}

async fn purge_deletes_what_message_count_counts_and_says_how_many(url: String) {
    let name = unique("amqp_purge");
    let t = AmqpTransport::connect(&name, &dsn(&url, "lease=off&prefetch=50"))
        .expect_within("connect")
        .await;
    for i in 0..4 {
        t.send(message(&format!("m{i}"), &[]), None)
            .expect_within("send")
            .await;
    }
    t.send(message("later", &[]), Some(Duration::from_secs(60)))
        .expect_within("delayed send")
        .await;
    // One handed out and held; the consumer prefetches the others.
    let held = receive(&t, 1, Duration::from_secs(10)).await;
    assert_eq!(t.message_count().expect_within("count").await, 5);

    assert_eq!(t.purge().expect_within("purge").await, 5);
    assert_eq!(t.message_count().expect_within("count").await, 0);
    assert!(t.get(10).expect_within("get").await.is_empty());
    assert!(matches!(
        t.ack(&held[0].id).within("ack after purge").await,
        Err(TransportError::NotFound(_))
    ));
    // Nothing comes back once the handle is gone either.
    t.close().expect_within("close").await;
    let other = AmqpTransport::connect(&name, &dsn(&url, "lease=off"))
        .expect_within("connect again")
        .await;
    assert!(other.get(10).expect_within("get").await.is_empty());
    assert_eq!(other.message_count().expect_within("count").await, 0);

    other.delete().expect_within("delete").await;
    other
        .delete()
        .expect_within("deleting again is no error")
        .await;
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_AMQP_URL", tests = [
        delayed_message_waits_in_a_ttl_queue_and_comes_back_with_its_own_headers,
        quorum_queue_dead_letters_past_the_delivery_limit_instead_of_dropping,
        idle_consumer_gives_its_prefetched_messages_to_other_handles,
        headers_that_cannot_travel_are_refused_and_the_transport_keeps_working,
        setup_refuses_a_queue_declared_with_another_type,
        close_gives_back_unsettled_messages_and_later_calls_fail_closed,
        a_message_a_consumer_did_not_acknowledge_before_its_connection_closed_comes_back_marked_as_redelivered,
        acking_a_batch_leaves_an_unacknowledged_earlier_delivery_alone,
        message_count_includes_what_the_consumer_received_but_no_fetch_took: current_thread,
        the_abilities_are_those_rabbitmq_has,
        purge_deletes_what_message_count_counts_and_says_how_many,
    ];
    tests = [
        bad_dsn_gives_invalid_dsn_with_the_password_masked: current_thread,
        a_closed_port_is_unreachable_within_the_connect_timeout: current_thread,
        a_port_that_never_answers_is_unreachable_within_the_connect_timeout: current_thread,
    ];
}
