//! The messages a worker handles at once, polled on its own task.
//!
//! A set of its own rather than `futures-util`'s `FuturesUnordered`, for
//! one measured reason: `FuturesUnordered` allocates a task holding the
//! future for every future pushed (one allocation per message, of the
//! size of the worker's handling future, over a kilobyte;
//! `tests/in_flight_cost.rs` measures it), where this set keeps a slot per
//! message in flight and reuses it: starting a message allocates nothing,
//! which `memory_e2e` counts (`allocs=` per message).

use std::future::{poll_fn, Future};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

use tokio::time::Instant;

use super::events::panic_message;
use super::fetch::MessageId;
use super::settle::Done;
use crate::envelope::Envelope;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};

/// A message being handled.
pub(super) struct TaskInfo {
    pub(super) receiver: usize,
    pub(super) id: MessageId,
    pub(super) since: Instant,
    /// The envelope, to park it if its handler panics.
    pub(super) envelope: Option<Envelope>,
}

pub(super) enum Finished {
    Done(Done, MessageId),
    Panicked {
        receiver: usize,
        id: MessageId,
        envelope: Option<Envelope>,
        message: String,
    },
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The slots woken since they were last polled, and the waker of the task
/// polling the in-flight set.
#[derive(Default)]
struct ReadyQueue {
    inner: Mutex<ReadyInner>,
}

#[derive(Default)]
struct ReadyInner {
    slots: Vec<usize>,
    parent: Option<Waker>,
}

/// The waker of one slot: queues the slot and wakes the worker's task.
struct SlotWaker {
    slot: usize,
    queued: AtomicBool,
    queue: Arc<ReadyQueue>,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let parent = {
            let mut inner = lock(&self.queue.inner);
            inner.slots.push(self.slot);
            inner.parent.clone()
        };
        if let Some(parent) = parent {
            parent.wake();
        }
    }
}

/// Room for one message being handled. Its future lives in a box made once
/// and reused, so starting a message allocates nothing.
struct Slot<F> {
    future: Pin<Box<Option<F>>>,
    waker: Waker,
    wake: Arc<SlotWaker>,
    task: Option<TaskInfo>,
}

/// The messages being handled, polled on the worker's task: each is polled
/// once when it starts (most handlers finish then), and afterwards only
/// when its waker says it can make progress.
pub(super) struct InFlight<F> {
    slots: Vec<Slot<F>>,
    free: Vec<usize>,
    len: usize,
    queue: Arc<ReadyQueue>,
    /// Woken slots taken from the queue and not polled yet.
    polling: VecDeque<usize>,
}

impl<F: Future<Output = Done>> InFlight<F> {
    pub(super) fn new() -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
            queue: Arc::new(ReadyQueue::default()),
            polling: VecDeque::new(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The messages being handled.
    pub(super) fn tasks(&self) -> impl Iterator<Item = &TaskInfo> + '_ {
        self.slots.iter().filter_map(|s| s.task.as_ref())
    }

    /// Starts `future` and polls it once; returns what it gave if it
    /// finished at once.
    pub(super) fn start(&mut self, task: TaskInfo, future: F) -> Option<Finished> {
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                let wake = Arc::new(SlotWaker {
                    slot: self.slots.len(),
                    queued: AtomicBool::new(false),
                    queue: self.queue.clone(),
                });
                self.slots.push(Slot {
                    future: Box::pin(None),
                    waker: Waker::from(wake.clone()),
                    wake,
                    task: None,
                });
                self.slots.len() - 1
            }
        };
        let slot = &mut self.slots[i];
        slot.future.set(Some(future));
        slot.task = Some(task);
        self.len += 1;
        self.poll_slot(i)
    }

    /// Polls slot `i` with its own waker; frees it when its future
    /// finished (or panicked).
    fn poll_slot(&mut self, i: usize) -> Option<Finished> {
        let slot = &mut self.slots[i];
        slot.task.as_ref()?;
        let future = slot.future.as_mut().as_pin_mut()?;
        let mut cx = Context::from_waker(&slot.waker);
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| future.poll(&mut cx)));
        let finished = match polled {
            Ok(Poll::Pending) => return None,
            Ok(Poll::Ready(done)) => Finished::Done(done, slot.task.take()?.id),
            Err(panic) => {
                let task = slot.task.take()?;
                Finished::Panicked {
                    receiver: task.receiver,
                    id: task.id,
                    envelope: task.envelope,
                    message: panic_message(&*panic),
                }
            }
        };
        slot.future.set(None);
        self.free.push(i);
        self.len -= 1;
        Some(finished)
    }

    /// Polls the woken messages until one finishes.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Finished> {
        if self.len == 0 {
            return Poll::Pending;
        }
        self.take_woken(Some(cx.waker()));
        // A future that wakes itself at once would keep this loop going:
        // after as many polls as there are messages, let the runtime run
        // others first.
        let mut polls = self.len + 1;
        while let Some(i) = self.polling.pop_front() {
            self.slots[i].wake.queued.store(false, Ordering::Release);
            if let Some(finished) = self.poll_slot(i) {
                return Poll::Ready(finished);
            }
            polls -= 1;
            if polls == 0 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if self.polling.is_empty() {
                self.take_woken(None);
            }
        }
        Poll::Pending
    }

    /// Moves the woken slots to `polling`, registering `parent` to be woken
    /// next time.
    fn take_woken(&mut self, parent: Option<&Waker>) {
        let mut inner = lock(&self.queue.inner);
        if let Some(parent) = parent {
            if !inner.parent.as_ref().is_some_and(|w| w.will_wake(parent)) {
                inner.parent = Some(parent.clone());
            }
        }
        self.polling.extend(inner.slots.drain(..));
    }

    /// The next message to finish; pending forever when there is none.
    pub(super) fn next(&mut self) -> impl Future<Output = Finished> + '_ {
        poll_fn(move |cx| self.poll_next(cx))
    }

    /// A message that finished, without waiting for one.
    pub(super) fn try_next(&mut self) -> impl Future<Output = Option<Finished>> + '_ {
        poll_fn(move |cx| {
            Poll::Ready(match self.poll_next(cx) {
                Poll::Ready(finished) => Some(finished),
                Poll::Pending => None,
            })
        })
    }

    /// Drops every message being handled; returns them.
    pub(super) fn abandon(&mut self) -> Vec<TaskInfo> {
        let mut out = Vec::with_capacity(self.len);
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(task) = slot.task.take() {
                slot.future.set(None);
                self.free.push(i);
                out.push(task);
            }
        }
        self.len = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::settle::Action;
    use super::*;
    use crate::transport::LocalId;

    fn task(key: u64) -> TaskInfo {
        TaskInfo {
            receiver: 0,
            id: MessageId::Local(LocalId::new(key)),
            since: Instant::now(),
            envelope: None,
        }
    }

    fn done() -> Done {
        Done::new(0, Action::Ack)
    }

    fn finished_key(finished: Finished) -> String {
        match finished {
            Finished::Done(_, id) => id.text().into_owned(),
            Finished::Panicked { id, message, .. } => {
                format!("{} panicked: {message}", id.text())
            }
        }
    }

    #[tokio::test]
    async fn messages_that_wait_are_polled_again_when_woken_and_their_slots_reused() {
        let mut in_flight = InFlight::new();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let mut rx = Some(rx);
        let mut make = |wait: bool| {
            let rx = if wait { rx.take() } else { None };
            async move {
                if let Some(rx) = rx {
                    let _ = rx.await;
                }
                tokio::task::yield_now().await;
                done()
            }
        };
        assert!(in_flight.start(task(1), make(true)).is_none());
        assert!(in_flight.start(task(2), make(false)).is_none());
        assert_eq!(in_flight.len(), 2);
        // Only the one that can make progress finishes.
        assert_eq!(finished_key(in_flight.next().await), "2");
        assert!(in_flight.try_next().await.is_none());
        tx.send(()).unwrap();
        assert_eq!(finished_key(in_flight.next().await), "1");
        assert!(in_flight.is_empty());
        // A finished message's slot takes the next one.
        assert!(in_flight.start(task(3), make(false)).is_none());
        assert_eq!(in_flight.slots.len(), 2);
        assert_eq!(finished_key(in_flight.next().await), "3");
    }

    #[tokio::test]
    async fn a_message_that_always_wakes_itself_does_not_keep_the_worker_busy() {
        let mut in_flight = InFlight::new();
        let spin = poll_fn(|cx| {
            cx.waker().wake_by_ref();
            Poll::<Done>::Pending
        });
        assert!(in_flight.start(task(1), spin).is_none());
        // Polled a bounded number of times, then handed back to the runtime.
        assert!(in_flight.try_next().await.is_none());
        assert_eq!(in_flight.abandon().len(), 1);
        assert!(in_flight.is_empty());
    }

    #[tokio::test]
    async fn a_panicking_message_is_reported_with_its_id() {
        let mut in_flight = InFlight::new();
        let boom = async {
            tokio::task::yield_now().await;
            panic!("boom");
        };
        assert!(in_flight.start(task(7), boom).is_none());
        assert_eq!(finished_key(in_flight.next().await), "7 panicked: boom");
        assert!(in_flight.is_empty());
    }
}
