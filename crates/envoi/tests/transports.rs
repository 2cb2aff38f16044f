//! Configuring transports by DSN through the facade.

use envoi::testing::Abilities;
use envoi::transport::RawMessage;
use envoi::{BuildError, Messenger, MessengerBuilderExt, TransportError};

#[tokio::test]
async fn an_unknown_scheme_is_an_invalid_dsn_with_the_password_masked() {
    match envoi::transports::from_dsn("db", "mysql://root:secret@db/app").await {
        Err(TransportError::InvalidDsn { dsn, reason }) => {
            assert_eq!(dsn, "mysql://root:***@db/app");
            assert!(reason.contains("mysql://"), "{reason}");
        }
        other => panic!("expected an invalid DSN, got {other:?}"),
    }
    match envoi::transports::from_dsn("db", "not a dsn").await {
        Err(TransportError::InvalidDsn { reason, .. }) => {
            assert!(reason.contains("scheme://"), "{reason}")
        }
        other => panic!("expected an invalid DSN, got {other:?}"),
    }
}

#[cfg(not(feature = "postgres"))]
#[tokio::test]
async fn a_scheme_whose_feature_is_off_names_the_feature_to_enable() {
    match envoi::transports::from_dsn("db", "postgres://app:pw@db/shop").await {
        Err(TransportError::InvalidDsn { dsn, reason }) => {
            assert_eq!(dsn, "postgres://app:***@db/shop");
            assert!(reason.contains("`postgres` feature"), "{reason}");
        }
        other => panic!("expected an invalid DSN, got {other:?}"),
    }
}

#[tokio::test]
async fn core_schemes_work_in_every_feature_combination() {
    let t = envoi::transports::from_dsn("async", "in-memory://?serialize=true")
        .await
        .unwrap();
    t.send(RawMessage::default(), None).await.unwrap();
    assert_eq!(t.counter().message_count().await.unwrap(), 1);
}

#[tokio::test]
async fn the_builder_reports_the_transport_whose_dsn_is_bad() {
    let error = Messenger::builder()
        .with_transport_factories()
        .transport_dsn("orders", "kafka://broker:9092")
        .build_async()
        .await
        .unwrap_err();
    match &error {
        BuildError::Transport { name, reason } => {
            assert_eq!(name, "orders");
            assert!(reason.contains("kafka://"), "{reason}");
        }
        other => panic!("expected a transport error, got {other:?}"),
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use envoi::testing::Within;

    /// The longest a test waits for a worker to stop before it fails.
    const WAIT: std::time::Duration = std::time::Duration::from_secs(120);
    use envoi::worker::Worker;
    use envoi::Message;
    use serde::{Deserialize, Serialize};
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[derive(Debug, Clone, Serialize, Deserialize)]
    struct Ping(u32);
    impl Message for Ping {
        const NAME: &'static str = "Ping";
    }
    impl envoi::Command for Ping {
        type Output = ();
        type Error = Infallible;
    }

    #[tokio::test]
    async fn a_sqlite_dsn_configures_a_persistent_transport_the_worker_consumes() {
        let dir = tempfile::tempdir().unwrap();
        let dsn = format!("sqlite://{}/envoi.db", dir.path().display());
        let seen = Arc::new(AtomicU32::new(0));
        let counter = seen.clone();
        let messenger = Messenger::builder()
            .with_transport_factories()
            .command_handler(move |p: Ping| {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(p.0, Ordering::Relaxed);
                    Ok::<_, Infallible>(())
                }
            })
            .transport_dsn("orders", dsn.clone())
            .route::<Ping>("orders")
            .build_async()
            .await
            .unwrap();
        let orders = messenger.transport("orders").unwrap();
        for n in 1..=3 {
            messenger.dispatcher().dispatch(Ping(n)).await.unwrap();
        }
        assert_eq!(orders.counter().message_count().await.unwrap(), 3);
        // Persistent: stored in the database, where another handle on it
        // finds them.
        let reopened = envoi::transports::from_dsn("orders", &dsn).await.unwrap();
        assert_eq!(reopened.counter().message_count().await.unwrap(), 3);
        let report = Worker::builder(&messenger)
            .receiver("orders")
            .stop_when_empty()
            .build()
            .unwrap()
            .run()
            .within(WAIT, "the worker to stop")
            .await;
        assert_eq!(report.stats.handled, 3);
        assert_eq!(seen.load(Ordering::Relaxed), 6);
    }

    #[tokio::test]
    async fn a_bad_sqlite_option_is_an_invalid_dsn() {
        match envoi::transports::from_dsn("q", "sqlite://x.db?lease=soon").await {
            Err(TransportError::InvalidDsn { reason, .. }) => {
                assert!(reason.contains("lease"), "{reason}")
            }
            other => panic!("expected an invalid DSN, got {other:?}"),
        }
    }

    #[test]
    fn the_sqlite_module_is_the_transport_crate() {
        let config = envoi::sqlite::SqliteConfig::from_dsn("sqlite://var/q.db").unwrap();
        assert_eq!(config.path, std::path::Path::new("var/q.db"));
    }
}
