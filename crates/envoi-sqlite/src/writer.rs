//! The writer: one task owning the handle's write connection. SQLite has a
//! single writer per database, so writes queue anyway; queuing them here
//! lets the task commit everything that queued while it was busy in one
//! transaction (group commit), so concurrent sends, claims and acks share
//! commits instead of taking turns on the write lock.

use std::borrow::Cow;
use std::sync::Arc;

use envoi_core::transport::{Delivery, RawMessage, REDELIVERED_HEADER};
use envoi_core::Headers;
use sqlx::sqlite::{SqliteConnection, SqliteRow};
use sqlx::{AssertSqlSafe, Connection, Row, TypeInfo, ValueRef};
use tokio::sync::{mpsc, oneshot};

use crate::sql::Statements;
use crate::transport::Signal;

/// The header set on a delivery whose stored headers are not TEXT holding a
/// JSON object of strings (the row was written by something else): it says
/// what is wrong. The headers that could be read (every string value of a
/// JSON object) are kept, and the stored text in [`STORED_HEADERS`]. The
/// message is still handed out, so the worker can move it to the failure
/// transport instead of the row blocking the queue.
pub const INVALID_HEADERS: &str = envoi_core::serializer::INVALID_HEADERS_HEADER;

/// The header holding a delivery's headers as they were stored, set with
/// [`INVALID_HEADERS`] (unless the stored value is NULL): the text as it
/// is or, when it is not UTF-8, as an SQL blob literal (`x'7b22ff…'`), so
/// nothing of it is lost.
pub const STORED_HEADERS: &str = "X-Envoi-Stored-Headers";

/// The header set on a delivery whose stored body is neither a BLOB nor
/// TEXT (the row was written by something else): it says what was stored.
/// The body handed out is the value as SQLite renders it as text (`5` for
/// the integer 5; empty for NULL).
pub const INVALID_BODY: &str = envoi_core::serializer::INVALID_BODY_HEADER;

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
        /// Only rows still leased by the claim at this time (their
        /// `delivered_at`); any leased row when `None`.
        claim: Option<i64>,
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

/// Reads a claimed, listed or found row (`id, body, headers`) as a
/// delivery. Only an unreadable id fails: a body or headers of the wrong
/// storage type, not UTF-8 or not a JSON object of strings are handed out
/// as well as they can be read, with [`INVALID_BODY`] or
/// [`INVALID_HEADERS`] saying what is wrong, so the worker parks the
/// message instead of the row coming back on every claim.
pub(crate) fn decode_row(row: &SqliteRow) -> Result<Delivery, sqlx::Error> {
    let id: i64 = row.try_get(0)?;
    // The storage classes first: reading a value as bytes may convert it.
    let body_class = storage_class(row, 1)?;
    let headers_class = storage_class(row, 2)?;
    // Unchecked: any storage class reads as bytes (a number as its text,
    // NULL as nothing); the classes above say whether that was expected.
    let body: Vec<u8> = row.try_get_unchecked(1)?;
    let stored: &[u8] = row.try_get_unchecked(2)?;
    let mut headers = read_headers(headers_class, stored);
    // The mark is the transport's to set, from the row's delivery count,
    // not a stored header's (envoi never stores it).
    headers.remove(REDELIVERED_HEADER);
    if !matches!(body_class, "BLOB" | "TEXT") {
        let handed_out = if body_class == "NULL" {
            "handed out empty"
        } else {
            "handed out as its text"
        };
        headers.insert(
            INVALID_BODY,
            format!("body stored as {body_class}, not BLOB: {handed_out}"),
        );
    }
    Ok(Delivery {
        id: id.to_string(),
        raw: RawMessage { body, headers },
    })
}

/// What [`INVALID_HEADERS`] or [`INVALID_BODY`] says is wrong with the row
/// `delivery` was read from; `None` when it was stored as envoi stores rows.
fn invalid_reason(delivery: &Delivery) -> Option<&str> {
    let raw = &delivery.raw;
    raw.header(INVALID_HEADERS).or(raw.header(INVALID_BODY))
}

/// The SQLite storage class of column `index`: `NULL`, `INTEGER`, `REAL`,
/// `TEXT` or `BLOB`.
fn storage_class(row: &SqliteRow, index: usize) -> Result<&'static str, sqlx::Error> {
    let value = row.try_get_raw(index)?;
    if value.is_null() {
        return Ok("NULL");
    }
    Ok(match value.type_info().name() {
        "INTEGER" => "INTEGER",
        "REAL" => "REAL",
        "TEXT" => "TEXT",
        "BLOB" => "BLOB",
        _ => "an unknown storage class",
    })
}

/// The headers of a row, stored as `class` holding `stored`.
fn read_headers(class: &str, stored: &[u8]) -> Headers {
    if class == "TEXT" {
        if let Ok(text) = std::str::from_utf8(stored) {
            if text == "{}" {
                return Headers::new();
            }
            match serde_json::from_str::<Headers>(text) {
                Ok(headers) => return headers,
                Err(e) => return salvage_headers(class, stored, Some(e)),
            }
        }
    }
    salvage_headers(class, stored, None)
}

/// The headers of a row that are not TEXT holding a JSON object of
/// strings: every string value of a JSON object, with [`INVALID_HEADERS`]
/// saying what is wrong and [`STORED_HEADERS`] keeping what was stored.
/// `parsed` is why reading them as headers failed, if that was tried: a
/// name given twice, which reading them as a JSON object hides.
#[cold]
fn salvage_headers(class: &str, stored: &[u8], parsed: Option<serde_json::Error>) -> Headers {
    let mut problems = Vec::new();
    let mut headers = Headers::new();
    if class != "TEXT" {
        problems.push(format!("headers stored as {class}, not TEXT"));
    }
    if class != "NULL" {
        let text = match std::str::from_utf8(stored) {
            Ok(text) => Cow::Borrowed(text),
            Err(e) => {
                problems.push(format!(
                    "stored headers are not UTF-8 ({e}); `{STORED_HEADERS}` holds them as a blob literal"
                ));
                String::from_utf8_lossy(stored)
            }
        };
        const NOT_AN_OBJECT: &str = "stored headers are not a JSON object of strings";
        match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(serde_json::Value::Object(map)) => {
                let mut not_strings = Vec::new();
                for (name, value) in map {
                    match value {
                        serde_json::Value::String(value) => {
                            headers.insert(name, value);
                        }
                        other => not_strings.push(format!("`{name}` holds {}", json_kind(&other))),
                    }
                }
                if !not_strings.is_empty() {
                    problems.push(format!("{NOT_AN_OBJECT}: {}", not_strings.join(", ")));
                }
            }
            Ok(other) => problems.push(format!("{NOT_AN_OBJECT}: they are {}", json_kind(&other))),
            Err(e) => problems.push(format!("{NOT_AN_OBJECT}: {e}")),
        }
        if let (true, Some(e)) = (problems.is_empty(), parsed) {
            problems.push(format!("{NOT_AN_OBJECT}: {e}"));
        }
        if !problems.is_empty() {
            let kept = match text {
                Cow::Borrowed(text) => text.to_owned(),
                // Not UTF-8: read lossily above, kept exactly here.
                Cow::Owned(_) => blob_literal(stored),
            };
            headers.insert(STORED_HEADERS, kept);
        }
    }
    if !problems.is_empty() {
        headers.insert(INVALID_HEADERS, problems.join("; "));
    }
    headers
}

/// What a JSON value is, for an error message.
fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// `bytes` as an SQL blob literal: `x'7b22ff'`.
fn blob_literal(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2 + 3);
    s.push_str("x'");
    for b in bytes {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    s.push('\'');
    s
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

    /// Whether it takes several statements that must commit together: a
    /// batch failing half-way must store none of its rows, or a caller
    /// told it failed would store the first ones twice by sending again.
    fn several_statements(&self) -> bool {
        matches!(self, Op::Insert(rows, _) if rows.len() > 1)
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

    /// The outcomes of `group` applied and committed in one transaction, or
    /// `None` (rolled back) if any part failed.
    async fn try_group(&mut self, group: &[Op]) -> Option<Vec<Outcome>> {
        self.in_transaction(group).await.ok()
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
                        claim: None,
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

/// Adds the `delivery_count` column to a table set up before it existed.
/// Another process may add it at the same time: the column being there
/// afterwards is what counts.
async fn add_delivery_count(
    conn: &mut SqliteConnection,
    sql: &Statements,
) -> Result<(), sqlx::Error> {
    let has = sqlx::query_scalar::<_, i64>(q(&sql.has_delivery_count));
    if has.fetch_one(&mut *conn).await? > 0 {
        return Ok(());
    }
    let added = sqlx::query(q(&sql.add_delivery_count))
        .execute(&mut *conn)
        .await;
    match added {
        Ok(_) => Ok(()),
        Err(e) => {
            let has = sqlx::query_scalar::<_, i64>(q(&sql.has_delivery_count));
            if has.fetch_one(&mut *conn).await? > 0 {
                Ok(())
            } else {
                Err(e)
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
            let legacy: i64 = sqlx::query_scalar(q(&sql.has_legacy_index))
                .fetch_one(&mut *conn)
                .await?;
            if legacy > 0 {
                sqlx::query(q(&sql.drop_legacy_index))
                    .execute(&mut *conn)
                    .await?;
            }
            add_delivery_count(conn, sql).await?;
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
            for row in &rows {
                match decode_row(row) {
                    Ok(mut d) => {
                        // Claimed before and not acknowledged.
                        if row.try_get::<i64, _>(3).is_ok_and(|count| count > 1) {
                            d = d.redelivered();
                        }
                        if let Some(reason) = invalid_reason(&d) {
                            // Handed out all the same, with the reason, so
                            // the worker parks it: given back, it would be
                            // claimed again on every poll.
                            tracing::warn!(
                                queue,
                                id = %d.id,
                                reason,
                                "a claimed row was not stored as envoi stores rows; it is handed out with the reason"
                            );
                        }
                        deliveries.push(d);
                    }
                    // Only the id can fail, and it is the table's integer
                    // primary key; a row without one could be neither
                    // acknowledged nor released, so it stays leased and
                    // comes back once per lease, reported each time.
                    Err(e) => tracing::error!(
                        queue,
                        error = %e,
                        "a claimed row has no readable id; it stays leased"
                    ),
                }
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
        Op::Release {
            ids, now, claim, ..
        } => {
            match (ids.as_slice(), claim) {
                ([], _) => {}
                ([id], None) => {
                    sqlx::query(q(&sql.release))
                        .bind(*id)
                        .bind(queue)
                        .bind(*now)
                        .execute(&mut *conn)
                        .await?;
                }
                (many, claim) => {
                    // Only rows still leased under `claim`, when given.
                    let sql = if claim.is_some() {
                        &sql.release_claimed
                    } else {
                        &sql.release_many
                    };
                    let mut query = sqlx::query(q(sql))
                        .bind(id_list(many))
                        .bind(queue)
                        .bind(*now);
                    if let Some(claim) = claim {
                        query = query.bind(*claim);
                    }
                    query.execute(&mut *conn).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The delivery `decode_row` makes of `SELECT 1, <body>, <headers>`.
    async fn decoded(body: &str, headers: &str) -> Delivery {
        let mut conn = SqliteConnection::connect("sqlite::memory:")
            .await
            .expect("memory db");
        let row = sqlx::query(AssertSqlSafe(format!("SELECT 1, {body}, {headers}")))
            .fetch_one(&mut conn)
            .await
            .expect("select");
        decode_row(&row).expect("a row with an id decodes")
    }

    #[tokio::test]
    async fn rows_stored_as_envoi_stores_them_decode_without_a_reason() {
        let d = decoded("x'7b7d'", r#"'{"type":"Job","kind":"command"}'"#).await;
        assert_eq!(d.id, "1");
        assert_eq!(d.raw.body, b"{}");
        assert_eq!(
            d.raw.headers,
            Headers::from([("kind", "command"), ("type", "Job")])
        );
        // A TEXT body is read as its bytes, as before.
        let d = decoded("'{}'", "'{}'").await;
        assert_eq!(
            (d.raw.body.as_slice(), d.raw.headers.len()),
            (&b"{}"[..], 0)
        );
    }

    #[tokio::test]
    async fn a_body_of_the_wrong_storage_class_is_read_as_its_text_with_the_reason() {
        for (body, bytes, reason) in [
            (
                "5",
                &b"5"[..],
                "body stored as INTEGER, not BLOB: handed out as its text",
            ),
            (
                "2.5",
                b"2.5",
                "body stored as REAL, not BLOB: handed out as its text",
            ),
            (
                "NULL",
                b"",
                "body stored as NULL, not BLOB: handed out empty",
            ),
        ] {
            let d = decoded(body, r#"'{"type":"Job"}'"#).await;
            assert_eq!(d.raw.body, bytes, "{body}");
            assert_eq!(d.raw.header(INVALID_BODY), Some(reason), "{body}");
            assert_eq!(d.raw.header("type"), Some("Job"), "{body}");
            assert_eq!(d.raw.header(INVALID_HEADERS), None, "{body}");
        }
    }

    #[tokio::test]
    async fn invalid_headers_keep_their_strings_and_the_stored_text_with_the_reason() {
        /// Stored headers, the headers read, the stored text kept, the reason.
        type Case = (
            &'static str,
            &'static [(&'static str, &'static str)],
            Option<&'static str>,
            &'static str,
        );
        let cases: [Case; 8] = [
            (
                r#"'{"type":"Job","type":"Other"}'"#,
                &[("type", "Other")],
                Some(r#"{"type":"Job","type":"Other"}"#),
                "stored headers are not a JSON object of strings: \
                 header `type` is given more than once at line 1 column 29",
            ),
            (
                r#"CAST('{"type":"Job"}' AS BLOB)"#,
                &[("type", "Job")],
                Some(r#"{"type":"Job"}"#),
                "headers stored as BLOB, not TEXT",
            ),
            (
                "CAST(x'7b22ff223a2231227d' AS TEXT)",
                &[("\u{fffd}", "1")],
                Some("x'7b22ff223a2231227d'"),
                "stored headers are not UTF-8 (invalid utf-8 sequence of 1 bytes from index 2); \
                 `X-Envoi-Stored-Headers` holds them as a blob literal",
            ),
            (
                r#"'{"type":"Job","n":1,"tags":["a"]}'"#,
                &[("type", "Job")],
                Some(r#"{"type":"Job","n":1,"tags":["a"]}"#),
                "stored headers are not a JSON object of strings: `n` holds a number, \
                 `tags` holds an array",
            ),
            (
                "'not json'",
                &[],
                Some("not json"),
                "stored headers are not a JSON object of strings: expected ident at line 1 column 2",
            ),
            (
                "'[1,2]'",
                &[],
                Some("[1,2]"),
                "stored headers are not a JSON object of strings: they are an array",
            ),
            (
                "7",
                &[],
                Some("7"),
                "headers stored as INTEGER, not TEXT; \
                 stored headers are not a JSON object of strings: they are a number",
            ),
            ("NULL", &[], None, "headers stored as NULL, not TEXT"),
        ];
        for (stored, read, kept, reason) in cases {
            let d = decoded("x'7b7d'", stored).await;
            let mut expected: Headers = read.iter().copied().collect();
            expected.insert(INVALID_HEADERS, reason);
            if let Some(kept) = kept {
                expected.insert(STORED_HEADERS, kept);
            }
            assert_eq!(d.raw.headers, expected, "{stored}");
            assert_eq!(d.raw.body, b"{}", "{stored}");
        }
    }

    #[test]
    fn a_blob_literal_spells_every_byte_in_lowercase_hex() {
        assert_eq!(blob_literal(&[0x7b, 0x00, 0xff, 0x0a]), "x'7b00ff0a'");
        assert_eq!(blob_literal(&[]), "x''");
    }
}
