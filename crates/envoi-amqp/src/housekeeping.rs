//! The background task of a handle: gives back messages whose lease ran
//! out, and cancels a consumer no fetch asked anything of for
//! `consumer_idle`, giving back what it had prefetched.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::StreamExt;
use lapin::options::BasicCancelOptions;
use lapin::Consumer;

use crate::consume::ConsumeState;
use crate::link::Link;
use crate::settle::Settle;
use crate::shared::{lock, Shared};

impl Shared {
    /// Gives back expired leases and stops an idle consumer.
    async fn housekeep(self: &Arc<Self>) {
        let Some(link) = self.current().filter(|l| l.healthy()) else {
            return;
        };
        let now = Instant::now();
        let expired: Vec<u64> = {
            let mut state = lock(&self.consume);
            if state.epoch != link.epoch {
                return;
            }
            let expired: Vec<u64> = state
                .leased
                .iter()
                .filter(|(_, lease)| lease.deadline <= now)
                .map(|(tag, _)| *tag)
                .collect();
            for tag in &expired {
                state.leased.remove(tag);
            }
            state.settling.extend(expired.iter().copied());
            expired
        };
        if !expired.is_empty() {
            tracing::debug!(transport = %self.name, count = expired.len(), "leases expired; giving the messages back");
            release_all(&link, &expired).await;
            lock(&self.consume).settled(link.epoch, &expired);
        }
        self.cancel_if_idle(&link).await;
    }

    /// Cancels the consumer if no fetch asked for messages for
    /// `consumer_idle`, and gives back what it had prefetched.
    async fn cancel_if_idle(self: &Arc<Self>, link: &Arc<Link>) {
        let idle = |s: &ConsumeState| {
            s.consuming(link.epoch)
                && s.last_get
                    .is_none_or(|at| at.elapsed() >= self.config.consumer_idle)
        };
        if !idle(&lock(&self.consume)) {
            return;
        }
        let _switch = self.consume_switch.lock().await;
        let (tag, consumer, buffered) = {
            let mut state = lock(&self.consume);
            if !idle(&state) {
                return;
            }
            state.drain(&self.on_arrival, &self.name);
            state.active = None;
            let buffered: Vec<u64> = state.buffer.drain(..).map(|d| d.delivery_tag).collect();
            state.settling.extend(buffered.iter().copied());
            (state.tag.take(), state.consumer.take(), buffered)
        };
        if let Some(tag) = tag {
            let _ = link
                .consumer
                .basic_cancel(tag, BasicCancelOptions::default())
                .await;
        }
        if let Some(consumer) = consumer {
            // What it delivered between the drain above and the broker
            // taking the cancellation.
            let rest = tokio::spawn(give_back_rest(
                Arc::downgrade(self),
                Arc::clone(link),
                consumer,
            ));
            let mut state = lock(&self.consume);
            state.give_backs.retain(|p| !p.is_finished());
            state.give_backs.push(rest);
        }
        release_all(link, &buffered).await;
        lock(&self.consume).settled(link.epoch, &buffered);
    }
}

/// Gives back the deliveries `tags` of `link`, all frames at once.
async fn release_all(link: &Link, tags: &[u64]) {
    let _ = join_all(
        tags.iter()
            .map(|&t| Settle::Release.send(&link.consumer, t)),
    )
    .await;
}

/// Gives back everything a cancelled consumer still delivers, until the
/// broker confirms the cancellation and the stream ends.
async fn give_back_rest(shared: Weak<Shared>, link: Arc<Link>, mut consumer: Consumer) {
    while let Some(Ok(delivery)) = consumer.next().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let tag = delivery.delivery_tag;
        {
            let mut state = lock(&shared.consume);
            if state.epoch != link.epoch {
                // The connection that delivered it is gone, and with it the
                // delivery: the broker has put it back.
                continue;
            }
            state.seen(tag);
            state.settling.insert(tag);
        }
        let _ = Settle::Release.send(&link.consumer, tag).await;
        lock(&shared.consume).settled(link.epoch, &[tag]);
    }
}

/// Periodically expires leases and cancels an idle consumer, for as long as
/// the transport lives.
pub(crate) async fn housekeeping(shared: Weak<Shared>) {
    let tick = {
        let Some(s) = shared.upgrade() else {
            return;
        };
        let by_lease = s.config.lease.map_or(Duration::from_secs(1), |l| l / 8);
        by_lease
            .min(s.config.consumer_idle / 4)
            .clamp(Duration::from_millis(25), Duration::from_secs(1))
    };
    loop {
        tokio::time::sleep(tick).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.closed.load(Ordering::SeqCst) {
            return;
        }
        shared.housekeep().await;
    }
}
