//! Hook middleware (Postboy): `can_handle`, `before`, `after` and
//! `dispose` instead of an onion with `next`.
//!
//! A [`Hook`] says whether it takes part in an operation
//! ([`can_handle`](Hook::can_handle)), may stop it before it runs
//! ([`before`](Hook::before) returning [`Decision::Interrupt`]), is told when
//! it succeeded ([`after`](Hook::after)) and releases what it holds when it
//! leaves the bus ([`dispose`](Hook::dispose)). [`HookMiddleware`] turns a
//! hook into one layer of the bus's user middleware, so hooks are added to
//! and removed from a live bus with
//! `MessageBus::add_middleware` and
//! `MessageBus::remove_middleware`.
//!
//! # Stages
//!
//! The [`Stage`] of an operation follows from how the message was
//! dispatched: [`Stage::Execute`] for a command, [`Stage::Callback`] for a
//! query (request/response), [`Stage::Publish`] for an event.
//!
//! # Semantics
//!
//! For one operation, hooks run in registration order, and for each:
//!
//! 1. `can_handle` is called exactly once;
//! 2. if it returned `true`, `before` is called; an
//!    [`Interrupt`](Decision::Interrupt) cancels the operation at once with
//!    [`BusError::Cancelled`] carrying the stage, the message id (from its
//!    [`MessageIdStamp`], stamped here when absent), the hook's name and the
//!    reason. Later hooks are not evaluated, the handler does not run and no
//!    `after` is called.
//!
//! When the operation succeeds, `after` is called **in registration order**
//! (not in reverse, as an onion would unwind) for every hook whose
//! `can_handle` returned `true`, with the handler's result. When it fails,
//! no `after` is called — nor when a received message's handler failed and
//! the retry step sent it back for another attempt.
//!
//! Consecutive hook layers of one bus cooperate to get that order: the
//! outermost hook layer of a dispatch collects the `after` calls of the
//! hook layers inside it and makes them, in order, once the operation has
//! succeeded. A dispatch made from inside a handler is an operation of its
//! own, with its own `after` calls.
//!
//! # Disposal
//!
//! `MessageBus::remove_middleware`
//! calls the hook's `dispose`; `MessageBus::dispose`
//! disposes every middleware and clears the chain. A hook is disposed at
//! most once, however many times either is called. Dispatches already in
//! flight finish on the chain they started with.
//!
//! ```
//! use envoi_core::middleware::hook::{Decision, Hook, HookContext, HookMiddleware};
//! use envoi_core::{BusError, Command, DispatchError, Message, Messenger, Stage};
//! use std::convert::Infallible;
//!
//! #[derive(Debug, Clone)]
//! struct DeleteAccount { admin: bool }
//! impl Message for DeleteAccount { const NAME: &'static str = "DeleteAccount"; }
//! impl Command for DeleteAccount { type Output = (); type Error = Infallible; }
//!
//! /// Lets only administrators execute `DeleteAccount`.
//! struct AdminOnly;
//!
//! impl Hook for AdminOnly {
//!     fn can_handle(&self, ctx: &HookContext<'_>) -> bool {
//!         ctx.stage() == Stage::Execute && ctx.message::<DeleteAccount>().is_some()
//!     }
//!     fn before(&self, ctx: &HookContext<'_>) -> Decision {
//!         match ctx.message::<DeleteAccount>() {
//!             Some(cmd) if cmd.admin => Decision::Continue,
//!             _ => Decision::interrupt("administrators only"),
//!         }
//!     }
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let messenger = Messenger::builder()
//!     .command_handler(|_: DeleteAccount| async { Ok::<_, Infallible>(()) })
//!     .middleware(HookMiddleware::new(AdminOnly))
//!     .build()
//!     .unwrap();
//! let bus = messenger.dispatcher();
//! bus.dispatch(DeleteAccount { admin: true }).await.unwrap();
//! match bus.dispatch(DeleteAccount { admin: false }).await {
//!     Err(DispatchError::Infrastructure(BusError::Cancelled { middleware, reason, .. })) => {
//!         assert_eq!(middleware, "AdminOnly");
//!         assert_eq!(reason.as_deref(), Some("administrators only"));
//!     }
//!     other => panic!("unexpected {other:?}"),
//! }
//! # });
//! ```

use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::{short_type_name, BoxFuture, Middleware, Next};
use crate::envelope::message::Message;
use crate::envelope::stamp::{HandledStamp, HandlerResult, MessageIdStamp, RedeliveryStamp};
use crate::envelope::Envelope;
use crate::error::{BusError, Result, Stage};

/// What [`Hook::before`] decides.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// Go on with the next hook, then the operation.
    Continue,
    /// Cancel the operation now.
    Interrupt {
        /// Why, for the [`BusError::Cancelled`] error.
        reason: Option<String>,
    },
}

impl Decision {
    /// An interruption with a reason.
    pub fn interrupt(reason: impl Into<String>) -> Self {
        Decision::Interrupt {
            reason: Some(reason.into()),
        }
    }

    /// An interruption without a reason.
    pub fn interrupt_silently() -> Self {
        Decision::Interrupt { reason: None }
    }
}

/// What a hook sees of the operation: its stage and its message.
#[derive(Debug, Clone, Copy)]
pub struct HookContext<'a> {
    stage: Stage,
    envelope: &'a Envelope,
}

impl<'a> HookContext<'a> {
    /// The context of an operation on `envelope`; the stage follows from the
    /// envelope's [`kind`](Envelope::kind).
    pub fn new(envelope: &'a Envelope) -> Self {
        Self {
            stage: Stage::from(envelope.kind()),
            envelope,
        }
    }

    /// The stage: `Execute` (command), `Callback` (query) or `Publish`
    /// (event).
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The envelope, with its stamps and headers.
    pub fn envelope(&self) -> &'a Envelope {
        self.envelope
    }

    /// The message, if it is an `M`.
    pub fn message<M: Message>(&self) -> Option<&'a M> {
        self.envelope.message::<M>()
    }

    /// The message's name.
    pub fn message_name(&self) -> &'static str {
        self.envelope.message_name()
    }

    /// The message's id, once a hook has taken part in the operation (the
    /// first participating hook stamps a [`MessageIdStamp`] when absent).
    pub fn message_id(&self) -> Option<uuid::Uuid> {
        self.envelope.last::<MessageIdStamp>().map(|s| s.id)
    }
}

/// A Postboy-style middleware: filter, pre-hook, post-hook, cleanup.
///
/// Every method has a default, so a hook implements only what it needs.
/// Keep `can_handle` fast and free of side effects: it is called for every
/// operation.
pub trait Hook: Send + Sync + 'static {
    /// A stable name for diagnostics and cancellation errors; the type name
    /// by default.
    fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed(short_type_name(std::any::type_name::<Self>()))
    }

    /// Whether this hook takes part in the operation. Called once per hook
    /// per operation. `true` by default.
    fn can_handle(&self, ctx: &HookContext<'_>) -> bool {
        let _ = ctx;
        true
    }

    /// Called before the operation if [`can_handle`](Self::can_handle)
    /// returned `true`; may interrupt it. Continues by default.
    fn before(&self, ctx: &HookContext<'_>) -> Decision {
        let _ = ctx;
        Decision::Continue
    }

    /// Called after the operation succeeded, if `can_handle` returned
    /// `true`. `result` is the value the last handler to run in this
    /// process returned (`()` for an event); absent when no handler ran
    /// here: a message sent to a transport that stores it, an event without
    /// handlers. Does nothing by default.
    fn after(&self, ctx: &HookContext<'_>, result: Option<&HandlerResult>) {
        let _ = (ctx, result);
    }

    /// Releases long-lived resources when the hook leaves the bus. Called
    /// at most once by [`HookMiddleware`]. Does nothing by default.
    fn dispose(&self) {}
}

/// Turns a [`Hook`] into a [`Middleware`]; see the [module docs](self).
pub struct HookMiddleware {
    hook: Arc<dyn Hook>,
    name: Cow<'static, str>,
    disposed: AtomicBool,
}

impl HookMiddleware {
    /// The middleware running `hook`.
    pub fn new(hook: impl Hook) -> Self {
        Self::from_arc(Arc::new(hook))
    }

    /// The middleware running a shared hook.
    pub fn from_arc(hook: Arc<dyn Hook>) -> Self {
        let name = hook.name();
        Self {
            hook,
            name,
            disposed: AtomicBool::new(false),
        }
    }

    /// Whether the hook was disposed.
    pub fn is_disposed(&self) -> bool {
        self.disposed.load(Ordering::Acquire)
    }
}

impl fmt::Debug for HookMiddleware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookMiddleware")
            .field("name", &self.name)
            .field("disposed", &self.is_disposed())
            .finish()
    }
}

/// A deferred `after` call.
#[derive(Clone)]
struct PendingAfter {
    hook: Arc<dyn Hook>,
    envelope: Envelope,
}

/// The `after` calls collected for the operation of one message.
struct Collector {
    /// Identifies the message of the operation (the address of the shared
    /// message, the same for every clone of its envelope).
    owner: usize,
    pending: RefCell<Vec<PendingAfter>>,
}

tokio::task_local! {
    static COLLECTOR: Collector;
}

fn owner_of(envelope: &Envelope) -> usize {
    envelope.message_any() as *const dyn std::any::Any as *const () as usize
}

fn result_of(envelope: &Envelope) -> Option<&HandlerResult> {
    envelope.last::<HandledStamp>().map(|s| &s.result)
}

/// Runs the collected `after` calls, in the order they were collected.
fn run_afters(pending: Vec<PendingAfter>, out: &Envelope) {
    let result = result_of(out);
    for p in pending {
        p.hook.after(&HookContext::new(&p.envelope), result);
    }
}

impl Middleware for HookMiddleware {
    fn takes_part(&self, envelope: &Envelope) -> bool {
        self.hook.can_handle(&HookContext::new(envelope))
    }

    fn handle<'a>(&'a self, envelope: Envelope, next: Next<'a>) -> BoxFuture<'a, Result<Envelope>> {
        if !next.caller_takes_part() && !self.hook.can_handle(&HookContext::new(&envelope)) {
            // Not taking part: no allocation of our own.
            return next.run(envelope).boxed();
        }
        let envelope = if envelope.has::<MessageIdStamp>() {
            envelope
        } else {
            envelope.with(MessageIdStamp::generate())
        };
        let ctx = HookContext::new(&envelope);
        if let Decision::Interrupt { reason } = self.hook.before(&ctx) {
            let error = BusError::Cancelled {
                stage: ctx.stage(),
                message_id: ctx
                    .message_id()
                    .map(|id| id.to_string())
                    .unwrap_or_default(),
                middleware: self.name.to_string(),
                reason,
            };
            return Box::pin(std::future::ready(Err(error)));
        }
        let owner = owner_of(&envelope);
        let pending = PendingAfter {
            hook: self.hook.clone(),
            envelope: envelope.clone(),
        };
        // Inside the operation of an outer hook layer: hand it our `after`.
        let joined = COLLECTOR
            .try_with(|c| c.owner == owner)
            .unwrap_or(false)
            .then(|| {
                COLLECTOR.with(|c| {
                    let mut list = c.pending.borrow_mut();
                    list.push(pending.clone());
                    list.len() - 1
                })
            });
        match joined {
            Some(index) => Box::pin(async move {
                let out = next.run(envelope).await;
                if out.is_err() {
                    // Failed below us: no `after` for us or anyone inside.
                    COLLECTOR.with(|c| c.pending.borrow_mut().truncate(index));
                }
                out
            }),
            None => {
                let collector = Collector {
                    owner,
                    pending: RefCell::new(vec![pending]),
                };
                Box::pin(COLLECTOR.scope(collector, async move {
                    // Counted rather than kept: a copy of the envelope
                    // would make the pipeline copy its stamps to add more.
                    let redeliveries = envelope.all::<RedeliveryStamp>().count();
                    let out = next.run(envelope).await;
                    let pending = COLLECTOR.with(|c| std::mem::take(&mut *c.pending.borrow_mut()));
                    match &out {
                        // A received message whose handler failed and that
                        // the retry step sent back for another attempt
                        // comes back as a success: the operation failed.
                        Ok(out) if out.all::<RedeliveryStamp>().count() > redeliveries => {}
                        Ok(out) => run_afters(pending, out),
                        Err(_) => {}
                    }
                    out
                }))
            }
        }
    }

    fn name(&self) -> Cow<'static, str> {
        self.name.clone()
    }

    fn dispose(&self) {
        if !self.disposed.swap(true, Ordering::AcqRel) {
            self.hook.dispose();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::message::MessageKind;
    use crate::testing::{FailingEndpoint, Ping, RecordingEndpoint};
    use crate::MiddlewareStack;
    use std::sync::Mutex;

    type Log = Arc<Mutex<Vec<String>>>;

    struct Probe {
        name: &'static str,
        can: bool,
        interrupt: bool,
        log: Log,
    }

    impl Hook for Probe {
        fn name(&self) -> Cow<'static, str> {
            Cow::Borrowed(self.name)
        }
        fn can_handle(&self, ctx: &HookContext<'_>) -> bool {
            self.log
                .lock()
                .unwrap()
                .push(format!("{}.can_handle({})", self.name, ctx.stage()));
            self.can
        }
        fn before(&self, _: &HookContext<'_>) -> Decision {
            self.log
                .lock()
                .unwrap()
                .push(format!("{}.before", self.name));
            if self.interrupt {
                Decision::interrupt("nope")
            } else {
                Decision::Continue
            }
        }
        fn after(&self, _: &HookContext<'_>, result: Option<&HandlerResult>) {
            self.log.lock().unwrap().push(format!(
                "{}.after({:?})",
                self.name,
                result.and_then(|r| r.downcast_ref::<u8>())
            ));
        }
        fn dispose(&self) {
            self.log
                .lock()
                .unwrap()
                .push(format!("{}.dispose", self.name));
        }
    }

    fn probe(name: &'static str, can: bool, interrupt: bool, log: &Log) -> Arc<dyn Middleware> {
        Arc::new(HookMiddleware::new(Probe {
            name,
            can,
            interrupt,
            log: log.clone(),
        }))
    }

    #[tokio::test]
    async fn afters_run_in_registration_order_after_success() {
        let log = Log::default();
        let stack = MiddlewareStack::new([
            probe("a", true, false, &log),
            probe("b", false, false, &log),
            probe("c", true, false, &log),
        ]);
        let end = RecordingEndpoint::new();
        stack
            .run_with(Envelope::new(Ping), &end)
            .await
            .expect("dispatch succeeds");
        assert_eq!(end.calls().len(), 1);
        assert_eq!(
            *log.lock().unwrap(),
            [
                "a.can_handle(Execute)",
                "a.before",
                "b.can_handle(Execute)",
                "c.can_handle(Execute)",
                "c.before",
                "a.after(None)",
                "c.after(None)",
            ]
        );
    }

    #[tokio::test]
    async fn an_interrupt_cancels_with_stage_id_name_and_reason() {
        let log = Log::default();
        let stack = MiddlewareStack::new([
            probe("a", true, false, &log),
            probe("b", true, true, &log),
            probe("c", true, false, &log),
        ]);
        let end = RecordingEndpoint::new();
        let err = stack
            .run_with(Envelope::query(Ping), &end)
            .await
            .unwrap_err();
        match err {
            BusError::Cancelled {
                stage,
                message_id,
                middleware,
                reason,
            } => {
                assert_eq!(stage, Stage::Callback);
                assert!(uuid::Uuid::parse_str(&message_id).is_ok(), "{message_id}");
                assert_eq!(middleware, "b");
                assert_eq!(reason.as_deref(), Some("nope"));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(end.calls().is_empty(), "the handler must not run");
        assert_eq!(
            *log.lock().unwrap(),
            [
                "a.can_handle(Callback)",
                "a.before",
                "b.can_handle(Callback)",
                "b.before"
            ]
        );
    }

    #[tokio::test]
    async fn the_cancellation_names_the_existing_message_id() {
        let log = Log::default();
        let id = MessageIdStamp::generate();
        let err = probe("x", true, true, &log)
            .handle(Envelope::event(Ping).with(id), Next::passthrough())
            .await
            .unwrap_err();
        match err {
            BusError::Cancelled {
                stage, message_id, ..
            } => {
                assert_eq!(stage, Stage::Publish);
                assert_eq!(message_id, id.id.to_string());
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn no_after_is_called_when_the_operation_fails() {
        let log = Log::default();
        let stack =
            MiddlewareStack::new([probe("a", true, false, &log), probe("b", true, false, &log)]);
        let end = FailingEndpoint::plain();
        assert!(stack.run_with(Envelope::new(Ping), &end).await.is_err());
        assert!(log.lock().unwrap().iter().all(|l| !l.contains("after")));
    }

    #[tokio::test]
    async fn after_receives_the_handler_result() {
        let log = Log::default();
        let mw = probe("a", true, false, &log);
        let end = crate::testing::FnEndpoint::new(|e: Envelope| {
            Box::pin(async move { Ok(e.with(HandledStamp::new("h", HandlerResult::new(7u8)))) })
        });
        mw.handle(Envelope::new(Ping), Next::to_endpoint(&end))
            .await
            .unwrap();
        assert!(log
            .lock()
            .unwrap()
            .contains(&"a.after(Some(7))".to_string()));
    }

    #[tokio::test]
    async fn a_participating_hook_stamps_a_message_id_once() {
        let log = Log::default();
        let stack =
            MiddlewareStack::new([probe("a", true, false, &log), probe("b", true, false, &log)]);
        let end = RecordingEndpoint::new();
        stack.run_with(Envelope::new(Ping), &end).await.unwrap();
        assert_eq!(end.single().all::<MessageIdStamp>().count(), 1);
    }

    #[tokio::test]
    async fn a_hook_that_does_not_take_part_leaves_the_envelope_alone() {
        let log = Log::default();
        let end = RecordingEndpoint::new();
        probe("a", false, false, &log)
            .handle(Envelope::new(Ping), end.next())
            .await
            .unwrap();
        assert_eq!(end.single().stamps().count(), 0);
        assert_eq!(*log.lock().unwrap(), ["a.can_handle(Execute)"]);
    }

    #[test]
    fn dispose_reaches_the_hook_once() {
        let log = Log::default();
        let mw = probe("a", true, false, &log);
        mw.dispose();
        mw.dispose();
        assert_eq!(*log.lock().unwrap(), ["a.dispose"]);
    }

    #[test]
    fn the_name_defaults_to_the_type_name() {
        struct AuditTrail;
        impl Hook for AuditTrail {}
        assert_eq!(HookMiddleware::new(AuditTrail).name(), "AuditTrail");
        assert_eq!(Stage::from(MessageKind::Query), Stage::Callback);
    }
}
