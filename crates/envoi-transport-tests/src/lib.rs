//! # envoi-transport-tests
//!
//! One conformance suite that every envoi transport passes, modelled on
//! Watermill's universal Pub/Sub tests. The cases work at the raw level of
//! [`Transport`]: bodies and headers go in through `send`, come out through
//! the `get` of its [`Receiver`], and are settled with `ack`, `reject` or
//! `release`. Envelope-level
//! behaviour (stamps, the serializer) is tested through the serializer
//! elsewhere and is deliberately absent here.
//!
//! ## Running the suite for a transport
//!
//! A transport crate adds this crate as a dev-dependency, declares
//! `tests/conformance.rs` as a test target that does without the built-in
//! harness (the suite's cases run through this crate's [harness], which
//! reports the cases of a broker whose URL is missing as ignored, with the
//! reason):
//!
//! ```toml
//! [[test]]
//! name = "conformance"
//! path = "tests/conformance.rs"
//! harness = false
//! ```
//!
//! and writes the file:
//!
//! ```
//! use std::sync::Arc;
//! use envoi_core::transport::Transport;
//!
//! async fn make(name: String) -> Option<Arc<dyn Transport>> {
//!     // Open the transport called `name` on the broker at the URL, with a
//!     // lease of `Options::lease`.
//!     let url = std::env::var("ENVOI_EXAMPLE_URL").ok()?;
//!     let _ = (name, url);
//!     None
//! }
//!
//! envoi_transport_tests::conformance!(make, env = "ENVOI_EXAMPLE_URL");
//! ```
//!
//! Without `ENVOI_EXAMPLE_URL` every case is reported as
//! `ignored (ENVOI_EXAMPLE_URL is not set)`, or fails with
//! `ENVOI_REQUIRE_BROKERS=1`. A transport that needs no broker leaves out
//! `env`: its cases always run.
//!
//! With [`Options`] (here a one-second lease, for a transport whose
//! messages do not outlive the process):
//!
//! ```
//! # use std::sync::Arc;
//! # use envoi_core::transport::Transport;
//! # async fn make(name: String) -> Option<Arc<dyn Transport>> { let _ = name; None }
//! envoi_transport_tests::conformance!(
//!     make,
//!     envoi_transport_tests::Options {
//!         lease: std::time::Duration::from_secs(1),
//!         persistent: false,
//!         ..envoi_transport_tests::Options::default()
//!     }
//! );
//! ```
//!
//! The macro writes the target's `main`: one test per case, named after
//! the case, each calling the function of the same name in [`cases`] on a
//! multi-thread tokio runtime with two workers. A target that runs more
//! than one suite adds them with [`conformance_trials!`].
//!
//! ## What `make` must do
//!
//! * `make(name)` opens the transport (queue, table, stream) called `name`.
//!   Calling it twice with the same name gives two handles on the same
//!   queue: the cases use that to model restarts and several processes.
//! * The transport's lease (visibility timeout) must be
//!   [`Options::lease`] (2 s by default) so that redelivery cases finish
//!   quickly.
//! * Returning `None` skips the case, which then passes: `make` prints why.
//!   A missing broker URL is better said with `env`, which the harness
//!   checks before any case runs.
//!
//! Every case uses names of its own (with a random suffix), so the cases
//! can run in parallel and repeatedly against the same server.
//!
//! ## Abilities
//!
//! The cases send through [`Transport::send`] and
//! [`Transport::send_batch`] and take messages out through the transport's
//! [`Receiver`] ([`receiver`] hands it out, and panics with "the transport
//! under test has no receiving side" for a transport without one). The
//! other abilities are used where the transport has them:
//!
//! | ability | the suite |
//! |---|---|
//! | [`Setup`] | runs it on each handle it opens; [`cases::setup_is_idempotent`] runs it again, concurrently |
//! | [`Keepalive`] | [`cases::keepalive_prevents_redelivery`] needs it; [`cases::unknown_ids_do_not_disturb_other_messages`] also keeps unknown ids alive |
//! | [`MessageCount`] | [`cases::message_count_counts_waiting_messages`] needs it; other cases check the count where there is one |
//! | [`Browse`] | [`cases::list_and_find_do_not_lease`] needs it |
//!
//! A case that needs an ability the transport lacks prints
//! `skipped <case>: transport cannot <ability>` (`keep leases alive`,
//! `count messages`, `browse`) and passes.
//!
//! ## What the cases expect of every transport
//!
//! * **Bodies**: any UTF-8 text up to 256 KiB (envoi sends JSON). With
//!   [`Options::binary_bodies`] (the default), any bytes as well: empty,
//!   NUL bytes and invalid UTF-8.
//! * **Headers**: keys made of ASCII letters, digits, `-`, `_` and `.`;
//!   values any UTF-8 string without NUL (quotes, backslashes, newlines,
//!   tabs, emoji, empty, several KiB), up to 64 headers per message. A
//!   transport whose native headers cannot hold that must encode them.
//!   No header name is reserved: `X-Envoi-Redelivered` round-trips like
//!   any other.
//! * **At least once**: a message handed out and neither acknowledged nor
//!   rejected comes back (after [`Receiver::release`] at once, after the
//!   lease otherwise); an acknowledged or rejected message never comes back.
//! * **Redeliveries are marked on the delivery**: a first delivery has
//!   [`Delivery::redelivered`] `false`, whatever its stored headers say; a
//!   message that comes back after its lease ran out has it `true` (unless
//!   [`Options::marks_redeliveries`] is off).
//! * **`get`** may wait briefly for a message but comes back (empty) within
//!   a few seconds when none is available.
//! * **Unknown ids**: `ack`, `reject`, `release` and `keepalive` of a
//!   [`DeliveryId`] the transport does not know must not panic nor disturb
//!   other messages.
//!
//! What a transport promises beyond that is said in [`Options`]:
//! [`persistent`](Options::persistent), [`ordered`](Options::ordered),
//! [`delay`](Options::delay) (each `true` by default),
//! [`lease_expiry`](Options::lease_expiry),
//! [`marks_redeliveries`](Options::marks_redeliveries) and
//! [`binary_bodies`](Options::binary_bodies). A case that needs a promise
//! the options deny prints `skipped <case>: transport is not <capability>`
//! (or why else it does not apply) and passes.
//!
//! [`Transport`]: envoi_core::transport::Transport
//! [`Transport::send`]: envoi_core::transport::Transport::send
//! [`Transport::send_batch`]: envoi_core::transport::Transport::send_batch
//! [`Receiver`]: envoi_core::transport::Receiver
//! [`Receiver::release`]: envoi_core::transport::Receiver::release
//! [`Setup`]: envoi_core::transport::Setup
//! [`Keepalive`]: envoi_core::transport::Keepalive
//! [`MessageCount`]: envoi_core::transport::MessageCount
//! [`Browse`]: envoi_core::transport::Browse
//! [`Delivery::redelivered`]: envoi_core::transport::Delivery::redelivered
//! [`DeliveryId`]: envoi_core::transport::DeliveryId

#![forbid(unsafe_code)]

pub mod cases;
pub mod harness;
mod support;

use std::time::Duration;

pub use support::{receiver, unique_name, MakeTransport};

/// What the suite may assume about the transport under test.
#[derive(Debug, Clone)]
pub struct Options {
    /// The lease (visibility timeout) the transports made by `make` use.
    /// Keepalive cases renew it every quarter of this; redelivery cases wait
    /// for it to pass. Default: 2 s.
    pub lease: Duration,
    /// Whether a message handed out and never settled comes back by itself
    /// once the lease passes. Default: `true`. A transport that cannot do
    /// that (it only redelivers what is released) sets it to `false`, which
    /// skips the lease and keepalive cases.
    pub lease_expiry: bool,
    /// Whether a message that comes back after its lease expired is marked
    /// as redelivered ([`Delivery::redelivered`]), which lets
    /// [`Deduplicate`] handle it while the claim of the consumer that died
    /// still holds. Default: `true`. A transport that cannot tell sets it
    /// to `false`; the lease cases then only check that a first delivery is
    /// not marked.
    ///
    /// [`Delivery::redelivered`]: envoi_core::transport::Delivery::redelivered
    /// [`Deduplicate`]: envoi_core::middleware::dedup::Deduplicate
    pub marks_redeliveries: bool,
    /// Whether bodies may be any bytes, not only UTF-8 text. Default: `true`.
    pub binary_bodies: bool,
    /// Whether stored messages survive the handles that sent them: a handle
    /// opened after the first was dropped (a restart) receives them.
    /// Default: `true`. A transport whose messages live only as long as
    /// its handle (or process) sets it to `false`, which skips
    /// [`cases::messages_survive_reopening`].
    pub persistent: bool,
    /// Whether a single consumer receives messages in the order they were
    /// sent, one by one or as a batch. Default: `true`. A transport that
    /// does not keep that order sets it to `false`, which skips
    /// [`cases::single_consumer_receives_in_order`].
    pub ordered: bool,
    /// Whether `send` honours a delay: a delayed message is not handed out
    /// before it. Default: `true`. A transport that cannot delay sets it to
    /// `false`, which skips [`cases::delay_is_honoured`] and the delayed
    /// part of [`cases::send_batch_and_ack_batch`].
    pub delay: bool,
    /// The longest a case waits for messages it expects. Generous, because
    /// CI machines are slow. Default: 30 s.
    pub timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(2),
            lease_expiry: true,
            marks_redeliveries: true,
            binary_bodies: true,
            persistent: true,
            ordered: true,
            delay: true,
            timeout: Duration::from_secs(30),
        }
    }
}

/// Names of every case, in the order the [`conformance!`] macro emits them.
pub const CASES: &[&str] = &[
    "publish_consume_integrity",
    "binary_bodies_round_trip",
    "acked_message_never_comes_back",
    "rejected_message_never_comes_back",
    "released_message_is_redelivered",
    "continues_after_repeated_errors",
    "unacked_message_is_redelivered_after_lease",
    "keepalive_prevents_redelivery",
    "concurrent_consumers_see_every_message_once",
    "consumers_reopened_mid_stream_lose_nothing",
    "many_consumers_closing_at_once_lose_nothing",
    "single_consumer_receives_in_order",
    "concurrent_publishers_lose_nothing",
    "transport_names_isolate_messages",
    "delay_is_honoured",
    "message_count_counts_waiting_messages",
    "list_and_find_do_not_lease",
    "setup_is_idempotent",
    "send_batch_and_ack_batch",
    "get_never_exceeds_max",
    "get_on_an_empty_transport_returns",
    "unknown_ids_do_not_disturb_other_messages",
    "messages_survive_reopening",
    "claimed_message_survives_consumer_crash",
];

/// Writes the `main` of a test target (with `harness = false` in its
/// crate's `Cargo.toml`) that runs every conformance case, as a test of
/// the [harness], on the transport made by `make` (an
/// `async fn(String) -> Option<Arc<dyn Transport>>`), optionally with
/// [`Options`]; see the [crate docs](crate) for an example.
///
/// With `env = "VARIABLE"` last, the cases need the broker URL in that
/// variable: without it they are reported as ignored, with the reason (or
/// fail, with `ENVOI_REQUIRE_BROKERS=1`). `make` reads the URL itself.
#[macro_export]
macro_rules! conformance {
    ($make:path) => {
        $crate::conformance!($make, $crate::Options::default());
    };
    ($make:path, env = $variable:literal) => {
        $crate::conformance!($make, $crate::Options::default(), env = $variable);
    };
    ($make:path, $options:expr) => {
        fn main() -> ::std::process::ExitCode {
            let mut trials = $crate::harness::Trials::default();
            $crate::conformance_trials!(&mut trials, "", $make, $options);
            trials.run()
        }
    };
    ($make:path, $options:expr, env = $variable:literal) => {
        fn main() -> ::std::process::ExitCode {
            let mut trials = $crate::harness::Trials::default();
            $crate::conformance_trials!(&mut trials, "", $make, $options, env = $variable);
            trials.run()
        }
    };
}

/// Adds every conformance case, as a test of the [harness] called
/// `prefix` followed by the case's name, to `trials` (a
/// `&mut` [`Trials`](harness::Trials)): the suite of [`conformance!`], for a
/// test target that runs more than one suite, or more than the suite.
///
/// ```
/// # use std::sync::Arc;
/// # use envoi_core::transport::Transport;
/// use envoi_transport_tests::harness::Trials;
///
/// async fn make(name: String) -> Option<Arc<dyn Transport>> {
///     Some(Arc::new(envoi_core::transport::in_memory::InMemoryTransport::new()))
/// }
///
/// let mut trials = Trials::default();
/// envoi_transport_tests::conformance_trials!(&mut trials, "first::", make, Default::default());
/// envoi_transport_tests::conformance_trials!(
///     &mut trials,
///     "second::",
///     make,
///     Default::default(),
///     env = "ENVOI_EXAMPLE_URL"
/// );
/// assert_eq!(trials.len(), 2 * envoi_transport_tests::CASES.len());
/// ```
#[macro_export]
macro_rules! conformance_trials {
    ($trials:expr, $prefix:literal, $make:path, $options:expr) => {
        $crate::__conformance_cases!(
            $trials,
            $prefix,
            $make,
            $options,
            $crate::harness::Decision::Run(())
        )
    };
    ($trials:expr, $prefix:literal, $make:path, $options:expr, env = $variable:literal) => {
        $crate::__conformance_cases!(
            $trials,
            $prefix,
            $make,
            $options,
            $crate::harness::Decision::for_url($variable).map(|_| ())
        )
    };
}

/// Adds the cases for [`conformance_trials!`]; not part of the API.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($trials:expr, $prefix:literal, $make:path, $options:expr, $need:expr) => {
        $crate::__conformance_cases!(
            @each $trials, $prefix, $make, $options, $need;
            publish_consume_integrity,
            binary_bodies_round_trip,
            acked_message_never_comes_back,
            rejected_message_never_comes_back,
            released_message_is_redelivered,
            continues_after_repeated_errors,
            unacked_message_is_redelivered_after_lease,
            keepalive_prevents_redelivery,
            concurrent_consumers_see_every_message_once,
            consumers_reopened_mid_stream_lose_nothing,
            many_consumers_closing_at_once_lose_nothing,
            single_consumer_receives_in_order,
            concurrent_publishers_lose_nothing,
            transport_names_isolate_messages,
            delay_is_honoured,
            message_count_counts_waiting_messages,
            list_and_find_do_not_lease,
            setup_is_idempotent,
            send_batch_and_ack_batch,
            get_never_exceeds_max,
            get_on_an_empty_transport_returns,
            unknown_ids_do_not_disturb_other_messages,
            messages_survive_reopening,
            claimed_message_survives_consumer_crash
        )
    };
    (@each $trials:expr, $prefix:literal, $make:path, $options:expr, $need:expr; $($case:ident),*) => {{
        let trials: &mut $crate::harness::Trials = $trials;
        let need: $crate::harness::Decision<()> = $need;
        $(
            trials.add(
                ::std::concat!($prefix, ::std::stringify!($case)),
                &need,
                $crate::harness::Runtime::MultiThread { worker_threads: 2 },
                |()| async {
                    let options: $crate::Options = $options;
                    $crate::cases::$case(&$make, &options).await;
                },
            );
        )*
    }};
}
