//! The commands run in process against SQLite transports in a temporary
//! directory: their output, their exit status and what they leave in the
//! transports.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoi::failure::MultiplierRetryStrategy;
use envoi::middleware::BoxFuture;
use envoi::testing::Abilities;
use envoi::transport::{
    Browse, Delivery, DeliveryId, MessageCount, RawMessage, Receiver, Setup, Transport,
};
use envoi::worker::StopHandle;
use envoi::TransportError;
use envoi::{Command, Message, Messenger, MessengerBuilderExt, Recoverable, Unrecoverable};
use envoi_cli::{execute, Cli, Console};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Fate {
    /// Handled at once.
    Fine,
    /// Fails once (recoverable), then is handled.
    Once,
    /// Fails until the warehouse is fixed (default retry policy).
    Warehouse,
    /// Fails for good (unrecoverable).
    Declined,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PlaceOrder {
    id: u32,
    fate: Fate,
}
impl Message for PlaceOrder {
    const NAME: &'static str = "PlaceOrder";
}
impl Command for PlaceOrder {
    type Output = ();
    type Error = OrderError;
}

#[derive(Debug, thiserror::Error)]
enum OrderError {
    #[error("payment gateway timed out")]
    Timeout(#[source] Recoverable),
    #[error("warehouse unavailable")]
    Warehouse,
    #[error("card declined")]
    Declined(#[source] Unrecoverable),
}

struct App {
    messenger: Messenger,
    /// Once set, `Warehouse` orders are handled.
    fixed: Arc<AtomicBool>,
    _dir: tempfile::TempDir,
}

impl App {
    fn transport(&self, name: &str) -> &Arc<dyn Transport> {
        self.messenger.transport(name).unwrap()
    }

    async fn count(&self, name: &str) -> u64 {
        self.transport(name)
            .counter()
            .message_count()
            .await
            .unwrap()
    }

    async fn place(&self, orders: &[(u32, Fate)]) {
        for &(id, fate) in orders {
            self.messenger
                .dispatcher()
                .dispatch(PlaceOrder { id, fate })
                .await
                .unwrap();
        }
    }

    /// Places 10 orders: 6 fine, 2 failing once, one failing until fixed,
    /// one declined.
    async fn place_mixed(&self) {
        let mut orders: Vec<(u32, Fate)> = (1..=6).map(|id| (id, Fate::Fine)).collect();
        orders.extend([
            (7, Fate::Once),
            (8, Fate::Once),
            (9, Fate::Warehouse),
            (10, Fate::Declined),
        ]);
        self.place(&orders).await;
    }

    async fn cli(&self, args: &[&str]) -> (u8, String, String) {
        run_cli(&self.messenger, args).await
    }

    async fn ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.cli(args).await;
        assert_eq!(code, 0, "{args:?} failed: {err}\n{out}");
        assert_eq!(err, "", "{args:?}");
        out
    }

    /// Ids of the messages in the failure transport, oldest first.
    async fn failed_ids(&self) -> Vec<String> {
        self.transport("failed")
            .browser()
            .list(100)
            .await
            .unwrap()
            .into_iter()
            .map(|d| d.id.into_string())
            .collect()
    }
}

/// Runs the command `args` (without the program name) against
/// `messenger`; returns its exit status, output and error output.
async fn run_cli(messenger: &Messenger, args: &[&str]) -> (u8, String, String) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let argv = std::iter::once("app").chain(args.iter().copied());
    let code = envoi_cli::run_with(messenger, argv, &mut out, &mut err).await;
    (
        code,
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
    )
}

/// Sends a raw message of the type `name` with `body` to the failure
/// transport `failed`, as if parked there; returns its id.
async fn park_raw(
    failed: &Arc<dyn Transport>,
    name: &'static str,
    body: impl Into<Vec<u8>>,
) -> String {
    let mut raw = RawMessage::default();
    raw.headers.insert("type", name);
    raw.body = body.into();
    failed.send(raw, None).await.unwrap()
}

async fn app_with(failure_transport: bool) -> App {
    let dir = tempfile::tempdir().unwrap();
    let dsn = format!("sqlite://{}/envoi.db", dir.path().display());
    let fixed = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let handler = {
        let fixed = fixed.clone();
        move |order: PlaceOrder| {
            let fixed = fixed.clone();
            let seen = seen.clone();
            async move {
                match order.fate {
                    Fate::Fine => Ok(()),
                    Fate::Once => {
                        if seen.lock().unwrap().insert(order.id) {
                            Err(OrderError::Timeout(Recoverable::new("no answer in 5s")))
                        } else {
                            Ok(())
                        }
                    }
                    Fate::Warehouse if fixed.load(Ordering::Relaxed) => Ok(()),
                    Fate::Warehouse => Err(OrderError::Warehouse),
                    Fate::Declined => Err(OrderError::Declined(Unrecoverable::new(
                        "issuer says: stolen card",
                    ))),
                }
            }
        }
    };
    let mut builder = Messenger::builder()
        .with_transport_factories()
        .command_handler(handler)
        .transport_dsn("orders", dsn.clone())
        .transport_dsn("failed", dsn)
        .route::<PlaceOrder>("orders")
        .default_retry_strategy(MultiplierRetryStrategy {
            max_retries: 2,
            delay: Duration::from_millis(5),
            jitter: 0.0,
            ..Default::default()
        });
    if failure_transport {
        builder = builder.failure_transport("failed");
    }
    App {
        messenger: builder.build_async().await.unwrap(),
        fixed,
        _dir: dir,
    }
}

async fn app() -> App {
    app_with(true).await
}

const DRAIN: &[&str] = &[
    "consume",
    "orders",
    "--stop-when-empty",
    "--concurrency",
    "4",
];

#[tokio::test]
async fn help_lists_every_command_and_exits_zero() {
    let app = app().await;
    let out = app.ok(&["--help"]).await;
    for command in ["consume", "failed", "stats", "setup-transports", "debug"] {
        assert!(out.contains(command), "{command} missing from:\n{out}");
    }
}

#[tokio::test]
async fn debug_prints_each_bus_pipeline_and_the_routes() {
    let app = app().await;
    let out = app.ok(&["debug"]).await;
    assert!(out.contains("bus default"), "{out}");
    assert!(out.contains("SendMessage"), "{out}");
    assert!(out.contains("PlaceOrder -> orders"), "{out}");
    assert!(out.contains("failed (failure transport)\n"), "{out}");
}

#[tokio::test]
async fn setup_transports_sets_up_each_transport_and_refuses_unknown_ones() {
    let app = app().await;
    let out = app.ok(&["setup-transports"]).await;
    assert_eq!(out, "set up `failed`\nset up `orders`\n");
    let out = app.ok(&["setup-transports", "orders"]).await;
    assert_eq!(out, "set up `orders`\n");
    let (code, out, err) = app.cli(&["setup-transports", "orders", "kafka"]).await;
    assert_eq!(code, 1);
    assert_eq!(out, "");
    assert_eq!(
        err,
        "error: unknown transport `kafka` (configured: failed, orders)\n"
    );
}

#[tokio::test]
async fn stats_counts_the_waiting_messages_per_transport_as_text_and_json() {
    let app = app().await;
    app.place(&[(1, Fate::Fine), (2, Fate::Fine), (3, Fate::Fine)])
        .await;
    let out = app.ok(&["stats"]).await;
    assert_eq!(
        out,
        "TRANSPORT  MESSAGES  NOTE\nfailed     0         failure transport\norders     3\n"
    );
    let out = app.ok(&["stats", "orders", "--format", "json"]).await;
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        doc,
        serde_json::json!({"transports": [
            {"name": "orders", "messages": 3, "failure_transport": false}
        ]})
    );
}

#[tokio::test]
async fn stats_of_an_unknown_transport_or_format_fails() {
    let app = app().await;
    let (code, out, err) = app.cli(&["stats", "nope"]).await;
    assert_eq!((code, out.as_str()), (1, ""));
    assert_eq!(
        err,
        "error: unknown transport `nope` (configured: failed, orders)\n"
    );
    let (code, _, err) = app.cli(&["stats", "--format", "xml"]).await;
    assert_eq!(code, 2);
    assert!(err.contains("invalid value 'xml'"), "{err}");
}

#[tokio::test]
async fn consume_handles_retries_and_parks_what_fails_for_good() {
    let app = app().await;
    app.place_mixed().await;
    let out = app.ok(DRAIN).await;
    assert!(
        out.starts_with("Consuming orders (concurrency 4). Stop with Ctrl-C.\n"),
        "{out}"
    );
    // 8 handled (2 of them on their retry); retries: 2 once-failures and 2
    // for the warehouse order; 2 parked.
    assert!(
        out.contains("handled 8, retried 4, failed 2, released 0"),
        "{out}"
    );
    assert!(out.contains("Stopped (no more messages)"), "{out}");
    let failures: Vec<&str> = out.lines().filter(|l| l.starts_with("failed: ")).collect();
    assert_eq!(failures.len(), 2, "{out}");
    assert!(failures
        .iter()
        .all(|l| l.contains("PlaceOrder orders#") && l.ends_with("-> parked in `failed`")));
    assert!(
        failures.iter().any(|l| l.contains("card declined")),
        "{out}"
    );
    assert_eq!(app.count("orders").await, 0);
    assert_eq!(app.count("failed").await, 2);
}

#[tokio::test]
async fn consume_quiet_prints_no_failure_lines() {
    let app = app().await;
    app.place(&[(1, Fate::Declined)]).await;
    let mut args = DRAIN.to_vec();
    args.push("--quiet");
    let out = app.ok(&args).await;
    assert!(!out.contains("failed: "), "{out}");
    assert!(out.contains("failed 1"), "{out}");
}

#[tokio::test]
async fn consume_stops_at_its_message_limit_and_leaves_the_rest() {
    let app = app().await;
    let orders: Vec<(u32, Fate)> = (1..=10).map(|id| (id, Fate::Fine)).collect();
    app.place(&orders).await;
    let out = app.ok(&["consume", "orders", "--limit", "3"]).await;
    assert!(out.contains("Stopped (message limit reached)"), "{out}");
    assert!(out.contains("handled 3,"), "{out}");
    assert_eq!(app.count("orders").await, 7);
}

#[tokio::test]
async fn consume_stops_at_its_time_limit_when_nothing_comes() {
    let app = app().await;
    let (code, out, _) = app
        .cli(&["consume", "orders", "failed", "--time-limit", "300ms"])
        .await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("Consuming orders, failed (concurrency 1)."),
        "{out}"
    );
    assert!(out.contains("Stopped (time limit reached)"), "{out}");
    assert!(out.contains("handled 0, retried 0, failed 0"), "{out}");
}

/// A transport every fetch of which fails, as a database the process may
/// not write does.
struct Refusing;

impl Transport for Refusing {
    fn send(
        &self,
        _: RawMessage,
        _: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        Box::pin(async { Ok("1".to_string()) })
    }

    fn as_receiver(&self) -> Option<&dyn Receiver> {
        Some(self)
    }
}

impl Receiver for Refusing {
    fn get(&self, _: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        Box::pin(async {
            Err(TransportError::backend(
                "claiming messages",
                "attempt to write a readonly database",
            ))
        })
    }

    fn ack<'a>(&'a self, _: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async { Ok(()) })
    }

    fn reject<'a>(&'a self, _: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async { Ok(()) })
    }

    fn release<'a>(&'a self, _: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async { Ok(()) })
    }
}

#[tokio::test]
async fn consume_that_can_read_nothing_ends_in_an_error() {
    let messenger = Messenger::builder()
        .transport("orders", Arc::new(Refusing))
        .build()
        .unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let argv = ["app", "consume", "orders", "--time-limit", "300ms"];
    let code = envoi_cli::run_with(&messenger, argv, &mut out, &mut err).await;
    let (out, err) = (
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("Stopped (time limit reached)"), "{out}");
    assert!(
        err.starts_with("error: nothing could be read: transport `orders` failed "),
        "{err}"
    );
    assert!(
        err.contains("attempt to write a readonly database"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[tokio::test]
async fn consume_of_a_failure_transport_warns_in_one_line_that_failures_come_back() {
    let app = app().await;
    let (code, out, err) = app.cli(&["consume", "failed", "--stop-when-empty"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Stopped (no more messages)"), "{out}");
    assert_eq!(
        err,
        "warning: `failed` is a failure transport: messages that fail again go back to it \
         under a new id, due 1 s later, doubling each time; --stop-when-empty stops once \
         each has been tried; use `failed retry` to handle each failed message once\n"
    );
    // Ordinary transports get no warning (`ok` checks that nothing is on
    // standard error).
    app.ok(&["consume", "orders", "--stop-when-empty"]).await;
}

#[tokio::test]
async fn consume_stops_at_its_failure_limit() {
    let app = app().await;
    let orders: Vec<(u32, Fate)> = (1..=5).map(|id| (id, Fate::Declined)).collect();
    app.place(&orders).await;
    let out = app.ok(&["consume", "orders", "--failure-limit", "2"]).await;
    assert!(out.contains("Stopped (failure limit reached)"), "{out}");
    let failed = app.count("failed").await;
    assert!(failed >= 2, "{failed}");
    assert_eq!(app.count("orders").await + failed, 5, "nothing is lost");
}

#[tokio::test]
async fn consume_stops_gracefully_when_asked_and_loses_nothing() {
    let app = app().await;
    let orders: Vec<(u32, Fate)> = (1..=20).map(|id| (id, Fate::Fine)).collect();
    app.place(&orders).await;
    let stop = StopHandle::new();
    let stopper = stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        stopper.stop();
    });
    let command = <Cli as clap::Parser>::try_parse_from(["app", "consume", "orders"])
        .unwrap()
        .command;
    let mut out = Vec::new();
    let mut console = Console::new(&mut out).with_stop_handle(stop);
    execute(&app.messenger, command, &mut console)
        .await
        .unwrap();
    drop(console);
    let out = String::from_utf8(out).unwrap();
    assert!(out.contains("Stopped (stop requested)"), "{out}");
    let handled: u64 = out
        .split("handled ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert_eq!(app.count("orders").await + handled, 20);
}

#[tokio::test]
async fn consume_of_an_unknown_transport_fails_with_one_line() {
    let app = app().await;
    let (code, out, err) = app.cli(&["consume", "orders", "payments"]).await;
    assert_eq!((code, out.as_str()), (1, ""));
    assert_eq!(
        err,
        "error: unknown transport `payments` (configured: failed, orders)\n"
    );
}

#[tokio::test]
async fn consume_refuses_bad_limits_as_usage_errors() {
    let app = app().await;
    for (args, expected) in [
        (
            &["consume", "orders", "--time-limit", "soon"][..],
            "invalid duration `soon`",
        ),
        (
            &["consume", "orders", "--memory-limit", "lots"][..],
            "invalid size `lots`",
        ),
        (
            &["consume", "orders", "--concurrency", "0"][..],
            "`0` is not a whole number of at least 1",
        ),
        (
            &["consume", "orders", "--limit", "0"][..],
            "invalid value '0' for '--limit <N>': `0` is not a whole number of at least 1",
        ),
        (
            &["consume", "orders", "--failure-limit", "0"][..],
            "invalid value '0' for '--failure-limit <N>': `0` is not a whole number of at least 1",
        ),
        (
            &["consume", "orders", "--time-limit", "0s"][..],
            "`0s` is not a duration greater than zero",
        ),
        (
            &["consume", "orders", "--memory-limit", "0"][..],
            "`0` is not a size greater than zero",
        ),
        (&["consume"][..], "TRANSPORT"),
    ] {
        let (code, out, err) = app.cli(args).await;
        assert_eq!(code, 2, "{args:?}");
        assert_eq!(out, "", "{args:?}");
        assert!(err.contains(expected), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn a_negative_number_or_duration_is_refused_by_its_own_parser_not_taken_for_a_flag() {
    let app = app().await;
    for (args, expected) in [
        (
            &["consume", "orders", "--time-limit", "-5s"][..],
            "invalid duration `-5s`",
        ),
        (
            &["consume", "orders", "--grace-period", "-1s"][..],
            "invalid duration `-1s`",
        ),
        (
            &["consume", "orders", "--limit", "-1"][..],
            "`-1` is not a whole number of at least 1",
        ),
        (
            &["consume", "orders", "--memory-limit", "-1G"][..],
            "invalid size `-1G`",
        ),
        (
            &["failed", "show", "--max", "-3"][..],
            "`-3` is not a whole number of at least 1",
        ),
    ] {
        let (code, out, err) = app.cli(args).await;
        assert_eq!(code, 2, "{args:?}");
        assert_eq!(out, "", "{args:?}");
        assert!(err.contains(expected), "{args:?}: {err}");
        // Clap's tip for an unknown flag (`use '-- -5'`) fails when pasted.
        assert!(!err.contains("use '--"), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn consume_accepts_memory_limits_and_durations_with_units() {
    let app = app().await;
    app.place(&[(1, Fate::Fine)]).await;
    let out = app
        .ok(&[
            "consume",
            "orders",
            "--memory-limit",
            "64GB",
            "--time-limit",
            "1m30s",
            "--grace-period",
            "2s",
            "--batch-size",
            "8",
            "--stop-when-empty",
        ])
        .await;
    assert!(out.contains("handled 1,"), "{out}");
}

#[tokio::test]
async fn failed_show_lists_each_failure_with_its_error_and_retry_count() {
    let app = app().await;
    app.place_mixed().await;
    app.ok(DRAIN).await;
    let ids = app.failed_ids().await;
    let out = app.ok(&["failed", "show"]).await;
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("ID  MESSAGE     ERROR") && lines[0].ends_with("RETRIES  FAILED AT"),
        "{out}"
    );
    let rows = &lines[1..3];
    let warehouse = rows.iter().find(|l| l.contains("warehouse")).unwrap();
    let declined = rows.iter().find(|l| l.contains("card declined")).unwrap();
    assert!(warehouse.contains("  2  "), "two retries: {warehouse}");
    assert!(declined.contains("  0  "), "no retry: {declined}");
    for (row, id) in rows.iter().zip(&ids) {
        assert!(row.starts_with(&format!("{id} ")), "{row}");
        assert!(row.contains("PlaceOrder"), "{row}");
        assert!(row.ends_with('Z'), "a UTC time: {row}");
    }
    assert!(out.contains("2 message(s) in `failed`."), "{out}");

    let out = app.ok(&["failed", "show", "--max", "1"]).await;
    assert!(out.contains("1 of 2 messages in `failed` shown"), "{out}");
}

#[tokio::test]
async fn failed_show_of_one_message_prints_its_error_chain_and_stamps() {
    let app = app().await;
    app.place(&[(10, Fate::Declined)]).await;
    app.ok(DRAIN).await;
    let id = app.failed_ids().await.remove(0);
    let out = app.ok(&["failed", "show", &id]).await;
    assert!(out.contains(&format!("Id           {id}\n")), "{out}");
    assert!(out.contains("Message      PlaceOrder (command)\n"), "{out}");
    assert!(
        out.contains("Transport    failed (failed in orders)\n"),
        "{out}"
    );
    assert!(out.contains("Retries      0\n"), "{out}");
    assert!(out.contains("Error        handler `"), "{out}");
    assert!(out.contains("Caused by\n  1. card declined\n"), "{out}");
    assert!(
        out.contains("  2. unrecoverable: issuer says: stolen card\n"),
        "{out}"
    );
    assert!(
        out.contains("  SentToFailureTransport: [{\"original_transport\":\"orders\"}]"),
        "{out}"
    );
    assert!(out.contains("\"fate\": \"Declined\""), "{out}");

    let out = app.ok(&["failed", "show", &id, "--format", "json"]).await;
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["id"], id.as_str());
    assert_eq!(doc["original_transport"], "orders");
    assert_eq!(doc["error_chain"][0], "card declined");
    assert_eq!(doc["body"]["id"], 10);
}

#[tokio::test]
async fn failed_show_json_lists_the_failures() {
    let app = app().await;
    app.place_mixed().await;
    app.ok(DRAIN).await;
    let out = app.ok(&["failed", "show", "--format", "json"]).await;
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["transport"], "failed");
    assert_eq!(doc["total"], 2);
    assert_eq!(doc["messages"].as_array().unwrap().len(), 2);
    assert_eq!(doc["messages"][0]["message"], "PlaceOrder");
    // `--json` is short for `--format json`.
    assert_eq!(app.ok(&["failed", "show", "--json"]).await, out);
}

#[tokio::test]
async fn json_is_short_for_format_json_and_does_not_go_with_another_format() {
    let app = app().await;
    assert_eq!(
        app.ok(&["stats", "--json"]).await,
        app.ok(&["stats", "--format", "json"]).await
    );
    let (code, _, err) = app.cli(&["stats", "--json", "--format", "text"]).await;
    assert_eq!(code, 2);
    assert!(err.contains("cannot be used with"), "{err}");
}

#[tokio::test]
async fn failed_show_of_an_empty_failure_transport_says_so() {
    let app = app().await;
    assert_eq!(
        app.ok(&["failed", "show"]).await,
        "No failed messages in `failed`.\n"
    );
}

#[tokio::test]
async fn a_missing_id_is_an_error_and_changes_nothing() {
    let app = app().await;
    app.place_mixed().await;
    app.ok(DRAIN).await;
    let ids = app.failed_ids().await;
    for command in ["show", "retry", "remove"] {
        let mut args = vec!["failed", command];
        if command != "show" {
            args.push(&ids[0]);
        }
        args.push("999999");
        let (code, out, err) = app.cli(&args).await;
        assert_eq!(code, 1, "{args:?}");
        assert_eq!(out, "", "{args:?}");
        assert_eq!(err, "error: no message with id `999999` in `failed`\n");
    }
    assert_eq!(app.failed_ids().await, ids);
}

#[tokio::test]
async fn failed_retry_removes_what_is_handled_and_parks_again_what_fails_for_good() {
    let app = app().await;
    app.place_mixed().await;
    app.ok(DRAIN).await;
    let ids = app.failed_ids().await;
    app.fixed.store(true, Ordering::Relaxed);
    let out = app.ok(&["failed", "retry", "--all"]).await;
    assert!(
        out.contains(
            "Retried 2 message(s) from `failed`: 1 handled, 0 sent for another try, 1 failed again, 0 kept."
        ),
        "{out}"
    );
    assert!(out.contains("handled"), "{out}");
    let now = app.failed_ids().await;
    assert_eq!(now.len(), 1, "the declined order is back");
    assert!(!ids.contains(&now[0]), "under a new id");
    assert!(
        out.contains(&format!("failed again, back in `failed` as {}", now[0])),
        "{out}"
    );
    assert_eq!(
        out.matches("failed again, back in").count(),
        1,
        "each outcome is printed once: {out}"
    );
    assert!(
        out.contains("` failed: card declined"),
        "the handler's own error: {out}"
    );
    let show = app.ok(&["failed", "show", &now[0]]).await;
    assert!(show.contains("card declined"), "{show}");
    assert_eq!(app.count("orders").await, 0);

    // The old ids are gone; the one that failed again says where it went.
    let mut notes = Vec::new();
    for old in &ids {
        let (code, _, err) = app.cli(&["failed", "show", old]).await;
        assert_ne!(code, 0, "{err}");
        assert!(
            err.contains(&format!("no message with id `{old}`")),
            "{err}"
        );
        notes.extend(
            err.contains("it was retried, failed again and is now")
                .then_some(err),
        );
    }
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].contains(&format!("is now `{}`", now[0])),
        "{}",
        notes[0]
    );
}

#[tokio::test]
async fn failed_retry_with_retries_left_sends_the_message_back_to_its_transport() {
    let app = app().await;
    app.place(&[(9, Fate::Warehouse)]).await;
    app.ok(DRAIN).await;
    let ids = app.failed_ids().await;
    assert_eq!(ids.len(), 1);
    // Still broken: the retry from the failure transport has a fresh budget,
    // so it goes back to `orders` with a delay.
    let out = app.ok(&["failed", "retry", &ids[0]]).await;
    assert!(
        out.contains("failed; sent to `orders` for another try"),
        "{out}"
    );
    assert!(out.contains("Run `consume orders`"), "{out}");
    assert_eq!(app.count("failed").await, 0);
    assert_eq!(app.count("orders").await, 1);
    // Fixed meanwhile: the worker handles it.
    app.fixed.store(true, Ordering::Relaxed);
    let out = app.ok(DRAIN).await;
    assert!(out.contains("handled 1, retried 0, failed 0"), "{out}");
    assert_eq!(app.count("orders").await + app.count("failed").await, 0);
}

#[tokio::test]
async fn failed_retry_keeps_a_message_that_does_not_decode() {
    let app = app().await;
    let mut raw = RawMessage::default();
    raw.headers.insert("type", "Refund");
    raw.body = b"{}".to_vec();
    let id = app.transport("failed").send(raw, None).await.unwrap();
    let out = app.ok(&["failed", "show"]).await;
    assert!(out.contains("Refund"), "{out}");
    let (code, out, err) = app.cli(&["failed", "retry", &id]).await;
    assert_eq!(code, 1);
    assert!(
        out.contains("kept: does not decode: unknown message type `Refund`"),
        "{out}"
    );
    assert_eq!(
        err,
        "error: 1 message(s) could not be retried and stay in `failed`; see above\n"
    );
    assert_eq!(app.failed_ids().await, vec![id]);
}

#[tokio::test]
async fn failed_retry_writes_an_outcome_too_long_for_a_table_once_in_full_on_its_own_line() {
    let app = app().await;
    let name = "Refund".repeat(30);
    let mut raw = RawMessage::default();
    raw.headers.insert("type", name.clone());
    raw.body = b"{}".to_vec();
    let id = app.transport("failed").send(raw, None).await.unwrap();
    let (code, out, _) = app.cli(&["failed", "retry", &id]).await;
    assert_eq!(code, 1);
    let full = format!("{id} ({name}): kept: does not decode: unknown message type `{name}`\n");
    assert!(out.starts_with(&full), "{out}");
    assert_eq!(out.matches("kept: does not decode").count(), 1, "{out}");
    assert!(!out.contains('…'), "nothing is cut: {out}");
}

#[tokio::test]
async fn failed_remove_deletes_the_named_messages_or_all_of_them() {
    let app = app().await;
    app.place_mixed().await;
    app.ok(DRAIN).await;
    let ids = app.failed_ids().await;
    let out = app.ok(&["failed", "remove", &ids[1]]).await;
    assert!(out.starts_with("ID  MESSAGE     ERROR\n"), "{out}");
    assert!(
        out.ends_with("Removed 1 message(s) from `failed`.\n"),
        "{out}"
    );
    assert_eq!(app.failed_ids().await, vec![ids[0].clone()]);
    let out = app.ok(&["failed", "remove", "--all"]).await;
    assert!(
        out.ends_with("Removed 1 message(s) from `failed`.\n"),
        "{out}"
    );
    assert_eq!(app.count("failed").await, 0);
    let out = app.ok(&["failed", "remove", "--all"]).await;
    assert_eq!(out, "No failed messages in `failed`.\n");
}

#[tokio::test]
async fn failed_remove_counts_a_message_named_by_several_spellings_of_its_id_once() {
    let app = app().await;
    app.place(&[(9, Fate::Declined), (10, Fate::Declined)])
        .await;
    app.ok(DRAIN).await;
    let ids = app.failed_ids().await;
    assert_eq!(ids.len(), 2);
    let (padded, signed) = (format!("0{}", ids[0]), format!("+{}", ids[0]));
    let out = app
        .ok(&["failed", "remove", &ids[0], &padded, &signed])
        .await;
    let rows: Vec<&str> = out.lines().filter(|l| l.contains("PlaceOrder")).collect();
    assert_eq!(rows.len(), 1, "one row for the one message: {out}");
    assert!(rows[0].starts_with(&format!("{} ", ids[0])), "{out}");
    assert!(
        out.ends_with("Removed 1 message(s) from `failed`.\n"),
        "{out}"
    );
    assert_eq!(app.failed_ids().await, vec![ids[1].clone()]);
}

#[tokio::test]
async fn failed_retry_handles_a_message_named_by_several_spellings_of_its_id_once() {
    let app = app().await;
    app.place(&[(9, Fate::Warehouse)]).await;
    app.ok(DRAIN).await;
    let ids = app.failed_ids().await;
    assert_eq!(ids.len(), 1);
    app.fixed.store(true, Ordering::Relaxed);
    let (padded, signed) = (format!("0{}", ids[0]), format!("+{}", ids[0]));
    let out = app
        .ok(&["failed", "retry", &ids[0], &padded, &signed])
        .await;
    let rows: Vec<&str> = out.lines().filter(|l| l.contains("PlaceOrder")).collect();
    assert_eq!(rows.len(), 1, "retried once: {out}");
    assert!(
        out.contains(
            "Retried 1 message(s) from `failed`: 1 handled, 0 sent for another try, 0 failed again, 0 kept."
        ),
        "{out}"
    );
    assert_eq!(app.count("failed").await, 0);
    assert_eq!(app.count("orders").await, 0);
}

#[tokio::test]
async fn failed_commands_refuse_a_transport_that_is_not_a_failure_transport() {
    let app = app().await;
    app.place(&[(1, Fate::Fine), (2, Fate::Fine)]).await;
    for args in [
        &["failed", "remove", "--all", "--transport", "orders"][..],
        &["failed", "retry", "--all", "--transport", "orders"][..],
        &["failed", "show", "--transport", "orders"][..],
    ] {
        let (code, out, err) = app.cli(args).await;
        assert_eq!((code, out.as_str()), (1, ""), "{args:?}");
        assert_eq!(
            err, "error: `orders` is not a failure transport (failure transports: failed)\n",
            "{args:?}"
        );
    }
    assert_eq!(
        app.count("orders").await,
        2,
        "the waiting work is untouched"
    );
    let out = app.ok(&["failed", "show", "--transport", "failed"]).await;
    assert_eq!(out, "No failed messages in `failed`.\n");
}

/// A pipe whose reader is gone (`… | head -1`): every write fails.
struct ClosedPipe;

impl std::io::Write for ClosedPipe {
    fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
        Err(std::io::ErrorKind::BrokenPipe.into())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Err(std::io::ErrorKind::BrokenPipe.into())
    }
}

/// Output that cannot be written for another reason (a full disk).
struct FullDisk;

impl std::io::Write for FullDisk {
    fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
        Err(std::io::Error::other("no space left on device"))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn output_into_a_closed_pipe_ends_the_command_quietly_with_status_zero() {
    let app = app().await;
    app.place(&[(10, Fate::Declined)]).await;
    app.ok(DRAIN).await;
    let id = app.failed_ids().await.remove(0);
    for args in [
        vec!["app", "failed", "show", id.as_str()],
        vec!["app", "failed", "show", "--format", "json"],
        vec!["app", "stats", "--format", "json"],
        vec!["app", "stats"],
        vec!["app", "debug"],
    ] {
        let mut err = Vec::new();
        let code = envoi_cli::run_with(&app.messenger, &args, &mut ClosedPipe, &mut err).await;
        assert_eq!(code, 0, "{args:?}");
        assert_eq!(String::from_utf8(err).unwrap(), "", "{args:?}");
    }
    // Other write errors still fail the command, in one line.
    let mut err = Vec::new();
    let args = ["app", "stats"];
    let code = envoi_cli::run_with(&app.messenger, args, &mut FullDisk, &mut err).await;
    assert_eq!(code, 1);
    assert_eq!(
        String::from_utf8(err).unwrap(),
        "error: writing the output failed: no space left on device\n"
    );
}

#[tokio::test]
async fn retry_and_remove_need_ids_or_all_but_not_both() {
    let app = app().await;
    for args in [
        &["failed", "retry"][..],
        &["failed", "remove"][..],
        &["failed", "remove", "1", "--all"][..],
    ] {
        let (code, out, err) = app.cli(args).await;
        assert_eq!((code, out.as_str()), (2, ""), "{args:?}");
        assert!(err.contains("error:"), "{args:?}: {err}");
        // The usage names both ways of choosing messages.
        assert!(err.contains("<IDS|--all>"), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn failed_commands_need_a_failure_transport_or_a_named_one() {
    let app = app_with(false).await;
    let (code, out, err) = app.cli(&["failed", "show"]).await;
    assert_eq!((code, out.as_str()), (1, ""));
    assert_eq!(
        err,
        "error: no failure transport is configured; name a transport with --transport\n"
    );
    let (code, _, err) = app.cli(&["failed", "show", "--transport", "dlq"]).await;
    assert_eq!(code, 1);
    assert!(err.starts_with("error: unknown transport `dlq`"), "{err}");
    let out = app.ok(&["failed", "show", "--transport", "failed"]).await;
    assert_eq!(out, "No failed messages in `failed`.\n");
}

#[tokio::test]
async fn the_in_memory_transport_works_with_the_failure_commands_too() {
    let messenger = Messenger::builder()
        .command_handler(|_: PlaceOrder| async {
            Err::<(), _>(OrderError::Declined(Unrecoverable::new("nope")))
        })
        .transport_dsn("orders", "in-memory://")
        .transport_dsn("failed", "in-memory://")
        .route::<PlaceOrder>("orders")
        .failure_transport("failed")
        .build_async()
        .await
        .unwrap();
    messenger
        .dispatcher()
        .dispatch(PlaceOrder {
            id: 1,
            fate: Fate::Declined,
        })
        .await
        .unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let args = ["app", "consume", "orders", "--stop-when-empty"];
    assert_eq!(
        envoi_cli::run_with(&messenger, args, &mut out, &mut err).await,
        0
    );
    let mut out = Vec::new();
    let args = ["app", "failed", "show"];
    assert_eq!(
        envoi_cli::run_with(&messenger, args, &mut out, &mut err).await,
        0
    );
    let out = String::from_utf8(out).unwrap();
    assert!(out.contains("PlaceOrder"), "{out}");
    assert!(out.contains("card declined"), "{out}");
}

#[tokio::test]
async fn failed_show_keeps_each_message_on_one_table_line_whatever_its_headers_hold() {
    let app = app().await;
    let mut raw = RawMessage::default();
    // A type header with a line break and a terminal escape sequence.
    raw.headers.insert("type", "Refund\nID  MESSAGE\x1b[2J");
    raw.body = b"{}".to_vec();
    app.transport("failed").send(raw, None).await.unwrap();
    let out = app.ok(&["failed", "show"]).await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "a header, one row, a count, a hint: {out}");
    assert!(lines[1].contains("Refund ID  MESSAGE [2J"), "{out}");
    assert!(!out.contains('\x1b'), "{out:?}");
}

/// A failure transport that stores messages but cannot delete them, as a
/// database locked by another process: after the first `deletable` deletes,
/// every delete fails.
struct Undeletable {
    inner: Arc<dyn Transport>,
    deletable: std::sync::atomic::AtomicUsize,
}

impl Undeletable {
    fn new(inner: Arc<dyn Transport>, deletable: usize) -> Self {
        Self {
            inner,
            deletable: deletable.into(),
        }
    }
}

impl Transport for Undeletable {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        self.inner.send(message, delay)
    }

    fn as_receiver(&self) -> Option<&dyn Receiver> {
        Some(self)
    }

    fn as_setup(&self) -> Option<&dyn Setup> {
        self.inner.as_setup()
    }

    fn as_message_count(&self) -> Option<&dyn MessageCount> {
        self.inner.as_message_count()
    }

    fn as_browse(&self) -> Option<&dyn Browse> {
        self.inner.as_browse()
    }
}

impl Receiver for Undeletable {
    fn get(&self, max: usize) -> BoxFuture<'_, Result<Vec<Delivery>, TransportError>> {
        self.inner.receiver().get(max)
    }

    fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        use std::sync::atomic::Ordering;
        let allowed = self
            .deletable
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if allowed {
            return self.inner.receiver().ack(id);
        }
        Box::pin(async {
            Err(TransportError::backend(
                "deleting a message",
                "database is locked",
            ))
        })
    }

    fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        self.inner.receiver().reject(id)
    }

    fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
        self.inner.receiver().release(id)
    }
}

/// A messenger whose failure transport (on SQLite in a temporary
/// directory, returned to be kept) can delete only `deletable` messages.
async fn undeletable_failures(
    deletable: usize,
) -> (tempfile::TempDir, Messenger, Arc<dyn Transport>) {
    let dir = tempfile::tempdir().unwrap();
    let failed = envoi::sqlite::SqliteTransport::with_config(
        "failed",
        envoi::sqlite::SqliteConfig::new(dir.path().join("envoi.db")),
    )
    .await
    .unwrap();
    let messenger = Messenger::builder()
        .command_handler(|_: PlaceOrder| async { Ok::<(), OrderError>(()) })
        .message::<PlaceOrder>()
        .transport(
            "failed",
            Arc::new(Undeletable::new(Arc::new(failed), deletable)),
        )
        .failure_transport("failed")
        .build()
        .unwrap();
    let failed = messenger.transport("failed").unwrap().clone();
    failed.as_setup().unwrap().setup().await.unwrap();
    (dir, messenger, failed)
}

#[tokio::test]
async fn failed_retry_that_cannot_remove_the_old_copy_fails_and_says_so() {
    let (_dir, messenger, failed) = undeletable_failures(0).await;
    let id = park_raw(&failed, "PlaceOrder", br#"{"id":1,"fate":"Fine"}"#).await;

    let (code, out, err) = run_cli(&messenger, &["failed", "retry", id.as_str()]).await;
    // Handled, but still in the failure transport: another retry would
    // handle it again, so the command must not report success.
    assert!(
        out.contains("handled; removing the old copy failed"),
        "{out}"
    );
    assert_eq!(code, 1, "{out}");
    assert_eq!(
        err,
        "error: 1 retried message(s) could not be removed from `failed` and are still there; see above\n"
    );
    assert_eq!(failed.counter().message_count().await.unwrap(), 1);
}

#[tokio::test]
async fn consume_writes_each_failure_on_one_line_whatever_its_error_holds() {
    let app = app().await;
    let mut raw = RawMessage::default();
    // Its error names the type: a line break in it must not split the line.
    raw.headers
        .insert("type", "Refund\nStopped (no more messages)");
    raw.body = b"{}".to_vec();
    app.transport("orders").send(raw, None).await.unwrap();
    let out = app.ok(DRAIN).await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "a banner, one failure, a summary: {out}");
    assert!(lines[1].starts_with("failed: "), "{out}");
    assert!(
        lines[1].contains("Refund Stopped (no more messages)"),
        "{out}"
    );
}

#[tokio::test]
async fn failed_remove_that_deletes_only_some_says_which_are_still_there() {
    let (_dir, messenger, failed) = undeletable_failures(1).await;
    let mut ids = Vec::new();
    for n in 1..=3 {
        let body = format!(r#"{{"id":{n},"fate":"Fine"}}"#);
        ids.push(park_raw(&failed, "PlaceOrder", body).await);
    }

    let (code, out, err) = run_cli(&messenger, &["failed", "remove", "--all"]).await;
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "Removed 1 of 3 message(s) from `failed`; still there: {}, {}.",
            ids[1], ids[2]
        )),
        "{out}"
    );
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with(&ids[0])).collect();
    assert_eq!(rows.len(), 1, "the removed message is listed: {out}");
    assert!(err.contains("database is locked"), "{err}");
    assert_eq!(failed.counter().message_count().await.unwrap(), 2);
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Audit {
    order: u32,
}
impl Message for Audit {
    const NAME: &'static str = "Audit";
}
impl Command for Audit {
    type Output = ();
    type Error = OrderError;
}

/// Builds a messenger whose failure transport `failed` is in memory.
trait FailuresInMemory {
    fn with_failures_in_memory(self) -> Messenger;
}

impl FailuresInMemory for envoi::MessengerBuilder {
    fn with_failures_in_memory(self) -> Messenger {
        self.transport(
            "failed",
            Arc::new(envoi::transport::in_memory::InMemoryTransport::new()),
        )
        .failure_transport("failed")
        .build()
        .unwrap()
    }
}

/// The messenger's bus, for the handlers registered before it is built:
/// [`BusSlot::fill`] it once the messenger is.
#[derive(Clone, Default)]
struct BusSlot(Arc<Mutex<Option<envoi::MessageBus>>>);

impl BusSlot {
    fn fill(&self, messenger: &Messenger) {
        *self.0.lock().unwrap() = Some(messenger.bus().clone());
    }

    /// Defers an `Audit` of `order` through the bus until the message
    /// being handled is done.
    async fn defer_audit(self, order: u32) {
        let bus = self.0.lock().unwrap().clone().expect("bus set");
        bus.dispatch_after_current(envoi::Envelope::new(Audit { order }))
            .await
            .expect("a deferred dispatch is accepted");
    }
}

/// A messenger with an in-memory failure transport whose `PlaceOrder`
/// handler (counting its runs) defers an `Audit` whose handler fails while
/// `audit_failing` is set, and counts the audits it handles otherwise.
fn deferring_a_failing_audit(
    audit_failing: Arc<AtomicBool>,
) -> (Messenger, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let (orders, audits) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let bus = BusSlot::default();
    let (slot, placed, audited) = (bus.clone(), orders.clone(), audits.clone());
    let messenger = Messenger::builder()
        .command_handler(move |order: PlaceOrder| {
            placed.fetch_add(1, Ordering::SeqCst);
            let deferred = slot.clone().defer_audit(order.id);
            async move {
                deferred.await;
                Ok::<(), OrderError>(())
            }
        })
        .command_handler(move |_: Audit| {
            let result = if audit_failing.load(Ordering::SeqCst) {
                Err(OrderError::Warehouse)
            } else {
                audited.fetch_add(1, Ordering::SeqCst);
                Ok(())
            };
            async move { result }
        })
        .message::<PlaceOrder>()
        .message::<Audit>()
        .with_failures_in_memory();
    bus.fill(&messenger);
    (messenger, orders, audits)
}

#[tokio::test]
async fn failed_retry_of_a_message_handled_whose_deferred_dispatch_fails_removes_it_and_parks_only_the_dispatch(
) {
    let audit_failing = Arc::new(AtomicBool::new(true));
    let (messenger, orders, audits) = deferring_a_failing_audit(audit_failing.clone());
    let failed = messenger.transport("failed").unwrap().clone();
    let id = park_raw(&failed, "PlaceOrder", br#"{"id":1,"fate":"Fine"}"#).await;

    let (code, out, err) = run_cli(&messenger, &["failed", "retry", &id]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("handled; its deferred `Audit` failed, parked in `failed`"),
        "{out}"
    );
    assert!(
        out.contains("1 handled, 0 sent for another try, 0 failed again, 0 kept"),
        "{out}"
    );
    // The order left the failure transport; only its audit is there.
    let left = failed.browser().list(10).await.unwrap();
    assert_eq!(left.len(), 1, "{out}");
    assert!(left[0].id.as_str() != id, "the order was removed");
    assert_eq!(left[0].raw.header("type"), Some("Audit"));
    assert_eq!(orders.load(Ordering::SeqCst), 1);

    // Retried in turn, the audit is handled, and the order not again.
    audit_failing.store(false, Ordering::SeqCst);
    let (code, out, err) = run_cli(&messenger, &["failed", "retry", left[0].id.as_str()]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(audits.load(Ordering::SeqCst), 1);
    assert_eq!(orders.load(Ordering::SeqCst), 1);
    assert_eq!(failed.counter().message_count().await.unwrap(), 0);
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Paid {
    order: u32,
}
impl Message for Paid {
    const NAME: &'static str = "Paid";
}
impl envoi::Event for Paid {
    type Error = OrderError;
}

#[tokio::test]
async fn failed_retry_of_a_message_parked_again_parks_what_its_successful_handler_deferred_that_fails(
) {
    let audits = Arc::new(AtomicUsize::new(0));
    let bus = BusSlot::default();
    let (slot, audited) = (bus.clone(), audits.clone());
    let messenger = Messenger::builder()
        .event_handler(move |paid: Paid| {
            let deferred = slot.clone().defer_audit(paid.order);
            async move {
                deferred.await;
                Ok::<(), OrderError>(())
            }
        })
        .event_handler(|_: Paid| async {
            Err::<(), _>(OrderError::Declined(Unrecoverable::new("for good")))
        })
        .command_handler(move |_: Audit| {
            audited.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>(OrderError::Warehouse) }
        })
        .message::<Paid>()
        .message::<Audit>()
        .with_failures_in_memory();
    bus.fill(&messenger);
    let failed = messenger.transport("failed").unwrap().clone();
    let id = park_raw(&failed, "Paid", br#"{"order":1}"#).await;

    let (code, out, _) = run_cli(&messenger, &["failed", "retry", id.as_str()]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("failed again, back in `failed`"), "{out}");
    assert!(
        out.contains("its deferred `Audit` failed, parked in `failed`"),
        "{out}"
    );
    assert_eq!(audits.load(Ordering::SeqCst), 1);
    // The event, parked again, and the audit its first handler deferred,
    // which will not be deferred again (that handler does not run again).
    let mut names: Vec<String> = failed
        .browser()
        .list(10)
        .await
        .unwrap()
        .iter()
        .map(|d| d.raw.header("type").unwrap_or("?").to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["Audit", "Paid"], "{out}");
}

#[tokio::test]
async fn failed_retry_of_a_dispatch_parked_because_it_could_not_be_sent_says_where_it_was_sent() {
    let audits = Arc::new(AtomicUsize::new(0));
    let audited = audits.clone();
    let down = Arc::new(envoi::transport::in_memory::InMemoryTransport::new());
    let messenger = Messenger::builder()
        .command_handler(move |_: Audit| {
            audited.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), OrderError>(()) }
        })
        .transport("down", down.clone())
        .transport(
            "failed",
            Arc::new(envoi::transport::in_memory::InMemoryTransport::new()),
        )
        .failure_transport("failed")
        .route::<Audit>("down")
        .build()
        .unwrap();
    let failed = messenger.transport("failed").unwrap().clone();
    let parked = envoi::Envelope::new(Audit { order: 1 })
        .with(envoi::stamp::UnsentStamp::new("down"))
        .with(envoi::stamp::SentToFailureTransportStamp::new("down"));
    let raw = messenger.serializer().encode(&parked).unwrap();
    let id = failed.send(raw, None).await.unwrap();

    let (code, out, _) = run_cli(&messenger, &["failed", "retry", id.as_str()]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("sent to `down`"), "{out}");
    assert!(
        out.contains("0 handled, 0 sent for another try, 0 failed again, 0 kept, 1 sent on to its transport."),
        "{out}"
    );
    assert_eq!(audits.load(Ordering::SeqCst), 0, "not handled here");
    assert_eq!(down.counter().message_count().await.unwrap(), 1);
    assert_eq!(failed.counter().message_count().await.unwrap(), 0);
}

#[tokio::test]
async fn failed_retry_of_a_dispatch_parked_unsent_to_a_transport_that_is_gone_parks_it_again_with_why(
) {
    let messenger = Messenger::builder()
        .transport(
            "failed",
            Arc::new(envoi::transport::in_memory::InMemoryTransport::new()),
        )
        .failure_transport("failed")
        .route::<Audit>("failed")
        .build()
        .unwrap();
    let failed = messenger.transport("failed").unwrap().clone();
    let parked = envoi::Envelope::new(Audit { order: 1 })
        .with(envoi::stamp::UnsentStamp::new("gone"))
        .with(envoi::stamp::SentToFailureTransportStamp::new("gone"));
    let raw = messenger.serializer().encode(&parked).unwrap();
    let id = failed.send(raw, None).await.unwrap();

    let (code, out, _) = run_cli(&messenger, &["failed", "retry", id.as_str()]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("unknown transport `gone`"), "{out}");
    assert!(out.contains("1 failed again"), "{out}");
    let left = failed.browser().list(10).await.unwrap();
    assert_eq!(left.len(), 1, "parked again, the old copy removed: {out}");
    assert_ne!(left[0].id.as_str(), id, "{out}");
    let again = messenger.serializer().decode(&left[0].raw).unwrap();
    assert_eq!(
        again.last::<envoi::stamp::UnsentStamp>().unwrap().transport,
        "gone"
    );
}

/// A transport that hands out every ability of `inner` but those named in
/// `hidden` ("receiver", "message count", "browse", "setup").
struct Hiding {
    inner: Arc<dyn Transport>,
    hidden: &'static [&'static str],
}

impl Hiding {
    fn in_memory(hidden: &'static [&'static str]) -> Arc<dyn Transport> {
        Arc::new(Hiding {
            inner: Arc::new(envoi::transport::in_memory::InMemoryTransport::new()),
            hidden,
        })
    }

    fn shows<'a, T: ?Sized>(&self, ability: &str, it: Option<&'a T>) -> Option<&'a T> {
        it.filter(|_| !self.hidden.contains(&ability))
    }
}

impl Transport for Hiding {
    fn send(
        &self,
        message: RawMessage,
        delay: Option<Duration>,
    ) -> BoxFuture<'_, Result<String, TransportError>> {
        self.inner.send(message, delay)
    }

    fn as_receiver(&self) -> Option<&dyn Receiver> {
        self.shows("receiver", self.inner.as_receiver())
    }

    fn as_keepalive(&self) -> Option<&dyn envoi::transport::Keepalive> {
        self.inner.as_keepalive()
    }

    fn as_setup(&self) -> Option<&dyn Setup> {
        self.shows("setup", self.inner.as_setup())
    }

    fn as_message_count(&self) -> Option<&dyn MessageCount> {
        self.shows("message count", self.inner.as_message_count())
    }

    fn as_browse(&self) -> Option<&dyn Browse> {
        self.shows("browse", self.inner.as_browse())
    }

    fn bind(&self, binding: &envoi::transport::TransportBinding) {
        self.inner.bind(binding);
    }
}

/// A messenger routing `PlaceOrder` (declined by its handler) to an
/// in-memory `orders`, with the failure transport `failed`.
fn with_failure_transport(failed: Arc<dyn Transport>) -> Messenger {
    Messenger::builder()
        .command_handler(|_: PlaceOrder| async {
            Err::<(), _>(OrderError::Declined(Unrecoverable::new("nope")))
        })
        .transport(
            "orders",
            Arc::new(envoi::transport::in_memory::InMemoryTransport::new()),
        )
        .transport("failed", failed)
        .route::<PlaceOrder>("orders")
        .failure_transport("failed")
        .build()
        .unwrap()
}

/// Parks `n` declined orders in the failure transport through a worker.
async fn park_declined(messenger: &Messenger, n: u32) {
    for id in 1..=n {
        let order = PlaceOrder {
            id,
            fate: Fate::Declined,
        };
        messenger.dispatcher().dispatch(order).await.unwrap();
    }
    let (code, out, err) = run_cli(messenger, &["consume", "orders", "--stop-when-empty"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&format!("failed {n},")), "{out}");
}

#[tokio::test]
async fn stats_says_a_transport_that_cannot_count_cannot_instead_of_failing() {
    let messenger = with_failure_transport(Hiding::in_memory(&["message count"]));
    park_declined(&messenger, 2).await;
    let order = PlaceOrder {
        id: 3,
        fate: Fate::Fine,
    };
    messenger.dispatcher().dispatch(order).await.unwrap();

    let (code, out, err) = run_cli(&messenger, &["stats"]).await;
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    assert_eq!(
        out,
        "TRANSPORT  MESSAGES  NOTE\n\
         failed     -         failure transport; cannot count\n\
         orders     1\n"
    );
    let (code, out, err) = run_cli(&messenger, &["stats", "--json"]).await;
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        doc,
        serde_json::json!({"transports": [
            {"name": "failed", "messages": null, "failure_transport": true, "note": "cannot count"},
            {"name": "orders", "messages": 1, "failure_transport": false}
        ]})
    );

    // The failure commands work without a count: they count what they list.
    let (code, out, err) = run_cli(&messenger, &["failed", "show"]).await;
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    assert!(out.contains("2 message(s) in `failed`."), "{out}");
    let (code, out, err) = run_cli(&messenger, &["failed", "remove", "--all"]).await;
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    assert!(
        out.ends_with("Removed 2 message(s) from `failed`.\n"),
        "{out}"
    );
    let failed = messenger.transport("failed").unwrap();
    assert!(failed.browser().list(10).await.unwrap().is_empty());
}

#[tokio::test]
async fn setup_transports_says_when_a_transport_has_nothing_to_set_up() {
    let dir = tempfile::tempdir().unwrap();
    let messenger = Messenger::builder()
        .with_transport_factories()
        .transport_dsn("cache", "in-memory://")
        .transport_dsn(
            "orders",
            format!("sqlite://{}/envoi.db", dir.path().display()),
        )
        .build_async()
        .await
        .unwrap();
    let (code, out, err) = run_cli(&messenger, &["setup-transports"]).await;
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    assert_eq!(out, "nothing to set up for `cache`\nset up `orders`\n");
}

#[tokio::test]
async fn failed_commands_on_a_failure_transport_that_cannot_list_its_messages_fail_in_one_line() {
    let messenger = with_failure_transport(Hiding::in_memory(&["browse"]));
    park_declined(&messenger, 1).await;
    for (command, args) in [
        ("show", &["failed", "show"][..]),
        ("show", &["failed", "show", "1"][..]),
        ("retry", &["failed", "retry", "--all"][..]),
        ("remove", &["failed", "remove", "1"][..]),
    ] {
        let (code, out, err) = run_cli(&messenger, args).await;
        assert_eq!((code, out.as_str()), (1, ""), "{args:?}");
        assert_eq!(
            err,
            format!(
                "error: `failed {command}` needs a transport that can list and find its messages; `failed` cannot\n"
            ),
            "{args:?}"
        );
    }
    let failed = messenger.transport("failed").unwrap();
    assert_eq!(failed.counter().message_count().await.unwrap(), 1);
}

#[tokio::test]
async fn failed_retry_and_remove_need_a_failure_transport_that_can_remove_messages() {
    let inner: Arc<dyn Transport> = Arc::new(envoi::transport::in_memory::InMemoryTransport::new());
    let messenger = with_failure_transport(Arc::new(Hiding {
        inner: inner.clone(),
        hidden: &["receiver"],
    }));
    let id = park_raw(
        messenger.transport("failed").unwrap(),
        "PlaceOrder",
        br#"{"id":1,"fate":"Fine"}"#,
    )
    .await;
    let out = run_cli(&messenger, &["failed", "show"]).await.1;
    assert!(out.contains("1 message(s) in `failed`."), "{out}");
    for command in ["retry", "remove"] {
        let (code, out, err) = run_cli(&messenger, &["failed", command, &id]).await;
        assert_eq!((code, out.as_str()), (1, ""), "{command}");
        assert_eq!(
            err,
            format!(
                "error: `failed {command}` needs a transport that can remove messages; `failed` cannot\n"
            ),
        );
    }
    assert_eq!(inner.counter().message_count().await.unwrap(), 1);
}
