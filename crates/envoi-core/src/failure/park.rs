//! Parking: how a message that failed for good is stamped before it goes
//! to its failure transport.

use std::time::Duration;

use crate::envelope::stamp::{
    DelayStamp, ErrorDetailsStamp, RedeliveryStamp, SentToFailureTransportStamp, Stamp,
};
use crate::envelope::Envelope;
use crate::error::{BusError, HandlerError};
use crate::transport::serializer::STAMP_HEADER_PREFIX;
use crate::transport::RawMessage;
use crate::transport::SenderDispatcher;

/// The longest [`parked_again_delay`].
pub const MAX_PARKED_AGAIN_DELAY: Duration = Duration::from_secs(3600);

/// How long a message that failed again after being received from its
/// failure transport waits there before it is handed out again, given how
/// many times it was parked before (its [`SentToFailureTransportStamp`]s):
/// 1 s after one, 2 s after two, doubling up to
/// [`MAX_PARKED_AGAIN_DELAY`].
///
/// ```
/// use envoi_core::failure::parked_again_delay;
/// use std::time::Duration;
///
/// assert_eq!(parked_again_delay(1), Duration::from_secs(1));
/// assert_eq!(parked_again_delay(3), Duration::from_secs(4));
/// assert_eq!(parked_again_delay(40), Duration::from_secs(3600));
/// ```
pub fn parked_again_delay(times_parked: usize) -> Duration {
    let doublings = u32::try_from(times_parked.saturating_sub(1))
        .unwrap_or(u32::MAX)
        .min(12);
    Duration::from_secs(1u64 << doublings).min(MAX_PARKED_AGAIN_DELAY)
}

/// The delay of `envelope` parked in its failure transport: none the first
/// time, [`parked_again_delay`] by the parks it carries when it was parked
/// before (whether it failed again straight from the failure transport or
/// after being sent back from there to its origin), or when it goes `back`
/// into the failure transport it was received from.
pub(crate) fn park_delay(envelope: &Envelope, back: bool) -> Duration {
    let parks = envelope.all::<SentToFailureTransportStamp>().count();
    if back || parks > 0 {
        parked_again_delay(parks)
    } else {
        Duration::ZERO
    }
}

/// `envelope` as it is parked in its failure transport: with why
/// (`details`), where it came from (`origin`, where a retry from the failure
/// transport sends it), a fresh retry budget, and the delay of
/// [`park_delay`] (`back`: it goes back into the failure transport it was
/// received from).
pub(crate) fn parked_copy(
    envelope: Envelope,
    details: ErrorDetailsStamp,
    origin: impl Into<String>,
    back: bool,
) -> Envelope {
    let delay = park_delay(&envelope, back);
    envelope
        .with(details)
        .with(SentToFailureTransportStamp::new(origin))
        .with(RedeliveryStamp::new(0))
        .with(DelayStamp::new(delay))
}

/// Parks `envelope` in the failure transport `failure`: its copy is
/// stamped ([`parked_copy`]: why, where it came from, a fresh retry
/// budget, the park delay) and sent through `dispatcher`. Returns the copy
/// as sent. The one park operation: the retry step parks a message out of
/// retries through it, and the worker what fails outside the retry step
/// (and what `failed retry` handles again).
pub(crate) async fn park(
    dispatcher: &dyn SenderDispatcher,
    failure: &str,
    envelope: Envelope,
    details: ErrorDetailsStamp,
    origin: impl Into<String>,
    back: bool,
) -> Result<Envelope, BusError> {
    let parked = parked_copy(envelope, details, origin, back);
    dispatcher.send(failure, parked).await
}

/// One [`ErrorDetailsStamp`] describing every handler failure.
pub fn error_details(errors: &[HandlerError]) -> ErrorDetailsStamp {
    match errors {
        [one] => {
            let mut d = ErrorDetailsStamp::from_error("handler", one);
            d.kind = format!("handler:{}", one.handler);
            d
        }
        many => ErrorDetailsStamp::new(
            "handler",
            many.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        ),
    }
}

/// Adds `stamp` to its `X-Message-Stamp-<name>` header's array, keeping
/// only the newest [`STAMP_HISTORY`](crate::transport::serializer::STAMP_HISTORY) of a
/// retry-history stamp, as the serializer does. A header that is not a JSON
/// array is kept under `X-Malformed-Stamp-<name>`.
pub(crate) fn append_stamp_header<S: Stamp>(raw: &mut RawMessage, stamp: &S) {
    let key = format!("{STAMP_HEADER_PREFIX}{}", S::NAME);
    let Ok(value) = serde_json::to_value(stamp) else {
        return;
    };
    let mut values = match raw.headers.remove(&key) {
        None => Vec::new(),
        Some(existing) => match serde_json::from_str::<Vec<serde_json::Value>>(&existing) {
            Ok(values) => values,
            Err(_) => {
                raw.headers
                    .insert(format!("X-Malformed-Stamp-{}", S::NAME), existing);
                Vec::new()
            }
        },
    };
    values.push(value);
    if crate::transport::serializer::is_history(S::NAME) {
        let excess = values
            .len()
            .saturating_sub(crate::transport::serializer::STAMP_HISTORY);
        values.drain(..excess);
    }
    if let Ok(json) = serde_json::to_string(&values) {
        raw.headers.insert(key, json);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appending_a_stamp_header_keeps_what_was_there() {
        let mut raw = RawMessage::default();
        raw.headers.insert("X-Message-Stamp-Delay", r#"[{"ms":1}]"#);
        append_stamp_header(&mut raw, &DelayStamp { ms: 2 });
        assert_eq!(
            raw.header("X-Message-Stamp-Delay"),
            Some(r#"[{"ms":1},{"ms":2}]"#)
        );
        raw.headers.insert("X-Message-Stamp-Delay", "garbage");
        append_stamp_header(&mut raw, &DelayStamp { ms: 3 });
        assert_eq!(raw.header("X-Message-Stamp-Delay"), Some(r#"[{"ms":3}]"#));
        assert_eq!(raw.header("X-Malformed-Stamp-Delay"), Some("garbage"));
    }

    #[test]
    fn appending_a_retry_history_stamp_header_keeps_only_the_newest() {
        let mut raw = RawMessage::default();
        for n in 0..40 {
            append_stamp_header(
                &mut raw,
                &RedeliveryStamp {
                    retry_count: n,
                    at: 0,
                },
            );
        }
        let kept: Vec<RedeliveryStamp> =
            serde_json::from_str(raw.header("X-Message-Stamp-Redelivery").unwrap()).unwrap();
        let counts: Vec<u32> = kept.iter().map(|r| r.retry_count).collect();
        let newest: Vec<u32> =
            (40 - crate::transport::serializer::STAMP_HISTORY as u32..40).collect();
        assert_eq!(counts, newest);
    }
}
