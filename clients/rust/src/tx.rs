//! [`Tx`], the request's SQLx transaction that the layer lends the handler.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sqlx::{PgConnection, Postgres, Transaction};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

use crate::Error;

/// The request's transaction (`sqlx::Transaction<'static, Postgres>`), which
/// the layer begins on the application's `PgPool` before the handler runs,
/// and commits with the stored response (or rolls back) after it answers.
/// It rides in the request's extensions; it is cheap to clone.
///
/// In axum, take it as an extractor (`tx: Tx`, or `Option<Tx>` when the
/// layer may fail open); elsewhere `request.extensions().get::<Tx>()`.
/// [`Tx::lock`] gives the transaction to one task at a time. Do not commit
/// or roll it back yourself (nested `begin` makes a savepoint): the layer
/// ends it.
#[derive(Clone)]
pub struct Tx {
    transaction: Arc<Mutex<Option<Transaction<'static, Postgres>>>>,
}

impl Tx {
    /// Hands the transaction over to the handler.
    pub(crate) fn new(transaction: Transaction<'static, Postgres>) -> Tx {
        Tx { transaction: Arc::new(Mutex::new(Some(transaction))) }
    }

    /// Locks the transaction for queries, for as long as the guard lives:
    /// `query.execute(&mut *guard)`, as with a `Transaction`.
    /// `Err(Error::TransactionEnded)` once the layer has taken it back.
    pub async fn lock(&self) -> Result<TxGuard<'_>, Error> {
        MutexGuard::try_map(self.transaction.lock().await, Option::as_mut)
            .map(|guard| TxGuard { guard })
            .map_err(|_| Error::TransactionEnded)
    }

    /// Takes the transaction back from the handler (waiting for its guard to drop).
    pub(crate) async fn take(&self) -> Option<Transaction<'static, Postgres>> {
        self.transaction.lock().await.take()
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
    use http::StatusCode;
    use http::request::Parts;

    use super::Tx;

    impl<S: Send + Sync> FromRequestParts<S> for Tx {
        type Rejection = (StatusCode, &'static str);

        /// The transaction the layer lent this request; 500 on a route without the layer.
        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Tx, Self::Rejection> {
            parts.extensions.get::<Tx>().cloned().ok_or((
                StatusCode::INTERNAL_SERVER_ERROR,
                "this route is not behind pg_idempotency::IdempotencyLayer",
            ))
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
