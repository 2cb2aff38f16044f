//! A test harness for tests that need a broker: each test becomes a
//! [`Trial`] of [`libtest_mimic`], run on a tokio runtime of its own,
//! reported as **ignored, with the reason**, when what it needs (a broker
//! URL in an environment variable, a server binary) is missing, and failed
//! instead when [`REQUIRE_BROKERS`]`=1` asks every broker test to run.
//!
//! The built-in harness cannot do that without an `#[ignore]` attribute,
//! which the house does not use: a broker test that returned early for
//! want of its URL was reported as `ok`, a skip that looked like a pass.
//!
//! ## Using it
//!
//! A test target opts out of the built-in harness in its crate's
//! `Cargo.toml`:
//!
//! ```toml
//! [[test]]
//! name = "postgres"
//! path = "tests/postgres.rs"
//! harness = false
//! ```
//!
//! and lists its tests with [`broker_tests!`](crate::broker_tests), which
//! writes the `main` of the target. A test that needs a URL takes it as its
//! argument; one that needs nothing takes none:
//!
//! ```
//! async fn sends_and_receives(url: String) {
//!     assert!(!url.is_empty());
//! }
//!
//! async fn refuses_a_bad_dsn() {}
//!
//! fn parses_outside_a_runtime() {}
//!
//! envoi_transport_tests::broker_tests! {
//!     env = "ENVOI_EXAMPLE_URL", tests = [sends_and_receives];
//!     tests = [refuses_a_bad_dsn: current_thread, parses_outside_a_runtime: sync];
//! }
//! # // The doctest harness wraps this in its own `main`; call ours.
//! # let _ = main;
//! ```
//!
//! Without `ENVOI_EXAMPLE_URL`, `cargo test` prints
//!
//! ```text
//! test sends_and_receives ... ignored (ENVOI_EXAMPLE_URL is not set)
//! test refuses_a_bad_dsn ... ok
//! test parses_outside_a_runtime ... ok
//!
//! test result: ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out
//! ```
//!
//! and with `ENVOI_REQUIRE_BROKERS=1` the first test fails, saying the
//! same. The usual arguments work as with the built-in harness: a name
//! filter, `--exact`, `--skip`, `--test-threads` (or `RUST_TEST_THREADS`),
//! `--list`; output is never captured (`--nocapture` is accepted and
//! changes nothing).
//!
//! ## Runtimes
//!
//! An async test runs on a runtime of its own, built like `#[tokio::test]`
//! builds it (every driver enabled): by default a multi-thread runtime with
//! two workers, or the [`Runtime`] named after the test in the macro
//! (`: current_thread`, `: multi_thread(4)`). A test marked `: sync` is a
//! plain `fn`, run outside any runtime. Each test runs on a thread named
//! after it, as under the built-in harness, so a panic or
//! [`within`](envoi_core::testing::within)'s timeout names the test.

use std::any::Any;
use std::future::Future;
use std::process::ExitCode;

pub use envoi_core::testing::REQUIRE_BROKERS;
pub use libtest_mimic::{Arguments, Conclusion, Trial};

use libtest_mimic::{Completion, Failed};

/// What the harness does with a test that needs something (a broker URL,
/// a server binary): run it with what it needs, report it ignored, or fail
/// it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision<T> {
    /// What the test needs was found: run it with this.
    Run(T),
    /// It is missing: report the test as ignored, with this reason.
    Ignore(String),
    /// It is missing and [`REQUIRE_BROKERS`]`=1`: fail the test, with
    /// this reason.
    Fail(String),
}

impl<T> Decision<T> {
    /// Decides from what looking for the test's need `found` (the thing, or
    /// why it is missing) and whether every broker test is `required` to
    /// run.
    ///
    /// ```
    /// use envoi_transport_tests::harness::Decision;
    ///
    /// let missing: Result<String, String> = Err("ENVOI_X_URL is not set".into());
    /// assert_eq!(
    ///     Decision::new(missing, false),
    ///     Decision::Ignore("ENVOI_X_URL is not set".into())
    /// );
    /// ```
    pub fn new(found: Result<T, String>, required: bool) -> Self {
        match found {
            Ok(need) => Decision::Run(need),
            Err(why) if required => Decision::Fail(format!(
                "{why}, and {REQUIRE_BROKERS}=1 asks every broker test to run"
            )),
            Err(why) => Decision::Ignore(why),
        }
    }

    /// The same decision, with what was found turned by `f`.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Decision<U> {
        match self {
            Decision::Run(need) => Decision::Run(f(need)),
            Decision::Ignore(why) => Decision::Ignore(why),
            Decision::Fail(why) => Decision::Fail(why),
        }
    }
}

impl Decision<String> {
    /// The decision for tests that need the URL in the environment
    /// variable `variable`, read from the environment, as is
    /// [`REQUIRE_BROKERS`].
    pub fn for_url(variable: &str) -> Self {
        Decision::new(env_url(variable), brokers_required())
    }
}

/// The URL that `value`, the value of the environment variable `variable`,
/// holds, or why there is none: unset, empty or blank all say
/// `"<variable> is not set"`.
///
/// ```
/// use envoi_transport_tests::harness::url_in;
///
/// assert_eq!(url_in("ENVOI_X_URL", Some("nats://127.0.0.1")), Ok("nats://127.0.0.1".into()));
/// assert_eq!(url_in("ENVOI_X_URL", Some(" ")), Err("ENVOI_X_URL is not set".into()));
/// ```
pub fn url_in(variable: &str, value: Option<&str>) -> Result<String, String> {
    match value {
        Some(url) if !url.trim().is_empty() => Ok(url.to_string()),
        _ => Err(format!("{variable} is not set")),
    }
}

/// The URL in the environment variable `variable`, or why there is none
/// (see [`url_in`]).
pub fn env_url(variable: &str) -> Result<String, String> {
    match std::env::var(variable) {
        Ok(value) => url_in(variable, Some(&value)),
        Err(std::env::VarError::NotPresent) => url_in(variable, None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{variable} is not valid UTF-8")),
    }
}

/// Whether [`REQUIRE_BROKERS`] is `1` in the environment.
pub fn brokers_required() -> bool {
    std::env::var_os(REQUIRE_BROKERS).is_some_and(|v| v == "1")
}

/// The tokio runtime an async test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    /// A current-thread runtime (`#[tokio::test]`'s default).
    CurrentThread,
    /// A multi-thread runtime with this many workers.
    MultiThread {
        /// The number of worker threads.
        worker_threads: usize,
    },
}

impl Default for Runtime {
    /// A multi-thread runtime with two workers, what most broker tests use.
    fn default() -> Self {
        Runtime::MultiThread { worker_threads: 2 }
    }
}

impl Runtime {
    /// Builds the runtime, every driver enabled.
    fn build(self) -> std::io::Result<tokio::runtime::Runtime> {
        let mut builder = match self {
            Runtime::CurrentThread => tokio::runtime::Builder::new_current_thread(),
            Runtime::MultiThread { worker_threads } => {
                let mut builder = tokio::runtime::Builder::new_multi_thread();
                builder.worker_threads(worker_threads);
                builder
            }
        };
        builder.enable_all().build()
    }
}

/// The tests of one test target, collected before they run.
///
/// [`broker_tests!`](crate::broker_tests) and
/// [`conformance!`](crate::conformance) build one and [`run`](Self::run) it
/// from the `main` they write; it can also be used by hand:
///
/// ```
/// use envoi_transport_tests::harness::{Arguments, Decision, Runtime, Trials};
///
/// let mut trials = Trials::default();
/// let need = Decision::Ignore("ENVOI_X_URL is not set".to_string());
/// trials.add("needs_a_broker", &need, Runtime::default(), |url: String| async move {
///     assert!(!url.is_empty());
/// });
/// trials.add_sync("needs_nothing", &Decision::Run(()), |()| assert_eq!(1 + 1, 2));
///
/// let conclusion = trials.run_with(&Arguments::from_iter(["self", "--quiet"]));
/// assert_eq!((conclusion.num_passed, conclusion.num_ignored), (1, 1));
/// ```
#[derive(Debug, Default)]
pub struct Trials {
    trials: Vec<Trial>,
}

impl Trials {
    /// Adds the async test `test`, called `name`, as `need` decides: run
    /// on a `runtime` of its own with what it needs, reported ignored, or
    /// failed.
    pub fn add<T, F, Fut>(
        &mut self,
        name: impl Into<String>,
        need: &Decision<T>,
        runtime: Runtime,
        test: F,
    ) where
        T: Clone + Send + 'static,
        F: FnOnce(T) -> Fut + Send + 'static,
        Fut: Future<Output = ()>,
    {
        self.add_sync(name, need, move |need| match runtime.build() {
            Ok(runtime) => runtime.block_on(test(need)),
            Err(e) => panic!("cannot build the test's {runtime:?} runtime: {e}"),
        });
    }

    /// Adds the test `test`, called `name`, as `need` decides, to run
    /// outside any runtime.
    pub fn add_sync<T, F>(&mut self, name: impl Into<String>, need: &Decision<T>, test: F)
    where
        T: Clone + Send + 'static,
        F: FnOnce(T) + Send + 'static,
    {
        let name = name.into();
        let trial = match need.clone() {
            Decision::Run(need) => {
                let thread = name.clone();
                Trial::test(name, move || on_named_thread(thread, move || test(need)))
            }
            Decision::Ignore(why) => {
                Trial::ignorable_test(name, move || Ok(Completion::ignored_with(why)))
            }
            Decision::Fail(why) => Trial::test(name, move || Err(why.into())),
        };
        self.trials.push(trial);
    }

    /// The number of tests added.
    pub fn len(&self) -> usize {
        self.trials.len()
    }

    /// Whether no test was added.
    pub fn is_empty(&self) -> bool {
        self.trials.is_empty()
    }

    /// Runs the tests the command line selects, prints their outcomes and
    /// the summary as `cargo test` does, and returns the exit code of the
    /// test binary (101 when a test failed). Without `--test-threads`,
    /// `RUST_TEST_THREADS` says how many tests run at once, as it does for
    /// the built-in harness.
    pub fn run(self) -> ExitCode {
        let mut args = Arguments::from_args();
        if args.test_threads.is_none() {
            match test_threads(std::env::var("RUST_TEST_THREADS").ok().as_deref()) {
                Ok(threads) => args.test_threads = threads,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(101);
                }
            }
        }
        self.run_with(&args).exit_code()
    }

    /// Runs the tests that `args` select and returns what came of them.
    pub fn run_with(self, args: &Arguments) -> Conclusion {
        libtest_mimic::run(args, self.trials)
    }
}

/// The number of tests to run at once that `RUST_TEST_THREADS` (whose
/// value is `value`) asks for: none when it is unset, an error unless it is
/// a positive integer.
fn test_threads(value: Option<&str>) -> Result<Option<usize>, String> {
    match value {
        None => Ok(None),
        Some(value) => match value.trim().parse::<usize>() {
            Ok(threads) if threads > 0 => Ok(Some(threads)),
            _ => Err(format!(
                "RUST_TEST_THREADS is `{value}`, should be a positive integer"
            )),
        },
    }
}

/// Runs `body` on a thread called `name` and waits for it: a panic becomes
/// the failure, its message kept.
fn on_named_thread(name: String, body: impl FnOnce() + Send + 'static) -> Result<(), Failed> {
    let thread = std::thread::Builder::new()
        .name(name)
        .spawn(body)
        .map_err(|e| format!("cannot start the test's thread: {e}"))?;
    thread
        .join()
        .map_err(|payload| Failed::from(panic_message(payload.as_ref())))
}

/// What a panic said, as the built-in harness reports it.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    match payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
    {
        Some(message) => format!("test panicked: {message}"),
        None => "test panicked".to_string(),
    }
}

/// Writes the `main` of a test target (with `harness = false`) that runs
/// the listed tests through the [harness](crate::harness): the tests of a
/// group with `env = "VARIABLE"` need the URL in that variable and take it
/// as their argument; those of a group with `needs = path` need what the
/// function `path` (a `fn() -> Result<T, String>`: the thing, or why it is
/// missing) finds, and take it; those of a group with neither need
/// nothing and take no argument. Groups end with `;`.
///
/// After a test's name, `: current_thread` or `: multi_thread(N)` picks its
/// [`Runtime`] (two workers by default) and `: sync` makes it a plain `fn`.
///
/// ```
/// # use std::path::PathBuf;
/// /// Where the server binary is, or why there is none.
/// fn server() -> Result<PathBuf, String> {
///     Err("no server binary".into())
/// }
///
/// async fn restarts_the_server(binary: PathBuf) {
///     assert!(binary.is_file());
/// }
///
/// async fn round_trip(url: String) {
///     assert!(url.starts_with("redis://"));
/// }
///
/// async fn many_clients(url: String) {
///     assert!(url.starts_with("redis://"));
/// }
///
/// envoi_transport_tests::broker_tests! {
///     env = "ENVOI_REDIS_URL", tests = [round_trip: current_thread, many_clients: multi_thread(4)];
///     needs = server, tests = [restarts_the_server];
/// }
/// # let _ = main;
/// ```
#[macro_export]
macro_rules! broker_tests {
    ($(
        $(env = $variable:literal,)?
        $(needs = $find:path,)?
        tests = [$($test:ident $(: $runtime:ident $(($workers:literal))?)?),* $(,)?]
    );+ $(;)?) => {
        fn main() -> ::std::process::ExitCode {
            let mut trials = $crate::harness::Trials::default();
            $(
                $crate::__broker_group!(
                    trials,
                    [$($variable)?] [$($find)?];
                    $($test [$($runtime $(($workers))?)?]),*
                );
            )+
            trials.run()
        }
    };
}

/// Adds one group of [`broker_tests!`]; not part of the API.
#[doc(hidden)]
#[macro_export]
macro_rules! __broker_group {
    ($trials:ident, [$variable:literal] []; $($test:ident [$($runtime:tt)*]),*) => {
        let need = $crate::harness::Decision::for_url($variable);
        $( $crate::__broker_trial!($trials, need, $test, $test, [$($runtime)*]); )*
    };
    ($trials:ident, [] [$find:path]; $($test:ident [$($runtime:tt)*]),*) => {
        let need = $crate::harness::Decision::new(
            $find(),
            $crate::harness::brokers_required(),
        );
        $( $crate::__broker_trial!($trials, need, $test, $test, [$($runtime)*]); )*
    };
    ($trials:ident, [] []; $($test:ident [$($runtime:tt)*]),*) => {
        let need = $crate::harness::Decision::Run(());
        $( $crate::__broker_trial!($trials, need, $test, |()| $test(), [$($runtime)*]); )*
    };
}

/// Adds one test of [`broker_tests!`]; not part of the API.
#[doc(hidden)]
#[macro_export]
macro_rules! __broker_trial {
    ($trials:ident, $need:ident, $name:ident, $test:expr, []) => {
        $trials.add(
            stringify!($name),
            &$need,
            $crate::harness::Runtime::default(),
            $test,
        );
    };
    ($trials:ident, $need:ident, $name:ident, $test:expr, [current_thread]) => {
        $trials.add(
            stringify!($name),
            &$need,
            $crate::harness::Runtime::CurrentThread,
            $test,
        );
    };
    ($trials:ident, $need:ident, $name:ident, $test:expr, [multi_thread($workers:literal)]) => {
        $trials.add(
            stringify!($name),
            &$need,
            $crate::harness::Runtime::MultiThread {
                worker_threads: $workers,
            },
            $test,
        );
    };
    ($trials:ident, $need:ident, $name:ident, $test:expr, [sync]) => {
        $trials.add_sync(stringify!($name), &$need, $test);
    };
}

#[cfg(test)]
mod tests {
    use super::test_threads;

    #[test]
    fn rust_test_threads_must_be_a_positive_integer() {
        assert_eq!(test_threads(None), Ok(None));
        assert_eq!(test_threads(Some("3")), Ok(Some(3)));
        for bad in ["0", "-1", "two", ""] {
            let error = test_threads(Some(bad)).unwrap_err();
            assert!(error.contains("RUST_TEST_THREADS"), "{error}");
        }
    }
}
