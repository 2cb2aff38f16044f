//! Effect-style typed dispatchers with the default span, `metrics()`,
//! `deadline(d)` and custom middleware, through a real bus.

use envoi_core::testing::Within;

/// The longest a test waits for a worker to stop before it fails (real
/// time, whatever the tokio clock does).
const WAIT: std::time::Duration = std::time::Duration::from_secs(120);

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoi_core::middleware::BoxFuture;
use envoi_core::typed::deadline::deadline;
use envoi_core::typed::metrics::{
    metrics, DISPATCH_DURATION, DISPATCH_TOTAL, LABEL_OUTCOME, LABEL_SIDE, LABEL_TAG,
};
use envoi_core::typed::span::SpanAttributes;
use envoi_core::typed::{DispatchContext, DispatchMiddleware, DispatchNext};
use envoi_core::{
    BusError, Command, DispatchError, Dispatcher, Envelope, Event, Message, Messenger, Query,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Instrument, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

// ----- messages -----

#[derive(Debug, Clone)]
struct PlaceOrder {
    quantity: u32,
    token: String,
}
impl Message for PlaceOrder {
    const NAME: &'static str = "PlaceOrder";
}
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("out of stock")]
struct OutOfStock;
impl Command for PlaceOrder {
    type Output = u32;
    type Error = OutOfStock;
}

#[derive(Debug, Clone)]
struct OrderTotal;
impl Message for OrderTotal {
    const NAME: &'static str = "OrderTotal";
}
impl Query for OrderTotal {
    type Output = u64;
    type Error = Infallible;
}

#[derive(Debug, Clone)]
struct OrderPlaced;
impl Message for OrderPlaced {
    const NAME: &'static str = "OrderPlaced";
}
impl Event for OrderPlaced {
    type Error = Infallible;
}

/// Handlers: `PlaceOrder` fails for quantity 0 and sleeps `quantity`
/// seconds when above 100; it notes the name of the span it runs in.
fn messenger(seen: &Arc<Mutex<Vec<String>>>) -> Messenger {
    let seen = seen.clone();
    Messenger::builder()
        .command_handler(move |c: PlaceOrder| {
            let seen = seen.clone();
            async move {
                let current = tracing::Span::current();
                let name = current.metadata().map(|m| m.name()).unwrap_or("none");
                seen.lock().unwrap().push(format!("handler in {name}"));
                if c.quantity > 100 {
                    tokio::time::sleep(Duration::from_secs(u64::from(c.quantity))).await;
                }
                if c.quantity == 0 || c.token.is_empty() {
                    Err(OutOfStock)
                } else {
                    Ok(c.quantity)
                }
            }
        })
        .query_handler(|_: OrderTotal| async { Ok::<_, Infallible>(42) })
        .event_handler(|_: OrderPlaced| async { Ok::<_, Infallible>(()) })
        .build()
        .unwrap()
}

fn order(quantity: u32) -> PlaceOrder {
    PlaceOrder {
        quantity,
        token: "Bearer s3cr3t".into(),
    }
}

// ----- a subscriber that records spans -----

#[derive(Debug, Clone)]
struct SpanRecord {
    id: u64,
    name: String,
    parent: Option<String>,
    fields: BTreeMap<String, String>,
}

#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<SpanRecord>>>);

impl Spans {
    fn all(&self) -> Vec<SpanRecord> {
        self.0.lock().unwrap().clone()
    }
    fn named(&self, name: &str) -> Vec<SpanRecord> {
        self.all().into_iter().filter(|s| s.name == name).collect()
    }
}

struct Visitor<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Visitor<'_> {
    fn record_i64(&mut self, f: &Field, v: i64) {
        self.0.insert(f.name().into(), format!("i64:{v}"));
    }
    fn record_u64(&mut self, f: &Field, v: u64) {
        self.0.insert(f.name().into(), format!("u64:{v}"));
    }
    fn record_f64(&mut self, f: &Field, v: f64) {
        self.0.insert(f.name().into(), format!("f64:{v}"));
    }
    fn record_bool(&mut self, f: &Field, v: bool) {
        self.0.insert(f.name().into(), format!("bool:{v}"));
    }
    fn record_str(&mut self, f: &Field, v: &str) {
        self.0.insert(f.name().into(), format!("str:{v}"));
    }
    fn record_debug(&mut self, f: &Field, v: &dyn fmt::Debug) {
        self.0.insert(f.name().into(), format!("debug:{v:?}"));
    }
}

/// Records spans into the sink of the test that holds [`capture`]'s guard.
struct Capture;

/// Where [`Capture`] records: the running test's spans.
static SINK: Mutex<Option<Spans>> = Mutex::new(None);

fn sink() -> Option<Spans> {
    SINK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(sink) = sink() else { return };
        let parent = ctx
            .span(id)
            .and_then(|s| s.parent())
            .map(|p| p.name().to_string());
        let mut fields = BTreeMap::new();
        attrs.record(&mut Visitor(&mut fields));
        sink.0.lock().unwrap().push(SpanRecord {
            id: id.into_u64(),
            name: attrs.metadata().name().to_string(),
            parent,
            fields,
        });
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let Some(sink) = sink() else { return };
        let mut spans = sink.0.lock().unwrap();
        if let Some(s) = spans.iter_mut().find(|s| s.id == id.into_u64()) {
            values.record(&mut Visitor(&mut s.fields));
        }
    }
}

/// The tests of this binary run one at a time under one process-wide
/// capturing subscriber, installed once: tracing's level hint and callsite
/// interest are process-wide, so per-thread subscribers coming and going on
/// other test threads could change whether a test's spans are enabled.
struct Captured {
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl Drop for Captured {
    fn drop(&mut self) {
        *SINK
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

fn capture() -> (Spans, Captured) {
    static SERIAL: Mutex<()> = Mutex::new(());
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    let serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    INSTALLED.call_once(|| {
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Capture))
            .expect("no other global subscriber in this test binary");
    });
    let spans = Spans::default();
    *SINK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(spans.clone());
    (spans, Captured { _serial: serial })
}

// ----- span -----

#[tokio::test]
async fn command_and_query_dispatchers_open_one_span_named_side_dot_tag() {
    let (spans, _guard) = capture();
    let m = messenger(&Arc::default());
    let bus = m.dispatcher();
    bus.dispatch(order(2)).await.unwrap();
    bus.ask(OrderTotal).await.unwrap();
    bus.dispatch(order(3)).await.unwrap();
    let names: Vec<_> = spans.all().into_iter().map(|s| s.name).collect();
    assert_eq!(
        names,
        [
            "command.PlaceOrder",
            "query.OrderTotal",
            "command.PlaceOrder"
        ]
    );
}

#[tokio::test]
async fn events_get_a_span_only_when_asked() {
    let (spans, _guard) = capture();
    let m = messenger(&Arc::default());
    m.dispatcher().publish(OrderPlaced).await.unwrap();
    assert!(spans.all().is_empty());
    m.dispatcher()
        .span_events(true)
        .publish(OrderPlaced)
        .await
        .unwrap();
    assert_eq!(spans.named("event.OrderPlaced").len(), 1);
}

#[tokio::test]
async fn without_span_opens_none() {
    let (spans, _guard) = capture();
    let m = messenger(&Arc::default());
    m.dispatcher()
        .without_span()
        .dispatch(order(1))
        .await
        .unwrap();
    assert!(spans.all().is_empty());
}

#[tokio::test]
async fn the_span_is_a_child_of_the_callers_span_and_the_handler_runs_inside_it() {
    let (spans, _guard) = capture();
    let seen = Arc::default();
    let m = messenger(&seen);
    let bus = m.dispatcher();
    async { bus.dispatch(order(1)).await.unwrap() }
        .instrument(tracing::info_span!("http.request"))
        .await;
    let dispatch = spans.named("command.PlaceOrder");
    assert_eq!(dispatch.len(), 1);
    assert_eq!(dispatch[0].parent.as_deref(), Some("http.request"));
    assert_eq!(*seen.lock().unwrap(), ["handler in command.PlaceOrder"]);
}

/// Notes the span it runs in.
struct WhereAmI(Arc<Mutex<Vec<String>>>);

impl DispatchMiddleware for WhereAmI {
    fn wrap<'a>(
        &'a self,
        _ctx: DispatchContext,
        next: DispatchNext<'a>,
    ) -> BoxFuture<'a, envoi_core::Result<Envelope>> {
        let current = tracing::Span::current();
        let name = current.metadata().map(|m| m.name()).unwrap_or("none");
        self.0.lock().unwrap().push(format!("middleware in {name}"));
        next.run()
    }
}

#[tokio::test]
async fn a_callers_own_middleware_runs_inside_the_dispatch_span() {
    let (_spans, _guard) = capture();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let m = messenger(&seen);
    m.dispatcher()
        .with(WhereAmI(seen.clone()))
        .dispatch(order(1))
        .await
        .unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [
            "middleware in command.PlaceOrder",
            "handler in command.PlaceOrder"
        ]
    );
}

#[tokio::test]
async fn span_attributes_come_only_from_the_tags_extractor_with_their_own_types() {
    let (spans, _guard) = capture();
    let m = messenger(&Arc::default());
    let orders = m
        .dispatcher()
        .span_attributes(SpanAttributes::new().tag(|p: &PlaceOrder| {
            [
                ("order.quantity", p.quantity.into()),
                ("order.bulk", (p.quantity > 10).into()),
                ("order.ratio", (f64::from(p.quantity) / 4.0).into()),
                ("order.channel", "web".into()),
            ]
        }));
    orders.dispatch(order(3)).await.unwrap();
    orders.ask(OrderTotal).await.unwrap();

    let placed = &spans.named("command.PlaceOrder")[0];
    assert_eq!(placed.fields.get("order.quantity").unwrap(), "i64:3");
    assert_eq!(placed.fields.get("order.bulk").unwrap(), "bool:false");
    assert_eq!(placed.fields.get("order.ratio").unwrap(), "f64:0.75");
    assert_eq!(placed.fields.get("order.channel").unwrap(), "str:web");
    assert_eq!(placed.fields.len(), 4, "{:?}", placed.fields);
    for span in spans.all() {
        assert!(
            span.fields.values().all(|v| !v.contains("s3cr3t")),
            "the token must not reach a span: {span:?}"
        );
    }
    let total = &spans.named("query.OrderTotal")[0];
    assert!(total.fields.is_empty(), "no extractor, no attributes");
}

#[tokio::test]
async fn a_failed_dispatch_records_an_error_status_on_its_span() {
    let (spans, _guard) = capture();
    let m = messenger(&Arc::default());
    let err = m.dispatcher().dispatch(order(0)).await.unwrap_err();
    assert_eq!(err.domain(), Some(&OutOfStock));
    m.dispatcher().dispatch(order(1)).await.unwrap();
    let records = spans.named("command.PlaceOrder");
    assert_eq!(
        records[0].fields.get("otel.status_code").unwrap(),
        "str:error"
    );
    assert_eq!(
        records[0].fields.get("otel.status_description").unwrap(),
        "str:handler"
    );
    assert!(
        !records[1].fields.contains_key("otel.status_code"),
        "success leaves the status unset"
    );
}

// ----- metrics() -----

/// `(name, labels, value)` of one metric.
type Metric = (String, Vec<(String, String)>, DebugValue);

fn read(snapshotter: &Snapshotter) -> Vec<Metric> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(ck, _, _, v)| {
            let (_, key) = ck.into_parts();
            let labels = key
                .labels()
                .map(|l| (l.key().to_string(), l.value().to_string()))
                .collect();
            (key.name().to_string(), labels, v)
        })
        .collect()
}

fn count(snap: &[Metric], tag: &str, outcome: &str) -> u64 {
    snap.iter()
        .filter_map(|(name, labels, v)| {
            let has = |k: &str, val: &str| labels.iter().any(|(lk, lv)| lk == k && lv == val);
            match v {
                DebugValue::Counter(c)
                    if name == DISPATCH_TOTAL
                        && has(LABEL_TAG, tag)
                        && has(LABEL_OUTCOME, outcome) =>
                {
                    Some(*c)
                }
                _ => None,
            }
        })
        .sum()
}

fn durations(snap: &[Metric], tag: &str) -> Vec<f64> {
    snap.iter()
        .filter(|(name, labels, _)| {
            name == DISPATCH_DURATION && labels.iter().any(|(k, v)| k == LABEL_TAG && v == tag)
        })
        .flat_map(|(_, _, v)| match v {
            DebugValue::Histogram(h) => h.iter().map(|x| x.into_inner()).collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// Runs `f` on a paused current-thread runtime with a recorder installed.
fn recorded<F: Future>(f: impl FnOnce() -> F) -> (F::Output, Snapshotter) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let out = metrics::with_local_recorder(&recorder, || rt.block_on(f()));
    (out, snapshotter)
}

#[test]
fn metric_names_and_labels_are_the_public_contract() {
    let (_spans, _captured) = capture();
    assert_eq!(DISPATCH_TOTAL, "cqrs_dispatch_total");
    assert_eq!(DISPATCH_DURATION, "cqrs_dispatch_duration");
    assert_eq!(
        [LABEL_TAG, LABEL_SIDE, LABEL_OUTCOME],
        ["cqrs.tag", "cqrs.side", "cqrs.outcome"]
    );
}

#[test]
fn metrics_counts_successes_and_failures_and_times_both() {
    let (_spans, _captured) = capture();
    let m = messenger(&Arc::default());
    let (_, snap) = recorded(|| async {
        let orders = m.dispatcher().with(metrics());
        orders.dispatch(order(1)).await.unwrap();
        orders.dispatch(order(2)).await.unwrap();
        assert_eq!(
            orders.dispatch(order(0)).await.unwrap_err().domain(),
            Some(&OutOfStock)
        );
        orders.ask(OrderTotal).await.unwrap();
    });
    let snap = read(&snap);
    assert_eq!(count(&snap, "PlaceOrder", "success"), 2);
    assert_eq!(count(&snap, "PlaceOrder", "failure"), 1);
    assert_eq!(count(&snap, "OrderTotal", "success"), 1);
    assert_eq!(durations(&snap, "PlaceOrder").len(), 3);
    let side = snap
        .iter()
        .find(|(n, l, _)| n == DISPATCH_TOTAL && l.iter().any(|(_, v)| v == "OrderTotal"))
        .map(|(_, l, _)| l.clone())
        .unwrap();
    assert!(side.contains(&(LABEL_SIDE.to_string(), "query".to_string())));
}

#[test]
fn the_duration_covers_a_slow_failure_as_well_as_a_success() {
    let (_spans, _captured) = capture();
    let m = messenger(&Arc::default());
    let (_, snap) = recorded(|| async {
        // Quantity 150 sleeps 150 s (virtual time) and succeeds.
        let orders = m.dispatcher().with(metrics());
        orders.dispatch(order(150)).await.unwrap();
        // A deadline inside metrics turns a slow dispatch into a failure
        // after 5 s; the duration still counts it.
        let limited = m
            .dispatcher()
            .with(metrics())
            .with(deadline(Duration::from_secs(5)));
        let err = limited.dispatch(order(200)).await.unwrap_err();
        assert!(matches!(
            err,
            DispatchError::Infrastructure(BusError::DeadlineExceeded { .. })
        ));
    });
    let snap = read(&snap);
    let mut d = durations(&snap, "PlaceOrder");
    d.sort_by(f64::total_cmp);
    assert_eq!(d, [5.0, 150.0]);
    assert_eq!(count(&snap, "PlaceOrder", "success"), 1);
    assert_eq!(count(&snap, "PlaceOrder", "failure"), 1);
}

#[test]
fn metrics_inside_a_deadline_count_the_abandoned_dispatch_as_cancelled() {
    let (_spans, _captured) = capture();
    let m = messenger(&Arc::default());
    let (_, snap) = recorded(|| async {
        let limited = m
            .dispatcher()
            .with(deadline(Duration::from_secs(1)))
            .with(metrics());
        assert!(limited.dispatch(order(300)).await.is_err());
    });
    let snap = read(&snap);
    assert_eq!(count(&snap, "PlaceOrder", "cancelled"), 1);
    assert_eq!(count(&snap, "PlaceOrder", "failure"), 0);
    assert_eq!(durations(&snap, "PlaceOrder"), [1.0]);
}

#[test]
fn metrics_after_a_custom_middleware_still_records() {
    let (_spans, _captured) = capture();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let m = messenger(&seen);
    let (_, snap) = recorded(|| async {
        let orders = m.dispatcher().with(WhereAmI(seen.clone())).with(metrics());
        orders.dispatch(order(1)).await.unwrap();
    });
    assert_eq!(count(&read(&snap), "PlaceOrder", "success"), 1);
    assert_eq!(seen.lock().unwrap().len(), 2);
}

// ----- deadline(d) and cancellation -----

/// A handler that never finishes and tells when its future is dropped.
fn stuck_messenger(dropped: &Arc<AtomicBool>, started: tokio::sync::mpsc::Sender<()>) -> Messenger {
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let dropped = dropped.clone();
    Messenger::builder()
        .command_handler(move |c: PlaceOrder| {
            let flag = Flag(dropped.clone());
            let started = started.clone();
            async move {
                let _flag = flag;
                let _ = started.send(()).await;
                std::future::pending::<()>().await;
                Ok::<_, OutOfStock>(c.quantity)
            }
        })
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn an_expired_deadline_drops_the_handler_and_is_an_infrastructure_error() {
    let (_spans, _captured) = capture();
    let dropped = Arc::new(AtomicBool::new(false));
    let (tx, _rx) = tokio::sync::mpsc::channel(4);
    let m = stuck_messenger(&dropped, tx);
    let err = m
        .dispatcher()
        .with(deadline(Duration::from_secs(5)))
        .dispatch(order(1))
        .await
        .unwrap_err();
    match err {
        DispatchError::Infrastructure(BusError::DeadlineExceeded { tag, side, after }) => {
            assert_eq!(tag, "PlaceOrder");
            assert_eq!(side, "command");
            assert_eq!(after, Duration::from_secs(5));
        }
        other => panic!("expected DeadlineExceeded, got {other:?}"),
    }
    assert!(
        dropped.load(Ordering::SeqCst),
        "the handler's future is dropped"
    );
}

#[tokio::test(start_paused = true)]
async fn a_callers_own_timeout_cancels_the_handler() {
    let (_spans, _captured) = capture();
    let dropped = Arc::new(AtomicBool::new(false));
    let (tx, _rx) = tokio::sync::mpsc::channel(4);
    let m = stuck_messenger(&dropped, tx);
    let bus = m.dispatcher();
    let timed = tokio::time::timeout(Duration::from_secs(3), bus.dispatch(order(1))).await;
    assert!(timed.is_err());
    assert!(dropped.load(Ordering::SeqCst));
}

#[tokio::test]
async fn dropping_the_dispatch_future_cancels_the_handler() {
    let (_spans, _captured) = capture();
    let dropped = Arc::new(AtomicBool::new(false));
    let (tx, mut started) = tokio::sync::mpsc::channel(4);
    let m = stuck_messenger(&dropped, tx);
    let bus = m.dispatcher();
    let task = tokio::spawn(async move { bus.dispatch(order(1)).await });
    started.recv().await.unwrap();
    assert!(!dropped.load(Ordering::SeqCst), "still running");
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert!(
        dropped.load(Ordering::SeqCst),
        "a client hanging up stops the handler"
    );
}

// ----- custom middleware -----

/// The audit-log example of the specification: records tag and side after each success.
#[derive(Clone, Default)]
struct AuditSink(Arc<Mutex<Vec<String>>>);

struct AuditLog(AuditSink);

impl DispatchMiddleware for AuditLog {
    fn wrap<'a>(
        &'a self,
        ctx: DispatchContext,
        next: DispatchNext<'a>,
    ) -> BoxFuture<'a, envoi_core::Result<Envelope>> {
        Box::pin(async move {
            let out = next.run().within(WAIT, "the worker to stop").await;
            if out.is_ok() {
                self.0
                     .0
                    .lock()
                    .unwrap()
                    .push(format!("{}.{}", ctx.side, ctx.tag));
            }
            out
        })
    }
}

#[tokio::test]
async fn the_audit_log_middleware_composes_without_touching_output_or_error_types() {
    let (_spans, _captured) = capture();
    let m = messenger(&Arc::default());
    let audit = AuditSink::default();
    let orders: Dispatcher = m
        .dispatcher()
        .with(AuditLog(audit.clone()))
        .with(metrics())
        .with(deadline(Duration::from_secs(30)));
    let placed: Result<u32, DispatchError<OutOfStock>> = orders.dispatch(order(4)).await;
    assert_eq!(placed.unwrap(), 4);
    let failed: Result<u32, DispatchError<OutOfStock>> = orders.dispatch(order(0)).await;
    assert!(matches!(failed, Err(DispatchError::Domain(OutOfStock))));
    let total: Result<u64, DispatchError<Infallible>> = orders.ask(OrderTotal).await;
    assert_eq!(total.unwrap(), 42);
    assert_eq!(
        *audit.0.lock().unwrap(),
        ["command.PlaceOrder", "query.OrderTotal"]
    );
}

/// Notes entering and leaving.
struct Layer2(&'static str, Arc<Mutex<Vec<String>>>);

impl DispatchMiddleware for Layer2 {
    fn wrap<'a>(
        &'a self,
        _ctx: DispatchContext,
        next: DispatchNext<'a>,
    ) -> BoxFuture<'a, envoi_core::Result<Envelope>> {
        Box::pin(async move {
            self.1.lock().unwrap().push(format!("{} in", self.0));
            let out = next.run().within(WAIT, "the worker to stop").await;
            self.1.lock().unwrap().push(format!("{} out", self.0));
            out
        })
    }
}

#[tokio::test]
async fn middleware_is_applied_in_the_order_given_outermost_first() {
    let (_spans, _captured) = capture();
    let m = messenger(&Arc::default());
    let log = Arc::new(Mutex::new(Vec::new()));
    m.dispatcher()
        .with(Layer2("outer", log.clone()))
        .with(Layer2("inner", log.clone()))
        .dispatch(order(1))
        .await
        .unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        ["outer in", "inner in", "inner out", "outer out"]
    );
}
