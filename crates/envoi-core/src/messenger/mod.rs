//! [`Messenger`] and its builder: the configuration layer that registers
//! handlers, buses, user middleware, routes, senders and retry policies and
//! assembles each bus in the canonical order.
//!
//! ```
//! use envoi_core::{Command, Event, Message, Messenger};
//! use std::convert::Infallible;
//!
//! #[derive(Debug, Clone)]
//! struct Ship { order: u32 }
//! impl Message for Ship { const NAME: &'static str = "Ship"; }
//! impl Command for Ship { type Output = (); type Error = Infallible; }
//!
//! #[derive(Debug, Clone)]
//! struct Shipped { order: u32 }
//! impl Message for Shipped { const NAME: &'static str = "Shipped"; }
//! impl Event for Shipped { type Error = Infallible; }
//!
//! let messenger = Messenger::builder()
//!     .command_handler(|_: Ship| async { Ok::<_, Infallible>(()) })
//!     .event_handler(|_: Shipped| async { Ok::<_, Infallible>(()) })
//!     .event_handler(|_: Shipped| async { Ok::<_, Infallible>(()) })
//!     .bus("event.bus", |bus| bus)
//!     .build()
//!     .unwrap();
//! assert_eq!(messenger.bus().name(), "default");
//! assert!(messenger.bus_named("event.bus").is_some());
//! println!("{}", messenger.debug());
//! ```

mod builder;
mod error;

use std::collections::BTreeMap;
use std::fmt;
use std::fmt::Write as _;
use std::sync::{Arc, Weak};

use crate::envelope::stamp::BusNameStamp;
use crate::envelope::Envelope;
use crate::error::{BusError, TransportError};
use crate::failure::FailurePolicy;
use crate::pipeline::bus::MessageBus;
use crate::transport::serializer::Serializer;
use crate::transport::{Inbox, SenderDispatcher, Transport};
use crate::typed::Dispatcher;
use crate::BoxFuture;

pub use builder::{BusBuilder, MessengerBuilder};
pub use error::BuildError;

impl Inbox for MessengerInner {
    fn dispatch_received(&self, envelope: Envelope) -> BoxFuture<'_, Result<Envelope, BusError>> {
        let bus = envelope
            .last::<BusNameStamp>()
            .and_then(|b| self.buses.get(&*b.bus))
            .unwrap_or(&self.default);
        Box::pin(bus.dispatch(envelope))
    }
}

struct MessengerInner {
    buses: BTreeMap<String, MessageBus>,
    order: Vec<String>,
    default: MessageBus,
    dispatcher: Arc<dyn SenderDispatcher>,
    transports: BTreeMap<String, Arc<dyn Transport>>,
    serializer: Serializer,
    retry: Option<Arc<FailurePolicy>>,
}

/// A handle to a [`Messenger`] that does not keep it alive; transports that
/// dispatch (the sync transport) hold one.
#[derive(Clone, Default)]
pub struct WeakMessenger(Weak<MessengerInner>);

impl WeakMessenger {
    /// The messenger, if it still exists.
    pub fn upgrade(&self) -> Option<Messenger> {
        self.0.upgrade().map(|inner| Messenger { inner })
    }
}

impl fmt::Debug for WeakMessenger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WeakMessenger")
    }
}

/// A configured application: its buses, handlers, routes and senders. Cheap
/// to clone.
#[derive(Clone)]
pub struct Messenger {
    inner: Arc<MessengerInner>,
}

impl fmt::Debug for Messenger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Messenger")
            .field("buses", &self.inner.order)
            .finish()
    }
}

impl Messenger {
    /// Starts a configuration.
    pub fn builder() -> MessengerBuilder {
        MessengerBuilder::default()
    }

    /// The default bus.
    pub fn bus(&self) -> &MessageBus {
        &self.inner.default
    }

    /// The bus called `name`.
    pub fn bus_named(&self, name: &str) -> Option<&MessageBus> {
        self.inner.buses.get(name)
    }

    /// Every bus, default first, then in definition order.
    pub fn buses(&self) -> impl Iterator<Item = &MessageBus> + '_ {
        self.inner.order.iter().map(move |n| &self.inner.buses[n])
    }

    /// A typed dispatcher on the default bus.
    pub fn dispatcher(&self) -> Dispatcher {
        Dispatcher::new(self.inner.default.clone())
    }

    /// The sender dispatcher every bus sends through.
    pub fn sender_dispatcher(&self) -> &Arc<dyn SenderDispatcher> {
        &self.inner.dispatcher
    }

    /// The transport registered as `name`.
    pub fn transport(&self, name: &str) -> Option<&Arc<dyn Transport>> {
        self.inner.transports.get(name)
    }

    /// Every registered transport with its name, sorted by name.
    pub fn transports(&self) -> impl Iterator<Item = (&str, &Arc<dyn Transport>)> + '_ {
        self.inner.transports.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// The names of the registered transports, sorted.
    pub fn transport_names(&self) -> Vec<&str> {
        self.inner.transports.keys().map(String::as_str).collect()
    }

    /// The serializer transports and workers encode and decode with.
    pub fn serializer(&self) -> &Serializer {
        &self.inner.serializer
    }

    /// The failure policy (retry strategies and failure transports),
    /// when the messenger has transports.
    pub fn failure_policy(&self) -> Option<&FailurePolicy> {
        self.inner.retry.as_deref()
    }

    /// The failure transport of messages received from `transport`.
    pub fn failure_transport_for(&self, transport: &str) -> Option<&str> {
        self.inner.retry.as_ref()?.failure_for(transport)
    }

    /// Every configured failure transport, sorted, without duplicates.
    pub fn failure_transports(&self) -> Vec<&str> {
        self.inner
            .retry
            .as_ref()
            .map(|r| r.failure_transports())
            .unwrap_or_default()
    }

    /// Sets up every registered transport that needs it
    /// ([`Setup::setup`](crate::transport::Setup::setup)), in name order,
    /// and returns each one's result (`Ok` for a transport with nothing to
    /// set up).
    pub async fn setup_transports(&self) -> Vec<(String, Result<(), TransportError>)> {
        let mut out = Vec::with_capacity(self.inner.transports.len());
        for (name, transport) in &self.inner.transports {
            let result = match transport.as_setup() {
                Some(setup) => setup.setup().await,
                None => Ok(()),
            };
            out.push((name.clone(), result));
        }
        out
    }

    /// A handle that does not keep the messenger alive.
    pub fn downgrade(&self) -> WeakMessenger {
        WeakMessenger(Arc::downgrade(&self.inner))
    }

    /// A readable listing of each bus's pipeline, the routes and the
    /// handlers.
    pub fn debug(&self) -> String {
        let mut out = String::new();
        for bus in self.buses() {
            let _ = writeln!(out, "bus {}", bus.name());
            for (i, step) in bus.pipeline().iter().enumerate() {
                let _ = writeln!(out, "  {}. {}", i + 1, step);
            }
        }
        let bus = self.bus();
        if let Some(send) = bus.send_step() {
            let _ = writeln!(out, "routes");
            for (message, transports) in send.routes().describe() {
                let _ = writeln!(out, "  {message} -> {}", transports.join(", "));
            }
        }
        if !self.inner.transports.is_empty() {
            let _ = writeln!(out, "transports");
            for (name, transport) in &self.inner.transports {
                let mut notes = Vec::new();
                if let Some(f) = self.failure_transport_for(name) {
                    if f != name {
                        notes.push(format!("failures -> {f}"));
                    }
                }
                if self.failure_transports().contains(&name.as_str()) {
                    notes.push("failure transport".into());
                }
                if transport.as_local_sender().is_some() {
                    notes.push("in process".into());
                }
                if transport.as_receiver().is_none() {
                    notes.push("nothing to consume".into());
                }
                let _ = if notes.is_empty() {
                    writeln!(out, "  {name}")
                } else {
                    writeln!(out, "  {name} ({})", notes.join(", "))
                };
            }
        }
        let _ = writeln!(out, "handlers");
        for (message, kind, handlers) in bus.handle_step().registry().describe() {
            let handlers: Vec<String> = handlers.into_iter().map(readable_handler).collect();
            let _ = writeln!(out, "  {kind} {message}: {}", handlers.join(", "));
        }
        out
    }
}

/// A handler's name as `debug` shows it: a closure's type name
/// (`configure::{{closure}}::{{closure}}`) reads as the function it was
/// written in (`closure in configure`); any other name as it is.
fn readable_handler(name: &str) -> String {
    match name.find("::{{closure}}") {
        Some(at) => format!("closure in {}", &name[..at]),
        None if name.starts_with("{{closure}}") => "closure".to_string(),
        None => name.to_string(),
    }
}
