use envoi::failure::MultiplierRetryStrategy;
use envoi::testing::TestKit;
use envoi::{Command, Message, Messenger, MessengerBuilder, MessengerBuilderExt};
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ChargeCard {
    order: u64,
}
impl Message for ChargeCard {
    const NAME: &'static str = "ChargeCard";
}
impl Command for ChargeCard {
    type Output = ();
    type Error = GatewayTimeout;
}

#[derive(Debug, thiserror::Error)]
#[error("the payment gateway timed out")]
struct GatewayTimeout;

/// The payments configuration, which `main` builds its messenger from.
fn payments() -> MessengerBuilder {
    Messenger::builder()
        .with_transport_factories()
        .transport_dsn("payments", "sqlite://var/shop.db")
        .transport_dsn("failed", "sqlite://var/shop.db")
        .route::<ChargeCard>("payments")
        .retry_strategy(
            "payments",
            MultiplierRetryStrategy {
                max_retries: 3,
                delay: Duration::from_secs(30),
                jitter: 0.0,
                ..Default::default()
            },
        )
        .failure_transport("failed")
        .command_handler(|_: ChargeCard| async { Err(GatewayTimeout) })
}

#[tokio::test(start_paused = true)]
async fn a_charge_that_keeps_failing_is_parked_after_three_retries() {
    let kit = TestKit::new(payments()).await.unwrap();
    kit.dispatcher()
        .dispatch(ChargeCard { order: 7 })
        .await
        .unwrap();

    // The retries wait 30 s, 60 s and 120 s on tokio's paused clock: no time at all.
    kit.run_until_idle().await;

    let retries = kit.retried::<ChargeCard>();
    let delays: Vec<Duration> = retries.iter().map(|r| r.delay).collect();
    assert_eq!(delays, [30, 60, 120].map(Duration::from_secs));
    kit.assert_handled::<ChargeCard>(0);
    kit.assert_parked::<ChargeCard>(1);
    let parked = kit.parked::<ChargeCard>().remove(0);
    assert_eq!(parked.failure_transport, "failed");
    assert!(parked.error.contains("the payment gateway timed out"));
}
