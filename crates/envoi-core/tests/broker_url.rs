//! A broker test without its URL is skipped, or fails when a run asks for
//! every broker test (`ENVOI_REQUIRE_BROKERS=1`, as `.ci/run` sets). One
//! test in this binary, as it changes the process's environment.

use envoi_core::testing::{broker_url, REQUIRE_BROKERS};

#[test]
fn a_missing_url_skips_the_test_unless_every_broker_test_must_run() {
    let variable = "ENVOI_TEST_OF_A_URL_NOBODY_SETS";
    std::env::remove_var(variable);
    std::env::remove_var(REQUIRE_BROKERS);
    assert_eq!(broker_url(variable, "a test"), None);

    std::env::set_var(variable, "  ");
    assert_eq!(
        broker_url(variable, "a test"),
        None,
        "blank counts as unset"
    );

    std::env::set_var(variable, "redis://127.0.0.1:6379");
    assert_eq!(
        broker_url(variable, "a test").as_deref(),
        Some("redis://127.0.0.1:6379")
    );

    std::env::remove_var(variable);
    std::env::set_var(REQUIRE_BROKERS, "1");
    let failed = std::panic::catch_unwind(|| broker_url(variable, "a test")).unwrap_err();
    let message = failed.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains("a test: ENVOI_TEST_OF_A_URL_NOBODY_SETS is not set"),
        "{message}"
    );
    std::env::remove_var(REQUIRE_BROKERS);
}
