//! Setting up and tearing down: the work-queue stream, the durable pull
//! consumer on it, and binding to that consumer.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::stream::{Config as StreamConfig, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, stream::Stream};
use envoi_core::transport::{Setup, Teardown};
use envoi_core::{BoxFuture, TransportError};

use crate::config::{subject_matches, Storage};
use crate::transport::{backend, lock};
use crate::NatsTransport;

impl NatsTransport {
    fn consumer_config(&self) -> pull::Config {
        let config = &self.inner.config;
        pull::Config {
            durable_name: Some(self.inner.names.consumer.clone()),
            description: Some("envoi transport consumer".to_string()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: config.lease,
            // Delays are naks: they must not use up a delivery budget.
            max_deliver: -1,
            max_ack_pending: config.max_ack_pending,
            filter_subject: self.inner.names.subject.clone(),
            ..Default::default()
        }
    }

    /// Creates the stream (or checks the one there captures the subject)
    /// and binds the consumer.
    async fn setup_now(&self) -> Result<(), TransportError> {
        let names = &self.inner.names;
        let stream = self
            .inner
            .js
            .get_or_create_stream(StreamConfig {
                name: names.stream.clone(),
                subjects: vec![names.subject.clone()],
                retention: RetentionPolicy::WorkQueue,
                storage: match self.inner.config.storage {
                    Storage::File => StorageType::File,
                    Storage::Memory => StorageType::Memory,
                },
                num_replicas: 1,
                ..Default::default()
            })
            .await
            .map_err(|e| backend(format!("creating stream `{}`", names.stream), e))?;
        let info = stream.cached_info();
        let captured = if info.config.subjects.is_empty() {
            info.config.name == names.subject
        } else {
            info.config
                .subjects
                .iter()
                .any(|filter| subject_matches(filter, &names.subject))
        };
        if !captured {
            return Err(backend(
                format!("setting up stream `{}`", names.stream),
                format!(
                    "the existing stream does not capture subject `{}` (its subjects: {:?})",
                    names.subject, info.config.subjects
                ),
            ));
        }
        if info.config.retention != RetentionPolicy::WorkQueue {
            tracing::warn!(
                stream = %names.stream,
                "existing stream is not a work queue: acknowledged messages stay in it and `list` shows them"
            );
        }
        let consumer = self.bind_consumer(&stream).await?;
        *lock(&self.inner.consumer) = Some(Arc::new(consumer));
        Ok(())
    }

    /// Binds to the durable consumer, creating it, or updating it when its
    /// settings differ from the configuration. A consumer that already has
    /// the right settings is left untouched (no write on the server).
    async fn bind_consumer<I>(&self, stream: &Stream<I>) -> Result<PullConsumer, TransportError> {
        let wanted = self.consumer_config();
        let name = &self.inner.names.consumer;
        if let Ok(existing) = stream.get_consumer::<pull::Config>(name).await {
            let current = &existing.cached_info().config;
            let same = current.ack_wait == wanted.ack_wait
                && current.max_deliver == wanted.max_deliver
                && current.max_ack_pending == wanted.max_ack_pending
                && current.filter_subject == wanted.filter_subject
                && current.ack_policy == wanted.ack_policy
                && current.deliver_policy == wanted.deliver_policy;
            if same {
                return Ok(existing);
            }
        }
        stream
            .create_consumer(wanted)
            .await
            .map_err(|e| backend(format!("creating consumer `{name}`"), e))
    }

    /// Sets up on first use, when `auto_setup` is on.
    pub(crate) async fn ensure_setup(&self) -> Result<(), TransportError> {
        if !self.inner.config.auto_setup || self.inner.set_up.load(Ordering::Acquire) {
            return Ok(());
        }
        // Boxed: the set-up future is several kilobytes, and every `send`
        // future would otherwise be that large (and copied that much).
        Box::pin(async {
            let _once = self.inner.setting_up.lock().await;
            if !self.inner.set_up.load(Ordering::Acquire) {
                self.setup_now().await?;
                self.inner.set_up.store(true, Ordering::Release);
            }
            Ok(())
        })
        .await
    }

    /// The stream, without reading its information.
    pub(crate) async fn open_stream(&self) -> Result<Stream<()>, TransportError> {
        let stream = &self.inner.names.stream;
        self.inner
            .js
            .get_stream_no_info(stream)
            .await
            .map_err(|e| backend(format!("opening stream `{stream}`"), e))
    }

    /// The pull consumer, bound (or re-created, if it went missing) when
    /// needed.
    pub(crate) async fn bound_consumer(&self) -> Result<Arc<PullConsumer>, TransportError> {
        if let Some(consumer) = lock(&self.inner.consumer).clone() {
            return Ok(consumer);
        }
        let stream = self.open_stream().await?;
        // Brings the consumer back if it was deleted behind our back.
        let consumer = Arc::new(self.bind_consumer(&stream).await?);
        *lock(&self.inner.consumer) = Some(consumer.clone());
        Ok(consumer)
    }

    /// Drops the binding: the next `get` binds again.
    pub(crate) fn forget_consumer(&self) {
        *lock(&self.inner.consumer) = None;
    }

    /// Forgets everything this handle holds of the stream's messages: the
    /// binding, what was fetched ahead and the leases.
    fn forget_messages(&self) {
        self.forget_consumer();
        self.inner.read_ahead.abort();
        lock(&self.inner.leases).clear();
    }
}

impl Setup for NatsTransport {
    /// Gets or creates the work-queue stream and binds the durable pull
    /// consumer, creating or updating it only when its settings differ.
    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            self.check_open()?;
            let _once = self.inner.setting_up.lock().await;
            self.setup_now().await?;
            self.inner.set_up.store(true, Ordering::Release);
            Ok(())
        })
    }
}

impl Teardown for NatsTransport {
    /// Purges the stream's messages on the transport's subject (waiting,
    /// delayed and leased alike) and returns how many there were.
    fn purge(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            self.check_open()?;
            self.ensure_setup().await?;
            let stream = self.open_stream().await?;
            self.inner.read_ahead.abort();
            let purged = stream
                .purge()
                .filter(self.inner.names.subject.as_str())
                .await
                .map_err(|e| backend(format!("purging stream `{}`", self.stream()), e))?;
            lock(&self.inner.leases).clear();
            Ok(purged.purged)
        })
    }

    /// Deletes the stream, its consumer and every message in it; a stream
    /// already gone counts as deleted. The next use sets up again (with
    /// `auto_setup`).
    fn delete(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            self.check_open()?;
            let _once = self.inner.setting_up.lock().await;
            self.inner.set_up.store(false, Ordering::Release);
            self.forget_messages();
            let stream = &self.inner.names.stream;
            match self.inner.js.delete_stream(stream).await {
                Ok(_) => Ok(()),
                Err(e) => match e.kind() {
                    jetstream::context::DeleteStreamErrorKind::JetStream(js)
                        if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                    {
                        Ok(())
                    }
                    _ => Err(backend(format!("deleting stream `{stream}`"), e)),
                },
            }
        })
    }
}
