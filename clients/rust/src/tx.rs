//! [`Tx`], the request's SQLx transaction that the layer lends the handler,
//! begun when the handler first asks for it.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

use crate::Error;

/// The request's transaction (`sqlx::Transaction<'static, Postgres>`), which
/// the layer lends the handler and commits with the stored response (or
/// rolls back) once the handler has finished. It is begun on the
/// application's `PgPool` when the handler first locks it, so a handler
/// that first calls another service (a payment provider) holds no
/// connection meanwhile (with `IdempotencyLayer::one_transaction`, it is
/// the transaction the claim was made in). It rides in the request's
/// extensions; it is cheap to clone.
///
/// In axum, take it as an extractor (`tx: Tx`, or `Option<Tx>` when the
/// layer may fail open); elsewhere `request.extensions().get::<Tx>()`.
/// [`Tx::lock`] gives the transaction to one task at a time. Do not commit
/// or roll it back yourself (nested `begin` makes a savepoint): the layer
/// ends it.
///
/// The layer also learns from it whether the handler finished: while a
/// `Tx` of the request is alive, or when one was dropped by a panic, the
/// response the layer gets is not the handler's own (a timeout answered
/// for it, or a panic handler did), and nothing of the request is kept.
#[derive(Clone)]
pub struct Tx {
    lent: Arc<Lent>,
}

/// What the layer and the handler's `Tx` handles share.
pub(crate) struct Lent {
    pool: PgPool,
    slot: Mutex<Slot>,
    unwound: AtomicBool,
}

/// The transaction's life.
enum Slot {
    /// Not begun yet: the handler has not asked for it.
    Idle,
    Open(Transaction<'static, Postgres>),
    /// Taken back by the layer.
    Ended,
}

/// The layer's side of a lent transaction.
pub(crate) struct Loan {
    lent: Arc<Lent>,
}

impl Loan {
    /// A transaction to lend: `begun`, or begun on `pool` when the handler first locks it.
    pub(crate) fn new(pool: PgPool, begun: Option<Transaction<'static, Postgres>>) -> Loan {
        let slot = Mutex::new(begun.map_or(Slot::Idle, Slot::Open));
        Loan { lent: Arc::new(Lent { pool, slot, unwound: AtomicBool::new(false) }) }
    }

    /// The handler's handle.
    pub(crate) fn tx(&self) -> Tx {
        Tx { lent: self.lent.clone() }
    }

    /// True when no handle of the handler is alive any more and none was
    /// dropped by a panic: the handler ran to its end (or never took one).
    pub(crate) fn handler_finished(&self) -> bool {
        Arc::strong_count(&self.lent) == 1 && !self.lent.unwound.load(Ordering::Acquire)
    }

    /// Takes the transaction back (waiting for a guard to drop); `None`
    /// when the handler never began it.
    pub(crate) async fn end(&self) -> Option<Transaction<'static, Postgres>> {
        match std::mem::replace(&mut *self.lent.slot.lock().await, Slot::Ended) {
            Slot::Open(transaction) => Some(transaction),
            Slot::Idle | Slot::Ended => None,
        }
    }
}

impl Tx {
    /// Locks the transaction for queries, for as long as the guard lives:
    /// `query.execute(&mut *guard)`, as with a `Transaction`. The first lock
    /// begins it on a connection of the pool (an error when none can be
    /// had: `Error::Database`, which answers 503). `Err(Error::TransactionEnded)`
    /// once the layer has taken it back.
    pub async fn lock(&self) -> Result<TxGuard<'_>, Error> {
        let mut slot = self.lent.slot.lock().await;
        if matches!(*slot, Slot::Idle) {
            *slot = Slot::Open(self.lent.pool.begin().await?);
        }
        MutexGuard::try_map(slot, |slot| match slot {
            Slot::Open(transaction) => Some(transaction),
            Slot::Idle | Slot::Ended => None,
        })
        .map(|guard| TxGuard { guard })
        .map_err(|_| Error::TransactionEnded)
    }
}

impl Drop for Tx {
    /// Notes a handle dropped by a panic: the handler did not finish.
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.lent.unwound.store(true, Ordering::Release);
        }
    }
}

/// The request's transaction, locked for one task. It derefs to the
/// `PgConnection` inside the transaction, so `&mut *guard` is an executor
/// exactly as `&mut *tx` is for a `Transaction`.
pub struct TxGuard<'a> {
    guard: MappedMutexGuard<'a, Transaction<'static, Postgres>>,
}

impl TxGuard<'_> {
    /// The `sqlx::Transaction` itself, e.g. for `Acquire::begin` (a savepoint).
    pub fn transaction(&mut self) -> &mut Transaction<'static, Postgres> {
        &mut self.guard
    }
}

impl Deref for TxGuard<'_> {
    type Target = PgConnection;

    /// The connection, inside the transaction.
    fn deref(&self) -> &PgConnection {
        &self.guard
    }
}

impl DerefMut for TxGuard<'_> {
    /// The connection, inside the transaction, as an executor.
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.guard
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
    use http::request::Parts;

    use super::Tx;
    use crate::Error;

    impl<S: Send + Sync> FromRequestParts<S> for Tx {
        type Rejection = Error;

        /// The transaction the layer lent this request; `Error::NotGuarded`
        /// (a 500 problem) on a route without the layer.
        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Tx, Error> {
            parts.extensions.get::<Tx>().cloned().ok_or(Error::NotGuarded)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for Tx {
        type Rejection = std::convert::Infallible;

        /// The transaction, or `None` (the layer failed open without a database).
        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Tx>, Self::Rejection> {
            Ok(parts.extensions.get::<Tx>().cloned())
        }
    }
}
