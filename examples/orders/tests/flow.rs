//! The flow with small numbers: every order and every event ends handled or
//! parked, the parked ones are exactly those that fail for good, and the
//! binary's command line finds them.

use std::process::Command;
use std::time::Duration;

use envoi::stamp::ErrorDetailsStamp;
use envoi::testing::Abilities;
use example_orders::{
    card_declined, discontinued, gateway_times_out, mail_server_busy, run, thousands, FlowConfig,
    EVENTS, FAILED, ORDERS,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_order_and_event_is_handled_or_parked_and_the_parked_ones_fail_for_good() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("envoi.db");
    let n = 1_000;
    let config = FlowConfig::new(&database)
        .orders(n)
        .concurrency(8)
        .retry_delay(Duration::from_millis(20));
    let summary = run(&config).await.unwrap();

    let ids = 1..=n;
    let declined = ids.clone().filter(|&id| card_declined(id)).count() as u64;
    let handled_ids: Vec<u64> = ids.clone().filter(|&id| !card_declined(id)).collect();
    let discontinued_count = handled_ids.iter().filter(|&&id| discontinued(id)).count() as u64;
    assert!(
        declined > 0 && discontinued_count > 0,
        "the run exercises both"
    );

    assert_eq!(summary.dispatched, n);
    assert_eq!(summary.orders_handled + summary.orders_parked, n);
    assert_eq!(summary.orders_parked, declined);
    assert_eq!(
        summary.events_handled + summary.events_parked,
        summary.orders_handled
    );
    assert_eq!(summary.events_parked, discontinued_count);
    // One retry per transient failure: the gateway timeouts of orders that
    // are not declined, and the busy mail server of events.
    let transient = handled_ids
        .iter()
        .filter(|&&id| gateway_times_out(id))
        .count()
        + handled_ids
            .iter()
            .filter(|&&id| mail_server_busy(id))
            .count();
    assert_eq!(summary.retried, transient as u64);
    assert_eq!(
        summary.deliveries,
        summary.orders_handled
            + summary.orders_parked
            + summary.events_handled
            + summary.events_parked
            + summary.retried
    );
    assert_eq!(summary.order_latency.samples as u64, summary.orders_handled);
    assert_eq!(
        summary.end_to_end_latency.samples as u64,
        summary.events_handled
    );
    assert!(summary.order_latency.p50 <= summary.order_latency.p99);
    assert!(summary.end_to_end_latency.p50 <= summary.end_to_end_latency.p99);
    let text = summary.to_string();
    assert!(text.contains("Throughput"), "{text}");

    // What is parked is in the failure transport, with why; nothing waits
    // elsewhere.
    assert_eq!(
        summary.in_failure_transport,
        summary.orders_parked + summary.events_parked
    );
    let messenger = example_orders::messenger(&database, Duration::from_millis(20))
        .await
        .unwrap();
    for name in [ORDERS, EVENTS] {
        let count = messenger
            .transport(name)
            .unwrap()
            .counter()
            .message_count()
            .await
            .unwrap();
        assert_eq!(count, 0, "{name}");
    }
    let parked = messenger
        .transport(FAILED)
        .unwrap()
        .browser()
        .list(100)
        .await
        .unwrap();
    assert_eq!(parked.len() as u64, summary.in_failure_transport);
    let mut parked_orders = Vec::new();
    for delivery in &parked {
        let details: Vec<ErrorDetailsStamp> =
            serde_json::from_str(delivery.raw.header("X-Message-Stamp-ErrorDetails").unwrap())
                .unwrap();
        let body: serde_json::Value = serde_json::from_slice(&delivery.raw.body).unwrap();
        let id = body["id"].as_u64().unwrap();
        match delivery.raw.header("type") {
            Some("PlaceOrder") => {
                assert!(card_declined(id), "{id}");
                assert!(details[0].message.contains("card declined"));
                parked_orders.push(id);
            }
            Some("OrderPlaced") => {
                assert!(discontinued(id), "{id}");
                assert!(details[0].message.contains("sku discontinued"));
            }
            other => panic!("unexpected message {other:?}"),
        }
    }
    assert_eq!(parked_orders.len() as u64, declined);
}

fn binary(database: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_example-orders"))
        .args(args)
        .env("EXAMPLE_ORDERS_DB", database)
        .env("EXAMPLE_ORDERS_COUNT", "200")
        .output()
        .unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

#[test]
fn the_binary_runs_the_flow_then_its_command_line_shows_and_retries_the_failures() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("envoi.db");

    let (code, out, err) = binary(&database, &[]);
    assert_eq!(code, 0, "{err}\n{out}");
    // Order 123 is the one declined card in 200 orders.
    assert!(
        out.contains("Failed      1 for good, parked in `failed`: 1 PlaceOrder, 0 OrderPlaced"),
        "{out}"
    );
    assert!(
        out.contains("cargo run --release -p example-orders -- failed show"),
        "{out}"
    );

    let (code, out, err) = binary(&database, &["failed", "show"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("PlaceOrder"), "{out}");
    assert!(out.contains("card declined"), "{out}");
    assert!(out.contains("1 message(s) in `failed`."), "{out}");

    let (code, out, err) = binary(&database, &["stats", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    let failed = doc["transports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "failed")
        .unwrap();
    assert_eq!(failed["messages"], 1);

    // The card is still declined: the retry parks it again.
    let (code, out, err) = binary(&database, &["failed", "retry", "--all"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 failed again"), "{out}");

    // A worker on the failure transport tries it once more, parks it again
    // for later, and stops.
    let (code, out, err) = binary(&database, &["consume", "failed", "--stop-when-empty"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Stopped (no more messages)"), "{out}");
    assert!(out.contains("failed 1"), "{out}");
    assert!(err.contains("`failed` is a failure transport"), "{err}");
    let (code, out, err) = binary(&database, &["stats"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("failed     1"), "{out}");

    let (code, out, err) = binary(&database, &["failed", "show", "424242"]);
    assert_eq!((code, out.as_str()), (1, ""));
    assert_eq!(err, "error: no message with id `424242` in `failed`\n");

    let (code, _, err) = binary(&database, &["consume", "payments"]);
    assert_eq!(code, 1);
    assert_eq!(
        err,
        "error: unknown transport `payments` (configured: events, failed, orders)\n"
    );
}

#[test]
fn the_command_line_on_a_missing_or_unusable_database_is_one_error_line() {
    let dir = tempfile::tempdir().unwrap();
    // A mistyped path is not an empty database: nothing is created.
    let missing = dir.path().join("typo").join("envoi.db");
    let (code, out, err) = binary(&missing, &["stats"]);
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(err.starts_with("error: no database at `"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!missing.parent().unwrap().exists());

    let garbage = dir.path().join("notes.db");
    std::fs::write(&garbage, "not a database, just notes\n".repeat(200)).unwrap();
    let (code, out, err) = binary(&garbage, &["stats"]);
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(err.contains("is not an SQLite database"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    // No stray lock file beside what failed to open.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["notes.db"], "{left:?}");
}

#[test]
fn the_main_job_does_not_delete_a_file_that_is_not_a_database() {
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "my notes\n").unwrap();
    let (code, _, err) = binary(&notes, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is not an SQLite database"), "{err}");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "my notes\n");
    // Nothing left beside it.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["notes.txt"], "{left:?}");

    // A directory is not a database either.
    let folder = dir.path().join("folder");
    std::fs::create_dir(&folder).unwrap();
    let (code, _, err) = binary(&folder, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is not an SQLite database"), "{err}");
    assert!(folder.is_dir());
}

#[test]
fn any_file_name_works_for_the_database() {
    let dir = tempfile::tempdir().unwrap();
    // `?` and `#` would end the path of a DSN.
    let database = dir.path().join("what?#now.db");
    let (code, out, err) = binary(&database, &[]);
    assert_eq!(code, 0, "{err}\n{out}");
    assert!(database.exists());
    let (code, out, err) = binary(&database, &["stats"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("failed     1"), "{out}");
}

#[test]
fn the_main_job_and_the_command_line_do_not_share_a_database() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("envoi.db");
    let (code, _, err) = binary(&database, &[]);
    assert_eq!(code, 0, "{err}");

    // While the main job runs (holding the database), the command line
    // would take its messages from under it.
    let job = example_orders::lock_database(&database, example_orders::Access::Exclusive).unwrap();
    let (code, out, err) = binary(&database, &["consume", "orders", "--stop-when-empty"]);
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(err.contains("is in use by the example's main job"), "{err}");
    drop(job);

    // While the command line runs, the main job would delete the database
    // under it.
    let cli = example_orders::lock_database(&database, example_orders::Access::Shared).unwrap();
    let (code, out, err) = binary(&database, &[]);
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(
        err.contains("is in use by another example-orders process"),
        "{err}"
    );
    // Several command lines at once are fine.
    let (code, _, err) = binary(&database, &["stats"]);
    assert_eq!(code, 0, "{err}");
    drop(cli);
}

#[test]
fn ctrl_c_stops_the_main_job_gracefully_and_says_what_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("envoi.db");
    let mut child = Command::new(env!("CARGO_BIN_EXE_example-orders"))
        .env("EXAMPLE_ORDERS_DB", &database)
        .env("EXAMPLE_ORDERS_COUNT", "50000")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its first line comes once it listens for Ctrl-C; interrupted a
    // moment later, while it dispatches and handles.
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut first,
    )
    .unwrap();
    assert!(first.starts_with("Placing 50,000 orders"), "{first}");
    std::thread::sleep(Duration::from_millis(500));
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let output = child.wait_with_output().unwrap();
    let err = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("the worker stopped (stop requested)"), "{err}");
    assert!(err.contains("orders dispatched"), "{err}");
    assert!(
        err.contains("consume events orders --stop-when-empty"),
        "{err}"
    );

    // Nothing was left leased: what is left is handed out at once.
    let (code, out, err) = binary(
        &database,
        &["consume", "events", "orders", "--stop-when-empty"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Stopped (no more messages) after"), "{out}");
}

#[test]
fn help_and_a_bad_command_line_need_no_database() {
    // No database there: only a command that runs looks for it.
    let unusable = std::path::Path::new("/nonexistent/envoi.db");
    let (code, out, err) = binary(unusable, &["--help"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("failed"), "{out}");
    assert!(out.contains("consume"), "{out}");
    assert_eq!(err, "");

    let (code, out, err) = binary(unusable, &["consume", "orders", "--limit", "0"]);
    assert_eq!((code, out.as_str()), (2, ""));
    assert!(err.contains("--limit"), "{err}");
    assert!(!err.contains("no database"), "{err}");
}

#[test]
fn the_printed_hint_works_when_pasted_into_a_shell_whatever_the_database_path() {
    let dir = tempfile::tempdir().unwrap();
    // A quote, a space and a dollar sign, each of which a shell reads.
    let database = dir.path().join("it's my $HOME.db");
    let (code, out, err) = binary(&database, &[]);
    assert_eq!(code, 0, "{err}\n{out}");
    let hint = out
        .lines()
        .find(|l| l.contains("-- stats"))
        .unwrap_or_else(|| panic!("no stats hint in {out}"));
    let command = hint.split('#').next().unwrap().trim();
    // The same command, with the binary this test built in place of cargo.
    let binary = env!("CARGO_BIN_EXE_example-orders");
    let command = command.replace(
        "cargo run --release -p example-orders --",
        &format!("'{binary}'"),
    );
    let output = Command::new("sh")
        .args(["-c", &command])
        .env_remove("EXAMPLE_ORDERS_DB")
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    );
    assert_eq!(output.status.code(), Some(0), "{command}: {err}");
    assert!(out.contains("failed     1"), "{command}: {out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_summary_does_not_call_handled_a_retried_message_that_was_then_parked() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("envoi.db");
    // The event of order 3256 meets a busy mail server and a discontinued
    // item: it is retried, then parked.
    let n = 3_300;
    let config = FlowConfig::new(&database)
        .orders(n)
        .rate(None)
        .concurrency(8)
        .retry_delay(Duration::from_millis(20));
    let summary = run(&config).await.unwrap();
    let ids = 1..=n;
    let retried_then_parked = ids
        .clone()
        .filter(|&id| !card_declined(id) && mail_server_busy(id) && discontinued(id))
        .count() as u64;
    assert_eq!(retried_then_parked, 1);
    assert_eq!(summary.retried_then_parked, retried_then_parked);
    assert_eq!(
        summary.retried_then_handled + summary.retried_then_parked,
        summary.retried,
        "each transient failure here happens once"
    );
    let text = summary.to_string();
    let line = text.lines().find(|l| l.starts_with("Retried")).unwrap();
    assert_eq!(
        line,
        format!(
            "Retried     {} transient failures: {} handled on a later try, 1 parked after it",
            thousands(summary.retried),
            thousands(summary.retried - 1)
        )
    );
}
