//! The test kit's assertions: each panics with what it expected, what it
//! found, and the list of what was recorded, the records it counted
//! marked.

use std::fmt::Write as _;

use super::journal::{Activity, Record};
use super::TestKit;
use crate::envelope::message::Message;

/// How many records a failed assertion lists at most (the last ones).
const LISTED: usize = 50;

/// `records`, one numbered line each (the last [`LISTED`]), those `marked`
/// takes flagged with `>`.
pub(super) fn listing(records: &[Record], marked: impl Fn(&Record) -> bool) -> String {
    if records.is_empty() {
        return "the test kit recorded nothing".to_string();
    }
    let mut out = format!(
        "what the test kit recorded ({}; `>` marks what was counted):",
        records.len()
    );
    let skipped = records.len().saturating_sub(LISTED);
    if skipped > 0 {
        let _ = write!(out, "\n   … {skipped} earlier records");
    }
    for (n, record) in records.iter().enumerate().skip(skipped) {
        let mark = if marked(record) { '>' } else { ' ' };
        let _ = write!(out, "\n{mark} {:>3}. {record}", n + 1);
    }
    out
}

/// `n time` or `n times`.
fn times(n: usize) -> String {
    if n == 1 {
        "1 time".to_string()
    } else {
        format!("{n} times")
    }
}

impl TestKit {
    /// Panics unless the records of an `M` that `matches` takes number
    /// `expected`, saying what was `done` to it.
    #[track_caller]
    fn assert_count<M: Message>(
        &self,
        done: &str,
        expected: usize,
        matches: impl Fn(&Activity) -> bool,
    ) {
        let found = self.count::<M>(&matches);
        if found != expected {
            let counted = |r: &Record| r.message::<M>().is_some() && matches(&r.activity);
            panic!(
                "expected {} to be {done} {}, but it was {done} {}\n{}",
                M::NAME,
                times(expected),
                times(found),
                listing(&self.records(), counted)
            );
        }
    }

    /// Panics, listing what was recorded, unless an `M` was dispatched
    /// exactly `expected` times.
    #[track_caller]
    pub fn assert_dispatched<M: Message>(&self, expected: usize) {
        self.assert_count::<M>("dispatched", expected, |a| {
            matches!(a, Activity::Dispatched { .. })
        });
    }

    /// Panics, listing what was recorded, unless an `M` was sent to
    /// `transport` exactly `expected` times.
    #[track_caller]
    pub fn assert_sent_to<M: Message>(&self, transport: &str, expected: usize) {
        let done = format!("sent to `{transport}`");
        self.assert_count::<M>(
            &done,
            expected,
            |a| matches!(a, Activity::Sent { transport: t } if t == transport),
        );
    }

    /// Panics, listing what was recorded, unless handlers handled an `M`
    /// successfully exactly `expected` times (once per handler: see
    /// [`handled`](Self::handled)).
    #[track_caller]
    pub fn assert_handled<M: Message>(&self, expected: usize) {
        self.assert_count::<M>("handled", expected, |a| {
            matches!(a, Activity::Handled { .. })
        });
    }

    /// Panics, listing what was recorded, unless an `M` was retried
    /// exactly `expected` times.
    #[track_caller]
    pub fn assert_retried<M: Message>(&self, expected: usize) {
        self.assert_count::<M>("retried", expected, |a| {
            matches!(a, Activity::Retried { .. })
        });
    }

    /// Panics, listing what was recorded, unless an `M` was parked in a
    /// failure transport exactly `expected` times.
    #[track_caller]
    pub fn assert_parked<M: Message>(&self, expected: usize) {
        self.assert_count::<M>("parked", expected, |a| matches!(a, Activity::Parked { .. }));
    }

    /// Panics, listing what was recorded, when any message was parked in a
    /// failure transport, or failed in a worker without being parked.
    #[track_caller]
    pub fn assert_nothing_parked(&self) {
        let failed = |r: &Record| {
            matches!(
                r.activity,
                Activity::Parked { .. } | Activity::Failed { .. }
            )
        };
        let records = self.records();
        let found = records.iter().filter(|r| failed(r)).count();
        if found > 0 {
            let what = if found == 1 {
                "1 message was parked or failed".to_string()
            } else {
                format!("{found} messages were parked or failed")
            };
            panic!(
                "expected nothing parked, but {what}\n{}",
                listing(&records, failed)
            );
        }
    }
}
