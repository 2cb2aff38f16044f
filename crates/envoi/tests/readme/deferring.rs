use envoi::testing::TestKit;
use envoi::{Command, Context, Message, Messenger, MessengerBuilder, MessengerBuilderExt};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PlaceOrder {
    id: u64,
}
impl Message for PlaceOrder {
    const NAME: &'static str = "PlaceOrder";
}
impl Command for PlaceOrder {
    type Output = ();
    type Error = ShopError;
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SendConfirmation {
    order: u64,
}
impl Message for SendConfirmation {
    const NAME: &'static str = "SendConfirmation";
}
impl Command for SendConfirmation {
    type Output = ();
    type Error = ShopError;
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct ShopError(String);

/// The handler of `PlaceOrder`: stores the order, and asks for its
/// confirmation once this handler has succeeded.
async fn place_order(order: PlaceOrder, ctx: Context) -> Result<(), ShopError> {
    // … store the order …
    ctx.dispatch_after_current(SendConfirmation { order: order.id })
        .await
        .map_err(|e| ShopError(e.to_string()))
}

/// The shop's configuration, which `main` builds its messenger from.
fn shop() -> MessengerBuilder {
    Messenger::builder()
        .with_transport_factories()
        .transport_dsn("orders", "sqlite://var/shop.db")
        .route::<PlaceOrder>("orders")
        .route::<SendConfirmation>("orders")
        .command_handler(place_order)
        .command_handler(|_: SendConfirmation| async { Ok(()) })
}

#[tokio::test(start_paused = true)]
async fn the_confirmation_is_sent_once_the_order_is_placed() {
    let kit = TestKit::new(shop()).await.unwrap();

    kit.dispatcher()
        .dispatch(PlaceOrder { id: 42 })
        .await
        .unwrap();
    kit.assert_sent_to::<PlaceOrder>("orders", 1);
    kit.assert_dispatched::<SendConfirmation>(0);

    kit.run_until_idle().await;
    kit.assert_handled::<PlaceOrder>(1);
    let confirmed = [SendConfirmation { order: 42 }];
    assert_eq!(kit.sent_to::<SendConfirmation>("orders"), confirmed);
    assert_eq!(kit.handled::<SendConfirmation>(), confirmed);
    kit.assert_nothing_parked();
}
