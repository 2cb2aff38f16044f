//! A broker that cannot be reached: building the messenger and running the
//! command line against it end within the connect timeout with an error
//! that names the DSN, its password masked. No broker is needed: the DSNs
//! point at a closed port.

use std::time::Duration;

use envoi::{Messenger, MessengerBuilderExt};

/// DSNs with a password, at a port nothing listens on, with a short
/// connect timeout.
const CLOSED: &[(&str, &str)] = &[
    (
        "postgres",
        "postgres://app:s3cr3t@127.0.0.1:1/shop?connect_timeout=1s",
    ),
    ("redis", "redis://app:s3cr3t@127.0.0.1:1?connect_timeout=1s"),
    (
        "rabbitmq",
        "amqp://app:s3cr3t@127.0.0.1:1/%2f?connect_timeout=1s",
    ),
    ("nats", "nats://app:s3cr3t@127.0.0.1:1?connect_timeout=1s"),
];

/// What a newcomer sees: the build's error, or what `stats` prints.
async fn what_the_user_sees(name: &str, dsn: &str) -> (bool, String) {
    let built = Messenger::builder()
        .with_transport_factories()
        .transport_dsn(name, dsn)
        .build_async()
        .await;
    let messenger = match built {
        Ok(m) => m,
        Err(e) => return (false, e.to_string()),
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = envoi_cli::run_with(&messenger, ["app", "stats"], &mut out, &mut err).await;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out),
        String::from_utf8_lossy(&err)
    );
    (code == 0, text)
}

#[tokio::test]
async fn every_broker_transport_names_its_masked_dsn_when_it_cannot_connect() {
    for (name, dsn) in CLOSED {
        let seen = tokio::time::timeout(Duration::from_secs(20), what_the_user_sees(name, dsn))
            .await
            .unwrap_or_else(|_| panic!("{name}: no answer within 20 s for a closed port"));
        let (succeeded, text) = seen;
        println!("{name}: {text}");
        assert!(!succeeded, "{name}: a closed port reads as success: {text}");
        assert!(
            text.contains("app:***@127.0.0.1:1"),
            "{name}: the error does not name the masked DSN: {text}"
        );
        assert!(
            !text.contains("s3cr3t"),
            "{name}: the password shows: {text}"
        );
        assert!(text.contains("cannot connect"), "{name}: {text}");
    }
}
