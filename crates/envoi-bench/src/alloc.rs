//! A counting global allocator, so scenarios report allocations measured,
//! not guessed.

use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Counts heap allocations made while `f` runs (all threads).
pub(crate) fn count<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let region = Region::new(GLOBAL);
    let r = f();
    (r, made_since(&region))
}

/// Counts heap allocations made while `f` runs to completion (all
/// threads, so everything else the process does meanwhile counts too).
pub(crate) async fn count_async<R>(f: impl std::future::Future<Output = R>) -> (R, usize) {
    let region = Region::new(GLOBAL);
    let r = f.await;
    (r, made_since(&region))
}

/// Allocations and reallocations since `region` began.
fn made_since(region: &Region<'_, System>) -> usize {
    let stats = region.change();
    stats.allocations + stats.reallocations
}
