//! `*_vs_<peer>` scenarios: envoi against the job queues teams already run
//! (graphile-worker, BullMQ, Dramatiq, Symfony Messenger, apalis's
//! in-memory backend), each installed from its own package registry and run
//! against the same broker in the same run.
//!
//! Both sides move N messages of the same ~100-byte JSON shape
//! ([`envoi_side::payload`]) to a no-op handler, end to end: the consumers are started
//! and ready first, then the clock starts, the producers enqueue N messages
//! and the clock stops when the last one has been handled. Throughput is N
//! over that time, on both sides; each side checks it handled exactly N.
//!
//! Each side runs in a process of its own (envoi's is this binary again,
//! `--side envoi <scenario> <n>`), so that their memory can be compared:
//! a sampler reads the peak resident set (`VmHWM`) of the side's process and
//! of every process it starts, and adds them up ([`child`]).
//!
//! Every scenario runs one untimed warm-up of each side
//! (`ENVOI_BENCH_WARMUP` messages), then timed rounds (the plan of
//! [`crate::harness`]: 3 unless `ENVOI_BENCH_ROUNDS` says otherwise) in
//! which the sides alternate, and reports each side's median rate and its largest peak RSS:
//!
//! ```text
//! <scenario>: envoi=<msg/s> baseline=<msg/s> ratio=<r> peak_rss_mb=<envoi> baseline_rss_mb=<peer> n=<N> rounds=<r>
//! ```
//!
//! A scenario whose broker URL variable is not set, or whose peer cannot be
//! installed here, prints `<scenario>: skipped: <why>` and succeeds.

mod apalis_memory;
mod bullmq;
mod child;
mod dramatiq;
mod envoi_side;
mod graphile;
mod install;
mod symfony;

use std::process::{Command, ExitCode};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::harness::Plan;
use crate::report;

/// Where envoi's side of a scenario keeps its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    Postgres,
    Redis,
    Amqp,
    Memory,
}

impl Backend {
    /// The variable holding the broker's URL, if the backend has one.
    fn url_var(self) -> Option<&'static str> {
        match self {
            Backend::Postgres => Some("ENVOI_POSTGRES_URL"),
            Backend::Redis => Some("ENVOI_REDIS_URL"),
            Backend::Amqp => Some("ENVOI_AMQP_URL"),
            Backend::Memory => None,
        }
    }
}

/// One round of a peer: the command that runs it, moving `n` messages
/// through the broker at `url` (empty for the in-memory backend).
type PeerCommand = fn(url: &str, n: u64) -> Result<Command, String>;

/// A `*_vs_<peer>` scenario.
struct Spec {
    scenario: &'static str,
    backend: Backend,
    /// Installs the peer if needed; `Err` says why it cannot run here.
    prepare: fn() -> Result<(), String>,
    peer: PeerCommand,
}

const SPECS: &[Spec] = &[
    Spec {
        scenario: "postgres_vs_graphile",
        backend: Backend::Postgres,
        prepare: graphile::prepare,
        peer: graphile::batched,
    },
    Spec {
        scenario: "postgres_vs_graphile_unbatched",
        backend: Backend::Postgres,
        prepare: graphile::prepare,
        peer: graphile::unbatched,
    },
    Spec {
        scenario: "redis_vs_bullmq",
        backend: Backend::Redis,
        prepare: bullmq::prepare,
        peer: bullmq::command,
    },
    Spec {
        scenario: "amqp_vs_dramatiq",
        backend: Backend::Amqp,
        prepare: dramatiq::prepare,
        peer: dramatiq::rabbitmq,
    },
    Spec {
        scenario: "redis_vs_dramatiq",
        backend: Backend::Redis,
        prepare: dramatiq::prepare,
        peer: dramatiq::redis,
    },
    Spec {
        scenario: "amqp_vs_symfony",
        backend: Backend::Amqp,
        prepare: symfony::prepare,
        peer: symfony::amqp,
    },
    Spec {
        scenario: "redis_vs_symfony",
        backend: Backend::Redis,
        prepare: symfony::prepare,
        peer: symfony::redis,
    },
    Spec {
        scenario: "postgres_vs_symfony",
        backend: Backend::Postgres,
        prepare: symfony::prepare,
        peer: symfony::doctrine,
    },
    Spec {
        scenario: "memory_vs_apalis",
        backend: Backend::Memory,
        prepare: apalis_memory::prepare,
        peer: apalis_memory::command,
    },
];

fn spec(scenario: &str) -> Result<&'static Spec, String> {
    SPECS
        .iter()
        .find(|s| s.scenario == scenario)
        .ok_or_else(|| format!("no peer scenario named `{scenario}`"))
}

/// Declares the `pub(crate) fn <scenario>()` main.rs lists.
macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "`: see the module docs.")]
        pub(crate) fn $name() -> Result<(), String> {
            run(spec(stringify!($name))?)
        }
    )*};
}

scenarios!(
    postgres_vs_graphile,
    postgres_vs_graphile_unbatched,
    redis_vs_bullmq,
    amqp_vs_dramatiq,
    redis_vs_dramatiq,
    amqp_vs_symfony,
    redis_vs_symfony,
    postgres_vs_symfony,
    memory_vs_apalis,
);

/// The hidden `--side envoi <scenario> <n>` entry point: runs envoi's side
/// of `scenario` once in this process and prints its outcome line.
pub(crate) fn side_main(args: &[String]) -> ExitCode {
    match side(args) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("envoi side: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn side(args: &[String]) -> Result<String, String> {
    let [who, scenario, n] = args else {
        return Err("usage: envoi-bench --side envoi <scenario> <n>".into());
    };
    if who != "envoi" {
        return Err(format!("only the envoi side runs in-binary, not `{who}`"));
    }
    let spec = spec(scenario)?;
    let n: u64 = n
        .parse()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("<n> must be a positive count, not `{n}`"))?;
    let url = match spec.backend.url_var() {
        Some(var) => std::env::var(var).map_err(|_| format!("{var} is not set"))?,
        None => String::new(),
    };
    let outcome = envoi_side::run(spec.backend, &url, n)?;
    Ok(child::outcome_line(outcome.handled, outcome.seconds))
}

/// The command running envoi's side of `scenario` with `n` messages.
fn envoi_command(scenario: &str, n: u64) -> Result<Command, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.args(["--side", "envoi", scenario, &n.to_string()]);
    Ok(cmd)
}

/// What the timed rounds of one side measured.
#[derive(Debug, Default)]
struct Tally {
    rates: Vec<f64>,
    peak_rss_kb: u64,
}

impl Tally {
    fn add(&mut self, run: child::Run) {
        self.rates.push(run.rate());
        self.peak_rss_kb = self.peak_rss_kb.max(run.peak_rss_kb);
    }
}

fn run(spec: &Spec) -> Result<(), String> {
    let url = match spec.backend.url_var() {
        Some(var) => match std::env::var(var) {
            Ok(url) if !url.trim().is_empty() => url,
            _ => {
                println!("{}: skipped: {var} is not set", spec.scenario);
                return Ok(());
            }
        },
        None => String::new(),
    };
    if let Err(why) = (spec.prepare)() {
        println!("{}: skipped: {why}", spec.scenario);
        return Ok(());
    }
    let Plan { n, rounds, warmup } = Plan::from_env()?;
    let envoi_side = |n| child::run_side("envoi", envoi_command(spec.scenario, n)?, n);
    let peer_side = |n| child::run_side("peer", (spec.peer)(&url, n)?, n);
    if warmup > 0 {
        envoi_side(warmup)?;
        peer_side(warmup)?;
    }
    let (mut envoi, mut peer) = (Tally::default(), Tally::default());
    for round in 0..rounds {
        // Alternate which side goes first, so neither always follows the
        // other's leftovers on the broker.
        if round % 2 == 0 {
            envoi.add(envoi_side(n)?);
            peer.add(peer_side(n)?);
        } else {
            peer.add(peer_side(n)?);
            envoi.add(envoi_side(n)?);
        }
    }
    report::line(
        spec.scenario,
        median(&envoi.rates),
        median(&peer.rates),
        "msg/s",
        &[
            ("peak_rss_mb", mb(envoi.peak_rss_kb)),
            ("baseline_rss_mb", mb(peer.peak_rss_kb)),
            ("n", n.to_string()),
            ("rounds", rounds.to_string()),
        ],
    );
    Ok(())
}

fn mb(kb: u64) -> String {
    format!("{:.0}", kb as f64 / 1024.0)
}

/// The median of `values` (the mean of the middle two for an even count);
/// 0 for none.
fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        len if len % 2 == 1 => v[len / 2],
        len => (v[len / 2 - 1] + v[len / 2]) / 2.0,
    }
}

/// A lower-case suffix unique to this round: process id and clock.
pub(crate) fn unique() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}_{}", std::process::id(), nanos % 1_000_000_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_takes_the_middle_value_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn every_scenario_has_one_spec_and_a_url_variable_unless_in_memory() {
        for s in SPECS {
            assert_eq!(spec(s.scenario).map(|f| f.scenario), Ok(s.scenario));
            let prefix = s.scenario.split('_').next();
            let var = s.backend.url_var();
            match prefix {
                Some("memory") => assert_eq!(var, None),
                Some(p) => assert!(
                    var.is_some_and(|v| v.to_lowercase().contains(p)),
                    "{} uses {var:?}",
                    s.scenario
                ),
                None => unreachable!(),
            }
        }
    }

    #[test]
    fn the_side_entry_point_refuses_bad_arguments() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(side(&args(&["envoi"])).is_err());
        assert!(side(&args(&["peer", "memory_vs_apalis", "10"])).is_err());
        assert!(side(&args(&["envoi", "no_such_scenario", "10"])).is_err());
        assert!(side(&args(&["envoi", "memory_vs_apalis", "0"])).is_err());
        assert!(side(&args(&["envoi", "memory_vs_apalis", "ten"])).is_err());
    }

    #[test]
    fn the_envoi_side_runs_the_in_memory_scenario_and_handles_every_message() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let line = side(&args(&["envoi", "memory_vs_apalis", "500"])).unwrap();
        let (handled, seconds, peak) = child::parse_outcome(&line).unwrap();
        assert_eq!(handled, 500);
        assert!(seconds > 0.0);
        assert!(peak.is_some());
    }
}
