//! Stopping a worker: the [`StopHandle`], signals, and why a worker
//! stopped.

use std::fmt;
use std::sync::Arc;

use tokio::sync::watch;

/// Why a worker stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// A [`StopHandle`] asked it to (a signal, for instance).
    Stopped,
    /// It processed as many messages as its message limit, whatever
    /// became of them (handled, retried or failed).
    MessageLimit,
    /// It ran for its time limit.
    TimeLimit,
    /// Its resident memory exceeded the memory limit.
    MemoryLimit,
    /// As many messages failed as its failure limit.
    FailureLimit,
    /// Every receiver was empty ([`WorkerBuilder::stop_when_empty`](crate::worker::WorkerBuilder::stop_when_empty)).
    Empty,
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StopReason::Stopped => "stop requested",
            StopReason::MessageLimit => "message limit reached",
            StopReason::TimeLimit => "time limit reached",
            StopReason::MemoryLimit => "memory limit exceeded",
            StopReason::FailureLimit => "failure limit reached",
            StopReason::Empty => "no more messages",
        })
    }
}

/// Stops one or more workers; cheap to clone.
///
/// [`stop`](Self::stop) is graceful: a worker stops fetching and lets the
/// handlers in flight finish within its
/// [grace period](crate::worker::WorkerBuilder::grace_period). [`stop_now`](Self::stop_now)
/// does not wait: the handlers in flight are dropped and their messages
/// given back, to be delivered again.
///
/// ```
/// use envoi_core::worker::StopHandle;
///
/// let stop = StopHandle::new();
/// let same = stop.clone();
/// same.stop();
/// assert!(stop.is_stopped());
/// assert!(!stop.is_stopped_now());
/// same.stop_now();
/// assert!(stop.is_stopped_now());
/// ```
#[derive(Clone)]
pub struct StopHandle {
    pub(super) tx: Arc<watch::Sender<u8>>,
}

/// [`StopHandle`] levels: asked to stop gracefully, then at once.
const STOP: u8 = 1;
const STOP_NOW: u8 = 2;

impl Default for StopHandle {
    fn default() -> Self {
        Self {
            tx: Arc::new(watch::channel(0).0),
        }
    }
}

impl fmt::Debug for StopHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StopHandle")
            .field("stopped", &self.is_stopped())
            .field("now", &self.is_stopped_now())
            .finish()
    }
}

impl StopHandle {
    /// A handle that has not been used.
    pub fn new() -> Self {
        Self::default()
    }

    fn raise(&self, level: u8) {
        self.tx.send_if_modified(|current| {
            let raised = *current < level;
            *current = (*current).max(level);
            raised
        });
    }

    /// Asks every worker using this handle to stop gracefully.
    pub fn stop(&self) {
        self.raise(STOP);
    }

    /// Asks every worker using this handle to stop at once, even during the
    /// grace period of a graceful stop: the handlers in flight are dropped
    /// and their messages given back to their transports.
    pub fn stop_now(&self) {
        self.raise(STOP_NOW);
    }

    /// Whether [`stop`](Self::stop) or [`stop_now`](Self::stop_now) was
    /// called.
    pub fn is_stopped(&self) -> bool {
        *self.tx.borrow() >= STOP
    }

    /// Whether [`stop_now`](Self::stop_now) was called.
    pub fn is_stopped_now(&self) -> bool {
        *self.tx.borrow() >= STOP_NOW
    }

    /// Resolves once [`stop`](Self::stop) (or
    /// [`stop_now`](Self::stop_now)) is called.
    pub async fn stopped(&self) {
        self.reached(STOP).await;
    }

    /// Resolves once [`stop_now`](Self::stop_now) is called.
    pub(super) async fn stopped_now(&self) {
        self.reached(STOP_NOW).await;
    }

    /// Resolves once the handle is at `level` or above.
    async fn reached(&self, level: u8) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|current| *current >= level).await;
    }

    /// Spawns a task that calls [`stop`](Self::stop) on SIGINT (Ctrl-C) or,
    /// on Unix, SIGTERM, and [`stop_now`](Self::stop_now) on a second one.
    /// Must be called inside a tokio runtime; fails when the signal
    /// handlers cannot be installed.
    pub fn stop_on_signals(&self) -> std::io::Result<tokio::task::JoinHandle<()>> {
        #[cfg(unix)]
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let handle = self.clone();
        Ok(tokio::spawn(async move {
            for level in [STOP, STOP_NOW] {
                #[cfg(unix)]
                tokio::select! {
                    r = tokio::signal::ctrl_c() => { if r.is_err() { term.recv().await; } }
                    _ = term.recv() => {}
                }
                #[cfg(not(unix))]
                if tokio::signal::ctrl_c().await.is_err() {
                    return;
                }
                handle.raise(level);
            }
        }))
    }
}

/// The resident set size of this process, in bytes (Linux only).
pub(super) fn resident_memory() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stop_reason_reads_as_a_reason() {
        // Shown as "Stopped (<reason>)": no reason may just repeat the verb.
        let reasons = [
            StopReason::Stopped,
            StopReason::MessageLimit,
            StopReason::TimeLimit,
            StopReason::MemoryLimit,
            StopReason::FailureLimit,
            StopReason::Empty,
        ];
        for reason in reasons {
            let text = reason.to_string();
            assert!(text.contains(' ') && text != "stopped", "{text}");
        }
    }

    #[test]
    fn resident_memory_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(resident_memory().is_some_and(|b| b > 0));
        }
    }
}
