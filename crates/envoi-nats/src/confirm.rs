//! Settling the server confirms: acks and naks are sent until JetStream has
//! applied them, and sent again after a reconnect while their message's
//! lease lasts.
//!
//! A plain publish only queues the ack on the connection: a process that
//! exits right after (a worker stopped by SIGTERM), or a connection that
//! dies before the server read it (a broker restart), loses it, and the
//! message comes back after its lease to be handled again. So every ack and
//! nak goes out as a publish, and the last one of a batch as a request,
//! which the server answers once it has applied it. The consumer applies
//! the acks of one connection in order, so that answer confirms every ack
//! of the batch, provided they all went out on the connection the answer
//! came back on: when the client reconnected in between (its count of
//! connections moved), the batch is sent again. Acking twice is harmless.
//! With `double_ack`, every ack is a request of its own, and only those
//! not answered are sent again.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::client::RequestErrorKind;
use async_nats::connection::State;
use async_nats::jetstream::AckKind;
use async_nats::{Client, Subject};
use bytes::Bytes;
use envoi_core::transport::support::Backoff;
use envoi_core::TransportError;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;

use crate::transport::backend;
use crate::NatsTransport;

/// The longest one attempt waits for the server's answer before the
/// settlement is sent again.
const ATTEMPT: Duration = Duration::from_secs(5);
/// How often a wait for an answer checks whether the client reconnected.
const RECONNECT_POLL: Duration = Duration::from_millis(25);
/// How long settling goes on while nobody listens on the ack subjects: the
/// consumer is gone (deleted), or JetStream is not back yet after a restart.
const NO_RESPONDERS_GRACE: Duration = Duration::from_secs(2);

/// An ack or nak to have confirmed: the ack subject of one delivery, and
/// when its lease ends (past it, JetStream may have handed the message to
/// another consumer, and it is not sent again).
#[derive(Debug)]
pub(crate) struct Settlement {
    pub(crate) reply: Subject,
    pub(crate) lease_ends: Instant,
}

/// How one attempt ended.
enum Attempt {
    /// Every settlement was confirmed.
    Confirmed,
    /// The client reconnected meanwhile: send again at once.
    Reconnected,
    /// No answer, or a failure: send again after a pause.
    Failed { why: String, no_responders: bool },
}

/// How many times the client has connected (the first connection
/// included): it moves when the client reconnects.
fn connections(client: &Client) -> u64 {
    client.statistics().connects.load(Ordering::Relaxed)
}

/// Resolves once the client has connected again since `since`.
async fn reconnected(client: &Client, since: u64) {
    while connections(client) == since {
        tokio::time::sleep(RECONNECT_POLL).await;
    }
}

/// Sends `payload` to `reply` as a request and waits for the server's
/// answer. `Err` says why there was none, and whether nobody listens.
async fn request(client: &Client, reply: Subject, payload: Bytes) -> Result<(), (String, bool)> {
    match client.request(reply, payload).await {
        Ok(answer) => match answer.status {
            Some(status) if !status.is_success() => {
                Err((format!("the server answered {status}"), false))
            }
            _ => Ok(()),
        },
        Err(e) => {
            let no_responders = e.kind() == RequestErrorKind::NoResponders;
            Err((e.to_string(), no_responders))
        }
    }
}

impl NatsTransport {
    /// Sends `kind` for every settlement in `pending` and returns once the
    /// server has confirmed them all; sends again what a reconnect may have
    /// lost or what got no answer, for as long as the lease of its message
    /// lasts. Fails, saying how many were not confirmed, once every lease
    /// has run out (those messages come back), when nobody listens on
    /// their ack subjects, or when the transport is closed meanwhile.
    pub(crate) async fn confirm(
        &self,
        what: &'static str,
        kind: AckKind,
        mut pending: Vec<Settlement>,
    ) -> Result<(), TransportError> {
        let payload = Bytes::from(kind);
        let mut pause = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        let mut why = String::new();
        let mut no_responders_since = None;
        let mut first = true;
        loop {
            if !first {
                self.check_open()?;
                let before = pending.len();
                let now = Instant::now();
                pending.retain(|s| s.lease_ends > now);
                if pending.is_empty() {
                    return Err(backend(
                        what,
                        format!(
                            "{before} not confirmed by the server before their lease ran out \
                             ({why}); their messages will be delivered again"
                        ),
                    ));
                }
            }
            first = false;
            match self.attempt(&payload, &mut pending).await {
                Attempt::Confirmed => return Ok(()),
                Attempt::Reconnected => {
                    why = "the connection was lost".into();
                    no_responders_since = None;
                }
                Attempt::Failed {
                    why: failure,
                    no_responders,
                } => {
                    why = failure;
                    if no_responders {
                        let since = *no_responders_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= NO_RESPONDERS_GRACE {
                            return Err(backend(
                                what,
                                format!(
                                    "{} not confirmed: nobody listens on their ack subjects \
                                     (the consumer is gone)",
                                    pending.len()
                                ),
                            ));
                        }
                    } else {
                        no_responders_since = None;
                    }
                    let last_lease = pending.iter().map(|s| s.lease_ends).max();
                    let wake = Instant::now() + pause.next_wait();
                    tokio::time::sleep_until(last_lease.map_or(wake, |end| wake.min(end))).await;
                }
            }
        }
    }

    /// One attempt: waits (within [`ATTEMPT`]) for the connection, sends
    /// everything in `pending` and waits for the answers. Takes out of
    /// `pending` what was confirmed.
    async fn attempt(&self, payload: &Bytes, pending: &mut Vec<Settlement>) -> Attempt {
        let client = &self.inner.client;
        let deadline = Instant::now() + ATTEMPT;
        while client.connection_state() != State::Connected {
            if Instant::now() >= deadline {
                return Attempt::Failed {
                    why: "not connected to the server".into(),
                    no_responders: false,
                };
            }
            tokio::time::sleep(RECONNECT_POLL).await;
        }
        let generation = connections(client);
        let mut confirmed = vec![false; pending.len()];
        let mut failure = None;
        let mut lost_connection = false;
        let sent = async {
            if self.inner.config.double_ack {
                let mut answers: FuturesUnordered<_> = pending
                    .iter()
                    .enumerate()
                    .map(|(i, s)| async move {
                        (i, request(client, s.reply.clone(), payload.clone()).await)
                    })
                    .collect();
                while let Some((i, answer)) = answers.next().await {
                    match answer {
                        Ok(()) => confirmed[i] = true,
                        Err(e) => failure = Some(e),
                    }
                }
            } else if let Some((last, rest)) = pending.split_last() {
                for s in rest {
                    if let Err(e) = client.publish(s.reply.clone(), payload.clone()).await {
                        failure = Some((e.to_string(), false));
                        return;
                    }
                }
                match request(client, last.reply.clone(), payload.clone()).await {
                    // In order on one connection: the answer to the last
                    // confirms them all, unless some went out on another.
                    Ok(()) if connections(client) == generation => confirmed.fill(true),
                    Ok(()) => {
                        if let Some(last) = confirmed.last_mut() {
                            *last = true;
                        }
                    }
                    Err(e) => failure = Some(e),
                }
            }
        };
        tokio::select! {
            () = sent => {}
            () = reconnected(client, generation) => lost_connection = true,
            () = tokio::time::sleep_until(deadline) => {
                failure.get_or_insert_with(|| (format!("no answer within {ATTEMPT:?}"), false));
            }
        }
        let mut answered = confirmed.into_iter();
        pending.retain(|_| !answered.next().unwrap_or(false));
        if pending.is_empty() {
            Attempt::Confirmed
        } else if lost_connection || connections(client) != generation {
            Attempt::Reconnected
        } else {
            let (why, no_responders) =
                failure.unwrap_or_else(|| ("no answer from the server".into(), false));
            Attempt::Failed { why, no_responders }
        }
    }
}
