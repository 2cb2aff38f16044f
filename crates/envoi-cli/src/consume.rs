//! `consume`: a worker with a progress bar, a live rate and a summary.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use envoi_core::transport::Transport;
use envoi_core::worker::{
    StopHandle, Worker, WorkerEvent, WorkerListener, WorkerReport, WorkerStats,
};
use envoi_core::Messenger;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::parse::{
    parse_duration, parse_positive, parse_positive_duration, parse_positive_size,
    parse_positive_u64,
};
use crate::table::flatten;
use crate::{unknown_transport, CliError, Console};

/// Arguments of `consume`.
///
/// The numbers and durations accept a value starting with `-`, so that
/// `--time-limit -5s` is refused by the duration's parser, which says what
/// a duration looks like, rather than read as the flags `-5` and `-s`.
#[derive(Debug, Args)]
#[non_exhaustive]
pub struct ConsumeArgs {
    /// The transports to consume, in priority order (first given, first read).
    ///
    /// A failure transport can be consumed, but a message that fails there
    /// again is parked in it again: `failed retry` handles each once.
    #[arg(required = true, value_name = "TRANSPORT")]
    pub transports: Vec<String>,
    /// Stop after this many messages.
    #[arg(long, value_name = "N", value_parser = parse_positive_u64, allow_hyphen_values = true)]
    pub limit: Option<u64>,
    /// Stop after running this long (500ms, 30s, 5m, 1h30m).
    #[arg(long, value_name = "DURATION", value_parser = parse_positive_duration, allow_hyphen_values = true)]
    pub time_limit: Option<Duration>,
    /// Stop when the process uses more memory than this (128MB, 1G; Linux).
    #[arg(long, value_name = "SIZE", value_parser = parse_positive_size, allow_hyphen_values = true)]
    pub memory_limit: Option<u64>,
    /// Stop after this many failed messages.
    #[arg(long, value_name = "N", value_parser = parse_positive_u64, allow_hyphen_values = true)]
    pub failure_limit: Option<u64>,
    /// Handle up to this many messages at once.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_positive, allow_hyphen_values = true)]
    pub concurrency: usize,
    /// Ask a transport for up to this many messages at a time.
    #[arg(long, value_name = "N", value_parser = parse_positive, allow_hyphen_values = true)]
    pub batch_size: Option<usize>,
    /// Stop once every transport is empty and nothing is in flight.
    #[arg(long)]
    pub stop_when_empty: bool,
    /// How long handlers in flight may take to finish after a stop (default 10s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, allow_hyphen_values = true)]
    pub grace_period: Option<Duration>,
    /// Do not print a line per failed message or failed transport operation.
    #[arg(long, short)]
    pub quiet: bool,
}

/// The most failure lines printed by one run.
const MAX_LINES: usize = 200;

/// Lines for failed messages and transport errors, written out by the
/// progress loop (listeners are called in line and must be quick). Each is
/// one line: a line break in an error (or a message name) becomes a space.
#[derive(Default)]
struct FailureLog {
    lines: Mutex<Vec<String>>,
    total: AtomicU64,
}

impl FailureLog {
    fn push(&self, line: String) {
        let line = flatten(&line);
        let n = self.total.fetch_add(1, Ordering::Relaxed) as usize;
        let mut lines = self
            .lines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if n < MAX_LINES {
            lines.push(line);
        } else if n == MAX_LINES {
            lines.push("… more failures are not shown".to_string());
        }
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(
            &mut *self
                .lines
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

struct LogListener(Arc<FailureLog>);

impl WorkerListener for LogListener {
    fn on_event(&self, event: &WorkerEvent) {
        match event {
            WorkerEvent::Failed {
                transport,
                id,
                message,
                kind,
                error,
                parked_in,
                released,
                ..
            } => {
                let fate = match (parked_in, released) {
                    (Some(f), _) => format!("parked in `{f}`"),
                    (None, true) => "released, to be delivered again".to_string(),
                    (None, false) => "rejected (no failure transport)".to_string(),
                };
                self.0.push(format!(
                    "failed: {message} {transport}#{id} ({kind}): {error} -> {fate}"
                ));
            }
            WorkerEvent::TransportFailed {
                transport,
                operation,
                error,
            } => self.0.push(format!(
                "transport `{transport}`: {operation} failed: {error}"
            )),
            _ => {}
        }
    }
}

/// The fetches that failed, so that a run that could read nothing at all
/// (a database it may not write, a broker that refuses it) ends in an
/// error rather than a clean stop.
#[derive(Default)]
struct FetchFailures {
    times: AtomicU64,
    last: Mutex<Option<(String, String)>>,
}

struct FetchListener(Arc<FetchFailures>);

impl WorkerListener for FetchListener {
    fn on_event(&self, event: &WorkerEvent) {
        if let WorkerEvent::TransportFailed {
            transport,
            operation: "get",
            error,
        } = event
        {
            self.0.times.fetch_add(1, Ordering::Relaxed);
            *self
                .0
                .last
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some((transport.to_string(), error.clone()));
        }
    }
}

impl FetchFailures {
    /// The error of a run that received nothing while fetches failed.
    fn nothing_read(&self, stats: &WorkerStats) -> Option<CliError> {
        let times = self.times.load(Ordering::Relaxed);
        if stats.received > 0 || times == 0 {
            return None;
        }
        let (transport, error) = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()?;
        Some(CliError::NothingRead {
            transport,
            times,
            error,
        })
    }
}

/// Messages per second over the last few seconds.
struct Rate {
    samples: VecDeque<(Instant, u64)>,
}

impl Rate {
    const WINDOW: Duration = Duration::from_secs(3);

    fn new() -> Self {
        Rate {
            samples: VecDeque::new(),
        }
    }

    fn record(&mut self, now: Instant, processed: u64) -> f64 {
        self.samples.push_back((now, processed));
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Self::WINDOW)
            && self.samples.len() > 2
        {
            self.samples.pop_front();
        }
        match (self.samples.front(), self.samples.back()) {
            (Some((t0, n0)), Some((t1, n1))) if t1 > t0 => {
                (n1 - n0) as f64 / t1.duration_since(*t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

fn processed(s: &WorkerStats) -> u64 {
    s.handled + s.stopped_by_filter + s.retried + s.failed
}

/// ", stopped by filter N" when a filter stopped any message, else nothing.
fn stopped_note(s: &WorkerStats) -> String {
    if s.stopped_by_filter == 0 {
        String::new()
    } else {
        format!(", stopped by filter {}", s.stopped_by_filter)
    }
}

/// The messages waiting in the transports that can count them (the others
/// add nothing: the bar then only grows as messages are handled).
async fn waiting(transports: &[Arc<dyn Transport>]) -> u64 {
    let mut total = 0;
    for counter in transports.iter().filter_map(|t| t.as_message_count()) {
        total += counter.message_count().await.unwrap_or(0);
    }
    total
}

/// The warning printed when `consume` reads failure transports, or `None`
/// when none of `consumed` is one of `failure`.
fn failure_transport_warning(
    consumed: &[String],
    failure: &[&str],
    stop_when_empty: bool,
) -> Option<String> {
    let mut named: Vec<&str> = Vec::new();
    for name in consumed {
        if failure.contains(&name.as_str()) && !named.contains(&name.as_str()) {
            named.push(name);
        }
    }
    let list = named
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let (what, it) = match named.len() {
        0 => return None,
        1 => (format!("{list} is a failure transport"), "it"),
        _ => (format!("{list} are failure transports"), "them"),
    };
    let once = if stop_when_empty {
        "; --stop-when-empty stops once each has been tried"
    } else {
        ""
    };
    Some(format!(
        "warning: {what}: messages that fail again go back to {it} under a new id, due 1 s \
         later, doubling each time{once}; use `failed retry` to handle each failed message once"
    ))
}

fn flush(console: &mut Console<'_>, bar: Option<&ProgressBar>, log: &FailureLog) {
    let lines = log.take();
    if lines.is_empty() {
        return;
    }
    let mut write = || {
        for line in &lines {
            let _ = writeln!(console.out, "{line}");
        }
        let _ = console.out.flush();
    };
    match bar {
        Some(bar) => bar.suspend(write),
        None => write(),
    }
}

/// The worker `args` describe, reporting failed fetches to
/// `fetch_failures` and, unless quiet, failures to `log`.
fn build_worker(
    messenger: &Messenger,
    args: &ConsumeArgs,
    stop: StopHandle,
    log: &Arc<FailureLog>,
    fetch_failures: &Arc<FetchFailures>,
) -> Result<Worker, CliError> {
    let mut builder = Worker::builder(messenger)
        .receivers(args.transports.iter().cloned())
        .concurrency(args.concurrency)
        .stop_handle(stop)
        .listener(FetchListener(fetch_failures.clone()));
    if let Some(n) = args.limit {
        builder = builder.message_limit(n);
    }
    if let Some(t) = args.time_limit {
        builder = builder.time_limit(t);
    }
    if let Some(bytes) = args.memory_limit {
        builder = builder.memory_limit(bytes);
    }
    if let Some(n) = args.failure_limit {
        builder = builder.failure_limit(n);
    }
    if let Some(n) = args.batch_size {
        builder = builder.batch_size(n);
    }
    if let Some(g) = args.grace_period {
        builder = builder.grace_period(g);
    }
    if args.stop_when_empty {
        builder = builder.stop_when_empty();
    }
    if !args.quiet {
        builder = builder.listener(LogListener(log.clone()));
    }
    Ok(builder.build()?)
}

/// Writes the warning about consuming a failure transport, if there is
/// one, and the banner.
fn announce(
    messenger: &Messenger,
    args: &ConsumeArgs,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    if let Some(warning) = failure_transport_warning(
        &args.transports,
        &messenger.failure_transports(),
        args.stop_when_empty,
    ) {
        let _ = writeln!(console.warnings, "{warning}");
        let _ = console.warnings.flush();
    }
    writeln!(
        console.out,
        "Consuming {} (concurrency {}). Stop with Ctrl-C.",
        args.transports.join(", "),
        args.concurrency
    )?;
    console.out.flush()?;
    Ok(())
}

/// The progress bar and what keeps its length up to date.
struct Bar {
    bar: ProgressBar,
    /// The messages waiting, refreshed in the background (counting must
    /// not hold up the worker); until the first count, the one made for
    /// the bar.
    waiting: Arc<AtomicU64>,
    /// The task refreshing `waiting`, when the bar's length follows it
    /// (without `--limit`).
    counter: Option<tokio::task::JoinHandle<()>>,
    /// Whether the length is `--limit` rather than what is waiting.
    fixed_length: bool,
}

impl Bar {
    /// A bar on standard error, sized by `--limit` or by the messages
    /// waiting in the transports that can count them.
    async fn start(limit: Option<u64>, transports: Vec<Arc<dyn Transport>>) -> Bar {
        let initial = waiting(&transports).await;
        let bar = ProgressBar::with_draw_target(
            Some(limit.unwrap_or(initial)),
            ProgressDrawTarget::stderr(),
        );
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] [{bar:30}] {pos}/{len} {msg}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        let waiting_now = Arc::new(AtomicU64::new(initial));
        let counter = limit.is_none().then(|| {
            let waiting_now = waiting_now.clone();
            tokio::spawn(async move {
                loop {
                    waiting_now.store(waiting(&transports).await, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            })
        });
        Bar {
            bar,
            waiting: waiting_now,
            counter,
            fixed_length: limit.is_some(),
        }
    }

    fn update(&self, stats: &WorkerStats, per_sec: f64) {
        let done = processed(stats);
        if !self.fixed_length {
            self.bar
                .set_length(done + self.waiting.load(Ordering::Relaxed));
        }
        self.bar.set_position(done);
        self.bar.set_message(format!(
            "{per_sec:.0} msg/s | handled {}{} | retried {} | failed {}",
            stats.handled,
            stopped_note(stats).replace(", ", " | "),
            stats.retried,
            stats.failed
        ));
    }

    fn finish(self) {
        if let Some(task) = self.counter {
            task.abort();
        }
        self.bar.finish_and_clear();
    }
}

/// Runs `worker` to its end, updating `bar` and writing out the failure
/// lines every tenth of a second.
async fn drive(
    worker: Worker,
    bar: Option<&Bar>,
    log: &FailureLog,
    console: &mut Console<'_>,
) -> WorkerReport {
    let progress = worker.progress();
    let mut rate = Rate::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let run = worker.run();
    tokio::pin!(run);
    loop {
        tokio::select! {
            report = &mut run => return report,
            _ = tick.tick() => {
                let stats = progress.snapshot();
                let per_sec = rate.record(Instant::now(), processed(&stats));
                if let Some(bar) = bar {
                    bar.update(&stats, per_sec);
                }
                flush(console, bar.map(|b| &b.bar), log);
            }
        }
    }
}

/// Writes the summary line of a finished run.
fn summarize(console: &mut Console<'_>, report: &WorkerReport) -> Result<(), CliError> {
    let s = &report.stats;
    let secs = report.elapsed.as_secs_f64();
    let avg = if secs > 0.0 {
        processed(s) as f64 / secs
    } else {
        0.0
    };
    writeln!(
        console.out,
        "Stopped ({}) after {secs:.1}s: handled {}{}, retried {}, failed {}, released {} ({avg:.0} msg/s).",
        report.reason,
        s.handled,
        stopped_note(s),
        s.retried,
        s.failed,
        s.released
    )?;
    Ok(())
}

pub(crate) async fn run(
    messenger: &Messenger,
    args: ConsumeArgs,
    console: &mut Console<'_>,
) -> Result<(), CliError> {
    let mut transports = Vec::with_capacity(args.transports.len());
    for name in &args.transports {
        let t = messenger
            .transport(name)
            .ok_or_else(|| unknown_transport(messenger, name))?;
        transports.push(t.clone());
    }
    let log = Arc::new(FailureLog::default());
    let fetch_failures = Arc::new(FetchFailures::default());
    let stop = console.stop.clone().unwrap_or_default();
    let worker = build_worker(messenger, &args, stop.clone(), &log, &fetch_failures)?;
    // Listening from here on: a Ctrl-C while the banner is written or the
    // waiting messages are counted stops the worker before it starts.
    let signals = stop.stop_on_signals().ok();
    announce(messenger, &args, console)?;
    let bar = if console.progress {
        Some(Bar::start(args.limit, transports).await)
    } else {
        None
    };
    let report = drive(worker, bar.as_ref(), &log, console).await;
    if let Some(task) = signals {
        task.abort();
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    flush(console, None, &log);
    summarize(console, &report)?;
    match fetch_failures.nothing_read(&report.stats) {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_names_messages_a_filter_stopped_only_when_there_are_any() {
        let mut s = WorkerStats::default();
        assert_eq!(stopped_note(&s), "");
        s.stopped_by_filter = 3;
        s.handled = 2;
        assert_eq!(stopped_note(&s), ", stopped by filter 3");
        assert_eq!(processed(&s), 5, "stopped messages count as processed");
    }

    #[test]
    fn the_rate_is_measured_over_the_recent_window() {
        let mut r = Rate::new();
        let t0 = Instant::now();
        assert_eq!(r.record(t0, 0), 0.0);
        assert_eq!(r.record(t0 + Duration::from_secs(1), 100), 100.0);
        assert_eq!(r.record(t0 + Duration::from_secs(2), 300), 150.0);
        // Ten seconds later only the recent samples count.
        let rate = r.record(t0 + Duration::from_secs(12), 1300);
        assert_eq!(rate, 100.0);
    }

    #[test]
    fn consuming_a_failure_transport_is_warned_about_once_in_one_line() {
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            failure_transport_warning(&names(&["orders"]), &["failed"], true),
            None
        );
        let one =
            failure_transport_warning(&names(&["orders", "failed"]), &["failed"], true).unwrap();
        assert_eq!(
            one,
            "warning: `failed` is a failure transport: messages that fail again go back to it \
             under a new id, due 1 s later, doubling each time; --stop-when-empty stops once \
             each has been tried; use `failed retry` to handle each failed message once"
        );
        let two =
            failure_transport_warning(&names(&["dlq", "failed", "dlq"]), &["dlq", "failed"], false)
                .unwrap();
        assert_eq!(
            two,
            "warning: `dlq`, `failed` are failure transports: messages that fail again go back \
             to them under a new id, due 1 s later, doubling each time; use `failed retry` to \
             handle each failed message once"
        );
        assert!(!two.contains('\n'));
    }

    #[test]
    fn the_failure_log_stops_after_its_limit_and_says_so() {
        let log = FailureLog::default();
        for i in 0..MAX_LINES + 10 {
            log.push(format!("line {i}"));
        }
        let lines = log.take();
        assert_eq!(lines.len(), MAX_LINES + 1);
        assert_eq!(lines.last().unwrap(), "… more failures are not shown");
        assert!(log.take().is_empty());
    }
}
