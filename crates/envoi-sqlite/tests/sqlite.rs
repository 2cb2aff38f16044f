//! SQLite-specific behaviour: leases across pools and processes, keepalive,
//! restarts, prefetching, wake-ups, DSNs and the schema.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::serializer::INVALID_HEADERS_HEADER;
use envoi_core::testing::Abilities;
use envoi_core::transport::{
    Browse, Keepalive, MessageCount, RawMessage, Receiver, Setup, Teardown, Transport,
    TransportFactory, WakeUp,
};
use envoi_core::TransportError;
use envoi_sqlite::{SqliteConfig, SqliteTransport, SqliteTransportFactory};

mod common;
use common::{db_path, raw_pool};

fn dsn(path: &std::path::Path, options: &str) -> String {
    format!("sqlite://{}?{options}", path.display())
}

fn text(body: &str) -> RawMessage {
    RawMessage {
        body: body.as_bytes().to_vec(),
        ..RawMessage::default()
    }
}

async fn open(path: &std::path::Path, options: &str) -> SqliteTransport {
    let t = SqliteTransport::connect("jobs", &dsn(path, options))
        .await
        .expect("open");
    t.setup().await.expect("setup");
    t
}

async fn bodies_within(t: &SqliteTransport, n: usize, within: Duration) -> Vec<String> {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(5);
        let got = common::within(left, "a get", t.get(n - out.len())).await;
        for d in got.expect("get") {
            t.ack(&d.id).await.expect("ack");
            out.push(String::from_utf8(d.raw.body).expect("utf-8"));
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_fails_half_way_stores_none_of_its_messages() {
    let path = db_path("batch-atomic");
    let t = open(&path, "").await;
    // Another program's trigger refuses one row of the batch: the 80th.
    let pool = raw_pool(&path).await;
    sqlx::query(
        "CREATE TRIGGER refuse_bad BEFORE INSERT ON envoi_jobs WHEN NEW.body = CAST('bad' AS BLOB) \
         BEGIN SELECT RAISE(ABORT, 'bad row'); END",
    )
    .execute(&pool)
    .await
    .expect("trigger");
    pool.close().await;

    let batch: Vec<(RawMessage, Option<Duration>)> = (0..100)
        .map(|i| (text(if i == 79 { "bad" } else { "good" }), None))
        .collect();
    let sent = t.send_batch(batch).await;
    assert!(sent.is_err(), "{sent:?}");
    // Told it failed, the caller may send it again: nothing of it is stored.
    assert_eq!(t.message_count().await.expect("count"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expires_for_another_pool_on_the_same_file_unless_kept_alive() {
    let path = db_path("lease");
    const LEASE: Duration = Duration::from_secs(2);
    let a = open(&path, "lease=2s&batch=1&poll=20ms").await;
    let b = open(&path, "lease=2s&batch=1&poll=20ms").await;
    a.send(text("held"), None).await.expect("send");
    let held = a.get(1).await.expect("get").remove(0);

    // Kept alive every 200 ms for two leases: the other pool never gets it.
    let until = Instant::now() + 2 * LEASE;
    let mut kept_at = Instant::now();
    while Instant::now() < until {
        assert!(
            b.get(10).await.expect("get").is_empty(),
            "stolen while kept alive"
        );
        kept_at = Instant::now();
        a.keepalive(&held.id).await.expect("keepalive");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The holder goes silent: after the lease the other pool gets it.
    let silent_at = Instant::now();
    let mut again = Vec::new();
    while again.is_empty() && silent_at.elapsed() < Duration::from_secs(15) {
        again = b.get(1).await.expect("get");
    }
    let back_after = kept_at.elapsed();
    assert_eq!(
        again.len(),
        1,
        "the message never came back after its lease"
    );
    // The last keepalive leased it for a lease from when it ran, after
    // `kept_at` (the margin covers the clock counting whole milliseconds).
    assert!(
        back_after + Duration::from_millis(5) >= LEASE,
        "came back {back_after:?} after the last keepalive, before its {LEASE:?} lease ran out"
    );
    assert_eq!(
        again[0].id, held.id,
        "the row keeps its id across deliveries"
    );
    b.ack(&again[0].id).await.expect("ack");
    assert_eq!(a.message_count().await.expect("count"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_waiting_messages_and_redelivers_leased_ones_after_the_lease() {
    // Far longer than the few statements that must run within it.
    const LEASE: Duration = Duration::from_secs(5);
    let path = db_path("restart");
    let a = open(&path, "lease=5s&batch=1").await;
    for i in 0..10 {
        a.send(text(&format!("m{i}")), None).await.expect("send");
    }
    let taken_at = Instant::now();
    let taken = a.get(3).await.expect("get");
    assert_eq!(taken.len(), 3);
    a.close().await.expect("close");
    drop(a);

    let b = open(&path, "lease=5s&batch=1&poll=20ms").await;
    let waiting = bodies_within(&b, 7, Duration::from_secs(10)).await;
    let expected: Vec<String> = (3..10).map(|i| format!("m{i}")).collect();
    assert_eq!(
        waiting, expected,
        "waiting messages after a restart (the leased ones not among them)"
    );
    assert!(
        b.get(10).await.expect("get").is_empty(),
        "leased messages were handed out before their lease expired"
    );
    let leased = bodies_within(&b, 3, Duration::from_secs(20)).await;
    let back_after = taken_at.elapsed();
    assert_eq!(leased, ["m0", "m1", "m2"]);
    assert!(
        back_after + Duration::from_millis(5) >= LEASE,
        "leased messages came back {back_after:?} after they were taken, before their {LEASE:?} lease ran out"
    );
    assert_eq!(b.message_count().await.expect("count"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_a_killed_worker_process_come_back_and_acked_ones_do_not() {
    use std::io::{BufRead, BufReader};

    // The test binary runs itself as the worker that gets killed: it claims
    // messages, acks two, says so, then waits for SIGKILL.
    if let Ok(dsn) = std::env::var("ENVOI_SQLITE_CHILD_DSN") {
        let t = SqliteTransport::connect("jobs", &dsn).await.expect("open");
        let got = t.get(5).await.expect("get");
        assert_eq!(got.len(), 5, "the child expected 5 messages");
        for d in &got[..2] {
            t.ack(&d.id).await.expect("ack");
        }
        println!("CHILD-READY");
        tokio::time::sleep(Duration::from_secs(120)).await;
        panic!("the child was not killed");
    }

    let path = db_path("killed");
    let options = "lease=1s&poll=20ms&batch=16";
    let parent = open(&path, options).await;
    for i in 0..20 {
        parent
            .send(text(&format!("job-{i:02}")), None)
            .await
            .expect("send");
    }
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "messages_of_a_killed_worker_process_come_back_and_acked_ones_do_not",
            "--exact",
            "--nocapture",
        ])
        .env("ENVOI_SQLITE_CHILD_DSN", dsn(&path, options))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the child worker");
    let stdout = child.stdout.take().expect("child stdout");
    let ready = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|l| l.contains("CHILD-READY"))
    });
    let ready = tokio::time::timeout(Duration::from_secs(60), ready)
        .await
        .expect("the child did not get ready in time")
        .expect("reading the child");
    assert!(ready, "the child exited without claiming");
    child.kill().expect("SIGKILL the child"); // SIGKILL on Unix
    child.wait().expect("reap the child");

    // The child claimed 16 rows (batch=16), took 5 of them and acked 2: 18
    // are left, 14 of them leased to a dead process.
    let got = bodies_within(&parent, 18, Duration::from_secs(30)).await;
    assert_eq!(got.len(), 18, "lost messages: got {got:?}");
    let expected: Vec<String> = (2..20).map(|i| format!("job-{i:02}")).collect();
    assert_eq!(got, expected, "the two acked jobs are the oldest");
    assert_eq!(parent.message_count().await.expect("count"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetched_messages_are_given_back_when_the_handle_is_dropped() {
    let path = db_path("prefetch");
    let a = open(&path, "lease=60s&batch=16").await;
    for i in 0..5 {
        a.send(text(&format!("p{i}")), None).await.expect("send");
    }
    let first = a.get(1).await.expect("get");
    assert_eq!(first.len(), 1);
    let b = open(&path, "lease=60s&batch=1&poll=20ms").await;
    assert!(
        b.get(10).await.expect("get").is_empty(),
        "the rows a prefetched are leased to it"
    );
    a.ack(&first[0].id).await.expect("ack");
    drop(a);
    // Dropping releases in the background; well before the 60 s lease.
    let rest = bodies_within(&b, 4, Duration::from_secs(10)).await;
    assert_eq!(rest, ["p1", "p2", "p3", "p4"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_wakes_a_consumer_waiting_on_another_handle() {
    let path = db_path("wake");
    let consumer = open(&path, "poll=20s").await;
    let producer = open(&path, "poll=20s").await;
    let waiting = tokio::spawn(async move {
        let started = Instant::now();
        let got = consumer.get(1).await.expect("get");
        (got, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    producer.send(text("wake up"), None).await.expect("send");
    let (got, waited) = common::within(Duration::from_secs(30), "the waiting consumer", waiting)
        .await
        .expect("consumer task");
    assert_eq!(got.len(), 1, "the consumer woke without the message");
    assert!(
        waited < Duration::from_secs(10),
        "the consumer waited {waited:?}: it was not woken by the send"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn factory_turns_bad_dsns_into_invalid_dsn_errors() {
    let factory = SqliteTransportFactory;
    assert!(factory.supports("sqlite://x.db"));
    assert!(factory.supports("sqlite:x.db"));
    assert!(!factory.supports("postgres://u:p@h/db"));
    for bad in [
        "sqlite://",
        "sqlite::memory:",
        "sqlite://x.db?lease=forever",
        "sqlite://x.db?table=a;drop",
        "sqlite://x.db?unknown=1",
    ] {
        match factory.create("jobs", bad).await {
            Err(TransportError::InvalidDsn { dsn, reason }) => {
                assert_eq!(dsn, bad);
                assert!(!reason.is_empty());
            }
            Err(other) => panic!("{bad}: expected InvalidDsn, got {other}"),
            Ok(_) => panic!("{bad}: accepted"),
        }
    }
    let path = db_path("factory");
    let t = factory
        .create("jobs", &dsn(&path, "lease=5s"))
        .await
        .expect("a good DSN");
    t.send(text("via factory"), None).await.expect("send");
    assert_eq!(t.counter().message_count().await.expect("count"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unopenable_database_is_a_backend_error() {
    let dir = db_path("not-a-file");
    std::fs::create_dir_all(&dir).expect("mkdir");
    match SqliteTransport::connect("jobs", &dsn(&dir, "")).await {
        Err(TransportError::Backend { context, .. }) => {
            assert!(context.contains("opening SQLite database"), "{context}")
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_auto_setup_the_table_must_be_set_up_first() {
    let path = db_path("no-auto-setup");
    let t = SqliteTransport::connect("jobs", &dsn(&path, "auto_setup=false"))
        .await
        .expect("open");
    let err = t
        .send(text("too early"), None)
        .await
        .expect_err("no table yet");
    assert!(
        format!("{err}").contains("envoi_jobs"),
        "the error names the table: {err}"
    );
    assert!(
        format!("{err}").contains("set the transport up first"),
        "the error says what to do: {err}"
    );
    t.setup().await.expect("setup");
    t.send(text("now"), None).await.expect("send after setup");
    assert_eq!(t.message_count().await.expect("count"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_has_the_documented_columns_and_claim_index() {
    let path = db_path("schema");
    let t = open(&path, "table=envoi_queue").await;
    assert_eq!(t.table(), "envoi_queue");
    let pool = raw_pool(&path).await;
    let columns: Vec<(String, String)> =
        sqlx::query_as("SELECT name, type FROM pragma_table_info('envoi_queue') ORDER BY cid")
            .fetch_all(&pool)
            .await
            .expect("table_info");
    let expected = [
        ("id", "INTEGER"),
        ("queue_name", "TEXT"),
        ("body", "BLOB"),
        ("headers", "TEXT"),
        ("created_at", "INTEGER"),
        ("available_at", "INTEGER"),
        ("delivered_at", "INTEGER"),
        ("lease_until", "INTEGER"),
        ("delivery_count", "INTEGER"),
    ];
    let columns: Vec<(&str, &str)> = columns
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    assert_eq!(columns, expected);
    let index: Vec<(String,)> =
        sqlx::query_as("SELECT name FROM pragma_index_info('envoi_queue:claim') ORDER BY seqno")
            .fetch_all(&pool)
            .await
            .expect("index_info");
    let index: Vec<&str> = index.iter().map(|(n,)| n.as_str()).collect();
    assert_eq!(index, ["queue_name", "available_at", "id"]);
    let mode: (String,) = sqlx::query_as("PRAGMA journal_mode")
        .fetch_one(&pool)
        .await
        .expect("journal_mode");
    assert_eq!(mode.0, "wal");
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_with_malformed_headers_is_delivered_with_the_reason() {
    let path = db_path("bad-headers");
    let t = open(&path, "poll=20ms").await;
    let pool = raw_pool(&path).await;
    sqlx::query(
        "INSERT INTO envoi_jobs (queue_name, body, headers, created_at, available_at) \
         VALUES ('jobs', x'7b7d', 'not json', 0, 0)",
    )
    .execute(&pool)
    .await
    .expect("raw insert");
    pool.close().await;
    let got = t.get(1).await.expect("get");
    assert_eq!(got.len(), 1, "the malformed row must still be handed out");
    let reason = got[0]
        .raw
        .header(INVALID_HEADERS_HEADER)
        .expect("the delivery says what is wrong");
    assert!(reason.contains("not a JSON object"), "{reason}");
    assert_eq!(got[0].raw.body, b"{}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transports_sharing_a_table_and_handles_sharing_a_connection_stay_apart() {
    let path = db_path("shared");
    let options = dsn(&path, "table=shared&poll=20ms");
    let orders = Arc::new(
        SqliteTransport::connect("orders", &options)
            .await
            .expect("open"),
    );
    let mails = SqliteTransport::connect("mails", &options)
        .await
        .expect("open");
    orders.send(text("order"), None).await.expect("send");
    mails.send(text("mail"), None).await.expect("send");
    let clone = (*orders).clone();
    assert_eq!(orders.message_count().await.expect("count"), 1);
    let got = clone.get(10).await.expect("get");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].raw.body, b"order");
    assert!(
        mails.find(&got[0].id).await.expect("find").is_none(),
        "another transport's row is visible through `find`"
    );
    mails
        .ack(&got[0].id)
        .await
        .expect("ack of a foreign id is a no-op");
    assert_eq!(orders.message_count().await.expect("count"), 1);
    orders.ack(&got[0].id).await.expect("ack");
    assert_eq!(orders.message_count().await.expect("count"), 0);
    assert_eq!(mails.message_count().await.expect("count"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_messages_returns_when_a_message_is_sent_and_times_out_otherwise() {
    let path = db_path("wait");
    let consumer = open(&path, "poll=0s").await;
    let producer = open(&path, "poll=0s").await;
    assert!(consumer.get(10).await.expect("get").is_empty());

    // Nothing sent: the wait lasts its timeout.
    let started = Instant::now();
    consumer.wait_for_messages(Duration::from_millis(300)).await;
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "returned after {:?} with nothing sent",
        started.elapsed()
    );

    // A send after the empty get but before the wait: returns at once.
    producer.send(text("early"), None).await.expect("send");
    let started = Instant::now();
    consumer.wait_for_messages(Duration::from_secs(20)).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "missed a send made before the wait"
    );
    let got = consumer.get(10).await.expect("get");
    assert_eq!(got.len(), 1);
    consumer.ack(&got[0].id).await.expect("ack");
    assert!(consumer.get(10).await.expect("get").is_empty());

    // A send during the wait wakes it.
    let waiter = {
        let consumer = consumer.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            consumer.wait_for_messages(Duration::from_secs(20)).await;
            started.elapsed()
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    producer.send(text("late"), None).await.expect("send");
    let waited = common::within(Duration::from_secs(30), "the waiting consumer", waiter)
        .await
        .expect("waiter");
    assert!(
        waited < Duration::from_secs(10),
        "the wait was not woken by the send ({waited:?})"
    );
    assert_eq!(consumer.get(10).await.expect("get").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_get_claims_only_what_it_asks_for() {
    let path = db_path("no-prefetch");
    let a = open(&path, "lease=60s").await;
    let b = open(&path, "lease=60s&poll=20ms").await;
    for i in 0..3 {
        a.send(text(&format!("n{i}")), None).await.expect("send");
    }
    let first = a.get(1).await.expect("get");
    assert_eq!(first.len(), 1);
    let others = bodies_within(&b, 2, Duration::from_secs(5)).await;
    assert_eq!(
        others,
        ["n1", "n2"],
        "rows beyond the one asked for were held back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_timeout_sqlite_cannot_take_is_an_invalid_dsn() {
    let path = db_path("busy-timeout-too-long");
    // SQLite takes the busy timeout in milliseconds as a C int: 1000 hours
    // is more than it holds.
    let bad = dsn(&path, "busy_timeout=1000h");
    match SqliteTransport::connect("jobs", &bad).await {
        Err(TransportError::InvalidDsn { reason, .. }) => {
            assert!(reason.contains("busy_timeout"), "{reason}")
        }
        other => panic!("expected InvalidDsn, got {other:?}"),
    }
    let mut config = SqliteConfig::new(&path);
    config.busy_timeout = Duration::from_secs(1000 * 3600);
    match SqliteTransport::with_config("jobs", config).await {
        Err(TransportError::InvalidDsn { reason, .. }) => {
            assert!(reason.contains("busy_timeout"), "{reason}")
        }
        other => panic!("expected InvalidDsn, got {other:?}"),
    }
    // The longest it can take still opens.
    let t = open(&path, "busy_timeout=596h").await;
    t.send(text("x"), None).await.expect("send");
    assert_eq!(t.message_count().await.expect("count"), 1);
}

/// Prefetched rows kept past their lease may have been claimed by another
/// consumer since: giving them back must not end that consumer's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetched_rows_whose_lease_ran_out_are_not_taken_from_their_new_holder() {
    let path = db_path("stale-prefetch");
    let a = open(&path, "batch=4&lease=300ms&poll=0").await;
    let b = open(&path, "lease=60s&poll=0").await;
    let c = open(&path, "lease=60s&poll=0").await;
    for i in 0..4 {
        a.send(text(&format!("m{i}")), None).await.expect("send");
    }
    // `a` hands out one and keeps three, leased for 300 ms.
    assert_eq!(a.get(1).await.expect("get").len(), 1);
    tokio::time::sleep(Duration::from_millis(450)).await;
    // The leases ran out: `b` claims all four and is still handling them.
    assert_eq!(b.get(10).await.expect("get").len(), 4);
    // `a` finds its kept rows stale and gives them back: they are `b`'s now.
    let got = a.get(1).await.expect("get");
    assert!(got.is_empty(), "a took back b's messages: {got:?}");
    let got = c.get(10).await.expect("get");
    assert!(got.is_empty(), "b's leases were ended: {got:?}");

    // The same when the holder of stale rows is closed or dropped.
    for i in 4..8 {
        a.send(text(&format!("m{i}")), None).await.expect("send");
    }
    assert_eq!(a.get(1).await.expect("get").len(), 1);
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert_eq!(b.get(10).await.expect("get").len(), 4);
    a.close().await.expect("close");
    drop(a);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let got = c.get(10).await.expect("get");
    assert!(got.is_empty(), "b's leases were ended: {got:?}");
}

/// A configuration built in code is checked as a DSN's is: a lease under
/// 1 ms would hand every message out again at once, a poll over 1 m would
/// keep an idle worker asked to stop waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_built_in_code_is_checked_like_a_dsn() {
    let path = db_path("config-in-code");
    let mut no_lease = SqliteConfig::new(&path);
    no_lease.lease = Duration::ZERO;
    let mut long_poll = SqliteConfig::new(&path);
    long_poll.poll = Duration::from_secs(3600);
    let mut no_batch = SqliteConfig::new(&path);
    no_batch.batch = 0;
    let mut bad_table = SqliteConfig::new(&path);
    bad_table.table = Some("a;drop".into());
    for (config, option) in [
        (no_lease, "`lease`"),
        (long_poll, "`poll`"),
        (no_batch, "`batch`"),
        (bad_table, "table name"),
    ] {
        match SqliteTransport::with_config("jobs", config).await {
            Err(TransportError::InvalidDsn { reason, .. }) => {
                assert!(reason.contains(option), "{reason}")
            }
            other => panic!("{option}: expected InvalidDsn, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transports_named_x_and_x_claim_share_a_file() {
    let path = db_path("claim-names");
    // `open` sets up the transport `jobs`, table `envoi_jobs`.
    let jobs = open(&path, "").await;
    let claims = SqliteTransport::connect("jobs_claim", &dsn(&path, "poll=20ms"))
        .await
        .expect("connect jobs_claim");
    claims.setup().await.expect("setup jobs_claim beside jobs");
    assert_eq!(claims.table(), "envoi_jobs_claim");
    claims.send(text("claim"), None).await.expect("send");
    assert_eq!(
        bodies_within(&claims, 1, Duration::from_secs(5)).await,
        ["claim"]
    );
    assert_eq!(jobs.message_count().await.expect("count"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_replaces_the_claim_index_under_its_former_name() {
    let path = db_path("legacy-index");
    let t = open(&path, "table=envoi_queue").await;
    t.setup().await.expect("setup");
    let pool = raw_pool(&path).await;
    sqlx::query("DROP INDEX \"envoi_queue:claim\"")
        .execute(&pool)
        .await
        .expect("drop index");
    sqlx::query("CREATE INDEX envoi_queue_claim ON envoi_queue (queue_name, available_at, id)")
        .execute(&pool)
        .await
        .expect("index under the former name");
    t.setup().await.expect("setup again");
    let indexes: Vec<(String,)> = sqlx::query_as(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'envoi_queue' \
         ORDER BY name",
    )
    .fetch_all(&pool)
    .await
    .expect("indexes");
    let indexes: Vec<&str> = indexes.iter().map(|(n,)| n.as_str()).collect();
    assert_eq!(indexes, ["envoi_queue:claim"]);
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_adds_the_delivery_count_to_a_table_made_without_it() {
    let path = db_path("no-delivery-count");
    std::fs::create_dir_all(path.parent().expect("dir")).expect("test dir");
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}?mode=rwc", path.display()))
        .await
        .expect("new database");
    // The table as set up before the column existed, holding one message
    // whose lease ran out and one never handed out.
    sqlx::query(
        "CREATE TABLE envoi_jobs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            queue_name TEXT NOT NULL,
            body BLOB NOT NULL,
            headers TEXT NOT NULL,
            created_at INTEGER NOT NULL,
            available_at INTEGER NOT NULL CHECK (typeof(available_at) = 'integer'),
            delivered_at INTEGER,
            lease_until INTEGER
        )",
    )
    .execute(&pool)
    .await
    .expect("old table");
    sqlx::query(
        "INSERT INTO envoi_jobs (queue_name, body, headers, created_at, available_at, delivered_at, lease_until)
         VALUES ('jobs', 'leased', '{}', 1, 2, 1, 2), ('jobs', 'waiting', '{}', 1, 3, NULL, NULL)",
    )
    .execute(&pool)
    .await
    .expect("old rows");
    let early = SqliteTransport::connect("jobs", &dsn(&path, "auto_setup=false"))
        .await
        .expect("open");
    let err = early.get(1).await.expect_err("the claim needs the column");
    assert!(
        format!("{err}").contains("set the transport up first"),
        "the error says what to do: {err}"
    );
    let t = open(&path, "batch=1").await;
    // Set up twice, as two processes would: the column is added once.
    t.setup().await.expect("setup again");
    let columns: Vec<(String,)> = sqlx::query_as(
        "SELECT name FROM pragma_table_info('envoi_jobs') WHERE name = 'delivery_count'",
    )
    .fetch_all(&pool)
    .await
    .expect("table_info");
    assert_eq!(columns.len(), 1, "setup adds the column");
    let got = t.get(2).await.expect("claim on the migrated table");
    let bodies: Vec<&[u8]> = got.iter().map(|d| d.raw.body.as_slice()).collect();
    assert_eq!(bodies, [b"leased".as_slice(), b"waiting".as_slice()]);
    // Counted from the migration on: neither claim is known to be a second.
    assert!(got.iter().all(|d| !d.redelivered));
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_or_expired_message_is_marked_and_a_prefetched_one_given_back_is_not() {
    let path = db_path("marks");
    let a = open(&path, "lease=60s&batch=4").await;
    for body in ["released", "prefetched"] {
        a.send(text(body), None).await.expect("send");
    }
    // Claims both, hands out one, keeps the other.
    let first = a.get(1).await.expect("get");
    assert_eq!(first[0].raw.body, b"released");
    assert!(!first[0].redelivered, "handed out the first time");
    a.release(&first[0].id).await.expect("release");
    drop(a);
    let b = open(&path, "lease=60s&batch=1&poll=20ms").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < 2 && Instant::now() < deadline {
        got.extend(b.get(2).await.expect("get"));
    }
    let marks: Vec<(&[u8], bool)> = got
        .iter()
        .map(|d| (d.raw.body.as_slice(), d.redelivered))
        .collect();
    assert_eq!(
        marks,
        [
            (b"released".as_slice(), true),
            (b"prefetched".as_slice(), false)
        ],
        "the released message was handed out before; the prefetched one was not"
    );
}

/// No header is the transport's: one named `X-Envoi-Redelivered` stored in
/// a row is an ordinary header, handed out as it is, and only the row's
/// delivery count marks a delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_redelivered_header_is_an_ordinary_header_and_does_not_mark_a_first_delivery() {
    let path = db_path("stored-mark");
    let t = open(&path, "").await;
    let pool = raw_pool(&path).await;
    sqlx::query(
        "INSERT INTO envoi_jobs (queue_name, body, headers, created_at, available_at)
         VALUES ('jobs', 'x', '{\"X-Envoi-Redelivered\":\"true\"}', 1, 1)",
    )
    .execute(&pool)
    .await
    .expect("row written by hand");
    let got = t.get(1).await.expect("get");
    assert_eq!(got.len(), 1);
    assert!(!got[0].redelivered, "the stored header is not the mark");
    assert_eq!(got[0].raw.header("X-Envoi-Redelivered"), Some("true"));
    assert_eq!(got[0].raw.header(INVALID_HEADERS_HEADER), None);
    pool.close().await;
}

/// A rejected message is deleted, as an acknowledged one: it never comes
/// back, whether its lease runs out or another handle looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_message_is_deleted() {
    let path = db_path("reject");
    let t = open(&path, "lease=300ms&poll=20ms").await;
    t.send(text("bad"), None).await.expect("send");
    t.send(text("good"), None).await.expect("send");
    let got = t.get(2).await.expect("get");
    assert_eq!(got.len(), 2);
    t.reject(&got[0].id).await.expect("reject");
    t.release(&got[1].id).await.expect("release");
    assert_eq!(t.message_count().await.expect("count"), 1);
    assert!(t.find(&got[0].id).await.expect("find").is_none());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(bodies_within(&t, 2, Duration::from_secs(2)).await, ["good"]);
    let unknown = t.reject(&"not-an-id".into()).await;
    assert!(
        matches!(unknown, Err(TransportError::NotFound(ref id)) if id == "not-an-id"),
        "{unknown:?}"
    );
}

/// `purge` deletes this transport's rows, leased and delayed ones included,
/// and no other's; `delete` drops the table once no transport's rows are
/// left in it, does nothing without one, and with `auto_setup` the next use
/// creates it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_and_delete_remove_only_this_transport_s_rows_and_the_table_once_unused() {
    let path = db_path("teardown");
    let options = dsn(&path, "table=shared&batch=4&poll=0");
    let orders = SqliteTransport::connect("orders", &options)
        .await
        .expect("open");
    let mails = SqliteTransport::connect("mails", &options)
        .await
        .expect("open");
    for body in ["leased", "kept", "waiting"] {
        orders.send(text(body), None).await.expect("send");
    }
    orders
        .send(text("delayed"), Some(Duration::from_secs(60)))
        .await
        .expect("send");
    mails.send(text("mail"), None).await.expect("send");
    // One handed out, two kept by this handle (batch=4).
    assert_eq!(orders.get(1).await.expect("get").len(), 1);
    assert_eq!(orders.purge().await.expect("purge"), 4);
    assert_eq!(orders.message_count().await.expect("count"), 0);
    assert!(
        orders.get(10).await.expect("get").is_empty(),
        "kept rows are forgotten"
    );
    assert_eq!(mails.message_count().await.expect("count"), 1);
    assert_eq!(orders.purge().await.expect("purge again"), 0);

    let table_exists = |pool: sqlx::SqlitePool| async move {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'shared'",
        )
        .fetch_one(&pool)
        .await
        .expect("sqlite_master");
        pool.close().await;
        n == 1
    };
    orders.send(text("again"), None).await.expect("send");
    orders.delete().await.expect("delete");
    assert!(
        table_exists(raw_pool(&path).await).await,
        "the table still holds another transport's row"
    );
    assert_eq!(orders.message_count().await.expect("count"), 0);
    assert_eq!(mails.message_count().await.expect("count"), 1);
    mails.delete().await.expect("delete");
    assert!(!table_exists(raw_pool(&path).await).await, "dropped");
    mails.delete().await.expect("deleting again does nothing");
    // With auto_setup, the next use creates the table again.
    mails.send(text("after"), None).await.expect("send");
    assert_eq!(mails.message_count().await.expect("count"), 1);
}

/// `close` gives back what the handle kept, stops the writer and closes
/// the connections: every clone fails with `Closed` afterwards, and
/// closing again does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_gives_back_kept_rows_and_closes_every_clone() {
    let path = db_path("close");
    let a = open(&path, "lease=60s&batch=8&poll=0").await;
    for i in 0..3 {
        a.send(text(&format!("c{i}")), None).await.expect("send");
    }
    assert_eq!(a.get(1).await.expect("get").len(), 1);
    let clone = a.clone();
    a.close().await.expect("close");
    a.close().await.expect("close again");
    for outcome in [
        clone.send(text("late"), None).await.map(drop),
        clone.get(1).await.map(drop),
        clone.message_count().await.map(drop),
    ] {
        assert!(
            matches!(outcome, Err(TransportError::Closed)),
            "{outcome:?}"
        );
    }
    let b = open(&path, "lease=60s&poll=0").await;
    let mut got: Vec<Vec<u8>> = b
        .get(10)
        .await
        .expect("get")
        .into_iter()
        .map(|d| d.raw.body)
        .collect();
    got.sort();
    assert_eq!(
        got,
        [b"c1".to_vec(), b"c2".to_vec()],
        "kept rows given back"
    );
}
