//! Stage middleware made from a closure: [`as_middleware`], with an owned
//! handle to the rest of the stage ([`OwnedStageNext`]), as
//! [`from_fn`](crate::middleware::from_fn) makes onion middleware.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use super::{PipelineStage, StageItem, StageMiddleware, StageNext};
use crate::envelope::Envelope;
use crate::error::{BusError, Result};
use crate::middleware::relay::{relay, Link, OwnedNextFuture};
use crate::BoxFuture;

/// Registers a closure as a stage middleware. It takes the envelope and an
/// owned handle to the rest of the stage ([`OwnedStageNext`]) and returns
/// a future of the envelope that comes back; neither argument needs an
/// annotation, and the future no box.
///
/// ```
/// use envoi_core::middleware::stage::{as_middleware, PipelineStage, StagePipeline};
///
/// let timed = as_middleware(|envelope, next| async move {
///     let start = std::time::Instant::now();
///     let out = next.run(envelope).await;
///     let _elapsed = start.elapsed();
///     out
/// });
/// let pipeline = StagePipeline::new().use_(PipelineStage::BeforeConsuming, [timed]);
/// # let _ = pipeline;
/// ```
///
/// The closure behaves as [`StageMiddleware::handle`]. A closure
/// middleware costs what [`from_fn`](crate::middleware::from_fn) tells: one
/// allocation more per call than a [`StageMiddleware`] type, which
/// [`as_stage_middleware`](super::as_stage_middleware) registers, and in
/// `after_consuming` after a failure one more for the failure's message
/// ([`OwnedStageNext::failure`]).
pub fn as_middleware<F, Fut>(middleware: F) -> StageItem
where
    F: Fn(Envelope, OwnedStageNext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Envelope>> + Send + 'static,
{
    StageItem::Middleware(Arc::new(FnStageMiddleware(middleware)))
}

/// A stage middleware made from a closure.
struct FnStageMiddleware<F>(F);

impl<F, Fut> StageMiddleware for FnStageMiddleware<F>
where
    F: Fn(Envelope, OwnedStageNext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Envelope>> + Send + 'static,
{
    fn handle<'a>(
        &'a self,
        envelope: Envelope,
        next: StageNext<'a>,
    ) -> BoxFuture<'a, Result<Envelope>> {
        let link = Link::new();
        let stage = next.stage();
        let handle = OwnedStageNext {
            link: link.clone(),
            stage,
            failure: next.failure().map(StageFailure::of),
        };
        let fut = (self.0)(envelope, handle);
        Box::pin(relay(
            link,
            fut,
            move |envelope| next.run(envelope),
            stage.middleware_name(),
        ))
    }
}

/// The rest of a stage, handed to an [`as_middleware`] closure: the owned,
/// `'static` counterpart of [`StageNext`], which the closure's future can
/// own.
///
/// Running it consumes it, so it runs at most once; dropping it without
/// running it short-circuits the stage. As with
/// [`OwnedNext`](crate::middleware::OwnedNext), the rest runs in the
/// middleware's own future, and a handle run once its middleware has
/// finished fails with
/// [`OwnedNextError::Gone`](crate::middleware::OwnedNextError::Gone).
#[must_use = "a stage middleware that drops `next` short-circuits the stage"]
pub struct OwnedStageNext {
    link: Arc<Link>,
    stage: PipelineStage,
    failure: Option<StageFailure>,
}

impl OwnedStageNext {
    /// The stage being run.
    pub fn stage(&self) -> PipelineStage {
        self.stage
    }

    /// In [`AfterConsuming`](PipelineStage::AfterConsuming): what the
    /// handler's error was, if it failed; `None` when [`StageNext::failure`]
    /// is. The error itself stays with the dispatch, which returns it; a
    /// [`StageMiddleware`] type sees it whole.
    pub fn failure(&self) -> Option<&StageFailure> {
        self.failure.as_ref()
    }

    /// Runs the rest of the stage (and, in `outgoing` and
    /// `before_consuming`, what the stage wraps), once the returned future
    /// is first polled.
    pub fn run(self, envelope: Envelope) -> OwnedNextFuture {
        OwnedNextFuture::new(self.link, envelope)
    }
}

impl fmt::Debug for OwnedStageNext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedStageNext")
            .field("stage", &self.stage)
            .field("failure", &self.failure)
            .finish()
    }
}

/// What an [`OwnedStageNext`] tells of the handler's error: its
/// [`kind`](BusError::kind) and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageFailure {
    kind: &'static str,
    message: String,
}

impl StageFailure {
    fn of(error: &BusError) -> Self {
        Self {
            kind: error.kind(),
            message: error.to_string(),
        }
    }

    /// The error's [`kind`](BusError::kind): `handler` for a handler that
    /// failed.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// The error's message, as it displays.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for StageFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}
