//! Each writer operation as the statements it runs on the write
//! connection (or in the transaction the writer opened on it).

use std::sync::Arc;

use envoi_core::transport::Delivery;
use sqlx::sqlite::{SqliteConnection, SqliteRow};
use sqlx::{AssertSqlSafe, Row};

use crate::op::{NewRow, Op, Outcome};
use crate::row::{decode_row, invalid_reason};
use crate::sql::Statements;

/// Rows per multi-row `INSERT`; the remainder goes through the single-row
/// statement, so only two insert statements are ever prepared.
pub(crate) const INSERT_CHUNK: usize = 64;

pub(crate) fn q(sql: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(sql))
}

/// Runs `op` for the queue `queue`.
pub(crate) async fn apply(
    conn: &mut SqliteConnection,
    sql: &Statements,
    queue: &str,
    op: &Op,
) -> Result<Outcome, sqlx::Error> {
    let done = |()| Outcome::Done;
    match op {
        Op::Setup(_) => setup(conn, sql).await.map(done),
        Op::Insert(rows, _) => insert(conn, sql, queue, rows).await.map(Outcome::Ids),
        Op::Claim {
            take, now, until, ..
        } => claim(conn, sql, queue, *take, (*now, *until))
            .await
            .map(Outcome::Deliveries),
        Op::Remove(ids, _) => remove(conn, sql, queue, ids).await.map(done),
        Op::Release {
            ids, now, claim, ..
        } => release(conn, sql, queue, ids, *now, *claim).await.map(done),
        Op::Keepalive { id, until, .. } => {
            sqlx::query(q(&sql.keepalive))
                .bind(*id)
                .bind(queue)
                .bind(*until)
                .execute(&mut *conn)
                .await?;
            Ok(Outcome::Done)
        }
        Op::Purge(_) => purge(conn, sql, queue).await.map(Outcome::Count),
        Op::Drop(_) => drop_table(conn, sql, queue).await.map(done),
        // The writer answers it itself, once the connection is closed.
        Op::Close(_) => Ok(Outcome::Done),
    }
}

/// Creates the table and its index, replaces the index under its former
/// name and adds the `delivery_count` column to a table made before it.
async fn setup(conn: &mut SqliteConnection, sql: &Statements) -> Result<(), sqlx::Error> {
    sqlx::query(q(&sql.schema.create_table))
        .execute(&mut *conn)
        .await?;
    sqlx::query(q(&sql.schema.create_index))
        .execute(&mut *conn)
        .await?;
    let legacy: i64 = sqlx::query_scalar(q(&sql.schema.has_legacy_index))
        .fetch_one(&mut *conn)
        .await?;
    if legacy > 0 {
        sqlx::query(q(&sql.schema.drop_legacy_index))
            .execute(&mut *conn)
            .await?;
    }
    add_delivery_count(conn, sql).await
}

/// Adds the `delivery_count` column to a table set up before it existed.
/// Another process may add it at the same time: the column being there
/// afterwards is what counts.
async fn add_delivery_count(
    conn: &mut SqliteConnection,
    sql: &Statements,
) -> Result<(), sqlx::Error> {
    let has = sqlx::query_scalar::<_, i64>(q(&sql.schema.has_delivery_count));
    if has.fetch_one(&mut *conn).await? > 0 {
        return Ok(());
    }
    let added = sqlx::query(q(&sql.schema.add_delivery_count))
        .execute(&mut *conn)
        .await;
    match added {
        Ok(_) => Ok(()),
        Err(e) => {
            let has = sqlx::query_scalar::<_, i64>(q(&sql.schema.has_delivery_count));
            if has.fetch_one(&mut *conn).await? > 0 {
                Ok(())
            } else {
                Err(e)
            }
        }
    }
}

/// Inserts `rows`, [`INSERT_CHUNK`] per statement; their ids in order.
async fn insert(
    conn: &mut SqliteConnection,
    sql: &Statements,
    queue: &str,
    rows: &[NewRow],
) -> Result<Vec<i64>, sqlx::Error> {
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
    Ok(ids)
}

/// Leases up to `take` available rows at `now` until `until`, oldest
/// first.
async fn claim(
    conn: &mut SqliteConnection,
    sql: &Statements,
    queue: &str,
    take: usize,
    (now, until): (i64, i64),
) -> Result<Vec<Delivery>, sqlx::Error> {
    let rows = sqlx::query(q(&sql.claim))
        .bind(now)
        .bind(until)
        .bind(queue)
        .bind(i64::try_from(take).unwrap_or(i64::MAX))
        .fetch_all(&mut *conn)
        .await?;
    let mut deliveries: Vec<Delivery> = rows.iter().filter_map(|row| claimed(row, queue)).collect();
    // RETURNING gives no order: oldest first.
    deliveries.sort_by_key(|d| d.id.as_str().parse::<i64>().unwrap_or(i64::MAX));
    Ok(deliveries)
}

/// A claimed row (`id, body, headers, delivery_count`) as a delivery,
/// marked as redelivered when it was claimed before and not acknowledged
/// (its lease ran out, or it was released).
fn claimed(row: &SqliteRow, queue: &str) -> Option<Delivery> {
    let mut delivery = match decode_row(row) {
        Ok(delivery) => delivery,
        // Only the id can fail, and it is the table's integer primary key;
        // a row without one could be neither acknowledged nor released, so
        // it stays leased and comes back once per lease, reported each time.
        Err(e) => {
            tracing::error!(
                queue,
                error = %e,
                "a claimed row has no readable id; it stays leased"
            );
            return None;
        }
    };
    if row.try_get::<i64, _>(3).is_ok_and(|count| count > 1) {
        delivery = delivery.mark_redelivered();
    }
    if let Some(reason) = invalid_reason(&delivery) {
        // Handed out all the same, with the reason, so the worker parks
        // it: given back, it would be claimed again on every poll.
        tracing::warn!(
            queue,
            id = %delivery.id,
            reason,
            "a claimed row was not stored as envoi stores rows; it is handed out with the reason"
        );
    }
    Some(delivery)
}

/// Deletes the queue's rows with these ids.
async fn remove(
    conn: &mut SqliteConnection,
    sql: &Statements,
    queue: &str,
    ids: &[i64],
) -> Result<(), sqlx::Error> {
    match ids {
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
    Ok(())
}

/// Makes the queue's leased rows with these ids available at `now`: any
/// leased row, or only those still leased by the claim at `claim`.
async fn release(
    conn: &mut SqliteConnection,
    sql: &Statements,
    queue: &str,
    ids: &[i64],
    now: i64,
    claim: Option<i64>,
) -> Result<(), sqlx::Error> {
    match (ids, claim) {
        ([], _) => {}
        ([id], None) => {
            sqlx::query(q(&sql.release))
                .bind(*id)
                .bind(queue)
                .bind(now)
                .execute(&mut *conn)
                .await?;
        }
        (many, None) => {
            sqlx::query(q(&sql.release_many))
                .bind(id_list(many))
                .bind(queue)
                .bind(now)
                .execute(&mut *conn)
                .await?;
        }
        (many, Some(claim)) => {
            sqlx::query(q(&sql.release_claimed))
                .bind(id_list(many))
                .bind(queue)
                .bind(now)
                .bind(claim)
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(())
}

/// Deletes every row of the queue; how many there were.
async fn purge(
    conn: &mut SqliteConnection,
    sql: &Statements,
    queue: &str,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(q(&sql.purge))
        .bind(queue)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected())
}

/// Deletes the queue's rows, then the table (and its index) when no other
/// queue's rows are left in it. Nothing to do when there is no table.
async fn drop_table(
    conn: &mut SqliteConnection,
    sql: &Statements,
    queue: &str,
) -> Result<(), sqlx::Error> {
    let exists: i64 = sqlx::query_scalar(q(&sql.schema.table_exists))
        .fetch_one(&mut *conn)
        .await?;
    if exists == 0 {
        return Ok(());
    }
    purge(conn, sql, queue).await?;
    let others: i64 = sqlx::query_scalar(q(&sql.schema.has_rows))
        .fetch_one(&mut *conn)
        .await?;
    if others == 0 {
        sqlx::query(q(&sql.schema.drop_table))
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// `ids` as a JSON array, for `json_each`.
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
