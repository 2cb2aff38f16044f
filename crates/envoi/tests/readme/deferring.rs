use envoi::testing::TestKit;
use envoi::WeakMessenger;
use envoi::{Command, Envelope, Message, Messenger, MessengerBuilder, MessengerBuilderExt};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};

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

/// The shop's configuration, which `main` builds its messenger from. The
/// handler of `PlaceOrder` defers the confirmation through `messenger`,
/// filled once the messenger is built.
fn shop(messenger: Arc<OnceLock<WeakMessenger>>) -> MessengerBuilder {
    Messenger::builder()
        .with_transport_factories()
        .transport_dsn("orders", "sqlite://var/shop.db")
        .route::<PlaceOrder>("orders")
        .route::<SendConfirmation>("orders")
        .command_handler(move |order: PlaceOrder| {
            let messenger = messenger.get().and_then(WeakMessenger::upgrade);
            async move {
                let messenger = messenger.ok_or(ShopError("not built yet".into()))?;
                // … store the order; confirm it once this handler succeeded.
                let confirm = Envelope::new(SendConfirmation { order: order.id });
                messenger
                    .bus()
                    .dispatch_after_current(confirm)
                    .await
                    .map_err(|e| ShopError(e.to_string()))?;
                Ok(())
            }
        })
        .command_handler(|_: SendConfirmation| async { Ok(()) })
}

#[tokio::test(start_paused = true)]
async fn the_confirmation_is_sent_once_the_order_is_placed() {
    let messenger = Arc::new(OnceLock::new());
    let kit = TestKit::new(shop(messenger.clone())).await.unwrap();
    messenger.set(kit.messenger().downgrade()).unwrap();

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
