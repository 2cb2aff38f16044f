//! Run with: `cargo run --release -p example-orders`
//!
//! An order flow handled in process: thousands of `PlaceOrder` commands,
//! each publishing an `OrderPlaced` event to two handlers, and a query for
//! the totals at the end.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use envoi::{Command, DispatchError, Event, Message, Messenger, Query};

#[derive(Debug, Clone)]
struct PlaceOrder {
    id: u64,
    quantity: u32,
}
impl Message for PlaceOrder {
    const NAME: &'static str = "PlaceOrder";
}
impl Command for PlaceOrder {
    type Output = ();
    type Error = OrderError;
}

#[derive(Debug, thiserror::Error)]
enum OrderError {
    #[error("order {0} has no items")]
    Empty(u64),
}

#[derive(Debug, Clone)]
struct OrderPlaced {
    quantity: u32,
}
impl Message for OrderPlaced {
    const NAME: &'static str = "OrderPlaced";
}
impl Event for OrderPlaced {
    type Error = Infallible;
}

#[derive(Debug, Clone)]
struct Totals;
impl Message for Totals {
    const NAME: &'static str = "Totals";
}
impl Query for Totals {
    type Output = (u64, u64);
    type Error = Infallible;
}

#[tokio::main]
async fn main() {
    let orders = Arc::new(AtomicU64::new(0));
    let items = Arc::new(AtomicU64::new(0));
    let messenger = Messenger::builder()
        .command_handler(|cmd: PlaceOrder| async move {
            if cmd.quantity == 0 {
                Err(OrderError::Empty(cmd.id))
            } else {
                Ok(())
            }
        })
        .event_handler({
            let orders = orders.clone();
            move |_: OrderPlaced| {
                let orders = orders.clone();
                async move {
                    orders.fetch_add(1, Ordering::Relaxed);
                    Ok::<_, Infallible>(())
                }
            }
        })
        .event_handler({
            let items = items.clone();
            move |e: OrderPlaced| {
                let items = items.clone();
                async move {
                    items.fetch_add(u64::from(e.quantity), Ordering::Relaxed);
                    Ok::<_, Infallible>(())
                }
            }
        })
        .query_handler({
            let (orders, items) = (orders.clone(), items.clone());
            move |_: Totals| {
                let (orders, items) = (orders.clone(), items.clone());
                async move {
                    Ok::<_, Infallible>((
                        orders.load(Ordering::Relaxed),
                        items.load(Ordering::Relaxed),
                    ))
                }
            }
        })
        .build()
        .expect("valid configuration");
    println!("{}", messenger.debug());

    let bus = messenger.dispatcher();
    let start = Instant::now();
    let (mut placed, mut rejected) = (0u64, 0u64);
    for id in 0..10_000u64 {
        let quantity = (id % 7) as u32;
        match bus.dispatch(PlaceOrder { id, quantity }).await {
            Ok(()) => {
                placed += 1;
                bus.publish(OrderPlaced { quantity })
                    .await
                    .expect("event handlers do not fail");
            }
            Err(DispatchError::Domain(OrderError::Empty(_))) => rejected += 1,
            Err(e) => panic!("infrastructure failure: {e}"),
        }
    }
    let elapsed = start.elapsed();
    let (orders, items) = bus.ask(Totals).await.expect("the query has a handler");
    assert_eq!(orders, placed);
    println!(
        "placed {placed} orders ({items} items), rejected {rejected}, in {:.1} ms ({:.0} dispatches/s)",
        elapsed.as_secs_f64() * 1000.0,
        (placed * 2 + rejected) as f64 / elapsed.as_secs_f64()
    );
}
