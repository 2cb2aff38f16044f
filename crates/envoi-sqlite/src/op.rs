//! What the writer task is asked to do, and what it answers.

use envoi_core::transport::Delivery;
use tokio::sync::oneshot;

/// Where the writer sends an operation's outcome.
pub(crate) type Reply<T> = oneshot::Sender<Result<T, sqlx::Error>>;

/// A row to insert.
pub(crate) struct NewRow {
    pub(crate) body: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) created_at: i64,
    pub(crate) available_at: i64,
}

/// An operation for the writer.
pub(crate) enum Op {
    /// Create the table and its index, bring an older one up to date.
    Setup(Reply<()>),
    /// Insert rows; answers their ids, in order.
    Insert(Vec<NewRow>, Reply<Vec<i64>>),
    /// Lease up to `take` available rows until `until`.
    Claim {
        take: usize,
        now: i64,
        until: i64,
        reply: Reply<Vec<Delivery>>,
    },
    /// Delete rows by id (ack, reject).
    Remove(Vec<i64>, Reply<()>),
    /// Make leased rows available again.
    Release {
        ids: Vec<i64>,
        now: i64,
        /// Only rows still leased by the claim at this time (their
        /// `delivered_at`); any leased row when `None`.
        claim: Option<i64>,
        reply: Option<Reply<()>>,
    },
    /// Extend a row's lease to `until`.
    Keepalive {
        id: i64,
        until: i64,
        reply: Reply<()>,
    },
    /// Delete every row of the queue; answers how many.
    Purge(Reply<u64>),
    /// Delete every row of the queue, then the table if no other queue's
    /// rows are left in it.
    Drop(Reply<()>),
    /// Finish what queued before, close the connection, then answer.
    Close(oneshot::Sender<()>),
}

/// What applying an operation gave.
pub(crate) enum Outcome {
    Done,
    Count(u64),
    Ids(Vec<i64>),
    Deliveries(Vec<Delivery>),
}

impl Op {
    /// Whether committing it makes messages available to consumers.
    pub(crate) fn wakes(&self) -> bool {
        matches!(self, Op::Insert(..) | Op::Release { .. })
    }

    /// Whether it takes several statements that must commit together: a
    /// batch failing half-way must store none of its rows, or a caller
    /// told it failed would store the first ones twice by sending again;
    /// a drop must not leave the table without the rows it counted on.
    pub(crate) fn several_statements(&self) -> bool {
        match self {
            Op::Insert(rows, _) => rows.len() > 1,
            Op::Drop(_) => true,
            _ => false,
        }
    }
}

impl Outcome {
    /// The outcome an operation answering `()` expects.
    pub(crate) fn done(self) -> Result<(), sqlx::Error> {
        match self {
            Outcome::Done => Ok(()),
            _ => Err(unexpected("an operation")),
        }
    }

    /// The outcome of an insert.
    pub(crate) fn ids(self) -> Result<Vec<i64>, sqlx::Error> {
        match self {
            Outcome::Ids(ids) => Ok(ids),
            _ => Err(unexpected("an insert")),
        }
    }

    /// The outcome of a claim.
    pub(crate) fn deliveries(self) -> Result<Vec<Delivery>, sqlx::Error> {
        match self {
            Outcome::Deliveries(d) => Ok(d),
            _ => Err(unexpected("a claim")),
        }
    }

    /// The outcome of a purge.
    pub(crate) fn count(self) -> Result<u64, sqlx::Error> {
        match self {
            Outcome::Count(n) => Ok(n),
            _ => Err(unexpected("a purge")),
        }
    }
}

fn unexpected(what: &str) -> sqlx::Error {
    sqlx::Error::Protocol(format!("unexpected outcome of {what}"))
}
