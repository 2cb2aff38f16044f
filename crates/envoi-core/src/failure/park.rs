//! Parking: how a message that failed for good is stamped before it goes
//! to its failure transport.

use std::time::Duration;

use crate::envelope::stamp::{
    DelayStamp, ErrorDetailsStamp, RedeliveryStamp, SentToFailureTransportStamp,
};
use crate::envelope::Envelope;
use crate::error::HandlerError;

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
