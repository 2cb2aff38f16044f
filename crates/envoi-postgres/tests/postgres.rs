//! Behaviour specific to the PostgreSQL transport, against the server in
//! `ENVOI_POSTGRES_URL`.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{admin, body, connections, dsn, open, receive, text, unique, wait_for_listener};
use envoi_core::serializer::INVALID_HEADERS_HEADER;
use envoi_core::transport::support::STORED_HEADERS_HEADER;
use envoi_core::transport::{
    Browse, DeliveryId, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown, Transport,
    TransportFactory, WakeUp,
};
use envoi_core::TransportError;
use envoi_postgres::sqlx;
use envoi_postgres::{PostgresTransport, PostgresTransportFactory};

const TABLE: &str = "envoi_test_messages";

/// The tests' options, with `extra` added or replacing a default of the
/// same name (an option given twice is an invalid DSN).
fn options(extra: &str) -> String {
    let given: Vec<&str> = extra
        .split('&')
        .filter_map(|o| o.split('=').next())
        .collect();
    let defaults = [
        format!("table={TABLE}"),
        "lease=2s".into(),
        "wait=200ms".into(),
        "poll=200ms".into(),
        "max_connections=4".into(),
    ];
    let mut all: Vec<String> = defaults
        .into_iter()
        .filter(|d| !given.contains(&d.split('=').next().unwrap_or_default()))
        .collect();
    if !extra.is_empty() {
        all.push(extra.to_string());
    }
    all.join("&")
}

async fn setup_creates_the_table_and_claim_index_idempotently(url: String) {
    let table = unique("envoi_setup");
    let a = PostgresTransport::connect("a", &common::dsn(&url, &format!("table={table}")))
        .await
        .unwrap();
    let b = PostgresTransport::connect("b", &common::dsn(&url, &format!("table={table}")))
        .await
        .unwrap();
    let (ra, rb, rc) = tokio::join!(a.setup(), b.setup(), a.setup());
    for r in [ra, rb, rc] {
        r.unwrap_or_else(|e| panic!("concurrent setup failed: {e}"));
    }
    a.setup().await.expect("a repeated setup failed");

    let admin = admin(&url).await;
    let columns: Vec<(String,)> = sqlx::query_as(
        "SELECT column_name::text FROM information_schema.columns \
         WHERE table_name = $1 ORDER BY ordinal_position",
    )
    .bind(&table)
    .fetch_all(&admin)
    .await
    .unwrap();
    let columns: Vec<String> = columns.into_iter().map(|(c,)| c).collect();
    assert_eq!(
        columns,
        [
            "id",
            "queue_name",
            "body",
            "headers",
            "created_at",
            "available_at",
            "leased_until",
            "delivery_count"
        ]
    );
    let indexes: Vec<(String, String)> =
        sqlx::query_as("SELECT indexname::text, indexdef FROM pg_indexes WHERE tablename = $1")
            .bind(&table)
            .fetch_all(&admin)
            .await
            .unwrap();
    let claim_index = format!("{table}_queue_available_idx");
    let (_, definition) = indexes
        .iter()
        .find(|(name, _)| *name == claim_index)
        .unwrap_or_else(|| panic!("no claim index among {indexes:?}"));
    assert!(
        definition.ends_with("(queue_name, available_at, id)"),
        "{definition}"
    );
    assert_eq!(
        indexes.len(),
        2,
        "expected the primary key and the claim index: {indexes:?}"
    );

    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE \"{table}\"")))
        .execute(&admin)
        .await
        .unwrap();
}

async fn claims_skip_rows_locked_elsewhere_instead_of_waiting(url: String) {
    let name = unique("skip_locked");
    let t = open(&name, &url, &options("")).await;
    let mut ids = Vec::new();
    for b in ["first", "second", "third"] {
        ids.push(t.send(text(b), None).await.unwrap());
    }
    let admin = admin(&url).await;
    let mut lock = admin.begin().await.unwrap();
    let first: i64 = ids[0].parse().unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM {TABLE} WHERE id = $1 FOR UPDATE"
    )))
    .bind(first)
    .execute(&mut *lock)
    .await
    .unwrap();

    // Without SKIP LOCKED the claim would wait for the other transaction.
    let got = tokio::time::timeout(Duration::from_secs(10), t.get(10))
        .await
        .expect("get waited for a row locked by another transaction")
        .unwrap();
    let got: Vec<String> = got.iter().map(body).collect();
    assert_eq!(got, ["second", "third"]);

    lock.rollback().await.unwrap();
    let again = receive(&t, 1, Duration::from_secs(10)).await;
    assert_eq!(body(&again[0]), "first");
    assert_eq!(t.purge().await.unwrap(), 3);
}

async fn one_listener_connection_serves_every_consumer(url: String) {
    let app = unique("envoi_one_listener");
    let t = open(
        &unique("one_listener"),
        &url,
        &options(&format!("application_name={app}")),
    )
    .await;
    let until = Instant::now() + Duration::from_millis(1500);
    let consumers: Vec<_> = (0..8)
        .map(|_| {
            let t = t.clone();
            tokio::spawn(async move {
                while Instant::now() < until {
                    t.get(1).await.expect("get failed");
                }
            })
        })
        .collect();
    let admin = admin(&url).await;
    assert!(
        wait_for_listener(&admin, &app, Duration::from_secs(10)).await,
        "no listener connection appeared"
    );
    let (total, listening) = connections(&admin, &app).await;
    for c in consumers {
        common::within(Duration::from_secs(30), "a consumer", c)
            .await
            .unwrap();
    }
    assert_eq!(
        listening, 1,
        "8 consumers should share one LISTEN connection"
    );
    // The query pool (4) plus the listener.
    assert!(total <= 5, "{total} connections for 8 consumers");
}

async fn notify_wakes_a_waiting_consumer_long_before_the_poll_interval(url: String) {
    let name = unique("notify");
    let app = unique("envoi_notify");
    // Polling alone would take up to 20 s.
    let consumer = open(
        &name,
        &url,
        &format!("table={TABLE}&wait=20s&poll=20s&application_name={app}"),
    )
    .await;
    let producer = open(&name, &url, &options("")).await;
    let waiting = {
        let consumer = consumer.clone();
        tokio::spawn(async move {
            loop {
                let got = consumer.get(1).await.expect("get failed");
                if let Some(d) = got.into_iter().next() {
                    return (d, Instant::now());
                }
            }
        })
    };
    let admin = admin(&url).await;
    assert!(
        wait_for_listener(&admin, &app, Duration::from_secs(10)).await,
        "no listener connection appeared"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sent_at = Instant::now();
    producer.send(text("wake up"), None).await.unwrap();
    let (delivery, received_at) = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("the waiting consumer was not woken")
        .unwrap();
    let latency = received_at - sent_at;
    assert_eq!(body(&delivery), "wake up");
    assert!(
        latency < Duration::from_secs(10),
        "woken after {latency:?}: the notification was not used"
    );
    consumer.ack(&delivery.id).await.unwrap();
}

async fn wait_for_messages_returns_when_a_message_is_notified(url: String) {
    let name = unique("wait");
    let app = unique("envoi_wait");
    let consumer = open(
        &name,
        &url,
        &format!("table={TABLE}&poll=20s&application_name={app}"),
    )
    .await;
    let producer = open(&name, &url, &options("")).await;
    let admin = admin(&url).await;
    // The first wait starts the listener; it returns after the listener's
    // first wake-up, which follows LISTEN.
    consumer.wait_for_messages(Duration::from_secs(15)).await;
    assert!(wait_for_listener(&admin, &app, Duration::from_secs(10)).await);
    // An empty claim; its wait for a wake-up (up to 20 s) is cut short.
    let claim = tokio::time::timeout(Duration::from_millis(500), consumer.get(1)).await;
    assert!(claim.map_or(true, |got| got.unwrap().is_empty()));
    let send = {
        let producer = producer.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            producer.send(text("arrived"), None).await.unwrap();
        })
    };
    let started = Instant::now();
    consumer.wait_for_messages(Duration::from_secs(15)).await;
    let waited = started.elapsed();
    send.await.unwrap();
    assert!(
        waited < Duration::from_secs(10),
        "wait_for_messages ignored the notification ({waited:?})"
    );
    let got = receive(&consumer, 1, Duration::from_secs(10)).await;
    assert_eq!(body(&got[0]), "arrived");
    consumer.ack(&got[0].id).await.unwrap();
}

async fn polling_delivers_when_listen_is_disabled(url: String) {
    let name = unique("polling");
    let app = unique("envoi_polling");
    let consumer = open(
        &name,
        &url,
        &options(&format!("listen=false&application_name={app}")),
    )
    .await;
    let producer = open(&name, &url, &options("")).await;
    assert!(consumer.get(1).await.unwrap().is_empty());
    producer.send(text("polled"), None).await.unwrap();
    let got = receive(&consumer, 1, Duration::from_secs(10)).await;
    assert_eq!(body(&got[0]), "polled");
    consumer.ack(&got[0].id).await.unwrap();
    let admin = admin(&url).await;
    assert_eq!(
        connections(&admin, &app).await.1,
        0,
        "listen=false still opened a LISTEN connection"
    );
}

async fn send_batch_stores_one_row_each_with_ids_in_order_and_delays_in_available_at(url: String) {
    let name = unique("batch");
    let t = open(&name, &url, &options("")).await;
    let batch: Vec<(RawMessage, Option<Duration>)> = (0..100)
        .map(|i| {
            let delay = (i % 10 == 9).then_some(Duration::from_secs(60));
            (text(&format!("m{i}")), delay)
        })
        .collect();
    let ids = t.send_batch(batch).await.unwrap();
    let numeric: Vec<i64> = ids.iter().map(|id| id.parse().unwrap()).collect();
    assert!(
        numeric.windows(2).all(|w| w[0] < w[1]),
        "ids are not in send order: {ids:?}"
    );
    let listed = t.list(1000).await.unwrap();
    assert_eq!(
        listed.iter().map(|d| d.id.to_string()).collect::<Vec<_>>(),
        ids,
        "list is not in send order"
    );
    for (i, d) in listed.iter().enumerate() {
        assert_eq!(body(d), format!("m{i}"));
    }

    let admin = admin(&url).await;
    let (delayed,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {TABLE} WHERE queue_name = $1 \
         AND available_at > now() + interval '50 seconds'"
    )))
    .bind(&name)
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(delayed, 10, "delayed messages must wait in available_at");

    let got = receive(&t, 90, Duration::from_secs(10)).await;
    assert!(
        got.iter().all(|d| !body(d).ends_with('9')),
        "a delayed message was handed out"
    );
    t.ack_batch(&common::ids(&got)).await.unwrap();
    assert_eq!(t.message_count().await.unwrap(), 10);
    assert_eq!(t.purge().await.unwrap(), 10);
}

async fn a_released_message_keeps_its_place_in_line(url: String) {
    let t = open(&unique("place"), &url, &options("")).await;
    for b in ["a", "b", "c"] {
        t.send(text(b), None).await.unwrap();
    }
    let first = receive(&t, 1, Duration::from_secs(10)).await.remove(0);
    assert_eq!(body(&first), "a");
    t.release(&first.id).await.unwrap();
    let all = receive(&t, 3, Duration::from_secs(10)).await;
    assert_eq!(all.iter().map(body).collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(all[0].id, first.id);
    assert_eq!(t.purge().await.unwrap(), 3);
}

async fn keepalive_moves_the_lease_forward_and_fails_for_a_gone_message(url: String) {
    let name = unique("keepalive");
    let t = open(&name, &url, &options("")).await;
    let id = DeliveryId::from(t.send(text("slow"), None).await.unwrap());
    let held = receive(&t, 1, Duration::from_secs(10)).await.remove(0);
    assert_eq!(held.id, id);
    let admin = admin(&url).await;
    // When the lease ends, in milliseconds since the epoch (the server's
    // clock).
    let leased_until = || async {
        let (ms,): (f64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT (extract(epoch FROM leased_until) * 1000)::float8 \
             FROM {TABLE} WHERE id = $1"
        )))
        .bind(id.as_str().parse::<i64>().unwrap())
        .fetch_one(&admin)
        .await
        .unwrap();
        ms
    };
    let before = leased_until().await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    t.keepalive(&id).await.unwrap();
    let after = leased_until().await;
    // The claim set it to a lease after its time; the keepalive, at least
    // 800 ms later, to a lease after its own.
    assert!(
        after >= before + 790.0,
        "keepalive did not extend the lease (it ended at {before} ms, now at {after} ms)"
    );
    t.ack(&id).await.unwrap();
    assert!(matches!(
        t.keepalive(&id).await,
        Err(TransportError::NotFound(_))
    ));
    assert!(matches!(
        t.release(&id).await,
        Err(TransportError::NotFound(_))
    ));
    // Acking again is harmless: a late consumer may ack after another one.
    t.ack(&id).await.unwrap();
}

async fn expired_lease_redelivers_and_counts_the_delivery(url: String) {
    // A lease far longer than the get that checks it is not handed out.
    let t = open(&unique("expired"), &url, &options("lease=3s")).await;
    let id = DeliveryId::from(t.send(text("again"), None).await.unwrap());
    let first = receive(&t, 1, Duration::from_secs(10)).await.remove(0);
    assert!(
        !first.redelivered,
        "a first delivery is marked as redelivered"
    );
    assert!(
        t.get(1).await.unwrap().is_empty(),
        "a leased message was handed out"
    );
    let second = receive(&t, 1, Duration::from_secs(10)).await.remove(0);
    assert_eq!((&first.id, &second.id), (&id, &id));
    assert!(
        second.redelivered,
        "a message whose lease ran out is not marked as redelivered"
    );
    let admin = admin(&url).await;
    let (count,): (i32,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT delivery_count FROM {TABLE} WHERE id = $1"
    )))
    .bind(id.as_str().parse::<i64>().unwrap())
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(count, 2);
    t.ack(&id).await.unwrap();
}

async fn get_claims_at_most_the_batch_option(url: String) {
    let t = open(&unique("batch_cap"), &url, &options("batch=3")).await;
    t.send_batch((0..10).map(|i| (text(&i.to_string()), None)).collect())
        .await
        .unwrap();
    let got = t.get(100).await.unwrap();
    assert_eq!(got.len(), 3);
    assert_eq!(t.purge().await.unwrap(), 10);
}

async fn messages_postgres_cannot_store_are_refused_with_a_clear_error(url: String) {
    let t = open(&unique("refused"), &url, &options("max_body=16")).await;
    let nul = RawMessage {
        body: b"{}".to_vec(),
        headers: [("trace\0id".to_string(), "x".to_string())].into(),
    };
    let err = t.send(nul.clone(), None).await.unwrap_err();
    let chain = format!(
        "{err}: {}",
        std::error::Error::source(&err)
            .map(ToString::to_string)
            .unwrap_or_default()
    );
    assert!(chain.contains("NUL"), "{chain}");
    assert!(t
        .send_batch(vec![(text("ok"), None), (nul, None)])
        .await
        .is_err());
    match t.send(text(&"x".repeat(17)), None).await {
        Err(TransportError::TooLarge {
            size: 17,
            limit: 16,
        }) => {}
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(
        t.message_count().await.unwrap(),
        0,
        "a refused message was stored"
    );
}

async fn rows_with_odd_headers_written_by_hand_are_delivered_as_stored_to_be_parked(url: String) {
    let name = unique("odd_headers");
    let t = open(&name, &url, &options("")).await;
    let admin = admin(&url).await;
    for headers in [r#"{"n": 1, "type": "Odd"}"#, "[1, 2]"] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {TABLE} (queue_name, body, headers) VALUES ($1, $2, $3::jsonb)"
        )))
        .bind(&name)
        .bind(headers.as_bytes())
        .bind(headers)
        .execute(&admin)
        .await
        .unwrap();
    }
    let got = receive(&t, 2, Duration::from_secs(10)).await;
    // A value that is not a string is not stringified: the string headers
    // stay, and what was stored is kept, with what is wrong with it.
    assert_eq!(got[0].raw.header("type"), Some("Odd"));
    assert_eq!(got[0].raw.header("n"), None);
    assert_eq!(
        got[0].raw.header(STORED_HEADERS_HEADER),
        Some(r#"{"n": 1, "type": "Odd"}"#)
    );
    assert_eq!(got[1].raw.header(STORED_HEADERS_HEADER), Some("[1, 2]"));
    // Neither decodes: the worker parks each, saying why.
    let serializer = envoi_core::serializer::Serializer::builder()
        .build()
        .unwrap();
    for (delivery, why) in got.iter().zip(["`n` holds a number", "they are an array"]) {
        let marked = delivery
            .raw
            .header(INVALID_HEADERS_HEADER)
            .unwrap_or_default();
        assert!(marked.contains(why), "{marked}");
        let reason = serializer.decode(&delivery.raw).unwrap_err().to_string();
        assert!(reason.contains(why), "{reason}");
    }
    assert_eq!(t.purge().await.unwrap(), 2);
}

async fn a_row_with_null_headers_in_a_relaxed_table_is_delivered_marked_with_the_rest(url: String) {
    let table = unique("envoi_relaxed");
    let name = unique("relaxed");
    let t = open(
        &name,
        &url,
        &format!("table={table}&lease=2s&wait=200ms&poll=200ms"),
    )
    .await;
    let admin = admin(&url).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {table} ALTER COLUMN headers DROP NOT NULL"
    )))
    .execute(&admin)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (queue_name, body, headers) VALUES ($1, $2, NULL)"
    )))
    .bind(&name)
    .bind(b"{}".as_slice())
    .execute(&admin)
    .await
    .unwrap();
    t.send(text("good"), None).await.unwrap();

    let got = receive(&t, 2, Duration::from_secs(10)).await;
    let reason = got[0]
        .raw
        .header(INVALID_HEADERS_HEADER)
        .unwrap_or_default();
    assert_eq!(reason, "the stored headers are NULL");
    assert_eq!(body(&got[1]), "good", "the row claimed with it comes too");
    for d in &got {
        t.ack(&d.id).await.unwrap();
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&admin)
        .await
        .unwrap();
}

/// Runs `op` on a transport of `dsn`, expecting
/// [`TransportError::Unreachable`] within a few seconds naming `masked`;
/// returns the error's text with its cause.
async fn expect_unreachable<F>(dsn: &str, masked: &str, op: F) -> String
where
    F: AsyncFnOnce(&PostgresTransport) -> Result<(), TransportError>,
{
    let t = PostgresTransport::connect("unreachable", dsn)
        .await
        .expect("creating connects nothing");
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(20), op(&t))
        .await
        .expect("the operation hung instead of failing within the connect timeout");
    let waited = started.elapsed();
    let error = result.expect_err("an unreachable server was used");
    let text = format!(
        "{error}: {}",
        std::error::Error::source(&error)
            .map(ToString::to_string)
            .unwrap_or_default()
    );
    match &error {
        TransportError::Unreachable { dsn, .. } => assert_eq!(dsn, masked, "{text}"),
        other => panic!("expected Unreachable, got {other:?}"),
    }
    assert!(!text.contains("s3cret"), "the password leaked: {text}");
    assert!(
        waited < Duration::from_secs(6),
        "failed only after {waited:?}"
    );
    text
}

async fn a_server_that_refuses_connections_is_named_as_the_cause_not_a_pool_timeout() {
    // Nothing listens on port 1: no server is needed.
    let text = expect_unreachable(
        "postgres://postgres:s3cret@127.0.0.1:1/test?acquire_timeout=300ms&listen=false",
        "postgres://postgres:***@127.0.0.1:1/test?acquire_timeout=300ms&listen=false",
        async |t| t.setup().await,
    )
    .await;
    assert!(text.to_lowercase().contains("refused"), "{text}");
}

async fn a_closed_port_is_unreachable_within_the_connect_timeout() {
    // The default acquire timeout (10 s) is longer: the first connection
    // is bounded by `connect_timeout`.
    expect_unreachable(
        "postgres://u:s3cret@127.0.0.1:1/test?connect_timeout=1s",
        "postgres://u:***@127.0.0.1:1/test?connect_timeout=1s",
        async |t| t.send(text("lost"), None).await.map(drop),
    )
    .await;
}

async fn a_server_that_never_answers_is_unreachable_within_the_connect_timeout() {
    // The kernel accepts the connection; nothing ever answers on it.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let text = expect_unreachable(
        &format!("postgres://u:s3cret@127.0.0.1:{port}/test?connect_timeout=1s&sslmode=disable"),
        &format!("postgres://u:***@127.0.0.1:{port}/test?connect_timeout=1s&sslmode=disable"),
        async |t| t.get(1).await.map(drop),
    )
    .await;
    assert!(text.contains("no answer within 1s"), "{text}");
    drop(silent);
}

async fn purge_deletes_only_its_own_queue(url: String) {
    let a = open(&unique("purge_a"), &url, &options("")).await;
    let b = open(&unique("purge_b"), &url, &options("")).await;
    a.send_batch(vec![(text("a1"), None), (text("a2"), None)])
        .await
        .unwrap();
    b.send(text("b1"), None).await.unwrap();
    assert_eq!(a.purge().await.unwrap(), 2);
    assert_eq!(a.message_count().await.unwrap(), 0);
    assert_eq!(b.message_count().await.unwrap(), 1);
    assert_eq!(b.purge().await.unwrap(), 1);
}

async fn a_closed_transport_fails_with_closed(url: String) {
    let t = open(&unique("closed"), &url, &options("")).await;
    t.close().await.unwrap();
    assert!(matches!(
        t.send(text("late"), None).await,
        Err(TransportError::Closed)
    ));
    assert!(matches!(t.get(1).await, Err(TransportError::Closed)));
    t.close().await.expect("closing again does nothing");
}

async fn factory_accepts_postgres_dsns_and_masks_passwords_in_errors() {
    let factory = PostgresTransportFactory;
    assert!(factory.supports("postgres://u@h/db"));
    assert!(factory.supports("postgresql://u@h/db"));
    assert!(!factory.supports("sqlite://envoi.db"));
    assert!(!factory.supports("postgres"));

    // Connecting is lazy: a transport is created without a server.
    let t: Arc<dyn Transport> = factory
        .create(
            "orders",
            "postgresql://u:secret@127.0.0.1:1/db?table=orders_q&lease=5s",
        )
        .await
        .unwrap();
    assert!(t.as_receiver().is_some());
    assert!(t.as_keepalive().is_some());
    assert!(t.as_setup().is_some());
    assert!(t.as_message_count().is_some());
    assert!(t.as_browse().is_some());
    assert!(t.as_teardown().is_some());
    assert!(t.as_wake_up().is_some());
    assert!(t.as_local_sender().is_none() && t.as_local_receiver().is_none());

    match factory
        .create("orders", "postgres://u:secret@h/db?table=Bad-Name")
        .await
    {
        Err(TransportError::InvalidDsn { dsn, reason }) => {
            assert_eq!(dsn, "postgres://u:***@h/db?table=Bad-Name");
            assert!(reason.contains("table name"), "{reason}");
        }
        other => panic!("expected InvalidDsn, got {other:?}"),
    }
}

async fn transport_names_must_be_usable_as_queue_names() {
    for bad in ["", "a\0b"] {
        let err = PostgresTransport::connect(bad, "postgres://u@h/db")
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("invalid postgres transport"),
            "{err}"
        );
    }
    let ok = PostgresTransport::connect("any name — even ünïcode", "postgres://u@h/db").await;
    assert!(ok.is_ok());
}

fn creating_a_transport_outside_a_runtime_is_an_error_not_a_panic() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    // Polled by hand, without a runtime: it fails at once.
    let mut connecting = std::pin::pin!(PostgresTransport::connect("q", "postgres://u@h/db"));
    let polled = connecting
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()));
    let Poll::Ready(Err(err)) = polled else {
        panic!("connecting outside a runtime did not fail at once");
    };
    assert!(err.to_string().contains("Tokio runtime"), "{err}");
}

async fn concurrent_consumers_on_separate_handles_share_the_work_without_duplicates(url: String) {
    let name = unique("share");
    let producer = open(&name, &url, &options("")).await;
    let n = 400;
    producer
        .send_batch((0..n).map(|i| (text(&i.to_string()), None)).collect())
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let t = open(&name, &url, &options("batch=7")).await;
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                let got = t.get(50).await.expect("get failed");
                if got.is_empty() {
                    break;
                }
                seen.extend(got.iter().map(body));
                t.ack_batch(&common::ids(&got))
                    .await
                    .expect("ack_batch failed");
            }
            seen
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(
            common::within(Duration::from_secs(30), "a consumer", task)
                .await
                .unwrap(),
        );
    }
    let unique_bodies: BTreeSet<_> = all.iter().cloned().collect();
    assert_eq!(
        unique_bodies.len(),
        all.len(),
        "a message was handed out twice"
    );
    assert_eq!(all.len(), n);
    assert_eq!(producer.message_count().await.unwrap(), 0);
}

async fn an_empty_get_waits_up_to_the_wait_option_and_not_at_all_with_zero(url: String) {
    let name = unique("wait_option");
    let patient = open(&name, &url, &format!("table={TABLE}&wait=3s")).await;
    let eager = open(&name, &url, &format!("table={TABLE}&wait=0")).await;

    let started = Instant::now();
    assert!(patient.get(1).await.unwrap().is_empty());
    let patient_took = started.elapsed();
    let started = Instant::now();
    assert!(eager.get(1).await.unwrap().is_empty());
    let eager_took = started.elapsed();

    assert!(
        patient_took >= Duration::from_millis(2900),
        "wait=3s returned after {patient_took:?}"
    );
    assert!(
        eager_took < Duration::from_secs(2),
        "wait=0 returned after {eager_took:?}"
    );
}

async fn concurrent_sends_are_each_stored_once_under_their_own_id(url: String) {
    let name = unique("grouped");
    let t = Arc::new(open(&name, &url, &options("")).await);
    let n = 300;
    let mut sends = tokio::task::JoinSet::new();
    for i in 0..n {
        let t = Arc::clone(&t);
        // Every tenth one delayed: delayed and immediate rows share groups.
        let delay = (i % 10 == 0).then(|| Duration::from_secs(60));
        sends.spawn(async move { (i, t.send(text(&format!("m{i}")), delay).await) });
    }
    let mut ids = BTreeSet::new();
    while let Some(joined) = sends.join_next().await {
        let (i, sent) = joined.unwrap();
        let id = sent.unwrap_or_else(|e| panic!("send {i} failed: {e}"));
        let id = DeliveryId::from(id);
        let found = t.find(&id).await.unwrap().expect("a sent id is not stored");
        assert_eq!(
            body(&found),
            format!("m{i}"),
            "id {id} holds another message"
        );
        assert!(ids.insert(id), "two sends got one id");
    }
    assert_eq!(t.message_count().await.unwrap(), n as u64);
    let mut due = 0;
    loop {
        let got = t.get(100).await.unwrap();
        if got.is_empty() {
            break;
        }
        due += got.len();
    }
    assert_eq!(due, n - n / 10, "only the messages without a delay are due");
    t.purge().await.unwrap();
}

async fn a_send_the_database_refuses_fails_alone_among_concurrent_sends(url: String) {
    let name = unique("refused");
    let t = Arc::new(open(&name, &url, &options("")).await);
    let mut sends = tokio::task::JoinSet::new();
    for i in 0..100 {
        let t = Arc::clone(&t);
        // A due time past the end of PostgreSQL's calendar: that row's
        // INSERT fails, whichever statement it is in.
        let delay = (i == 50).then(|| Duration::from_secs(1 << 50));
        sends.spawn(async move { (i, t.send(text(&format!("m{i}")), delay).await) });
    }
    let mut stored = 0;
    while let Some(joined) = sends.join_next().await {
        match joined.unwrap() {
            (50, Err(TransportError::Backend { .. })) => {}
            (50, other) => panic!("the out-of-range send gave {other:?}"),
            (i, Err(e)) => panic!("send {i} failed with its neighbour: {e}"),
            (_, Ok(_)) => stored += 1,
        }
    }
    assert_eq!(stored, 99);
    assert_eq!(t.message_count().await.unwrap(), 99);
    t.purge().await.unwrap();
}

/// Options with a lease far longer than any of the waits below.
fn long_lease() -> String {
    format!("table={TABLE}&lease=60s&wait=200ms&poll=200ms&max_connections=4")
}

/// A large `get` that comes back full claims the next batch ahead; smaller
/// `get`s then hand it out, each row once.
async fn rows_claimed_ahead_are_each_handed_out_once(url: String) {
    let t = open(&unique("ahead"), &url, &long_lease()).await;
    t.send_batch((0..350).map(|i| (text(&format!("m{i}")), None)).collect())
        .await
        .unwrap();
    let mut seen = Vec::new();
    for max in [100, 10, 100, 100, 100, 100] {
        let got = t.get(max).await.unwrap();
        assert!(got.len() <= max);
        t.ack_batch(&common::ids(&got)).await.unwrap();
        seen.extend(got.iter().map(body));
    }
    let distinct: BTreeSet<&String> = seen.iter().collect();
    assert_eq!(distinct.len(), seen.len(), "a row was handed out twice");
    assert_eq!(seen.len(), 350);
    assert_eq!(t.message_count().await.unwrap(), 0);
}

/// Rows claimed ahead and never handed out go back to the queue when the
/// transport is closed or dropped, not when their lease ends.
async fn rows_claimed_ahead_are_given_back_on_close_and_drop(url: String) {
    let name = unique("ahead_back");
    let t = open(&name, &url, &long_lease()).await;
    t.send_batch((0..300).map(|i| (text(&format!("m{i}")), None)).collect())
        .await
        .unwrap();
    let mut seen = BTreeSet::new();
    for closing in [true, false] {
        let handle = open(&name, &url, &long_lease()).await;
        let got = handle.get(100).await.unwrap();
        assert_eq!(got.len(), 100);
        handle.ack_batch(&common::ids(&got)).await.unwrap();
        seen.extend(got.iter().map(body));
        if closing {
            handle.close().await.unwrap();
        } else {
            drop(handle);
        }
    }
    // Well within the 60 s lease, the last 100 are all available again.
    let rest = receive(&t, 100, Duration::from_secs(10)).await;
    seen.extend(rest.iter().map(body));
    assert_eq!(seen.len(), 300);
    t.purge().await.unwrap();
}

/// Rows claimed ahead whose lease ran out before the transport was closed
/// or dropped may be another consumer's by then: they are not given back,
/// which would end that consumer's lease and let a third take them.
async fn rows_claimed_ahead_past_their_lease_are_not_given_back_on_close_or_drop(url: String) {
    let name = unique("ahead_expired");
    let short = format!("table={TABLE}&lease=2s&wait=200ms&poll=200ms&max_connections=4");
    let t = open(&name, &url, &long_lease()).await;
    for closing in [true, false] {
        t.send_batch((0..200).map(|i| (text(&format!("m{i}")), None)).collect())
            .await
            .unwrap();
        let a = open(&name, &url, &short).await;
        let got = a.get(100).await.unwrap();
        assert_eq!(got.len(), 100);
        a.ack_batch(&common::ids(&got)).await.unwrap();
        // The next 100 are claimed ahead for `a`; their lease runs out and
        // another consumer takes them.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let b = open(&name, &url, &long_lease()).await;
        let taken = receive(&b, 100, Duration::from_secs(10)).await;
        assert_eq!(taken.len(), 100);
        if closing {
            a.close().await.unwrap();
        } else {
            drop(a);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let c = open(&name, &url, &long_lease()).await;
        let stolen = c.get(100).await.unwrap();
        assert!(
            stolen.is_empty(),
            "closing: {closing}; {} rows another consumer holds were given back",
            stolen.len()
        );
        t.purge().await.unwrap();
    }
}

/// Drops `table` (if it is there) when dropped, so a test that fails
/// leaves no table behind.
struct DropTable {
    url: String,
    table: String,
}

impl Drop for DropTable {
    fn drop(&mut self) {
        let (url, table) = (self.url.clone(), self.table.clone());
        // A runtime of its own: the test's may be shutting down.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime to drop the test table");
            runtime.block_on(async {
                let admin = admin(&url).await;
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
                    .execute(&admin)
                    .await
                    .map(drop)
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop the test table `{}`", self.table);
        }
    }
}

/// Whether `table` exists.
async fn table_exists(admin: &sqlx::PgPool, table: &str) -> bool {
    let (exists,): (bool,) = sqlx::query_as("SELECT to_regclass($1) IS NOT NULL")
        .bind(table)
        .fetch_one(admin)
        .await
        .unwrap();
    exists
}

async fn without_auto_setup_a_transport_not_set_up_says_to_set_it_up(url: String) {
    let table = unique("never_set_up");
    let _drop = DropTable {
        url: url.clone(),
        table: table.clone(),
    };
    let t = PostgresTransport::connect(
        "jobs",
        &dsn(&url, &format!("table={table}&auto_setup=false")),
    )
    .await
    .unwrap();
    let err = t
        .send(text("too early"), None)
        .await
        .expect_err("no table yet");
    let text = format!(
        "{err}: {}",
        std::error::Error::source(&err)
            .map(ToString::to_string)
            .unwrap_or_default()
    );
    assert!(text.contains(&table), "the error names the table: {text}");
    assert!(text.contains("does not exist"), "{text}");
    assert!(
        text.contains("set the transport up first"),
        "the error says what to do: {text}"
    );
    assert!(
        !table_exists(&admin(&url).await, &table).await,
        "auto_setup=false created the table"
    );
}

async fn auto_setup_creates_the_table_on_first_use(url: String) {
    let table = unique("envoi_auto");
    let _drop = DropTable {
        url: url.clone(),
        table: table.clone(),
    };
    let options = format!("table={table}&lease=2s&wait=200ms&poll=200ms");
    let t = PostgresTransport::connect("jobs", &dsn(&url, &options))
        .await
        .unwrap();
    t.send(text("first"), None)
        .await
        .unwrap_or_else(|e| panic!("the first send, with no setup, failed: {e}"));
    let admin = admin(&url).await;
    assert!(table_exists(&admin, &table).await);
    let (indexes,): (i64,) = sqlx::query_as("SELECT count(*) FROM pg_indexes WHERE indexname = $1")
        .bind(format!("{table}_queue_available_idx"))
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(indexes, 1, "the claim index was not created");
    let got = receive(&t, 1, Duration::from_secs(10)).await;
    assert_eq!(body(&got[0]), "first");
    t.ack(&got[0].id).await.unwrap();

    // A consumer that comes first creates the table too.
    let other = unique("envoi_auto_get");
    let _drop_other = DropTable {
        url: url.clone(),
        table: other.clone(),
    };
    let c = PostgresTransport::connect("jobs", &dsn(&url, &format!("table={other}&wait=0")))
        .await
        .unwrap();
    assert!(c.get(1).await.unwrap().is_empty());
    assert!(table_exists(&admin, &other).await);
    t.close().await.unwrap();
    c.close().await.unwrap();
}

async fn processes_starting_at_once_on_a_new_table_all_send(url: String) {
    const PROCESSES: usize = 8;
    let table = unique("envoi_race");
    let _drop = DropTable {
        url: url.clone(),
        table: table.clone(),
    };
    let options = format!("table={table}&max_connections=2&listen=false");
    let mut transports = Vec::new();
    for i in 0..PROCESSES {
        // A pool each: as many sessions as separate processes would have.
        let t = PostgresTransport::connect(&format!("q{i}"), &dsn(&url, &options))
            .await
            .unwrap();
        transports.push(Arc::new(t));
    }
    let start = Arc::new(tokio::sync::Barrier::new(PROCESSES));
    let sends: Vec<_> = transports
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (t, start) = (Arc::clone(t), Arc::clone(&start));
            tokio::spawn(async move {
                start.wait().await;
                t.send(text(&format!("m{i}")), None).await
            })
        })
        .collect();
    for (i, send) in sends.into_iter().enumerate() {
        let sent = tokio::time::timeout(Duration::from_secs(30), send)
            .await
            .unwrap_or_else(|_| panic!("the first send of process {i} did not finish"))
            .expect("a send task panicked");
        sent.unwrap_or_else(|e| panic!("the first send of process {i} failed: {e}"));
    }
    let admin = admin(&url).await;
    let (rows,): (i64,) =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&admin)
            .await
            .unwrap();
    assert_eq!(rows, PROCESSES as i64);
    for t in &transports {
        t.close().await.unwrap();
    }
}

async fn a_rejected_message_is_deleted_not_handed_out_again(url: String) {
    let t = open(&unique("rejected"), &url, &options("lease=300ms")).await;
    t.send(text("poison"), None).await.unwrap();
    let got = receive(&t, 1, Duration::from_secs(10)).await.remove(0);
    t.reject(&got.id).await.unwrap();
    assert_eq!(t.find(&got.id).await.unwrap(), None);
    assert_eq!(t.message_count().await.unwrap(), 0);
    // Well past its lease, it does not come back.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(t.get(1).await.unwrap().is_empty());
    // Rejecting again is harmless, as acknowledging again is.
    t.reject(&got.id).await.unwrap();
}

async fn delete_removes_the_queue_and_drops_the_table_once_no_other_queue_uses_it(url: String) {
    let table = unique("envoi_deleted");
    let options = format!("table={table}&lease=2s&wait=200ms&poll=200ms");
    let a = open(&unique("delete_a"), &url, &options).await;
    let b = open(&unique("delete_b"), &url, &options).await;
    a.send_batch(vec![(text("a1"), None), (text("a2"), None)])
        .await
        .unwrap();
    b.send(text("b1"), None).await.unwrap();
    let admin = admin(&url).await;
    let table_exists = || async {
        let (exists,): (bool,) = sqlx::query_as("SELECT to_regclass($1) IS NOT NULL")
            .bind(&table)
            .fetch_one(&admin)
            .await
            .unwrap();
        exists
    };

    // Another queue still has a row: only `a`'s rows go.
    a.delete().await.unwrap();
    assert_eq!(a.message_count().await.unwrap(), 0);
    assert_eq!(b.message_count().await.unwrap(), 1);
    assert!(
        table_exists().await,
        "a table another queue uses was dropped"
    );

    // The last queue: the table goes too; deleting again does nothing.
    b.delete().await.unwrap();
    assert!(!table_exists().await, "the table was left behind");
    b.delete().await.expect("deleting again does nothing");
    a.delete()
        .await
        .expect("deleting a gone table does nothing");

    // `setup` brings it back, empty.
    a.setup().await.unwrap();
    assert_eq!(a.message_count().await.unwrap(), 0);
    a.send(text("again"), None).await.unwrap();
    assert_eq!(receive(&a, 1, Duration::from_secs(10)).await.len(), 1);
    a.delete().await.unwrap();
    assert!(!table_exists().await);
}

envoi_transport_tests::broker_tests! {
    env = "ENVOI_POSTGRES_URL", tests = [
        setup_creates_the_table_and_claim_index_idempotently,
        claims_skip_rows_locked_elsewhere_instead_of_waiting,
        one_listener_connection_serves_every_consumer,
        notify_wakes_a_waiting_consumer_long_before_the_poll_interval,
        wait_for_messages_returns_when_a_message_is_notified,
        polling_delivers_when_listen_is_disabled,
        send_batch_stores_one_row_each_with_ids_in_order_and_delays_in_available_at,
        a_released_message_keeps_its_place_in_line,
        keepalive_moves_the_lease_forward_and_fails_for_a_gone_message,
        expired_lease_redelivers_and_counts_the_delivery,
        get_claims_at_most_the_batch_option,
        messages_postgres_cannot_store_are_refused_with_a_clear_error,
        rows_with_odd_headers_written_by_hand_are_delivered_as_stored_to_be_parked,
        a_row_with_null_headers_in_a_relaxed_table_is_delivered_marked_with_the_rest,
        purge_deletes_only_its_own_queue,
        a_closed_transport_fails_with_closed,
        concurrent_consumers_on_separate_handles_share_the_work_without_duplicates,
        an_empty_get_waits_up_to_the_wait_option_and_not_at_all_with_zero,
        concurrent_sends_are_each_stored_once_under_their_own_id,
        a_send_the_database_refuses_fails_alone_among_concurrent_sends,
        rows_claimed_ahead_are_each_handed_out_once,
        rows_claimed_ahead_are_given_back_on_close_and_drop,
        rows_claimed_ahead_past_their_lease_are_not_given_back_on_close_or_drop,
        without_auto_setup_a_transport_not_set_up_says_to_set_it_up,
        auto_setup_creates_the_table_on_first_use,
        processes_starting_at_once_on_a_new_table_all_send,
        a_rejected_message_is_deleted_not_handed_out_again,
        delete_removes_the_queue_and_drops_the_table_once_no_other_queue_uses_it,
    ];
    tests = [
        a_server_that_refuses_connections_is_named_as_the_cause_not_a_pool_timeout: current_thread,
        a_closed_port_is_unreachable_within_the_connect_timeout: current_thread,
        a_server_that_never_answers_is_unreachable_within_the_connect_timeout: current_thread,
        factory_accepts_postgres_dsns_and_masks_passwords_in_errors: current_thread,
        transport_names_must_be_usable_as_queue_names: current_thread,
        creating_a_transport_outside_a_runtime_is_an_error_not_a_panic: sync,
    ];
}
