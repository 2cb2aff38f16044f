//! The stage pipeline (ServiceConnect): filters and middleware attached to the
//! four stages a message passes through.
//!
//! | stage | runs | a filter's `Stop` |
//! |---|---|---|
//! | [`Outgoing`](PipelineStage::Outgoing) | before the message leaves the producer | fails the dispatch with [`BusError::OutgoingFiltersBlocked`] |
//! | [`BeforeConsuming`](PipelineStage::BeforeConsuming) | right before the handler | ends processing without the handler and without an error (a consumed message is acknowledged) |
//! | [`AfterConsuming`](PipelineStage::AfterConsuming) | after the handler returned or failed | skips the stage's middleware |
//! | [`OnConsumedSuccessfully`](PipelineStage::OnConsumedSuccessfully) | only after the handler succeeded | skips the stage's middleware |
//!
//! [`StagePipeline::use_`] (`use` is a Rust keyword) appends
//! [filters](as_filter) and [middleware](as_middleware) to a stage and
//! returns the pipeline, so calls chain. **Within a stage all filters run
//! before all middleware**, whatever order they were given in; a `Stop`
//! from any filter short-circuits the stage, so its middleware never runs.
//!
//! A bus has one stage pipeline, which runs after its user middleware:
//! give it items when the messenger is built (`MessengerBuilder::stages`,
//! `BusBuilder::stages`) or while it runs (`MessageBus::use_stage`), and
//! within each stage every filter runs before any middleware, whatever was
//! added when. (A `StagePipeline` is also a [`Middleware`] of its own, for a
//! pipeline assembled by hand; added to a bus as a user middleware, it is a
//! layer apart from the bus's.) Where the stages run depends on where the
//! message goes:
//!
//! * dispatched and handled in this process: all four, in order, around the
//!   handler;
//! * dispatched and routed to a transport (the sender side): `outgoing`
//!   only, just before the message is sent;
//! * received from a transport (it carries a
//!   [`ReceivedStamp`], the receiver side): `before_consuming`,
//!   `after_consuming` and `on_consumed_successfully` around the handler.
//!
//! ```
//! use envoi_core::middleware::stage::{as_filter, as_middleware, FilterAction, PipelineStage, StagePipeline};
//!
//! let pipeline = StagePipeline::new()
//!     .use_(PipelineStage::Outgoing, [as_middleware(|envelope, next| async move {
//!         next.run(envelope.with_header("origin", "billing")).await
//!     })])
//!     .use_(PipelineStage::BeforeConsuming, [as_filter(|envelope| {
//!         if envelope.header("tenant").is_some() { FilterAction::Continue } else { FilterAction::Stop }
//!     })]);
//! # let _ = pipeline;
//! ```
//!
//! Closures need no annotations: [`as_filter`] takes a function of the
//! envelope, [`as_middleware`] a function of the envelope and an owned
//! handle to the rest of the stage ([`OwnedStageNext`]) returning a future.
//! Types implementing [`Filter`] or [`StageMiddleware`] go in with
//! [`as_stage_filter`] and [`as_stage_middleware`].

mod from_fn;

use std::fmt;
use std::sync::Arc;

pub use from_fn::{as_middleware, OwnedStageNext, StageFailure};

use super::was_retried;
use super::{BoxFuture, Middleware, Next};
use crate::envelope::stamp::{ReceivedStamp, StoppedByFilterStamp};
use crate::envelope::Envelope;
use crate::error::{BusError, Result};

/// One of the four stages, as ServiceConnect has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PipelineStage {
    /// Before the message leaves the producer.
    Outgoing,
    /// Immediately before the handler.
    BeforeConsuming,
    /// After the handler returned or failed.
    AfterConsuming,
    /// Only after the handler succeeded.
    OnConsumedSuccessfully,
}

impl PipelineStage {
    fn index(self) -> usize {
        match self {
            PipelineStage::Outgoing => 0,
            PipelineStage::BeforeConsuming => 1,
            PipelineStage::AfterConsuming => 2,
            PipelineStage::OnConsumedSuccessfully => 3,
        }
    }

    /// How errors name a closure middleware of this stage.
    fn middleware_name(self) -> &'static str {
        match self {
            PipelineStage::Outgoing => "outgoing stage middleware",
            PipelineStage::BeforeConsuming => "before_consuming stage middleware",
            PipelineStage::AfterConsuming => "after_consuming stage middleware",
            PipelineStage::OnConsumedSuccessfully => "on_consumed_successfully stage middleware",
        }
    }

    /// `outgoing`, `before_consuming`, `after_consuming` or
    /// `on_consumed_successfully`.
    pub fn as_str(self) -> &'static str {
        match self {
            PipelineStage::Outgoing => "outgoing",
            PipelineStage::BeforeConsuming => "before_consuming",
            PipelineStage::AfterConsuming => "after_consuming",
            PipelineStage::OnConsumedSuccessfully => "on_consumed_successfully",
        }
    }
}

impl fmt::Display for PipelineStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a [`Filter`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterAction {
    /// Let the message through to the next filter, then the stage's
    /// middleware.
    Continue,
    /// Short-circuit the stage.
    Stop,
}

/// A synchronous check of an envelope (message, stamps and headers). A
/// closure is one; [`as_filter`] takes it without annotations.
pub trait Filter: Send + Sync + 'static {
    /// Decides whether the stage goes on.
    fn filter(&self, envelope: &Envelope) -> FilterAction;
}

impl<F> Filter for F
where
    F: Fn(&Envelope) -> FilterAction + Send + Sync + 'static,
{
    fn filter(&self, envelope: &Envelope) -> FilterAction {
        self(envelope)
    }
}

/// An async middleware of one stage: it gets the envelope and the rest of
/// the stage ([`StageNext`]), like an onion [`Middleware`]. A closure makes
/// one with [`as_middleware`].
pub trait StageMiddleware: Send + Sync + 'static {
    /// Processes `envelope`, usually by calling `next.run(envelope)`.
    fn handle<'a>(
        &'a self,
        envelope: Envelope,
        next: StageNext<'a>,
    ) -> BoxFuture<'a, Result<Envelope>>;
}

/// A filter or a middleware, as [`StagePipeline::use_`] accepts them.
#[derive(Clone)]
pub enum StageItem {
    /// A filter (runs before every middleware of its stage).
    Filter(Arc<dyn Filter>),
    /// A middleware.
    Middleware(Arc<dyn StageMiddleware>),
}

impl fmt::Debug for StageItem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StageItem::Filter(_) => "Filter",
            StageItem::Middleware(_) => "Middleware",
        })
    }
}

/// Registers a filter closure as a stage item; its argument needs no
/// annotation.
///
/// ```
/// use envoi_core::middleware::stage::{as_filter, FilterAction};
///
/// let tenants_only = as_filter(|envelope| match envelope.header("tenant") {
///     Some(_) => FilterAction::Continue,
///     None => FilterAction::Stop,
/// });
/// # let _ = tenants_only;
/// ```
pub fn as_filter<F>(filter: F) -> StageItem
where
    F: Fn(&Envelope) -> FilterAction + Send + Sync + 'static,
{
    StageItem::Filter(Arc::new(filter))
}

/// Registers a [`Filter`] type as a stage item.
pub fn as_stage_filter(filter: impl Filter) -> StageItem {
    StageItem::Filter(Arc::new(filter))
}

/// Registers a [`StageMiddleware`] type as a stage item.
pub fn as_stage_middleware(middleware: impl StageMiddleware) -> StageItem {
    StageItem::Middleware(Arc::new(middleware))
}

#[derive(Default, Clone)]
struct StageItems {
    filters: Vec<Arc<dyn Filter>>,
    middleware: Vec<Arc<dyn StageMiddleware>>,
}

impl StageItems {
    fn passes(&self, envelope: &Envelope) -> bool {
        self.filters
            .iter()
            .all(|f| f.filter(envelope) == FilterAction::Continue)
    }

    fn is_empty(&self) -> bool {
        self.filters.is_empty() && self.middleware.is_empty()
    }
}

/// What a stage's middleware chain ends in.
enum Terminal<'a> {
    /// The rest of the bus pipeline (the handler, or the send step).
    Rest(Next<'a>),
    /// In-process dispatch: the consuming stages around the rest.
    Consume(&'a StagePipeline, Next<'a>),
    /// A stage that runs after the handler: nothing more to do.
    Done,
}

/// The rest of a stage, handed to a [`StageMiddleware`]. Running it
/// consumes it.
#[must_use = "a stage middleware that drops `next` short-circuits the stage"]
pub struct StageNext<'a> {
    stage: PipelineStage,
    chain: &'a [Arc<dyn StageMiddleware>],
    terminal: Terminal<'a>,
    failure: Option<&'a BusError>,
}

impl<'a> StageNext<'a> {
    /// The stage being run.
    pub fn stage(&self) -> PipelineStage {
        self.stage
    }

    /// In [`AfterConsuming`](PipelineStage::AfterConsuming): the handler's
    /// error, if it failed. `None` otherwise, and for a received message
    /// whose failure the retry step took to schedule a retry (it carries
    /// one more [`RedeliveryStamp`](crate::envelope::stamp::RedeliveryStamp) than it
    /// came with).
    pub fn failure(&self) -> Option<&'a BusError> {
        self.failure
    }

    /// Runs the rest of the stage (and, in `outgoing` and
    /// `before_consuming`, what the stage wraps).
    pub fn run(self, envelope: Envelope) -> BoxFuture<'a, Result<Envelope>> {
        match self.chain.split_first() {
            Some((first, rest)) => first.handle(
                envelope,
                StageNext {
                    chain: rest,
                    ..self
                },
            ),
            None => match self.terminal {
                Terminal::Rest(next) => next.run(envelope).boxed(),
                Terminal::Consume(pipeline, next) => Box::pin(pipeline.consume(envelope, next)),
                Terminal::Done => Box::pin(std::future::ready(Ok(envelope))),
            },
        }
    }
}

impl fmt::Debug for StageNext<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StageNext")
            .field("stage", &self.stage)
            .field("remaining", &self.chain.len())
            .finish()
    }
}

/// Filters and middleware per stage, run as one bus [`Middleware`]; see the
/// [module docs](self).
#[derive(Default, Clone)]
pub struct StagePipeline {
    stages: [StageItems; 4],
}

impl fmt::Debug for StagePipeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("StagePipeline");
        for stage in [
            PipelineStage::Outgoing,
            PipelineStage::BeforeConsuming,
            PipelineStage::AfterConsuming,
            PipelineStage::OnConsumedSuccessfully,
        ] {
            let items = &self.stages[stage.index()];
            d.field(
                stage.as_str(),
                &format_args!(
                    "{} filter(s), {} middleware",
                    items.filters.len(),
                    items.middleware.len()
                ),
            );
        }
        d.finish()
    }
}

impl StagePipeline {
    /// An empty pipeline.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends filters and middleware to `stage`, keeping their order within
    /// each kind (filters still run before middleware).
    #[must_use = "`use_` returns the pipeline with the items added"]
    pub fn use_(
        mut self,
        stage: PipelineStage,
        items: impl IntoIterator<Item = StageItem>,
    ) -> Self {
        let slot = &mut self.stages[stage.index()];
        for item in items {
            match item {
                StageItem::Filter(f) => slot.filters.push(f),
                StageItem::Middleware(m) => slot.middleware.push(m),
            }
        }
        self
    }

    /// Appends every stage's filters and middleware of `other` to this
    /// pipeline's.
    #[must_use = "`merge` returns the pipeline with the items added"]
    pub fn merge(mut self, other: StagePipeline) -> Self {
        for (mine, theirs) in self.stages.iter_mut().zip(other.stages) {
            mine.filters.extend(theirs.filters);
            mine.middleware.extend(theirs.middleware);
        }
        self
    }

    /// Whether no stage has a filter or a middleware.
    pub fn is_empty(&self) -> bool {
        self.stages.iter().all(StageItems::is_empty)
    }

    fn items(&self, stage: PipelineStage) -> &StageItems {
        &self.stages[stage.index()]
    }

    /// Runs `outgoing` around `terminal`.
    async fn outgoing<'a>(
        &'a self,
        envelope: Envelope,
        terminal: Terminal<'a>,
    ) -> Result<Envelope> {
        let items = self.items(PipelineStage::Outgoing);
        if !items.passes(&envelope) {
            return Err(BusError::OutgoingFiltersBlocked {
                message: envelope.message_name(),
            });
        }
        StageNext {
            stage: PipelineStage::Outgoing,
            chain: &items.middleware,
            terminal,
            failure: None,
        }
        .run(envelope)
        .await
    }

    /// Runs the three consuming stages around the handler (`next`).
    async fn consume(&self, envelope: Envelope, next: Next<'_>) -> Result<Envelope> {
        let before = self.items(PipelineStage::BeforeConsuming);
        if !before.passes(&envelope) {
            // Processing of this envelope ends here, without an error.
            let stage = PipelineStage::BeforeConsuming.as_str();
            return Ok(envelope.with(StoppedByFilterStamp::new(stage)));
        }
        let input = envelope.clone();
        let out = StageNext {
            stage: PipelineStage::BeforeConsuming,
            chain: &before.middleware,
            terminal: Terminal::Rest(next),
            failure: None,
        }
        .run(envelope)
        .await;
        // A received message whose handler failed and that the retry step
        // sent back for another attempt comes back as a success: it was not
        // consumed successfully.
        let retried = matches!(&out, Ok(e) if was_retried(&input, e));

        let after = self.items(PipelineStage::AfterConsuming);
        let out = if after.is_empty() {
            out
        } else {
            match out {
                Ok(envelope) => {
                    self.after_stage(PipelineStage::AfterConsuming, envelope, None)
                        .await
                }
                Err(error) => {
                    let envelope = error.envelope().cloned().unwrap_or(input);
                    // The handler's error is the outcome, whatever the stage does.
                    let _ = self
                        .after_stage(PipelineStage::AfterConsuming, envelope, Some(&error))
                        .await;
                    Err(error)
                }
            }
        };

        match out {
            Ok(envelope) if retried => Ok(envelope),
            Ok(envelope) => {
                self.after_stage(PipelineStage::OnConsumedSuccessfully, envelope, None)
                    .await
            }
            Err(error) => Err(error),
        }
    }

    /// Runs a stage that comes after the handler.
    async fn after_stage(
        &self,
        stage: PipelineStage,
        envelope: Envelope,
        failure: Option<&BusError>,
    ) -> Result<Envelope> {
        let items = self.items(stage);
        if items.is_empty() || !items.passes(&envelope) {
            return Ok(envelope);
        }
        StageNext {
            stage,
            chain: &items.middleware,
            terminal: Terminal::Done,
            failure,
        }
        .run(envelope)
        .await
    }
}

impl Middleware for StagePipeline {
    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        if envelope.has::<ReceivedStamp>() {
            // Receiver side.
            return Box::pin(self.consume(envelope, next));
        }
        if next.sends(&envelope) {
            // Sender side of a routed message.
            return Box::pin(self.outgoing(envelope, Terminal::Rest(next)));
        }
        // In process: all four.
        Box::pin(self.outgoing(envelope, Terminal::Consume(self, next)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FailingEndpoint, FnEndpoint, Ping, RecordingEndpoint};
    use std::sync::Mutex;

    type Log = Arc<Mutex<Vec<String>>>;

    fn mark(log: &Log, name: &'static str) -> StageItem {
        let log = log.clone();
        as_middleware(move |envelope, next| {
            let log = log.clone();
            async move {
                log.lock().unwrap().push(format!("{name} in"));
                let out = next.run(envelope).await;
                log.lock().unwrap().push(format!("{name} out"));
                out
            }
        })
    }

    fn gate(log: &Log, name: &'static str, action: FilterAction) -> StageItem {
        let log = log.clone();
        as_filter(move |_| {
            log.lock().unwrap().push(format!("{name} filter"));
            action
        })
    }

    fn all_stages(log: &Log) -> StagePipeline {
        StagePipeline::new()
            .use_(PipelineStage::Outgoing, [mark(log, "outgoing")])
            .use_(PipelineStage::BeforeConsuming, [mark(log, "before")])
            .use_(PipelineStage::AfterConsuming, [mark(log, "after")])
            .use_(
                PipelineStage::OnConsumedSuccessfully,
                [mark(log, "success")],
            )
    }

    fn handler(log: &Log) -> FnEndpoint {
        let log = log.clone();
        FnEndpoint::new(move |e| {
            let log = log.clone();
            Box::pin(async move {
                log.lock().unwrap().push("handler".into());
                Ok(e)
            })
        })
    }

    #[tokio::test]
    async fn in_process_dispatch_runs_the_four_stages_in_order() {
        let log = Log::default();
        let end = handler(&log);
        all_stages(&log)
            .handle(Envelope::new(Ping), Next::to_endpoint(&end))
            .await
            .unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            [
                "outgoing in",
                "before in",
                "handler",
                "before out",
                "after in",
                "after out",
                "success in",
                "success out",
                "outgoing out",
            ]
        );
    }

    #[tokio::test]
    async fn filters_run_before_middleware_whatever_the_order_given() {
        let log = Log::default();
        let p = StagePipeline::new().use_(
            PipelineStage::BeforeConsuming,
            [
                mark(&log, "m1"),
                gate(&log, "f1", FilterAction::Continue),
                mark(&log, "m2"),
                gate(&log, "f2", FilterAction::Continue),
            ],
        );
        let end = RecordingEndpoint::new();
        p.handle(Envelope::new(Ping), end.next()).await.unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            [
                "f1 filter",
                "f2 filter",
                "m1 in",
                "m2 in",
                "m2 out",
                "m1 out"
            ]
        );
    }

    /// Lets through only messages with a tenant header.
    struct TenantsOnly;
    impl Filter for TenantsOnly {
        fn filter(&self, envelope: &Envelope) -> FilterAction {
            match envelope.header("tenant") {
                Some(_) => FilterAction::Continue,
                None => FilterAction::Stop,
            }
        }
    }

    #[tokio::test]
    async fn a_filter_type_registered_with_as_stage_filter_decides_like_a_closure() {
        let p = StagePipeline::new().use_(PipelineStage::Outgoing, [as_stage_filter(TenantsOnly)]);
        let end = RecordingEndpoint::new();
        let err = p.handle(Envelope::new(Ping), end.next()).await.unwrap_err();
        assert!(matches!(err, BusError::OutgoingFiltersBlocked { .. }));
        p.handle(
            Envelope::new(Ping).with_header("tenant", "acme"),
            end.next(),
        )
        .await
        .unwrap();
        assert_eq!(end.calls().len(), 1);
    }

    #[tokio::test]
    async fn an_outgoing_stop_blocks_the_dispatch() {
        let log = Log::default();
        let p = all_stages(&log).use_(
            PipelineStage::Outgoing,
            [gate(&log, "policy", FilterAction::Stop)],
        );
        let end = RecordingEndpoint::new();
        let err = p.handle(Envelope::new(Ping), end.next()).await.unwrap_err();
        assert!(matches!(
            err,
            BusError::OutgoingFiltersBlocked { message: "Ping" }
        ));
        assert!(end.calls().is_empty());
        assert_eq!(*log.lock().unwrap(), ["policy filter"]);
    }

    #[tokio::test]
    async fn a_before_consuming_stop_ends_processing_without_handler_or_error() {
        let log = Log::default();
        let p = all_stages(&log).use_(
            PipelineStage::BeforeConsuming,
            [gate(&log, "tenant", FilterAction::Stop)],
        );
        let end = RecordingEndpoint::new();
        p.handle(Envelope::new(Ping), end.next())
            .await
            .expect("no error");
        assert!(end.calls().is_empty());
        assert_eq!(
            *log.lock().unwrap(),
            ["outgoing in", "tenant filter", "outgoing out"]
        );
    }

    #[tokio::test]
    async fn after_consuming_runs_on_failure_and_sees_the_error_but_success_stage_does_not_run() {
        let log = Log::default();
        let seen: Arc<Mutex<Option<String>>> = Arc::default();
        let seen2 = seen.clone();
        let p = all_stages(&log).use_(
            PipelineStage::AfterConsuming,
            [as_middleware(move |e, next| {
                *seen2.lock().unwrap() = next.failure().map(|f| f.kind().to_string());
                next.run(e)
            })],
        );
        let end = FailingEndpoint::plain();
        let err = p.handle(Envelope::new(Ping), end.next()).await.unwrap_err();
        assert!(matches!(err, BusError::HandlerFailed { .. }));
        assert_eq!(seen.lock().unwrap().as_deref(), Some("handler"));
        assert_eq!(
            *log.lock().unwrap(),
            [
                "outgoing in",
                "before in",
                "before out",
                "after in",
                "after out",
                "outgoing out"
            ]
        );
    }

    #[tokio::test]
    async fn a_received_envelope_runs_only_the_consuming_stages() {
        let log = Log::default();
        let end = handler(&log);
        all_stages(&log)
            .handle(
                Envelope::new(Ping).with(ReceivedStamp::new("async")),
                Next::to_endpoint(&end),
            )
            .await
            .unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            [
                "before in",
                "handler",
                "before out",
                "after in",
                "after out",
                "success in",
                "success out"
            ]
        );
    }

    /// An endpoint that, like the bus, sends every envelope it is given.
    struct Sending(RecordingEndpoint);
    impl crate::middleware::Endpoint for Sending {
        fn call(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope>> {
            self.0.call(envelope)
        }
        fn sends(&self, _: &Envelope) -> bool {
            true
        }
    }

    #[tokio::test]
    async fn a_routed_envelope_runs_only_outgoing_on_the_sender_side() {
        let log = Log::default();
        let end = Sending(RecordingEndpoint::new());
        all_stages(&log)
            .handle(Envelope::new(Ping), Next::to_endpoint(&end))
            .await
            .unwrap();
        assert_eq!(*log.lock().unwrap(), ["outgoing in", "outgoing out"]);
        assert_eq!(end.0.calls().len(), 1);
    }

    #[tokio::test]
    async fn an_outgoing_middleware_sees_and_sets_headers() {
        let p = StagePipeline::new().use_(
            PipelineStage::Outgoing,
            [
                as_middleware(|e, next| next.run(e.with_header("tenant", "acme"))),
                as_filter(|e| {
                    if e.header("secret").is_some() {
                        FilterAction::Stop
                    } else {
                        FilterAction::Continue
                    }
                }),
            ],
        );
        let end = RecordingEndpoint::new();
        p.handle(Envelope::new(Ping), end.next()).await.unwrap();
        assert_eq!(end.single().header("tenant"), Some("acme"));
        let err = p
            .handle(Envelope::new(Ping).with_header("secret", "x"), end.next())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), "outgoing_blocked");
    }
}
