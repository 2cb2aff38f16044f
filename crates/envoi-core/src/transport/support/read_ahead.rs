//! Fetching the next batch while the caller handles this one, and handing
//! it out only while its lease is fresh.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::TransportError;

/// A fetch running in the background.
type Fetch<T> = JoinHandle<Result<Vec<T>, TransportError>>;

/// Messages fetched ahead of the next `get`: a transport whose `get` came
/// back full starts fetching the next batch in the background
/// ([`fetch_ahead`](Self::fetch_ahead)), and its next `get` hands that out
/// ([`take`](Self::take)) instead of waiting for a round trip.
///
/// What is fetched ahead is leased to this consumer like anything it
/// fetches, and the lease runs while it waits. So a batch is handed out
/// only while it is less than half a lease old: older, it comes back as
/// [`Taken::stale`] for the transport to give back (it would leave its
/// handler too little of the lease), and past its whole lease it is dropped
/// without being given back (by then the message may be another
/// consumer's, and giving it back would end that consumer's lease).
///
/// A `get` dropped while it waits for a fetch in flight puts the fetch back
/// for the next one, so nothing fetched is left leased until its lease
/// ends.
///
/// ```
/// use envoi_core::transport::support::ReadAhead;
/// use std::time::Duration;
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let ahead = ReadAhead::new(Duration::from_secs(30));
/// ahead.fetch_ahead(async { Ok(vec![1, 2, 3]) });
/// let taken = ahead.take(2).await.unwrap();
/// assert_eq!(taken.fresh, [1, 2]);
/// assert_eq!(ahead.drain().await, [3]);
/// # });
/// ```
#[derive(Debug)]
pub struct ReadAhead<T> {
    state: Mutex<State<T>>,
    lease: Duration,
}

#[derive(Debug)]
struct State<T> {
    /// The fetch in flight, and when it started.
    fetching: Option<(Fetch<T>, Instant)>,
    /// Fetched and not handed out yet.
    spare: VecDeque<T>,
    /// When the fetch that gave `spare` started.
    fetched_at: Option<Instant>,
}

impl<T> Default for State<T> {
    fn default() -> Self {
        Self {
            fetching: None,
            spare: VecDeque::new(),
            fetched_at: None,
        }
    }
}

/// What [`ReadAhead::take`] hands back.
#[derive(Debug)]
#[non_exhaustive]
pub struct Taken<T> {
    /// Fetched ahead and fresh: hand these out.
    pub fresh: Vec<T>,
    /// Fetched ahead more than half a lease ago, but within it: give these
    /// back to the transport.
    pub stale: Vec<T>,
}

impl<T: Send + 'static> ReadAhead<T> {
    /// Nothing fetched ahead yet, for messages leased for `lease`.
    pub fn new(lease: Duration) -> Self {
        Self {
            state: Mutex::new(State::default()),
            lease,
        }
    }

    fn state(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether nothing is fetched ahead or being fetched.
    pub fn is_idle(&self) -> bool {
        let state = self.state();
        state.fetching.is_none() && state.spare.is_empty()
    }

    /// Starts `fetch` in the background, unless a fetch is in flight or
    /// messages fetched before wait to be handed out.
    pub fn fetch_ahead<F>(&self, fetch: F)
    where
        F: Future<Output = Result<Vec<T>, TransportError>> + Send + 'static,
    {
        let mut state = self.state();
        if state.fetching.is_some() || !state.spare.is_empty() {
            return;
        }
        state.fetching = Some((tokio::spawn(fetch), Instant::now()));
    }

    /// Up to `want` messages fetched ahead, waiting for a fetch in flight;
    /// empty when nothing was fetched ahead. Fails when the fetch in flight
    /// failed.
    pub async fn take(&self, want: usize) -> Result<Taken<T>, TransportError> {
        let fetching = self.state().fetching.take();
        if let Some(fetching) = fetching {
            // Should this call be dropped while the fetch runs, the guard
            // puts the fetch back, so that the next call hands its
            // messages out (or `drain` gives them back).
            let mut waiting = Pending {
                ahead: self,
                fetching: Some(fetching),
            };
            let (fetched, started) = match waiting.fetching.as_mut() {
                Some((fetch, started)) => (fetch.await, *started),
                None => return Ok(Taken::empty()),
            };
            waiting.fetching = None;
            // An aborted fetch (the transport is closing) leaves nothing.
            if let Ok(fetched) = fetched {
                let fetched = fetched?;
                let mut state = self.state();
                state.spare.extend(fetched);
                state.fetched_at = Some(started);
            }
        }
        let mut state = self.state();
        let lease = self.lease;
        match state.fetched_at.map(|at| at.elapsed()) {
            Some(age) if age > lease / 2 && !state.spare.is_empty() => {
                let stale: Vec<T> = state.spare.drain(..).collect();
                Ok(Taken {
                    fresh: Vec::new(),
                    // Past its lease, a message may be someone else's by now.
                    stale: if age < lease { stale } else { Vec::new() },
                })
            }
            _ => {
                let n = want.min(state.spare.len());
                Ok(Taken {
                    fresh: state.spare.drain(..n).collect(),
                    stale: Vec::new(),
                })
            }
        }
    }

    /// Everything fetched ahead and not handed out whose lease has not run
    /// out, waiting for a fetch in flight: what a transport gives back when
    /// it closes.
    pub async fn drain(&self) -> Vec<T> {
        let state = std::mem::take(&mut *self.state());
        fresh(state, self.lease).await
    }

    /// [`drain`](Self::drain) for a transport being dropped: takes what is
    /// fetched ahead now and returns a future that yields what is still
    /// within its lease (to spawn, giving it back), or `None` when nothing
    /// was fetched ahead.
    pub fn drain_later(&mut self) -> Option<impl Future<Output = Vec<T>> + Send + 'static> {
        let state = std::mem::take(self.state.get_mut().unwrap_or_else(PoisonError::into_inner));
        if state.fetching.is_none() && state.spare.is_empty() {
            return None;
        }
        Some(fresh(state, self.lease))
    }

    /// Stops a fetch in flight and forgets what was fetched ahead (a
    /// transport whose messages are gone, purged or deleted, say).
    pub fn abort(&self) {
        let state = std::mem::take(&mut *self.state());
        if let Some((fetch, _)) = state.fetching {
            fetch.abort();
        }
    }
}

impl<T> Taken<T> {
    fn empty() -> Self {
        Self {
            fresh: Vec::new(),
            stale: Vec::new(),
        }
    }
}

/// What `state` holds, and what its fetch in flight brings, that is still
/// within `lease`.
async fn fresh<T>(state: State<T>, lease: Duration) -> Vec<T> {
    let mut out: Vec<T> = match state.fetched_at {
        Some(at) if at.elapsed() >= lease => Vec::new(),
        _ => state.spare.into(),
    };
    if let Some((fetch, started)) = state.fetching {
        if let Ok(Ok(fetched)) = fetch.await {
            if started.elapsed() < lease {
                out.extend(fetched);
            }
        }
    }
    out
}

/// A fetch a `take` is waiting for: put back when that `take` is dropped
/// before it finished (joined with a fetch another `take` started
/// meanwhile, if any).
struct Pending<'a, T: Send + 'static> {
    ahead: &'a ReadAhead<T>,
    fetching: Option<(Fetch<T>, Instant)>,
}

impl<T: Send + 'static> Drop for Pending<'_, T> {
    fn drop(&mut self) {
        let Some((mine, started)) = self.fetching.take() else {
            return;
        };
        let mut state = self.ahead.state();
        match state.fetching.take() {
            None => state.fetching = Some((mine, started)),
            Some((theirs, at)) => {
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    state.fetching = Some((theirs, at));
                    return;
                };
                let joined = runtime.spawn(async move {
                    let mut all = Vec::new();
                    for fetch in [mine, theirs] {
                        if let Ok(Ok(fetched)) = fetch.await {
                            all.extend(fetched);
                        }
                    }
                    Ok(all)
                });
                state.fetching = Some((joined, started.min(at)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_batch_older_than_half_a_lease_is_stale_and_past_the_lease_dropped() {
        let ahead = ReadAhead::new(Duration::from_secs(10));
        ahead.fetch_ahead(async { Ok(vec![1, 2]) });
        tokio::time::sleep(Duration::from_secs(6)).await;
        let taken = ahead.take(5).await.unwrap();
        assert!(taken.fresh.is_empty());
        assert_eq!(taken.stale, [1, 2]);

        ahead.fetch_ahead(async { Ok(vec![3]) });
        tokio::time::sleep(Duration::from_secs(11)).await;
        let taken = ahead.take(5).await.unwrap();
        assert!(taken.fresh.is_empty() && taken.stale.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_fetch_is_the_next_take_s_error_and_leaves_nothing() {
        let ahead: ReadAhead<u8> = ReadAhead::new(Duration::from_secs(10));
        ahead.fetch_ahead(async { Err(TransportError::Closed) });
        assert!(matches!(ahead.take(1).await, Err(TransportError::Closed)));
        assert!(ahead.is_idle());
    }

    #[tokio::test(start_paused = true)]
    async fn a_take_dropped_while_it_waits_puts_the_fetch_back() {
        let ahead = ReadAhead::new(Duration::from_secs(10));
        ahead.fetch_ahead(async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok(vec![7])
        });
        let dropped = tokio::time::timeout(Duration::from_millis(10), ahead.take(1)).await;
        assert!(dropped.is_err(), "the fetch was still running");
        assert!(!ahead.is_idle(), "put back");
        assert_eq!(ahead.take(1).await.unwrap().fresh, [7]);
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_fetched_ahead_while_a_batch_waits() {
        let ahead = ReadAhead::new(Duration::from_secs(10));
        ahead.fetch_ahead(async { Ok(vec![1]) });
        ahead.take(0).await.unwrap();
        ahead.fetch_ahead(async { Ok(vec![2]) });
        assert_eq!(ahead.drain().await, [1]);
        let mut ahead = ahead;
        assert!(ahead.drain_later().is_none());
    }
}
