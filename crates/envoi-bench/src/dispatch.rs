//! In-process dispatch scenarios.

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use envoi_core::{Command, Envelope, Message, MessageBus, Messenger};
use tower::{Service, ServiceExt};

use crate::{alloc, report};

/// The dispatched command: small and cheap to clone, like an id.
#[derive(Debug, Clone)]
pub(crate) struct Noop(pub(crate) u64);

impl Message for Noop {
    const NAME: &'static str = "Noop";
}

impl Command for Noop {
    type Output = ();
    type Error = Infallible;
}

async fn handle_noop(cmd: Noop) -> Result<(), Infallible> {
    black_box(cmd.0);
    Ok(())
}

/// A tower layer that only boxes its inner future: the cost of one boxed
/// layer.
#[derive(Clone)]
struct Boxed<S>(S);

impl<S> Service<Noop> for Boxed<S>
where
    S: Service<Noop, Response = (), Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = ();
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<(), Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: Noop) -> Self::Future {
        Box::pin(self.0.call(req))
    }
}

type Tower7 =
    Boxed<Boxed<Boxed<Boxed<Boxed<Boxed<Boxed<tower::util::ServiceFn<fn(Noop) -> HandlerFut>>>>>>>>;
type HandlerFut = Pin<Box<dyn Future<Output = Result<(), Infallible>> + Send>>;

fn tower_handler(cmd: Noop) -> HandlerFut {
    // The innermost future is boxed too, as envoi's handler future is.
    Box::pin(handle_noop(cmd))
}

fn tower_stack() -> Tower7 {
    let f: fn(Noop) -> HandlerFut = tower_handler;
    Boxed(Boxed(Boxed(Boxed(Boxed(Boxed(Boxed(tower::service_fn(
        f,
    ))))))))
}

/// A tower layer that passes the request on and returns its inner
/// service's future as it is: what a layer that does nothing costs when
/// the stack is composed at compile time.
#[derive(Clone)]
struct Pass<S>(S);

impl<S> Service<Noop> for Pass<S>
where
    S: Service<Noop, Response = (), Error = Infallible>,
{
    type Response = ();
    type Error = Infallible;
    type Future = S::Future;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    #[inline]
    fn call(&mut self, req: Noop) -> Self::Future {
        self.0.call(req)
    }
}

/// The tower stack a Rust user would write: seven pass-through layers
/// composed at compile time, type-erased once with `BoxService` (which
/// boxes the future), over the handler whose future is boxed as envoi's
/// is: two allocations per call, like envoi.
type TowerStatic = tower::util::BoxService<Noop, (), Infallible>;

fn tower_static() -> TowerStatic {
    let f: fn(Noop) -> HandlerFut = tower_handler;
    tower::util::BoxService::new(Pass(Pass(Pass(Pass(Pass(Pass(Pass(tower::service_fn(
        f,
    )))))))))
}

pub(crate) fn canonical_bus() -> MessageBus {
    Messenger::builder()
        .command_handler(handle_noop)
        .build()
        .expect("a valid configuration")
        .bus()
        .clone()
}

/// Runs `op` `iters` times on a current-thread runtime and returns ns per
/// call.
pub(crate) fn time_async<F, Fut>(rt: &tokio::runtime::Runtime, iters: u64, mut op: F) -> f64
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = ()>,
{
    rt.block_on(async {
        let start = Instant::now();
        for i in 0..iters {
            op(i).await;
        }
        start.elapsed().as_nanos() as f64 / iters as f64
    })
}

pub(crate) fn fastest(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// Runs one call of `svc` per iteration, `iters` times; ns per call.
fn time_tower<S>(rt: &tokio::runtime::Runtime, svc: &mut S, iters: u64) -> f64
where
    S: Service<Noop, Response = (), Error = Infallible>,
{
    rt.block_on(async {
        let start = Instant::now();
        for i in 0..iters {
            let r = svc.ready().await.expect("infallible").call(Noop(i)).await;
            black_box(r.is_ok());
        }
        start.elapsed().as_nanos() as f64 / iters as f64
    })
}

/// Allocations of 1,000 calls of `svc`.
fn tower_allocs<S>(rt: &tokio::runtime::Runtime, svc: &mut S) -> usize
where
    S: Service<Noop, Response = (), Error = Infallible>,
{
    let ((), allocs) = alloc::count(|| {
        rt.block_on(async {
            for i in 0..1000 {
                let r = svc.ready().await.expect("infallible").call(Noop(i)).await;
                black_box(r.is_ok());
            }
        })
    });
    allocs
}

/// `dispatch_canonical`: envoi's full canonical pipeline against the tower
/// stack a Rust user would write (seven pass-through layers composed at
/// compile time, boxed once: `dispatch_tower_static`), with tower's stack
/// of seven boxed layers as a second figure, all over a no-op handler.
pub(crate) fn canonical() -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    let bus = canonical_bus();
    let mut boxed = tower_stack();
    let mut fixed = tower_static();
    // Many short rounds, the sides taking turns at going first, and the
    // fastest round of each: on a shared machine the minimum is the figure
    // least disturbed by other work.
    const ITERS: u64 = 50_000;
    const ROUNDS: usize = 25;

    // Correctness first: the handler runs and is stamped.
    let out = rt
        .block_on(bus.dispatch(Envelope::new(Noop(1))))
        .map_err(|e| e.to_string())?;
    if !out.has::<envoi_core::stamp::HandledStamp>() {
        return Err("the handler did not run".into());
    }

    let (mut envoi, mut stat, mut tower, mut direct) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let envoi_round = |rt: &tokio::runtime::Runtime| {
        time_async(rt, ITERS, |i| {
            let bus = &bus;
            async move {
                let r = bus.dispatch(Envelope::new(Noop(i))).await;
                black_box(r.is_ok());
            }
        })
    };
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            envoi.push(envoi_round(&rt));
            stat.push(time_tower(&rt, &mut fixed, ITERS));
        } else {
            stat.push(time_tower(&rt, &mut fixed, ITERS));
            envoi.push(envoi_round(&rt));
        }
        tower.push(time_tower(&rt, &mut boxed, ITERS));
        direct.push(time_async(&rt, ITERS, |i| async move {
            let r = handle_noop(Noop(i)).await;
            black_box(r.is_ok());
        }));
    }
    let ((), allocs) = alloc::count(|| {
        rt.block_on(async {
            for i in 0..1000 {
                let r = bus.dispatch(Envelope::new(Noop(i))).await;
                black_box(r.is_ok());
            }
        })
    });
    let static_allocs = tower_allocs(&rt, &mut fixed);
    let boxed_allocs = tower_allocs(&rt, &mut boxed);
    report::line(
        "dispatch_canonical",
        fastest(envoi),
        fastest(stat),
        "ns",
        &[
            ("allocs", format!("{:.1}", allocs as f64 / 1000.0)),
            (
                "baseline_allocs",
                format!("{:.1}", static_allocs as f64 / 1000.0),
            ),
            ("boxed_baseline", format!("{:.1}ns", fastest(tower))),
            (
                "boxed_baseline_allocs",
                format!("{:.1}", boxed_allocs as f64 / 1000.0),
            ),
            ("direct", format!("{:.1}ns", fastest(direct))),
        ],
    );
    Ok(())
}

/// Loops only envoi's dispatch (for instruction-level profiling with
/// callgrind); `ENVOI_BENCH_ITERS` sets the count.
pub(crate) fn profile_envoi() -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    let bus = canonical_bus();
    let iters = iters_from_env();
    let ns = time_async(&rt, iters, |i| {
        let bus = &bus;
        async move {
            black_box(bus.dispatch(Envelope::new(Noop(i))).await.is_ok());
        }
    });
    println!("profile_envoi: {ns:.1}ns over {iters} dispatches");
    Ok(())
}

/// The observed side of `dispatch_observed`: the default dispatch span,
/// `metrics()` and a hook that takes part in nothing.
fn observed_dispatcher() -> Result<envoi_core::Dispatcher, String> {
    Ok(Messenger::builder()
        .command_handler(handle_noop)
        .middleware(envoi_core::middleware::hook::HookMiddleware::new(
            Uninterested,
        ))
        .build()
        .map_err(|e| e.to_string())?
        .dispatcher()
        .with(envoi_core::typed::metrics::metrics()))
}

/// Loops only the observed side of `dispatch_observed`, like
/// [`profile_envoi`].
pub(crate) fn profile_observed() -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    let observed = observed_dispatcher()?;
    let iters = iters_from_env();
    let ns = time_async(&rt, iters, |i| {
        let d = &observed;
        async move {
            black_box(d.dispatch(Noop(i)).await.is_ok());
        }
    });
    println!("profile_observed: {ns:.1}ns over {iters} dispatches");
    Ok(())
}

/// Loops only the tower stack, like [`profile_envoi`].
pub(crate) fn profile_tower() -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    let mut svc = tower_stack();
    let iters = iters_from_env();
    let ns = rt.block_on(async {
        let start = Instant::now();
        for i in 0..iters {
            let r = svc.ready().await.expect("infallible").call(Noop(i)).await;
            black_box(r.is_ok());
        }
        start.elapsed().as_nanos() as f64 / iters as f64
    });
    println!("profile_tower: {ns:.1}ns over {iters} calls");
    Ok(())
}

fn iters_from_env() -> u64 {
    std::env::var("ENVOI_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000)
}

/// A hook that takes part in nothing: the cost of a registered hook.
struct Uninterested;

impl envoi_core::middleware::hook::Hook for Uninterested {
    fn can_handle(&self, _ctx: &envoi_core::middleware::hook::HookContext<'_>) -> bool {
        false
    }
}

/// `dispatch_observed`: the canonical pipeline plus the default dispatch
/// span (no subscriber), `metrics()` (no recorder) and one hook whose
/// `can_handle` is false, against the bare canonical pipeline, both through
/// the typed dispatcher.
pub(crate) fn observed() -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    let bare = Messenger::builder()
        .command_handler(handle_noop)
        .build()
        .map_err(|e| e.to_string())?
        .dispatcher()
        .without_span();
    let observed = observed_dispatcher()?;
    rt.block_on(observed.dispatch(Noop(1)))
        .map_err(|e| e.to_string())?;

    const ITERS: u64 = 50_000;
    const ROUNDS: usize = 25;
    let (mut envoi, mut baseline) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        envoi.push(time_async(&rt, ITERS, |i| {
            let d = &observed;
            async move {
                black_box(d.dispatch(Noop(i)).await.is_ok());
            }
        }));
        baseline.push(time_async(&rt, ITERS, |i| {
            let d = &bare;
            async move {
                black_box(d.dispatch(Noop(i)).await.is_ok());
            }
        }));
    }
    let ((), allocs) = alloc::count(|| {
        rt.block_on(async {
            for i in 0..1000 {
                black_box(observed.dispatch(Noop(i)).await.is_ok());
            }
        })
    });
    report::line(
        "dispatch_observed",
        fastest(envoi),
        fastest(baseline),
        "ns",
        &[("allocs", format!("{:.1}", allocs as f64 / 1000.0))],
    );
    Ok(())
}

#[cfg(test)]
mod sizes {
    /// Envelopes move through every step and the dispatch future holds
    /// them: both must stay small for the pipeline to stay fast.
    #[test]
    fn envelopes_are_one_pointer_and_the_dispatch_future_stays_small() {
        let bus = super::canonical_bus();
        let fut = bus.dispatch(envoi_core::Envelope::new(super::Noop(1)));
        // One (fat) pointer to the shared body.
        assert_eq!(
            std::mem::size_of::<envoi_core::Envelope>(),
            2 * std::mem::size_of::<usize>()
        );
        let size = std::mem::size_of_val(&fut);
        assert!(size <= 160, "dispatch future grew to {size} bytes");
        let typed = envoi_core::Messenger::builder()
            .command_handler(super::handle_noop)
            .build()
            .expect("a valid configuration")
            .dispatcher();
        let fut = typed.dispatch(super::Noop(1));
        let size = std::mem::size_of_val(&fut);
        assert!(size <= 160, "typed dispatch future grew to {size} bytes");
    }
}
