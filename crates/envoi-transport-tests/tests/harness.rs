//! The harness runs a broker test when its URL is set, reports it as
//! ignored with the reason when it is not, and fails it instead when
//! `ENVOI_REQUIRE_BROKERS=1` asks every broker test to run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use envoi_transport_tests::harness::{url_in, Arguments, Conclusion, Decision, Runtime, Trials};

const VARIABLE: &str = "ENVOI_HARNESS_TEST_URL";

/// The decision for `VARIABLE` holding `value`, with or without
/// `ENVOI_REQUIRE_BROKERS=1`.
fn decide(value: Option<&str>, required: bool) -> Decision<String> {
    Decision::new(url_in(VARIABLE, value), required)
}

/// Runs `trials` one at a time with the command-line arguments `args`,
/// writing what `cargo test` would print to a file rather than among this
/// test binary's own results; returns what came of them and what was
/// printed.
fn run_with(trials: Trials, args: &[&str]) -> (Conclusion, String) {
    let log = std::env::temp_dir().join(format!(
        "envoi-harness-{}.log",
        uuid::Uuid::new_v4().simple()
    ));
    let log_arg = format!("--logfile={}", log.display());
    let args = ["harness", "--test-threads=1", &log_arg]
        .into_iter()
        .chain(args.iter().copied());
    let conclusion = trials.run_with(&Arguments::from_iter(args));
    let printed = std::fs::read_to_string(&log).expect("the harness's log");
    let _ = std::fs::remove_file(&log);
    (conclusion, printed)
}

fn run(trials: Trials) -> Conclusion {
    run_with(trials, &[]).0
}

#[test]
fn a_set_url_runs_the_test_with_it() {
    let url = "redis://127.0.0.1:6379";
    assert_eq!(decide(Some(url), false), Decision::Run(url.to_string()));
    assert_eq!(decide(Some(url), true), Decision::Run(url.to_string()));
}

#[test]
fn an_unset_or_blank_url_ignores_the_test_and_says_which_variable() {
    let reason = Decision::Ignore(format!("{VARIABLE} is not set"));
    assert_eq!(decide(None, false), reason);
    assert_eq!(decide(Some(""), false), reason);
    assert_eq!(decide(Some("  "), false), reason);
}

#[test]
fn an_unset_url_fails_the_test_when_every_broker_test_must_run() {
    let Decision::Fail(why) = decide(None, true) else {
        panic!("a missing URL under ENVOI_REQUIRE_BROKERS=1 must fail the test");
    };
    assert!(why.starts_with(&format!("{VARIABLE} is not set")), "{why}");
    assert!(why.contains("ENVOI_REQUIRE_BROKERS=1"), "{why}");
}

#[test]
fn a_run_test_gets_the_url_on_a_thread_named_after_it() {
    let seen = Arc::new(Mutex::new(None));
    let mut trials = Trials::default();
    let record = Arc::clone(&seen);
    trials.add(
        "gets_the_url",
        &decide(Some("nats://127.0.0.1:4222"), false),
        Runtime::CurrentThread,
        move |url: String| async move {
            let thread = std::thread::current().name().map(str::to_string);
            *record.lock().unwrap() = Some((url, thread));
        },
    );
    let conclusion = run(trials);
    assert_eq!((conclusion.num_passed, conclusion.num_ignored), (1, 0));
    assert_eq!(
        seen.lock().unwrap().clone(),
        Some((
            "nats://127.0.0.1:4222".to_string(),
            Some("gets_the_url".to_string())
        ))
    );
}

#[test]
fn an_ignored_test_is_counted_as_ignored_with_its_reason_and_never_runs() {
    let ran = Arc::new(AtomicBool::new(false));
    let mut trials = Trials::default();
    let flag = Arc::clone(&ran);
    trials.add(
        "needs_a_broker",
        &decide(None, false),
        Runtime::default(),
        move |_url: String| async move { flag.store(true, Ordering::SeqCst) },
    );
    trials.add_sync("needs_nothing", &Decision::Run(()), |()| {});
    let (conclusion, printed) = run_with(trials, &[]);
    assert!(
        printed.contains(&format!(
            "test needs_a_broker ... ignored ({VARIABLE} is not set)"
        )),
        "the reason is not printed with the test:\n{printed}"
    );
    assert_eq!(
        (
            conclusion.num_passed,
            conclusion.num_ignored,
            conclusion.num_failed
        ),
        (1, 1, 0)
    );
    assert!(!ran.load(Ordering::SeqCst), "an ignored test must not run");
}

#[test]
fn a_required_missing_broker_and_a_panic_are_counted_as_failures() {
    let mut trials = Trials::default();
    trials.add(
        "needs_a_broker",
        &decide(None, true),
        Runtime::default(),
        |_url: String| async {},
    );
    trials.add_sync("panics", &Decision::Run(()), |()| panic!("on purpose"));
    let conclusion = run(trials);
    assert_eq!((conclusion.num_failed, conclusion.num_passed), (2, 0));
}

#[test]
fn a_name_filter_selects_the_tests_it_matches() {
    let mut trials = Trials::default();
    for name in ["first_case", "second_case", "other"] {
        trials.add_sync(name, &Decision::Run(()), |()| {});
    }
    let (conclusion, _) = run_with(trials, &["case"]);
    assert_eq!((conclusion.num_passed, conclusion.num_filtered_out), (2, 1));
}
