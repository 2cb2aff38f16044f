//! What `futures-util`'s `FuturesUnordered` would cost the worker, which
//! keeps its messages in flight in a set of its own instead
//! (`src/worker/in_flight.rs`): one allocation for every future pushed,
//! holding the future, where the worker's set reuses a slot per message in
//! flight.

use std::alloc::System;

use futures_util::stream::{FuturesUnordered, StreamExt};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[test]
fn futures_unordered_allocates_a_task_for_every_future_pushed() {
    // A future the size of a worker's handling of one message.
    let handling = |n: usize| {
        let state = [n as u8; 1024];
        async move { state[0] }
    };
    let mut set = FuturesUnordered::new();
    let rounds = 1000;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        // Warm up: the set's own queue.
        set.push(handling(0));
        set.next().await;
        let region = Region::new(GLOBAL);
        for n in 0..rounds {
            set.push(handling(n));
            set.next().await;
        }
        let per_future = region.change().allocations as f64 / rounds as f64;
        println!("FuturesUnordered: {per_future} allocations per future");
        assert!(per_future >= 1.0, "{per_future}");
    });
}
