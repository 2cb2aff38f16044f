//! The writer: one task owning the handle's write connection. SQLite has a
//! single writer per database, so writes queue anyway; queuing them here
//! lets the task commit everything that queued while it was busy in one
//! transaction (group commit), so concurrent sends, claims and acks share
//! commits instead of taking turns on the write lock.

use std::sync::Arc;

use envoi_core::transport::Delivery;
use sqlx::sqlite::SqliteConnection;
use sqlx::Connection;
use tokio::sync::{mpsc, oneshot};

use crate::apply::apply;
use crate::op::{Op, Outcome, Reply};
use crate::signal::Signal;
use crate::sql::Statements;

/// Most operations committed together.
const MAX_GROUP: usize = 256;

pub(crate) struct Writer {
    pub(crate) conn: SqliteConnection,
    pub(crate) sql: Arc<Statements>,
    pub(crate) queue: Arc<str>,
    pub(crate) signal: Arc<Signal>,
    pub(crate) rx: mpsc::Receiver<Op>,
}

impl Writer {
    /// Runs until every handle is gone, or one asks it to close; then
    /// closes the connection and answers those that asked.
    pub(crate) async fn run(mut self) {
        let mut group: Vec<Op> = Vec::with_capacity(16);
        let mut closing = Vec::new();
        while let Some(op) = self.rx.recv().await {
            self.gather(op, &mut group, &mut closing);
            if group.is_empty() {
                continue;
            }
            let wake = group.iter().any(Op::wakes);
            if group.len() == 1 {
                if let Some(op) = group.pop() {
                    let outcome = self.apply_alone(&op).await;
                    self.reply(op, outcome).await;
                }
            } else {
                self.commit_group(&mut group).await;
            }
            if wake {
                self.signal.wake();
            }
        }
        if let Err(e) = self.conn.close().await {
            tracing::warn!(error = %e, "closing the SQLite write connection failed");
        }
        for done in closing {
            let _ = done.send(());
        }
    }

    /// Adds `first` and what else queued (up to [`MAX_GROUP`]) to `group`.
    /// A request to close stops new operations from queuing; those queued
    /// before it are still applied.
    fn gather(&mut self, first: Op, group: &mut Vec<Op>, closing: &mut Vec<oneshot::Sender<()>>) {
        let mut next = Some(first);
        while let Some(op) = next {
            match op {
                Op::Close(done) => {
                    closing.push(done);
                    self.rx.close();
                }
                op => group.push(op),
            }
            next = if group.len() < MAX_GROUP {
                self.rx.try_recv().ok()
            } else {
                None
            };
        }
    }

    /// Applies `group` in one transaction; if anything in it fails, applies
    /// each on its own so one failure does not fail the others.
    async fn commit_group(&mut self, group: &mut Vec<Op>) {
        if let Ok(outcomes) = self.in_transaction(group).await {
            for (op, outcome) in group.drain(..).zip(outcomes) {
                self.reply(op, Ok(outcome)).await;
            }
            return;
        }
        for op in group.drain(..) {
            let outcome = self.apply_alone(&op).await;
            self.reply(op, outcome).await;
        }
    }

    /// Applies one operation: straight on the connection when it is one
    /// statement, in a transaction of its own when it is several.
    async fn apply_alone(&mut self, op: &Op) -> Result<Outcome, sqlx::Error> {
        if !op.several_statements() {
            return apply(&mut self.conn, &self.sql, &self.queue, op).await;
        }
        // One operation, one outcome.
        let mut outcomes = self.in_transaction(std::slice::from_ref(op)).await?;
        outcomes.pop().ok_or(sqlx::Error::RowNotFound)
    }

    /// The outcomes of `ops` applied and committed in one transaction, or
    /// the first error (rolled back).
    async fn in_transaction(&mut self, ops: &[Op]) -> Result<Vec<Outcome>, sqlx::Error> {
        let mut tx = self.conn.begin_with("BEGIN IMMEDIATE").await?;
        let mut outcomes = Vec::with_capacity(ops.len());
        for op in ops {
            match apply(&mut tx, &self.sql, &self.queue, op).await {
                Ok(o) => outcomes.push(o),
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(e);
                }
            }
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    /// Answers the caller of `op`.
    async fn reply(&mut self, op: Op, outcome: Result<Outcome, sqlx::Error>) {
        fn send<T>(reply: Reply<T>, result: Result<T, sqlx::Error>) {
            let _ = reply.send(result);
        }
        match op {
            Op::Claim { reply, now, .. } => {
                if let Err(Ok(unwanted)) = reply.send(outcome.and_then(Outcome::deliveries)) {
                    self.give_back_unwanted(unwanted, now).await;
                }
            }
            Op::Insert(_, reply) => send(reply, outcome.and_then(Outcome::ids)),
            Op::Purge(reply) => send(reply, outcome.and_then(Outcome::count)),
            Op::Setup(reply)
            | Op::Remove(_, reply)
            | Op::Keepalive { reply, .. }
            | Op::Drop(reply) => send(reply, outcome.and_then(Outcome::done)),
            Op::Release { reply, .. } => match (reply, outcome) {
                (Some(reply), outcome) => send(reply, outcome.and_then(Outcome::done)),
                (None, Err(e)) => tracing::warn!(error = %e, "releasing messages failed"),
                (None, Ok(_)) => {}
            },
            // Never gathered into a group.
            Op::Close(done) => {
                let _ = done.send(());
            }
        }
    }

    /// Gives back at once, rather than after the lease, the rows of the
    /// claim made at `claim` whose caller gave up waiting: never handed
    /// out, that claim does not count as a delivery.
    async fn give_back_unwanted(&mut self, unwanted: Vec<Delivery>, claim: i64) {
        let ids: Vec<i64> = unwanted
            .iter()
            .filter_map(|d| d.id.as_str().parse().ok())
            .collect();
        let release = Op::Release {
            ids,
            now: crate::transport::now_ms(),
            claim: Some(claim),
            reply: None,
        };
        let _ = apply(&mut self.conn, &self.sql, &self.queue, &release).await;
        self.signal.wake();
    }
}
