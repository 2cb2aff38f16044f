//! Rows written by something other than envoi: a body or headers of the
//! wrong storage type, headers that are not UTF-8, not JSON, or a JSON
//! object holding more than strings. Each is handed out once, with what can
//! be read of it and the reason, and a worker parks it in the failure
//! transport instead of the row coming back on every claim.

use envoi_core::testing::Within;

/// The longest a test waits for a worker to stop before it fails (real
/// time, whatever the tokio clock does).
const WAIT: std::time::Duration = std::time::Duration::from_secs(120);

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoi_core::serializer::{INVALID_BODY_HEADER, INVALID_HEADERS_HEADER};
use envoi_core::stamp::ErrorDetailsStamp;
use envoi_core::testing::Abilities;
use envoi_core::transport::support::STORED_HEADERS_HEADER;
use envoi_core::transport::{Browse, Delivery, MessageCount, Receiver, Setup};
use envoi_core::worker::{StopReason, Worker, WorkerEvent};
use envoi_core::{Command, Message, Messenger};
use envoi_sqlite::{SqliteTransport, SqliteTransportFactory};
use serde::{Deserialize, Serialize};

mod common;
use common::{db_path, raw_pool};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Job {
    n: u32,
}
impl Message for Job {
    const NAME: &'static str = "Job";
}

#[derive(Debug, thiserror::Error)]
#[error("never fails")]
struct Never;

impl Command for Job {
    type Output = ();
    type Error = Never;
}

/// A row as something else might write it, and what the delivery of it
/// holds.
struct Row {
    /// The SQL of the stored body.
    body: &'static str,
    /// The SQL of the stored headers.
    headers: &'static str,
    /// The body handed out.
    delivered_body: &'static [u8],
    /// The `type` header handed out, when it could be read.
    delivered_type: Option<&'static str>,
    /// Which header says what is wrong, and a part of what it says.
    reason: (&'static str, &'static str),
    /// The stored headers kept in [`STORED_HEADERS_HEADER`].
    stored: Option<&'static str>,
}

const ROWS: [Row; 5] = [
    Row {
        // `{"n":1}`: a body that decodes, so only the reason parks it.
        body: "x'7b226e223a317d'",
        headers: r#"CAST('{"type":"Job"}' AS BLOB)"#,
        delivered_body: br#"{"n":1}"#,
        delivered_type: Some("Job"),
        reason: (INVALID_HEADERS_HEADER, "headers stored as BLOB, not TEXT"),
        stored: Some(r#"{"type":"Job"}"#),
    },
    Row {
        // `{"n":1}`: a body that decodes, so only the reason parks it.
        body: "x'7b226e223a317d'",
        headers: "CAST(x'7b22ff223a2231227d' AS TEXT)",
        delivered_body: br#"{"n":1}"#,
        delivered_type: None,
        reason: (INVALID_HEADERS_HEADER, "stored headers are not UTF-8"),
        stored: Some("x'7b22ff223a2231227d'"),
    },
    Row {
        body: "5",
        headers: r#"'{"type":"Job"}'"#,
        delivered_body: b"5",
        delivered_type: Some("Job"),
        reason: (INVALID_BODY_HEADER, "body stored as INTEGER, not BLOB"),
        stored: None,
    },
    Row {
        // `{"n":1}`: a body that decodes, so only the reason parks it.
        body: "x'7b226e223a317d'",
        headers: "'not json'",
        delivered_body: br#"{"n":1}"#,
        delivered_type: None,
        reason: (
            INVALID_HEADERS_HEADER,
            "stored headers are not a JSON object of strings: expected ident",
        ),
        stored: Some("not json"),
    },
    Row {
        // `{"n":1}`: a body that decodes, so only the reason parks it.
        body: "x'7b226e223a317d'",
        headers: r#"'{"type":"Job","n":1}'"#,
        delivered_body: br#"{"n":1}"#,
        delivered_type: Some("Job"),
        reason: (
            INVALID_HEADERS_HEADER,
            "stored headers are not a JSON object of strings: `n` holds a number",
        ),
        stored: Some(r#"{"type":"Job","n":1}"#),
    },
];

/// Inserts [`ROWS`] into `table` for queue `jobs`, as another program would.
async fn insert_rows(path: &Path, table: &str) {
    let pool = raw_pool(path).await;
    for row in &ROWS {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table} (queue_name, body, headers, created_at, available_at) \
             VALUES ('jobs', {}, {}, 0, 0)",
            row.body, row.headers
        )))
        .execute(&pool)
        .await
        .expect("raw insert");
    }
    pool.close().await;
}

/// Asserts that `raw` holds what can be read of `row` and says what is
/// wrong with it.
fn assert_salvaged(got: &envoi_core::transport::RawMessage, row: &Row) {
    let what = row.headers;
    assert_eq!(got.body, row.delivered_body, "{what}: body");
    assert_eq!(got.header("type"), row.delivered_type, "{what}: type");
    let (header, says) = row.reason;
    let reason = got
        .header(header)
        .unwrap_or_else(|| panic!("{what}: no `{header}` saying what is wrong"));
    assert!(reason.contains(says), "{what}: {reason}");
    assert_eq!(
        got.header(STORED_HEADERS_HEADER),
        row.stored,
        "{what}: stored text"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_the_wrong_storage_type_or_with_invalid_headers_are_handed_out_once_with_the_reason(
) {
    let path = db_path("malformed-get");
    let dsn = format!("sqlite://{}?poll=20ms&lease=60s", path.display());
    let t = SqliteTransport::connect("jobs", &dsn).await.expect("open");
    t.setup().await.expect("setup");
    insert_rows(&path, "envoi_jobs").await;

    let got: Vec<Delivery> = t.get(10).await.expect("get");
    assert_eq!(got.len(), ROWS.len(), "every row is handed out");
    for (d, row) in got.iter().zip(&ROWS) {
        assert_salvaged(&d.raw, row);
    }
    // Handed out once: leased like any delivery, not given back at once.
    assert!(
        t.get(10).await.expect("get").is_empty(),
        "a malformed row was handed out again while leased"
    );
    // `list` and `find` read them the same way.
    let listed = t.list(10).await.expect("list");
    assert_eq!(listed.len(), ROWS.len());
    for (d, row) in listed.iter().zip(&ROWS) {
        assert_salvaged(&d.raw, row);
    }
    let found = t.find(&got[1].id).await.expect("find").expect("found");
    assert_salvaged(&found.raw, &ROWS[1]);

    assert_eq!(t.message_count().await.expect("count"), 5);
    for d in &got {
        t.ack(&d.id).await.expect("ack");
    }
    assert_eq!(t.message_count().await.expect("count"), 0);
}

#[tokio::test]
async fn a_row_whose_due_time_is_not_a_number_is_refused_by_the_table() {
    // Text compares above every number in SQLite: such a row would never be
    // due, never claimed, and counted as waiting for ever.
    let path = db_path("malformed-due");
    let t = SqliteTransport::connect("jobs", &format!("sqlite://{}", path.display()))
        .await
        .expect("open");
    t.setup().await.expect("setup");
    let pool = raw_pool(&path).await;
    let refused = sqlx::query(
        "INSERT INTO envoi_jobs (queue_name, body, headers, created_at, available_at) \
         VALUES ('jobs', x'7b7d', '{}', 0, 'soon')",
    )
    .execute(&pool)
    .await
    .expect_err("a due time that is not a number");
    assert!(
        refused.to_string().contains("CHECK constraint failed"),
        "{refused}"
    );
    pool.close().await;
    assert_eq!(t.message_count().await.expect("count"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_parks_each_malformed_row_once_with_the_reason_and_acks_it() {
    let path = db_path("malformed-worker");
    let dsn = format!("sqlite://{}?poll=20ms", path.display());
    let handled = Arc::new(Mutex::new(0_u32));
    let count = handled.clone();
    let messenger = Messenger::builder()
        .command_handler(move |_: Job| {
            let count = count.clone();
            async move {
                *count.lock().unwrap() += 1;
                Ok::<_, Never>(())
            }
        })
        .transport_factory(SqliteTransportFactory)
        .transport_dsn("jobs", dsn.as_str())
        .transport_dsn("failed", dsn.as_str())
        .route::<Job>("jobs")
        .failure_transport("failed")
        .build_async()
        .await
        .expect("messenger");
    let jobs = messenger.transport("jobs").expect("jobs transport");
    let failed = messenger.transport("failed").expect("failure transport");
    jobs.as_setup()
        .expect("setup")
        .setup()
        .await
        .expect("setup");
    failed
        .as_setup()
        .expect("setup")
        .setup()
        .await
        .expect("setup");
    insert_rows(&path, "envoi_jobs").await;
    assert_eq!(jobs.counter().message_count().await.expect("count"), 5);

    let events = Arc::new(Mutex::new(Vec::new()));
    let log = events.clone();
    let report = Worker::builder(&messenger)
        .receiver("jobs")
        .concurrency(1)
        .stop_when_empty()
        .idle_sleep(Duration::from_millis(20))
        // A row coming back on every claim would keep the worker busy
        // until this limit, not empty.
        .time_limit(Duration::from_secs(30))
        .listener(move |e: &WorkerEvent| {
            if let WorkerEvent::Failed {
                id,
                parked_in,
                released,
                ..
            } = e
            {
                log.lock()
                    .unwrap()
                    .push((id.clone(), parked_in.clone(), *released));
            }
        })
        .build()
        .expect("worker")
        .run()
        .within(WAIT, "the worker to stop")
        .await;

    assert_eq!(report.reason, StopReason::Empty, "the queue never emptied");
    assert_eq!(*handled.lock().unwrap(), 0, "no malformed row was handled");
    assert_eq!((report.stats.handled, report.stats.failed), (0, 5));
    // Each row failed once, and was parked, not released.
    let events = events.lock().unwrap().clone();
    let mut ids: Vec<&str> = events.iter().map(|(id, _, _)| id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 5, "a row failed more than once: {events:?}");
    assert!(
        events
            .iter()
            .all(|(_, parked_in, released)| parked_in.as_deref() == Some("failed") && !released),
        "{events:?}"
    );
    // The originals are acknowledged; the parked copies keep what could be
    // read, the reason, the stored headers and the decoder's error.
    assert_eq!(jobs.counter().message_count().await.expect("count"), 0);
    let parked = failed.browser().list(10).await.expect("list");
    assert_eq!(parked.len(), 5, "nothing lost");
    for (d, row) in parked.iter().zip(&ROWS) {
        assert_salvaged(&d.raw, row);
        let details: Vec<ErrorDetailsStamp> = serde_json::from_str(
            d.raw
                .header("X-Message-Stamp-ErrorDetails")
                .expect("parked with an ErrorDetails stamp"),
        )
        .expect("ErrorDetails stamps");
        let [details] = details.as_slice() else {
            panic!("{}: one ErrorDetails stamp: {details:?}", row.headers);
        };
        // The serializer refuses what the transport marked, naming the
        // marker and its reason, however well the rest decodes.
        assert_eq!(details.kind, "decode:invalid_header", "{}", row.headers);
        let (header, says) = row.reason;
        assert!(
            details.message.contains(header) && details.message.contains(says),
            "{}: {details:?}",
            row.headers
        );
    }
}
