//! The order flow of envoi's main example, as a library so that its tests
//! can run it with small numbers; `main.rs` runs it with 5,000 orders, or
//! runs the envoi command line when given arguments.
//!
//! # The flow
//!
//! Producers dispatch [`PlaceOrder`] commands, routed to the SQLite
//! transport `orders`. A worker in the same process consumes `events` and
//! `orders` (events first, so work already started is finished first):
//!
//! * `charge_payment` handles a `PlaceOrder` and publishes an
//!   [`OrderPlaced`] event, routed to `events`;
//! * `send_confirmation` and `reserve_stock` both handle every
//!   `OrderPlaced`.
//!
//! Some handlers fail, on purpose and deterministically by order id:
//!
//! | handler | failure | orders | what happens |
//! |---|---|---|---|
//! | `charge_payment` | payment gateway timeout, first try only ([`Recoverable`]) | [`gateway_times_out`]: 1 in 9 | retried after the retry delay, then handled |
//! | `charge_payment` | card declined ([`Unrecoverable`]) | [`card_declined`]: 1 in 500 | parked in `failed` at once |
//! | `send_confirmation` | mail server busy, first try only ([`Recoverable`]) | [`mail_server_busy`]: 1 in 13 | the event is retried; `reserve_stock`, which succeeded, does not run again |
//! | `reserve_stock` | SKU discontinued ([`Unrecoverable`]) | [`discontinued`]: 1 in 700 | the event is parked in `failed` |
//!
//! Every message ends handled or parked: [`run`] stops the worker once every
//! order and every event it produced is accounted for, and returns a
//! [`Summary`] with the counts, the throughput and the latency from dispatch
//! to handled (each message carries the time it was dispatched).

#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use envoi::failure::MultiplierRetryStrategy;
use envoi::sqlite::{SqliteConfig, SqliteTransport};
use envoi::stamp::RedeliveryStamp;
use envoi::worker::{StopHandle, StopReason, Worker, WorkerError, WorkerEvent, WorkerListener};
use envoi::{
    BuildError, Command, Context, ContextHandler, Envelope, Event, Handler, Message, Messenger,
    Recoverable, TransportError, Unrecoverable,
};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

/// The transport orders are sent to.
pub const ORDERS: &str = "orders";
/// The transport events are sent to.
pub const EVENTS: &str = "events";
/// The failure transport.
pub const FAILED: &str = "failed";

/// Places an order: charge the customer, then announce it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlaceOrder {
    /// The order number, from 1.
    pub id: u64,
    /// Who ordered.
    pub customer: u32,
    /// How many items.
    pub quantity: u32,
    /// The total, in cents.
    pub amount_cents: u64,
    /// When it was dispatched, in microseconds since the Unix epoch.
    pub sent_at_us: u64,
}

impl Message for PlaceOrder {
    const NAME: &'static str = "PlaceOrder";
}

impl Command for PlaceOrder {
    type Output = ();
    type Error = PaymentError;
}

/// Why charging an order failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PaymentError {
    /// The gateway did not answer; worth another try.
    #[error("payment gateway timed out")]
    GatewayTimeout(#[source] Recoverable),
    /// The card was declined; retrying cannot help.
    #[error("card declined")]
    Declined(#[source] Unrecoverable),
    /// The `OrderPlaced` event could not be published.
    #[error("publishing OrderPlaced failed: {0}")]
    Publish(String),
}

/// An order was placed and paid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPlaced {
    /// The order number.
    pub id: u64,
    /// Who ordered.
    pub customer: u32,
    /// How many items.
    pub quantity: u32,
    /// The total, in cents.
    pub amount_cents: u64,
    /// When the order was dispatched, in microseconds since the Unix epoch.
    pub ordered_at_us: u64,
}

impl Message for OrderPlaced {
    const NAME: &'static str = "OrderPlaced";
}

impl Event for OrderPlaced {
    type Error = FulfilmentError;
}

/// Why fulfilling an order failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FulfilmentError {
    /// The mail server was busy; worth another try.
    #[error("mail server busy")]
    MailServerBusy(#[source] Recoverable),
    /// The item is no longer sold; retrying cannot help.
    #[error("sku discontinued")]
    Discontinued(#[source] Unrecoverable),
}

/// Whether the payment gateway times out on the first try for order `id`
/// (1 in 9).
pub fn gateway_times_out(id: u64) -> bool {
    id % 9 == 4
}

/// Whether the card of order `id` is declined, for good (1 in 500).
pub fn card_declined(id: u64) -> bool {
    id % 500 == 123
}

/// Whether the mail server is busy on the first try for order `id`
/// (1 in 13).
pub fn mail_server_busy(id: u64) -> bool {
    id % 13 == 6
}

/// Whether the item of order `id` is discontinued, for good (1 in 700).
pub fn discontinued(id: u64) -> bool {
    id % 700 == 456
}

/// Microseconds since the Unix epoch.
fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Remembers which orders were tried, so a simulated glitch happens on the
/// first try only.
#[derive(Debug, Default)]
struct FirstTry(Mutex<HashSet<u64>>);

impl FirstTry {
    fn is_first(&self, id: u64) -> bool {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id)
    }
}

/// Charges an order and publishes [`OrderPlaced`] on the bus it runs on,
/// through its context.
#[derive(Default)]
struct ChargePayment {
    tries: FirstTry,
}

impl ContextHandler<PlaceOrder> for ChargePayment {
    type Output = ();
    type Error = PaymentError;

    async fn handle(&self, order: &PlaceOrder, ctx: Context) -> Result<(), PaymentError> {
        if card_declined(order.id) {
            return Err(PaymentError::Declined(Unrecoverable::new(format!(
                "the issuer refused the card of customer {}",
                order.customer
            ))));
        }
        if gateway_times_out(order.id) && self.tries.is_first(order.id) {
            return Err(PaymentError::GatewayTimeout(Recoverable::new(
                "no answer within 2s",
            )));
        }
        ctx.publish(OrderPlaced {
            id: order.id,
            customer: order.customer,
            quantity: order.quantity,
            amount_cents: order.amount_cents,
            ordered_at_us: order.sent_at_us,
        })
        .await
        .map_err(|e| PaymentError::Publish(e.to_string()))
    }

    fn name(&self) -> &'static str {
        "charge_payment"
    }
}

/// Mails the customer.
#[derive(Default)]
struct SendConfirmation {
    tries: FirstTry,
}

impl Handler<OrderPlaced> for SendConfirmation {
    type Output = ();
    type Error = FulfilmentError;

    async fn handle(&self, placed: &OrderPlaced) -> Result<(), FulfilmentError> {
        if mail_server_busy(placed.id) && self.tries.is_first(placed.id) {
            return Err(FulfilmentError::MailServerBusy(Recoverable::new(
                "421 too many connections",
            )));
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "send_confirmation"
    }
}

/// Reserves the items in the warehouse.
struct ReserveStock;

impl Handler<OrderPlaced> for ReserveStock {
    type Output = ();
    type Error = FulfilmentError;

    async fn handle(&self, placed: &OrderPlaced) -> Result<(), FulfilmentError> {
        if discontinued(placed.id) {
            return Err(FulfilmentError::Discontinued(Unrecoverable::new(format!(
                "no stock will come for the {} item(s) of order {}",
                placed.quantity, placed.id
            ))));
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "reserve_stock"
    }
}

/// The example's messenger: the three SQLite transports in `database`, the
/// routes, the failure transport, a retry strategy starting at
/// `retry_delay` (3 retries, doubling), and the handlers.
///
/// # Errors
///
/// When the database cannot be opened.
pub async fn messenger(database: &Path, retry_delay: Duration) -> Result<Messenger, BuildError> {
    // Opened from a configuration rather than a DSN, so that any file name
    // works (a `?` or `#` in it, or bytes that are not UTF-8).
    let open = |name: &'static str| async move {
        let mut config = SqliteConfig::new(database);
        // A worker reading two transports in priority order must not wait
        // on the first when it is empty; it waits on both when both are.
        config.poll = Duration::ZERO;
        SqliteTransport::with_config(name, config)
            .await
            .map_err(|e| BuildError::Transport {
                name: name.to_string(),
                reason: e.to_string(),
            })
    };
    Messenger::builder()
        .transport(ORDERS, Arc::new(open(ORDERS).await?))
        .transport(EVENTS, Arc::new(open(EVENTS).await?))
        .transport(FAILED, Arc::new(open(FAILED).await?))
        .route::<PlaceOrder>(ORDERS)
        .route::<OrderPlaced>(EVENTS)
        .failure_transport(FAILED)
        .default_retry_strategy(MultiplierRetryStrategy {
            max_retries: 3,
            delay: retry_delay,
            multiplier: 2.0,
            max_delay: Some(retry_delay * 10),
            jitter: 0.1,
        })
        .command_handler(ChargePayment::default())
        .event_handler(SendConfirmation::default())
        .event_handler(ReserveStock)
        .build()
}

/// Where the example keeps its database: `$EXAMPLE_ORDERS_DB` when set
/// and not empty, otherwise `example-orders-data/envoi.db` in the cargo
/// target directory (beside the `debug` and `release` directories, so that
/// the command line run afterwards finds the failures of the last run,
/// whichever profile either was built with).
pub fn database_path() -> PathBuf {
    database_variable()
        .map(PathBuf::from)
        .unwrap_or_else(default_database_path)
}

/// `$EXAMPLE_ORDERS_DB`, unless it is unset or empty: an empty path would
/// give SQLite a new throwaway database on every connection.
pub fn database_variable() -> Option<std::ffi::OsString> {
    chosen_path(std::env::var_os("EXAMPLE_ORDERS_DB"))
}

/// A database path given in a variable, `None` when it is empty.
fn chosen_path(variable: Option<std::ffi::OsString>) -> Option<std::ffi::OsString> {
    variable.filter(|p| !p.is_empty())
}

/// `example-orders-data/envoi.db` in the cargo target directory.
fn default_database_path() -> PathBuf {
    let dir = std::env::current_exe()
        .ok()
        .and_then(|exe| {
            let profile = exe.parent()?;
            Some(profile.parent().unwrap_or(profile).to_path_buf())
        })
        .unwrap_or_else(std::env::temp_dir);
    dir.join("example-orders-data").join("envoi.db")
}

/// Who uses the database: the flow alone, or the command line, any number
/// of times at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The flow, which deletes the database and counts every message it
    /// makes: nothing else may use the database meanwhile.
    Exclusive,
    /// The command line.
    Shared,
}

/// Locks `database` for `access` through the file `<database>.lock`, held
/// until the returned file is dropped: the flow would otherwise delete the
/// database under a running `consume`, or miss the messages another process
/// takes from it. Creates the database's directory if missing. Checks
/// first that `database` is an SQLite database or nothing
/// ([`check_database`]), so no lock file is left beside anything else.
///
/// # Errors
///
/// [`FlowError::NotADatabase`] (or [`FlowError::Clean`]) from the check,
/// [`FlowError::InUse`] when another process holds a lock that conflicts,
/// [`FlowError::Lock`] when the lock file cannot be opened or locked.
pub fn lock_database(database: &Path, access: Access) -> Result<std::fs::File, FlowError> {
    check_database(database)?;
    let mut name = database.as_os_str().to_owned();
    name.push(".lock");
    let path = PathBuf::from(name);
    let failed = |source| FlowError::Lock {
        path: path.clone(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(failed)?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(failed)?;
    let locked = match access {
        Access::Exclusive => file.try_lock(),
        Access::Shared => file.try_lock_shared(),
    };
    match locked {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(FlowError::InUse {
            database: database.to_path_buf(),
            by: match access {
                Access::Exclusive => "another example-orders process",
                Access::Shared => "the example's main job",
            },
        }),
        // A file system without locks: run unguarded rather than not at all.
        Err(std::fs::TryLockError::Error(e)) if e.kind() == std::io::ErrorKind::Unsupported => {
            Ok(file)
        }
        Err(std::fs::TryLockError::Error(source)) => Err(failed(source)),
    }
}

/// How to run the flow.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FlowConfig {
    /// The SQLite database; deleted and created again at the start.
    pub database: PathBuf,
    /// How many orders to place.
    pub orders: u64,
    /// How many tasks dispatch them.
    pub producers: u64,
    /// Orders dispatched per second, or `None` for as fast as possible.
    pub rate: Option<u64>,
    /// How many messages the worker handles at once.
    pub concurrency: usize,
    /// The first retry's delay.
    pub retry_delay: Duration,
    /// Gives up when the run takes longer than this.
    pub time_limit: Duration,
    /// Draws progress bars on standard error.
    pub progress: bool,
    /// Stops the flow early: dispatching ends, the worker stops gracefully
    /// (handlers in flight finish, what it fetched but did not start goes
    /// back), and [`run`] returns [`FlowError::Incomplete`].
    pub stop: StopHandle,
}

impl FlowConfig {
    /// 5,000 orders at 2,500 a second from 4 producers, a worker handling
    /// 16 at once, retries after 100 ms, no progress bars, 120 s at most.
    pub fn new(database: impl Into<PathBuf>) -> Self {
        FlowConfig {
            database: database.into(),
            orders: 5_000,
            producers: 4,
            rate: Some(2_500),
            concurrency: 16,
            retry_delay: Duration::from_millis(100),
            time_limit: Duration::from_secs(120),
            progress: false,
            stop: StopHandle::new(),
        }
    }

    /// Places `n` orders.
    #[must_use]
    pub fn orders(mut self, n: u64) -> Self {
        self.orders = n;
        self
    }

    /// Dispatches `per_second` orders a second (`None`: as fast as
    /// possible).
    #[must_use]
    pub fn rate(mut self, per_second: Option<u64>) -> Self {
        self.rate = per_second.filter(|r| *r > 0);
        self
    }

    /// Handles up to `n` messages at once.
    #[must_use]
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }

    /// Retries first after `delay`.
    #[must_use]
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Draws progress bars (or not).
    #[must_use]
    pub fn progress(mut self, on: bool) -> Self {
        self.progress = on;
        self
    }
}

/// What can stop the flow.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FlowError {
    /// The messenger could not be configured.
    #[error("configuring the messenger failed: {0}")]
    Build(#[from] BuildError),
    /// The previous run's database could not be removed.
    #[error("removing `{path}` failed: {source}")]
    Clean {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A transport failed.
    #[error("transport `{transport}`: {source}")]
    Transport {
        /// The transport.
        transport: String,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// The worker could not be configured.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// An order could not be dispatched.
    #[error("dispatching order {id} failed: {error}")]
    Dispatch {
        /// The order.
        id: u64,
        /// Why.
        error: String,
    },
    /// The file named as the database is not an SQLite database, so the
    /// flow does not delete it to start afresh.
    #[error("`{path}` is not an SQLite database; the example deletes its database at the start, so it leaves this file alone: set EXAMPLE_ORDERS_DB to another path")]
    NotADatabase {
        /// The file.
        path: PathBuf,
    },
    /// Another process uses the database.
    #[error("`{database}` is in use by {by}; wait for it to finish, or set EXAMPLE_ORDERS_DB to another file")]
    InUse {
        /// The database.
        database: PathBuf,
        /// Who holds it.
        by: &'static str,
    },
    /// The database's lock file could not be opened or locked.
    #[error("locking `{path}` failed: {source}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The worker stopped before every message was handled or parked.
    #[error("the worker stopped ({reason}) before every message was handled or parked: {detail}")]
    Incomplete {
        /// Why it stopped.
        reason: StopReason,
        /// The counts so far.
        detail: String,
    },
}

/// The 50th and 99th percentiles of a latency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Latency {
    /// How many messages were measured.
    pub samples: usize,
    /// Half took at most this long.
    pub p50: Duration,
    /// 99 in 100 took at most this long.
    pub p99: Duration,
}

impl Latency {
    fn of(mut micros: Vec<u64>) -> Self {
        micros.sort_unstable();
        let n = micros.len();
        let at = |q: f64| {
            if n == 0 {
                return Duration::ZERO;
            }
            let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
            Duration::from_micros(micros[rank - 1])
        };
        Latency {
            samples: n,
            p50: at(0.50),
            p99: at(0.99),
        }
    }
}

/// What a run did.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Summary {
    /// The database it ran on.
    pub database: PathBuf,
    /// Orders dispatched.
    pub dispatched: u64,
    /// How long dispatching took.
    pub dispatch_time: Duration,
    /// `PlaceOrder` messages handled.
    pub orders_handled: u64,
    /// `PlaceOrder` messages parked in the failure transport.
    pub orders_parked: u64,
    /// `OrderPlaced` messages handled (by both handlers).
    pub events_handled: u64,
    /// `OrderPlaced` messages parked in the failure transport.
    pub events_parked: u64,
    /// Retries scheduled after transient failures.
    pub retried: u64,
    /// Messages handled on a try after the first.
    pub retried_then_handled: u64,
    /// Messages parked in the failure transport after a retry (a later try
    /// failed for good).
    pub retried_then_parked: u64,
    /// Messages the worker took from the transports (first tries and
    /// retries).
    pub deliveries: u64,
    /// Messages waiting in the failure transport at the end.
    pub in_failure_transport: u64,
    /// How long the worker ran.
    pub elapsed: Duration,
    /// The worker's concurrency.
    pub concurrency: usize,
    /// From dispatching a `PlaceOrder` to its handling.
    pub order_latency: Latency,
    /// From dispatching a `PlaceOrder` to the handling of its
    /// `OrderPlaced`.
    pub end_to_end_latency: Latency,
}

impl Summary {
    /// Messages handled per second of the worker's run.
    pub fn throughput(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            (self.orders_handled + self.events_handled) as f64 / secs
        } else {
            0.0
        }
    }
}

/// `1234567` as `1,234,567`.
///
/// ```
/// assert_eq!(example_orders::thousands(1_234_567), "1,234,567");
/// ```
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "Orders      {} PlaceOrder dispatched in {:.2}s",
            thousands(self.dispatched),
            self.dispatch_time.as_secs_f64()
        )?;
        writeln!(
            f,
            "Handled     {} messages: {} PlaceOrder, {} OrderPlaced (2 handlers each)",
            thousands(self.orders_handled + self.events_handled),
            thousands(self.orders_handled),
            thousands(self.events_handled)
        )?;
        write!(
            f,
            "Retried     {} transient failures: {} handled on a later try",
            thousands(self.retried),
            thousands(self.retried_then_handled)
        )?;
        if self.retried_then_parked > 0 {
            write!(
                f,
                ", {} parked after it",
                thousands(self.retried_then_parked)
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "Failed      {} for good, parked in `{FAILED}`: {} PlaceOrder, {} OrderPlaced",
            thousands(self.orders_parked + self.events_parked),
            thousands(self.orders_parked),
            thousands(self.events_parked)
        )?;
        writeln!(
            f,
            "Throughput  {} messages/s ({} deliveries in {:.2}s, concurrency {})",
            thousands(self.throughput().round() as u64),
            thousands(self.deliveries),
            self.elapsed.as_secs_f64(),
            self.concurrency
        )?;
        writeln!(
            f,
            "Latency     PlaceOrder dispatched -> handled:            p50 {:>9}  p99 {:>9}",
            ms(self.order_latency.p50),
            ms(self.order_latency.p99)
        )?;
        write!(
            f,
            "            PlaceOrder dispatched -> OrderPlaced handled: p50 {:>9}  p99 {:>9}",
            ms(self.end_to_end_latency.p50),
            ms(self.end_to_end_latency.p99)
        )
    }
}

/// The worker's tally of finished messages and their latencies.
#[derive(Default)]
struct Tally {
    orders_handled: AtomicU64,
    orders_parked: AtomicU64,
    events_handled: AtomicU64,
    events_parked: AtomicU64,
    retried_then_handled: AtomicU64,
    retried_then_parked: AtomicU64,
    order_latency: Mutex<Vec<u64>>,
    end_to_end: Mutex<Vec<u64>>,
}

impl Tally {
    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    fn orders_done(&self) -> u64 {
        Self::get(&self.orders_handled) + Self::get(&self.orders_parked)
    }

    fn events_done(&self) -> u64 {
        Self::get(&self.events_handled) + Self::get(&self.events_parked)
    }

    /// Every order is handled or parked, and so is every event the handled
    /// orders published.
    fn complete(&self, orders: u64) -> bool {
        self.orders_done() >= orders && self.events_done() >= Self::get(&self.orders_handled)
    }

    fn describe(&self, orders: u64) -> String {
        format!(
            "{} of {} orders and {} of {} events handled or parked",
            thousands(self.orders_done()),
            thousands(orders),
            thousands(self.events_done()),
            thousands(Self::get(&self.orders_handled))
        )
    }

    fn record(samples: &Mutex<Vec<u64>>, since_us: u64) {
        samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(now_us().saturating_sub(since_us));
    }

    fn take(samples: &Mutex<Vec<u64>>) -> Vec<u64> {
        std::mem::take(
            &mut *samples
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

struct TallyListener(Arc<Tally>);

/// Whether `envelope` went through a retry (its first try failed).
fn was_retried(envelope: &Envelope) -> bool {
    envelope.all::<RedeliveryStamp>().any(|r| r.retry_count > 0)
}

impl WorkerListener for TallyListener {
    fn on_event(&self, event: &WorkerEvent) {
        let t = &self.0;
        match event {
            WorkerEvent::Handled { envelope, .. } => {
                if was_retried(envelope) {
                    t.retried_then_handled.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(order) = envelope.message::<PlaceOrder>() {
                    Tally::record(&t.order_latency, order.sent_at_us);
                    t.orders_handled.fetch_add(1, Ordering::Relaxed);
                } else if let Some(placed) = envelope.message::<OrderPlaced>() {
                    Tally::record(&t.end_to_end, placed.ordered_at_us);
                    t.events_handled.fetch_add(1, Ordering::Relaxed);
                }
            }
            WorkerEvent::Failed {
                message,
                parked_in: Some(_),
                envelope,
                ..
            } => {
                if envelope.as_ref().is_some_and(was_retried) {
                    t.retried_then_parked.fetch_add(1, Ordering::Relaxed);
                }
                if message == PlaceOrder::NAME {
                    t.orders_parked.fetch_add(1, Ordering::Relaxed);
                } else if message == OrderPlaced::NAME {
                    t.events_parked.fetch_add(1, Ordering::Relaxed);
                }
            }
            _ => {}
        }
    }
}

/// The first bytes of every SQLite database file.
const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";

/// Fails with [`FlowError::NotADatabase`] when `path` names something
/// other than an SQLite database or nothing: a directory, or a file that
/// does not start as every SQLite database does. The flow deletes its
/// database at the start, so a mistyped `EXAMPLE_ORDERS_DB` must not delete
/// some other file; [`lock_database`] checks too, so it leaves no lock file
/// beside it.
pub fn check_database(path: &Path) -> Result<(), FlowError> {
    let unreadable = |source| FlowError::Clean {
        path: path.to_path_buf(),
        source,
    };
    if path.is_dir() {
        return Err(FlowError::NotADatabase {
            path: path.to_path_buf(),
        });
    }
    match std::fs::File::open(path) {
        Ok(mut file) => {
            use std::io::Read;
            let mut start = Vec::with_capacity(SQLITE_MAGIC.len());
            file.by_ref()
                .take(SQLITE_MAGIC.len() as u64)
                .read_to_end(&mut start)
                .map_err(unreadable)?;
            // An empty file is what SQLite makes of a new database.
            if !start.is_empty() && start != SQLITE_MAGIC {
                return Err(FlowError::NotADatabase {
                    path: path.to_path_buf(),
                });
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(unreadable(source)),
    }
    Ok(())
}

/// Deletes the previous run's database, after [`check_database`].
fn remove_database(path: &Path) -> Result<(), FlowError> {
    check_database(path)?;
    let mut files = vec![path.to_path_buf()];
    for suffix in ["-wal", "-shm"] {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        files.push(PathBuf::from(name));
    }
    for file in files {
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(FlowError::Clean { path: file, source }),
        }
    }
    Ok(())
}

struct Bars {
    dispatched: ProgressBar,
    orders: ProgressBar,
    events: ProgressBar,
}

impl Bars {
    fn new(orders: u64, visible: bool) -> Self {
        let multi = MultiProgress::with_draw_target(if visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        });
        let style = ProgressStyle::with_template("{prefix:>10} [{bar:40}] {pos:>6}/{len:<6} {msg}")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        let bar = |prefix: &'static str, len: u64| {
            let bar = multi.add(ProgressBar::new(len));
            bar.set_style(style.clone());
            bar.set_prefix(prefix);
            bar
        };
        Bars {
            dispatched: bar("dispatched", orders),
            orders: bar("orders", orders),
            events: bar("events", 0),
        }
    }

    fn finish(&self) {
        self.dispatched.finish();
        self.orders.finish();
        self.events.finish();
    }
}

/// Runs the flow; see the [crate documentation](crate).
///
/// # Errors
///
/// When the database cannot be prepared, an order cannot be dispatched, or
/// the worker stops (time limit) before every message is handled or parked.
pub async fn run(config: &FlowConfig) -> Result<Summary, FlowError> {
    remove_database(&config.database)?;
    let messenger = messenger(&config.database, config.retry_delay).await?;
    for (name, transport) in messenger.transports() {
        let Some(setup) = transport.as_setup() else {
            continue;
        };
        setup.setup().await.map_err(|source| FlowError::Transport {
            transport: name.to_string(),
            source,
        })?;
    }
    let n = config.orders;
    let tally = Arc::new(Tally::default());
    let stop = config.stop.clone();
    let worker = Worker::builder(&messenger)
        .receivers([EVENTS, ORDERS])
        .concurrency(config.concurrency)
        .idle_sleep(Duration::from_millis(50))
        .time_limit(config.time_limit)
        .stop_handle(stop.clone())
        .listener(TallyListener(tally.clone()))
        .build()?;
    let progress = worker.progress();
    let bars = Bars::new(n, config.progress);

    let started = Instant::now();
    let dispatched = Arc::new(AtomicU64::new(0));
    let producers = config.producers.clamp(1, n.max(1));
    let mut tasks = Vec::new();
    for p in 0..producers {
        let bus = messenger.dispatcher();
        let dispatched = dispatched.clone();
        let stop = stop.clone();
        // Each producer sends its share of the rate: its k-th order is due
        // k × producers / rate seconds after the start.
        let interval = config
            .rate
            .map(|r| Duration::from_secs_f64(producers as f64 / r as f64));
        let start = tokio::time::Instant::now();
        tasks.push(tokio::spawn(async move {
            let mut id = p + 1;
            let mut k = 0u32;
            while id <= n && !stop.is_stopped() {
                if let Some(every) = interval {
                    tokio::time::sleep_until(start + every * k).await;
                    k += 1;
                }
                let order = PlaceOrder {
                    id,
                    customer: (id * 7919 % 1000) as u32 + 1,
                    quantity: (id % 5) as u32 + 1,
                    amount_cents: 1_000 + id * 37 % 9_000,
                    sent_at_us: now_us(),
                };
                bus.dispatch(order).await.map_err(|e| FlowError::Dispatch {
                    id,
                    error: e.to_string(),
                })?;
                dispatched.fetch_add(1, Ordering::Relaxed);
                id += producers;
            }
            Ok::<Instant, FlowError>(Instant::now())
        }));
    }

    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut window: std::collections::VecDeque<(Instant, u64)> = Default::default();
    let run = worker.run();
    tokio::pin!(run);
    let report = loop {
        tokio::select! {
            report = &mut run => break report,
            _ = tick.tick() => {
                let stats = progress.snapshot();
                let now = Instant::now();
                let processed = stats.handled + stats.retried + stats.failed;
                window.push_back((now, processed));
                while window.len() > 2 && window.front().is_some_and(|(t, _)| now.duration_since(*t) > Duration::from_secs(2)) {
                    window.pop_front();
                }
                let rate = match (window.front(), window.back()) {
                    (Some((t0, n0)), Some((t1, n1))) if t1 > t0 => (n1 - n0) as f64 / t1.duration_since(*t0).as_secs_f64(),
                    _ => 0.0,
                };
                bars.dispatched.set_position(dispatched.load(Ordering::Relaxed));
                bars.orders.set_position(tally.orders_done());
                bars.events.set_length(Tally::get(&tally.orders_handled));
                bars.events.set_position(tally.events_done());
                bars.events.set_message(format!(
                    "{rate:.0} msg/s | retried {} | parked {}",
                    stats.retried,
                    Tally::get(&tally.orders_parked) + Tally::get(&tally.events_parked)
                ));
                if tally.complete(n) {
                    stop.stop();
                }
            }
        }
    };
    bars.dispatched
        .set_position(dispatched.load(Ordering::Relaxed));
    bars.orders.set_position(tally.orders_done());
    bars.events.set_position(tally.events_done());
    bars.finish();

    let mut dispatch_done = started;
    for task in tasks {
        match task.await {
            Ok(Ok(at)) => dispatch_done = dispatch_done.max(at),
            Ok(Err(e)) => return Err(e),
            Err(e) => {
                return Err(FlowError::Dispatch {
                    id: 0,
                    error: format!("a producer task failed: {e}"),
                })
            }
        }
    }
    if !tally.complete(n) {
        return Err(FlowError::Incomplete {
            reason: report.reason,
            detail: format!(
                "{} ({} orders dispatched)",
                tally.describe(n),
                dispatched.load(Ordering::Relaxed)
            ),
        });
    }
    let in_failure_transport = match messenger
        .transport(FAILED)
        .and_then(|t| t.as_message_count())
    {
        Some(counter) => counter
            .message_count()
            .await
            .map_err(|source| FlowError::Transport {
                transport: FAILED.to_string(),
                source,
            })?,
        None => 0,
    };
    Ok(Summary {
        database: config.database.clone(),
        dispatched: dispatched.load(Ordering::Relaxed),
        dispatch_time: dispatch_done.duration_since(started),
        orders_handled: Tally::get(&tally.orders_handled),
        orders_parked: Tally::get(&tally.orders_parked),
        events_handled: Tally::get(&tally.events_handled),
        events_parked: Tally::get(&tally.events_parked),
        retried: report.stats.retried,
        retried_then_handled: Tally::get(&tally.retried_then_handled),
        retried_then_parked: Tally::get(&tally.retried_then_parked),
        deliveries: report.stats.received,
        in_failure_transport,
        elapsed: report.elapsed,
        concurrency: config.concurrency,
        order_latency: Latency::of(Tally::take(&tally.order_latency)),
        end_to_end_latency: Latency::of(Tally::take(&tally.end_to_end)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_described_with_thousands_separated() {
        let tally = Tally::default();
        tally.orders_handled.store(3_671, Ordering::Relaxed);
        tally.events_handled.store(1_200, Ordering::Relaxed);
        assert_eq!(
            tally.describe(5_000),
            "3,671 of 5,000 orders and 1,200 of 3,671 events handled or parked"
        );
    }

    #[test]
    fn an_empty_database_variable_means_the_default_database() {
        assert_eq!(chosen_path(Some("".into())), None);
        assert_eq!(chosen_path(None), None);
        assert_eq!(
            chosen_path(Some("/tmp/orders.db".into())),
            Some("/tmp/orders.db".into())
        );
        assert!(default_database_path().ends_with("example-orders-data/envoi.db"));
    }

    #[test]
    fn percentiles_pick_the_nearest_rank() {
        let l = Latency::of((1..=100).rev().collect());
        assert_eq!(l.samples, 100);
        assert_eq!(l.p50, Duration::from_micros(50));
        assert_eq!(l.p99, Duration::from_micros(99));
        assert_eq!(Latency::of(vec![7]).p99, Duration::from_micros(7));
        assert_eq!(Latency::of(Vec::new()), Latency::default());
    }

    #[test]
    fn thousands_are_separated_by_commas() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn the_failure_rules_hit_a_few_orders_in_five_thousand() {
        let ids = 1..=5_000u64;
        assert_eq!(ids.clone().filter(|&i| card_declined(i)).count(), 10);
        assert_eq!(ids.clone().filter(|&i| discontinued(i)).count(), 7);
        assert!(!ids.clone().any(|i| card_declined(i) && discontinued(i)));
        assert_eq!(ids.clone().filter(|&i| gateway_times_out(i)).count(), 556);
    }
}
