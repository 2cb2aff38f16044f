//! Reaching a backend within a bounded time: the `connect_timeout` DSN
//! option every transport reads, and the error that names the (masked)
//! DSN when the backend cannot be reached.

use std::future::Future;
use std::time::Duration;

use super::dsn::mask_dsn;
use super::DsnQuery;
use crate::error::{BoxError, TransportError};

/// How long a transport waits for its backend to answer a connection
/// attempt when the DSN sets no `connect_timeout`.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl DsnQuery {
    /// Takes the `connect_timeout` option (a duration such as `3s`),
    /// [`DEFAULT_CONNECT_TIMEOUT`] when absent. Fails for a zero or
    /// malformed value.
    ///
    /// ```
    /// use envoi_core::transport::support::{DsnQuery, DEFAULT_CONNECT_TIMEOUT};
    /// use std::time::Duration;
    ///
    /// let mut q = DsnQuery::parse("redis://h?connect_timeout=750ms").unwrap();
    /// assert_eq!(q.connect_timeout().unwrap(), Duration::from_millis(750));
    /// let mut q = DsnQuery::parse("redis://h").unwrap();
    /// assert_eq!(q.connect_timeout().unwrap(), DEFAULT_CONNECT_TIMEOUT);
    /// let mut q = DsnQuery::parse("redis://h?connect_timeout=0s").unwrap();
    /// assert!(q.connect_timeout().is_err());
    /// ```
    pub fn connect_timeout(&mut self) -> Result<Duration, TransportError> {
        match self.duration("connect_timeout")? {
            None => Ok(DEFAULT_CONNECT_TIMEOUT),
            Some(d) if d.is_zero() => {
                Err(self.invalid("`connect_timeout` must be longer than zero".into()))
            }
            Some(d) => Ok(d),
        }
    }
}

/// Runs `connect` for at most `timeout`; a failure or a timeout becomes
/// [`TransportError::Unreachable`] naming `dsn` with its password masked.
///
/// ```
/// use envoi_core::transport::support::connect_within;
/// use envoi_core::TransportError;
/// use std::time::Duration;
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let never = std::future::pending::<Result<(), std::io::Error>>();
/// let error = connect_within("redis://u:secret@h:1", Duration::from_millis(10), never)
///     .await
///     .unwrap_err();
/// assert!(matches!(error, TransportError::Unreachable { .. }));
/// let text = error.to_string();
/// assert!(text.contains("redis://u:***@h:1") && text.contains("no answer within 10ms"), "{text}");
/// # });
/// ```
pub async fn connect_within<T, E>(
    dsn: &str,
    timeout: Duration,
    connect: impl Future<Output = Result<T, E>>,
) -> Result<T, TransportError>
where
    E: Into<BoxError>,
{
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(connected)) => Ok(connected),
        Ok(Err(error)) => Err(unreachable(dsn, error.into())),
        Err(_) => Err(unreachable(
            dsn,
            format!("no answer within {timeout:?}").into(),
        )),
    }
}

/// [`TransportError::Unreachable`] for `dsn` (masked here) because of
/// `source`.
pub fn unreachable(dsn: &str, source: BoxError) -> TransportError {
    TransportError::Unreachable {
        dsn: mask_dsn(dsn),
        source,
    }
}
