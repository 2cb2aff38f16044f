//! The table's life: created by [`Setup`] (or on first use with
//! `auto_setup`), emptied and removed by [`Teardown`].

use std::sync::atomic::{AtomicBool, Ordering};

use envoi_core::transport::{Setup, Teardown};
use envoi_core::{BoxFuture, TransportError};
use tokio::sync::Mutex;

use crate::op::Op;
use crate::transport::{Inner, SqliteTransport};

/// Whether this handle set the table up, for `auto_setup`.
#[derive(Default)]
pub(crate) struct SetupState {
    done: AtomicBool,
    /// Held while setting up, so concurrent first uses set up once.
    running: Mutex<()>,
}

impl Inner {
    /// Sets the table up on first use, with `auto_setup`.
    pub(crate) async fn ensure_setup(&self) -> Result<(), TransportError> {
        if !self.config.auto_setup || self.setup.done.load(Ordering::Acquire) {
            return Ok(());
        }
        let _running = self.setup.running.lock().await;
        if !self.setup.done.load(Ordering::Acquire) {
            self.write("creating the table", Op::Setup).await?;
            self.setup.done.store(true, Ordering::Release);
        }
        Ok(())
    }
}

impl Setup for SqliteTransport {
    fn setup(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.write("creating the table", Op::Setup).await?;
            inner.setup.done.store(true, Ordering::Release);
            Ok(())
        })
    }
}

/// `purge` deletes the transport's rows (waiting, delayed and leased) and
/// forgets those this handle kept. `delete` deletes them too, then the
/// table with its index unless another transport's rows are still in it
/// (a shared table); without a table there is nothing to do. With
/// `auto_setup`, the next use creates the table again.
impl Teardown for SqliteTransport {
    fn purge(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.ensure_setup().await?;
            inner.prefetched.clear();
            inner.write("purging messages", Op::Purge).await
        })
    }

    fn delete(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            let inner = &*self.inner;
            inner.prefetched.clear();
            inner.write("deleting the table", Op::Drop).await?;
            inner.setup.done.store(false, Ordering::Release);
            Ok(())
        })
    }
}
