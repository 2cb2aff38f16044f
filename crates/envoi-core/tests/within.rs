//! A test that would hang fails instead, saying what it waited for: the
//! test binary runs itself as the hanging test (selected by an environment
//! variable) and checks how that process ended.

use std::process::Command;
use std::time::Duration;

use envoi_core::testing::Within;

const CHILD: &str = "ENVOI_WITHIN_CHILD";

#[tokio::test(start_paused = true)]
async fn hangs_under_a_paused_clock() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    std::future::pending::<()>()
        .within(Duration::from_millis(300), "a message that never comes")
        .await;
}

#[test]
fn a_wait_past_its_limit_ends_the_test_process_with_what_it_waited_for() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "hangs_under_a_paused_clock", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(101), "{stderr}");
    assert!(
        stderr.contains("hangs_under_a_paused_clock: timed out after 300ms waiting for a message that never comes"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_wait_within_its_limit_returns_the_output() {
    let answer = async { 42 }
        .within(Duration::from_secs(60), "the answer")
        .await;
    assert_eq!(answer, 42);
}
