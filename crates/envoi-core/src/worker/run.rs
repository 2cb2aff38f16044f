//! The worker's loop.

use std::collections::{HashSet, VecDeque};
use std::future::{poll_fn, Future};
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use super::acks::Acks;
use super::builder::Options;
use super::events::{WorkerEvent, WorkerReport};
use super::fetch::{poll_ahead, Ahead, Held, MessageId};
use super::handle::{Ctx, Work};
use super::in_flight::{Finished, InFlight};
use super::rate::Bucket;
use super::settle::{Action, Done};
use super::stop::{resident_memory, StopHandle, StopReason};
use crate::envelope::Envelope;
use crate::far;
use crate::pipeline::context::StopSignal;
use crate::BoxFuture;

/// Makes the future handling a started message.
pub(super) type Start<'a, F> = fn(&'a Ctx, usize, MessageId, Work) -> F;

/// The state of one [`Worker::run`].
pub(super) struct Run<'a, F> {
    pub(super) ctx: &'a Ctx,
    pub(super) start: Start<'a, F>,
    pub(super) options: Options,
    pub(super) stop: StopHandle,
    /// Raised when the worker begins to stop, for the handlers' contexts
    /// ([`Context::cancelled`](crate::pipeline::context::Context::cancelled)).
    pub(super) stopping: StopSignal,
    pub(super) buffer: VecDeque<Held>,
    pub(super) in_flight: InFlight<F>,
    pub(super) acks: Vec<Acks>,
    /// Lists to record acknowledgements in while the others are sent.
    pub(super) spare_acks: Vec<Acks>,
    pub(super) rejects: Vec<(usize, MessageId)>,
    pub(super) releases: Vec<(usize, MessageId)>,
    pub(super) panicked: Vec<(usize, MessageId, Option<Envelope>, String)>,
    pub(super) buckets: Vec<Option<Bucket>>,
    /// The next batch, asked for while the current one is handled.
    pub(super) ahead: Option<Ahead<'a>>,
    pub(super) processed: u64,
    pub(super) started: Instant,
    /// Per receiver, no fetching from it before this: parking one of its
    /// messages failed (see [`Ctx::park_backoff`]).
    pub(super) fetch_after: Vec<Option<Instant>>,
    /// Per receiver, the ids of messages this run parked back into it (a
    /// failure transport being consumed) and has not fetched again: they
    /// do not count as waiting work for [`WorkerBuilder::stop_when_empty`]
    /// (and are kept only with that option).
    pub(super) again: Vec<HashSet<String>>,
    /// How often leases are extended; `None` for never.
    pub(super) keepalive_every: Option<Duration>,
    /// Ticks every `keepalive_every` (never without it).
    pub(super) ticker: tokio::time::Interval,
    /// A keepalive tick came since the acknowledgements were last sent:
    /// those waiting go now, as no keepalive extends their leases.
    pub(super) settle: bool,
}

/// Resolves when any of `futures` does.
/// What interrupts a worker's waits: a stop, and its time limit.
pub(super) struct Interrupts {
    /// Changes when a stop is asked for.
    stopped: tokio::sync::watch::Receiver<u8>,
    /// The end of the time limit.
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// Whether there is a time limit.
    timed: bool,
}

async fn any(mut futures: Vec<BoxFuture<'_, ()>>) {
    poll_fn(|cx| {
        for f in &mut futures {
            if f.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    })
    .await
}

impl<'a, F: Future<Output = Done> + 'a> Run<'a, F> {
    pub(super) fn new(
        ctx: &'a Ctx,
        options: Options,
        stop: StopHandle,
        stopping: StopSignal,
        start: Start<'a, F>,
    ) -> Self {
        let now = Instant::now();
        let keepalive_every = options.keepalive_interval.filter(|d| !d.is_zero());
        let mut ticker = tokio::time::interval_at(
            now + keepalive_every.unwrap_or(far::FAR),
            keepalive_every.unwrap_or(far::FAR),
        );
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self {
            ctx,
            start,
            buckets: ctx
                .receivers
                .iter()
                .map(|r| r.rate.map(|l| Bucket::new(l, now)))
                .collect(),
            acks: ctx.receivers.iter().map(|_| Acks::default()).collect(),
            spare_acks: ctx.receivers.iter().map(|_| Acks::default()).collect(),
            options,
            stop,
            stopping,
            buffer: VecDeque::new(),
            ahead: None,
            in_flight: InFlight::new(),
            rejects: Vec::new(),
            releases: Vec::new(),
            panicked: Vec::new(),
            processed: 0,
            started: now,
            fetch_after: ctx.receivers.iter().map(|_| None).collect(),
            again: ctx.receivers.iter().map(|_| HashSet::new()).collect(),
            keepalive_every,
            ticker,
            settle: false,
        }
    }

    /// Starts handling `held`; records it at once if it finished.
    pub(super) fn start(&mut self, held: Held) {
        let ctx = self.ctx;
        let again = &mut self.again[held.receiver];
        if !again.is_empty() {
            again.remove(&*held.id.text());
        }
        let (task, work) = ctx.begin(held);
        let future = (self.start)(ctx, task.receiver, task.id.clone(), work);
        if let Some(finished) = self.in_flight.start(task, future) {
            self.record(finished);
        }
    }

    pub(super) fn record(&mut self, finished: Finished) {
        match finished {
            Finished::Done(done, id) => {
                self.processed += 1;
                // Only a worker that stops when empty needs them; one that
                // runs on would keep ids of messages others may delete.
                if let (Some(again), Action::Ack, true) =
                    (done.again, done.action, self.options.stop_when_empty)
                {
                    self.again[done.receiver].insert(again);
                }
                match done.action {
                    Action::Ack => self.acks[done.receiver].push(id),
                    Action::Reject => self.rejects.push((done.receiver, id)),
                    Action::Release => self.releases.push((done.receiver, id)),
                }
            }
            Finished::Panicked {
                receiver,
                id,
                envelope,
                message,
            } => self.panicked.push((receiver, id, envelope, message)),
        }
    }

    /// When fetching from `receiver` pauses after a failed park, and it is
    /// not over yet: its end.
    #[inline]
    pub(super) fn paused(&self, receiver: usize, now: Instant) -> Option<Instant> {
        self.fetch_after[receiver].filter(|until| now < *until)
    }

    /// When fetching from every receiver pauses after a failed park: the
    /// soonest end of those pauses.
    pub(super) fn all_paused(&self) -> Option<Instant> {
        if self.fetch_after.iter().any(Option::is_none) {
            return None;
        }
        let now = Instant::now();
        let mut soonest: Option<Instant> = None;
        for receiver in 0..self.fetch_after.len() {
            let until = self.paused(receiver, now)?;
            soonest = Some(soonest.map_or(until, |s| s.min(until)));
        }
        soonest
    }

    /// Extends the leases of messages held for half the keepalive interval
    /// or longer: one fetched just after a tick is extended at the next,
    /// one fetched just before it at the one after, so no lease goes more
    /// than one and a half intervals without.
    pub(super) async fn keepalive(&mut self) {
        let Some(every) = self.keepalive_every else {
            return;
        };
        let interval = every / 2;
        if self.pending_acks() > 0 {
            self.settle = true;
        }
        let now = Instant::now();
        let held: Vec<(usize, MessageId)> = self
            .buffer
            .iter()
            .map(|h| (h.receiver, &h.id, h.since))
            .chain(self.in_flight.tasks().map(|t| (t.receiver, &t.id, t.since)))
            .filter(|(_, _, since)| now.saturating_duration_since(*since) >= interval)
            .map(|(r, id, _)| (r, id.clone()))
            .collect();
        for (receiver, id) in held {
            // A transport that leases nothing has nothing to extend.
            let Some(keepalive) = self.ctx.receivers[receiver].transport.as_keepalive() else {
                continue;
            };
            if let Err(e) = keepalive.keepalive(&id.delivery_id()).await {
                self.transport_failed(receiver, "keepalive", &e);
            }
        }
    }

    pub(super) fn limit_reached(
        &self,
        last_memory_check: &mut Option<Instant>,
    ) -> Option<StopReason> {
        if self.stop.is_stopped() {
            return Some(StopReason::Stopped);
        }
        let o = &self.options;
        if o.message_limit.is_some_and(|n| self.processed >= n) {
            return Some(StopReason::MessageLimit);
        }
        if o.failure_limit
            .is_some_and(|n| self.ctx.counters.failed.load(Ordering::Relaxed) >= n)
        {
            return Some(StopReason::FailureLimit);
        }
        let now = Instant::now();
        if o.time_limit
            .is_some_and(|t| now.saturating_duration_since(self.started) >= t)
        {
            return Some(StopReason::TimeLimit);
        }
        if let Some(limit) = o.memory_limit {
            if last_memory_check
                .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1))
            {
                *last_memory_check = Some(now);
                if resident_memory().is_some_and(|rss| rss > limit) {
                    return Some(StopReason::MemoryLimit);
                }
            }
        }
        None
    }

    pub(super) async fn run(mut self) -> WorkerReport {
        let ctx = self.ctx;
        ctx.events.emit(|| WorkerEvent::Started {
            transports: ctx.receivers.iter().map(|r| r.name.to_string()).collect(),
        });
        let mut interrupts = Interrupts {
            stopped: self.stop.tx.subscribe(),
            deadline: Box::pin(tokio::time::sleep_until(
                self.started + self.options.time_limit.unwrap_or(far::FAR),
            )),
            timed: self.options.time_limit.is_some(),
        };
        // Checked at once, then about every second.
        let mut memory_checked = None;
        let reason = loop {
            if let Some(reason) = self.limit_reached(&mut memory_checked) {
                break reason;
            }
            if let Some(reason) = self.round(&mut interrupts).await {
                break reason;
            }
        };
        self.shut_down().await;
        let report = WorkerReport {
            reason,
            stats: ctx.counters.snapshot(),
            elapsed: self.started.elapsed(),
        };
        ctx.events.emit(|| WorkerEvent::Stopped { report });
        report
    }

    /// One round of the loop: extend due leases, start what the buffer
    /// holds, harvest what finished, then settle, fetch or wait. Returns why
    /// the worker stops, when it found every receiver empty.
    async fn round(&mut self, interrupts: &mut Interrupts) -> Option<StopReason> {
        // A worker kept busy (handlers that finish at once, a free slot,
        // messages to fetch) never reaches a wait that watches the ticker:
        // extend the leases of what it holds here too.
        if self.keepalive_every.is_some()
            && poll_fn(|cx| Poll::Ready(self.ticker.poll_tick(cx).is_ready())).await
        {
            self.keepalive().await;
        }
        self.start_buffered().await;
        self.harvest().await;
        let budget = self.budget();
        let fetching = self.buffer.is_empty()
            && self.in_flight.len() < self.options.concurrency
            && (budget > 0 || self.ahead.is_some());
        if self.must_flush(fetching) {
            self.flush().await;
            return None;
        }
        if !self.buffer.is_empty() && self.in_flight.len() < self.options.concurrency {
            // Room freed up while harvesting: start more first.
            return None;
        }
        if fetching {
            return self.fetch_or_idle(budget, interrupts).await;
        }
        // Full, or out of budget: wait for a message to finish.
        let ctx = self.ctx;
        tokio::select! {
            finished = self.in_flight.next(), if !self.in_flight.is_empty() => self.record(finished),
            _ = poll_fn(|cx| poll_ahead(&mut self.ahead, &mut self.buffer, &mut self.buckets, ctx, cx)), if self.ahead.is_some() => {}
            _ = interrupts.stopped.changed() => {}
            _ = interrupts.deadline.as_mut(), if interrupts.timed => {}
            _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
        }
        None
    }

    /// Starts what the buffer holds, up to the concurrency (at most that
    /// many per round, though most finish at once, so the stop conditions
    /// are checked as often as before).
    async fn start_buffered(&mut self) {
        let room = self
            .options
            .concurrency
            .saturating_sub(self.in_flight.len());
        for _ in 0..room {
            let Some(held) = self.buffer.pop_front() else {
                break;
            };
            self.start(held);
            // Let the runtime run other tasks now and then.
            tokio::task::consume_budget().await;
        }
    }

    /// Records whatever finished without waiting (the batch asked for ahead
    /// is sent on its way by its first poll here).
    async fn harvest(&mut self) {
        let ctx = self.ctx;
        if self.ahead.is_some() {
            poll_fn(|cx| {
                let _ = poll_ahead(
                    &mut self.ahead,
                    &mut self.buffer,
                    &mut self.buckets,
                    ctx,
                    cx,
                );
                Poll::Ready(())
            })
            .await;
        }
        while !self.in_flight.is_empty() {
            match self.in_flight.try_next().await {
                Some(finished) => self.record(finished),
                None => break,
            }
        }
    }

    /// Whether what is settled waits no longer. Acknowledgements wait for a
    /// batch's worth, for the buffer to run dry, or for a keepalive tick;
    /// then they go with the next fetch, if there is one (`fetching`).
    fn must_flush(&self, fetching: bool) -> bool {
        let pending = self.pending_acks();
        !self.panicked.is_empty()
            || !self.rejects.is_empty()
            || !self.releases.is_empty()
            || (pending >= self.options.batch_size && !self.buffer.is_empty())
            // No keepalive extends a handled message's lease: it waits for
            // the others one keepalive interval at most.
            || (pending > 0 && self.settle)
            || (pending > 0 && self.buffer.is_empty() && !fetching)
    }

    /// Fetches a batch, or, when nothing came, checks whether every
    /// receiver is empty (with `stop_when_empty`) and waits for messages.
    async fn fetch_or_idle(
        &mut self,
        budget: u64,
        interrupts: &mut Interrupts,
    ) -> Option<StopReason> {
        if let Some(until) = self.all_paused() {
            // Parking failed for every receiver: wait before fetching (the
            // messages given back) again, handling what is in flight.
            tokio::select! {
                finished = self.in_flight.next(), if !self.in_flight.is_empty() => self.record(finished),
                _ = interrupts.stopped.changed() => {}
                _ = interrupts.deadline.as_mut(), if interrupts.timed => {}
                _ = tokio::time::sleep_until(until) => {}
                // The pause (up to 5 s) must not let the leases of what is
                // in flight run out.
                _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
            }
            return None;
        }
        let (n, token_wait) = self.fetch(budget).await;
        // A `get` still out: the worker must stop, or settle what finished
        // while it waits.
        if n > 0 || self.ahead.is_some() {
            return None;
        }
        if self.in_flight.is_empty() && self.buffer.is_empty() {
            self.flush().await;
            // A receiver paused after a failed park holds the message given
            // back, and was not asked since: it is not known to be empty
            // (it may not count).
            if self.options.stop_when_empty
                && self.panicked.is_empty()
                && self.fetch_after.iter().all(Option::is_none)
                && self.all_empty().await
            {
                return Some(StopReason::Empty);
            }
        }
        self.idle(token_wait, interrupts).await;
        None
    }

    /// Waits for messages to arrive (or a paused or rate-limited receiver
    /// to be ready), for one in flight to finish, or for an interrupt.
    async fn idle(&mut self, token_wait: Option<Duration>, interrupts: &mut Interrupts) {
        let idle = token_wait.map_or(self.options.idle_sleep, |w| {
            w.max(Duration::from_millis(1)).min(self.options.idle_sleep)
        });
        let now = Instant::now();
        let waits: Vec<BoxFuture<'_, ()>> = self
            .ctx
            .receivers
            .iter()
            .enumerate()
            .map(|(i, r)| {
                // A paused receiver (holding the message it could not park)
                // wakes us when its pause ends, not at once; a rate-limited
                // one not before its next token.
                if let Some(until) = self.paused(i, now) {
                    Box::pin(tokio::time::sleep_until(until)) as BoxFuture<'_, ()>
                } else if self.buckets[i].is_some() {
                    Box::pin(tokio::time::sleep(idle)) as BoxFuture<'_, ()>
                } else if let Some(wake_up) = r.transport.as_wake_up() {
                    wake_up.wait_for_messages(idle)
                } else {
                    Box::pin(tokio::time::sleep(idle)) as BoxFuture<'_, ()>
                }
            })
            .collect();
        tokio::select! {
            finished = self.in_flight.next(), if !self.in_flight.is_empty() => self.record(finished),
            _ = interrupts.stopped.changed() => {}
            _ = interrupts.deadline.as_mut(), if interrupts.timed => {}
            _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
            _ = any(waits) => {}
        }
    }

    /// Gives back the messages fetched and not started.
    pub(super) fn give_back_buffer(&mut self) {
        for held in std::mem::take(&mut self.buffer) {
            self.give_back(held.receiver, held.id);
        }
    }

    /// Tells the handlers in flight the worker is stopping (their
    /// contexts' `cancelled`), releases what was not started, lets what is
    /// in flight finish within the grace period (cut short by
    /// [`StopHandle::stop_now`]), releases the rest, and flushes.
    pub(super) async fn shut_down(&mut self) {
        self.stopping.raise();
        let stop = self.stop.clone();
        let period = self.options.grace_period;
        let grace = async move {
            tokio::select! {
                () = tokio::time::sleep(period) => {}
                () = stop.stopped_now() => {}
            }
        };
        tokio::pin!(grace);
        // A batch asked for ahead (or a `get` still out when the stop came)
        // is given back with the buffer when it arrives, while the handlers
        // in flight go on; should it not arrive within the grace period,
        // its messages come back when their leases expire.
        let ctx = self.ctx;
        self.give_back_buffer();
        while !self.in_flight.is_empty() || self.ahead.is_some() {
            // What was given back or finished is settled at once: the grace
            // period may outlast the leases of messages no longer held.
            if self.has_outcomes() {
                self.flush().await;
                continue;
            }
            tokio::select! {
                _ = poll_fn(|cx| poll_ahead(&mut self.ahead, &mut self.buffer, &mut self.buckets, ctx, cx)), if self.ahead.is_some() => {
                    self.give_back_buffer();
                }
                finished = self.in_flight.next(), if !self.in_flight.is_empty() => self.record(finished),
                _ = &mut grace => break,
                _ = self.ticker.tick(), if self.keepalive_every.is_some() => self.keepalive().await,
            }
        }
        self.ahead = None;
        for task in self.in_flight.abandon() {
            self.give_back(task.receiver, task.id);
        }
        self.flush().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messenger::Messenger;
    use crate::transport::{DeliveryId, MessageCount, RawMessage, Receiver as _, Transport};
    use crate::worker::{StopHandle, Worker};
    use crate::TransportError;
    use std::sync::Arc;

    fn assert_send<T: Send>(_: &T) {}

    #[test]
    fn run_is_a_send_future_so_a_worker_can_be_spawned() {
        let messenger = Messenger::builder()
            .transport(
                "async",
                Arc::new(crate::transport::in_memory::InMemoryTransport::new()),
            )
            .build()
            .unwrap();
        let worker = Worker::builder(&messenger)
            .receiver("async")
            .build()
            .unwrap();
        let run = worker.run();
        assert_send(&run);
    }
    #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
    struct Job(u64);

    impl crate::Message for Job {
        const NAME: &'static str = "Job";
    }

    impl crate::Command for Job {
        type Output = ();
        type Error = std::convert::Infallible;
    }

    /// An encoding in-memory queue whose gets and acknowledgements take a
    /// while, as a broker's round trips do.
    struct Slow(crate::transport::in_memory::InMemoryTransport);

    impl Transport for Slow {
        fn send(
            &self,
            message: RawMessage,
            delay: Option<Duration>,
        ) -> BoxFuture<'_, Result<String, TransportError>> {
            self.0.send(message, delay)
        }

        fn as_receiver(&self) -> Option<&dyn crate::transport::Receiver> {
            Some(self)
        }

        fn as_message_count(&self) -> Option<&dyn crate::transport::MessageCount> {
            self.0.as_message_count()
        }

        fn bind(&self, binding: &crate::transport::TransportBinding) {
            self.0.bind(binding);
        }
    }

    impl crate::transport::Receiver for Slow {
        fn get(
            &self,
            max: usize,
        ) -> BoxFuture<'_, Result<Vec<crate::transport::Delivery>, TransportError>> {
            // Claimed at once; the answer takes a while to come back.
            Box::pin(async move {
                let got = self.0.get(max).await;
                tokio::time::sleep(Duration::from_millis(3)).await;
                got
            })
        }

        fn ack<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                self.0.ack(id).await
            })
        }

        fn ack_batch<'a>(
            &'a self,
            ids: &'a [DeliveryId],
        ) -> BoxFuture<'a, Result<(), TransportError>> {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                self.0.ack_batch(ids).await
            })
        }

        fn reject<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
            self.0.reject(id)
        }

        fn release<'a>(&'a self, id: &'a DeliveryId) -> BoxFuture<'a, Result<(), TransportError>> {
            self.0.release(id)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn acknowledgements_recorded_while_others_are_sent_are_sent_too() {
        let queue = Arc::new(Slow(
            crate::transport::in_memory::InMemoryTransport::with_config(
                crate::transport::in_memory::InMemoryConfig {
                    serialize: true,
                    ..Default::default()
                },
            ),
        ));
        let messenger = Messenger::builder()
            .command_handler(|job: Job| async move {
                // Handlers finish while gets and acknowledgements are out.
                tokio::time::sleep(Duration::from_millis(job.0 % 5)).await;
                Ok::<_, std::convert::Infallible>(())
            })
            .transport("slow", queue.clone())
            .route::<Job>("slow")
            .build()
            .unwrap();
        for n in 0..30 {
            messenger.dispatcher().dispatch(Job(n)).await.unwrap();
        }
        let report = Worker::builder(&messenger)
            .receiver("slow")
            .concurrency(3)
            .batch_size(4)
            .message_limit(30)
            .build()
            .unwrap()
            .run()
            .await;
        assert_eq!(report.stats.handled, 30);
        assert_eq!(queue.0.acknowledged(), 30);
        assert_eq!(queue.0.message_count().await.unwrap(), 0);
    }

    fn slow_messenger(stop: Option<(StopHandle, u64)>) -> (Messenger, Arc<Slow>) {
        let queue = Arc::new(Slow(
            crate::transport::in_memory::InMemoryTransport::with_config(
                crate::transport::in_memory::InMemoryConfig {
                    serialize: true,
                    ..Default::default()
                },
            ),
        ));
        let messenger = Messenger::builder()
            .command_handler(move |job: Job| {
                let stop = stop.clone();
                async move {
                    if let Some((stop, at)) = stop {
                        if job.0 == at {
                            stop.stop();
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    Ok::<_, std::convert::Infallible>(())
                }
            })
            .transport("slow", queue.clone())
            .route::<Job>("slow")
            .build()
            .unwrap();
        (messenger, queue)
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_asked_for_ahead_stays_within_the_message_limit() {
        let (messenger, queue) = slow_messenger(None);
        for n in 0..30 {
            messenger.dispatcher().dispatch(Job(n)).await.unwrap();
        }
        let report = Worker::builder(&messenger)
            .receiver("slow")
            .batch_size(4)
            .message_limit(10)
            .build()
            .unwrap()
            .run()
            .await;
        assert_eq!((report.stats.handled, report.stats.released), (10, 0));
        // Nothing else was taken: the other 20 are available at once.
        assert_eq!(queue.0.get(100).await.unwrap().len(), 20);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_gives_back_the_batch_asked_for_ahead() {
        let stop = StopHandle::new();
        let (messenger, queue) = slow_messenger(Some((stop.clone(), 1)));
        for n in 0..20 {
            messenger.dispatcher().dispatch(Job(n)).await.unwrap();
        }
        let report = Worker::builder(&messenger)
            .receiver("slow")
            .batch_size(4)
            .stop_handle(stop)
            .build()
            .unwrap()
            .run()
            .await;
        assert_eq!(report.reason, StopReason::Stopped);
        let handled = report.stats.handled;
        assert!(report.stats.released > 0, "{:?}", report.stats);
        assert_eq!(queue.0.acknowledged(), handled);
        // Everything not handled is available again at once, not leased.
        assert_eq!(queue.0.get(100).await.unwrap().len() as u64, 20 - handled);
    }
}
