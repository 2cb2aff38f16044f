//! What a baseline proves it did: every one of the N jobs consumed exactly
//! once, and as many rows deleted or entries acknowledged as it consumed.

use crate::e2e::Job;

/// The jobs a baseline consumed, by id (the ids sent are `0..n`).
#[derive(Debug)]
pub(crate) struct Tally {
    seen: Vec<bool>,
    count: u64,
}

impl Tally {
    /// None of `n` jobs consumed yet.
    pub(crate) fn new(n: u64) -> Self {
        Self {
            seen: vec![false; usize::try_from(n).unwrap_or(usize::MAX)],
            count: 0,
        }
    }

    /// Records job `id`; an id never sent, or one consumed before, fails.
    pub(crate) fn record(&mut self, id: u64) -> Result<(), String> {
        let slot = usize::try_from(id)
            .ok()
            .and_then(|i| self.seen.get_mut(i))
            .ok_or_else(|| format!("consumed job {id}, which was never sent"))?;
        if std::mem::replace(slot, true) {
            return Err(format!("consumed job {id} twice"));
        }
        self.count += 1;
        Ok(())
    }

    /// Decodes a consumed body as the worker does (the baseline pays for
    /// it too) and records its job.
    pub(crate) fn body(&mut self, bytes: &[u8]) -> Result<(), String> {
        let job: Job = serde_json::from_slice(bytes).map_err(|e| format!("bad body: {e}"))?;
        self.record(job.id)
    }

    /// Fails unless every job was consumed.
    pub(crate) fn finish(&self) -> Result<(), String> {
        if self.count as usize == self.seen.len() {
            Ok(())
        } else {
            Err(format!(
                "consumed {} distinct jobs of {}",
                self.count,
                self.seen.len()
            ))
        }
    }
}

/// Fails unless the backend reports `done` rows deleted (or entries
/// acknowledged) for the `n` messages consumed.
pub(crate) fn settled(what: &str, done: u64, n: u64) -> Result<(), String> {
    if done == n {
        Ok(())
    } else {
        Err(format!("{what} {done} for {n} messages consumed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_passes_only_when_every_job_came_exactly_once() {
        let mut tally = Tally::new(3);
        tally.record(2).unwrap();
        tally
            .body(br#"{"id":0,"payload":"order-00000000"}"#)
            .unwrap();
        assert_eq!(tally.finish().unwrap_err(), "consumed 2 distinct jobs of 3");
        tally.record(1).unwrap();
        tally.finish().unwrap();
    }

    #[test]
    fn a_duplicate_an_unknown_id_or_a_bad_body_fails_the_tally() {
        let mut tally = Tally::new(2);
        tally.record(1).unwrap();
        assert_eq!(tally.record(1).unwrap_err(), "consumed job 1 twice");
        assert_eq!(
            tally.record(2).unwrap_err(),
            "consumed job 2, which was never sent"
        );
        assert!(tally.body(b"not json").unwrap_err().starts_with("bad body"));
    }

    #[test]
    fn settled_counts_must_match_the_messages_consumed() {
        settled("deleted", 5, 5).unwrap();
        assert_eq!(
            settled("deleted", 4, 5).unwrap_err(),
            "deleted 4 for 5 messages consumed"
        );
    }
}
