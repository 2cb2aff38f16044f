//! What a closure middleware costs beside a middleware type doing the same:
//! one allocation more per call, the link between its owned `next` and the
//! adapter that runs the rest (`src/middleware/relay.rs`). One test alone in
//! its binary, since the allocator counts every thread's allocations.

use std::alloc::System;
use std::sync::Arc;

use envoi_core::middleware::{from_fn, BoxFuture, Middleware, MiddlewareStack, Next};
use envoi_core::{Envelope, Message, Result};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[derive(Debug)]
struct Ping;
impl Message for Ping {
    const NAME: &'static str = "Ping";
}

/// Adds a header on the way in, boxing its future as a type does.
struct Tag;
impl Middleware for Tag {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        Box::pin(async move { next.run(envelope.with_header("tag", "x")).await })
    }
}

const ROUNDS: usize = 100;

/// Allocations of `ROUNDS` runs of `stack`, after a warm-up run.
fn allocations(runtime: &tokio::runtime::Runtime, stack: &MiddlewareStack) -> usize {
    runtime.block_on(async {
        stack.run(Envelope::new(Ping)).await.unwrap();
        let region = Region::new(GLOBAL);
        for _ in 0..ROUNDS {
            let out = stack.run(Envelope::new(Ping)).await.unwrap();
            assert_eq!(out.header("tag"), Some("x"));
        }
        region.change().allocations
    })
}

#[test]
fn a_closure_middleware_makes_one_allocation_more_per_call_than_a_middleware_type() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let typed = MiddlewareStack::new([Arc::new(Tag) as Arc<dyn Middleware>]);
    let closure = MiddlewareStack::new([Arc::new(from_fn("tag", |envelope, next| async move {
        next.run(envelope.with_header("tag", "x")).await
    })) as Arc<dyn Middleware>]);
    let typed = allocations(&runtime, &typed);
    let closure = allocations(&runtime, &closure);
    println!("{ROUNDS} runs: type {typed} allocations, closure {closure}");
    assert_eq!(closure, typed + ROUNDS);
}
