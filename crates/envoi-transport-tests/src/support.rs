//! Helpers the cases share: opening handles, reaching their abilities,
//! receiving with deadlines, asserting silence.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoi_core::TransportError;

use envoi_core::transport::{Delivery, DeliveryId, RawMessage, Receiver, Transport};

/// A handle on a transport under test.
pub(crate) type Handle = Arc<dyn Transport>;

/// How long a loop sleeps after an empty `get`, so transports whose `get`
/// returns at once are not spun on.
const IDLE: Duration = Duration::from_millis(10);

/// Opens transports by name; implemented for every
/// `async fn(String) -> Option<Arc<dyn Transport>>`.
pub trait MakeTransport {
    /// Opens the transport called `name`, or `None` to skip the case.
    fn open(&self, name: String) -> impl Future<Output = Option<Arc<dyn Transport>>>;
}

impl<F, Fut> MakeTransport for F
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Option<Arc<dyn Transport>>>,
{
    fn open(&self, name: String) -> impl Future<Output = Option<Arc<dyn Transport>>> {
        self(name)
    }
}

/// A transport name unique to this run: `tag` plus a random suffix, made of
/// lowercase ASCII letters, digits and `_` so it is a valid table, queue or
/// stream name everywhere.
pub fn unique_name(tag: &str) -> String {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{tag}_{}", &suffix[..12])
}

/// The receiving side of the transport under test. Every case takes
/// messages out of the transport it sends to, so a transport without one
/// ([`Transport::as_receiver`] is `None`) cannot be tested by the suite.
///
/// # Panics
///
/// When the transport has no receiving side.
///
/// ```
/// use envoi_core::transport::in_memory::InMemoryTransport;
/// use envoi_transport_tests::receiver;
///
/// let queue = InMemoryTransport::new();
/// let _ = receiver(&queue);
/// ```
pub fn receiver(transport: &dyn Transport) -> &dyn Receiver {
    transport
        .as_receiver()
        .unwrap_or_else(|| panic!("the transport under test has no receiving side"))
}

/// Opens `name` and runs its [`Setup`](envoi_core::transport::Setup), if
/// it has one.
pub(crate) async fn open(make: &impl MakeTransport, name: &str) -> Option<Handle> {
    let transport = make.open(name.to_string()).await?;
    setup(&*transport)
        .await
        .unwrap_or_else(|e| panic!("setup of `{name}` failed: {e}"));
    Some(transport)
}

/// Runs the transport's [`Setup`](envoi_core::transport::Setup); `Ok` at
/// once when it has nothing to set up.
pub(crate) async fn setup(transport: &dyn Transport) -> Result<(), TransportError> {
    match transport.as_setup() {
        Some(setup) => setup.setup().await,
        None => Ok(()),
    }
}

/// Whether a case needing what the transport promises (`capability`, read
/// from [`Options`](crate::Options)) runs; prints why not otherwise.
pub(crate) fn requires(case: &str, has: bool, capability: &str) -> bool {
    if !has {
        eprintln!("skipped {case}: transport is not {capability}");
    }
    has
}

/// The ability a case needs (`Some`), or `None` after printing that the
/// transport cannot do what the case tests (`what`).
pub(crate) fn ability<'a, A: ?Sized>(
    case: &str,
    ability: Option<&'a A>,
    what: &str,
) -> Option<&'a A> {
    if ability.is_none() {
        eprintln!("skipped {case}: transport cannot {what}");
    }
    ability
}

/// A message with a text body and the given headers.
pub(crate) fn message(body: impl Into<Vec<u8>>, headers: &[(&str, &str)]) -> RawMessage {
    RawMessage {
        body: body.into(),
        headers: headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// A message whose body is `body` and no headers.
pub(crate) fn text(body: &str) -> RawMessage {
    message(body, &[])
}

/// The delivery's body as text (the cases send text bodies unless they test
/// binary ones).
pub(crate) fn body(delivery: &Delivery) -> String {
    String::from_utf8(delivery.raw.body.clone())
        .unwrap_or_else(|_| panic!("body of delivery `{}` is not the UTF-8 sent", delivery.id))
}

/// Sends `message` now.
pub(crate) async fn send(transport: &dyn Transport, message: RawMessage) -> String {
    let id = transport
        .send(message, None)
        .await
        .unwrap_or_else(|e| panic!("send failed: {e}"));
    assert!(!id.is_empty(), "send returned an empty id");
    id
}

/// Sends text bodies now, one `send` each.
pub(crate) async fn send_texts(transport: &dyn Transport, bodies: &[String]) -> Vec<String> {
    let mut ids = Vec::with_capacity(bodies.len());
    for b in bodies {
        ids.push(send(transport, text(b)).await);
    }
    ids
}

/// One `get(max)`, checked against `max`.
pub(crate) async fn get(transport: &dyn Transport, max: usize) -> Vec<Delivery> {
    let got = receiver(transport)
        .get(max)
        .await
        .unwrap_or_else(|e| panic!("get({max}) failed: {e}"));
    assert!(
        got.len() <= max,
        "get({max}) handed out {} messages",
        got.len()
    );
    for d in &got {
        assert!(!d.id.as_str().is_empty(), "a delivery has an empty id");
    }
    got
}

/// Receives until `n` deliveries arrived or `timeout` passed; leaves them
/// unsettled. Panics if fewer than `n` arrived.
pub(crate) async fn receive(
    transport: &dyn Transport,
    n: usize,
    max: usize,
    timeout: Duration,
) -> Vec<Delivery> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "received {} of {n} messages within {timeout:?}",
            out.len()
        );
        let got = get(transport, max.min(n - out.len()).max(1)).await;
        if got.is_empty() {
            tokio::time::sleep(IDLE).await;
        }
        out.extend(got);
    }
    out
}

/// Receives `n` deliveries like [`receive`], acknowledging each batch as it
/// arrives (so a slow run never lets a lease expire on what it holds).
pub(crate) async fn receive_and_ack(
    transport: &dyn Transport,
    n: usize,
    max: usize,
    timeout: Duration,
) -> Vec<Delivery> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "received {} of {n} messages within {timeout:?}",
            out.len()
        );
        let got = get(transport, max.min(n - out.len()).max(1)).await;
        if got.is_empty() {
            tokio::time::sleep(IDLE).await;
        }
        for d in &got {
            ack(transport, &d.id).await;
        }
        out.extend(got);
    }
    out
}

/// Asserts `got` holds every one of `expected` exactly once, naming what is
/// missing, duplicated or unexpected.
pub(crate) fn assert_exactly_once(got: &[String], expected: &[String], what: &str) {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for g in got {
        *counts.entry(g.as_str()).or_default() += 1;
    }
    let missing: Vec<&String> = expected
        .iter()
        .filter(|e| !counts.contains_key(e.as_str()))
        .collect();
    let twice: Vec<(&str, usize)> = counts
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, n)| (*k, *n))
        .collect();
    let unexpected: Vec<&str> = counts
        .keys()
        .filter(|k| !expected.iter().any(|e| e == *k))
        .copied()
        .collect();
    assert!(
        missing.is_empty() && twice.is_empty() && unexpected.is_empty(),
        "{what}: {} of {} expected messages missing (first: {:?}), {} seen more than once \
         (first: {:?}), {} unexpected (first: {:?})",
        missing.len(),
        expected.len(),
        &missing[..missing.len().min(5)],
        twice.len(),
        &twice[..twice.len().min(5)],
        unexpected.len(),
        &unexpected[..unexpected.len().min(5)],
    );
}

/// Acknowledges `id`.
pub(crate) async fn ack(transport: &dyn Transport, id: &DeliveryId) {
    receiver(transport)
        .ack(id)
        .await
        .unwrap_or_else(|e| panic!("ack of `{id}` failed: {e}"));
}

/// Releases `id`.
pub(crate) async fn release(transport: &dyn Transport, id: &DeliveryId) {
    receiver(transport)
        .release(id)
        .await
        .unwrap_or_else(|e| panic!("release of `{id}` failed: {e}"));
}

/// Polls `get` for `during` and panics if anything is handed out.
pub(crate) async fn expect_nothing(transport: &dyn Transport, during: Duration, why: &str) {
    let deadline = Instant::now() + during;
    while Instant::now() < deadline {
        let got = get(transport, 10).await;
        if let Some(d) = got.first() {
            panic!(
                "{why}, but `{}` (id `{}`) was handed out",
                String::from_utf8_lossy(&d.raw.body),
                d.id
            );
        }
        tokio::time::sleep(IDLE).await;
    }
}

/// `message_count`, or `None` when the transport cannot count
/// ([`Transport::as_message_count`] is `None`).
pub(crate) async fn count(transport: &dyn Transport) -> Option<u64> {
    let counter = transport.as_message_count()?;
    match counter.message_count().await {
        Ok(n) => Some(n),
        Err(e) => panic!("message_count failed: {e}"),
    }
}

/// Waits (up to a few seconds, counts of some brokers lag) for
/// `message_count` to be `expected`, then asserts it. Does nothing when the
/// transport cannot count.
pub(crate) async fn expect_count(transport: &dyn Transport, expected: u64, when: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let Some(n) = count(transport).await else {
            return;
        };
        if n == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "message_count is {n} {when}, expected {expected}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The longest a case waits for silence after settling: long enough for a
/// lease to pass if the transport has one.
pub(crate) fn settle_wait(options: &crate::Options) -> Duration {
    if options.lease_expiry {
        options.lease + options.lease / 2 + Duration::from_millis(500)
    } else {
        Duration::from_millis(500)
    }
}
