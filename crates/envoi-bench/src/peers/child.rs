//! Running one side of a peer scenario as a child process: its outcome
//! line, and the peak resident set of the process and of every process it
//! starts, measured the same way for both sides.
//!
//! A side prints `handled=<messages> seconds=<elapsed> peak_rss_kb=<kib>`
//! on stdout (other lines are ignored; `peak_rss_kb` is the side's own
//! process's peak resident set, `VmHWM` or `getrusage`'s `ru_maxrss`, read
//! just before it exits); its stderr is passed through. While it runs, a
//! sampler walks its process tree every [`SAMPLE_EVERY`] through
//! `/proc/<pid>/task/<tid>/children` and keeps, per process, the largest
//! `VmHWM` it read (the kernel's own peak of that process's resident set).
//! The side's footprint is the sum over its processes of each one's peak.
//! Processes the sampler saw only once are left out (the main process
//! aside): they are helpers that live for less than two intervals, such as
//! the `sh`, `stty` and `grep` Symfony's console runs to size the terminal
//! or the scripts of a pyenv `python3` shim, not part of the queue. The
//! sampler can also miss the last growth of a process that exits; the
//! side's own report covers its main process, and the processes it starts
//! live for the whole run.

use std::collections::HashMap;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often the sampler reads the process tree.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// What one run of a side did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Run {
    pub(super) handled: u64,
    pub(super) seconds: f64,
    /// The sum over the side's processes of each one's peak RSS, in KiB.
    pub(super) peak_rss_kb: u64,
    /// How many processes the side ran (itself included).
    pub(super) processes: usize,
}

impl Run {
    /// Messages per second.
    pub(super) fn rate(&self) -> f64 {
        self.handled as f64 / self.seconds
    }
}

/// The line a side prints when it is done, with this process's peak RSS.
pub(super) fn outcome_line(handled: u64, seconds: f64) -> String {
    let peak = vm_hwm_kb(std::process::id()).unwrap_or(0);
    format!("handled={handled} seconds={seconds:.6} peak_rss_kb={peak}")
}

/// What a side reported: messages handled, seconds, and its own peak RSS
/// in KiB when it gave one.
type Outcome = (u64, f64, Option<u64>);

/// Reads `handled=<n> seconds=<s> [peak_rss_kb=<kib>]` from the last line
/// of `stdout` that has the first two.
pub(super) fn parse_outcome(stdout: &str) -> Result<Outcome, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.contains("handled=") && l.contains("seconds="))
        .ok_or_else(|| format!("no `handled=… seconds=…` line in {stdout:?}"))?;
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .ok_or_else(|| format!("no {key} in {line:?}"))
    };
    let handled = field("handled=")?
        .parse::<u64>()
        .map_err(|e| format!("bad handled= in {line:?}: {e}"))?;
    let seconds = field("seconds=")?
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .ok_or_else(|| format!("bad seconds= in {line:?}"))?;
    let peak = match field("peak_rss_kb=") {
        Ok(kb) => Some(
            kb.parse::<u64>()
                .map_err(|e| format!("bad peak_rss_kb= in {line:?}: {e}"))?,
        ),
        Err(_) => None,
    };
    Ok((handled, seconds, peak))
}

/// Runs `cmd`, one side moving `n` messages, and checks it handled exactly
/// `n`; `who` names the side in errors.
pub(super) fn run_side(who: &str, mut cmd: Command, n: u64) -> Result<Run, String> {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start the {who} side ({shown}): {e}"))?;
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (root, done) = (child.id(), done.clone());
        std::thread::spawn(move || sample_until(root, &done))
    };
    let mut stdout = String::new();
    let read = child
        .stdout
        .take()
        .map(|mut out| out.read_to_string(&mut stdout));
    let status = child.wait().map_err(|e| e.to_string());
    done.store(true, Ordering::Relaxed);
    let mut peaks = sampler.join().unwrap_or_default();
    let status = status?;
    if let Some(Err(e)) = read {
        return Err(format!("cannot read the {who} side's output: {e}"));
    }
    if !status.success() {
        return Err(format!("the {who} side ({shown}) exited with {status}"));
    }
    let (handled, seconds, own_peak) =
        parse_outcome(&stdout).map_err(|e| format!("{who} side: {e}"))?;
    if let Some(kb) = own_peak {
        let root = peaks.entry(child.id()).or_insert(0);
        *root = kb.max(*root);
    }
    if handled != n {
        return Err(format!("the {who} side handled {handled} of {n} messages"));
    }
    let run = Run {
        handled,
        seconds,
        peak_rss_kb: peaks.values().sum(),
        processes: peaks.len(),
    };
    eprintln!(
        "  {who}: {n} in {seconds:.3}s = {:.0} msg/s, peak RSS {:.1} MiB over {} process(es)",
        run.rate(),
        run.peak_rss_kb as f64 / 1024.0,
        run.processes
    );
    Ok(run)
}

/// Samples the tree under `root` until `done`, returning the largest
/// `VmHWM` in KiB of `root` and of each process seen in two samples or
/// more.
fn sample_until(root: u32, done: &AtomicBool) -> HashMap<u32, u64> {
    // pid -> (largest VmHWM, samples that saw it)
    let mut seen: HashMap<u32, (u64, u32)> = HashMap::new();
    loop {
        let finished = done.load(Ordering::Relaxed);
        for pid in tree(root) {
            if let Some(kb) = vm_hwm_kb(pid) {
                let (peak, samples) = seen.entry(pid).or_insert((0, 0));
                *peak = kb.max(*peak);
                *samples += 1;
            }
        }
        if finished {
            return lasting(seen, root);
        }
        std::thread::sleep(SAMPLE_EVERY);
    }
}

/// The peaks of `root` and of the processes seen in two samples or more.
fn lasting(seen: HashMap<u32, (u64, u32)>, root: u32) -> HashMap<u32, u64> {
    seen.into_iter()
        .filter(|&(pid, (_, samples))| pid == root || samples >= 2)
        .map(|(pid, (peak, _))| (pid, peak))
        .collect()
}

/// `root` and its descendants, as far as `/proc` shows them now.
fn tree(root: u32) -> Vec<u32> {
    let mut all = vec![root];
    let mut i = 0;
    while i < all.len() {
        let pid = all[i];
        all.extend(children(pid));
        i += 1;
    }
    all
}

fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// The `VmHWM` of `pid` in KiB; `None` once it has exited.
fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_hwm(&status)
}

fn parse_vm_hwm(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outcome_line_reads_back_and_noise_around_it_is_ignored() {
        let out = format!("starting\n{}\n", outcome_line(20_000, 1.25));
        let (handled, seconds, peak) = parse_outcome(&out).unwrap();
        assert_eq!((handled, seconds), (20_000, 1.25));
        assert!(peak.is_some_and(|kb| kb > 0), "this process's own peak");
        assert_eq!(
            parse_outcome("handled=3 seconds=0.5"),
            Ok((3, 0.5, None)),
            "the peak is optional"
        );
    }

    #[test]
    fn an_outcome_without_a_count_or_a_positive_time_is_refused() {
        assert!(parse_outcome("").is_err());
        assert!(parse_outcome("handled=ten seconds=1").is_err());
        assert!(parse_outcome("handled=10 seconds=0").is_err());
        assert!(parse_outcome("handled=10 seconds=NaN").is_err());
        assert!(parse_outcome("handled=10 seconds=1 peak_rss_kb=lots").is_err());
    }

    #[test]
    fn vm_hwm_is_read_in_kib_from_a_status_file() {
        let status = "Name:\tx\nVmPeak:\t  9000 kB\nVmHWM:\t    4321 kB\nVmRSS:\t 100 kB\n";
        assert_eq!(parse_vm_hwm(status), Some(4321));
        assert_eq!(parse_vm_hwm("Name:\tzombie\n"), None);
    }

    #[test]
    fn a_side_counts_the_peak_rss_of_its_children_too() {
        // A shell that starts two children and prints an outcome line.
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "sleep 0.3 & sleep 0.3 & wait; echo handled=3 seconds=0.5 peak_rss_kb=100000",
        ]);
        let run = run_side("test", cmd, 3).unwrap();
        assert_eq!((run.handled, run.seconds), (3, 0.5));
        assert_eq!(run.rate(), 6.0);
        assert_eq!(run.processes, 3, "the shell and its two lasting children");
        assert!(
            run.peak_rss_kb > 100_000,
            "the shell's own report plus its children's sampled peaks"
        );
    }

    #[test]
    fn a_helper_seen_in_one_sample_only_is_left_out_but_the_main_process_never_is() {
        let seen = HashMap::from([(1, (500, 1)), (2, (300, 5)), (3, (200, 1))]);
        let kept = lasting(seen, 1);
        assert_eq!(kept, HashMap::from([(1, 500), (2, 300)]));
    }

    #[test]
    fn a_side_that_handles_too_few_or_fails_is_an_error() {
        let mut short = Command::new("sh");
        short.args(["-c", "echo handled=2 seconds=0.5"]);
        assert!(run_side("test", short, 3).unwrap_err().contains("2 of 3"));
        let mut failing = Command::new("sh");
        failing.args(["-c", "exit 3"]);
        assert!(run_side("test", failing, 3).is_err());
    }
}
