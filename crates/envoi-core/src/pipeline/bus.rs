//! The [`MessageBus`]: wraps a message in an envelope and runs it through the
//! canonical pipeline.
//!
//! The canonical order (as Symfony Messenger has it):
//!
//! 1. `AddBusNameStamp`
//! 2. `DispatchAfterCurrentBus`
//! 3. `FailedMessageProcessing`
//! 4. user middleware, in registration order
//! 5. `SendMessage`
//! 6. `Retry`
//! 7. `HandleMessage`
//!
//! The built-in steps are known types, so the bus runs them inline in one
//! future: no boxing and no dynamic call of their own, and a step with nothing
//! to do (no routes, no retry configuration) costs a branch. Only user
//! middleware goes through [`Middleware`]'s boxed futures.
//!
//! The user-middleware part can change while the bus runs
//! ([`add_middleware`](MessageBus::add_middleware),
//! [`remove_middleware`](MessageBus::remove_middleware)): the chain is an
//! immutable list swapped atomically, so dispatch never takes a lock, and a
//! dispatch already in flight finishes on the chain it started with.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use arc_swap::ArcSwap;
use futures_util::FutureExt;

use crate::envelope::message::Message;
use crate::envelope::stamp::{DispatchAfterCurrentBusStamp, HandledStamp, ReceivedStamp};
use crate::envelope::Envelope;
use crate::error::{BusError, Result, StepResult};
use crate::middleware::stage::{PipelineStage, StageItem, StagePipeline};
use crate::middleware::{Endpoint, Middleware, MiddlewareStack, Next};
use crate::pipeline::add_bus_name::AddBusNameStamp;
use crate::pipeline::canonical::{Step, CANONICAL};
use crate::pipeline::dispatch_after_current_bus::DispatchAfterCurrentBus;
use crate::pipeline::dispatch_after_current_bus::{
    self, into_result, run_now, scope, take_deferred,
};
use crate::pipeline::failed_message_processing::FailedMessageProcessing;
use crate::pipeline::frame::{framed, Frame, Framed};
use crate::pipeline::handle_message::{hand_on, single_failed, HandleMessage};
use crate::pipeline::retry::Retry;
use crate::pipeline::send_message::{Route, SendMessage, Started};
use crate::pipeline::verdict::Verdict;
use crate::BoxFuture;

/// Identifies a middleware added to a live bus, for removing it later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MiddlewareId(u64);

/// The user part of a bus's pipeline (step 4): the user middleware, then
/// the bus's one stage pipeline. Immutable: changing it swaps in a new one.
#[derive(Default)]
struct Chain {
    ids: Vec<MiddlewareId>,
    /// The user middleware, in registration order.
    items: Vec<Arc<dyn Middleware>>,
    /// Every filter and stage middleware of the bus, added at build time or
    /// later: within a stage, filters run before the middleware, whoever
    /// added them when.
    stages: StagePipeline,
    /// What runs: `items`, then `stages` when it has anything.
    run: Vec<Arc<dyn Middleware>>,
}

impl Chain {
    fn new(ids: Vec<MiddlewareId>, items: Vec<Arc<dyn Middleware>>, stages: StagePipeline) -> Self {
        let mut run = items.clone();
        if !stages.is_empty() {
            run.push(Arc::new(stages.clone()));
        }
        Self {
            ids,
            items,
            stages,
            run,
        }
    }
}

pub(crate) struct BusInner {
    name: Arc<str>,
    add_bus_name: AddBusNameStamp,
    user: ArcSwap<Chain>,
    /// Whether the user chain is empty: lets a dispatch skip the chain
    /// without loading it. A dispatch racing an `add_middleware` may miss
    /// the new middleware, as if it had started just before.
    user_empty: AtomicBool,
    send: Option<SendMessage>,
    retry: Retry,
    handle: HandleMessage,
    next_id: AtomicU64,
    disposed: AtomicBool,
}

/// A named bus running the canonical pipeline. Cheap to clone.
///
/// Build buses with `Messenger::builder`; use
/// the typed `Dispatcher` for `Result`s typed by the
/// message definition.
#[derive(Clone)]
pub struct MessageBus {
    inner: Arc<BusInner>,
}

impl MessageBus {
    pub(crate) fn new(
        name: Arc<str>,
        middleware: Vec<Arc<dyn Middleware>>,
        stages: StagePipeline,
        send: Option<SendMessage>,
        retry: Retry,
        handle: HandleMessage,
    ) -> Self {
        let ids = (0..middleware.len() as u64).map(MiddlewareId).collect();
        let next = middleware.len() as u64;
        let chain = Chain::new(ids, middleware, stages);
        let user_empty = AtomicBool::new(chain.run.is_empty());
        Self {
            // The handle step links back to its bus, for the contexts of
            // its handlers, without keeping it alive.
            inner: Arc::new_cyclic(|bus| BusInner {
                add_bus_name: AddBusNameStamp::new(name.clone()),
                name,
                user: ArcSwap::from_pointee(chain),
                user_empty,
                send,
                retry,
                handle: handle.on_bus(bus.clone()),
                next_id: AtomicU64::new(next),
                disposed: AtomicBool::new(false),
            }),
        }
    }

    /// The bus `inner` links to, if it still exists.
    pub(crate) fn upgrade(inner: &Weak<BusInner>) -> Option<Self> {
        inner.upgrade().map(|inner| Self { inner })
    }

    /// The bus's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether a dispatch of `envelope` would send it to transports (it is
    /// routed) rather than handle it in this process.
    pub fn is_routed(&self, envelope: &Envelope) -> bool {
        self.inner.route(envelope).is_some()
    }

    /// The transports a dispatch of `envelope` would send it to that give
    /// no result back (all but those that handle on send, like `sync://`),
    /// by name.
    pub fn routed_without_result(&self, envelope: &Envelope) -> Vec<Arc<str>> {
        self.inner
            .route(envelope)
            .map(|(_, routes)| {
                routes
                    .iter()
                    .filter(|r| !r.answers())
                    .map(|r| r.transport().clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Runs `envelope` through the pipeline and returns it with the stamps
    /// the steps added (a [`HandledStamp`] per
    /// handler, or a [`SentStamp`](crate::envelope::stamp::SentStamp) per transport).
    pub fn dispatch(
        &self,
        envelope: Envelope,
    ) -> impl Future<Output = Result<Envelope>> + Send + '_ {
        // A mapping adapter rather than an `async` wrapper: the pipeline's
        // future is built in place, not moved into an outer state machine
        // on its first poll.
        self.inner
            .dispatch(envelope)
            .map(|out: StepResult| out.map_err(|e| *e))
    }

    /// Dispatches `envelope`, a message received from a transport (stamped
    /// with its [`ReceivedStamp`]), and says what became of it: handled,
    /// retried, parked or failed, with the dispatches its handlers deferred
    /// that failed afterwards. What a worker settles the
    /// message with its transport by.
    ///
    /// ```
    /// use envoi_core::pipeline::verdict::Fate;
    /// use envoi_core::stamp::ReceivedStamp;
    /// use envoi_core::{Command, Envelope, Message, Messenger};
    ///
    /// #[derive(Debug, Clone)]
    /// struct Ping;
    /// impl Message for Ping { const NAME: &'static str = "Ping"; }
    /// impl Command for Ping { type Output = (); type Error = std::convert::Infallible; }
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let messenger = Messenger::builder()
    ///     .command_handler(|_: Ping| async { Ok(()) })
    ///     .build()
    ///     .unwrap();
    /// let received = Envelope::new(Ping).with(ReceivedStamp::new("queue"));
    /// let verdict = messenger.bus().receive(received).await;
    /// assert!(matches!(verdict.fate, Fate::Handled(_)));
    /// assert!(verdict.failed_deferred.is_empty());
    /// # });
    /// ```
    pub fn receive(&self, envelope: Envelope) -> impl Future<Output = Verdict> + Send + '_ {
        self.inner.receive(envelope)
    }

    /// Dispatches `message` as a command.
    pub async fn dispatch_message<M: Message>(&self, message: M) -> Result<Envelope> {
        self.dispatch(Envelope::new(message)).await
    }

    /// Dispatches `envelope` after the current dispatch has finished, when
    /// called while a handler runs (from the handler, or from anything its
    /// future runs, such as the pipeline of a dispatch it makes): it is
    /// queued until the dispatch running that handler has succeeded. Called
    /// outside any handler (by a middleware around the outermost dispatch,
    /// say), it runs at once. See
    /// [`crate::pipeline::dispatch_after_current_bus`].
    pub async fn dispatch_after_current(&self, envelope: Envelope) -> Result<Envelope> {
        self.dispatch(envelope.with(DispatchAfterCurrentBusStamp))
            .await
    }

    /// Appends `middleware` to the user part of the pipeline. Dispatches
    /// already running keep the chain they started with.
    pub fn add_middleware(&self, middleware: Arc<dyn Middleware>) -> MiddlewareId {
        let id = MiddlewareId(self.inner.next_id.fetch_add(1, Ordering::Relaxed));
        self.inner.user.rcu(|chain| {
            let mut ids = chain.ids.clone();
            let mut items = chain.items.clone();
            ids.push(id);
            items.push(middleware.clone());
            Chain::new(ids, items, chain.stages.clone())
        });
        self.inner.user_empty.store(false, Ordering::SeqCst);
        id
    }

    /// Removes the middleware added as `id` and calls its
    /// [`dispose`](Middleware::dispose). Returns whether it was there.
    pub fn remove_middleware(&self, id: MiddlewareId) -> bool {
        let mut removed = None;
        self.inner.user.rcu(|chain| {
            removed = None;
            let mut ids = chain.ids.clone();
            let mut items = chain.items.clone();
            if let Some(pos) = ids.iter().position(|i| *i == id) {
                ids.remove(pos);
                removed = Some(items.remove(pos));
            }
            Chain::new(ids, items, chain.stages.clone())
        });
        self.sync_user_empty();
        match removed {
            Some(m) => {
                m.dispose();
                true
            }
            None => false,
        }
    }

    fn sync_user_empty(&self) {
        // Another thread may change the chain (and store its own answer)
        // between the look and the store: look again after storing, so the
        // last answer stored is never a stale "empty" for a chain that has
        // a middleware.
        loop {
            let empty = self.inner.user.load().run.is_empty();
            self.inner.user_empty.store(empty, Ordering::SeqCst);
            if self.inner.user.load().run.is_empty() == empty {
                return;
            }
        }
    }

    /// Appends filters and middleware to `stage` of the bus's stage
    /// pipeline, the one that runs after the user middleware: within each
    /// stage, filters run before the middleware, whether they were added
    /// when the bus was built or now. Dispatches already running keep the
    /// pipeline they started with.
    ///
    /// ```
    /// use envoi_core::middleware::stage::{as_filter, FilterAction, PipelineStage};
    /// use envoi_core::{Envelope, Event, Message, Messenger};
    /// use std::convert::Infallible;
    ///
    /// #[derive(Debug, Clone)]
    /// struct Invoiced;
    /// impl Message for Invoiced { const NAME: &'static str = "Invoiced"; }
    /// impl Event for Invoiced { type Error = Infallible; }
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let messenger = Messenger::builder()
    ///     .event_handler(|_: Invoiced| async { Ok(()) })
    ///     .build()
    ///     .unwrap();
    /// messenger.bus().use_stage(
    ///     PipelineStage::BeforeConsuming,
    ///     [as_filter(|e| if e.header("tenant").is_some() { FilterAction::Continue } else { FilterAction::Stop })],
    /// );
    /// let out = messenger.bus().dispatch(Envelope::event(Invoiced)).await.unwrap();
    /// assert!(out.stamps().all(|s| s.name() != "Handled"), "stopped before the handler");
    /// # });
    /// ```
    pub fn use_stage(&self, stage: PipelineStage, items: impl IntoIterator<Item = StageItem>) {
        let items: Vec<StageItem> = items.into_iter().collect();
        self.inner.user.rcu(|chain| {
            let stages = chain.stages.clone().use_(stage, items.iter().cloned());
            Chain::new(chain.ids.clone(), chain.items.clone(), stages)
        });
        self.sync_user_empty();
    }

    /// The ids of the user middleware, in order.
    pub fn middleware_ids(&self) -> Vec<MiddlewareId> {
        self.inner.user.load().ids.clone()
    }

    /// Disposes every user middleware, clears the chain and refuses further
    /// dispatches with [`BusError::Disposed`]. Idempotent.
    pub fn dispose(&self) {
        self.inner.disposed.store(true, Ordering::SeqCst);
        let old = self.inner.user.swap(Arc::new(Chain::default()));
        self.sync_user_empty();
        for m in &old.items {
            m.dispose();
        }
    }

    /// The pipeline, step by step, in the [canonical order](CANONICAL),
    /// for `debug` listings: the user middleware by name, and whether the
    /// send and retry steps have work.
    pub fn pipeline(&self) -> Vec<Cow<'static, str>> {
        let mut steps: Vec<Cow<'static, str>> = Vec::new();
        for step in CANONICAL {
            match step {
                Step::User => {
                    steps.extend(self.inner.user.load().run.iter().map(|m| m.name()));
                }
                Step::SendMessage => steps.push(match &self.inner.send {
                    Some(s) if !s.routes().is_empty() => step.name().into(),
                    _ => format!("{} (no routes)", step.name()).into(),
                }),
                Step::Retry => steps.push(match self.inner.retry.policy() {
                    Some(_) => step.name().into(),
                    None => format!("{} (not configured)", step.name()).into(),
                }),
                _ => steps.push(step.name().into()),
            }
        }
        steps
    }

    /// The bus's pipeline as a [`MiddlewareStack`] of its public steps, in
    /// the [canonical order](CANONICAL): what the bus runs, assembled by
    /// hand. Dispatching through it does what
    /// [`dispatch`](Self::dispatch) does (the bus runs the same steps
    /// inline, without a boxed layer for each).
    pub fn stack(&self) -> MiddlewareStack {
        let inner = &self.inner;
        let chain = inner.user.load_full();
        let mut after_deferral: Vec<Arc<dyn Middleware>> = Vec::new();
        let mut before: Vec<Arc<dyn Middleware>> = Vec::new();
        for step in CANONICAL {
            match step {
                Step::AddBusName => before.push(Arc::new(inner.add_bus_name.clone())),
                // Deferred dispatches run through the steps after it.
                Step::DispatchAfterCurrentBus => {}
                Step::FailedMessageProcessing => {
                    after_deferral.push(Arc::new(FailedMessageProcessing))
                }
                Step::User => after_deferral.extend(chain.run.iter().cloned()),
                Step::SendMessage => {
                    if let Some(send) = &inner.send {
                        after_deferral.push(Arc::new(send.clone()));
                    }
                }
                Step::Retry => after_deferral.push(Arc::new(inner.retry.clone())),
                Step::HandleMessage => after_deferral.push(Arc::new(inner.handle.clone())),
            }
        }
        let rest = MiddlewareStack::new(after_deferral.clone());
        before.push(Arc::new(DispatchAfterCurrentBus::new(Arc::new(rest))));
        MiddlewareStack::new(before.into_iter().chain(after_deferral))
    }

    pub(crate) fn send_step(&self) -> Option<&SendMessage> {
        self.inner.send.as_ref()
    }

    pub(crate) fn handle_step(&self) -> &HandleMessage {
        &self.inner.handle
    }
}

impl fmt::Debug for MessageBus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageBus")
            .field("name", &self.inner.name)
            .field("pipeline", &self.pipeline())
            .finish()
    }
}

// Steps that run rarely (several handlers, deferred dispatches, sending,
// retrying) are awaited through a box: a future holds the state of every
// step it awaits inline, and the common path's futures are moved (into a
// box, by a caller) whole, so keeping the rare states out keeps them small.
impl BusInner {
    async fn dispatch(self: &Arc<Self>, envelope: Envelope) -> StepResult {
        self.live()?;
        // 1. AddBusNameStamp
        let envelope = self.add_bus_name.apply(envelope);
        if envelope.has::<DispatchAfterCurrentBusStamp>() {
            // 2. DispatchAfterCurrentBus. The user middleware are asked
            // whether they take part when the message runs, not now: a
            // hook's `can_handle` is called once per operation.
            return Box::pin(self.defer(envelope)).await;
        }
        // User middleware that takes no part would only pass the envelope
        // on: the chain starts at the first one that does (`start`), or is
        // skipped (`None`).
        let user = if self.user_empty.load(Ordering::Relaxed) {
            None
        } else {
            self.user_chain(&envelope)
        };
        if user.is_none() && self.is_plain(&envelope) {
            // Steps 2 to 6 have nothing to do: go straight to the handlers
            // and settle what they deferred, as step 2 would. The common
            // case, one handler, runs right here: the same code as the end
            // of `core`, written out because one more nested future costs
            // this path about a sixth of its time.
            if let Some(handler) = self.handle.single(&envelope) {
                let call = handler.call(&envelope, self.handle.bus());
                let (out, scope_id) = match scope(call).await {
                    Ok((result, scope_id)) => (
                        envelope.with(HandledStamp::new(handler.name(), result)),
                        scope_id,
                    ),
                    Err(error) => return Err(single_failed(envelope, handler, error)),
                };
                // Nothing deferred, the common case: no frame is made.
                let Some(frame) = deferred_frame(scope_id) else {
                    return Ok(out);
                };
                return Box::pin(settle_plain(Ok(out), frame, false)).await;
            }
            let (result, frame) = Box::pin(framed(self.handle.process(envelope))).await;
            return match finish(result, frame, false) {
                Finish::Ready(result) => result,
                Finish::Pending(settling) => settling.await,
            };
        }
        // Step 2 has nothing to defer: the steps after it run here in a
        // frame, and step 2 settles what their handlers deferred afterwards.
        let received = envelope.has::<ReceivedStamp>();
        let (result, frame) = match &user {
            // No user middleware with work to do: sent (step 5) or,
            // once received, steps 3, 6 and 7.
            None => match self.route(&envelope) {
                Some((send, targets)) => {
                    let sending = match send.start(envelope, targets) {
                        Started::Done(result) => return result.map_err(Box::new),
                        Started::Pending(sending) => sending,
                    };
                    return sending.await.map_err(Box::new);
                }
                None => {
                    let envelope = FailedMessageProcessing::apply(envelope);
                    Box::pin(framed(self.core(envelope))).await
                }
            },
            // Steps 3 and 4 from the first middleware that takes part.
            Some((chain, start)) => {
                let envelope = FailedMessageProcessing::apply(envelope);
                let next = Next::after_asking(&chain.run[start + 1..], Some(&**self));
                let (result, frame) = Framed::new(chain.run[*start].handle(envelope, next)).await;
                (result.map_err(Box::new), frame)
            }
        };
        match finish(result, frame, received) {
            Finish::Ready(result) => result,
            Finish::Pending(settling) => settling.await,
        }
    }

    /// [`MessageBus::receive`]: steps 1 and 3, then the user middleware and
    /// steps 5 to 7 in a frame; step 2 settles what the handlers deferred,
    /// and the frame's record of the retry step says what became of the
    /// message.
    async fn receive(self: &Arc<Self>, envelope: Envelope) -> Verdict {
        if let Err(error) = self.live() {
            return Verdict::of(Err(error), None, Vec::new());
        }
        // 1. AddBusNameStamp, 3. FailedMessageProcessing
        let envelope = FailedMessageProcessing::apply(self.add_bus_name.apply(envelope));
        let user = if self.user_empty.load(Ordering::Relaxed) {
            None
        } else {
            self.user_chain(&envelope)
        };
        let (result, frame) = match &user {
            None => framed(self.core(envelope)).await,
            Some((chain, start)) => {
                let next = Next::after_asking(&chain.run[start + 1..], Some(&**self));
                let (result, frame) = Framed::new(chain.run[*start].handle(envelope, next)).await;
                (result.map_err(Box::new), frame)
            }
        };
        let retry = frame.retry.clone();
        let (result, failed) = if frame.deferred.is_empty() {
            (result, Vec::new())
        } else {
            Box::pin(dispatch_after_current_bus::settle(result, frame, true)).await
        };
        Verdict::of(result, retry, failed)
    }

    /// Refuses a dispatch once the bus is disposed.
    #[inline]
    fn live(&self) -> std::result::Result<(), Box<BusError>> {
        if self.disposed.load(Ordering::Relaxed) {
            return Err(Box::new(BusError::Disposed(self.name.to_string())));
        }
        Ok(())
    }

    /// The user middleware chain and the position of its first middleware
    /// that takes part in dispatching `envelope`; `None` if none does.
    #[inline(never)]
    fn user_chain(&self, envelope: &Envelope) -> Option<(Arc<Chain>, usize)> {
        let chain = self.user.load_full();
        let start = chain.run.iter().position(|m| m.takes_part(envelope))?;
        Some((chain, start))
    }

    /// Whether steps 3, 5 and 6 leave `envelope` untouched (step 2 was
    /// checked first): not received from a transport (so neither failure
    /// processing nor retry applies), and not routed to a transport.
    #[inline]
    fn is_plain(&self, envelope: &Envelope) -> bool {
        !envelope.has::<ReceivedStamp>() && self.route(envelope).is_none()
    }

    /// Step 5's send step and the transports it sends `envelope` to, if it
    /// sends it (routed and not received).
    #[inline]
    fn route(&self, envelope: &Envelope) -> Option<(&SendMessage, &[Route])> {
        let send = self.send.as_ref()?;
        Some((send, send.targets(envelope)?))
    }

    /// Step 2 for a message stamped to wait for the current dispatch: kept
    /// until it ends, then steps 3 and 4 and the core.
    async fn defer(self: &Arc<Self>, envelope: Envelope) -> StepResult {
        dispatch_after_current_bus::run(
            envelope,
            || Arc::new(AfterDeferral(self.clone())) as Arc<dyn Endpoint>,
            |e| self.after_deferral(e),
        )
        .await
    }

    /// Steps 3 and 4, then the core.
    async fn after_deferral(&self, envelope: Envelope) -> StepResult {
        // 3. FailedMessageProcessing
        let envelope = FailedMessageProcessing::apply(envelope);
        // 4. user middleware
        if self.user_empty.load(Ordering::Relaxed) {
            return self.core(envelope).await;
        }
        let chain = self.user.load_full();
        Next::new(&chain.run, Some(self))
            .run(envelope)
            .await
            .map_err(Box::new)
    }

    /// Steps 5 to 7. What the handlers deferred goes to the frame of the
    /// dispatch this runs in.
    async fn core(&self, envelope: Envelope) -> StepResult {
        // 5. SendMessage
        if let Some((send, targets)) = self.route(&envelope) {
            let sending = match send.start(envelope, targets) {
                Started::Done(result) => return result.map_err(Box::new),
                Started::Pending(sending) => sending,
            };
            return sending.await.map_err(Box::new);
        }
        // 6. Retry, 7. HandleMessage. Retrying is awaited inline: every
        // caller boxes this future already.
        if self.retry.policy().is_some() && envelope.has::<ReceivedStamp>() {
            return self
                .retry
                .process(envelope, |e| self.handle.process(e))
                .await;
        }
        // 7. HandleMessage; one handler (the common case) runs inline.
        let Some(handler) = self.handle.single(&envelope) else {
            return Box::pin(self.handle.process(envelope)).await;
        };
        match scope(handler.call(&envelope, self.handle.bus())).await {
            Ok((result, scope_id)) => {
                let out = envelope.with(HandledStamp::new(handler.name(), result));
                let unframed = hand_on(take_deferred(scope_id));
                if unframed.is_empty() {
                    Ok(out)
                } else {
                    Box::pin(run_now(out, unframed)).await
                }
            }
            Err(error) => Err(single_failed(envelope, handler, error)),
        }
    }
}

/// What step 2 still has to do once the steps after it returned.
enum Finish {
    /// Nothing: the result is the dispatch's.
    Ready(StepResult),
    /// Settling what the handlers deferred, boxed so the dispatch futures
    /// that await it keep one pointer for it.
    Pending(BoxFuture<'static, StepResult>),
}

/// Step 2's end for a dispatch not made by a worker: what the frame holds
/// is settled, and deferred dispatches that failed become the dispatch's
/// error.
#[inline]
/// What the handler run in `scope_id` deferred, as a frame to settle; `None`
/// when it deferred nothing. The list is gone before the caller awaits
/// anything, so its future keeps no slot for it.
fn deferred_frame(scope_id: u64) -> Option<Frame> {
    let deferred = take_deferred(scope_id);
    if deferred.is_empty() {
        return None;
    }
    Some(Frame {
        deferred,
        retry: None,
    })
}

fn finish(result: StepResult, frame: Frame, received: bool) -> Finish {
    if frame.deferred.is_empty() {
        return Finish::Ready(result);
    }
    Finish::Pending(Box::pin(settle_plain(result, frame, received)))
}

/// [`dispatch_after_current_bus::settle`], failures made an error.
async fn settle_plain(result: StepResult, frame: Frame, received: bool) -> StepResult {
    let (result, failed) = dispatch_after_current_bus::settle(result, frame, received).await;
    into_result(result, failed)
}

impl Endpoint for BusInner {
    fn call(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope>> {
        Box::pin(async move { self.core(envelope).await.map_err(|e| *e) })
    }

    fn sends(&self, envelope: &Envelope) -> bool {
        self.route(envelope).is_some()
    }
}

/// Where deferred envelopes go: the pipeline from step 3 on.
struct AfterDeferral(Arc<BusInner>);

impl Endpoint for AfterDeferral {
    fn call(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope>> {
        Box::pin(async move { self.0.after_deferral(envelope).await.map_err(|e| *e) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::middleware::from_fn;
    use std::sync::atomic::AtomicUsize;
    use std::time::{Duration, Instant};

    fn bus() -> MessageBus {
        MessageBus::new(
            Arc::from("bus"),
            Vec::new(),
            StagePipeline::new(),
            None,
            Retry::disabled(),
            HandleMessage::new(crate::pipeline::handler::Handlers::new()),
        )
    }

    fn pass() -> Arc<dyn Middleware> {
        Arc::new(from_fn("pass", |e, next| next.run(e)))
    }

    #[test]
    fn a_middleware_added_while_another_is_removed_is_not_skipped() {
        let bus = bus();
        // 0: churning; 1: asked to pause; 2: paused; 3: stop.
        let state = Arc::new(AtomicUsize::new(0));
        let churn = std::thread::spawn({
            let (bus, state) = (bus.clone(), state.clone());
            move || loop {
                match state.load(Ordering::SeqCst) {
                    0 => {
                        let id = bus.add_middleware(pass());
                        bus.remove_middleware(id);
                    }
                    1 => state.store(2, Ordering::SeqCst),
                    2 => std::hint::spin_loop(),
                    _ => return,
                }
            }
        });
        let start = Instant::now();
        let (mut trials, mut skipped) = (0, 0);
        while start.elapsed() < Duration::from_millis(500) {
            trials += 1;
            let id = bus.add_middleware(pass());
            // Let the other thread finish what it was doing, then look.
            state.store(1, Ordering::SeqCst);
            while state.load(Ordering::SeqCst) != 2 {
                std::hint::spin_loop();
            }
            if bus.inner.user_empty.load(Ordering::SeqCst) {
                skipped += 1;
            }
            bus.remove_middleware(id);
            state.store(0, Ordering::SeqCst);
        }
        state.store(3, Ordering::SeqCst);
        churn.join().unwrap();
        assert_eq!(
            skipped, 0,
            "a bus with a middleware took itself for one without, in {skipped} of {trials} trials"
        );
    }
}
