//! The writer: one task owning the handle's write connection. SQLite has a
//! single writer per database, so writes queue anyway; queuing them here
//! lets the task commit everything that queued while it was busy in one
//! transaction (group commit), so concurrent sends, claims and acks share
//! commits instead of taking turns on the write lock.

use std::sync::Arc;

use envoi_core::transport::{Delivery, RawMessage};
use envoi_core::Headers;
use sqlx::sqlite::{SqliteConnection, SqliteRow};
use sqlx::{AssertSqlSafe, Connection, Row};
use tokio::sync::{mpsc, oneshot};

use crate::sql::Statements;
use crate::transport::Signal;

/// The header set on a delivery whose stored headers are not a JSON object
/// of strings (the row was written by something else). The message is still
/// handed out, so the worker can move it to the failure transport instead
/// of the row blocking the queue.
pub const INVALID_HEADERS: &str = "X-Envoi-Invalid-Headers";

/// Most operations committed together.
const MAX_GROUP: usize = 256;

/// Rows per multi-row `INSERT`; the remainder goes through the single-row
/// statement, so only two insert statements are ever prepared.
pub(crate) const INSERT_CHUNK: usize = 64;

type Reply<T> = oneshot::Sender<Result<T, sqlx::Error>>;

/// A row to insert.
pub(crate) struct NewRow {
    pub(crate) body: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) created_at: i64,
    pub(crate) available_at: i64,
}

/// What the writer is asked to do.
pub(crate) enum Op {
    Setup(Reply<()>),
    Insert(Vec<NewRow>, Reply<Vec<i64>>),
    Claim {
        take: usize,
        now: i64,
        until: i64,
        reply: Reply<Vec<Delivery>>,
    },
    Delete(Vec<i64>, Reply<()>),
    Release {
        ids: Vec<i64>,
        now: i64,
        reply: Option<Reply<()>>,
    },
    Keepalive {
        id: i64,
        until: i64,
        reply: Reply<()>,
    },
}

enum Outcome {
    Done,
    Ids(Vec<i64>),
    Deliveries(Vec<Delivery>),
}

pub(crate) struct Writer {
    pub(crate) conn: SqliteConnection,
    pub(crate) sql: Arc<Statements>,
    pub(crate) queue: Arc<str>,
    pub(crate) signal: Arc<Signal>,
    pub(crate) rx: mpsc::Receiver<Op>,
}

fn q(sql: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(sql))
}

pub(crate) fn decode_row(row: &SqliteRow) -> Result<Delivery, sqlx::Error> {
    let id: i64 = row.try_get(0)?;
    let body: Vec<u8> = row.try_get(1)?;
    let headers: &str = row.try_get(2)?;
    let headers = if headers == "{}" {
        Headers::new()
    } else {
        serde_json::from_str(headers).unwrap_or_else(|e| {
            Headers::from([(
                INVALID_HEADERS,
                format!("stored headers are not a JSON object of strings: {e}"),
            )])
        })
    };
    Ok(Delivery {
        id: id.to_string(),
        raw: RawMessage { body, headers },
    })
}

fn id_list(ids: &[i64]) -> String {
    let mut s = String::with_capacity(ids.len() * 8 + 2);
    s.push('[');
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&id.to_string());
    }
    s.push(']');
    s
}

impl Op {
    /// Whether committing it makes messages available to consumers.
    fn wakes(&self) -> bool {
        matches!(self, Op::Insert(..) | Op::Release { .. })
    }
}

impl Writer {
    /// Runs until every handle is gone.
    pub(crate) async fn run(mut self) {
        let mut group: Vec<Op> = Vec::with_capacity(16);
        while let Some(op) = self.rx.recv().await {
            group.push(op);
            while group.len() < MAX_GROUP {
                match self.rx.try_recv() {
                    Ok(op) => group.push(op),
                    Err(_) => break,
                }
            }
            let wake = group.iter().any(Op::wakes);
            if group.len() == 1 {
                if let Some(op) = group.pop() {
                    let outcome = apply(&mut self.conn, &self.sql, &self.queue, &op).await;
                    self.reply(op, outcome).await;
                }
            } else {
                self.commit_group(&mut group).await;
            }
            if wake {
                self.signal.wake();
            }
        }
        let _ = self.conn.close().await;
    }

    /// Applies `group` in one transaction; if anything in it fails, applies
    /// each on its own so one failure does not fail the others.
    async fn commit_group(&mut self, group: &mut Vec<Op>) {
        if let Some(outcomes) = self.try_group(group).await {
            for (op, outcome) in group.drain(..).zip(outcomes) {
                self.reply(op, Ok(outcome)).await;
            }
            return;
        }
        for op in group.drain(..) {
            let outcome = apply(&mut self.conn, &self.sql, &self.queue, &op).await;
            self.reply(op, outcome).await;
        }
    }

    /// The outcomes of `group` applied and committed in one transaction, or
    /// `None` (rolled back) if any part failed.
    async fn try_group(&mut self, group: &[Op]) -> Option<Vec<Outcome>> {
        let mut tx = self.conn.begin_with("BEGIN IMMEDIATE").await.ok()?;
        let mut outcomes = Vec::with_capacity(group.len());
        for op in group {
            match apply(&mut tx, &self.sql, &self.queue, op).await {
                Ok(o) => outcomes.push(o),
                Err(_) => {
                    let _ = tx.rollback().await;
                    return None;
                }
            }
        }
        tx.commit().await.ok()?;
        Some(outcomes)
    }

    async fn reply(&mut self, op: Op, outcome: Result<Outcome, sqlx::Error>) {
        match (op, outcome) {
            (Op::Claim { reply, .. }, Ok(Outcome::Deliveries(d))) => {
                if let Err(Ok(unwanted)) = reply.send(Ok(d)) {
                    // The caller gave up waiting: give the rows back now
                    // rather than after the lease.
                    let ids: Vec<i64> = unwanted.iter().filter_map(|d| d.id.parse().ok()).collect();
                    let release = Op::Release {
                        ids,
                        now: crate::transport::now_ms(),
                        reply: None,
                    };
                    let _ = apply(&mut self.conn, &self.sql, &self.queue, &release).await;
                    self.signal.wake();
                }
            }
            (Op::Insert(_, reply), Ok(Outcome::Ids(ids))) => {
                let _ = reply.send(Ok(ids));
            }
            (Op::Setup(reply) | Op::Delete(_, reply) | Op::Keepalive { reply, .. }, Ok(_)) => {
                let _ = reply.send(Ok(()));
            }
            (Op::Release { reply, .. }, Ok(_)) => {
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(()));
                }
            }
            (op, Err(e)) => match op {
                Op::Setup(r) | Op::Delete(_, r) | Op::Keepalive { reply: r, .. } => {
                    let _ = r.send(Err(e));
                }
                Op::Insert(_, r) => {
                    let _ = r.send(Err(e));
                }
                Op::Claim { reply, .. } => {
                    let _ = reply.send(Err(e));
                }
                Op::Release { reply, .. } => match reply {
                    Some(r) => {
                        let _ = r.send(Err(e));
                    }
                    None => tracing::warn!(error = %e, "releasing messages failed"),
                },
            },
            (Op::Claim { reply, .. }, Ok(_)) => {
                let _ = reply.send(Err(sqlx::Error::Protocol(
                    "unexpected claim outcome".into(),
                )));
            }
            (Op::Insert(_, reply), Ok(_)) => {
                let _ = reply.send(Err(sqlx::Error::Protocol(
                    "unexpected insert outcome".into(),
                )));
            }
        }
    }
}

async fn apply(
    conn: &mut SqliteConnection,
    sql: &Statements,
    queue: &Arc<str>,
    op: &Op,
) -> Result<Outcome, sqlx::Error> {
    let queue: &str = queue;
    match op {
        Op::Setup(_) => {
            sqlx::query(q(&sql.create_table))
                .execute(&mut *conn)
                .await?;
            sqlx::query(q(&sql.create_index))
                .execute(&mut *conn)
                .await?;
            Ok(Outcome::Done)
        }
        Op::Insert(rows, _) => {
            let mut ids = Vec::with_capacity(rows.len());
            let mut chunks = rows.chunks_exact(INSERT_CHUNK);
            for chunk in chunks.by_ref() {
                let mut query = sqlx::query(q(&sql.insert_chunk));
                for r in chunk {
                    query = query
                        .bind(queue)
                        .bind(r.body.as_slice())
                        .bind(r.headers.as_str())
                        .bind(r.created_at)
                        .bind(r.available_at);
                }
                let mut got: Vec<i64> = query
                    .fetch_all(&mut *conn)
                    .await?
                    .iter()
                    .map(|row| row.try_get::<i64, _>(0))
                    .collect::<Result<_, _>>()?;
                // Ids grow in insertion order; RETURNING promises no order.
                got.sort_unstable();
                ids.extend(got);
            }
            for r in chunks.remainder() {
                let done = sqlx::query(q(&sql.insert))
                    .bind(queue)
                    .bind(r.body.as_slice())
                    .bind(r.headers.as_str())
                    .bind(r.created_at)
                    .bind(r.available_at)
                    .execute(&mut *conn)
                    .await?;
                ids.push(done.last_insert_rowid());
            }
            Ok(Outcome::Ids(ids))
        }
        Op::Claim {
            take, now, until, ..
        } => {
            let rows = sqlx::query(q(&sql.claim))
                .bind(*now)
                .bind(*until)
                .bind(queue)
                .bind(i64::try_from(*take).unwrap_or(i64::MAX))
                .fetch_all(&mut *conn)
                .await?;
            let mut deliveries = Vec::with_capacity(rows.len());
            let mut broken = Vec::new();
            for row in &rows {
                match decode_row(row) {
                    Ok(d) => deliveries.push(d),
                    Err(e) => {
                        // A row that does not decode cannot be handed out: give
                        // it back and say so, rather than hold it in silence.
                        if let Ok(id) = row.try_get::<i64, _>(0) {
                            broken.push(id);
                        }
                        tracing::error!(queue, error = %e, "a claimed row does not decode");
                    }
                }
            }
            if !broken.is_empty() {
                sqlx::query(q(&sql.release_many))
                    .bind(id_list(&broken))
                    .bind(queue)
                    .bind(*now)
                    .execute(&mut *conn)
                    .await?;
            }
            // RETURNING gives no order: oldest first.
            deliveries.sort_by_key(|d| d.id.parse::<i64>().unwrap_or(i64::MAX));
            Ok(Outcome::Deliveries(deliveries))
        }
        Op::Delete(ids, _) => {
            match ids.as_slice() {
                [] => {}
                [id] => {
                    sqlx::query(q(&sql.ack))
                        .bind(*id)
                        .bind(queue)
                        .execute(&mut *conn)
                        .await?;
                }
                many => {
                    sqlx::query(q(&sql.ack_many))
                        .bind(id_list(many))
                        .bind(queue)
                        .execute(&mut *conn)
                        .await?;
                }
            }
            Ok(Outcome::Done)
        }
        Op::Release { ids, now, .. } => {
            match ids.as_slice() {
                [] => {}
                [id] => {
                    sqlx::query(q(&sql.release))
                        .bind(*id)
                        .bind(queue)
                        .bind(*now)
                        .execute(&mut *conn)
                        .await?;
                }
                many => {
                    sqlx::query(q(&sql.release_many))
                        .bind(id_list(many))
                        .bind(queue)
                        .bind(*now)
                        .execute(&mut *conn)
                        .await?;
                }
            }
            Ok(Outcome::Done)
        }
        Op::Keepalive { id, until, .. } => {
            sqlx::query(q(&sql.keepalive))
                .bind(*id)
                .bind(queue)
                .bind(*until)
                .execute(&mut *conn)
                .await?;
            Ok(Outcome::Done)
        }
    }
}
