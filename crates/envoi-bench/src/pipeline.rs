//! The consuming loop of the baselines, written once: what envoi's worker
//! does with a transport that reads ahead. When a batch arrives, the next
//! fetch starts at once; the batch is handled while it runs, and its
//! acknowledgement (a delete, an `XACK`, confirmed acks) goes out while
//! the fetch after it runs: one fetch and one acknowledgement in flight at
//! a time, as the worker has.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;

/// Empty fetches in a row after which a baseline is taken to have lost
/// messages (every message is stored before consuming starts).
const DRY_FETCHES: u32 = 50;

/// What a consuming loop did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Consumed {
    /// Messages fetched and handled.
    pub(crate) messages: u64,
    /// What the acknowledgements reported done (rows deleted, entries
    /// acknowledged, messages confirmed).
    pub(crate) settled: u64,
}

/// Fetches batches with `fetch` until `n` messages were handled with
/// `handle` (which gives the key to acknowledge each by) and acknowledges
/// each batch with `ack` (which answers how many it settled). The next
/// fetch runs while a batch is handled, and a batch's acknowledgement while
/// the next batch is fetched.
pub(crate) async fn consume<M, K, Fetch, FetchFut, Ack, AckFut>(
    n: u64,
    mut fetch: Fetch,
    mut handle: impl FnMut(M) -> Result<K, String>,
    mut ack: Ack,
) -> Result<Consumed, String>
where
    M: Send + 'static,
    Fetch: FnMut() -> FetchFut,
    FetchFut: Future<Output = Result<Vec<M>, String>> + Send + 'static,
    Ack: FnMut(Vec<K>) -> AckFut,
    AckFut: Future<Output = Result<u64, String>> + Send + 'static,
{
    let mut done = Consumed {
        messages: 0,
        settled: 0,
    };
    let mut ahead: Option<JoinHandle<Result<Vec<M>, String>>> = None;
    let mut acking: Option<JoinHandle<Result<u64, String>>> = None;
    let mut dry = 0;
    while done.messages < n {
        let batch = match ahead.take() {
            Some(fetching) => fetching.await.map_err(|e| e.to_string())??,
            None => fetch().await?,
        };
        if let Some(acked) = acking.take() {
            done.settled += acked.await.map_err(|e| e.to_string())??;
        }
        if batch.is_empty() {
            dry += 1;
            if dry == DRY_FETCHES {
                return Err(format!("ran dry after {} of {n}", done.messages));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        dry = 0;
        done.messages += batch.len() as u64;
        if done.messages < n {
            ahead = Some(tokio::spawn(fetch()));
        }
        let keys = batch
            .into_iter()
            .map(&mut handle)
            .collect::<Result<Vec<K>, String>>()?;
        acking = Some(tokio::spawn(ack(keys)));
    }
    if let Some(acked) = acking {
        done.settled += acked.await.map_err(|e| e.to_string())??;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    #[tokio::test]
    async fn consume_handles_every_batch_and_sums_what_the_acks_settled() {
        let next = Arc::new(AtomicU64::new(0));
        let acked = Arc::new(Mutex::new(Vec::new()));
        let (a, f) = (acked.clone(), next.clone());
        let done = consume(
            10,
            move || {
                let next = f.clone();
                async move {
                    let start = next.fetch_add(4, Ordering::SeqCst);
                    Ok((start..(start + 4).min(10)).collect::<Vec<u64>>())
                }
            },
            |m| Ok(m * 10),
            move |keys: Vec<u64>| {
                let acked = a.clone();
                async move {
                    let n = keys.len() as u64;
                    acked.lock().unwrap().extend(keys);
                    Ok(n)
                }
            },
        )
        .await
        .unwrap();
        assert_eq!(
            done,
            Consumed {
                messages: 10,
                settled: 10
            }
        );
        let mut keys = acked.lock().unwrap().clone();
        keys.sort_unstable();
        assert_eq!(keys, (0..10).map(|m| m * 10).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn consume_fails_when_the_backend_runs_dry_before_n() {
        let err = consume(
            3,
            || async { Ok(Vec::<u64>::new()) },
            Ok,
            |keys: Vec<u64>| async move { Ok(keys.len() as u64) },
        )
        .await
        .unwrap_err();
        assert_eq!(err, "ran dry after 0 of 3");
    }

    #[tokio::test]
    async fn a_failed_handle_or_ack_fails_the_loop() {
        let err = consume(
            2,
            || async { Ok(vec![1u64, 2]) },
            |m| if m == 2 { Err("bad".into()) } else { Ok(m) },
            |keys: Vec<u64>| async move { Ok(keys.len() as u64) },
        )
        .await
        .unwrap_err();
        assert_eq!(err, "bad");
        let err = consume(
            2,
            || async { Ok(vec![1u64, 2]) },
            Ok,
            |_: Vec<u64>| async { Err::<u64, _>("ack refused".to_string()) },
        )
        .await
        .unwrap_err();
        assert_eq!(err, "ack refused");
    }
}
