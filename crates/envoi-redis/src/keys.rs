//! Where a transport keeps its messages in Redis, and the commands that
//! write and read them there.

use std::time::Duration;

use envoi_core::transport::RawMessage;
use redis::Cmd;

use crate::codec;
use crate::scripts;

/// The consumer that holds the entries given back to the group (released,
/// or read ahead and not handed out) until a `get` claims them. Every
/// handle's own consumer name ends in `-` and 16 hex digits, so none is
/// this one.
pub(crate) const RELEASE_CONSUMER: &str = "envoi:released";

/// The keys and names one handle works with.
#[derive(Debug)]
pub(crate) struct Keys {
    /// The stream key.
    pub(crate) stream: String,
    /// The consumer group.
    pub(crate) group: String,
    /// This handle's consumer name in the group.
    pub(crate) consumer: String,
    /// The sorted set of delayed message ids, scored with their due time.
    pub(crate) delayed: String,
    /// The prefix of a delayed message's payload hash (`<prefix><id>`).
    pub(crate) payload_prefix: String,
    /// The `MAXLEN ~` cap of the stream, or empty for none.
    pub(crate) trim: String,
}

impl Keys {
    pub(crate) fn new(
        stream: String,
        group: String,
        consumer: String,
        trim: Option<usize>,
    ) -> Self {
        Self {
            delayed: format!("{stream}:delayed"),
            payload_prefix: format!("{stream}:delayed:"),
            trim: trim.map(|n| n.to_string()).unwrap_or_default(),
            stream,
            group,
            consumer,
        }
    }

    /// The payload hash of delayed message `id`.
    pub(crate) fn payload(&self, id: &str) -> String {
        format!("{}{id}", self.payload_prefix)
    }

    /// `XADD` of `raw` at the end of the stream (capped when `trim` is set).
    pub(crate) fn xadd(&self, raw: &RawMessage) -> Cmd {
        let (args, bytes) = codec::fields_size(raw);
        let mut cmd = Cmd::with_capacity(args + 6, bytes + 8 + self.stream.len() + self.trim.len());
        cmd.arg("XADD").arg(&self.stream);
        if !self.trim.is_empty() {
            cmd.arg("MAXLEN").arg("~").arg(&self.trim);
        }
        cmd.arg("*");
        codec::push_fields(&mut cmd, raw);
        cmd
    }

    /// Stores `raw` as delayed message `id`, due in `delay_ms`.
    pub(crate) fn send_delayed(&self, raw: &RawMessage, delay_ms: u64, id: &str) -> Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(scripts::SEND_DELAYED)
            .arg(2)
            .arg(&self.delayed)
            .arg(self.payload(id))
            .arg(delay_ms)
            .arg(id);
        codec::push_fields(&mut cmd, raw);
        cmd
    }

    /// `XREADGROUP` for up to `max` new entries of this consumer, waiting
    /// up to `block` for one when given.
    pub(crate) fn read_new(&self, max: usize, block: Option<Duration>) -> Cmd {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(max);
        if let Some(block) = block {
            cmd.arg("BLOCK").arg(millis(block).max(1));
        }
        cmd.arg("STREAMS").arg(&self.stream).arg(">");
        cmd
    }

    /// `XACK` of `ids` in the group.
    pub(crate) fn xack(&self, ids: &[&str]) -> Cmd {
        let mut cmd = redis::cmd("XACK");
        cmd.arg(&self.stream).arg(&self.group).arg(ids);
        cmd
    }
}

/// `CLIENT SETNAME` takes no spaces nor special characters.
pub(crate) fn client_name(stream: &str, consumer: &str) -> String {
    format!("envoi:{stream}:{consumer}")
        .chars()
        .map(|c| if c.is_ascii_graphic() { c } else { '_' })
        .collect()
}

/// `d` in whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_names_hold_no_spaces_or_control_characters() {
        assert_eq!(client_name("my stream", "c\n1"), "envoi:my_stream:c_1");
        assert_eq!(
            client_name("envoi:a", "consumer-1"),
            "envoi:envoi:a:consumer-1"
        );
    }

    #[test]
    fn the_delay_set_and_payloads_live_next_to_the_stream() {
        let keys = Keys::new("s".into(), "g".into(), "c".into(), Some(10));
        assert_eq!(keys.delayed, "s:delayed");
        assert_eq!(keys.payload("abc"), "s:delayed:abc");
        assert_eq!(keys.trim, "10");
        let xadd: Vec<_> = keys
            .xadd(&RawMessage::default())
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
                _ => String::new(),
            })
            .collect();
        assert_eq!(xadd[..6], ["XADD", "s", "MAXLEN", "~", "10", "*"]);
    }
}
